"""gpufaas' wire: length-prefixed frames on long-lived TCP (or Unix) connections, both ways at once.

Why not gRPC: on this project's machines a grpc.aio round trip costs 240-440 us at concurrency 1
and tops out near 3,000-3,800 calls/s per core (unary or bidi stream), against 14 us and over
60,000 for a frame on an asyncio (uvloop) socket (measured when the wire was chosen; that
benchmark is not kept in this repository). The serving path crosses three such hops per call.

A frame (all integers big-endian):

    u32 length of what follows | u16 type | u16 flags | u32 correlation id | u32 header length |
    header (a protobuf message from gpufaas.proto, chosen by type) | body (raw bytes, may be empty)

A frame with a non-zero correlation id and the REQUEST flag asks for exactly one answer carrying
the same id (flag REPLY); id 0 is a one-way message. Bodies carry payloads and results as they
are: never parsed, never inside a protobuf message. A frame over the connection's `max_frame_bytes`
is never buffered: a request is answered with an Error (TOO_LARGE) as its prefix arrives and its
bytes are read and dropped, the connection kept (the gateways' and the nodes' payload limits are
set apart: a gateway's payload over its node's limit fails that call alone, not the link's others);
a reply to a request this end is waiting on fails that request alone (`AnswerTooLarge`: a node's
result over its gateway's limit), its bytes dropped likewise; anything else over the limit (a
one-way message, a reply nobody waits for: nobody to tell) cuts the peer off.

Messages produced within one pass of the event loop are written with one system call (they are
queued and flushed by a callback scheduled with `call_soon`), so a burst of small messages costs
one write; a large body is handed to the transport at once, and `drain()` waits for the peer.

Authentication: a server made with the cluster's wire key (gpufaas.credentials.wire_key) reads
nothing from a peer until both have proved they hold it: the server sends a Hello with a fresh
nonce, the client answers with its own nonce and HMAC(key, "client", both nonces), the server
replies with HMAC(key, "server", both nonces). The key itself never crosses the connection; a
replayed proof fails on the fresh nonces. A peer that sends anything else first, a wrong proof, or
nothing within HANDSHAKE_S is cut off. Frames are not encrypted or signed one by one after that:
on a network others can read, carry the wire over TLS or a private network (docs/security.md).

Nothing is allocated for a peer before it is authenticated: until then a connection reads into a
buffer of HANDSHAKE_FRAME_BYTES, and a frame announced larger than that (a Hello is under 100
bytes) cuts it off, whatever `max_frame_bytes` allows afterwards; the full read buffer is made
once the peer has proved the key. A server holds at most `max_unauthenticated` connections that
have not finished the handshake (MAX_UNAUTHENTICATED by default); one accepted past that is closed
at once, without a read. Under TLS a connection counts from the end of its TLS handshake (asyncio
and uvloop never tell the protocol of one that fails, so a peer that connected and closed would
have held its slot until the time ran out), and is closed then past the cap; a TLS handshake in
flight (the TLS layer's buffers) is bounded by the handshake time alone (`ssl_handshake_timeout`).

A peer whose host vanishes (powered off, partitioned: its packets dropped, so no reset ever comes)
is noticed by the kernel within `dead_after_s` (DEAD_AFTER_S by default) on every TCP connection,
whatever the connection is doing: TCP keepalive probes an idle one (no data unacknowledged, which
includes one whose request was delivered and whose answer is awaited), and TCP_USER_TIMEOUT ends
one whose sent data stays unacknowledged that long (see `keepalive_options`). The connection then
closes with ConnectionLost (ETIMEDOUT) and its waiting requests fail at once. This costs nothing per
frame (the probes are the kernel's, sent only on a silent connection); a peer process that is alive
but stuck keeps its kernel answering and is not detected (the callers' deadlines cover it).

Encryption: with TLS (gpufaas.tls; a daemon configures its links once at start, and `connect` and
`Server` use that unless given `tls`), every connection is TLS 1.3, both ends show a certificate
of the cluster CA, and each checks that the other's role belongs on the link (a node's
certificate is refused where the scheduler is expected). The key handshake above still runs
inside it: it binds the link to this cluster's secret, so a leaked certificate alone opens
nothing (docs/security.md).

Errors: `ConnectionLost` (OSError) when the connection closed under a request or a send;
`RemoteError` when the peer answered a request with an Error message (TOO_LARGE: the request was
over the peer's limit); `FrameTooLarge` (ConnectionLost) when a frame over the limit that is no
request was announced.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import fcntl
import hashlib
import hmac
import logging
import math
import os
import socket
import ssl
import struct
import termios
from collections.abc import Callable, Container, Mapping
from typing import Any, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.tls import LinkTls, PeerRefused, links_of

log = logging.getLogger("gpufaas.wire")

_PREFIX = struct.Struct("!IHHII")  # length, type, flags, correlation id, header length
PREFIX_BYTES = _PREFIX.size
FLAG_REQUEST = 1
FLAG_REPLY = 2
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
HEADER_ALLOWANCE_BYTES = 1024 * 1024  # what a frame may hold beside its body
_SMALL_BUFFER_BYTES = 256 * 1024  # frames up to this size are read into one reused buffer
_INLINE_BODY_BYTES = 64 * 1024  # bodies up to this size are copied into the frame's one write
_MAX_CORRELATION_ID = 2**32 - 1  # the frame's field is a u32; 0 means none
# The ids of the latest requests given up on (timed out, their caller gone) whose answers have not
# come: such an answer over the limit is dropped as it comes, not taken for garbage (`_over_limit`).
_GIVEN_UP_KEPT = 1024
# The most frames of one connection handled in one turn of the loop; the rest of a read waits for
# the next turn, with the connection's reading paused meanwhile. A read of the full buffer holds
# thousands of small frames: handled at once, they held the loop for a third of a second, and an
# overloaded scheduler's keep-alives of its leadership lease waited that out until the lease lapsed.
FRAMES_PER_TURN = 64
HANDSHAKE_S = 5.0  # a peer that has not proved the key by then is cut off
HANDSHAKE_FRAME_BYTES = 1024  # the largest frame read before the handshake (a Hello, an Error's answer)
MAX_UNAUTHENTICATED = 64  # a server's connections still in the handshake; more are closed at once
_NONCE_BYTES = 16
# What a TLS record's first bytes read as: a handshake (22), version 3.x. A plain end that reads them
# first, or a TLS end reset during its TLS handshake, has a peer of the other kind.
_TLS_HANDSHAKE_START = b"\x16\x03"
_SAME_TLS = (
    "if one end runs with TLS and the other without (--no-tls, or no TLS files: its log says so), "
    "give both the same setting"
)
# A TCP peer silent this long while probed, or leaving sent data unacknowledged this long, is dead.
DEAD_AFTER_S = 5.0

M = TypeVar("M", bound=Message)

WIRE_ERROR_KINDS = ("connect", "auth", "frame_too_large", "malformed", "handler")
# The wire's errors in this process by kind: a connection that could not be opened (connect), a
# handshake that failed either way, a frame over HANDSHAKE_FRAME_BYTES before it, or a connection
# closed on accepting it because `max_unauthenticated` others were in the handshake (auth), a
# frame over the limit (frame_too_large: a request refused, anything else cutting the connection)
# or one that does not parse (malformed: the connection is cut), a handler that raised on a frame (handler).
# A process is one daemon, whose metrics read this when scraped (gpufaas.metrics.ProcessErrors).
error_counts: collections.Counter[str] = collections.Counter()


class MessageType(enum.IntEnum):
    """The frame's type names its header's protobuf message."""

    ERROR = 1
    PLACE = 2
    PLACEMENT = 3
    REJECTION = 4
    ABANDON = 5
    EXECUTE = 6
    EXECUTE_REPLY = 7
    DONE = 8
    ATTACH = 9
    ATTACH_REPLY = 10
    REVOKE = 11
    REVOKE_REPLY = 12
    EVICT = 13
    EVICT_REPLY = 14
    CLUSTER = 15
    CLUSTER_REPLY = 16
    WORKER_HELLO = 17
    LOAD_MODEL = 18
    MODEL_LOADED = 19
    CALL = 20
    CALL_RESULT = 21
    WORKERS = 22
    HELLO = 23
    STAGE = 24
    STAGE_REPLY = 25
    HOLDINGS = 26


MESSAGES: dict[MessageType, type[Message]] = {
    MessageType.ERROR: pb.Error,
    MessageType.PLACE: pb.Place,
    MessageType.PLACEMENT: pb.Placement,
    MessageType.REJECTION: pb.Rejection,
    MessageType.ABANDON: pb.Abandon,
    MessageType.EXECUTE: pb.Execute,
    MessageType.EXECUTE_REPLY: pb.ExecuteReply,
    MessageType.DONE: pb.Done,
    MessageType.ATTACH: pb.Attach,
    MessageType.ATTACH_REPLY: pb.AttachReply,
    MessageType.REVOKE: pb.Revoke,
    MessageType.REVOKE_REPLY: pb.RevokeReply,
    MessageType.EVICT: pb.Evict,
    MessageType.EVICT_REPLY: pb.EvictReply,
    MessageType.CLUSTER: pb.ClusterRequest,
    MessageType.CLUSTER_REPLY: pb.ClusterReply,
    MessageType.WORKER_HELLO: pb.WorkerHello,
    MessageType.LOAD_MODEL: pb.LoadModel,
    MessageType.MODEL_LOADED: pb.ModelLoaded,
    MessageType.CALL: pb.Call,
    MessageType.CALL_RESULT: pb.CallResult,
    MessageType.WORKERS: pb.WorkersRequest,
    MessageType.HELLO: pb.Hello,
    MessageType.STAGE: pb.Stage,
    MessageType.STAGE_REPLY: pb.StageReply,
    MessageType.HOLDINGS: pb.Holdings,
}


def max_frame_bytes_for(max_body_bytes: int) -> int:
    """The frame limit for a connection that carries bodies up to `max_body_bytes`."""
    return max_body_bytes + HEADER_ALLOWANCE_BYTES


class ConnectionLost(ConnectionError):
    """The connection closed (or could not be opened): nothing more goes through it."""


class NotSent(ConnectionLost):
    """Nothing was written: the connection was lost before the send or request (the peer cannot
    have seen it), though `closed` may not have resolved yet (the last frames still being handled)."""


class FrameTooLarge(ConnectionLost):
    """The peer announced a frame over this end's limit, not a request; the connection was closed."""


