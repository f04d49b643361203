"""Liveness: each daemon's event-loop lag as it measures it, and the supervisor's watchdog verdict.

A process that exits is seen by its supervisor at once; one that stops answering (a stalled
event loop, SIGSTOP, a deadlock) was not: calls waited on it while it looked alive. Two pieces:

- `LoopLag` (in every daemon): how late the daemon's own event loop runs a timer, kept as the
  latest reading and the worst of the last `window_s`; `LoopLagCollector` puts both in the
  daemon's metrics, `LoopLag.report()` in its /healthz. `run_loop_lag` is the timer task.
- `Watchdog` (in the supervisor): when to probe each component and when one that stopped
  answering is to be killed (and so restarted). Pure: time and probe outcomes are passed in;
  gpufaas.dev.local_cluster sends the probes and kills.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LAG_INTERVAL_S = 0.25  # how often a daemon's loop times itself
LAG_WINDOW_S = 60.0  # the worst lag reported is over this window


@dataclass
class LoopLag:
    """Readings of how late a timer fired: `measured(lag_s, now)` records one; `latest_s` is the
    last, `max_s(now)` the worst of those within `window_s` of `now` (0.0 when none)."""

    window_s: float = LAG_WINDOW_S
    latest_s: float = 0.0
    _readings: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    def measured(self, lag_s: float, now: float) -> None:
        self.latest_s = max(0.0, lag_s)
        self._readings.append((now, self.latest_s))
        self._forget(now)

    def max_s(self, now: float) -> float:
        self._forget(now)
        return max((lag for _, lag in self._readings), default=0.0)

    def report(self, now: float) -> dict[str, float]:
        """What /healthz shows: the latest and the window's worst lag, in seconds."""
        return {"loop_lag_s": round(self.latest_s, 4), "loop_lag_max_s": round(self.max_s(now), 4)}

    def _forget(self, now: float) -> None:
        while self._readings and self._readings[0][0] < now - self.window_s:
            self._readings.popleft()


async def run_loop_lag(lag: LoopLag, interval_s: float = LAG_INTERVAL_S) -> None:
    """Until cancelled: sleep `interval_s` on the running loop and record how late it woke."""
    loop = asyncio.get_running_loop()
    while True:
        expected = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        now = loop.time()
        lag.measured(now - expected, now)


class LoopLagCollector(Collector):
    """The daemon's loop lag as two gauges (seconds): the latest reading and the window's worst."""

    def __init__(self, lag: LoopLag, clock: Callable[[], float]) -> None:
        self.lag = lag
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpufaas_event_loop_lag_seconds",
            "How late this daemon's event loop ran a timer, latest reading (a busy or stalled loop delays every call).",
            value=self.lag.latest_s,
        )
        yield GaugeMetricFamily(
            "gpufaas_event_loop_lag_max_seconds",
            f"The worst event-loop lag of the last {LAG_WINDOW_S:g} s.",
            value=self.lag.max_s(self.clock()),
        )


@dataclass(frozen=True, slots=True)
class WatchdogPolicy:
    """A component is probed every `every_s` with `timeout_s` to answer; `failures` unanswered
    probes in a row, after it answered once since its start (or `start_grace_s` after its start,
    whichever comes first), and it is killed. Unresponsive for about
    `failures * max(every_s, timeout_s)` before the kill: short enough that calls wait seconds,
    not minutes; long enough that a loop busy for a moment is not killed."""

    every_s: float = 0.25
    timeout_s: float = 0.5
    failures: int = 2
    start_grace_s: float = 60.0


@dataclass
class Watchdog:
    """Probe schedule and verdicts per named component.

    `started(name, now)` when it (re)starts; `due(now)` the components to probe now (each is
    handed out again only after `probed`); `probed(name, answered, now)` records the outcome and
    answers whether to kill it. `kills[name]` counts the kills, `failing[name]` the unanswered
    probes in a row.
    """

    policy: WatchdogPolicy = field(default_factory=WatchdogPolicy)
    kills: dict[str, int] = field(default_factory=dict)
    failing: dict[str, int] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _answered: set[str] = field(default_factory=set)
    _next_at: dict[str, float] = field(default_factory=dict)
    _in_flight: set[str] = field(default_factory=set)

    def started(self, name: str, now: float) -> None:
        self._started_at[name] = now
        self._answered.discard(name)
        self._in_flight.discard(name)  # an answer from the previous process does not count
        self.failing[name] = 0
        self._next_at[name] = now

    def forget(self, name: str) -> None:
        """Stop probing `name` (it exited: its supervisor restarts it, then `started` again)."""
        self._next_at.pop(name, None)
        self._in_flight.discard(name)

    def due(self, now: float) -> list[str]:
        ready = sorted(n for n, at in self._next_at.items() if at <= now and n not in self._in_flight)
        self._in_flight.update(ready)
        return ready

    def probed(self, name: str, answered: bool, now: float) -> bool:
        """Record a probe's outcome; True: the component stopped answering, kill it."""
        if name not in self._in_flight:
            return False  # restarted or forgotten while the probe was out
        self._in_flight.discard(name)
        self._next_at[name] = now + self.policy.every_s
        if answered:
            self._answered.add(name)
            self.failing[name] = 0
            return False
        self.failing[name] = self.failing.get(name, 0) + 1
        judged = name in self._answered or now - self._started_at.get(name, now) >= self.policy.start_grace_s
        if judged and self.failing[name] >= self.policy.failures:
            self.kills[name] = self.kills.get(name, 0) + 1
            self.forget(name)
            return True
        return False
