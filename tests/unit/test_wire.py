"""gpufaas.wire: framing, request/reply correlation, limits and failures, over loopback and in memory."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

import pytest
import uvloop
from google.protobuf.message import Message

from gpufaas import wire
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_REPLY,
    FLAG_REQUEST,
    HEADER_ALLOWANCE_BYTES,
    PREFIX_BYTES,
    AnswerTooLarge,
    Connection,
    ConnectionLost,
    Frame,
    FrameTooLarge,
    MessageType,
    RemoteError,
    Server,
    connect,
    encode,
    max_frame_bytes_for,
)

SCENARIO_TIMEOUT_S = 30.0
WAIT_S = 5.0
MIB = 1024 * 1024
SMALL_BUFFER_BYTES = wire._SMALL_BUFFER_BYTES  # frames over this take the "big frame" path
INLINE_BODY_BYTES = wire._INLINE_BODY_BYTES  # bodies over this are written on their own
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,  # what the daemons run on: its transports differ
}
Run = Callable[[Coroutine[Any, Any, Any]], Any]
Summary = tuple[int, int, int, bytes, bytes]


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """Run a scenario on a fresh event loop (each kind the project uses), bounded in time."""

    def run_(scenario: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            return runner.run(asyncio.wait_for(scenario, SCENARIO_TIMEOUT_S))

    return run_


# --- builders ---------------------------------------------------------------------------------


def echo(conn: Connection, frame: Frame) -> None:
    conn.reply(frame, MessageType.EXECUTE_REPLY, frame.header, frame.body)


class Peer:
    """A handler that keeps every frame and every close it is told about; requests are answered
    by `answer` (default: echo the header and body back)."""

    def __init__(self, answer: Callable[[Connection, Frame], None] = echo) -> None:
        self.answer = answer
        self.frames: list[Frame] = []
        self.closes: list[BaseException | None] = []

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        if frame.is_request:
            self.answer(conn, frame)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.closes.append(exc)


def hold(conn: Connection, frame: Frame) -> None:
    """Leave the request unanswered (the test answers it, or never does)."""


def summary(frame: Frame) -> Summary:
    return (frame.type, frame.flags, frame.correlation_id, frame.header, frame.body)


def raw_frame(
    type_: int, header: Message | bytes, body: bytes = b"", *, flags: int = 0, correlation_id: int = 0
) -> bytes:
    """A whole frame's bytes, as they go on the wire."""
    return encode(type_, header, body, flags=flags, correlation_id=correlation_id) + body


def one_way(index: int, body_bytes: int) -> tuple[bytes, Summary]:
    """A one-way Done frame numbered `index`, and what its receiver should see."""
    header = pb.Done(call_id=f"c{index}", attempt=index % 7).SerializeToString()
    body = bytes([index % 251]) * body_bytes
    return raw_frame(MessageType.DONE, header, body), (int(MessageType.DONE), 0, 0, header, body)


async def until(predicate: Callable[[], object]) -> None:
    """Yield to the loop until `predicate()` holds (bounded: TimeoutError otherwise)."""
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def listening(session: Callable[[], Peer], **options: Any) -> AsyncIterator[Server]:
    """A Server(session, **options) on a free loopback port, closed on the way out."""
    server = Server(session, **options)
    await server.start("127.0.0.1:0")
    try:
        yield server
    finally:
        await server.close()


def serving(
    peer: Peer, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, key: bytes | None = None
) -> contextlib.AbstractAsyncContextManager[Server]:
    """A Server on a free loopback port whose connections all report to `peer`."""
    return listening(lambda: peer, max_frame_bytes=max_frame_bytes, key=key)


async def accepted(server: Server) -> Connection:
    """The server's end of its one connection (once it has accepted it)."""
    await until(lambda: server.connections)
    (conn,) = server.connections
    return conn


