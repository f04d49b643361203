"""The GPU manager daemon: registers the node's GPUs in etcd and runs calls placed on them.

It serves gpufaas.wire connections:
- from gateways: Execute(token) + payload -> ExecuteReply + result. The token is a grant signed
  by the attached scheduler; the node checks it (gpu_manager.ledger) before running anything.
- from the scheduler: Attach (its token key and epoch; answered with the workers this node runs
  and what its disk and host pool hold, or refused (FENCED) when the node has seen a newer
  leader's epoch), Revoke (grants never presented are refused from then on), Evict,
  Stage (packages to bring before their first call). Every call run is reported back on that
  connection with a Done (outcome, measured times, memory), and what the node holds with a
  Holdings whenever that changes.

Beside the wire it serves its staged blobs to peer nodes (gpufaas.blobnet) and keeps a holder
record in etcd saying where and which packages (gpufaas.holders). It watches the schedulers'
leader key in etcd: the newest leader's epoch fences off an older one (gpu_manager.ledger), even
before the new leader attaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from google.protobuf.message import Message
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_manager.containers import DEFAULT_IMAGE, DockerLauncher, node_instance
from gpu_manager.devices import Device, Nvml
from gpu_manager.drain import NodeDrain
from gpu_manager.ledger import GrantLedger, LeaseClosed, Refused
from gpu_manager.metrics import NodeMetrics
from gpu_manager.pool import ModelRun, RunResult, WorkerPool
from gpu_manager.sandbox import Isolation
from gpu_manager.storage import NodeStorage, StorageOptions
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.errors import GpufaasError
from gpufaas.grants import LEASE_KEEPING_OUTCOMES
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import KeyValue, LeaseKeeper, LeaseLost, Store, StoreError, WatchEvent, list_and_watch
from gpufaas.tls import LinkTls
from gpufaas.wire import (
    Connection,
    ConnectionLost,
    Frame,
    MessageType,
    Server,
    Unauthenticated,
    connect,
    max_frame_bytes_for,
)
from gpufaas.wire_local import serve_here, withdraw

log = logging.getLogger("gpufaas.gpu_manager")
LEASE_TTL_S = 3  # the node's heartbeat: a node silent this long leaves the cluster
DEFAULT_HOST_CACHE_MB = 4096  # the cpu backend's host tier
PRUNE_INTERVAL_S = 10.0
PACKAGE_GRACE_S = 3600.0  # a staged package no worker uses is deleted once unused this long
HOLDINGS_COALESCE_S = 0.05  # changes to what the node holds are reported at most this often
HOLDINGS_RETRY_S = 1.0  # a holder record etcd did not take is put again this often
NAME_PROBE_S = 1.0  # a registered address where nothing answers within this is a dead node's
# Outcomes after which the model's worker is gone from the GPU (the scheduler drops its entry).
_WORKER_LOST = {pb.LOAD_FAILED, pb.WORKER_DIED}


async def _holder_put(storage: NodeStorage, lease: int, *, failing: bool) -> bool:
    """Put the node's holder record; False where etcd did not take it (said once a streak)."""
    try:
        await storage.put_holder(lease)
    except StoreError as exc:
        if not failing:
            log.warning("cannot record this node's holdings in etcd (%s); retrying", exc)
        return False
    return True


class NodeNameTaken(GpufaasError):
    """Another running GPU manager is registered under this node's name."""


async def check_name_free(store: Store, key: str, address: str, server: Server) -> None:
    """NodeNameTaken if the node record at `key` is another running GPU manager's: two nodes of
    one name would overwrite each other's record (the scheduler would see a new incarnation at
    each write). A restart takes its key over at once, though its dead process's record stays
    until its lease's TTL: that record names this node's own `address` (same host and port), or
    an address where nothing answers now. Something that answers is taken for the live node: a
    wire handshake done, or refused once connected (under link TLS a node may not dial a node)."""
    existing = await store.get(key)
    if existing is None:
        return
    try:
        other = NodeRecord.from_json(existing.value)
    except ValueError:  # no node's record: registering replaces it
        return
    if other.address == address:
        return
    try:
        link = await connect(
            other.address, key=server.key, tls=server.tls or False, timeout_s=NAME_PROBE_S, dead_after_s=None
        )
    except Unauthenticated:
        pass
    except ConnectionLost:  # refused or silent: the node that registered it is gone
        return
    else:
        link.close()
    raise NodeNameTaken(
        f"node {other.node} is registered by another running GPU manager at {other.address}; "
        "give this one another --node"
    )


