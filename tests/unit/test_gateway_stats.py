"""The gateway's one record of its calls (gateway.stats.FunctionStats) as Prometheus reads it: the
same series prometheus-client's own Counter and Histogram would expose, never reset by a
redeploy, dropped with a deleted function, and the counts GET /system/functions reports."""

from __future__ import annotations

from typing import Never

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from gateway.stats import FunctionStats
from gpufaas.functions import MAX_TIMEOUT_S
from gpufaas.metrics import LATENCY_BUCKETS_S, LoopSeries
from tests.scrape import sample

# (function, HTTP status, seconds): on a bucket's upper bound, between two, under the first,
# over the last; the first call of each (function, status) in sorted order, as the collector
# lists them (prometheus-client lists series in the order they were first observed).
CALLS = [
    ("bert", 200, 0.005),
    ("bert", 200, 0.0051),
    ("bert", 429, 0.0004),
    ("resnet", 200, 0.0),
    ("resnet", 500, 5000.0),
    ("resnet", 200, 120.0),
    ("bert", 200, 1.0),
    ("resnet", 200, 0.25),
]


def recorded(calls: list[tuple[str, int, float]]) -> CollectorRegistry:
    registry = CollectorRegistry()
    stats = FunctionStats()
    registry.register(stats)
    for name, status, duration_s in calls:
        stats.record(name, status, duration_s, hit=True if status == 200 else None)
    return registry


def test_the_series_are_those_prometheus_clients_counter_and_histogram_expose() -> None:
    # What the gateway exported before its calls had one record: a counter and a histogram
    # kept by prometheus-client, under the same names, help and labels.
    reference = CollectorRegistry()
    invocations = Counter(
        "gateway_function_invocation",
        "Function invocations by function and HTTP status.",
        ["function_name", "code"],
        registry=reference,
    )
    seconds = Histogram(
        "gateway_functions_seconds",
        "Invocation duration at the gateway, by function and HTTP status.",
        ["function_name", "code"],
        buckets=LATENCY_BUCKETS_S,
        registry=reference,
    )
    for name, status, duration_s in CALLS:
        invocations.labels(name, str(status)).inc()
        seconds.labels(name, str(status)).observe(duration_s)
    assert generate_latest(recorded(CALLS)).decode() == generate_latest(reference).decode()


def test_bucket_bounds_are_inclusive_and_the_count_is_the_inf_bucket() -> None:
    stats = FunctionStats(buckets_s=(0.1, 1.0))
    for duration_s in (0.1, 0.5, 2.0, 0.05):
        stats.record("f", 200, duration_s, hit=True)
    registry = CollectorRegistry()
    registry.register(stats)
    text = generate_latest(registry).decode()
    buckets = {le: sample(text, "gateway_functions_seconds_bucket", le=le) for le in ("0.1", "1.0", "+Inf")}
    assert buckets == {"0.1": 2, "1.0": 3, "+Inf": 4}
    assert sample(text, "gateway_functions_seconds_count", function_name="f", code="200") == 4
    assert sample(text, "gateway_functions_seconds_sum") == pytest.approx(2.65)
    assert sample(text, "gateway_function_invocation_total", function_name="f", code="200") == 4


def test_a_redeploy_resets_the_overview_but_not_the_counters() -> None:
    stats = FunctionStats()
    registry = CollectorRegistry()
    registry.register(stats)
    stats.record("f", 200, 0.02, hit=False)
    stats.record("f", 503, 0.001)
    stats.drop("f")  # a new package
    assert stats.summary("f")["calls"] == 0
    stats.record("f", 200, 0.01, hit=True)
    text = generate_latest(registry).decode()
    assert sample(text, "gateway_function_invocation_total", function_name="f", code="200") == 2
    assert sample(text, "gateway_function_invocation_total", function_name="f", code="503") == 1
    assert sample(text, "gateway_functions_seconds_sum", code="200") == pytest.approx(0.03)
    assert stats.count("f") == 3
    assert stats.summary("f") == {
        "calls": 1,
        "hits": 1,
        "misses": 0,
        "errors": 0,
        "hit_ratio": 1.0,
        "latency_ms": {"p50": 10.0, "p95": 10.0, "p99": 10.0},
    }


