"""`python -m gpu_manager`'s making of a node from its settings: a setup it cannot run with is
one clear error (a GpufaasError, which the daemon's main prints as one line), not a traceback."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from gpu_manager.__main__ import Hardware, daemon
from gpu_manager.daemon import GpuManagerDaemon
from gpu_manager.devices import logical_devices
from gpu_manager.sandbox import Isolation
from gpu_manager.settings import NodeSettings
from gpufaas.errors import GpufaasError
from gpufaas.service_main import ListenError, wire_daemon_running
from tests.fakes import MemoryStore


@pytest.mark.parametrize("pool_dir", ["shared", "a-file"])
def test_a_pool_directory_the_node_cannot_use_is_a_clear_error(tmp_path: Path, pool_dir: str) -> None:
    # Before: the host pool's OSError ('choose another --pool-dir', or the mkdir's FileExistsError)
    # left `python -m gpu_manager` (and a gateway's --with-node) as a traceback.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky: another user could swap the pool's files
    (tmp_path / "a-file").write_text("")
    settings = NodeSettings(
        state_dir=tmp_path / "state", node="n1", pool_mb=16, pool_dir=tmp_path / pool_dir, unconfined_workers=True
    )
    machine = Hardware("cpu", logical_devices(1, 1024, "cpu"), 0, Isolation(network=False, users=False))

    async def make() -> None:
        daemon(MemoryStore(), settings, machine, None, tls=False)  # type: ignore[arg-type]

    with pytest.raises(GpufaasError, match=r"--pool-dir|File exists"):
        asyncio.run(make())


def test_a_pool_larger_than_its_filesystem_has_free_is_a_clear_error(tmp_path: Path) -> None:
    # Before, --pool-mb beyond the free space of --pool-dir's filesystem was taken, and the pool
    # failed later, at some load, on a full filesystem.
    pool_mb = 1 << 30  # a PiB
    settings = NodeSettings(
        state_dir=tmp_path / "state", node="n1", pool_mb=pool_mb, pool_dir=tmp_path / "shm", unconfined_workers=True
    )
    machine = Hardware("cpu", logical_devices(1, 1024, "cpu"), 0, Isolation(network=False, users=False))

    async def make() -> None:
        daemon(MemoryStore(), settings, machine, None, tls=False)  # type: ignore[arg-type]

    with pytest.raises(GpufaasError, match=rf"^node n1 cannot set up its storage: --pool-mb {pool_mb}: .* MiB free; "):
        asyncio.run(make())
    assert list((tmp_path / "shm").iterdir()) == []  # the pool's directory not left behind


def test_a_blob_port_in_use_is_said_with_its_flag_and_the_node_left_stopped(tmp_path: Path) -> None:
    # Before, a node with three listeners said only "[Errno 98] Address already in use" for its
    # --blob-listen, and left its spare worker and its host pool behind (its start was not stopped).
    settings = NodeSettings(
        state_dir=tmp_path / "state", node="n1", pool_mb=16, pool_dir=tmp_path, unconfined_workers=True, spares=1
    )
    machine = Hardware("cpu", logical_devices(1, 1024, "cpu"), 0, Isolation(network=False, users=False))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        settings = settings.model_copy(update={"listen": "127.0.0.1:0", "blob_listen": taken})

        async def start() -> GpuManagerDaemon:
            node = daemon(MemoryStore(), settings, machine, None, tls=False)  # type: ignore[arg-type]
            with pytest.raises(ListenError, match=f"node n1 cannot start: --blob-listen: cannot listen on {taken}: "):
                async with wire_daemon_running(node, settings, None, "node n1"):
                    pass
            return node

        node = asyncio.run(start())
    assert node.pool.live_workers() == 0
    assert not node.storage.host_pool.root.exists()


def test_a_second_node_on_a_state_directory_in_use_refuses_and_leaves_the_first_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a node started twice on one --state-dir (by mistake, or again while the first still
    # stopped) removed the running one's host pool as "left by an earlier run" (and, confined,
    # killed its workers' cgroups and cleared their homes at start), then failed on its port.
    import gpu_manager.__main__ as node_main

    settings = NodeSettings(
        state_dir=tmp_path / "state", node="n1", pool_mb=16, pool_dir=tmp_path, unconfined_workers=True
    )
    settings.state_dir.mkdir()  # (`hardware` makes it)
    machine = Hardware("cpu", logical_devices(1, 1024, "cpu"), 0, Isolation(network=False, users=False))
    running: list[GpuManagerDaemon] = []

    async def open_store(*_: object) -> MemoryStore:
        return MemoryStore()

    async def serve_wire_daemon(node: GpuManagerDaemon, *_: object, **__: object) -> None:
        if not running:  # the first serves while the second starts
            running.append(node)
            await node_main.serve(settings, machine, None, None)

    monkeypatch.setattr(node_main, "open_store", open_store)
    monkeypatch.setattr(node_main, "serve_wire_daemon", serve_wire_daemon)
    with pytest.raises(GpufaasError, match=r"--state-dir .* is in use by another node"):
        asyncio.run(node_main.serve(settings, machine, None, None))
    assert running[0].storage.host_pool.root.is_dir()
