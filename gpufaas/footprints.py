"""What each model's worker measurably uses in host memory, and what an unmeasured one is charged.

Shared by the node's host tier (gpu_manager.host_tier, which measures) and the scheduler's view of
it (cache_manager.HostTier, which learns the measures from the node's reports), so that both
charge a model the same: its own last measure, else the median of the others', else its declared
memory (a cpu worker of a 100 MB model measures 7-17 MB).
"""

from __future__ import annotations

import statistics


class Footprints:
    """Model -> MiB measured, with the median kept up to date as measures come in."""

    __slots__ = ("_median_mb", "_measured_mb")

    def __init__(self) -> None:
        self._measured_mb: dict[str, int] = {}
        self._median_mb: int | None = None

    def get(self, model: str) -> int | None:
        return self._measured_mb.get(model)

    def record(self, model: str, mb: int) -> None:
        self._measured_mb[model] = mb
        self._median_mb = int(statistics.median(self._measured_mb.values()))

    def charge_mb(self, model: str, declared_mb: int) -> int:
        """`model`'s measure, else the median of every measure, else `declared_mb`."""
        known = self._measured_mb.get(model)
        if known is not None:
            return known
        return self._median_mb if self._median_mb is not None else declared_mb
