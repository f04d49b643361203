"""The node's worker processes: warm spares per GPU, one worker per (model, GPU), calls pipelined.

A miss costs a weight load, not a process start: each GPU keeps `spares_per_gpu` spare workers
(gpu_manager.spare_workers; more while misses come faster than spares are made:
gpu_manager.spares) that have imported the runtime (torch) and created their device context. A
miss takes one, sends it the model, and a new spare starts in the background. Meanwhile the package is fetched (if this
node lacks it) and its weights are readied (mapped from the node's host model pool: the node's
`prepare_weights`), or its files read ahead into host memory, in parallel with waiting for a
spare (EDAS's parallel loading: gpu_manager.loads). How worker processes are started and stopped
is the runtime's (gpu_manager.runtimes: forked from a zygote, or containers), chosen once; what a
worker is, and the messages the node exchanges with it, gpu_manager.workers.

Calls for a ready worker are written to it at once, in order (its socket is the queue), so it
never idles between calls; a function that batches has the waiting calls merged by the worker.

Two tiers (GPU memory, and host memory from which a model comes back onto any GPU of its
node): with `host_cache_mb` > 0 an evicted worker is not stopped but parked, its model kept in host
memory (least recently parked first out, within `host_cache_mb` of the host memory parked workers
measurably use: gpu_manager.parked_workers); a miss for that model (same package) takes it back
instead of loading. On the cpu backend a worker is not
bound to a device, so taking it back is free; on cuda an evicted worker stops, and its weights stay
in the node's host model pool, from which the next miss copies them (gpu_manager.host_pool).

GPU memory is measured from outside the worker, never taken from its report (its handler can
rewrite that): with an NVML session (cuda) each worker's model is booked at NVML's peak figure for
its PID, read after its load and after calls (at most once per MEASURE_EVERY_S); elsewhere at its
declared size (gpu_manager.gpu_memory). A model over its declaration beyond a margin
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
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpu_manager.backends import backend_class
from gpu_manager.devices import Nvml
from gpu_manager.gpu_memory import MEASURE_EVERY_S, GpuMemory, over_memory_message
from gpu_manager.gpu_workers import GpuWorkers
from gpu_manager.host_tier import proportional_set_mb
from gpu_manager.loads import LoadFailed, ModelFiles, ModelLoader
from gpu_manager.parked_workers import ParkedWorkers
from gpu_manager.runtimes import (
    RUNTIMES,
    SPARE_START_TIMEOUT_S,
    STOP_GRACE_S,
    ContainerEngine,
    Prepare,
    Runtime,
    make_runtime,
)
from gpu_manager.sandbox import Isolation
from gpu_manager.spare_workers import SpareWorkers
from gpu_manager.worker_processes import WorkerProcesses
from gpu_manager.workers import (
    EXIT_CAUSES,
    CallTimedOut,
    ModelRun,
    RunResult,
    WeightsPlan,
    Worker,
    WorkerState,
    misbehaved_message,
)
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost

__all__ = [
    "EXIT_CAUSES",
    "MEASURE_EVERY_S",
    "STOP_GRACE_S",
    "ModelRun",
    "RunResult",
    "WeightsPlan",
    "WorkerPool",
]

log = logging.getLogger("gpufaas.gpu_manager.pool")


class WorkerPool:
    """The worker processes of one node.

    `gpus`: node-local GPU id -> device index. `fetch_package(digest)` returns the package's
    directory, fetching it if needed, and the seconds that took (0: it was on disk);
    `prepare_weights(digest, directory)` what the worker maps from the host model pool and its
    requirements layer (None: neither). `wait_for_victims`: a miss waits for its victims to exit
    before loading (their device memory must be free first); default: on cuda only.
    `host_cache_mb`: the host tier's size (0: off; the cpu backend only), in MiB of what its
    workers measurably use, read by `measure_host_mb(pid)` once parked. `isolation`: how workers
    are confined (gpu_manager.sandbox; default: all of it the node can do). `extra_spares`: how
    many spares beyond `spares_per_gpu` a GPU may keep while misses come faster than spares are
    made and `cpu_busy()` says no (default: the load average below the CPU count;
    gpu_manager.spares; 0 on cuda). `runtime`: "process" (forked from the zygote, run by
    `python`) or "docker" (a container per worker, made by `launcher` for a model: no spares;
    gpu_manager.containers). `nvml`: the session the node measures its workers' GPU memory with
    (None: nothing measures it, models are booked at their declared sizes); `capacity_mb(gpu_id)`:
    the GPU memory the scheduler may book on that GPU, against which a model measured over its
    declaration is checked (None: no check). A setting it cannot run with is a ValueError.

    State, all touched only from the event loop:
    - `_workers`: (model, gpu_id) -> its worker, LOADING or READY (gpu_manager.gpu_workers).
    - `_spares`: each GPU's warm spares and those on their way (gpu_manager.spare_workers).
    - `_parked`: model -> a PARKED worker (the host tier: gpu_manager.parked_workers).
    - `_processes`: every process this pool started and has not yet seen exit, and the pool's
      background tasks (gpu_manager.worker_processes); shutdown stops them all.
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
        launcher: ContainerEngine | None = None,
        node: str = "node",
        prepare_weights: Callable[[str, Path], Awaitable[WeightsPlan]] | None = None,
        measure_host_mb: Callable[[int], int | None] = proportional_set_mb,
        cpu_busy: Callable[[], bool] | None = None,
        nvml: Nvml | None = None,
        capacity_mb: Callable[[str], int] | None = None,
    ) -> None:
        """See the class's docstring."""
        _check_settings(backend, runtime, spares_per_gpu, extra_spares, host_cache_mb)
        self.backend = backend
        self.gpus = dict(gpus)
        self.spares_per_gpu = spares_per_gpu
        self.max_body_bytes = max_body_bytes
        self.wait_for_victims = backend == "cuda" if wait_for_victims is None else wait_for_victims
        self.host_cache_mb = host_cache_mb
        self.isolation = isolation if isolation is not None else Isolation()
        self.runtime = runtime
        self.node = node
        self._closed = False
        self._grant_order = 0  # one more for each scheduler that numbers its grants afresh (`run`)
        self._workers = GpuWorkers()
        files = ModelFiles(fetch_package, prepare_weights, self.isolation)
        self._processes = WorkerProcesses(
            self._choose_runtime(python=python, launcher=launcher, prepare=files.for_container),
            closing=lambda: self._closed,
            on_hello=lambda worker: self._spares.on_hello(worker),  # noqa: PLW0108 (made below)
            on_exit=self._on_exit,
            network_isolation=self.isolation.network,
        )
        self._loader = ModelLoader(
            files, self._processes.runtime, max_body_bytes=max_body_bytes, wait_for_victims=self.wait_for_victims
        )
        self._memory = GpuMemory(self.gpus, nvml, capacity_mb, self._processes.runtime.processes)
        # Not on cuda: there each spare holds a device context the GPU's registered capacity leaves out.
        self._spares = SpareWorkers(
            list(self.gpus),
            floor=spares_per_gpu,
            max_extra=0 if backend == "cuda" else extra_spares,
            spawn=self._processes.spawn,
            closing=lambda: self._closed,
            cpu_busy=cpu_busy if cpu_busy is not None else _cpu_busy,
        )
        self._parked = ParkedWorkers(
            host_cache_mb, measure_host_mb=measure_host_mb, stop=self._stop_later, track=self._processes.track
        )

    def _choose_runtime(self, *, python: str, launcher: ContainerEngine | None, prepare: Prepare) -> Runtime:
        """The one place the runtime is chosen: the pool speaks to it through `Runtime` only."""
        return make_runtime(
            self.runtime,
            backend=self.backend,
            gpus=self.gpus,
            isolation=self.isolation,
            max_body_bytes=self.max_body_bytes,
            closing=lambda: self._closed,
            python=python,
            launcher=launcher,
            node=self.node,
            prepare=prepare,
            track=lambda task: self._processes.track(task),  # noqa: PLW0108 (not made yet)
            spares_per_gpu=self.spares_per_gpu,
        )

    @property
    def worker_starts(self) -> int:
        """Worker processes started since the pool was made (the node's metrics read it)."""
        return self._processes.worker_starts

    @property
    def worker_exits(self) -> collections.Counter[str]:
        """Worker processes exited since the pool was made, by cause (EXIT_CAUSES)."""
        return self._processes.worker_exits

    @property
    def models_over_declared(self) -> collections.Counter[str]:
        """Workers whose model was over its declared size beyond the margin, by how that was seen:
        "measured" (NVML) or "claimed" (the worker's own report)."""
        return self._memory.models_over_declared

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start every GPU's spares (in the background)."""
        self._spares.start()

    async def check_runtime(self) -> None:
        """Refuse to start where the runtime cannot run (the docker runtime: no engine, no image);
        clear what a previous run of the node left (its containers)."""
        await self._processes.runtime.check()

    async def spares_ready(self, timeout_s: float = SPARE_START_TIMEOUT_S) -> list[pb.WorkerHello]:
        """Wait until every GPU's first spares are warm; their hellos (what they cost and hold)."""
        return await self._spares.ready(timeout_s)

    async def shutdown(self) -> None:
        """Stop every worker this pool started, ready or not, and the zygote; later calls are refused."""
        self._closed = True
        await self._processes.shutdown(self._stop)

    def workers(self) -> list[tuple[str, str, int, int]]:
        """(model, gpu_id, pid, memory_mb) of every worker that is READY."""
        return self._workers.ready()

    def live_workers(self) -> int:
        """Worker processes started and not yet seen exit (spares, loading, ready, parked)."""
        return len(self._processes.live)

    def packages_in_use(self) -> set[str]:
        """The package digests of every worker that has or is taking a model (parked ones too)."""
        return self._processes.packages_in_use()

    def forget_grant_order(self) -> None:
        """A new scheduler attached: its grants are numbered afresh (see `run`'s `seq`)."""
        self._grant_order += 1
        self._workers.forget_grant_order()

    def spare_count(self, gpu_id: str) -> int:
        return self._spares.count(gpu_id)

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
        grant_order = self._grant_order
        while True:
            worker = self._workers.get(run.model, gpu_id)
            if worker is None or worker.run is None or worker.run.package_digest == run.package_digest:
                break
            # The function was redeployed (a new package): its worker runs stale code. Look again
            # after stopping it: a concurrent call may have started the new one meanwhile.
            await self._stop(worker)
        stages: pb.MissStages | None = None  # set on a miss
        if worker is None or worker.state is WorkerState.GONE:
            if worker is not None:
                self._workers.forget(worker)
            taken_back = self._take_back(run, gpu_id)  # first: parking the victims could push it out
            victims = [*self._evict_for_miss(gpu_id, evict, seq), *self._processes.exiting(gpu_id)]
            taken = taken_back or await self._load_here(run, gpu_id, victims, deadline, timeout_s)
            if isinstance(taken, RunResult):
                return taken  # the load failed or timed out
            worker, stages = taken
        else:
            self._evict_for_miss(gpu_id, evict, seq)  # a grant that expected a miss can still name victims
            if worker.state is WorkerState.LOADING:
                waited = await self._wait_loaded(worker, f"model {run.model!r} on {gpu_id}", deadline)
                if waited is not None:
                    return waited
        if grant_order == self._grant_order:  # (else a new scheduler, counting from 1, attached meanwhile)
            worker.last_seq = max(worker.last_seq, seq)
        result = await self._call(
            worker, call_id, payload, content_type=content_type, deadline=deadline, timeout_s=timeout_s
        )
        return result if stages is None else _with_miss(result, stages)

    async def _wait_loaded(self, worker: Worker, what: str, deadline: float) -> RunResult | None:
        """Wait for another call's load of `what` into `worker`: None once it is ready, else this
        call's answer (it shares a failed load's outcome)."""
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(worker.ready)
        except TimeoutError:
            return RunResult(pb.TIMEOUT, f"{what}: still loading at the deadline")
        except Exception as exc:  # its load failed: this call shares the outcome
            outcome = exc.outcome if isinstance(exc, LoadFailed) else pb.WORKER_DIED
            return RunResult(outcome, str(exc))
        return None

    async def _load_here(
        self, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]], deadline: float, timeout_s: float
    ) -> tuple[Worker, pb.MissStages] | RunResult:
        """Load `run` on `gpu_id` through a spare: the worker and the miss's stages, or the
        call's answer when the load failed or timed out."""
        worker = self._begin_load(run, gpu_id)
        load_task = asyncio.create_task(self._load(worker, run, gpu_id, victims))
        self._processes.track(load_task)
        try:
            async with asyncio.timeout_at(deadline):
                return worker, await asyncio.shield(load_task)
        except TimeoutError:
            self._kill(worker)
            message = f"model {run.model!r} on {gpu_id}: not loaded within the {timeout_s:g} s timeout; worker killed"
            return RunResult(pb.TIMEOUT, message, loaded=True, worker_killed=True)
        except LoadFailed as exc:
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
        victims = [w for w in (self._workers.get(model, gpu_id), self._parked.pop(model)) if w is not None]
        await asyncio.gather(*(self._stop(worker) for worker in victims))
        return bool(victims)

    async def release(self, model: str, gpu_id: str, *, to_host: bool, seq: int = 0) -> bool:
        """EDAS's staged exit, first stage: the idle `model` leaves `gpu_id`, into the host tier
        when `to_host` and the node has one (its process and host copy stay), else its worker
        stops. A worker with calls in flight, still loading, or used by a grant later than `seq`
        stays: the scheduler's view has moved on. True if it left."""
        worker = self._workers.idle(model, gpu_id, seq)
        if worker is None:
            return False
        if to_host and self._parked.enabled:
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
        """Stop (or park) the victims grant `seq` may evict (see GpuWorkers.victim); returns the
        exits of those stopped, to wait on."""
        exits: list[asyncio.Future[None]] = []
        for model in evict:
            victim = self._workers.victim(model, gpu_id, seq)
            if victim is None:
                continue
            if self._parked.enabled and victim.state is WorkerState.READY:
                self._park(victim)
                continue
            self._workers.forget(victim)
            self._stop_later(victim)
            exits.append(victim.exited)
        return exits

    def _park(self, worker: Worker) -> None:
        """Move a ready worker from its GPU to the host tier (oldest parked out past the budget)."""
        self._workers.forget(worker)
        self._parked.park(worker)

    def _take_back(self, run: ModelRun, gpu_id: str) -> tuple[Worker, pb.MissStages] | None:
        """The model's parked worker (same package), now serving on `gpu_id`, or None."""
        started = time.perf_counter()
        worker = self._parked.take_back(run, gpu_id)
        if worker is None:
            return None
        self._workers.add(worker)
        return worker, pb.MissStages(from_host=True, host_s=time.perf_counter() - started)

    def _begin_load(self, run: ModelRun, gpu_id: str) -> Worker:
        """Claim a worker for `run` on `gpu_id` now (a spare if one is warm, else one that is
        starting, else a new process), so that concurrent calls of the model share its load."""
        worker = self._spares.claim(gpu_id) or self._processes.spawn(gpu_id, run)
        worker.state = WorkerState.LOADING
        worker.run = run
        worker.memory_mb = run.memory_mb
        self._workers.add(worker)
        self._spares.replenish(gpu_id)
        return worker

    async def _load(
        self, worker: Worker, run: ModelRun, gpu_id: str, victims: list[asyncio.Future[None]]
    ) -> pb.MissStages:
        """`run` loaded into `worker` (gpu_manager.loads) and booked on its GPU: the miss's
        stages; LoadFailed, the worker ended as the failure says, otherwise."""
        try:
            stages, loaded = await self._loader.load(worker, run, gpu_id, victims)
        except LoadFailed as failure:
            self._workers.forget(worker)
            if failure.worker_end == "kill":
                self._kill(worker)
            elif failure.worker_end == "stop":
                self._stop_later(worker)
                _fail_ready(worker, failure)
            raise
        if not self._book(worker, int(loaded.peak_memory_mb), measure=True):
            over_memory = LoadFailed(pb.LOAD_FAILED, over_memory_message(worker), worker.memory_mb)
            _fail_ready(worker, over_memory)
            raise over_memory
        worker.state = WorkerState.READY
        if not worker.ready.done():
            worker.ready.set_result(None)
        return stages

    # --- calls ------------------------------------------------------------------------------
    async def _call(
        self, worker: Worker, call_id: str, payload: bytes, *, content_type: str, deadline: float, timeout_s: float
    ) -> RunResult:
        if worker.state is not WorkerState.READY or worker.conn is None:
            return self._died(worker, call_id)
        try:
            reply, output = await worker.call(call_id, payload, content_type=content_type, deadline=deadline)
        except CallTimedOut as timed_out:
            if timed_out.running and not worker.is_gone:  # maybe stuck in the handler: killing is the sure way out
                self._kill(worker)
            return _timeout_answer(worker, timeout_s, killed=timed_out.running)
        except ConnectionLost:
            return self._died(worker, call_id)
        return _call_answer(reply, output, worker, kept=self._book(worker, int(reply.peak_memory_mb)))

    def _book(self, worker: Worker, reported_mb: int, *, measure: bool = False) -> bool:
        """Book `worker`'s model on its GPU (gpu_manager.gpu_memory); False when it was stopped:
        measured over its declaration, its GPU's models would overcommit it."""
        if self._memory.book(worker, reported_mb, measure=measure, booked_mb=self._workers.booked_mb):
            return True
        worker.exit_cause = "over_memory"
        self._workers.forget(worker)
        self._stop_later(worker)
        return False

    def _died(self, worker: Worker, call_id: str) -> RunResult:
        self._workers.forget(worker)
        return _died_answer(worker, call_id, over_memory=self._processes.runtime.over_memory(worker))

    # --- processes --------------------------------------------------------------------------
    def _on_exit(self, worker: Worker) -> None:
        self._workers.forget(worker)
        self._parked.exited(worker)
        self._spares.on_exit(worker)

    def _kill(self, worker: Worker) -> None:
        """SIGKILL now, without waiting."""
        self._workers.forget(worker)
        self._processes.kill(worker)

    def _stop_later(self, worker: Worker) -> None:
        """Stop `worker` in the background (its exit is `worker.exited`)."""
        self._processes.track(asyncio.create_task(self._stop(worker)))

    async def _stop(self, worker: Worker) -> None:
        """SIGTERM, SIGKILL after STOP_GRACE_S; returns once the process is gone."""
        self._workers.forget(worker)
        await self._processes.stop(worker)


