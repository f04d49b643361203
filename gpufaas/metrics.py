"""Prometheus metrics: each daemon's registry, its scrape endpoint, and the credential it asks for.

The gateway serves its metrics at /metrics behind the admin credential. The scheduler and the
nodes speak only gpufaas.wire, so each opens a small HTTP listener of its own for scrapes
(`--metrics-listen`), which asks for `Authorization: Bearer <metrics token>`: a token derived
from the cluster secret (`gpufaas.credentials.metrics_token`), so a Prometheus server needs one
credential file for every daemon and nothing new has to be distributed. Labels are bounded: functions, models, GPU
types, outcomes; never call ids.

The same listener answers GET /healthz for anyone: the daemon's event-loop lag (gpufaas.liveness),
nothing else. It is what the local cluster's watchdog probes: the listener runs on the daemon's
own event loop (uvicorn serving a Starlette app, started in the running loop), so a stalled loop
does not answer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from itertools import accumulate
from typing import Any, Generic, TypeVar

import uvicorn
from prometheus_client import CollectorRegistry, disable_created_metrics, make_asgi_app
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpufaas import store, wire
from gpufaas.liveness import LoopLag, LoopLagCollector, run_loop_lag
from gpufaas.proto import gpufaas_pb2 as pb

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series beside every counter: they double a scrape for nothing

# Seconds: a warm call takes milliseconds, a miss up to a minute (a load), a queued call longer,
# and a call may run for its function's timeout_s, up to an hour (gpufaas.functions.MAX_TIMEOUT_S):
# past the last bound histogram_quantile answers that bound, so the buckets reach the hour.
LATENCY_BUCKETS_S = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
    *(300.0, 600.0, 1800.0, 3600.0),
)
BYTES_PER_MB = 1024 * 1024  # gpufaas's "MB" is a MiB (NVML's and torch's); Prometheus wants bytes
_GRACEFUL_SHUTDOWN_S = 1  # close() waits this long for a response under way
# An idle connection is closed after this long: the listener's clients do not reuse one sooner (a
# scrape comes every 15 s or more; the watchdog's probe closes its connection).
_KEEP_ALIVE_S = 1
_UNAUTHORIZED = b"needs Authorization: Bearer <metrics token> (gpufaas credentials)\n"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
S = TypeVar("S")


class MetricsServer:
    """GET /metrics (the registry, as prometheus-client's ASGI app serves it) and GET /healthz
    (the loop lag as JSON, open: a liveness probe holds no credential), served by uvicorn on a
    listener of its own, on the daemon's event loop. Two routes need no framework: a Starlette
    app cost each daemon 35 ms more at its start (its imports; 0.1 s on a busy machine) and each
    watchdog probe 20-60 us more CPU (uvicorn's share is about 55 us over a bare asyncio server).

    With `token` set a /metrics request must carry `Authorization: Bearer <token>` (401
    otherwise); None serves anyone (an insecure cluster). From `start()` on the event loop's lag
    is measured (`loop_lag`) and is in the registry's metrics."""

    def __init__(self, registry: CollectorRegistry, *, token: str | None) -> None:
        self.registry = registry
        self.token = token
        self.loop_lag = LoopLag()
        self._expected_authorization = None if token is None else f"Bearer {token}".encode()
        self._scrape = make_asgi_app(registry)
        self._server: uvicorn.Server | None = None
        self._lag_task: asyncio.Task[None] | None = None

    async def start(self, listen: str) -> str:
        """Listen on HOST:PORT (port 0: any free one; a name binds every address it resolves to,
        as asyncio does); returns the bound address (the first socket's)."""
        host, _, port = listen.rpartition(":")
        if not host or not port.isdecimal():
            raise ValueError(f"--metrics-listen: expected HOST:PORT, got {listen!r}")
        config = uvicorn.Config(
            self._app,
            host=host.strip("[]"),
            port=int(port),
            lifespan="off",
            interface="asgi3",
            ws="none",
            # The daemon's logging stays as it set it up, but for uvicorn's own loggers (process-wide:
            # no other uvicorn runs in a scheduler or a node): no access log line per probe.
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=_KEEP_ALIVE_S,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        )
        config.load()
        server = uvicorn.Server(config)
        # Not `serve()`: it installs SIGINT/SIGTERM handlers of its own (the daemon's would no
        # longer reach it) and wakes every 0.1 s to refresh a Date header. `startup()` binds (as
        # asyncio.start_server does: loop.create_server(host, port)) and serves; `shutdown()` undoes it.
        server.lifespan = config.lifespan_class(config)  # what `serve()` sets first ("off": nothing)
        try:
            await server.startup()
        except SystemExit as exc:  # uvicorn exits the process when it cannot bind, having logged why
            raise OSError(f"--metrics-listen: cannot listen on {listen} (uvicorn logged the reason)") from exc
        self._server = server
        loop = asyncio.get_running_loop()
        self.registry.register(LoopLagCollector(self.loop_lag, loop.time))
        self._lag_task = loop.create_task(run_loop_lag(self.loop_lag))
        bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
        return f"{bound_host}:{bound_port}"

    async def close(self) -> None:
        """Stop listening and close the open connections (a response under way gets
        `_GRACEFUL_SHUTDOWN_S`). Takes 0.1 s or more: uvicorn's shutdown waits that long first."""
        if self._lag_task is not None:
            self._lag_task.cancel()
            self._lag_task = None
        if self._server is not None:
            server, self._server = self._server, None
            await server.shutdown()

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The listener's ASGI app: GET /healthz, GET /metrics (with the token), 404 or 405 else."""
        path = scope["path"]
        if path not in ("/healthz", "/metrics"):
            await _respond(send, 404, b"not found: the metrics are at /metrics\n")
        elif scope["method"] != "GET":
            await _respond(send, 405, b"use GET\n", [(b"allow", b"GET")])
        elif path == "/healthz":
            health = {"status": "ok", **self.loop_lag.report(asyncio.get_running_loop().time())}
            await _respond(send, 200, json.dumps(health).encode() + b"\n", content_type=b"application/json")
        elif self._expected_authorization is not None and not hmac.compare_digest(
            next((value for name, value in scope["headers"] if name == b"authorization"), b""),
            self._expected_authorization,
        ):
            await _respond(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b'Bearer realm="gpufaas metrics"')])
        else:
            await self._scrape(scope, receive, send)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    """One whole response, its length declared."""
    head = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def outcome_label(outcome: int) -> str:
    """A call's Outcome as a label value: its name in lower case, "unknown" for a value this
    gpufaas has no name for (a newer peer's, or a worker's forgery): never an error on the path
    that reports the call, and never a series per value a peer makes up."""
    try:
        return pb.Outcome.Name(outcome).lower()
    except ValueError:
        return "unknown"


