"""A content-addressed blob store on disk: blobs named by their sha256, written resumably and
verified while they stream in, never held whole in memory.

Layout under `root` (one store per daemon; nobody else writes there):

    root/sha256/<hex>     a complete, verified blob (read-only, 0444): appears whole or not at all
    root/partial/<hex>    a blob being written; kept when a transfer breaks, so it resumes

A writer hashes what it writes as it goes; `commit` checks size and digest, flushes the bytes to
disk and renames the partial into place (CorruptBlob, and the partial discarded, on a mismatch). A broken transfer
keeps its partial, and the hash state of what was written stays in memory, so the next writer of
that blob in this process resumes where it stopped without reading it again (after a restart
the partial is read back once). One writer per blob at a time (BlobBusy for a second).

`pump` is the fast path for large blobs: one thread reads into buffers and writes them (around
the page cache: O_DIRECT) while another hashes them (both drop the GIL), so a blob moves at about
the speed of the slower of the two rather than of their sum.

Both directories are private to the daemon (0700): a function reaches a blob only through its
own package directory, into which `link_into` hard-links it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpufaas.packages import EMPTY_DIGEST, InvalidPackage, hex_of
from gpufaas.processes import pid_alive

PUMP_BUFFER_BYTES = 4 << 20
_INGEST_PREFIX = ".ingest-"  # then the writing process's PID: a dead one's are discarded
PUMP_DEPTH = 4  # buffers in flight between the reading and the hashing thread
# A large blob's bytes are written around the page cache (O_DIRECT, in whole aligned buffers):
# a node or gateway receiving GBs of weights would otherwise fill its memory with a second copy of
# them that nobody reads soon (the host pool holds the one that matters), and page-cache pages the
# machine has to find (on a VM, have backed) cost more than the write. Where the filesystem cannot
# (tmpfs), the page cache it is.
DIRECT_ALIGN = 4096


class CorruptBlob(InvalidPackage):
    """Bytes that do not hash to the digest they were sent as, or more or fewer than declared."""


class BlobBusy(InvalidPackage):
    """Another writer holds this blob now: retry once it is done."""


class BlobStore:
    """The blobs under `root` (see the module docstring). Thread-safe: writers run in threads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._complete = root / "sha256"
        self._partial = root / "partial"
        for directory in (root, self._complete, self._partial):
            directory.mkdir(parents=True, exist_ok=True)
            os.chmod(directory, 0o700)
        self._lock = threading.Lock()
        self._writing: set[str] = set()
        # Hash state of partials this process wrote and left: digest -> (bytes hashed, hasher).
        self._resume: dict[str, tuple[int, Any]] = {}

    # --- reading ------------------------------------------------------------------------------
    def path(self, digest: str) -> Path | None:
        """The file of a complete blob, or None."""
        path = self._complete / hex_of(digest)
        return path if path.is_file() else None

    def has(self, digest: str) -> bool:
        return self.path(digest) is not None

    def size(self, digest: str) -> int | None:
        path = self.path(digest)
        if path is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            return path.stat().st_size
        return None

    def partial_size(self, digest: str) -> int:
        """How many bytes of an unfinished blob are here (0 if none)."""
        try:
            return (self._partial / hex_of(digest)).stat().st_size
        except FileNotFoundError:
            return 0

    def busy(self, digest: str) -> bool:
        """Whether a writer holds blob `digest` now (another upload or fetch of it is under way)."""
        with self._lock:
            return digest in self._writing

    def digests(self) -> Iterator[str]:
        """Every complete blob."""
        for path in self._complete.iterdir():
            if len(path.name) == 64:
                yield f"sha256:{path.name}"

    def used_bytes(self) -> int:
        total = 0
        for path in self._complete.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def partial_bytes(self) -> int:
        """The bytes of unfinished blobs (broken transfers kept for a resume, transfers under
        way): disk they take as much as complete ones."""
        total = 0
        for path in self._partial.iterdir():
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    # --- writing ------------------------------------------------------------------------------
    def writer(self, digest: str, size: int) -> BlobWriter:
        """A writer of blob `digest` of `size` bytes, positioned after what a broken earlier
        transfer left (`offset`). BlobBusy if another writer holds it; use it as a context
        manager (leaving without `commit` keeps the partial for a later resume)."""
        hex_digest = hex_of(digest)
        if size < 0:
            raise CorruptBlob(f"blob {digest}: a size of {size} bytes is not one")
        with self._lock:
            if digest in self._writing:
                raise BlobBusy(f"blob {digest} is being written by another transfer; retry when it ends")
            self._writing.add(digest)
        try:
            return BlobWriter(self, digest, size, self._partial / hex_digest, self._resume.pop(digest, None))
        except BaseException:
            self._release(digest)
            raise

    def put(self, data: bytes | bytearray | memoryview, digest: str | None = None) -> str:
        """Store small bytes whole (or verify them against `digest`); returns the digest."""
        if digest is None:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has(digest):
            return digest
        with self.writer(digest, len(data)) as writer:
            if writer.offset:
                writer.restart()
            writer.write(data)
            writer.commit()
        return digest

    def put_file(self, source: Path, digest: str) -> Path:
        """Store a local file's bytes as `digest` (verified); returns the blob's path."""
        existing = self.path(digest)
        if existing is not None:
            return existing
        size = source.stat().st_size
        with source.open("rb", buffering=0) as reader, self.writer(digest, size) as writer:
            if writer.offset:
                reader.seek(writer.offset)
            writer.pump(reader.readinto, size - writer.offset)
            return writer.commit()

    def ingest(self, read_into: Callable[[memoryview], int | None], size: int) -> str:
        """Store `size` bytes read with `read_into` whose digest is not known beforehand (an
        archive's member); returns their digest. CorruptBlob if fewer arrive."""
        temporary = self._partial / f"{_INGEST_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            hasher = hashlib.sha256()
            buffer = memoryview(bytearray(min(max(size, 1), PUMP_BUFFER_BYTES)))
            left = size
            while left:
                got = _fill(read_into, buffer[: min(left, len(buffer))])
                if not got:
                    raise CorruptBlob(f"{size - left} of {size} bytes arrived")
                hasher.update(buffer[:got])
                view = buffer[:got]
                while view:
                    view = view[os.write(fd, view) :]
                left -= got
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        os.fsync(fd)  # on disk before it is named whole (see `BlobWriter.commit`)
        os.close(fd)
        digest = "sha256:" + hasher.hexdigest()
        if self.has(digest):
            temporary.unlink()
        else:
            self._finished(digest, temporary)
        return digest

    def remove(self, digest: str) -> bool:
        """Delete a complete blob (and any partial of it); whether it was here."""
        hex_digest = hex_of(digest)
        with contextlib.suppress(FileNotFoundError):
            (self._partial / hex_digest).unlink()
        try:
            (self._complete / hex_digest).unlink()
        except FileNotFoundError:
            return False
        return True

    def discard_partials(self, keep: Callable[[str], bool] = lambda _: False) -> list[str]:
        """Delete unfinished blobs no writer holds (but those `keep` names); the digests deleted."""
        removed = []
        for path in self._partial.iterdir():
            if path.name.startswith(_INGEST_PREFIX):
                # An ingest's: its writer removes it on failure, unless its process died first.
                pid = path.name.removeprefix(_INGEST_PREFIX).partition("-")[0]
                if not (pid.isdecimal() and pid_alive(int(pid))):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                continue
            digest = f"sha256:{path.name}"
            with self._lock:  # held while it goes: no writer may open it meanwhile
                if digest in self._writing or keep(digest):
                    continue
                self._resume.pop(digest, None)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(digest)
        return removed

    def link_into(self, digest: str, target: Path) -> None:
        """Make `target` a hard link to the blob (a copy where the filesystem cannot link)."""
        source = self.path(digest)
        if source is None:
            raise FileNotFoundError(f"blob {digest} is not in the store")
        try:
            os.link(source, target)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            shutil.copyfile(source, target)

    # --- for BlobWriter -----------------------------------------------------------------------
    def _finished(self, digest: str, partial: Path) -> Path:
        target = self._complete / hex_of(digest)
        os.chmod(partial, 0o444)
        os.replace(partial, target)  # atomic: the blob appears whole
        _sync_directory(self._complete)  # and the rename itself survives a power loss
        return target

    def _release(self, digest: str, resume: tuple[int, Any] | None = None) -> None:
        with self._lock:
            self._writing.discard(digest)
            if resume is not None:
                self._resume[digest] = resume


