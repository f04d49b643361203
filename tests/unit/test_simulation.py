"""The simulator on the shipped trace: the paper's qualitative results, and its own invariants."""

from __future__ import annotations

import pytest

from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, SimResult, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_trace


def run(
    policy: str,
    *,
    working_set: int = 35,
    rpm: int = 325,
    memory_mb: int = 8192,
    seed: int = 0,
    room_aware_misses: bool = True,
) -> SimResult:
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=working_set, rpm=rpm, seed=seed), paper_table1())
    return simulate(
        workload, policy, cluster=ClusterConfig(gpu_memory_mb=memory_mb), room_aware_misses=room_aware_misses
    )


@pytest.mark.parametrize("working_set", [15, 25, 35])
def test_locality_beats_load_balancing_at_the_papers_operating_point(working_set: int) -> None:
    lb, lalb, o3 = (run(p, working_set=working_set) for p in ("lb", "lalb", "lalb-o3"))
    for result in (lb, lalb, o3):
        assert result.completed == result.requests == 1950
    assert lb.avg_latency_s > 1.5 * max(lalb.avg_latency_s, o3.avg_latency_s)
    assert lb.miss_ratio > 4 * max(lalb.miss_ratio, o3.miss_ratio)
    assert lb.avg_top_model_replicas > lalb.avg_top_model_replicas
    assert lb.false_miss_ratio > lalb.false_miss_ratio


@pytest.mark.parametrize("room_aware_misses", [False, True], ids=["algorithm-2-literal", "room-aware"])
def test_paper_ordering_when_queues_build_up(room_aware_misses: bool) -> None:
    """With memory pressure and load (the regime of the paper's Figure 4, where LB saturates),
    LB > LALB > LALB-O3 in both average latency and miss ratio at working set 35."""
    lb, lalb, o3 = (
        run(p, rpm=450, memory_mb=6144, room_aware_misses=room_aware_misses) for p in ("lb", "lalb", "lalb-o3")
    )
    assert lb.avg_latency_s > lalb.avg_latency_s > o3.avg_latency_s
    assert lb.miss_ratio > lalb.miss_ratio > o3.miss_ratio


def test_o3_limit_zero_reproduces_lalb_on_the_whole_trace() -> None:
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=35), paper_table1())
    lalb = simulate(workload, "lalb")
    o3_zero = simulate(workload, "lalb-o3", max_num_skips=0)
    assert lalb.to_json() | {"policy": "x"} == o3_zero.to_json() | {"policy": "x"}


def test_room_aware_misses_evict_less_than_algorithm_2_to_the_letter() -> None:
    literal, room_aware = run("lalb", room_aware_misses=False), run("lalb", room_aware_misses=True)
    assert room_aware.miss_ratio < literal.miss_ratio


def test_utilization_counts_inference_only() -> None:
    result = run("lb", working_set=15)
    # 1950 requests x Table I inference times (about 1.3 s) over 12 GPUs and the makespan.
    assert 0.4 < result.gpu_utilization < 0.7


def test_same_seed_same_result_and_other_seed_differs() -> None:
    assert run("lalb-o3", seed=3) == run("lalb-o3", seed=3)
    assert run("lalb-o3", seed=3) != run("lalb-o3", seed=4)
