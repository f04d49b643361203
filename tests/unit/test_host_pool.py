"""The host model pool: weights copied once from the disk cache into shared memory, shared by the
packages that hold them, least recently used out first, never one a worker maps."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from gpu_manager import host_pool
from gpu_manager.host_pool import HostModelPool, default_budget_bytes, huge_pages
from gpu_manager.storage import NodeStorage, StorageOptions
from gpufaas.blobs import BlobStore
from gpufaas.keys import Keys
from gpufaas.packages import Manifest, PackageFile, sha256_digest
from gpufaas.store import Store

MB = 1 << 20


def package(blobs: BlobStore, weights: bytes, handler: bytes = b"h") -> Manifest:
    return Manifest.of(
        [
            PackageFile("handler.py", blobs.put(handler), len(handler)),
            PackageFile("w.bin", blobs.put(weights), len(weights)),
        ]
    )


def test_weights_are_copied_in_once_and_shared(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    weights = os.urandom(2 * MB)
    first, second = package(blobs, weights), package(blobs, weights, b"other handler")

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 10 * MB)
        placed = await pool.admit(first, blobs)
        assert placed is not None and list(placed) == ["w.bin"]  # the handler is too small to pool
        copy = Path(placed["w.bin"])
        assert copy.read_bytes() == weights and copy.stat().st_ino != blobs.path(sha256_digest(weights)).stat().st_ino  # type: ignore[union-attr]
        assert oct(copy.stat().st_mode & 0o777) == "0o444" and oct(pool.root.stat().st_mode & 0o777) == "0o700"
        assert pool.root.parent == tmp_path / "shm" and pool.root.name.startswith("gpufaas-pool-")
        assert pool.holds(first) and pool.holds(second)  # the same weights: the same copy
        assert await pool.admit(second, blobs) == placed and pool.admitted == 1 and pool.used_bytes == 2 * MB

    asyncio.run(main())


def test_least_recently_used_weights_leave_but_not_those_in_use(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    a, b, c = (package(blobs, os.urandom(4 * MB), bytes([i])) for i in range(3))
    mapped: set[str] = set()

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 9 * MB, in_use=lambda: set(mapped))
        assert await pool.admit(a, blobs) and await pool.admit(b, blobs)
        mapped.update(d for _, d, _ in pool.weights(a))  # a worker maps a's weights
        assert await pool.admit(c, blobs)
        assert pool.holds(a) and not pool.holds(b) and pool.holds(c) and pool.evicted == 1
        mapped.update(d for _, d, _ in pool.weights(c))
        assert await pool.admit(b, blobs) is None  # everything else is mapped: b is read from disk
        assert pool.used_bytes == 8 * MB
        mapped.clear()
        pool.retain(d for _, d, _ in pool.weights(c))  # a's package left the disk cache
        assert not pool.holds(a) and pool.holds(c)

    asyncio.run(main())


def test_a_miss_that_cannot_fit_leaves_the_idle_weights_in_the_pool(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    mapped_package = package(blobs, os.urandom(6 * MB), b"mapped")
    idle = [package(blobs, os.urandom(MB + 1), bytes([i])) for i in range(3)]
    large = package(blobs, os.urandom(5 * MB), b"large")
    mapped: set[str] = set()

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 10 * MB, in_use=lambda: set(mapped))
        assert await pool.admit(mapped_package, blobs)
        mapped.update(d for _, d, _ in pool.weights(mapped_package))
        for manifest in idle:
            assert await pool.admit(manifest, blobs)
        # 6 MB mapped + 5 MB > 10 MB with every idle entry gone: read from disk, nothing dropped.
        assert await pool.admit(large, blobs) is None
        assert all(pool.holds(manifest) for manifest in idle) and pool.evicted == 0

    asyncio.run(main())


def test_a_copy_cut_short_leaves_nothing_and_the_next_one_pools_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    weights = os.urandom(2 * MB)
    manifest = package(blobs, weights)
    copies = {"made": 0}

    def copy_filling_the_tmpfs_once(writer: int) -> None:
        copies["made"] += 1
        if copies["made"] == 1:
            os.write(writer, weights[: MB // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        os.write(writer, weights)

    # (either way of copying, whichever this filesystem takes)
    monkeypatch.setattr(host_pool, "_copy_direct", lambda _reader, writer, *_: copy_filling_the_tmpfs_once(writer))
    monkeypatch.setattr(host_pool, "_copy_sendfile", lambda _source, writer, _size: copy_filling_the_tmpfs_once(writer))

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 10 * MB)
        assert await pool.admit(manifest, blobs) is None
        assert list(pool.root.iterdir()) == [] and pool.used_bytes == 0  # no uncounted part left
        placed = await pool.admit(manifest, blobs)  # not blocked by the part (O_EXCL)
        assert placed is not None and Path(placed["w.bin"]).read_bytes() == weights

    asyncio.run(main())


def test_a_blob_under_two_paths_is_counted_once(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    weights = os.urandom(3 * MB)
    digest = blobs.put(weights)
    handler = PackageFile("handler.py", blobs.put(b"h"), 1)
    twice = Manifest.of(
        [handler, PackageFile("a.bin", digest, len(weights)), PackageFile("b/a.bin", digest, len(weights))]
    )
    other = package(blobs, os.urandom(3 * MB))

    async def main() -> None:
        miss_pool = HostModelPool(tmp_path / "miss", 4 * MB)  # room for one copy, not two
        placed = await miss_pool.admit(twice, blobs)
        assert placed is not None and placed["a.bin"] == placed["b/a.bin"] and miss_pool.used_bytes == 3 * MB
        prestage_pool = HostModelPool(tmp_path / "prestage", 8 * MB)
        assert await prestage_pool.admit(other, blobs)
        assert await prestage_pool.admit(twice, blobs, evict=False)  # 3 MB into the 5 MB free
        assert prestage_pool.used_bytes == 6 * MB

    asyncio.run(main())


def test_no_pool_and_a_model_larger_than_it(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    manifest = package(blobs, os.urandom(3 * MB))

    async def main() -> None:
        assert await HostModelPool(tmp_path / "none", 0).admit(manifest, blobs) is None
        assert not (tmp_path / "none").exists()
        assert await HostModelPool(tmp_path / "small", 2 * MB).admit(manifest, blobs) is None

    asyncio.run(main())


def test_the_default_budget_is_a_share_of_free_memory(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path)
    assert default_budget_bytes(tmp_path / "not" / "yet", 0.5) == int(free.f_bavail * free.f_frsize * 0.5)


def test_the_pool_makes_a_directory_of_its_own_and_clears_what_a_crashed_run_left(tmp_path: Path) -> None:
    parent = tmp_path / "shm"
    parent.mkdir()
    parent.chmod(0o1777)  # like /dev/shm: everyone may write, the sticky bit keeps each one's own
    left = parent / "gpufaas-pool-node-x1y2"
    left.mkdir()
    (left / "stale").write_bytes(b"x")
    planted = parent / "gpufaas-pool-node-zzzz"
    planted.symlink_to(tmp_path / "elsewhere")
    pool = HostModelPool(parent, MB, name="gpufaas-pool-node")
    assert not left.exists() and planted.is_symlink()  # a link is never followed, never removed
    assert pool.root.parent == parent and pool.root.name.startswith("gpufaas-pool-node-")
    pool.close()
    assert not pool.root.exists()


def test_a_parent_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(OSError, match="other users"):
        HostModelPool(parent, MB)


def test_prestaging_takes_only_free_room(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    a, b = (package(blobs, os.urandom(4 * MB), bytes([i])) for i in range(2))

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 6 * MB)
        assert await pool.admit(a, blobs)
        assert await pool.admit(b, blobs, evict=False) is None and pool.holds(a)  # a stays
        assert await pool.admit(b, blobs) and not pool.holds(a)  # a miss may push it out

    asyncio.run(main())


def test_two_prestagings_at_once_take_only_free_room_together(tmp_path: Path) -> None:
    # Each fits the free room alone, not both: the second finds no room when it reserves, rather
    # than pushing out what a miss may want.
    blobs = BlobStore(tmp_path / "blobs")
    held, a, b = (package(blobs, os.urandom(size * MB), bytes([i])) for i, size in enumerate((4, 3, 3)))

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 9 * MB)
        assert await pool.admit(held, blobs)
        results = await asyncio.gather(pool.admit(a, blobs, evict=False), pool.admit(b, blobs, evict=False))
        assert pool.holds(held) and pool.evicted == 0
        assert sorted(result is None for result in results) == [False, True]

    asyncio.run(main())


def test_a_miss_that_joins_a_prestagings_copy_that_found_no_room_makes_room_itself(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")

    def weights_of(tag: bytes, *sizes_mb: int) -> Manifest:
        files = [PackageFile("handler.py", blobs.put(tag), len(tag))]
        for index, size_mb in enumerate(sizes_mb):
            files.append(PackageFile(f"w{index}.bin", blobs.put(os.urandom(size_mb * MB)), size_mb * MB))
        return Manifest.of(files)

    idle, wanted, other = weights_of(b"idle", 4), weights_of(b"wanted", 3, 2), weights_of(b"other", 2)

    async def main() -> None:
        pool = HostModelPool(tmp_path / "shm", 10 * MB)
        assert await pool.admit(idle, blobs)
        prestaging = asyncio.create_task(pool.admit(wanted, blobs, evict=False))  # 5 MB into the 6 free
        await asyncio.sleep(0)  # its first copy runs
        # Meanwhile another package takes 2 MB: the pre-staging's second copy finds 1 MB free.
        others = asyncio.create_task(pool.admit(other, blobs))
        miss = asyncio.create_task(pool.admit(wanted, blobs))  # joins the pre-staging's copies
        assert await prestaging is None and await others
        assert await miss is not None  # it pushed the idle weights out, as a miss may
        assert pool.holds(wanted) and not pool.holds(idle) and pool.used_bytes == 7 * MB

    asyncio.run(main())


def storage_of(tmp_path: Path, options: StorageOptions, *, on_change: Callable[[], None] = lambda: None) -> NodeStorage:
    """A node's storage under `tmp_path` kept as `options` say (no etcd: nothing here reaches it)."""
    return NodeStorage(
        cast(Store, None),
        Keys("/t"),
        node="n",
        state_dir=tmp_path / "state",
        in_use=set,
        on_change=on_change,
        options=options,
    )


