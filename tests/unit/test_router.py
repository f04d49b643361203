"""gateway.router and gateway.invoke against a fake scheduler and fake nodes that speak the real
protocol (gpufaas.wire frames over loopback sockets): placements and retries, the one deadline,
scheduler reconnections, node connections, and what the invocation route answers over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
from google.protobuf.message import Message

from gateway import router as router_module
from gateway.app import GatewayConfig, create_app
from gateway.invoke import MAX_CALL_ID_CHARS
from gateway.router import (
    DEADLINE_GRACE_S,
    MAYBE_SENT,
    NOT_SENT,
    OUTCOME_UNKNOWN,
    RECONNECT_S,
    CallFailed,
    CallResult,
    Router,
)
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.tls import LinkTls, configure, ensure_tls
from gpufaas.wire import MESSAGES, Connection, Frame, MessageType, Server
from tests.fakes import MemoryStore
from tests.scrape import sample

SCENARIO_TIMEOUT_S = 10.0
WAIT_S = 3.0
MAX_PAYLOAD_BYTES = 1024 * 1024
# Every byte value, and larger than what the wire copies into a frame's one write (64 KiB).
PAYLOAD = bytes(range(256)) * 400
DIGEST = "sha256:" + "ab" * 32
CLOSE = "close"  # a FakeNode script entry: drop the connection instead of answering

NodeAnswer = tuple[pb.ExecuteReply, bytes] | str | pb.Error  # (reply, body), CLOSE, or an Error frame


def run(scenario: Coroutine[Any, Any, None]) -> None:
    """Run a scenario on uvloop (what the gateway runs on), bounded in time."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario, SCENARIO_TIMEOUT_S))


async def until(predicate: Callable[[], object], what: str, timeout_s: float = WAIT_S) -> None:
    """Yield to the loop until `predicate()` holds; an AssertionError naming `what` otherwise."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"waited {timeout_s} s for {what}") from None


# --- builders -----------------------------------------------------------------------------------


def make_spec(name: str = "resnet", *, timeout_s: float = 5.0) -> FunctionSpec:
    return FunctionSpec(name=name, package_digest=DIGEST, memory_mb=100, timeout_s=timeout_s)


def make_reply(outcome: int = pb.OK, message: str = "", **fields: Any) -> pb.ExecuteReply:
    return pb.ExecuteReply(outcome=outcome, message=message, **fields)  # type: ignore[arg-type]


def no_result(outcome: int, message: str) -> tuple[pb.ExecuteReply, bytes]:
    """A node's answer of a call that did not run to its result: the outcome, and no body."""
    return make_reply(outcome, message), b""


# --- the fakes ----------------------------------------------------------------------------------


@dataclass
class Received:
    """One frame a fake got: its type, its parsed header, and its raw header and body bytes."""

    type: MessageType
    message: Message
    raw: bytes
    conn: Connection


class FakeScheduler:
    """Plays the scheduler on a real socket: keeps every frame a gateway sends (Place, Abandon, ...)
    and answers only when the test says so (`send`), or at once through `respond` when set.
    `drop()` closes the gateways' connections and keeps listening; `stop()` and `start(address)`
    take it down and bring it back on the same port."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.accepted = 0  # connections accepted, over restarts
        self.respond: Callable[[pb.Place], list[pb.Placement | pb.Rejection]] | None = None
        self.address = ""
        self._server: Server | None = None
        self._barriers = 0

    async def start(self, listen: str = "127.0.0.1:0") -> FakeScheduler:
        self._server = Server(self._session)
        self.address = await self._server.start(listen)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None

    def drop(self) -> None:
        assert self._server is not None
        for conn in list(self._server.connections):
            conn.close()

    def _session(self) -> FakeScheduler:
        self.accepted += 1
        return self

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        type_ = MessageType(frame.type)
        message = frame.message(MESSAGES[type_])
        self.received.append(Received(type_, message, frame.header + frame.body, conn))
        if isinstance(message, pb.Place) and self.respond is not None:
            self.send(*self.respond(message))

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass

    @property
    def gateway(self) -> Connection:
        """The gateway's one open connection."""
        assert self._server is not None, "the fake scheduler is not running"
        (conn,) = [c for c in self._server.connections if not c.is_closed]
        return conn

    def send(self, *messages: pb.Placement | pb.Rejection) -> None:
        for message in messages:
            type_ = MessageType.PLACEMENT if isinstance(message, pb.Placement) else MessageType.REJECTION
            self.gateway.send(type_, message)

    def frames(self) -> list[Received]:
        """What the gateway sent, without the barriers' traffic."""
        return [r for r in self.received if not getattr(r.message, "call_id", "").startswith("barrier-")]

    @property
    def places(self) -> list[pb.Place]:
        return [r.message for r in self.frames() if isinstance(r.message, pb.Place)]

    @property
    def abandons(self) -> list[pb.Abandon]:
        return [r.message for r in self.frames() if isinstance(r.message, pb.Abandon)]

    def types(self) -> list[MessageType]:
        return [r.type for r in self.frames()]

    async def wait_places(self, count: int) -> list[pb.Place]:
        await until(lambda: len(self.places) >= count, f"Place number {count} at the scheduler")
        return self.places

    async def barrier(self) -> None:
        """Return once every frame the gateway sent before now has arrived: a Placement for a call
        nobody waits for comes back as an Abandon on the same (ordered) connection."""
        self._barriers += 1
        call_id = f"barrier-{self._barriers}"
        self.send(pb.Placement(call_id=call_id, attempt=1))
        await until(
            lambda: any(getattr(r.message, "call_id", "") == call_id for r in self.received),
            "the router to hand back a placement nobody waits for",
        )


class FakeNode:
    """Plays a node on a real socket: answers each Execute with what `script` holds for its token
    (a reply and a body, CLOSE, or a future the test resolves later to hold the call); a token not
    in the script runs as an echo (OK, the payload back with its content type). Any other request
    (the router's ping) is answered with an Error, as a node does; a `silent` node answers
    nothing (its host cut off, its connections open). `stop()` leaves nothing listening at its
    address, so connecting there is refused."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.script: dict[bytes, NodeAnswer | asyncio.Future[NodeAnswer]] = {}
        self.executes: list[tuple[pb.Execute, bytes]] = []
        self.accepted = 0
        self.pings = 0
        self.silent = False
        self.address = ""
        self._server: Server | None = None
        self._held: set[asyncio.Task[None]] = set()

    async def start(self, listen: str = "127.0.0.1:0", tls: LinkTls | bool = True) -> FakeNode:
        self._server = Server(self._session, max_frame_bytes=MAX_PAYLOAD_BYTES + 1024 * 1024, tls=tls)
        self.address = await self._server.start(listen)
        return self

    async def stop(self) -> None:
        for task in list(self._held):
            task.cancel()
        if self._server is not None:
            await self._server.close()
            self._server = None

    def _session(self) -> FakeNode:
        self.accepted += 1
        return self

    @property
    def tokens(self) -> list[bytes]:
        return [execute.token for execute, _ in self.executes]

    def hold(self, token: bytes) -> asyncio.Future[NodeAnswer]:
        """Keep the call with `token` unanswered until the returned future is resolved."""
        future: asyncio.Future[NodeAnswer] = asyncio.get_running_loop().create_future()
        self.script[token] = future
        return future

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        assert frame.is_request
        if self.silent:
            return
        if frame.type != MessageType.EXECUTE:
            self.pings += 1
            conn.reply_error(frame, pb.INVALID, f"a GPU manager does not answer message type {frame.type}")
            return
        execute = frame.message(pb.Execute)
        self.executes.append((execute, frame.body))
        answer = self.script.get(execute.token)
        if answer is None:
            answer = (make_reply(content_type=execute.content_type, batch_calls=1), frame.body)
        if isinstance(answer, asyncio.Future):
            task = asyncio.create_task(self._answer_later(conn, frame, answer))
            self._held.add(task)
            task.add_done_callback(self._held.discard)
        else:
            self._answer(conn, frame, answer)

    async def _answer_later(self, conn: Connection, frame: Frame, future: asyncio.Future[NodeAnswer]) -> None:
        self._answer(conn, frame, await future)

    def _answer(self, conn: Connection, frame: Frame, answer: NodeAnswer) -> None:
        if isinstance(answer, str):
            assert answer == CLOSE
            conn.close()
            return
        if isinstance(answer, pb.Error):
            conn.reply_error(frame, answer.status, answer.message)
            return
        reply, body = answer
        conn.reply(frame, MessageType.EXECUTE_REPLY, reply, body)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass

    def placement(
        self, call_id: str, attempt: int, *, token: bytes | None = None, queue_s: float = 0.0
    ) -> pb.Placement:
        """A placement of `call_id` on this node's gpu0 (token "<call id>#<attempt>" unless given)."""
        return pb.Placement(
            call_id=call_id,
            attempt=attempt,
            node=self.name,
            node_address=self.address,
            gpu="gpu0",
            hit=True,
            queue_s=queue_s,
            token=token if token is not None else f"{call_id}#{attempt}".encode(),
        )


# --- a router between the fakes ------------------------------------------------------------------


