"""The node's worker processes: warm spares per GPU, one worker per (model, GPU), calls pipelined.

A miss costs a weight load, not a process start: each GPU keeps `spares_per_gpu` spare workers
that have imported the runtime (torch) and created their device context. A miss takes one, sends
it the model, and a new spare starts in the background. Meanwhile the package is fetched (if this
node lacks it) and its files are read ahead into host memory, in parallel with waiting for a
spare (EDAS's parallel loading).

Calls for a ready worker are written to it at once, in order (its socket is the queue), so it
never idles between calls; a function that batches has the waiting calls merged by the worker.

Two tiers (DESIGN: GPU memory, and host memory from which a model comes back onto any GPU of its
node): with `host_cache_mb` > 0 an evicted worker is not stopped but parked, its model kept in host
memory (least recently parked first out, within `host_cache_mb` of declared model memory); a miss
for that model (same package) takes it back instead of loading. On the cpu backend a worker is not
bound to a device, so taking it back is free; the cuda backend's host tier (weights kept in host
memory and copied back onto any GPU, Torpor's late binding) is not built, so it stops its victims.

`run` answers every call with a RunResult whose `outcome` (a gpufaas.proto Outcome) says what
happened; it raises only when cancelled:

    OK                 the output (and its content type)
    HANDLER_ERROR      predict raised: the worker stays
    LOAD_FAILED        load raised, or the package could not be had: no worker is left
    TIMEOUT            no result by the deadline; a worker stuck in this call was killed
    WORKER_DIED        the worker exited under the call (or before it was ready): transient
    INVALID_INPUT, OUTPUT_INVALID, OUTPUT_TOO_LARGE   the call's own, the worker stays
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_manager.backends import backend_class
from gpu_manager.containers import (
    LAYER_MOUNT,
    PACKAGE_MOUNT,
    POOL_MOUNT,
    SOCKET_NAME,
    DockerLauncher,
    container_environment,
    container_spec,
)
from gpu_manager.sandbox import (
    LOG_LINE_BYTES,
    Isolation,
    LogBudget,
    data_allowance_mb,
    lock_package,
    package_uid,
    private_home,
    worker_environment,
)
from gpufaas.local_cluster import pid_alive
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, max_frame_bytes_for

log = logging.getLogger("gpufaas.gpu_manager.pool")
worker_log = logging.getLogger("gpufaas.worker")  # what workers print

STOP_GRACE_S = 2.0
"""How long a stopped worker has to exit after SIGTERM before it gets SIGKILL."""
_DROP_REPORT_S = 10.0  # how often a worker's dropped output is told of, at most
_OUTPUT_GRACE_S = 1.0  # a worker's output is read this long after it exits (then its pipe is closed)
_KILL_WAIT_S = 30.0  # tearing down a large CUDA context can take seconds; past this, log and move on
_EXIT_POLL_S = 0.005
_JUST_FETCHED_S = 0.05  # a package that took longer than this to get is in the page cache already
RUNTIMES = ("process", "docker")  # how workers run: forked from the zygote, or in containers
SPARE_START_TIMEOUT_S = 120.0  # importing torch and creating a CUDA context, on a busy machine
SPARE_RETRY_S = 5.0  # after a spare died warming up (a broken runtime), before starting another
EXIT_CAUSES = ("stopped", "load_failed", "killed", "died", "start_failed", "shutdown")
"""Why a worker process exited (`WorkerPool.worker_exits`): the pool stopped it (evicted, released,
replaced after a redeploy, pushed out of the host tier), its load failed, it was killed (a call's
timeout), it exited by itself, it could not be started, or the node shut down."""


@dataclass(frozen=True, slots=True)
class ModelRun:
    """What a call needs of its model's worker (from the scheduler's signed grant)."""

    model: str
    package_digest: str
    memory_mb: int
    max_batch_size: int = 1
    max_batch_wait_s: float = 0.0
    environment: dict[str, str] = field(default_factory=dict)
    load_time_s: float = 0.0  # emulated backend's profile; 0 = from Table I or size
    inference_time_s: float = 0.0


@dataclass(slots=True)
class RunResult:
    """One call's answer. `loaded`: this call loaded the model (a miss); `stages` then says
    where the miss's time went."""

    outcome: int
    message: str = ""
    output: bytes = b""
    content_type: str = ""
    loaded: bool = False
    load_time_s: float = 0.0
    inference_time_s: float = 0.0
    batch_calls: int = 0
    peak_memory_mb: int = 0
    stages: pb.MissStages | None = None
    worker_killed: bool = False  # the call's worker was killed (a timeout in the handler)


@dataclass(frozen=True, slots=True)
class WeightsPlan:
    """How a worker taking a model gets what lies beside its package (from the node's
    `prepare_weights`): `pooled` maps package paths to their copies in the host model pool,
    `layer_dir` is its installed requirements layer (empty: none). `pool_s`: copying into the
    pool on this call's path; `from_pool`: the weights were in the pool already."""

    pooled: dict[str, str] = field(default_factory=dict)
    layer_dir: str = ""
    pool_s: float = 0.0
    from_pool: bool = False


NO_WEIGHTS = WeightsPlan()


class _State(enum.Enum):
    STARTING = "starting"  # process started, not yet warm
    SPARE = "spare"  # warm (runtime imported, context created), waiting for a model
    LOADING = "loading"  # taking a model
    READY = "ready"  # serving calls
    PARKED = "parked"  # evicted from its GPU, its model kept in host memory (host tier)
    GONE = "gone"  # exited, killed or being stopped


