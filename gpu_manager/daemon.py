"""The GPU manager daemon: registers the node's GPUs in etcd and serves Execute/Evict over gRPC."""

from __future__ import annotations

import contextlib
import logging
import uuid

import grpc
import httpx

from gpu_manager.devices import Device
from gpu_manager.packages import InvalidPackage, PackageCache
from gpu_manager.pool import HandlerError, RunTimeout, WorkerDied, WorkerPool
from gpu_manager.worker import WorkerSpec
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.proto import gpufaas_pb2_grpc as pb_grpc
from gpufaas.store import LeaseKeeper, Store

log = logging.getLogger("gpufaas.gpu_manager")
LEASE_TTL_S = 3  # the node's heartbeat: a node silent this long leaves the cluster


class GpuManagerDaemon(pb_grpc.GpuManagerServicer):
    """One per node. The scheduler guarantees one call at a time per GPU; the pool enforces it too.

    On start it registers `{root}/nodes/{node}` (address, GPUs, a fresh incarnation id) under its
    lease, so a restart is seen as a new incarnation whose cache is empty.
    """

    def __init__(
        self,
        store: Store,
        *,
        node: str,
        backend: str,
        devices: list[Device],
        pool: WorkerPool,
        packages: PackageCache,
        keys: Keys | None = None,
    ) -> None:
        if not devices:
            raise ValueError("a GPU manager needs at least one device")
        self.store = store
        self.keys = keys if keys is not None else Keys()
        self.node = node
        self.backend = backend
        self.devices = {device.gpu_id: device for device in devices}
        self.pool = pool
        self.packages = packages
        self.incarnation = uuid.uuid4().hex
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._lease: LeaseKeeper | None = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))

    async def start(self, listen: str = "127.0.0.1:0", *, advertise: str | None = None) -> str:
        """Serve gRPC on `listen`; register `advertise` (the address the scheduler dials: needed
        when listening on 0.0.0.0 in a container) or else the bound listen address."""
        self._server = grpc.aio.server()
        pb_grpc.add_GpuManagerServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        port = self._server.add_insecure_port(listen)
        self.address = advertise or f"{listen.rsplit(':', 1)[0]}:{port}"
        await self._server.start()
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        log.info("node %s serving on %s with %d %s GPU(s)", self.node, self.address, len(self.devices), self.backend)
        return self.address

    async def stop(self) -> None:
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.pool.shutdown()
        await self._http.aclose()

    async def _register(self, lease: int) -> None:
        record = NodeRecord(
            node=self.node,
            address=self.address,
            backend=self.backend,
            incarnation=self.incarnation,
            gpus=[GpuRecord(d.gpu_id, d.memory_mb, d.gpu_type) for d in self.devices.values()],
        )
        await self.store.put(self.keys.node(self.node), record.to_json(), lease=lease)

    async def _fetch(self, digest: str, url: str) -> bytes:
        if not url:
            kv = await self.store.get(self.keys.service("gateway"))
            if kv is None:
                raise InvalidPackage(f"package {digest} is not on this node and no gateway is registered to fetch it")
            url = f"{kv.value.decode()}/system/packages/{digest}"
        response = await self._http.get(url)
        if response.status_code != 200:
            raise InvalidPackage(f"fetching package {digest} from {url} failed with HTTP {response.status_code}")
        return response.content

    async def Execute(self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext) -> pb.ExecuteReply:  # noqa: N802
        device = self.devices.get(request.gpu)
        if device is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node {self.node} has no GPU {request.gpu!r}")
        assert device is not None
        for victim in request.evict:
            await self.pool.evict(victim, device.gpu_id)
        try:
            package_dir = await self.packages.ensure(
                request.package_digest, lambda digest: self._fetch(digest, request.package_url)
            )
        except (InvalidPackage, httpx.HTTPError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"function package unavailable: {exc}")
        spec = WorkerSpec(
            model=request.model,
            gpu_id=device.gpu_id,
            device_index=device.index,
            backend=self.backend,
            package_dir=str(package_dir),
            memory_mb=int(request.memory_mb),
            load_time_s=request.load_time_s or None,
            inference_time_s=request.inference_time_s or None,
        )
        try:
            result = await self.pool.run(spec, request.call_id, request.payload, timeout_s=request.timeout_s)
        except HandlerError as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        except RunTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except WorkerDied as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"worker died: {exc}")
        return pb.ExecuteReply(
            output=result.output,
            loaded=result.loaded,
            load_time_s=result.load_time_s,
            inference_time_s=result.inference_time_s,
            peak_memory_mb=result.peak_memory_mb,
        )

    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.EvictReply:  # noqa: N802
        evicted = False
        with contextlib.suppress(KeyError):
            evicted = await self.pool.evict(request.model, request.gpu)
        return pb.EvictReply(evicted=evicted)
