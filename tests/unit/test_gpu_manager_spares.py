"""How many spares a GPU keeps (gpu_manager.spares.SpareTarget), on a manual clock."""

from __future__ import annotations

import pytest

from gpu_manager.spares import SpareTarget


def test_the_floor_until_loads_come_faster_than_a_spare_is_made() -> None:
    spares = SpareTarget(1, max_extra=4, window_s=10.0)
    assert spares.target(0.0, cpu_busy=False) == 1
    spares.record_start(0.05)  # a spare takes 50 ms to be warm
    for i in range(10):  # one load a second: 0.05 expected per start
        spares.record_load(float(i))
    assert spares.target(9.0, cpu_busy=False) == 2  # rounded up: one more
    for i in range(400):  # 40 a second: 2 per start
        spares.record_load(10.0 + i / 40)
    assert spares.target(19.9, cpu_busy=False) == 3
    spares.record_start(0.5)  # slower starts weigh in (moving average: 0.14 s)
    assert spares.target(19.9, cpu_busy=False) == 1 + 4  # capped at the floor + max_extra
    assert spares.target(19.9, cpu_busy=True) == 1  # busy CPUs: the floor only
    assert spares.target(40.0, cpu_busy=False) == 1  # the loads left the window


def test_no_floor_means_no_spares_and_bad_settings_are_refused() -> None:
    spares = SpareTarget(0)
    spares.record_start(0.05)
    for i in range(100):
        spares.record_load(i / 100)
    assert spares.target(1.0, cpu_busy=False) == 0  # the docker runtime: none made ahead
    with pytest.raises(ValueError, match="window_s"):
        SpareTarget(1, window_s=0)
