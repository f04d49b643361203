"""gpufaas.service_main: a daemon whose listener cannot be bound ends in one line and exit status
1, not a traceback, and is stopped if it had started."""

from __future__ import annotations

import socket
from collections.abc import Iterator

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
