"""How the gateway runs one call: ask the scheduler for a placement, send the payload straight to
the node it names, wait for the result there.

The scheduler never sees the payload. Per call:

    Place(metadata) ─▶ scheduler ... Placement(node, GPU, token, attempt) or Rejection
    Execute(token) + payload ─▶ node ... ExecuteReply + result

The scheduler is the leading one among several (scheduler.leadership): the router follows the
address etcd's leader key names (`set_scheduler_address`) and hears placements only on its link
to it (a leader that steps down closes its gateways' links); a node that has seen a newer leader
refuses an older one's token, and the call is asked again of the leader.

A placement that cannot be used is not the end of the call, but a call runs at most once:
- the Execute was never sent (no connection to the node could be had, or the node is known to be
  unreachable from this gateway just now, below): the gateway says so (Abandon REFUSED: "the grant
  did not run there and never will") and the scheduler places the call again, elsewhere;
- the node refused the token (Abandon REFUSED): the same;
- the connection was lost after the Execute was sent (closed by the node, by the kernel's
  keepalive, or because the node left the cluster: `Router.node_left`): the call may be running
  there. The gateway says so (Abandon NODE_UNREACHABLE) and the scheduler places it again only
  once the node's ledger says it never saw the grant (which revokes it there); otherwise it
  answers that the call's outcome is unknown, and the gateway answers 502 saying so. A call in
  that state is never sent to another scheduler (a new leader cannot ask the node about the
  former leader's grant): across a scheduler change it is answered 502 "outcome unknown" too.
A worker that died under a call is reported by the node itself, and the scheduler either places the
call again or answers with a Rejection. The gateway keeps the one deadline: past it (plus a grace
for the inner hops to answer first) it answers 504 and withdraws the call (Abandon CANCELLED). A
placement for a call the gateway no longer waits for is handed back the same way, so that its slot
is freed; one that comes past the call's deadline too (504: never sent, the node would start it with
nothing left, and time it out).

Leases (docs/hit-leases.md): a Place says the gateway takes leases, and a hit's Placement may come
with one (`lease_s`): once its call is answered, the function's next calls go straight to that node
under the same token, one at a time, without a Place (gateway.leases). A call the node refuses under
a lease (revoked, past its time, a call under it already) never ran: it is placed as any other. One
whose node was lost after its Execute went may have run there, and no scheduler holds it to ask the
node: it is answered 502 "outcome unknown", never run twice.

Node connections (`NodeConnections`): one per node, pinged every PING_S. A node whose connection
could not be made or was lost is dialled again in the background, and one that has answered
nothing for PING_TIMEOUT_S (no ping answer, no reply) takes no new Execute: meanwhile its
placements are handed back at once (never sent) instead of each waiting for a connect timeout or
joining calls stuck on a link that is cut. One silent for SILENT_CLOSE_S has its connection
closed, which ends the calls on it (a one-way cut never resets a connection, and a reply stuck
behind the node's retransmissions would otherwise wait for the kernel's timeout or the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.leases import Lease, LeaseKey, Leases
from gpufaas.errors import CALL_ID_IN_FLIGHT, call_id_in_flight
from gpufaas.functions import FunctionSpec
from gpufaas.grants import LEASE_KEEPING_OUTCOMES
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import (
    Connection,
    ConnectionLost,
    Frame,
    MessageType,
    NotSent,
    RemoteError,
    Unauthenticated,
    connect,
    max_frame_bytes_for,
    taken_bytes,
)
from gpufaas.wire_local import PEER_NAME, link_here

log = logging.getLogger("gpufaas.gateway.router")

# The gateway waits this much beyond a call's timeout for the inner hops' own deadline answers,
# so that they report first (one end-to-end deadline per call).
DEADLINE_GRACE_S = 1.0
SCHEDULER_WAIT_S = 5.0  # how long a call waits for a scheduler that is (re)connecting
IN_PROCESS = " (in this process: linked in memory)"  # said of a link to the gateway's own scheduler or node
RECONNECT_S = 0.2
_SILENT = "it answered no ping"
NODE_CONNECT_S = 2.0  # a node connection not made within this is a node unreachable
PING_S = 1.0  # how often each node connection is asked for an answer
PING_TIMEOUT_S = 1.5  # a node that answers nothing this long after a ping takes no new Execute
# A node that answers nothing this long (as long as its lease would take to expire) is gone to this
# gateway: its connection is closed, and the calls on it are reported (the scheduler asks the node).
SILENT_CLOSE_S = 3.0
PING_BYTES_MAX = 256  # more than a ping and its answer (a link that moved more is busy, not silent)
REDIAL_S = 0.5  # how often a node that could not be reached is dialled again in the background
REDIAL_FOR_S = 60.0  # then its placements dial it themselves again
# The ping: a request a node does not serve, answered at once with an Error. Any answer proves the
# node reads this connection (gpufaas.wire has no ping message of its own).
PING_TYPE = MessageType.CLUSTER
# Abandon reasons, as the scheduler reads them (scheduler.calls): the grant did not run at its node
# and never will (refused there, or never sent), or the Execute may have reached the node.
NOT_SENT = pb.Abandon.REFUSED
MAYBE_SENT = pb.Abandon.NODE_UNREACHABLE
# A Rejection's status for "whether the call ran is unknown" (scheduler.calls.OUTCOME_UNKNOWN: no
# Status names it yet); answered 502 like any status without a mapping below.
OUTCOME_UNKNOWN = pb.STATUS_UNSPECIFIED

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
    leased: bool = False  # it ran under a lease (no Place)
    # The placements the gateway tried for it, this one too (X-Attempts): not `placement.attempt`,
    # which a call whose client used its X-Call-Id before starts past that call's (scheduler.calls).
    placements: int = 1


class _NotSent(Exception):
    """The Execute was not sent: the placement cannot have run at its node."""


class _MaybeSent(Exception):
    """The connection to the node was lost after the Execute was sent: it may be running there."""


class _NodeError(_MaybeSent):
    """The node answered the Execute with an Error (`status`, `message`), its link up. A placed
    call's scheduler asks the node whether it saw the grant, as after a lost link; a call under a
    lease is answered with what the node said."""

    def __init__(self, error: RemoteError) -> None:
        super().__init__(error)
        self.status: pb.Status = error.status  # type: ignore[assignment]
        self.message = error.message


class _AnswerTooLarge(CallFailed):
    """The call ran, and its node's answer was over this gateway's limit (not read; the link stays)."""


class Mailbox:
    """One call in flight: what the scheduler says about it (Placements, a Rejection), in
    arrival order, and what is needed to ask again. `waiting`: the call waits for a placement
    (it is not executing), so a new scheduler connection must be asked again; `attempt`: the
    latest placement tried, under scheduler connection `epoch` (attempts restart with a new one);
    `unsure`: the node of that attempt was lost after its Execute was sent, and only the scheduler
    that placed it can have the node say whether it ran (a new one gets no Place for it);
    `placements`: the placements tried, across scheduler connections."""

    __slots__ = (
        "attempt",
        "clock",
        "deadline",
        "epoch",
        "messages",
        "place",
        "placements",
        "unsure",
        "waiter",
        "waiting",
    )

    def __init__(self, place: pb.Place, deadline: float, clock: Callable[[], float]) -> None:
        self.place = place
        self.deadline = deadline
        self.clock = clock
        self.messages: deque[pb.Placement | pb.Rejection] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.waiting = False
        self.unsure = False
        self.attempt = 0
        self.epoch = 0
        self.placements = 0

    def remaining_s(self) -> float:
        """What remains of the call's deadline now (at least a millisecond)."""
        return max(0.001, self.deadline - self.clock())

    def place_now(self) -> pb.Place:
        """The call's Place, saying what remains of its deadline now."""
        self.place.timeout_s = self.remaining_s()
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


