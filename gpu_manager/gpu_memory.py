"""What each worker's model is booked at on its GPU, from the node's own measurement (NVML, by the
PIDs of the worker and what it started) where it has one, and whether a model measured over its
declaration has to go."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from gpu_manager.devices import Nvml
from gpu_manager.workers import Worker, book_memory, memory_margin_mb

log = logging.getLogger("gpufaas.gpu_manager.pool")

MEASURE_EVERY_S = 1.0  # NVML's per-process query costs about a small model's inference: not per call


class GpuMemory:
    """The worker pool's GPU memory books. `nvml`: the session the node measures its workers with
    (None: nothing measures them; models are booked at their declared sizes); `gpus`: node-local
    GPU id -> device index; `capacity_mb(gpu_id)`: what the scheduler may book on that GPU, against
    which a model measured over its declaration is checked (None: no check)."""

    def __init__(
        self,
        gpus: dict[str, int],
        nvml: Nvml | None,
        capacity_mb: Callable[[str], int] | None,
        processes: Callable[[Worker], list[int]] = lambda worker: [worker.pid],
    ) -> None:
        """`processes(worker)`: the worker's process and those it started (its control group),
        whose GPU memory is its model's: a handler may run its model in a process of its own."""
        self.gpus = gpus
        self._nvml = nvml
        self._capacity_mb = capacity_mb
        self._processes = processes
        # Workers whose model was over its declared size beyond the margin, by how that was seen:
        # "measured" (NVML) or "claimed" (the worker's own report, booked at the declared size).
        self.models_over_declared: collections.Counter[str] = collections.Counter()

    def book(self, worker: Worker, reported_mb: int, *, measure: bool, booked_mb: Callable[[str], int]) -> bool:
        """Set what `worker`'s model is booked at (`worker.memory_mb`) from the node's own
        measurement where it has one (`measure`: now, else at most once per MEASURE_EVERY_S),
        never from the worker's `reported_mb` (see book_memory). Returns False when the worker has
        to be stopped: measured over its declaration, its GPU's models (`booked_mb(gpu_id)`, read
        after this booking) would overcommit the GPU."""
        run = worker.run
        if run is None:
            return True
        booking = book_memory(run.memory_mb, reported_mb, self._measure_gpu_mb(worker, force=measure))
        worker.memory_mb = booking.booked_mb
        if not booking.over_declared:
            return True
        source = "measured" if booking.measured else "claimed"
        if not worker.over_declared:
            worker.over_declared = True
            self.models_over_declared[source] += 1
            figure = booking.booked_mb if booking.measured else reported_mb
            log.warning(
                "model %r on %s (pid %d) %s %d MiB of GPU memory, over its declared %d MiB by more than the "
                "%d MiB margin%s",
                run.model,
                worker.gpu_id,
                worker.pid,
                "holds" if booking.measured else "reports",
                figure,
                run.memory_mb,
                memory_margin_mb(run.memory_mb),
                "; declare what it uses" if booking.measured else f"; booked at the declared {run.memory_mb} MiB",
            )
        if not booking.measured or self._capacity_mb is None:
            return True
        gpu_booked_mb = booked_mb(worker.gpu_id)
        if gpu_booked_mb <= self._capacity_mb(worker.gpu_id):
            return True
        log.error("%s; its models would then book %d MiB", over_memory_message(worker), gpu_booked_mb)
        return False

    def _measure_gpu_mb(self, worker: Worker, *, force: bool) -> int | None:
        """The most GPU memory the node has seen `worker` and the processes it started hold
        together (NVML, by PID), measuring again when `force`d or MEASURE_EVERY_S after the last
        time; None where nothing measures it (no NVML; a container's PID, which NVML does not
        know; NVML not listing it yet)."""
        if self._nvml is None or not worker.pid or worker.container:
            return None
        now = time.monotonic()
        if force or now - worker.measured_s >= MEASURE_EVERY_S:
            worker.measured_s = now
            held_mb = self._nvml.processes_mb(self.gpus[worker.gpu_id], self._processes(worker))
            if held_mb is not None:
                worker.measured_mb = max(worker.measured_mb, held_mb)
        return worker.measured_mb or None


def over_memory_message(worker: Worker) -> str:
    """Why `worker` was stopped for its GPU memory (its call's or its load's answer)."""
    declared_mb = worker.run.memory_mb if worker.run is not None else 0
    return (
        f"model {worker.model!r} on {worker.gpu_id} holds {worker.memory_mb} MiB of GPU memory, over its declared "
        f"{declared_mb} MiB, and its GPU has no room for that: its worker was stopped (declare memory_mb >= "
        f"{worker.memory_mb})"
    )