@dataclass
class Cluster:
    scheduler: FakeScheduler
    node_a: FakeNode
    node_b: FakeNode
    router: Router
    tasks: list[asyncio.Task[CallResult]] = field(default_factory=list)

    def invoke(
        self,
        call_id: str,
        spec: FunctionSpec | None = None,
        payload: bytes = PAYLOAD,
        content_type: str = "application/octet-stream",
    ) -> asyncio.Task[CallResult]:
        """Start the call (as the invocation route does) and leave it running."""
        task = asyncio.create_task(
            self.router.invoke(spec or make_spec(), call_id, payload, content_type, clock=time.monotonic)
        )
        self.tasks.append(task)
        return task

    async def placed(
        self, call_id: str, spec: FunctionSpec | None = None, payload: bytes = PAYLOAD, *, places: int = 1
    ) -> asyncio.Task[CallResult]:
        """Start the call and wait for its Place: the scheduler's Place number `places`."""
        task = self.invoke(call_id, spec, payload)
        await self.scheduler.wait_places(places)
        return task

    def place_on(self, node: FakeNode, call_id: str, attempt: int, answer: NodeAnswer | None = None) -> None:
        """Send the placement of `call_id`'s attempt on `node`; the node answers its Execute with
        `answer` where given (an echo otherwise, or what the test scripted)."""
        if answer is not None:
            node.script[f"{call_id}#{attempt}".encode()] = answer
        self.scheduler.send(node.placement(call_id, attempt))

    async def executing(self, node: FakeNode) -> None:
        await until(lambda: node.executes, f"the Execute at {node.name}")

    async def abandoned(self, what: str) -> pb.Abandon:
        """Wait for the scheduler's first Abandon and return it: the only one."""
        await until(lambda: self.scheduler.abandons, what)
        (abandon,) = self.scheduler.abandons
        return abandon


@contextlib.asynccontextmanager
async def cluster(*, scheduler_wait_s: float = 2.0, connected: bool = True) -> AsyncIterator[Cluster]:
    """A FakeScheduler, two FakeNodes (a and b) and a started Router linked to the scheduler (and
    connected, unless `connected` is False). Calls still running at the end are cancelled."""
    scheduler = await FakeScheduler().start()
    node_a, node_b = await FakeNode("node-a").start(), await FakeNode("node-b").start()
    router = Router(
        max_payload_bytes=MAX_PAYLOAD_BYTES, scheduler_address=scheduler.address, scheduler_wait_s=scheduler_wait_s
    )
    router.start()
    env = Cluster(scheduler, node_a, node_b, router)
    try:
        if connected:
            await until(lambda: router.scheduler is not None, "the router to connect to the scheduler")
        yield env
    finally:
        for task in env.tasks:
            task.cancel()
        await asyncio.gather(*env.tasks, return_exceptions=True)
        await router.stop()
        for fake in (node_a, node_b, scheduler):
            await fake.stop()


async def failure(task: asyncio.Task[CallResult]) -> CallFailed:
    with pytest.raises(CallFailed) as caught:
        await task
    return caught.value


async def reconnected(env: Cluster, connections: int) -> None:
    """Wait until the router is linked again, over the fake scheduler's connection `connections`."""
    await until(
        lambda: env.scheduler.accepted >= connections and env.router.scheduler is not None,
        f"the router to reconnect (connection {connections})",
    )


ClusterTest = Callable[..., Coroutine[Any, Any, None]]


def in_cluster(
    *, tuned: dict[str, float] | None = None, **options: Any
) -> Callable[[ClusterTest], Callable[..., None]]:
    """Make `async def test_x(env, ...)` a test that `run`s inside `cluster(**options)`; its other
    parameters stay pytest's (fixtures, parametrize). `tuned` sets gateway.router's timing
    constants for the test, before the cluster starts."""

    def decorate(body: ClusterTest) -> Callable[..., None]:
        @functools.wraps(body)
        def test(**params: Any) -> None:
            async def scenario() -> None:
                async with cluster(**options) as env:
                    await body(env, **params)

            with pytest.MonkeyPatch.context() as patch:
                for name, value in (tuned or {}).items():
                    patch.setattr(router_module, name, value)
                run(scenario())

        signature = inspect.signature(body)
        test.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])  # type: ignore[attr-defined]
        return test

    return decorate


# --- one call, end to end -------------------------------------------------------------------------


@in_cluster()
async def test_a_call_is_placed_by_the_scheduler_and_run_on_the_node_without_the_scheduler_seeing_the_payload(
    env: Cluster,
) -> None:
    spec = make_spec("resnet", timeout_s=5.0)
    task = env.invoke("call-1", spec, PAYLOAD, "image/png")
    (place,) = await env.scheduler.wait_places(1)
    assert (place.call_id, place.function, place.payload_bytes) == ("call-1", "resnet", len(PAYLOAD))
    assert 4.5 < place.timeout_s <= 5.0, "Place carries what remains of the call's deadline"

    sent = env.node_a.placement("call-1", 1, token=b"signed-grant", queue_s=0.25)
    reply = make_reply(content_type="application/json", loaded=True, load_time_s=1.5, batch_calls=2)
    env.node_a.script[b"signed-grant"] = (reply, b'{"label": "cat"}')
    env.scheduler.send(sent)
    result = await task

    assert result.output == b'{"label": "cat"}'
    assert result.placement == sent
    assert result.reply == reply
    ((execute, body),) = env.node_a.executes
    assert (execute.token, execute.content_type) == (b"signed-grant", "image/png")
    assert body == PAYLOAD
    assert env.node_b.executes == []

    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE], "a call that ran is not abandoned"
    seen = b"".join(r.raw for r in env.scheduler.received)
    assert PAYLOAD[:64] not in seen and len(seen) < 1024, "the payload went to the scheduler"


@pytest.mark.parametrize(
    ("status", "http_status"),
    [
        (pb.NOT_FOUND, 404),
        (pb.INVALID, 400),
        (pb.OVERLOADED, 429),
        (pb.UNAVAILABLE, 503),
        (pb.DEADLINE, 504),
        (pb.FUNCTION_FAILED, 500),
        (pb.TOO_LARGE, 413),
        (pb.RESULT_TOO_LARGE, 502),
    ],
    ids=str,
)
@in_cluster()
async def test_a_rejection_is_the_answer_with_its_http_status(env: Cluster, status: int, http_status: int) -> None:
    task = await env.placed("call-1")
    env.scheduler.send(pb.Rejection(call_id="call-1", status=status, message="why, and what to do"))  # type: ignore[arg-type]
    failed = await failure(task)
    assert (failed.status, failed.message) == (http_status, "why, and what to do")
    assert env.node_a.executes == [] and env.node_b.executes == []


@pytest.mark.parametrize("said", ["call id 'call-1'", "call 'call-1'"], ids=["older scheduler", "scheduler"])
@in_cluster()
async def test_a_call_id_the_scheduler_finds_in_flight_is_a_409_as_the_gateways(env: Cluster, said: str) -> None:
    # Seen by another gateway, or a lease's own call's: the scheduler's Rejection INVALID was a 400.
    task = await env.placed("call-1")
    message = f"{said} is already in flight; use a new X-Call-Id"
    env.scheduler.send(pb.Rejection(call_id="call-1", status=pb.INVALID, message=message))
    assert ((failed := await failure(task)).status, failed.message) == (409, message)


@pytest.mark.parametrize(
    ("outcome", "http_status"),
    [
        (pb.HANDLER_ERROR, 500),
        (pb.LOAD_FAILED, 500),
        (pb.OUTPUT_INVALID, 500),
        (pb.INVALID_INPUT, 400),
        (pb.OUTPUT_TOO_LARGE, 502),
    ],
    ids=str,
)
@in_cluster()
async def test_a_failed_outcome_at_the_node_is_the_answer_with_the_nodes_message(
    env: Cluster, outcome: int, http_status: int
) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(outcome, "ValueError: bad image"))
    failed = await failure(task)
    assert (failed.status, failed.message) == (http_status, "ValueError: bad image")
    assert env.node_a.tokens == [b"call-1#1"], "a failed outcome is not retried"
    await env.scheduler.barrier()
    assert env.scheduler.places == [env.scheduler.places[0]]
    assert not [a for a in env.scheduler.abandons if a.reason != pb.Abandon.CANCELLED]


@in_cluster()
async def test_a_timeout_at_the_node_is_a_504_with_the_functions_deadline_message(env: Cluster) -> None:
    spec = make_spec("slowpoke", timeout_s=3.0)
    task = await env.placed("call-1", spec)
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.TIMEOUT, "worker killed after 3 s"))
    failed = await failure(task)
    assert (failed.status, failed.message) == (504, spec.deadline_message())
    assert "'slowpoke'" in failed.message and "3 s" in failed.message


# --- placements that cannot be used -------------------------------------------------------------


@in_cluster()
async def test_a_payload_over_the_nodes_limit_is_a_413_for_that_call_alone_and_the_scheduler_is_told(
    env: Cluster,
) -> None:
    """The gateway's --max-payload-mb above its node's: a payload between the two cut the gateway's
    link to the node, and the other calls running there lost their answers (502, outcome unknown)."""
    held = await env.placed("call-1")
    release = env.node_a.hold(b"call-1#1")
    env.place_on(env.node_a, "call-1", 1)
    await env.executing(env.node_a)
    big = await env.placed("call-2", payload=bytes(3 * MAX_PAYLOAD_BYTES), places=2)
    env.place_on(env.node_a, "call-2", 1)
    async with asyncio.timeout(WAIT_S):
        failed = await failure(big)
    assert failed.status == 413 and "over what node node-a takes" in failed.message
    abandon = await env.abandoned("the Abandon of the call refused as too large")  # its grant never ran
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-2", 1, pb.Abandon.CANCELLED)
    release.set_result((make_reply(), b"done"))
    assert (await held).output == b"done"
    assert env.node_a.tokens == [b"call-1#1"] and env.node_a.accepted == 1


@in_cluster()
async def test_a_result_over_the_gateways_limit_is_a_502_for_that_call_alone(env: Cluster) -> None:
    """A node's --max-payload-mb above its gateway's: a result between the two cut the gateway's
    link to the node, and the other calls running there lost their answers (502, outcome unknown)."""
    env.node_a.script[b"call-1#1"] = (make_reply(), bytes(3 * MAX_PAYLOAD_BYTES))
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    failed = await failure(task)
    assert failed.status == 502 and "ran on node node-a" in failed.message
    assert "over what this gateway takes" in failed.message
    # It ran (its node tells the scheduler): nothing to hand back; the link serves the next call.
    task = await env.placed("call-2", places=2)
    env.place_on(env.node_a, "call-2", 1)
    assert (await task).output == PAYLOAD
    await env.scheduler.barrier()
    assert env.scheduler.abandons == [] and env.node_a.accepted == 1, "one link to the node, kept"


