"""How the gateway runs one call: ask the scheduler for a placement, send the payload straight to
the node it names, wait for the result there.

The scheduler never sees the payload. Per call:

    Place(metadata) ─▶ scheduler ... Placement(node, GPU, token, attempt) or Rejection
    Execute(token) + payload ─▶ node ... ExecuteReply + result

The scheduler is the leading one among several (scheduler.leadership): the router follows the
address etcd's leader key names (`set_scheduler_address`) and hears placements only on its link
to it (a leader that steps down closes its gateways' links); a node that has seen a newer leader
refuses an older one's token, and the call is asked again of the leader.

A placement that cannot be used is not the end of the call: the node unreachable (Abandon
NODE_UNREACHABLE: its connection could not be opened, was lost, or was closed because the node left
the cluster, `Router.node_left`) or refusing the token (Abandon REFUSED) are reported, and the
scheduler places the call again; a worker that died under it is reported by the node itself, and the scheduler
either places the call again or answers with a Rejection. The gateway keeps the one deadline:
past it (plus a grace for the inner hops to answer first) it answers 504 and withdraws the call
(Abandon CANCELLED). A placement for a call the gateway no longer waits for is handed back the
same way, so that its slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gpufaas.functions import FunctionSpec
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import (
    Connection,
    ConnectionLost,
    Frame,
    MessageType,
    RemoteError,
    Unauthenticated,
    connect,
    max_frame_bytes_for,
)

log = logging.getLogger("gpufaas.gateway.router")

# The gateway waits this much beyond a call's timeout for the inner hops' own deadline answers,
# so that they report first (one end-to-end deadline per call).
DEADLINE_GRACE_S = 1.0
SCHEDULER_WAIT_S = 5.0  # how long a call waits for a scheduler that is (re)connecting
RECONNECT_S = 0.2

# Why a call ended without a result -> HTTP status, in one place (README's HTTP API lists them).
STATUS_TO_HTTP = {
    pb.NOT_FOUND: 404,
    pb.INVALID: 400,
    pb.OVERLOADED: 429,
    pb.UNAVAILABLE: 503,
    pb.DEADLINE: 504,
    pb.FUNCTION_FAILED: 500,
    pb.TOO_LARGE: 413,
    pb.RESULT_TOO_LARGE: 502,
}
OUTCOME_TO_HTTP = {
    pb.HANDLER_ERROR: 500,
    pb.LOAD_FAILED: 500,
    pb.OUTPUT_INVALID: 500,
    pb.INVALID_INPUT: 400,
    pb.OUTPUT_TOO_LARGE: 502,
}


class CallFailed(Exception):
    """The call's answer is an error: an HTTP status and a message saying what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class CallResult:
    output: bytes
    placement: pb.Placement
    reply: pb.ExecuteReply


class _Mailbox:
    """One call in flight: what the scheduler says about it (Placements, a Rejection), in
    arrival order, and what is needed to ask again. `waiting`: the call waits for a placement
    (it is not executing), so a new scheduler connection must be asked again; `attempt`: the
    latest placement tried, under scheduler connection `epoch` (attempts restart with a new one)."""

    __slots__ = ("attempt", "clock", "deadline", "epoch", "messages", "place", "waiter", "waiting")

    def __init__(self, place: pb.Place, deadline: float, clock: Callable[[], float]) -> None:
        self.place = place
        self.deadline = deadline
        self.clock = clock
        self.messages: deque[pb.Placement | pb.Rejection] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.waiting = False
        self.attempt = 0
        self.epoch = 0

    def place_now(self) -> pb.Place:
        """The call's Place, saying what remains of its deadline now."""
        self.place.timeout_s = max(0.001, self.deadline - self.clock())
        return self.place

    def put(self, message: pb.Placement | pb.Rejection) -> None:
        self.messages.append(message)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> pb.Placement | pb.Rejection:
        while not self.messages:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.messages.popleft()


