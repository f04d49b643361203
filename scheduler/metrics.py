"""The scheduler's Prometheus metrics: what it placed, what it evicted, and what the nodes measured."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufaas.metrics import BYTES_PER_MB, LoopCounter, LoopHistogram, LoopSeries, ProcessErrors
from scheduler.calls import Assignment, Evict, EvictHost
from scheduler.core import Scheduler


class SchedulerMetrics:
    """Counters the service feeds from the effects it applies and the Done messages it gets;
    what the pure scheduler holds (its queue, its out-of-order count, the memory its cache
    manager plans on each GPU) is read at scrape time, so the hot path pays nothing for it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_SchedulerState(scheduler))
        r.register(ProcessErrors())
        # Per call: counted on the event loop without a lock (gpufaas.metrics.LoopCounter).
        self.calls = LoopCounter(
            "gpufaas_scheduler_calls", "Calls done, by cache result (a miss loaded or took back the model).", ["cache"]
        )
        self.placements = LoopCounter(
            "gpufaas_scheduler_placements", "Placements sent, by what the scheduler expected.", ["cache"]
        )
        self.queue_wait = LoopHistogram(
            "gpufaas_scheduler_queue_wait_seconds", "Time a call waited before its placement."
        )
        measured = ("model", "gpu_type")  # what a node's timing is labelled with
        self.load = LoopHistogram(
            "gpufaas_load_seconds", "Model loads (or take-backs from host memory) as nodes measured them.", measured
        )
        self.inference = LoopHistogram(
            "gpufaas_inference_seconds", "Batch inference times as nodes measured them.", measured
        )
        for metric in (self.calls, self.placements, self.queue_wait, self.load, self.inference):
            r.register(metric)
        self.evictions = Counter(
            "gpufaas_scheduler_evictions", "Models a placement evicted from a GPU's LRU list.", registry=r
        )
        self.releases = Counter(
            "gpufaas_scheduler_releases", "Staged-exit releases, by stage (gpu, host).", ["stage"], registry=r
        )
        self.failures = Counter(
            "gpufaas_scheduler_call_failures", "Attempts that ended other than OK, by outcome.", ["outcome"], registry=r
        )
        self.leases = Counter(
            "gpufaas_scheduler_leases",
            "Hit placements that were also leases of their slot to their gateway (docs/hit-leases.md).",
            registry=r,
        )
        # The series every call touches, bound once.
        self._placed = {True: self.placements.series("hit"), False: self.placements.series("miss")}
        self._done = {True: self.calls.series("miss"), False: self.calls.series("hit")}  # by `loaded`
        self._queue_wait = self.queue_wait.series()
        self._loads: dict[tuple[str, str], LoopSeries] = {}
        self._inferences: dict[tuple[str, str], LoopSeries] = {}

    def forget_model(self, model: str) -> None:
        """`model` runs no function any more (its function was updated to another package, or
        deleted): its load and inference series go, so that redeploys do not grow the exposition
        (and this daemon) for good. Its series start afresh if it is deployed again."""
        for bound, parent in ((self._loads, self.load), (self._inferences, self.inference)):
            for key in [key for key in bound if key[0] == model]:
                del bound[key]
                parent.remove(*key)

    def applied(self, effect: object) -> None:
        """An effect the service carries out."""
        if isinstance(effect, Assignment):
            self._placed[effect.hit].inc()
            self._queue_wait.observe(effect.queue_s)
            if effect.lease_s:
                self.leases.inc()
            if effect.evict:
                self.evictions.inc(len(effect.evict))

    def released(self, effects: Iterable[object]) -> None:
        """The staged exit's releases (the Evict and EvictHost effects of `CallBook.release_idle`)."""
        for effect in effects:
            if isinstance(effect, Evict):
                self.releases.labels("gpu").inc(len(effect.models))
            elif isinstance(effect, EvictHost):
                self.releases.labels("host").inc(len(effect.models))

    def done(
        self,
        model: str,
        gpu_type: str,
        *,
        ok: bool,
        outcome: str,
        loaded: bool,
        load_time_s: float,
        inference_time_s: float,
        retired: bool = False,
    ) -> None:
        """A node's Done for the current attempt of a call of `model` on a GPU of `gpu_type`.
        `retired`: no function runs `model` any more (`forget_model` dropped its series): the
        call is counted, its timings are not, so that they make no series of it again."""
        if not ok:
            self.failures.labels(outcome).inc()
            return
        self._done[loaded].inc()
        if retired:
            return
        if loaded and load_time_s > 0:
            _child(self._loads, self.load, model, gpu_type).observe(load_time_s)
        if inference_time_s > 0:
            _child(self._inferences, self.inference, model, gpu_type).observe(inference_time_s)


def _child(bound: dict[tuple[str, str], LoopSeries], parent: LoopHistogram, model: str, gpu_type: str) -> LoopSeries:
    """`parent.series(model, gpu_type)`, bound once per pair in `bound`."""
    child = bound.get((model, gpu_type))
    if child is None:
        child = bound[(model, gpu_type)] = parent.series(model, gpu_type)
    return child


class _SchedulerState(Collector):
    """What the scheduler holds now, read when scraped: O(GPUs)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self._scheduler
        yield GaugeMetricFamily(
            "gpufaas_scheduler_queue_depth", "Calls in the global queue.", value=len(scheduler.queue)
        )
        yield GaugeMetricFamily(
            "gpufaas_scheduler_queue_head_skips",
            "Times the call at the head of the global queue was passed over (lalb-o3 forces it at --o3-limit).",
            value=scheduler.queue.head_skips(),
        )
        yield CounterMetricFamily(
            "gpufaas_scheduler_o3_skips",
            "Out-of-order dispatches (lalb-o3): calls run ahead of older queued calls, each of which counted a skip.",
            value=scheduler.num_dispatched_ahead,
        )
        planned = GaugeMetricFamily(
            "gpufaas_gpu_memory_planned_bytes",
            "GPU memory the cache manager plans as used on each GPU (the models in its LRU list).",
            labels=["gpu"],
        )
        capacity = GaugeMetricFamily(
            "gpufaas_gpu_memory_capacity_bytes",
            "GPU memory the cache manager may plan with on each GPU (the node's figure, less its reserve).",
            labels=["gpu"],
        )
        for state in scheduler.gpus():
            gpu_id = state.spec.gpu_id
            cache = scheduler.cache.gpu(gpu_id)
            planned.add_metric([gpu_id], cache.used_mb * BYTES_PER_MB)
            capacity.add_metric([gpu_id], cache.capacity_mb * BYTES_PER_MB)
        yield planned
        yield capacity