class NodeConnections:
    """The gateway's connections to the nodes, one per node address (opened on first use), and
    which nodes take no Execute just now (`unusable`): a node whose connection could not be made
    or was lost, dialled again in the background every REDIAL_S (for REDIAL_FOR_S, then a
    placement dials it itself), and one that has answered nothing for PING_TIMEOUT_S after a ping
    (each connection is pinged every PING_S), until it answers again."""

    def __init__(self, *, max_frame_bytes: int, key: bytes | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.key = key
        self.clock = clock
        self._conns: dict[str, Connection] = {}
        self._connects: dict[str, asyncio.Task[Connection]] = {}
        self._abandoned: set[asyncio.Task[Connection]] = set()  # dials of an address that left meanwhile
        self.unusable: dict[str, str] = {}  # address -> why no Execute goes there now
        self._heard: dict[str, float] = {}  # address -> when it last answered anything
        self._redials: dict[str, asyncio.Task[None]] = {}
        self._watches: set[asyncio.Task[None]] = set()

    async def get(self, address: str) -> Connection:
        """The open connection to `address`, made if there is none. Raises ConnectionLost (nothing
        was sent) if the node takes no Execute now or cannot be connected to."""
        why = self.unusable.get(address)
        if why is not None:
            raise ConnectionLost(f"node at {address} is unreachable from this gateway just now ({why})")
        conn = self._conns.get(address)
        if conn is not None and not conn.is_closed:
            return conn
        try:
            return await self._connect(address)
        except ConnectionLost as exc:
            self._unreachable(address, str(exc))
            raise

    def heard(self, address: str) -> None:
        """The node at `address` answered something (a reply, a ping's answer)."""
        self._heard[address] = self.clock()
        if self.unusable.get(address) == _SILENT:
            del self.unusable[address]
            log.info("node at %s answers again", address)

    def joined(self, address: str) -> None:
        """A node registered at `address` (its etcd key put): if it was found unreachable, dial it
        now rather than at the background dial's next turn, so that the scheduler, which attaches
        it meanwhile, does not get its placements there handed back (on a single GPU they would
        come back until the scheduler gave up on the call)."""
        if address in self.unusable and self.unusable[address] != _SILENT and address not in self._connects:
            dial = asyncio.ensure_future(self._connect(address))
            dial.add_done_callback(lambda done: done.cancelled() or done.exception())  # (failures: the redial goes on)

    def left(self, address: str) -> None:
        """The node left the cluster: its connection closes (failing the calls on it) and it takes
        no Execute until a new connection is made (dialled in the background: it may come back)."""
        conn = self._conns.pop(address, None)
        dial = self._connects.pop(address, None)  # (a later dial, the node back, is a new one)
        if dial is not None:
            self._abandoned.add(dial)
        if conn is not None and not conn.is_closed:
            log.info("node at %s left the cluster: closing its connection", address)
            conn.close(ConnectionLost(f"the node at {address} left the cluster"))
        self._unreachable(address, "it left the cluster")

    async def close(self) -> None:
        tasks = [*self._connects.values(), *self._abandoned, *self._redials.values(), *self._watches]
        for task in tasks:
            task.cancel()
        for conn in self._conns.values():
            conn.close()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _connect(self, address: str) -> Connection:
        """One dial at a time per address, shared by whoever asks meanwhile."""
        task = self._connects.get(address)
        if task is None:
            task = asyncio.create_task(self._dial_unless_left(address))
            self._connects[address] = task
            task.add_done_callback(lambda done: self._connected(address, done))
        return await asyncio.shield(task)

    async def _dial_unless_left(self, address: str) -> Connection:
        """`_dial`, but a connection made after the node left (`left`, while it was dialled) is
        closed and ConnectionLost raised: it would be kept and the node that left be taken for
        usable (and pinged until it died)."""
        conn = await self._dial(address)
        if asyncio.current_task() in self._abandoned:
            conn.close()
            raise ConnectionLost(f"the node at {address} left the cluster while it was dialled")
        return conn

    async def _dial(self, address: str) -> Connection:
        # In memory where this process runs the node (`python -m gateway --with-node`).
        here = link_here(address, None, client_role="gateway", peer_role="node", max_frame_bytes=self.max_frame_bytes)
        if here is not None:
            return here
        return await connect(
            address,
            None,
            max_frame_bytes=self.max_frame_bytes,
            timeout_s=NODE_CONNECT_S,
            key=self.key,
            peer_role="node",  # under TLS: a scheduler's certificate is no node
        )

    def _connected(self, address: str, done: asyncio.Task[Connection]) -> None:
        if self._connects.get(address) is done:
            del self._connects[address]
        self._abandoned.discard(done)
        if done.cancelled() or done.exception() is not None:
            return
        conn = done.result()
        log.info("linked to the node at %s%s", address, IN_PROCESS if conn.peer == PEER_NAME else "")
        self._conns[address] = conn
        self.heard(address)
        self.unusable.pop(address, None)
        watch = asyncio.create_task(self._watch(address, conn))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)

    def _silent(self, address: str, conn: Connection, silent_s: float) -> None:
        if self.unusable.get(address) != _SILENT:
            log.warning("node at %s answered nothing for %.1f s: no new calls go there", address, silent_s)
            self.unusable[address] = _SILENT
        if silent_s >= SILENT_CLOSE_S:
            log.warning("node at %s answered nothing for %.1f s: closing its connection", address, silent_s)
            conn.close(ConnectionLost(f"the node at {address} answered nothing for {silent_s:.1f} s"))

    def _unreachable(self, address: str, why: str) -> None:
        """No Execute goes to `address` until a connection is made again (dialled in the background)."""
        self.unusable[address] = why
        if address not in self._redials:
            redial = asyncio.create_task(self._redial(address))
            self._redials[address] = redial
            redial.add_done_callback(lambda _: self._redials.pop(address, None))

    async def _redial(self, address: str) -> None:
        until = self.clock() + REDIAL_FOR_S
        while self.clock() < until:
            await asyncio.sleep(REDIAL_S)
            conn = self._conns.get(address)
            if conn is not None and not conn.is_closed:
                return  # a placement made one meanwhile
            with contextlib.suppress(ConnectionLost):
                await self._connect(address)
                log.info("node at %s reachable again", address)
                return
        self.unusable.pop(address, None)  # from now on a placement there dials it itself
        self._heard.pop(address, None)  # (a node gone for good, as addresses churn, leaves nothing here)

    async def _watch(self, address: str, conn: Connection) -> None:
        """Ping the connection while it is open; mark the node silent while it answers nothing
        (no Execute goes there meanwhile), close the connection once it has been silent for
        SILENT_CLOSE_S (the kernel's own timeout, checked only as its retransmissions back off, took
        up to 8 s under a one-way cut), and mark the node unreachable once the connection is lost."""
        silent_since: float | None = None
        while not conn.is_closed:
            await asyncio.sleep(PING_S)
            sent = self.clock()
            moved_at_ping = _moved(conn)
            try:
                await conn.request(PING_TYPE, pb.ClusterRequest(), timeout_s=PING_TIMEOUT_S)
            except RemoteError:
                pass  # the node's answer that it serves no such request: an answer all the same
            except TimeoutError:
                # A link that moved more than the ping meanwhile is busy (a large payload or result
                # on its way, the ping's answer behind it), not silent: heard.
                if _moved(conn) - moved_at_ping <= PING_BYTES_MAX:
                    if self._heard.get(address, 0.0) < sent:
                        silent_since = sent if silent_since is None else silent_since
                        self._silent(address, conn, self.clock() - silent_since)
                    continue
            except ConnectionLost:
                break
            silent_since = None
            if self._conns.get(address) is conn:
                self.heard(address)
        # (A request fails at once on a lost transport whose last frames are still being handled:
        # `closed` resolves after them.)
        reason = await asyncio.shield(conn.closed)
        if self._conns.get(address) is conn:
            del self._conns[address]
            self._unreachable(address, f"its connection was lost: {reason or 'closed'}")


