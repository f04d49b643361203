"""Every worker process one pool started: started through the node's runtime, stopped (SIGTERM,
then SIGKILL) or killed, their exits counted, and the pool's background tasks kept."""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
from collections.abc import Awaitable, Callable

from gpu_manager.loads import LoadFailed
from gpu_manager.runtimes import KILL_WAIT_S, STOP_GRACE_S, Runtime
from gpu_manager.workers import UNASKED_FRAMES_ALLOWED, ModelRun, Worker, WorkerState
from gpufaas.wire import ConnectionLost

log = logging.getLogger("gpufaas.gpu_manager.pool")


class WorkerProcesses:
    """The processes of one pool, and what it runs in the background. The pool lends `closing()`
    (whether it is shutting down) and its hooks: `on_hello(worker)` when a worker said hello (or
    failed to), `on_exit(worker)` once its process is gone. `network_isolation`: workers should
    have no network (one that says it has is warned of, once).

    State, touched only from the event loop:
    - `live`: every process started and not yet seen exit; shutdown stops them all.
    - `_exiting`: GPU -> the exits of workers stopping there (evicted, released): a miss on that
      GPU waits for them as for its own victims, since their device memory is not free until then.
    - `_tasks`: loads and stops in the background (cancelled at shutdown); `_watchers`: one per
      worker, which starts it and waits for its exit (never cancelled: it tells that it exited).
    - `worker_starts`, `worker_exits` (by cause): since the pool was made, for the node's metrics.
      Started - exited = len(live).
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        closing: Callable[[], bool],
        on_hello: Callable[[Worker], None],
        on_exit: Callable[[Worker], None],
        network_isolation: bool,
    ) -> None:
        self.runtime = runtime
        self._network_isolation = network_isolation
        self._warned_network = False
        self._closing = closing
        self._on_hello = on_hello
        self._on_exit = on_exit
        self.live: set[Worker] = set()
        self._exiting: dict[str, set[asyncio.Future[None]]] = {}
        self._tasks: set[asyncio.Task[object]] = set()
        self._watchers: set[asyncio.Task[None]] = set()
        self.worker_starts = 0
        self.worker_exits: collections.Counter[str] = collections.Counter()

    def spawn(self, gpu_id: str, run: ModelRun | None = None) -> Worker:
        """Start a worker for `gpu_id` through the runtime (in the background): forked from the
        zygote, or on the docker runtime a container for `run`."""
        worker = Worker(gpu_id)
        worker.on_misbehaved = self._misbehaved
        self.live.add(worker)
        self.worker_starts += 1
        worker.hello.add_done_callback(lambda _: self._hello(worker))
        worker.exited.add_done_callback(lambda _: self._exited(worker))
        # Not in _tasks: shutdown must not cancel it, it is what tells that the process exited.
        watcher = asyncio.create_task(self.runtime.run(worker, run))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return worker

    def packages_in_use(self) -> set[str]:
        """The package digests of every worker that has or is taking a model (parked ones too), and
        of those stopped or killed until their process exits: it still maps its weights in the
        host pool (an entry unlinked under it would not free its memory) and reads its package."""
        return {w.run.package_digest for w in self.live if w.run is not None}

    def exiting(self, gpu_id: str) -> set[asyncio.Future[None]]:
        """The exits of the workers stopping on `gpu_id` (see `_exiting`)."""
        return self._exiting.get(gpu_id, set())

    def track(self, task: asyncio.Task[object]) -> None:
        """Keep `task` until it is done (cancelled at shutdown); its failure is logged, but for a
        load's, which reaches its callers through the worker's futures (or they gave up)."""
        self._tasks.add(task)
        task.add_done_callback(self._untrack)

    def kill(self, worker: Worker) -> None:
        """SIGKILL now, without waiting (a miss on its GPU waits for its exit, as for a stop's). Its
        calls are answered once its socket is read to its end: results it wrote before it died (a
        batch-mate of the call it was killed for, finished as the deadline came) still answer theirs."""
        worker.exit_cause = worker.exit_cause or "killed"
        if worker.hello.done():  # (one killed before it started holds no device: a miss need not wait)
            self._exits_before_loads(worker)
        worker.gone(ConnectionLost(f"worker pid {worker.pid} was killed"), calls=False)
        worker.signal(signal.SIGKILL)

    def _exits_before_loads(self, worker: Worker) -> None:
        """A worker on a GPU holds its device memory until it exits: a load there waits for that
        (`exiting`). (A worker killed at a call's deadline was not waited for: the next miss on its
        GPU loaded beside a CUDA context still being torn down, and could run out of memory.)"""
        if not worker.exited.done() and worker.state is not WorkerState.PARKED and worker.gpu_id:
            exiting = self._exiting.setdefault(worker.gpu_id, set())
            exiting.add(worker.exited)
            worker.exited.add_done_callback(exiting.discard)

    def _misbehaved(self, worker: Worker) -> None:
        """`worker` sent more than UNASKED_FRAMES_ALLOWED frames the node did not ask for: its
        handler writes to its socket. Killed now and its socket closed, not stopped with a grace:
        each frame it sends meanwhile is the node's CPU. Its calls are answered as a death's."""
        log.warning(
            "model %r on %s: worker pid %d sent more than %d frames the node did not ask for (its handler "
            "writes to the worker's socket); killed",
            worker.model,
            worker.gpu_id,
            worker.pid,
            UNASKED_FRAMES_ALLOWED,
        )
        worker.exit_cause = worker.exit_cause or "misbehaved"
        self.kill(worker)
        if worker.conn is not None:
            worker.conn.close()  # nothing more of it is read (the rest of this read included)

    async def stop(self, worker: Worker) -> None:
        """SIGTERM, SIGKILL after STOP_GRACE_S; returns once the process is gone."""
        if worker.exited.done():
            return
        worker.exit_cause = worker.exit_cause or ("shutdown" if self._closing() else "stopped")
        self._exits_before_loads(worker)
        worker.gone(ConnectionLost(f"worker pid {worker.pid} was stopped"))
        worker.signal(signal.SIGTERM)
        done, _ = await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
        if not done:
            worker.signal(signal.SIGKILL)
            await asyncio.wait({worker.exited}, timeout=KILL_WAIT_S)

    async def shutdown(self, stop: Callable[[Worker], Awaitable[None]]) -> None:
        """The pool is closing: first what is still starting (a zygote would fork spares nobody
        stops), then the background tasks; every live worker is stopped by `stop`, then what the
        runtime itself holds goes."""
        await self.runtime.stop_starting()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(stop(worker) for worker in list(self.live)), return_exceptions=True)
        await self.runtime.shutdown()

    def _hello(self, worker: Worker) -> None:
        self._on_hello(worker)
        if (
            self._network_isolation
            and worker.hello.exception() is None
            and not worker.hello.result().network_isolated
            and not self._warned_network
        ):
            self._warned_network = True
            log.warning(
                "workers could not get a network namespace of their own (neither root nor user namespaces): "
                "functions can reach the network, etcd and the daemons' ports; run the node as root or use "
                "the docker runtime"
            )

    def _exited(self, worker: Worker) -> None:
        self.live.discard(worker)
        self.worker_exits[worker.exit_cause or ("shutdown" if self._closing() else "died")] += 1
        if worker.run is not None and worker.run.package_digest not in self.packages_in_use():
            digest = worker.run.package_digest
            release = self.runtime.release_package(digest, lambda: digest in self.packages_in_use())
            self.track(asyncio.ensure_future(release))
        self._on_exit(worker)

    def _untrack(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, LoadFailed):
            log.error("background task %s failed", task.get_name(), exc_info=exc)