class RecordingTransport(asyncio.Transport):
    """Keeps what a Connection hands the transport: one entry per write call."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False
        self.reading = True
        self.pauses = 0

    def pause_reading(self) -> None:
        self.pauses += self.reading  # counts pauses of a reading transport (a second is a no-op)
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading, "resumed while reading"
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.writes.append(b"".join(list_of_data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.0.0.7", 7001) if name == "peername" else default


def attached(peer: Peer | None = None, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Connection:
    """A Connection on a RecordingTransport (call inside a running loop)."""
    conn = Connection(peer, max_frame_bytes=max_frame_bytes)
    conn.connection_made(RecordingTransport())
    return conn


def recorded(conn: Connection) -> RecordingTransport:
    assert isinstance(conn.transport, RecordingTransport)
    return conn.transport


async def feed(conn: Connection, data: bytes, chunk: int | None = None) -> None:
    """Deliver `data` the way a transport does (get_buffer, fill, buffer_updated), at most
    `chunk` bytes per read, reading nothing while the connection has paused reading (the loop
    turns meanwhile); stops early if the connection closes."""
    transport = recorded(conn)
    at = 0
    while at < len(data) and not conn.is_closed:
        if not transport.reading:
            await asyncio.sleep(0)
            continue
        buffer = conn.get_buffer(-1)
        n = min(len(buffer), len(data) - at, chunk or len(data))
        assert n > 0, f"the connection offers no room to read into after {at} bytes"
        buffer[:n] = data[at : at + n]
        conn.buffer_updated(n)
        at += n
    while not transport.reading and not conn.is_closed:
        await asyncio.sleep(0)


# --- requests and messages over TCP -----------------------------------------------------------


def test_many_concurrent_requests_each_get_their_own_answer(run: Run) -> None:
    count = 200
    held: list[tuple[Connection, Frame]] = []

    def answer_all_in_reverse(conn: Connection, frame: Frame) -> None:
        held.append((conn, frame))
        if len(held) == count:
            for c, f in reversed(held):
                c.reply(f, MessageType.EXECUTE_REPLY, f.header, f.body + b"!")

    async def scenario() -> list[Frame]:
        async with serving(Peer(answer_all_in_reverse)) as server:
            conn = await connect(server.address)
            replies = await asyncio.gather(
                *(
                    conn.request(MessageType.EXECUTE, pb.Execute(content_type=f"t{i}"), f"payload {i}".encode())
                    for i in range(count)
                )
            )
            await conn.aclose()
            return replies

    replies = run(scenario())
    assert [(r.message(pb.Execute).content_type, r.body) for r in replies] == [
        (f"t{i}", f"payload {i}!".encode()) for i in range(count)
    ]
    assert {(r.type, r.flags) for r in replies} == {(MessageType.EXECUTE_REPLY, FLAG_REPLY)}
    assert all(f.is_request and f.flags == FLAG_REQUEST for _, f in held)
    assert len({f.correlation_id for _, f in held}) == count
    assert 0 not in {f.correlation_id for _, f in held}


def test_one_way_messages_go_both_ways_without_a_correlation_id(run: Run) -> None:
    server_peer, client_peer = Peer(), Peer()

    async def scenario() -> None:
        async with serving(server_peer) as server:
            conn = await connect(server.address, client_peer)
            conn.send(MessageType.DONE, pb.Done(call_id="c1", attempt=2, outcome=pb.OK), b"result")
            server_end = await accepted(server)
            server_end.send(MessageType.EVICT, pb.Evict(gpu="0", models=["m@1"]))
            await until(lambda: server_peer.frames and client_peer.frames)
            await conn.aclose()

    run(scenario())
    (done,) = server_peer.frames
    assert (done.type, done.flags, done.correlation_id, done.is_request) == (MessageType.DONE, 0, 0, False)
    assert done.message(pb.Done) == pb.Done(call_id="c1", attempt=2, outcome=pb.OK)
    assert done.body == b"result"
    (evict,) = client_peer.frames
    assert (evict.type, evict.correlation_id, evict.body) == (MessageType.EVICT, 0, b"")
    assert list(evict.message(pb.Evict).models) == ["m@1"]


def test_the_server_end_may_ask_the_client_end(run: Run) -> None:
    async def scenario() -> Frame:
        async with serving(Peer()) as server:
            conn = await connect(server.address, Peer())
            server_end = await accepted(server)
            reply = await server_end.request(MessageType.REVOKE, pb.Revoke(grants=[pb.GrantRef(call_id="c9")]), b"x")
            await conn.aclose()
            return reply

    reply = run(scenario())
    assert reply.message(pb.Revoke).grants[0].call_id == "c9"
    assert reply.body == b"x"


def test_a_request_to_an_end_without_a_handler_is_answered_unavailable(run: Run) -> None:
    async def scenario() -> RemoteError:
        async with serving(Peer()) as server:
            conn = await connect(server.address)  # no handler: it only asks
            server_end = await accepted(server)
            with pytest.raises(RemoteError) as caught:
                await server_end.request(MessageType.EVICT, pb.Evict(gpu="0"))
            # The connection stays usable.
            assert (await conn.request(MessageType.PLACE, pb.Place(call_id="c1"))).message(pb.Place).call_id == "c1"
            await conn.aclose()
            return caught.value

    error = run(scenario())
    assert (error.status, error.message) == (pb.UNAVAILABLE, "this end takes no requests")


def test_reply_error_raises_remote_error_with_its_status_and_message(run: Run) -> None:
    def refuse(conn: Connection, frame: Frame) -> None:
        conn.reply_error(frame, pb.INVALID, f"no such function {frame.message(pb.Place).function!r}")

    async def scenario() -> RemoteError:
        async with serving(Peer(refuse)) as server:
            conn = await connect(server.address)
            with pytest.raises(RemoteError) as caught:
                await conn.request(MessageType.PLACE, pb.Place(call_id="c1", function="nope"))
            assert not conn.is_closed
            await conn.aclose()
            return caught.value

    error = run(scenario())
    assert error.status == pb.INVALID
    assert error.message == str(error) == "no such function 'nope'"


def test_a_handler_that_raises_answers_an_error_and_keeps_the_connection(run: Run) -> None:
    def fail_on_boom(conn: Connection, frame: Frame) -> None:
        if frame.body == b"boom":
            raise RuntimeError("handler bug")
        echo(conn, frame)

    class FailingOnOneWay(Peer):
        def on_frame(self, conn: Connection, frame: Frame) -> None:
            super().on_frame(conn, frame)
            if not frame.is_request:
                raise RuntimeError("handler bug on a one-way message")

    peer = FailingOnOneWay(fail_on_boom)

    async def scenario() -> tuple[RemoteError, Frame]:
        async with serving(peer) as server:
            conn = await connect(server.address)
            with pytest.raises(RemoteError) as caught:
                await conn.request(MessageType.PLACE, pb.Place(), b"boom")
            conn.send(MessageType.DONE, pb.Done(call_id="c1"))
            after = await conn.request(MessageType.PLACE, pb.Place(), b"fine")
            assert not conn.is_closed and server.connections
            await conn.aclose()
            return caught.value, after

    error, after = run(scenario())
    assert error.status == pb.UNAVAILABLE
    assert "internal error" in error.message
    assert after.body == b"fine"
    assert [f.body for f in peer.frames] == [b"boom", b"", b"fine"]


def test_a_malformed_message_closes_the_connection_and_fails_its_requests(run: Run) -> None:
    def parse_place(conn: Connection, frame: Frame) -> None:
        place = frame.message(pb.Place)  # raises ConnectionLost on garbage
        conn.reply(frame, MessageType.PLACEMENT, pb.Placement(call_id=place.call_id))

    server_peer, client_peer = Peer(parse_place), Peer()

    async def scenario() -> None:
        async with serving(server_peer) as server:
            conn = await connect(server.address, client_peer)
            good = await conn.request(MessageType.PLACE, pb.Place(call_id="c1"))
            assert good.message(pb.Placement).call_id == "c1"
            with pytest.raises(ConnectionLost):
                await conn.request(MessageType.PLACE, b"\x0a\x05ab")  # field 1 claims 5 bytes, holds 2
            await until(lambda: conn.is_closed and not server.connections)
            with pytest.raises(ConnectionLost):
                await conn.request(MessageType.PLACE, pb.Place(call_id="c2"))

    run(scenario())
    (exc,) = server_peer.closes
    assert isinstance(exc, ConnectionLost)
    assert "malformed Place message" in str(exc)
    assert len(client_peer.closes) == 1


def test_frame_message_raises_connection_lost_on_garbage() -> None:
    frame = Frame(MessageType.PLACE, 0, 0, b"\xff\xff\xff", b"")
    with pytest.raises(ConnectionLost, match="malformed Place message"):
        frame.message(pb.Place)


@pytest.mark.parametrize("body_bytes", [100 * 1024, 3 * MIB], ids=["in-one-read", "many-reads"])
def test_a_request_over_the_receivers_limit_is_answered_too_large_and_the_link_stays(run: Run, body_bytes: int) -> None:
    """A gateway's limit above its node's: a payload between the two cut the whole link, and every
    other call in flight on it lost its answer. The request alone is refused, its body read and dropped."""
    server_peer = Peer(hold)

    async def scenario() -> None:
        async with serving(server_peer, max_frame_bytes=64 * 1024) as server:
            conn = await connect(server.address)
            waiting = asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place(call_id="held")))
            await until(lambda: server_peer.frames)
            with pytest.raises(RemoteError) as refused:
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"big"), bytes(body_bytes), timeout_s=WAIT_S)
            assert refused.value.status == pb.TOO_LARGE
            assert "over this end's limit of 65536 bytes" in refused.value.message
            after = asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place(call_id="after")))
            await until(lambda: len(server_peer.frames) == 2)
            server_end = await accepted(server)
            for frame in server_peer.frames:
                server_end.reply(frame, MessageType.PLACEMENT, pb.Placement(call_id=frame.message(pb.Place).call_id))
            assert (await waiting).message(pb.Placement).call_id == "held"
            assert (await after).message(pb.Placement).call_id == "after"
            assert not conn.is_closed
            await conn.aclose()

    run(scenario())
    assert [f.message(pb.Place).call_id for f in server_peer.frames] == ["held", "after"]  # the big one never arrived


def test_a_one_way_message_over_the_receivers_limit_closes_it_with_frame_too_large(run: Run) -> None:
    server_peer = Peer(hold)

    async def scenario() -> None:
        async with serving(server_peer, max_frame_bytes=64 * 1024) as server:
            conn = await connect(server.address)
            waiting = asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place(call_id="held")))
            await until(lambda: server_peer.frames)
            conn.send(MessageType.DONE, pb.Done(), bytes(100 * 1024))  # nobody to answer: cut off
            with pytest.raises(ConnectionLost):
                await waiting
            await until(lambda: not server.connections)

    run(scenario())
    (exc,) = server_peer.closes
    assert isinstance(exc, FrameTooLarge)
    assert "exceeds this connection's limit of 65536" in str(exc)
    assert [f.message(pb.Place).call_id for f in server_peer.frames] == ["held"]


@pytest.mark.parametrize("body_bytes", [100 * 1024, 3 * MIB], ids=["in-one-read", "many-reads"])
def test_a_reply_over_the_askers_limit_fails_that_request_alone_and_the_link_stays(run: Run, body_bytes: int) -> None:
    """A node's limit above its gateway's: a result between the two cut the whole link, and every
    other call in flight on it lost its answer. The request it answers alone fails (AnswerTooLarge),
    its bytes read and dropped."""
    held: list[tuple[Connection, Frame]] = []

    def answer_the_second_with_too_much(conn: Connection, frame: Frame) -> None:
        held.append((conn, frame))
        if len(held) == 2:
            conn.reply(frame, MessageType.EXECUTE_REPLY, b"", bytes(body_bytes))

    client_peer = Peer()

    async def scenario() -> None:
        async with serving(Peer(answer_the_second_with_too_much)) as server:
            conn = await connect(server.address, client_peer, max_frame_bytes=64 * 1024)
            first = asyncio.ensure_future(conn.request(MessageType.EXECUTE, pb.Execute(token=b"first")))
            await until(lambda: held)
            with pytest.raises(AnswerTooLarge) as failed:
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"second"), timeout_s=WAIT_S)
            assert failed.value.status == pb.RESULT_TOO_LARGE
            assert "over this end's limit of 65536 bytes" in failed.value.message
            server_end, frame = held[0]
            server_end.reply(frame, MessageType.EXECUTE_REPLY, b"", b"small")
            assert (await first).body == b"small"
            assert not conn.is_closed
            await conn.aclose()

    run(scenario())
    assert client_peer.closes == [None]


def test_a_reply_over_the_limit_that_nobody_waits_for_closes_the_link(run: Run) -> None:
    async def scenario() -> BaseException | None:
        async with serving(Peer(hold)) as server:
            conn = await connect(server.address, Peer(), max_frame_bytes=64 * 1024)
            waiting = asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place(call_id="held")))
            server_end = await accepted(server)
            stray = Frame(MessageType.EXECUTE, FLAG_REQUEST, 999_999, b"", b"")  # no such request
            server_end.reply(stray, MessageType.EXECUTE_REPLY, b"", bytes(100 * 1024))
            with pytest.raises(ConnectionLost):
                await waiting
            return await conn.closed

    assert isinstance(run(scenario()), FrameTooLarge)


@pytest.mark.parametrize("body_bytes", [100 * 1024, 3 * MIB], ids=["in-one-read", "many-reads"])
def test_a_late_reply_over_the_limit_to_a_request_given_up_on_is_dropped_and_the_link_stays(
    run: Run, body_bytes: int
) -> None:
    """A small late answer (its request timed out, or its caller went) is dropped; one over the
    limit cut the link, and every other request in flight on it failed (a gateway's call whose
    client went away, its result over the gateway's limit: every other call to that node 502)."""
    held: list[tuple[Connection, Frame]] = []
    client_peer = Peer()

    async def scenario() -> None:
        async with serving(Peer(lambda conn, frame: held.append((conn, frame)))) as server:
            conn = await connect(server.address, client_peer, max_frame_bytes=64 * 1024)
            with pytest.raises(TimeoutError):
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"late"), timeout_s=0.05)
            other = asyncio.ensure_future(conn.request(MessageType.EXECUTE, pb.Execute(token=b"other")))
            await until(lambda: len(held) == 2)
            (late_end, late), (other_end, other_frame) = held
            late_end.reply(late, MessageType.EXECUTE_REPLY, b"", bytes(body_bytes))
            other_end.reply(other_frame, MessageType.EXECUTE_REPLY, b"", b"small")
            assert (await other).body == b"small"
            assert not conn.is_closed
            await conn.aclose()

    run(scenario())
    assert client_peer.closes == [None] and client_peer.frames == []


