"""Run a module as `python -m MODULE ARGS...` under cProfile, profiling only between SIGUSR1 (on) and
SIGUSR2 (off, and the statistics written): `python -m bench.profiled_main OUT MODULE ARGS...`;
with `--from-start` before MODULE, from the start until SIGUSR2.

A benchmark starts a daemon this way to profile its steady state only (not its start-up, its
warm-up or its shutdown). The signals' handlers run on the main thread, between bytecodes, which
is where the daemons' event loop runs, so that is the thread profiled. Times are the process's CPU
time (`time.process_time`), so a profile taken on a busy host is not inflated by waiting for a CPU.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main(argv: list[str]) -> None:
    from_start = "--from-start" in argv[1:2]  # profile from the start (SIGUSR2 still ends it)
    if from_start:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 2:
        sys.exit("usage: python -m bench.profiled_main OUT [--from-start] MODULE [ARGS...]")
    out, module, args = Path(argv[0]), argv[1], argv[2:]
    # CPU time, not wall time: on a shared host a wall-clock profile charges whichever function
    # was running when the process was descheduled.
    profile = cProfile.Profile(time.process_time)

    def start(signum: int, frame: FrameType | None) -> None:
        profile.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *args]
    if from_start:
        profile.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
