"""The `gpufaas` command line and its client tooling (deploying, stack files, `top`); no daemon
imports it. `app` is the typer application, `main` the console script's entry point."""

from gpufaas.cli.commands import app, main

__all__ = ["app", "main"]