def test_a_large_body_arrives_intact_both_ways_and_small_frames_follow(run: Run) -> None:
    body = random.Random(15).randbytes(15 * MIB)
    limit = max_frame_bytes_for(16 * MIB)
    server_peer = Peer()

    async def scenario() -> tuple[Frame, Frame, Frame]:
        async with serving(server_peer, max_frame_bytes=limit) as server:
            conn = await connect(server.address, max_frame_bytes=limit)
            before = await conn.request(MessageType.EXECUTE, pb.Execute(content_type="small"), b"before")
            big = await conn.request(MessageType.EXECUTE, pb.Execute(content_type="big"), body)
            for i in range(3):
                conn.send(MessageType.DONE, pb.Done(call_id=f"after{i}"), b"x" * i)
            after = await conn.request(MessageType.EXECUTE, pb.Execute(content_type="small"), b"after")
            await conn.aclose()
            return before, big, after

    before, big, after = run(scenario())
    assert before.body == b"before" and after.body == b"after"
    assert big.message(pb.Execute).content_type == "big"
    assert len(big.body) == len(body) and big.body == body
    received = [(f.type, f.body[:8], len(f.body)) for f in server_peer.frames]
    assert received == [
        (MessageType.EXECUTE, b"before", 6),
        (MessageType.EXECUTE, body[:8], len(body)),
        (MessageType.DONE, b"", 0),
        (MessageType.DONE, b"x", 1),
        (MessageType.DONE, b"xx", 2),
        (MessageType.EXECUTE, b"after", 5),
    ]
    assert server_peer.frames[1].body == body


