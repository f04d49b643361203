"""`gpufaas sim`: replay a trace through the real scheduler and cache manager on the simulator's
virtual clock, one policy, a comparison or a sweep."""

from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from gpufaas.cli.base import app, console, err_console, user_errors
from gpufaas.errors import GpufaasError
from gpufaas.functions import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from scheduler.policies import PolicyConfig
    from simulator.engine import Batching, ClusterConfig, Meter, SimResult
    from simulator.report import Aggregate
    from simulator.workload import TraceCounts, Workload, WorkloadConfig


# --batch-exponent's largest: k**EXPONENT stays a float, and a run's latencies summable, for any
# batch a run forms.
MAX_BATCH_EXPONENT = 10.0


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


def _timeout_s(value: float) -> float:
    """--timeout-s: what a function's timeout_s may be (typer's min= and max= let NaN through)."""
    if not 0 < value <= MAX_TIMEOUT_S:
        raise typer.BadParameter(f"must be in (0, {MAX_TIMEOUT_S:g}] s, as a function's timeout_s, got {value}")
    return value


def _positive_or_none(value: float | None) -> float | None:
    """A positive finite number or None (typer's min= cannot leave out 0, nor NaN): --slo-factor's,
    whose declared min=0.0 let 0 through to the workload's own check, an error after the trace
    loaded. Infinity ran, and `--json` wrote it as `Infinity`, which JSON parsers refuse."""
    if value is not None and not 0 < value < math.inf:
        raise typer.BadParameter(f"must be a positive finite number, got {value}")
    return value


class _SimCommand(TyperCommand):
    """`gpufaas sim`, whose `--help` ends with the policy's flags as the scheduler declares them
    (built when read: the scheduler's settings are not imported by every command)."""

    @property
    def epilog(self) -> str:
        from gpufaas.policy_flags import policy_flags_help

        return escape(policy_flags_help())

    @epilog.setter
    def epilog(self, _: str | None) -> None:
        """The command's declared epilog (none) gives way to the one above."""


