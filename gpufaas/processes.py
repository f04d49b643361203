"""Whether a process lives, and what runs below it: shared by the daemons (a node watching its
workers), the tooling, the benches and the tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one that exited but was not reaped is
    dead for every purpose here). A process of another user counts as alive.

    A killed process's main thread can turn zombie while its other threads are still exiting and
    still hold its descriptors (the last thread out unmaps the memory, then closes the files): a
    dying server's listening socket can accept connections for tens of milliseconds after its
    main thread shows `Z`. Such a process is alive until its last thread is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return len(os.listdir(f"/proc/{pid}/task")) > 1
    return True


def survivors(pids: Iterable[int], grace_s: float = 5.0) -> list[int]:
    """Those of `pids` still alive once each had up to `grace_s` to finish dying: a process that was
    killed, or told to stop, may take a moment (its last thread closes its descriptors at the end,
    see pid_alive), and is no survivor for that. Polls every 10 ms; returns at once when none lives."""
    left = [pid for pid in pids if pid_alive(pid)]
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [pid for pid in left if pid_alive(pid)]
    return left


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), so that what a server leaves behind can be found and
    stopped by PID (a worker's children; Ray's raylet and GCS start sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree(pid: int) -> list[int]:
    """`pid` and every process below it, from each thread's /proc children list (cheap: no walk of
    /proc); only `pid` where the kernel has no such lists. Reparented ones (a double fork) are
    not found: a control group holds those (gpu_manager.cgroups)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(child) for child in children.read_text().split())
    return found


def started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field): with its
    PID, it names the process, where the PID alone may come to name another once it exits. None
    where there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