def test_a_request_or_send_on_a_closed_connection_raises_connection_lost(run: Run) -> None:
    client_peer = Peer()

    async def scenario() -> None:
        async with serving(Peer()) as server:
            conn = await connect(server.address, client_peer)
            await conn.aclose()
            assert conn.is_closed
            with pytest.raises(ConnectionLost, match="is closed"):
                await conn.request(MessageType.PLACE, pb.Place())
            with pytest.raises(ConnectionLost, match="is closed"):
                conn.send(MessageType.DONE, pb.Done())
            # An answer to a peer that is gone is dropped silently.
            conn.reply(Frame(MessageType.PLACE, FLAG_REQUEST, 5, b"", b""), MessageType.PLACEMENT, pb.Placement())
            await conn.aclose()  # again: nothing more happens

    run(scenario())
    assert client_peer.closes == [None]


def test_the_peer_closing_fails_pending_requests_and_calls_on_close_once(run: Run) -> None:
    server_peer, client_peer = Peer(hold), Peer()

    async def scenario() -> list[BaseException | Frame]:
        async with serving(server_peer) as server:
            conn = await connect(server.address, client_peer)
            waiting = [
                asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place(call_id=f"c{i}"))) for i in range(3)
            ]
            await until(lambda: len(server_peer.frames) == 3)
            await server.close()
            outcomes = await asyncio.gather(*waiting, return_exceptions=True)
            await conn.closed
            conn.close()  # closing our end afterwards reports nothing more
            await asyncio.sleep(0.01)
            assert not server.connections
            return outcomes

    outcomes = run(scenario())
    assert [type(o) for o in outcomes] == [ConnectionLost] * 3
    assert len(client_peer.closes) == 1
    assert len(server_peer.closes) == 1


def test_connect_to_a_port_nobody_listens_on_raises_connection_lost(run: Run) -> None:
    async def scenario() -> None:
        with socket.socket() as bound:  # bound, not listening: connections are refused
            bound.bind(("127.0.0.1", 0))
            port = bound.getsockname()[1]
            with pytest.raises(ConnectionLost, match=f"cannot connect to 127.0.0.1:{port}"):
                await connect(f"127.0.0.1:{port}", timeout_s=2.0)

    run(scenario())


def test_a_request_that_times_out_ignores_its_late_answer(run: Run) -> None:
    held: list[tuple[Connection, Frame]] = []

    def hold_the_first(conn: Connection, frame: Frame) -> None:
        if frame.body == b"slow":
            held.append((conn, frame))
        else:
            echo(conn, frame)

    async def scenario() -> Frame:
        async with serving(Peer(hold_the_first)) as server:
            conn = await connect(server.address)
            with pytest.raises(TimeoutError):
                await conn.request(MessageType.EXECUTE, pb.Execute(), b"slow", timeout_s=0.05)
            ((server_end, slow),) = held
            server_end.reply(slow, MessageType.EXECUTE_REPLY, b"", b"late")
            reply = await conn.request(MessageType.EXECUTE, pb.Execute(), b"next")
            assert not conn.is_closed
            await conn.aclose()
            return reply

    assert run(scenario()).body == b"next"


# --- framing: how bytes arrive ----------------------------------------------------------------


def test_the_frame_layout_is_as_documented(run: Run) -> None:
    """Written by hand from the module's docstring, read back the same way."""
    header = pb.Place(call_id="c1").SerializeToString()
    body = b"payload"
    frame = struct.pack("!IHHII", 12 + len(header) + len(body), MessageType.PLACE, FLAG_REQUEST, 77, len(header))
    frame += header + body

    async def scenario() -> bytes:
        loop = asyncio.get_running_loop()
        async with serving(Peer()) as server:
            host, _, port = server.address.rpartition(":")
            with socket.socket() as sock:
                sock.setblocking(False)
                await loop.sock_connect(sock, (host, int(port)))
                await loop.sock_sendall(sock, frame)
                answer = b""
                while len(answer) < len(frame):
                    chunk = await loop.sock_recv(sock, 65536)
                    assert chunk, "the server closed the connection"
                    answer += chunk
                return answer

    answer = run(scenario())
    assert struct.unpack_from("!IHHII", answer) == (
        12 + len(header) + len(body),
        MessageType.EXECUTE_REPLY,
        FLAG_REPLY,
        77,
        len(header),
    )
    assert answer[PREFIX_BYTES:] == header + body


def test_many_small_frames_sent_at_once_are_all_delivered_in_order(run: Run) -> None:
    frames = [one_way(i, i % 40) for i in range(500)]
    peer = Peer()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with serving(peer) as server:
            host, _, port = server.address.rpartition(":")
            with socket.socket() as sock:
                sock.setblocking(False)
                await loop.sock_connect(sock, (host, int(port)))
                await loop.sock_sendall(sock, b"".join(data for data, _ in frames))
                await until(lambda: len(peer.frames) == len(frames))

    run(scenario())
    assert [summary(f) for f in peer.frames] == [expected for _, expected in frames]


def test_frames_written_a_byte_at_a_time_are_delivered_when_complete(run: Run) -> None:
    (first, first_seen), (second, second_seen) = one_way(1, 3), one_way(2, 0)
    peer = Peer()

    async def scenario() -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            _, conn = await asyncio.get_running_loop().create_unix_connection(lambda: Connection(peer), sock=ours)
            data = first + second
            for i in range(len(data)):
                if i == len(first):
                    await until(lambda: len(peer.frames) == 1)
                assert len(peer.frames) == (0 if i < len(first) else 1), f"after {i} bytes"
                theirs.send(data[i : i + 1])
                await asyncio.sleep(0.001)  # let the loop read it on its own
            await until(lambda: len(peer.frames) == 2)
            conn.close()

    run(scenario())
    assert [summary(f) for f in peer.frames] == [first_seen, second_seen]


def stream() -> tuple[bytes, list[Summary]]:
    """Frames of many sizes around the reading buffer's: runs of small ones longer than the
    buffer (so reads end inside a frame), one that fills the buffer exactly, one a byte over it
    and one of a few MiB, each between small ones."""
    rng = random.Random(3)
    sizes = [rng.randrange(0, 3000) for _ in range(600)]
    for index, frame_bytes in [
        (300, SMALL_BUFFER_BYTES),  # exactly the buffer's size
        (400, SMALL_BUFFER_BYTES + 1),  # one byte over: the big path
        (500, 3 * MIB),
    ]:
        sizes[index] = frame_bytes - len(one_way(index, 0)[0])
    frames = [one_way(i, size) for i, size in enumerate(sizes)]
    assert [len(data) for data, _ in frames][300:401:100] == [SMALL_BUFFER_BYTES, SMALL_BUFFER_BYTES + 1]
    return b"".join(data for data, _ in frames), [seen for _, seen in frames]


