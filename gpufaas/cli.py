"""The `gpufaas` command line: the user's entry point (today: `gpufaas sim`, the simulator)."""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpufaas.errors import GpufaasError

if TYPE_CHECKING:
    from simulator.engine import SimResult

app = typer.Typer(
    name="gpufaas",
    help="gpufaas: GPU-enabled Function-as-a-Service for ML inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """gpufaas: GPU-enabled Function-as-a-Service for ML inference."""


class TraceFormat(enum.StrEnum):
    azure2019 = "azure2019"
    azure2021 = "azure2021"


def _int_list(value: str, flag: str, *, minimum: int) -> list[int]:
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated whole numbers, got {value!r}", param_hint=flag) from None
    if not numbers or any(n < minimum for n in numbers):
        raise typer.BadParameter(f"every value must be >= {minimum}, got {value!r}", param_hint=flag)
    return numbers


@app.command()
def sim(
    trace: Annotated[
        Path | None,
        typer.Option(help="Trace file. Default: the Azure Functions 2019 extract shipped with gpufaas."),
    ] = None,
    trace_format: Annotated[TraceFormat, typer.Option(help="Trace file format.")] = TraceFormat.azure2019,
    policy: Annotated[str, typer.Option(help="Scheduling policy: lb, lalb or lalb-o3.")] = "lalb-o3",
    o3_limit: Annotated[int, typer.Option(min=0, help="lalb-o3: how often a request may be passed over.")] = 25,
    gpus: Annotated[int, typer.Option(min=1, help="Number of simulated GPUs.")] = 12,
    gpu_memory_mb: Annotated[int, typer.Option(min=1, help="Cache capacity of each GPU (MB).")] = 8192,
    working_set: Annotated[
        str, typer.Option(help="Most invoked functions to keep; a comma list (15,25,35) runs each.")
    ] = "35",
    start_minute: Annotated[int | None, typer.Option(help="First trace minute of the window.")] = None,
    minutes: Annotated[int, typer.Option(min=1, help="Length of the window in minutes.")] = 6,
    rpm: Annotated[int, typer.Option(min=1, help="Requests per minute after scaling.")] = 325,
    seed: Annotated[int, typer.Option(help="Seed for arrival times inside each minute.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    compare: Annotated[bool, typer.Option(help="Run every policy on the same workload.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write the paper's figures (4-6 with --compare, 7 with --sweep-o3) to a PNG.")
    ] = None,
    literal_misses: Annotated[
        bool,
        typer.Option(
            help="Algorithm 2 to the letter: a miss loads on the GPU being filled even if another idle GPU has room."
        ),
    ] = False,
    sweep_o3: Annotated[
        str | None, typer.Option(help="Run lalb-o3 at each of these limits (e.g. 0,5,10,...,45): Figure 7.")
    ] = None,
) -> None:
    """Replay a function trace through the real scheduler and cache manager on a virtual clock."""
    from scheduler import make_policy
    from simulator.engine import ClusterConfig
    from simulator.report import (
        build_workloads,
        compare_policies,
        execute,
        plot_policies,
        plot_sweep,
        policy_runs,
        shipped_trace,
        sweep_runs,
    )
    from simulator.workload import WorkloadConfig, load_trace

    working_sets = _int_list(working_set, "--working-set", minimum=1)
    limits = _int_list(sweep_o3, "--sweep-o3", minimum=0) if sweep_o3 is not None else None
    if limits is not None and compare:
        raise typer.BadParameter("use either --compare or --sweep-o3, not both", param_hint="--sweep-o3")
    try:
        make_policy(policy)
    except GpufaasError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policy") from None
    if plot is not None and plot.suffix.lower() != ".png":
        raise typer.BadParameter(f"the plot is written as PNG; name it *.png, got {plot}", param_hint="--plot")

    with _user_errors():
        trace_path = trace if trace is not None else shipped_trace()
        counts = load_trace(trace_path, trace_format.value)
        workload_config = WorkloadConfig(start_minute=start_minute, minutes=minutes, rpm=rpm, seed=seed)
        workloads = build_workloads(counts, working_sets, workload_config)
        if limits is not None:
            runs = sweep_runs(working_sets, limits)
        elif compare or plot is not None:
            runs = policy_runs(working_sets, compare_policies(), o3_limit)
        else:
            runs = policy_runs(working_sets, [policy], o3_limit)
        cluster = ClusterConfig(gpus=gpus, gpu_memory_mb=gpu_memory_mb)
        total = sum(len(workloads[run.working_set].requests) for run in runs)
        with _progress(total, enabled=not json_output and sys.stderr.isatty()) as advance:
            results = execute(
                workloads, runs, cluster=cluster, room_aware_misses=not literal_misses, on_progress=advance
            )
        if plot is not None:
            (plot_sweep if limits is not None else plot_policies)(results, plot)

    first = next(iter(workloads.values()))
    meta = {
        "trace": str(trace_path),
        "trace_format": trace_format.value,
        "start_minute": first.start_minute,
        "minutes": first.minutes,
        "rpm": rpm,
        "seed": seed,
        "gpus": gpus,
        "gpu_memory_mb": gpu_memory_mb,
    }
    if json_output:
        if len(results) == 1:
            print(json.dumps({**results[0].to_json(), **meta}, indent=2))
        else:
            print(json.dumps({**meta, "results": [r.to_json() for r in results]}, indent=2))
    else:
        _print_table(results, meta)
        if plot is not None:
            Console().print(f"wrote {plot}")


def _print_table(results: Sequence[SimResult], meta: Mapping[str, object]) -> None:
    table = Table(
        title=(
            f"{meta['trace']} minutes {meta['start_minute']}+{meta['minutes']}, {meta['rpm']} rpm, "
            f"{meta['gpus']} GPUs x {meta['gpu_memory_mb']} MB, seed {meta['seed']}"
        ),
        title_justify="left",
    )
    columns = [
        ("policy", "policy"),
        ("WS", "working_set"),
        ("O3 limit", "max_num_skips"),
        ("requests", "requests"),
        ("avg lat (s)", "avg_latency_s"),
        ("p50 (s)", "p50_latency_s"),
        ("p99 (s)", "p99_latency_s"),
        ("miss ratio", "miss_ratio"),
        ("false miss", "false_miss_ratio"),
        ("top replicas", "avg_top_model_replicas"),
        ("GPU util", "gpu_utilization"),
        ("fn lat var (s²)", "function_latency_variance"),
    ]
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "policy" else "right")
    for result in results:
        row = []
        for _, field in columns:
            value = getattr(result, field)
            row.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@contextmanager
def _user_errors() -> Iterator[None]:
    """A user's mistake becomes one line on stderr and exit status 1, never a traceback."""
    try:
        yield
    except GpufaasError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(code=1) from None


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda _: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err_console
    ) as progress:
        task = progress.add_task("sim", total=total)
        yield lambda n: progress.advance(task, n)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
