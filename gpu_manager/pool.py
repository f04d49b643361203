"""The node's worker processes, driven from asyncio: start or reuse, one inference per GPU, kill.

Errors raised by `WorkerPool.run`:

    HandlerError (GpufaasError)   the function's `load` or `predict` raised: the user's to fix
    RunTimeout (GpufaasError)     no result within the call's timeout: the worker running it (if it
                                  got that far) was killed, since it may be stuck
    WorkerDied (RuntimeError)     the worker process exited under a call (or was found dead): the
                                  node's fault and transient; the next call starts a fresh worker
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from gpu_manager.backends import backend_class
from gpu_manager.packages import PackageCache
from gpu_manager.worker import Ready, Reply, Request, WorkerSpec, worker_main
from gpufaas.errors import GpufaasError

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
"""How long an evicted worker has to exit after SIGTERM before it gets SIGKILL."""
_KILL_WAIT_S = 30.0  # tearing down a large CUDA context can take seconds; past this, log and move on
_POLL_S = 0.1  # how often a reader thread checks that its worker is still alive


@dataclass(frozen=True, slots=True)
class RunResult:
    """One inference. `loaded`: this call started the worker (a cache miss), and `load_time_s` is
    then the wall time from process start to ready (0.0 on a hit)."""

    output: bytes
    loaded: bool
    load_time_s: float
    inference_time_s: float
    peak_memory_mb: int


class HandlerError(GpufaasError):
    """The function's `load` or `predict` raised. `resident`: the model's worker is running (and its
    memory held) after the error: True after a `predict` error, False after a `load` error."""

    def __init__(self, message: str, *, model: str, gpu_id: str, resident: bool) -> None:
        super().__init__(message)
        self.model, self.gpu_id, self.resident = model, gpu_id, resident


class RunTimeout(GpufaasError):
    """A call got no result within its timeout; its worker (if it had one running) was killed."""

    def __init__(self, message: str, *, model: str, gpu_id: str) -> None:
        super().__init__(message)
        self.model, self.gpu_id = model, gpu_id


class WorkerDied(RuntimeError):
    """A worker process exited without answering; the pool has forgotten it. `exit_code` is the
    process's status (negative: the signal that killed it), None if it could not be read."""

    def __init__(self, message: str, *, model: str, gpu_id: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.model, self.gpu_id, self.exit_code = model, gpu_id, exit_code


def _started_from(spec: WorkerSpec) -> tuple[str, int]:
    return spec.package_dir, spec.device_index


class _Worker:
    """One worker process, the parent's end of its pipe, and the thread that reads that pipe.

    The reader thread polls rather than blocking in `recv()` so that it also notices the process
    exiting even when a grandchild keeps the pipe open; it reaps the process (only this thread
    waits on it) and then resolves `exited`. The connection is never closed explicitly: it is
    closed when the last user (a send in flight, the reader thread) lets go of it.
    """

    def __init__(self, spec: WorkerSpec, process: BaseProcess, conn: Connection) -> None:
        self.spec = spec
        self.process = process
        self.conn = conn
        self.pid: int = process.pid or 0
        self.messages: asyncio.Queue[Ready | Reply | None] = asyncio.Queue()  # None: the process exited
        self._loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int | None] = self._loop.create_future()  # result: exit status
        self._send_lock = threading.Lock()  # a send left running by a cancelled call must finish first
        self._reader = threading.Thread(target=self._read, name=f"reader-{self.pid}", daemon=True)
        self._reader.start()

    async def send(self, request: Request) -> None:
        # In a thread: a large payload blocks until the worker has read it.
        await asyncio.to_thread(self._send_blocking, request)

    def _send_blocking(self, request: Request) -> None:
        with self._send_lock:
            self.conn.send(request)

    async def wait_exit(self, timeout_s: float) -> bool:
        await asyncio.wait({self.exited}, timeout=timeout_s)
        return self.exited.done()

    def exit_code(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    def _read(self) -> None:
        conn, process = self.conn, self.process
        try:
            while True:
                if conn.poll(_POLL_S):
                    self._post(conn.recv())
                elif process.exitcode is not None:
                    while conn.poll(0):  # what it wrote just before exiting
                        self._post(conn.recv())
                    break
        except (EOFError, OSError):
            pass  # its end of the pipe is closed: it has exited or is about to
        while process.exitcode is None:
            process.join(_POLL_S)
        self._call_soon(self._on_exit, process.exitcode)

    def _post(self, message: Ready | Reply) -> None:
        self._call_soon(self.messages.put_nowait, message)

    def _on_exit(self, exit_code: int | None) -> None:
        if not self.exited.done():
            self.exited.set_result(exit_code)
        self.messages.put_nowait(None)

    def _call_soon(self, callback: Callable[..., object], *args: object) -> None:
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(callback, *args)


class WorkerPool:
    """The worker processes of one node: at most one per (model, gpu_id), one call at a time per GPU.

    State, all touched only from the event loop:
    - `_workers`: (model, gpu_id) -> a worker that reported ready. An entry stays until the worker
      is evicted, killed by a timeout, or found dead by a call (which then raises WorkerDied).
    - `_live`: every process this pool started and has not yet seen exit, ready or not; shutdown
      kills them all.
    - `_gpu_locks`: one lock per gpu_id, held for a whole call, worker start included: one
      inference (or load) at a time per GPU, and concurrent first calls of a model start it once.
    """

    def __init__(self, backend: str, package_cache: PackageCache) -> None:
        backend_class(backend)  # an unknown name fails here, at startup, listing the valid ones
        self.backend = backend
        self.package_cache = package_cache
        self._context = multiprocessing.get_context("spawn")  # CUDA cannot be used after fork
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._live: set[_Worker] = set()
        self._gpu_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    def workers(self) -> list[tuple[str, str, int]]:
        """(model, gpu_id, pid) of every worker that is ready and has not been seen to exit."""
        return [(m, g, w.pid) for (m, g), w in self._workers.items() if not w.exited.done()]

    async def run(self, spec: WorkerSpec, call_id: str, payload: bytes, *, timeout_s: float) -> RunResult:
        """Run one inference of `spec.model` on `spec.gpu_id`, starting its worker if there is none.

        `timeout_s` bounds the whole call: waiting for the GPU, starting the worker, the inference.
        A worker started from another package (the function was redeployed) is replaced.
        Raises HandlerError, RunTimeout or WorkerDied (see the module docstring).
        """
        if self._closed:
            raise RuntimeError("the worker pool is shut down")
        if spec.backend != self.backend:
            raise ValueError(
                f"spec for {spec.model!r} asks for backend {spec.backend!r}; this node runs {self.backend!r}"
            )
        deadline = asyncio.get_running_loop().time() + timeout_s
        lock = self._gpu_locks.setdefault(spec.gpu_id, asyncio.Lock())
        try:
            async with asyncio.timeout_at(deadline):
                await lock.acquire()
        except TimeoutError:
            raise RunTimeout(
                f"model {spec.model!r}: GPU {spec.gpu_id} stayed busy for the whole {timeout_s:g} s timeout",
                model=spec.model,
                gpu_id=spec.gpu_id,
            ) from None
        try:
            if self._closed:  # shut down while this call waited for the GPU
                raise RuntimeError("the worker pool is shut down")
            return await self._run_locked(spec, call_id, payload, deadline, timeout_s)
        finally:
            lock.release()

    async def evict(self, model: str, gpu_id: str) -> bool:
        """Stop the worker of `model` on `gpu_id` (SIGTERM, SIGKILL after STOP_GRACE_S) and wait
        for it to exit, which frees its device memory. False if there was none. A call running on
        it fails with WorkerDied: the cache manager never evicts a model in use."""
        worker = self._workers.get((model, gpu_id))
        if worker is None:
            return False
        await self._stop(worker)
        return True

    async def shutdown(self) -> None:
        """Stop every worker this pool started, ready or still loading; later calls are refused."""
        self._closed = True
        await asyncio.gather(*(self._stop(worker) for worker in list(self._live)))

    # --- one call, with the GPU's lock held ------------------------------------------------

    async def _run_locked(
        self, spec: WorkerSpec, call_id: str, payload: bytes, deadline: float, timeout_s: float
    ) -> RunResult:
        worker = self._workers.get((spec.model, spec.gpu_id))
        if worker is not None and _started_from(worker.spec) != _started_from(spec):
            # The function was redeployed (a new package): its worker runs stale code. The other
            # fields (declared memory, emulated times) stay as they were when the worker started.
            await self._stop(worker)
            worker = None
        if worker is not None and worker.exited.done():
            self._forget(worker)
            raise WorkerDied(
                f"worker of model {spec.model!r} on {spec.gpu_id} (pid {worker.pid}) exited with status "
                f"{worker.exit_code()} since its last call",
                model=spec.model,
                gpu_id=spec.gpu_id,
                exit_code=worker.exit_code(),
            )
        loaded, load_time_s = False, 0.0
        if worker is None:
            started_s = time.perf_counter()
            worker = await self._start(spec, deadline, timeout_s)
            loaded, load_time_s = True, time.perf_counter() - started_s
        reply = await self._call(worker, call_id, payload, deadline, timeout_s)
        if not reply.ok:
            raise HandlerError(
                f"model {spec.model!r} on {spec.gpu_id}: predict raised {reply.result!s}",
                model=spec.model,
                gpu_id=spec.gpu_id,
                resident=True,
            )
        assert isinstance(reply.result, bytes)  # ok replies carry the output bytes
        return RunResult(
            output=reply.result,
            loaded=loaded,
            load_time_s=load_time_s,
            inference_time_s=reply.inference_time_s,
            peak_memory_mb=reply.peak_memory_mb,
        )

    async def _start(self, spec: WorkerSpec, deadline: float, timeout_s: float) -> _Worker:
        worker = self._spawn(spec)
        try:
            async with asyncio.timeout_at(deadline):
                message = await worker.messages.get()
        except TimeoutError:
            self._kill(worker)
            raise RunTimeout(
                f"model {spec.model!r} on {spec.gpu_id}: not loaded within the {timeout_s:g} s timeout; worker killed",
                model=spec.model,
                gpu_id=spec.gpu_id,
            ) from None
        except BaseException:  # cancelled: a half-started worker would belong to nobody
            self._kill(worker)
            raise
        if isinstance(message, Ready) and message.ok:
            self._workers[(spec.model, spec.gpu_id)] = worker
            return worker
        if isinstance(message, Ready):  # load failed; the worker exits by itself
            if not await worker.wait_exit(STOP_GRACE_S):
                self._kill(worker)
            raise HandlerError(
                f"model {spec.model!r} on {spec.gpu_id}: load failed: {message.error}",
                model=spec.model,
                gpu_id=spec.gpu_id,
                resident=False,
            )
        self._kill(worker)
        await worker.wait_exit(_KILL_WAIT_S)
        raise WorkerDied(
            f"worker of model {spec.model!r} on {spec.gpu_id} (pid {worker.pid}) exited with status "
            f"{worker.exit_code()} before it was ready",
            model=spec.model,
            gpu_id=spec.gpu_id,
            exit_code=worker.exit_code(),
        )

    async def _call(self, worker: _Worker, call_id: str, payload: bytes, deadline: float, timeout_s: float) -> Reply:
        spec = worker.spec
        try:
            async with asyncio.timeout_at(deadline):
                await worker.send(Request(call_id, payload))
                while (message := await worker.messages.get()) is not None:
                    if isinstance(message, Reply) and message.call_id == call_id:
                        return message
                    # Otherwise a reply to a call that was cancelled while the worker ran it.
        except TimeoutError:
            self._kill(worker)  # it may be stuck in the handler; killing is the only sure way out
            raise RunTimeout(
                f"model {spec.model!r} on {spec.gpu_id}: no result within the {timeout_s:g} s timeout; worker killed",
                model=spec.model,
                gpu_id=spec.gpu_id,
            ) from None
        except OSError:  # the pipe broke under the send: the worker is gone
            self._kill(worker)
        self._forget(worker)
        await worker.wait_exit(_KILL_WAIT_S)
        raise WorkerDied(
            f"worker of model {spec.model!r} on {spec.gpu_id} (pid {worker.pid}) exited with status "
            f"{worker.exit_code()} during call {call_id}",
            model=spec.model,
            gpu_id=spec.gpu_id,
            exit_code=worker.exit_code(),
        )

    # --- process lifecycle -----------------------------------------------------------------

    def _spawn(self, spec: WorkerSpec) -> _Worker:
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
            args=(spec, child_conn),
            name=f"gpufaas-worker:{spec.model}@{spec.gpu_id}",
            # Daemonic: multiprocessing kills it if this process exits without shutdown(). The
            # price: a handler cannot start processes of its own with multiprocessing.
            daemon=True,
        )
        # start() launches a fresh interpreter and writes it a few KB: milliseconds, so it runs on
        # the event loop, where no cancellation can fall between "started" and "tracked".
        process.start()
        child_conn.close()  # the worker now holds the only other end: its exit reads as EOF here
        worker = _Worker(spec, process, parent_conn)
        self._live.add(worker)
        worker.exited.add_done_callback(lambda _: self._live.discard(worker))
        return worker

    def _forget(self, worker: _Worker) -> None:
        key = (worker.spec.model, worker.spec.gpu_id)
        if self._workers.get(key) is worker:  # a newer worker may hold the key already
            del self._workers[key]

    def _kill(self, worker: _Worker) -> None:
        """SIGKILL now, without waiting; the reader thread reaps the process."""
        self._forget(worker)
        if not worker.exited.done():
            worker.process.kill()

    async def _stop(self, worker: _Worker) -> None:
        self._forget(worker)
        if worker.exited.done():
            return
        worker.process.terminate()
        if await worker.wait_exit(STOP_GRACE_S):
            return
        worker.process.kill()
        if not await worker.wait_exit(_KILL_WAIT_S):
            logger.warning(
                "worker pid %d (%s on %s) survived SIGKILL", worker.pid, worker.spec.model, worker.spec.gpu_id
            )
