"""The node's disk cache (gpu_manager.staging.PackageStore) against real blob servers on loopback:
nearest holder first, a wrong or broken holder passed over, shared blobs fetched once, packages
linked, evicted within the budget, adopted after a restart; and its requirements layer."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from gpu_manager.loads import ModelFiles
from gpu_manager.sandbox import Isolation
from gpu_manager.staging import LINK_MIN_BYTES, NoRoom, PackageStore
from gpufaas.blobnet import BlobServer
from gpufaas.blobs import BlobStore, BlobWriter
from gpufaas.holders import HolderRecord, PackageRecord
from gpufaas.packages import InvalidPackage, Manifest, PackageFile, sha256_digest
from gpufaas.requirements import Layer, LayerCache, python_tag

TOKEN = "Bearer node-token"


def open_to(method: str, authorization: str | None) -> tuple[int, str] | None:
    return None if authorization == TOKEN else (403, "no")


class Cluster:
    """Package records and holders (real blob servers) a PackageStore fetches from."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.records: dict[str, PackageRecord] = {}
        self.holders: list[HolderRecord] = []
        self.servers: dict[str, BlobServer] = {}

    def holder(self, name: str, kind: str = "gateway") -> BlobServer:
        server = BlobServer(BlobStore(self.tmp_path / name), open_to)
        url = f"http://{server.start('127.0.0.1:0')}"
        self.servers[name] = server
        self.holders.append(HolderRecord(name, kind, url))  # type: ignore[arg-type]
        return server

    def package(self, files: dict[str, bytes], gateway: str = "gw", *, layer: Layer | None = None) -> str:
        entries = []
        for path, data in files.items():
            entries.append(PackageFile(path, sha256_digest(data), len(data)))
            for name, server in self.servers.items():
                if name == gateway or any(h.name == name and h.kind == "node" for h in self.holders):
                    server.store.put(data)
        manifest = Manifest.of(entries)
        self.records[manifest.digest] = PackageRecord(manifest, gateway, layer)
        return manifest.digest

    def store(self, root: Path, **options: object) -> PackageStore:
        async def records(digest: str) -> PackageRecord | None:
            return self.records.get(digest)

        async def holders() -> list[HolderRecord]:
            return list(self.holders)

        return PackageStore(root, records=records, holders=holders, me="node-me", authorization=TOKEN, **options)  # type: ignore[arg-type]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = Cluster(tmp_path)
    yield c
    c.stop()


HANDLER = b"def load(d):\n    return 1\n\ndef predict(m, i):\n    return i\n"


def test_a_package_is_fetched_once_and_linked(tmp_path: Path, cluster: Cluster) -> None:
    gateway = cluster.holder("gw")
    weights = os.urandom(LINK_MIN_BYTES * 3)
    digest = cluster.package({"handler.py": HANDLER, "model/w.bin": weights, "empty.txt": b""})
    changes: list[int] = []

    async def main() -> None:
        store = cluster.store(tmp_path / "node", on_change=lambda: changes.append(1))
        paths = await asyncio.gather(*(store.ensure(digest) for _ in range(3)))  # share one staging
        assert len(set(paths)) == 1 and store.staged() == {digest}
        directory = paths[0]
        assert (directory / "handler.py").read_bytes() == HANDLER
        linked = directory / "model" / "w.bin"
        assert linked.read_bytes() == weights and linked.stat().st_nlink == 2  # a link to its blob
        assert (directory / "handler.py").stat().st_nlink == 1  # small: a copy
        assert gateway.bytes_sent == len(weights) + len(HANDLER)
        stats = store.stats[digest]
        assert stats.fetched_bytes == len(weights) + len(HANDLER) and stats.sources == {"gw": stats.fetched_bytes}
        assert await store.ensure(digest) == directory and gateway.bytes_sent == stats.fetched_bytes
        assert changes == [1]

    asyncio.run(main())


