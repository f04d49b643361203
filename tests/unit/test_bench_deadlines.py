"""The simulator benchmarks that compare latencies give every call the longest deadline
(NO_DEADLINE_S): with the functions' 60 s default a queued row drops calls at their deadline, and
its latencies, over completed calls only, hide them. Each says how many timed out all the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import eviction_compare, mqfq_keepalive, paper_reproduction, reproduction_robustness, transfer_compare
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace
from simulator.workload import NO_DEADLINE_S, Workload, load_trace

LOADED_RPM = 450  # the loaded point of docs/policies.md (6 GB GPUs), where queues build


def _trace_builders() -> dict[str, Callable[[], list[Workload]]]:
    counts = load_trace(shipped_trace(), "azure2019")
    return {
        "eviction_compare": lambda: [workload for _, workload, _ in eviction_compare.workloads()],
        "mqfq_keepalive": lambda: [mqfq_keepalive.point_workload(counts, LOADED_RPM)],
        "reproduction_robustness": lambda: reproduction_robustness.workloads(counts, 35, LOADED_RPM)[:1],
        "transfer_compare": lambda: transfer_compare.point_workloads(LOADED_RPM, [None]),
    }


@pytest.mark.parametrize("bench", ["eviction_compare", "mqfq_keepalive", "reproduction_robustness", "transfer_compare"])
def test_every_call_of_a_bench_workload_has_the_longest_deadline(bench: str) -> None:
    for workload in _trace_builders()[bench]():
        assert {workload.timeout_s(f) for f in workload.function_models} == {NO_DEADLINE_S}


def test_paper_reproduction_workloads_have_the_longest_deadline() -> None:
    assert paper_reproduction.BASE.timeout_s == NO_DEADLINE_S


def test_the_loaded_point_times_out_no_call_and_the_figures_say_so() -> None:
    """lb at 450 rpm on 6 GB GPUs (mqfq_keepalive's loaded point): with the 60 s default
    calls timed out; now none does, and the bench's figures carry the count."""
    workload = mqfq_keepalive.point_workload(load_trace(shipped_trace(), "azure2019"), LOADED_RPM)
    result = simulate(workload, "lb", cluster=ClusterConfig(gpu_memory_mb=6144))
    assert result.timed_out == 0 and result.completed == result.requests
    assert mqfq_keepalive.figures(result)["timed_out"] == 0
    assert "timed_out" in transfer_compare.METRICS