class Router:
    """The gateway's link to the scheduler (one connection, re-established when it drops) and to
    the nodes (one connection per node, opened on first use), and the calls in flight."""

    def __init__(
        self,
        *,
        max_payload_bytes: int,
        scheduler_address: str | None = None,
        scheduler_wait_s: float = SCHEDULER_WAIT_S,
        wire_key: bytes | None = None,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.wire_key = wire_key  # proved to the scheduler and the nodes (gpufaas.wire)
        self.scheduler_wait_s = scheduler_wait_s
        self._address = scheduler_address
        self._scheduler: Connection | None = None
        self._connected = asyncio.Event()
        self._calls: dict[str, _Mailbox] = {}
        self._nodes: dict[str, Connection] = {}
        self._node_connects: dict[str, asyncio.Task[Connection]] = {}
        self._link: asyncio.Task[None] | None = None
        self._address_changed = asyncio.Event()
        self.epoch = 0  # bumped on every new scheduler connection: attempts restart with it

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._link = asyncio.create_task(self._keep_linked())

    async def stop(self) -> None:
        if self._link is not None:
            self._link.cancel()
            with contextlib.suppress(BaseException):
                await self._link
        if self._scheduler is not None:
            self._scheduler.close()
        for conn in self._nodes.values():
            conn.close()
        for task in self._node_connects.values():
            task.cancel()

    def set_scheduler_address(self, address: str) -> None:
        """The scheduler registered (or moved: another leads): connect there."""
        if address != self._address:
            self._address = address
            self._address_changed.set()
            if self._scheduler is not None:
                self._scheduler.close()

    def node_left(self, address: str) -> None:
        """The node at `address` left the gateway's view of the cluster (its etcd key is gone: its
        lease expired or it deregistered). Its connection is closed, so that the calls waiting on it
        fail over at once through the node-unreachable path: the scheduler, which saw the node leave
        too, has placed them again or will. Without this a node cut off by a partition holds its
        calls until the wire gives up on it (gpufaas.wire's dead_after_s), or until their deadline
        where the wire cannot tell. A later placement on that node opens a new connection."""
        conn = self._nodes.pop(address, None)
        if conn is not None and not conn.is_closed:
            log.info("node at %s left the cluster: closing its connection", address)
            conn.close(ConnectionLost(f"the node at {address} left the cluster"))

    @property
    def scheduler_address(self) -> str | None:
        """Where the router links to the (leading) scheduler."""
        return self._address

    @property
    def scheduler(self) -> Connection | None:
        conn = self._scheduler
        return conn if conn is not None and not conn.is_closed else None

    async def _keep_linked(self) -> None:
        while True:
            if self._address is None:
                self._address_changed.clear()
                await self._address_changed.wait()
                continue
            self._address_changed.clear()
            try:
                conn = await connect(self._address, _SchedulerSession(self), timeout_s=2.0, key=self.wire_key)
            except ConnectionLost as exc:
                # A wrong secret is a misconfiguration an operator must see; the rest is routine.
                level = logging.WARNING if isinstance(exc, Unauthenticated) else logging.DEBUG
                log.log(level, "scheduler at %s: %s", self._address, exc)
                await self._reconnect_pause()
                continue
            self.epoch += 1
            self._scheduler = conn
            self._connected.set()
            for box in self._calls.values():  # a new scheduler knows none of them
                if box.waiting:
                    box.attempt, box.epoch = 0, self.epoch
                    conn.send(MessageType.PLACE, box.place_now())
            log.info("connected to the scheduler at %s", self._address)
            await conn.closed
            self._connected.clear()
            self._scheduler = None
            log.warning("lost the connection to the scheduler at %s; reconnecting", self._address)
            await self._reconnect_pause()

    async def _reconnect_pause(self) -> None:
        """RECONNECT_S before dialling again, cut short when another scheduler took the lead
        since the last dial."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._address_changed.wait(), RECONNECT_S)

    async def cluster(self, timeout_s: float = 5.0) -> pb.ClusterReply:
        conn = self.scheduler
        if conn is None:
            raise CallFailed(503, "the scheduler is unreachable; check that it runs (gpufaas status)")
        try:
            frame = await conn.request(MessageType.CLUSTER, pb.ClusterRequest(), timeout_s=timeout_s)
        except (ConnectionLost, TimeoutError, RemoteError) as exc:
            raise CallFailed(503, f"the scheduler did not answer ({exc or type(exc).__name__})") from None
        return frame.message(pb.ClusterReply)

    # --- from the scheduler -----------------------------------------------------------------
    def on_scheduler_message(self, message: pb.Placement | pb.Rejection, conn: Connection | None = None) -> None:
        """A Placement or Rejection arrived on `conn` (None: on the current link). Only the link to
        the current leader is heard: a call a former leader's message was for waits on, and is
        asked again of the leader when the router links to it."""
        if conn is not None and conn is not self._scheduler:
            log.debug("ignoring a message for call %s from a scheduler no longer linked", message.call_id)
            return
        box = self._calls.get(message.call_id)
        if box is not None:
            box.put(message)
        elif isinstance(message, pb.Placement):
            self.abandon(message.call_id, message.attempt, pb.Abandon.CANCELLED, "nobody waits for the call")

    def abandon(self, call_id: str, attempt: int, reason: int, detail: str = "") -> None:
        conn = self.scheduler
        if conn is not None:
            with contextlib.suppress(ConnectionLost):
                conn.send(
                    MessageType.ABANDON,
                    pb.Abandon(call_id=call_id, attempt=attempt, reason=reason, detail=detail),  # type: ignore[arg-type]
                )

    # --- one call ---------------------------------------------------------------------------
    async def invoke(
        self, spec: FunctionSpec, call_id: str, payload: bytes, content_type: str, *, clock: Callable[[], float]
    ) -> CallResult:
        """Run the call to its end; raises CallFailed with the HTTP status to answer."""
        if call_id in self._calls:
            raise CallFailed(409, f"call {call_id!r} is already in flight; use a new X-Call-Id")
        deadline = clock() + spec.timeout_s
        box = _Mailbox(
            pb.Place(call_id=call_id, function=spec.name, timeout_s=spec.timeout_s, payload_bytes=len(payload)),
            deadline,
            clock,
        )
        self._calls[call_id] = box
        try:
            async with asyncio.timeout(spec.timeout_s + DEADLINE_GRACE_S):
                return await self._run(box, spec, payload, content_type)
        except TimeoutError:
            self.abandon(call_id, 0, pb.Abandon.CANCELLED, "the gateway's deadline passed")
            raise CallFailed(504, spec.deadline_message()) from None
        except CallFailed:
            raise  # an answer: the scheduler (or the node, which tells it) has finished with the call
        except BaseException:
            self.abandon(call_id, 0, pb.Abandon.CANCELLED, "the client went away")
            raise
        finally:
            del self._calls[call_id]

    async def _run(self, box: _Mailbox, spec: FunctionSpec, payload: bytes, content_type: str) -> CallResult:
        call_id = box.place.call_id
        await self._ask(box)
        while True:
            message = await box.get()
            if isinstance(message, pb.Rejection):
                raise CallFailed(STATUS_TO_HTTP.get(message.status, 502), message.message)
            if message.attempt <= box.attempt:
                continue  # a placement already tried (or replaced)
            box.attempt, box.waiting = message.attempt, False
            try:
                node = await self._node(message.node_address)
                frame = await node.request(
                    MessageType.EXECUTE,
                    pb.Execute(token=message.token, content_type=content_type),
                    payload,
                    timeout_s=max(0.001, box.deadline - box.clock()) + DEADLINE_GRACE_S,
                )
            except (ConnectionLost, RemoteError) as exc:
                log.warning("call %s: node %s unreachable (%s)", call_id, message.node, exc)
                box.waiting = True
                if box.epoch != self.epoch:
                    await self._ask(box)  # the scheduler that placed it is gone
                else:
                    self.abandon(call_id, box.attempt, pb.Abandon.NODE_UNREACHABLE, str(exc))
                continue
            reply = frame.message(pb.ExecuteReply)
            if reply.outcome == pb.OK:
                return CallResult(frame.body, message, reply)
            if reply.outcome == pb.TIMEOUT:
                log.info("call %s timed out on %s/%s: %s", call_id, message.node, message.gpu, reply.message)
                raise CallFailed(504, spec.deadline_message())
            if reply.outcome not in (pb.REFUSED, pb.WORKER_DIED):
                raise CallFailed(OUTCOME_TO_HTTP.get(reply.outcome, 502), reply.message)
            box.waiting = True
            if box.epoch != self.epoch:
                await self._ask(box)  # the scheduler that placed it is gone: ask the new one
            elif reply.outcome == pb.REFUSED:
                log.warning("call %s: node %s refused the placement: %s", call_id, message.node, reply.message)
                self.abandon(call_id, box.attempt, pb.Abandon.REFUSED, reply.message)
            # WORKER_DIED: the node told the scheduler, which places the call again or rejects it.

    async def _ask(self, box: _Mailbox) -> None:
        """Send the call's Place (waiting a little for a scheduler that is reconnecting)."""
        conn = self.scheduler
        if conn is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(self.scheduler_wait_s, box.deadline - box.clock()))):
                    await self._connected.wait()
            conn = self.scheduler
            if conn is None:
                raise CallFailed(503, "the scheduler is unreachable; check that it runs (gpufaas status)")
        box.waiting, box.attempt, box.epoch = True, 0, self.epoch
        conn.send(MessageType.PLACE, box.place_now())

    async def _node(self, address: str) -> Connection:
        conn = self._nodes.get(address)
        if conn is not None and not conn.is_closed:
            return conn
        task = self._node_connects.get(address)
        if task is None:
            task = asyncio.create_task(
                connect(
                    address,
                    None,
                    max_frame_bytes=max_frame_bytes_for(self.max_payload_bytes),
                    timeout_s=2.0,
                    key=self.wire_key,
                )
            )
            self._node_connects[address] = task
            task.add_done_callback(lambda _: self._node_connects.pop(address, None))
        conn = await asyncio.shield(task)
        self._nodes[address] = conn
        return conn


class _SchedulerSession:
    def __init__(self, router: Router) -> None:
        self.router = router

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.PLACEMENT:
            self.router.on_scheduler_message(frame.message(pb.Placement), conn)
        elif frame.type == MessageType.REJECTION:
            self.router.on_scheduler_message(frame.message(pb.Rejection), conn)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass  # Router._keep_linked sees `conn.closed` resolve
