"""Prometheus metrics: each daemon's registry, its scrape endpoint, and the credential it asks for.

The gateway serves its metrics at /metrics behind the admin credential. The scheduler and the
nodes speak only gpufaas.wire, so each opens a small HTTP listener of its own for scrapes
(`--metrics-listen`), which asks for `Authorization: Bearer <metrics token>`: a token derived
from the cluster secret (`gpufaas.credentials.metrics_token`), so a Prometheus server needs one
credential file for every daemon and nothing new has to be distributed. Labels are bounded: functions, models, GPU
types, outcomes; never call ids.

The same listener answers GET /healthz for anyone: the daemon's event-loop lag (gpufaas.liveness),
nothing else. It is what the local cluster's watchdog probes: the listener runs on the daemon's
own event loop, so a stalled loop does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufaas import store, wire
from gpufaas.liveness import LoopLag, LoopLagCollector, run_loop_lag

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series beside every counter: they double a scrape for nothing

# Seconds: a warm call takes milliseconds, a miss up to a minute (a load), a queued call longer.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BYTES_PER_MB = 1024 * 1024  # gpufaas's "MB" is a MiB (NVML's and torch's); Prometheus wants bytes
_REQUEST_TIMEOUT_S = 5.0
_MAX_HEAD_BYTES = 8192


class MetricsServer:
    """GET /metrics over HTTP/1.1 on a listener of its own (one request per connection), and
    GET /healthz (the loop lag as JSON, open: a liveness probe holds no credential).

    With `token` set a /metrics request must carry `Authorization: Bearer <token>` (401
    otherwise); None serves anyone (an insecure cluster). From `start()` on the event loop's lag
    is measured (`loop_lag`) and is in the registry's metrics."""

    def __init__(self, registry: CollectorRegistry, *, token: str | None) -> None:
        self.registry = registry
        self.token = token
        self.loop_lag = LoopLag()
        self._server: asyncio.Server | None = None
        self._lag_task: asyncio.Task[None] | None = None

    async def start(self, listen: str) -> str:
        """Listen on HOST:PORT (port 0: any free one); returns the bound address."""
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--metrics-listen: expected HOST:PORT, got {listen!r}")
        self._server = await asyncio.start_server(self._serve, host.strip("[]"), int(port))
        loop = asyncio.get_running_loop()
        self.registry.register(LoopLagCollector(self.loop_lag, loop.time))
        self._lag_task = loop.create_task(run_loop_lag(self.loop_lag))
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        return f"{bound_host}:{bound_port}"

    async def close(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            self._lag_task = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
            status, content_type, body = self._answer(head[:_MAX_HEAD_BYTES].decode("latin-1"))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}[status]
        extra = 'WWW-Authenticate: Bearer realm="gpufaas metrics"\r\n' if status == 401 else ""
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _answer(self, head: str) -> tuple[int, str, bytes]:
        request_line, *header_lines = head.split("\r\n")
        method, _, rest = request_line.partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if path not in ("/metrics", "/healthz"):
            return 404, "text/plain", b"not found: the metrics are at /metrics\n"
        if method != "GET":
            return 405, "text/plain", b"use GET\n"
        if path == "/healthz":
            health = {"status": "ok", **self.loop_lag.report(asyncio.get_running_loop().time())}
            return 200, "application/json", json.dumps(health).encode() + b"\n"
        if self.token is not None:
            headers = {
                name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)
            }
            offered = headers.get("authorization", "")
            if not hmac.compare_digest(offered.encode(), f"Bearer {self.token}".encode()):
                return 401, "text/plain", b"needs Authorization: Bearer <metrics token> (gpufaas credentials)\n"
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)


class ProcessErrors(Collector):
    """The etcd and wire errors of this process (one daemon), as counted where they happen
    (`gpufaas.store.etcd_error_counts`, `gpufaas.wire.error_counts`): every daemon's registry
    has one."""

    def collect(self) -> Iterator[Metric]:
        etcd = CounterMetricFamily(
            "gpufaas_etcd_errors",
            "etcd calls that failed, by operation and kind (unavailable, refused, token_expired, lease_lost, "
            "compacted).",
            labels=["operation", "kind"],
        )
        for (operation, kind), count in sorted(store.etcd_error_counts.items()):
            etcd.add_metric([operation, kind], count)
        yield etcd
        errors = CounterMetricFamily(
            "gpufaas_wire_errors",
            "Daemon-to-daemon connection errors, by kind (connect, auth, frame_too_large, malformed, handler).",
            labels=["kind"],
        )
        for kind in wire.WIRE_ERROR_KINDS:
            errors.add_metric([kind], wire.error_counts[kind])
        yield errors
