"""bench.machine.write_results replaces a results file whole, or leaves the earlier one."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from bench import machine


def test_a_write_cut_short_leaves_the_earlier_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills halfway through the write: written in place, the earlier results were
    truncated to the new file's first half; now they stay, and no partial file is left beside."""
    out = tmp_path / "results" / "bench.json"
    machine.write_results(out, {"run": 1})
    earlier = out.read_text()
    write_text = Path.write_text

    def full_disk(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        machine.write_results(out, {"run": 2, "rows": list(range(100))})
    monkeypatch.undo()
    assert out.read_text() == earlier
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json"]
    machine.write_results(out, {"run": 3})
    assert json.loads(out.read_text()) == {"run": 3}