@pytest.mark.parametrize("chunk", [7, 4093, 65536, SMALL_BUFFER_BYTES + 5, None])
def test_a_stream_cut_into_any_reads_yields_the_same_frames(chunk: int | None) -> None:
    data, expected = stream()
    peer = Peer()

    async def scenario() -> None:
        conn = attached(peer, max_frame_bytes=4 * MIB)
        await feed(conn, data, chunk)
        assert not conn.is_closed

    asyncio.run(scenario())
    assert [summary(f) for f in peer.frames] == expected


@pytest.mark.parametrize("chunk", [1, 7, 4093, SMALL_BUFFER_BYTES + 5, None])
def test_a_request_over_the_limit_amid_a_stream_cut_into_any_reads_is_skipped_and_answered_alone(
    chunk: int | None,
) -> None:
    # Its body looks like frames, more than the reading buffer holds: none of them may be delivered.
    body = b"".join(one_way(i, 100)[0] for i in range(100, 2300))
    assert len(body) > SMALL_BUFFER_BYTES
    big = raw_frame(MessageType.EXECUTE, pb.Execute(token=b"t"), body, flags=FLAG_REQUEST, correlation_id=9)
    around = [one_way(i, 100) for i in range(6)]
    data = b"".join(d for d, _ in around[:3]) + big + b"".join(d for d, _ in around[3:])
    peer = Peer()

    async def scenario() -> bytes:
        conn = attached(peer, max_frame_bytes=64 * 1024)
        await feed(conn, data, chunk)
        await asyncio.sleep(0)
        assert not conn.is_closed
        return b"".join(recorded(conn).writes)

    written = asyncio.run(scenario())
    assert [summary(f) for f in peer.frames] == [seen for _, seen in around]
    length, type_, flags, correlation_id, header_bytes = struct.unpack_from("!IHHII", written)
    assert (type_, flags, correlation_id, len(written)) == (MessageType.ERROR, FLAG_REPLY, 9, 4 + length)
    error = pb.Error.FromString(written[PREFIX_BYTES : PREFIX_BYTES + header_bytes])
    assert error.status == pb.TOO_LARGE and f"a request of {len(big)} bytes" in error.message


# --- writing ----------------------------------------------------------------------------------


def test_messages_sent_in_one_loop_pass_are_written_with_one_write() -> None:
    async def scenario() -> None:
        conn = attached()
        transport = recorded(conn)
        frames = [one_way(i, 10) for i in range(50)]
        for i in range(50):
            conn.send(MessageType.DONE, pb.Done(call_id=f"c{i}", attempt=i % 7), bytes([i % 251]) * 10)
        assert transport.writes == []  # nothing before the loop turns
        await asyncio.sleep(0)
        assert transport.writes == [b"".join(data for data, _ in frames)]
        conn.send(MessageType.DONE, pb.Done(call_id="next"))
        await asyncio.sleep(0)
        assert transport.writes[1:] == [raw_frame(MessageType.DONE, pb.Done(call_id="next"))]
        await asyncio.sleep(0)
        assert len(transport.writes) == 2  # no empty writes afterwards

    asyncio.run(scenario())


def test_the_answers_to_what_one_read_brought_are_written_before_the_loop_turns() -> None:
    """A server answers what it just read at once, with one write: not after every other
    connection's reads of the loop pass (a scheduler reads dozens of them per pass)."""

    async def scenario() -> None:
        conn = attached(Peer())
        transport = recorded(conn)
        requests = [
            raw_frame(MessageType.PLACE, f"h{i}".encode(), b"", flags=FLAG_REQUEST, correlation_id=i) for i in range(3)
        ]
        await feed(conn, b"".join(requests))
        answers = [
            raw_frame(MessageType.EXECUTE_REPLY, f"h{i}".encode(), b"", flags=FLAG_REPLY, correlation_id=i)
            for i in range(3)
        ]
        assert transport.writes == [b"".join(answers)]
        await feed(conn, one_way(9, 4)[0])  # nothing to answer: nothing written
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert transport.writes == [b"".join(answers)]  # and no empty write when the loop turns

    asyncio.run(scenario())


def test_one_read_of_many_frames_is_handled_a_turns_worth_at_a_time_with_reading_paused() -> None:
    """A read of thousands of small frames is not handled in one callback: FRAMES_PER_TURN of
    them per loop turn, the connection reading nothing more meanwhile, so that timers and other
    connections run in between (an overloaded scheduler's lease keep-alives waited out whole
    reads until its lease lapsed). Requests are answered turn by turn, in order."""
    per_turn = wire.FRAMES_PER_TURN
    count = 2 * per_turn + 5
    requests = [
        raw_frame(MessageType.PLACE, f"h{i}".encode(), b"", flags=FLAG_REQUEST, correlation_id=i + 1)
        for i in range(count)
    ]
    peer = Peer()

    async def scenario() -> None:
        conn = attached(peer)
        transport = recorded(conn)
        ticks: list[int] = []  # frames handled when each of a chain of loop callbacks ran

        def tick() -> None:
            ticks.append(len(peer.frames))
            if len(ticks) < 4:
                asyncio.get_running_loop().call_soon(tick)

        asyncio.get_running_loop().call_soon(tick)
        buffer = conn.get_buffer(-1)
        data = b"".join(requests)
        buffer[: len(data)] = data
        conn.buffer_updated(len(data))  # one read holding every frame
        assert len(peer.frames) == per_turn
        assert not transport.reading
        assert len(transport.writes) == 1  # this turn's answers, at once
        await until(lambda: len(peer.frames) == count)
        assert ticks[:3] == [per_turn, 2 * per_turn, count]  # the loop turned between the slices
        assert transport.reading and transport.pauses == 1
        assert [f.correlation_id for f in peer.frames] == list(range(1, count + 1))
        answered = b"".join(transport.writes)
        assert answered == b"".join(
            raw_frame(MessageType.EXECUTE_REPLY, f"h{i}".encode(), b"", flags=FLAG_REPLY, correlation_id=i + 1)
            for i in range(count)
        )
        assert len(transport.writes) == 3

    asyncio.run(scenario())


