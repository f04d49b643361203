"""Daemons' log files: `gpufaas logs` and a failed start's message show a log's last lines without
reading it whole; the local cluster keeps its logs to a bounded size."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufaas.cli import app
from gpufaas.logfiles import rotate, tail_lines

runner = CliRunner()


def _big_log(path: Path, size_bytes: int) -> None:
    """A log of about `size_bytes`, ending in lines 'last 0' .. 'last 2'."""
    line = b"x" * 1023 + b"\n"
    with path.open("wb") as file:
        for _ in range(size_bytes // len(line)):
            file.write(line)
        file.write(b"last 0\nlast 1\nlast 2\n")


def test_logs_shows_the_end_of_a_big_log_without_reading_it_whole(tmp_path: Path) -> None:
    """`gpufaas logs gateway -n 2` on a log of 64 MB (a daemon's log grows to gigabytes: it was
    read whole, decoded and split, several times its size in memory, to show two lines)."""
    (tmp_path / "logs").mkdir()
    _big_log(tmp_path / "logs" / "gateway.log", 64 * 1024 * 1024)
    tracemalloc.start()
    try:
        result = runner.invoke(app, ["logs", "gateway", "-n", "2", "--state-dir", str(tmp_path)])
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output
    assert result.stdout == "last 1\nlast 2\n"
    assert peak_bytes < 16 * 1024 * 1024, f"{peak_bytes} bytes in memory to show two lines"


@pytest.mark.parametrize(
    ("text", "lines", "expected"),
    [
        (b"", 3, []),
        (b"one", 3, ["one"]),
        (b"one\ntwo\n", 1, ["two"]),
        (b"one\ntwo", 5, ["one", "two"]),
        (b"one\r\ntwo\n\nthree\n", 3, ["two", "", "three"]),
        (b"bad \xff byte\nok\n", 2, ["bad \ufffd byte", "ok"]),
    ],
)
def test_tail_lines_are_the_files_last_lines(tmp_path: Path, text: bytes, lines: int, expected: list[str]) -> None:
    path = tmp_path / "a.log"
    path.write_bytes(text)
    assert tail_lines(path, lines) == expected


def test_tail_lines_across_chunks_and_within_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "a.log"
    path.write_text("".join(f"line {index} " + "y" * 1000 + "\n" for index in range(500)))
    assert tail_lines(path, 200) == [f"line {index} " + "y" * 1000 for index in range(300, 500)]
    path.write_bytes(b"z" * 100_000)  # one endless line: its end, read within the bound
    assert tail_lines(path, 3, max_bytes=10_000) == ["z" * 10_000]


def test_rotate_moves_a_log_over_its_bound_aside(tmp_path: Path) -> None:
    path = tmp_path / "node0.log"
    assert not rotate(path, 10)  # none yet
    path.write_bytes(b"a" * 10)
    assert not rotate(path, 10) and path.exists()
    path.write_bytes(b"b" * 11)
    assert rotate(path, 10)
    assert not path.exists() and (tmp_path / "node0.log.1").read_bytes() == b"b" * 11