@app.command(cls=_SimCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sim(
    ctx: typer.Context,
    trace: Annotated[
        Path | None,
        typer.Option(help="Trace file. Default: the Azure Functions 2019 extract shipped with gpufaas."),
    ] = None,
    trace_format: Annotated[TraceFormat, typer.Option(help="Trace file format.")] = TraceFormat.azure2019,
    policy: Annotated[
        str, typer.Option(help="Scheduling policy: lb, lalb, lalb-o3, mqfq-sticky or torpor.")
    ] = "lalb-o3",
    gpus: Annotated[int, typer.Option(min=1, help="Number of simulated GPUs.")] = 12,
    gpu_memory_mb: Annotated[int, typer.Option(min=1, help="Cache capacity of each GPU (MB).")] = 8192,
    working_set: Annotated[
        str,
        typer.Option(
            help="Most invoked functions to keep; a comma list (15,25,35) runs each; 'all': every function "
            "the window invokes."
        ),
    ] = "35",
    start_minute: Annotated[int | None, typer.Option(help="First trace minute of the window.")] = None,
    minutes: Annotated[int, typer.Option(min=1, help="Length of the window in minutes.")] = 6,
    whole_trace: Annotated[
        bool,
        typer.Option(help="The window is the trace's whole span, first minute to last (instead of --minutes)."),
    ] = False,
    optimum: Annotated[
        bool,
        typer.Option(
            help="Compute the optimal miss ratio (the floor every policy is measured against). An integer "
            "program: leave it out (--no-optimum) for windows of millions of requests."
        ),
    ] = True,
    progress_every_s: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="Print a progress line on stderr this often (wall seconds): requests done, events, "
            "events/s, requests/s. Default: a progress bar on a terminal, nothing otherwise.",
        ),
    ] = None,
    rpm: Annotated[int, typer.Option(min=1, help="Requests per minute after scaling.")] = 325,
    seed: Annotated[int, typer.Option(help="Seed for arrival times inside each minute.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    compare: Annotated[bool, typer.Option(help="Run every policy on the same workload.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write the paper's figures (4-6 with --compare, 7 with --sweep-o3) to a PNG.")
    ] = None,
    slots: Annotated[int, typer.Option(min=1, help="D: calls each GPU runs at once.")] = 1,
    adaptive_slots: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Adaptive D (MQFQ-Sticky's): each GPU's D moves between 1 and this from its utilization every "
            "200 ms, starting at --slots, at most this (at this where --slots is above it; use with "
            "--interference).",
        ),
    ] = None,
    utilization_threshold: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Adaptive D: above this share of time busy D steps down.")
    ] = 0.9,
    hit_lease_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Hit leases, as the scheduler's --hit-lease-s takes them: a hit placed while nothing waits leases "
            "its slot this long to the gateway, whose next calls of the function run there without the scheduler "
            "(0: none).",
        ),
    ] = 0.0,
    max_batch_size: Annotated[
        int, typer.Option(min=1, help="Calls of one model a worker may merge into one batch (needs --slots > 1).")
    ] = 1,
    max_batch_wait_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="How long a free worker with fewer calls than a batch waits for more (at most what a function's spec "
            "takes).",
        ),
    ] = 0.0,
    batch_exponent: Annotated[
        float,
        typer.Option(
            max=MAX_BATCH_EXPONENT,
            help="A batch of k calls takes k**EXPONENT times one call's time (1: batching gains nothing).",
        ),
    ] = 1.0,
    sweep_o3: Annotated[
        str | None, typer.Option(help="Run lalb-o3 at each of these limits (e.g. 0,5,10,...,45): Figure 7.")
    ] = None,
    mappings: Annotated[
        str,
        typer.Option(
            help="How models are dealt to functions: 'ends' (hottest gets the smallest, then the largest, ...) "
            "and/or seeds of a shuffle, comma-separated (e.g. ends,1,2,3). Several: every figure as mean ± sd."
        ),
    ] = "ends",
    host_memory_mb: Annotated[
        int,
        typer.Option(
            min=0,
            help="Each node's host tier (Torpor): models its GPUs evict stay in host memory up to this much, and a "
            "miss takes them back by a host-to-GPU copy instead of a load (0: none, the paper's testbed).",
        ),
    ] = 0,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node (they share its host tier).")] = 4,
    gpu_idle_release_s: Annotated[
        float | None,
        typer.Option(min=0.0, help="EDAS staged exit: a model unused this long leaves its GPU (for the host tier)."),
    ] = None,
    host_idle_release_s: Annotated[
        float | None,
        typer.Option(min=0.0, help="EDAS staged exit: a model this long in a host tier leaves it."),
    ] = None,
    host_to_gpu_mb_s: Annotated[
        float, typer.Option(min=1.0, help="Host-to-GPU copy bandwidth of a swap-in (MB/s).")
    ] = 10_000.0,
    gpus_per_link: Annotated[
        int,
        typer.Option(
            min=0,
            help="The transfer-bandwidth model: a node's GPUs sit behind shared host links (PCIe switches) of this "
            "many GPUs each, and concurrent loads share their bandwidth (0: off, every load takes its fixed time).",
        ),
    ] = 0,
    link_mb_s: Annotated[
        float | None,
        typer.Option(
            min=1.0, help="With --gpus-per-link: a shared link's bandwidth (MB/s; default --host-to-gpu-mb-s)."
        ),
    ] = None,
    slo_factor: Annotated[
        float | None,
        typer.Option(
            callback=_positive_or_none,
            help="Give every function an SLO of this multiple (> 0) of its model's inference time (torpor orders by "
            "it; every policy reports SLO attainment). Default: no SLOs.",
        ),
    ] = None,
    timeout_s: Annotated[
        float,
        typer.Option(
            callback=_timeout_s,
            help="Every function's timeout_s: a call still waiting for a GPU this long after it arrived times out "
            "and never runs, as on the real path (counted as timed out, not in the latencies).",
        ),
    ] = DEFAULT_TIMEOUT_S,
    timing_spread: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=10.0,
            help="Noise on every load and batch time: coefficient of variation of a mean-1 log-normal factor "
            "(0: the profile exactly, so every estimate is exact). Drawn from --seed.",
        ),
    ] = 0.0,
    interference: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=100.0,
            help="With --slots > 1: the calls on a GPU run at once, each slowed down by 1 + I x (others running) "
            "(0: no interference; 1: no gain over one at a time). Default: one batch at a time.",
        ),
    ] = None,
) -> None:
    """Replay a function trace through the real scheduler and cache manager on a virtual clock.

    The policy's knobs and the eviction choice follow as `python -m scheduler` takes them (listed
    below), e.g. `--o3-limit 10 --no-room-aware-misses --eviction heaviness`."""
    from gpufaas.policy_flags import policy_flags
    from simulator.engine import Batching, ClusterConfig
    from simulator.report import build_workloads, compare_policies, shipped_trace
    from simulator.workload import WorkloadConfig, load_trace

    # The policy's knobs and the eviction choice, as the real scheduler takes them.
    config, eviction = policy_flags(ctx.args)
    _check_whole_trace(ctx, whole_trace=whole_trace, start_minute=start_minute)
    working_set_or_all, mapping_seeds, limits = _sim_checked(
        working_set, mappings, sweep_o3, compare=compare, plot=plot, policy=policy
    )
    _check_numbers(hit_lease_s=hit_lease_s, max_batch_wait_ms=max_batch_wait_ms, batch_exponent=batch_exponent)
    cluster = ClusterConfig(
        gpus=gpus,
        gpu_memory_mb=gpu_memory_mb,
        slots=slots if adaptive_slots is None else min(slots, adaptive_slots),  # the D the run starts at, reported
        batch_exponent=batch_exponent,
        timing_spread=timing_spread,
        timing_seed=seed,
        gpus_per_node=gpus_per_node,
        host_memory_mb=host_memory_mb,
        eviction=eviction,
        gpu_idle_release_s=gpu_idle_release_s,
        host_idle_release_s=host_idle_release_s,
        host_to_gpu_mb_s=host_to_gpu_mb_s,
        gpus_per_link=gpus_per_link,
        link_mb_s=link_mb_s,
        interference=interference,
        adaptive_slots=adaptive_slots,
        utilization_threshold=utilization_threshold,
        hit_lease_s=hit_lease_s,
    )
    policies = compare_policies() if compare or plot is not None else [policy]
    workload_config = WorkloadConfig(
        start_minute=start_minute, minutes=minutes, rpm=rpm, seed=seed, slo_factor=slo_factor, timeout_s=timeout_s
    )
    with user_errors():
        trace_path = trace if trace is not None else shipped_trace()
        counts = load_trace(trace_path, trace_format.value)
        workload_config = _whole_window(counts, workload_config) if whole_trace else workload_config
        # 'all' keeps every function of the trace: the window keeps those it invokes.
        working_sets = [len(counts.counts) if ws is None else ws for ws in working_set_or_all]
        workloads = build_workloads(counts, working_sets, workload_config, mapping_seeds)
        working_sets = _distinct_working_sets(workloads, working_sets)
        batching = Batching(max_batch_size, max_batch_wait_ms) if max_batch_size > 1 else None
        runs = (working_sets, policies, limits, mapping_seeds)
        show = _Show(bar=not json_output and progress_every_s is None, every_s=progress_every_s, optimum=optimum)
        results = _sim_execute(workloads, runs, cluster, config, batching, show)
    first = next(iter(workloads.values()))
    window = {"start_minute": first.start_minute, "minutes": first.minutes, "rpm": rpm, "seed": seed}
    meta: dict[str, object] = {"trace": str(trace_path), "trace_format": trace_format.value, **window}
    meta.update(_sim_cluster_meta(cluster, results, slo_factor, timeout_s))
    _sim_output(results, meta, grouped=len(mapping_seeds) > 1, json_output=json_output)
    if plot is not None:  # after the results: a plot that cannot be written loses none of them
        _plot(results, plot, sweep=limits is not None, quiet=json_output)


