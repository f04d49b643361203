"""The blob store: verified, resumable, atomic writes; the pumped fast path; links into packages."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import threading
from pathlib import Path

import pytest

from gpufaas.blobs import PUMP_BUFFER_BYTES, BlobBusy, BlobStore, CorruptBlob
from gpufaas.packages import sha256_digest


def test_put_path_and_link(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"hello")
    assert digest == sha256_digest(b"hello")
    path = store.path(digest)
    assert path is not None and path.read_bytes() == b"hello"
    assert oct(path.stat().st_mode & 0o777) == "0o444"
    assert oct((tmp_path / "blobs").stat().st_mode & 0o777) == "0o700"
    store.link_into(digest, tmp_path / "copy")
    assert (tmp_path / "copy").stat().st_ino == path.stat().st_ino
    assert list(store.digests()) == [digest] and store.used_bytes() == 5
    assert store.remove(digest) and not store.has(digest) and not store.remove(digest)


def test_wrong_bytes_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    digest = sha256_digest(b"right")
    with store.writer(digest, 5) as writer:
        writer.write(b"wrong")
        with pytest.raises(CorruptBlob, match="hash to"):
            writer.commit()
    assert not store.has(digest) and store.partial_size(digest) == 0
    with store.writer(digest, 5) as writer, pytest.raises(CorruptBlob, match="more bytes"):
        writer.write(b"right!")
    with store.writer(digest, 5) as writer:
        writer.write(b"rig")
        with pytest.raises(CorruptBlob, match="3 of its 5"):
            writer.commit()


def test_a_broken_transfer_resumes_where_it_stopped(tmp_path: Path) -> None:
    data = os.urandom(1000)
    digest = sha256_digest(data)
    store = BlobStore(tmp_path)
    with store.writer(digest, len(data)) as writer:
        writer.write(data[:400])  # then the connection breaks: no commit
    assert store.partial_size(digest) == 400 and not store.has(digest)
    with store.writer(digest, len(data)) as writer:
        assert writer.offset == 400  # from the hash state kept in memory
        writer.write(data[400:])
        writer.commit()
    assert store.path(digest).read_bytes() == data  # type: ignore[union-attr]


def test_a_partial_left_by_an_earlier_process_is_hashed_back(tmp_path: Path) -> None:
    data = os.urandom(5000)
    digest = sha256_digest(data)
    with BlobStore(tmp_path).writer(digest, len(data)) as writer:
        writer.write(data[:3000])
    restarted = BlobStore(tmp_path)  # no hash state: reads the partial back
    with restarted.writer(digest, len(data)) as writer:
        assert writer.offset == 3000
        writer.write(data[3000:])
        writer.commit()
    assert restarted.has(digest)


def test_one_writer_per_blob(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    digest = sha256_digest(b"x")
    with store.writer(digest, 1), pytest.raises(BlobBusy):
        store.writer(digest, 1)
    with store.writer(digest, 1) as writer:
        writer.write(b"x")
        writer.commit()


def test_pump_moves_large_blobs_in_order_and_keeps_a_short_read(tmp_path: Path) -> None:
    data = os.urandom(3 * PUMP_BUFFER_BYTES + 12345)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    store = BlobStore(tmp_path)
    source = io.BytesIO(data)
    half = len(data) // 2

    def broken(buffer: memoryview) -> int:  # the sender stops half way
        if source.tell() >= half:
            return 0
        return source.readinto(buffer[: half - source.tell()])

    with store.writer(digest, len(data)) as writer:
        assert writer.pump(broken, len(data)) == half
    assert store.partial_size(digest) == half
    with store.writer(digest, len(data)) as writer:
        assert writer.offset == half
        assert writer.pump(source.readinto, len(data) - half) == len(data) - half
        writer.commit()
    assert store.path(digest).read_bytes() == data  # type: ignore[union-attr]


def test_put_file_and_partials_cleanup(tmp_path: Path) -> None:
    source = tmp_path / "w.bin"
    source.write_bytes(os.urandom(PUMP_BUFFER_BYTES * 2 + 1))
    store = BlobStore(tmp_path / "blobs")
    digest = sha256_digest(source.read_bytes())
    assert store.put_file(source, digest).read_bytes() == source.read_bytes()
    other = sha256_digest(b"other")
    with store.writer(other, 5) as writer:
        writer.write(b"ot")
    assert store.discard_partials() == [other] and store.partial_size(other) == 0
    with pytest.raises(CorruptBlob):
        store.put_file(source, other)


def test_an_ingest_whose_process_died_is_discarded_and_a_live_ones_kept(tmp_path: Path) -> None:
    # An archive's member is written to a temporary file before its digest is known; a gateway
    # killed meanwhile left it (up to the package limit) for good.
    store = BlobStore(tmp_path / "blobs")
    dead = subprocess.Popen(["true"])
    dead.wait()
    partial = tmp_path / "blobs" / "partial"
    orphan, live = partial / f".ingest-{dead.pid}-abc", partial / f".ingest-{os.getpid()}-def"
    for path in (orphan, live):
        path.write_bytes(b"half an archive member")
    store.discard_partials()
    assert not orphan.exists() and live.exists()


def test_writers_of_different_blobs_run_at_once(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    blobs = [os.urandom(PUMP_BUFFER_BYTES + i) for i in range(4)]
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            store.put(data)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(store.has(sha256_digest(b)) for b in blobs)


def test_a_write_that_fails_leaves_a_partial_the_next_writer_reads_back(tmp_path: Path, monkeypatch) -> None:
    from gpufaas import blobs

    data = os.urandom(3000)
    digest = sha256_digest(data)
    store = BlobStore(tmp_path)
    real_write = os.write

    def disk_full(fd: int, view: object) -> int:
        raise OSError(28, "No space left on device")

    with store.writer(digest, len(data)) as writer:
        writer.write(data[:1000])
        monkeypatch.setattr(blobs.os, "write", disk_full)
        with pytest.raises(OSError, match="No space"):
            writer.write(data[1000:2000])
        monkeypatch.setattr(blobs.os, "write", real_write)
    with store.writer(digest, len(data)) as writer:  # resumes from what is on disk, not a stale hash
        assert writer.offset == 1000
        writer.write(data[1000:])
        writer.commit()
    assert store.path(digest).read_bytes() == data  # type: ignore[union-attr]


def test_a_commit_that_fails_does_not_hold_the_blob(tmp_path: Path, monkeypatch) -> None:
    store = BlobStore(tmp_path)
    digest = sha256_digest(b"data")

    def fail(*args: object) -> None:
        raise OSError(5, "I/O error")

    with store.writer(digest, 4) as writer:
        writer.write(b"data")
        monkeypatch.setattr(store, "_finished", fail)
        with pytest.raises(OSError):
            writer.commit()
    monkeypatch.undo()
    store.put(b"data")  # not BlobBusy
    assert store.has(digest)


def test_a_blob_is_on_disk_before_its_name_says_it_is_whole(tmp_path: Path, monkeypatch) -> None:
    """Every way in (small writes, the pump, an ingest) flushes the blob's bytes before the rename
    that makes it complete, and the directory after it: a complete blob is never verified again."""
    from gpufaas import blobs

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source: str | Path, target: str | Path) -> None:
        events.append(("rename", str(source)))
        real_replace(source, target)

    monkeypatch.setattr(blobs.os, "fsync", fsync)
    monkeypatch.setattr(blobs.os, "replace", replace)
    store = BlobStore(tmp_path)
    large = tmp_path / "large"
    large.write_bytes(os.urandom(PUMP_BUFFER_BYTES + 5000))
    small = os.urandom(3000)
    ways_in = [
        lambda: store.put(small),
        lambda: store.put_file(large, sha256_digest(large.read_bytes())),
        lambda: store.ingest(io.BytesIO(b"ingested").readinto, 8),
    ]
    complete = str(tmp_path / "sha256")
    for way_in in ways_in:
        events.clear()
        way_in()
        [(_, partial)] = [event for event in events if event[0] == "rename"]
        assert events == [("fsync", partial), ("rename", partial), ("fsync", complete)]