def test_a_transport_lost_during_a_backlog_refuses_sends_at_once_and_closes_after_the_frames() -> None:
    """The frames a read brought are all handled though the transport went meanwhile (TLS reads a
    close with the data), but nothing is written from the loss on: a send fails as on a closed
    connection instead of going into a dead transport, and `closed` resolves after the frames."""
    count = 3 * wire.FRAMES_PER_TURN
    peer = Peer()

    async def scenario() -> None:
        conn = attached(peer)
        data = b"".join(one_way(i, 3)[0] for i in range(count))
        buffer = conn.get_buffer(-1)
        buffer[: len(data)] = data
        conn.buffer_updated(len(data))
        assert len(peer.frames) == wire.FRAMES_PER_TURN
        conn.connection_lost(None)  # as the transport reports it
        assert not conn.closed.done()
        with pytest.raises(wire.NotSent):  # a ConnectionLost that says the peer cannot have seen it
            conn.send(MessageType.DONE, pb.Done(call_id="late"))
        with pytest.raises(wire.NotSent):
            await conn.request(MessageType.PLACE, pb.Place(call_id="late"))
        await asyncio.wait_for(asyncio.shield(conn.closed), WAIT_S)
        assert len(peer.frames) == count and peer.closes == [None]

    asyncio.run(scenario())


def test_a_large_body_is_written_at_once_after_what_was_queued_before_it() -> None:
    async def scenario() -> None:
        conn = attached()
        transport = recorded(conn)
        big = bytes(range(256)) * ((INLINE_BODY_BYTES + 256) // 256)
        conn.send(MessageType.DONE, pb.Done(call_id="first"))
        conn.send(MessageType.EXECUTE, pb.Execute(), big)
        assert transport.writes == [
            raw_frame(MessageType.DONE, pb.Done(call_id="first")),
            raw_frame(MessageType.EXECUTE, pb.Execute(), big),
        ]
        conn.send(MessageType.DONE, pb.Done(call_id="last"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert transport.writes[2:] == [raw_frame(MessageType.DONE, pb.Done(call_id="last"))]

    asyncio.run(scenario())


def test_messages_queued_when_the_connection_closes_are_not_written() -> None:
    async def scenario() -> None:
        peer = Peer()
        conn = attached(peer)
        conn.send(MessageType.DONE, pb.Done(call_id="c1"))
        conn.close()
        await asyncio.sleep(0)
        assert recorded(conn).writes == []
        assert recorded(conn).closing
        assert peer.closes == [None]
        assert conn.peer == "10.0.0.7:7001"

    asyncio.run(scenario())


# --- limits and malformed frames --------------------------------------------------------------


def test_max_frame_bytes_for_fits_a_full_body_and_its_header_and_nothing_more() -> None:
    max_body = 100_000
    limit = max_frame_bytes_for(max_body)
    assert limit == max_body + HEADER_ALLOWANCE_BYTES
    header = bytes(limit - max_body - PREFIX_BYTES)  # exactly the room left beside the body

    async def scenario() -> None:
        fits = attached(Peer(), max_frame_bytes=limit)
        exact = raw_frame(MessageType.EXECUTE, header, bytes(max_body))
        assert len(exact) == limit
        await feed(fits, exact)
        assert not fits.is_closed
        assert isinstance(fits.handler, Peer) and len(fits.handler.frames) == 1

        over = attached(Peer(), max_frame_bytes=limit)
        # Refused from its prefix alone (a one-way message: nobody to answer, so it is cut off).
        await feed(over, raw_frame(MessageType.EXECUTE, header, bytes(max_body + 1))[:PREFIX_BYTES])
        reason = await over.closed
        assert isinstance(reason, FrameTooLarge)
        assert f"a frame of {limit + 1} bytes exceeds" in str(reason)
        assert recorded(over).closing

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(struct.pack("!I", PREFIX_BYTES - 5) + bytes(16), "malformed frame length 11", id="short-length"),
        pytest.param(
            struct.pack("!IHHII", 12 + 4, MessageType.DONE, 0, 0, 5) + bytes(4),
            "header longer than the frame",
            id="header-past-the-end",
        ),
    ],
)
def test_a_malformed_frame_closes_the_connection(data: bytes, reason: str) -> None:
    peer = Peer()

    async def scenario() -> None:
        conn = attached(peer)
        waiting = asyncio.ensure_future(conn.request(MessageType.PLACE, pb.Place()))
        await asyncio.sleep(0)
        await feed(conn, data + raw_frame(MessageType.DONE, pb.Done()))
        assert conn.is_closed
        with pytest.raises(ConnectionLost):
            await waiting

    asyncio.run(scenario())
    assert peer.frames == []  # nothing after the bad frame is delivered either
    (exc,) = peer.closes
    assert isinstance(exc, ConnectionLost) and not isinstance(exc, FrameTooLarge)
    assert reason in str(exc)


# --- the handshake ----------------------------------------------------------------------------

KEY = b"k" * 32


def keyed_server(peer: Peer, key: bytes | None = KEY) -> contextlib.AbstractAsyncContextManager[Server]:
    return serving(peer, key=key)


def test_ends_holding_the_same_key_talk_both_ways_after_the_handshake(run: Run) -> None:
    async def scenario() -> None:
        peer = Peer()
        async with keyed_server(peer) as server:
            conn = await connect(server.address, Peer(), key=KEY)
            assert conn.authenticated
            answer = await conn.request(MessageType.EXECUTE, pb.Execute(token=b"t"), b"payload", timeout_s=WAIT_S)
            assert answer.body == b"payload"
            server_end = await accepted(server)
            assert server_end.authenticated
            # Hellos are the connection's business: the handlers saw only the call.
            assert [f.type for f in peer.frames] == [MessageType.EXECUTE]
            await conn.aclose()

    run(scenario())


def test_a_client_with_the_wrong_key_is_refused_and_the_server_reads_nothing_from_it(run: Run) -> None:
    async def scenario() -> None:
        peer = Peer()
        async with keyed_server(peer) as server:
            with pytest.raises(wire.Unauthenticated, match=r"refused this end: .*wrong cluster secret"):
                await connect(server.address, Peer(), key=b"x" * 32)
            await until(lambda: not server.connections)
            assert peer.frames == []

    run(scenario())


def test_a_server_with_another_key_is_not_trusted_by_the_client(run: Run) -> None:
    async def scenario() -> None:
        # A server that accepts any client proof but cannot prove the client's key (an impostor).
        impostor = await asyncio.start_server(_impostor, "127.0.0.1", 0)
        port = impostor.sockets[0].getsockname()[1]
        try:
            with pytest.raises(wire.Unauthenticated, match="does not hold this cluster's secret"):
                await connect(f"127.0.0.1:{port}", key=KEY)
        finally:
            impostor.close()

    run(scenario())


async def _impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(raw_frame(MessageType.HELLO, pb.Hello(nonce=b"n" * 16)))
    (length,) = struct.unpack("!I", await reader.readexactly(4))
    rest = await reader.readexactly(length)
    _, _, correlation_id, _ = struct.unpack_from("!HHII", rest)
    writer.write(
        raw_frame(MessageType.HELLO, pb.Hello(proof=b"p" * 32), flags=FLAG_REPLY, correlation_id=correlation_id)
    )
    await writer.drain()
    await asyncio.sleep(1.0)
    writer.close()


def test_a_client_without_a_key_is_cut_off_at_its_first_frame(run: Run) -> None:
    async def scenario() -> None:
        peer = Peer()
        async with keyed_server(peer) as server:
            conn = await connect(server.address)  # no key: it never proves anything
            with pytest.raises(ConnectionLost):
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"t"), b"x", timeout_s=WAIT_S)
            assert peer.frames == []

    run(scenario())