class Unauthenticated(ConnectionLost):
    """The peer does not hold the same wire key (or speaks no handshake)."""


class RemoteError(Exception):
    """The peer answered a request with an Error message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class AnswerTooLarge(RemoteError):
    """The peer's answer to a request is over this end's limit (`max_frame_bytes`): not read (its
    bytes were dropped as they came), the connection kept. Status RESULT_TOO_LARGE."""

    def __init__(self, message: str) -> None:
        super().__init__(pb.RESULT_TOO_LARGE, message)


class Frame:
    """One received frame. `header` is the raw protobuf bytes; `message(cls)` parses it."""

    __slots__ = ("body", "correlation_id", "flags", "header", "type")

    def __init__(self, type_: int, flags: int, correlation_id: int, header: bytes, body: bytes) -> None:
        self.type = type_
        self.flags = flags
        self.correlation_id = correlation_id
        self.header = header
        self.body = body

    def message(self, cls: type[M]) -> M:
        try:
            return cls.FromString(self.header)
        except DecodeError as exc:
            raise ConnectionLost(f"malformed {cls.__name__} message: {exc}") from None

    @property
    def is_request(self) -> bool:
        return bool(self.flags & FLAG_REQUEST)


class Handler(Protocol):
    """What a connection tells its owner. Called on the event loop; must not block. A request
    (`frame.is_request`) is answered with `conn.reply(frame, ...)` or `conn.reply_error(...)`,
    now or later (from a task). A reply that answers no request its connection is waiting on is
    dropped (a late answer to a request given up on), unless the handler has `takes_stray_replies`
    set: an end that asks nothing counts every reply as the peer's own doing (a node's end of a
    worker's socket)."""

    def on_frame(self, conn: Connection, frame: Frame) -> None: ...
    def on_close(self, conn: Connection, exc: BaseException | None) -> None: ...


