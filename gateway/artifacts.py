"""The gateway's artifact store: blobs on disk (uploaded once, verified while they stream in),
packages registered in etcd (their requirements resolved on the way), the blob server nodes and
the CLI move bytes through, and the collection of what no function uses any more.

An upload, as `gpufaas deploy` makes it: ask which blobs are missing (`missing`), send those
(large ones to the blob server, `gpufaas.blobnet`; small ones batched in one tar), then register
the manifest (`register`), whose digest a function spec names. The older `.tar.gz` upload is the
same in one request (`receive_archive`).

Durability (docs/weights.md): a commit fetches the blobs this gateway lacks from the other
holders (`gather`: the upload may have gone to another gateway), and is answered only once one
other gateway holds them too (`replicate` pushes them to its blob server), so that the package
outlives the gateway that took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from gateway.auth import Credentials
from gpufaas.blobnet import UPLOAD_OFFSET, Authorizer, BlobServer, TransferError, fetch_blob, upload_blob
from gpufaas.blobs import BlobBusy, BlobStore, BlobWriter, CorruptBlob, empty_blob
from gpufaas.holders import HolderRecord, PackageRecord, read_holders, read_package, sources_for
from gpufaas.keys import Keys
from gpufaas.packages import (
    DIGEST_PATTERN,
    DISK_FULL_ERRNOS,
    EMPTY_DIGEST,
    MAX_BATCH_MEMBERS,
    BoundedTarInfo,
    InvalidPackage,
    Manifest,
    PackageTooLarge,
    read_archive,
    stream_members,
)
from gpufaas.requirements import (
    REQUIREMENTS_FILE,
    Layer,
    PipRunner,
    RequirementsError,
    base_environment,
    parse_requirements,
    pip_runner,
    resolve,
)
from gpufaas.store import KeyValue, Store

log = logging.getLogger("gpufaas.gateway.artifacts")

WRITE_BATCH_BYTES = 4 << 20  # chunks of an upload through the API are written this many at a time
# The tar of small files one request may carry, compressed as sent and unpacked alike: a batch that
# gzip shrinks 1000-fold (zeros) is refused at its header past this, not read to the end (gpufaas
# deploy sends at most 64 MiB a batch).
MAX_BATCH_BYTES = 256 << 20
BATCH_MEMBER_MAX_BYTES = 16 << 20  # each read whole: bounded
PEER_TIMEOUT_S = 30.0  # a holder silent this long on one connection is passed over for the next
# An upload through the API that sends nothing for this long is ended (what came is kept): its
# client may be gone without closing, and the server has no read timeout on a body of its own.
BODY_IDLE_TIMEOUT_S = 60.0
REPLICATE_TIMEOUT_S = 60.0  # the most a commit waits for a second gateway to take its blobs
# A batch's blob that another transfer writes (a deploy beside it sharing a file) is waited for this
# long, asking every BATCH_BUSY_POLL_S, before the batch is refused (409: send it again later).
BATCH_BUSY_WAIT_S = 10.0
BATCH_BUSY_POLL_S = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class PeerAccess:
    """The Authorization headers this gateway shows other holders: `read`, to fetch blobs (nodes
    and gateways admit the node token); `write`, to push blobs to another gateway's blob server
    (the admin's). None: an insecure cluster, where holders ask for none."""

    read: str | None = None
    write: str | None = None

    @classmethod
    def of(cls, credentials: Credentials | None) -> PeerAccess:
        if credentials is None:
            return cls()
        admin = f"Bearer {credentials.admin_password}"
        return cls(f"Bearer {credentials.node_token}" if credentials.node_token else admin, admin)


class MissingBlobs(InvalidPackage):
    """A manifest names blobs this gateway does not hold (yet): upload them, then register."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(
            f"{len(missing)} blob(s) of this package are not uploaded (e.g. {missing[0]}); "
            "upload them (POST /system/blobs/missing says which), then register the manifest"
        )
        self.missing = missing


class Artifacts:
    """Blobs under `root` and packages in etcd, for one gateway, known to nodes as holder `name`."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        root: Path,
        *,
        name: str,
        max_unpacked_bytes: int,
        grace_s: float = 3600.0,
        run_pip: PipRunner | None = None,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        access: PeerAccess | None = None,
    ) -> None:
        """`access`: what this gateway shows other holders when its blob server is asked for a
        blob it lacks and fetches it (the API's routes pass their own)."""
        self.store = store
        self.keys = keys
        self.name = name
        self.blobs = BlobStore(root)
        empty_blob(self.blobs)
        self.max_unpacked_bytes = max_unpacked_bytes
        self.max_batch_bytes = max_batch_bytes
        self.grace_s = grace_s
        self.access = access or PeerAccess()
        self.url = ""  # where this gateway serves blobs (gpufaas.blobnet), once started
        self._server: BlobServer | None = None
        self._run_pip = run_pip if run_pip is not None else pip_runner(sys.executable)
        self._resolving: dict[str, asyncio.Task[Layer]] = {}
        self._ensuring: set[str] = set()  # blobs `ensure_blob` is fetching now

    # --- the blob server ------------------------------------------------------------------------
    def serve(self, listen: str, authorize: Authorizer, *, advertise: str | None = None, host: str = "") -> str:
        """Start the blob server (uploads taken, each at most the package limit; a blob asked for
        and not here fetched from another holder first, `ensure_blob`); its URL: `advertise`,
        else http://`host` (the gateway's public host) at the bound port. Called on the gateway's
        event loop, where those fetches run."""
        loop = asyncio.get_running_loop()
        server = BlobServer(
            self.blobs,
            authorize,
            accept_uploads=True,
            max_blob_bytes=self.max_unpacked_bytes,
            on_missing=lambda digest: self._ensure_from_thread(digest, loop),
        )
        bound = server.start(listen)
        self._server = server
        bound_host, _, port = bound.rpartition(":")
        self.url = advertise or f"http://{host or bound_host}:{port}"
        return self.url

    def _ensure_from_thread(self, digest: str, loop: asyncio.AbstractEventLoop) -> Path | None:
        """`ensure_blob` for the blob server's connection threads (a GET for a blob not here),
        run on the gateway's loop; None past the time one holder may take."""
        future = asyncio.run_coroutine_threadsafe(self.ensure_blob(digest, self.access), loop)
        try:
            return future.result(PEER_TIMEOUT_S)
        except Exception as exc:  # (whatever failed, the client hears 404 and asks another holder)
            future.cancel()
            log.info("blob %s asked of this gateway's blob server could not be fetched: %r", digest, exc)
            return None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def holder(self, fallback_url: str) -> HolderRecord:
        """This gateway as a blob holder: its blob server, else its API (`fallback_url`/system)."""
        return HolderRecord(self.name, "gateway", self.url or f"{fallback_url}/system")

    # --- uploads --------------------------------------------------------------------------------
    async def missing(self, wanted: dict[str, int]) -> tuple[list[str], dict[str, int]]:
        """Of `wanted` (digest -> size), those not held whole here, and how many bytes of each an
        earlier, broken upload left (where its next upload starts). Those held are marked wanted
        now: the collection leaves them be for another grace, while their package is on its way."""
        return await asyncio.to_thread(self._missing, wanted)

    def _missing(self, wanted: dict[str, int]) -> tuple[list[str], dict[str, int]]:
        missing = []
        for digest in wanted:
            path = self.blobs.path(digest)
            if path is None:
                missing.append(digest)
            else:
                with contextlib.suppress(OSError):
                    os.utime(path)
        offsets = {digest: n for digest in missing if (n := self.blobs.partial_size(digest))}
        return missing, offsets

    async def receive(self, digest: str, size: int, offset: int, chunks: AsyncIterator[bytes]) -> int:
        """One blob through the API (the slow path beside the blob server): `chunks` are its
        bytes from `offset` on. Returns the offset reached; raises CorruptBlob (bytes wrong),
        BlobBusy, or OffsetMismatch."""
        if size > self.max_unpacked_bytes:
            raise PackageTooLarge(f"a blob may not be larger than {self.max_unpacked_bytes} bytes (the limit)")
        if self.blobs.has(digest):
            return size
        writer = await asyncio.to_thread(self.blobs.writer, digest, size)
        try:
            if offset != writer.offset:
                raise OffsetMismatch(writer.offset)
            await _write_body(writer, chunks)
            if writer.offset == size:
                await asyncio.to_thread(writer.commit)
            return writer.offset
        finally:
            writer.close()

    async def receive_batch(self, spooled: Path, *, compressed: bool) -> dict[str, int]:
        """A tar of small blobs, each member named by its digest: every one verified and stored.
        Returns digest -> size of what it held."""
        return await asyncio.to_thread(self._receive_batch, spooled, compressed)

    def _receive_batch(self, spooled: Path, compressed: bool) -> dict[str, int]:
        stored: dict[str, int] = {}
        unpacked_bytes = 0
        try:
            with tarfile.open(spooled, mode="r|gz" if compressed else "r|", tarinfo=BoundedTarInfo) as tar:
                for member in stream_members(tar, limit=MAX_BATCH_MEMBERS, what="the blob batch"):
                    if not member.isfile() or not DIGEST_PATTERN.fullmatch(member.name):
                        raise InvalidPackage(f"member {member.name!r}: a blob batch holds files named sha256:<hex>")
                    unpacked_bytes += member.size
                    if unpacked_bytes > self.max_batch_bytes:
                        raise PackageTooLarge(
                            f"the blob batch unpacks to more than {self.max_batch_bytes} bytes (the limit); "
                            "send fewer blobs per batch"
                        )
                    if member.size > BATCH_MEMBER_MAX_BYTES:
                        raise PackageTooLarge(
                            f"blob {member.name} is {member.size} bytes; a batch holds blobs of at most "
                            f"{BATCH_MEMBER_MAX_BYTES}: send larger ones with PUT /system/blobs/DIGEST"
                        )
                    reader = tar.extractfile(member)
                    if reader is None:
                        continue
                    data = reader.read()
                    if hashlib.sha256(data).hexdigest() != member.name[7:]:
                        raise CorruptBlob(f"blob {member.name}: its bytes hash to something else; upload it again")
                    _put_waiting(self.blobs, data, member.name)
                    stored[member.name] = len(data)
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
                raise  # storing a blob failed: this gateway's disk, not the batch
            raise InvalidPackage(f"the blob batch is not a valid tar: {exc}") from None
        return stored

    async def receive_archive(self, spooled: Path) -> Manifest:
        """A whole package as a `.tar.gz` (the older upload): its files become blobs."""

        def store(path: str, size: int, reader: object) -> str:
            return self.blobs.ingest(reader.readinto, size)  # type: ignore[attr-defined]

        return await asyncio.to_thread(
            read_archive, spooled, store, max_unpacked_bytes=self.max_unpacked_bytes, compressed=True
        )

    # --- packages -------------------------------------------------------------------------------
    async def register(self, manifest: Manifest, access: PeerAccess | None = None) -> PackageRecord:
        """Record a package whose blobs are all here, fetching those that are not from the other
        holders first (`gather`; MissingBlobs when none has them, CorruptBlob if one has another
        size than the manifest says), resolving its requirements.txt (RequirementsError naming
        what cannot be had). Idempotent: a package registered already is answered as it is."""
        manifest.check(max_unpacked_bytes=self.max_unpacked_bytes)
        existing = await self.record(manifest.digest)
        missing = await self.gather(manifest, existing, access or PeerAccess())
        if existing is not None:
            if missing:  # its holders keep it; this gateway's copy comes with the next fetch
                log.warning("package %s: %d of its blobs are on no holder reached", existing.digest, len(missing))
            return await self._refreshed(existing) or existing  # (collected meanwhile: a deploy's hold says)
        if missing:
            raise MissingBlobs(missing)
        layer = await self._requirements(manifest)
        record = PackageRecord(manifest, self.name, layer, time.time())
        key = self.keys.package(manifest.digest)
        if not await self.store.compare_and_put(key, record.to_json(), mod_revision=0):
            raced = await self.record(manifest.digest)  # registered meanwhile (another gateway)
            if raced is not None:
                return raced
        log.info(
            "registered package %s (%d files, %d bytes)", manifest.digest, len(manifest.files), manifest.unpacked_bytes
        )
        return record

    # --- other holders --------------------------------------------------------------------------
    async def gather(self, manifest: Manifest, record: PackageRecord | None, access: PeerAccess) -> list[str]:
        """Fetch the blobs of `manifest` this gateway lacks from the other holders (those that
        hold `record` whole first, then the gateways: `sources_for`), largest first. Returns those
        still missing; CorruptBlob for a blob held here with another size than the manifest's."""
        missing: dict[str, int] = {}
        for digest, size in manifest.blobs().items():
            held = self.blobs.size(digest)
            if held is None:
                missing[digest] = size
            elif held != size:
                raise CorruptBlob(f"blob {digest} holds {held} bytes here; the manifest says {size}")
        if not missing:
            return []
        sources = sources_for(record, await read_holders(self.store, self.keys), me=self.name)
        still = []
        for digest in sorted(missing, key=lambda d: -missing[d]):
            if not await asyncio.to_thread(self._fetch, digest, missing[digest], sources, access):
                still.append(digest)
        if len(still) < len(missing):
            log.info("fetched %d blob(s) of package %s from other holders", len(missing) - len(still), manifest.digest)
        return still

    async def ensure_blob(self, digest: str, access: PeerAccess) -> Path | None:
        """Blob `digest`'s path here, fetched from another holder first if a registered package
        names it (its size comes from there) and this gateway lacks it; None if it cannot be had."""
        path = self.blobs.path(digest)
        if path is not None or digest in self._ensuring:
            # (Asked again while fetching it: another gateway that lacks it too asks back. It
            # hears 404 and goes on to the next holder, instead of the two asking each other.)
            return path
        self._ensuring.add(digest)
        try:
            for kv in await self.store.get_prefix(self.keys.packages):
                with contextlib.suppress(InvalidPackage):
                    record = PackageRecord.from_json(kv.value)
                    size = record.manifest.blobs().get(digest)
                    if size is not None:
                        sources = sources_for(record, await read_holders(self.store, self.keys), me=self.name)
                        await asyncio.to_thread(self._fetch, digest, size, sources, access)
                        return self.blobs.path(digest)
            return None
        finally:
            self._ensuring.discard(digest)

    def _fetch(self, digest: str, size: int, sources: list[HolderRecord], access: PeerAccess) -> bool:
        """One blob from the first holder that serves it whole and right (blocking); True once here.
        Gateways and nodes alike over the process's link TLS (plain where the cluster has none)."""
        for holder in sources:
            try:
                fetch_blob(holder.url, digest, size, self.blobs, authorization=access.read, timeout_s=PEER_TIMEOUT_S)
                return True
            except BlobBusy:  # another upload or fetch of it runs here: it is on its way
                time.sleep(0.2)
                if self.blobs.has(digest):
                    return True
            except (TransferError, CorruptBlob) as exc:
                log.info("blob %s not fetched from %s: %s", digest, holder.name, exc)
            except OSError as exc:  # this gateway's own disk (full): no other holder helps
                log.warning("blob %s could not be stored on this gateway: %s", digest, exc)
                break
        return self.blobs.has(digest)

    async def replicate(self, manifest: Manifest, access: PeerAccess) -> tuple[str | None, int]:
        """Push the blobs of `manifest` (all held here) to one other live gateway's blob server,
        within REPLICATE_TIMEOUT_S, so that the package outlives this gateway. Returns that
        gateway's name (None when none took them: logged) and how many other gateways were
        registered (0: a cluster of one gateway, where only the nodes' staging copies it)."""
        others = [h for h in await read_holders(self.store, self.keys) if h.kind == "gateway" and h.name != self.name]
        random.shuffle(others)  # spread the second copies over the gateways
        deadline_s = time.monotonic() + REPLICATE_TIMEOUT_S
        for holder in others:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                break
            try:
                await asyncio.wait_for(asyncio.to_thread(self._push, holder.url, manifest, access), left_s)
                return holder.name, len(others)
            except (TransferError, TimeoutError, OSError) as exc:
                log.warning("package %s: gateway %s did not take a copy: %s", manifest.digest, holder.name, exc)
        log.log(
            logging.WARNING if others else logging.INFO,
            "package %s is held by this gateway only (%d other gateway(s) registered, none took a copy)",
            manifest.digest,
            len(others),
        )
        return None, len(others)

    def _push(self, url: str, manifest: Manifest, access: PeerAccess) -> None:
        """Every blob of `manifest` to the blob server at `url` (those it holds cost a HEAD)."""
        for digest in manifest.blobs():
            path = self.blobs.path(digest)
            if path is None:
                raise TransferError(f"blob {digest} left this gateway before it was copied")
            # Over the link TLS: the admin's credential it shows never crosses the network in clear.
            upload_blob(url, path, digest, authorization=access.write, timeout_s=PEER_TIMEOUT_S)

    async def _refreshed(self, record: PackageRecord, *, always: bool = False) -> PackageRecord | None:
        """A package registered again (a redeploy, another function with it): young again for the
        collection, so that it cannot go before the deploy that follows (a collection that read it
        before fails its compare-and-delete). Unless `always`, a record younger than half the grace
        is left as it is (one write saved). None: it was collected meanwhile."""
        now = time.time()
        if not always and now - record.created_unix_s < self.grace_s / 2:
            return record
        key = self.keys.package(record.digest)
        kv = await self.store.get(key)
        fresh = dataclasses.replace(record, created_unix_s=now)
        if kv is None or not await self.store.compare_and_put(key, fresh.to_json(), mod_revision=kv.mod_revision):
            return await self.record(record.digest)  # collected (None), or written meanwhile
        return fresh

    async def record(self, digest: str) -> PackageRecord | None:
        return await read_package(self.store, self.keys, digest)

    async def hold(self, digest: str) -> PackageRecord | None:
        """A package a deploy is about to name, made young (`_refreshed`); None if not registered."""
        record = await self.record(digest)
        return None if record is None else await self._refreshed(record)

    async def unnamed(self, digest: str) -> None:
        """A package a function no longer names (it was updated to another, or deleted): young
        again for the collection, which measures its grace from then. Calls that arrived before
        the change may still run it (and a node fetch it) until their deadlines."""
        record = await self.record(digest)
        if record is not None:
            await self._refreshed(record, always=True)

    async def _requirements(self, manifest: Manifest) -> Layer | None:
        entry = manifest.file(REQUIREMENTS_FILE)
        if entry is None:
            return None
        path = self.blobs.path(entry.digest)
        assert path is not None  # checked present by `register`
        try:
            text = await asyncio.to_thread(path.read_text, encoding="utf-8")  # (not the locale's)
        except UnicodeDecodeError:
            raise RequirementsError(f"{REQUIREMENTS_FILE} is not UTF-8 text") from None
        requirements = parse_requirements(text)
        if not requirements:
            return None
        base = await self._base_environment()
        key = hashlib.sha256(repr((requirements, sorted(base.items()))).encode()).hexdigest()
        task = self._resolving.get(key)
        if task is None:  # two deploys of one requirements.txt resolve it once
            task = asyncio.create_task(
                asyncio.to_thread(resolve, requirements, base, run=self._run_pip), name=f"resolve {key[:12]}"
            )
            self._resolving[key] = task
            task.add_done_callback(lambda _: self._resolving.pop(key, None))
        return await asyncio.shield(task)

    async def _base_environment(self) -> dict[str, str]:
        """What the workers run with: a node's (they share one image), else this process's own."""
        for holder in await read_holders(self.store, self.keys):
            if holder.kind == "node" and holder.base_environment:
                return holder.base_environment
        return await asyncio.to_thread(base_environment)

    # --- collection -----------------------------------------------------------------------------
    async def collect(self, in_use: Iterable[str], now_unix_s: float) -> tuple[list[str], list[str]]:
        """Delete the packages no function names that are older than the grace, then the blobs
        (and broken uploads) no package record names that are older than it. Returns the
        packages and blobs deleted."""
        used = set(in_use)
        removed_packages = []
        kept: list[KeyValue] = []
        for kv in await self.store.get_prefix(self.keys.packages):
            digest = "sha256:" + kv.key.removeprefix(self.keys.packages)
            try:
                record = PackageRecord.from_json(kv.value)
            except InvalidPackage:
                continue
            old = digest not in used and now_unix_s - record.created_unix_s > self.grace_s
            if old and await self.store.compare_and_delete(kv.key, mod_revision=kv.mod_revision):
                removed_packages.append(digest)
                continue
            kept.append(kv)
        referenced: set[str] = set()
        for kv in kept:
            with contextlib.suppress(InvalidPackage):
                referenced.update(PackageRecord.from_json(kv.value).manifest.blobs())
        removed_blobs = await asyncio.to_thread(self._collect_blobs, referenced, now_unix_s)
        return removed_packages, removed_blobs

    def _collect_blobs(self, referenced: set[str], now_unix_s: float) -> list[str]:
        removed = []
        for digest in list(self.blobs.digests()):
            path = self.blobs.path(digest)
            if digest in referenced or digest == EMPTY_DIGEST or path is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                if now_unix_s - path.stat().st_mtime > self.grace_s and self.blobs.remove(digest):
                    removed.append(digest)
        old = self.grace_s

        def stale(digest: str) -> bool:
            with contextlib.suppress(FileNotFoundError):
                return now_unix_s - (self.blobs.root / "partial" / digest[7:]).stat().st_mtime <= old
            return True

        removed += self.blobs.discard_partials(keep=stale)
        return removed


