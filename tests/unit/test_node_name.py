"""A node's name at start: a second running GPU manager of one name refuses (the two would
overwrite each other's record), and a restart takes over what its dead process left in etcd."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from gpu_manager.daemon import NodeNameTaken
from gpufaas.cluster import NodeRecord
from gpufaas.keys import Keys
from tests.fakes import MemoryStore
from tests.unit.test_node_calls import make_node


async def registered(store: MemoryStore) -> NodeRecord:
    kv = await store.get(Keys().node("n1"))
    assert kv is not None
    return NodeRecord.from_json(kv.value)


def test_a_second_running_node_of_the_same_name_refuses_and_leaves_the_first_registered(tmp_path: Path) -> None:
    # Before, both registered {root}/nodes/n1, each overwriting the other's record under its own
    # lease: the scheduler saw a new incarnation at each write, the gateways dialled the last.
    store = MemoryStore()

    async def run() -> None:
        first = make_node(tmp_path / "a", store)
        address = await first.start("127.0.0.1:0")
        second = make_node(tmp_path / "b", store)
        try:
            with pytest.raises(NodeNameTaken) as refused:
                await second.start("127.0.0.1:0")
            assert str(refused.value) == (
                f"node n1 is registered by another running GPU manager at {address}; give this one another --node"
            )
            assert (await registered(store)).incarnation == first.incarnation
        finally:
            await second.stop()
            await first.stop()

    asyncio.run(run())


def test_a_restart_takes_over_the_record_its_dead_process_left(tmp_path: Path) -> None:
    # The dead process's key stays until its lease's TTL runs out; nothing answers at its address.
    store = MemoryStore()
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        dead_address = f"127.0.0.1:{gone.getsockname()[1]}"
    dead = NodeRecord(node="n1", address=dead_address, backend="emulated", incarnation="dead", gpus=[])

    async def run() -> None:
        lease = await store.grant_lease(3600)
        await store.put(Keys().node("n1"), dead.to_json(), lease=lease)
        restarted = make_node(tmp_path / "a", store)
        try:
            address = await restarted.start("127.0.0.1:0")
            record = await registered(store)
            assert (record.address, record.incarnation) == (address, restarted.incarnation)
        finally:
            await restarted.stop()

    asyncio.run(run())
