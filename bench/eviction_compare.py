"""Benchmark: every registered eviction policy's miss ratio against the offline optimum (the floor),
on the shipped Azure traces and on Zipf workloads, in the simulator.

Workloads (each run once per eviction policy, under lalb-o3 with its defaults):
- azure2019: the shipped Azure Functions 2019 extract, the paper's window (6 minutes at 325 rpm,
  working set 35), 12 GPUs of 6,144 MB and of 4,096 MB (the paper's 8,192 holds nearly all of it);
- azure2021: the shipped Azure Functions 2021 head, the same shape, 12 GPUs of 6,144 MB;
- zipf-0.8, zipf-1.1: 4,000 calls over 200 equal models of 1,000 MB with that Zipf skew, one call
  at a time (each arrives after the previous one finished), on 4 GPUs of 8,192 MB (32 models
  resident): here the order of service is the order of arrival, so the floor is exactly reachable
  in principle.

The floor (simulator.optimal) pools the GPUs' memory and keeps the arrival order; on the traces
lalb-o3 also misses on purpose (a second copy of a busy model spreads its load), which no
eviction policy can avoid and the floor does not count.

Run: `python -m bench.eviction_compare [--out bench/results/eviction_compare.json]`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.machine import results_parser, run_metadata, write_results
from cache_manager import EvictionPolicy
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace, workload_optimum
from simulator.workload import NO_DEADLINE_S, Workload, WorkloadConfig, build_workload, load_trace, zipf_workload

REPO = Path(__file__).resolve().parent.parent
AZURE2021 = REPO / "simulator/traces/azure2021-head/Azure2021_200.csv"


def workloads() -> list[tuple[str, Workload, ClusterConfig]]:
    """The workloads and their clusters; every call's deadline is NO_DEADLINE_S (no call dropped)."""
    paper = WorkloadConfig(working_set=35, timeout_s=NO_DEADLINE_S)
    azure2019 = build_workload(load_trace(shipped_trace(), "azure2019"), paper, paper_table1())
    azure2021 = build_workload(load_trace(AZURE2021, "azure2021"), paper, paper_table1())
    out = [
        ("azure2019, 12 x 6144 MB", azure2019, ClusterConfig(gpus=12, gpu_memory_mb=6144)),
        ("azure2019, 12 x 4096 MB", azure2019, ClusterConfig(gpus=12, gpu_memory_mb=4096)),
        ("azure2021, 12 x 6144 MB", azure2021, ClusterConfig(gpus=12, gpu_memory_mb=6144)),
    ]
    for skew in (0.8, 1.1):
        zipf = zipf_workload(
            calls=4000, models=200, zipf_exponent=skew, memory_mb=1000, gap_s=10.0, seed=0, timeout_s=NO_DEADLINE_S
        )
        out.append((f"zipf-{skew}, 200 models, 4 x 8192 MB", zipf, ClusterConfig(gpus=4, gpu_memory_mb=8192)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = results_parser(__doc__, "eviction_compare.json").parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name, workload, cluster in workloads():
        floor = workload_optimum(workload, cluster)
        for eviction in sorted(EvictionPolicy.registry):
            result = simulate(workload, "lalb-o3", cluster=dataclasses.replace(cluster, eviction=eviction))
            rows.append(
                {
                    "workload": name,
                    "eviction": eviction,
                    "requests": result.requests,
                    "miss_ratio": round(result.miss_ratio, 4),
                    "optimal_miss_ratio": round(floor.miss_ratio, 4),
                    "optimal_exact": floor.exact,
                    "optimal_method": floor.method,
                    "above_floor": round(result.miss_ratio / floor.miss_ratio, 2) if floor.misses else None,
                    "avg_latency_s": round(result.avg_latency_s, 3),  # (over completed calls only)
                    "timed_out": result.timed_out,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    write_results(args.out, {"metadata": run_metadata(), "rows": rows}, _table(rows))
    return 0


def _table(rows: list[dict[str, Any]]) -> Iterator[str]:
    """The rows as a Markdown table."""
    yield "| workload | eviction | miss ratio | floor | x floor | avg latency (s) |"
    yield "| --- | --- | --- | --- | --- | --- |"
    for row in rows:
        floor_text = f"{row['optimal_miss_ratio']:.4f}" + ("" if row["optimal_exact"] else " (bound)")
        yield (
            f"| {row['workload']} | {row['eviction']} | {row['miss_ratio']:.4f} | {floor_text} | "
            f"{row['above_floor']} | {row['avg_latency_s']} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
