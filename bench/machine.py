"""What every benchmark shares: what it records about the run (when, which commit, on what machine,
how busy), its --out option, and how it writes its results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpufaas import native
from gpufaas.dev.local_cluster import write_atomically

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10, cwd=REPO
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def load_average() -> float | None:
    """The 1-minute load average (a figure near the CPU count flags a noisy run)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not available on this platform
        return None


def cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def compiled_decision_core() -> bool:
    """Whether a process started now would load gpufaas.native's builds."""
    return os.environ.get(native.ENV_SWITCH, "1") != "0" and native.current_build() is not None


def run_metadata(**extra: Any) -> dict[str, Any]:
    """Date, commit, Python, platform, CPUs and load average, whether the processes started from
    here run the decision core compiled (gpufaas.native: built, current and not switched off), plus
    `extra`."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "compiled_decision_core": compiled_decision_core(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "loadavg_1min": load_average(),
        **extra,
    }


def results_parser(doc: str | None, out_name: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its description (the first paragraph of `doc`) and --out, where
    its JSON goes (bench/results/`out_name` by default); the caller adds its own options."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0] or None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results" / out_name)
    return parser


def print_results(document: object, out: Path | None) -> None:
    """Print `document` as JSON (a benchmark whose output is its JSON), and write it to `out` too."""
    text = json.dumps(document, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def write_results(out: Path, document: object, summary: Iterable[str] = (), *, indent: int = 2) -> None:
    """Write `document` as JSON to `out` (its folder made first), then print the lines of
    `summary` and where the results went. `summary` is read after the file is written, so a
    failure while printing it loses nothing. The file is replaced whole (written beside it, then
    renamed over it): a write cut short (a full disk, a kill) leaves the earlier results there,
    where writing in place left them truncated."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(document, indent=indent) + "\n")
    for line in summary:
        print(line)
    print(f"wrote {out}")