def node_storage(tmp_path: Path, *, on_change: Callable[[], None]) -> NodeStorage:
    """A node's storage with a 10 MB host pool under `tmp_path`."""
    return storage_of(tmp_path, StorageOptions(pool_mb=10, pool_dir=tmp_path / "shm"), on_change=on_change)


def test_a_failed_copy_that_pushed_weights_out_is_reported_as_a_change_of_holdings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changes: list[None] = []
    storage = node_storage(tmp_path, on_change=lambda: changes.append(None))
    idle, wanted = (package(storage.packages.blobs, os.urandom(6 * MB), tag) for tag in (b"idle", b"wanted"))
    manifests = {idle.digest: idle, wanted.digest: wanted}
    monkeypatch.setattr(storage.packages, "manifest", manifests.get)
    monkeypatch.setattr(storage.packages, "staged", lambda: set(manifests))
    monkeypatch.setattr(storage.packages, "layer_dir", lambda _: None)

    def tmpfs_full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def main() -> None:
        await storage.weights(idle.digest, tmp_path)
        assert list(storage.holdings().pooled) == [idle.digest] and len(changes) == 1
        monkeypatch.setattr(host_pool, "_copy_direct", tmpfs_full)
        monkeypatch.setattr(host_pool, "_copy_sendfile", tmpfs_full)
        assert not (await storage.weights(wanted.digest, tmp_path)).pooled  # idle's weights went for it
        assert list(storage.holdings().pooled) == [] and len(changes) == 2  # the scheduler hears it
        storage.host_pool.close()

    asyncio.run(main())


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
27 1 0:24 / / rw,relatime - ext4 /dev/vda rw
30 27 0:40 / /mnt/huge rw,relatime shared:7 - tmpfs tmpfs rw,size=6291456k,huge=always
31 30 0:41 / /mnt/huge/small rw,relatime - tmpfs tmpfs rw,size=1024k
32 27 0:42 / /mnt/within\\040size rw,relatime - tmpfs tmpfs rw,huge=within_size
33 27 0:43 / /mnt/advise rw,relatime - tmpfs tmpfs rw,huge=advise
34 27 0:44 / /mnt/tab\\011and\\134slash rw,relatime - tmpfs tmpfs rw,huge=always
35 25 0:45 / /dev/shm rw,relatime - tmpfs tmpfs rw,huge=always
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/huge/pool", True),  # optional fields (shared:7) before the separator
        ("/mnt/huge", True),
        ("/mnt/huge/small/pool", False),  # the innermost mount decides
        ("/mnt/hugetlb", None),  # a sibling whose name only starts the same: the root's ext4
        ("/mnt/within size/pool", None),  # a space in a mount point is written \\040; within_size: it depends
        ("/mnt/advise/pool", False),  # huge=advise: only what is madvised, and the pool's copies are not
        ("/mnt/tab\tand\\slash/pool", True),  # any octal escape
        ("/dev/shm/gpufaas-pool", True),  # two mounts on one point: the later one, on top, is in use
        ("/var/lib/gpufaas", None),  # not a tmpfs
    ],
)
def test_huge_pages_reads_the_mount_in_use_for_the_pool(path: str, expected: bool | None) -> None:
    assert huge_pages(Path(path), MOUNTINFO, "always within_size advise [never] deny force") is expected