class BlobWriter:
    """Writes one blob (from `BlobStore.writer`): `write` or `pump` its bytes from `offset` on,
    then `commit`. Not shared between threads (except by `pump`, which runs its own)."""

    def __init__(self, store: BlobStore, digest: str, size: int, partial: Path, resume: tuple[int, Any] | None) -> None:
        self.store = store
        self.digest = digest
        self.size = size
        self._partial = partial
        self._fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o600)
        self._done = False
        # A write that failed half way (disk full): what the partial holds is no longer what was
        # hashed, so a later writer reads it back rather than resume from the hash kept here.
        self._broken = False
        try:
            on_disk = os.fstat(self._fd).st_size
            if on_disk > size:  # not this blob's prefix: start over
                os.ftruncate(self._fd, 0)
                on_disk = 0
            if resume is not None and resume[0] == on_disk:
                self.offset, self._hasher = resume
            else:
                self.offset, self._hasher = on_disk, _hash_prefix(partial, on_disk)
            os.lseek(self._fd, self.offset, os.SEEK_SET)
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def restart(self) -> None:
        """Forget what an earlier transfer left: write from byte 0."""
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        self.offset, self._hasher = 0, hashlib.sha256()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes (CorruptBlob past the declared size: the partial is discarded)."""
        if self.offset + len(data) > self.size:
            self._fail(f"blob {self.digest}: more bytes than its declared {self.size}")
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            self._broken = True
            raise
        self._hasher.update(data)  # once written: the hash is of what the partial holds
        self.offset += len(data)

    def write_many(self, chunks: list[bytes]) -> None:
        """Append several chunks with one system call (what an HTTP server hands over)."""
        total = sum(len(chunk) for chunk in chunks)
        if self.offset + total > self.size:
            self._fail(f"blob {self.digest}: more bytes than its declared {self.size}")
        try:
            written = os.writev(self._fd, chunks)
            if written != total:  # a short write (rare): the rest one by one
                rest = memoryview(b"".join(chunks))[written:]
                while rest:
                    rest = rest[os.write(self._fd, rest) :]
        except OSError:
            self._broken = True
            raise
        for chunk in chunks:
            self._hasher.update(chunk)
        self.offset += total

    def pump(self, read_into: Callable[[memoryview], int | None], nbytes: int) -> int:
        """Read up to `nbytes` with `read_into(buffer) -> n` (0 or None: the source ended) and
        append them: this thread reads and writes, a second one hashes, buffers in flight
        between them. Returns how many bytes were appended (fewer than `nbytes` if the source
        ended early: the partial keeps them). Exceptions of `read_into` propagate after what
        was read is kept."""
        if self.offset + nbytes > self.size:
            self._fail(f"blob {self.digest}: more bytes than its declared {self.size}")
        if nbytes <= PUMP_BUFFER_BYTES:  # not worth a thread
            small = memoryview(bytearray(max(1, nbytes)))
            got, error = _fill_keeping(read_into, small[:nbytes])
            self.write(small[:got])
            if error is not None:
                raise error
            return got
        pipe = _HashPipe(self._hasher.update, f"hash {self.digest[:19]}")
        direct = _open_direct(self._partial) if self.offset % DIRECT_ALIGN == 0 else -1
        appended = 0
        try:
            while appended < nbytes:
                buffer = pipe.free.get()
                want = min(PUMP_BUFFER_BYTES, nbytes - appended)
                got, error = _fill_keeping(read_into, memoryview(buffer)[:want])
                if got:
                    # Whole aligned buffers go around the page cache (see DIRECT_ALIGN); a last,
                    # shorter one through it.
                    aligned = direct >= 0 and got % DIRECT_ALIGN == 0 and self.offset % DIRECT_ALIGN == 0
                    try:
                        _pwrite_all(direct if aligned else self._fd, memoryview(buffer)[:got], self.offset)
                    except OSError as exc:
                        if not aligned or exc.errno != errno.EINVAL:
                            self._broken = True
                            raise
                        # A device whose blocks are larger than DIRECT_ALIGN: the page cache, then.
                        os.close(direct)
                        direct = -1
                        _pwrite_all(self._fd, memoryview(buffer)[:got], self.offset)
                    appended += got
                    self.offset += got
                    pipe.hash(buffer, got)
                else:
                    pipe.free.put(buffer)
                if error is not None:
                    raise error  # (what it read before it failed is written and hashed: kept)
                if got < want:
                    break
        finally:
            pipe.close()
            if direct >= 0:
                os.close(direct)
            os.lseek(self._fd, self.offset, os.SEEK_SET)  # `write` goes on from here
        return appended

    def commit(self) -> Path:
        """Check size and digest and put the blob in place; its path. CorruptBlob otherwise
        (the partial is discarded: its bytes are wrong)."""
        if self.offset != self.size:
            raise CorruptBlob(f"blob {self.digest}: {self.offset} of its {self.size} bytes arrived")
        actual = "sha256:" + self._hasher.hexdigest()
        if actual != self.digest:
            self._fail(f"blob {self.digest}: its bytes hash to {actual}: corrupted on the way, or not that blob")
        # On disk before its name says it is whole: a complete blob is never verified again, so
        # one renamed before its bytes reached the disk would, after a power loss, be served (and
        # loaded as weights) short or zeroed for good. O_DIRECT writes still need the flush.
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        self._done = True
        try:
            return self.store._finished(self.digest, self._partial)
        finally:
            self.store._release(self.digest)  # whatever happened: the blob is not held any more

    def close(self) -> None:
        """Leave without committing: the partial stays for a resume (unless it was discarded)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not self._done:
            self._done = True
            self.store._release(self.digest, None if self._broken else (self.offset, self._hasher))

    def _fail(self, message: str) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            self._partial.unlink()
        self._done = True
        self.store._release(self.digest)
        raise CorruptBlob(message)


