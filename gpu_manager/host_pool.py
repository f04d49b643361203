"""The node's host model pool (Torpor's late binding): weights read once per node into shared host
memory, mapped by any worker for any GPU of the node, kept while memory allows.

An entry is one blob (a package's large file: its weights), copied from the disk cache into a
file on a memory filesystem (tmpfs: /dev/shm by default), keyed by digest, so functions that share
weights share the copy. A worker taking a model is handed read-only descriptors on its entries
(gpufaas.weights maps them: no copy on cpu, a copy staged through pinned buffers on cuda; from
a tmpfs of huge pages that copy runs at nearly the device's pinned bandwidth, see `huge_pages`). A GPU eviction
drops only the GPU copy: the entry stays, and the next miss for that model on any GPU of the node
maps it again (a swap-in, no disk read).

Entries go least recently used first when a new one needs room, but never one a live worker maps
(`in_use`): unlinking it would not free its memory while mapped. The budget counts the bytes of
the entries; what a worker then copies privately (on cpu, a tensor it writes) is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import re
import shutil
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpufaas.blobs import BlobStore
from gpufaas.packages import Manifest, hex_of

log = logging.getLogger("gpufaas.gpu_manager.host_pool")

DEFAULT_POOL_PARENT = Path("/dev/shm")  # where the pool makes its directory unless --pool-dir says
POOL_MIN_FILE_BYTES = 1 << 20  # files this large go to the pool (weights); smaller ones are read from disk
DEFAULT_POOL_SHARE = 0.5  # of the memory filesystem's free space, when no budget is given
_COPY_CHUNK_BYTES = 64 << 20


@dataclass(slots=True)
class _Entry:
    path: Path
    size: int


class HostModelPool:
    """Pool entries within `budget_bytes`, in a directory of the pool's own that it makes in
    `parent` (a memory filesystem: /dev/shm by default) with an unguessable name, 0700: nobody
    else can plant or swap anything in it, even where `parent` is writable by everyone (sticky,
    as /dev/shm is). What earlier runs named `name` left there (theirs: this user's) goes, with a
    budget of 0 (no pool) too. `budget_bytes` None: DEFAULT_POOL_SHARE of what `parent`'s
    filesystem has free once that is gone. `in_use()` names the blobs live workers map now.
    Touched from the event loop only (copies run in threads)."""

    def __init__(
        self,
        parent: Path,
        budget_bytes: int | None,
        *,
        name: str = "gpufaas-pool",
        in_use: Callable[[], set[str]] = set,
        min_file_bytes: int = POOL_MIN_FILE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"a host pool budget must be >= 0 bytes, got {budget_bytes}")
        self.root = parent / name  # replaced by the pool's own directory below, where it has one
        # What a crashed run left holds memory until it goes: measured as free (the default
        # budget) only once gone, and removed even where this run keeps no pool.
        _clear_earlier_runs(parent, name, make_parent=budget_bytes != 0)
        if budget_bytes is None:
            budget_bytes = default_budget_bytes(parent)
        self.budget_bytes = budget_bytes
        self.min_file_bytes = min_file_bytes
        self._in_use = in_use
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._copying: dict[str, tuple[asyncio.Task[Path | None], bool]] = {}  # digest -> (its copy, may it evict)
        self.used_bytes = 0
        self.admitted = 0  # entries copied in since start (for the metrics)
        self.evicted = 0
        if budget_bytes:
            # Workers get descriptors, never the directory (mkdtemp: 0700, this user's, fresh).
            self.root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def weights(self, manifest: Manifest) -> list[tuple[str, str, int]]:
        """(path, blob digest, size) of a package's files that belong in the pool."""
        return [(f.path, f.digest, f.size) for f in manifest.large_files(self.min_file_bytes)]

    def holds(self, manifest: Manifest) -> bool:
        """Whether every pooled file of the package is in the pool (a package with none is not)."""
        wanted = self.weights(manifest)
        return bool(wanted) and all(digest in self._entries for _, digest, _ in wanted)

    def path(self, digest: str) -> Path | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries.move_to_end(digest)
        return entry.path

    def blobs(self) -> set[str]:
        return set(self._entries)

    async def admit(self, manifest: Manifest, blobs: BlobStore, *, evict: bool = True) -> dict[str, str] | None:
        """Bring a package's weights into the pool (copying from the disk cache those not there
        yet); returns package path -> pool file for each, or None if they do not all fit (then
        the worker reads them from disk). `evict=False`: only into free room (pre-staging, a guess,
        pushes out no weights a miss might want)."""
        wanted = self.weights(manifest)
        if not self.enabled or not wanted:
            return None
        # By digest: two paths of one blob (a package may hold the same file twice) share one copy.
        missing_bytes = sum({digest: size for _, digest, size in wanted if digest not in self._entries}.values())
        if missing_bytes > self.budget_bytes:
            return None
        placed: dict[str, str] = {}
        if not evict and missing_bytes > self.budget_bytes - self.used_bytes:
            return None
        for path, digest, size in wanted:
            pooled = await self._admit_blob(digest, size, blobs, keep={d for _, d, _ in wanted}, evict=evict)
            if pooled is None:
                return None
            placed[path] = str(pooled)
        return placed

    async def _admit_blob(
        self, digest: str, size: int, blobs: BlobStore, keep: set[str], *, evict: bool
    ) -> Path | None:
        existing = self.path(digest)
        if existing is not None:
            return existing
        copying = self._copying.get(digest)
        if copying is not None:
            task, evicts = copying
            pooled = await asyncio.shield(task)
            if pooled is not None or evicts or not evict:
                return pooled
            # The copy joined was a pre-staging's, which found no free room: this one may make some.
            return await self._admit_blob(digest, size, blobs, keep, evict=evict)
        task = asyncio.create_task(self._copy_in(digest, size, blobs, keep, evict=evict), name=f"pool {digest[:19]}")
        self._copying[digest] = (task, evict)
        task.add_done_callback(lambda _: self._copying.pop(digest, None))
        return await asyncio.shield(task)

    async def _copy_in(self, digest: str, size: int, blobs: BlobStore, keep: set[str], *, evict: bool) -> Path | None:
        # Checked here, when the room is reserved, not only in `admit`: two pre-stagings that
        # each fit the free room alone must not, together, push out what a miss might want.
        if not (self._make_room(size, keep) if evict else self.used_bytes + size <= self.budget_bytes):
            return None
        source = blobs.path(digest)
        if source is None:
            return None
        target = self.root / hex_of(digest)
        self.used_bytes += size  # reserved now: concurrent admissions see it
        try:
            await asyncio.to_thread(_copy, source, target, size)
        except BaseException as exc:  # cancelled too: the reservation goes with the copy
            self.used_bytes -= size
            target.unlink(missing_ok=True)
            if not isinstance(exc, OSError):
                raise
            log.warning("could not copy blob %s into the host pool: %s", digest, exc)
            return None
        self._entries[digest] = _Entry(target, size)
        self.admitted += 1
        return target

    def _make_room(self, size: int, keep: set[str]) -> bool:
        """Evict least recently used entries no worker maps until `size` more bytes fit."""
        if self.used_bytes + size <= self.budget_bytes:
            return True
        busy = self._in_use() | keep
        freeable = sum(entry.size for digest, entry in self._entries.items() if digest not in busy)
        if self.used_bytes - freeable + size > self.budget_bytes:
            return False  # it would not fit with every idle entry gone: none goes for nothing
        for digest in list(self._entries):
            if self.used_bytes + size <= self.budget_bytes:
                break
            if digest not in busy:
                self.drop(digest)
        return self.used_bytes + size <= self.budget_bytes

    def drop(self, digest: str) -> bool:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return False
        entry.path.unlink(missing_ok=True)
        self.used_bytes -= entry.size
        self.evicted += 1
        return True

    def retain(self, wanted: Iterable[str]) -> None:
        """Drop the entries of blobs no longer wanted (their packages left the disk cache)."""
        keep = set(wanted) | self._in_use()
        for digest in [d for d in self._entries if d not in keep]:
            self.drop(digest)

    def close(self) -> None:
        for digest in list(self._entries):
            self.drop(digest)
        if self.enabled:
            shutil.rmtree(self.root, ignore_errors=True)


def _copy(source: Path, target: Path, size: int) -> None:
    """Copy a blob into the pool: read around the page cache (O_DIRECT, into one reused aligned
    buffer) where the filesystem allows, else in the kernel (sendfile), so that the pool's copy is
    the only one the copy puts in memory."""
    tmp = target.with_suffix(".tmp")
    # A new file, never one found there (the directory is the pool's own: defence in depth).
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as writer:
            try:
                reader = os.open(source, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                reader = -1
            if reader >= 0:
                try:
                    _copy_direct(reader, writer.fileno(), size, source)
                finally:
                    os.close(reader)
            else:
                _copy_sendfile(source, writer.fileno(), size)
        # Readable by anyone who can reach it: only the node can pass the pool's directory (0700);
        # a container gets just its own files bind-mounted, a forked worker a descriptor.
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
    except BaseException:
        # A copy cut short (a full tmpfs, a source shorter than its size) leaves nothing: its part
        # would hold memory the pool does not count, and block the blob's next copy (O_EXCL).
        tmp.unlink(missing_ok=True)
        raise


def _copy_direct(reader: int, writer: int, size: int, source: Path) -> None:
    view = memoryview(mmap.mmap(-1, _COPY_CHUNK_BYTES))  # page-aligned, as O_DIRECT reads need
    offset = 0
    while offset < size:
        n = os.preadv(reader, [view], offset)
        if n == 0:
            raise OSError(f"{source} ended at byte {offset} of {size}")
        _write_all(writer, view[:n])
        offset += n


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _copy_sendfile(source: Path, writer: int, size: int) -> None:
    with source.open("rb") as reader:
        offset = 0
        while offset < size:
            n = os.sendfile(writer, reader.fileno(), offset, min(_COPY_CHUNK_BYTES, size - offset))
            if n == 0:
                raise OSError(f"{source} ended at byte {offset} of {size}")
            offset += n


def huge_pages(path: Path, mountinfo: str | None = None, shmem_enabled: str | None = None) -> bool | None:
    """Whether the files `path` makes land on a tmpfs of huge pages: True on one mounted
    `huge=always` (or wherever the kernel forces them); False on one of 4 KiB pages (no `huge=`,
    `huge=never` or `huge=advise`, or the kernel denies them); None where it cannot say (not a
    tmpfs, `huge=within_size`, which depends on how and on which kernel a file is written, or
    nothing to read). `mountinfo`: /proc/self/mountinfo's text, `shmem_enabled`:
    /sys/kernel/mm/transparent_hugepage/shmem_enabled's (each read when not given).

    Why it matters: a cuda load reads the pool's copy through page faults, one per page; on an
    H200, staging 1 GiB from huge pages moved 47-50 GB/s against 28-31 from 4 KiB pages
    (`bench/pool_copy_probe.py`)."""
    if mountinfo is None:
        try:
            mountinfo = os.fsdecode(Path("/proc/self/mountinfo").read_bytes())  # a mount point need not be UTF-8
        except OSError:
            return None
    if shmem_enabled is None:
        try:
            shmem_enabled = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
        except OSError:
            shmem_enabled = ""
    real = os.path.realpath(path)
    best: tuple[int, bool, bool | None] = (-1, False, None)  # (mount point's length, a tmpfs, its answer)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 6:
            continue
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        # `<`: of mounts stacked on one point the last listed, the one on top, is the one in use.
        if not inside or len(mount_point) < best[0]:
            continue
        fs_type, _, super_options = line.split(" - ", 1)[1].split(" ")[:3]
        tmpfs = fs_type == "tmpfs"
        best = (len(mount_point), tmpfs, _tmpfs_huge(super_options.split(",")) if tmpfs else None)
    _, tmpfs, answer = best
    if tmpfs and "[deny]" in shmem_enabled:  # the kernel's word goes over any tmpfs's option
        return False
    if tmpfs and "[force]" in shmem_enabled:
        return True
    return answer


def _tmpfs_huge(options: list[str]) -> bool | None:
    huge = next((o.removeprefix("huge=") for o in options if o.startswith("huge=")), "never")
    return {"always": True, "never": False, "advise": False}.get(huge)


def _check_parent(parent: Path) -> None:
    """The parent of the pool's directory must not let another user rename or replace what the
    pool makes in it: owned by this user or root, and writable by nobody else unless sticky."""
    status = os.lstat(parent)
    if stat.S_ISLNK(status.st_mode) or not stat.S_ISDIR(status.st_mode):
        raise OSError(f"the host pool's directory {parent} is not a directory (a link?): choose another --pool-dir")
    shared = status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if status.st_uid not in (0, os.geteuid()) or (shared and not status.st_mode & stat.S_ISVTX):
        raise OSError(
            f"{parent} lets other users replace the host pool's files (owner {status.st_uid}, mode "
            f"{stat.S_IMODE(status.st_mode):o}): choose a --pool-dir of this user's, or a sticky one like /dev/shm"
        )


def _clear_earlier_runs(parent: Path, name: str, *, make_parent: bool) -> None:
    """Remove what earlier runs named `name` left in `parent`, checked first (`_check_parent`);
    `make_parent`: a pool will be made there (`parent` is made if missing, and a parent refused is
    an OSError), else a parent missing or refused is left alone."""
    if make_parent:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_parent(parent)
    else:
        try:
            _check_parent(parent)
        except OSError:  # none there, or not this node's to touch: no pool is made in it either
            return
    _remove_stale(parent, name)


def _remove_stale(parent: Path, name: str) -> None:
    """The pool directories earlier runs of this node left (crashed): this user's own only."""
    for path in parent.glob(f"{name}-*"):
        with contextlib.suppress(OSError):
            status = os.lstat(path)
            if stat.S_ISDIR(status.st_mode) and status.st_uid == os.geteuid():
                shutil.rmtree(path, ignore_errors=True)


def default_budget_bytes(root: Path, share: float = DEFAULT_POOL_SHARE) -> int:
    """A share of what the memory filesystem under `root` has free (0 if it cannot be told)."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stats = os.statvfs(probe)
    except OSError:
        return 0
    return int(stats.f_bavail * stats.f_frsize * share)