def keepalive_options(dead_after_s: float) -> list[tuple[int, int, int]]:
    """The (level, option, value) socket options that make the kernel close a TCP connection whose
    peer has been silent for `dead_after_s` (Linux; whole seconds, at least 2).

    Keepalive: the first probe after TCP_KEEPIDLE (half of it) without traffic, then one each
    second. With TCP_USER_TIMEOUT set, Linux gives up on a probed connection once nothing has been
    received for the user timeout (TCP_KEEPCNT is then only a ceiling), and on one whose sent data
    has gone unacknowledged that long (retransmissions): either way `dead_after_s` after the peer
    fell silent, give or take a probe interval."""
    if dead_after_s < 2:
        raise ValueError(f"dead_after_s must be at least 2 s, got {dead_after_s}")
    idle_s = math.floor(dead_after_s / 2)
    interval_s = 1
    return [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, math.ceil((dead_after_s - idle_s) / interval_s)),
        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, math.ceil(dead_after_s * 1000)),
    ]


def encode(type_: int, header: Message | bytes, body: bytes, *, flags: int = 0, correlation_id: int = 0) -> bytes:
    """The frame's prefix and header (the body follows it, written separately when large)."""
    header_bytes = header if isinstance(header, bytes) else header.SerializeToString()
    prefix = _PREFIX.pack(
        PREFIX_BYTES - 4 + len(header_bytes) + len(body), type_, flags, correlation_id, len(header_bytes)
    )
    return prefix + header_bytes


