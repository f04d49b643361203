"""gpufaas.service_main: a daemon whose listener cannot be bound ends in one line and exit status
1, not a traceback, and is stopped if it had started."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpufaas.service_main import run_daemon, wire_daemon_running
from gpufaas.store import StoreError


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()


class _Daemon:
    """What `wire_daemon_running` needs of a daemon; `bind_error`: what its start raises."""

    def __init__(self, bind_error: OSError | None = None) -> None:
        self.bind_error = bind_error
        self.metrics = _Metrics()
        self.address = ""
        self.started = self.stopped = False

    async def start(self, listen: str, *, advertise: str | None = None) -> str:
        if self.bind_error is not None:
            raise self.bind_error
        self.started = True
        self.address = advertise or listen
        return self.address

    async def stop(self) -> None:
        self.stopped = True


class _Settings:
    def __init__(self, listen: str, metrics_listen: str | None) -> None:
        self.listen = listen
        self.advertise: str | None = None
        self.metrics_listen = metrics_listen


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _serve(daemon: _Daemon, settings: _Settings) -> int:
    async def main() -> None:
        async with wire_daemon_running(daemon, settings, None, "scheduler"):
            pass

    return run_daemon(main, "127.0.0.1:2379")


def test_a_port_in_use_is_one_line_and_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    daemon = _Daemon(OSError(98, "Address already in use"))
    assert _serve(daemon, _Settings("127.0.0.1:50051", None)) == 1
    assert capsys.readouterr().err == "error: scheduler cannot start: [Errno 98] Address already in use\n"


def test_a_listen_host_that_does_not_resolve_is_said_with_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "error: scheduler cannot start: [Errno -2] Name or service not known", naming no
    # flag nor address (a node has three listeners).
    daemon = _Daemon(socket.gaierror(-2, "Name or service not known"))
    assert _serve(daemon, _Settings("nowhere.invalid:0", None)) == 1
    said = "error: scheduler cannot start: --listen: cannot listen on nowhere.invalid:0: Name or service not known\n"
    assert capsys.readouterr().err == said


def test_a_metrics_port_in_use_stops_the_started_daemon(taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    # Before, the OSError went up in a traceback with the daemon running: its etcd lease (a node's
    # registration, a scheduler's leadership) stayed until it expired.
    daemon = _Daemon()
    assert _serve(daemon, _Settings("127.0.0.1:0", f"127.0.0.1:{taken_port}")) == 1
    assert daemon.started and daemon.stopped
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: scheduler cannot start: --metrics-listen: cannot listen on 127.0.0.1:{taken_port}")


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (OSError(98, "Address already in use"), "error: scheduler cannot start: [Errno 98] Address already in use\n"),
        (StoreError("etcd went away"), "error: cannot reach etcd at 127.0.0.1:2379: etcd went away; start etcd"),
    ],
)
def test_a_start_that_fails_partway_is_stopped(error: Exception, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before, only a metrics listener that failed stopped the daemon: a node whose wire port was in
    # use (or whose etcd failed as it registered) had started its workers and made its host pool
    # in /dev/shm, and left them there.
    daemon = _Daemon(error)
    assert _serve(daemon, _Settings("127.0.0.1:0", None)) == 1
    assert daemon.stopped
    assert capsys.readouterr().err.startswith(said)


# A daemon's logging as its main configures it, then a line a worker printed, relayed as the node
# relays it, and the daemon's own INFO and WARNING lines. In a process of its own: pytest's
# handlers on the root logger would make logging.basicConfig do nothing here.
_REPO = Path(__file__).resolve().parents[2]  # `python -c` imports from its working directory first
_LOG_LINES = """
import logging, sys
from gpufaas.service_main import configure_logging
from gpu_manager.runtimes.process import worker_log
configure_logging(sys.argv[1])
worker_log.info("a handler printed this")
logging.getLogger("gpufaas.node").info("the daemon's chatter")
logging.getLogger("gpufaas.node").warning("the daemon's warning")
"""


@pytest.mark.parametrize("level", ["warning", "error"])
def test_what_workers_print_is_written_whatever_the_daemons_log_level(level: str) -> None:
    # With --log-level warning or error, a function's prints and tracebacks, relayed at INFO,
    # were not written: `gpufaas logs` showed its author nothing.
    written = subprocess.run(
        [sys.executable, "-c", _LOG_LINES, level], capture_output=True, text=True, check=True, cwd=_REPO
    ).stderr
    assert "INFO gpufaas.worker: a handler printed this" in written
    assert "the daemon's chatter" not in written
    assert ("the daemon's warning" in written) is (level == "warning")


def test_at_debug_the_daemon_and_its_workers_write_everything() -> None:
    written = subprocess.run(
        [sys.executable, "-c", _LOG_LINES + 'worker_log.debug("a debug line")', "debug"],
        capture_output=True,
        text=True,
        check=True,
        cwd=_REPO,
    ).stderr
    assert "a handler printed this" in written and "the daemon's chatter" in written and "a debug line" in written
