"""The node's host tier bookkeeping (gpu_manager.host_tier): what a parked worker is charged,
what parking and measuring push out, and the PSS reader against this process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from gpu_manager.host_tier import ParkedTier, proportional_set_mb


@dataclass(eq=False)
class Parked:
    model: str
    memory_mb: int = 100
    host_mb: int | None = None


def test_a_worker_is_charged_its_measure_else_its_models_else_the_median_else_declared() -> None:
    tier: ParkedTier[Parked] = ParkedTier(1000)
    a = Parked("a")
    tier.park(a)
    assert tier.models() == [("a", 100)]  # nothing measured yet: declared
    tier.measured(a, 17, 0.0)
    b, c = Parked("b", memory_mb=400), Parked("c", memory_mb=400)
    tier.park(b)
    tier.measured(b, 23, 0.0)
    tier.park(c)
    assert tier.models() == [("a", 17), ("b", 23), ("c", 20)]  # c: the median of 17 and 23
    assert tier.used_mb == 60
    # A later worker of a measured model is charged its model's figure until it is measured itself.
    tier.pop("a")
    again = Parked("a")
    tier.park(again)
    assert tier.charge_mb(again) == 17


def test_parking_displaces_an_older_replica_and_the_oldest_past_the_budget() -> None:
    tier: ParkedTier[Parked] = ParkedTier(50)
    old_a, b = Parked("a", host_mb=20), Parked("b", host_mb=20)
    assert tier.park(old_a) == [] and tier.park(b) == []
    new_a = Parked("a", host_mb=20)
    assert tier.park(new_a) == [old_a]  # one worker per model in the tier
    assert [m for m, _ in tier.models()] == ["b", "a"] and tier.get("a") is new_a
    c = Parked("c", host_mb=20)
    assert tier.park(c) == [b]  # 60 > 50: the least recently parked goes
    assert [m for m, _ in tier.models()] == ["a", "c"]
    huge = Parked("h", host_mb=80)
    assert tier.park(huge) == [huge]  # more than the whole budget: it displaces itself, and only itself
    assert [m for m, _ in tier.models()] == ["a", "c"]
    measured_big = Parked("m", host_mb=20)
    assert tier.park(measured_big) == [new_a]
    assert tier.measured(measured_big, 500, 0.0) == [measured_big]  # measured past the budget: the same
    assert [m for m, _ in tier.models()] == ["c"]


def test_a_measure_above_the_estimate_pushes_out_the_oldest_even_of_a_worker_gone_since() -> None:
    tier: ParkedTier[Parked] = ParkedTier(300)
    a, b, c = Parked("a"), Parked("b"), Parked("c")
    for worker in (a, b, c):
        tier.park(worker)
    assert tier.used_mb == 300
    assert tier.measured(c, 150, 0.0) == [a]  # c uses more than declared: a (oldest) is pushed out
    assert tier.models() == [("b", 150), ("c", 150)]  # b: charged c's measure, the only one known
    # A worker measured after it left the tier is not charged, but its figure moves the estimate
    # of those not measured yet: b is now charged the median of 150 and 999, and no longer fits.
    gone = Parked("gone")
    assert tier.measured(gone, 999, 0.0) == [b]
    assert tier.models() == [("c", 150)]


def test_a_measure_past_the_whole_budget_also_pushes_out_those_its_median_now_puts_past_it() -> None:
    tier: ParkedTier[Parked] = ParkedTier(100)
    a, b, c = Parked("a", memory_mb=10), Parked("b", memory_mb=10), Parked("c", memory_mb=10)
    for worker in (a, b, c):
        tier.park(worker)
    assert tier.used_mb == 30
    # c goes, more than the whole budget; a and b, not measured, are charged the median: 150 each.
    assert tier.measured(c, 150, 0.0) == [c, a, b]
    assert tier.models() == [] and tier.used_mb <= tier.budget_mb


def test_the_budget_cannot_be_negative() -> None:
    with pytest.raises(ValueError, match="budget"):
        ParkedTier(-1)


def test_the_pss_of_this_process_is_read_and_a_missing_process_reads_as_none() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"):
        pytest.skip("this kernel has no /proc/PID/smaps_rollup")
    mine = proportional_set_mb(os.getpid())
    assert mine is not None and 1 <= mine < 64 * 1024
    assert proportional_set_mb(2**22 + 12345) is None  # above pid_max: no such process


def test_a_model_is_measured_again_only_once_its_last_measure_is_old() -> None:
    tier: ParkedTier[Parked] = ParkedTier(1000, remeasure_s=60.0)
    a = Parked("a")
    assert tier.wants_measure("a", 0.0)
    tier.park(a)
    tier.measured(a, 17, 10.0)
    tier.pop("a")
    again = Parked("a")
    tier.park(again)
    assert not tier.wants_measure("a", 69.9) and tier.charge_mb(again) == 17  # the model's figure
    assert tier.wants_measure("a", 70.0) and tier.wants_measure("b", 0.0)
