"""GpuManagerDaemon.stop when one of its steps fails: the later steps still run, the failure is logged."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gpu_manager.daemon import GpuManagerDaemon
from tests.unit.test_node_calls import make_node


class EtcdDownLease:
    """A lease keeper whose revoke cannot reach etcd (a failure it does not handle itself)."""

    async def stop(self, revoke: bool = True) -> None:
        raise ConnectionRefusedError("etcd is down")


def test_a_failing_step_of_the_stop_is_logged_and_the_later_steps_still_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    node: GpuManagerDaemon = make_node(tmp_path)
    ran: list[str] = []

    async def server_close() -> None:
        ran.append("server")

    async def pool_shutdown() -> None:
        ran.append("workers")
        raise RuntimeError("a worker will not die")

    node._lease = EtcdDownLease()  # type: ignore[assignment]
    monkeypatch.setattr(node._server, "close", server_close)
    monkeypatch.setattr(node.pool, "shutdown", pool_shutdown)
    monkeypatch.setattr(node.storage, "stop", lambda: ran.append("storage"))
    with caplog.at_level(logging.ERROR, logger="gpufaas.gpu_manager"):
        asyncio.run(node.stop())  # raises nothing of its steps'
    assert ran == ["server", "workers", "storage"]  # the host pool let go of after both failures
    failed = [r for r in caplog.records if "stopping" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info is not None for r in failed)
    assert "key from etcd" in failed[0].getMessage() and "workers" in failed[1].getMessage()