def test_the_kernels_shmem_setting_overrides_a_tmpfs_mount_option() -> None:
    assert huge_pages(Path("/mnt/huge/pool"), MOUNTINFO, "always within_size advise never [deny] force") is False
    assert huge_pages(Path("/mnt/huge/small"), MOUNTINFO, "always within_size advise never deny [force]") is True
    assert huge_pages(Path("/var/lib/gpufaas"), MOUNTINFO, "always within_size advise never deny [force]") is None
    assert huge_pages(Path("/mnt/within size"), MOUNTINFO, "always within_size advise never [deny] force") is False
    assert huge_pages(Path("/mnt/within size"), MOUNTINFO, "always within_size advise never deny [force]") is True


def test_huge_pages_reads_this_processs_own_mounts() -> None:
    mountinfo = Path("/proc/self/mountinfo").read_text()
    shmem_enabled = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    kernel = shmem_enabled.read_text() if shmem_enabled.exists() else ""
    for path in (Path("/dev/shm"), Path("/proc/self"), Path("/")):
        assert huge_pages(path) is huge_pages(path, mountinfo, kernel), path  # what it read is this process's
    assert huge_pages(Path("/proc/self")) is None  # procfs: no tmpfs


def test_a_node_storage_whose_blob_server_fails_to_stop_still_closes_its_host_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = node_storage(tmp_path, on_change=lambda: None)
    closed: list[None] = []
    monkeypatch.setattr(storage.host_pool, "close", lambda: closed.append(None))

    def stop_fails() -> None:
        raise OSError("the blob server's socket")

    monkeypatch.setattr(storage.blob_server, "stop", stop_fails)
    with pytest.raises(OSError):
        storage.stop()
    assert closed  # the pool's files in /dev/shm go with the node all the same


