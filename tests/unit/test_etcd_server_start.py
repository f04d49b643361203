"""EtcdServer.start when etcd does not come up: nothing of it is left running."""

from __future__ import annotations

import os
import signal
import stat
import sys
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


HEALTHY_ETCD = """\
import http.server, sys
port = int(next(a for a in sys.argv if a.startswith("--listen-client-urls=")).rsplit(":", 1)[1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"health": "true"}')
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def healthy_etcd(tmp_path: Path) -> Path:
    """An `etcd` that answers /health true on its client port, and nothing else."""
    binary = tmp_path / "fake-etcd"
    binary.write_text(f"#!{sys.executable}\n{HEALTHY_ETCD}")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


@pytest.mark.timeout(60)  # it waited for ever for the running process to exit by itself
def test_restart_of_a_running_etcd_stops_it_first(tmp_path: Path) -> None:
    binary = healthy_etcd(tmp_path)
    server = EtcdServer(binary=binary).start(tmp_path / "etcd")
    try:
        first = server.pid
        server.restart()
        assert server.is_running() and server.pid != first
        assert not survivors([first])
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_start_after_etcd_exited_by_itself_closes_the_log_it_had_open(tmp_path: Path) -> None:
    """etcd died (no stop() reaped it) and is started again: the old process's log is closed, not
    left open beside the new one (a file descriptor leaked per restart)."""
    binary = healthy_etcd(tmp_path)
    server = EtcdServer(binary=binary).start(tmp_path / "etcd")
    try:
        first_log = server._log
        assert first_log is not None
        os.kill(server.pid, signal.SIGKILL)  # a crash
        assert server._process is not None
        server._process.wait()  # exited; the object still holds it and its log
        server.start(tmp_path / "etcd", client_port=server.client_port, peer_port=server.peer_port)
        assert first_log.closed and server._log is not first_log
    finally:
        server.stop()


def test_etcd_is_seen_healthy_whatever_proxy_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd listens on loopback: its health is asked directly, not through an http_proxy (one set
    for a corporate network cannot reach this machine's 127.0.0.1)."""
    binary = healthy_etcd(tmp_path)
    for variable in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9")  # the discard port: nothing answers
    for variable in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr("urllib.request._opener", None)  # urlopen's, made once with the environment then
    with EtcdServer(binary=binary).start(tmp_path / "etcd", timeout_s=5) as server:
        assert server.is_running()
