"""Adaptive D (scheduler.adaptive_slots): steps of D against utilization on a manual clock, and
the controller driving the simulator's GPUs."""

from __future__ import annotations

import pytest

from scheduler.adaptive_slots import AdaptiveSlots
from simulator.engine import ClusterConfig, simulate
from simulator.workload import zipf_workload


def test_d_steps_down_while_busy_above_the_threshold_and_up_below_it_within_its_bounds() -> None:
    d = AdaptiveSlots(3, threshold=0.9, period_s=0.2)
    assert d.observe(0.0, {"g0": (1, 2)}) == {}  # first sight: D 2, its first period starts
    # Busy the whole period (one call running throughout): 100% > 90%, D 2 -> 1.
    assert d.observe(0.2, {"g0": (1, 2)}) == {"g0": 1}
    assert d.observe(0.4, {"g0": (1, 1)}) == {}  # already at 1
    # Busy 0.1 s of 0.2 (the call ended at 0.5): 50%, D 1 -> 2, then 3, then held at 3.
    assert d.observe(0.5, {"g0": (0, 1)}) == {}
    assert d.observe(0.6, {"g0": (0, 1)}) == {"g0": 2}
    assert d.observe(0.8, {"g0": (0, 2)}) == {"g0": 3}
    assert d.observe(1.0, {"g0": (0, 3)}) == {} and d.slots("g0") == 3
    # Events far apart: the whole span is one period, one step.
    assert d.observe(1.01, {"g0": (2, 3)}) == {}
    assert d.observe(9.0, {"g0": (2, 3)}) == {"g0": 2}
    assert d.changes == 4


def test_next_step_is_the_end_of_a_period_at_which_d_would_move_with_the_calls_running_unchanged() -> None:
    d = AdaptiveSlots(3, threshold=0.9, period_s=0.2, track_next_step=True)
    d.observe(0.0, {"g0": (1, 3)})
    assert d.next_step_s == pytest.approx(0.2)  # busy at D 3: it steps down at the period's end
    assert d.observe(0.2, {"g0": (1, 3)}) == {"g0": 2} and d.next_step_s == pytest.approx(0.4)
    assert d.observe(0.4, {"g0": (1, 2)}) == {"g0": 1}
    assert d.next_step_s == float("inf")  # busy at D 1: it stays there
    d.observe(0.5, {"g0": (0, 1)})
    assert d.next_step_s == pytest.approx(0.6)  # busy half the period: D rises at its end
    untracked = AdaptiveSlots(3, threshold=0.9, period_s=0.2)  # the service's: it samples on a timer
    untracked.observe(0.0, {"g0": (2, 3)})
    assert untracked.observe(0.2, {"g0": (1, 3)}) == {"g0": 2} and untracked.next_step_s == float("inf")


def test_a_gpu_whose_d_was_reset_gets_the_controllers_back_and_a_gpu_that_left_is_forgotten() -> None:
    d = AdaptiveSlots(4, period_s=0.2)
    d.observe(0.0, {"g0": (0, 1), "g1": (0, 1)})
    assert d.observe(0.2, {"g0": (0, 1), "g1": (0, 1)}) == {"g0": 2, "g1": 2}
    assert d.observe(0.3, {"g0": (0, 1)}) == {"g0": 2}  # g0 came back with its configured D
    assert d.slots("g1") is None
    with pytest.raises(ValueError, match="threshold"):
        AdaptiveSlots(2, threshold=1.5)


def test_a_gpu_configured_above_the_bound_is_brought_within_it_at_first_sight() -> None:
    # g0 joins at D 4 under a bound of 2: the first look says so. (It clamped its own D and said
    # nothing: the GPU took up to 4 calls until the next look.) A GPU it tracks joins at its D.
    d = AdaptiveSlots(2, period_s=0.2)
    assert d.start_slots("g0", 4) == 2 and d.start_slots("g0", 0) == 1
    assert d.observe(0.0, {"g0": (0, 4)}) == {"g0": 2}
    assert d.observe(0.2, {"g0": (1, 2)}) == {} and d.start_slots("g0", 4) == 2
    assert d.observe(0.4, {"g0": (1, 2)}) == {"g0": 1} and d.start_slots("g0", 4) == 1


def test_in_the_simulator_gpus_of_more_slots_than_adaptive_ds_bound_run_within_it_from_the_first_call() -> None:
    # Four calls of four models at 0 on one GPU configured at D 4, adaptive D at most 1: one at a
    # time, as at D 1. (They ran all four at once, D 4 until the first completion at 3.)
    calls = zipf_workload(calls=4, models=4, zipf_exponent=1.1, memory_mb=1000, gap_s=0.0, seed=1)
    results = [
        simulate(calls, "lalb", cluster=ClusterConfig(gpus=1, gpu_memory_mb=8000, slots=slots, adaptive_slots=1))
        for slots in (1, 4)
    ]
    assert results[1].avg_slots == 1.0
    assert results[1].avg_latency_s == pytest.approx(results[0].avg_latency_s)


def test_in_the_simulator_d_rises_on_an_idle_cluster_and_falls_on_a_saturated_one() -> None:
    light = zipf_workload(calls=200, models=4, zipf_exponent=1.1, memory_mb=1000, gap_s=5.0, seed=1)
    heavy = zipf_workload(calls=600, models=4, zipf_exponent=1.1, memory_mb=1000, gap_s=0.05, seed=1)
    cluster = ClusterConfig(gpus=2, gpu_memory_mb=8000, slots=2, interference=0.2, adaptive_slots=4)
    quiet, busy = (simulate(w, "lalb-o3", cluster=cluster) for w in (light, heavy))
    assert quiet.slot_changes > 0 and quiet.avg_slots > 3.0  # mostly idle: D at its maximum
    assert busy.avg_slots < 1.5  # saturated: D held at 1, so calls do not slow each other down
    fixed = simulate(heavy, "lalb-o3", cluster=ClusterConfig(gpus=2, gpu_memory_mb=8000, slots=2, interference=0.2))
    assert fixed.slot_changes == 0 and fixed.avg_slots == 2.0 and fixed.adaptive_slots is None