async def report_holdings(
    changed: asyncio.Event, tell_scheduler: Callable[[], None], put_holder: Callable[[bool], Awaitable[bool]]
) -> None:
    """The node's holdings loop: each time they `changed` (coalesced over HOLDINGS_COALESCE_S),
    told to the scheduler and put in etcd (`put_holder(failing)`: False where etcd did not take
    them). A put etcd refused is tried again every HOLDINGS_RETRY_S (peers fetch from where the
    record says) on its own: a change meanwhile still reaches the scheduler at once, and the
    scheduler is not told holdings again that did not change."""
    failing = False
    while True:
        if failing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLDINGS_RETRY_S):
                    await changed.wait()
        else:
            await changed.wait()
        if changed.is_set():
            await asyncio.sleep(HOLDINGS_COALESCE_S)
            changed.clear()
            tell_scheduler()
        failing = not await put_holder(failing)


class GpuManagerDaemon:
    """One per node. On start it registers `{root}/nodes/{node}` (address, GPUs, a fresh
    incarnation id) under its lease, so a restart is seen as a new incarnation whose cache is empty.

    `wire_key`: the cluster's wire key; the scheduler and gateways must prove it before the node
    reads anything from them. `storage`: how the node keeps packages, its host model pool and its
    blob server (gpu_manager.storage.StorageOptions; None: its defaults). `tls`: its wire
    server's (gpufaas.wire.Server's: True, the process's). `in_process`: dials of its address from
    this process reach it in memory (gpufaas.wire_local; a gateway running it, `python -m gateway
    --with-node`). The rest configure the worker pool (gpu_manager.pool).
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
        extra_spares: int = 0,
        max_body_bytes: int = 16 * 1024 * 1024,
        host_cache_mb: int = 0,
        package_grace_s: float = PACKAGE_GRACE_S,
        wire_key: bytes | None = None,
        isolation: Isolation | None = None,
        runtime: str = "process",
        docker_image: str = DEFAULT_IMAGE,
        storage: StorageOptions | None = None,
        tls: LinkTls | bool = True,
        in_process: bool = False,
    ) -> None:
        """See the class's docstring."""
        if not devices:
            raise ValueError("a GPU manager needs at least one device")
        self.store = store
        self.keys = keys if keys is not None else Keys()
        self.node = node
        self.backend = backend
        self.devices = {device.gpu_id: device for device in devices}
        self.max_body_bytes = max_body_bytes
        self.package_grace_s = package_grace_s
        self._holdings_dirty = asyncio.Event()
        self.storage = self._make_storage(state_dir, storage if storage is not None else StorageOptions())
        # NVML on cuda: the metrics' measure of each GPU's memory, and the pool's of each worker's.
        self._nvml = Nvml.open() if backend == "cuda" else None
        self.pool = self._make_pool(
            spares_per_gpu, extra_spares, host_cache_mb, isolation=isolation, runtime=runtime, docker_image=docker_image
        )
        self.ledger = GrantLedger(node, frozenset(self.devices))
        self.metrics = NodeMetrics(self.pool, node=node, device_used_mb=self._device_used_mb)
        self.metrics.registry.register(_LedgerCollector(self.ledger))
        self.incarnation = uuid.uuid4().hex
        self.drain = NodeDrain()  # its calls in flight, and its graceful stop (gpu_manager.drain)
        self.address = ""
        self.context_mb = 0  # what one spare holds on its GPU (measured on cuda)
        self._scheduler: Connection | None = None
        self._server = Server(
            lambda: _Session(self), max_frame_bytes=max_frame_bytes_for(max_body_bytes), key=wire_key, tls=tls
        )
        self.in_process = in_process
        self._lease: LeaseKeeper | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _make_storage(self, state_dir: Path, options: StorageOptions) -> NodeStorage:
        """The node's packages on disk, its host model pool and its blob server (see `__init__`)."""
        return NodeStorage(
            self.store,
            self.keys,
            node=self.node,
            state_dir=state_dir,
            in_use=self._packages_in_use,
            on_change=self._holdings_dirty.set,
            options=options,
        )

    def _make_pool(
        self,
        spares_per_gpu: int,
        extra_spares: int,
        host_cache_mb: int,
        *,
        isolation: Isolation | None,
        runtime: str,
        docker_image: str,
    ) -> WorkerPool:
        """The node's worker pool, over its devices and its storage's packages and weights."""
        return WorkerPool(
            self.backend,
            gpus={d.gpu_id: d.index for d in self.devices.values()},
            fetch_package=self.storage.packages.fetch,
            prepare_weights=self.storage.weights,
            spares_per_gpu=spares_per_gpu,
            extra_spares=extra_spares,
            max_body_bytes=self.max_body_bytes,
            host_cache_mb=host_cache_mb,
            isolation=isolation,
            runtime=runtime,
            launcher=_docker_launcher(self, docker_image) if runtime == "docker" else None,
            node=self.node,
            nvml=self._nvml,
            capacity_mb=self._capacity_mb,
        )

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
        if self.in_process:  # before the address is registered: no dial from here goes over TCP
            serve_here(self.address, self._server, role="node")
        try:
            await self._announce()
        except BaseException:
            if self.in_process:  # (a start that fails is not stopped: nothing else withdraws it)
                withdraw(self.address)
            raise
        log.info("node %s serving on %s with %d %s GPU(s)", self.node, self.address, len(self.devices), self.backend)
        return self.address

    async def _announce(self) -> None:
        """The blob server started, the node registered (`check_name_free`), and its watches begun."""
        await check_name_free(self.store, key := self.keys.node(self.node), self.address, self._server)
        await self.storage.start(self.address)
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        self._spawn(self._prune())
        self._spawn(self._report_holdings())
        self._spawn(
            list_and_watch(
                self.store,
                key,  # a prefix: other nodes whose names start with ours are ignored below
                on_list=lambda kvs, _: None if any(kv.key == key for kv in kvs) else self._reregister(),
                on_event=lambda event: self._reregister() if event.key == key and event.kind == "delete" else None,
            )
        )
        self._spawn(
            list_and_watch(
                self.store, self.keys.scheduler_leader, on_list=self._leaders_listed, on_event=self._leader_changed
            )
        )

    async def stop(self) -> None:
        """Stop serving and free what the node holds: each step runs whatever an earlier one raised
        (etcd down, a worker that will not die); one that failed is logged, not raised."""
        for task in list(self._tasks):  # first: the key's watch must not put it back when it goes
            task.cancel()
        lease, nvml = self._lease, self._nvml
        await _stop_steps(
            self.node,
            ("withdraw its key from etcd", lease.stop if lease is not None else lambda: None),  # (revokes it)
            ("withdraw its in-process address", lambda: withdraw(self.address) if self.in_process else None),
            ("close its wire server", self._server.close),
            ("stop its workers", self.pool.shutdown),
            ("stop its storage (blob server, host pool)", self.storage.stop),
            ("close NVML", nvml.close if nvml is not None else lambda: None),
        )

    def _capacity_mb(self, gpu_id: str) -> int:
        """What the scheduler may book on `gpu_id`: the device less its spares' contexts."""
        return max(1, self.devices[gpu_id].memory_mb - self.context_mb * self.pool.spares_per_gpu)

    async def _register(self, lease: int) -> None:
        await self.store.put(self.keys.node(self.node), node_record(self).to_json(), lease=lease)
        await self.storage.put_holder(lease)

    async def register_now(self) -> None:
        """Put the node's record again (under its lease), as it is now: draining, say."""
        if self._lease is not None:
            await self._register(self._lease.lease)

    async def _reregister(self) -> None:
        """The node's key went while the node runs (deleted by hand, say): put it back."""
        if self._lease is None:
            return
        log.warning("node %s: its key is gone from etcd; registering again", self.node)
        with contextlib.suppress(LeaseLost):  # the lease keeper re-registers under a new lease then
            await self._register(self._lease.lease)

    # --- the schedulers' leader key -------------------------------------------------------------
    def _leaders_listed(self, kvs: list[KeyValue], revision: int) -> None:
        for kv in kvs:
            if kv.key == self.keys.scheduler_leader:  # a prefix watch: not the keys that only start so
                self._saw_epoch(kv.create_revision)

    async def _leader_changed(self, event: WatchEvent) -> None:
        if event.key != self.keys.scheduler_leader or event.kind != "put":
            return
        with contextlib.suppress(StoreError):  # the event lacks the key's create_revision (the epoch)
            kv = await self.store.get(self.keys.scheduler_leader)
            if kv is not None:
                self._saw_epoch(kv.create_revision)

    def _saw_epoch(self, epoch: int) -> None:
        """A scheduler leads as `epoch`: an attached one of an older epoch is deposed; its link is
        closed and its grants are refused (the new leader attaches by itself)."""
        if self.ledger.saw_epoch(epoch) and self._scheduler is not None:
            log.warning(
                "the scheduler of epoch %d leads now: closing the link of the one attached (epoch %d)",
                self.ledger.epoch,
                self.ledger.scheduler_epoch,
            )
            self._scheduler.close()
            self._scheduler = None

    def _device_used_mb(self, gpu_id: str) -> int | None:
        return self._nvml.used_mb(self.devices[gpu_id].index) if self._nvml is not None else None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)  # (not ensure_future: its type checks ran on every Execute)
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
                removed = await self.storage.prune(now, self.package_grace_s)
                if removed:
                    log.info("unstaged %d package(s) no worker used for %g s", len(removed), self.package_grace_s)

    def _packages_in_use(self) -> set[str]:
        return self.pool.packages_in_use()

    async def _report_holdings(self) -> None:
        """Tell the scheduler (and etcd, for peers) what the node holds, when that changed."""

        def tell_scheduler() -> None:
            scheduler = self._scheduler
            if scheduler is not None and not scheduler.is_closed:
                _send(scheduler, MessageType.HOLDINGS, self.storage.holdings())

        async def put_holder(failing: bool) -> bool:
            return self._lease is None or await _holder_put(self.storage, self._lease.lease, failing=failing)

        await report_holdings(self._holdings_dirty, tell_scheduler, put_holder)

    # --- calls from gateways ----------------------------------------------------------------
    async def execute(self, conn: Connection, frame: Frame, request: pb.Execute) -> None:
        received_s = time.perf_counter()
        now_unix_s = time.time()
        lease_call_id = request.lease_call_id
        try:
            grant = self._admit(request, now_unix_s)
        except Refused as exc:
            # A lease that ended is routine (the gateway places the call: counted in
            # gpufaas_node_calls_refused_under_leases); a grant or a lease token refused is not.
            (log.debug if isinstance(exc, LeaseClosed) else log.info)("refused a call from %s: %s", conn.peer, exc)
            conn.reply(frame, MessageType.EXECUTE_REPLY, pb.ExecuteReply(outcome=pb.REFUSED, message=str(exc)))
            return
        run = ModelRun(
            model=grant.model,
            package_digest=grant.package_digest,
            memory_mb=int(grant.memory_mb),
            worker=grant.worker,
            load_time_s=grant.load_time_s,
            inference_time_s=grant.inference_time_s,
        )
        # The gateway's: what remains of this call's deadline (a lease's grant holds its first call's).
        timeout_s = request.timeout_s if lease_call_id else grant.expires_unix_s - now_unix_s
        if request.timeout_s > 0:
            timeout_s = min(timeout_s, request.timeout_s)
        lease = (grant.call_id, grant.attempt) if grant.lease_s else None
        try:
            result = await self.pool.run(
                run,
                grant.gpu,
                lease_call_id or grant.call_id,
                frame.body,
                content_type=request.content_type,
                timeout_s=max(0.001, timeout_s),
                evict=() if lease_call_id else tuple(grant.evict),  # (a lease's own call made the room)
                seq=grant.gpu_seq,
            )
        except Exception:  # (a bug): answered at once, its slot freed, as a failed call's
            result = _run_failed(self.node, lease_call_id or grant.call_id)
        except BaseException:
            if lease is not None:
                self.ledger.lease_call_ended(lease, time.time(), keep=False, done=False)
            raise
        if lease is not None:  # before the answer: its gateway may send the lease's next call at once
            self.ledger.lease_call_ended(lease, time.time(), keep=_keeps_lease(result))
        conn.reply(
            frame,
            MessageType.EXECUTE_REPLY,
            pb.ExecuteReply(
                **measured(result),
                message=result.message,
                stages=result.stages,
                content_type=result.content_type,
                node_s=time.perf_counter() - received_s,
            ),
            result.output,
        )
        # The rest waits a turn of the loop: where the gateway and the scheduler share this process
        # (`python -m gateway --with-node`), the answer then reaches the caller before the scheduler
        # takes the Done, which costs the caller nothing (its slot is freed a few us later).
        asyncio.get_running_loop().call_soon(self._ran, grant, result, lease_call_id)

    def _admit(self, request: pb.Execute, now_unix_s: float) -> pb.Grant:
        """The grant an Execute runs under: its placement's, or a lease's (`lease_call_id`); Refused."""
        if not request.lease_call_id:
            return self.ledger.admit(request.token, now_unix_s)
        if not request.timeout_s > 0:
            raise Refused("a call under a lease must say what remains of its deadline (Execute.timeout_s)")
        return self.ledger.admit_under_lease(request.token, now_unix_s)

    def _ran(self, grant: pb.Grant, result: RunResult, lease_call_id: str = "") -> None:
        lease_ended = bool(grant.lease_s) and self.ledger.lease_done_sent((grant.call_id, grant.attempt))
        scheduler = self._scheduler
        if scheduler is not None and not scheduler.is_closed and grant.scheduler_id == self.ledger.scheduler_id:
            # (else the scheduler that placed it is gone: a new one learns the workers on attach)
            done = done_message(grant, result)
            done.lease_call_id, done.lease_ended = lease_call_id, lease_ended
            _send(scheduler, MessageType.DONE, done)  # first: what frees the call's slot
        self.metrics.ran(grant.model, result)

    # --- requests from the scheduler --------------------------------------------------------
    def attach(self, conn: Connection, frame: Frame) -> None:
        attached = admit_scheduler(self.ledger, conn, frame, self._scheduler)
        if attached is None:
            return
        request, new_scheduler = attached
        if new_scheduler:
            self.pool.forget_grant_order()  # a new scheduler numbers its grants from 1
        self._scheduler = conn
        log.info("scheduler %s (epoch %d) attached from %s", request.scheduler_id, request.epoch, conn.peer)
        self.report_workers(conn, frame)

    def report_workers(self, conn: Connection, frame: Frame) -> None:
        """Answer with the models resident now (the workers that are ready), for reconciliation."""
        workers = [pb.Worker(gpu=gpu, model=model, memory_mb=mb) for model, gpu, _, mb in self.pool.workers()]
        parked = [pb.Worker(model=model, memory_mb=mb) for model, mb in self.pool.parked()]
        reply = pb.AttachReply(
            node=self.node,
            incarnation=self.incarnation,
            workers=workers,
            parked=parked,
            host_memory_mb=self.pool.host_cache_mb,
            holdings=self.storage.holdings(),
        )
        conn.reply(frame, MessageType.ATTACH_REPLY, reply)

    def stage(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Stage)
        already = [d for d in request.packages if self.storage.packages.path_for(d) is not None]
        conn.reply(frame, MessageType.STAGE_REPLY, pb.StageReply(staged=already))
        for digest in request.packages:
            if digest not in already:
                self._spawn(self.storage.stage(digest))

    def revoke(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Revoke)
        unseen, seen = self.ledger.revoke(
            ((g.call_id, g.attempt) for g in request.grants),
            time.time(),
            claim_by_unix_s=request.claim_by_unix_s,
            if_idle=request.if_idle,
        )
        busy = [ref for ref in seen if self.ledger.lease_busy(ref)]  # (a lease's: its last Done will say)
        conn.reply(
            frame,
            MessageType.REVOKE_REPLY,
            pb.RevokeReply(
                unseen=[pb.GrantRef(call_id=c, attempt=a) for c, a in unseen],
                seen=[pb.GrantRef(call_id=c, attempt=a) for c, a in seen],
                busy=[pb.GrantRef(call_id=c, attempt=a) for c, a in busy],
            ),
        )

    async def evict(self, conn: Connection, frame: Frame, request: pb.Evict) -> None:
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
            self.ledger.end_leases()  # it counts their slots free once it has lost this node