def test_peers_come_first_and_a_wrong_or_dead_holder_is_passed(tmp_path: Path, cluster: Cluster) -> None:
    gateway = cluster.holder("gw")
    peer = cluster.holder("node-peer", kind="node")
    weights = os.urandom(1 << 20)
    digest = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    cluster.holders = [
        HolderRecord("node-peer", "node", cluster.holders[1].url, frozenset({digest})),
        HolderRecord("node-dead", "node", "http://127.0.0.1:1", frozenset({digest})),
        cluster.holders[0],
    ]
    # The peer's copy of the weights went bad on its disk.
    path = peer.store.path(sha256_digest(weights))
    assert path is not None
    path.chmod(0o644)
    corrupt = bytearray(weights)
    corrupt[0] ^= 1
    path.write_bytes(bytes(corrupt))

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        directory = await store.ensure(digest)
        assert (directory / "w.bin").read_bytes() == weights
        # The handler came from the peer; the weights, refused from it, from the gateway.
        assert store.stats[digest].sources == {"node-peer": len(HANDLER), "gw": len(weights)}
        assert gateway.bytes_sent == len(weights)

    asyncio.run(main())


def test_nothing_to_fetch_from_says_why(tmp_path: Path, cluster: Cluster) -> None:
    cluster.holder("gw")
    digest = cluster.package({"handler.py": HANDLER})
    cluster.servers["gw"].store.remove(sha256_digest(HANDLER))

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        # Every holder says it has not the blob (removed from the gateway's disk by hand): what to do,
        # once, not the same refusal once per pass over the holders.
        with pytest.raises(InvalidPackage, match=r"held by no gateway or node any more \(gw: not here\)") as refused:
            await store.ensure(digest)
        assert "deploy the function again" in str(refused.value) and str(refused.value).count("gw") == 1
        with pytest.raises(InvalidPackage, match="not registered"):
            await store.ensure(sha256_digest(b"nothing"))
        assert store.staged() == set()
        assert store._used_at == {}  # nothing kept of what could not be had: it grew with every digest asked

    asyncio.run(main())


def test_shared_weights_are_fetched_once_for_two_packages(tmp_path: Path, cluster: Cluster) -> None:
    gateway = cluster.holder("gw")
    weights = os.urandom(2 << 20)
    first = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    second = cluster.package({"handler.py": HANDLER + b"# v2\n", "w.bin": weights})

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        await asyncio.gather(store.ensure(first), store.ensure(second))
        assert gateway.bytes_sent == len(weights) + len(HANDLER) + len(HANDLER) + 5

    asyncio.run(main())


def test_least_recently_used_packages_leave_for_a_new_one_but_never_one_in_use(
    tmp_path: Path, cluster: Cluster
) -> None:
    cluster.holder("gw")
    packages = [cluster.package({"handler.py": HANDLER + bytes([i]), "w.bin": os.urandom(1 << 20)}) for i in range(4)]
    busy: set[str] = set()
    clock = [0.0]

    async def main() -> None:
        store = cluster.store(
            tmp_path / "node", budget_bytes=int(2.5 * (1 << 20)), in_use=lambda: set(busy), clock=lambda: clock[0]
        )
        for index in range(2):
            clock[0] = index
            await store.ensure(packages[index])
        busy.add(packages[0])  # the oldest, but a worker holds it
        clock[0] = 2
        await store.ensure(packages[2])
        assert store.staged() == {packages[0], packages[2]}
        assert store.used_bytes() <= int(2.5 * (1 << 20)) + 200
        assert not (store.packages_dir / packages[1][7:]).exists()
        busy.clear()
        clock[0] = 3
        await store.ensure(packages[3])
        assert store.staged() == {packages[2], packages[3]}
        # Unused for longer than the grace: collected, unless in use.
        busy.add(packages[3])
        assert await store.collect(set(busy), now_unix_s=100.0, grace_s=50.0) == [packages[2]]
        assert store.staged() == {packages[3]}

    asyncio.run(main())


def test_a_restarted_node_adopts_what_it_staged(tmp_path: Path, cluster: Cluster) -> None:
    gateway = cluster.holder("gw")
    digest = cluster.package({"handler.py": HANDLER, "w.bin": os.urandom(1 << 20)})
    stray = tmp_path / "node" / "packages" / ("f" * 64)

    async def main() -> None:
        await cluster.store(tmp_path / "node").ensure(digest)
        stray.mkdir()  # a package whose record is gone
        sent = gateway.bytes_sent
        again = cluster.store(tmp_path / "node")
        await again.recover()
        assert again.staged() == {digest} and not stray.exists()
        await again.ensure(digest)
        assert gateway.bytes_sent == sent

    asyncio.run(main())


