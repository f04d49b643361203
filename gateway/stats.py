"""Per-function call statistics the gateway keeps for its overview: calls by cache result, errors,
and the latency percentiles of the most recent calls (a bounded window per function)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT_CALLS = 1024  # calls per function the percentiles are taken over
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(slots=True)
class _Function:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))


class FunctionStats:
    """Counts since the gateway started. Recording costs a dict lookup and a deque append (the
    invoke path pays it per call); percentiles are computed only when asked for."""

    def __init__(self) -> None:
        self._functions: dict[str, _Function] = {}

    def _of(self, name: str) -> _Function:
        stats = self._functions.get(name)
        if stats is None:
            stats = self._functions[name] = _Function()
        return stats

    def answered(self, name: str, duration_s: float, *, hit: bool) -> None:
        """A call that the function answered, in `duration_s` at the gateway."""
        stats = self._of(name)
        if hit:
            stats.hits += 1
        else:
            stats.misses += 1
        stats.recent_s.append(duration_s)

    def failed(self, name: str) -> None:
        """A call that got an error (the function's own, a timeout, no capacity...)."""
        self._of(name).errors += 1

    def drop(self, name: str) -> None:
        """Forget one function (deleted, or deployed with a new package)."""
        self._functions.pop(name, None)

    def forget(self, keep: set[str]) -> None:
        """Drop the functions not in `keep` (deleted ones), so the table stays bounded."""
        for name in [n for n in self._functions if n not in keep]:
            del self._functions[name]

    def summary(self, name: str) -> dict[str, Any]:
        """calls, hits, misses, errors, hit_ratio (None before the first answered call) and
        latency_ms {p50, p95, p99} over the recent calls (None before the first)."""
        stats = self._functions.get(name) or _Function()
        answered = stats.hits + stats.misses
        return {
            "calls": answered + stats.errors,
            "hits": stats.hits,
            "misses": stats.misses,
            "errors": stats.errors,
            "hit_ratio": stats.hits / answered if answered else None,
            "latency_ms": _percentiles_ms(stats.recent_s),
        }


def _percentiles_ms(durations_s: deque[float]) -> dict[str, float] | None:
    if not durations_s:
        return None
    ordered = sorted(durations_s)
    # Nearest rank: the smallest duration that at least the share q of the calls took no longer than.
    return {f"p{round(q * 100)}": round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000, 3) for q in QUANTILES}
