"""Runs grids of simulations (policies x working sets, O3 limits) and draws the paper's figures."""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Unpack

from gpufaas.errors import InvalidInput
from gpufaas.profiles import paper_table1
from scheduler import registered_policies
from simulator.engine import Batching, ClusterConfig, Meter, PolicyOptions, SimResult, simulate
from simulator.optimal import Optimum, optimal_misses
from simulator.workload import TraceCounts, Workload, WorkloadConfig, build_workload

SHIPPED_TRACE = "traces/azure2019-500fn/invocations.csv"
PAPER_POLICY_ORDER = ("lb", "lalb", "lalb-o3")


def shipped_trace() -> Path:
    """The Azure Functions 2019 extract shipped with the simulator (test data, CC-BY 4.0)."""
    return Path(str(resources.files("simulator").joinpath(SHIPPED_TRACE)))


MappingSeed = int | None
"""How a workload's models are dealt to its functions: None = from both ends, K = seeded shuffle."""


@dataclass(frozen=True, slots=True)
class Run:
    policy: str
    working_set: int
    max_num_skips: int
    mapping_seed: MappingSeed = None


def policy_runs(
    working_sets: Sequence[int],
    policies: Sequence[str],
    max_num_skips: int,
    mapping_seeds: Sequence[MappingSeed] = (None,),
) -> list[Run]:
    return [
        Run(policy, ws, max_num_skips, mapping)
        for ws in working_sets
        for mapping in mapping_seeds
        for policy in policies
    ]


def sweep_runs(
    working_sets: Sequence[int], limits: Sequence[int], mapping_seeds: Sequence[MappingSeed] = (None,)
) -> list[Run]:
    return [Run("lalb-o3", ws, limit, mapping) for ws in working_sets for mapping in mapping_seeds for limit in limits]


def compare_policies() -> list[str]:
    """Every registered policy, the paper's three first in the paper's order."""
    extra = [p for p in registered_policies() if p not in PAPER_POLICY_ORDER]
    return [*PAPER_POLICY_ORDER, *extra]


def build_workloads(
    trace: TraceCounts,
    working_sets: Sequence[int],
    workload_config: WorkloadConfig,
    mapping_seeds: Sequence[MappingSeed] = (None,),
) -> dict[tuple[int, MappingSeed], Workload]:
    """One seeded workload per (working set, mapping), the rest of `workload_config` shared:
    the same requests for every mapping of a working set, only the models dealt differently."""
    return {
        (ws, mapping): build_workload(
            trace, replace(workload_config, working_set=ws, mapping_seed=mapping), paper_table1()
        )
        for ws in dict.fromkeys(working_sets)
        for mapping in dict.fromkeys(mapping_seeds)
    }


def execute(
    workloads: dict[tuple[int, MappingSeed], Workload],
    runs: Sequence[Run],
    *,
    cluster: ClusterConfig,
    batching: Batching | None = None,
    on_progress: Callable[[int], None] | None = None,
    optimum: bool = False,
    meter: Meter | None = None,
    **options: Unpack[PolicyOptions],
) -> list[SimResult]:
    """Run each simulation on its working set's workload (the same requests for every policy),
    under the PolicyConfig `options` as `simulate` takes them; `batching` applies to every
    function of the workload (None: no batching). `on_progress(n)` is told of every `n` requests
    ended (completed, timed out, refused). With `optimum`, each result carries the workload's
    floor (`workload_optimum`), computed once per workload. `meter` is kept up to date by each run
    in turn (`simulate`'s)."""
    results = []
    floors: dict[tuple[int, MappingSeed], Optimum] = {}
    for run in runs:
        key = (run.working_set, run.mapping_seed)
        workload = workloads[key]
        if optimum and key not in floors:
            with contextlib.suppress(ImportError):  # several sizes and no scipy: no floor to show
                floors[key] = workload_optimum(workload, cluster)
        done = [0]

        def progress(completed: int, done: list[int] = done) -> None:
            if on_progress is not None:
                on_progress(completed - done[0])
            done[0] = completed

        results.append(
            simulate(
                workload,
                run.policy,
                cluster=cluster,
                max_num_skips=run.max_num_skips,
                batching=None if batching is None else dict.fromkeys(workload.function_models, batching),
                on_progress=progress,
                meter=meter,
                **options,
            )
        )
        if key in floors:
            results[-1] = replace(
                results[-1], optimal_miss_ratio=floors[key].miss_ratio, optimal_exact=floors[key].exact
            )
    return results


def workload_optimum(workload: Workload, cluster: ClusterConfig) -> Optimum:
    """The fewest misses any eviction could have on `workload`'s arrival order in the cluster's
    GPU memory pooled (simulator.optimal). The calls of a model larger than one GPU are left out:
    the run rejects them (`SimResult.rejected`), so they are not among its misses either, though
    the pool could hold that model."""
    memory_of = {profile.model: profile.memory_mb for profile in workload.profiles}
    sequence = [
        (request.model, memory_of[request.model])
        for request in workload.requests
        if memory_of[request.model] <= cluster.gpu_memory_mb
    ]
    return optimal_misses(sequence, cluster.gpus * cluster.gpu_memory_mb)