def node_record(node: GpuManagerDaemon) -> NodeRecord:
    """The record `node` registers in etcd: its address, GPUs, incarnation and whether it drains."""
    return NodeRecord(
        node=node.node,
        address=node.address,
        backend=node.backend,
        incarnation=node.incarnation,
        gpus=[GpuRecord(d.gpu_id, node._capacity_mb(d.gpu_id), d.gpu_type, link=d.link) for d in node.devices.values()],
        draining=node.drain.draining,
    )


async def _stop_steps(node: str, *steps: tuple[str, Callable[[], Awaitable[None] | None]]) -> None:
    """Run each of `steps` (what it does, the step) in turn, whatever an earlier one raised: a
    failure is logged once with its traceback and the next step runs; nothing is raised."""
    for what, step in steps:
        try:
            outcome = step()
            if outcome is not None:
                await outcome
        except Exception:
            log.exception("node %s: stopping, could not %s; going on", node, what)


def _docker_launcher(node: GpuManagerDaemon, image: str) -> DockerLauncher:
    """The docker runtime's engine for `node`, its containers labelled with this node of this
    cluster: its name, key root and state directory (gpu_manager.containers.node_instance)."""
    state_dir = node.storage.packages.root
    return DockerLauncher(image, node_instance(node.node, root=node.keys.root, state_dir=state_dir))