def _moved(conn: Connection) -> int:
    """The bytes a connection has moved either way, a count that only grows: read from it, and
    sent that its peer took (`taken_bytes`). A node that moves them answers, though its answers to
    pings wait behind them (a getsockopt: once a ping, not per call)."""
    return conn.received_bytes + taken_bytes(conn)


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
        take_leases: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A scheduler in this process (`python -m gateway --with-scheduler`) is linked in memory
        whenever it is the one at the scheduler address (`_dial`: gpufaas.wire_local).
        `take_leases`: the Places say the gateway takes leases (the scheduler grants them or not)."""
        self.max_payload_bytes = max_payload_bytes
        self.take_leases = take_leases
        self.clock = clock
        self.leases = Leases()
        self.wire_key = wire_key  # proved to the scheduler and the nodes (gpufaas.wire)
        self.scheduler_wait_s = scheduler_wait_s
        self._address = scheduler_address
        self._scheduler: Connection | None = None
        self._connected = asyncio.Event()
        self._calls: dict[str, Mailbox] = {}
        self.nodes = NodeConnections(max_frame_bytes=max_frame_bytes_for(max_payload_bytes), key=wire_key)
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
        await self.nodes.close()

    def set_scheduler_address(self, address: str) -> None:
        """The scheduler registered (or moved: another leads): connect there."""
        if address != self._address:
            self._address = address
            self._address_changed.set()
            if self._scheduler is not None:
                self._scheduler.close()

    def node_joined(self, address: str) -> None:
        """A node registered at `address` (again, after a restart or a partition): dialled at once
        if it was found unreachable (`NodeConnections.joined`)."""
        self.nodes.joined(address)

    def node_left(self, address: str) -> None:
        """The node at `address` left the gateway's view of the cluster (its etcd key is gone: its
        lease expired or it deregistered). Its connection is closed, so that the calls on it end
        now rather than when the wire gives up on a node cut off by a partition (gpufaas.wire's
        dead_after_s), or at their deadline where the wire cannot tell: each is answered through
        the scheduler (placed again where the node never saw its grant, else 502 "outcome
        unknown": the scheduler saw the node leave too). The node is dialled again in the
        background (it may come back), and takes no Execute until a connection is made."""
        self.nodes.left(address)

    @property
    def scheduler_address(self) -> str | None:
        """Where the router links to the (leading) scheduler."""
        return self._address

    @property
    def scheduler(self) -> Connection | None:
        conn = self._scheduler
        return conn if conn is not None and not conn.is_closed else None

    async def _keep_linked(self) -> None:
        """Keep a link to the scheduler at `_address`, for the router's life: dialled again
        whenever it is lost, whatever ended it (one that raised is logged and dialled again)."""
        while True:
            if self._address is None:
                self._address_changed.clear()
                await self._address_changed.wait()
                continue
            self._address_changed.clear()
            try:
                await self._link_once(self._address)
            except Exception:
                log.exception("the link to the scheduler at %s failed; reconnecting", self._address)
                self._connected.clear()
                self._scheduler = None
                await self._reconnect_pause()

    async def _link_once(self, address: str) -> None:
        """Dial the scheduler at `address`, ask it for every call that waits, and return once the
        link is lost (after the reconnect pause)."""
        conn = await self._dial(address)
        if conn is None:
            return
        self.epoch += 1
        self._scheduler = conn
        self._connected.set()
        try:
            for box in self._calls.values():  # a new scheduler knows none of them
                if box.waiting and box.unsure:
                    box.put(pb.Rejection(call_id=box.place.call_id, status=OUTCOME_UNKNOWN, message=_unsure(box)))
                elif box.waiting:
                    box.attempt, box.epoch = 0, self.epoch
                    # A link closed as it was made (the scheduler stopping): the calls stay waiting,
                    # and the next link asks for them.
                    with contextlib.suppress(NotSent):
                        conn.send(MessageType.PLACE, box.place_now())
        except BaseException:
            conn.close()  # not left open to a scheduler that would keep it, and its calls, meanwhile
            raise
        log.info("connected to the scheduler at %s%s", address, IN_PROCESS if conn.peer == PEER_NAME else "")
        await conn.closed
        self._connected.clear()
        self._scheduler = None
        log.warning("lost the connection to the scheduler at %s; reconnecting", address)
        await self._reconnect_pause()

    async def _dial(self, address: str) -> Connection | None:
        """A connection to the scheduler at `address` (in memory where this process runs it:
        gpufaas.wire_local); None where the dial failed (after the reconnect pause) or another
        scheduler took the lead meanwhile."""
        try:
            here = link_here(address, SchedulerSession(self), client_role="gateway", peer_role="scheduler")
        except Unauthenticated as exc:  # this process serves something else there
            log.warning("scheduler at %s: %s", address, exc)
            await self._reconnect_pause()
            return None
        if here is not None:
            return here
        # Under TLS the peer must show the scheduler's certificate (a node's is refused), pinned
        # or found through the leader key alike.
        dial = asyncio.ensure_future(
            connect(address, SchedulerSession(self), timeout_s=2.0, key=self.wire_key, peer_role="scheduler")
        )
        moved = asyncio.ensure_future(self._address_changed.wait())
        await asyncio.wait({dial, moved}, return_when=asyncio.FIRST_COMPLETED)
        moved.cancel()
        if not dial.done():
            # Another scheduler leads now: drop the dial of the old one, which may hang for its
            # whole timeout (a dead container's address is not refused, it is silent).
            dial.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionLost):
                await dial
            return None
        try:
            return dial.result()
        except ConnectionLost as exc:
            # A wrong secret is a misconfiguration an operator must see; the rest is routine.
            level = logging.WARNING if isinstance(exc, Unauthenticated) else logging.DEBUG
            log.log(level, "scheduler at %s: %s", address, exc)
            await self._reconnect_pause()
            return None

    async def _reconnect_pause(self) -> None:
        """RECONNECT_S before dialling again, cut short when another scheduler took the lead
        since the last dial."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._address_changed.wait(), RECONNECT_S)

    async def cluster(self, timeout_s: float = 5.0, *, summary: bool = False, queue_limit: int = 0) -> pb.ClusterReply:
        """The scheduler's view of the cluster (`summary`: only that it answers, and its name;
        `queue_limit`: list only that many of the global queue's oldest calls, 0 all)."""
        conn = self.scheduler
        if conn is None:
            raise CallFailed(503, "the scheduler is unreachable; check that it runs (gpufaas status)")
        try:
            frame = await conn.request(
                MessageType.CLUSTER, pb.ClusterRequest(summary=summary, queue_limit=queue_limit), timeout_s=timeout_s
            )
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

    def on_scheduler_closed(self, conn: Connection) -> None:
        """The link `conn` closed (this very moment, not when `_keep_linked` wakes to it): a call
        asking now waits for the next link rather than find this one closed and give up."""
        if conn is self._scheduler:
            self._connected.clear()

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
        self,
        spec: FunctionSpec,
        call_id: str,
        payload: bytes,
        content_type: str,
        *,
        clock: Callable[[], float],
        given_call_id: bool = False,
    ) -> CallResult:
        """Run the call to its end; raises CallFailed with the HTTP status to answer. `given_call_id`:
        the client named the call (X-Call-Id), and may use the id again once it ends."""
        if call_id in self._calls:
            raise CallFailed(409, call_id_in_flight(call_id))
        deadline = clock() + spec.timeout_s
        box = Mailbox(
            pb.Place(
                call_id=call_id,
                function=spec.name,
                timeout_s=spec.timeout_s,
                payload_bytes=len(payload),
                lease=self.take_leases,
                given_call_id=given_call_id,
            ),
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

    async def _run(self, box: Mailbox, spec: FunctionSpec, payload: bytes, content_type: str) -> CallResult:
        call_id = box.place.call_id
        lease = self.leases.take((spec.name, spec.model), self.clock(), self.epoch) if self.take_leases else None
        if lease is not None:
            leased = await self._run_leased(lease, box, spec, payload, content_type)
            if leased is not None:
                return leased
        await self._ask(box)
        while True:
            message = await box.get()
            if isinstance(message, pb.Rejection):
                raise CallFailed(_rejection_status(message), message.message)
            if message.attempt <= box.attempt:
                continue  # a placement already tried (or replaced)
            # A new placement: the scheduler knows the one before it did not run (or its worker died).
            box.attempt, box.waiting, box.unsure = message.attempt, False, False
            box.placements += 1
            remaining_s = box.deadline - box.clock()
            if remaining_s <= 0:  # placed as its deadline passed: not started for nobody (`invoke` hands it back)
                raise TimeoutError
            # The call's own deadline, for the node: a lease's grant holds a later one for its other calls.
            execute = pb.Execute(token=message.token, content_type=content_type, timeout_s=remaining_s)
            frame = await self._execute_placed(box, message, payload, execute, (spec.name, spec.model))
            if frame is None:
                continue  # not sent, or its node lost after: the scheduler was told
            reply = frame.message(pb.ExecuteReply)
            if message.lease_s > 0 and reply.outcome in LEASE_KEEPING_OUTCOMES and box.epoch == self.epoch:
                self.leases.add((spec.name, spec.model), message, self.clock(), box.epoch)
            if reply.outcome == pb.OK:
                return CallResult(frame.body, message, reply, placements=box.placements)
            if reply.outcome == pb.TIMEOUT:
                log.info("call %s timed out on %s/%s: %s", call_id, message.node, message.gpu, reply.message)
                raise CallFailed(504, spec.deadline_message())
            if reply.outcome not in (pb.REFUSED, pb.WORKER_DIED):
                raise CallFailed(OUTCOME_TO_HTTP.get(reply.outcome, 502), reply.message)
            box.waiting = True
            if reply.outcome == pb.WORKER_DIED:  # asked again (a new link): a retry, a second death its answer
                box.place.worker_died = True
            if box.epoch != self.epoch:
                await self._ask(box)  # the scheduler that placed it is gone: ask the new one
            elif reply.outcome == pb.REFUSED:
                log.warning("call %s: node %s refused the placement: %s", call_id, message.node, reply.message)
                self.abandon(call_id, box.attempt, pb.Abandon.REFUSED, reply.message)
            # WORKER_DIED: the node told the scheduler, which places the call again or rejects it.

    async def _execute_placed(
        self, box: Mailbox, message: pb.Placement, payload: bytes, execute: pb.Execute, key: LeaseKey
    ) -> Frame | None:
        """`_execute` of a placed call; None where the placement failed on the way (the scheduler
        is told: it places the call again, or answers it). Raises CallFailed for the call's answer;
        a lease the placement grants is kept (under `key`) where the call ran, its answer unread."""
        call_id = box.place.call_id
        try:
            return await _execute(self.nodes, message, payload, execute)
        except _NotSent as exc:
            log.info("call %s: not sent to node %s (%s)", call_id, message.node, exc)
            await self._placement_failed(box, NOT_SENT, str(exc))
        except _MaybeSent as exc:
            log.warning("call %s: node %s lost after the call was sent (%s)", call_id, message.node, exc)
            await self._placement_failed(box, MAYBE_SENT, str(exc))
        except _AnswerTooLarge:  # it ran: its node tells the scheduler, as of any call, and keeps the lease
            if message.lease_s > 0 and box.epoch == self.epoch:
                self.leases.add(key, message, self.clock(), box.epoch)
            raise
        except CallFailed as exc:  # its payload is over the node's limit: not run, nor will it be
            self.abandon(call_id, box.attempt, pb.Abandon.CANCELLED, exc.message)
            raise
        return None

    async def _run_leased(
        self, lease: Lease, box: Mailbox, spec: FunctionSpec, payload: bytes, content_type: str
    ) -> CallResult | None:
        """Run the call under `lease`; None where it did not run (the node refused the lease, or
        could not be sent the call) or its worker died under it: it is then placed (as a retry)."""
        execute = pb.Execute(
            token=lease.placement.token,
            content_type=content_type,
            lease_call_id=box.place.call_id,
            timeout_s=box.remaining_s(),
        )
        try:
            frame = await _execute(self.nodes, lease.placement, payload, execute)
        except _NotSent:
            self.leases.drop(lease)
            return None
        except _NodeError as exc:  # its link up: not lost, the node's word is the answer
            self.leases.drop(lease)
            raise CallFailed(STATUS_TO_HTTP.get(exc.status, 502), _node_said(lease, exc.message)) from None
        except _MaybeSent as exc:
            self.leases.drop(lease)
            log.warning("call %s: node %s lost under a lease (%s)", box.place.call_id, lease.placement.node, exc)
            raise CallFailed(502, _unsure_leased(box, lease)) from None
        except _AnswerTooLarge:  # it ran under the lease, which goes on
            self.leases.give_back(lease, self.clock())
            raise
        except CallFailed:  # its payload over the node's limit: skipped there unread, on a link that stays
            self.leases.put_back(lease)
            raise
        except BaseException:  # its deadline, its client gone: is the lease free?
            self.leases.drop(lease)
            raise
        reply = frame.message(pb.ExecuteReply)
        if reply.outcome in LEASE_KEEPING_OUTCOMES:
            self.leases.give_back(lease, self.clock())
        else:
            self.leases.drop(lease)
        if reply.outcome == pb.OK:
            return CallResult(frame.body, lease.answer, reply, leased=True)
        if reply.outcome == pb.REFUSED:
            log.debug("call %s: lease refused by %s: %s", box.place.call_id, lease.placement.node, reply.message)
            return None
        if reply.outcome == pb.WORKER_DIED:
            box.place.worker_died = True  # placed as its retry: a second death is its answer
            return None
        if reply.outcome == pb.TIMEOUT:
            raise CallFailed(504, spec.deadline_message())
        raise CallFailed(OUTCOME_TO_HTTP.get(reply.outcome, 502), reply.message)

    async def _placement_failed(self, box: Mailbox, reason: int, detail: str) -> None:
        """Report a placement that could not be used (`reason`: NOT_SENT or MAYBE_SENT) to the
        scheduler that made it; if that one is gone, a call never sent is asked of the new one
        afresh, and one that may have run is answered 502: its outcome is unknown."""
        box.waiting = True
        if box.epoch == self.epoch:
            box.unsure = reason == MAYBE_SENT
            self.abandon(box.place.call_id, box.attempt, reason, detail)
        elif reason == MAYBE_SENT:
            raise CallFailed(502, _unsure(box))
        else:
            await self._ask(box)  # the scheduler that placed it is gone: ask the new one

    async def _ask(self, box: Mailbox) -> None:
        """Send the call's Place (waiting a little for a scheduler that is reconnecting)."""
        conn = self.scheduler
        if conn is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(self.scheduler_wait_s, box.deadline - box.clock()))):
                    await self._connected.wait()
            conn = self.scheduler
            if conn is None:
                raise CallFailed(503, "the scheduler is unreachable; check that it runs (gpufaas status)")
            if box.waiting and box.epoch == self.epoch:
                return  # the new link asked for it already, as for every call waiting (`_keep_linked`)
        box.waiting, box.attempt, box.epoch = True, 0, self.epoch
        with contextlib.suppress(NotSent):
            # A link lost while it handles its last frames writes nothing: the call waits, and the
            # next link asks for it, as for every call waiting when a link is made.
            conn.send(MessageType.PLACE, box.place_now())