def test_a_restarted_node_stages_again_a_package_missing_a_file(tmp_path: Path, cluster: Cluster) -> None:
    # A file of a staged package removed (or truncated) by hand while the node was down: adopted
    # as it was, every load of it failed, and deploying the package again changed nothing.
    cluster.holder("gw")
    weights = os.urandom(LINK_MIN_BYTES * 4)
    digest = cluster.package({"handler.py": HANDLER, "w.bin": weights, "notes.txt": b"some notes\n"})

    async def main() -> None:
        package_dir = await cluster.store(tmp_path / "node").ensure(digest)
        (package_dir / "w.bin").unlink()
        (package_dir / "notes.txt").write_bytes(b"cut")
        again = cluster.store(tmp_path / "node")
        await again.recover()
        assert again.staged() == set()
        restaged = await again.ensure(digest)
        assert (restaged / "w.bin").read_bytes() == weights
        assert (restaged / "notes.txt").read_bytes() == b"some notes\n"

    asyncio.run(main())


def test_a_restarted_node_adopts_a_package_whose_layer_is_empty(tmp_path: Path, cluster: Cluster) -> None:
    # requirements.txt named only what the base holds: the gateway recorded the empty layer, which
    # is never installed (nothing to install), so no layer directory exists for it.
    cluster.holder("gw")
    files = {"handler.py": HANDLER, "requirements.txt": b"tabulate\n"}
    digest = cluster.package(files, layer=Layer((), python_tag()))

    async def main() -> None:
        layers = tmp_path / "layers"
        await cluster.store(tmp_path / "node", layers=LayerCache(layers, run=_no_pip)).ensure(digest)  # type: ignore[arg-type]
        again = cluster.store(tmp_path / "node", layers=LayerCache(layers, run=_no_pip))  # type: ignore[arg-type]
        await again.recover()
        assert again.staged() == {digest} and again.layer_dir(digest) is None

    asyncio.run(main())


