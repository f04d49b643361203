"""bench.replay_bench: the simulated column runs the workload the cluster is sent (the same
deadline), and the real column times each call from its scheduled arrival."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import httpx
import pytest

from bench import replay_bench
from gpufaas.types import DEFAULT_BATCH_SIZE, Request
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload, zipf_workload


def test_the_simulated_calls_have_the_deployed_functions_deadline() -> None:
    """100 calls of 1 s at once on one GPU: the last waits 99 s. The cluster's functions have
    timeout_s TIMEOUT_S and answer every call; the simulated column must not time out those
    waiting past the workload's default 60 s (and average the others only)."""
    workload = zipf_workload(calls=100, models=1, zipf_exponent=1.0, memory_mb=100, gap_s=0.0, seed=0)
    result = simulate(replay_bench.compressed(workload, 1.0), "lalb-o3", cluster=ClusterConfig(gpus=1))
    assert result.timed_out == 0
    assert result.completed == 100
    assert all(replay_bench.compressed(workload, 10.0).timeout_s(f) == 3600.0 for f in workload.function_models)


class _FakeClock:
    """time.monotonic for bench.replay_bench only: the given readings in turn."""

    def __init__(self, readings: list[float]) -> None:
        self._readings = iter(readings)

    def monotonic(self) -> float:
        return next(self._readings)


class _Answer:
    status_code = 200
    headers: ClassVar[dict[str, str]] = {"x-cache": "hit"}


class _FakeClient:
    def __init__(self, **_: object) -> None:
        pass

    async def __aenter__(self) -> _FakeClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def post(self, url: str, content: bytes) -> _Answer:
        return _Answer()


def test_a_call_sent_a_hair_before_its_arrival_keeps_its_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock reads 1 ns before the call's arrival when it is sent and 2 s after when it is
    answered: its latency is 2 s (it was recorded as 0.0)."""
    request = Request("r000000", "f", "m", 0.01, DEFAULT_BATCH_SIZE)
    workload = Workload([request], [], {"f": "m"}, "f", 0, 1)
    clock = _FakeClock([100.0, 100.0, 100.01 - 1e-9, 102.01])
    monkeypatch.setattr(replay_bench, "time", clock)
    monkeypatch.setattr(replay_bench.httpx, "AsyncClient", _FakeClient)
    figures = asyncio.run(replay_bench.replay("http://gateway", workload, {"m": "f00"}, {}))
    assert figures["completed"] == 1
    assert figures["avg_latency_s"] == pytest.approx(2.0)


class _FailingClient(_FakeClient):
    async def post(self, url: str, content: bytes) -> _Answer:
        if url.endswith("f00"):
            raise httpx.ReadError("connection closed")
        return _Answer()


def test_a_call_the_transport_failed_is_counted_as_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """One of two calls fails with a ReadError: the replay counts it among the errors and reports
    the other, instead of raising (which ended the benchmark and lost every policy's results)."""
    requests = [Request(f"r{i:06d}", f"f{i}", f"m{i}", 0.0, DEFAULT_BATCH_SIZE) for i in range(2)]
    workload = Workload(requests, [], {"f0": "m0", "f1": "m1"}, "f0", 0, 1)
    monkeypatch.setattr(replay_bench.httpx, "AsyncClient", _FailingClient)
    figures = asyncio.run(replay_bench.replay("http://gateway", workload, {"m0": "f00", "m1": "f01"}, {}))
    assert (figures["completed"], figures["errors"]) == (1, 1)