def _check_numbers(*, hit_lease_s: float, max_batch_wait_ms: float, batch_exponent: float) -> None:
    """The bounds of these options that their declarations do not give (the services' own live in
    modules that only a run imports): each finite, and no wider than the services take it."""
    from gpufaas.functions import MAX_BATCH_WAIT_MS
    from gpufaas.grants import MAX_CLAIM_S

    if not batch_exponent > 0:  # NaN too
        raise typer.BadParameter(f"must be positive, got {batch_exponent}", param_hint="--batch-exponent")
    if not hit_lease_s <= MAX_CLAIM_S:
        raise typer.BadParameter(
            f"must be at most {MAX_CLAIM_S:g} s, as the scheduler's --hit-lease-s, got {hit_lease_s}",
            param_hint="--hit-lease-s",
        )
    if not max_batch_wait_ms <= MAX_BATCH_WAIT_MS:
        raise typer.BadParameter(
            f"must be at most {MAX_BATCH_WAIT_MS:g} ms, as a function's spec takes it, got {max_batch_wait_ms}",
            param_hint="--max-batch-wait-ms",
        )


def _distinct_working_sets(workloads: dict[tuple[int, int | None], Workload], working_sets: list[int]) -> list[int]:
    """The working sets to run: of those whose workloads keep the same functions (a size past
    what the window invokes keeps them all, and so does a size listed twice), the first only, with
    a note on stderr. Run twice, their results were one group of the aggregate over mappings,
    each mapping in it twice."""
    first_of: dict[int, int] = {}  # functions kept -> the working set that first kept them
    for ws in working_sets:
        kept = len(next(w for (size, _), w in workloads.items() if size == ws).function_models)
        if kept in first_of:
            err_console.print(f"note: --working-set {ws} keeps the same {kept} functions as {first_of[kept]}: run once")
        else:
            first_of[kept] = ws
    return list(first_of.values())


