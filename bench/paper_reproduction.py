"""Reproduces the LALB paper's evaluation in the simulator; writes JSON and the figures for docs/."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from simulator.engine import ClusterConfig, SimResult, simulate
from simulator.report import (
    PAPER_POLICY_ORDER,
    MappingSeed,
    build_workloads,
    execute,
    plot_policies,
    plot_sweep,
    policy_runs,
    shipped_trace,
    sweep_runs,
)
from simulator.workload import NO_DEADLINE_S, Workload, WorkloadConfig, load_trace, zipf_workload

WORKING_SETS = (15, 25, 35)
SWEEP_LIMITS = (0, 5, 10, 15, 20, 25, 30, 35, 40, 45)
SEEDS = range(10)
# A second operating point with memory pressure (6 GB of cache per GPU, 450 requests a minute):
# where the paper's trace regime (queues that build up) is reached with this trace extract.
PRESSURE = {"gpu_memory_mb": 6144, "rpm": 450}
# The workloads' shape; every call's deadline is NO_DEADLINE_S: none is dropped, as in the paper.
BASE = WorkloadConfig(timeout_s=NO_DEADLINE_S)


# One call at a time on a small cluster, where a miss always finds every idle GPU full: where the
# coldest-victim placement matters (section 3 of docs/paper-reproduction.md).
@dataclass(frozen=True)
class OneAtATime:
    gpus: int = 2
    gpu_memory_mb: int = 300
    models: int = 8
    model_mb: int = 100
    zipf_exponent: float = 1.1
    calls: int = 1000
    gap_s: float = 10.0  # a miss takes 3 s: each call arrives after the previous one completed


ONE_AT_A_TIME_SEEDS = range(20)


def _summary(results: Sequence[SimResult], field: str) -> dict[str, float]:
    values = [float(getattr(r, field)) for r in results]
    return {
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _seed_study(
    trace_path: Path, rpm: int, gpu_memory_mb: int, *, room_aware: bool, coldest_victim: bool = True
) -> dict[str, object]:
    counts = load_trace(trace_path, "azure2019")
    cluster = ClusterConfig(gpu_memory_mb=gpu_memory_mb)
    per_policy: dict[str, dict[int, list[SimResult]]] = {}
    for seed in SEEDS:
        workloads = build_workloads(counts, WORKING_SETS, replace(BASE, rpm=rpm, seed=seed))
        runs = policy_runs(WORKING_SETS, PAPER_POLICY_ORDER, 25)
        results = execute(
            workloads, runs, cluster=cluster, room_aware_misses=room_aware, coldest_victim_misses=coldest_victim
        )
        for result in results:
            per_policy.setdefault(result.policy, {}).setdefault(result.working_set, []).append(result)
    study: dict[str, object] = {"rpm": rpm, "gpu_memory_mb": gpu_memory_mb, "seeds": list(SEEDS)}
    for policy, by_ws in per_policy.items():
        study[policy] = {
            str(ws): {field: _summary(results, field) for field in ("avg_latency_s", "miss_ratio", "timed_out")}
            for ws, results in by_ws.items()
        }
    orderings = {}
    for ws in WORKING_SETS:
        wins = 0
        for i in range(len(SEEDS)):
            lb, lalb, o3 = (per_policy[p][ws][i] for p in PAPER_POLICY_ORDER)
            wins += (
                lb.avg_latency_s > lalb.avg_latency_s > o3.avg_latency_s
                and lb.miss_ratio > lalb.miss_ratio > o3.miss_ratio
            )
        orderings[str(ws)] = wins
    study["seeds_with_full_ordering"] = orderings
    return study


def _one_at_a_time_study() -> dict[str, object]:
    """LALB's miss ratio, one call at a time, with misses on the GPU being filled (room-aware
    only) and on the GPU with the coldest victim."""
    setup = OneAtATime()
    cluster = ClusterConfig(gpus=setup.gpus, gpu_memory_mb=setup.gpu_memory_mb)
    study: dict[str, object] = {**asdict(setup), "policy": "lalb", "seeds": list(ONE_AT_A_TIME_SEEDS)}
    for label, coldest in (("filling_gpu", False), ("coldest_victim", True)):
        results = [
            simulate(
                zipf_workload(
                    calls=setup.calls,
                    models=setup.models,
                    zipf_exponent=setup.zipf_exponent,
                    memory_mb=setup.model_mb,
                    gap_s=setup.gap_s,
                    seed=seed,
                    timeout_s=NO_DEADLINE_S,
                ),
                "lalb",
                cluster=cluster,
                coldest_victim_misses=coldest,
            )
            for seed in ONE_AT_A_TIME_SEEDS
        ]
        study[label] = {"miss_ratio": _summary(results, "miss_ratio")}
    return study


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/data/paper_reproduction.json"))
    parser.add_argument("--figures", type=Path, default=Path("docs/figures"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.figures.mkdir(parents=True, exist_ok=True)

    trace_path = shipped_trace()
    counts = load_trace(trace_path, "azure2019")
    base = BASE
    report: dict[str, object] = {"trace": "simulator/traces/azure2019-500fn/invocations.csv", "defaults": {}}
    for label, rpm, memory_mb, suffix in (
        ("defaults", base.rpm, 8192, ""),
        ("pressure", PRESSURE["rpm"], PRESSURE["gpu_memory_mb"], "-pressure"),
    ):
        cluster = ClusterConfig(gpu_memory_mb=memory_mb)
        workloads = build_workloads(counts, WORKING_SETS, replace(base, rpm=rpm))
        # The paper's Algorithm 2 to the letter for the comparison with the paper ...
        runs = policy_runs(WORKING_SETS, PAPER_POLICY_ORDER, 25)
        grid = execute(workloads, runs, cluster=cluster, room_aware_misses=False)
        ws35: dict[tuple[int, MappingSeed], Workload] = {(35, None): workloads[(35, None)]}
        sweep = execute(ws35, sweep_runs([35], SWEEP_LIMITS), cluster=cluster, room_aware_misses=False)
        # ... and gpufaas' default (misses placed where they evict nothing, else the coldest model), beside it.
        refined = execute(workloads, runs, cluster=cluster, room_aware_misses=True)
        room_only = execute(workloads, runs, cluster=cluster, room_aware_misses=True, coldest_victim_misses=False)
        plot_policies(grid, args.figures / f"fig4-6{suffix}.png")
        plot_sweep(sweep, args.figures / f"fig7{suffix}.png")
        report[label] = {
            "rpm": rpm,
            "gpu_memory_mb": memory_mb,
            "seed": base.seed,
            "grid": [r.to_json() for r in grid],
            "o3_sweep": [r.to_json() for r in sweep],
            "seed_study": _seed_study(trace_path, rpm, memory_mb, room_aware=False),
            "refined_grid": [r.to_json() for r in refined],
            "refined_seed_study": _seed_study(trace_path, rpm, memory_mb, room_aware=True),
            # Room-aware misses without the coldest victim: what the latter adds.
            "room_only_grid": [r.to_json() for r in room_only],
            "room_only_seed_study": _seed_study(trace_path, rpm, memory_mb, room_aware=True, coldest_victim=False),
        }
    report["one_call_at_a_time"] = _one_at_a_time_study()
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} and figures in {args.figures}")


if __name__ == "__main__":
    main()