def crashed_pool(tmp_path: Path, left_bytes: int) -> Path:
    """The host pool's directory of a node storage under `tmp_path` that was never closed (its
    node crashed), holding a file of `left_bytes` (sparse: its size is what counts here)."""
    storage = storage_of(tmp_path, StorageOptions(disk_cache_mb=100, pool_mb=1, pool_dir=tmp_path / "shm"))
    with open(storage.host_pool.root / "weights", "wb") as left:
        left.truncate(left_bytes)
    return storage.host_pool.root


def test_a_node_run_with_no_pool_still_clears_the_pool_a_crashed_run_left(tmp_path: Path) -> None:
    left = crashed_pool(tmp_path, MB)
    storage = storage_of(tmp_path, StorageOptions(disk_cache_mb=100, pool_mb=0, pool_dir=tmp_path / "shm"))
    assert not storage.host_pool.enabled
    assert not left.exists()  # (it was left in /dev/shm, holding its memory for good)


def test_the_default_budget_is_measured_once_what_a_crashed_run_left_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    left = crashed_pool(tmp_path, 60 * MB)
    shm = tmp_path / "shm"
    real_statvfs = os.statvfs

    def statvfs(path: str | os.PathLike[str]) -> object:
        """A memory filesystem of 100 MB at `shm`, less the files in it."""
        if not Path(path).is_relative_to(shm):
            return real_statvfs(path)
        used = sum(f.stat().st_size for f in shm.rglob("*") if f.is_file())
        return type("Stats", (), {"f_bavail": (100 * MB - used) // 4096, "f_frsize": 4096})()

    monkeypatch.setattr(os, "statvfs", statvfs)
    storage = storage_of(tmp_path, StorageOptions(disk_cache_mb=100, pool_dir=shm))
    assert not left.exists()
    # Half of the 100 MB free, not of the 40 MB the crashed run's pool left free.
    assert storage.host_pool.budget_bytes == 50 * MB
    storage.stop()
