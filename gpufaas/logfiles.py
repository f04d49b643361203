"""Daemons' log files: their last lines read without reading them whole (`gpufaas logs`, a failed
start's message), and kept to a bounded size (the local cluster appends to them for as long as its
state directory lives)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TAIL_CHUNK_BYTES = 64 * 1024
# A daemon's log over this size when it (re)starts is moved to NAME.log.1 (`rotate`): appended to
# across every start and restart, it would grow for as long as its directory lives.
LOG_ROTATE_BYTES = 64 * 1024 * 1024
# At most this much of a file's end is read for its last lines: a file of one endless line (no
# newline in gigabytes) is shown by its end, not read whole.
TAIL_MAX_BYTES = 16 * 1024 * 1024


def tail_lines(path: Path, lines: int, *, max_bytes: int = TAIL_MAX_BYTES) -> list[str]:
    """The last `lines` lines of the file at `path` (UTF-8, bad bytes replaced; split as
    str.splitlines splits), read backwards from its end in chunks: memory in proportion to what is
    shown, never to the file, and at most `max_bytes` of it. Raises OSError as open() does."""
    if lines <= 0:
        return []
    with path.open("rb") as file:
        end = file.seek(0, os.SEEK_END)
        position, chunks, newlines = end, [], 0
        # One newline more than the lines asked for: the text before it is a partial line.
        while position > 0 and newlines <= lines and end - position < max_bytes:
            size = min(TAIL_CHUNK_BYTES, position, max_bytes - (end - position))
            position -= size
            file.seek(position)
            chunk = file.read(size)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
    data = b"".join(reversed(chunks))
    found = data.decode(errors="replace").splitlines()
    if position > 0 and len(found) > lines:  # the first is cut short (it began before what was read)
        found = found[1:]
    return found[-lines:]


def rotate(path: Path, max_bytes: int) -> bool:
    """Move the file at `path` to `path.1` (replacing an older one) if it holds more than
    `max_bytes`, so that a log appended to across restarts keeps at most about twice that;
    whether it moved it. A file that is not there, or cannot be moved, is left as it is."""
    with contextlib.suppress(OSError):
        if path.stat().st_size > max_bytes:
            path.replace(path.with_name(path.name + ".1"))
            return True
    return False
