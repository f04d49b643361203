"""The gateway's one record of its calls: the per-function counts and latency histograms its
Prometheus metrics expose, and the overview's calls by cache result and recent latencies."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpufaas.metrics import LATENCY_BUCKETS_S, LoopSeries, check_buckets_s

RECENT_CALLS = 1024  # calls per function the percentiles are taken over
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(slots=True)
class _Recent:
    """A function's part of the overview, since the gateway started or the function's last
    deletion or new package."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))


class FunctionStats(Collector):
    """Every call the gateway answers or fails is recorded once, by `record` (one whose client went
    away before its answer too: under 499, gateway.invoke.CLIENT_GONE), and read in two ways:

    - as Prometheus series, by function and HTTP status (this is the gateway registry's collector):
      `gateway_function_invocation_total` and the histogram `gateway_functions_seconds`, with
      OpenFaaS's names and labels. A redeploy keeps them (Prometheus sees counters that only
      grow); a deletion drops them (`delete`, `forget`), so that their number is bounded by the
      functions deployed now times the statuses they answered with, not by every function ever
      called (a new function of the name counts from 0: a counter reset, as rate() reads one).
    - as the overview's summary of each function (`summary`): calls by cache result, errors (the
      calls whose client left among them), and latency percentiles over its last RECENT_CALLS
      answered calls. `drop` and `forget` reset it.

    Recording costs two dict lookups, a bisection over the buckets (`LoopSeries`) and a deque
    append (the invoke path pays it per call); cumulative buckets and percentiles are computed
    when read. Recorded and read on the event loop's thread only (the /metrics route scrapes
    there): nothing is locked.
    """

    def __init__(self, buckets_s: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self._bounds_s = check_buckets_s(buckets_s)
        # The buckets' `le` labels, written as prometheus-client writes its own histograms'.
        self._le = [floatToGoString(b) for b in self._bounds_s] + ["+Inf"]  # type: ignore[no-untyped-call]
        # (function, HTTP status) -> its series: a counter and a histogram of durations at once (the
        # count is the sum of the bucket counts). Never reset: Prometheus reads it as monotonic.
        self._series: dict[tuple[str, int], LoopSeries] = {}
        # function -> the same series by status, so that `count` and `delete` read only its own.
        self._series_of: dict[str, dict[int, LoopSeries]] = {}
        self._recent: dict[str, _Recent] = {}  # function -> its overview part

    def record(self, name: str, status: int, duration_s: float, *, hit: bool | None = None) -> None:
        """One call to function `name`, answered with HTTP `status` after `duration_s` at the
        gateway. `hit`: for an answered call, whether its model was already loaded; None for a
        call that failed (the function's own error, a timeout, no capacity, its client gone...)."""
        series = self._series.get((name, status))
        if series is None:
            series = self._series[(name, status)] = LoopSeries(self._bounds_s)
            self._series_of.setdefault(name, {})[status] = series
        series.observe(duration_s)
        recent = self._recent.get(name)
        if recent is None:
            recent = self._recent[name] = _Recent()
        if hit is None:
            recent.errors += 1
            return
        if hit:
            recent.hits += 1
        else:
            recent.misses += 1
        recent.recent_s.append(duration_s)

    def count(self, name: str) -> int:
        """Calls to function `name` since the gateway started, whatever their status. O(its
        statuses), not O(every function's): GET /system/functions asks it of each function."""
        return sum(sum(s.counts) for s in self._series_of.get(name, {}).values())

    def collect(self) -> Iterator[Metric]:
        invocations = CounterMetricFamily(
            "gateway_function_invocation",
            "Function invocations by function and HTTP status.",
            labels=["function_name", "code"],
        )
        seconds = HistogramMetricFamily(
            "gateway_functions_seconds",
            "Invocation duration at the gateway, by function and HTTP status.",
            labels=["function_name", "code"],
        )
        for (name, status), series in sorted(self._series.items()):
            labels = [name, str(status)]
            cumulative = list(accumulate(series.counts))
            invocations.add_metric(labels, cumulative[-1])
            seconds.add_metric(labels, list(zip(self._le, cumulative, strict=True)), series.sum_s)
        yield invocations
        yield seconds

    def drop(self, name: str) -> None:
        """Reset one function's overview (deleted, or deployed with a new package); its
        Prometheus series go on counting."""
        self._recent.pop(name, None)

    def delete(self, name: str) -> None:
        """Drop one deleted function's overview and Prometheus series."""
        self._recent.pop(name, None)
        for status in self._series_of.pop(name, {}):
            del self._series[(name, status)]

    def forget(self, keep: set[str]) -> None:
        """Drop the overview and the series of the functions not in `keep` (deleted ones, among
        them those a call answered after the deletion recorded again), so that both stay bounded."""
        for name in {n for n in self._recent if n not in keep} | {n for n in self._series_of if n not in keep}:
            self.delete(name)

    def summary(self, name: str) -> dict[str, Any]:
        """calls, hits, misses, errors, hit_ratio (None before the first answered call) and
        latency_ms {p50, p95, p99} over the recent calls (None before the first)."""
        recent = self._recent.get(name) or _Recent()
        answered = recent.hits + recent.misses
        return {
            "calls": answered + recent.errors,
            "hits": recent.hits,
            "misses": recent.misses,
            "errors": recent.errors,
            "hit_ratio": recent.hits / answered if answered else None,
            "latency_ms": _percentiles_ms(recent.recent_s),
        }


def _percentiles_ms(durations_s: deque[float]) -> dict[str, float] | None:
    if not durations_s:
        return None
    ordered = sorted(durations_s)
    # Nearest rank: the smallest duration that at least the share q of the calls took no longer than.
    return {f"p{round(q * 100)}": round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000, 3) for q in QUANTILES}
