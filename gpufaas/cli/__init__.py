"""The `gpufaas` command line and its client tooling (deploying, stack files, `top`); no daemon
imports it. `app` is the typer application, `main` the console script's entry point."""

from gpufaas.cli.base import app

# Importing a command module registers its commands on `app`, and `gpufaas --help` lists them in
# the order they were registered: simulation, the local cluster, credentials, functions, views.
# isort: off
from gpufaas.cli import sim, local, session, functions, views  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    app()
