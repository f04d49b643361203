"""Each GPU's warm spare workers: started before any model is known, so that a miss takes one
instead of waiting for a process start (how many: gpu_manager.spares)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from gpu_manager.runtimes import SPARE_RETRY_S
from gpu_manager.spares import SpareTarget
from gpu_manager.workers import Worker, WorkerState
from gpufaas.proto import gpufaas_pb2 as pb

log = logging.getLogger("gpufaas.gpu_manager.pool")


class SpareWorkers:
    """The spares of one pool. State, touched only from the event loop: `_spares`: gpu_id -> warm
    spares, oldest first; `_starting`: gpu_id -> spares on their way (a miss may claim one before
    its hello). The pool lends `spawn(gpu_id)` (start a worker process, not yet for a model) and
    `closing()` (whether it is shutting down: no spare is made then). `floor`: the spares each GPU
    keeps; `max_extra`: how many more it may keep while misses come faster than spares are made
    and `cpu_busy()` says no."""

    def __init__(
        self,
        gpus: list[str],
        *,
        floor: int,
        max_extra: int,
        spawn: Callable[[str], Worker],
        closing: Callable[[], bool],
        cpu_busy: Callable[[], bool],
    ) -> None:
        self._spawn = spawn
        self._closing = closing
        self._cpu_busy = cpu_busy
        self._spares: dict[str, deque[Worker]] = {gpu: deque() for gpu in gpus}
        self._starting: dict[str, list[Worker]] = {gpu: [] for gpu in gpus}
        self._targets = {gpu: SpareTarget(floor, max_extra=max_extra) for gpu in gpus}

    def start(self) -> None:
        """Start every GPU's spares (in the background)."""
        for gpu_id in self._targets:
            self.replenish(gpu_id)

    def count(self, gpu_id: str) -> int:
        return len(self._spares.get(gpu_id, ()))

    async def ready(self, timeout_s: float) -> list[pb.WorkerHello]:
        """Wait up to `timeout_s` until every spare on its way is warm; the hellos of every warm
        spare (what they cost and hold)."""
        waiting = [w.hello for workers in self._starting.values() for w in workers]
        waiting += [w.hello for spares in self._spares.values() for w in spares]
        if not waiting:
            return []
        done, _ = await asyncio.wait(waiting, timeout=timeout_s)
        return [future.result() for future in done if future.exception() is None]

    def claim(self, gpu_id: str) -> Worker | None:
        """A spare of `gpu_id` for a miss (a warm one, else one still starting), or None; the
        load is counted toward the GPU's spare target."""
        self._targets[gpu_id].record_load(time.monotonic())
        if self._spares[gpu_id]:
            return self._spares[gpu_id].popleft()
        if self._starting[gpu_id]:
            return self._starting[gpu_id].pop(0)
        return None

    def replenish(self, gpu_id: str) -> None:
        """Start spares for `gpu_id` up to its target now."""
        if self._closing():
            return
        target = self._targets[gpu_id].target(time.monotonic(), cpu_busy=self._cpu_busy())
        while len(self._spares[gpu_id]) + len(self._starting[gpu_id]) < target:
            self._starting[gpu_id].append(self._spawn(gpu_id))

    def on_hello(self, worker: Worker) -> None:
        """`worker` said hello (or failed to): a spare still unclaimed becomes warm."""
        if worker.hello.exception() is None and worker.gpu_id in self._targets:
            self._targets[worker.gpu_id].record_start(worker.warm_s - worker.spawned_s)
        starting = self._starting.get(worker.gpu_id, [])
        if worker in starting and worker.hello.exception() is None:
            starting.remove(worker)
            worker.state = WorkerState.SPARE
            self._spares[worker.gpu_id].append(worker)

    def on_exit(self, worker: Worker) -> None:
        """`worker`'s process is gone: a spare is replaced, after SPARE_RETRY_S if it died warming
        up (a broken runtime must not respawn in a tight loop)."""
        was_spare = False
        for group in (self._starting.get(worker.gpu_id, []), self._spares.get(worker.gpu_id, deque())):
            if worker in group:
                group.remove(worker)
                was_spare = True
        if not was_spare or self._closing():
            return
        if worker.hello.done() and worker.hello.exception() is None:
            self.replenish(worker.gpu_id)
        else:
            log.error(
                "a spare worker for %s exited before it was ready; see the log above; retrying in %g s",
                worker.gpu_id,
                SPARE_RETRY_S,
            )
            asyncio.get_running_loop().call_later(SPARE_RETRY_S, self.replenish, worker.gpu_id)