def _send(scheduler: Connection, type_: int, message: Message) -> None:
    """Send `message` to the scheduler if its link takes it: one lost while its last frames are
    still handled is not closed yet, but takes nothing (NotSent); the scheduler learns what the
    node holds and runs when it attaches again."""
    with contextlib.suppress(ConnectionLost):
        scheduler.send(type_, message)


def admit_scheduler(
    ledger: GrantLedger, conn: Connection, frame: Frame, current: Connection | None
) -> tuple[pb.Attach, bool] | None:
    """A scheduler's `Attach` frame on `conn`, put to `ledger`: None when it is fenced (answered
    FENCED), else the request and whether it comes from a scheduler the ledger did not know (whose
    grants are numbered afresh). `current`, the link it replaces, is closed if it is another."""
    request = frame.message(pb.Attach)
    new_scheduler = request.scheduler_id != ledger.scheduler_id
    try:
        ledger.attach(request.scheduler_id, request.token_key, request.epoch)
    except Refused as exc:
        log.warning("refused a scheduler from %s: %s", conn.peer, exc)
        conn.reply_error(frame, pb.FENCED, str(exc))
        return None
    if current is not None and current is not conn:
        current.close()
    return request, new_scheduler


def measured(result: RunResult) -> dict[str, Any]:
    """What a run's answer (`ExecuteReply`) and its Done share: its outcome and what was measured."""
    return {
        "outcome": result.outcome,
        "loaded": result.loaded,
        "load_time_s": result.load_time_s,
        "inference_time_s": result.inference_time_s,
        "batch_calls": result.batch_calls,
    }


