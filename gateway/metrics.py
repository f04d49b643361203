"""The gateway's Prometheus metrics, with OpenFaaS's gateway names where they exist."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.metrics import LATENCY_BUCKETS_S, ProcessErrors
from gpufaas.store import Store, StoreError


class GatewayMetrics:
    """`invocations` ((function, HTTP status) -> count) is kept by the invoke path as a plain
    Counter (the hot path pays a dict increment) and read at scrape time, as is the count of
    deployed functions; call durations go to a histogram. `gateway_service_count` (OpenFaaS: a
    function's replicas; here the GPUs holding its model) is what `count_replicas` last read from
    etcd: the /metrics route calls it before each scrape."""

    def __init__(self, invocations: Counter[tuple[str, int]], functions_deployed: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.replicas: dict[str, int] = {}  # function name -> GPUs holding its model, as last read
        self.registry.register(_Counts(invocations, functions_deployed, self.replicas))
        self.registry.register(ProcessErrors())
        self.seconds = Histogram(
            "gateway_functions_seconds",
            "Invocation duration at the gateway, by function and HTTP status.",
            ["function_name", "code"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )

    async def count_replicas(self, store: Store, keys: Keys, functions: Mapping[str, FunctionSpec]) -> None:
        """Read every model's replicas (one range read of `{root}/models/`) and count, for each
        deployed function, the GPUs that hold its model. etcd out of reach: the last counts stay
        (the error is counted in gpufaas_etcd_errors_total), so a scrape never fails on it."""
        try:
            kvs = await store.get_prefix(keys.models)
        except StoreError:
            return
        holders: dict[str, int] = {}
        for kv in kvs:
            try:
                value = json.loads(kv.value)
            except ValueError:
                continue  # not ours to judge here: the scheduler writes these keys
            if isinstance(value, list):
                holders[kv.key] = len(value)
        self.replicas.clear()
        for name, spec in functions.items():
            self.replicas[name] = holders.get(keys.replicas(spec.model), 0)


class _Counts(Collector):
    def __init__(
        self,
        invocations: Counter[tuple[str, int]],
        functions_deployed: Callable[[], int],
        replicas: Mapping[str, int],
    ) -> None:
        self._invocations = invocations
        self._deployed = functions_deployed
        self._replicas = replicas

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
        service_count = GaugeMetricFamily(
            "gateway_service_count",
            "Replicas of each function: the GPUs that hold its model (0: it loads on its next call).",
            labels=["function_name"],
        )
        for name, count in sorted(self._replicas.items()):
            service_count.add_metric([name], count)
        yield service_count
