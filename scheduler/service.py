"""The scheduler service: the pure Scheduler behind gRPC, fed by etcd, dispatching to GPU managers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from cache_manager import CacheManager
from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError, ModelTooLarge, UnknownModel
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys, gpu_address, split_gpu_address
from gpufaas.profiles import paper_table1
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.proto import gpufaas_pb2_grpc as pb_grpc
from gpufaas.store import KeyValue, LeaseKeeper, Store, StoreError, WatchEvent
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler.core import Scheduler
from scheduler.decisions import Dispatch
from scheduler.estimator import Estimator
from scheduler.policies import PolicyConfig, make_policy

log = logging.getLogger("gpufaas.scheduler")

# Each hop hands the next one a little less time than it has itself, so the inner hop reports a
# deadline before the outer one gives up waiting (one end-to-end deadline per invocation).
DEADLINE_MARGIN_S = 0.05
MAX_ATTEMPTS = 2  # a call whose worker died is retried once
LEASE_TTL_S = 5
# Changes are written to etcd within this long, coalesced: a burst of calls costs one write per
# key that changed, not one per call (a GPU that went busy and idle again in between costs none).
FLUSH_DELAY_S = 0.02
PROFILE_WRITE_INTERVAL_S = 5.0  # measured times move a little on every call: persist them calmly


class NodeClient(Protocol):
    """One narrow handle per GPU manager (STYLE §4)."""

    async def execute(self, request: pb.ExecuteRequest, timeout_s: float) -> pb.ExecuteReply: ...
    async def close(self) -> None: ...


class GrpcNodeClient:
    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GpuManagerStub(self._channel)  # type: ignore[no-untyped-call]

    async def execute(self, request: pb.ExecuteRequest, timeout_s: float) -> pb.ExecuteReply:
        reply: pb.ExecuteReply = await self._stub.Execute(request, timeout=max(0.001, timeout_s))
        return reply

    async def close(self) -> None:
        await self._channel.close(grace=None)


@dataclass(slots=True)
class _Call:
    """One invocation from Invoke to its answer. Lifecycle: created by Invoke, resolved (future)
    by _execute or by a deadline, forgotten when Invoke returns."""

    request: Request
    spec: FunctionSpec
    payload: bytes
    deadline: float  # monotonic
    submitted_at: float
    future: asyncio.Future[pb.InvokeReply]
    attempts: int = 0
    dispatched_at: float = 0.0


@dataclass(slots=True)
class _Node:
    record: NodeRecord
    client: NodeClient
    gpu_ids: list[str] = field(default_factory=list)


async def _reachable(address: str, timeout_s: float = 1.0) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            return False
        return True


class CallFailed(Exception):
    """Resolves a call with a gRPC status for the gateway to translate."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class SchedulerService(pb_grpc.SchedulerServicer):
    """Hosts the pure scheduler and cache manager.

    Learns nodes and GPUs from etcd (watch), persists every change of LRU lists, replicas, GPU
    status and profiles back to etcd (coalesced by one flusher task), rebuilds its cache state
    from etcd on start, and dispatches over gRPC, feeding measured times to the estimator. All
    scheduler state is touched from the event loop only, so no lock is needed.
    """

    def __init__(
        self,
        store: Store,
        *,
        keys: Keys | None = None,
        policy: str = "lalb-o3",
        max_num_skips: int = 25,
        queue_capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        node_client: Callable[[str], NodeClient] = GrpcNodeClient,
    ) -> None:
        self.store = store
        self.keys = keys if keys is not None else Keys()
        self.policy_name = policy
        self.queue_capacity = queue_capacity
        self.clock = clock
        self._node_client = node_client
        self.scheduler = Scheduler(
            make_policy(policy, PolicyConfig(max_num_skips=max_num_skips)),
            estimator=Estimator(paper_table1()),
            cache=CacheManager(),
        )
        self._functions: dict[str, FunctionSpec] = {}
        self._nodes: dict[str, _Node] = {}
        self._calls: dict[str, _Call] = {}
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._gateway_url = ""
        self._dirty_gpus: set[str] = set()
        self._dirty_models: set[str] = set()
        self._dirty_profiles: set[tuple[str, str, int]] = set()  # (gpu type, model, batch size)
        self._deleted_gpus: set[str] = set()
        self._flush_wanted = asyncio.Event()
        self._written: dict[str, bytes] = {}  # last value put per key: unchanged values are not rewritten
        self._profile_written_at: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._server: grpc.aio.Server | None = None
        self._lease: LeaseKeeper | None = None
        self.address = ""

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, listen: str = "127.0.0.1:0", *, advertise: str | None = None) -> str:
        """Recover state from etcd, start watching, serve gRPC; returns the address registered in
        etcd for gateways to find (`advertise`, else the bound listen address)."""
        revision = await self._recover()
        self._server = grpc.aio.server()
        pb_grpc.add_SchedulerServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        port = self._server.add_insecure_port(listen)
        host = listen.rsplit(":", 1)[0]
        self.address = advertise or f"{host}:{port}"
        await self._server.start()
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        self._tasks = [
            asyncio.create_task(self._watch(self.keys.functions, revision, self._on_function_event)),
            asyncio.create_task(self._watch(self.keys.nodes, revision, self._on_node_event)),
            asyncio.create_task(self._watch(self.keys.services, revision, self._on_service_event)),
            asyncio.create_task(self._flusher()),
        ]
        self._kick()
        log.info("scheduler serving on %s (policy %s, %d GPUs)", self.address, self.policy_name, len(self._gpu_ids()))
        return self.address

    async def stop(self) -> None:
        for task in [*self._tasks, *self._inflight.values()]:
            task.cancel()
        for task in [*self._tasks, *self._inflight.values()]:
            with contextlib.suppress(BaseException):
                await task
        await self._flush()
        if self._server is not None:
            await self._server.stop(grace=0.5)
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        for node in self._nodes.values():
            await node.client.close()

    async def _register(self, lease: int) -> None:
        await self.store.put(self.keys.service("scheduler"), self.address.encode(), lease=lease)

    async def _recover(self) -> int:
        """Rebuild functions, nodes and every GPU's cache from etcd; returns the revision read."""
        revision = await self.store.revision()
        for kv in await self.store.get_prefix(self.keys.functions):
            self._apply_function(kv.key, kv.value)
        for kv in await self.store.get_prefix(self.keys.services):
            self._apply_service(kv.key, kv.value)
        for kv in await self.store.get_prefix(self.keys.profiles):
            self._apply_profile(kv)
        for kv in await self.store.get_prefix(self.keys.nodes):
            with contextlib.suppress(ValueError, KeyError):
                await self._add_node(NodeRecord.from_json(kv.value))
        live = set(self._gpu_ids())
        for kv in await self.store.get_prefix(self.keys.gpus):
            parsed = self.keys.parse_gpu_key(kv.key)
            if parsed is None:
                continue
            node, gpu, kind = parsed
            address = gpu_address(node, gpu)
            if kind != "lru":
                continue
            if address not in live:
                self._deleted_gpus.add(address)  # a GPU that left while no scheduler ran
                continue
            items = json.loads(kv.value)
            # Stored most recent first: admit oldest first so the recency order comes back.
            for item in reversed(items):
                self.scheduler.register_model(ModelSpec(item["model"], int(item["memory_mb"])))
                self.scheduler.cache.admit(address, item["model"], int(item["memory_mb"]))
        self._flush_wanted.set()
        return revision

    # --- watches --------------------------------------------------------------------------
    async def _watch(self, prefix: str, revision: int, apply: Callable[[WatchEvent], Any]) -> None:
        start = revision + 1
        while True:
            try:
                async for event in self.store.watch_prefix(prefix, start_revision=start):
                    start = event.mod_revision + 1
                    result = apply(event)
                    if asyncio.iscoroutine(result):
                        await result
            except asyncio.CancelledError:
                raise
            except StoreError as exc:
                log.warning("watch on %s failed (%s); retrying", prefix, exc)
                await asyncio.sleep(0.5)

    def _on_function_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self._apply_function(event.key, event.value)
        else:
            self._functions.pop(event.key.removeprefix(self.keys.functions), None)

    def _apply_function(self, key: str, value: bytes) -> None:
        try:
            spec = FunctionSpec.from_json(value)
        except GpufaasError as exc:
            log.warning("ignoring invalid function spec at %s: %s", key, exc)
            return
        self._functions[spec.name] = spec
        self.scheduler.register_model(ModelSpec(spec.model, spec.memory_mb, spec.required_gpu_type))

    def _on_service_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self._apply_service(event.key, event.value)

    def _apply_service(self, key: str, value: bytes) -> None:
        if key == self.keys.service("gateway"):
            self._gateway_url = value.decode()

    def _apply_profile(self, kv: KeyValue) -> None:
        with contextlib.suppress(ValueError, KeyError):
            gpu_type, model = kv.key.removeprefix(self.keys.profiles).split("/", 1)
            raw = json.loads(kv.value)
            if raw.get("load_time_s") is not None:
                self.scheduler.estimator.observe_load(model, gpu_type, float(raw["load_time_s"]))
            for batch, seconds in raw.get("inference_time_s", {}).items():
                self.scheduler.estimator.observe_inference(model, gpu_type, int(batch), float(seconds))

    async def _on_node_event(self, event: WatchEvent) -> None:
        node = event.key.removeprefix(self.keys.nodes)
        if event.kind == "delete":
            log.info("node %s left the cluster (lease expired or removed)", node)
            await self._remove_node(node)
        else:
            try:
                record = NodeRecord.from_json(event.value)
            except (ValueError, KeyError) as exc:
                log.warning("ignoring invalid node record for %s: %s", node, exc)
                return
            known = self._nodes.get(node)
            if known is not None and known.record == record:
                return
            if known is not None:
                # A restarted GPU manager: its workers, and so its cached models, are gone.
                log.info("node %s re-registered (incarnation %s)", node, record.incarnation)
                await self._remove_node(node)
            await self._add_node(record)
        self._kick()

    async def _add_node(self, record: NodeRecord) -> None:
        node = _Node(record, self._node_client(record.address))
        for gpu in record.gpus:
            address = gpu_address(record.node, gpu.gpu)
            self.scheduler.add_gpu(GpuSpec(address, gpu.memory_mb, gpu.gpu_type))
            node.gpu_ids.append(address)
            self._deleted_gpus.discard(address)
            self._dirty_gpus.add(address)
        self._nodes[record.node] = node
        self._flush_wanted.set()

    async def _remove_node(self, name: str) -> None:
        node = self._detach_node(name)
        if node is not None:
            await node.client.close()

    def _detach_node(self, name: str) -> _Node | None:
        """Take a node's GPUs out: their running and parked calls go back to the front of the
        global queue in arrival order, their cache entries are dropped."""
        node = self._nodes.pop(name, None)
        if node is None:
            return None
        for address in node.gpu_ids:
            running = self.scheduler.gpu(address).running
            models = list(self.scheduler.cache.models_on(address))
            requeued = self.scheduler.remove_gpu(address)
            if running is not None:
                task = self._inflight.pop(running.request_id, None)
                if task is not None:
                    task.cancel()
            for request in requeued:
                call = self._calls.get(request.request_id)
                if call is None:  # its caller is gone: nobody waits for it
                    self.scheduler.cancel(request.request_id)
            self._dirty_models.update(models)
            self._deleted_gpus.add(address)
            self._dirty_gpus.discard(address)
        self._flush_wanted.set()
        return node

    async def _probe(self, node: _Node) -> None:
        """Re-admit a node that was unreachable once it answers again, if etcd still lists the
        same incarnation (a new incarnation arrives through the watch instead)."""
        await node.client.close()
        record = node.record
        while record.node not in self._nodes:
            await asyncio.sleep(1.0)
            with contextlib.suppress(StoreError, ValueError, KeyError):
                kv = await self.store.get(self.keys.node(record.node))
                if kv is None or NodeRecord.from_json(kv.value) != record:
                    return  # it left, or restarted: the watch handles both
                client = self._node_client(record.address)
                if await _reachable(record.address):
                    if record.node not in self._nodes:
                        log.info("node %s answers again; re-admitting it", record.node)
                        await self._add_node(record)
                        self._kick()
                    await client.close()
                    return
                await client.close()

    def _gpu_ids(self) -> list[str]:
        return [gpu for node in self._nodes.values() for gpu in node.gpu_ids]

    # --- gRPC: Invoke ---------------------------------------------------------------------
    async def Invoke(self, request: pb.InvokeRequest, context: grpc.aio.ServicerContext) -> pb.InvokeReply:  # noqa: N802
        now = self.clock()
        spec = self._functions.get(request.function)
        if spec is None:
            # A deploy that just happened may not have reached the watch yet: read through once.
            with contextlib.suppress(ValueError, StoreError):
                kv = await self.store.get(self.keys.function(request.function))
                if kv is not None:
                    self._apply_function(kv.key, kv.value)
                    spec = self._functions.get(request.function)
        if spec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"function {request.function!r} is not deployed")
        assert spec is not None
        if len(self.scheduler.queue) >= self.queue_capacity:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the global queue is full ({self.queue_capacity} calls waiting); retry later",
            )
        if not self._nodes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no GPU manager is registered: start a node")
        timeout_s = request.timeout_s if request.timeout_s > 0 else spec.timeout_s
        call_id = request.call_id or uuid.uuid4().hex
        item = Request(call_id, spec.name, spec.model, now, spec.batch_size)
        try:
            self.scheduler.submit(item)
        except ModelTooLarge as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (UnknownModel, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        call = _Call(
            item,
            spec,
            request.payload,
            deadline=now + timeout_s - DEADLINE_MARGIN_S,
            submitted_at=now,
            future=asyncio.get_running_loop().create_future(),
        )
        self._calls[call_id] = call
        try:
            self._kick()
            try:
                return await asyncio.wait_for(asyncio.shield(call.future), timeout=max(0.0, call.deadline - now))
            except TimeoutError:
                self.scheduler.cancel(call_id)
                self._kick()
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"function {spec.name!r} did not finish within its timeout of {timeout_s:g} s; "
                    "raise its timeout_s or send it less work",
                )
            except CallFailed as exc:
                await context.abort(exc.code, exc.details)
        finally:
            self._calls.pop(call_id, None)
            if not call.future.done():
                call.future.cancel()
            # A caller that went away (cancelled RPC) leaves nothing queued behind.
            self.scheduler.cancel(call_id)
        raise AssertionError("unreachable")  # context.abort raises

    # --- dispatching ----------------------------------------------------------------------
    def _kick(self) -> None:
        """Run the policy for every idle GPU and start the resulting dispatches."""
        for decision in self.scheduler.schedule(self.clock()):
            if isinstance(decision, Dispatch):
                self._dirty_gpus.add(decision.gpu_id)
                self._dirty_models.add(decision.request.model)
                self._dirty_models.update(decision.evict)
                self._inflight[decision.request.request_id] = asyncio.create_task(self._execute(decision))
            else:
                self._dirty_gpus.add(decision.gpu_id)
        self._flush_wanted.set()

    async def _execute(self, decision: Dispatch) -> None:
        request = decision.request
        call_id = request.request_id
        call = self._calls.get(call_id)
        now = self.clock()
        if call is None or call.future.done():
            # The caller gave up while the request waited: free the GPU without running it (on a
            # miss the model was never loaded there, so its cache entry goes too).
            self.scheduler.on_failure(call_id, now, drop_model=not decision.hit, requeue=False)
            self._inflight.pop(call_id, None)
            self._kick()
            return
        call.attempts += 1
        call.dispatched_at = now
        node_name, gpu = split_gpu_address(decision.gpu_id)
        node = self._nodes[node_name]
        estimator = self.scheduler.estimator
        gpu_type = self.scheduler.gpu(decision.gpu_id).spec.gpu_type
        message = pb.ExecuteRequest(
            call_id=call_id,
            function=call.spec.name,
            model=request.model,
            package_digest=call.spec.package_digest,
            gpu=gpu,
            evict=list(decision.evict),
            payload=call.payload,
            timeout_s=max(0.001, call.deadline - now - DEADLINE_MARGIN_S),
            memory_mb=call.spec.memory_mb,
            package_url=self._package_url(call.spec.package_digest),
            load_time_s=estimator.load_time_s(request.model, gpu_type, call.spec.memory_mb),
            inference_time_s=estimator.inference_time_s(request.model, gpu_type, request.batch_size),
        )
        try:
            reply = await node.client.execute(message, call.deadline - now)
        except asyncio.CancelledError:
            # The node left: remove_gpu already put the request back in the queue.
            raise
        except grpc.aio.AioRpcError as exc:
            self._inflight.pop(call_id, None)
            self._on_execute_error(decision, call, exc)
        else:
            self._inflight.pop(call_id, None)
            done = self.clock()
            self.scheduler.on_complete(
                call_id,
                done,
                load_time_s=reply.load_time_s if reply.loaded else None,
                inference_time_s=reply.inference_time_s,
            )
            self._dirty_profiles.add((gpu_type, request.model, request.batch_size))
            if self.scheduler.observe_memory(request.model, decision.gpu_id, reply.peak_memory_mb):
                log.info("model %s measured at %d MB on %s", request.model, reply.peak_memory_mb, decision.gpu_id)
            if not call.future.done():
                call.future.set_result(
                    pb.InvokeReply(
                        output=reply.output,
                        gpu=decision.gpu_id,
                        hit=not reply.loaded,
                        queue_s=call.dispatched_at - call.submitted_at,
                        load_time_s=reply.load_time_s,
                        inference_time_s=reply.inference_time_s,
                        attempts=call.attempts,
                    )
                )
        self._dirty_gpus.add(decision.gpu_id)
        self._kick()

    def _on_execute_error(self, decision: Dispatch, call: _Call, exc: grpc.aio.AioRpcError) -> None:
        call_id = decision.request.request_id
        now = self.clock()
        code = exc.code()
        if decision.gpu_id not in self.scheduler.cache.gpu_ids():
            return  # its node left meanwhile: the request was requeued with the node's work
        if code == grpc.StatusCode.UNAVAILABLE:
            # The node does not answer (crashed, or cut off): stop sending it work now rather than
            # when its lease expires. Its calls are requeued; this one did not run, so it keeps
            # its retry. The node comes back if it answers again under the same incarnation.
            call.attempts -= 1
            node_name = split_gpu_address(decision.gpu_id)[0]
            log.warning("node %s is unreachable (%s); taking its GPUs out", node_name, exc.details())
            node = self._detach_node(node_name)
            if node is not None:
                self._tasks.append(asyncio.create_task(self._probe(node)))
            return
        if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.INVALID_ARGUMENT):
            # The function's own error (or a bad package): the GPU and the worker are fine.
            self.scheduler.on_complete(call_id, now)
            self._fail(call, code, exc.details() or "the function failed")
            return
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # The GPU manager killed the stuck worker: the model is no longer cached there.
            self.scheduler.on_failure(call_id, now, drop_model=True, requeue=False)
            self._fail(
                call,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"function {call.spec.name!r} did not finish within its timeout of {call.spec.timeout_s:g} s; "
                "raise its timeout_s or send it less work",
            )
            return
        # The worker died: drop its cache entry, retry once on another GPU.
        retry = call.attempts < MAX_ATTEMPTS and call.deadline > now
        log.warning(
            "call %s failed on %s (%s: %s)%s",
            call_id,
            decision.gpu_id,
            code,
            exc.details(),
            " retrying" if retry else "",
        )
        self.scheduler.on_failure(call_id, now, drop_model=True, requeue=retry, avoid_gpu=True)
        self._dirty_models.add(decision.request.model)
        if not retry:
            self._fail(call, grpc.StatusCode.UNAVAILABLE, f"the function's worker failed twice: {exc.details()}")

    @staticmethod
    def _fail(call: _Call, code: grpc.StatusCode, details: str) -> None:
        if not call.future.done():
            call.future.set_exception(CallFailed(code, details))

    def _package_url(self, digest: str) -> str:
        return f"{self._gateway_url}/system/packages/{digest}" if self._gateway_url else ""

    # --- gRPC: GetCluster -----------------------------------------------------------------
    async def GetCluster(self, request: pb.ClusterRequest, context: grpc.aio.ServicerContext) -> pb.ClusterReply:  # noqa: N802
        now = self.clock()
        gpus = []
        for node in self._nodes.values():
            for address in node.gpu_ids:
                state = self.scheduler.gpu(address)
                cache = self.scheduler.cache.gpu(address)
                gpus.append(
                    pb.GpuInfo(
                        gpu=address,
                        node=node.record.node,
                        status="idle" if state.idle else "busy",
                        memory_used_mb=cache.used_mb,
                        memory_capacity_mb=cache.capacity_mb,
                        lru=cache.lru_list(),
                        local_queue=len(state.local_queue),
                        running=state.running.request_id if state.running is not None else "",
                        gpu_type=state.spec.gpu_type,
                    )
                )
        queue = [
            pb.QueuedCall(call_id=r.request_id, function=r.function, model=r.model, waited_s=now - r.arrival_s)
            for r in self.scheduler.queue
        ]
        return pb.ClusterReply(gpus=gpus, queue=queue, policy=self.policy_name, queue_capacity=self.queue_capacity)

    # --- persistence ----------------------------------------------------------------------
    async def _flusher(self) -> None:
        while True:
            await self._flush_wanted.wait()
            await asyncio.sleep(FLUSH_DELAY_S)
            self._flush_wanted.clear()
            try:
                await self._flush()
            except StoreError as exc:
                log.warning("could not persist cache state (%s); retrying", exc)
                self._flush_wanted.set()
                await asyncio.sleep(0.5)

    async def _flush(self) -> None:
        """Write what changed since the last flush. The cache manager is the single writer of
        these keys, so plain puts suffice (no read-modify-write)."""
        gpus, self._dirty_gpus = self._dirty_gpus, set()
        models, self._dirty_models = self._dirty_models, set()
        profiles, self._dirty_profiles = self._dirty_profiles, set()
        deleted, self._deleted_gpus = self._deleted_gpus, set()
        try:
            for address in deleted:
                node, gpu = split_gpu_address(address)
                for key in (self.keys.gpu_lru(node, gpu), self.keys.gpu_status(node, gpu)):
                    await self.store.delete(key)
                    self._written.pop(key, None)
            for address in gpus:
                if address not in self.scheduler.cache.gpu_ids():
                    continue
                node, gpu = split_gpu_address(address)
                cache = self.scheduler.cache.gpu(address)
                state = self.scheduler.gpu(address)
                lru = [{"model": m, "memory_mb": cache.item(m).memory_mb} for m in cache.lru_list()]
                await self._put(self.keys.gpu_lru(node, gpu), json.dumps(lru).encode())
                status = {
                    "status": "idle" if state.idle else "busy",
                    "memory_used_mb": cache.used_mb,
                    "memory_capacity_mb": cache.capacity_mb,
                    "running": state.running.request_id if state.running is not None else None,
                    "local_queue": len(state.local_queue),
                }
                await self._put(self.keys.gpu_status(node, gpu), json.dumps(status).encode())
            for model in models:
                holders = sorted(self.scheduler.cache.gpus_with(model))
                key = self.keys.replicas(model)
                if holders:
                    await self._put(key, json.dumps(holders).encode())
                elif self._written.get(key) != b"":  # b"": deleted by us already
                    await self.store.delete(key)
                    self._written[key] = b""
            now = self.clock()
            for gpu_type, model, batch in profiles:
                key = self.keys.profile(gpu_type, model)
                if now - self._profile_written_at.get(key, -PROFILE_WRITE_INTERVAL_S) < PROFILE_WRITE_INTERVAL_S:
                    self._dirty_profiles.add((gpu_type, model, batch))  # later
                    continue
                self._profile_written_at[key] = now
                estimator = self.scheduler.estimator
                record = {
                    "load_time_s": estimator.load_time_s(model, gpu_type, self.scheduler.model(model).memory_mb),
                    "inference_time_s": {str(batch): estimator.inference_time_s(model, gpu_type, batch)},
                }
                await self.store.put(key, json.dumps(record).encode())
        except StoreError:
            # Put it all back: the next flush retries every key.
            self._dirty_gpus |= gpus
            self._dirty_models |= models
            self._dirty_profiles |= profiles
            self._deleted_gpus |= deleted
            raise

    async def _put(self, key: str, value: bytes) -> None:
        if self._written.get(key) == value:
            return
        await self.store.put(key, value)
        self._written[key] = value
