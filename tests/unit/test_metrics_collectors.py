"""What the daemons' metrics read at scrape time: lalb-o3's out-of-order dispatches, the memory the
cache manager plans per GPU, a node's worker processes by exit cause, gateway_service_count from
the replicas in etcd, and the etcd and wire errors every daemon counts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.metrics import GatewayMetrics
from gateway.stats import FunctionStats
from gpu_manager.metrics import LOAD_SERIES_MODELS, NodeMetrics
from gpu_manager.pool import EXIT_CAUSES, ModelRun, WorkerPool
from gpu_manager.staging import LocalPackages
from gpu_manager.workers import RunResult
from gpufaas import store, wire
from gpufaas.dev.etcd_server import free_port
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.metrics import LoopCounter, LoopHistogram
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore, StoreError
from gpufaas.wire import Connection, ConnectionLost, Frame, Server, Unauthenticated, connect
from scheduler.decisions import Dispatch, Step
from scheduler.metrics import SchedulerMetrics
from scheduler.policies.base import SchedulingContext, SchedulingPolicy
from tests.builders import cache_on, make_scheduler, submit
from tests.fakes import MemoryStore
from tests.fixtures.make_packages import build_package
from tests.scrape import sample

MB = 1024 * 1024


def scrape(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return sample(generate_latest(registry).decode(), name, **labels)


# --- the scheduler ------------------------------------------------------------------------------


def test_o3_skips_count_each_call_dispatched_ahead_of_older_ones_and_nothing_else() -> None:
    s = make_scheduler("lalb-o3", gpus=1, max_num_skips=2)
    metrics = SchedulerMetrics(s)
    cache_on(s, "g0", "A")
    (b,) = submit(s, "B")
    now = 0.0
    for expected in (1, 2):
        (a,) = submit(s, "A", now=now)
        assert [d.request.model for d in s.schedule(now)] == ["A"]  # ahead of B
        assert scrape(metrics.registry, "gpufaas_scheduler_o3_skips_total") == expected
        assert scrape(metrics.registry, "gpufaas_scheduler_queue_head_skips") == expected
        assert scrape(metrics.registry, "gpufaas_scheduler_queue_depth") == 1
        now += 1.0
        s.on_complete(a.request_id, now)
    submit(s, "A", now=now)
    # B reached the limit: it goes first, in order, and A after it; no skip is added.
    (forced,) = s.schedule(now)
    assert isinstance(forced, Dispatch) and forced.request == b
    assert scrape(metrics.registry, "gpufaas_scheduler_o3_skips_total") == 2


class _WhatIfPolicy(SchedulingPolicy, name="test-metrics-what-if"):
    """Tries passing over the queue for its youngest call, takes that back, and dispatches the
    head: a pass-over the plan drops."""

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        queued = [request for request, _ in ctx.queue.walk()]
        savepoint = ctx.savepoint()
        ctx.pass_over(queued[-1].request_id)
        ctx.rollback(savepoint)
        return [ctx.dispatch(queued[0], gpu_id, now)]


# Out of the registry, so that commands listing every policy never see it; put back per test.
WHAT_IF = SchedulingPolicy.registry.pop("test-metrics-what-if")


@pytest.mark.parametrize("policy", ["lalb", "test-metrics-what-if"])
def test_in_order_dispatch_and_a_pass_over_the_plan_drops_count_no_o3_skip(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SchedulingPolicy.registry, WHAT_IF.name, WHAT_IF)
    s = make_scheduler(policy, gpus=1)
    metrics = SchedulerMetrics(s)
    cache_on(s, "g0", "A")
    submit(s, "B", "A")
    assert [d.request.model for d in s.schedule(0.0)] == ["B"]
    assert scrape(metrics.registry, "gpufaas_scheduler_o3_skips_total") == 0


def test_the_memory_the_cache_manager_plans_is_exported_per_gpu() -> None:
    s = make_scheduler("lalb", gpus={"n0/gpu0": 8000, "n0/gpu1": 4000}, models={"A": 1000, "B": 2500})
    metrics = SchedulerMetrics(s)
    cache_on(s, "n0/gpu0", "A", "B")
    cache_on(s, "n0/gpu1", "B")
    planned = "gpufaas_gpu_memory_planned_bytes"
    assert scrape(metrics.registry, planned, gpu="n0/gpu0") == 3500 * MB
    assert scrape(metrics.registry, planned, gpu="n0/gpu1") == 2500 * MB
    assert scrape(metrics.registry, "gpufaas_gpu_memory_capacity_bytes", gpu="n0/gpu1") == 4000 * MB


# --- a node --------------------------------------------------------------------------------------


def test_a_nodes_worker_processes_are_counted_as_they_start_and_by_why_they_exit(tmp_path: Path) -> None:
    build_package("echo_function", tmp_path)
    packages = LocalPackages(tmp_path / "store")
    digest = packages.add_archive((tmp_path / "echo_function.tar.gz").read_bytes())
    fetch = packages.fetch

    def run(model: str, **profile: float) -> ModelRun:
        return ModelRun(model, digest, memory_mb=100, **{"load_time_s": 0.001, "inference_time_s": 0.001, **profile})

    async def scenario() -> None:
        pool = WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=fetch, spares_per_gpu=1)
        used_mb = {"gpu0": 777}
        metrics = NodeMetrics(pool, node="n0", device_used_mb=used_mb.get)

        def value(name: str, **labels: str) -> float:
            return scrape(metrics.registry, name, **labels)

        def balanced() -> bool:
            started = value("gpufaas_node_worker_starts_total")
            exited = value("gpufaas_node_worker_exits_total")
            return started - exited == value("gpufaas_node_worker_processes")

        async def settled(cause: str, count: int) -> None:
            for _ in range(500):
                if value("gpufaas_node_worker_exits_total", cause=cause) >= count:
                    break
                await asyncio.sleep(0.01)
            assert value("gpufaas_node_worker_exits_total", cause=cause) == count

        pool.start()
        try:
            await pool.spares_ready(30.0)
            assert value("gpufaas_node_worker_starts_total") == 1
            result = await pool.run(run("a"), "gpu0", "c1", b"{}", content_type="application/json", timeout_s=30)
            assert result.outcome == pb.OK and result.loaded
            await pool.spares_ready(30.0)
            assert value("gpufaas_node_worker_starts_total") == 2  # the spare took `a`; another replaced it
            assert value("gpufaas_node_gpu_memory_workers_bytes", gpu="n0/gpu0") == 100 * MB
            assert value("gpufaas_node_gpu_memory_used_bytes", gpu="n0/gpu0") == 777 * MB
            assert await pool.evict("a", "gpu0")
            await settled("stopped", 1)
            assert value("gpufaas_node_gpu_memory_workers_bytes", gpu="n0/gpu0") == 0
            slow = await pool.run(
                run("slow", load_time_s=60), "gpu0", "c2", b"{}", content_type="application/json", timeout_s=0.5
            )
            assert slow.outcome == pb.TIMEOUT and slow.worker_killed
            await settled("killed", 1)
            assert value("gpufaas_node_worker_exits_total", cause="died") == 0
            assert balanced()
        finally:
            await pool.shutdown()
        await settled("shutdown", 1)  # the spare
        assert value("gpufaas_node_worker_processes") == 0
        assert balanced()
        # Every cause is a series from the start, so a dashboard's rate() has something to read.
        causes = {s.labels["cause"] for f in metrics.registry.collect() for s in f.samples if "cause" in s.labels}
        assert causes == set(EXIT_CAUSES)

    asyncio.run(scenario())


def test_a_worker_reply_of_an_outcome_with_no_name_is_counted_as_unknown(tmp_path: Path) -> None:
    # The outcome comes from the worker's reply, which its user's code can write: naming one
    # this gpufaas does not know raised ValueError where the node counted the call it had run.
    packages = LocalPackages(tmp_path / "store")
    metrics = NodeMetrics(WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=packages.fetch), node="n0")
    for outcome in (99, 12345, pb.HANDLER_ERROR):
        metrics.ran("m", RunResult(outcome))  # type: ignore[arg-type]
    assert scrape(metrics.registry, "gpufaas_node_calls_total", outcome="unknown", cache="hit") == 2
    assert scrape(metrics.registry, "gpufaas_node_calls_total", outcome="handler_error") == 1
    # Nor is a series bound per value forged: the node's memory would grow with every forged call.
    for outcome in range(1000, 1100):
        metrics.ran("m", RunResult(outcome))  # type: ignore[arg-type]
    assert len(metrics._calls_by) == 1


def test_a_nodes_load_series_are_kept_for_the_models_it_loaded_most_recently(tmp_path: Path) -> None:
    packages = LocalPackages(tmp_path / "store")
    pool = WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=packages.fetch)
    metrics = NodeMetrics(pool, node="n0")

    def loaded(model: str) -> None:
        metrics.ran(model, RunResult(pb.OK, loaded=True, load_time_s=0.5))

    def series() -> set[str]:
        exposition = generate_latest(metrics.registry).decode()
        return {
            line.split('model="')[1].split('"')[0] for line in exposition.splitlines() if "load_seconds_count{" in line
        }

    for version in range(LOAD_SERIES_MODELS):
        loaded(f"m{version}")
    loaded("m0")  # loaded again: now the most recent
    loaded("new")  # one model too many: the least recently loaded one's series goes
    assert len(series()) == LOAD_SERIES_MODELS
    assert "m1" not in series() and {"m0", "m2", "new"} <= series()
    assert scrape(metrics.registry, "gpufaas_node_load_seconds_count", model="m0") == 2
    loaded("m1")  # back: its series starts afresh
    assert scrape(metrics.registry, "gpufaas_node_load_seconds_count", model="m1") == 1
    assert scrape(metrics.registry, "gpufaas_node_loads_total", source="load") == LOAD_SERIES_MODELS + 3


# --- the gateway --------------------------------------------------------------------------------


def test_gateway_service_count_is_the_gpus_holding_each_deployed_functions_model() -> None:
    keys = Keys()
    hot = FunctionSpec(name="hot", package_digest="sha256:" + "a" * 64, memory_mb=10)
    cold = FunctionSpec(name="cold", package_digest="sha256:" + "b" * 64, memory_mb=10)
    metrics = GatewayMetrics(FunctionStats(), lambda: 2)

    async def scenario() -> None:
        memory = MemoryStore()
        await memory.put(keys.replicas(hot.model), json.dumps(["n0/gpu0", "n1/gpu0"]).encode())
        await memory.put(keys.replicas("retired@0"), json.dumps(["n0/gpu1"]).encode())  # no function's
        await metrics.count_replicas(memory, keys, {"hot": hot, "cold": cold})
        assert scrape(metrics.registry, "gateway_service_count", function_name="hot") == 2
        assert scrape(metrics.registry, "gateway_service_count", function_name="cold") == 0
        assert 'function_name="cold"' in generate_latest(metrics.registry).decode()  # 0, not absent
        # etcd out of reach: the last counts stay, and the scrape does not fail.
        await memory.put(keys.replicas(cold.model), json.dumps(["n0/gpu0"]).encode())
        memory.set_reachable(False)
        await metrics.count_replicas(memory, keys, {"hot": hot, "cold": cold})
        assert scrape(metrics.registry, "gateway_service_count", function_name="cold") == 0
        memory.set_reachable(True)
        await metrics.count_replicas(memory, keys, {"hot": hot})  # cold was removed
        assert scrape(metrics.registry, "gateway_service_count", function_name="cold") == 0
        assert 'function_name="cold"' not in generate_latest(metrics.registry).decode()

    asyncio.run(scenario())


# --- every daemon: etcd and the wire --------------------------------------------------------------


class _Silent:
    def on_frame(self, conn: Connection, frame: Frame) -> None:
        pass

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass


def test_etcd_and_wire_errors_are_counted_where_they_happen_and_exported_by_kind() -> None:
    registry = SchedulerMetrics(make_scheduler("lalb")).registry
    etcd_before = scrape(registry, "gpufaas_etcd_errors_total", kind="unavailable")
    wire_before = {kind: scrape(registry, "gpufaas_wire_errors_total", kind=kind) for kind in wire.WIRE_ERROR_KINDS}

    async def scenario() -> None:
        with pytest.raises(StoreError):
            await EtcdStore.open(f"127.0.0.1:{free_port()}", timeout_s=2.0)  # nothing listens there
        with pytest.raises(ConnectionLost):
            await connect(f"127.0.0.1:{free_port()}", timeout_s=2.0)
        server = Server(_Silent, key=b"k" * 32)
        address = await server.start("127.0.0.1:0")
        try:
            with pytest.raises(Unauthenticated):
                await connect(address, key=b"x" * 32, timeout_s=2.0)
        finally:
            await server.close()

    asyncio.run(scenario())
    assert scrape(registry, "gpufaas_etcd_errors_total", kind="unavailable") == etcd_before + 1
    assert sum(count for (_, kind), count in store.etcd_error_counts.items() if kind == "unavailable") >= 1
    after = {kind: scrape(registry, "gpufaas_wire_errors_total", kind=kind) for kind in wire.WIRE_ERROR_KINDS}
    # The client's refused proof and the server's refusal of it: both ends are in this process.
    assert {kind: after[kind] - wire_before[kind] for kind in after} == {
        "connect": 1,
        "auth": 2,
        "frame_too_large": 0,
        "malformed": 0,
        "handler": 0,
    }


def test_loop_metrics_expose_what_prometheus_clients_own_expose() -> None:
    """LoopCounter and LoopHistogram (no lock, for the per-call path) read exactly as
    prometheus-client's Counter and Histogram fed the same values, bucket edges included."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = LoopCounter("demo_calls", "Calls.", ["cache"])
    histogram = LoopHistogram("demo_seconds", "Durations.", ["model"], buckets_s=(0.001, 0.01, 0.1))
    ours.register(counter)
    ours.register(histogram)
    their_counter = Counter("demo_calls", "Calls.", ["cache"], registry=theirs)
    their_histogram = Histogram("demo_seconds", "Durations.", ["model"], buckets=(0.001, 0.01, 0.1), registry=theirs)
    for cache, model, seconds in [("hit", "m", 0.001), ("miss", "m", 0.0105), ("hit", "n", 3.0), ("hit", "m", 0.0)]:
        counter.series(cache).inc()
        their_counter.labels(cache).inc()
        histogram.series(model).observe(seconds)
        their_histogram.labels(model).observe(seconds)
    counter.series("miss").inc(2.5)
    their_counter.labels("miss").inc(2.5)
    assert generate_latest(ours) == generate_latest(theirs)
    with pytest.raises(ValueError, match="takes the labels"):
        counter.series("hit", "extra")
    with pytest.raises(ValueError, match="only goes up"):
        counter.series("hit").inc(-1)
    for bad in [(), (0.1, 0.01), (0.1, float("inf"))]:
        with pytest.raises(ValueError, match="increasing order"):
            LoopHistogram("demo_bad_seconds", "Durations.", buckets_s=bad)