def _run_failed(node: str, call_id: str) -> RunResult:
    """The answer of a call whose run raised (a bug, or an error the pool makes no RunResult of),
    logged with its traceback (to be called in the `except`). Its worker may have run it, so its
    outcome is unknown: OUTCOME_UNSPECIFIED (no Outcome names that), which the gateway answers 502
    with this message; a lease under it ends, and its Done frees its slot as a failed call's."""
    log.exception("call %s: its run on node %s raised", call_id, node)
    return RunResult(
        pb.OUTCOME_UNSPECIFIED,
        f"the outcome of call {call_id!r} is unknown: node {node} failed while running it (an internal error, "
        "logged there), so it was not run again (check its effects before retrying)",
    )


def _keeps_lease(result: RunResult) -> bool:
    """Whether a lease goes on after a call under it answered `result` (gpufaas.grants'
    LEASE_KEEPING_OUTCOMES, the gateway's rule too): not once its worker is lost, killed or timed
    out (the scheduler drops the model there where it is gone, and the next call is placed)."""
    return result.outcome in LEASE_KEEPING_OUTCOMES and not result.worker_killed


def done_message(grant: pb.Grant, result: RunResult) -> pb.Done:
    """The Done a node sends the scheduler that placed `grant` once its run answered `result`."""
    return pb.Done(
        **measured(result),
        call_id=grant.call_id,
        attempt=grant.attempt,
        gpu=grant.gpu,
        peak_memory_mb=result.peak_memory_mb,
        worker_lost=result.outcome in _WORKER_LOST or result.worker_killed,
    )


