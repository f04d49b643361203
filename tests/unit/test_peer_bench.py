"""bench.peer_bench counts Ray's model loads over the requests it divides them by: the measured
phase's, as gpufaas's misses are counted (X-Cache of the measured requests only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from bench import peer_bench

WARMUP_LOADS_PER_S = 50  # a cold warm-up loads models much faster than the steady state
MEASURED_LOADS_PER_S = 3
REQUESTS_PER_S = 100


def test_ray_point_counts_only_the_measured_phases_model_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A fake load client (one run: `warmup` unrecorded seconds, then `duration` measured ones) and
    a fake Ray whose replicas count loads: the point's loads are the measured seconds' only."""
    loads = [0]

    def fake_load(url: str, concurrency: int, args: argparse.Namespace, *extra: str, **workload: Any) -> dict[str, Any]:
        loads[0] += round(args.warmup * WARMUP_LOADS_PER_S)
        loads[0] += round(args.duration * MEASURED_LOADS_PER_S)
        return {"requests": round(args.duration * REQUESTS_PER_S), "warmup_s": args.warmup}

    monkeypatch.setattr(peer_bench, "load", fake_load)
    monkeypatch.setattr(peer_bench, "replica_loads", lambda url: {1: loads[0]})
    args = argparse.Namespace(duration=10.0, warmup=2.0)
    point = peer_bench.ray_point("http://ray/mux", 1, args, tmp_path, "ray")
    assert point["requests"] == 1000
    assert point["model_loads"] == 30  # 10 s x 3, none of the warm-up's 100
    assert point["reload_ratio"] == 0.03
    assert point["warmup_s"] == 2.0
