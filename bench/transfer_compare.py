"""The transfer-bandwidth model's effect: interference-aware placement and heaviness-aware eviction
with and without loads that share their PCIe switch, on the shipped trace.

Torpor's two claims that depend on transfers: concurrent host-to-GPU copies behind one PCIe switch
slow each other down, so a miss should go where no other copy runs (interference-aware
placement); and a heavy model is dear to swap back, so light ones should be evicted first
(heaviness-aware eviction). Without a bandwidth model neither can show anything (every load took
its fixed time). Here the simulator's transfer model is on (`ClusterConfig.gpus_per_link`: 2 GPUs
per switch, the switch's uplink as wide as one GPU's link, so two copies at once get half each)
and each mechanism is switched on and off on the same requests, at three points: the paper's
(325 rpm, 8 GB), loaded (450 rpm, 6 GB), and one where swap-ins are frequent (450 rpm, 4 GB GPUs
with 16 GB of host tier per node). Working set 35, four mappings, timing noise 0.2, as
bench/policy_compare.py.

    python -m bench.transfer_compare      # writes bench/results/transfer_compare.json
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.machine import results_parser, run_metadata, write_results
from bench.policy_compare import HOST_TIER_MB, MAPPINGS, SLO_FACTOR, TIMING_SPREAD
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, SimResult, simulate
from simulator.report import shipped_trace
from simulator.workload import NO_DEADLINE_S, Workload, WorkloadConfig, build_workload, load_trace

GPUS_PER_LINK = 2


@dataclass(frozen=True)
class Row:
    label: str
    policy: str
    gpus_per_link: int  # 0: no transfer model
    interference_aware: bool = True
    eviction: str = "lru"
    link_mb_s: float | None = None


ROWS = (
    Row("lalb-o3 + host tier, no transfer model", "lalb-o3", 0),
    Row("lalb-o3 + host tier, shared switches, placement unaware", "lalb-o3", GPUS_PER_LINK, interference_aware=False),
    Row("lalb-o3 + host tier, shared switches, interference-aware", "lalb-o3", GPUS_PER_LINK),
    Row(
        "lalb-o3 + host tier, shared switches, unaware + heaviness",
        "lalb-o3",
        GPUS_PER_LINK,
        interference_aware=False,
        eviction="heaviness",
    ),
    Row("lalb-o3 + host tier, shared switches, aware + heaviness", "lalb-o3", GPUS_PER_LINK, eviction="heaviness"),
    # A narrow uplink (PCIe 3 x8 behind the switch): copies are slower and contention dearer.
    Row(
        "lalb-o3 + host tier, x8 uplinks, placement unaware",
        "lalb-o3",
        GPUS_PER_LINK,
        interference_aware=False,
        link_mb_s=5_000.0,
    ),
    Row("lalb-o3 + host tier, x8 uplinks, interference-aware", "lalb-o3", GPUS_PER_LINK, link_mb_s=5_000.0),
    Row("torpor + host tier, shared switches, placement unaware", "torpor", GPUS_PER_LINK, interference_aware=False),
    Row("torpor + host tier, shared switches, interference-aware", "torpor", GPUS_PER_LINK),
)
POINTS = {
    "paper (325 rpm, 8 GB)": (325, 8192),
    "loaded (450 rpm, 6 GB)": (450, 6144),
    "swap-heavy (450 rpm, 4 GB)": (450, 4096),
}
# (the latencies cover completed calls only: timed_out says how many did not complete)
METRICS = ("avg_latency_s", "p99_latency_s", "miss_ratio", "swap_ins", "contended_loads", "avg_load_s", "timed_out")


def point_workloads(rpm: int, mappings: Sequence[int | None]) -> list[Workload]:
    """The point's workloads, one per mapping; every call's deadline is NO_DEADLINE_S (none dropped)."""
    counts = load_trace(shipped_trace(), "azure2019")
    table = paper_table1()
    return [
        build_workload(
            counts,
            WorkloadConfig(working_set=35, rpm=rpm, mapping_seed=m, slo_factor=SLO_FACTOR, timeout_s=NO_DEADLINE_S),
            table,
        )
        for m in mappings
    ]


def run_point(rpm: int, memory_mb: int, mappings: Sequence[int | None]) -> list[dict[str, Any]]:
    workloads = point_workloads(rpm, mappings)
    rows = []
    for row in ROWS:
        cluster = ClusterConfig(
            gpu_memory_mb=memory_mb,
            host_memory_mb=HOST_TIER_MB,
            eviction=row.eviction,
            timing_spread=TIMING_SPREAD,
            gpus_per_link=row.gpus_per_link,
            link_mb_s=row.link_mb_s,
        )
        results: list[SimResult] = [
            simulate(w, row.policy, cluster=cluster, interference_aware_loads=row.interference_aware) for w in workloads
        ]
        figures: dict[str, Any] = {"config": row.label}
        for name in METRICS:
            values = [float(getattr(r, name)) for r in results]
            figures[name] = {
                "mean": statistics.fmean(values),
                "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
        rows.append(figures)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = results_parser(__doc__, "transfer_compare.json").parse_args(argv)
    started = time.perf_counter()
    points = {name: run_point(rpm, memory_mb, MAPPINGS) for name, (rpm, memory_mb) in POINTS.items()}
    document = {
        "metadata": run_metadata(
            trace="simulator/traces/azure2019-500fn (shipped)",
            working_set=35,
            mappings=["ends" if m is None else f"seed {m}" for m in MAPPINGS],
            timing_spread=TIMING_SPREAD,
            host_memory_mb_per_node=HOST_TIER_MB,
            gpus_per_link=GPUS_PER_LINK,
            wall_s=round(time.perf_counter() - started, 1),
        ),
        "points": points,
    }
    write_results(args.out, document, _summary(points))
    return 0


def _summary(points: dict[str, list[dict[str, Any]]]) -> Iterator[str]:
    """Each point's name, then its rows, a line each."""
    for name, rows in points.items():
        yield name
        for row in rows:
            yield (
                f"  {row['config']:58} avg {row['avg_latency_s']['mean']:6.2f} ± {row['avg_latency_s']['stdev']:4.2f} s"
                f"  p99 {row['p99_latency_s']['mean']:6.2f} s  miss {row['miss_ratio']['mean']:.3f}"
                f"  swap-ins {row['swap_ins']['mean']:5.1f}  contended {row['contended_loads']['mean']:5.1f}"
                f"  load {row['avg_load_s']['mean']:.2f} s"
            )


if __name__ == "__main__":
    raise SystemExit(main())
