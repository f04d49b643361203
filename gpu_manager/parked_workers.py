"""The worker pool's host tier: ready workers moved off their GPU with their model kept in host
memory, taken back by a miss for the same package (gpu_manager.host_tier keeps the books)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gpu_manager.host_tier import ParkedTier
from gpu_manager.workers import ModelRun, Worker, WorkerState


class ParkedWorkers:
    """The PARKED workers of one pool, one per model, least recently parked first, within
    `budget_mb` of the host memory they measurably use (read by `measure_host_mb(pid)` off the
    event loop once parked). The pool lends `stop(worker)` (stop it in the background: pushed
    out, or its package redeployed) and `track(task)` (keeps a background measurement, cancelled
    at shutdown). A budget of 0 is no tier: nothing is parked."""

    def __init__(
        self,
        budget_mb: int,
        *,
        measure_host_mb: Callable[[int], int | None],
        stop: Callable[[Worker], None],
        track: Callable[[asyncio.Task[Any]], None],
    ) -> None:
        self._tier: ParkedTier[Worker] = ParkedTier(budget_mb)
        self._measure_host_mb = measure_host_mb
        self._stop = stop
        self._track = track

    @property
    def enabled(self) -> bool:
        return self._tier.budget_mb > 0

    def park(self, worker: Worker) -> None:
        """Move a ready worker (which its GPU's books no longer hold) into the tier; the oldest
        parked go past the budget."""
        worker.state = WorkerState.PARKED
        worker.host_mb = None
        self._stop_all(self._tier.park(worker))
        measurable = worker.pid and not worker.container and self._tier.get(worker.model) is worker
        if measurable and self._tier.wants_measure(worker.model, time.monotonic()):
            self._track(asyncio.create_task(self._measure(worker)))

    def take_back(self, run: ModelRun, gpu_id: str) -> Worker | None:
        """`run.model`'s parked worker, out of the tier and READY on `gpu_id`, or None: none is
        parked, or the one parked runs another package (a redeploy: it is stopped)."""
        worker = self._tier.get(run.model)
        if worker is None or worker.state is not WorkerState.PARKED:
            return None
        self._tier.pop(run.model)
        if worker.run is None or worker.run.package_digest != run.package_digest:
            self._stop(worker)  # its code is stale
            return None
        worker.gpu_id = gpu_id
        worker.state = WorkerState.READY
        # Grants are ordered per GPU: the order it was used in on its last GPU means nothing here
        # (kept, it made a later grant's eviction of it look stale, and it stayed for good).
        worker.last_seq = 0
        return worker

    def pop(self, model: str) -> Worker | None:
        """`model`'s parked worker, out of the tier (for the caller to stop), or None."""
        return self._tier.pop(model)

    def exited(self, worker: Worker) -> None:
        """`worker`'s process is gone: it leaves the tier if it was there."""
        if self._tier.get(worker.model) is worker:
            self._tier.pop(worker.model)

    def models(self) -> list[tuple[str, int]]:
        """(model, MiB of host memory it is charged) of every parked worker, least recently
        parked first."""
        return self._tier.models()

    async def _measure(self, worker: Worker) -> None:
        """Charge a parked worker what it uses (its PSS, read off the event loop)."""
        host_mb = await asyncio.to_thread(self._measure_host_mb, worker.pid)
        if host_mb is not None and worker.state is WorkerState.PARKED:
            self._stop_all(self._tier.measured(worker, host_mb, time.monotonic()))

    def _stop_all(self, workers: list[Worker]) -> None:
        for displaced in workers:
            self._stop(displaced)
