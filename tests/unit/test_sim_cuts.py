"""Dispatched calls cut at their deadline in the simulator, as the node cuts them (gpu_manager.pool):
one the worker runs has the worker killed (the model gone from that GPU, the calls it held dying
with it), one still queued at its worker is answered TIMEOUT with its slot freed."""

from __future__ import annotations

import pytest

from gpufaas.profiles import ModelProfile
from gpufaas.types import DEFAULT_BATCH_SIZE, Request
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload

ONE_GPU = ClusterConfig(gpus=1, slots=1, gpu_memory_mb=4096)


def _workload(calls: list[tuple[str, float]], timeouts_s: dict[str, float], inference_s: float) -> Workload:
    """Calls (function, arrival) of model A (load 0.5 s, `inference_s` a call) on 1 GPU."""
    model = ModelProfile("A", "rtx2080", 1000, 0.5, inference_s, DEFAULT_BATCH_SIZE)
    return Workload(
        requests=[
            Request(f"r{i:06d}", function, "A", at_s, DEFAULT_BATCH_SIZE) for i, (function, at_s) in enumerate(calls)
        ],
        profiles=[model],
        function_models={function: "A" for function in timeouts_s},
        top_function=next(iter(timeouts_s)),
        start_minute=0,
        minutes=1,
        timeouts_s=timeouts_s,
    )


def test_a_running_call_past_its_deadline_is_cut_and_its_model_reloaded() -> None:
    # Each call takes 3.5 s (load 0.5 s, then 3 s) against a 2 s timeout: the node kills its
    # worker at 2 s, so the next call, 10 s later, loads the model again.
    workload = _workload([("fn-A", 0.0), ("fn-A", 10.0), ("fn-A", 20.0)], {"fn-A": 2.0}, inference_s=3.0)
    result = simulate(workload, "lalb", cluster=ONE_GPU)
    assert (result.completed, result.timed_out, result.timeout_rate) == (0, 3, 1.0)
    assert (result.misses, result.hits) == (3, 0)
    assert result.makespan_s == pytest.approx(22.0)  # the last cut at its deadline, not its end at 23.5 s
    assert result.avg_latency_s == 0.0  # no completed call: none in the latency figures
    # The GPU computed each call from 0.5 s to its cut at 2 s: 4.5 s of 22.
    assert result.gpu_utilization == pytest.approx(4.5 / 22.0)


def test_calls_held_by_a_killed_worker_die_with_it_and_are_retried() -> None:
    # 1 GPU, 3 slots: r0 loads A (0.5 s) and runs to 1.5 s; r1 runs next, past its deadline
    # (2.0 s): its worker is killed there, with r2 queued behind it. r2 (deadline 2.1 s) is tried
    # again, a miss that cannot load by its deadline: cut while loading, it times out too.
    workload = _workload([("fn-A", 0.0), ("fn-A", 0.0), ("fn-A", 0.1)], {"fn-A": 2.0}, inference_s=1.0)
    result = simulate(workload, "lalb", cluster=ClusterConfig(gpus=1, slots=3, gpu_memory_mb=4096))
    assert (result.completed, result.timed_out) == (1, 2)
    assert result.avg_latency_s == pytest.approx(1.5)
    assert result.misses == 2  # r0's load, and r2's retry after the kill
    assert result.makespan_s == pytest.approx(2.1)


def test_a_call_queued_at_its_worker_times_out_without_a_kill() -> None:
    # fn-short's call waits on the worker behind fn-long's (running 0.5-1.5 s) past its 1 s
    # deadline: answered TIMEOUT, the worker kept; it still runs there (1.5-2.5 s), unreported.
    workload = _workload([("fn-long", 0.0), ("fn-short", 0.0)], {"fn-long": 60.0, "fn-short": 1.0}, inference_s=1.0)
    result = simulate(workload, "lalb", cluster=ClusterConfig(gpus=1, slots=2, gpu_memory_mb=4096))
    assert (result.completed, result.timed_out) == (1, 1)
    assert (result.misses, result.hits) == (1, 1)
    assert result.avg_latency_s == pytest.approx(1.5)
    assert result.makespan_s == pytest.approx(2.5)
