"""bench.density_bench's verdict of a run where a system answered no call is written, not raised."""

from __future__ import annotations

from typing import Any

from bench import density_bench


def _point(throughput_rps: float | None, errors: int) -> dict[str, Any]:
    return {"throughput_rps": throughput_rps, "p50_ms": None, "p99_ms": None, "errors": errors}


def test_the_verdict_of_a_run_whose_peer_or_ours_answered_no_call() -> None:
    """Ray at 0 req/s (every call failed) at N = 40 and with no throughput at N = 200; gpufaas with
    none at N = 100: no ratio there, and the N = 200 target is judged (failed where gpufaas answered
    nothing), instead of a ZeroDivisionError or TypeError after every system ran, which lost all
    the results."""
    results = {
        "gpufaas": {"n40": _point(50.0, 0), "n100": _point(None, 8), "n200": _point(40.0, 0)},
        "ray-haproxy": {"n40": _point(0.0, 8), "n100": _point(30.0, 0), "n200": _point(None, 8)},
    }
    verdict = density_bench.verdict(results)
    assert verdict["ratio_to_ray_haproxy"] == {"n40": None, "n100": None, "n200": None}
    assert verdict["n200_at_least_half_of_ray_haproxy_no_errors"] is True  # the peer answered nothing there
    results["gpufaas"]["n200"] = _point(None, 8)
    assert density_bench.verdict(results)["n200_at_least_half_of_ray_haproxy_no_errors"] is False


def test_the_verdict_keeps_three_digits() -> None:
    results = {"gpufaas": {"n200": _point(50.0, 0)}, "ray-haproxy": {"n200": _point(30.0, 0)}}
    verdict = density_bench.verdict(results)
    assert verdict["ratio_to_ray_haproxy"] == {"n200": 1.667}
    assert verdict["n200_at_least_half_of_ray_haproxy_no_errors"] is True
