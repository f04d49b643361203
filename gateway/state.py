"""The gateway's state behind its routes: its configuration, the mirrors of etcd (functions,
nodes, the scheduler's address), the artifact store (packages and blobs), the router, and
per-function stats."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from gateway.artifacts import Artifacts, PeerAccess, blob_authorizer
from gateway.auth import Credentials, Role
from gateway.metrics import GatewayMetrics
from gateway.readiness import ReadinessProbe, readiness_of
from gateway.router import SCHEDULER_WAIT_S, Router
from gateway.stats import FunctionStats
from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.liveness import LoopLag, LoopLagCollector, run_loop_lag
from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB
from gpufaas.store import KeyValue, LeaseKeeper, Store, StoreError, WatchEvent, list_and_watch

log = logging.getLogger("gpufaas.gateway")

LEASE_TTL_S = 5


@dataclass
class GatewayConfig:
    state_dir: Path
    public_url: str = "http://127.0.0.1:8080"
    scheduler_address: str | None = None  # None: follow the leader's in etcd (services/scheduler)
    max_payload_bytes: int = 16 * 1024 * 1024
    max_package_bytes: int = 2 * 1024 * 1024 * 1024
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_MB * 1024 * 1024
    package_grace_s: float = 3600.0  # a package (or blob) no function uses is deleted once it is this old
    # The blob server (gpufaas.blobnet): where it listens (None: none; blobs then move through the
    # API only) and the URL nodes and the CLI are told (default: http://the bound address).
    blob_listen: str | None = "127.0.0.1:0"
    blob_advertise: str | None = None
    keys: Keys = field(default_factory=Keys)
    scheduler_wait_s: float = SCHEDULER_WAIT_S  # how long a call waits for a scheduler to (re)connect
    # Who may use which route (gateway.auth); None: anyone may use any (--insecure, development only).
    credentials: Credentials | None = None
    wire_key: bytes | None = None  # proved to the scheduler and the nodes (gpufaas.wire)


class ApiError(Exception):
    """An error answer: status, a message saying what went wrong and what to do."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class Gateway:
    """State behind the HTTP API: mirrors of the function registry and of the nodes fed by etcd
    (list, then watch), the artifact store, and the router (one connection to the scheduler,
    one per node)."""

    def __init__(self, store: Store, config: GatewayConfig) -> None:
        self.store = store
        self.config = config
        self.keys = config.keys
        self.spool_dir = config.state_dir / "spool"  # request bodies on their way into the store
        # Known to nodes as a blob holder by a name that survives restarts (its public URL).
        holder_name = "gateway-" + hashlib.sha256(config.public_url.encode()).hexdigest()[:12]
        self.artifacts = Artifacts(
            store,
            config.keys,
            config.state_dir / "blobs",
            name=holder_name,
            max_unpacked_bytes=config.max_unpacked_bytes,
            grace_s=config.package_grace_s,
            access=PeerAccess.of(config.credentials),
        )
        self.functions: dict[str, FunctionSpec] = {}
        # Per function written through this gateway whose change the watch has not brought yet:
        # the revision its events must pass to be newer than the mirror (`function_written`).
        self._function_floors: dict[str, int] = {}
        # Every call, once: the metrics, the overview (GET /system/overview), invocationCount.
        self.stats = FunctionStats()
        self.metrics = GatewayMetrics(self.stats, lambda: len(self.functions))
        self.loop_lag = LoopLag()  # this process's event-loop lag: /healthz and the metrics
        self.metrics.registry.register(LoopLagCollector(self.loop_lag, time.monotonic))
        self.router = Router(
            max_payload_bytes=config.max_payload_bytes,
            scheduler_address=config.scheduler_address,
            scheduler_wait_s=config.scheduler_wait_s,
            wire_key=config.wire_key,
        )
        self.readiness = ReadinessProbe(readiness_of(self.router, store))  # GET /healthz
        self.nodes: dict[str, NodeRecord] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._lease: LeaseKeeper | None = None
        self._blobs_served = False

    async def start(self) -> None:
        """List what the gateway mirrors (functions, the scheduler's address, the nodes' GPUs) and
        keep it current (StoreError if etcd cannot be reached now)."""
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.spool_dir.glob("*.part"):
            stale.unlink(missing_ok=True)
        # Every function's code is stored here: nobody but the gateway's user may look in.
        os.chmod(self.config.state_dir, 0o700)
        self.serve_blobs()
        mirrors = (
            (self.keys.functions, self._functions_listed, self._function_changed),
            (self.keys.services, self._services_listed, self._service_changed),
            (self.keys.nodes, self._nodes_listed, self._node_changed),
        )
        for prefix, on_list, on_event in mirrors:
            revision = await self.store.revision()
            on_list(await self.store.get_prefix(prefix), revision)
            self._tasks.append(
                asyncio.create_task(
                    list_and_watch(self.store, prefix, on_list=on_list, on_event=on_event, listed_at=revision)
                )
            )
        self.router.start()
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        self._tasks.append(asyncio.create_task(self._collect_packages()))
        self._tasks.append(asyncio.create_task(run_loop_lag(self.loop_lag)))

    def serve_blobs(self) -> None:
        """Start the blob server (`blob_listen`; None: none), once; OSError if it cannot bind. On
        the gateway's event loop. `start` calls it; a daemon calls it first, before its HTTP
        server, whose startup would print an OSError raised in `start` as a traceback."""
        if self.config.blob_listen is None or self._blobs_served:
            return
        credentials = self.config.credentials
        authorize = (
            blob_authorizer(credentials.role_of, Role.ADMIN, Role.NODE)
            if credentials is not None
            else (lambda method, authorization: None)
        )
        public_host = urllib.parse.urlsplit(self.config.public_url).hostname or ""
        self.artifacts.serve(self.config.blob_listen, authorize, advertise=self.config.blob_advertise, host=public_host)
        self._blobs_served = True

    async def _collect_packages(self) -> None:
        """Delete, now and then, the packages no function uses and the blobs no package names,
        once older than `package_grace_s` (the grace covers an upload whose deploy is on its way)."""
        while True:
            await asyncio.sleep(min(60.0, self.config.package_grace_s / 2))
            with contextlib.suppress(OSError, StoreError):
                await self.collect_packages(time.time())

    async def collect_packages(self, now_unix_s: float) -> tuple[list[str], list[str]]:
        """One collection (see `_collect_packages`): the packages and blobs deleted. What is in use
        is read from etcd, not from this gateway's mirror: a mirror whose watch lagged for longer
        than the grace would not hold another gateway's function, whose package would go."""
        in_use = set()
        for kv in await self.store.get_prefix(self.keys.functions):
            with contextlib.suppress(GpufaasError):
                in_use.add(FunctionSpec.from_json(kv.value).package_digest)
        packages, blobs = await self.artifacts.collect(in_use, now_unix_s)
        if packages or blobs:
            log.info(
                "deleted %d package(s) no function uses and %d blob(s) no package names", len(packages), len(blobs)
            )
        return packages, blobs

    async def stop(self) -> None:
        """Stop the gateway's tasks, withdraw its keys, close its links and its blob server; each
        step runs whatever an earlier one raised (which is raised at the end)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        try:
            if self._lease is not None:
                await self._lease.stop(revoke=True)
        finally:
            try:
                await self.router.stop()
            finally:
                self.artifacts.stop()

    async def _register(self, lease: int) -> None:
        await self.store.put(self.keys.service("gateway"), self.config.public_url.encode(), lease=lease)
        holder = self.artifacts.holder(self.config.public_url)
        await self.store.put(self.keys.holder(holder.name), holder.to_json(), lease=lease)

    # --- mirrors of etcd ------------------------------------------------------------------
    def _functions_listed(self, kvs: list[KeyValue], revision: int) -> None:
        """The registry at `revision`, but for a function written through this gateway that the
        list predates (its version there is the one the write replaced, or older): the mirror's.
        Where it cannot tell (the function is not listed, and the write replaced a version older
        than `revision`), the list: a write it missed comes with the watch, which resumes after it."""
        listed: dict[str, tuple[FunctionSpec, int]] = {}
        for kv in kvs:
            spec = self._spec_at(kv.key, kv.value)
            if spec is not None:
                listed[spec.name] = (spec, kv.mod_revision)
        functions = {name: spec for name, (spec, _) in listed.items()}
        for name, floor in list(self._function_floors.items()):
            listed_at = listed[name][1] if name in listed else None
            if (listed_at is not None and listed_at > floor) or (listed_at is None and floor <= revision):
                del self._function_floors[name]
                continue
            mine = self.functions.get(name)
            if mine is None:
                functions.pop(name, None)
            else:
                functions[name] = mine
        self.functions = functions

    def _function_changed(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(self.keys.functions)
        floor = self._function_floors.get(name)
        if floor is not None:
            if event.mod_revision <= floor:
                return  # older than what this gateway wrote since (the watch lags the writes)
            del self._function_floors[name]
        spec = None if event.kind == "delete" else self._spec_at(event.key, event.value)
        if spec is None:
            # Deleted, or overwritten with no spec of it: gone, as a re-list finds it (it was kept
            # until one, and answered meanwhile).
            self.function_deleted(name)
        else:
            self.function_written(spec)

    def _spec_at(self, key: str, value: bytes) -> FunctionSpec | None:
        """The function spec stored at `key`; None, with a warning, for one that is invalid or names
        another function (put by hand): mirrored by its own name, its key's delete took out nobody."""
        try:
            return FunctionSpec.stored_at(key, value, self.keys.function)
        except GpufaasError as exc:
            log.warning("ignoring invalid function spec at %s: %s", key, exc)
            return None

    def function_written(self, spec: FunctionSpec, *, over_revision: int = 0) -> None:
        """`spec` is the function's now (written through this gateway, or its watch brought it).
        `over_revision` (> 0: written through this gateway): the revision of the version it
        replaced, or the store's before a create; the watch's events of the function up to it,
        which may come after this, are older than `spec` and are ignored."""
        self._hold_back(spec.name, over_revision)
        old = self.functions.get(spec.name)
        if old is not None and old.model != spec.model:
            self.stats.drop(spec.name)  # a new package: its hit ratio and latency start afresh
        self.functions[spec.name] = spec

    def function_deleted(self, name: str, *, over_revision: int = 0) -> None:
        """The function is deleted (through this gateway: `over_revision` as `function_written`'s)."""
        self._hold_back(name, over_revision)
        self.functions.pop(name, None)
        self.stats.delete(name)  # its overview and its Prometheus series

    def _hold_back(self, name: str, over_revision: int) -> None:
        if over_revision > 0:
            self._function_floors[name] = max(self._function_floors.get(name, 0), over_revision)

    def _services_listed(self, kvs: list[KeyValue], revision: int) -> None:
        for kv in kvs:
            self._service_changed(WatchEvent("put", kv.key, kv.value, kv.mod_revision))

    def _service_changed(self, event: WatchEvent) -> None:
        """The leader key: the scheduler that leads now, to link to (unless one was configured)."""
        if event.key != self.keys.scheduler_leader or self.config.scheduler_address is not None:
            return
        if event.kind == "put":
            try:
                address = event.value.decode()
            except UnicodeDecodeError:  # (put by hand) raised out of the gateway's start, which failed
                log.warning("ignoring the scheduler address at %s: %r is not UTF-8", event.key, event.value)
                return
            self.router.set_scheduler_address(address)
        else:  # its lease expired or was revoked: the next leader puts it again
            log.info("no scheduler leads now; waiting for the next leader")

    def _nodes_listed(self, kvs: list[KeyValue], revision: int) -> None:
        before, self.nodes = self.nodes, {}
        for kv in kvs:
            self._node_changed(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
        for name, record in before.items():  # gone, or moved elsewhere, while the watch was down
            now = self.nodes.get(name)
            if now is None or now.address != record.address:
                self._node_left(record)

    def _node_changed(self, event: WatchEvent) -> None:
        """A node's key: its record, or its departure (its lease expired: cut off or dead, or it
        deregistered), which the router hears at once (`Router.node_left`), so that the calls on
        it end now rather than when the wire gives up on it."""
        name = event.key.removeprefix(self.keys.nodes)
        if event.kind == "delete":
            record = self.nodes.pop(name, None)
            if record is not None:
                self._node_left(record)
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = NodeRecord.from_json(event.value)
            old = self.nodes.get(name)
            self.nodes[name] = record
            if old is not None and old.address != record.address:
                self._node_left(old)  # it moved: nothing reaches it at the old address
            if old != record:
                self.router.node_joined(record.address)  # (back after a restart or a partition)

    def _node_left(self, record: NodeRecord) -> None:
        """`record`'s address is left, unless a node the mirror holds now registered there (the
        same process under a new name, or a new node at a reused address): its connection stays."""
        if any(other.address == record.address for other in self.nodes.values()):
            log.info("node %s left the cluster; its address is another node's now", record.node)
            return
        log.info("node %s left the cluster (its key is gone)", record.node)
        self.router.node_left(record.address)

    def largest_gpu_mb(self, gpu_type: str | None) -> int | None:
        """The largest registered GPU (of `gpu_type`, if given), in MB; None if none is known."""
        sizes = [g.memory_mb for n in self.nodes.values() for g in n.gpus if gpu_type in (None, g.gpu_type)]
        return max(sizes, default=None)