def _no_pip(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
    raise AssertionError(f"pip run for an empty layer: {argv}")


def test_a_package_with_requirements_gets_its_layer(tmp_path: Path, cluster: Cluster) -> None:
    cluster.holder("gw")
    layer = Layer(("tabulate==0.9.0",), python_tag())
    digest = cluster.package({"handler.py": HANDLER, "requirements.txt": b"tabulate==0.9.0\n"}, layer=layer)
    installs: list[list[str]] = []

    def pip(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        installs.append(list(argv))
        target = Path(argv[argv.index("--target") + 1])
        (target / "tabulate-0.9.0.dist-info").mkdir(parents=True)
        (target / "tabulate-0.9.0.dist-info" / "METADATA").write_text("Name: tabulate\nVersion: 0.9.0\n")
        (target / "tabulate.py").write_text("VERSION = '0.9.0'\n")
        return 0, "", ""

    async def main() -> None:
        store = cluster.store(tmp_path / "node", layers=LayerCache(tmp_path / "layers", run=pip))  # type: ignore[arg-type]
        await store.ensure(digest)
        directory = store.layer_dir(digest)
        assert directory is not None and (directory / "tabulate.py").exists()
        assert len(installs) == 1 and "tabulate==0.9.0" in installs[0]

    asyncio.run(main())


def test_a_package_without_its_layer_leaves_no_directory_to_outlive_its_blobs(tmp_path: Path, cluster: Cluster) -> None:
    # A package directory's large files are links to its blobs: one left unstaged (its layer failed
    # to install, or went before a restart) kept their disk after the blobs were collected, unbudgeted.
    cluster.holder("gw")
    weights = os.urandom(LINK_MIN_BYTES * 4)
    layer = Layer(("tabulate==0.9.0",), python_tag())
    files = {"handler.py": HANDLER, "w.bin": weights, "requirements.txt": b"tabulate==0.9.0\n"}
    digest = cluster.package(files, layer=layer)
    pip_works = False

    def pip(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        if not pip_works:
            return 1, "", "ERROR: no matching distribution"
        info = Path(argv[argv.index("--target") + 1]) / "tabulate-0.9.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Name: tabulate\nVersion: 0.9.0\n")
        return 0, "", ""

    async def main() -> None:
        nonlocal pip_works
        layers = LayerCache(tmp_path / "layers", run=pip)  # type: ignore[arg-type]
        store = cluster.store(tmp_path / "node", layers=layers)
        package_dir = store.packages_dir / digest[7:]
        with pytest.raises(InvalidPackage, match="requirements"):
            await store.ensure(digest)
        assert not package_dir.exists()
        pip_works = True
        await store.ensure(digest)
        assert (package_dir / "w.bin").stat().st_nlink == 2  # a link to its blob, not a stale copy
        layer_dir = store.layer_dir(digest)
        assert layer_dir is not None
        shutil.rmtree(layer_dir)  # gone before the node's restart
        again = cluster.store(tmp_path / "node", layers=layers)
        await again.recover()
        assert again.staged() == set() and not package_dir.exists()

    asyncio.run(main())


def test_blobs_a_failed_staging_left_are_collected_after_the_grace(tmp_path: Path, cluster: Cluster) -> None:
    gateway = cluster.holder("gw")
    weights = os.urandom(1 << 20)
    digest = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    gateway.store.remove(sha256_digest(HANDLER))  # the handler cannot be had: the staging fails

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        with pytest.raises(InvalidPackage):
            await store.ensure(digest)
        assert store.blobs.has(sha256_digest(weights))  # fetched before the failure
        await store.collect(set(), now_unix_s=time.time(), grace_s=60.0)
        assert store.blobs.has(sha256_digest(weights))  # young: a retry may want it
        await store.collect(set(), now_unix_s=time.time() + 120, grace_s=60.0)
        assert not store.blobs.has(sha256_digest(weights))

    asyncio.run(main())


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root (CI runs as root)")
def test_a_package_staged_again_is_locked_again_for_its_own_user(tmp_path: Path, cluster: Cluster) -> None:
    # Unstaged (unused for the grace, or evicted for room) and staged again, a package is a new
    # directory (mkdtemp's: root's, 0700), which its workers, running as its own user, cannot enter
    # until it is locked for that user (root:uid, 0750) again.
    cluster.holder("gw")
    digest = cluster.package({"handler.py": HANDLER, "w.bin": os.urandom(1 << 20)})
    isolation = Isolation(users=True)
    uid = isolation.package_users.uid(digest)

    def locked_for_its_user(path: Path, mode: int) -> bool:
        status = path.stat()
        return (status.st_uid, status.st_gid, status.st_mode & 0o777) == (0, uid, mode)

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        files = ModelFiles(store.fetch, None, isolation)
        for _ in range(2):
            directory, _ = await store.fetch(digest)
            assert await files.own(digest, directory) == uid
            assert locked_for_its_user(directory, 0o750) and locked_for_its_user(directory / "handler.py", 0o640)
            assert await store.collect(set(), now_unix_s=time.time() + 7200, grace_s=3600) == [digest]

    asyncio.run(main())


def test_evicting_the_old_version_for_room_keeps_the_weights_the_new_one_shares(
    tmp_path: Path, cluster: Cluster
) -> None:
    # A redeploy with only its handler changed, on a full disk: the new package needs only its
    # handler fetched, the room is made by evicting the old version, and the weights blob the two
    # share must stay for the new one to link.
    gateway = cluster.holder("gw")
    weights = os.urandom(1 << 20)
    old = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    new = cluster.package({"handler.py": HANDLER + b"# v2\n", "w.bin": weights})

    async def main() -> None:
        store = cluster.store(tmp_path / "node", budget_bytes=(1 << 20) + len(HANDLER) + 2)
        await store.ensure(old)
        sent = gateway.bytes_sent
        directory = await store.ensure(new)
        assert (directory / "w.bin").read_bytes() == weights
        assert store.staged() == {new} and gateway.bytes_sent == sent + len(HANDLER) + 5

    asyncio.run(main())


def test_a_package_taken_while_room_is_made_is_not_evicted(tmp_path: Path, cluster: Cluster) -> None:
    # A miss for c needs room: a and b (least recently used first) are to go. While a is removed
    # a call for b lands; b is still staged, so it is answered at once and a worker takes it: the
    # eviction must not then remove b under that worker.
    cluster.holder("gw")
    a, b = (cluster.package({"handler.py": HANDLER + bytes([i]), "w.bin": os.urandom(1 << 20)}) for i in range(2))
    c = cluster.package({"handler.py": HANDLER + b"c", "w.bin": os.urandom(2 << 20)})
    busy: set[str] = set()
    clock = [0.0]

    async def main() -> None:
        store = cluster.store(
            tmp_path / "node", budget_bytes=int(2.5 * (1 << 20)), in_use=lambda: set(busy), clock=lambda: clock[0]
        )
        for index, digest in enumerate((a, b)):
            clock[0] = index
            await store.ensure(digest)
        original_remove = store.remove
        taken: list[Path] = []

        async def remove(digest: str) -> int:
            if digest == a:
                taken.append(await store.ensure(b))
            return await original_remove(digest)

        store.remove = remove  # type: ignore[method-assign]
        clock[0] = 2
        await store.ensure(c)
        assert b in store.staged() and taken[0].exists(), "b was evicted while a worker held it"
        assert store.staged() == {b, c}  # over the budget for as long as b is held, rather than b gone

    asyncio.run(main())


def test_a_package_staged_again_while_it_is_removed_keeps_its_blobs(tmp_path: Path, cluster: Cluster) -> None:
    # A call for a package lands while the package is being unstaged, after its first blob went:
    # the staging it starts must not count the blobs the removal is about to delete as here (it
    # would link them, and be staged with none of its blobs: never pooled, nothing served to peers).
    cluster.holder("gw")
    weights = os.urandom(1 << 20)
    digest = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    blobs = [sha256_digest(HANDLER), sha256_digest(weights)]

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        await store.ensure(digest)
        loop = asyncio.get_running_loop()
        first_gone = asyncio.Event()
        original_remove = store.blobs.remove

        def remove(blob: str) -> bool:
            removed = original_remove(blob)
            if not first_gone.is_set():
                loop.call_soon_threadsafe(first_gone.set)
                time.sleep(0.3)  # the staging runs on meanwhile
            return removed

        store.blobs.remove = remove  # type: ignore[method-assign]
        removal = asyncio.create_task(store.remove(digest))
        await first_gone.wait()
        directory = await store.ensure(digest)
        await removal
        assert store.staged() == {digest} and (directory / "w.bin").read_bytes() == weights
        assert all(store.blobs.path(blob) is not None for blob in blobs), "staged without its blobs"

    asyncio.run(main())


def test_a_full_disk_here_is_said_so_and_not_asked_of_every_holder(
    tmp_path: Path, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's own write failing (ENOSPC) is no fault of the holder: fetch_blob called it the
    holder breaking off, so staging asked every holder FETCH_ATTEMPTS times (re-reading the
    partial from disk before each) and blamed them."""
    cluster.holder("gw")
    cluster.holder("gw2")
    digest = cluster.package({"handler.py": HANDLER}, gateway="gw")
    cluster.servers["gw2"].store.put(HANDLER)
    writes: list[int] = []

    def full(self: object, data: object) -> None:
        writes.append(1)
        raise OSError(28, "No space left on device")

    async def main() -> None:
        store = cluster.store(tmp_path / "node")
        monkeypatch.setattr(BlobWriter, "write", full)
        with pytest.raises(InvalidPackage, match=r"on this node: .*No space left"):
            await store.ensure(digest)

    asyncio.run(main())
    assert len(writes) == 1


def test_partial_blobs_count_against_the_disk_budget(tmp_path: Path, cluster: Cluster) -> None:
    """What a broken fetch left is on the disk too: a pre-staging that fits only if it is not
    counted does not fit, and making room drops such a partial no staging wants before it would
    exceed the budget. A partial of a blob being staged counts once, not as well as its size."""
    cluster.holder("gw")
    weights = os.urandom(1 << 20)
    digest = cluster.package({"handler.py": HANDLER, "w.bin": weights})
    budget = int(1.5 * (1 << 20))
    orphan = os.urandom(1 << 20)

    async def main() -> None:
        store = cluster.store(tmp_path / "node", budget_bytes=budget)
        with store.blobs.writer(sha256_digest(orphan), len(orphan)) as writer:
            writer.write(orphan[: 900 << 10])  # a fetch of another package broke off here
        with pytest.raises(NoRoom):
            await store.ensure(digest, make_room=False)
        await store.ensure(digest)  # a call: room made
        assert store.used_bytes() <= budget
        assert store.blobs.partial_size(sha256_digest(orphan)) == 0

        again = cluster.store(tmp_path / "again", budget_bytes=budget)
        with again.blobs.writer(sha256_digest(weights), len(weights)) as writer:
            writer.write(weights[: 900 << 10])  # its own fetch broke off here: 124 KiB more to come
        await again.ensure(digest, make_room=False)
        assert again.used_bytes() <= budget

    asyncio.run(main())


def test_files_a_package_copies_rather_than_links_count_against_the_disk_budget(
    tmp_path: Path, cluster: Cluster
) -> None:
    """Weights marked executable (0755) are copied into the package's directory, not linked to
    their blob (0444): twice their size on disk, which the budget counted once."""
    cluster.holder("gw")
    packages = []
    for _ in range(2):
        weights = os.urandom(1 << 20)
        entries = [
            PackageFile("handler.py", sha256_digest(HANDLER), len(HANDLER)),
            PackageFile("w.bin", sha256_digest(weights), len(weights), mode=0o755),
        ]
        cluster.servers["gw"].store.put(HANDLER)
        cluster.servers["gw"].store.put(weights)
        manifest = Manifest.of(entries)
        cluster.records[manifest.digest] = PackageRecord(manifest, "gw", None)
        packages.append(manifest.digest)
    budget = int(2.5 * (1 << 20))

    def on_disk(root: Path) -> int:
        inodes = {(f.stat().st_ino, f.stat().st_size) for f in root.rglob("*") if f.is_file()}
        return sum(size for _, size in inodes)

    async def main() -> None:
        store = cluster.store(tmp_path / "node", budget_bytes=budget)
        await store.ensure(packages[0])
        assert store.used_bytes() == on_disk(tmp_path / "node")  # the blob and its copy
        with pytest.raises(NoRoom):
            await store.ensure(packages[1], make_room=False)
        await store.ensure(packages[1])  # a call: the other package leaves for it
        assert store.staged() == {packages[1]}
        assert store.used_bytes() == on_disk(tmp_path / "node") <= budget
        again = cluster.store(tmp_path / "node", budget_bytes=budget)
        await again.recover()
        assert again.used_bytes() == store.used_bytes()

    asyncio.run(main())


def test_a_package_in_use_past_the_grace_is_kept_for_the_grace_after_its_last_worker_and_a_restart(
    tmp_path: Path, cluster: Cluster
) -> None:
    cluster.holder("gw")
    digest = cluster.package({"handler.py": HANDLER, "w.bin": os.urandom(1 << 20)})
    staged_s = time.time()

    async def main() -> None:
        store = cluster.store(tmp_path / "node", clock=lambda: staged_s)
        await store.ensure(digest)
        # Its worker serves for two hours (hits: no fetch), then stops.
        assert await store.collect({digest}, now_unix_s=staged_s + 7200, grace_s=3600) == []
        # (it was unstaged here: its grace ran from its fetch, not from its last use)
        assert await store.collect(set(), now_unix_s=staged_s + 7210, grace_s=3600) == []
        # The node restarts: it adopts the package as used when its worker last held it.
        again = cluster.store(tmp_path / "node")
        await again.recover()
        assert await again.collect(set(), now_unix_s=staged_s + 7220, grace_s=3600) == []
        assert await again.collect(set(), now_unix_s=staged_s + 7200 + 3601, grace_s=3600) == [digest]

    asyncio.run(main())