@in_cluster()
async def test_a_result_over_the_gateways_limit_under_a_lease_keeps_the_lease(env: Cluster) -> None:
    await leased(env, "call-1")
    env.node_a.script[b"call-1#1"] = (make_reply(), bytes(3 * MAX_PAYLOAD_BYTES))
    assert (await failure(env.invoke("call-2"))).status == 502
    env.node_a.script.pop(b"call-1#1")
    result = await env.router.invoke(make_spec(), "call-3", PAYLOAD, "image/png", clock=time.monotonic)
    assert result.leased and result.output == PAYLOAD


@in_cluster()
async def test_a_result_over_the_gateways_limit_of_a_leased_placements_own_call_keeps_the_lease(env: Cluster) -> None:
    """The call ran, and its node keeps the lease (the scheduler holds its slot for it): the
    gateway left it unused, and the function's next call was placed (queued behind the lease)."""
    env.node_a.script[b"call-1#1"] = (make_reply(), bytes(3 * MAX_PAYLOAD_BYTES))
    task = await env.placed("call-1")
    placement = env.node_a.placement("call-1", 1)
    placement.lease_s = 5.0
    env.scheduler.send(placement)
    assert (await failure(task)).status == 502
    env.node_a.script.pop(b"call-1#1")
    async with asyncio.timeout(WAIT_S):
        result = await env.router.invoke(make_spec(), "call-2", PAYLOAD, "image/png", clock=time.monotonic)
    assert result.leased and result.output == PAYLOAD
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1 and env.scheduler.abandons == []


@in_cluster()
async def test_a_refused_token_is_abandoned_and_the_next_placement_used(env: Cluster) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.REFUSED, "the grant expired"))
    abandon = await env.abandoned("the Abandon of the refused placement")
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 1, pb.Abandon.REFUSED)
    assert abandon.detail == "the grant expired"
    assert not task.done(), "a refusal is not the call's answer"

    env.place_on(env.node_b, "call-1", 2)
    result = await task
    assert result.output == PAYLOAD and result.placement.attempt == 2
    assert (env.node_a.tokens, env.node_b.tokens) == ([b"call-1#1"], [b"call-1#2"])
    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE, MessageType.ABANDON], "the Place is sent once"


@in_cluster()
async def test_a_node_that_cannot_be_connected_to_is_handed_back_as_never_sent_and_the_call_runs_on_the_next(
    env: Cluster,
) -> None:
    await env.node_a.stop()  # connecting to node a is now refused
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    abandon = await env.abandoned("the Abandon of the unreachable node")
    # Never sent: it cannot have run there (REFUSED), so the scheduler may place it again at once.
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 1, pb.Abandon.REFUSED)
    assert abandon.reason == NOT_SENT and env.node_a.address in abandon.detail

    env.place_on(env.node_b, "call-1", 2)
    result = await task
    assert (result.output, result.placement.node, result.placement.attempt) == (PAYLOAD, "node-b", 2)
    assert env.node_b.tokens == [b"call-1#2"]
    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE, MessageType.ABANDON]


@in_cluster()
async def test_an_execute_refused_by_a_node_link_lost_during_its_last_frames_is_handed_back_as_never_sent(
    env: Cluster,
) -> None:
    """A TLS link can read its peer's close in the read that brought its last frames, and handles
    those frames over the next turns (wire.FRAMES_PER_TURN): until then it is not closed, but it
    writes nothing. An Execute asked of it then never left: never sent (REFUSED), not "may have run"."""
    first = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    await first
    conn = await env.router.nodes.get(env.node_a.address)
    conn._backlog = True  # as `_defer_rest` leaves it: frames of the last read wait for the next turn
    conn.connection_lost(None)  # the loss, read with them
    assert not conn.is_closed

    task = await env.placed("call-2", places=2)
    env.place_on(env.node_a, "call-2", 1)
    abandon = await env.abandoned("the Abandon of the lost link's Execute")
    assert (abandon.call_id, abandon.reason) == ("call-2", NOT_SENT)
    conn._parse_backlog()  # the backlog handled: the link closes
    assert conn.is_closed
    env.place_on(env.node_b, "call-2", 2)
    assert (await task).placement.node == "node-b"


@in_cluster()
async def test_a_call_asking_a_scheduler_link_lost_during_its_last_frames_is_asked_on_the_next_link(
    env: Cluster,
) -> None:
    """As above, on the scheduler's link: the Place is not written; the call waits, and the next link
    asks for it."""
    conn = env.router.scheduler
    assert conn is not None
    conn._backlog = True
    conn.connection_lost(None)
    task = env.invoke("call-1")
    await asyncio.sleep(0.05)
    assert not task.done() and env.scheduler.places == []
    conn._parse_backlog()
    assert conn.transport is not None
    conn.transport.close()
    await reconnected(env, 2)
    await env.scheduler.wait_places(1)
    assert env.scheduler.places[0].call_id == "call-1"
    env.place_on(env.node_a, "call-1", 1)
    assert (await task).placement.node == "node-a"


@in_cluster(tuned={"PING_S": 0.01})
async def test_a_node_link_lost_during_its_last_frames_is_given_up_once_they_are_handled(env: Cluster) -> None:
    """The node's watcher finds its ping refused while the lost link still handles its last frames:
    it waits for the link to close, then marks the node unreachable (before, it read a result
    that was not there yet and died, leaving the node marked usable)."""
    first = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    await first
    conn = await env.router.nodes.get(env.node_a.address)
    conn._backlog = True
    conn.connection_lost(None)
    await asyncio.sleep(0.05)  # pings meanwhile: each refused at once
    assert env.node_a.address not in env.router.nodes.unusable
    conn._parse_backlog()
    assert conn.transport is not None
    conn.transport.close()
    await until(lambda: env.node_a.address in env.router.nodes.unusable, "the node marked unreachable")
    assert "its connection was lost" in env.router.nodes.unusable[env.node_a.address]


@in_cluster()
async def test_a_node_found_unreachable_takes_no_execute_until_it_is_dialled_again_in_the_background(
    env: Cluster,
) -> None:
    address = env.node_a.address
    await env.node_a.stop()
    first = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    await until(lambda: env.scheduler.abandons, "the Abandon of the unreachable node")
    assert address in env.router.nodes.unusable
    # The next placement there is handed back at once: no dial, no connect timeout.
    second = await env.placed("call-2", places=2)
    started = time.monotonic()
    env.place_on(env.node_a, "call-2", 1)
    await until(lambda: len(env.scheduler.abandons) == 2, "the Abandon of the second placement")
    assert time.monotonic() - started < 0.1
    abandon = env.scheduler.abandons[1]
    assert (abandon.call_id, abandon.reason) == ("call-2", NOT_SENT) and "just now" in abandon.detail

    # The node comes back at its address: the background dial finds it, and calls go there.
    await env.node_a.start(address)
    await until(lambda: address not in env.router.nodes.unusable, "the node dialled again", timeout_s=2.0)
    assert env.node_a.accepted == 1
    for call_id, task in (("call-1", first), ("call-2", second)):
        env.place_on(env.node_a, call_id, 2)
        assert (await task).placement.node == "node-a"
    assert env.node_a.accepted == 1, "the connection the background dial made is used"


@in_cluster()
async def test_a_dead_worker_is_not_abandoned_the_router_waits_for_the_next_placement(env: Cluster) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.WORKER_DIED, "exit code -9"))
    await env.executing(env.node_a)
    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE], "the node reports a dead worker itself"
    assert not task.done()

    env.place_on(env.node_b, "call-1", 2)
    result = await task
    assert (result.placement.node, result.placement.attempt, result.output) == ("node-b", 2, PAYLOAD)
    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE]


@in_cluster()
async def test_a_call_whose_worker_died_asked_again_on_a_new_scheduler_link_says_it_is_a_retry(env: Cluster) -> None:
    """The node told the scheduler of the death, and the link went before its answer: the new link's
    Place says the worker died, so that a second death is the call's answer (not a third run)."""
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.WORKER_DIED, "exit code -9"))
    await env.executing(env.node_a)
    env.scheduler.drop()  # (whether the router reads the node's answer before or after: asked again either way)
    (first, again) = await env.scheduler.wait_places(2)
    assert not first.worker_died and again.worker_died
    env.place_on(env.node_b, "call-1", 1)
    assert (await task).placement.node == "node-b"


@in_cluster()
async def test_a_dead_worker_then_a_rejection_makes_the_rejection_the_answer(env: Cluster) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.WORKER_DIED, "exit code -9"))
    await env.executing(env.node_a)
    message = "the function's worker died twice; see the node's log"
    env.scheduler.send(pb.Rejection(call_id="call-1", status=pb.UNAVAILABLE, message=message))
    failed = await failure(task)
    assert (failed.status, failed.message) == (503, message)


@in_cluster()
async def test_a_stale_placement_is_ignored(env: Cluster) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=no_result(pb.REFUSED, "revoked"))
    await until(lambda: env.scheduler.abandons, "the Abandon of the refused placement")
    # Attempt 1 again (a duplicate) and attempt 0: both already tried or replaced.
    env.scheduler.send(
        env.node_b.placement("call-1", 1, token=b"duplicate"),
        env.node_b.placement("call-1", 0, token=b"older"),
        env.node_b.placement("call-1", 2),
    )
    result = await task
    assert result.placement.attempt == 2 and result.placement.token == b"call-1#2"
    assert env.node_b.tokens == [b"call-1#2"]


@in_cluster()
async def test_a_placement_for_a_call_nobody_waits_for_is_handed_back(env: Cluster) -> None:
    env.place_on(env.node_a, "gone-1", 3)
    abandon = await env.abandoned("the Abandon of the unwanted placement")
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("gone-1", 3, pb.Abandon.CANCELLED)
    # A rejection for such a call needs no answer.
    env.scheduler.send(pb.Rejection(call_id="gone-2", status=pb.DEADLINE, message="late"))
    await env.scheduler.barrier()
    assert [a.call_id for a in env.scheduler.abandons] == ["gone-1"]
    assert env.node_a.executes == []