def _plot(results: list[SimResult], plot: Path, *, sweep: bool, quiet: bool) -> None:
    from simulator.report import plot_policies, plot_sweep

    with user_errors():
        try:
            (plot_sweep if sweep else plot_policies)(results, plot)
        except OSError as exc:  # (a disk full: the file was checked before the run)
            raise GpufaasError(f"cannot write the plot {plot}: {exc}; the results are above") from None
    if not quiet:
        console.print(f"wrote {plot}", markup=False)  # (a path: "[/x]" in it, read as markup, a traceback)


def _check_whole_trace(ctx: typer.Context, *, whole_trace: bool, start_minute: int | None) -> None:
    """--whole-trace is its own window: refuse --start-minute or --minutes beside it."""
    minutes_source = ctx.get_parameter_source("minutes")
    minutes_given = minutes_source is not None and minutes_source.name != "DEFAULT"
    if whole_trace and (start_minute is not None or minutes_given):
        raise typer.BadParameter("the whole trace is one window: leave out --start-minute and --minutes")


def _whole_window(counts: TraceCounts, config: WorkloadConfig) -> WorkloadConfig:
    """`config` with its window the trace's whole span, first minute to last."""
    return replace(config, start_minute=counts.minutes[0], minutes=counts.minutes[-1] - counts.minutes[0] + 1)


