"""bench.policy_compare compares latencies of every call: none is dropped at a deadline."""

from __future__ import annotations

from bench import policy_compare
from simulator.engine import ClusterConfig, simulate


def test_lb_at_the_loaded_point_times_out_no_call() -> None:
    """lb at 450 rpm on 6 GB GPUs queues calls for minutes (102 s on average in docs/policies.md):
    with the functions' default 60 s deadline most of them timed out, and its average latency,
    over the completed calls only, looked three times better than it is."""
    rpm, memory_mb = policy_compare.POINTS["loaded (450 rpm, 6 GB)"]
    workload = policy_compare.trace_workloads(rpm, [None])[0]
    result = simulate(workload, "lb", cluster=ClusterConfig(gpu_memory_mb=memory_mb))
    assert result.timed_out == 0
    assert result.completed == result.requests