class _LedgerCollector(Collector):
    """What the node's grant ledger admitted and refused, and the newest leader's epoch it has
    seen, read when scraped."""

    def __init__(self, ledger: GrantLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        ledger = self._ledger
        yield CounterMetricFamily("gpufaas_node_grants_admitted", "Grants this node admitted.", value=ledger.admitted)
        yield CounterMetricFamily(
            "gpufaas_node_calls_admitted_again",
            "Grants admitted for a call admitted here before under another attempt or scheduler: a retry after its "
            "worker died, or a call placed twice (what fencing the schedulers' epochs prevents).",
            value=ledger.admitted_again,
        )
        yield CounterMetricFamily(
            "gpufaas_node_calls_admitted_under_leases",
            "Calls admitted under a lease (docs/hit-leases.md): sent by a gateway without a placement of their own.",
            value=ledger.admitted_under_leases,
        )
        yield CounterMetricFamily(
            "gpufaas_node_calls_refused_under_leases",
            "Calls refused under a lease that had ended, or under which a call ran: their gateways placed them.",
            value=ledger.refused_under_leases,
        )
        yield CounterMetricFamily(
            "gpufaas_node_grants_refused_stale",
            "Grants refused because a newer scheduler leader's epoch has been seen (a deposed leader's).",
            value=ledger.refused_stale,
        )
        yield GaugeMetricFamily(
            "gpufaas_node_scheduler_epoch",
            "The newest scheduler leader's epoch this node has seen.",
            value=ledger.epoch,
        )


# Who may send each message a node answers, by the role its TLS certificate names (a plain link has
# no role: the HMAC handshake alone admitted it, and any message goes).
SENDERS: dict[int, str] = {
    MessageType.EXECUTE: "gateway",
    MessageType.ATTACH: "scheduler",
    MessageType.REVOKE: "scheduler",
    MessageType.WORKERS: "scheduler",
    MessageType.EVICT: "scheduler",
    MessageType.STAGE: "scheduler",
}


class _Session:
    """One accepted connection (a gateway's or the scheduler's): routes its frames."""

    def __init__(self, daemon: GpuManagerDaemon) -> None:
        self.daemon = daemon
        # The daemon's handler of each message type: execute and evict run as its tasks, the
        # others answer at once. Each is parsed here, so that a malformed one closes the link (the
        # wire's rule) instead of failing a task that never answers.
        self._routes: dict[int, Callable[[Connection, Frame], object]] = {
            MessageType.EXECUTE: lambda conn, frame: daemon._spawn(
                daemon.drain.tracked(daemon.execute(conn, frame, frame.message(pb.Execute)))
            ),
            MessageType.ATTACH: self._attach,
            MessageType.REVOKE: self._revoke,
            MessageType.WORKERS: daemon.report_workers,
            MessageType.EVICT: lambda conn, frame: daemon._spawn(daemon.evict(conn, frame, frame.message(pb.Evict))),
            MessageType.STAGE: daemon.stage,
        }

    def _attach(self, conn: Connection, frame: Frame) -> None:
        self.daemon.attach(conn, frame)
        self.daemon.drain.attached = self.daemon._scheduler is not None

    def _revoke(self, conn: Connection, frame: Frame) -> None:
        """A Revoke answered (the daemon's), then, if marked `drained` and sent by the attached
        scheduler, counted by the node's drain."""
        self.daemon.revoke(conn, frame)
        if conn is self.daemon._scheduler:
            self.daemon.drain.revoked(frame.message(pb.Revoke), self.daemon.ledger.scheduler_id)

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        route = self._routes.get(frame.type)
        sender = SENDERS.get(frame.type)
        if route is not None and sender is not None and conn.peer_role not in (None, sender):
            # Both roles reach this port and share the cluster secret; only the certificate tells
            # them apart, so a gateway's cannot attach with an epoch of its choosing (and fence the
            # real leader out) nor a scheduler's run calls.
            log.warning(
                "refused message type %d from a %s's certificate: only a %s sends it",
                frame.type,
                conn.peer_role,
                sender,
            )
            if frame.is_request:
                conn.reply_error(frame, pb.UNAUTHENTICATED, f"only the {sender} sends message type {frame.type}")
        elif route is not None:
            route(conn, frame)
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, f"a GPU manager does not answer message type {frame.type}")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        with contextlib.suppress(Exception):
            self.daemon.detached(conn)
        self.daemon.drain.attached = self.daemon._scheduler is not None
