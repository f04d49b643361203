"""Runs grids of simulations (policies x working sets, O3 limits) and draws the paper's figures."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from gpufaas.errors import InvalidInput
from gpufaas.profiles import paper_table1
from scheduler import registered_policies
from simulator.engine import Batching, ClusterConfig, SimResult, simulate
from simulator.workload import TraceCounts, Workload, WorkloadConfig, build_workload

SHIPPED_TRACE = "traces/azure2019-500fn/invocations.csv"
PAPER_POLICY_ORDER = ("lb", "lalb", "lalb-o3")


def shipped_trace() -> Path:
    """The Azure Functions 2019 extract shipped with the simulator (test data, CC-BY 4.0)."""
    return Path(str(resources.files("simulator").joinpath(SHIPPED_TRACE)))


@dataclass(frozen=True, slots=True)
class Run:
    policy: str
    working_set: int
    max_num_skips: int


def policy_runs(working_sets: Sequence[int], policies: Sequence[str], max_num_skips: int) -> list[Run]:
    return [Run(policy, ws, max_num_skips) for ws in working_sets for policy in policies]


def sweep_runs(working_sets: Sequence[int], limits: Sequence[int]) -> list[Run]:
    return [Run("lalb-o3", ws, limit) for ws in working_sets for limit in limits]


def compare_policies() -> list[str]:
    """Every registered policy, the paper's three first in the paper's order."""
    extra = [p for p in registered_policies() if p not in PAPER_POLICY_ORDER]
    return [*PAPER_POLICY_ORDER, *extra]


def build_workloads(
    trace: TraceCounts, working_sets: Sequence[int], workload_config: WorkloadConfig
) -> dict[int, Workload]:
    """One seeded workload per working set, the rest of `workload_config` shared."""
    return {
        ws: build_workload(trace, replace(workload_config, working_set=ws), paper_table1())
        for ws in dict.fromkeys(working_sets)
    }


def execute(
    workloads: dict[int, Workload],
    runs: Sequence[Run],
    *,
    cluster: ClusterConfig,
    room_aware_misses: bool = True,
    coldest_victim_misses: bool = True,
    batching: Batching | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> list[SimResult]:
    """Run each simulation on its working set's workload (the same requests for every policy);
    `batching` applies to every function of the workload (None: no batching). `on_progress(n)`
    is told of every `n` requests completed."""
    results = []
    for run in runs:
        workload = workloads[run.working_set]
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
                room_aware_misses=room_aware_misses,
                coldest_victim_misses=coldest_victim_misses,
                batching=None if batching is None else dict.fromkeys(workload.function_models, batching),
                on_progress=progress,
            )
        )
    return results


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
