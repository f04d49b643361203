"""A daemon's metrics listener (gpufaas.metrics.MetricsServer) over a real loopback socket, asked
the way its clients ask: http.client, as the supervisor's watchdog probes it."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import pytest
from prometheus_client import CollectorRegistry, Counter

from gpufaas.metrics import MetricsServer

TOKEN = "metrics-token"


def get(
    address: str, path: str, headers: dict[str, str] | None = None, *, method: str = "GET", timeout_s: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request on a connection of its own (blocking: run it in a
    thread while the server's loop runs)."""
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def serving(token: str | None, check: Callable[[MetricsServer, str], Awaitable[None]]) -> None:
    """Start a server on 127.0.0.1:0 (its registry counts one thing), run `check(server, address)`
    on its loop, close the server."""

    async def main() -> None:
        registry = CollectorRegistry()
        Counter("test_things", "Things counted.", registry=registry).inc(3)
        server = MetricsServer(registry, token=token)
        address = await server.start("127.0.0.1:0")
        try:
            await check(server, address)
        finally:
            await server.close()

    asyncio.run(main())


def test_port_0_listens_on_a_free_port_and_start_returns_the_bound_address() -> None:
    async def check(server: MetricsServer, address: str) -> None:
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and port.isdigit() and int(port) > 0
        status, _, _ = await asyncio.to_thread(get, address, "/healthz")
        assert status == 200

    serving(TOKEN, check)


def test_metrics_ask_for_the_bearer_token_and_serve_the_registry_with_it() -> None:
    async def check(server: MetricsServer, address: str) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"X-Token": TOKEN}):
            status, answer, body = await asyncio.to_thread(get, address, "/metrics", headers)
            assert status == 401, headers
            assert answer["www-authenticate"] == 'Bearer realm="gpufaas metrics"'
            assert b"test_things" not in body
        status, answer, body = await asyncio.to_thread(get, address, "/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and answer["content-type"].startswith("text/plain; version=")
        assert "test_things_total 3.0" in body.decode()
        assert "gpufaas_event_loop_lag_seconds" in body.decode()  # the loop lag, from start() on

    serving(TOKEN, check)


def test_without_a_token_the_metrics_are_served_to_anyone() -> None:
    async def check(server: MetricsServer, address: str) -> None:
        status, _, body = await asyncio.to_thread(get, address, "/metrics")
        assert status == 200 and "test_things_total 3.0" in body.decode()

    serving(None, check)


def test_healthz_is_open_and_reports_the_loop_lag_as_json() -> None:
    async def check(server: MetricsServer, address: str) -> None:
        await asyncio.sleep(0.3)  # a reading or so
        status, answer, body = await asyncio.to_thread(get, address, "/healthz")
        assert status == 200 and answer["content-type"] == "application/json"
        health = json.loads(body)
        assert health["status"] == "ok" and set(health) == {"status", "loop_lag_s", "loop_lag_max_s"}
        assert 0.0 <= health["loop_lag_s"] <= health["loop_lag_max_s"]

    serving(TOKEN, check)


def test_other_paths_and_methods_are_refused() -> None:
    async def check(server: MetricsServer, address: str) -> None:
        assert (await asyncio.to_thread(get, address, "/other"))[0] == 404
        assert (await asyncio.to_thread(get, address, "/healthz", method="POST"))[0] == 405
        assert (await asyncio.to_thread(get, address, "/metrics", method="DELETE"))[0] == 405

    serving(TOKEN, check)


def test_a_stalled_event_loop_does_not_answer_the_probe() -> None:
    # What the watchdog relies on: the listener runs on the daemon's loop, not a thread of its own.
    async def check(server: MetricsServer, address: str) -> None:
        def late_probe() -> tuple[int, dict[str, str], bytes]:
            time.sleep(0.1)  # sent once the loop stalls
            return get(address, "/healthz", timeout_s=0.3)

        probe = asyncio.get_running_loop().run_in_executor(None, late_probe)  # on its thread at once
        time.sleep(0.6)  # the loop stalls (blocking on purpose) past the probe's timeout
        with pytest.raises(TimeoutError):
            await probe
        assert (await asyncio.to_thread(get, address, "/healthz"))[0] == 200  # and answers once it runs

    serving(TOKEN, check)


def test_close_stops_listening_and_leaves_the_daemons_signal_handlers_alone() -> None:
    def daemon_handler(signum: int, frame: FrameType | None) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, daemon_handler)
    try:

        async def main() -> str:
            server = MetricsServer(CollectorRegistry(), token=TOKEN)
            address = await server.start("127.0.0.1:0")
            assert signal.getsignal(signal.SIGTERM) is daemon_handler  # uvicorn's serve() would take it
            assert (await asyncio.to_thread(get, address, "/healthz"))[0] == 200
            await server.close()
            return address

        address = asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(ConnectionRefusedError):
        get(address, "/healthz")


def test_a_bad_address_or_a_taken_port_fails_start() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="HOST:PORT"):
            await MetricsServer(CollectorRegistry(), token=None).start("9100")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = MetricsServer(CollectorRegistry(), token=None)
            with pytest.raises(OSError, match="cannot listen"):
                await server.start(f"127.0.0.1:{taken.getsockname()[1]}")
            await server.close()

    asyncio.run(main())