def test_a_keyless_server_makes_a_keyed_client_give_up_with_a_clear_error(run: Run) -> None:
    async def scenario() -> None:
        async with keyed_server(Peer(), key=None) as server:
            with pytest.raises(wire.Unauthenticated, match=r"sent no handshake in 0\.5 s"):
                await connect(server.address, key=KEY, timeout_s=0.5)

    run(scenario())


def test_a_keyed_client_cut_off_by_its_own_check_before_the_handshake_says_why(run: Run) -> None:
    # A dial of another service that speaks first (an SSH banner): the client cuts it off, and its
    # error is that reason, not a guess (that one end runs with TLS and the other without).
    async def scenario() -> None:
        async def banner(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
                await writer.wait_closed()

        other = await asyncio.start_server(banner, "127.0.0.1", 0)
        port = other.sockets[0].getsockname()[1]
        try:
            with pytest.raises(ConnectionLost, match=r"closed before its handshake began: .* announced a frame of"):
                await connect(f"127.0.0.1:{port}", key=KEY, tls=False, timeout_s=WAIT_S)
        finally:
            other.close()

    run(scenario())


def test_a_client_that_stays_silent_is_cut_off_after_the_handshake_time(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "HANDSHAKE_S", 0.2)

    async def scenario() -> None:
        async with keyed_server(Peer()) as server:
            reader, writer = await asyncio.open_connection(*server.address.rsplit(":", 1))
            hello = await reader.readexactly(4)  # the server's Hello arrives ...
            assert struct.unpack("!I", hello)[0] > 0
            async with asyncio.timeout(WAIT_S):  # ... then, with nothing sent back, EOF
                while await reader.read(4096):
                    pass
            writer.close()

    run(scenario())


def test_a_proof_replayed_on_a_new_connection_fails(run: Run) -> None:
    async def scenario() -> None:
        async with keyed_server(Peer()) as server:
            host, port = server.address.rsplit(":", 1)
            # Record a good client Hello against one server nonce ...
            reader, writer = await asyncio.open_connection(host, port)
            (length,) = struct.unpack("!I", await reader.readexactly(4))
            first_nonce = Frame(0, 0, 0, (await reader.readexactly(length))[12:], b"").message(pb.Hello).nonce
            client_nonce = b"c" * 16
            proof = wire._proof(KEY, b"client", first_nonce, client_nonce)
            writer.close()
            # ... and replay it on a second connection, whose server nonce differs.
            reader, writer = await asyncio.open_connection(host, port)
            await reader.readexactly(4 + length)
            replay = raw_frame(
                MessageType.HELLO, pb.Hello(nonce=client_nonce, proof=proof), flags=FLAG_REQUEST, correlation_id=1
            )
            writer.write(replay)
            (answer_length,) = struct.unpack("!I", await reader.readexactly(4))
            answer = await reader.readexactly(answer_length)
            assert struct.unpack_from("!H", answer)[0] == MessageType.ERROR
            assert await reader.read() == b""  # and the connection is closed
            writer.close()

    run(scenario())


# --- nothing allocated before the handshake ---------------------------------------------------
def test_a_frame_announced_before_the_handshake_past_its_cap_cuts_the_peer_off_unallocated() -> None:
    async def scenario() -> None:
        conn = Connection(Peer(), max_frame_bytes=max_frame_bytes_for(16 * MIB), key=KEY, server=True)
        conn.connection_made(RecordingTransport())
        assert len(conn._buf) == wire.HANDSHAKE_FRAME_BYTES  # not the 256 KiB read buffer yet
        # A length the connection's limit allows once authenticated: before, it is refused unread.
        await feed(conn, struct.pack("!I", 16 * MIB) + b"x" * 100)
        assert conn.is_closed
        assert isinstance(conn.closed.result(), wire.Unauthenticated)
        assert conn._rest is None and len(conn._buf) == wire.HANDSHAKE_FRAME_BYTES

    asyncio.run(scenario())


def test_after_the_handshake_the_full_buffer_is_made_and_large_frames_pass(run: Run) -> None:
    body = random.Random(3).randbytes(SMALL_BUFFER_BYTES * 3)

    async def scenario() -> None:
        limit = max_frame_bytes_for(4 * MIB)
        async with listening(Peer, max_frame_bytes=limit, key=KEY) as server:
            conn = await connect(server.address, Peer(), key=KEY, max_frame_bytes=limit)
            answer = await conn.request(MessageType.EXECUTE, pb.Execute(), body, timeout_s=WAIT_S)
            assert answer.body == body
            server_end = await accepted(server)
            assert len(server_end._buf) == SMALL_BUFFER_BYTES and len(conn._buf) == SMALL_BUFFER_BYTES
            await conn.aclose()

    run(scenario())


async def _open_silent(address: str, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = address.rsplit(":", 1)
    return [await asyncio.open_connection(host, int(port)) for _ in range(count)]


async def _hello_or_eof(reader: asyncio.StreamReader) -> bytes:
    """The first bytes the server sends (its Hello), or b"" when it closed the connection unread."""
    try:
        return await asyncio.wait_for(reader.read(4096), WAIT_S)
    except ConnectionResetError:
        return b""


def test_connections_past_the_handshake_cap_are_closed_at_once_and_authenticated_ones_do_not_count(
    run: Run,
) -> None:
    async def scenario() -> None:
        async with listening(Peer, key=KEY, max_unauthenticated=3) as server:
            # Authenticated clients hold no handshake slot.
            clients = [await connect(server.address, Peer(), key=KEY) for _ in range(4)]
            silent = await _open_silent(server.address, 5)
            greeted = [await _hello_or_eof(reader) for reader, _ in silent]
            assert [bool(first) for first in greeted] == [True, True, True, False, False]
            await until(lambda: len(server.handshaking) == 3)
            with pytest.raises(ConnectionLost):  # no slot while three peers sit in the handshake
                await connect(server.address, key=KEY, timeout_s=1.0)
            silent[0][1].close()  # one leaves: a proper client gets in again
            await until(lambda: len(server.handshaking) == 2)
            late = await connect(server.address, Peer(), key=KEY)
            answer = await late.request(MessageType.EXECUTE, pb.Execute(), b"still served", timeout_s=WAIT_S)
            assert answer.body == b"still served"
            for conn in [*clients, late]:
                await conn.aclose()
            for _, writer in silent:
                writer.close()

    run(scenario())


def test_a_servers_own_handshake_time_cuts_off_a_silent_peer_and_frees_its_slot(run: Run) -> None:
    async def scenario() -> None:
        async with listening(Peer, key=KEY, max_unauthenticated=1, handshake_s=0.2) as server:
            ((reader, writer),) = await _open_silent(server.address, 1)
            assert await _hello_or_eof(reader)
            async with asyncio.timeout(WAIT_S):  # then EOF, with nothing sent back
                while await reader.read(4096):
                    pass
            await until(lambda: not server.handshaking)
            conn = await connect(server.address, Peer(), key=KEY)
            assert conn.authenticated
            await conn.aclose()
            writer.close()

    run(scenario())


@pytest.mark.parametrize("options", [{"max_unauthenticated": 0}, {"handshake_s": 0.0}, {"dead_after_s": 1.5}])
def test_a_server_refuses_limits_that_would_admit_nobody(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Server(Peer, key=KEY, **options)


# --- a vanished peer: the kernel's keepalive and user timeout ----------------------------------


@pytest.mark.parametrize(
    ("dead_after_s", "idle_s", "count", "user_timeout_ms"), [(5.0, 2, 3, 5000), (2, 1, 1, 2000), (9.5, 4, 6, 9500)]
)
def test_keepalive_options_give_up_on_a_silent_peer_after_dead_after_s(
    dead_after_s: float, idle_s: int, count: int, user_timeout_ms: int
) -> None:
    """A probe after half of `dead_after_s` without traffic, then one a second; the user timeout
    (which also ends a probed connection once nothing came back for that long) is `dead_after_s`."""
    assert wire.keepalive_options(dead_after_s) == [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count),
        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms),
    ]
    # The last probe goes out no earlier than the user timeout: the count never ends it first.
    assert idle_s + count >= dead_after_s


def test_a_dead_after_s_under_two_seconds_is_refused() -> None:
    for dead_after_s in (1.9, 0.0, -1.0):
        with pytest.raises(ValueError, match="at least 2 s"):
            wire.keepalive_options(dead_after_s)
    with pytest.raises(ValueError, match="at least 2 s"):
        asyncio.run(connect("127.0.0.1:1", dead_after_s=1.0))


def _socket_options(conn: Connection) -> list[tuple[int, int, int]]:
    assert conn.transport is not None
    sock = conn.transport.get_extra_info("socket")
    return [(level, option, sock.getsockopt(level, option)) for level, option, _ in wire.keepalive_options(2)]


def test_both_ends_of_a_tcp_connection_give_up_on_a_silent_peer(run: Run) -> None:
    """Every wire socket, client or accepted, keyed or not, carries `keepalive_options` of its own
    `dead_after_s` (DEAD_AFTER_S by default); None leaves the kernel's defaults (keepalive off)."""

    async def scenario() -> None:
        peer = Peer()
        for key in (None, KEY):
            async with serving(peer, key=key) as server:
                client = await connect(server.address, key=key)
                assert _socket_options(client) == wire.keepalive_options(wire.DEAD_AFTER_S)
                assert _socket_options(await accepted(server)) == wire.keepalive_options(wire.DEAD_AFTER_S)
                client.close()
        async with listening(lambda: peer, dead_after_s=None) as server:
            own = await connect(server.address, dead_after_s=8)
            assert _socket_options(own) == wire.keepalive_options(8)
            assert _socket_options(await accepted(server))[0] == (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 0)
            own.close()

    run(scenario())


def test_a_unix_socket_connection_is_left_as_it_is(run: Run) -> None:
    """A worker's connection (a Unix socket) has no TCP options to set: it opens and carries frames."""

    async def scenario() -> None:
        peer = Peer()
        ours, theirs = socket.socketpair()
        with ours, theirs:
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_unix_connection(lambda: Connection(None), sock=ours)
            _, other = await loop.create_unix_connection(lambda: Connection(peer), sock=theirs)
            frame = await conn.request(MessageType.EXECUTE, pb.Execute(token=b"t"), b"body", timeout_s=WAIT_S)
            assert frame.body == b"body"
            conn.close()
            other.close()

    run(scenario())


def test_request_ids_wrap_past_the_frames_u32_and_skip_those_still_awaiting_answers(run: Run) -> None:
    # A gateway's link to a node carries every call to it for the gateway's life: past 2**32
    # requests the id no longer fit the frame, and every call on the link failed (a struct.error).
    held: list[Frame] = []

    def answer_unless_held(conn: Connection, frame: Frame) -> None:
        if frame.body == b"hold":
            held.append(frame)
        else:
            echo(conn, frame)

    async def scenario() -> list[int]:
        async with serving(Peer(answer_unless_held)) as server:
            conn = await connect(server.address)
            waiting = asyncio.ensure_future(conn.request(MessageType.EXECUTE, pb.Execute(), b"hold"))  # id 1
            await until(lambda: held)
            conn._last_id = 2**32 - 3  # as after that many requests
            ids = []
            for i in range(4):
                reply = await conn.request(MessageType.EXECUTE, pb.Execute(), f"p{i}".encode())
                assert reply.body == f"p{i}".encode()
                ids.append(reply.correlation_id)
            assert not waiting.done()  # its id was not given to another request
            await conn.aclose()
            return [held[0].correlation_id, *ids]

    held_id, *ids = run(scenario())
    assert held_id == 1
    assert ids == [2**32 - 2, 2**32 - 1, 2, 3]


def test_a_dial_cancelled_during_the_key_handshake_closes_its_connection(run: Run) -> None:
    # A gateway cancels its dial of the scheduler when the leader changes meanwhile: the connection
    # was left open, unheld, and the old leader (a standby now) authenticated it once it caught up.
    async def scenario() -> None:
        peer_closed, got_proof = asyncio.Event(), asyncio.Event()

        async def slow_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(raw_frame(MessageType.HELLO, pb.Hello(nonce=bytes(16))))
            await writer.drain()
            await reader.read(1024)  # the client's proof, never answered
            got_proof.set()
            if await reader.read(1024) == b"":
                peer_closed.set()

        server = await asyncio.start_server(slow_server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            dial = asyncio.ensure_future(connect(f"127.0.0.1:{port}", None, key=b"k" * 32, timeout_s=WAIT_S))
            await asyncio.wait_for(got_proof.wait(), WAIT_S)
            dial.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dial
            await asyncio.wait_for(peer_closed.wait(), WAIT_S)
        finally:
            server.close()

    run(scenario())
