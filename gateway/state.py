"""The gateway's state behind its routes: its configuration, the mirrors of etcd (functions,
nodes, the scheduler's address), the package files on disk, the router, and per-function stats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import Credentials
from gateway.metrics import GatewayMetrics
from gateway.router import SCHEDULER_WAIT_S, Router
from gateway.stats import FunctionStats
from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError
from gpufaas.functions import DIGEST_PATTERN, FunctionSpec
from gpufaas.keys import Keys
from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB
from gpufaas.store import KeyValue, LeaseKeeper, Store, WatchEvent, list_and_watch

log = logging.getLogger("gpufaas.gateway")

LEASE_TTL_S = 5
HEALTH_ETCD_TIMEOUT_S = 1.0


@dataclass
class GatewayConfig:
    state_dir: Path
    public_url: str = "http://127.0.0.1:8080"
    scheduler_address: str | None = None  # None: look it up in etcd (services/scheduler)
    max_payload_bytes: int = 16 * 1024 * 1024
    max_package_bytes: int = 2 * 1024 * 1024 * 1024
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_MB * 1024 * 1024
    package_grace_s: float = 3600.0  # a package no function uses is deleted once it is this old
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
    (list, then watch), the package files on disk, and the router (one connection to the
    scheduler, one per node)."""

    def __init__(self, store: Store, config: GatewayConfig) -> None:
        self.store = store
        self.config = config
        self.keys = config.keys
        self.packages_dir = config.state_dir / "packages"
        self.functions: dict[str, FunctionSpec] = {}
        self.invocations: Counter[tuple[str, int]] = Counter()
        self.metrics = GatewayMetrics(self.invocations, lambda: len(self.functions))
        self.stats = FunctionStats()  # for the overview (GET /system/overview)
        self.router = Router(
            max_payload_bytes=config.max_payload_bytes,
            scheduler_address=config.scheduler_address,
            scheduler_wait_s=config.scheduler_wait_s,
            wire_key=config.wire_key,
        )
        self.nodes: dict[str, NodeRecord] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._lease: LeaseKeeper | None = None

    async def start(self) -> None:
        """List what the gateway mirrors (functions, the scheduler's address, the nodes' GPUs) and
        keep it current (StoreError if etcd cannot be reached now)."""
        self.packages_dir.mkdir(parents=True, exist_ok=True)
        # Every function's code is stored here: nobody but the gateway's user may look in.
        os.chmod(self.config.state_dir, 0o700)
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

    async def _collect_packages(self) -> None:
        """Delete, now and then, the stored packages that no function uses and that are older than
        `package_grace_s` (the grace covers an upload whose deploy is on its way)."""
        while True:
            await asyncio.sleep(min(60.0, self.config.package_grace_s / 2))
            with contextlib.suppress(OSError):
                removed = await asyncio.to_thread(self.collect_packages, time.time())
                if removed:
                    log.info("deleted %d package(s) no function uses", len(removed))

    def collect_packages(self, now_unix_s: float) -> list[str]:
        """One collection (see `_collect_packages`); returns the digests deleted."""
        # A thread runs this (asyncio.to_thread) while the loop may change `functions`: a snapshot.
        used = {spec.package_digest.removeprefix("sha256:") for spec in list(self.functions.values())}
        removed = []
        for path in self.packages_dir.glob("*.tar.gz"):
            hex_digest = path.name.removesuffix(".tar.gz")
            with contextlib.suppress(FileNotFoundError):
                if hex_digest not in used and now_unix_s - path.stat().st_mtime > self.config.package_grace_s:
                    path.unlink()
                    removed.append(f"sha256:{hex_digest}")
        return removed

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        await self.router.stop()

    async def _register(self, lease: int) -> None:
        await self.store.put(self.keys.service("gateway"), self.config.public_url.encode(), lease=lease)

    # --- mirrors of etcd ------------------------------------------------------------------
    def _functions_listed(self, kvs: list[KeyValue], revision: int) -> None:
        self.functions = {}
        for kv in kvs:
            with contextlib.suppress(GpufaasError):
                spec = FunctionSpec.from_json(kv.value)
                self.functions[spec.name] = spec

    def _function_changed(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(self.keys.functions)
        if event.kind == "delete":
            self.functions.pop(name, None)
            self.stats.drop(name)
        else:
            with contextlib.suppress(GpufaasError):
                spec = FunctionSpec.from_json(event.value)
                old = self.functions.get(name)
                if old is not None and old.model != spec.model:
                    self.stats.drop(name)  # a new package: its hit ratio and latency start afresh
                self.functions[name] = spec

    def _services_listed(self, kvs: list[KeyValue], revision: int) -> None:
        for kv in kvs:
            self._service_changed(WatchEvent("put", kv.key, kv.value, kv.mod_revision))

    def _service_changed(self, event: WatchEvent) -> None:
        if (
            event.key == self.keys.service("scheduler")
            and event.kind == "put"
            and self.config.scheduler_address is None
        ):
            self.router.set_scheduler_address(event.value.decode())

    def _nodes_listed(self, kvs: list[KeyValue], revision: int) -> None:
        self.nodes = {}
        for kv in kvs:
            self._node_changed(WatchEvent("put", kv.key, kv.value, kv.mod_revision))

    def _node_changed(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(self.keys.nodes)
        if event.kind == "delete":
            self.nodes.pop(name, None)
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            self.nodes[name] = NodeRecord.from_json(event.value)

    def largest_gpu_mb(self, gpu_type: str | None) -> int | None:
        """The largest registered GPU (of `gpu_type`, if given), in MB; None if none is known."""
        sizes = [g.memory_mb for n in self.nodes.values() for g in n.gpus if gpu_type in (None, g.gpu_type)]
        return max(sizes, default=None)

    # --- packages -------------------------------------------------------------------------
    def package_path(self, digest: str) -> Path:
        if not DIGEST_PATTERN.match(digest):
            raise ApiError(400, f"{digest!r} is not a package digest; expected 'sha256:' and 64 hex digits")
        return self.packages_dir / f"{digest.removeprefix('sha256:')}.tar.gz"