def _put_waiting(blobs: BlobStore, data: bytes, digest: str) -> None:
    """Store a batch's blob (blocking); another transfer writing it now (an upload or a fetch of
    the same bytes) is waited for: it commits them, or it breaks off and these are written.
    BlobBusy if it still writes after BATCH_BUSY_WAIT_S."""
    deadline = time.monotonic() + BATCH_BUSY_WAIT_S
    while True:
        try:
            blobs.put(data, digest)
            return
        except BlobBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(BATCH_BUSY_POLL_S)


async def _write_body(writer: BlobWriter, chunks: AsyncIterator[bytes]) -> None:
    """Append `chunks` to `writer`, WRITE_BATCH_BYTES a write. UploadStalled when none comes for
    BODY_IDLE_TIMEOUT_S. Whatever ends it, what arrived before is written: kept for a resume."""
    batch: list[bytes] = []
    batched = 0
    try:
        async for chunk in idle_bounded(chunks):
            batch.append(chunk)
            batched += len(chunk)
            if batched >= WRITE_BATCH_BYTES:
                full, batch, batched = batch, [], 0  # (emptied first: a failed write is not tried again)
                await asyncio.to_thread(writer.write_many, full)
    except TimeoutError:
        raise UploadStalled(writer.offset + batched) from None
    finally:
        if batch:
            await asyncio.to_thread(writer.write_many, batch)