def _sim_checked(
    working_set: str,
    mappings: str,
    sweep_o3: str | None,
    *,
    compare: bool,
    plot: Path | None,
    policy: str,
) -> tuple[list[int | None], list[int | None], list[int] | None]:
    """`gpufaas sim`'s options that go together, checked: (working sets, None for 'all', mapping
    seeds, the o3 limits of a sweep or None)."""
    from scheduler import make_policy

    working_sets: list[int | None] = (
        [None] if working_set.strip() == "all" else list(_int_list(working_set, "--working-set", minimum=1))
    )
    mapping_seeds = _mapping_list(mappings)
    if plot is not None and len(mapping_seeds) > 1:
        raise typer.BadParameter("--plot draws one mapping; pass one --mappings value with it", param_hint="--plot")
    limits = _int_list(sweep_o3, "--sweep-o3", minimum=0) if sweep_o3 is not None else None
    repeated = sorted({limit for limit in limits if limits.count(limit) > 1}) if limits else []
    if repeated:  # (each ran again, the same run: a sweep can take hours, and its plot drew it twice)
        raise typer.BadParameter(f"{repeated[0]} is listed twice", param_hint="--sweep-o3")
    if limits is not None and compare:
        raise typer.BadParameter("use either --compare or --sweep-o3, not both", param_hint="--sweep-o3")
    try:
        make_policy(policy)
    except GpufaasError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policy") from None
    if plot is not None and importlib.util.find_spec("matplotlib") is None:  # (before the run, as below)
        raise typer.BadParameter("the plot needs matplotlib: pip install 'gpufaas[plot]'", param_hint="--plot")
    if plot is not None and plot.suffix.lower() != ".png":
        raise typer.BadParameter(f"the plot is written as PNG; name it *.png, got {plot}", param_hint="--plot")
    folder = (plot or Path()).absolute().parent
    if plot is not None and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
        # Checked before the run, not found after it: a sweep can take hours.
        raise typer.BadParameter(f"{folder} is not a folder this user can write the plot into", param_hint="--plot")
    if plot is not None and (plot.is_dir() or (plot.exists() and not os.access(plot, os.W_OK))):
        raise typer.BadParameter(f"{plot} is a folder, or a file this user cannot write", param_hint="--plot")
    return working_sets, mapping_seeds, limits


@dataclass(frozen=True)
class _Show:
    """How `gpufaas sim` shows a run going: a progress bar (on a terminal only), or a line on
    stderr every `every_s` wall seconds; and whether it computes the optimal miss ratio."""

    bar: bool
    every_s: float | None
    optimum: bool


def _sim_execute(
    workloads: dict[tuple[int, int | None], Workload],
    plan: tuple[list[int], list[str], list[int] | None, list[int | None]],
    cluster: ClusterConfig,
    config: PolicyConfig,
    batching: Batching | None,
    show: _Show,
) -> list[SimResult]:
    """Every run of `plan` (working sets, policies, the o3 limits of a sweep or None, mapping
    seeds: each policy, or lalb-o3 at each limit, per working set and mapping) with the policy's
    knobs of `config`, shown going as `show` says."""
    from simulator.engine import Meter, check_runnable, policy_options
    from simulator.report import execute, policy_runs, sweep_runs

    for workload in workloads.values():  # refused before any run (and its floor): no model fits a GPU
        check_runnable(workload, cluster)
    working_sets, policies, limits, mapping_seeds = plan
    if limits is not None:
        runs = sweep_runs(working_sets, limits, mapping_seeds)
    else:
        runs = policy_runs(working_sets, policies, config.max_num_skips, mapping_seeds)
    total = sum(len(workloads[(run.working_set, run.mapping_seed)].requests) for run in runs)
    meter = Meter()
    progress = (
        _progress_lines(total, meter, show.every_s)
        if show.every_s is not None
        else _progress(total, enabled=show.bar and sys.stderr.isatty())
    )
    with progress as advance:
        return execute(
            workloads,
            runs,
            cluster=cluster,
            batching=batching,
            on_progress=advance,
            optimum=show.optimum,
            meter=meter,
            **policy_options(config),
        )


def _sim_cluster_meta(
    cluster: ClusterConfig, results: Sequence[SimResult], slo_factor: float | None, timeout_s: float
) -> dict[str, object]:
    """What `gpufaas sim` reports of the simulated cluster beside the results (and of the functions:
    their SLOs, their timeout)."""
    return {
        "gpus": cluster.gpus,
        "gpu_memory_mb": cluster.gpu_memory_mb,
        "slots": cluster.slots,
        "mappings": list(dict.fromkeys(result.mapping for result in results)),
        "timing_spread": cluster.timing_spread,
        "host_memory_mb": cluster.host_memory_mb,
        "eviction": cluster.eviction,
        "slo_factor": slo_factor,
        "timeout_s": timeout_s,
        "interference": cluster.interference,
        "adaptive_slots": cluster.adaptive_slots,
        "gpus_per_link": cluster.gpus_per_link,
        "hit_lease_s": cluster.hit_lease_s,
    }


