"""The worker pool's GPU tier: the worker of each (model, GPU) on the node, loading or ready."""

from __future__ import annotations

from gpu_manager.workers import Worker, WorkerState


class GpuWorkers:
    """(model, gpu_id) -> its worker, LOADING or READY (touched only from the event loop). An
    entry goes when the worker is evicted, parked, found dead, killed by a timeout, or replaced
    after a redeploy."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, str], Worker] = {}

    def get(self, model: str, gpu_id: str) -> Worker | None:
        return self._workers.get((model, gpu_id))

    def add(self, worker: Worker) -> None:
        """`worker` now serves (or is taking) its model on its GPU."""
        self._workers[(worker.model, worker.gpu_id)] = worker

    def forget(self, worker: Worker) -> None:
        """`worker` leaves its GPU's books (if it still holds its entry)."""
        key = (worker.model, worker.gpu_id)
        if self._workers.get(key) is worker:  # a newer worker may hold the key already
            del self._workers[key]

    def ready(self) -> list[tuple[str, str, int, int]]:
        """(model, gpu_id, pid, memory_mb) of every worker that is READY."""
        return [
            (model, gpu, w.pid, w.memory_mb)
            for (model, gpu), w in self._workers.items()
            if w.state is WorkerState.READY
        ]

    def booked_mb(self, gpu_id: str) -> int:
        """What the models loading or ready on `gpu_id` are booked at."""
        return sum(
            w.memory_mb
            for (_, gpu), w in self._workers.items()
            if gpu == gpu_id and w.state in (WorkerState.LOADING, WorkerState.READY)
        )

    def forget_grant_order(self) -> None:
        """A new scheduler attached: its grants are numbered afresh."""
        for worker in self._workers.values():
            worker.last_seq = 0

    def idle(self, model: str, gpu_id: str, seq: int) -> Worker | None:
        """`model`'s worker on `gpu_id` if it is idle as grant `seq` sees it: READY, no calls in
        flight, not used by a later grant."""
        worker = self._workers.get((model, gpu_id))
        if worker is None or worker.pending or worker.state is not WorkerState.READY or worker.last_seq > seq:
            return None
        return worker

    def victim(self, model: str, gpu_id: str, seq: int) -> Worker | None:
        """`model`'s worker on `gpu_id` if grant `seq` may evict it: not one with calls in flight,
        still loading, or used by a later grant (the scheduler's view has moved on: it
        re-admitted the model)."""
        worker = self._workers.get((model, gpu_id))
        if worker is None or worker.pending or worker.state is WorkerState.LOADING or worker.last_seq > seq:
            return None
        return worker