# --- the one deadline, and a client that goes away ----------------------------------------------


@pytest.mark.parametrize("stuck", ["at the scheduler", "at the node"])
@in_cluster()
async def test_past_the_deadline_the_call_is_a_504_and_withdrawn(env: Cluster, stuck: str) -> None:
    spec = make_spec("quick", timeout_s=0.2)
    started = time.monotonic()
    task = await env.placed("call-1", spec)
    if stuck == "at the node":
        env.node_a.hold(b"call-1#1")
        env.place_on(env.node_a, "call-1", 1)
    failed = await failure(task)
    elapsed = time.monotonic() - started
    assert (failed.status, failed.message) == (504, spec.deadline_message())
    budget_s = spec.timeout_s + DEADLINE_GRACE_S
    assert budget_s - 0.05 <= elapsed < budget_s + 1.0, f"answered after {elapsed:.2f} s"
    abandon = await env.abandoned("the Abandon of the call")
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 0, pb.Abandon.CANCELLED)


@in_cluster()
async def test_a_placement_that_comes_past_the_calls_deadline_is_not_sent_to_its_node(env: Cluster) -> None:
    """Placed as its deadline passed (the scheduler counts it from the Place's arrival, a hop later;
    or asked again on a new link in its last moment): no Execute, which the node would start with a
    millisecond left and time out (killing a worker the call had started in), but a 504 and the
    placement handed back (the scheduler frees its slot)."""
    now_s = [100.0]
    spec = make_spec(timeout_s=5.0)
    task = asyncio.create_task(env.router.invoke(spec, "call-1", PAYLOAD, "image/png", clock=lambda: now_s[0]))
    env.tasks.append(task)
    await env.scheduler.wait_places(1)
    now_s[0] += spec.timeout_s  # its deadline passed (the gateway's grace has not)
    env.place_on(env.node_a, "call-1", 1)
    failed = await failure(task)
    assert (failed.status, failed.message) == (504, spec.deadline_message())
    abandon = await env.abandoned("the placement handed back")
    assert (abandon.call_id, abandon.reason) == ("call-1", pb.Abandon.CANCELLED)
    assert env.node_a.executes == []


@pytest.mark.parametrize("waiting", ["for a placement", "at the node"])
@in_cluster()
async def test_a_cancelled_call_is_withdrawn(env: Cluster, waiting: str) -> None:
    task = await env.placed("call-1")
    if waiting == "at the node":
        env.node_a.hold(b"call-1#1")
        env.place_on(env.node_a, "call-1", 1)
        await env.executing(env.node_a)
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    abandon = await env.abandoned("the Abandon of the call")
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 0, pb.Abandon.CANCELLED)
    # The call id is free again.
    again = await env.placed("call-1", places=2)
    env.scheduler.send(env.node_b.placement("call-1", 1, token=b"again"))
    assert (await again).output == PAYLOAD


@in_cluster()
async def test_a_call_id_already_in_flight_is_a_409_and_leaves_the_first_call_alone(env: Cluster) -> None:
    first = await env.placed("call-1")
    failed = await failure(env.invoke("call-1", payload=b"another"))
    assert failed.status == 409 and "'call-1'" in failed.message
    await env.scheduler.barrier()
    assert env.scheduler.types() == [MessageType.PLACE]

    env.place_on(env.node_a, "call-1", 1)
    assert (await first).output == PAYLOAD
    assert [body for _, body in env.node_a.executes] == [PAYLOAD]


# --- the scheduler connection -------------------------------------------------------------------


@in_cluster(scheduler_wait_s=0.3, connected=False)
async def test_a_scheduler_unreachable_at_start_is_a_503_after_scheduler_wait_s(env: Cluster) -> None:
    await env.scheduler.stop()  # nothing listens at the router's scheduler address
    started = time.monotonic()
    failed = await failure(env.invoke("call-1", make_spec(timeout_s=5.0)))
    elapsed = time.monotonic() - started
    assert failed.status == 503 and "scheduler is unreachable" in failed.message
    assert 0.25 <= elapsed < 1.0, f"answered after {elapsed:.2f} s; scheduler_wait_s is 0.3 s"


@in_cluster(scheduler_wait_s=3.0, connected=False)
async def test_a_call_waits_for_a_scheduler_that_comes_up_within_scheduler_wait_s(env: Cluster) -> None:
    address = env.scheduler.address
    await env.scheduler.stop()
    task = env.invoke("call-1")
    await asyncio.sleep(0.3)
    assert not task.done()
    await env.scheduler.start(address)
    (place,) = await env.scheduler.wait_places(1)
    assert place.call_id == "call-1"
    env.place_on(env.node_a, "call-1", 1)
    assert (await task).output == PAYLOAD


@in_cluster(scheduler_wait_s=3.0)
async def test_a_call_asking_as_the_scheduler_link_closes_waits_for_the_next_link(env: Cluster) -> None:
    """The link closes in the turn before the call's first step, before `_keep_linked` wakes to
    it: the call waits for the next link instead of finding the closed one still flagged as up
    (a 503 in compose's leader-kill test)."""
    task = env.invoke("call-1")  # its first step runs in the next turn
    link = env.router.scheduler
    assert link is not None
    link.close()
    (place,) = await env.scheduler.wait_places(1)
    assert place.call_id == "call-1"
    env.place_on(env.node_a, "call-1", 1)
    assert (await task).output == PAYLOAD