class Connection(asyncio.BufferedProtocol):
    """One end of a framed connection (client or server side; both may send and ask).

    Lifecycle: made by `connect()` or a `Server`; `closed` resolves once, with the reason, when
    the transport goes (either side closing, a protocol error, or `close()`). Requests still
    waiting then fail with ConnectionLost, and the handler's `on_close` is called once.
    """

    def __init__(
        self,
        handler: Handler | None,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        key: bytes | None = None,
        server: bool = False,
        handshake_s: float | None = None,
        dead_after_s: float | None = DEAD_AFTER_S,
        peer_check: Callable[[Mapping[str, Any] | None], str] | None = None,
    ) -> None:
        """`handshake_s`: how long a server end waits for the peer's proof (None: HANDSHAKE_S);
        `dead_after_s`: how soon a silent TCP peer is given up on (`keepalive_options`; None: never,
        the kernel's defaults; ignored on a Unix socket); `peer_check`: a TLS server end's check of
        the peer's certificate (`LinkTls.check`: its role, or PeerRefused, which closes the connection)."""
        if dead_after_s is not None:
            keepalive_options(dead_after_s)  # a bad value is refused here, not on the first connection
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes
        self.peer = ""
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[BaseException | None] = self._loop.create_future()
        # True once `closed` is resolved: a plain attribute, read several times per call on the
        # serving path (a property calling `closed.done()` cost 1 % of the gateway's CPU).
        self.is_closed = False
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._last_id = 0  # the newest request's correlation id
        self._given_up: dict[int, None] = {}  # requests given up on, oldest first (_GIVEN_UP_KEPT)
        self._out: list[bytes] = []
        self.sent_bytes = 0  # every byte of every frame sent on this end, written or still buffered
        self.received_bytes = 0  # every byte read on this end
        self._flush_scheduled = False
        self._can_write = asyncio.Event()
        self._can_write.set()
        # Reading: small frames land in `_buf` (reused); one large frame gets a buffer of its own.
        # Before the handshake `_buf` is HANDSHAKE_FRAME_BYTES: a peer not yet authenticated gets
        # no more memory than that (get_buffer grows it once the peer has proved the key).
        self._buf = bytearray(_SMALL_BUFFER_BYTES if key is None else HANDSHAKE_FRAME_BYTES)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # end of the bytes received into _buf
        self._rest: _LargeFrame | _SkippedFrame | None = None  # the rest of a frame `_buf` does not hold
        self._backlog = False  # frames past FRAMES_PER_TURN wait in `_buf` for the next turn
        # The transport went while a backlog waits: `closed` resolves once it is handled, and
        # nothing is written meanwhile.
        self._lost_after_backlog: tuple[Exception | None] | None = None
        # The handshake (see the module's doc): nothing but it is read until `authenticated`.
        self._key = key
        self._server_side = server
        self.authenticated = key is None
        self._server_nonce = b""
        self._hello: asyncio.Future[bytes] = self._loop.create_future()  # client: the server's nonce
        self._handshake_s = handshake_s
        self._dead_after_s = dead_after_s
        self.on_authenticated: Callable[[Connection], None] | None = None  # server end: told once
        self._peer_check = peer_check
        self.peer_role: str | None = None  # the role the peer's TLS certificate names (TLS only)

    # --- asyncio protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        if self._peer_check is not None and not self._peer_allowed(transport):
            return
        sock = transport.get_extra_info("socket")
        if self._dead_after_s is not None and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            for level, option, value in keepalive_options(self._dead_after_s):
                sock.setsockopt(level, option, value)
        if self._key is not None and self._server_side:
            self._server_nonce = os.urandom(_NONCE_BYTES)
            self.send(MessageType.HELLO, pb.Hello(nonce=self._server_nonce))
            handshake_s = HANDSHAKE_S if self._handshake_s is None else self._handshake_s
            self._loop.call_later(handshake_s, self._handshake_expired, handshake_s)

    def _peer_allowed(self, transport: asyncio.BaseTransport) -> bool:
        assert self._peer_check is not None
        try:
            self.peer_role = self._peer_check(transport.get_extra_info("peercert"))
        except PeerRefused as exc:
            error_counts["auth"] += 1
            log.warning("connection %s refused: %s", self.peer, exc)
            transport.abort()  # type: ignore[attr-defined]  # every stream transport has it
            self._fail_all(Unauthenticated(str(exc)))
            return False
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._backlog and not self.is_closed:
            # What the peer sent before it closed is handled first: a TLS end reads the close in
            # the read that brought the frames, before the backlog of that read is handled.
            self._lost_after_backlog = (exc,)
            return
        self._fail_all(exc)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._rest is not None:
            return self._rest.room()
        if self.authenticated and len(self._buf) < _SMALL_BUFFER_BYTES:
            # The peer proved the key: the full buffer now, with what is unparsed at its front.
            grown = bytearray(_SMALL_BUFFER_BYTES)
            tail = self._end - self._start
            grown[:tail] = self._buf[self._start : self._end]
            self._buf, self._start, self._end = grown, 0, tail
        if self._end == len(self._buf):
            # Move the unparsed tail to the front (it is shorter than one small frame).
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received_bytes += nbytes
        if self._rest is not None:
            if self._rest.filled(nbytes):
                rest, self._rest = self._rest, None
                rest.end(self)
        else:
            self._end += nbytes
            self._parse()
        if self._out:
            # What the frames just read were answered with leaves now, not after every other
            # connection's reads of this loop iteration (a connection is read once an iteration).
            self._flush()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # --- sending ------------------------------------------------------------------------------
    def send(self, type_: int, header: Message | bytes, body: bytes = b"") -> None:
        """A one-way message. Raises ConnectionLost if the connection is closed."""
        self._write(encode(type_, header, body), body)

    async def request(
        self, type_: int, header: Message | bytes, body: bytes = b"", *, timeout_s: float | None = None
    ) -> Frame:
        """Send a request and wait for its answer. Raises ConnectionLost, TimeoutError, or
        RemoteError (the peer answered with an Error)."""
        correlation_id = self._last_id = _next_correlation_id(self._last_id, self._pending)
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._pending[correlation_id] = future
        try:
            self._write(encode(type_, header, body, flags=FLAG_REQUEST, correlation_id=correlation_id), body)
            if len(body) > _INLINE_BODY_BYTES:
                await self.drain()
            if timeout_s is None:
                frame = await future
            else:
                # A timer failing the future, not asyncio.timeout (a context manager that cancels the
                # task and maps the cancellation back): the same TimeoutError at the same moment,
                # for a third of the cost, on every request of the serving path.
                timer = self._loop.call_later(timeout_s, time_out, future)
                try:
                    frame = await future
                finally:
                    timer.cancel()
        finally:
            if self._pending.pop(correlation_id, None) is not None:  # given up on: its answer may still come
                self._given_up[correlation_id] = None
                if len(self._given_up) > _GIVEN_UP_KEPT:
                    del self._given_up[next(iter(self._given_up))]
        if frame.type == MessageType.ERROR:
            error = frame.message(pb.Error)
            raise RemoteError(error.status, error.message)
        return frame

    def reply(self, to: Frame, type_: int, header: Message | bytes, body: bytes = b"") -> None:
        """Answer request `to`. A connection closed meanwhile drops the answer silently: the peer
        that asked is gone."""
        if self.is_closed or self._lost_after_backlog is not None:
            return
        self._write(encode(type_, header, body, flags=FLAG_REPLY, correlation_id=to.correlation_id), body)

    def reply_error(self, to: Frame, status: int, message: str) -> None:
        self.reply(to, MessageType.ERROR, pb.Error(status=status, message=message))  # type: ignore[arg-type]

    def unwritten_bytes(self) -> int:
        """How many of the last `sent_bytes` are still buffered on this end (here or in the
        transport), not yet written to the socket: a frame that ended at `sent_bytes` == N is all
        written once `sent_bytes - unwritten_bytes() >= N`."""
        buffered = sum(map(len, self._out))
        return buffered + (self.transport.get_write_buffer_size() if self.transport is not None else 0)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark (or the connection closed)."""
        await self._can_write.wait()  # closing sets it too

    def close(self, exc: BaseException | None = None) -> None:
        if self.transport is not None:
            self.transport.close()
        self._fail_all(exc)

    async def aclose(self) -> None:
        self.close()
        await asyncio.shield(self.closed)

    # --- the handshake (the client's side: `_client_handshake`) -------------------------------
    def _handshake_frame(self, frame: Frame) -> None:
        """A frame before the handshake completed: only the handshake's own are taken."""
        if frame.type != MessageType.HELLO:
            self._protocol_error(Unauthenticated(f"{self.peer} sent a {_type_name(frame.type)} before the handshake"))
            return
        hello = frame.message(pb.Hello)
        if not self._server_side:
            if not self._hello.done():
                self._hello.set_result(hello.nonce)
            return
        assert self._key is not None
        if frame.is_request and hmac.compare_digest(
            hello.proof, _proof(self._key, b"client", self._server_nonce, hello.nonce)
        ):
            self.authenticated = True
            if self.on_authenticated is not None:
                self.on_authenticated(self)
            self.reply(
                frame,
                MessageType.HELLO,
                pb.Hello(proof=_proof(self._key, b"server", self._server_nonce, hello.nonce)),
            )
            return
        if frame.is_request:
            self.reply_error(frame, pb.UNAUTHENTICATED, "wrong cluster secret: check --secret-file on both ends")
            self._flush()
        self._protocol_error(Unauthenticated(f"{self.peer} failed the handshake (wrong cluster secret)"))

    def _handshake_expired(self, handshake_s: float) -> None:
        if not self.authenticated and not self.is_closed:
            self._protocol_error(Unauthenticated(f"{self.peer} did not complete the handshake in {handshake_s:g} s"))

    # --- internals ----------------------------------------------------------------------------
    def _write(self, prefix: bytes, body: bytes) -> None:
        if self.is_closed or self.transport is None or self._lost_after_backlog is not None:
            raise NotSent(f"connection to {self.peer or 'peer'} is closed")
        self.sent_bytes += len(prefix) + len(body)
        if len(body) > _INLINE_BODY_BYTES:
            self._flush()  # keep frames in order
            self.transport.writelines((prefix, body))
            return
        self._out.append(prefix + body if body else prefix)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out or self.transport is None or self.transport.is_closing():
            self._out.clear()
            return
        out, self._out = self._out, []
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _parse(self) -> None:
        buf, start, end = self._buf, self._start, self._end
        view = memoryview(buf)
        turn_frames = 0
        try:
            while end - start >= 4:
                (length,) = struct.unpack_from("!I", buf, start)
                total = 4 + length
                if not self.authenticated and total > HANDSHAKE_FRAME_BYTES:
                    # Checked again each frame: the Hello that authenticates may come first in a read.
                    self._protocol_error(Unauthenticated(_oversized_before_handshake(self.peer, buf, start, total)))
                    return
                if length < PREFIX_BYTES - 4:
                    self._protocol_error(ConnectionLost(f"malformed frame length {length}"))
                    return
                if total > self.max_frame_bytes:
                    if end - start < PREFIX_BYTES:
                        break  # its prefix says whether it is a request, which is skipped (else: cut off)
                    start = _over_limit(self, view, start, end, total)
                    if self.is_closed:
                        return
                    continue
                if end - start < total:
                    if total > len(buf):  # a large frame: the rest goes straight into a buffer of its own
                        self._rest = _LargeFrame(view[start:end], total)
                        start = end = 0
                    break
                if turn_frames == FRAMES_PER_TURN:
                    self._defer_rest()
                    break
                turn_frames += 1
                self._deliver(view, start, total, owned=False)
                start += total
                if self.is_closed:
                    return
        finally:
            view.release()
        if start == end:
            start = end = 0
        self._start, self._end = start, end

    def _defer_rest(self) -> None:
        """Leave the frames past this turn's for the next one, reading nothing more meanwhile."""
        assert self.transport is not None
        self._backlog = True
        self.transport.pause_reading()  # again, from _parse_backlog: a transport's pause is idempotent
        self._loop.call_soon(self._parse_backlog)

    def _parse_backlog(self) -> None:
        self._backlog = False
        if self.is_closed or self.transport is None:
            return
        self._parse()
        if self._out:
            self._flush()
        if self._backlog:
            return
        if self._lost_after_backlog is not None:
            self._fail_all(self._lost_after_backlog[0])
        else:
            self.transport.resume_reading()

    def _deliver(self, view: memoryview, start: int, total: int, *, owned: bool) -> None:
        _, type_, flags, correlation_id, header_len = _PREFIX.unpack_from(view, start)
        header_at = start + PREFIX_BYTES
        body_at = header_at + header_len
        if body_at > start + total:
            self._protocol_error(ConnectionLost("malformed frame: header longer than the frame"))
            return
        header = bytes(view[header_at:body_at])
        body = bytes(view[body_at : start + total]) if body_at < start + total else b""
        frame = Frame(type_, flags, correlation_id, header, body)
        # Before the handshake, a client takes replies (its Hello's answer) and Hellos; a server Hellos.
        if not self.authenticated and not (flags & FLAG_REPLY and not self._server_side):
            try:
                self._handshake_frame(frame)
            except ConnectionLost as exc:  # a malformed Hello
                self._protocol_error(exc)
            return
        if flags & FLAG_REPLY:
            future = self._pending.pop(correlation_id, None)
            if future is not None and not future.done():
                future.set_result(frame)
                return
            self._given_up.pop(correlation_id, None)
            if not getattr(self.handler, "takes_stray_replies", False):
                return
        if self.handler is None:
            if frame.is_request:
                self.reply_error(frame, pb.UNAVAILABLE, "this end takes no requests")
            return
        try:
            self.handler.on_frame(self, frame)
        except ConnectionLost as exc:  # a malformed message: the peer does not speak our protocol
            log.warning("closing connection from %s: %s", self.peer, exc)
            self._protocol_error(exc)
        except Exception:
            error_counts["handler"] += 1
            log.exception("handling a %s frame from %s failed", _type_name(type_), self.peer)
            if frame.is_request:
                self.reply_error(frame, pb.UNAVAILABLE, "internal error; see the daemon's log")

    def _protocol_error(self, exc: ConnectionLost) -> None:
        error_counts[_error_kind(exc)] += 1
        log.warning("connection %s: %s", self.peer, exc)
        self.close(exc)

    def _fail_all(self, exc: BaseException | None) -> None:
        if self.closed.done():
            return
        self.is_closed = True
        self.closed.set_result(exc)
        if self._key is not None and not self._server_side and not self._hello.done():
            # This end's own reason where it cut the peer off; else, plain, the likeliest one (a TLS
            # server takes a plain client's first bytes for TLS, and closes without a word).
            why = f": {exc}" if isinstance(exc, ConnectionLost) else f": {_SAME_TLS}" if self.peer_role is None else ""
            self._hello.set_exception(
                ConnectionLost(f"connection to {self.peer or 'peer'} closed before its handshake began{why}")
            )
            self._hello.exception()  # seen: a client refused before its handshake never awaits it
        self._can_write.set()
        self._out.clear()
        lost = ConnectionLost(f"connection to {self.peer or 'peer'} closed" + (f": {exc}" if exc else ""))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(lost)
        self._pending.clear()
        if self.handler is not None:
            try:
                self.handler.on_close(self, exc)
            except Exception:
                log.exception("on_close of %s failed", self.peer)


