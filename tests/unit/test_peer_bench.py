"""bench.peer_bench counts Ray's model loads over the requests it divides them by: the measured
phase's, as gpufaas's misses are counted (X-Cache of the measured requests only)."""

from __future__ import annotations

import argparse
import json
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


def _point(throughput_rps: float | None, p50_ms: float | None, errors: int) -> dict[str, Any]:
    return {"throughput_rps": throughput_rps, "p50_ms": p50_ms, "p99_ms": p50_ms, "errors": errors, "reload_ratio": 0.0}


def test_the_verdict_of_a_run_whose_peer_failed_every_call_is_written(tmp_path: Path) -> None:
    """A Ray mode that answered no call (0 req/s) and a hits point with no success (no p50): the
    verdict fails those targets and the report is written, instead of a ZeroDivisionError after
    every system ran that lost all the results."""
    points = ("c1", "c8", "c32")
    results = {
        "gpufaas": {c: _point(1200.0, 0.9, 0) for c in points},
        "ray-default": {c: _point(0.0, None, 50) for c in points},
        "ray-haproxy": {c: _point(None, None, 0) for c in points},
        "gpufaas-hits": {c: _point(0.0, None, 10) for c in points},
    }
    verdict = peer_bench.verdict(results)
    assert verdict["ratio_to_ray_default"] == dict.fromkeys(points)
    assert verdict["ratio_to_ray_haproxy"] == dict.fromkeys(points)
    assert verdict["ahead_of_ray_default_at_every_concurrency"] is True
    assert verdict["hits_c1_p50_le_1_5_ms"] is False
    assert verdict["c32_at_least_1000_rps_no_errors_reload_le_0_15"] is True
    report = {"metadata": {}, "results": results, "failures": {}, "verdict": verdict}
    peer_bench.write_report(tmp_path / "peer.json", report, point_label="c")
    assert (tmp_path / "peer.json").exists()


def test_a_run_where_a_system_failed_exits_non_zero_and_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A system that failed was recorded in the JSON only, and the benchmark exited 0: a script
    running it took the run for a good one. It exits 1 now, naming the failure on stderr."""

    def run(system: str, work: Path) -> dict[str, Any]:
        if system == "ray-default":
            raise RuntimeError("ray did not start")
        return {"c1": _point(100.0, 1.0, 0)}

    args = argparse.Namespace(duration=1.0, warmup=0.0, out=tmp_path / "peer.json")
    status = peer_bench.run_and_report(
        args, ["gpufaas", "ray-default"], run, prefix="t-", point_label="c", verdict=lambda results: {}
    )
    assert status == 1
    assert "ray-default failed: ray did not start" in capsys.readouterr().err
    assert json.loads(args.out.read_text())["failures"] == {"ray-default": "ray did not start"}
    all_good = peer_bench.run_and_report(args, ["gpufaas"], run, prefix="t-", point_label="c", verdict=lambda r: {})
    assert all_good == 0