@in_cluster()
async def test_a_dial_hanging_on_a_deposed_scheduler_is_dropped_when_another_leads(env: Cluster) -> None:
    """A dead container's address is not refused but silent: the dial of it would wait its whole
    2 s timeout. When the leader key names another scheduler meanwhile, the router drops that dial
    and links to the new leader at once."""
    with socket.socket() as silent:  # its accept queue full: further SYNs go unanswered
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        fillers = [socket.socket() for _ in range(4)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(silent.getsockname())
        try:
            env.router.set_scheduler_address(f"127.0.0.1:{silent.getsockname()[1]}")
            await asyncio.sleep(0.5)  # the dial of the silent address is under way
            assert env.router.scheduler is None
            moved = time.monotonic()
            env.router.set_scheduler_address(env.scheduler.address)
            await reconnected(env, 2)
            linked_s = time.monotonic() - moved
        finally:
            for filler in fillers:
                filler.close()
    # Without dropping the dial: the 1.5 s left of its timeout, then the reconnect pause.
    assert linked_s < 0.8, f"linked to the new leader {linked_s:.2f} s after the key moved"


@pytest.mark.parametrize("how", ["keeps listening", "restarts"])
@in_cluster()
async def test_a_call_waiting_for_its_placement_is_placed_again_after_a_reconnection(env: Cluster, how: str) -> None:
    task = await env.placed("call-1", make_spec("resnet"), b"small payload")
    first = env.scheduler.frames()[0].conn
    if how == "keeps listening":
        env.scheduler.drop()
    else:
        address = env.scheduler.address
        await env.scheduler.stop()
        await asyncio.sleep(2 * RECONNECT_S)
        await env.scheduler.start(address)
    places = await env.scheduler.wait_places(2)
    assert env.scheduler.frames()[1].conn is not first, "the Place is sent on the new connection"
    assert (places[1].call_id, places[1].function, places[1].payload_bytes) == ("call-1", "resnet", 13)
    assert env.scheduler.accepted == 2

    env.place_on(env.node_a, "call-1", 1)
    assert (await task).output == b"small payload"


def spoil_the_next_link(env: Cluster, spoil: Callable[[Connection], object]) -> list[Connection]:
    """Have `spoil` applied to the next scheduler link the router dials (only that one): the list
    it is added to, once made."""
    dial = env.router._dial
    spoiled: list[Connection] = []

    async def dial_spoiling_the_first(address: str) -> Connection | None:
        conn = await dial(address)
        if conn is not None and not spoiled:
            spoiled.append(conn)
            spoil(conn)
        return conn

    env.router._dial = dial_spoiling_the_first  # type: ignore[method-assign]
    return spoiled


@in_cluster()
async def test_a_scheduler_link_closed_as_it_is_made_is_dialled_again(env: Cluster) -> None:
    # A scheduler stopping just as it accepts: the Place sent again for a waiting call raised
    # NotSent, the link task died unheard, and every call after got 503 until the gateway restarted.
    task = await env.placed("call-1", make_spec("resnet"), b"small payload")
    closed = spoil_the_next_link(env, lambda conn: conn.close())
    env.scheduler.drop()
    places = await env.scheduler.wait_places(2)
    assert closed and places[1].call_id == "call-1"
    assert env.router.scheduler is not None and not env.router._link.done()
    env.place_on(env.node_a, "call-1", 1)
    assert (await task).output == b"small payload"


@in_cluster()
async def test_a_scheduler_link_whose_setup_raised_is_closed_before_the_next_dial(env: Cluster) -> None:
    # Whatever raises while a new link asks again for the waiting calls, the link is closed: left
    # open, the scheduler would keep it (and its calls) for as long as the socket lived.
    task = await env.placed("call-1", make_spec("resnet"), b"small payload")

    def send(*_: object) -> None:
        raise RuntimeError("injected")

    failed = spoil_the_next_link(env, lambda conn: setattr(conn, "send", send))
    env.scheduler.drop()
    places = await env.scheduler.wait_places(2)
    assert failed and failed[0].is_closed, "the link that raised was left open"
    assert places[1].call_id == "call-1" and env.scheduler.accepted == 3
    env.place_on(env.node_a, "call-1", 1)
    assert (await task).output == b"small payload"


@in_cluster()
async def test_a_place_sent_again_after_a_reconnection_carries_what_remains_of_the_deadline(env: Cluster) -> None:
    """Place.timeout_s is "what remains of the call's end-to-end deadline" (gpufaas.proto): the
    scheduler derives the grant's expiry from it, so that the node answers before the gateway's
    own deadline. After a reconnection the remaining time is smaller than at the first Place."""
    started = time.monotonic()
    task = await env.placed("call-1", make_spec(timeout_s=5.0))
    await asyncio.sleep(0.4)
    env.scheduler.drop()
    places = await env.scheduler.wait_places(2)
    remaining_s = 5.0 - (time.monotonic() - started)
    assert places[1].timeout_s <= remaining_s + 0.05, (
        f"the Place sent again says {places[1].timeout_s:.3f} s remain; at most {remaining_s:.3f} s do "
        f"(the first said {places[0].timeout_s:.3f} s)"
    )
    assert not task.done()


@pytest.mark.parametrize("outcome", [pb.WORKER_DIED, pb.REFUSED], ids=["WORKER_DIED", "REFUSED"])
@in_cluster()
async def test_a_placement_lost_with_its_scheduler_is_placed_afresh_with_the_new_one(
    env: Cluster, outcome: int
) -> None:
    task = await env.placed("call-1")
    answer = env.node_a.hold(b"call-1#1")
    env.place_on(env.node_a, "call-1", 1)
    await env.executing(env.node_a)

    env.scheduler.drop()
    await reconnected(env, 2)
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1, "a call running on a node is not placed again on reconnection"

    answer.set_result(no_result(outcome, "gone with the old scheduler"))
    places = await env.scheduler.wait_places(2)
    assert places[1].call_id == "call-1"
    assert places[1].timeout_s <= places[0].timeout_s - RECONNECT_S, "the fresh Place has what remains"
    assert env.scheduler.frames()[-1].conn is env.scheduler.gateway
    await env.scheduler.barrier()
    assert env.scheduler.abandons == [], "the new scheduler never placed attempt 1"

    # The new scheduler numbers its attempts from 1 again.
    env.scheduler.send(env.node_b.placement("call-1", 1, token=b"from-the-new-scheduler"))
    result = await task
    assert result.placement.token == b"from-the-new-scheduler" and result.output == PAYLOAD


@in_cluster()
async def test_a_call_refused_while_its_new_link_is_down_too_is_asked_for_once_on_the_next(env: Cluster) -> None:
    """The link changed under a running call, and the new one went too (a deposed leader closing
    what it accepts): the node's refusal finds no link, and the call waits for the next. That link
    asks for every waiting call; the call's own wait must not ask again (a second Place of one
    call id is refused: the client got a 400)."""
    task = await env.placed("call-1", make_spec(timeout_s=5.0))
    answer = env.node_a.hold(b"call-1#1")
    env.place_on(env.node_a, "call-1", 1)
    await env.executing(env.node_a)
    env.scheduler.drop()
    await reconnected(env, 2)
    address = env.scheduler.address
    await env.scheduler.stop()
    answer.set_result(no_result(pb.REFUSED, "fenced: a newer leader attached me"))
    await until(lambda: env.router.scheduler is None, "the router to lose link 2")
    await asyncio.sleep(0.05)  # the call waits for a link
    await env.scheduler.start(address)
    await reconnected(env, 3)
    link = env.scheduler.gateway
    await asyncio.sleep(0.05)
    await env.scheduler.barrier()
    asked = [r.message.call_id for r in env.scheduler.frames() if r.conn is link and isinstance(r.message, pb.Place)]
    assert asked == ["call-1"]
    env.scheduler.send(env.node_b.placement("call-1", 1, token=b"third"))
    assert (await task).placement.token == b"third"


@in_cluster()
async def test_a_node_lost_after_the_execute_and_after_its_scheduler_changed_is_a_502_outcome_unknown(
    env: Cluster,
) -> None:
    """The node went under the call (it may have run it) after the scheduler connection changed:
    the new scheduler never heard of the call and cannot ask the node about the former one's grant,
    so the call is not placed afresh (it could run twice): answered 502, its outcome unknown."""
    task = await env.placed("call-1", make_spec(timeout_s=5.0))
    answer = env.node_a.hold(b"call-1#1")
    env.place_on(env.node_a, "call-1", 1)
    await env.executing(env.node_a)

    env.scheduler.drop()
    await reconnected(env, 2)
    answer.set_result(CLOSE)  # the node goes too, under the call
    failed = await failure(task)
    assert failed.status == 502 and "is unknown" in failed.message and "not run again" in failed.message
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1 and env.scheduler.abandons == []


@in_cluster()
async def test_a_node_not_reached_after_its_scheduler_changed_gets_the_call_placed_afresh(env: Cluster) -> None:
    await env.node_a.stop()
    task = await env.placed("call-1", make_spec(timeout_s=5.0))
    env.router.epoch += 1  # as if the scheduler connection changed while the placement was on its way
    env.place_on(env.node_a, "call-1", 1)
    places = await env.scheduler.wait_places(2)
    assert places[1].call_id == "call-1" and env.scheduler.abandons == []
    env.scheduler.send(env.node_b.placement("call-1", 1, token=b"from-the-new-scheduler"))
    assert (await task).placement.token == b"from-the-new-scheduler"


@in_cluster()
async def test_a_node_lost_after_the_execute_waits_for_the_schedulers_word(env: Cluster) -> None:
    """The connection closed under the Execute: the router reports it (NODE_UNREACHABLE: it may
    have run) and takes what the scheduler decides: a new placement (the node never saw the grant)
    or a Rejection saying the outcome is unknown (502)."""
    placed_again, unknown = env.invoke("call-1"), env.invoke("call-2")
    await env.scheduler.wait_places(2)
    env.place_on(env.node_a, "call-1", 1, answer=CLOSE)
    await until(lambda: len(env.scheduler.abandons) == 1, "the Abandon of call-1")
    assert env.scheduler.abandons[0].reason == MAYBE_SENT == pb.Abandon.NODE_UNREACHABLE
    env.place_on(env.node_b, "call-1", 2)
    assert (await placed_again).placement.attempt == 2

    env.place_on(env.node_b, "call-2", 1, answer=CLOSE)
    await until(lambda: len(env.scheduler.abandons) == 2, "the Abandon of call-2")
    message = "the outcome of call 'call-2' is unknown: it started on node node-b ..."
    env.scheduler.send(pb.Rejection(call_id="call-2", status=OUTCOME_UNKNOWN, message=message))
    failed = await failure(unknown)
    assert (failed.status, failed.message) == (502, message)


@in_cluster()
async def test_a_call_whose_node_was_lost_after_the_execute_is_not_placed_again_by_a_new_scheduler(
    env: Cluster,
) -> None:
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1, answer=CLOSE)
    await until(lambda: env.scheduler.abandons, "the Abandon of call-1")
    env.scheduler.drop()  # before it answered about the node
    failed = await failure(task)
    assert failed.status == 502 and "is unknown" in failed.message
    await reconnected(env, 2)
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1, "not placed again with the new scheduler"


@in_cluster()
async def test_a_new_leader_gets_the_waiting_call_and_the_former_leaders_placements_are_ignored(env: Cluster) -> None:
    """Another scheduler leads (its address put in etcd): the router links to it and sends it the
    calls that wait for a placement; whatever the former leader's link still delivers is not
    heard (a deposed leader back from a pause must not get a call run twice)."""
    task = await env.placed("call-1")
    former = env.router.scheduler
    assert former is not None
    leader = await FakeScheduler().start()
    try:
        env.router.set_scheduler_address(leader.address)
        assert env.router.scheduler_address == leader.address
        places = await leader.wait_places(1)
        assert places[0].call_id == "call-1"
        # A placement the former leader made before it was deposed, arriving late on its link.
        env.router.on_scheduler_message(env.node_a.placement("call-1", 1, token=b"deposed"), former)
        await asyncio.sleep(0.05)
        assert env.node_a.executes == [] and not task.done()
        leader.send(env.node_b.placement("call-1", 1, token=b"from-the-leader"))
        assert (await task).placement.token == b"from-the-leader"
        assert env.node_a.tokens == []
    finally:
        await leader.stop()


# --- node connections ---------------------------------------------------------------------------


@in_cluster()
async def test_one_connection_per_node_is_reused_across_calls(env: Cluster) -> None:
    for i in range(3):
        task = env.invoke(f"call-{i}", payload=f"payload {i}".encode())
        await env.scheduler.wait_places(i + 1)
        env.place_on(env.node_a, f"call-{i}", 1)
        assert (await task).output == f"payload {i}".encode()
    assert env.node_a.accepted == 1
    assert env.node_a.tokens == [b"call-0#1", b"call-1#1", b"call-2#1"]


@in_cluster()
async def test_calls_placed_together_on_a_new_node_share_one_connection(env: Cluster) -> None:
    tasks = [env.invoke(f"call-{i}", payload=f"payload {i}".encode()) for i in range(4)]
    await env.scheduler.wait_places(4)
    # Answered in reverse order, in one pass of the event loop.
    env.scheduler.send(*(env.node_a.placement(f"call-{i}", 1) for i in reversed(range(4))))
    results = await asyncio.gather(*tasks)
    assert [r.output for r in results] == [f"payload {i}".encode() for i in range(4)]
    assert env.node_a.accepted == 1


@in_cluster()
async def test_a_node_connection_that_broke_is_opened_again(env: Cluster) -> None:
    warm = await env.placed("warm-up")
    env.place_on(env.node_a, "warm-up", 1)
    await warm

    task = await env.placed("call-1", places=2)
    env.place_on(env.node_a, "call-1", 1, answer=CLOSE)
    abandon = await env.abandoned("the Abandon of the lost node connection")
    assert (abandon.attempt, abandon.reason) == (1, pb.Abandon.NODE_UNREACHABLE)

    # (The scheduler asks the node whether it saw attempt 1; it did not, so it places it again.)
    await until(lambda: env.node_a.accepted == 2, "the node dialled again in the background", timeout_s=2.0)
    env.place_on(env.node_a, "call-1", 2)
    assert (await task).output == PAYLOAD
    assert env.node_a.accepted == 2
    assert env.node_a.tokens == [b"warm-up#1", b"call-1#1", b"call-1#2"]