class _LargeFrame:
    """A frame larger than a connection's reading buffer, received into a buffer of its own."""

    __slots__ = ("data", "filled_bytes")

    def __init__(self, first: memoryview, total: int) -> None:
        self.data = bytearray(total)
        self.data[: len(first)] = first
        self.filled_bytes = len(first)

    def room(self) -> memoryview:
        """Where the next read goes."""
        return memoryview(self.data)[self.filled_bytes :]

    def filled(self, nbytes: int) -> bool:
        """`nbytes` were read into `room()`; True when the frame is whole."""
        self.filled_bytes += nbytes
        return self.filled_bytes == len(self.data)

    def end(self, conn: Connection) -> None:
        conn._deliver(memoryview(self.data), 0, len(self.data), owned=True)


class _SkippedFrame:
    """The rest of a request over a connection's limit (`_over_limit`): read into `scratch` (the
    connection's reading buffer, which holds nothing else meanwhile) and dropped, never buffered whole."""

    __slots__ = ("left_bytes", "scratch")

    def __init__(self, scratch: bytearray, left_bytes: int) -> None:
        self.scratch = scratch
        self.left_bytes = left_bytes

    def room(self) -> memoryview:
        """Where the next read goes: no further than the frame's end (what follows is parsed)."""
        return memoryview(self.scratch)[: min(self.left_bytes, len(self.scratch))]

    def filled(self, nbytes: int) -> bool:
        self.left_bytes -= nbytes
        return self.left_bytes == 0

    def end(self, conn: Connection) -> None:
        """Nothing to do: the request was answered (the reply's asker told) as it began."""


