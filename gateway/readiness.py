"""The gateway's readiness (GET /healthz): whether the scheduler and etcd answer, asked of them at
most once per `max_age_s` however many probes come (the route is open: anyone may ask)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.router import CallFailed, Router
from gpufaas.store import Store, StoreError

SCHEDULER_TIMEOUT_S = 1.0  # a connected scheduler whose loop stalls this long is not ready
ETCD_TIMEOUT_S = 1.0
MAX_AGE_S = 0.5  # an answer this young is the answer: probes more often than this cost nothing


@dataclass(frozen=True, slots=True)
class Readiness:
    scheduler: bool
    etcd: bool

    @property
    def ready(self) -> bool:
        return self.scheduler and self.etcd


class ReadinessProbe:
    """`check()` answers the last readiness found if it is younger than `max_age_s` (measured from
    when it was found), else finds it anew, once for every caller waiting meanwhile."""

    def __init__(
        self,
        find: Callable[[], Awaitable[Readiness]],
        *,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._find = find
        self.max_age_s = max_age_s
        self._clock = clock
        self._last: tuple[float, Readiness] | None = None
        self._finding: asyncio.Future[Readiness] | None = None

    async def check(self) -> Readiness:
        if self._last is not None and self._clock() - self._last[0] < self.max_age_s:
            return self._last[1]
        if self._finding is None:
            self._finding = asyncio.ensure_future(self._found())
        # Shielded: a probe that gives up (its client gone) does not cancel the others' answer.
        return await asyncio.shield(self._finding)

    async def _found(self) -> Readiness:
        try:
            readiness = await self._find()
            self._last = (self._clock(), readiness)
            return readiness
        finally:
            self._finding = None


def readiness_of(router: Router, store: Store) -> Callable[[], Awaitable[Readiness]]:
    """What a gateway's readiness is found by: a summary from the scheduler (its loop answers),
    and a read of etcd's revision, each within its timeout."""

    async def find() -> Readiness:
        try:
            await router.cluster(timeout_s=SCHEDULER_TIMEOUT_S, summary=True)
            scheduler = True
        except CallFailed:
            scheduler = False
        try:
            async with asyncio.timeout(ETCD_TIMEOUT_S):
                await store.revision()
            etcd = True
        except (StoreError, TimeoutError):
            etcd = False
        return Readiness(scheduler, etcd)

    return find
