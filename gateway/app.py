"""The HTTP gateway (FastAPI): function CRUD, package store, invocation (placed by the scheduler,
run on the node it names: gateway.router)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import gpufaas
from gateway.auth import OPEN_PATHS, AuthMiddleware, Credentials
from gateway.invoke import InvokeMiddleware
from gateway.metrics import GatewayMetrics
from gateway.router import SCHEDULER_WAIT_S, CallFailed, Router
from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError, InvalidInput
from gpufaas.functions import DIGEST_PATTERN, FUNCTION_SPEC_SCHEMA, NAME_PATTERN, FunctionSpec
from gpufaas.keys import Keys
from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB, InvalidPackage, PackageTooLarge, check_archive
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import KeyValue, LeaseKeeper, Store, StoreError, WatchEvent, list_and_watch

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
        used = {spec.package_digest.removeprefix("sha256:") for spec in self.functions.values()}
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
        else:
            with contextlib.suppress(GpufaasError):
                self.functions[name] = FunctionSpec.from_json(event.value)

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


# The write routes read their bodies themselves (a package is streamed; a spec's errors name its
# fields), so their bodies are described to OpenAPI here.
PACKAGE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the function's package: a .tar.gz with handler.py at its top (gpufaas.packages)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
SPEC_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"application/json": {"schema": FUNCTION_SPEC_SCHEMA}}}
}
DELETE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["functionName"],
                    "properties": {"functionName": {"type": "string", "pattern": NAME_PATTERN.pattern}},
                }
            }
        },
    }
}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


def create_app(store: Store, config: GatewayConfig) -> FastAPI:
    """The ASGI app. The store is opened and closed by the caller; the app owns the rest."""
    gateway = Gateway(store, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="gpufaas gateway", version=gpufaas.__version__, lifespan=lifespan)
    app.state.gateway = gateway
    if config.credentials is not None:  # every route but invocations (checked per function by InvokeMiddleware)
        app.add_middleware(AuthMiddleware, credentials=config.credentials)
    # Added last, so outermost: POST /function/{name} is answered before the rest (gateway.invoke).
    app.add_middleware(InvokeMiddleware, gateway=gateway)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(InvalidInput)
    async def on_invalid(request: Request, exc: InvalidInput) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(StoreError)
    async def on_store(request: Request, exc: StoreError) -> JSONResponse:
        return _error(503, f"the datastore (etcd) is unreachable: {exc}; check that etcd runs")

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", []) if p != "body")
        return _error(422, f"invalid request{' at ' + where if where else ''}: {first.get('msg', 'malformed')}")

    # --- health and info ------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Ready: the gateway reaches the scheduler (connected) and etcd (a read answered within
        a second). 503 otherwise, naming what is missing: calls would fail or wait."""
        scheduler = gateway.router.scheduler is not None
        try:
            async with asyncio.timeout(HEALTH_ETCD_TIMEOUT_S):
                await store.revision()
            etcd = True
        except (StoreError, TimeoutError):
            etcd = False
        ready = scheduler and etcd
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "scheduler": scheduler, "etcd": etcd},
            status_code=200 if ready else 503,
        )

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """Alive: the process answers (what a liveness probe restarts on; readiness is /healthz)."""
        return {"status": "ok"}

    @app.get("/system/info")
    async def info() -> dict[str, Any]:
        return {
            "provider": {
                "provider": "gpufaas",
                "orchestration": "gpufaas",
                "version": {"release": gpufaas.__version__},
            },
            "version": {"release": gpufaas.__version__},
            "arch": platform.machine(),
        }

    # --- packages -------------------------------------------------------------------------
    @app.post("/system/packages", status_code=201, openapi_extra=PACKAGE_BODY)
    async def upload_package(request: Request, digest: str | None = None) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_package_bytes:
            raise ApiError(413, f"the package is larger than the gateway's limit of {config.max_package_bytes} bytes")
        expected = digest or request.headers.get("x-package-digest")
        if expected is not None:
            gateway.package_path(expected)  # validates the form
        hasher = hashlib.sha256()
        size = 0
        with tempfile.NamedTemporaryFile(dir=gateway.packages_dir, delete=False, suffix=".part") as part:
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > config.max_package_bytes:
                        raise ApiError(413, f"the package is larger than the limit of {config.max_package_bytes} bytes")
                    hasher.update(chunk)
                    part.write(chunk)
            except BaseException:
                part.close()
                os.unlink(part.name)
                raise
        actual = f"sha256:{hasher.hexdigest()}"
        if size == 0:
            os.unlink(part.name)
            raise ApiError(400, "the package is empty; send the function's .tar.gz as the request body")
        if expected is not None and expected != actual:
            os.unlink(part.name)
            raise ApiError(400, f"the package's digest is {actual}, not {expected}: the upload was corrupted; retry it")
        try:  # refused at the door, not at its first call
            await asyncio.to_thread(check_archive, part.name, max_unpacked_bytes=config.max_unpacked_bytes)
        except InvalidPackage as exc:
            os.unlink(part.name)
            raise ApiError(413 if isinstance(exc, PackageTooLarge) else 400, str(exc)) from None
        os.replace(part.name, gateway.package_path(actual))
        return {"digest": actual, "size_bytes": size}

    @app.get("/system/packages/{digest}")
    async def download_package(digest: str) -> FileResponse:
        path = gateway.package_path(digest)
        if not path.exists():
            raise ApiError(404, f"package {digest} is not stored here; upload it with POST /system/packages")
        return FileResponse(path, media_type="application/gzip")

    # --- functions ------------------------------------------------------------------------
    async def spec_from(request: Request) -> FunctionSpec:
        try:
            raw = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body must be a JSON function spec") from None
        if isinstance(raw, dict):
            # OpenFaaS names the function "service" and its environment "envVars".
            if "service" in raw and "name" not in raw:
                raw["name"] = raw.pop("service")
            if "envVars" in raw and "environment" not in raw:
                raw["environment"] = raw.pop("envVars")
        spec = FunctionSpec.from_dict(raw)
        if not gateway.package_path(spec.package_digest).exists():
            raise ApiError(400, f"package {spec.package_digest} is not uploaded; POST it to /system/packages first")
        largest = gateway.largest_gpu_mb(spec.required_gpu_type)
        if largest is not None and spec.memory_mb > largest:
            kind = f"{spec.gpu} GPU" if spec.required_gpu_type else "GPU"
            raise ApiError(
                422,
                f"memory_mb {spec.memory_mb} is more than any {kind} of the cluster holds (the largest: {largest} MB); "
                "declare the model's real peak memory, or add a larger GPU",
            )
        return spec

    @app.post("/system/functions", status_code=202, openapi_extra=SPEC_BODY)
    async def deploy(request: Request) -> dict[str, Any]:
        spec = await spec_from(request)
        created = await store.compare_and_put(gateway.keys.function(spec.name), spec.to_json(), mod_revision=0)
        if not created:
            raise ApiError(409, f"function {spec.name!r} already exists; update it with PUT /system/functions")
        gateway.functions[spec.name] = spec
        return {"name": spec.name, "model": spec.model}

    @app.put("/system/functions", status_code=202, openapi_extra=SPEC_BODY)
    async def update(request: Request) -> dict[str, Any]:
        spec = await spec_from(request)
        key = gateway.keys.function(spec.name)
        for _ in range(5):
            current = await store.get(key)
            if current is None:
                raise ApiError(404, f"function {spec.name!r} does not exist; deploy it with POST /system/functions")
            if await store.compare_and_put(key, spec.to_json(), mod_revision=current.mod_revision):
                gateway.functions[spec.name] = spec
                return {"name": spec.name, "model": spec.model}
        raise ApiError(409, f"function {spec.name!r} is being changed concurrently; retry")

    async def describe(spec: FunctionSpec) -> dict[str, Any]:
        replicas_kv = await store.get(gateway.keys.replicas(spec.model))
        replicas = json.loads(replicas_kv.value) if replicas_kv is not None else []
        return {
            "name": spec.name,
            "package_digest": spec.package_digest,
            "model": spec.model,
            "memory_mb": spec.memory_mb,
            "gpu": spec.gpu,
            "batch_size": spec.batch_size,
            "timeout_s": spec.timeout_s,
            "labels": spec.labels,
            "environment": spec.environment,
            "max_batch_size": spec.max_batch_size,
            "max_batch_wait_ms": spec.max_batch_wait_ms,
            "public": spec.public,
            "invocationCount": sum(n for (name, _), n in gateway.invocations.items() if name == spec.name),
            "replicas": len(replicas),
            "gpus": replicas,
        }

    @app.get("/system/functions")
    async def list_functions() -> list[dict[str, Any]]:
        return [await describe(spec) for spec in sorted(gateway.functions.values(), key=lambda s: s.name)]

    @app.get("/system/function/{name}")
    async def get_function(name: str) -> dict[str, Any]:
        spec = gateway.functions.get(name)
        if spec is None:
            raise ApiError(404, f"function {name!r} is not deployed; list functions with GET /system/functions")
        return await describe(spec)

    @app.delete("/system/functions", status_code=202, openapi_extra=DELETE_BODY)
    async def delete(request: Request) -> dict[str, Any]:
        try:
            raw = await request.json()
        except (ValueError, UnicodeDecodeError):
            raw = None
        if not isinstance(raw, dict) or not isinstance(raw.get("functionName"), str):
            raise ApiError(400, 'the body must be JSON like {"functionName": "NAME"}')
        name = raw["functionName"]
        try:
            key = gateway.keys.function(name)
        except ValueError:
            raise ApiError(400, f"{name!r} is not a valid function name") from None
        if not await store.delete(key):
            raise ApiError(404, f"function {name!r} is not deployed")
        gateway.functions.pop(name, None)
        return {"name": name, "deleted": True}

    # --- cluster views --------------------------------------------------------------------
    async def cluster() -> pb.ClusterReply:
        try:
            return await gateway.router.cluster()
        except CallFailed as exc:
            raise ApiError(exc.status, exc.message) from None

    @app.get("/system/gpus")
    async def gpus() -> list[dict[str, Any]]:
        reply = await cluster()
        return [
            {
                "gpu": g.gpu,
                "node": g.node,
                "gpu_type": g.gpu_type,
                "status": g.status,
                "memory_used_mb": g.memory_used_mb,
                "memory_capacity_mb": g.memory_capacity_mb,
                "lru": list(g.lru),
                "local_queue": g.local_queue,
                "slots": g.slots,
                "running": list(g.running),
                "host_tier": list(g.host_tier),
            }
            for g in reply.gpus
        ]

    @app.get("/system/queue")
    async def queue() -> dict[str, Any]:
        reply = await cluster()
        return {
            "policy": reply.policy,
            "capacity": reply.queue_capacity,
            "length": len(reply.queue),
            "calls": [
                {"call_id": c.call_id, "function": c.function, "model": c.model, "waited_s": c.waited_s}
                for c in reply.queue
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the credentials every route but the open ones asks for."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "admin": {"type": "http", "scheme": "basic", "description": "user admin, the admin password"},
                "token": {"type": "http", "scheme": "bearer", "description": "the admin password"},
            }
            schema["security"] = [{"admin": []}, {"token": []}]
            for path, operations in schema["paths"].items():
                if path in OPEN_PATHS:
                    for operation in operations.values():
                        operation["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
