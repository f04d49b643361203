"""The node's worker processes: warm spares per GPU, one worker per (model, GPU), calls pipelined.

A miss costs a weight load, not a process start: each GPU keeps `spares_per_gpu` spare workers
(more while misses come faster than spares are made: gpu_manager.spares) that have imported the
runtime (torch) and created their device context. A miss takes one, sends
it the model, and a new spare starts in the background. Meanwhile the package is fetched (if this
node lacks it) and its weights are readied (mapped from the node's host model pool: the node's
`prepare_weights`), or its files read ahead into host memory, in parallel with waiting for a
spare (EDAS's parallel loading). How worker processes are started and stopped is the runtime's
(gpu_manager.runtimes: forked from a zygote, or containers); what a worker is, gpu_manager.workers.

Calls for a ready worker are written to it at once, in order (its socket is the queue), so it
never idles between calls; a function that batches has the waiting calls merged by the worker.

Two tiers (DESIGN: GPU memory, and host memory from which a model comes back onto any GPU of its
node): with `host_cache_mb` > 0 an evicted worker is not stopped but parked, its model kept in host
memory (least recently parked first out, within `host_cache_mb` of the host memory parked workers
measurably use: gpu_manager.host_tier); a miss for that model (same package) takes it back instead
of loading. On the cpu backend a worker is not
bound to a device, so taking it back is free; on cuda an evicted worker stops, and its weights stay
in the node's host model pool, from which the next miss copies them (gpu_manager.host_pool).

GPU memory is measured from outside the worker, never taken from its report (its handler can
rewrite that): with an NVML session (cuda) each worker's model is booked at NVML's peak figure for
its PID, read after its load and after calls (at most once per MEASURE_EVERY_S); elsewhere at its
declared size (gpu_manager.workers' `book_memory`). A model over its declaration beyond a margin
is logged and counted (`models_over_declared`, once per worker); one measured over it whose GPU's
models then add up to more than the GPU's capacity is stopped (exit cause "over_memory"), its
call answered, its measured size reported so that the scheduler books it at that from then on.

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
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpu_manager.backends import backend_class
from gpu_manager.containers import DockerLauncher
from gpu_manager.devices import Nvml
from gpu_manager.host_tier import ParkedTier, proportional_set_mb
from gpu_manager.runtimes import (
    KILL_WAIT_S,
    RUNTIMES,
    SPARE_RETRY_S,
    SPARE_START_TIMEOUT_S,
    STOP_GRACE_S,
    DockerRuntime,
    ProcessRuntime,
    Runtime,
)
from gpu_manager.sandbox import Isolation, lock_package, package_uid
from gpu_manager.spares import SpareTarget
from gpu_manager.workers import (
    EXIT_CAUSES,
    NO_WEIGHTS,
    ModelRun,
    RunResult,
    WeightsPlan,
    Worker,
    WorkerState,
    book_memory,
    memory_margin_mb,
)
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost, Frame, MessageType

__all__ = ["EXIT_CAUSES", "STOP_GRACE_S", "ModelRun", "RunResult", "WeightsPlan", "WorkerPool"]

log = logging.getLogger("gpufaas.gpu_manager.pool")

_JUST_FETCHED_S = 0.05  # a package that took longer than this to get is in the page cache already
MEASURE_EVERY_S = 1.0  # NVML's per-process query costs about a small model's inference: not per call


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
        extra_spares: int = 0,
        max_body_bytes: int = 16 * 1024 * 1024,
        wait_for_victims: bool | None = None,
        host_cache_mb: int = 0,
        python: str = sys.executable,
        isolation: Isolation | None = None,
        runtime: str = "process",
        launcher: DockerLauncher | None = None,
        node: str = "node",
        prepare_weights: Callable[[str, Path], Awaitable[WeightsPlan]] | None = None,
        measure_host_mb: Callable[[int], int | None] = proportional_set_mb,
        cpu_busy: Callable[[], bool] | None = None,
        nvml: Nvml | None = None,
        capacity_mb: Callable[[str], int] | None = None,
    ) -> None:
        """`gpus`: node-local GPU id -> device index. `fetch_package(digest)` returns the package's
        directory, fetching it if needed, and the seconds that took (0: it was on disk);
        `prepare_weights(digest, directory)` what the worker maps from the host model pool and its
        requirements layer (None: neither). `wait_for_victims`: a miss waits for its victims to
        exit before loading (their device memory must be free first); default: on cuda only.
        `host_cache_mb`: the host tier's size (0: off; the cpu backend only), in MiB of what its
        workers measurably use, read by `measure_host_mb(pid)` once parked. `isolation`: how
        workers are confined (gpu_manager.sandbox; default: all of it the node can do).
        `extra_spares`: how many spares beyond `spares_per_gpu` a GPU may keep while misses come
        faster than spares are made and `cpu_busy()` says no (default: the load average below the
        CPU count; gpu_manager.spares; 0 on cuda). `runtime`: "process" (forked
        from the zygote) or "docker" (a container per worker, made by `launcher` for a model: no
        spares; gpu_manager.containers). `nvml`: the session the node measures its workers' GPU
        memory with (None: nothing measures it, models are booked at their declared sizes);
        `capacity_mb(gpu_id)`: the GPU memory the scheduler may book on that GPU, against which a
        model measured over its declaration is checked (None: no check)."""
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown worker runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
        backend_class(backend)  # an unknown name fails here, at startup, listing the valid ones
        if spares_per_gpu < 0:
            raise ValueError(f"spares_per_gpu must be >= 0, got {spares_per_gpu}")
        if extra_spares < 0:
            raise ValueError(f"extra_spares must be >= 0, got {extra_spares}")
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
        self._measure_host_mb = measure_host_mb
        self._cpu_busy = cpu_busy if cpu_busy is not None else _cpu_busy
        self._nvml = nvml
        self._capacity_mb = capacity_mb
        self.isolation = isolation if isolation is not None else Isolation()
        self.runtime = runtime
        self.node = node
        self._closed = False
        common: dict[str, Any] = {
            "backend": backend,
            "gpus": self.gpus,
            "isolation": self.isolation,
            "max_body_bytes": max_body_bytes,
            "closing": lambda: self._closed,
        }
        # The one place the runtime is chosen: the pool speaks to it through `Runtime` only.
        self._runtime: Runtime = (
            DockerRuntime(
                launcher=launcher or DockerLauncher(),
                node=node,
                prepare=self._prepare_container,
                track=self._track,
                **common,
            )
            if runtime == "docker"
            else ProcessRuntime(python=python, **common)
        )
        if spares_per_gpu and not self._runtime.keeps_spares:
            raise ValueError(f"the {runtime} runtime keeps no spares (a worker is made for a model): use 0 spares")
        self._locked: set[str] = set()  # package digests made readable to their own user only
        self._warned_network = False
        self._workers: dict[tuple[str, str], Worker] = {}
        self._spares: dict[str, deque[Worker]] = {gpu: deque() for gpu in self.gpus}
        self._starting: dict[str, list[Worker]] = {gpu: [] for gpu in self.gpus}
        # Up to `extra_spares` beyond the floor follow the miss rate (gpu_manager.spares); not on
        # cuda, where each spare holds a device context the GPU's registered capacity leaves out.
        extra = 0 if backend == "cuda" else extra_spares
        self._spare_targets = {gpu: SpareTarget(spares_per_gpu, max_extra=extra) for gpu in self.gpus}
        self._parked: ParkedTier[Worker] = ParkedTier(host_cache_mb)  # model -> worker, oldest parked first
        # GPU -> the exits of workers stopping there (evicted, released): a miss on that GPU waits
        # for them as for its own victims, since their device memory is not free until then.
        self._exiting: dict[str, set[asyncio.Future[None]]] = {}
        self._live: set[Worker] = set()
        self._tasks: set[asyncio.Task[object]] = set()  # loads and stops in the background
        self._watchers: set[asyncio.Task[None]] = set()  # one per worker: starts it, waits for its exit
        # Worker processes started and exited (by cause) since the pool was made: counted for the
        # node's metrics, which read them when scraped. Started - exited = len(_live).
        self.worker_starts = 0
        self.worker_exits: collections.Counter[str] = collections.Counter()
        # Workers whose model was over its declared size beyond the margin, by how that was seen:
        # "measured" (NVML) or "claimed" (the worker's own report, booked at the declared size).
        self.models_over_declared: collections.Counter[str] = collections.Counter()

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start every GPU's spares (in the background)."""
        for gpu_id in self.gpus:
            self._replenish(gpu_id)

    async def check_runtime(self) -> None:
        """Refuse to start where the runtime cannot run (the docker runtime: no engine, no image);
        clear what a previous run of the node left (its containers)."""
        await self._runtime.check()

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
        # First what is still starting (a zygote would fork spares nobody stops), then the loads.
        await self._runtime.stop_starting()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._stop(worker) for worker in list(self._live)), return_exceptions=True)
        await self._runtime.shutdown()

    def workers(self) -> list[tuple[str, str, int, int]]:
        """(model, gpu_id, pid, memory_mb) of every worker that is READY."""
        return [
            (model, gpu, w.pid, w.memory_mb)
            for (model, gpu), w in self._workers.items()
            if w.state is WorkerState.READY
        ]

    def live_workers(self) -> int:
        """Worker processes started and not yet seen exit (spares, loading, ready, parked)."""
        return len(self._live)

    def packages_in_use(self) -> set[str]:
        """The package digests of every worker that has or is taking a model (parked ones too)."""
        return {w.run.package_digest for w in self._live if w.run is not None and w.state is not WorkerState.GONE}

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
        if worker is None or worker.state is WorkerState.GONE:
            if worker is not None:
                self._forget(worker)
            victims = [*self._evict_for_miss(gpu_id, evict, seq), *self._exiting.get(gpu_id, ())]
            taken = self._take_back(run, gpu_id) or await self._load_here(run, gpu_id, victims, deadline, timeout_s)
            if isinstance(taken, RunResult):
                return taken  # the load failed or timed out
            worker, stages = taken
        else:
            self._evict_for_miss(gpu_id, evict, seq)  # a grant that expected a miss can still name victims
            if worker.state is WorkerState.LOADING:
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
    ) -> tuple[Worker, pb.MissStages] | RunResult:
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
            return RunResult(exc.outcome, exc.message, loaded=True, peak_memory_mb=exc.peak_memory_mb)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this call was cancelled
            return RunResult(pb.WORKER_DIED, "the node shut down while the model loaded", loaded=True)

    async def evict(self, model: str, gpu_id: str) -> bool:
        """Stop `model`'s worker on `gpu_id` (and its copy in the host tier, if any) and wait for
        them to exit (their memory is then free); False if there was none. Calls still on it fail
        with WORKER_DIED."""
        victims = [w for w in (self._workers.get((model, gpu_id)), self._parked.pop(model)) if w is not None]
        await asyncio.gather(*(self._stop(worker) for worker in victims))
        return bool(victims)

    async def release(self, model: str, gpu_id: str, *, to_host: bool, seq: int = 0) -> bool:
        """EDAS's staged exit, first stage: the idle `model` leaves `gpu_id`, into the host tier
        when `to_host` and the node has one (its process and host copy stay), else its worker
        stops. A worker with calls in flight, still loading, or used by a grant later than `seq`
        stays: the scheduler's view has moved on. True if it left."""
        worker = self._workers.get((model, gpu_id))
        if worker is None or worker.pending or worker.state is not WorkerState.READY or worker.last_seq > seq:
            return False
        if to_host and self.host_cache_mb:
            self._park(worker)
            return True
        await self._stop(worker)
        return True

    async def release_from_host(self, model: str) -> bool:
        """The second stage: `model`'s copy in the host tier goes (its process stops)."""
        worker = self._parked.pop(model)
        if worker is None:
            return False
        await self._stop(worker)
        return True

    def parked(self) -> list[tuple[str, int]]:
        """(model, MiB of host memory it is charged) of the host tier's workers, least recently
        parked first."""
        return self._parked.models()

    # --- misses -----------------------------------------------------------------------------
    def _evict_for_miss(self, gpu_id: str, evict: tuple[str, ...], seq: int) -> list[asyncio.Future[None]]:
        """Stop the victims, except one that a later grant uses or that has calls in flight
        (then the scheduler's view has moved on: it re-admitted the model); returns their exits,
        to wait on."""
        exits: list[asyncio.Future[None]] = []
        for model in evict:
            victim = self._workers.get((model, gpu_id))
            if victim is None or victim.pending or victim.state is WorkerState.LOADING or victim.last_seq > seq:
                continue
            if self.host_cache_mb and victim.state is WorkerState.READY:
                self._park(victim)
                continue
            self._forget(victim)
            self._track(asyncio.create_task(self._stop(victim)))
            exits.append(victim.exited)
        return exits

    def _park(self, worker: Worker) -> None:
        """Move a ready worker from its GPU to the host tier (oldest parked out past the budget)."""
        self._forget(worker)
        worker.state = WorkerState.PARKED
        worker.host_mb = None
        self._stop_displaced(self._parked.park(worker))
        measurable = worker.pid and not worker.container and self._parked.get(worker.model) is worker
        if measurable and self._parked.wants_measure(worker.model, time.monotonic()):
            self._track(asyncio.create_task(self._measure_parked(worker)))

    async def _measure_parked(self, worker: Worker) -> None:
        """Charge a parked worker what it uses (its PSS, read off the event loop)."""
        host_mb = await asyncio.to_thread(self._measure_host_mb, worker.pid)
        if host_mb is not None and worker.state is WorkerState.PARKED:
            self._stop_displaced(self._parked.measured(worker, host_mb, time.monotonic()))

    def _stop_displaced(self, workers: list[Worker]) -> None:
        for displaced in workers:
            self._track(asyncio.create_task(self._stop(displaced)))

    def _take_back(self, run: ModelRun, gpu_id: str) -> tuple[Worker, pb.MissStages] | None:
        """The model's parked worker (same package), now serving on `gpu_id`, or None."""
        started = time.perf_counter()
        worker = self._parked.get(run.model)
        if worker is None or worker.state is not WorkerState.PARKED:
            return None
        self._parked.pop(run.model)
        if worker.run is None or worker.run.package_digest != run.package_digest:
            self._track(asyncio.create_task(self._stop(worker)))  # a redeploy: its code is stale
            return None
        worker.gpu_id = gpu_id
        worker.state = WorkerState.READY
        # Grants are ordered per GPU: the order it was used in on its last GPU means nothing here
        # (kept, it made a later grant's eviction of it look stale, and it stayed for good).
        worker.last_seq = 0
        self._workers[(run.model, gpu_id)] = worker
        return worker, pb.MissStages(from_host=True, host_s=time.perf_counter() - started)

    def _begin_load(self, run: ModelRun, gpu_id: str) -> Worker:
        """Claim a worker for `run` on `gpu_id` now (a spare if one is warm, else one that is
        starting, else a new process), so that concurrent calls of the model share its load."""
        spares = self._spares[gpu_id]
        self._spare_targets[gpu_id].record_load(time.monotonic())
        if spares:
            worker = spares.popleft()
        elif self._starting[gpu_id]:
            worker = self._starting[gpu_id].pop(0)
        else:
            worker = self._spawn(gpu_id, run)
        worker.state = WorkerState.LOADING
        worker.run = run
        worker.memory_mb = run.memory_mb
        self._workers[(run.model, gpu_id)] = worker
        self._replenish(gpu_id)
        return worker

    async def _load(
        self, worker: Worker, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]]
    ) -> pb.MissStages:
        started = time.perf_counter()
        stages = pb.MissStages()
        was_warm = worker.hello.done()

        async def package() -> tuple[Path, WeightsPlan]:
            directory, stages.fetch_s = await self._fetch_package(run.package_digest)
            await self._own_package(run.package_digest, directory)  # readable by its own user only
            weights = await self._weights(run, directory)
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
            await asyncio.wait(victims, timeout=KILL_WAIT_S)  # their device memory must be free first
        load_started = time.perf_counter()
        assert worker.conn is not None
        seen = self._runtime.worker_view(weights)  # its weights where the worker sees them
        try:
            confinement = await self._runtime.confinement(worker, run)
        except OSError as exc:
            self._forget(worker)
            worker.exit_cause = "load_failed"
            self._kill(worker)
            message = f"model {run.model!r} on {gpu_id}: cannot confine its worker: {exc}"
            raise _LoadFailed(pb.LOAD_FAILED, message) from None
        try:
            worker.conn.send(
                MessageType.LOAD_MODEL,
                pb.LoadModel(
                    model=run.model,
                    package_dir=self._runtime.package_dir(directory),
                    pooled=seen.pooled,
                    layer_dir=seen.layer_dir,
                    memory_mb=run.memory_mb,
                    max_batch_size=run.max_batch_size,
                    max_batch_wait_s=run.max_batch_wait_s,
                    environment=run.environment,
                    load_time_s=run.load_time_s,
                    inference_time_s=run.inference_time_s,
                    max_result_bytes=self.max_body_bytes,
                    **confinement,
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
        if not self._book(worker, int(loaded.peak_memory_mb), measure=True):
            failure = _LoadFailed(pb.LOAD_FAILED, self._over_memory_message(worker), worker.memory_mb)
            if not worker.ready.done():
                worker.ready.set_exception(failure)
                worker.ready.exception()
            raise failure
        worker.state = WorkerState.READY
        if not worker.ready.done():
            worker.ready.set_result(None)
        return stages

    async def _weights(self, run: ModelRun, directory: Path) -> WeightsPlan:
        if self._prepare_weights is None:
            return NO_WEIGHTS
        return await self._prepare_weights(run.package_digest, directory)

    # --- calls ------------------------------------------------------------------------------
    async def _call(
        self, worker: Worker, call_id: str, payload: bytes, *, content_type: str, deadline: float, timeout_s: float
    ) -> RunResult:
        model, gpu_id = worker.model, worker.gpu_id
        if worker.state is not WorkerState.READY or worker.conn is None:
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
        kept = self._book(worker, int(reply.peak_memory_mb))
        return RunResult(
            outcome=reply.outcome,
            message=reply.message if kept else (reply.message or self._over_memory_message(worker)),
            output=frame.body,
            content_type=reply.content_type,
            inference_time_s=reply.inference_s,
            batch_calls=reply.batch_calls or 1,
            peak_memory_mb=worker.memory_mb,
            worker_killed=not kept,  # the scheduler drops the model from the GPU (Done.worker_lost)
        )

    # --- GPU memory -------------------------------------------------------------------------
    def _book(self, worker: Worker, reported_mb: int, *, measure: bool = False) -> bool:
        """Set what `worker`'s model is booked at (`worker.memory_mb`) from the node's own
        measurement where it has one (`measure`: now, else at most once per MEASURE_EVERY_S),
        never from the worker's `reported_mb` (see book_memory). Returns False when the worker
        was stopped: measured over its declaration, its GPU's models would overcommit it."""
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
        booked_mb = sum(
            w.memory_mb
            for (_, gpu_id), w in self._workers.items()
            if gpu_id == worker.gpu_id and w.state in (WorkerState.LOADING, WorkerState.READY)
        )
        if booked_mb <= self._capacity_mb(worker.gpu_id):
            return True
        log.error("%s; its models would then book %d MiB", self._over_memory_message(worker), booked_mb)
        worker.exit_cause = "over_memory"
        self._forget(worker)
        self._track(asyncio.create_task(self._stop(worker)))
        return False

    def _measure_gpu_mb(self, worker: Worker, *, force: bool) -> int | None:
        """The most GPU memory the node has seen `worker` hold (NVML, by PID), measuring again
        when `force`d or MEASURE_EVERY_S after the last time; None where nothing measures it (no
        NVML; a container's PID, which NVML does not know; NVML not listing it yet)."""
        if self._nvml is None or not worker.pid or worker.container:
            return None
        now = time.monotonic()
        if force or now - worker.measured_s >= MEASURE_EVERY_S:
            worker.measured_s = now
            process_mb = self._nvml.process_mb(self.gpus[worker.gpu_id], worker.pid)
            if process_mb is not None:
                worker.measured_mb = max(worker.measured_mb, process_mb)
        return worker.measured_mb or None

    def _over_memory_message(self, worker: Worker) -> str:
        declared_mb = worker.run.memory_mb if worker.run is not None else 0
        return (
            f"model {worker.model!r} on {worker.gpu_id} holds {worker.memory_mb} MiB of GPU memory, over its declared "
            f"{declared_mb} MiB, and its GPU has no room for that: its worker was stopped (declare memory_mb >= "
            f"{worker.memory_mb})"
        )

    def _died(self, worker: Worker, call_id: str) -> RunResult:
        self._forget(worker)
        if self._runtime.over_memory(worker):  # the kernel killed it at its group's limit: not transient
            return RunResult(
                pb.HANDLER_ERROR,
                f"model {worker.model!r} on {worker.gpu_id}: its processes went over their {worker.cgroup_limit_mb} "
                f"MiB of host memory (declared memory_mb {worker.run.memory_mb if worker.run else 0}); its worker "
                f"was killed during call {call_id}",
                worker_killed=True,
            )
        return RunResult(
            pb.WORKER_DIED,
            f"worker of model {worker.model!r} on {worker.gpu_id} (pid {worker.pid}) exited during call {call_id}",
        )

    # --- processes --------------------------------------------------------------------------
    def _replenish(self, gpu_id: str) -> None:
        if self._closed:
            return
        target = self._spare_targets[gpu_id].target(time.monotonic(), cpu_busy=self._cpu_busy())
        while len(self._spares[gpu_id]) + len(self._starting[gpu_id]) < target:
            self._starting[gpu_id].append(self._spawn(gpu_id))

    def _spawn(self, gpu_id: str, run: ModelRun | None = None) -> Worker:
        """Fork a worker for `gpu_id` from the zygote, or on the docker runtime start a container
        for `run` (in the background); a forked one becomes a spare when it says hello, unless a
        miss claims it first."""
        worker = Worker(gpu_id)
        self._live.add(worker)
        self.worker_starts += 1
        worker.hello.add_done_callback(lambda _: self._on_hello(worker))
        worker.exited.add_done_callback(lambda _: self._on_exit(worker))
        # Not in _tasks: shutdown must not cancel it, it is what tells that the process exited.
        watcher = asyncio.create_task(self._runtime.run(worker, run))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return worker

    async def _prepare_container(self, run: ModelRun) -> tuple[Path, int, WeightsPlan]:
        """What a container for `run` mounts: its package's directory, the user that owns it, and
        its weights in the host pool (the docker runtime's `prepare`)."""
        directory, _ = await self._fetch_package(run.package_digest)
        uid = await self._own_package(run.package_digest, directory)
        return directory, uid, await self._weights(run, directory)

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

    def _on_hello(self, worker: Worker) -> None:
        if worker.hello.exception() is None and worker.gpu_id in self._spare_targets:
            self._spare_targets[worker.gpu_id].record_start(worker.warm_s - worker.spawned_s)
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
            worker.state = WorkerState.SPARE
            self._spares[worker.gpu_id].append(worker)

    def _on_exit(self, worker: Worker) -> None:
        self._live.discard(worker)
        self.worker_exits[worker.exit_cause or ("shutdown" if self._closed else "died")] += 1
        self._forget(worker)
        if worker.run is not None and worker.run.package_digest not in self.packages_in_use():
            digest = worker.run.package_digest
            self._track(
                asyncio.ensure_future(self._runtime.release_package(digest, lambda: digest in self.packages_in_use()))
            )
        if self._parked.get(worker.model) is worker:
            self._parked.pop(worker.model)
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

    def _forget(self, worker: Worker) -> None:
        key = (worker.model, worker.gpu_id)
        if self._workers.get(key) is worker:  # a newer worker may hold the key already
            del self._workers[key]

    def _kill(self, worker: Worker) -> None:
        """SIGKILL now, without waiting."""
        self._forget(worker)
        worker.exit_cause = worker.exit_cause or "killed"
        worker.gone(ConnectionLost(f"worker pid {worker.pid} was killed"))
        worker.signal(signal.SIGKILL)

    async def _stop(self, worker: Worker) -> None:
        """SIGTERM, SIGKILL after STOP_GRACE_S; returns once the process is gone."""
        self._forget(worker)
        if worker.exited.done():
            return
        worker.exit_cause = worker.exit_cause or ("shutdown" if self._closed else "stopped")
        if worker.state is not WorkerState.PARKED and worker.gpu_id:  # it holds device memory until it exits
            exiting = self._exiting.setdefault(worker.gpu_id, set())
            exiting.add(worker.exited)
            worker.exited.add_done_callback(exiting.discard)
        worker.gone(ConnectionLost(f"worker pid {worker.pid} was stopped"))
        worker.signal(signal.SIGTERM)
        done, _ = await asyncio.wait({worker.exited}, timeout=STOP_GRACE_S)
        if not done:
            worker.signal(signal.SIGKILL)
            await asyncio.wait({worker.exited}, timeout=KILL_WAIT_S)


class _LoadFailed(Exception):
    def __init__(self, outcome: int, message: str, peak_memory_mb: int = 0) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.peak_memory_mb = peak_memory_mb  # measured: the worker was stopped for holding that


def _cpu_busy() -> bool:
    """Whether the machine's CPUs are all busy (the last minute's load average at their number):
    no spares are made ahead then, beyond each GPU's floor."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False


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
