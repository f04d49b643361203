"""The robustness bound on a small run of bench/policy_robustness.py: off the tuned window, with
their defaults and no SLOs, every policy but the paper's baseline averages within 1.5x of lalb-o3
and no function starves (lalb, known not to when loaded, is an expected failure)."""

from __future__ import annotations

from typing import Any

import pytest

import scheduler
import simulator.engine
from bench.policy_robustness import BASELINE, Window, recording_waits, run_window, violations
from simulator.engine import simulate
from simulator.report import compare_policies
from simulator.workload import zipf_workload

POLICIES = [p for p in compare_policies() if p != "lalb-o3"]
# lalb (LALB to the letter, in arrival order) is lalb-o3's own ablation, not the baseline, and it
# does not meet the bound when loaded: 1.8-3.2x lalb-o3 over the bench's windows at 450 rpm.
KNOWN_OVER = {"lalb": "in-order LALB: 1.8-3.2x lalb-o3 at 450 rpm on 6 GB GPUs (policy_robustness.json)"}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    # Two mappings of a later window at the loaded point (450 rpm, 6 GB), where mqfq-sticky to the
    # letter averaged 4.3x lalb-o3 on the tuned window; a larger working set at the paper's point.
    return [
        run_window(Window(720, 35), 450, 6144, (None, 2), POLICIES),
        run_window(Window(700, 50), 325, 8192, (None,), POLICIES),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN_OVER[p], strict=True)) if p in KNOWN_OVER else p
        for p in POLICIES
        if p != BASELINE
    ],
)
def test_off_the_tuned_window_a_policy_stays_within_1_5x_of_lalb_o3_and_starves_nothing(
    runs: list[dict[str, Any]], policy: str
) -> None:
    others = [p for p in POLICIES if p != policy]
    assert violations(runs, exempt=others) == []


@pytest.mark.slow
def test_the_bound_is_not_vacuous_the_baseline_breaks_it_when_loaded(runs: list[dict[str, Any]]) -> None:
    found = violations(runs[:1], exempt=[p for p in POLICIES if p != BASELINE])
    assert any(line.startswith(f"{BASELINE} averages") for line in found)
    assert any(line.startswith(f"{BASELINE} starves") for line in found)


def test_the_waits_are_those_of_the_run_and_the_simulator_is_left_as_it_was() -> None:
    workload = zipf_workload(calls=40, models=4, zipf_exponent=1.1, memory_mb=1000, gap_s=0.0, seed=1)
    with recording_waits() as longest:
        result = simulate(workload, "lalb-o3")
    # 40 calls at 0 s on 12 GPUs: some wait, and the last to start still runs 1 s after it.
    assert set(longest) == {r.function for r in workload.requests}
    assert 0.0 < max(longest.values()) <= result.makespan_s - 1.0
    assert simulator.engine.make_policy is scheduler.make_policy
