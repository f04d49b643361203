"""The interface every way of running a node's workers implements (gpu_manager.runtimes), and
the timings they share with the worker pool."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

from gpu_manager.sandbox import Isolation
from gpu_manager.workers import ModelRun, WeightsPlan, Worker
from gpufaas.processes import tree
from gpufaas.wire import ConnectionLost, max_frame_bytes_for

log = logging.getLogger("gpufaas.gpu_manager.pool")

SPARE_START_TIMEOUT_S = 120.0  # importing torch and creating a CUDA context, on a busy machine
SPARE_RETRY_S = 5.0  # after a spare (or the zygote) died warming up (a broken runtime), before another
STOP_GRACE_S = 2.0
"""How long a stopped worker has to exit after SIGTERM before it gets SIGKILL."""
KILL_WAIT_S = 30.0  # tearing down a large CUDA context can take seconds; past this, log and move on

# A container's package, owner and weights, made ready by the worker pool before it starts.
Prepare = Callable[[ModelRun], Awaitable[tuple[Path, int, WeightsPlan]]]


class Runtime(ABC):
    """One way of running a node's workers (see gpu_manager.runtimes)."""

    name: ClassVar[str]
    keeps_spares: ClassVar[bool]  # whether a worker starts before its model is known

    def __init__(
        self,
        *,
        backend: str,
        gpus: dict[str, int],
        isolation: Isolation,
        max_body_bytes: int,
        closing: Callable[[], bool],
    ) -> None:
        """`gpus`: node-local GPU id -> device index; `closing()`: whether the node is shutting
        down (a worker that cannot start then is no error)."""
        self.backend = backend
        self.gpus = gpus
        self.isolation = isolation
        self.max_frame_bytes = max_frame_bytes_for(max_body_bytes)
        self._closing = closing

    async def check(self) -> None:  # noqa: B027  (an optional hook)
        """Refuse to start (with an error that says what to do) where this runtime cannot run."""

    @abstractmethod
    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        """Start `worker`'s process (for `model`, where the runtime makes a worker for a model),
        connect it (`worker.conn`), and return once it is gone, `worker.exited` resolved."""

    def package_dir(self, directory: Path) -> str:
        """Where the worker finds its package (what LoadModel says)."""
        return str(directory)

    def worker_view(self, weights: WeightsPlan) -> WeightsPlan:
        """`weights` at the paths the worker sees them (what LoadModel says)."""
        return weights

    @abstractmethod
    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        """The LoadModel fields that confine `worker`, taking `run` (gpu_manager.sandbox); what
        the node itself holds it to is set up here, before its handler runs (OSError if not)."""

    def processes(self, worker: Worker) -> list[int]:
        """`worker`'s process and those it started, as far as this runtime can tell (their GPU
        memory is its model's)."""
        return tree(worker.pid)

    def over_memory(self, worker: Worker) -> bool:
        """Whether `worker` (or a process it started) was killed for its memory limit."""
        return worker.exit_cause == "over_memory"

    async def release_package(self, digest: str, in_use: Callable[[], bool]) -> None:  # noqa: B027
        """No worker of package `digest` is left on this node: what the runtime keeps for it goes."""

    async def stop_starting(self) -> None:  # noqa: B027  (an optional hook)
        """The node is shutting down: cancel what would still start workers."""

    async def shutdown(self) -> None:  # noqa: B027  (an optional hook)
        """After every worker stopped: what the runtime itself holds goes."""

    def _start_failed(self, worker: Worker, exc: BaseException | None, what: str) -> None:
        if not self._closing():
            log.error("cannot start %s: %s", what, exc)
        worker.exit_cause = worker.exit_cause or ("shutdown" if self._closing() else "start_failed")
        worker.gone(ConnectionLost(f"cannot start {what}: {exc or 'the pool shut down'}"))