def _over_limit(conn: Connection, view: memoryview, start: int, end: int, total: int) -> int:
    """A frame of `total` bytes over `conn`'s limit begins at `start` of `view` (its prefix whole,
    `end` where the bytes read end); returns where parsing goes on.

    A request whose prefix reads as one (a known type, a correlation id, a header within the frame
    and its allowance) is answered TOO_LARGE at once and its bytes are read and dropped, as they
    arrive (`_SkippedFrame`): the connection stays, and the other requests on it are answered (a
    gateway whose payload limit is above its node's sent a payload between the two: that call alone
    is refused, not every call on the link). A reply that reads as one, to a request this end
    waits on, fails that request with AnswerTooLarge and is dropped alike (a node's limit above its
    gateway's: a result between the two fails that call alone); a late one, to a request given up
    on (`_given_up`), is dropped alike, as a small one is. Anything else over the limit (a one-way
    message, a reply to no request, a prefix that reads as garbage) closes the connection with
    FrameTooLarge: nobody would be told, or the stream is not frames."""
    _, type_, flags, correlation_id, header_bytes = _PREFIX.unpack_from(view, start)
    too_large = f"a frame of {total} bytes exceeds this connection's limit of {conn.max_frame_bytes}"
    readable = type_ in MESSAGES and header_bytes <= min(HEADER_ALLOWANCE_BYTES, total - PREFIX_BYTES)
    request = flags == FLAG_REQUEST and correlation_id != 0
    reply = flags == FLAG_REPLY and readable
    asker = conn._pending.pop(correlation_id, None) if reply else None
    late = reply and asker is None and correlation_id in conn._given_up
    if not readable or not (request or asker is not None or late):
        conn._protocol_error(FrameTooLarge(too_large))
        return end
    error_counts["frame_too_large"] += 1
    kind = "request: refused" if request else "late reply: dropped" if late else "reply: its request failed"
    over_limit = f"is over this end's limit of {conn.max_frame_bytes} bytes; it was not read"
    log.warning("connection %s: %s (a %s %s), the connection kept", conn.peer, too_large, _type_name(type_), kind)
    if late:
        del conn._given_up[correlation_id]
    elif asker is not None:
        if not asker.done():
            asker.set_exception(AnswerTooLarge(f"an answer of {total} bytes {over_limit}"))
    elif request:
        conn.reply_error(
            Frame(type_, flags, correlation_id, b"", b""), pb.TOO_LARGE, f"a request of {total} bytes {over_limit}"
        )
    if end - start >= total:
        return start + total
    conn._rest = _SkippedFrame(conn._buf, total - (end - start))
    return end


