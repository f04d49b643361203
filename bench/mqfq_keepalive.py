"""Benchmark: what MQFQ-Sticky's keep-alive (alpha) does now that a flow past it is swapped out.

The shipped Azure 2019 trace at the paper's two operating points used in docs/policies.md (325
rpm with 8 GB per GPU, and 450 rpm with 6 GB), working set 35, 12 GPUs in 3 nodes of 4, a host tier
of 16 GB per node (swap-out needs one: without a tier nothing moves), mqfq-sticky with T = 10 s
and its swap-out on (`mqfq_swap_out`), alpha swept; beside it mqfq-sticky as shipped (no
swap-out), without a host tier, and lalb-o3 on the same cluster. Each point: average and p99 latency, the
latency floor, misses and swap-ins per call, swap-outs, and the GPU memory held on average.

Run: `python -m bench.mqfq_keepalive [--out bench/results/mqfq_keepalive.json]` (seconds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.machine import results_parser, run_metadata, write_results
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, SimResult, simulate
from simulator.report import shipped_trace
from simulator.workload import NO_DEADLINE_S, TraceCounts, Workload, WorkloadConfig, build_workload, load_trace

ALPHAS = (0.0, 0.5, 1.5, 3.0, 10.0, 1e9)  # 1e9: only flows with one call so far (a TTL of 0) go
POINTS = {"paper (325 rpm, 8 GB)": (325, 8192), "loaded (450 rpm, 6 GB)": (450, 6144)}
HOST_MB = 16384


def figures(result: SimResult) -> dict[str, Any]:
    dispatched = result.hits + result.misses
    return {
        "avg_latency_s": round(result.avg_latency_s, 3),
        "p99_latency_s": round(result.p99_latency_s, 3),
        "floor_latency_s": round(result.floor_latency_s, 3),
        "miss_ratio": round(result.miss_ratio, 4),
        "swap_ins_per_call": round(result.swap_ins / dispatched, 4) if dispatched else 0.0,
        "swap_outs": result.releases,
        "avg_gpu_memory_gb": round(result.avg_gpu_memory_gb, 1),
        "timed_out": result.timed_out,  # (the latencies are over completed calls only)
    }


def point_workload(trace: TraceCounts, rpm: int) -> Workload:
    """The point's workload: working set 35 at `rpm`, every call's deadline NO_DEADLINE_S (none dropped)."""
    return build_workload(trace, WorkloadConfig(working_set=35, rpm=rpm, timeout_s=NO_DEADLINE_S), paper_table1())


def main(argv: list[str] | None = None) -> int:
    args = results_parser(__doc__, "mqfq_keepalive.json").parse_args(argv)
    trace = load_trace(shipped_trace(), "azure2019")
    report: dict[str, Any] = {"metadata": run_metadata(host_memory_mb_per_node=HOST_MB), "points": {}}
    for name, (rpm, gpu_memory_mb) in POINTS.items():
        workload = point_workload(trace, rpm)
        cluster = ClusterConfig(gpus=12, gpu_memory_mb=gpu_memory_mb, gpus_per_node=4, host_memory_mb=HOST_MB)
        rows = {"lalb-o3": figures(simulate(workload, "lalb-o3", cluster=cluster))}
        for alpha in ALPHAS:
            label = "mqfq-sticky + swap-out, alpha 1e9" if alpha >= 1e9 else f"mqfq-sticky + swap-out, alpha {alpha:g}"
            result = simulate(workload, "mqfq-sticky", cluster=cluster, mqfq_ttl_alpha=alpha, mqfq_swap_out=True)
            rows[label] = figures(result)
        rows["mqfq-sticky (no swap-out, the default)"] = figures(simulate(workload, "mqfq-sticky", cluster=cluster))
        without_tier = dataclasses.replace(cluster, host_memory_mb=0)
        rows["mqfq-sticky, no host tier"] = figures(simulate(workload, "mqfq-sticky", cluster=without_tier))
        report["points"][name] = rows
        print(f"== {name}")
        for label, row in rows.items():
            print(
                f"  {label:<38} avg {row['avg_latency_s']:>7.3f} s  p99 {row['p99_latency_s']:>7.2f} s  "
                f"miss {row['miss_ratio']:.3f}  swap-ins {row['swap_ins_per_call']:.3f}  "
                f"swap-outs {row['swap_outs']:>4}  GPU mem {row['avg_gpu_memory_gb']:>5.1f} GB"
            )
    write_results(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
