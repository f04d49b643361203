"""EtcdServer.start when etcd does not come up: nothing of it is left running."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from gpufaas.dev.etcd_server import EtcdServer
from gpufaas.processes import survivors


def never_healthy_etcd(tmp_path: Path) -> tuple[Path, Path]:
    """An `etcd` that runs but never answers /health, and the file it writes its PID to."""
    pid_file = tmp_path / "etcd.pid"
    binary = tmp_path / "fake-etcd"
    binary.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary, pid_file


def test_a_start_interrupted_while_waiting_stops_the_etcd_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while etcd comes up: etcd (in a session of its own, so the terminal's SIGINT misses
    it) must not be left running, holding its ports and data dir, by a start that never returned."""
    binary, pid_file = never_healthy_etcd(tmp_path)

    def interrupted(self: EtcdServer, deadline: float) -> None:
        for _ in range(1000):  # until the shell has run, so that its PID is known
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(EtcdServer, "_wait_healthy", interrupted)
    server = EtcdServer(binary=binary)
    with pytest.raises(KeyboardInterrupt):
        server.start(tmp_path / "etcd")
    pid = int(pid_file.read_text())
    assert not survivors([pid]), "etcd was left running"
    assert not server.is_running()
    assert server._log is None  # its log closed too
