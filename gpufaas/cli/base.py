"""What every `gpufaas` command shares: the typer app, the consoles, the common options and how a
user's mistake is reported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from gpufaas.errors import GpufaasError

app = typer.Typer(
    name="gpufaas",
    help="gpufaas: GPU-enabled Function-as-a-Service for ML inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True, soft_wrap=True)
console = Console(soft_wrap=True)  # messages: never wrapped mid-sentence when piped
PIPED_TABLE_WIDTH = 200  # columns a table gets on stdout that is not a terminal


def table_console() -> Console:
    """A console for a table on stdout: the terminal's width, or PIPED_TABLE_WIDTH when piped (Rich's
    default there, 80 columns, cut names short with '…', and `gpufaas ls | grep NAME` found nothing)."""
    return Console(width=None if sys.stdout.isatty() else PIPED_TABLE_WIDTH)


@app.callback()
def _root() -> None:
    """gpufaas: GPU-enabled Function-as-a-Service for ML inference."""


StateDir = Annotated[Path, typer.Option("--state-dir", help="Where the local cluster keeps its state and logs.")]
GatewayOpt = Annotated[
    str | None,
    typer.Option(
        "--gateway",
        "-g",
        help="Gateway URL (else $GPUFAAS_URL, else the stack file's provider.gateway for deploy, else the local "
        "cluster's, from its cluster.json, else http://127.0.0.1:8080).",
    ),
]


@contextmanager
def user_errors() -> Iterator[None]:
    """A user's mistake becomes one line on stderr and exit status 1, never a traceback."""
    try:
        yield
    except GpufaasError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)  # its words, not markup
        raise typer.Exit(code=1) from None