def _sim_output(results: list[SimResult], meta: dict[str, object], *, grouped: bool, json_output: bool) -> None:
    """The results as JSON or tables (aggregated over mappings when `grouped`)."""
    from simulator.report import aggregate

    groups = aggregate(results) if grouped else []
    if json_output:
        if len(results) == 1:
            print(json.dumps({**results[0].to_json(), **meta}, indent=2))
        else:
            document: dict[str, object] = {**meta, "results": [r.to_json() for r in results]}
            if groups:
                document["aggregates"] = [group.to_json() for group in groups]
            print(json.dumps(document, indent=2))
    elif groups:
        _print_aggregates(groups, meta)
    else:
        _print_table(results, meta)


def _sim_title(meta: Mapping[str, object]) -> str:
    noise = f", timing spread {meta['timing_spread']}" if meta.get("timing_spread") else ""
    noise += f", host tier {meta['host_memory_mb']} MB/node" if meta.get("host_memory_mb") else ""
    noise += f", interference {meta['interference']}" if meta.get("interference") is not None else ""
    noise += f", timeout {meta['timeout_s']:g} s" if "timeout_s" in meta else ""
    return (
        f"{meta['trace']} minutes {meta['start_minute']}+{meta['minutes']}, {meta['rpm']} rpm, "
        f"{meta['gpus']} GPUs x {meta['gpu_memory_mb']} MB x {meta['slots']} slots, seed {meta['seed']}{noise}, "
        f"mapping {', '.join(str(m) for m in meta['mappings'])}"  # type: ignore[attr-defined]
    )


_TIMED_OUT_CAPTION = (
    "timed out: calls still waiting for a GPU at their deadline (never run); the latencies cover the "
    "completed calls only"
)
_REJECTED_CAPTION = "rejected: calls whose model is larger than a GPU's memory, refused at once (never run)"


def _caption(*, timed_out: bool, rejected: bool) -> str | None:
    """The table's caption: what its timed-out and rejected columns count, for those it shows."""
    shown = [caption for caption, on in ((_TIMED_OUT_CAPTION, timed_out), (_REJECTED_CAPTION, rejected)) if on]
    return "\n".join(shown) or None


def _print_aggregates(groups: Sequence[Aggregate], meta: Mapping[str, object]) -> None:
    """One row per (policy, WS, O3 limit): each metric as mean ± sample sd over the mappings; with
    `--slo-factor` the SLO columns and, where any call timed out, the timeout rate (and the
    caption saying what the latencies cover), as the table of single runs has them."""
    table = Table(title=_sim_title(meta) + " (mean ± sd over mappings)", title_justify="left")
    columns = [
        ("avg lat (s)", "avg_latency_s"),
        ("p50 (s)", "p50_latency_s"),
        ("p99 (s)", "p99_latency_s"),
        ("miss ratio", "miss_ratio"),
        ("false miss", "false_miss_ratio"),
        ("GPU util", "gpu_utilization"),
        ("fn lat var (s²)", "function_latency_variance"),
    ]
    if meta.get("slo_factor"):
        columns += [("SLO met", "slo_attainment"), ("fns in SLO", "slo_functions_met")]
    timed_out = any(group.metrics["timeout_rate"].mean > 0 for group in groups)
    if timed_out:
        columns.insert(0, ("timeout rate", "timeout_rate"))
    rejected = any(group.metrics["rejection_rate"].mean > 0 for group in groups)
    if rejected:
        columns.insert(0, ("rejection rate", "rejection_rate"))
    table.caption, table.caption_justify = _caption(timed_out=timed_out, rejected=rejected), "left"
    for header in ("policy", "WS", "O3 limit", "mappings", *(h for h, _ in columns)):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for group in groups:
        cells = [f"{group.metrics[f].mean:.3f} ± {group.metrics[f].stdev:.3f}" for _, f in columns]
        table.add_row(group.policy, str(group.working_set), str(group.max_num_skips), str(len(group.mappings)), *cells)
    Console(width=None if sys.stdout.isatty() else 250).print(table)


