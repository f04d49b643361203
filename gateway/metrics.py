"""The gateway's Prometheus metrics, with OpenFaaS's gateway names where they exist."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.stats import FunctionStats
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.metrics import ProcessErrors
from gpufaas.store import Store, StoreError


class GatewayMetrics:
    """Read at scrape time: the calls, from the record the invoke path keeps (`calls`, the
    gateway's FunctionStats: gateway_function_invocation_total and gateway_functions_seconds), the
    count of deployed functions, and `gateway_service_count` (OpenFaaS: a function's replicas; here
    the GPUs holding its model), what `count_replicas` last read from etcd: the /metrics route
    calls it before each scrape."""

    def __init__(self, calls: FunctionStats, functions_deployed: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.replicas: dict[str, int] = {}  # function name -> GPUs holding its model, as last read
        self.registry.register(calls)
        self.registry.register(_Counts(functions_deployed, self.replicas))
        self.registry.register(ProcessErrors())

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
    def __init__(self, functions_deployed: Callable[[], int], replicas: Mapping[str, int]) -> None:
        self._deployed = functions_deployed
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gateway_functions_deployed", "Functions in the registry.", value=self._deployed())
        service_count = GaugeMetricFamily(
            "gateway_service_count",
            "Replicas of each function: the GPUs that hold its model (0: it loads on its next call).",
            labels=["function_name"],
        )
        for name, count in sorted(self._replicas.items()):
            service_count.add_metric([name], count)
        yield service_count
