"""bench.ledger_bench measures what it says: a ledger admitting every grant at a steady rate, swept
as the node's daemon sweeps it, holding what it must keep."""

from __future__ import annotations

from bench.ledger_bench import run


def test_every_grant_is_admitted_and_the_ledger_holds_about_its_keep_time_of_them() -> None:
    result = run(rate=200.0, seconds=90.0, claim_s=5.0)
    assert result["admitted"] == 18_000
    assert result["sweeps"] == 8  # (every 10 s of the 90)
    # Kept 60 s past a claim time 5 s ahead: 65 s of grants, plus at most the spread of claim times.
    assert 65 * 200 <= result["grants_held_at_end"] <= 71 * 200
    assert 0 < result["admit_p50_us"] <= result["admit_p99_us"]
    assert result["sweep_max_ms"] is not None and result["sweep_median_ms_after_60s"] is not None