def _mapping_list(text: str) -> list[int | None]:
    """--mappings: 'ends' and/or non-negative shuffle seeds, comma-separated, no repeats."""
    out: list[int | None] = []
    for item in (part.strip() for part in text.split(",")):
        if item == "ends":
            value: int | None = None
        elif item.isascii() and item.isdigit():  # (str.isdigit takes '²', which int() does not)
            value = int(item)
        else:
            raise typer.BadParameter(
                f"expected 'ends' or a non-negative seed, got {item!r} (e.g. --mappings ends,1,2)",
                param_hint="--mappings",
            )
        if value in out:
            raise typer.BadParameter(f"{item!r} is listed twice", param_hint="--mappings")
        out.append(value)
    return out


def _print_table(results: Sequence[SimResult], meta: Mapping[str, object]) -> None:
    table = Table(title=_sim_title(meta), title_justify="left")
    columns = [
        ("policy", "policy"),
        ("WS", "working_set"),
        ("O3 limit", "max_num_skips"),
        ("requests", "requests"),
        ("avg lat (s)", "avg_latency_s"),
        ("floor (s)", "floor_latency_s"),
        ("p50 (s)", "p50_latency_s"),
        ("p99 (s)", "p99_latency_s"),
        ("miss ratio", "miss_ratio"),
        ("optimal", "optimal_miss_ratio"),
        ("false miss", "false_miss_ratio"),
        ("top replicas", "avg_top_model_replicas"),
        ("GPU util", "gpu_utilization"),
        ("fn lat var (s²)", "function_latency_variance"),
    ]
    if any(result.max_batch_size > 1 for result in results):
        columns.append(("calls/batch", "avg_batch_calls"))
    if meta.get("slo_factor"):
        columns += [("SLO met", "slo_attainment"), ("fns in SLO", "slo_functions_met")]
    timed_out = any(result.timed_out for result in results)
    if timed_out:
        columns[4:4] = [("timed out", "timed_out"), ("timeout rate", "timeout_rate")]
    rejected = any(result.rejected for result in results)
    if rejected:
        columns[4:4] = [("rejected", "rejected"), ("rejection rate", "rejection_rate")]
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "policy" else "right")
    for result in results:
        row = []
        for _, field in columns:
            value = getattr(result, field)
            if field == "optimal_miss_ratio":  # a floor; "≥" where the solver only bounded it
                row.append("-" if value is None else f"{'' if result.optimal_exact else '≥'}{value:.3f}")
                continue
            row.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        table.add_row(*row)
    table.caption, table.caption_justify = _caption(timed_out=timed_out, rejected=rejected), "left"
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@contextmanager
def _progress_lines(total: int, meter: Meter, every_s: float) -> Iterator[Callable[[int], None]]:
    """A progress line on stderr every `every_s` wall seconds while the runs go, and one at the
    end: requests done of `total`, the discrete-event loop's events, and both per wall second."""
    started_s = time.perf_counter()
    done = [0]
    next_s = [started_s + every_s]

    def line(end: bool) -> None:
        elapsed_s = max(time.perf_counter() - started_s, 1e-9)
        print(
            f"sim{' done' if end else ''}: {done[0]:,}/{total:,} requests, {meter.events:,} events in "
            f"{elapsed_s:,.0f} s wall ({meter.events / elapsed_s:,.0f} events/s, {done[0] / elapsed_s:,.0f} "
            f"requests/s), virtual clock {meter.now_s:,.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def advance(completed: int) -> None:
        done[0] += completed
        if time.perf_counter() >= next_s[0]:
            line(end=False)
            next_s[0] = time.perf_counter() + every_s

    yield advance
    line(end=True)


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