@dataclass(frozen=True, slots=True)
class Spread:
    """One metric over several runs: mean and sample standard deviation (0 for one run)."""

    mean: float
    stdev: float


AGGREGATED_METRICS = (
    "avg_latency_s",
    "floor_latency_s",
    "p50_latency_s",
    "p99_latency_s",
    "miss_ratio",
    "false_miss_ratio",
    "avg_top_model_replicas",
    "gpu_utilization",
    "function_latency_variance",
    "avg_batch_calls",
    "slo_attainment",
    "slo_functions_met",
    "avg_gpu_memory_gb",
    "timeout_rate",
    "rejection_rate",
)


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The runs of one (policy, working set, O3 limit) over several mappings."""

    policy: str
    working_set: int
    max_num_skips: int
    mappings: tuple[str, ...]
    metrics: dict[str, Spread]

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "working_set": self.working_set,
            "max_num_skips": self.max_num_skips,
            "mappings": list(self.mappings),
            **{f"{name}_mean": spread.mean for name, spread in self.metrics.items()},
            **{f"{name}_stdev": spread.stdev for name, spread in self.metrics.items()},
        }


def aggregate(results: Sequence[SimResult]) -> list[Aggregate]:
    """Group results by (policy, working set, O3 limit), in first-seen order, and give each
    metric's mean and spread over the group's mappings."""
    groups: dict[tuple[str, int, int], list[SimResult]] = {}
    for result in results:
        groups.setdefault((result.policy, result.working_set, result.max_num_skips), []).append(result)
    out = []
    for (policy, ws, limit), members in groups.items():
        metrics = {}
        for name in AGGREGATED_METRICS:
            values = [float(getattr(member, name)) for member in members]
            metrics[name] = Spread(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
        out.append(Aggregate(policy, ws, limit, tuple(member.mapping for member in members), metrics))
    return out


# --- figures ---------------------------------------------------------------------------------

_POLICY_PANELS = (
    ("avg_latency_s", "Average latency (s)", "Fig. 4a"),
    ("miss_ratio", "Cache miss ratio", "Fig. 4b"),
    ("gpu_utilization", "GPU utilization", "Fig. 4c"),
    ("false_miss_ratio", "False-miss ratio", "Fig. 5"),
    ("avg_top_model_replicas", "GPUs holding the top model", "Fig. 6"),
)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInput("--plot needs matplotlib: pip install 'gpufaas[plot]'") from None
    return plt


def plot_policies(results: Sequence[SimResult], path: Path) -> None:
    """The paper's Figures 4-6 as grouped bars: one group per working set, one bar per policy."""
    plt = _pyplot()
    working_sets = sorted({r.working_set for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    by_key = {(r.working_set, r.policy): r for r in results}
    fig, axes = plt.subplots(1, len(_POLICY_PANELS), figsize=(4.2 * len(_POLICY_PANELS), 3.6))
    width = 0.8 / max(1, len(policies))
    for ax, (field, label, figure) in zip(axes, _POLICY_PANELS, strict=True):
        for i, policy in enumerate(policies):
            xs = [w + (i - (len(policies) - 1) / 2) * width for w in range(len(working_sets))]
            ys = [float(getattr(by_key[(ws, policy)], field)) for ws in working_sets]
            ax.bar(xs, ys, width, label=policy.upper())
        ax.set_xticks(range(len(working_sets)), [str(ws) for ws in working_sets])
        ax.set_xlabel("Working set size")
        ax.set_title(f"{figure}: {label}", fontsize=10)
    axes[0].legend(fontsize=8)
    _save(plt, fig, path)


def plot_sweep(results: Sequence[SimResult], path: Path) -> None:
    """The paper's Figure 7: average latency and miss ratio against the O3 limit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    twin = ax.twinx()
    for i, ws in enumerate(sorted({r.working_set for r in results})):
        series = sorted((r for r in results if r.working_set == ws), key=lambda r: r.max_num_skips)
        limits = [r.max_num_skips for r in series]
        ax.plot(limits, [r.avg_latency_s for r in series], "o-", color=f"C{2 * i}", label=f"latency (WS {ws})")
        twin.plot(limits, [r.miss_ratio for r in series], "s--", color=f"C{2 * i + 1}", label=f"miss ratio (WS {ws})")
    ax.set_xlabel("O3 limit (max skips)")
    ax.set_ylabel("Average latency (s)")
    twin.set_ylabel("Cache miss ratio")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    ax.set_title("Fig. 7: O3 sensitivity", fontsize=10)
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Write `fig` to `path` as a PNG whole or not at all, and close it: drawn into a file
    beside `path`, then renamed over it. Written in place, a write that failed (a full disk) or
    was interrupted left a truncated PNG where an earlier plot of the same name had been. A
    symbolic link at `path` stays, and the file it points to is replaced."""
    path = Path(os.path.realpath(path))
    partial = path.with_name(f".plot-{os.getpid()}.partial")  # (short: any name that fits, fits beside it)
    try:
        fig.tight_layout()
        fig.savefig(partial, dpi=120, format="png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        plt.close(fig)