async def _execute(nodes: NodeConnections, placement: pb.Placement, payload: bytes, execute: pb.Execute) -> Frame:
    """Send `execute` (of the placement's token) over `nodes` and wait for the node's answer. Raises
    _NotSent when no connection to the node could be had, _MaybeSent when it was lost after the Execute
    went (or _NodeError, one, when it answered an Error), CallFailed (413) when the node refused the
    payload unread, over its limit (`--max-payload-mb` below the gateway's), _AnswerTooLarge (502)
    when its answer was over this end's (the call ran)."""
    try:
        node = await nodes.get(placement.node_address)
    except ConnectionLost as exc:
        raise _NotSent(exc) from None
    if node.is_closed:  # (nothing awaited since: the Execute below is written, or this holds)
        raise _NotSent(f"the connection to {placement.node_address} closed")
    try:
        # No timeout of its own: `invoke`'s (the call's deadline plus the grace) bounds the wait,
        # and would end it at the same moment (one timer per call, not two).
        frame = await node.request(MessageType.EXECUTE, execute, payload)
    except NotSent as exc:  # the link was lost while its last frames were handled: never written
        raise _NotSent(exc) from None
    except RemoteError as exc:
        if exc.status == pb.TOO_LARGE:  # (the link stays: the node skipped the frame, gpufaas.wire)
            nodes.heard(placement.node_address)
            raise CallFailed(413, _too_large(placement, len(payload), exc.message)) from None
        if exc.status == pb.RESULT_TOO_LARGE:  # (the link stays: this end skipped the answer)
            nodes.heard(placement.node_address)
            raise _AnswerTooLarge(502, _answer_too_large(placement, exc.message)) from None
        nodes.heard(placement.node_address)
        raise _NodeError(exc) from None
    except ConnectionLost as exc:
        raise _MaybeSent(exc) from None
    nodes.heard(placement.node_address)
    return frame


