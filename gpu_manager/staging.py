"""The node's disk cache of packages: blobs fetched from the nearest holder (verified on the way,
resumed after a break), package directories made of hard links to them, requirement layers
installed beside, all within a disk budget (least recently used packages out first).

A package is *staged* here when its directory exists (every blob fetched and linked, its layer
installed): a call then needs no fetch. The scheduler asks for packages ahead of their first call
(pre-staging); a call for a package not staged fetches it on its critical path (`ensure`).

Layout under `root` (the node's state directory; workers pass through, list nothing):

    root/blobs/...          gpufaas.blobs.BlobStore (private to the node)
    root/packages/<hex>     a staged package: files linked to blobs (large, 0644) or copied
    root/layers/<hex>       an installed requirements layer (gpufaas.requirements.LayerCache)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gpufaas.blobnet import TransferError, fetch_blob
from gpufaas.blobs import BlobBusy, BlobStore, CorruptBlob, empty_blob
from gpufaas.holders import HolderRecord, PackageRecord, sources_for
from gpufaas.packages import EMPTY_DIGEST, InvalidPackage, Manifest, hex_of, read_archive, scan_directory
from gpufaas.requirements import LayerCache, RequirementsError, pip_runner

log = logging.getLogger("gpufaas.gpu_manager.staging")

LINK_MIN_BYTES = 64 << 10  # files this large (mode 0644) are hard links to their blob; smaller ones copies
PARALLEL_FETCHES = 4
FETCH_ATTEMPTS = 3  # passes over the holders before a blob is given up on
_TMP_PREFIX = ".tmp-"
_BUSY_WAIT_S = 0.05


class NoRoom(InvalidPackage):
    """A package that pre-staging would have to evict others for (it does not: a miss may)."""


@dataclass
class StageStats:
    """What staging one package cost: seconds fetching blobs (and bytes, from whom), linking its
    directory, installing its layer."""

    fetch_s: float = 0.0
    fetched_bytes: int = 0
    link_s: float = 0.0
    layer_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # holder -> bytes it served


class PackageStore:
    """Staged packages under `root` (see the module docstring).

    `records(digest)` reads a package's record (etcd), `holders()` the blob holders, `me` and
    `my_host` name this node (never asked for its own blobs; holders on its host are nearest).
    `budget_bytes`: disk the blobs may use (None: no bound). `in_use()` names the packages
    workers hold now, which are never evicted. `on_change()` runs after the set of staged
    packages changed. `layers`: where requirements layers go (default: `root/layers`, installed
    with this interpreter's pip). Concurrent `ensure`s of one package share one staging.
    """

    def __init__(
        self,
        root: Path,
        *,
        records: Callable[[str], Awaitable[PackageRecord | None]],
        holders: Callable[[], Awaitable[list[HolderRecord]]],
        me: str,
        my_host: str = "",
        authorization: str | None = None,
        budget_bytes: int | None = None,
        in_use: Callable[[], set[str]] = set,
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        layers: LayerCache | None = None,
    ) -> None:
        self.root = root
        self.blobs = BlobStore(root / "blobs")
        empty_blob(self.blobs)
        self.packages_dir = root / "packages"
        self.layers = layers if layers is not None else LayerCache(root / "layers", run=pip_runner(sys.executable))
        for directory in (root, self.packages_dir):
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o711)  # workers pass through to their own package; nobody lists them
        for stale in self.packages_dir.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        self._records = records
        self._holders = holders
        self.me = me
        self.my_host = my_host
        self.authorization = authorization
        self.budget_bytes = budget_bytes
        self._in_use = in_use
        self._on_change = on_change
        self._clock = clock
        self._staging: dict[str, asyncio.Task[Path]] = {}
        self._fetching: dict[str, asyncio.Task[Path]] = {}
        # Blobs the stagings under way will link (how many of them each): an eviction for room, or
        # a collection, must not delete one that is here already (shared with the old version).
        self._linking: Counter[str] = Counter()
        # The blobs each removal under way may delete: a staging waits for those that may take one
        # of its blobs before it looks which are here (it would count one about to go).
        self._deletions: dict[asyncio.Future[None], frozenset[str]] = {}
        self._fetch_slots = asyncio.Semaphore(PARALLEL_FETCHES)
        # Staged packages: digest -> (manifest, layer directory or None), and when each was last used.
        self._staged: dict[str, tuple[Manifest, Path | None]] = {}
        self._used_at: dict[str, float] = {}
        self._copies_bytes = 0  # the staged packages' files copied rather than linked (`copied_bytes`)
        self.stats: dict[str, StageStats] = {}  # the latest staging of each package
        self.fetched_bytes = 0  # since start, for the metrics

    # --- what is here -------------------------------------------------------------------------
    def path_for(self, digest: str) -> Path | None:
        """The directory of a staged package, or None."""
        path = self.packages_dir / hex_of(digest)
        return path if digest in self._staged and path.is_dir() else None

    def staged(self) -> set[str]:
        return set(self._staged)

    def manifest(self, digest: str) -> Manifest | None:
        entry = self._staged.get(digest)
        return entry[0] if entry is not None else None

    def layer_dir(self, digest: str) -> Path | None:
        """The installed requirements layer of a staged package (None: it has none)."""
        entry = self._staged.get(digest)
        return entry[1] if entry is not None else None

    def used_bytes(self) -> int:
        """The disk the blobs take (what the budget bounds): complete ones and the partials of
        broken or running fetches, and the staged packages' copies of blobs (`copied_bytes`)."""
        return self.blobs.used_bytes() + self.blobs.partial_bytes() + self._copies_bytes

    async def recover(self) -> None:
        """Adopt the packages a previous run of this node staged (their records permitting); one
        with a file missing or of another size (edited by hand while the node was down) is removed,
        to be staged again from its blobs when asked."""
        for path in list(self.packages_dir.iterdir()):
            if path.name.startswith(_TMP_PREFIX) or len(path.name) != 64:
                continue
            digest = f"sha256:{path.name}"
            record = await self._records(digest)
            if (
                record is None
                or not all(self.blobs.has(d) for d in record.manifest.blobs())
                or not await asyncio.to_thread(_intact, path, record.manifest)
            ):
                await asyncio.to_thread(shutil.rmtree, path, True)
                continue
            needs_layer = record.requirements is not None and not record.requirements.empty
            layer = self.layers.path_for(record.requirements) if record.requirements is not None else None
            if needs_layer and layer is None:
                # Its layer is gone: staged again when asked (an empty one is never installed). Not
                # left here: once its blobs are collected its links would hold their disk, unbudgeted.
                await asyncio.to_thread(shutil.rmtree, path, True)
                continue
            self._staged[digest] = (record.manifest, layer)
            self._copies_bytes += copied_bytes(record.manifest)
            self._used_at[digest] = path.stat().st_mtime
        if self._staged and self._on_change is not None:
            self._on_change()

    # --- staging ------------------------------------------------------------------------------
    async def ensure(self, digest: str, *, make_room: bool = True) -> Path:
        """The directory of package `digest`, staging it first if it is not here; InvalidPackage
        (or RequirementsError) saying why it cannot be had. `make_room=False` (pre-staging, a
        guess): only into free disk, evicting no package (NoRoom otherwise)."""
        self._used_at[digest] = self._clock()
        try:
            return await self._ensure(digest, make_room)
        except BaseException:
            if digest not in self._staged:  # (kept for every digest ever asked for, it grew for good)
                self._used_at.pop(digest, None)
            raise

    async def _ensure(self, digest: str, make_room: bool) -> Path:
        for _ in range(2):
            path = self.path_for(digest)
            if path is not None:
                return path
            task = self._staging.get(digest)
            if task is None:
                task = asyncio.create_task(self._stage(digest, make_room), name=f"stage {digest[:19]}")
                self._staging[digest] = task
                task.add_done_callback(lambda _: self._staging.pop(digest, None))
            try:
                # Shielded: one caller giving up must not cancel the staging others wait for.
                return await asyncio.shield(task)
            except NoRoom:
                if not make_room:
                    raise
                await asyncio.sleep(0)  # a pre-staging that would not evict: this call may, again
        raise NoRoom(f"package {digest}: no room on this node's disk")

    async def fetch(self, digest: str) -> tuple[Path, float]:
        """`ensure`, and the seconds it spent staging the package for this caller (0: it was here)."""
        path = self.path_for(digest)
        if path is not None:
            self._used_at[digest] = self._clock()
            return path, 0.0
        started = time.perf_counter()
        path = await self.ensure(digest)
        return path, time.perf_counter() - started

    async def _stage(self, digest: str, make_room: bool) -> Path:
        record = await self._records(digest)
        if record is None:
            raise InvalidPackage(f"package {digest} is not registered (deleted, or never uploaded)")
        blobs = list(record.manifest.blobs())
        self._linking.update(blobs)
        try:
            await self._settled(blobs)
            return await self._stage_record(digest, record, make_room)
        finally:
            self._linking.subtract(blobs)
            self._linking = +self._linking  # (drops the blobs no staging needs any more)

    async def _settled(self, blobs: Iterable[str]) -> None:
        """Once the removals under way that may delete one of `blobs` are done. Those that begin
        later keep them: they are in `_linking` already."""
        wanted = set(blobs)
        pending = [done for done, doomed in self._deletions.items() if not doomed.isdisjoint(wanted)]
        if pending:
            await asyncio.wait(pending)

    async def _stage_record(self, digest: str, record: PackageRecord, make_room: bool) -> Path:
        manifest = record.manifest
        stats = StageStats()
        started = time.perf_counter()
        missing = {d: size for d, size in manifest.blobs().items() if not self.blobs.has(d)}
        # (what a broken fetch of them left is on the disk, counted in used_bytes already)
        more = sum(size - self.blobs.partial_size(d) for d, size in missing.items()) + copied_bytes(manifest)
        if make_room:
            await self._make_room(more)
        elif not await self._fits(more):
            raise NoRoom(f"package {digest}: {more} bytes more do not fit the free disk budget")
        if missing:
            sources = sources_for(record, await self._holders(), me=self.me, my_host=self.my_host)
            # Largest first: the weights set the pace; the small files fit in around them.
            order = sorted(missing, key=lambda d: -missing[d])
            # Every fetch settles before a failure is raised: none runs on unowned after it, and
            # what was fetched is on disk (collected after the grace if nothing wants it).
            fetched = await asyncio.gather(
                *(self._blob(d, missing[d], sources, stats) for d in order), return_exceptions=True
            )
            failure = next((r for r in fetched if isinstance(r, BaseException)), None)
            if failure is not None:
                raise failure
            stats.fetch_s = time.perf_counter() - started
        # The layer before the directory: a failed install (or a crash during it) must leave no
        # directory, whose links would hold its blobs' disk once they are collected, unbudgeted.
        layer_path: Path | None = None
        if record.requirements is not None and not record.requirements.empty:
            installing = time.perf_counter()
            try:
                layer_path = await self.layers.ensure(record.requirements)
            except RequirementsError as exc:
                raise InvalidPackage(f"package {digest}: its requirements could not be installed: {exc}") from None
            stats.layer_s = time.perf_counter() - installing
        linked = time.perf_counter()
        path = await asyncio.to_thread(self._link, manifest)
        stats.link_s = time.perf_counter() - linked
        if digest not in self._staged:
            self._copies_bytes += copied_bytes(manifest)
        self._staged[digest] = (manifest, layer_path)
        self._used_at.setdefault(digest, self._clock())
        self.stats[digest] = stats
        if stats.fetched_bytes:
            log.info(
                "staged package %s: %d bytes fetched in %.2f s (%s)",
                digest[:19],
                stats.fetched_bytes,
                stats.fetch_s,
                ", ".join(f"{n} B from {h}" for h, n in stats.sources.items()),
            )
        if self._on_change is not None:
            self._on_change()
        return path

    async def _blob(self, digest: str, size: int, sources: list[HolderRecord], stats: StageStats) -> None:
        task = self._fetching.get(digest)
        if task is None:  # packages that share a blob (the same weights) fetch it once
            task = asyncio.create_task(self._fetch(digest, size, sources, stats), name=f"fetch {digest[:19]}")
            self._fetching[digest] = task
            task.add_done_callback(lambda _: self._fetching.pop(digest, None))
        await asyncio.shield(task)

    async def _fetch(self, digest: str, size: int, sources: list[HolderRecord], stats: StageStats) -> Path:
        """One blob from the first holder that serves it whole and right; holders that refuse,
        break off or go slower than fetch_blob's floor rate (what arrived is kept: the next one
        resumes) or send wrong bytes are passed."""
        reasons: list[str] = []
        answered_404 = 0  # holders' "not here": every one of them, and no one can serve it
        async with self._fetch_slots:
            for _ in range(FETCH_ATTEMPTS):
                for holder in sources:
                    before = self.blobs.partial_size(digest)
                    try:
                        path = await asyncio.to_thread(
                            fetch_blob, holder.url, digest, size, self.blobs, authorization=self.authorization
                        )
                    except BlobBusy:
                        await asyncio.sleep(_BUSY_WAIT_S)
                        continue
                    except CorruptBlob as exc:
                        log.warning(
                            "holder %s sent wrong bytes for blob %s; fetching it elsewhere", holder.name, digest
                        )
                        reasons.append(f"{holder.name}: {exc}")
                        continue
                    except TransferError as exc:
                        reasons.append(f"{holder.name}: {exc}")
                        answered_404 += exc.status == 404
                        continue
                    except OSError as exc:  # this node's own disk (full): no other holder helps
                        raise InvalidPackage(f"blob {digest} could not be stored on this node: {exc}") from None
                    served = size - before
                    stats.fetched_bytes += served
                    stats.sources[holder.name] = stats.sources.get(holder.name, 0) + served
                    self.fetched_bytes += served
                    return path
                if not sources:
                    break
        raise _unfetched(digest, reasons, answered_404, sources)

    def _link(self, manifest: Manifest) -> Path:
        return link_package(self.blobs, manifest, self.packages_dir)

    # --- room ---------------------------------------------------------------------------------
    async def _fits(self, nbytes: int) -> bool:
        if self.budget_bytes is None:
            return True
        return await asyncio.to_thread(self.used_bytes) + nbytes <= self.budget_bytes

    async def _make_room(self, nbytes: int) -> None:
        """Drop the partials no staging wants, then evict least recently used packages no worker
        holds, until `nbytes` more fit the budget (as far as that goes: a package larger than the
        budget is still staged). A package asked for since the eviction began is kept: its caller
        has its directory, and its worker may not be in `in_use()` yet."""
        if self.budget_bytes is None:
            return
        used = await asyncio.to_thread(self.used_bytes)
        if used + nbytes <= self.budget_bytes:
            return
        # First the partials no staging under way wants (a broken fetch's, of a package not asked
        # for now): cheaper to fetch again than a staged package.
        wanted = set(self._fetching) | set(self._linking)
        await asyncio.to_thread(self.blobs.discard_partials, lambda d: d in wanted)
        used = await asyncio.to_thread(self.used_bytes)
        if used + nbytes <= self.budget_bytes:
            return
        began = self._clock()
        for digest in sorted(self._staged, key=lambda d: self._used_at.get(d, 0.0)):
            # Asked again before each: every removal awaits, and calls land meanwhile.
            if digest in self._in_use() or digest in self._staging or digest not in self._staged:
                continue
            if self._used_at.get(digest, 0.0) >= began:
                continue
            freed = await self.remove(digest)
            used -= freed
            if used + nbytes <= self.budget_bytes:
                return

    async def remove(self, digest: str) -> int:
        """Unstage a package: its directory, and the blobs no other staged package needs; the
        bytes freed. A staging that needs one of its blobs and starts meanwhile (a call for this
        package, again) waits for it to end, then fetches what went."""
        entry = self._staged.pop(digest, None)
        self._used_at.pop(digest, None)
        self.stats.pop(digest, None)
        with self._deleting(entry[0].blobs() if entry is not None else ()):
            return await self._remove(digest, entry)

    async def _remove(self, digest: str, entry: tuple[Manifest, Path | None] | None) -> int:
        """`remove`'s work, once the package is out of `_staged` (`entry`: what it was there)."""
        # Moved aside before anything awaits: a staging of it that starts meanwhile makes a new
        # directory rather than find this one half deleted.
        path = self.packages_dir / hex_of(digest)
        doomed = self.packages_dir / f"{_TMP_PREFIX}gone-{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, doomed)
        await asyncio.to_thread(shutil.rmtree, doomed, True)
        if entry is None:
            return 0
        freed = copied_bytes(entry[0])
        self._copies_bytes -= freed
        kept = {d for manifest, _ in self._staged.values() for d in manifest.blobs()}
        kept |= self._fetching.keys() | self._linking.keys()
        for blob, size in entry[0].blobs().items():
            if blob not in kept and await asyncio.to_thread(self.blobs.remove, blob):
                freed += size
        empty_blob(self.blobs)
        if self._on_change is not None:
            self._on_change()
        return freed

    @contextlib.contextmanager
    def _deleting(self, blobs: Iterable[str]) -> Iterator[None]:
        """Within it, `blobs` may be deleted: a staging that needs one of them waits (`_settled`)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deletions[done] = frozenset(blobs)
        try:
            yield
        finally:
            del self._deletions[done]
            done.set_result(None)

    async def collect(self, in_use: Iterable[str], now_unix_s: float, grace_s: float) -> list[str]:
        """Unstage the packages no worker holds that nobody asked for in `grace_s`; then drop
        what no staged package needs any more and is older than the grace: blobs (left by a
        staging that failed half way, or by a package a restart did not adopt), partial blobs no
        fetch is writing, requirement layers. The digests unstaged."""
        busy = set(in_use) | set(self._staging)
        held = [digest for digest in busy if digest in self._staged]  # used now: see `_touch`
        self._used_at.update({digest: max(self._used_at.get(digest, 0.0), now_unix_s) for digest in held})
        await asyncio.to_thread(_touch, [self.packages_dir / hex_of(digest) for digest in held], now_unix_s)
        removed = []
        for digest in list(self._staged):
            if digest not in busy and now_unix_s - self._used_at.get(digest, now_unix_s) > grace_s:
                await self.remove(digest)
                removed.append(digest)
        needed = {d for manifest, _ in self._staged.values() for d in manifest.blobs()} | set(self._fetching)
        if not self._staging:  # a staging under way may need any blob here
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._collect_blobs, needed, now_unix_s, grace_s)
        layers = {f"sha256:{layer.name}" for _, layer in self._staged.values() if layer is not None}
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.layers.collect, layers, now_unix_s, grace_s)
        partials = self.blobs.root / "partial"

        def keep(digest: str) -> bool:  # being written, or young enough for its fetch to resume
            with contextlib.suppress(FileNotFoundError):
                return digest in self._fetching or now_unix_s - (partials / digest[7:]).stat().st_mtime <= grace_s
            return False

        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.blobs.discard_partials, keep)
        return removed

    def _collect_blobs(self, needed: set[str], now_unix_s: float, grace_s: float) -> None:
        for digest in list(self.blobs.digests()):
            path = self.blobs.path(digest)
            if digest in needed or digest == EMPTY_DIGEST or path is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                if now_unix_s - path.stat().st_mtime > grace_s:
                    self.blobs.remove(digest)


def _unfetched(digest: str, reasons: list[str], answered_404: int, sources: list[HolderRecord]) -> InvalidPackage:
    """Why blob `digest` could not be had from `sources`, each reason once; where every refusal
    was a "not here" (its blobs removed from the gateway's disk by hand), what to do about it."""
    if reasons and answered_404 == len(reasons):
        holders = ", ".join(dict.fromkeys(holder.name for holder in sources))
        return InvalidPackage(
            f"blob {digest} is held by no gateway or node any more ({holders}: not here); "
            "deploy the function again to upload it"
        )
    detail = "; ".join(dict.fromkeys(reasons[-3:])) or "no gateway or node holds it"
    return InvalidPackage(f"blob {digest} could not be fetched: {detail}")


def copied_bytes(manifest: Manifest) -> int:
    """The disk a package's directory takes beside its blobs: the files `link_package` copies
    (small ones, and those of another mode than the blobs' 0444, such as 0755) rather than links.
    Counted in the budget: a package of 4 GB of weights marked executable took twice its size."""
    return sum(entry.size for entry in manifest.files if not _linked(entry.size, entry.mode))


def _touch(paths: Iterable[Path], now_unix_s: float) -> None:
    """Set the mtime of each of `paths` (staged packages a worker holds) to `now_unix_s`, as their
    use time is set: their grace runs from then, in this run and the next (a restarted node adopts
    a package as last used at its directory's mtime). Only a miss's fetch set it before: a package
    held past the grace was unstaged as soon as its last worker stopped, or the node restarted.
    One gone meanwhile is passed."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.utime(path, (now_unix_s, now_unix_s), follow_symlinks=False)


def _intact(directory: Path, manifest: Manifest) -> bool:
    """Whether every file of `manifest` is in `directory` at its size (a stat each, no hashing):
    a package adopted with one gone failed every load, and deploying it again (same digest, the
    directory already there) changed nothing."""
    for entry in manifest.files:
        try:
            if (directory / entry.path).stat().st_size != entry.size:
                return False
        except OSError:  # gone, or a path through something no longer a directory
            return False
    return True


def _linked(size: int, mode: int) -> bool:
    return size >= LINK_MIN_BYTES and mode == 0o644


def link_package(blobs: BlobStore, manifest: Manifest, packages_dir: Path) -> Path:
    """A package's directory under `packages_dir` from its blobs, atomically (it appears whole or
    not at all); large plain files are hard links to their blob (shared, 0444, the node's), the
    rest copies with the manifest's mode."""
    target = packages_dir / hex_of(manifest.digest)
    if target.is_dir():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name[:12]}-", dir=packages_dir))
    try:
        for entry in manifest.files:
            destination = tmp / entry.path
            destination.parent.mkdir(parents=True, exist_ok=True)
            if _linked(entry.size, entry.mode):
                blobs.link_into(entry.digest, destination)
            else:
                source = blobs.path(entry.digest)
                if source is None:
                    raise InvalidPackage(f"blob {entry.digest} went while package {manifest.digest} was linked")
                shutil.copyfile(source, destination)
                destination.chmod(entry.mode)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # lost a race to an identical staging: fine; else real
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class LocalPackages:
    """Packages made from local directories or archives, with the same blobs and links as staged
    ones but no holder to fetch from: what the worker pool's tests and the benchmarks run."""

    def __init__(self, root: Path) -> None:
        self.blobs = BlobStore(root / "blobs")
        empty_blob(self.blobs)
        self.packages_dir = root / "packages"
        self.packages_dir.mkdir(parents=True, exist_ok=True)
        self.manifests: dict[str, Manifest] = {}
        self.fetched: list[str] = []  # digests `ensure` was asked for, in order

    def add(self, directory: Path) -> str:
        """A package of `directory`'s files; its digest."""
        manifest, files = scan_directory(directory)
        for digest, path in files.items():
            self.blobs.put_file(path, digest)
        self.manifests[manifest.digest] = manifest
        return manifest.digest

    def add_archive(self, data: bytes) -> str:
        """A package of a `.tar.gz`'s files; its digest."""

        def store(path: str, size: int, reader: IO[bytes]) -> str:
            return self.blobs.ingest(reader.readinto, size)  # type: ignore[attr-defined]

        manifest = read_archive(io.BytesIO(data), store, max_unpacked_bytes=1 << 40)
        self.manifests[manifest.digest] = manifest
        return manifest.digest

    async def ensure(self, digest: str) -> Path:
        self.fetched.append(digest)
        manifest = self.manifests.get(digest)
        if manifest is None:
            raise InvalidPackage(f"package {digest} is not here")
        return await asyncio.to_thread(link_package, self.blobs, manifest, self.packages_dir)

    async def fetch(self, digest: str) -> tuple[Path, float]:
        """The worker pool's `fetch_package`: nothing is ever fetched from elsewhere."""
        return await self.ensure(digest), 0.0
