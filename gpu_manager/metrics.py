"""A node's Prometheus metrics: the calls it ran, the loads it did, the workers it lost."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_manager.pool import RunResult
from gpufaas.metrics import LATENCY_BUCKETS_S
from gpufaas.proto import gpufaas_pb2 as pb


class NodeMetrics:
    """Fed by the daemon with every call's result; worker counts are read at scrape time."""

    def __init__(self, *, workers: Callable[[], int], parked: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "gpufaas_node_calls", "Calls run here, by outcome and cache result.", ["outcome", "cache"], registry=r
        )
        self.loads = Counter(
            "gpufaas_node_loads", "Misses served, by where the model came from (load, host).", ["source"], registry=r
        )
        self.load_seconds = Histogram(
            "gpufaas_node_load_seconds",
            "Time a miss took to make its model ready, by model.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.workers_lost = Counter(
            "gpufaas_node_workers_lost", "Workers that died under a call, failed to load, or were killed.", registry=r
        )
        Gauge("gpufaas_node_workers", "Workers serving a model on a GPU.", registry=r).set_function(workers)
        Gauge("gpufaas_node_parked_workers", "Workers parked in the host tier.", registry=r).set_function(parked)

    def ran(self, model: str, result: RunResult) -> None:
        outcome = pb.Outcome.Name(result.outcome).lower()
        self.calls.labels(outcome, "miss" if result.loaded else "hit").inc()
        if result.loaded and result.outcome == pb.OK:
            from_host = result.stages is not None and result.stages.from_host
            self.loads.labels("host" if from_host else "load").inc()
            self.load_seconds.labels(model).observe(result.load_time_s)
        if result.outcome in (pb.LOAD_FAILED, pb.WORKER_DIED) or result.worker_killed:
            self.workers_lost.inc()