@in_cluster()
async def test_a_call_held_by_a_node_that_left_the_cluster_runs_on_its_next_placement(env: Cluster) -> None:
    """A node cut off by a partition answers nothing, and may never reset its connection: once the
    gateway's etcd view loses it, `node_left` closes its connection and the call moves on to the
    placement the scheduler made meanwhile."""
    task = await env.placed("call-1")
    held = env.node_a.hold(b"call-1#1")  # never answered: the node is gone
    env.place_on(env.node_a, "call-1", 1)
    await until(lambda: env.node_a.tokens == [b"call-1#1"], "the Execute on node a")
    env.place_on(env.node_b, "call-1", 2)  # the scheduler saw node a leave first
    await env.scheduler.barrier()
    assert not task.done()

    env.router.node_left(env.node_a.address)
    result = await task
    assert (result.output, result.placement.node, result.placement.attempt) == (PAYLOAD, "node-b", 2)
    (abandon,) = env.scheduler.abandons
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 1, pb.Abandon.NODE_UNREACHABLE)
    assert "left the cluster" in abandon.detail
    assert not held.done()

    # Back in the cluster: dialled again in the background, it takes calls again.
    await until(lambda: env.node_a.accepted == 2, "the node dialled again", timeout_s=2.0)
    again = await env.placed("call-2", places=2)
    env.place_on(env.node_a, "call-2", 1)
    assert (await again).placement.node == "node-a"
    assert env.node_a.accepted == 2


@in_cluster()
async def test_a_node_leaving_closes_only_its_own_connection(env: Cluster) -> None:
    task = await env.placed("call-1")
    release = env.node_a.hold(b"call-1#1")
    env.place_on(env.node_a, "call-1", 1)
    await until(lambda: env.node_a.tokens == [b"call-1#1"], "the Execute on node a")

    env.router.node_left(env.node_b.address)  # connected to by nobody yet
    env.router.node_left("127.0.0.1:1")  # never heard of
    release.set_result((make_reply(batch_calls=1), b"from a"))
    result = await task
    assert (result.output, result.placement.attempt) == (b"from a", 1)
    await env.scheduler.barrier()
    assert env.scheduler.abandons == [] and env.node_a.accepted == 1


@in_cluster(tuned={"REDIAL_S": 30.0})  # the background dial would come too late
async def test_a_node_found_unreachable_is_dialled_at_once_when_it_registers_again(env: Cluster) -> None:
    address = env.node_a.address
    await env.node_a.stop()
    task = await env.placed("call-1")
    env.place_on(env.node_a, "call-1", 1)
    await until(lambda: env.scheduler.abandons, "the Abandon of the unreachable node")
    env.router.node_joined(address)  # registered, but still down: nothing changes
    await asyncio.sleep(0.1)
    assert address in env.router.nodes.unusable

    await env.node_a.start(address)
    env.router.node_joined(address)  # back: its key put again
    await until(lambda: address not in env.router.nodes.unusable, "the node dialled at once", timeout_s=2.0)
    env.place_on(env.node_a, "call-1", 2)
    assert (await task).placement.node == "node-a"


@in_cluster(tuned={"PING_S": 0.05, "PING_TIMEOUT_S": 0.2, "SILENT_CLOSE_S": 60.0})
async def test_a_node_that_answers_nothing_takes_no_new_execute_until_it_answers_again(env: Cluster) -> None:
    """A node cut off without a reset (a partition; a one-way cut never resets the connection):
    pings go unanswered, so its placements are handed back at once, never sent, and run elsewhere;
    the calls already on it wait (their answer may still come). Once it answers, calls go there."""
    held_task = await env.placed("held")
    held = env.node_a.hold(b"held#1")
    env.place_on(env.node_a, "held", 1)
    await until(lambda: env.node_a.pings >= 2, "pings answered")
    assert env.node_a.address not in env.router.nodes.unusable

    env.node_a.silent = True
    await until(lambda: env.node_a.address in env.router.nodes.unusable, "the node found silent")
    task = await env.placed("call-1", places=2)
    env.place_on(env.node_a, "call-1", 1)
    abandon = await env.abandoned("the Abandon of the placement on the silent node")
    assert (abandon.call_id, abandon.reason) == ("call-1", NOT_SENT) and "answered no ping" in abandon.detail
    env.place_on(env.node_b, "call-1", 2)
    assert (await task).placement.node == "node-b"
    assert env.node_a.tokens == [b"held#1"] and not held_task.done()

    env.node_a.silent = False  # it answers again: the held call's answer, then calls
    held.set_result((make_reply(batch_calls=1), b"late"))
    assert (await held_task).output == b"late"
    await until(lambda: env.node_a.address not in env.router.nodes.unusable, "the node usable again")
    again = await env.placed("call-2", places=3)
    env.place_on(env.node_a, "call-2", 1)
    assert (await again).placement.node == "node-a"
    assert env.node_a.accepted == 1


@in_cluster(tuned={"PING_S": 0.05, "PING_TIMEOUT_S": 0.1, "SILENT_CLOSE_S": 0.5})
async def test_a_node_silent_for_silent_close_s_has_its_connection_closed_and_its_calls_reported(env: Cluster) -> None:
    """A reply stuck behind a one-way cut never comes and the kernel may take long to end the
    connection: once the node has answered nothing for SILENT_CLOSE_S the router closes it, and
    the call on it is reported as maybe run (the scheduler asks the node's ledger)."""
    task = await env.placed("call-1")
    env.node_a.hold(b"call-1#1")
    env.node_a.silent = True
    env.place_on(env.node_a, "call-1", 1)
    abandon = await env.abandoned("the Abandon of the call on the silent node")
    assert (abandon.call_id, abandon.attempt, abandon.reason) == ("call-1", 1, MAYBE_SENT)
    assert "answered nothing" in abandon.detail
    assert not task.done()  # the scheduler's word decides
    env.place_on(env.node_b, "call-1", 2)
    assert (await task).placement.node == "node-b"


async def throttled_proxy(target: str, rate_bytes_s: int) -> tuple[asyncio.Server, str]:
    """A TCP proxy to `target` that passes what is sent there at `rate_bytes_s` (answers at full
    speed): a slow link. Returns the server and its address."""
    host, _, port = target.rpartition(":")

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: int | None) -> None:
        try:
            while chunk := await reader.read(16 * 1024):
                writer.write(chunk)
                await writer.drain()
                if rate:
                    await asyncio.sleep(len(chunk) / rate)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A small receive window, as a slow link's: what waits for it stays with the sender.
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, upstream_writer, rate_bytes_s), pipe(upstream_reader, writer, None))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tls(tmp_path_factory.mktemp("cluster") / "tls").directory


@contextlib.asynccontextmanager
async def slow_node(env: Cluster, tls_dir: Path | None) -> AsyncIterator[tuple[FakeNode, str]]:
    """node-a (with `tls_dir`, one of that name whose links, and the router's, are TLS) behind a
    link of 512 KiB/s (`throttled_proxy`): the node and the link's address. The router's socket
    buffers 64 KiB, as a real slow link's does (on loopback it grows to 4 MB: a payload of 1 MiB
    would sit in it whole); what waits beyond it stays in the router's transport."""
    node = env.node_a if tls_dir is None else await FakeNode("node-a").start(tls=LinkTls.load(tls_dir, "node"))
    if tls_dir is not None:
        configure(LinkTls.load(tls_dir, "gateway"))  # the router's (this process's) link TLS
    dial = env.router.nodes._dial

    async def dial_with_a_small_buffer(address: str) -> Connection:
        conn = await dial(address)
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        return conn

    env.router.nodes._dial = dial_with_a_small_buffer  # type: ignore[method-assign]
    proxy, address = await throttled_proxy(node.address, 512 * 1024)
    try:
        yield node, address
    finally:
        proxy.close()
        if tls_dir is not None:
            configure(None)
            await node.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@in_cluster(tuned={"PING_S": 0.1, "PING_TIMEOUT_S": 0.2, "SILENT_CLOSE_S": 0.5})
async def test_a_node_busy_taking_a_large_payload_on_a_slow_link_is_not_taken_for_silent(
    env: Cluster, tls: bool, tls_dir: Path
) -> None:
    # 1 MiB at 512 KiB/s: 2 s on the link, and the pings' answers wait behind it. Only replies
    # counted: the node was judged silent, its connection cut, and the call reported maybe run.
    # Under TLS the bytes in the router's transport were not seen as waiting (its TLS transport
    # counts only its own buffer): counted as moved, the link's progress went down at each refill
    # of the socket's buffer, and the node was judged silent again.
    payload = os.urandom(MAX_PAYLOAD_BYTES)
    async with slow_node(env, tls_dir if tls else None) as (node, address):
        task = await env.placed("big-1", payload=payload)
        placement = node.placement("big-1", 1)
        placement.node_address = address
        env.scheduler.send(placement)
        result = await task
        assert result.output == payload and result.placement.node == "node-a"
        assert env.scheduler.abandons == [] and address not in env.router.nodes.unusable


# --- leases (docs/hit-leases.md) -------------------------------------------------------------------


async def leased(env: Cluster, call_id: str, lease_s: float = 5.0) -> CallResult:
    """Run `call_id` on node a under a placement that is also a lease (the scheduler's first Place)."""
    task = await env.placed(call_id, places=len(env.scheduler.places) + 1)
    placement = env.node_a.placement(call_id, 1)
    placement.lease_s = lease_s
    env.scheduler.send(placement)
    return await task