class _Worker:
    """One worker process (forked by the zygote) and the node's end of its socket.

    Lifecycle: STARTING -> SPARE -> LOADING -> READY <-> PARKED, and GONE (any state may jump to
    GONE; a spare claimed while starting goes straight to LOADING; a parked worker taken back
    serves on whichever GPU took it). GONE when its socket closes (it exited, or
    the pool let go of it); `exited` resolves once its process is gone too (its device memory is
    then free). `pid` is known from its hello on.
    """

    def __init__(self, gpu_id: str) -> None:
        self.gpu_id = gpu_id
        self.pid = 0
        self.container = ""  # the docker runtime's container id (its pid is the container's own)
        self.on_signal: Callable[[int], None] | None = None  # how to signal it, where not by pid
        self.state = _State.STARTING
        self.exit_cause = ""  # set by whoever ends it (one of EXIT_CAUSES); empty: it exited by itself
        self.conn: Connection | None = None
        self.run: ModelRun | None = None
        self.weights: WeightsPlan | None = None  # the docker runtime's, fixed when its container is made
        self.memory_mb = 0
        loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[pb.WorkerHello] = loop.create_future()
        self.loaded: asyncio.Future[pb.ModelLoaded] = loop.create_future()
        self.ready: asyncio.Future[None] = loop.create_future()  # set when READY (or failed)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.last_seq = 0  # the latest grant (per-GPU order) that used this worker
        self.spawned_s = time.perf_counter()
        self.warm_s = 0.0  # when its hello came
        # Calls written to the worker and not yet answered, oldest first (the worker runs them in
        # this order, so the oldest is the one running).
        self.pending: dict[str, asyncio.Future[Frame]] = {}

    @property
    def model(self) -> str:
        return self.run.model if self.run is not None else ""

    # wire.Handler
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.CALL_RESULT:
            result = frame.message(pb.CallResult)
            future = self.pending.pop(result.call_id, None)
            if future is not None and not future.done():
                future.set_result(frame)
        elif frame.type == MessageType.WORKER_HELLO:
            hello = frame.message(pb.WorkerHello)
            self.pid = hello.pid
            self.warm_s = time.perf_counter()
            if not self.hello.done():
                self.hello.set_result(hello)
        elif frame.type == MessageType.MODEL_LOADED and not self.loaded.done():
            self.loaded.set_result(frame.message(pb.ModelLoaded))

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self._gone(ConnectionLost(f"worker pid {self.pid} closed its socket"))

    def _gone(self, exc: BaseException) -> None:
        self.state = _State.GONE
        for future in (self.hello, self.loaded, self.ready):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: nobody may be waiting
        for call in self.pending.values():
            if not call.done():
                call.set_exception(exc)
        self.pending.clear()

    def signal(self, signum: int) -> None:
        """Send the process a signal; before its hello (no pid yet) closing its socket is what
        makes it exit."""
        if self.on_signal is not None:
            self.on_signal(signum)
        elif self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)
        elif self.conn is not None:
            self.conn.close()


