"""A miss on the node: a worker takes a model. Its package is fetched, made its user's and its
weights readied (`ModelFiles`) while the worker warms up, then the worker is confined and sent
LoadModel (`ModelLoader`); the stages' times are the miss's Server-Timing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from gpu_manager.containers import UNCONFINED_UID
from gpu_manager.runtimes import KILL_WAIT_S, Runtime
from gpu_manager.sandbox import Isolation, lock_package, package_locked
from gpu_manager.workers import NO_WEIGHTS, ModelRun, WeightsPlan, Worker, misbehaved_message
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost

_JUST_FETCHED_S = 0.05  # a package that took longer than this to get is in the page cache already


class LoadFailed(Exception):
    """A load's failure, the answer of every call that waited on it. `worker_end`: what the pool
    does with the worker: "kill" it now, "stop" it (SIGTERM, in the background), or only "forget"
    it (it is gone already)."""

    def __init__(
        self,
        outcome: int,
        message: str,
        peak_memory_mb: int = 0,
        *,
        worker_end: Literal["kill", "stop", "forget"] = "forget",
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.peak_memory_mb = peak_memory_mb  # measured: the worker was stopped for holding that
        self.worker_end = worker_end


class ModelFiles:
    """What a worker taking a model finds on the node: `fetch_package(digest)` returns the
    package's directory, fetching it if needed, and the seconds that took (0: it was on disk);
    `prepare_weights(digest, directory)` what the worker maps from the host model pool and its
    requirements layer (None: neither). Where `isolation` runs workers as their package's own
    user, the package is made readable to that user only, once."""

    def __init__(
        self,
        fetch_package: Callable[[str], Awaitable[tuple[Path, float]]],
        prepare_weights: Callable[[str, Path], Awaitable[WeightsPlan]] | None,
        isolation: Isolation,
    ) -> None:
        self._fetch_package = fetch_package
        self._prepare_weights = prepare_weights
        self._isolation = isolation

    async def for_load(self, run: ModelRun, stages: pb.MissStages, *, read_ahead: bool) -> tuple[Path, WeightsPlan]:
        """`run`'s package directory and weights, their times written into `stages`. With
        `read_ahead` (the worker is still warming up) a package found on disk and not pooled is
        read into host memory meanwhile: its load then finds the weights in the page cache."""
        directory, stages.fetch_s = await self._fetch_package(run.package_digest)
        await self.own(run.package_digest, directory)  # readable by its own user only
        weights = await self.weights(run, directory)
        stages.pool_s, stages.from_pool = weights.pool_s, weights.from_pool
        if weights.pooled:
            return directory, weights  # the worker maps them from memory: nothing to read ahead
        if read_ahead and stages.fetch_s < _JUST_FETCHED_S:
            # A package fetched just now is in the page cache already, and with a warm spare
            # there is nothing to overlap with.
            prefetch_started = time.perf_counter()
            await asyncio.to_thread(_read_ahead, directory)
            stages.prefetch_s = time.perf_counter() - prefetch_started
        return directory, weights

    async def for_container(self, run: ModelRun) -> tuple[Path, int, WeightsPlan]:
        """What a container for `run` mounts: its package's directory, the user that owns it, and
        its weights in the host pool (the docker runtime's `prepare`)."""
        directory, _ = await self._fetch_package(run.package_digest)
        uid = await self.own(run.package_digest, directory, container=True)
        return directory, uid, await self.weights(run, directory)

    async def own(self, digest: str, directory: Path, *, container: bool = False) -> int:
        """The user a package's workers run as, its package made readable to that user only
        (gpu_manager.sandbox); without package users (not root, or --unconfined-workers), the
        node's own user, but for a `container` of a node that runs as root: UNCONFINED_UID, the
        same for every package (a container is never root; each mounts only its own package)."""
        if self._isolation.per_package_users:
            uid = self._isolation.package_users.uid(digest)
        elif container and os.getuid() == 0:
            uid = UNCONFINED_UID
        else:
            return os.getuid()
        # Checked at every load, not remembered by digest: a package unstaged (unused, or evicted
        # for room) and staged again is a new directory, which must be locked again.
        if not package_locked(directory, uid):
            await asyncio.to_thread(lock_package, directory, uid)
        return uid

    async def weights(self, run: ModelRun, directory: Path) -> WeightsPlan:
        if self._prepare_weights is None:
            return NO_WEIGHTS
        return await self._prepare_weights(run.package_digest, directory)


class ModelLoader:
    """Loads a model into a claimed worker: its files readied while it warms up (EDAS's parallel
    loading), the miss's victims waited for where their device memory must be free first
    (`wait_for_victims`), the worker confined by `runtime` and sent LoadModel. `max_body_bytes`:
    the largest result a call may return."""

    def __init__(self, files: ModelFiles, runtime: Runtime, *, max_body_bytes: int, wait_for_victims: bool) -> None:
        self.files = files
        self.runtime = runtime
        self.max_body_bytes = max_body_bytes
        self.wait_for_victims = wait_for_victims

    async def load(
        self, worker: Worker, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]]
    ) -> tuple[pb.MissStages, pb.ModelLoaded]:
        """The miss's stages and the worker's ModelLoaded, a successful one; LoadFailed (saying
        what to do with the worker) otherwise."""
        stages = pb.MissStages()
        was_warm = worker.hello.done()
        hello, directory, weights = await self._ready(worker, run, gpu_id, stages, was_warm=was_warm)
        _check_live(worker, run, gpu_id)
        # What readying the worker cost (forked from the zygote, then its device context).
        stages.spare_context_s = hello.context_s
        stages.spare_start_s = max(0.0, worker.warm_s - worker.spawned_s - hello.context_s)
        if not was_warm:  # the context was created while this call waited
            stages.start_s = max(0.0, stages.start_s - hello.context_s)
            stages.context_s = hello.context_s
        if victims and self.wait_for_victims:
            await asyncio.wait(victims, timeout=KILL_WAIT_S)  # their device memory must be free first
            _check_live(worker, run, gpu_id)
        load_started = time.perf_counter()
        loaded = await self._send(worker, run, gpu_id, directory, weights)
        stages.load_s = time.perf_counter() - load_started
        if not loaded.ok:
            worker.exit_cause = "load_failed"
            message = f"model {run.model!r} on {gpu_id}: load failed: {loaded.error}"
            raise LoadFailed(pb.LOAD_FAILED, message, worker_end="stop")
        return stages, loaded

    async def _ready(
        self, worker: Worker, run: ModelRun, gpu_id: str, stages: pb.MissStages, *, was_warm: bool
    ) -> tuple[pb.WorkerHello, Path, WeightsPlan]:
        """The worker's hello and the model's files, readied side by side; `stages.start_s`: how
        long the hello took, if the worker was not warm yet."""
        started = time.perf_counter()

        async def warm() -> pb.WorkerHello:
            hello = await worker.hello
            if not was_warm:
                stages.start_s = time.perf_counter() - started
            return hello

        package = asyncio.ensure_future(self.files.for_load(run, stages, read_ahead=not was_warm))
        try:
            hello, (directory, weights) = await asyncio.gather(warm(), package)
        except Exception as exc:
            package.cancel()
            died = isinstance(exc, ConnectionLost)
            worker.exit_cause = worker.exit_cause or ("died" if died else "load_failed")
            if died:
                message = f"worker for {run.model!r} on {gpu_id} exited while starting"
                raise LoadFailed(pb.WORKER_DIED, message, worker_end="kill") from None
            raise LoadFailed(pb.LOAD_FAILED, f"function package unavailable: {exc}", worker_end="kill") from None
        return hello, directory, weights

    async def _send(
        self, worker: Worker, run: ModelRun, gpu_id: str, directory: Path, weights: WeightsPlan
    ) -> pb.ModelLoaded:
        """Confine the worker and send it LoadModel (paths as it sees them); its ModelLoaded."""
        assert worker.conn is not None
        seen = self.runtime.worker_view(weights)  # its weights where the worker sees them
        try:
            confinement = await self.runtime.confinement(worker, run)
        except OSError as exc:
            worker.exit_cause = "load_failed"
            message = f"model {run.model!r} on {gpu_id}: cannot confine its worker: {exc}"
            raise LoadFailed(pb.LOAD_FAILED, message, worker_end="kill") from None
        load = pb.LoadModel(
            model=run.model,
            package_dir=self.runtime.package_dir(directory),
            pooled=seen.pooled,
            layer_dir=seen.layer_dir,
            memory_mb=run.memory_mb,
            worker=run.worker,
            load_time_s=run.load_time_s,
            inference_time_s=run.inference_time_s,
            max_result_bytes=self.max_body_bytes,
            **confinement,
        )
        try:
            return await worker.load(load)
        except ConnectionLost:
            if worker.exit_cause == "misbehaved":  # its handler's doing: a failed load, not placed again
                raise LoadFailed(pb.LOAD_FAILED, f"{misbehaved_message(worker)} while loading") from None
            message = f"worker of model {run.model!r} on {gpu_id} (pid {worker.pid}) exited while loading"
            raise LoadFailed(pb.WORKER_DIED, message) from None


def _check_live(worker: Worker, run: ModelRun, gpu_id: str) -> None:
    """LoadFailed if `worker` exited or was let go of (killed at its call's deadline, stopped)
    while its load waited (its files, its victims): nothing more is made for it (a control group,
    a home), which its exit, already handled, would never remove."""
    if worker.is_gone:
        worker.exit_cause = worker.exit_cause or "died"
        message = f"worker for {run.model!r} on {gpu_id} (pid {worker.pid}) exited or was let go of before its load"
        raise LoadFailed(pb.WORKER_DIED, message)


def _read_ahead(directory: Path) -> None:
    """Ask the kernel to read the package's files into host memory now (readahead runs while
    the worker is being readied); the load then finds its weights in the page cache."""
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
