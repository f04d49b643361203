"""How many warm spare workers a GPU keeps: a floor, raised while misses come faster than spares are made.

A miss that loads takes a spare, and a new one is forked at once; it is warm `start_s` later (the
fork, the runtime's imports shared with the zygote, the device context). A miss that arrives
before that finds no spare and waits for a process start on its critical path. So a GPU keeps its
configured floor plus the loads expected during one spare's start (`rate x start_s`, rounded
up), up to a ceiling, from the loads of the last `window_s` seconds. Extra spares are made only
while the machine's CPUs are not all busy (a spare made under load takes CPU from the calls); the
floor is always kept.

`SpareTarget` is plain bookkeeping with time passed in; the worker pool records loads and spare
start times and asks it for the target each time it refills.
"""

from __future__ import annotations

import math
from collections import deque

DEFAULT_WINDOW_S = 10.0
DEFAULT_MAX_EXTRA = 4  # spares above the floor, at most
_START_S_WEIGHT = 0.2  # of a new measure in the moving average of spare start times


class SpareTarget:
    """The number of spares one GPU should keep (see the module)."""

    def __init__(self, floor: int, *, max_extra: int = DEFAULT_MAX_EXTRA, window_s: float = DEFAULT_WINDOW_S) -> None:
        if floor < 0 or max_extra < 0 or not window_s > 0:
            raise ValueError(f"floor and max_extra must be >= 0 and window_s > 0, got {floor}, {max_extra}, {window_s}")
        self.floor = floor
        self.max_extra = max_extra
        self.window_s = window_s
        self.start_s = 0.0  # moving average of how long a spare takes to become warm (0: none seen yet)
        self._loads_s: deque[float] = deque()  # when each load of the window took (or wanted) a spare

    def record_load(self, now_s: float) -> None:
        self._loads_s.append(now_s)
        self._expire(now_s)

    def record_start(self, seconds: float) -> None:
        self.start_s = seconds if not self.start_s else (1 - _START_S_WEIGHT) * self.start_s + _START_S_WEIGHT * seconds

    def target(self, now_s: float, *, cpu_busy: bool) -> int:
        if self.floor == 0 or cpu_busy:
            return self.floor  # no spares configured (the docker runtime): none made ahead
        self._expire(now_s)
        expected = len(self._loads_s) / self.window_s * self.start_s
        return self.floor + min(self.max_extra, math.ceil(expected - 1e-9) if expected > 0 else 0)

    def _expire(self, now_s: float) -> None:
        while self._loads_s and now_s - self._loads_s[0] > self.window_s:
            self._loads_s.popleft()
