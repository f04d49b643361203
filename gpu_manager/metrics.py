"""A node's Prometheus metrics: the calls it ran, the loads it did, its workers and their memory."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_manager.pool import EXIT_CAUSES, RunResult, WorkerPool
from gpufaas.keys import gpu_address
from gpufaas.metrics import BYTES_PER_MB, LATENCY_BUCKETS_S, LoopCount, LoopCounter, ProcessErrors, outcome_label
from gpufaas.proto import gpufaas_pb2 as pb

LOST_CAUSES = ("load_failed", "died", "killed", "over_memory", "misbehaved")  # the exits counted as workers lost
# The models with a load-time series at once: those loaded most recently. A node sees every
# version of every function that misses on it, so without a bound redeploys grow the exposition
# (and the daemon) for good; the scheduler's series, labelled the same, are dropped as functions go.
LOAD_SERIES_MODELS = 256


class NodeMetrics:
    """Fed by the daemon with every call's result; the pool's workers, its process counts and
    the GPUs' memory are read at scrape time. `device_used_mb(gpu_id)`: what the device says is
    in use on that GPU (NVML, on cuda), None where nothing measures it."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        node: str,
        device_used_mb: Callable[[str], int | None] = lambda gpu_id: None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_PoolState(pool, node, device_used_mb))
        r.register(ProcessErrors())
        # Per call: counted on the event loop without a lock (gpufaas.metrics.LoopCounter).
        self.calls = LoopCounter(
            "gpufaas_node_calls", "Calls run here, by outcome and cache result.", ["outcome", "cache"]
        )
        r.register(self.calls)
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
        # `calls`' series by (outcome, loaded), bound on first use: `series()` builds and looks up
        # its label tuple, on every call of the serving path otherwise.
        self._calls_by: dict[tuple[int, bool], LoopCount] = {}
        self._load_models: OrderedDict[str, None] = OrderedDict()  # least recently loaded first

    def ran(self, model: str, result: RunResult) -> None:
        key = (result.outcome, result.loaded)
        calls = self._calls_by.get(key)
        if calls is None:
            outcome = outcome_label(result.outcome)  # (the worker's reply: its code may forge one)
            calls = self.calls.series(outcome, "miss" if result.loaded else "hit")
            if outcome != "unknown":  # bound only the Outcomes there are: not one per value forged
                self._calls_by[key] = calls
        calls.inc()
        if result.loaded and result.outcome == pb.OK:
            from_host = result.stages is not None and result.stages.from_host
            self.loads.labels("host" if from_host else "load").inc()
            self.load_seconds.labels(model).observe(result.load_time_s)
            self._loaded(model)

    def _loaded(self, model: str) -> None:
        """Keep `model`'s load series; drop the least recently loaded model's beyond
        LOAD_SERIES_MODELS (its series starts afresh if it loads here again)."""
        self._load_models[model] = None
        self._load_models.move_to_end(model)
        if len(self._load_models) > LOAD_SERIES_MODELS:
            oldest, _ = self._load_models.popitem(last=False)
            self.load_seconds.remove(oldest)


class _PoolState(Collector):
    """The pool's workers and process counts, and each GPU's memory, read when scraped: O(workers).
    GPUs are labelled "node/gpu", as the scheduler labels them, so the two line up."""

    def __init__(self, pool: WorkerPool, node: str, device_used_mb: Callable[[str], int | None]) -> None:
        self._pool = pool
        self._node = node
        self._device_used_mb = device_used_mb

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        ready = pool.workers()
        yield GaugeMetricFamily("gpufaas_node_workers", "Workers serving a model on a GPU.", value=len(ready))
        yield GaugeMetricFamily(
            "gpufaas_node_parked_workers", "Workers parked in the host tier.", value=len(pool.parked())
        )
        yield GaugeMetricFamily(
            "gpufaas_node_worker_processes",
            "Worker processes running (spares, loading, serving, parked): started less exited.",
            value=pool.live_workers(),
        )
        yield from _process_counts(pool)
        workers_mb = dict.fromkeys(pool.gpus, 0)
        for _, gpu_id, _, memory_mb in ready:
            workers_mb[gpu_id] = workers_mb.get(gpu_id, 0) + memory_mb
        reported = GaugeMetricFamily(
            "gpufaas_node_gpu_memory_workers_bytes",
            "GPU memory of the models this node's workers serve, as the node books them: NVML's peak figure for "
            "each worker's PID on cuda, the declared size elsewhere (never the worker's own report): what the node "
            "reports to the scheduler.",
            labels=["gpu"],
        )
        used = GaugeMetricFamily(
            "gpufaas_node_gpu_memory_used_bytes",
            "GPU memory in use by every process on the device, as NVML measures it (cuda backend only).",
            labels=["gpu"],
        )
        for gpu_id, memory_mb in sorted(workers_mb.items()):
            address = gpu_address(self._node, gpu_id)
            reported.add_metric([address], memory_mb * BYTES_PER_MB)
            device_mb = self._device_used_mb(gpu_id)
            if device_mb is not None:
                used.add_metric([address], device_mb * BYTES_PER_MB)
        yield reported
        yield used


def _process_counts(pool: WorkerPool) -> Iterator[Metric]:
    """The node's worker processes started and exited (by cause, and those lost), and the models
    found over their declared memory."""
    yield CounterMetricFamily(
        "gpufaas_node_worker_starts",
        "Worker processes started (warm spares; on the docker runtime, a container per model).",
        value=pool.worker_starts,
    )
    exits = CounterMetricFamily(
        "gpufaas_node_worker_exits",
        "Worker processes that exited, by cause (stopped: evicted, released or replaced; load_failed; "
        "killed: a call's timeout; died: by itself; start_failed; shutdown; over_memory: measured over its "
        "declared size, with no room for that on its GPU; misbehaved: killed for frames its node did not ask for).",
        labels=["cause"],
    )
    for cause in EXIT_CAUSES:
        exits.add_metric([cause], pool.worker_exits[cause])
    yield exits
    # Each worker once, from its exit: not per call (the calls waiting on one failed load, or
    # in one worker that died, share its loss).
    yield CounterMetricFamily(
        "gpufaas_node_workers_lost",
        "Workers that failed to load, died by themselves, were killed (a call's timeout or frames their node "
        "did not ask for) or went over their memory: worker exits of those causes.",
        value=sum(pool.worker_exits[cause] for cause in LOST_CAUSES),
    )
    over = CounterMetricFamily(
        "gpufaas_node_models_over_declared",
        "Workers whose model was over its declared memory_mb beyond the margin, once each, by source "
        "(measured: NVML's figure for its PID, which it is booked at; claimed: its own report, booked at the "
        "declared size).",
        labels=["source"],
    )
    for source in ("measured", "claimed"):
        over.add_metric([source], pool.models_over_declared[source])
    yield over