def test_a_deletion_drops_the_functions_series_and_no_other() -> None:
    stats = FunctionStats()
    registry = CollectorRegistry()
    registry.register(stats)
    for name, status, duration_s in CALLS:
        stats.record(name, status, duration_s, hit=True if status == 200 else None)
    stats.record("late", 200, 0.1, hit=True)  # a call of a deleted function answered since
    stats.delete("bert")
    stats.forget({"resnet"})
    text = generate_latest(registry).decode()
    assert 'function_name="bert"' not in text and 'function_name="late"' not in text
    assert sample(text, "gateway_function_invocation_total", function_name="resnet") == 4
    assert (stats.count("bert"), stats.count("late"), stats.count("resnet")) == (0, 0, 4)
    stats.record("bert", 200, 0.1, hit=True)  # deployed again: a new function's series
    assert sample(generate_latest(registry).decode(), "gateway_function_invocation_total", function_name="bert") == 1


def test_the_buckets_resolve_calls_as_long_as_a_timeout_allows() -> None:
    # A function may run a call for up to MAX_TIMEOUT_S (an hour). The buckets ended at 120 s:
    # calls of 5 minutes all fell in +Inf, and histogram_quantile answered their p50 with 120 s.
    stats = FunctionStats()
    registry = CollectorRegistry()
    registry.register(stats)
    for duration_s in (290.0, 300.0, 310.0, MAX_TIMEOUT_S):
        stats.record("generate", 200, duration_s, hit=True)
    text = generate_latest(registry).decode()
    finite = sorted(
        float(s.labels["le"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gateway_functions_seconds_bucket" and s.labels["le"] != "+Inf"
    )
    assert finite[-1] >= MAX_TIMEOUT_S
    by_le = {le: sample(text, "gateway_functions_seconds_bucket", le=floatToGoString(le)) for le in finite}
    assert by_le[finite[-1]] == 4
    median_le = next(le for le in finite if by_le[le] >= 2)  # the bucket histogram_quantile(0.5) ends in
    assert 290.0 <= median_le <= 2 * 300.0


def test_count_is_one_functions_calls_of_every_status() -> None:
    stats = FunctionStats()
    for name, status, duration_s in CALLS:
        stats.record(name, status, duration_s, hit=True if status == 200 else None)
    assert (stats.count("bert"), stats.count("resnet"), stats.count("absent")) == (4, 4, 0)


class _Unwalkable(dict[tuple[str, int], LoopSeries]):
    """Every function's series, which `count` must not walk (it may look one up)."""

    def items(self) -> Never:
        raise AssertionError("count walked every function's series")

    def __iter__(self) -> Never:
        raise AssertionError("count walked every function's series")


def test_counting_one_function_reads_its_own_series_not_every_functions() -> None:
    # GET /system/functions asks the count of each function, on the event loop: a count that
    # walked every function's series made that listing quadratic (10,000 functions: 100 million
    # steps, about 2.4 s during which no call was served).
    stats = FunctionStats()
    for i in range(3):
        stats.record(f"f{i}", 200, 0.001, hit=True)
    stats.record("f0", 500, 0.001)
    stats._series = _Unwalkable(stats._series)
    assert [stats.count(f"f{i}") for i in range(3)] == [2, 1, 1]
    assert stats.count("absent") == 0


def test_a_failed_call_is_an_error_in_the_overview_and_not_a_latency() -> None:
    stats = FunctionStats()
    stats.record("f", 200, 0.002, hit=True)
    stats.record("f", 504, 30.0)
    summary = stats.summary("f")
    assert (summary["calls"], summary["errors"], summary["latency_ms"]["p99"]) == (2, 1, 2.0)


@pytest.mark.parametrize("buckets_s", [(), (1.0, 0.5), (0.5, 0.5), (1.0, float("inf"))])
def test_buckets_must_be_finite_and_increasing(buckets_s: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="increasing order"):
        FunctionStats(buckets_s=buckets_s)
