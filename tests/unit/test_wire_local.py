"""gpufaas.wire_local: a Connection pair joined in memory behaves as a socket's ends do."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from gpufaas import wire
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, RemoteError, Server, Unauthenticated
from gpufaas.wire_local import PEER_NAME, link_here, local_pair, serve_here, withdraw


class Recorder:
    """A handler that keeps what it hears, answers CLUSTER requests with the body reversed and
    refuses other requests."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.closed: list[BaseException | None] = []

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        if frame.type == MessageType.CLUSTER:
            conn.reply(frame, MessageType.CLUSTER_REPLY, pb.ClusterReply(), frame.body[::-1])
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, "not this one")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.closed.append(exc)


def on_a_loop(scenario: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test runs `scenario` on an event loop of its own."""

    @functools.wraps(scenario)
    def test(*args: Any, **kwargs: Any) -> None:
        asyncio.run(scenario(*args, **kwargs))

    return test


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@on_a_loop
async def test_a_request_is_answered_and_an_error_raised_as_over_a_socket() -> None:
    server = Recorder()
    client_end, server_end = local_pair(None, server, server_role="scheduler", client_role="gateway")
    reply = await client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), b"abc", timeout_s=1)
    assert reply.type == MessageType.CLUSTER_REPLY and reply.body == b"cba"
    with pytest.raises(RemoteError, match="not this one"):
        await client_end.request(MessageType.PLACE, pb.Place(call_id="c1"), timeout_s=1)
    assert (client_end.peer_role, server_end.peer_role) == ("scheduler", "gateway")
    assert client_end.peer == server_end.peer == PEER_NAME


@on_a_loop
async def test_frames_arrive_in_order_and_never_inside_the_senders_call() -> None:
    server = Recorder()
    client_end, _ = local_pair(None, server)
    for index in range(50):
        client_end.send(MessageType.PLACE, pb.Place(call_id=f"c{index}"))
        assert server.frames == [], "delivered under the sender's own call"
    await turns()
    assert [frame.message(pb.Place).call_id for frame in server.frames] == [f"c{i}" for i in range(50)]


@on_a_loop
async def test_a_body_larger_than_the_read_buffer_arrives_whole() -> None:
    server = Recorder()
    client_end, _ = local_pair(None, server)
    body = bytes(range(256)) * 8192  # 2 MiB: several of the reader's buffers, a large body's path
    reply = await client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), body, timeout_s=2)
    assert reply.body == body[::-1]


@on_a_loop
async def test_a_request_over_the_limit_is_refused_alone_and_a_one_way_message_closes_both_ends() -> None:
    server = Recorder()
    client_end, server_end = local_pair(None, server, max_frame_bytes=64 * 1024)
    with pytest.raises(RemoteError) as refused:
        await client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), b"x" * 100_000, timeout_s=1)
    assert refused.value.status == pb.TOO_LARGE
    reply = await client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), b"ok", timeout_s=1)
    assert reply.body == b"ko"
    client_end.send(MessageType.DONE, pb.Done(), b"x" * 100_000)
    await turns()
    assert client_end.is_closed and server_end.is_closed


@pytest.mark.parametrize("closing", ["client", "server"])
@on_a_loop
async def test_closing_either_end_closes_both_and_each_handler_hears_it_once(closing: str) -> None:
    client, server = Recorder(), Recorder()
    client_end, server_end = local_pair(client, server)
    waiting = asyncio.ensure_future(client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), timeout_s=5))
    (client_end if closing == "client" else server_end).close()
    await turns()
    assert client_end.is_closed and server_end.is_closed
    assert len(client.closed) == 1 and len(server.closed) == 1
    with pytest.raises(ConnectionLost):
        await waiting
    with pytest.raises(ConnectionLost):
        client_end.send(MessageType.PLACE, pb.Place(call_id="late"))


@on_a_loop
async def test_a_server_closes_an_adopted_end_and_forgets_it_once_closed() -> None:
    server = Server(Recorder, tls=False)
    client_end, server_end = local_pair(None, Recorder())
    server.adopt(server_end)
    assert server_end in server.connections
    await server.close()
    await turns()
    assert client_end.is_closed and server.connections == set()


@on_a_loop
async def test_a_server_served_here_is_dialled_in_memory_until_withdrawn() -> None:
    handlers: list[Recorder] = []

    def handler() -> Recorder:
        handlers.append(Recorder())
        return handlers[-1]

    server = Server(handler, tls=False, dead_after_s=None)
    address = await server.start("127.0.0.1:0")
    assert link_here(address, None, client_role="gateway") is None  # not offered: dial it
    serve_here(address, server, role="node")
    try:
        dialled = link_here(address, None, client_role="gateway", peer_role="node")
        assert dialled is not None and dialled.peer == PEER_NAME and dialled.peer_role == "node"
        reply = await dialled.request(MessageType.CLUSTER, pb.ClusterRequest(), b"abc", timeout_s=1)
        assert reply.body == b"cba"
        # Served as an accepted connection: a handler of the server's own, closed with the server.
        (accepted,) = server.connections
        assert accepted.peer_role == "gateway" and len(handlers) == 1 and handlers[0].frames
        assert link_here("127.0.0.1:1", None, client_role="gateway") is None  # another address
        with pytest.raises(Unauthenticated, match="not a scheduler"):
            link_here(address, None, client_role="gateway", peer_role="scheduler")
    finally:
        withdraw(address)
    assert link_here(address, None, client_role="gateway") is None
    await server.close()
    await turns()
    assert dialled.is_closed


@on_a_loop
async def test_each_end_of_a_link_made_here_keeps_its_own_frame_limit() -> None:
    """As over a socket: the server refuses a frame over its limit even if the dialer takes larger."""
    server = Server(Recorder, tls=False, dead_after_s=None, max_frame_bytes=4096)
    address = await server.start("127.0.0.1:0")
    serve_here(address, server, role="node")
    try:
        dialled = link_here(address, None, client_role="gateway", max_frame_bytes=1 << 20)
        assert dialled is not None
        (accepted,) = server.connections
        assert (dialled.max_frame_bytes, accepted.max_frame_bytes) == (1 << 20, 4096)
        with pytest.raises(RemoteError, match="over this end's limit of 4096 bytes"):
            await dialled.request(MessageType.CLUSTER, pb.ClusterRequest(), b"x" * 8192, timeout_s=1)
    finally:
        withdraw(address)
        await server.close()


@on_a_loop
async def test_a_flood_is_delivered_a_turns_worth_at_a_time_whole_and_in_order() -> None:
    """The receiving end pauses its reading past wire.FRAMES_PER_TURN frames in a turn, as on a
    socket: the rest waits in memory and comes, in order, on the following turns."""
    server = Recorder()
    client_end, _ = local_pair(None, server)
    count = 3 * wire.FRAMES_PER_TURN + 1
    for i in range(count):
        client_end.send(MessageType.DONE, pb.Done(call_id=f"c{i}"))
    seen: list[int] = []
    for _ in range(6):
        await asyncio.sleep(0)
        seen.append(len(server.frames))
    assert seen[-1] == count
    assert max(b - a for a, b in zip([0, *seen], seen, strict=False)) == wire.FRAMES_PER_TURN
    assert [pb.Done.FromString(f.header).call_id for f in server.frames] == [f"c{i}" for i in range(count)]
    # the link still carries both ways afterwards
    reply = await client_end.request(MessageType.CLUSTER, pb.ClusterRequest(), b"ab", timeout_s=1)
    assert reply.body == b"ba"


@on_a_loop
async def test_an_end_that_closes_after_a_flood_is_heard_closing_after_all_it_sent() -> None:
    """As a FIN: the other end still reads, a turn's worth at a time, everything sent before the
    close, and hears the close after it."""
    server = Recorder()
    client_end, server_end = local_pair(None, server)
    count = 5 * wire.FRAMES_PER_TURN
    for i in range(count):
        client_end.send(MessageType.DONE, pb.Done(call_id=f"c{i}"))
    await asyncio.sleep(0)  # the frames leave in one write
    client_end.close()
    await asyncio.wait_for(asyncio.shield(server_end.closed), 1)
    assert [pb.Done.FromString(f.header).call_id for f in server.frames] == [f"c{i}" for i in range(count)]
    assert server.closed == [None]


@on_a_loop
async def test_many_small_writes_waiting_for_a_paused_end_reach_it_a_turns_worth_at_a_time() -> None:
    """What waits for an end that paused its reading comes as a socket's reads would: one read of
    everything waiting (up to the reader's buffer), handled FRAMES_PER_TURN frames a turn, not
    every queued write at once."""
    server = Recorder()
    client_end, server_end = local_pair(None, server)
    assert server_end.transport is not None
    server_end.transport.pause_reading()
    chunks, per_chunk = 30, 10
    for turn in range(chunks):  # one write a turn: 30 writes wait
        for i in range(per_chunk):
            client_end.send(MessageType.DONE, pb.Done(call_id=f"c{turn * per_chunk + i}"))
        await asyncio.sleep(0)
    assert server.frames == []
    server_end.transport.resume_reading()
    seen: list[int] = []
    while len(server.frames) < chunks * per_chunk:
        await asyncio.sleep(0)
        seen.append(len(server.frames))
    steps = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    assert max(steps) == wire.FRAMES_PER_TURN
    assert [pb.Done.FromString(f.header).call_id for f in server.frames] == [f"c{i}" for i in range(chunks * per_chunk)]
