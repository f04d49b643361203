"""bench.replay_bench's simulated column runs the workload the cluster is sent: the same deadline."""

from __future__ import annotations

from bench import replay_bench
from simulator.engine import ClusterConfig, simulate
from simulator.workload import zipf_workload


def test_the_simulated_calls_have_the_deployed_functions_deadline() -> None:
    """100 calls of 1 s at once on one GPU: the last waits 99 s. The cluster's functions have
    timeout_s TIMEOUT_S and answer every call; the simulated column must not time out those
    waiting past the workload's default 60 s (and average the others only)."""
    workload = zipf_workload(calls=100, models=1, zipf_exponent=1.0, memory_mb=100, gap_s=0.0, seed=0)
    result = simulate(replay_bench.compressed(workload, 1.0), "lalb-o3", cluster=ClusterConfig(gpus=1))
    assert result.timed_out == 0
    assert result.completed == 100
    assert all(replay_bench.compressed(workload, 10.0).timeout_s(f) == 3600.0 for f in workload.function_models)