async def read_what_is_left(conn: Connection) -> None:
    """Handle every frame whose bytes are in `conn`'s socket now, then return (at once if it is
    closed, or not a socket): for a peer seen to exit before its end of the socket was read to
    EOF, whose last frames closing it now would drop. Bytes that come later are not waited for:
    another process may hold a copy of the peer's end, and write on."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None or conn.is_closed:
        return
    try:
        unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
    except (OSError, ValueError):  # (ValueError: uvloop's socket of a closed transport, fd -1)
        return
    until_bytes = conn.received_bytes + unread
    assert conn.transport is not None
    if not conn._backlog:  # (a backlog resumes reading itself once handled)
        conn.transport.resume_reading()
    while not conn.is_closed and (conn.received_bytes < until_bytes or conn._backlog):
        await asyncio.sleep(0)  # the loop reads and handles them, a turn at a time


def time_out(future: asyncio.Future[Any]) -> None:
    """A timer's end for a future awaited under a deadline (`loop.call_later(s, time_out, f)`):
    fails it with TimeoutError unless it is done. Cheaper than asyncio.timeout per call."""
    if not future.done():
        future.set_exception(TimeoutError())


def _oversized_before_handshake(peer: str, buf: bytearray, start: int, total: int) -> str:
    """Why `peer`, which announced a frame of `total` bytes at `start` of `buf` before the
    handshake, is cut off."""
    if buf[start : start + len(_TLS_HANDSHAKE_START)] == _TLS_HANDSHAKE_START:
        return f"{peer} began a TLS handshake, and this end reads plain frames: {_SAME_TLS}"
    return (
        f"{peer} announced a frame of {total} bytes before the handshake "
        f"(at most {HANDSHAKE_FRAME_BYTES} are read before it)"
    )


def _dial_failed(address: str, exc: Exception, *, tls: bool) -> ConnectionLost:
    """What a dial of `address` that failed with `exc` raises (and counts): Unauthenticated where
    TLS failed (the server's certificate is not the cluster's, or it refused ours), ConnectionLost
    otherwise; either saying so where one end seems to run with TLS and the other without."""
    reason = str(exc) or type(exc).__name__  # (uvloop's reset during TLS has no message)
    if isinstance(exc, ssl.SSLError):
        error_counts["auth"] += 1
        plain = f": {_SAME_TLS}" if exc.reason == "WRONG_VERSION_NUMBER" else ""
        return Unauthenticated(f"TLS with {address} failed: {reason}{plain}")
    error_counts["connect"] += 1
    if tls and isinstance(exc, ConnectionResetError):  # a plain server cut the TLS handshake off
        reason += f" during the TLS handshake: {_SAME_TLS}"
    return ConnectionLost(f"cannot connect to {address}: {reason}")


def _error_kind(exc: ConnectionLost) -> str:
    if isinstance(exc, Unauthenticated):
        return "auth"
    return "frame_too_large" if isinstance(exc, FrameTooLarge) else "malformed"


def _proof(key: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, role + b"|" + server_nonce + b"|" + client_nonce, hashlib.sha256).digest()


def _type_name(type_: int) -> str:
    with contextlib.suppress(ValueError):
        return MessageType(type_).name
    return str(type_)


async def connect(
    address: str,
    handler: Handler | None = None,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    timeout_s: float = 5.0,
    key: bytes | None = None,
    dead_after_s: float | None = DEAD_AFTER_S,
    tls: LinkTls | bool = True,
    peer_role: str | None = None,
) -> Connection:
    """Open a connection to "host:port" (proving `key` to the server, and checking its proof,
    when given); raises ConnectionLost if it cannot be opened in time, Unauthenticated if the
    handshake fails or the server's certificate does not belong there. The connection is lost
    `dead_after_s` after its peer falls silent (see `keepalive_options`). `tls`: True, this
    process's link TLS (gpufaas.tls.configure; plain where none); False, plain; or the one given.
    `peer_role`: under TLS, the role the server's certificate must name ("scheduler", "node"),
    beside what the link allows (gpufaas.tls.PEERS)."""
    if dead_after_s is not None:
        keepalive_options(dead_after_s)  # raises ValueError on a bad value
    links = links_of(tls)
    host, _, port = address.rpartition(":")
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            _, protocol = await loop.create_connection(
                lambda: Connection(handler, max_frame_bytes=max_frame_bytes, key=key, dead_after_s=dead_after_s),
                host.strip("[]"),
                int(port),
                ssl=links.client if links is not None else None,
                ssl_handshake_timeout=timeout_s if links is not None else None,
            )
    except (OSError, TimeoutError, ValueError) as exc:  # (ssl.SSLError is an OSError)
        raise _dial_failed(address, exc, tls=links is not None) from None
    try:
        if links is not None:
            assert protocol.transport is not None
            try:
                protocol.peer_role = links.check(
                    protocol.transport.get_extra_info("peercert"), "wire-client", address, peer_role
                )
            except PeerRefused as exc:
                error_counts["auth"] += 1
                raise Unauthenticated(str(exc)) from None
        if key is not None:
            try:
                await _client_handshake(protocol, timeout_s)
            except ConnectionLost as exc:
                error_counts["auth" if isinstance(exc, Unauthenticated) else "connect"] += 1
                raise
    except BaseException:  # cancelled too (a gateway's dial when the leader changed): nobody holds it
        protocol.close()
        raise
    return protocol


def _next_correlation_id(last_id: int, pending: Container[int]) -> int:
    """The id of the request after the one numbered `last_id`: 1 to 2**32 - 1 (the frame's u32
    field), wrapping past the top (a gateway's link to a node carries every call to it for the
    gateway's life: 2**32 requests are 5 days at 10,000 a second), never 0 (no request) and never
    one of `pending` (still awaiting its answer)."""
    while True:
        last_id = last_id % _MAX_CORRELATION_ID + 1
        if last_id not in pending:
            return last_id


async def _client_handshake(conn: Connection, timeout_s: float) -> None:
    """The client's side of the handshake: prove the key and check the server's proof (raises
    Unauthenticated)."""
    assert conn._key is not None and not conn._server_side
    try:
        async with asyncio.timeout(timeout_s):
            server_nonce = await asyncio.shield(conn._hello)
        client_nonce = os.urandom(_NONCE_BYTES)
        proof = _proof(conn._key, b"client", server_nonce, client_nonce)
        frame = await conn.request(MessageType.HELLO, pb.Hello(nonce=client_nonce, proof=proof), timeout_s=timeout_s)
    except TimeoutError:
        raise Unauthenticated(
            f"{conn.peer} sent no handshake in {timeout_s:g} s: is it a gpufaas daemon run with this cluster's "
            "secret (--secret-file)?"
        ) from None
    except RemoteError as exc:
        raise Unauthenticated(f"{conn.peer} refused this end: {exc}") from None
    if not hmac.compare_digest(frame.message(pb.Hello).proof, _proof(conn._key, b"server", server_nonce, client_nonce)):
        raise Unauthenticated(f"{conn.peer} does not hold this cluster's secret: check its --secret-file")
    conn.authenticated = True


class Server:
    """Accepts connections on "host:port" (port 0: any free one); each gets a handler of its own
    from `handler_for()`.

    With `key`, every connection must pass the handshake (within `handshake_s`; None:
    HANDSHAKE_S) before anything it sends is read, and at most `max_unauthenticated` may be in
    it at once: one accepted past that is closed at once (counted as an "auth" wire error), so
    that peers without the key hold no more than that many connections' worth of memory (under
    TLS counted from the end of the TLS handshake, which `handshake_s` bounds too). Every
    accepted connection is lost `dead_after_s` after its peer falls silent (`keepalive_options`).
    `tls` as for `connect`: with TLS, a peer whose certificate's role does not belong on the
    server's side of the link is cut off as it connects. `address` is the bound "host:port" once
    started. `close()` stops listening and closes every accepted connection.
    """

    def __init__(
        self,
        handler_for: Callable[[], Handler],
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        key: bytes | None = None,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        handshake_s: float | None = None,
        dead_after_s: float | None = DEAD_AFTER_S,
        tls: LinkTls | bool = True,
    ) -> None:
        if dead_after_s is not None:
            keepalive_options(dead_after_s)  # raises ValueError on a bad value
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated must be >= 1, got {max_unauthenticated}")
        if handshake_s is not None and handshake_s <= 0:
            raise ValueError(f"handshake_s must be positive, got {handshake_s}")
        self._handler_for = handler_for
        self.max_frame_bytes = max_frame_bytes
        self.key = key
        self.max_unauthenticated = max_unauthenticated
        self.handshake_s = handshake_s
        self.dead_after_s = dead_after_s
        self.tls = links_of(tls)
        self.connections: set[Connection] = set()
        self.handshaking: set[Connection] = set()  # accepted, not yet authenticated
        self._refusing = False  # a refusal was logged since the handshakes last fell under the cap
        self._server: asyncio.Server | None = None
        self._closed = False  # closed: a TLS handshake done after it is refused
        self.address = ""

    async def start(self, listen: str) -> str:
        host, _, port = listen.rpartition(":")
        loop = asyncio.get_running_loop()
        links = self.tls
        self._server = await loop.create_server(
            self._accept,
            host.strip("[]") or None,
            int(port),
            ssl=links.server if links is not None else None,
            ssl_handshake_timeout=self._handshake_s() if links is not None else None,
        )
        bound = self._server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        return self.address

    def _accept(self) -> Connection | _Refused:
        """The protocol for a connection just accepted (TCP). Under TLS it is registered, and
        counted toward `max_unauthenticated`, only once its TLS handshake is done (`_made_tls`): a
        TLS handshake that fails (a peer that connected and closed: a port scan, a TCP readiness
        probe) is never told to the protocol, on asyncio or uvloop, so a slot taken at accept was
        held until the handshake time ran out, and a burst of such peers locked everyone out.
        A TLS handshake in flight is bounded by the server's ssl_handshake_timeout (`handshake_s`)."""
        if self.tls is None and self._handshakes_full():
            error_counts["auth"] += 1
            return _Refused()

        def made_tls(peercert: Mapping[str, Any] | None) -> str:
            return self._made_tls(conn, peercert)

        conn = Connection(
            self._handler_for(),
            max_frame_bytes=self.max_frame_bytes,
            key=self.key,
            server=True,
            handshake_s=self.handshake_s,
            dead_after_s=self.dead_after_s,
            peer_check=made_tls if self.tls is not None else None,
        )
        if self.tls is None:
            self._register(conn)
        return conn

    def _handshakes_full(self) -> bool:
        """Whether `max_unauthenticated` connections are in the key handshake (logged once a burst)."""
        if self.key is None or len(self.handshaking) < self.max_unauthenticated:
            return False
        if not self._refusing:  # once per burst: a flood must not flood the log too
            self._refusing = True
            log.warning(
                "%d connections are in the handshake already: closing new ones until they finish or time out",
                len(self.handshaking),
            )
        return True

    def _made_tls(self, conn: Connection, peercert: Mapping[str, Any] | None) -> str:
        """A TLS connection's handshake is done: its peer's role (PeerRefused, which closes it,
        where the role does not belong here, the server is closed, or the key handshake is full)."""
        assert self.tls is not None
        role = self.tls.check(peercert, "wire-server")
        if self._closed:
            raise PeerRefused("the server is closed")
        if self._handshakes_full():
            raise PeerRefused(f"{len(self.handshaking)} connections are in the handshake already")
        self._register(conn)
        return role

    def _register(self, conn: Connection) -> None:
        self.connections.add(conn)
        if not conn.authenticated:
            self.handshaking.add(conn)
            conn.on_authenticated = self._authenticated
        conn.closed.add_done_callback(lambda _: self._gone(conn))

    def _handshake_s(self) -> float:
        return HANDSHAKE_S if self.handshake_s is None else self.handshake_s

    def _authenticated(self, conn: Connection) -> None:
        self.handshaking.discard(conn)

    def _gone(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.handshaking.discard(conn)
        if len(self.handshaking) < self.max_unauthenticated:
            self._refusing = False

    def handler(self) -> Handler:
        """A new connection's handler (what `handler_for` makes)."""
        return self._handler_for()

    def adopt(self, conn: Connection) -> None:
        """Serve `conn`, made elsewhere (gpufaas.wire_local's in-process end), as an accepted
        connection: `close()` closes it with the rest."""
        self.connections.add(conn)
        conn.closed.add_done_callback(lambda _: self._gone(conn))

    async def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)


class _Refused(asyncio.Protocol):
    """A connection accepted past the server's `max_unauthenticated`: closed at once, unread."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]  # every stream transport has it


_TCP_INFO_BYTES = 128  # struct tcp_info as far as tcpi_bytes_acked (Linux 4.1 and later)
_BYTES_ACKED_AT = 120  # tcpi_bytes_acked's offset in it


def taken_bytes(conn: Connection) -> int:
    """How many bytes `conn` sent that its peer has taken, a count that only grows: on TCP, those
    the peer's kernel acknowledged (TCP_INFO's tcpi_bytes_acked, counted on the wire: below TLS and
    every buffer of this end, which a TLS transport's write buffer size does not show); elsewhere
    (an in-memory link, a kernel without the field), those that left this end's buffers. One
    getsockopt."""
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except (OSError, ValueError):  # not TCP, or closed meanwhile (uvloop: a negative descriptor)
            info = b""
        if len(info) >= _TCP_INFO_BYTES:
            acked: int = struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0]
            return acked
    return conn.sent_bytes - conn.unwritten_bytes()
