"""`gpufaas sim` reports the D its GPUs started at, under adaptive D too."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from gpufaas.cli import app


def _slots(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(
        app,
        ["sim", "--minutes", "1", "--rpm", "60", "--working-set", "3", "--gpus", "2", "--no-optimum", "--json", *args],
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    return {name: data[name] for name in ("slots", "adaptive_slots")}


def test_slots_above_the_adaptive_bound_report_the_bound_the_gpus_started_at() -> None:
    """--slots 3 under --adaptive-slots 2: the GPUs start at D = 2 (at most the bound), and the
    JSON said slots: 3, a D no GPU ever had."""
    assert _slots("--interference", "0.5", "--adaptive-slots", "2", "--slots", "3") == {"slots": 2, "adaptive_slots": 2}
    assert _slots("--interference", "0.5", "--adaptive-slots", "4", "--slots", "3") == {"slots": 3, "adaptive_slots": 4}
    assert _slots("--slots", "3") == {"slots": 3, "adaptive_slots": None}