@in_cluster()
async def test_a_leases_calls_go_straight_to_its_node_under_its_token_without_a_place(env: Cluster) -> None:
    first = await leased(env, "call-1")
    (place,) = env.scheduler.places
    assert place.lease, "the gateway says it takes leases"
    assert not first.leased
    for call_id in ("call-2", "call-3"):
        result = await env.router.invoke(make_spec(), call_id, PAYLOAD, "image/png", clock=time.monotonic)
        assert result.leased and result.output == PAYLOAD
        assert (result.placement.node, result.placement.gpu, result.placement.attempt) == ("node-a", "gpu0", 1)
    executes = [execute for execute, _ in env.node_a.executes]
    assert [(e.token, e.lease_call_id) for e in executes] == [
        (b"call-1#1", ""),
        (b"call-1#1", "call-2"),
        (b"call-1#1", "call-3"),
    ]
    assert all(0 < e.timeout_s <= 5.0 for e in executes), "each says what remains of its own deadline"
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1 and env.scheduler.abandons == []
    # Another function (or another version of this one) has no lease here: it is placed.
    other = await env.placed("call-4", make_spec("other"), places=2)
    env.place_on(env.node_b, "call-4", 1)
    assert not (await other).leased


@in_cluster()
async def test_a_lease_serves_one_call_at_a_time_the_next_is_placed(env: Cluster) -> None:
    await leased(env, "call-1")
    release = env.node_a.hold(b"call-1#1")  # the lease's next call is held at the node
    under = env.invoke("call-2")
    await until(lambda: len(env.node_a.executes) == 2, "the call under the lease at the node")
    beside = await env.placed("call-3", places=2)  # the lease is busy: asked of the scheduler
    env.place_on(env.node_b, "call-3", 1)
    assert not (await beside).leased
    release.set_result((make_reply(), b"done"))
    assert (await under).leased


@in_cluster()
async def test_a_lease_the_node_refuses_is_dropped_and_the_call_placed(env: Cluster) -> None:
    await leased(env, "call-1")
    env.node_a.script[b"call-1#1"] = no_result(pb.REFUSED, "the lease of call call-1 attempt 1 has ended")
    task = await env.placed("call-2", places=2)
    env.place_on(env.node_b, "call-2", 1)
    result = await task
    assert not result.leased and result.placement.node == "node-b"
    await env.scheduler.barrier()
    assert env.scheduler.abandons == [], "nothing ran: nothing to hand back"
    again = await env.placed("call-3", places=3)  # the lease is gone
    env.place_on(env.node_b, "call-3", 1)
    assert not (await again).leased


@in_cluster()
async def test_a_call_under_a_lease_whose_node_was_lost_after_it_was_sent_is_a_502_outcome_unknown(
    env: Cluster,
) -> None:
    await leased(env, "call-1")
    env.node_a.script[b"call-1#1"] = CLOSE
    caught = await failure(env.invoke("call-2"))
    assert caught.status == 502 and "is unknown" in caught.message and "under a lease" in caught.message
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1 and env.scheduler.abandons == [], "never run twice"


@in_cluster()
async def test_a_call_under_a_lease_its_node_answers_with_an_error_is_answered_with_what_the_node_said(
    env: Cluster,
) -> None:
    # It was a 502 saying the gateway lost the node, whose link was up (and kept).
    await leased(env, "call-1")
    env.node_a.script[b"call-1#1"] = pb.Error(status=pb.UNAVAILABLE, message="internal error; see the daemon's log")
    caught = await failure(env.invoke("call-2"))
    assert caught.status == 503 and "lost" not in caught.message
    said = "node node-a answered the call (under a lease) with an error: internal error; see the daemon's log"
    assert said in caught.message
    env.node_a.script.pop(b"call-1#1")  # the lease was dropped: the next call is placed
    task = await env.placed("call-3", places=2)
    env.place_on(env.node_a, "call-3", 1)
    assert not (await task).leased and env.node_a.accepted == 1, "one link to the node, kept"


@in_cluster()
async def test_a_lease_on_a_node_found_unreachable_is_dropped_and_the_call_placed(env: Cluster) -> None:
    await leased(env, "call-1")
    env.router.node_left(env.node_a.address)
    task = await env.placed("call-2", places=2)
    env.place_on(env.node_b, "call-2", 1)
    assert (await task).placement.node == "node-b"
    assert len(env.node_a.executes) == 1


@in_cluster()
async def test_a_call_whose_worker_died_under_a_lease_is_placed_as_its_retry(env: Cluster) -> None:
    await leased(env, "call-1")
    env.node_a.script[b"call-1#1"] = no_result(pb.WORKER_DIED, "the worker exited")
    task = env.invoke("call-2")
    (_, place) = await env.scheduler.wait_places(2)
    assert place.call_id == "call-2" and place.worker_died, "a second death must be its answer"
    env.place_on(env.node_b, "call-2", 1)
    assert (await task).placement.node == "node-b"
    assert not env.scheduler.places[0].worker_died


@in_cluster()
async def test_a_payload_over_the_nodes_limit_under_a_lease_is_a_413_and_the_lease_stays(env: Cluster) -> None:
    await leased(env, "call-1")
    failed = await failure(env.invoke("call-2", payload=bytes(3 * MAX_PAYLOAD_BYTES)))
    assert failed.status == 413 and "over what node node-a takes" in failed.message
    # The node skipped it unread (no call ran under the lease): the next call runs under it.
    result = await env.router.invoke(make_spec(), "call-3", PAYLOAD, "image/png", clock=time.monotonic)
    assert result.leased and result.output == PAYLOAD
    await env.scheduler.barrier()
    assert len(env.scheduler.places) == 1 and env.scheduler.abandons == [], "nothing placed, nothing to hand back"


@in_cluster()
async def test_a_call_given_up_under_a_lease_drops_the_lease(env: Cluster) -> None:
    await leased(env, "call-1")
    env.node_a.hold(b"call-1#1")  # the call under the lease never answers
    task = env.invoke("call-2")
    await until(lambda: len(env.node_a.executes) == 2, "the call under the lease at the node")
    task.cancel()  # its client went away: whether the lease is free again is unknown
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(env.router.leases) == 0
    again = await env.placed("call-3", places=2)
    env.place_on(env.node_b, "call-3", 1)
    assert not (await again).leased


@in_cluster()
async def test_a_lease_from_a_former_scheduler_link_is_not_used(env: Cluster) -> None:
    await leased(env, "call-1")
    env.scheduler.drop()
    await reconnected(env, 2)
    task = await env.placed("call-2", places=2)
    env.place_on(env.node_b, "call-2", 1)
    assert not (await task).leased


# --- POST /function/{name} over the router --------------------------------------------------------


