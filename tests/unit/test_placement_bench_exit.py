"""bench.placement_bench exits non-zero where the accounting check failed, its JSON written all the same."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import placement_bench

UNACCOUNTED = {
    "dones_sent_by_nodes": 10,
    "dones_accounted_by_scheduler": 9,
    "placements_received_by_gateways": 10,
    "placements_sent_by_scheduler": 10,
    "calls_running_after": 1,
    "calls_queued_after": 0,
    "every_done_accounted": False,
}


def _main_with(
    accounting: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, dict[str, Any]]:
    """main, its cluster's run replaced by figures with `accounting`: its status and its JSON."""

    def run(args: argparse.Namespace, mix: placement_bench.Mix, layout: Any, directory: Path) -> dict[str, Any]:
        return {"placements": 10, "accounting": accounting}

    monkeypatch.setattr(placement_bench, "run", run)
    out = tmp_path / "placement.json"
    status = placement_bench.main(["--mix", "zipf", "--functions", "4", "--gpus", "20", "--json", "--out", str(out)])
    return status, json.loads(out.read_text())


def test_a_failed_accounting_check_exits_non_zero_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check's failure was in the JSON only, and the benchmark exited 0: a script running it
    took the run for a good one."""
    status, document = _main_with(UNACCOUNTED, tmp_path, monkeypatch)
    assert status == 1
    assert document["accounting"]["every_done_accounted"] is False
    err = capsys.readouterr().err
    assert "the accounting check failed" in err and "dones_accounted_by_scheduler 9" in err


def test_an_unanswered_check_says_so_and_a_good_one_exits_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unanswered = {"every_done_accounted": False, "unanswered": "TimeoutError()"}
    assert placement_bench.accounting_failure(unanswered) == (
        "the accounting check failed: the scheduler did not answer (TimeoutError())"
    )
    status, _ = _main_with({**UNACCOUNTED, "every_done_accounted": True}, tmp_path, monkeypatch)
    assert status == 0
