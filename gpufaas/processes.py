"""Whether a process lives, and what runs below it: shared by the daemons (a node watching its
workers), the tooling, the benches and the tests."""

from __future__ import annotations

import contextlib
import os
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
