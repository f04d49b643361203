"""Mounts below a directory: finding them in /proc/self/mountinfo and detaching them (a node's
package homes are tmpfs mounts in its state directory, which must not outlive the node)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_MNT_DETACH = 0x2  # umount2: detach now, release once no process uses it (a dying worker may)


def mounted_under(parent: Path, mountinfo: str | None = None) -> list[Path]:
    """The mount points below `parent` (field 5 of /proc/self/mountinfo, or of `mountinfo`'s
    text), deepest first; [] where mountinfo cannot be read."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    prefix = str(parent.resolve()).rstrip("/") + "/"
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = fields[4].replace("\\040", " ")
            if point.startswith(prefix):
                points.append(Path(point))
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def detach(point: Path) -> bool:
    """Detach the mount at `point` (lazily); False if the kernel refuses (not root, not mounted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.umount2(os.fsencode(point), _MNT_DETACH) == 0)


def detach_under(parent: Path) -> int:
    """Detach every mount below `parent`, deepest first; returns how many were detached."""
    return sum(detach(point) for point in mounted_under(parent))