class _HashPipe:
    """The hashing thread of a large `BlobWriter.pump`, and the buffers that go around between
    it and the pump: PUMP_DEPTH page-aligned buffers (anonymous mappings, reused: what O_DIRECT
    writes need). The pump takes a buffer from `free`, fills and writes it, and passes it to
    `hash`; the thread hashes it and puts it back in `free`. Lifecycle: made by the pump, which
    `close`s it (waiting for the hashing to end) whatever happens."""

    def __init__(self, update: Callable[[memoryview], None], name: str) -> None:
        self.free: queue.Queue[mmap.mmap] = queue.Queue()
        for _ in range(PUMP_DEPTH):
            self.free.put(mmap.mmap(-1, PUMP_BUFFER_BYTES))
        self._filled: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._update = update
        self._thread = threading.Thread(target=self._hash_loop, name=name, daemon=True)
        self._thread.start()

    def hash(self, buffer: mmap.mmap, length: int) -> None:
        """Hash the first `length` bytes of `buffer` (written already), then free it."""
        self._filled.put((buffer, length))

    def close(self) -> None:
        """Hash what was passed, and end the thread."""
        self._filled.put(None)
        self._thread.join()

    def _hash_loop(self) -> None:
        while (item := self._filled.get()) is not None:
            buffer, length = item
            self._update(memoryview(buffer)[:length])
            self.free.put(buffer)


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_direct(path: Path) -> int:
    """A second descriptor on `path` that writes around the page cache (O_DIRECT), or -1 where
    the filesystem will not (tmpfs)."""
    try:
        return os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return -1


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _fill(read_into: Callable[[memoryview], int | None], buffer: memoryview) -> int:
    """Read until `buffer` is full or the source ends; how many bytes."""
    got, error = _fill_keeping(read_into, buffer)
    if error is not None:
        raise error
    return got


def _fill_keeping(read_into: Callable[[memoryview], int | None], buffer: memoryview) -> tuple[int, Exception | None]:
    """`_fill`, and what `read_into` raised (None: nothing) once the bytes before it are counted:
    the caller keeps those, then raises it."""
    got = 0
    while got < len(buffer):
        try:
            n = read_into(buffer[got:])
        except Exception as exc:
            return got, exc
        if not n:
            break
        got += n
    return got, None


def _hash_prefix(path: Path, nbytes: int) -> Any:
    hasher = hashlib.sha256()
    if nbytes:
        with path.open("rb") as source, mmap.mmap(source.fileno(), nbytes, access=mmap.ACCESS_READ) as mapped:
            hasher.update(mapped)
    return hasher


def empty_blob(store: BlobStore) -> None:
    """Every store holds the empty blob (packages often carry empty files, e.g. __init__.py)."""
    if not store.has(EMPTY_DIGEST):
        store.put(b"", EMPTY_DIGEST)
