"""What a node holds below its GPUs: its disk cache of packages (gpu_manager.staging), its host
model pool (gpu_manager.host_pool), the blob server its peers fetch from, and the holder record
that says where and what (gpufaas.holders) — the daemon's one handle on all of it.

The node reports what it holds (`holdings()`) to the scheduler, which prices misses by it, and
to etcd, where peers find blobs: `on_change` hears every change, coalesced by the daemon.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_manager.host_pool import DEFAULT_POOL_PARENT, HostModelPool, default_budget_bytes
from gpu_manager.pool import WeightsPlan
from gpu_manager.staging import NoRoom, PackageStore
from gpufaas.blobnet import BlobServer
from gpufaas.holders import HolderRecord, PackageRecord, read_holders, read_package
from gpufaas.keys import Keys
from gpufaas.packages import InvalidPackage
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.requirements import RequirementsError, base_environment
from gpufaas.store import Store, StoreError

log = logging.getLogger("gpufaas.gpu_manager.storage")

DEFAULT_DISK_SHARE = 0.5  # of the state directory's free disk, for the blobs, when no budget is given


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """How a node keeps what it holds below its GPUs, as the daemon's flags say.

    `package_token`: what peers must show to read this node's blobs, and what it shows to read
    theirs (None: nothing asked, nothing shown; tests of the logic only). `disk_cache_mb`: the
    disk the staged blobs may use (None: half the state directory's free space). `pool_mb`: the
    host model pool's size (None: half of `pool_dir`'s free memory; 0: no pool), in `pool_dir`
    (where the pool makes a directory of its own; None: /dev/shm). `blob_listen`: the blob
    server's address; `blob_advertise`: the URL other holders are told (None: the host the
    node's wire is reached at, the bound port).
    """

    package_token: str | None = None
    disk_cache_mb: int | None = None
    pool_mb: int | None = None
    pool_dir: Path | None = None
    blob_listen: str = "127.0.0.1:0"
    blob_advertise: str | None = None


def _check_pool_fits(pool: HostModelPool, pool_mb: int) -> None:
    """OSError naming --pool-mb, the pool closed, if its memory filesystem has less than `pool_mb`
    free: a pool asked for more would fail later, at some load, on a full filesystem. Measured once
    the pool removed what a crashed run of the node left there (its own space again)."""
    free_mb = default_budget_bytes(pool.root, 1.0) // (1024 * 1024)
    if pool_mb > free_mb:
        pool.close()
        raise OSError(
            f"--pool-mb {pool_mb}: {pool.root.parent} has {free_mb} MiB free; pass at most that, "
            "free memory there, or choose another --pool-dir"
        )


class NodeStorage:
    """The disk cache, the host pool and the blob server of node `node` (see the module), kept
    as `options` say. `in_use()` names the packages live workers hold (never evicted from disk
    or pool)."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        *,
        node: str,
        state_dir: Path,
        in_use: Callable[[], set[str]],
        on_change: Callable[[], None],
        options: StorageOptions,
    ) -> None:
        self.store = store
        self.keys = keys
        self.package_token = package_token = options.package_token
        self.name = f"node-{node}"
        self._in_use = in_use
        self._on_change = on_change
        disk_cache_mb = options.disk_cache_mb
        disk_budget = disk_cache_mb * 1024 * 1024 if disk_cache_mb else _free_bytes(state_dir, DEFAULT_DISK_SHARE)
        self.packages = PackageStore(
            state_dir,
            records=self._record,
            holders=self._holders,
            me=self.name,
            authorization=f"Bearer {package_token}" if package_token else None,
            budget_bytes=disk_budget,
            in_use=in_use,
            on_change=on_change,
        )
        # Named after the state directory: what a crashed run of this node left is found again.
        tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        pool_parent = options.pool_dir or DEFAULT_POOL_PARENT
        pool_mb = options.pool_mb
        pool_bytes = pool_mb * 1024 * 1024 if pool_mb is not None else None  # None: the pool's default
        self.host_pool = HostModelPool(pool_parent, pool_bytes, name=f"gpufaas-pool-{tag}", in_use=self._pooled_in_use)
        if pool_mb:
            _check_pool_fits(self.host_pool, pool_mb)
        self.blob_server = BlobServer(self.packages.blobs, self._authorize)
        self._blob_listen = options.blob_listen
        self._blob_advertise = options.blob_advertise
        self.blob_url = ""
        self._base_environment: dict[str, str] = {}

    async def start(self, wire_address: str) -> None:
        """Serve blobs; adopt what a previous run of the node staged. OSError naming the blob
        server's flag and address if it cannot listen (the node has three listeners)."""
        try:
            bound = self.blob_server.start(self._blob_listen)
        except OSError as exc:
            raise OSError(f"--blob-listen: cannot listen on {self._blob_listen}: {exc.strerror or exc}") from None
        # Peers reach the blob server on the host they reach the wire at, unless told otherwise.
        blob_port = bound.rpartition(":")[2]
        self.blob_url = self._blob_advertise or f"http://{wire_address.rpartition(':')[0]}:{blob_port}"
        self.packages.my_host = urllib.parse.urlsplit(self.blob_url).hostname or ""
        self._base_environment = await asyncio.to_thread(base_environment)
        await self.packages.recover()

    def stop(self) -> None:
        """Stop the blob server and close the host pool, whatever the first raised (the pool's
        files in /dev/shm must not outlive the node for a blob server that failed to stop)."""
        try:
            self.blob_server.stop()
        finally:
            self.host_pool.close()

    # --- what it holds ------------------------------------------------------------------------
    def holdings(self) -> pb.Holdings:
        staged = sorted(self.packages.staged())
        pooled = [d for d in staged if (m := self.packages.manifest(d)) is not None and self.host_pool.holds(m)]
        return pb.Holdings(
            staged=staged,
            pooled=pooled,
            disk_used_bytes=self.packages.used_bytes(),
            disk_budget_bytes=self.packages.budget_bytes or 0,
            pool_used_bytes=self.host_pool.used_bytes,
            pool_budget_bytes=self.host_pool.budget_bytes,
        )

    async def put_holder(self, lease: int) -> None:
        """This node's holder record in etcd, under its lease."""
        holdings = self.holdings()
        holder = HolderRecord(
            self.name,
            "node",
            self.blob_url,
            frozenset(holdings.staged),
            self._base_environment,
            frozenset(holdings.pooled),
        )
        await self.store.put(self.keys.holder(self.name), holder.to_json(), lease=lease)

    # --- staging, weights -----------------------------------------------------------------------
    async def stage(self, digest: str) -> None:
        """Pre-staging: the package on disk, and its weights in the host pool if they fit."""
        try:
            await self.packages.ensure(digest, make_room=False)  # a guess evicts nothing
        except NoRoom as exc:
            log.info("not pre-staging: %s", exc)
            return
        except (InvalidPackage, RequirementsError, OSError, StoreError) as exc:  # (StoreError: its record unread)
            log.warning("could not stage package %s: %s", digest, exc)
            return
        manifest = self.packages.manifest(digest)
        if manifest is not None and await self.host_pool.admit(manifest, self.packages.blobs, evict=False):
            self._on_change()

    async def weights(self, digest: str, directory: Path) -> WeightsPlan:
        """A taking worker's weights from the host pool (copied in first if they are not there)
        and its requirements layer (the worker pool's `prepare_weights`)."""
        manifest = self.packages.manifest(digest)
        layer = self.packages.layer_dir(digest)
        if manifest is None:
            return WeightsPlan(layer_dir=str(layer or ""))
        was_pooled = self.host_pool.holds(manifest)
        evicted = self.host_pool.evicted
        started = time.perf_counter()
        pooled = await self.host_pool.admit(manifest, self.packages.blobs) or {}
        # Also when it failed after pushing others' weights out: they are no longer held here.
        if (pooled and not was_pooled) or self.host_pool.evicted != evicted:
            self._on_change()
        return WeightsPlan(
            pooled=pooled,
            layer_dir=str(layer or ""),
            pool_s=0.0 if was_pooled else time.perf_counter() - started,
            from_pool=was_pooled,
        )

    async def prune(self, now_unix_s: float, grace_s: float) -> list[str]:
        """Unstage the packages no worker used for `grace_s` and drop their pool entries; the
        packages unstaged."""
        removed = await self.packages.collect(self._in_use(), now_unix_s, grace_s)
        staged = (self.packages.manifest(d) for d in self.packages.staged())
        self.host_pool.retain(f.digest for m in staged if m is not None for f in m.files)
        return removed

    # --- internals ------------------------------------------------------------------------------
    async def _record(self, digest: str) -> PackageRecord | None:
        return await read_package(self.store, self.keys, digest)

    async def _holders(self) -> list[HolderRecord]:
        return await read_holders(self.store, self.keys)

    def _authorize(self, method: str, authorization: str | None) -> tuple[int, str] | None:
        """Peers (and gateways) read this node's blobs with the cluster's node token."""
        expected = f"Bearer {self.package_token}"
        if self.package_token is None or hmac.compare_digest((authorization or "").encode(), expected.encode()):
            return None if method in ("GET", "HEAD") else (405, "a node's blobs are read-only")
        return (401 if not authorization else 403), "reading a node's blobs needs the cluster's node token"

    def _pooled_in_use(self) -> set[str]:
        """The pool's blobs that live workers map (never dropped under them)."""
        blobs: set[str] = set()
        for digest in self._in_use():
            manifest = self.packages.manifest(digest)
            if manifest is not None:
                blobs.update(d for _, d, _ in self.host_pool.weights(manifest))
        return blobs


def _free_bytes(path: Path, share: float) -> int:
    """A share of the free space of the filesystem `path` is on."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return int(stats.f_bavail * stats.f_frsize * share)