class _Zygote:
    """The zygote process (gpu_manager.zygote) and the pool's end of its control socket."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket, import_s: float) -> None:
        self.process = process
        self.control = control
        self.import_s = import_s

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def fork(self, gpu_id: str, device_index: int, sock: socket.socket, output_fd: int) -> None:
        """Ask for a worker for `gpu_id` on `sock`, writing its output to `output_fd` (raises
        OSError if the zygote is gone)."""
        socket.send_fds(self.control, [f"{gpu_id} {device_index}".encode()], [sock.fileno(), output_fd])


class _OutputRelay(asyncio.Protocol):
    """A worker's stdout and stderr (the read end of its pipe), logged line by line under
    `gpufaas.worker` within its LogBudget: a function that prints without end costs the node a
    bounded rate, and says how much it lost."""

    def __init__(self, worker: _Worker, budget: LogBudget) -> None:
        self.worker = worker
        self.budget = budget
        self._buffer = bytearray()
        self._reported = 0  # bytes dropped already told of
        self._reported_at = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        allowed = self.budget.take(len(data), now)
        self._buffer += data[:allowed]
        while (end := self._buffer.find(b"\n")) >= 0:
            self._emit(bytes(self._buffer[:end]))
            del self._buffer[: end + 1]
        if len(self._buffer) > LOG_LINE_BYTES:
            self._emit(bytes(self._buffer[:LOG_LINE_BYTES]) + b" [line cut]")
            self._buffer.clear()
        if self.budget.dropped > self._reported and now - self._reported_at >= _DROP_REPORT_S:
            self._report_dropped(now)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buffer:
            self._emit(bytes(self._buffer))
            self._buffer.clear()
        if self.budget.dropped > self._reported:
            self._report_dropped(time.monotonic())

    def _emit(self, line: bytes) -> None:
        worker_log.info("%s (pid %d): %s", self.worker.model or "spare", self.worker.pid, line.decode(errors="replace"))

    def _report_dropped(self, now: float) -> None:
        worker_log.warning(
            "%s (pid %d) wrote more than %d bytes/s: %d bytes of its output dropped so far",
            self.worker.model or "spare",
            self.worker.pid,
            self.budget.rate_bytes_s,
            self.budget.dropped,
        )
        self._reported, self._reported_at = self.budget.dropped, now


class WorkerPool:
    """The worker processes of one node.

    State, all touched only from the event loop:
    - `_workers`: (model, gpu_id) -> its worker, LOADING or READY. An entry goes when the worker
      is evicted, found dead, killed by a timeout, or replaced after a redeploy.
    - `_spares`: gpu_id -> warm spares, oldest first; `_starting`: gpu_id -> spares on their way.
    - `_parked`: model -> a PARKED worker (the host tier), least recently parked first.
    - `_live`: every process this pool started and has not yet seen exit; shutdown kills them all.
    """

    def __init__(
        self,
        backend: str,
        *,
        gpus: dict[str, int],
        fetch_package: Callable[[str], Awaitable[tuple[Path, float]]],
        spares_per_gpu: int = 1,
        max_body_bytes: int = 16 * 1024 * 1024,
        wait_for_victims: bool | None = None,
        host_cache_mb: int = 0,
        python: str = sys.executable,
        isolation: Isolation | None = None,
        runtime: str = "process",
        launcher: DockerLauncher | None = None,
        node: str = "node",
        prepare_weights: Callable[[str, Path], Awaitable[WeightsPlan]] | None = None,
    ) -> None:
        """`gpus`: node-local GPU id -> device index. `fetch_package(digest)` returns the package's
        directory, fetching it if needed, and the seconds that took (0: it was on disk);
        `prepare_weights(digest, directory)` what the worker maps from the host model pool and its
        requirements layer (None: neither). `wait_for_victims`: a miss waits for its victims to
        exit before loading (their device memory must be free first); default: on cuda only.
        `host_cache_mb`: the host tier's size (0: off; the cpu backend only). `isolation`: how
        workers are confined (gpu_manager.sandbox; default: all of it the node can do).
        `runtime`: "process" (forked from the zygote) or "docker" (a container per worker, made by
        `launcher` for a model: no spares; gpu_manager.containers)."""
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown worker runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
        if runtime == "docker" and spares_per_gpu:
            raise ValueError("the docker runtime keeps no spares (a container is made for a model): use 0 spares")
        backend_class(backend)  # an unknown name fails here, at startup, listing the valid ones
        if spares_per_gpu < 0:
            raise ValueError(f"spares_per_gpu must be >= 0, got {spares_per_gpu}")
        if host_cache_mb < 0 or (host_cache_mb and backend != "cpu"):
            raise ValueError(f"host_cache_mb must be >= 0, and 0 on the {backend} backend (a cpu-backend tier)")
        self.backend = backend
        self.gpus = dict(gpus)
        self.spares_per_gpu = spares_per_gpu
        self.max_body_bytes = max_body_bytes
        self.wait_for_victims = backend == "cuda" if wait_for_victims is None else wait_for_victims
        self.host_cache_mb = host_cache_mb
        self._fetch_package = fetch_package
        self._prepare_weights = prepare_weights
        self._python = python
        self.isolation = isolation if isolation is not None else Isolation()
        self.runtime = runtime
        self.node = node
        self.launcher = (launcher or DockerLauncher()) if runtime == "docker" else None
        self._sockets: Path | None = None  # the docker runtime's socket directories (_socket_root)
        self._locked: set[str] = set()  # package digests made readable to their own user only
        self._warned_network = False
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._spares: dict[str, deque[_Worker]] = {gpu: deque() for gpu in self.gpus}
        self._starting: dict[str, list[_Worker]] = {gpu: [] for gpu in self.gpus}
        self._parked: OrderedDict[str, _Worker] = OrderedDict()  # model -> worker, oldest parked first
        # GPU -> the exits of workers stopping there (evicted, released): a miss on that GPU waits
        # for them as for its own victims, since their device memory is not free until then.
        self._exiting: dict[str, set[asyncio.Future[None]]] = {}
        self._live: set[_Worker] = set()
        self._tasks: set[asyncio.Task[object]] = set()  # loads and stops in the background
        self._watchers: set[asyncio.Task[None]] = set()  # one per worker: starts it, waits for its exit
        self._zygote: _Zygote | None = None
        self._zygote_starting: asyncio.Future[_Zygote] | None = None
        self._closed = False
        # Worker processes started and exited (by cause) since the pool was made: counted for the
        # node's metrics, which read them when scraped. Started - exited = len(_live).
        self.worker_starts = 0
        self.worker_exits: collections.Counter[str] = collections.Counter()

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start every GPU's spares (in the background)."""
        for gpu_id in self.gpus:
            self._replenish(gpu_id)

    async def check_runtime(self) -> None:
        """The docker runtime: the engine answers and has the image (DockerUnavailable if not),
        and the containers a previous run of this node left are removed."""
        if self.launcher is not None:
            await self.launcher.check()
            removed = await self.launcher.remove_node_containers(self.node)
            if removed:
                log.info("removed %d worker container(s) a previous run of node %s left", removed, self.node)

    async def spares_ready(self, timeout_s: float = SPARE_START_TIMEOUT_S) -> list[pb.WorkerHello]:
        """Wait until every GPU's first spares are warm; their hellos (what they cost and hold)."""
        waiting = [w.hello for workers in self._starting.values() for w in workers]
        waiting += [w.hello for spares in self._spares.values() for w in spares]
        if not waiting:
            return []
        done, _ = await asyncio.wait(waiting, timeout=timeout_s)
        return [future.result() for future in done if future.exception() is None]

    async def shutdown(self) -> None:
        """Stop every worker this pool started, ready or not, and the zygote; later calls are refused."""
        self._closed = True
        # First the zygote still starting (it would fork spares nobody stops), then the loads.
        if self._zygote_starting is not None and not self._zygote_starting.done():
            self._zygote_starting.cancel()
            with contextlib.suppress(BaseException):
                await self._zygote_starting
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._stop(worker) for worker in list(self._live)), return_exceptions=True)
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
        zygote = self._zygote
        if zygote is not None:
            zygote.control.close()  # it exits when its control socket closes
            try:
                await asyncio.wait_for(zygote.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    zygote.process.kill()
                await zygote.process.wait()

    def workers(self) -> list[tuple[str, str, int, int]]:
        """(model, gpu_id, pid, memory_mb) of every worker that is READY."""
        return [
            (model, gpu, w.pid, w.memory_mb) for (model, gpu), w in self._workers.items() if w.state is _State.READY
        ]

    def live_workers(self) -> int:
        """Worker processes started and not yet seen exit (spares, loading, ready, parked)."""
        return len(self._live)

    def packages_in_use(self) -> set[str]:
        """The package digests of every worker that has or is taking a model (parked ones too)."""
        return {w.run.package_digest for w in self._live if w.run is not None and w.state is not _State.GONE}

    def forget_grant_order(self) -> None:
        """A new scheduler attached: its grants are numbered afresh (see `run`'s `seq`)."""
        for worker in self._workers.values():
            worker.last_seq = 0

    def spare_count(self, gpu_id: str) -> int:
        return len(self._spares.get(gpu_id, ()))

    # --- one call ---------------------------------------------------------------------------
    async def run(
        self,
        run: ModelRun,
        gpu_id: str,
        call_id: str,
        payload: bytes,
        *,
        content_type: str,
        timeout_s: float,
        evict: tuple[str, ...] = (),
        seq: int = 0,
    ) -> RunResult:
        """Run one call of `run.model` on `gpu_id`, loading the model first if it has no worker
        there (after stopping `evict`). `timeout_s` bounds the whole call. `seq` orders the
        scheduler's grants per GPU: a victim used by a later grant than this one is kept (grants
        can arrive out of order, through different gateways)."""
        if self._closed:
            return RunResult(pb.WORKER_DIED, "the node is shutting down")
        if gpu_id not in self.gpus:
            return RunResult(pb.REFUSED, f"this node has no GPU {gpu_id!r}")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            worker = self._workers.get((run.model, gpu_id))
            if worker is None or worker.run is None or worker.run.package_digest == run.package_digest:
                break
            # The function was redeployed (a new package): its worker runs stale code. Look again
            # after stopping it: a concurrent call may have started the new one meanwhile.
            await self._stop(worker)
        stages: pb.MissStages | None = None  # set on a miss
        if worker is None or worker.state is _State.GONE:
            if worker is not None:
                self._forget(worker)
            victims = [*self._evict_for_miss(gpu_id, evict, seq), *self._exiting.get(gpu_id, ())]
            taken = self._take_back(run, gpu_id) or await self._load_here(run, gpu_id, victims, deadline, timeout_s)
            if isinstance(taken, RunResult):
                return taken  # the load failed or timed out
            worker, stages = taken
        else:
            self._evict_for_miss(gpu_id, evict, seq)  # a grant that expected a miss can still name victims
            if worker.state is _State.LOADING:
                try:
                    async with asyncio.timeout_at(deadline):
                        await asyncio.shield(worker.ready)
                except TimeoutError:
                    return RunResult(pb.TIMEOUT, f"model {run.model!r} on {gpu_id}: still loading at the deadline")
                except Exception as exc:  # its load failed: this call shares the outcome
                    outcome = exc.outcome if isinstance(exc, _LoadFailed) else pb.WORKER_DIED
                    return RunResult(outcome, str(exc))
        worker.last_seq = max(worker.last_seq, seq)
        result = await self._call(
            worker, call_id, payload, content_type=content_type, deadline=deadline, timeout_s=timeout_s
        )
        if stages is not None:
            result.loaded = True
            result.stages = stages
            result.load_time_s = (
                stages.fetch_s + stages.pool_s + stages.start_s + stages.context_s + stages.load_s + stages.host_s
            )
        return result

    async def _load_here(
        self, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]], deadline: float, timeout_s: float
    ) -> tuple[_Worker, pb.MissStages] | RunResult:
        """Load `run` on `gpu_id` through a spare: the worker and the miss's stages, or the
        call's answer when the load failed or timed out."""
        worker = self._begin_load(run, gpu_id)
        load_task = asyncio.create_task(self._load(worker, run, gpu_id, victims))
        self._track(load_task)
        try:
            async with asyncio.timeout_at(deadline):
                return worker, await asyncio.shield(load_task)
        except TimeoutError:
            self._kill(worker)
            return RunResult(
                pb.TIMEOUT,
                f"model {run.model!r} on {gpu_id}: not loaded within the {timeout_s:g} s timeout; worker killed",
                loaded=True,
                worker_killed=True,
            )
        except _LoadFailed as exc:
            return RunResult(exc.outcome, exc.message, loaded=True)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this call was cancelled
            return RunResult(pb.WORKER_DIED, "the node shut down while the model loaded", loaded=True)

    async def evict(self, model: str, gpu_id: str) -> bool:
        """Stop `model`'s worker on `gpu_id` (and its copy in the host tier, if any) and wait for
        them to exit (their memory is then free); False if there was none. Calls still on it fail
        with WORKER_DIED."""
        victims = [w for w in (self._workers.get((model, gpu_id)), self._parked.pop(model, None)) if w is not None]
        await asyncio.gather(*(self._stop(worker) for worker in victims))
        return bool(victims)

    async def release(self, model: str, gpu_id: str, *, to_host: bool, seq: int = 0) -> bool:
        """EDAS's staged exit, first stage: the idle `model` leaves `gpu_id`, into the host tier
        when `to_host` and the node has one (its process and host copy stay), else its worker
        stops. A worker with calls in flight, still loading, or used by a grant later than `seq`
        stays: the scheduler's view has moved on. True if it left."""
        worker = self._workers.get((model, gpu_id))
        if worker is None or worker.pending or worker.state is not _State.READY or worker.last_seq > seq:
            return False
        if to_host and self.host_cache_mb:
            self._park(worker)
            return True
        await self._stop(worker)
        return True

    async def release_from_host(self, model: str) -> bool:
        """The second stage: `model`'s copy in the host tier goes (its process stops)."""
        worker = self._parked.pop(model, None)
        if worker is None:
            return False
        await self._stop(worker)
        return True

    def parked(self) -> list[tuple[str, int]]:
        """(model, memory_mb) of the host tier's workers, least recently parked first."""
        return [(model, w.memory_mb) for model, w in self._parked.items() if w.state is _State.PARKED]

    # --- misses -----------------------------------------------------------------------------
    def _evict_for_miss(self, gpu_id: str, evict: tuple[str, ...], seq: int) -> list[asyncio.Future[None]]:
        """Stop the victims, except one that a later grant uses or that has calls in flight
        (then the scheduler's view has moved on: it re-admitted the model); returns their exits,
        to wait on."""
        exits: list[asyncio.Future[None]] = []
        for model in evict:
            victim = self._workers.get((model, gpu_id))
            if victim is None or victim.pending or victim.state is _State.LOADING or victim.last_seq > seq:
                continue
            if self.host_cache_mb and victim.state is _State.READY:
                self._park(victim)
                continue
            self._forget(victim)
            self._track(asyncio.create_task(self._stop(victim)))
            exits.append(victim.exited)
        return exits

    def _park(self, worker: _Worker) -> None:
        """Move a ready worker from its GPU to the host tier (oldest parked out past the budget)."""
        self._forget(worker)
        worker.state = _State.PARKED
        older = self._parked.pop(worker.model, None)  # another replica of the model, parked before
        self._parked[worker.model] = worker
        if older is not None:
            self._track(asyncio.create_task(self._stop(older)))
        while sum(w.memory_mb for w in self._parked.values()) > self.host_cache_mb:
            _, oldest = self._parked.popitem(last=False)
            self._track(asyncio.create_task(self._stop(oldest)))

    def _take_back(self, run: ModelRun, gpu_id: str) -> tuple[_Worker, pb.MissStages] | None:
        """The model's parked worker (same package), now serving on `gpu_id`, or None."""
        started = time.perf_counter()
        worker = self._parked.get(run.model)
        if worker is None or worker.state is not _State.PARKED:
            return None
        del self._parked[run.model]
        if worker.run is None or worker.run.package_digest != run.package_digest:
            self._track(asyncio.create_task(self._stop(worker)))  # a redeploy: its code is stale
            return None
        worker.gpu_id = gpu_id
        worker.state = _State.READY
        self._workers[(run.model, gpu_id)] = worker
        return worker, pb.MissStages(from_host=True, host_s=time.perf_counter() - started)

    def _begin_load(self, run: ModelRun, gpu_id: str) -> _Worker:
        """Claim a worker for `run` on `gpu_id` now (a spare if one is warm, else one that is
        starting, else a new process), so that concurrent calls of the model share its load."""
        spares = self._spares[gpu_id]
        if spares:
            worker = spares.popleft()
        elif self._starting[gpu_id]:
            worker = self._starting[gpu_id].pop(0)
        else:
            worker = self._spawn(gpu_id, run)
        worker.state = _State.LOADING
        worker.run = run
        worker.memory_mb = run.memory_mb
        self._workers[(run.model, gpu_id)] = worker
        self._replenish(gpu_id)
        return worker

    async def _load(
        self, worker: _Worker, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]]
    ) -> pb.MissStages:
        started = time.perf_counter()
        stages = pb.MissStages()
        was_warm = worker.hello.done()

        async def package() -> tuple[Path, WeightsPlan]:
            directory, stages.fetch_s = await self._fetch_package(run.package_digest)
            await self._own_package(run.package_digest, directory)  # readable by its own user only
            weights = worker.weights or await self._weights(run, directory)
            stages.pool_s, stages.from_pool = weights.pool_s, weights.from_pool
            if weights.pooled:
                return directory, weights  # the worker maps them from memory: nothing to read ahead
            if not was_warm and stages.fetch_s < _JUST_FETCHED_S:
                # The worker is still warming up: read the weights into host memory meanwhile (a
                # package fetched just now is in the page cache already, and with a warm spare
                # there is nothing to overlap with).
                prefetch_started = time.perf_counter()
                await asyncio.to_thread(_read_ahead, directory)
                stages.prefetch_s = time.perf_counter() - prefetch_started
            return directory, weights

        async def warm() -> pb.WorkerHello:
            hello = await worker.hello
            if not was_warm:
                stages.start_s = time.perf_counter() - started
            return hello

        package_task = asyncio.ensure_future(package())
        try:
            hello, (directory, weights) = await asyncio.gather(warm(), package_task)
        except Exception as exc:
            package_task.cancel()
            worker.exit_cause = worker.exit_cause or ("died" if isinstance(exc, ConnectionLost) else "load_failed")
            self._kill(worker)
            if isinstance(exc, ConnectionLost):
                message = f"worker for {run.model!r} on {gpu_id} exited while starting"
                raise _LoadFailed(pb.WORKER_DIED, message) from None
            raise _LoadFailed(pb.LOAD_FAILED, f"function package unavailable: {exc}") from None
        # What readying the worker cost (forked from the zygote, then its device context).
        stages.spare_context_s = hello.context_s
        stages.spare_start_s = max(0.0, worker.warm_s - worker.spawned_s - hello.context_s)
        if not was_warm:  # the context was created while this call waited
            stages.start_s = max(0.0, stages.start_s - hello.context_s)
            stages.context_s = hello.context_s
        if victims and self.wait_for_victims:
            await asyncio.wait(victims, timeout=_KILL_WAIT_S)  # their device memory must be free first
        load_started = time.perf_counter()
        assert worker.conn is not None
        try:
            worker.conn.send(
                MessageType.LOAD_MODEL,
                pb.LoadModel(
                    model=run.model,
                    package_dir=PACKAGE_MOUNT if self.runtime == "docker" else str(directory),
                    pooled=weights.pooled,
                    layer_dir=weights.layer_dir,
                    memory_mb=run.memory_mb,
                    max_batch_size=run.max_batch_size,
                    max_batch_wait_s=run.max_batch_wait_s,
                    environment=run.environment,
                    load_time_s=run.load_time_s,
                    inference_time_s=run.inference_time_s,
                    max_result_bytes=self.max_body_bytes,
                    **await self._confinement(run),
                ),
            )
            loaded = await worker.loaded
        except ConnectionLost:
            self._forget(worker)
            raise _LoadFailed(
                pb.WORKER_DIED, f"worker of model {run.model!r} on {gpu_id} (pid {worker.pid}) exited while loading"
            ) from None
        stages.load_s = time.perf_counter() - load_started
        if not loaded.ok:
            self._forget(worker)
            worker.exit_cause = "load_failed"
            self._track(asyncio.create_task(self._stop(worker)))
            failure = _LoadFailed(pb.LOAD_FAILED, f"model {run.model!r} on {gpu_id}: load failed: {loaded.error}")
            if not worker.ready.done():
                worker.ready.set_exception(failure)
                worker.ready.exception()
            raise failure
        worker.memory_mb = int(loaded.peak_memory_mb) or run.memory_mb
        worker.state = _State.READY
        if not worker.ready.done():
            worker.ready.set_result(None)
        return stages

    async def _weights(self, run: ModelRun, directory: Path) -> WeightsPlan:
        if self._prepare_weights is None:
            return NO_WEIGHTS
        return await self._prepare_weights(run.package_digest, directory)

    # --- calls ------------------------------------------------------------------------------
    async def _call(
        self, worker: _Worker, call_id: str, payload: bytes, *, content_type: str, deadline: float, timeout_s: float
    ) -> RunResult:
        model, gpu_id = worker.model, worker.gpu_id
        if worker.state is not _State.READY or worker.conn is None:
            return self._died(worker, call_id)
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        worker.pending[call_id] = future
        try:
            worker.conn.send(MessageType.CALL, pb.Call(call_id=call_id, content_type=content_type), payload)
            if len(payload) > 65536:
                await worker.conn.drain()
            async with asyncio.timeout_at(deadline):
                frame = await future
        except TimeoutError:
            running = next(iter(worker.pending), None) == call_id
            worker.pending.pop(call_id, None)
            if running:  # it may be stuck in the handler; killing is the only sure way out
                self._kill(worker)
                return RunResult(
                    pb.TIMEOUT,
                    f"model {model!r} on {gpu_id}: no result within the {timeout_s:g} s timeout; worker killed",
                    worker_killed=True,
                )
            return RunResult(pb.TIMEOUT, f"model {model!r} on {gpu_id}: still queued at the worker at the deadline")
        except ConnectionLost:
            return self._died(worker, call_id)
        finally:
            worker.pending.pop(call_id, None)
        reply = frame.message(pb.CallResult)
        return RunResult(
            outcome=reply.outcome,
            message=reply.message,
            output=frame.body,
            content_type=reply.content_type,
            inference_time_s=reply.inference_s,
            batch_calls=reply.batch_calls or 1,
            peak_memory_mb=int(reply.peak_memory_mb),
        )

    def _died(self, worker: _Worker, call_id: str) -> RunResult:
        self._forget(worker)
        return RunResult(
            pb.WORKER_DIED,
            f"worker of model {worker.model!r} on {worker.gpu_id} (pid {worker.pid}) exited during call {call_id}",
        )

    # --- processes --------------------------------------------------------------------------
    def _replenish(self, gpu_id: str) -> None:
        if self._closed:
            return
        while len(self._spares[gpu_id]) + len(self._starting[gpu_id]) < self.spares_per_gpu:
            self._starting[gpu_id].append(self._spawn(gpu_id))

    def _spawn(self, gpu_id: str, run: ModelRun | None = None) -> _Worker:
        """Fork a worker for `gpu_id` from the zygote, or on the docker runtime start a container
        for `run` (in the background); a forked one becomes a spare when it says hello, unless a
        miss claims it first."""
        worker = _Worker(gpu_id)
        self._live.add(worker)
        self.worker_starts += 1
        worker.hello.add_done_callback(lambda _: self._on_hello(worker))
        worker.exited.add_done_callback(lambda _: self._on_exit(worker))
        # Not in _tasks: shutdown must not cancel it, it is what tells that the process exited.
        if self.runtime == "docker":
            assert run is not None, "the docker runtime starts a worker for a model"
            watcher = asyncio.create_task(self._run_container(worker, run))
        else:
            watcher = asyncio.create_task(self._run_worker(worker))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return worker

    async def _run_worker(self, worker: _Worker) -> None:
        """Have the worker forked, connect to it, and resolve `exited` once it is gone."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        output_read, output_write = os.pipe()
        output: asyncio.BaseTransport | None = None
        loop = asyncio.get_running_loop()
        try:
            zygote = await self._zygote_ready()
            zygote.fork(worker.gpu_id, self.gpus[worker.gpu_id], child, output_write)
            budget = LogBudget(self.isolation.log_rate_bytes_s, self.isolation.log_burst_bytes, time.monotonic())
            output, _ = await loop.connect_read_pipe(
                lambda: _OutputRelay(worker, budget), os.fdopen(output_read, "rb", buffering=0)
            )
            output_read = -1  # the transport owns it now
            max_frame_bytes = max_frame_bytes_for(self.max_body_bytes)
            _, conn = await loop.create_unix_connection(
                lambda: Connection(worker, max_frame_bytes=max_frame_bytes), sock=parent
            )
        except (OSError, RuntimeError, asyncio.CancelledError) as exc:  # cancelled: shut down meanwhile
            parent.close()
            if output is not None:
                output.close()
            elif output_read >= 0:
                os.close(output_read)
            if not self._closed:
                log.error("cannot start a worker for %s: %s", worker.gpu_id, exc)
            worker.exit_cause = worker.exit_cause or ("shutdown" if self._closed else "start_failed")
            worker._gone(ConnectionLost(f"cannot start a worker: {exc or 'the pool shut down'}"))
            worker.exited.set_result(None)
            return
        finally:
            child.close()  # the worker holds the only other end now: its exit reads as EOF here
            os.close(output_write)  # likewise
        worker.conn = conn
        await asyncio.shield(conn.closed)
        worker._gone(ConnectionLost(f"worker pid {worker.pid} exited"))
        assert output is not None
        loop.call_later(_OUTPUT_GRACE_S, output.close)  # what it printed last still reaches the log
        # The zygote reaps it; its device memory is free once the process is gone.
        for _ in range(int(_KILL_WAIT_S / _EXIT_POLL_S)):
            if not worker.pid or not pid_alive(worker.pid):
                break
            await asyncio.sleep(_EXIT_POLL_S)
        else:
            log.warning("worker pid %d (%s on %s) is still running", worker.pid, worker.model, worker.gpu_id)
        worker.exited.set_result(None)

    async def _run_container(self, worker: _Worker, run: ModelRun) -> None:
        """The docker runtime's `_run_worker`: a container for `run` on `worker.gpu_id` (its
        package mounted read-only, a Unix socket of its own to talk on), connected to, and
        `exited` resolved once it is gone and removed."""
        assert self.launcher is not None
        launcher = self.launcher
        worker_id = uuid.uuid4().hex[:12]
        socket_dir = self._socket_root() / worker_id
        listener: socket.socket | None = None
        loop = asyncio.get_running_loop()
        try:
            directory, _ = await self._fetch_package(run.package_digest)
            uid = await self._own_package(run.package_digest, directory)
            weights = await self._weights(run, directory)
            # The container sees its pool files and layer at paths of its own (read-only mounts).
            mounts = [(host, f"{POOL_MOUNT}/{Path(host).name}") for host in weights.pooled.values()]
            if weights.layer_dir:
                mounts.append((weights.layer_dir, LAYER_MOUNT))
            worker.weights = WeightsPlan(
                {path: f"{POOL_MOUNT}/{Path(host).name}" for path, host in weights.pooled.items()},
                LAYER_MOUNT if weights.layer_dir else "",
                weights.pool_s,
                weights.from_pool,
            )
            socket_dir.mkdir(parents=True, mode=0o700)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(socket_dir / SOCKET_NAME))
            listener.listen(1)
            listener.setblocking(False)
            if os.geteuid() == 0:
                os.chown(socket_dir, uid, uid)
                os.chown(socket_dir / SOCKET_NAME, uid, uid)
            spec = container_spec(
                image=launcher.image,
                node=self.node,
                worker_id=worker_id,
                backend=self.backend,
                gpu_id=worker.gpu_id,
                gpu_index=self.gpus[worker.gpu_id],
                memory_mb=run.memory_mb,
                uid=uid,
                package_dir=directory,
                socket_dir=socket_dir,
                max_processes=self.isolation.max_processes,
                environment=container_environment(os.environ),
                read_only_mounts=mounts,
            )
            worker.container = await launcher.start(spec)
            worker.on_signal = lambda signum: self._track(
                asyncio.ensure_future(launcher.kill(worker.container, signum))
            )
            accepting = asyncio.ensure_future(loop.sock_accept(listener))
            exiting = asyncio.ensure_future(launcher.exited(worker.container))
            try:
                done, _ = await asyncio.wait(
                    {accepting, exiting}, timeout=SPARE_START_TIMEOUT_S, return_when="FIRST_COMPLETED"
                )
            finally:
                exiting.cancel()
                if not accepting.done():
                    accepting.cancel()
            if accepting not in done:
                why = exiting.result() if exiting in done and exiting.exception() is None else "no answer"
                raise RuntimeError(f"the worker container did not connect ({why})")
            accepted, _ = accepting.result()
            max_frame_bytes = max_frame_bytes_for(self.max_body_bytes)
            _, conn = await loop.create_unix_connection(
                lambda: Connection(worker, max_frame_bytes=max_frame_bytes), sock=accepted
            )
        except (OSError, RuntimeError, TimeoutError, asyncio.CancelledError) as exc:
            if not self._closed:
                log.error("cannot start a container for %s on %s: %s", run.model, worker.gpu_id, exc)
            worker.exit_cause = worker.exit_cause or ("shutdown" if self._closed else "start_failed")
            worker._gone(ConnectionLost(f"cannot start a worker container: {exc or 'the pool shut down'}"))
            await self._remove_container(worker, socket_dir)
            return
        finally:
            if listener is not None:
                listener.close()  # one worker per socket: nobody else may connect
        worker.conn = conn
        await asyncio.shield(conn.closed)
        worker._gone(ConnectionLost(f"worker container {worker.container[:12]} exited"))
        await self._remove_container(worker, socket_dir)

    async def _remove_container(self, worker: _Worker, socket_dir: Path) -> None:
        assert self.launcher is not None
        if worker.container:
            status = await self.launcher.wait_and_remove(worker.container, _KILL_WAIT_S)
            if status not in (None, 0, -signal.SIGKILL, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
                log.info("worker container %s (%s) exited with status %s", worker.container[:12], worker.model, status)
        shutil.rmtree(socket_dir, ignore_errors=True)
        if not worker.exited.done():
            worker.exited.set_result(None)

    async def _own_package(self, digest: str, directory: Path) -> int:
        """The user a package's workers run as, its package made readable to that user only
        (gpu_manager.sandbox); without root, the node's own user."""
        if not self.isolation.per_package_users:
            return os.getuid()
        uid = package_uid(digest)
        if digest not in self._locked:
            await asyncio.to_thread(lock_package, directory, uid)
            self._locked.add(digest)
        return uid

    def _socket_root(self) -> Path:
        """Where the containers' sockets go: a short path of this pool's own (a Unix socket's path
        may not pass 107 bytes, which a state directory's easily would)."""
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="gpufaas-sockets-"))
            self._sockets.chmod(0o711)
        return self._sockets

    async def _zygote_ready(self) -> _Zygote:
        if self._zygote is not None and self._zygote.alive:
            return self._zygote
        if self._closed:
            raise RuntimeError("the worker pool is shut down")
        if self._zygote_starting is None or self._zygote_starting.done():
            self._zygote_starting = asyncio.ensure_future(self._start_zygote())
        return await asyncio.shield(self._zygote_starting)

    async def _start_zygote(self) -> _Zygote:
        if self._zygote is not None:  # it died: not in a tight loop
            log.error("the worker zygote exited with status %s; restarting it", self._zygote.process.returncode)
            await asyncio.sleep(SPARE_RETRY_S)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "gpu_manager.zygote",
                "--fd",
                str(child.fileno()),
                "--backend",
                self.backend,
                *(["--isolate"] if self.isolation.network else []),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                # Workers inherit it: no cluster address or secret reaches a function.
                env={**worker_environment(os.environ), "PYTHONUNBUFFERED": "1"},
            )
        finally:
            child.close()
        parent.setblocking(False)
        try:
            async with asyncio.timeout(SPARE_START_TIMEOUT_S):
                ready = await asyncio.get_running_loop().sock_recv(parent, 64)
        except (TimeoutError, OSError):
            ready = b""
        except asyncio.CancelledError:  # shut down while it started
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            parent.close()
            raise
        if not ready.startswith(b"ready "):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            parent.close()
            raise RuntimeError(f"the worker zygote did not start (status {process.returncode}); see the log above")
        self._zygote = _Zygote(process, parent, float(ready.split()[1]))
        return self._zygote

    async def _confinement(self, run: ModelRun) -> dict[str, Any]:
        """The LoadModel fields that confine the worker taking `run` (gpu_manager.sandbox)."""
        isolation = self.isolation
        if self.runtime == "docker":  # the container is the confinement: its user, limits, tmpfs
            return {"max_file_mb": isolation.max_file_mb}
        fields: dict[str, Any] = {
            "data_limit_mb": data_allowance_mb(self.backend, run.memory_mb) or 0,
            "max_processes": isolation.max_processes,
            "max_file_mb": isolation.max_file_mb,
        }
        if isolation.per_package_users:
            uid = package_uid(run.package_digest)
            fields |= {"uid": uid, "gid": uid}
            if isolation.homes_dir is not None:
                fields["home_dir"] = str(await asyncio.to_thread(private_home, isolation.homes_dir, uid))
        return fields

    def _on_hello(self, worker: _Worker) -> None:
        if (
            self.isolation.network
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
        starting = self._starting.get(worker.gpu_id, [])
        if worker in starting and worker.hello.exception() is None:
            starting.remove(worker)
            worker.state = _State.SPARE
            self._spares[worker.gpu_id].append(worker)

    def _on_exit(self, worker: _Worker) -> None:
        self._live.discard(worker)
        self.worker_exits[worker.exit_cause or ("shutdown" if self._closed else "died")] += 1
        self._forget(worker)
        if self._parked.get(worker.model) is worker:
            del self._parked[worker.model]
        was_spare = False
        for group in (self._starting.get(worker.gpu_id, []), self._spares.get(worker.gpu_id, deque())):
            if worker in group:
                group.remove(worker)
                was_spare = True
        if was_spare and not self._closed:
            if worker.hello.done() and worker.hello.exception() is None:
                self._replenish(worker.gpu_id)
            else:  # it died warming up: do not respawn in a tight loop
                log.error(
                    "a spare worker for %s exited before it was ready; see the log above; retrying in %g s",
                    worker.gpu_id,
                    SPARE_RETRY_S,
                )
                asyncio.get_running_loop().call_later(SPARE_RETRY_S, self._replenish, worker.gpu_id)

    def _track(self, task: asyncio.Task[object]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._untrack)

    def _untrack(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        # A load's failure reaches its callers through the worker's futures (or they gave up).
        if not task.cancelled() and (exc := task.exception()) is not None and not isinstance(exc, _LoadFailed):
            log.error("background task %s failed", task.get_name(), exc_info=exc)

    def _forget(self, worker: _Worker) -> None:
        key = (worker.model, worker.gpu_id)
        if self._workers.get(key) is worker:  # a newer worker may hold the key already
            del self._workers[key]

    def _kill(self, worker: _Worker) -> None:
        """SIGKILL now, without waiting."""
        self._forget(worker)
        worker.exit_cause = worker.exit_cause or "killed"
        worker._gone(ConnectionLost(f"worker pid {worker.pid} was killed"))
        worker.signal(signal.SIGKILL)

    async def _stop(self, worker: _Worker) -> None:
        """SIGTERM, SIGKILL after STOP_GRACE_S; returns once the process is gone."""
        self._forget(worker)
        if worker.exited.done():
            return
        worker.exit_cause = worker.exit_cause or ("shutdown" if self._closed else "stopped")
        if worker.state is not _State.PARKED and worker.gpu_id:  # it holds device memory until it exits
            exiting = self._exiting.setdefault(worker.gpu_id, set())
            exiting.add(worker.exited)
            worker.exited.add_done_callback(exiting.discard)
        worker._gone(ConnectionLost(f"worker pid {worker.pid} was stopped"))
        worker.signal(signal.SIGTERM)
        done, _ = await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
        if not done:
            worker.signal(signal.SIGKILL)
            await asyncio.wait({worker.exited}, timeout=_KILL_WAIT_S)


class _LoadFailed(Exception):
    def __init__(self, outcome: int, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


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