def _too_large(placement: pb.Placement, payload_bytes: int, why: str) -> str:
    return (
        f"the payload of {payload_bytes} bytes is over what node {placement.node} takes ({why}): send less "
        "(the node's --max-payload-mb is below this gateway's: the cluster's operator should set them alike)"
    )


def _answer_too_large(placement: pb.Placement, why: str) -> str:
    return (
        f"the function ran on node {placement.node}, and its result is over what this gateway takes ({why}): "
        "the node's --max-payload-mb is above this gateway's (the cluster's operator should set them alike)"
    )


def _unsure_leased(box: Mailbox, lease: Lease) -> str:
    return (
        f"the outcome of call {box.place.call_id!r} is unknown: the gateway lost node {lease.placement.node} after "
        "sending it the call (under a lease), so it was not run again (check its effects before retrying)"
    )


def _rejection_status(rejection: pb.Rejection) -> int:
    """The HTTP status of a call the scheduler rejected: 409 where its X-Call-Id is in flight (seen
    by another gateway, or a lease's own call's), as this gateway answers it, else by its Status."""
    if rejection.status == pb.INVALID and rejection.message.endswith(CALL_ID_IN_FLIGHT):
        return 409
    return STATUS_TO_HTTP.get(rejection.status, 502)


def _node_said(lease: Lease, error: str) -> str:
    return f"node {lease.placement.node} answered the call (under a lease) with an error: {error}"


def _unsure(box: Mailbox) -> str:
    return (
        f"the outcome of call {box.place.call_id!r} is unknown: the gateway lost its node after sending it the "
        "call, and the scheduler that placed it is gone, so nobody can ask the node whether it started it; it was "
        "not run again (check its effects before retrying)"
    )


class PlacementListener(Protocol):
    """What hears a scheduler link's answers: the router, or the placement bench's gateways."""

    def on_scheduler_message(self, message: pb.Placement | pb.Rejection, conn: Connection) -> None: ...
    def on_scheduler_closed(self, conn: Connection) -> None: ...


class SchedulerSession:
    """A gateway's side of its scheduler link: hands each `Placement` and `Rejection` to `listener`,
    and tells it when the link closes."""

    def __init__(self, listener: PlacementListener) -> None:
        self.listener = listener

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.PLACEMENT:
            self.listener.on_scheduler_message(frame.message(pb.Placement), conn)
        elif frame.type == MessageType.REJECTION:
            self.listener.on_scheduler_message(frame.message(pb.Rejection), conn)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.listener.on_scheduler_closed(conn)
