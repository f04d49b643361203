"""A node's worker processes as the node sees them: what a call needs of its model's worker
(`ModelRun`), a call's answer (`RunResult`), what a taking worker maps beside its package
(`WeightsPlan`), one worker process's state and the node's end of its socket (`Worker`, which
holds the node's side of the protocol with it: hello, LoadModel, calls), and what its model is
booked at on its GPU (`book_memory`), shared by the worker pool (gpu_manager.pool) and the
runtimes that start the processes (gpu_manager.runtimes)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, time_out

_DRAIN_OVER_BYTES = 65536  # a call's payload larger than this waits for the socket to take it
STALL_CHECK_S = 0.2  # a worker that takes none of a call's bytes this long, with none ahead of it, is stuck

EXIT_CAUSES = ("stopped", "load_failed", "killed", "died", "start_failed", "shutdown", "over_memory", "misbehaved")
"""Why a worker process exited (`WorkerPool.worker_exits`): the pool stopped it (evicted, released,
replaced after a redeploy, pushed out of the host tier), its load failed, it was killed (a call's
timeout), it exited by itself, it could not be started, the node shut down, its GPU memory (as
the node measured it) was over its declared size and more than its GPU had room for, or it sent
its node more than UNASKED_FRAMES_ALLOWED frames the node had not asked for (and was killed)."""

UNASKED_FRAMES_ALLOWED = 16
"""How many frames a worker may send that the protocol does not expect of it (a result for no call
the node is waiting on or gave up on, a second hello or ModelLoaded, a type a worker never sends, a
reply) before the node kills it. An honest worker sends none: every frame it sends answers the
node. Its handler can write to the worker's socket, though, and every frame it writes is parsed on
the node's event loop, on the node's CPU, outside the worker's cgroup: a flood of them held the
loop 94 % busy and tripled another function's latency. A few are let pass, not none: 16 cost the
node microseconds, and a frame the node misjudged (a race not foreseen) does not end a serving worker."""

MEMORY_MARGIN_MB = 64
MEMORY_MARGIN_FRACTION = 0.10
"""A model may hold up to max(MEMORY_MARGIN_MB, MEMORY_MARGIN_FRACTION of its declared size) more
than it declared before the node calls it over its declaration (allocator rounding, a library's
workspace: an honest declaration is an estimate)."""


# The outcomes a worker answers a call with (gpu_manager.worker); the others are the node's to say.
WORKER_OUTCOMES = frozenset({pb.OK, pb.INVALID_INPUT, pb.HANDLER_ERROR, pb.OUTPUT_INVALID, pb.OUTPUT_TOO_LARGE})


def held_to_what_the_node_saw(result: pb.CallResult, elapsed_s: float, most_calls: int) -> None:
    """Hold a worker's own figures for one call to what its node saw: the inference time to the
    `elapsed_s` from writing the call to reading its result (the call ran within them), the calls
    batched with it to the `most_calls` that were at the worker at some time while it was, and
    its outcome to one a worker may answer (another is its handler's error).

    The handler runs in the worker's process and can rewrite what it reports (its clock, its
    counts, the protocol's constants); the scheduler prices placements by these figures, and a
    function that inflated its time would look slower than a load and be given replicas, evicting
    others' models (as with memory, the node is the measurer). One that answered an outcome that
    is the node's (WORKER_DIED, REFUSED) would have its call placed again, or its model dropped
    while resident; one the protocol does not name failed the node's Done. A time it understates
    is not caught."""
    if not 0.0 <= result.inference_s <= elapsed_s:  # (NaN too)
        result.inference_s = elapsed_s
    result.batch_calls = max(1, min(result.batch_calls, most_calls))
    if result.outcome not in WORKER_OUTCOMES:
        result.message = f"its worker answered outcome {result.outcome}, which is not a worker's: {result.message}"
        result.outcome = pb.HANDLER_ERROR


def misbehaved_message(worker: Worker) -> str:
    """What a call (or a load) whose worker was killed for frames the node did not ask for is told."""
    return (
        f"model {worker.model!r} on {worker.gpu_id}: its worker (pid {worker.pid}) sent its node more than "
        f"{UNASKED_FRAMES_ALLOWED} frames the node had not asked for (its handler writes to the worker's socket) "
        "and was killed"
    )


def memory_margin_mb(declared_mb: int) -> int:
    """How far over `declared_mb` a model may measure before it counts as over its declaration."""
    return max(MEMORY_MARGIN_MB, math.ceil(declared_mb * MEMORY_MARGIN_FRACTION))


@dataclass(frozen=True, slots=True)
class MemoryBooking:
    """What a worker's model is booked at on its GPU (`booked_mb`, what the node tells the
    scheduler), whether that is the node's own measurement (`measured`) or the declared size,
    and whether the figure seen (the measurement, or else the worker's claim) is over the
    declared size beyond its margin (`over_declared`)."""

    booked_mb: int
    measured: bool
    over_declared: bool


def book_memory(declared_mb: int, reported_mb: int, measured_mb: int | None) -> MemoryBooking:
    """The node's decision on a worker's GPU memory. `measured_mb`: what the node measured itself
    (NVML's figure for the worker's PID, on cuda: its peak so far), None where nothing outside the
    worker measures it (the cpu and emulated backends; cuda where NVML cannot see the PID);
    `reported_mb`: the worker's own report, which its handler can rewrite.

    - Measured: booked at the measurement, over or under the declaration; the report is ignored.
    - Not measured: booked at `declared_mb`. The report is a claim the node cannot check: lower
      (that would overcommit the GPU) or higher (that would take GPU room from other models) it
      moves nothing; one over declared + margin only marks the model as over its declaration."""
    margin_mb = memory_margin_mb(declared_mb)
    if measured_mb is not None:
        return MemoryBooking(max(1, measured_mb), True, measured_mb > declared_mb + margin_mb)
    return MemoryBooking(declared_mb, False, reported_mb > declared_mb + margin_mb)


@dataclass(frozen=True, slots=True)
class ModelRun:
    """What a call needs of its model's worker (from the scheduler's signed grant)."""

    model: str
    package_digest: str
    memory_mb: int
    worker: bytes = b""  # the function's WorkerSettings, passed to the worker unread (empty: defaults)
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


class CallTimedOut(Exception):
    """A call had no result by its deadline. `running`: the worker was running it (it may be stuck
    in the handler), rather than still holding it queued behind others."""

    def __init__(self, running: bool) -> None:
        super().__init__("no result by the deadline")
        self.running = running


async def _drained(conn: Connection, answer: asyncio.Future[tuple[pb.CallResult, bytes]]) -> None:
    """Until `conn`'s buffer is below its high-water mark, or `answer` is done (its deadline came,
    or the worker went)."""
    drained = asyncio.ensure_future(conn.drain())
    try:
        await asyncio.wait((drained, answer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        drained.cancel()


async def _reads_nothing(conn: Connection, frame_end: int) -> bool:
    """Whether the worker at the other end of `conn` took none of its buffered bytes in
    STALL_CHECK_S (a worker that reads takes a socket's worth in microseconds), and the frame
    that ends at `frame_end` is still not all written."""
    taken = conn.sent_bytes - conn.unwritten_bytes()
    await asyncio.sleep(STALL_CHECK_S)
    return conn.sent_bytes - conn.unwritten_bytes() == taken < frame_end and not conn.is_closed


class WorkerState(enum.Enum):
    STARTING = "starting"  # process started, not yet warm
    SPARE = "spare"  # warm (runtime imported, context created), waiting for a model
    LOADING = "loading"  # taking a model
    READY = "ready"  # serving calls
    PARKED = "parked"  # evicted from its GPU, its model kept in host memory (host tier)
    GONE = "gone"  # exited, killed or being stopped


class Worker:
    """One worker process (forked by the zygote, or a container) and the node's end of its socket.

    Lifecycle: STARTING -> SPARE -> LOADING -> READY <-> PARKED, and GONE (any state may jump to
    GONE; a spare claimed while starting goes straight to LOADING; a parked worker taken back
    serves on whichever GPU took it). GONE when its socket closes (it exited, or
    the pool let go of it) or its runtime sees its process exit; `exited` resolves once its process
    is gone too (its device memory is then free). `pid` is known from its hello on.
    """

    takes_stray_replies = True  # its connection passes on replies too (gpufaas.wire.Handler): see on_frame

    def __init__(self, gpu_id: str) -> None:
        self.gpu_id = gpu_id
        self.pid = 0
        self.container = ""  # the docker runtime's container id (its pid is the container's own)
        self.on_signal: Callable[[int], None] | None = None  # how to signal it, where not by pid
        # Told once, when it has sent more than UNASKED_FRAMES_ALLOWED frames the node did not ask for.
        self.on_misbehaved: Callable[[Worker], None] | None = None
        self.unasked_frames = 0
        self.state = WorkerState.STARTING
        self.exit_cause = ""  # set by whoever ends it (one of EXIT_CAUSES); empty: it exited by itself
        self.conn: Connection | None = None
        self.run: ModelRun | None = None
        self.memory_mb = 0  # what its model is booked at on its GPU (see book_memory)
        self.measured_mb = 0  # the most GPU memory the node has measured it hold (0: none yet)
        self.measured_s = 0.0  # when it was last measured (time.monotonic)
        self.over_declared = False  # logged and counted as over its declaration once already
        self.host_mb: int | None = None  # host memory measured while parked (gpu_manager.host_tier)
        self.cgroup = ""  # its control group (gpu_manager.cgroups), once it took a model; "": none
        self.cgroup_limit_mb = 0  # that group's memory limit
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
        # Keyed by the node's own id for each call on this worker (`call`), not the caller's: two
        # calls a client sent with one X-Call-Id must not take each other's result.
        self.pending: dict[str, asyncio.Future[tuple[pb.CallResult, bytes]]] = {}
        # Calls the node stopped waiting for (their deadline came, or their caller went) while
        # still at the worker: it runs them all the same, and their results are still expected.
        self._given_up: set[str] = set()
        self._calls = itertools.count(1)
        self._written = 0  # calls written to it so far ...
        self._answered = 0  # ... and answered

    @property
    def model(self) -> str:
        return self.run.model if self.run is not None else ""

    @property
    def is_gone(self) -> bool:
        """GONE: exited, or let go of (killed, stopped), perhaps before its runtime connected to it
        (a property: its state moves across the runtime's awaits)."""
        return self.state is WorkerState.GONE

    # The node's side of the protocol (gpu_manager.worker has the worker's).
    async def load(self, load: pb.LoadModel) -> pb.ModelLoaded:
        """Send the worker its model and wait for its ModelLoaded (ConnectionLost if it goes first)."""
        assert self.conn is not None
        self.conn.send(MessageType.LOAD_MODEL, load)
        return await self.loaded

    async def call(
        self, call_id: str, payload: bytes, *, content_type: str, deadline: float
    ) -> tuple[pb.CallResult, bytes]:
        """Write one call and wait for its CallResult and output until `deadline` (the event loop's
        clock): raises ConnectionLost if the worker goes first, CallTimedOut at the deadline. Calls
        are written at once, in order: the socket is the worker's queue. The result's inference
        time and batch are the worker's, held to what the node saw (`held_to_what_the_node_saw`)."""
        conn = self.conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[pb.CallResult, bytes]] = loop.create_future()
        self._written = written = next(self._calls)
        key = f"{call_id}#{written}"  # (the caller's id too: the worker's log lines name it)
        # perf_counter, not loop.time(): uvloop's is cached per turn, in whole milliseconds.
        answered_before, sent_s = self._answered, time.perf_counter()
        self.pending[key] = future
        # A timer on the future rather than asyncio.timeout_at (which cancels the task and maps
        # the cancellation back): the same deadline for less, on every call. Armed before the
        # payload is written: a large one waits for the worker to read it, behind the calls before.
        timer = loop.call_at(deadline, time_out, future)
        try:
            conn.send(MessageType.CALL, pb.Call(call_id=key, content_type=content_type), payload)
            frame_end = conn.sent_bytes
            if len(payload) > _DRAIN_OVER_BYTES:
                await _drained(conn, future)
            result, output = await future
            held_to_what_the_node_saw(result, time.perf_counter() - sent_s, self._written - answered_before)
            return result, output
        except TimeoutError:
            # Running: the oldest call unanswered and all of its frame written (the worker reads
            # a call whole before it runs it). One whose frame is still partly in the node's
            # buffer is queued, like any call behind another: its bytes stay there (taking them
            # back mid-frame would cut the stream, and the worker with it), the worker runs it
            # later and its answer is dropped; the worker is not killed for a call it never had.
            # Unless it is the oldest and the worker reads none of it: nothing is ahead of it, so
            # a worker that reads nothing is stuck (as good as running it), and every call behind
            # would wait on it for good.
            oldest = next(iter(self.pending), None) == key
            written = conn.sent_bytes - conn.unwritten_bytes() >= frame_end
            raise CallTimedOut(running=oldest and (written or await _reads_nothing(conn, frame_end))) from None
        finally:
            timer.cancel()
            if self.pending.pop(key, None) is not None:  # no result yet (a result takes it out)
                self._given_up.add(key)

    # wire.Handler
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        """A frame from the worker: a result for a call the node wrote, its one hello, its one
        ModelLoaded. Any other is counted (`unasked_frames`): past UNASKED_FRAMES_ALLOWED the
        node is told (`on_misbehaved`), once. Replies come here too (`takes_stray_replies`: the
        node asks the worker nothing, so a reply is one more frame it did not ask for)."""
        if frame.type == MessageType.CALL_RESULT:
            # Parsed here, once: the caller gets the message with its output.
            result = frame.message(pb.CallResult)
            future = self.pending.pop(result.call_id, None)
            if future is not None:
                if not future.done():  # (done: its deadline has just come; a late result, expected)
                    self._answered += 1
                    future.set_result((result, frame.body))
                return
            if result.call_id in self._given_up:
                self._given_up.discard(result.call_id)
                return
        elif frame.type == MessageType.WORKER_HELLO and not self.hello.done():
            # The first hello only: it comes before any handler code runs in the process. A later
            # one would be the handler's, naming another PID for the node to measure.
            hello = frame.message(pb.WorkerHello)
            self.pid = hello.pid
            self.warm_s = time.perf_counter()
            self.hello.set_result(hello)
            return
        elif frame.type == MessageType.MODEL_LOADED and not self.loaded.done():
            self.loaded.set_result(frame.message(pb.ModelLoaded))
            return
        self.unasked_frames += 1
        if self.unasked_frames == UNASKED_FRAMES_ALLOWED + 1 and self.on_misbehaved is not None:
            self.on_misbehaved(self)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.gone(ConnectionLost(f"worker pid {self.pid} closed its socket"))

    def gone(self, exc: BaseException, *, calls: bool = True) -> None:
        """The process is gone or let go of: every future waiting on it fails with `exc`. Not
        `calls`: its calls are left waiting, for a process being killed whose socket is still read
        until it closes (`on_close`, or its runtime's own `gone` at its exit): a result it wrote
        before it died answers its call, as every call it finished was done."""
        self.state = WorkerState.GONE
        for future in (self.hello, self.loaded, self.ready):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: nobody may be waiting
        if not calls:
            return
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
