"""bench.sim_speed refuses a run it cannot make with one usage line, not a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import sim_speed


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus", "0"], "--gpus: expected a whole number >= 1, got '0'"),
        (["--minutes", "-1"], "--minutes: expected a whole number >= 1, got '-1'"),
        (["--minutes", "1000"], "--minutes 1000: "),
    ],
)
def test_a_run_it_cannot_make_is_a_usage_error(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["sim_speed", *argv, "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as exited:
        sim_speed.main()
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
