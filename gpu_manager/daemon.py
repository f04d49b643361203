"""The GPU manager daemon: registers the node's GPUs in etcd and runs calls placed on them.

It serves gpufaas.wire connections:
- from gateways: Execute(token) + payload -> ExecuteReply + result. The token is a grant signed
  by the attached scheduler; the node checks it (gpu_manager.ledger) before running anything.
- from the scheduler: Attach (its token key; answered with the workers this node runs and what
  its disk and host pool hold), Revoke (grants never presented are refused from then on), Evict,
  Stage (packages to bring before their first call). Every call run is reported back on that
  connection with a Done (outcome, measured times, memory), and what the node holds with a
  Holdings whenever that changes.

Beside the wire it serves its staged blobs to peer nodes (gpufaas.blobnet) and keeps a holder
record in etcd saying where and which packages (gpufaas.holders).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import urllib.parse
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gpu_manager.containers import DEFAULT_IMAGE, DockerLauncher
from gpu_manager.devices import Device, Nvml
from gpu_manager.host_pool import HostModelPool, default_budget_bytes
from gpu_manager.ledger import GrantLedger, Refused
from gpu_manager.metrics import NodeMetrics
from gpu_manager.pool import ModelRun, RunResult, WeightsPlan, WorkerPool
from gpu_manager.sandbox import Isolation
from gpu_manager.staging import PackageStore
from gpufaas.blobnet import BlobServer
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.holders import HolderRecord, PackageRecord, read_holders, read_package
from gpufaas.keys import Keys
from gpufaas.packages import InvalidPackage
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.requirements import RequirementsError, base_environment
from gpufaas.store import LeaseKeeper, LeaseLost, Store, StoreError, list_and_watch
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, Server, max_frame_bytes_for

log = logging.getLogger("gpufaas.gpu_manager")
LEASE_TTL_S = 3  # the node's heartbeat: a node silent this long leaves the cluster
DEFAULT_HOST_CACHE_MB = 4096  # the cpu backend's host tier
PRUNE_INTERVAL_S = 10.0
PACKAGE_GRACE_S = 3600.0  # a staged package no worker uses is deleted once unused this long
DEFAULT_DISK_SHARE = 0.5  # of the state directory's free disk, for the blobs, when no budget is given
HOLDINGS_COALESCE_S = 0.05  # changes to what the node holds are reported at most this often
# Outcomes after which the model's worker is gone from the GPU (the scheduler drops its entry).
_WORKER_LOST = {pb.LOAD_FAILED, pb.WORKER_DIED}


class GpuManagerDaemon:
    """One per node. On start it registers `{root}/nodes/{node}` (address, GPUs, a fresh
    incarnation id) under its lease, so a restart is seen as a new incarnation whose cache is empty.
    """

    def __init__(
        self,
        store: Store,
        *,
        node: str,
        backend: str,
        devices: list[Device],
        state_dir: Path,
        keys: Keys | None = None,
        spares_per_gpu: int = 1,
        max_body_bytes: int = 16 * 1024 * 1024,
        host_cache_mb: int = 0,
        package_grace_s: float = PACKAGE_GRACE_S,
        wire_key: bytes | None = None,
        package_token: str | None = None,
        isolation: Isolation | None = None,
        runtime: str = "process",
        docker_image: str = DEFAULT_IMAGE,
        disk_cache_mb: int | None = None,
        pool_mb: int | None = None,
        pool_dir: Path | None = None,
        blob_listen: str = "127.0.0.1:0",
        blob_advertise: str | None = None,
    ) -> None:
        """`wire_key`: the cluster's wire key; the scheduler and gateways must prove it before the
        node reads anything from them. `package_token`: the bearer token blobs are fetched from
        other holders with, and that this node asks of those fetching from it. None: neither
        (tests of the logic only). `disk_cache_mb`: the disk the staged blobs may use (None:
        half the state directory's free space). `pool_mb`: the host model pool's size (None: half
        of `pool_dir`'s free memory; 0: no pool), in `pool_dir` (default: a directory of this
        node's in /dev/shm). `blob_listen`/`blob_advertise`: the blob server's address and the URL
        other holders are told."""
        if not devices:
            raise ValueError("a GPU manager needs at least one device")
        self.store = store
        self.keys = keys if keys is not None else Keys()
        self.node = node
        self.backend = backend
        self.devices = {device.gpu_id: device for device in devices}
        self.max_body_bytes = max_body_bytes
        self.package_grace_s = package_grace_s
        self.package_token = package_token
        self.holder_name = f"node-{node}"
        disk_budget = disk_cache_mb * 1024 * 1024 if disk_cache_mb else _free_bytes(state_dir, DEFAULT_DISK_SHARE)
        self.packages = PackageStore(
            state_dir,
            records=self._package_record,
            holders=self._holders,
            me=self.holder_name,
            authorization=f"Bearer {package_token}" if package_token else None,
            budget_bytes=disk_budget,
            in_use=self._packages_in_use,
            on_change=self._holdings_changed,
        )
        # Named after the state directory: several nodes of one machine (and test clusters) apart.
        tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
        pool_root = pool_dir or Path("/dev/shm") / f"gpufaas-pool-{tag}"
        pool_bytes = pool_mb * 1024 * 1024 if pool_mb is not None else default_budget_bytes(pool_root)
        self.host_pool = HostModelPool(pool_root, pool_bytes, in_use=self._pooled_in_use)
        self.blob_server = BlobServer(self.packages.blobs, self._authorize_blob)
        self._blob_listen = blob_listen
        self._blob_advertise = blob_advertise
        self.blob_url = ""
        self._base_environment: dict[str, str] = {}
        self._holdings_dirty = asyncio.Event()
        self.pool = WorkerPool(
            backend,
            gpus={d.gpu_id: d.index for d in devices},
            fetch_package=self.packages.fetch,
            prepare_weights=self._weights,
            spares_per_gpu=spares_per_gpu,
            max_body_bytes=max_body_bytes,
            host_cache_mb=host_cache_mb,
            isolation=isolation,
            runtime=runtime,
            launcher=DockerLauncher(docker_image) if runtime == "docker" else None,
            node=node,
        )
        self.ledger = GrantLedger(node, frozenset(self.devices))
        # The metrics' measure of each GPU's memory in use (cuda: NVML; the other backends have none).
        self._nvml = Nvml.open() if backend == "cuda" else None
        self.metrics = NodeMetrics(self.pool, node=node, device_used_mb=self._device_used_mb)
        self.incarnation = uuid.uuid4().hex
        self.address = ""
        self.context_mb = 0  # what one spare holds on its GPU (measured on cuda)
        self._scheduler: Connection | None = None
        self._server = Server(lambda: _Session(self), max_frame_bytes=max_frame_bytes_for(max_body_bytes), key=wire_key)
        self._lease: LeaseKeeper | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, listen: str = "127.0.0.1:0", *, advertise: str | None = None) -> str:
        """Serve on `listen`; register `advertise` (the address gateways and the scheduler dial:
        needed when listening on 0.0.0.0 in a container) or else the bound listen address."""
        await self.pool.check_runtime()
        self.pool.start()
        if self.backend == "cuda" and self.pool.spares_per_gpu:
            # The cache may only plan with what the spares leave free: measure one context first.
            hellos = await self.pool.spares_ready()
            self.context_mb = max((int(h.context_mb) for h in hellos), default=0)
        bound = await self._server.start(listen)
        self.address = advertise or bound
        # Peers reach the blob server on the host they reach the wire at, unless told otherwise.
        blob_port = self.blob_server.start(self._blob_listen).rpartition(":")[2]
        self.blob_url = self._blob_advertise or f"http://{self.address.rpartition(':')[0]}:{blob_port}"
        self.packages.my_host = urllib.parse.urlsplit(self.blob_url).hostname or ""
        self._base_environment = await asyncio.to_thread(base_environment)
        await self.packages.recover()
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        self._spawn(self._prune())
        self._spawn(self._report_holdings())
        key = self.keys.node(self.node)
        self._spawn(
            list_and_watch(
                self.store,
                key,  # a prefix: other nodes whose names start with ours are ignored below
                on_list=lambda kvs, _: None if any(kv.key == key for kv in kvs) else self._reregister(),
                on_event=lambda event: self._reregister() if event.key == key and event.kind == "delete" else None,
            )
        )
        log.info("node %s serving on %s with %d %s GPU(s)", self.node, self.address, len(self.devices), self.backend)
        return self.address

    async def stop(self) -> None:
        for task in list(self._tasks):  # first: the key's watch must not put it back when it goes
            task.cancel()
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        await self._server.close()
        await self.pool.shutdown()
        self.blob_server.stop()
        self.host_pool.close()
        if self._nvml is not None:
            self._nvml.close()

    async def _register(self, lease: int) -> None:
        spare_mb = self.context_mb * self.pool.spares_per_gpu
        record = NodeRecord(
            node=self.node,
            address=self.address,
            backend=self.backend,
            incarnation=self.incarnation,
            gpus=[GpuRecord(d.gpu_id, max(1, d.memory_mb - spare_mb), d.gpu_type) for d in self.devices.values()],
        )
        await self.store.put(self.keys.node(self.node), record.to_json(), lease=lease)
        await self._put_holder(lease)

    async def _put_holder(self, lease: int) -> None:
        holdings = self.holdings()
        holder = HolderRecord(
            self.holder_name,
            "node",
            self.blob_url,
            frozenset(holdings.staged),
            self._base_environment,
            frozenset(holdings.pooled),
        )
        await self.store.put(self.keys.holder(self.holder_name), holder.to_json(), lease=lease)

    async def _reregister(self) -> None:
        """The node's key went while the node runs (deleted by hand, say): put it back."""
        if self._lease is None:
            return
        log.warning("node %s: its key is gone from etcd; registering again", self.node)
        with contextlib.suppress(LeaseLost):  # the lease keeper re-registers under a new lease then
            await self._register(self._lease.lease)

    def _device_used_mb(self, gpu_id: str) -> int | None:
        return self._nvml.used_mb(self.devices[gpu_id].index) if self._nvml is not None else None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prune(self) -> None:
        """Now and then: forget old grants, unstage packages no worker has used for a while (and
        their weights in the host pool)."""
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_S)
            now = time.time()
            self.ledger.prune(now)
            with contextlib.suppress(OSError):
                removed = await self.packages.collect(self.pool.packages_in_use(), now, self.package_grace_s)
                if removed:
                    log.info("unstaged %d package(s) no worker used for %g s", len(removed), self.package_grace_s)
            staged = (self.packages.manifest(d) for d in self.packages.staged())
            self.host_pool.retain(f.digest for m in staged if m is not None for f in m.files)

    # --- packages, blobs, the host pool -------------------------------------------------------
    async def _package_record(self, digest: str) -> PackageRecord | None:
        return await read_package(self.store, self.keys, digest)

    async def _holders(self) -> list[HolderRecord]:
        return await read_holders(self.store, self.keys)

    def _authorize_blob(self, method: str, authorization: str | None) -> tuple[int, str] | None:
        """Peers (and gateways) read this node's blobs with the cluster's node token."""
        if self.package_token is None or authorization == f"Bearer {self.package_token}":
            return None if method in ("GET", "HEAD") else (405, "a node's blobs are read-only")
        return (401 if not authorization else 403), "reading a node's blobs needs the cluster's node token"

    async def _weights(self, digest: str, directory: Path) -> WeightsPlan:
        """A taking worker's weights from the host pool (copied in first if they are not there)
        and its requirements layer."""
        manifest = self.packages.manifest(digest)
        layer = self.packages.layer_dir(digest)
        if manifest is None:
            return WeightsPlan(layer_dir=str(layer or ""))
        was_pooled = self.host_pool.holds(manifest)
        started = time.perf_counter()
        pooled = await self.host_pool.admit(manifest, self.packages.blobs) or {}
        if pooled and not was_pooled:
            self._holdings_changed()
        return WeightsPlan(
            pooled=pooled,
            layer_dir=str(layer or ""),
            pool_s=0.0 if was_pooled else time.perf_counter() - started,
            from_pool=was_pooled,
        )

    def _packages_in_use(self) -> set[str]:
        return self.pool.packages_in_use()

    def _pooled_in_use(self) -> set[str]:
        """The pool's blobs that live workers map (never dropped under them)."""
        blobs: set[str] = set()
        for digest in self.pool.packages_in_use():
            manifest = self.packages.manifest(digest)
            if manifest is not None:
                blobs.update(d for _, d, _ in self.host_pool.weights(manifest))
        return blobs

    async def _stage(self, digest: str) -> None:
        """Pre-staging: the package on disk, and its weights in the host pool if they fit."""
        try:
            await self.packages.ensure(digest)
        except (InvalidPackage, RequirementsError, OSError) as exc:
            log.warning("could not stage package %s: %s", digest, exc)
            return
        manifest = self.packages.manifest(digest)
        if manifest is not None and await self.host_pool.admit(manifest, self.packages.blobs):
            self._holdings_changed()

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

    def _holdings_changed(self) -> None:
        self._holdings_dirty.set()

    async def _report_holdings(self) -> None:
        """Tell the scheduler (and etcd, for peers) what the node holds, when that changed."""
        while True:
            await self._holdings_dirty.wait()
            await asyncio.sleep(HOLDINGS_COALESCE_S)
            self._holdings_dirty.clear()
            scheduler = self._scheduler
            if scheduler is not None and not scheduler.is_closed:
                with contextlib.suppress(ConnectionLost):
                    scheduler.send(MessageType.HOLDINGS, self.holdings())
            if self._lease is not None:
                with contextlib.suppress(StoreError):
                    await self._put_holder(self._lease.lease)

    # --- calls from gateways ----------------------------------------------------------------
    async def execute(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Execute)
        received_s = time.perf_counter()
        try:
            grant = self.ledger.admit(request.token, time.time())
        except Refused as exc:
            log.info("refused a call from %s: %s", conn.peer, exc)
            conn.reply(frame, MessageType.EXECUTE_REPLY, pb.ExecuteReply(outcome=pb.REFUSED, message=str(exc)))
            return
        run = ModelRun(
            model=grant.model,
            package_digest=grant.package_digest,
            memory_mb=int(grant.memory_mb),
            max_batch_size=max(1, grant.max_batch_size),
            max_batch_wait_s=grant.max_batch_wait_s,
            environment=dict(grant.environment),
            load_time_s=grant.load_time_s,
            inference_time_s=grant.inference_time_s,
        )
        result = await self.pool.run(
            run,
            grant.gpu,
            grant.call_id,
            frame.body,
            content_type=request.content_type,
            timeout_s=max(0.001, grant.expires_unix_s - time.time()),
            evict=tuple(grant.evict),
            seq=grant.gpu_seq,
        )
        conn.reply(
            frame,
            MessageType.EXECUTE_REPLY,
            pb.ExecuteReply(
                outcome=result.outcome,  # type: ignore[arg-type]
                message=result.message,
                loaded=result.loaded,
                load_time_s=result.load_time_s,
                inference_time_s=result.inference_time_s,
                batch_calls=result.batch_calls,
                stages=result.stages,
                content_type=result.content_type,
                node_s=time.perf_counter() - received_s,
            ),
            result.output,
        )
        self.metrics.ran(grant.model, result)
        self._done(grant, result)

    def _done(self, grant: pb.Grant, result: RunResult) -> None:
        scheduler = self._scheduler
        if scheduler is None or scheduler.is_closed or grant.scheduler_id != self.ledger.scheduler_id:
            return  # the scheduler that placed it is gone: a new one learns the workers on attach
        scheduler.send(
            MessageType.DONE,
            pb.Done(
                call_id=grant.call_id,
                attempt=grant.attempt,
                gpu=grant.gpu,
                outcome=result.outcome,  # type: ignore[arg-type]
                loaded=result.loaded,
                load_time_s=result.load_time_s,
                inference_time_s=result.inference_time_s,
                peak_memory_mb=result.peak_memory_mb,
                batch_calls=result.batch_calls,
                worker_lost=result.outcome in _WORKER_LOST or result.worker_killed,
            ),
        )

    # --- requests from the scheduler --------------------------------------------------------
    def attach(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Attach)
        old, self._scheduler = self._scheduler, conn
        if request.scheduler_id != self.ledger.scheduler_id:
            self.pool.forget_grant_order()  # a new scheduler numbers its grants from 1
        self.ledger.attach(request.scheduler_id, request.token_key)
        if old is not None and old is not conn:
            old.close()
        log.info("scheduler %s attached from %s", request.scheduler_id, conn.peer)
        self.report_workers(conn, frame)

    def report_workers(self, conn: Connection, frame: Frame) -> None:
        """Answer with the models resident now (the workers that are ready), for reconciliation."""
        workers = [pb.Worker(gpu=gpu, model=model, memory_mb=mb) for model, gpu, _, mb in self.pool.workers()]
        parked = [pb.Worker(model=model, memory_mb=mb) for model, mb in self.pool.parked()]
        conn.reply(
            frame,
            MessageType.ATTACH_REPLY,
            pb.AttachReply(
                node=self.node,
                incarnation=self.incarnation,
                workers=workers,
                parked=parked,
                host_memory_mb=self.pool.host_cache_mb,
                holdings=self.holdings(),
            ),
        )

    def stage(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Stage)
        already = [d for d in request.packages if self.packages.path_for(d) is not None]
        conn.reply(frame, MessageType.STAGE_REPLY, pb.StageReply(staged=already))
        for digest in request.packages:
            if digest not in already:
                self._spawn(self._stage(digest))

    def revoke(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Revoke)
        unseen, seen = self.ledger.revoke(
            ((g.call_id, g.attempt) for g in request.grants), time.time(), claim_by_unix_s=request.claim_by_unix_s
        )
        conn.reply(
            frame,
            MessageType.REVOKE_REPLY,
            pb.RevokeReply(
                unseen=[pb.GrantRef(call_id=c, attempt=a) for c, a in unseen],
                seen=[pb.GrantRef(call_id=c, attempt=a) for c, a in seen],
            ),
        )

    async def evict(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Evict)
        if not request.gpu:  # the host tier's copies
            evicted = [model for model in request.models if await self.pool.release_from_host(model)]
        elif request.if_idle:  # a staged exit
            evicted = [
                model
                for model in request.models
                if await self.pool.release(model, request.gpu, to_host=request.to_host, seq=request.gpu_seq)
            ]
        else:
            evicted = [model for model in request.models if await self.pool.evict(model, request.gpu)]
        conn.reply(frame, MessageType.EVICT_REPLY, pb.EvictReply(evicted=evicted))

    def detached(self, conn: Connection) -> None:
        if self._scheduler is conn:
            self._scheduler = None


class _Session:
    """One accepted connection (a gateway's or the scheduler's): routes its frames."""

    def __init__(self, daemon: GpuManagerDaemon) -> None:
        self.daemon = daemon

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        daemon = self.daemon
        if frame.type == MessageType.EXECUTE:
            daemon._spawn(daemon.execute(conn, frame))
        elif frame.type == MessageType.ATTACH:
            daemon.attach(conn, frame)
        elif frame.type == MessageType.REVOKE:
            daemon.revoke(conn, frame)
        elif frame.type == MessageType.WORKERS:
            daemon.report_workers(conn, frame)
        elif frame.type == MessageType.EVICT:
            daemon._spawn(daemon.evict(conn, frame))
        elif frame.type == MessageType.STAGE:
            daemon.stage(conn, frame)
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, f"a GPU manager does not answer message type {frame.type}")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        with contextlib.suppress(Exception):
            self.daemon.detached(conn)


def _free_bytes(path: Path, share: float) -> int:
    """A share of the free space of the filesystem `path` is on."""
    import os

    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return int(stats.f_bavail * stats.f_frsize * share)
