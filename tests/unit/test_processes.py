"""pid_alive: a zombie is dead, but not while its other threads still run (and hold its sockets)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufaas.processes import pid_alive, survivors

# The child: a thread that runs until `release` exists, and a main thread that ends itself alone
# (the raw exit syscall, not exit_group), so the process's main thread is a zombie while the other
# thread lives: what a SIGKILLed multi-threaded server looks like while its last thread exits.
CHILD = """
import ctypes, os, sys, threading, time
release = sys.argv[1]
def wait():
    while not os.path.exists(release):
        time.sleep(0.01)
threading.Thread(target=wait).start()
ctypes.CDLL(None, use_errno=True).syscall(60, 0)  # SYS_exit on x86_64: this thread only
"""


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.skipif(sys.platform != "linux" or not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_zombie_main_thread_with_a_live_thread_is_alive_until_the_last_thread_ends(tmp_path: Path) -> None:
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the child calls SYS_exit by its x86_64 number")
    release = tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(release)])
    try:
        wait_for(lambda: state(child.pid) == "Z")
        assert len(list(Path(f"/proc/{child.pid}/task").iterdir())) == 2
        assert pid_alive(child.pid)  # its main thread is a zombie, its other thread is not
        release.touch()
        wait_for(lambda: not pid_alive(child.pid))
        assert child.poll() is not None or state(child.pid) == "Z"  # gone, or a zombie not yet reaped
    finally:
        release.touch()
        child.kill()
        child.wait(timeout=10)


def test_a_process_that_is_gone_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())


def test_survivors_waits_for_the_dying_and_names_only_those_that_outlive_the_grace() -> None:
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    lasting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = time.monotonic()
        left = survivors([quick.pid, lasting.pid], grace_s=3.0)
        assert left == [lasting.pid]  # the one that ended within the grace is no survivor
        assert time.monotonic() - started >= 3.0  # it waited the grace for the other
        quick.wait(timeout=10)
        assert survivors([quick.pid], grace_s=60.0) == []  # none alive: at once
    finally:
        lasting.kill()
        lasting.wait(timeout=10)
