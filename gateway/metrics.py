"""The gateway's Prometheus metrics, with OpenFaaS's gateway names where they exist."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufaas.metrics import LATENCY_BUCKETS_S


class GatewayMetrics:
    """`invocations` ((function, HTTP status) -> count) is kept by the invoke path as a plain
    Counter (the hot path pays a dict increment) and read at scrape time, as is the count of
    deployed functions; call durations go to a histogram."""

    def __init__(self, invocations: Counter[tuple[str, int]], functions_deployed: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Counts(invocations, functions_deployed))
        self.seconds = Histogram(
            "gateway_functions_seconds",
            "Invocation duration at the gateway, by function and HTTP status.",
            ["function_name", "code"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )


class _Counts(Collector):
    def __init__(self, invocations: Counter[tuple[str, int]], functions_deployed: Callable[[], int]) -> None:
        self._invocations = invocations
        self._deployed = functions_deployed

    def collect(self) -> Iterator[Metric]:
        invocations = CounterMetricFamily(
            "gateway_function_invocation",
            "Function invocations by function and HTTP status.",
            labels=["function_name", "code"],
        )
        for (name, status), count in sorted(self._invocations.items()):
            invocations.add_metric([name, str(status)], count)
        yield invocations
        yield GaugeMetricFamily("gateway_functions_deployed", "Functions in the registry.", value=self._deployed())
