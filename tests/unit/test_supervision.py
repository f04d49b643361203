"""gpufaas.dev.supervision: when a crashed component is restarted (manual clock)."""

from __future__ import annotations

import pytest

from gpufaas.dev.supervision import Backoff, Supervision


def test_a_component_that_keeps_crashing_waits_longer_each_time_up_to_the_cap() -> None:
    supervision = Supervision(Backoff(first_s=0.2, factor=2.0, max_s=1.0, stable_s=30.0))
    supervision.started("scheduler", 0.0)
    now, delays = 0.0, []
    for _ in range(5):
        now += 0.1  # it dies soon after each start
        restart_at = supervision.exited("scheduler", now)
        delays.append(round(restart_at - now, 3))
        assert supervision.due(restart_at - 0.01) == []
        assert supervision.due(restart_at) == ["scheduler"]
        now = restart_at
        supervision.started("scheduler", now)
    assert delays == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert supervision.restarts == {"scheduler": 5}


def test_a_stable_run_is_forgiven_and_each_restart_is_handed_out_once() -> None:
    supervision = Supervision(Backoff(first_s=0.2, max_s=10.0, stable_s=30.0))
    supervision.started("etcd", 0.0)
    assert supervision.exited("etcd", 1.0) == 1.2
    assert supervision.exited("etcd", 1.1) == 1.2  # seen gone again before its restart: same time
    assert supervision.waiting("etcd")
    assert supervision.due(5.0) == ["etcd"] and supervision.due(5.0) == []
    supervision.started("etcd", 5.0)
    assert supervision.exited("etcd", 5.5) == 5.5 + 0.4  # a short run: backed off
    supervision.due(6.0)
    supervision.started("etcd", 6.0)
    assert supervision.exited("etcd", 100.0) == 100.2  # ran 94 s: starts afresh


def test_components_are_restarted_in_the_order_their_time_came() -> None:
    supervision = Supervision(Backoff(first_s=1.0))
    for name in ("node0", "gateway"):
        supervision.started(name, 0.0)
    supervision.exited("gateway", 0.5)
    supervision.exited("node0", 0.2)
    assert supervision.due(2.0) == ["node0", "gateway"]


@pytest.mark.parametrize(
    "bounds",
    [{"first_s": 0.0}, {"first_s": 20.0, "max_s": 10.0}, {"factor": 0.5}, {"stable_s": -1.0}],
)
def test_a_backoff_that_would_not_back_off_is_refused(bounds: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="a backoff needs"):
        Backoff(**bounds)
