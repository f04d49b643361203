"""The scheduler's recent evictions, for the cluster views (`gpufaas top`, the dashboard): a bounded
log fed by the effects the service carries out, with time passed in."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.calls import Assignment, Evict, EvictHost

RECENT_EVICTIONS = 50


@dataclass(frozen=True, slots=True)
class Eviction:
    at_s: float  # the service's clock
    gpu: str  # "node/gpu"; a node's host tier is "node/host"
    model: str
    reason: str  # lru | idle | removed | host


class EvictionLog:
    """The last `size` models that left a GPU or a host tier, and why:
    - lru: a placement made room for another model (Algorithm 1's eviction);
    - idle: a release the scheduler asked for if the worker is idle: the staged exit's (to the host
      tier or out), or an orphan's a node reported (the node keeps a worker that has calls in
      flight or that a later grant uses, so this is what was asked, not always what happened);
    - removed: a model no function runs any more;
    - host: a copy left a node's host tier."""

    def __init__(self, size: int = RECENT_EVICTIONS) -> None:
        self._log: deque[Eviction] = deque(maxlen=size)

    def record(self, effect: object, now_s: float) -> None:
        """Note what `effect` evicts, if anything (other effects are ignored)."""
        if isinstance(effect, Assignment):
            for model in effect.evict:
                self._log.append(Eviction(now_s, effect.gpu_id, model, "lru"))
        elif isinstance(effect, Evict):
            for model in effect.models:
                self._log.append(Eviction(now_s, effect.gpu_id, model, "idle" if effect.if_idle else "removed"))
        elif isinstance(effect, EvictHost):
            for model in effect.models:
                self._log.append(Eviction(now_s, f"{effect.node}/host", model, "host"))

    def recent(self) -> list[Eviction]:
        """The most recent first."""
        return list(reversed(self._log))