async def idle_bounded(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks`, and TimeoutError once none came for BODY_IDLE_TIMEOUT_S (its client is likely
    gone without closing: the server has no read timeout on a body of its own)."""
    pending = aiter(chunks)
    while True:
        try:
            async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):  # (no task per chunk, as wait_for makes)
                chunk = await anext(pending)
        except StopAsyncIteration:
            return
        yield chunk


class UploadStalled(InvalidPackage):
    """An upload whose client sent nothing for BODY_IDLE_TIMEOUT_S (`offset`: the bytes kept)."""

    def __init__(self, offset: int) -> None:
        super().__init__(
            f"no bytes of the upload came for {BODY_IDLE_TIMEOUT_S:g} s; send the rest with {UPLOAD_OFFSET}: {offset}"
        )
        self.offset = offset


class OffsetMismatch(InvalidPackage):
    """An upload that does not start where the blob's partial ends (`offset`)."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"this gateway holds {offset} bytes of the blob; send from Upload-Offset {offset}")
        self.offset = offset


def spool_limit_error(limit_bytes: int) -> PackageTooLarge:
    return PackageTooLarge(f"the request is larger than the limit of {limit_bytes} bytes")


async def spool(chunks: AsyncIterator[bytes], directory: Path, limit_bytes: int) -> tuple[Path, int, str]:
    """Write a request body to a temporary file in `directory` (PackageTooLarge past the limit,
    TimeoutError when it stops coming: `idle_bounded`; the file removed): its path, size and
    sha256 digest. The caller removes the file."""
    hasher = hashlib.sha256()
    size = 0
    fd, name = await asyncio.to_thread(_mkstemp, directory)
    try:
        batch: list[bytes] = []
        batched = 0
        async for chunk in idle_bounded(chunks):
            size += len(chunk)
            if size > limit_bytes:
                raise spool_limit_error(limit_bytes)
            hasher.update(chunk)
            batch.append(chunk)
            batched += len(chunk)
            if batched >= WRITE_BATCH_BYTES:
                await asyncio.to_thread(_write_all, fd, batch)
                batch, batched = [], 0
        if batch:
            await asyncio.to_thread(_write_all, fd, batch)
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    os.close(fd)
    return Path(name), size, "sha256:" + hasher.hexdigest()


def _write_all(fd: int, chunks: list[bytes]) -> None:
    """Append every byte of `chunks` (writev may write fewer, as a disk fills: then the rest,
    until the disk says why it takes no more)."""
    written = os.writev(fd, chunks)
    rest = memoryview(b"".join(chunks))[written:] if written < sum(len(c) for c in chunks) else memoryview(b"")
    while rest:
        rest = rest[os.write(fd, rest) :]


def _mkstemp(directory: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(dir=directory, suffix=".part")


def blob_authorizer(role_of: Callable[[bytes | None], object], admin: object, node: object) -> Authorizer:
    """The gateway's blob server admits the admin for anything, and nodes to read."""

    def authorize(method: str, authorization: str | None) -> tuple[int, str] | None:
        role = role_of(authorization.encode("latin-1") if authorization else None)
        if role is admin or (role is node and method in ("GET", "HEAD")):
            return None
        if role is None:
            return 401, "blobs need credentials: the admin's (`gpufaas login`) or, to read, a node's"
        return 403, "this credential may only read blobs; uploads need the admin credentials"

    return authorize


__all__ = [
    "Artifacts",
    "BlobBusy",
    "MissingBlobs",
    "OffsetMismatch",
    "PeerAccess",
    "UploadStalled",
    "blob_authorizer",
    "spool",
]
