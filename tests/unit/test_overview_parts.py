"""The pure parts behind the overview: the gateway's per-function stats and the scheduler's
eviction log."""

from __future__ import annotations

import hashlib

import pytest

from gateway.stats import RECENT_CALLS, FunctionStats
from gpufaas.functions import FunctionSpec
from scheduler.calls import Assignment, Evict, EvictHost
from scheduler.evictions import EvictionLog

# A function's stats in the overview before its first call (test_top's frames start from it too).
NO_CALLS = {"calls": 0, "hits": 0, "misses": 0, "errors": 0, "hit_ratio": None, "latency_ms": None}


def test_stats_count_calls_by_cache_result_and_errors() -> None:
    stats = FunctionStats()
    assert stats.summary("f") == NO_CALLS
    stats.record("f", 200, 0.5, hit=False)
    for _ in range(3):
        stats.record("f", 200, 0.01, hit=True)
    stats.record("f", 504, 30.0)
    summary = stats.summary("f")
    assert (summary["calls"], summary["hits"], summary["misses"], summary["errors"]) == (5, 3, 1, 1)
    assert summary["hit_ratio"] == pytest.approx(0.75)


def test_percentiles_are_nearest_rank_over_the_recent_calls() -> None:
    stats = FunctionStats()
    for ms in range(1, 101):  # 1..100 ms
        stats.record("f", 200, ms / 1000, hit=True)
    assert stats.summary("f")["latency_ms"] == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    stats.record("g", 200, 0.2, hit=True)
    assert stats.summary("g")["latency_ms"] == {"p50": 200.0, "p95": 200.0, "p99": 200.0}
    # Only the last RECENT_CALLS count: old slow calls leave the window.
    for _ in range(RECENT_CALLS):
        stats.record("f", 200, 0.001, hit=True)
    assert stats.summary("f")["latency_ms"] == {"p50": 1.0, "p95": 1.0, "p99": 1.0}
    assert stats.summary("f")["calls"] == 100 + RECENT_CALLS


def test_stats_forget_deleted_functions() -> None:
    stats = FunctionStats()
    stats.record("kept", 200, 0.1, hit=True)
    stats.record("gone", 200, 0.1, hit=True)
    stats.record("redeployed", 200, 0.1, hit=True)
    stats.forget({"kept", "redeployed"})
    assert stats.summary("kept")["calls"] == 1
    assert stats.summary("gone")["calls"] == 0
    stats.drop("redeployed")
    assert stats.summary("redeployed")["calls"] == 0


def _assignment(gpu_id: str, evict: tuple[str, ...]) -> Assignment:
    spec = FunctionSpec(name="f", package_digest="sha256:" + hashlib.sha256(b"f").hexdigest(), memory_mb=10)
    return Assignment(
        owner=None,  # type: ignore[arg-type]
        call_id="c",
        attempt=1,
        gpu_id=gpu_id,
        gpu_seq=1,
        hit=False,
        evict=evict,
        spec=spec,
        queue_s=0.0,
        deadline=10.0,
        claim_by=10.0,
        est_load_time_s=1.0,
        est_inference_time_s=0.1,
    )


def test_the_eviction_log_keeps_the_most_recent_with_their_reason() -> None:
    log = EvictionLog(size=3)
    log.record(_assignment("n/0", ()), 1.0)  # evicts nothing
    log.record(_assignment("n/0", ("a@1", "b@1")), 2.0)
    log.record(Evict("n/1", ("c@1",), to_host=True, if_idle=True), 3.0)
    log.record(EvictHost("n", ("d@1",)), 4.0)
    log.record(object(), 5.0)  # not an eviction
    recent = log.recent()
    assert [(e.gpu, e.model, e.reason, e.at_s) for e in recent] == [
        ("n/host", "d@1", "host", 4.0),
        ("n/1", "c@1", "idle", 3.0),
        ("n/0", "b@1", "lru", 2.0),
    ]
    log.record(Evict("n/1", ("e@1",)), 6.0)
    assert log.recent()[0].reason == "removed"
