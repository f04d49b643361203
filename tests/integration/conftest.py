"""Integration fixtures: a real etcd on loopback for the session, and a fresh key root per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from gpufaas.etcd_server import EtcdServer


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the whole session (stopped by PID at the end, and checked gone)."""
    server = EtcdServer().start(tmp_path_factory.mktemp("etcd"))
    pid = server.pid
    try:
        yield server
    finally:
        server.stop()
        assert not pid_alive(pid), f"etcd (pid {pid}) is still running after stop()"


class EtcdTarget(NamedTuple):
    endpoint: str  # "127.0.0.1:PORT"
    root: str  # "/t-<hex>": this test's own key root (a Keys(root) or a store prefix)


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> EtcdTarget:
    """The session's etcd and a key root no other test uses, so tests need no cleanup."""
    return EtcdTarget(etcd_server.endpoint, f"/t-{uuid.uuid4().hex[:12]}")