@contextlib.asynccontextmanager
async def http_gateway(
    tmp_path: Path, scheduler: FakeScheduler, *specs: FunctionSpec, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway app (MemoryStore holding `specs`) linked to `scheduler`, as an httpx client."""
    store = MemoryStore()
    keys = Keys("/unit")
    for spec in specs:
        await store.put(keys.function(spec.name), spec.to_json())
    config = GatewayConfig(
        state_dir=tmp_path,
        scheduler_address=scheduler.address,
        keys=keys,
        max_payload_bytes=max_payload_bytes,
        scheduler_wait_s=2.0,
    )
    app = create_app(store, config)
    try:
        async with app.router.lifespan_context(app):
            router: Router = app.state.gateway.router
            await until(lambda: router.scheduler is not None, "the gateway to connect to the scheduler")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                yield client
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def fakes() -> AsyncIterator[tuple[FakeScheduler, FakeNode]]:
    scheduler, node = await FakeScheduler().start(), await FakeNode("node-a").start()
    try:
        yield scheduler, node
    finally:
        await node.stop()
        await scheduler.stop()


def assert_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"error": message, "status": status}


# A miss's stages in the order its Server-Timing header names them.
MISS_STAGE_ORDER = ["fetch", "prefetch", "start", "context", "load", "inference", "spare-start", "spare-context"]


def server_timing(header: str) -> dict[str, float]:
    """Server-Timing "name;dur=ms, ..." as {name: ms}, in order."""
    stages: dict[str, float] = {}
    for part in header.split(", "):
        name, _, duration = part.partition(";dur=")
        stages[name] = float(duration)
    return stages


def test_http_a_miss_answers_the_result_with_its_headers_and_server_timing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            seconds = {
                "fetch_s": 0.5,
                "prefetch_s": 0.25,
                "start_s": 0.125,
                "context_s": 0.0625,
                "load_s": 1.5,
                "spare_start_s": 0.75,
                "spare_context_s": 0.375,
            }
            stages = pb.MissStages(**seconds)
            reply = make_reply(
                content_type="application/json",
                loaded=True,
                load_time_s=1.75,
                inference_time_s=0.03125,
                batch_calls=3,
                stages=stages,
            )
            node.script[b"grant"] = (reply, b'{"label": "cat"}')
            scheduler.respond = lambda place: [node.placement(place.call_id, 1, token=b"grant", queue_s=0.25)]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                response = await client.post(
                    "/function/resnet", content=PAYLOAD, headers={"X-Call-Id": "http-1", "Content-Type": "image/png"}
                )
            assert response.status_code == 200, response.text
            assert response.content == b'{"label": "cat"}'
            headers = response.headers
            assert headers["content-type"] == "application/json"
            assert headers["x-call-id"] == "http-1"
            assert headers["x-gpu"] == "node-a/gpu0"
            assert headers["x-cache"] == "miss"
            assert float(headers["x-queue-seconds"]) == 0.25
            assert float(headers["x-load-seconds"]) == 1.75
            assert float(headers["x-inference-seconds"]) == 0.03125
            assert headers["x-batch-calls"] == "3"
            assert float(headers["x-duration-seconds"]) >= 0
            assert "x-attempts" not in headers, "one placement: no X-Attempts"
            assert [p.given_call_id for p in scheduler.places] == [True], "the client named it"
            assert server_timing(headers["server-timing"]) == pytest.approx(
                {
                    "fetch": 500.0,
                    "prefetch": 250.0,
                    "start": 125.0,
                    "context": 62.5,
                    "load": 1500.0,
                    "inference": 31.25,
                    "spare-start": 750.0,
                    "spare-context": 375.0,
                }
            )
            assert list(server_timing(headers["server-timing"]))[:6] == MISS_STAGE_ORDER[:6]
            ((execute, body),) = node.executes
            assert (execute.token, execute.content_type, body) == (b"grant", "image/png", PAYLOAD)
            (place,) = scheduler.places
            assert (place.call_id, place.function, place.payload_bytes) == ("http-1", "resnet", len(PAYLOAD))

    run(scenario())


def test_http_a_content_type_that_is_no_header_value_is_a_502_and_never_a_header(tmp_path: Path) -> None:
    """The content type is the worker's word, and the worker runs the user's code."""

    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            node.script[b"grant"] = (make_reply(content_type="text/plain\r\nset-cookie: a=b"), b"out")
            scheduler.respond = lambda place: [node.placement(place.call_id, 1, token=b"grant")]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                response = await client.post("/function/resnet", content=b"input")
            assert response.status_code == 502, response.text
            assert "content type" in response.json()["error"]
            assert "set-cookie" not in response.headers

    run(scenario())


def test_http_an_x_call_id_with_a_control_character_is_refused_before_anything_runs(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                response = await client.post("/function/resnet", content=b"input", headers={"X-Call-Id": "a\x01b"})
            assert response.status_code == 400, response.text
            assert "X-Call-Id" in response.json()["error"]
            assert scheduler.places == [] and node.executes == []

    run(scenario())


def test_http_an_x_call_id_longer_than_the_limit_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # A named call's id is kept by the scheduler for minutes after it ends (and by its node, and in
    # its grant): 60 KB ids (what the head limit let through), even from anonymous callers of a
    # public function, held the scheduler's memory 60 KB a call.
    longest = "c" * MAX_CALL_ID_CHARS

    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            scheduler.respond = lambda place: [node.placement(place.call_id, 1)]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                refused = await client.post("/function/resnet", content=b"in", headers={"X-Call-Id": longest + "c"})
                answered = await client.post("/function/resnet", content=b"in", headers={"X-Call-Id": longest})
            assert refused.status_code == 400, refused.text
            assert f"at most {MAX_CALL_ID_CHARS} characters" in refused.json()["error"]
            assert answered.status_code == 200, answered.text
            assert [place.call_id for place in scheduler.places] == [longest]

    run(scenario())


def test_http_a_named_call_placed_past_its_id_s_earlier_attempts_at_its_first_placement_has_no_x_attempts(
    tmp_path: Path,
) -> None:
    # The scheduler places a call whose client used its X-Call-Id before past that call's attempts
    # (scheduler.calls._NamedIds): attempt 3 is its first placement, not a retry.
    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            node.script[b"fresh"] = (make_reply(loaded=False, batch_calls=1), b"\x00result")
            scheduler.respond = lambda place: [node.placement(place.call_id, 3, token=b"fresh")]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                response = await client.post("/function/resnet", content=b"input", headers={"X-Call-Id": "again"})
            assert response.status_code == 200, response.text
            assert "x-attempts" not in response.headers, "one placement: no X-Attempts"

    run(scenario())


def test_http_a_hit_after_a_retry_says_so_and_has_no_server_timing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            node.script[b"stale"] = no_result(pb.REFUSED, "the grant was revoked")
            node.script[b"fresh"] = (make_reply(loaded=False, batch_calls=1), b"\x00result")
            scheduler.respond = lambda place: [
                node.placement(place.call_id, 1, token=b"stale"),
                node.placement(place.call_id, 2, token=b"fresh"),
            ]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:
                response = await client.post("/function/resnet", content=b"input")  # no X-Call-Id
            assert response.status_code == 200, response.text
            assert response.content == b"\x00result"
            headers = response.headers
            assert headers["content-type"] == "application/octet-stream", "a reply without a content type"
            assert headers["x-cache"] == "hit"
            assert headers["x-attempts"] == "2"
            assert headers["x-batch-calls"] == "1"
            assert "server-timing" not in headers
            (place,) = scheduler.places
            call_id = headers["x-call-id"]
            assert len(call_id) == 32 and int(call_id, 16) >= 0, "a generated call id"
            assert place.call_id == call_id and not place.given_call_id
            assert [(a.call_id, a.attempt, a.reason) for a in scheduler.abandons] == [(call_id, 1, pb.Abandon.REFUSED)]

    run(scenario())


def test_http_errors_are_json_with_the_call_id_and_retry_after_on_429(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fakes() as (scheduler, node):
            answers: dict[str, pb.Placement | pb.Rejection] = {
                "busy": pb.Rejection(call_id="busy", status=pb.OVERLOADED, message="the global queue is full"),
                "unknown": pb.Rejection(call_id="unknown", status=pb.NOT_FOUND, message="not in the scheduler"),
                "raises": node.placement("raises", 1),
            }
            node.script[b"raises#1"] = no_result(pb.HANDLER_ERROR, "KeyError: 'image'")
            scheduler.respond = lambda place: [answers[place.call_id]]
            async with http_gateway(tmp_path, scheduler, make_spec("resnet")) as client:

                async def post(call_id: str) -> httpx.Response:
                    return await client.post("/function/resnet", content=b"{}", headers={"X-Call-Id": call_id})

                busy, unknown, raises = await post("busy"), await post("unknown"), await post("raises")
                metrics = (await client.get("/metrics")).text
            assert_error(busy, 429, "the global queue is full")
            assert busy.headers["retry-after"] == "1"
            assert_error(unknown, 404, "not in the scheduler")
            assert_error(raises, 500, "KeyError: 'image'")
            for response, call_id in ((busy, "busy"), (unknown, "unknown"), (raises, "raises")):
                assert response.headers["x-call-id"] == call_id
            assert "retry-after" not in unknown.headers and "retry-after" not in raises.headers
            assert sample(metrics, "gateway_function_invocation_total", function_name="resnet", code="429") == 1

    run(scenario())


def test_the_gateway_tells_the_router_when_a_node_leaves_its_view_of_the_cluster(tmp_path: Path) -> None:
    """A node's etcd key deleted (its lease expired: cut off or dead), or gone while the watch was
    re-listing, or the node registered again elsewhere: Router.node_left with its old address, so
    that the calls on it end now rather than when the wire gives up on it."""

    async def scenario() -> None:
        async with fakes() as (scheduler, _):
            store, keys = MemoryStore(), Keys("/unit")
            records = {
                name: NodeRecord(name, f"127.0.0.1:{port}", "cpu", "i1", [GpuRecord("gpu0", 1000, "cpu")])
                for name, port in (("node0", 7001), ("node1", 7002), ("node2", 7003))
            }
            for name, record in records.items():
                await store.put(keys.node(name), record.to_json())
            config = GatewayConfig(state_dir=tmp_path, scheduler_address=scheduler.address, keys=keys)
            app = create_app(store, config)
            async with app.router.lifespan_context(app):
                gateway = app.state.gateway
                left: list[str] = []
                gateway.router.node_left = left.append
                await until(lambda: len(gateway.nodes) == 3, "the nodes mirrored")
                await store.delete(keys.node("node0"))
                await until(lambda: left == ["127.0.0.1:7001"], "node0's departure")
                moved = NodeRecord("node1", "127.0.0.1:7012", "cpu", "i2", [GpuRecord("gpu0", 1000, "cpu")])
                await store.put(keys.node("node1"), moved.to_json())
                await until(lambda: left[1:] == ["127.0.0.1:7002"], "node1's old address")
                gateway._nodes_listed([], await store.revision())  # a re-list that finds none
                assert sorted(left[2:]) == ["127.0.0.1:7003", "127.0.0.1:7012"]
            await store.close()

    run(scenario())


def test_http_unknown_function_and_oversized_payload_never_reach_the_scheduler(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fakes() as (scheduler, _):
            # Were a call let through, it would be answered at once (and this test fail fast).
            scheduler.respond = lambda place: [
                pb.Rejection(call_id=place.call_id, status=pb.UNAVAILABLE, message="let through")
            ]
            pulled: list[bytes] = []

            async def stream(chunks: list[bytes]) -> AsyncIterator[bytes]:
                for chunk in chunks:
                    pulled.append(chunk)
                    yield chunk

            async with http_gateway(tmp_path, scheduler, make_spec("small"), max_payload_bytes=1024) as client:
                missing = await client.post("/function/nope", content=b"{}", headers={"X-Call-Id": "c-404"})
                declared = await client.post("/function/small", content=b"x" * 1025, headers={"X-Call-Id": "c-413"})
                streamed = await client.post("/function/small", content=stream([b"y" * 500] * 3))
                assert len(pulled) == 3, "a body without a declared length is read until it is over the limit"
                pulled.clear()
                # A declared length over the limit is refused before the body is read.
                unread = await client.post(
                    "/function/small", content=stream([b"tiny"]), headers={"Content-Length": "1025"}
                )
                await scheduler.barrier()
            body = missing.json()
            assert (missing.status_code, set(body), body["status"]) == (404, {"error", "status"}, 404)
            assert "'nope'" in body["error"]
            assert missing.headers["x-call-id"] == "c-404"
            limit = "the payload is larger than the limit of 1024 bytes"
            assert_error(declared, 413, limit)
            assert declared.headers["x-call-id"] == "c-413"
            assert_error(streamed, 413, limit)
            assert_error(unread, 413, limit)
            assert pulled == [], "the body of a call refused on its declared length was read"
            assert scheduler.frames() == [], "nothing reached the scheduler"

    run(scenario())


def test_server_timing_names_the_host_stage_only_when_the_model_came_back_from_host_memory() -> None:
    from gateway.invoke import miss_timing

    loaded = pb.ExecuteReply(loaded=True, stages=pb.MissStages(load_s=0.004), inference_time_s=0.001)
    assert [part.split(";")[0] for part in miss_timing(loaded).split(", ")] == MISS_STAGE_ORDER
    taken_back = pb.ExecuteReply(loaded=True, stages=pb.MissStages(from_host=True, host_s=0.00002))
    assert "host;dur=0.020" in miss_timing(taken_back)
    assert miss_timing(taken_back).index("host") < miss_timing(taken_back).index("inference")
