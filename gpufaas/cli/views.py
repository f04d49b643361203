"""What a cluster runs: `gpufaas gpus`, `top` (a live view) and `logs` (the local cluster's)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from gpufaas.cli.base import GatewayOpt, StateDir, app, console, err_console, table_console, user_errors
from gpufaas.cli.client import GatewayClient, gateway_url, is_count, is_number, is_text, is_texts, state_dir_default
from gpufaas.errors import GpufaasError

MAX_INTERVAL_S = 3600.0  # `top --interval`: an hour between frames is the longest a live view waits

# What `gpus` shows of each GPU (what the gateway's GET /system/gpus has; host_tier is newer).
SHOWN = {
    "node": is_text,
    "gpu": is_text,
    "gpu_type": is_text,
    "status": is_text,
    "memory_used_mb": is_number,
    "memory_capacity_mb": is_number,
    "local_queue": is_count,
    "lru": is_texts,
}


@app.command()
def gpus(gateway: GatewayOpt = None) -> None:
    """Every GPU: node, status, memory used/capacity, LRU list (most recent first), and its node's
    host tier (models evicted and kept in host memory, most recent first)."""
    with user_errors():
        client = GatewayClient(gateway_url(gateway))
        rows = client.rows(client.request("GET", "/system/gpus"), "a list of GPUs", SHOWN)
    table = Table(title_justify="left")
    columns = ("node", "GPU", "type", "status", "memory (MB)", "queued", "LRU list (most recent first)", "host tier")
    for column in columns:
        table.add_column(column)
    from gpufaas.cli.top import natural_key

    for g in sorted(rows, key=lambda g: natural_key(g["gpu"])):  # node2/0 before node10/0, as `top` lists them
        table.add_row(  # the gateway's words: text, not markup
            escape(g["node"]),
            escape(g["gpu"].rpartition("/")[2]),  # (node/gpu: the node has its column)
            escape(g["gpu_type"]),
            escape(g["status"]),
            f"{g['memory_used_mb']}/{g['memory_capacity_mb']}",
            str(g["local_queue"]),
            escape(", ".join(g["lru"]) or "-"),
            escape(", ".join(map(str, g.get("host_tier") or [])) or "-"),
        )
    table_console().print(table)


@app.command()
def top(
    gateway: GatewayOpt = None,
    # (max: sleeping `inf` or 1e300 seconds was an OverflowError's traceback, not a view)
    interval_s: Annotated[
        float, typer.Option("--interval", min=0.1, max=MAX_INTERVAL_S, help="Seconds between refreshes.")
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (for scripts).")] = False,
) -> None:
    """A live view of the cluster until Ctrl-C: GPUs (memory, running calls, LRU lists, host tiers),
    functions (calls, hit ratio, latency percentiles), the global queue and recent evictions."""
    from rich.live import Live

    from gpufaas.cli.top import render

    try:
        with user_errors():
            client = GatewayClient(gateway_url(gateway), timeout_s=10.0)
            overview = _fetch_overview(client)  # a first failure (no gateway, 401, 404) ends the command
        out = table_console()
        if once:
            out.print(render(overview, gateway_url=client.url, now_unix_s=time.time()))
            return
        problem: str | None = None
        with Live(console=out, auto_refresh=False) if out.is_terminal else contextlib.nullcontext() as live:
            while True:
                frame = render(overview, gateway_url=client.url, now_unix_s=time.time(), problem=problem)
                if live is not None:
                    live.update(frame, refresh=True)
                else:  # piped: one frame after another, like `top -b`
                    out.print(frame, "")
                time.sleep(interval_s)
                # A later failure keeps the last overview on screen under the error, and tries again.
                try:
                    overview, problem = _fetch_overview(client), None
                except GpufaasError as exc:
                    problem = f"refresh failed, showing the last overview: {exc}"
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends: quietly, with status 0
        return


def _fetch_overview(client: GatewayClient) -> dict[str, Any]:
    response = client.request("GET", "/system/overview")
    if response.status_code == 404:
        raise GpufaasError(
            f"the gateway at {client.url} has no /system/overview: it is older than this CLI; upgrade the "
            "gateway (meanwhile `gpufaas gpus` and `gpufaas ls` show part of the picture)"
        )
    overview = client.ok(response, accept=(200,))  # (a body that is not JSON: not a gateway)
    if not isinstance(overview, dict):
        raise client.not_a_gateway(response, "an overview")
    return overview


@app.command()
def logs(
    component: Annotated[str | None, typer.Argument(help="scheduler, gateway, node0, ... (default: list them)")] = None,
    lines: Annotated[int, typer.Option("-n", "--lines", min=1, help="How many lines from the end.")] = 50,
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Show the local cluster's logs."""
    log_dir = state_dir / "logs"
    available = sorted(p.stem for p in log_dir.glob("*.log")) if log_dir.is_dir() else []
    if component is None:
        console.print(f"logs in {log_dir}: {', '.join(available) or 'none'}", markup=False)  # (a path: text)
        return
    apart = {"scheduler": "--scheduler-apart", "node0": "--node-apart"}
    if component in apart and component not in available and "gateway" in available:
        role = component.rstrip("0")
        err_console.print(f"the {role} runs in the gateway's process (`gpufaas up {apart[component]}`: in its own)")
        component = "gateway"
    if component not in available:
        known = ", ".join(available) or "none (is the cluster up?)"
        err_console.print(f"[bold red]error:[/] no log for {escape(repr(component))}; available: {escape(known)}")
        raise typer.Exit(code=1)
    from gpufaas.logfiles import tail_lines

    try:  # its last lines only: a daemon's log grows to gigabytes
        text = tail_lines(log_dir / f"{component}.log", lines)
    except OSError as exc:  # removed since it was listed, or not readable
        err_console.print(f"[bold red]error:[/] cannot read {component}'s log: {escape(str(exc))}")
        raise typer.Exit(code=1) from None
    sys.stdout.write("\n".join(text) + "\n")
