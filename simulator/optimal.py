"""The fewest misses any eviction policy could have on a request sequence: the floor that every
policy's miss ratio is measured against.

The problem is offline caching with sizes and forced admission: requests arrive in a known order,
the requested model must be in GPU memory when it runs (it is loaded on a miss; nothing bypasses
the cache), and what is kept must fit. The cache is the cluster's GPU memory pooled into one
(`capacity_mb` = GPUs x memory per GPU): any placement on separate GPUs also fits the pool, so
the pool's optimum is a lower bound for every placement, replicas and all.

- All models of one size: Belady's MIN (evict the model needed furthest in the future) is optimal
  (`belady_misses`), O(n log n).
- Sizes that differ: MIN is not optimal, and the exact problem is NP-hard. It is solved exactly
  as an integer program over the gaps between a model's consecutive requests: keep the model
  through a gap (the second request hits) or not, such that at every request the requested model
  plus every model kept through that moment fits (`interval_program_misses`, with HiGHS through
  scipy). Gaps no request's room constrains are kept for free. If the solver stops at its time
  limit, the bound it proved is reported (`exact` False): still a floor, not necessarily reached.

The sequence is the arrival order. A policy that dispatches out of order (lalb-o3) serves another
order, which can miss less than this floor; a policy that evicts idle models on a timer can only
miss more. Models larger than the pool can never run and are left out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True, slots=True)
class Optimum:
    """The floor for one sequence: at least `misses` of `requests` miss (exactly that many when
    `exact`), found by `method` ("belady", "integer-program", "bound")."""

    requests: int
    misses: int
    exact: bool
    method: str

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0


def optimal_misses(
    sequence: Sequence[tuple[str, int]], capacity_mb: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S
) -> Optimum:
    """The fewest misses for `sequence` ((model, memory_mb) per request, in order) in a cache of
    `capacity_mb` (see the module). Models larger than the cache are left out."""
    if capacity_mb <= 0:
        raise ValueError(f"capacity_mb must be positive, got {capacity_mb}")
    runnable = [(model, mb) for model, mb in sequence if mb <= capacity_mb]
    sizes = {mb for _, mb in runnable}
    if len(sizes) <= 1:
        slots = capacity_mb // next(iter(sizes)) if sizes else 0
        return Optimum(len(runnable), belady_misses([m for m, _ in runnable], slots), True, "belady")
    misses, exact = interval_program_misses(runnable, capacity_mb, time_limit_s=time_limit_s)
    return Optimum(len(runnable), misses, exact, "integer-program" if exact else "bound")


def belady_misses(sequence: Sequence[str], slots: int) -> int:
    """Misses of Belady's MIN on `sequence` with room for `slots` models of one size: on a miss in
    a full cache, the model whose next request is furthest away (or never comes) leaves."""
    if slots <= 0:
        return len(sequence)
    next_use = _next_uses(sequence)
    cached: dict[str, int] = {}  # model -> the position of its next request
    furthest: list[tuple[int, str]] = []  # max-heap by next request, stale entries skipped
    misses = 0
    for position, model in enumerate(sequence):
        if model not in cached:
            misses += 1
            if len(cached) >= slots:
                while True:
                    negative, victim = heapq.heappop(furthest)
                    if cached.get(victim) == -negative:
                        del cached[victim]
                        break
        cached[model] = next_use[position]
        heapq.heappush(furthest, (-next_use[position], model))
    return misses


def interval_program_misses(
    sequence: Sequence[tuple[str, int]], capacity_mb: int, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S
) -> tuple[int, bool]:
    """(misses, exact) for models of several sizes, by the integer program in the module's
    docstring; every model fits `capacity_mb` alone. Needs scipy (`pip install 'gpufaas[sim]'`)."""
    try:
        import numpy as np
        from scipy.optimize import LinearConstraint, milp  # type: ignore[import-untyped]
        from scipy.sparse import csr_array  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError("the optimum for models of several sizes needs scipy: pip install 'gpufaas[sim]'") from None
    last_seen: dict[str, int] = {}
    gaps: list[tuple[int, int, int]] = []  # (after request, before request, MB) of each gap
    first_requests = 0
    for position, (model, mb) in enumerate(sequence):
        previous = last_seen.get(model)
        if previous is None:
            first_requests += 1
        elif position - previous > 1:  # back to back: nothing runs between, a hit
            gaps.append((previous, position, mb))
        last_seen[model] = position
    back_to_back = len(sequence) - first_requests - len(gaps)
    # Each request's room: its own model plus the gaps open across it must fit.
    load = [mb for _, mb in sequence]
    for start, end, mb in gaps:
        for position in range(start + 1, end):
            load[position] += mb
    tight = [p for p in range(len(sequence)) if load[p] > capacity_mb]
    if not tight:
        return first_requests, True  # everything fits throughout: only the first requests miss
    row_of = {p: row for row, p in enumerate(tight)}
    rows, cols, values = [], [], []
    for column, (start, end, mb) in enumerate(gaps):
        for position in range(start + 1, end):
            row = row_of.get(position)
            if row is not None:
                rows.append(row)
                cols.append(column)
                values.append(mb)
    matrix = csr_array((values, (rows, cols)), shape=(len(tight), len(gaps)))
    room = np.array([capacity_mb - sequence[p][1] for p in tight], dtype=float)
    result = milp(
        c=-np.ones(len(gaps)),  # keep as many gaps as possible: each is a hit
        constraints=LinearConstraint(matrix, -np.inf, room),
        integrality=np.ones(len(gaps)),
        bounds=(0, 1),
        options={"time_limit": time_limit_s, "disp": False},
    )
    if result.status == 0:
        kept = round(-result.fun)
        return len(sequence) - back_to_back - kept, True
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not math.isfinite(bound):
        # No bound proved in time: the only floor is that every first request misses.
        return first_requests, False
    return len(sequence) - back_to_back - math.floor(-bound + 1e-6), False


def _next_uses(sequence: Sequence[str]) -> list[int]:
    """For each position, the position of the same model's next request (len(sequence) if none)."""
    upcoming: dict[str, int] = {}
    next_use = [0] * len(sequence)
    for position in range(len(sequence) - 1, -1, -1):
        next_use[position] = upcoming.get(sequence[position], len(sequence))
        upcoming[sequence[position]] = position
    return next_use
