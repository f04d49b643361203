"""The gateway's mirror of the nodes (gateway.state): which node addresses it tells the router left;
and of the leader key: which scheduler address it tells the router."""

from __future__ import annotations

import asyncio
import itertools
import socket
from pathlib import Path

import pytest

from gateway import router as router_module
from gateway.router import NodeConnections
from gateway.state import Gateway, GatewayConfig
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.keys import Keys
from gpufaas.store import KeyValue, WatchEvent
from gpufaas.wire import ConnectionLost
from tests.fakes import MemoryStore

KEYS = Keys("/unit")


def record(name: str, port: int, incarnation: str = "i1") -> NodeRecord:
    return NodeRecord(name, f"127.0.0.1:{port}", "cpu", incarnation, [GpuRecord("gpu0", 1000, "cpu")])


def listed(*records: NodeRecord, revision: int) -> list[KeyValue]:
    return [KeyValue(KEYS.node(r.node), r.to_json(), 1, revision, 0) for r in records]


def gateway_of(tmp_path: Path) -> tuple[Gateway, list[str]]:
    """A gateway (not started) whose router records the addresses it is told left."""
    gateway = Gateway(MemoryStore(), GatewayConfig(state_dir=tmp_path, keys=KEYS, blob_listen=None))
    left: list[str] = []
    gateway.router.node_left = left.append  # type: ignore[method-assign]
    gateway.router.node_joined = lambda address: None  # type: ignore[method-assign]
    return gateway, left


def test_a_node_that_moved_while_the_watch_was_down_leaves_its_old_address(tmp_path: Path) -> None:
    """A re-list that finds a node under its key at another address: its old address is left (its
    connection closed, the calls on it ended now), as when the watch brings the move."""

    async def scenario() -> None:
        gateway, left = gateway_of(tmp_path)
        gateway._nodes_listed(listed(record("node0", 7000), record("node1", 7001), revision=1), 1)
        gateway._nodes_listed(listed(record("node0", 7000), record("node1", 7011, "i2"), revision=5), 5)
        assert left == ["127.0.0.1:7001"]
        assert gateway.nodes["node1"].address == "127.0.0.1:7011"

    asyncio.run(scenario())


def test_a_node_that_leaves_an_address_another_node_registered_at_does_not_close_its_connection(
    tmp_path: Path,
) -> None:
    """A node restarted under a new name at the same address (or a new node at a reused one): the
    old key's departure, or a move off the address, leaves the address to the node there now."""

    async def scenario() -> None:
        gateway, left = gateway_of(tmp_path)
        gateway._nodes_listed(listed(record("old", 7000), record("a", 7001), revision=1), 1)
        gateway._node_changed(WatchEvent("put", KEYS.node("new"), record("new", 7000, "i2").to_json(), 2))
        gateway._node_changed(WatchEvent("delete", KEYS.node("old"), b"", 3))
        gateway._node_changed(WatchEvent("put", KEYS.node("b"), record("b", 7001, "i2").to_json(), 4))
        gateway._node_changed(WatchEvent("put", KEYS.node("a"), record("a", 7011, "i2").to_json(), 5))
        assert left == []
        gateway._nodes_listed(listed(record("a", 7011, "i2"), revision=6), 6)  # "new" and "b" gone
        assert sorted(left) == ["127.0.0.1:7000", "127.0.0.1:7001"]

    asyncio.run(scenario())


def test_a_node_address_given_up_on_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that left and never answered again at its address (addresses churn: a pod's IP)
    keeps no entry of it once the background dial gives up on it, however many came and went."""
    monkeypatch.setattr(router_module, "REDIAL_S", 0.0)

    async def scenario() -> None:
        with socket.socket() as probe:  # a port nothing listens on: each dial is refused at once
            probe.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{probe.getsockname()[1]}"
        clock = itertools.count(0.0, 10.0)  # each reading 10 s on: the redial gives up within a few
        nodes = NodeConnections(max_frame_bytes=1 << 20, key=None, clock=lambda: next(clock))
        nodes.heard(address)
        nodes.left(address)
        while nodes._redials:
            await asyncio.sleep(0.01)
        assert address not in nodes.unusable and address not in nodes._heard
        await nodes.close()

    asyncio.run(scenario())


class FakeConn:
    """A stand-in node connection: open until closed."""

    def __init__(self) -> None:
        self.is_closed = False

    def close(self, exc: BaseException | None = None) -> None:
        self.is_closed = True


def test_a_dial_that_completes_after_its_node_left_is_closed_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that left while a dial of its address was in progress: the connection made is not
    kept, and the node is not taken for usable again (nor pinged until it dies)."""

    async def scenario() -> None:
        nodes = NodeConnections(max_frame_bytes=1 << 20, key=None)
        address = "127.0.0.1:9"
        made = FakeConn()
        dialled = asyncio.Event()
        answer = asyncio.get_running_loop().create_future()

        async def dial(_: str) -> FakeConn:
            dialled.set()
            return await answer  # type: ignore[no-any-return]

        monkeypatch.setattr(nodes, "_dial", dial)
        placement = asyncio.create_task(nodes.get(address))
        await dialled.wait()
        nodes.left(address)
        answer.set_result(made)  # the dial completes after the node left
        with pytest.raises(ConnectionLost):
            await placement
        assert made.is_closed
        assert address not in nodes._conns and address in nodes.unusable and not nodes._watches
        await nodes.close()

    asyncio.run(scenario())


def test_a_gateway_whose_lease_stop_fails_still_closes_its_links_and_blob_server(tmp_path: Path) -> None:
    """A step of the gateway's stop that raises does not end it: the node links and the blob
    server are closed all the same (the error is raised after them)."""

    class FailingLease:
        async def stop(self, revoke: bool = True) -> None:
            raise RuntimeError("the lease will not stop")

    async def scenario() -> None:
        gateway, _ = gateway_of(tmp_path)
        stopped: list[str] = []

        async def router_stop() -> None:
            stopped.append("router")

        gateway._lease = FailingLease()  # type: ignore[assignment]
        gateway.router.stop = router_stop  # type: ignore[method-assign]
        gateway.artifacts.stop = lambda: stopped.append("artifacts")  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="will not stop"):
            await gateway.stop()
        assert stopped == ["router", "artifacts"]

    asyncio.run(scenario())


def test_a_leader_key_whose_value_is_not_utf8_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Put by hand, it raised UnicodeDecodeError out of the list the gateway's start takes in:
    # the gateway could not start.
    gateway, _ = gateway_of(tmp_path)
    told: list[str] = []
    gateway.router.set_scheduler_address = told.append  # type: ignore[method-assign]
    leader = KEYS.scheduler_leader
    gateway._services_listed([KeyValue(leader, b"\xff", 1, 1, 0)], 1)
    gateway._service_changed(WatchEvent("put", leader, b"127.0.0.1:7000", 2))
    assert told == ["127.0.0.1:7000"]
    assert f"ignoring the scheduler address at {leader}: b'\\xff' is not UTF-8" in caplog.text