def _check_settings(backend: str, runtime: str, spares_per_gpu: int, extra_spares: int, host_cache_mb: int) -> None:
    """ValueError, at startup, for a setting the pool cannot run with."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown worker runtime {runtime!r}; use one of {', '.join(RUNTIMES)}")
    backend_class(backend)  # an unknown name fails here, at startup, listing the valid ones
    if spares_per_gpu < 0:
        raise ValueError(f"spares_per_gpu must be >= 0, got {spares_per_gpu}")
    if extra_spares < 0:
        raise ValueError(f"extra_spares must be >= 0, got {extra_spares}")
    if host_cache_mb < 0 or (host_cache_mb and backend != "cpu"):
        raise ValueError(f"host_cache_mb must be >= 0, and 0 on the {backend} backend (a cpu-backend tier)")


def _timeout_answer(worker: Worker, timeout_s: float, *, killed: bool) -> RunResult:
    """A call with no result by its deadline: `killed`, its worker was running it (and was killed
    for it), else it was still queued at the worker."""
    where = f"model {worker.model!r} on {worker.gpu_id}"
    if killed:
        message = f"{where}: no result within the {timeout_s:g} s timeout; worker killed"
        return RunResult(pb.TIMEOUT, message, worker_killed=True)
    return RunResult(pb.TIMEOUT, f"{where}: still queued at the worker at the deadline")


def _call_answer(reply: pb.CallResult, output: bytes, worker: Worker, *, kept: bool) -> RunResult:
    """A call's answer from the worker's `reply`; not `kept`: its worker was stopped for its GPU
    memory (measured after the call), which the answer says where the reply does not."""
    return RunResult(
        outcome=reply.outcome,
        message=reply.message if kept else (reply.message or over_memory_message(worker)),
        output=output,
        content_type=reply.content_type,
        inference_time_s=reply.inference_s,
        batch_calls=reply.batch_calls or 1,
        peak_memory_mb=worker.memory_mb,
        worker_killed=not kept,  # the scheduler drops the model from the GPU (Done.worker_lost)
    )


def _died_answer(worker: Worker, call_id: str, *, over_memory: bool) -> RunResult:
    """A call whose worker exited under it: transient, unless the kernel killed it at its group's
    memory limit (`over_memory`) or the node killed it for frames it did not ask for (its handler's
    doing, as the limit is: not placed again)."""
    if worker.exit_cause == "misbehaved":
        return RunResult(pb.HANDLER_ERROR, f"{misbehaved_message(worker)} during call {call_id}", worker_killed=True)
    if over_memory:
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


def _with_miss(result: RunResult, stages: pb.MissStages) -> RunResult:
    """`result` of a call that loaded its model: where the miss's time went."""
    result.loaded = True
    result.stages = stages
    result.load_time_s = (
        stages.fetch_s + stages.pool_s + stages.start_s + stages.context_s + stages.load_s + stages.host_s
    )
    return result


def _fail_ready(worker: Worker, failure: LoadFailed) -> None:
    """Calls waiting for `worker`'s load share its failure."""
    if not worker.ready.done():
        worker.ready.set_exception(failure)
        worker.ready.exception()  # retrieved: nobody may be waiting


def _cpu_busy() -> bool:
    """Whether the machine's CPUs are all busy (the last minute's load average at their number):
    no spares are made ahead then, beyond each GPU's floor."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False