def check_buckets_s(buckets_s: Sequence[float]) -> tuple[float, ...]:
    """A histogram's bucket bounds, checked: finite upper bounds in increasing order (+Inf is
    always added); ValueError otherwise."""
    if list(buckets_s) != sorted(set(buckets_s)) or not buckets_s or math.isinf(buckets_s[-1]):
        raise ValueError(f"buckets_s must be finite upper bounds in increasing order, got {buckets_s!r}")
    return tuple(buckets_s)


class LoopCount:
    """One counter series, counted on the event loop's thread: `value += n`, no lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; got {amount}")
        self.value += amount


class LoopSeries:
    """One histogram series, observed on the event loop's thread: a bisection and two additions,
    no lock (prometheus-client's `Histogram.observe` takes a lock per bucket it counts in)."""

    __slots__ = ("_bounds_s", "counts", "sum_s")

    def __init__(self, bounds_s: tuple[float, ...]) -> None:
        self._bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect_left(self._bounds_s, value_s)] += 1  # `le`: upper bounds are inclusive
        self.sum_s += value_s


class _LoopMetric(Collector, Generic[S]):
    """A labelled metric for a daemon's per-call path: its series are plain objects that the event
    loop's thread updates without a lock, and that a scrape, served on the same loop
    (`MetricsServer`), reads. Register it in the daemon's registry (it is a Collector). A series
    exists from its first `series(...)` until it is `remove`d."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._series: dict[tuple[str, ...], S] = {}

    def series(self, *values: str) -> S:
        """The series of these label values: bind it once where a call path uses it, as
        prometheus-client's `labels()`."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}, got {values!r}")
        found = self._series.get(values)
        if found is None:
            found = self._series[values] = self._new_series()
        return found

    def remove(self, *values: str) -> None:
        """Drop the series of these label values, if there is one (a bound one then counts unseen)."""
        self._series.pop(values, None)

    def _new_series(self) -> S:
        raise NotImplementedError

    def _sorted(self) -> list[tuple[tuple[str, ...], S]]:
        return sorted(self._series.items(), key=lambda item: item[0])


class LoopCounter(_LoopMetric[LoopCount]):
    """A counter (`name` without `_total`, which the exposition adds), as prometheus-client's."""

    def _new_series(self) -> LoopCount:
        return LoopCount()

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, count in self._sorted():
            counter.add_metric(list(values), count.value)
        yield counter


class LoopHistogram(_LoopMetric[LoopSeries]):
    """A histogram of seconds on `buckets_s` (finite upper bounds; +Inf is added), as prometheus-client's."""

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str] = (), buckets_s: Sequence[float] = LATENCY_BUCKETS_S
    ) -> None:
        super().__init__(name, documentation, labels)
        self._bounds_s = check_buckets_s(buckets_s)
        self._le = [floatToGoString(b) for b in self._bounds_s] + ["+Inf"]  # type: ignore[no-untyped-call]

    def _new_series(self) -> LoopSeries:
        return LoopSeries(self._bounds_s)

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, series in self._sorted():
            cumulative = list(accumulate(series.counts))
            histogram.add_metric(list(values), list(zip(self._le, cumulative, strict=True)), series.sum_s)
        yield histogram


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
