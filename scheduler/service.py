"""The scheduler service: the CallBook behind gpufaas.wire, fed by etcd, talking to GPU managers.

It only translates: frames from gateways (Place, Abandon, ClusterRequest) and from nodes (Done,
answers to Attach and Revoke) become CallBook calls; the effects the book returns become frames
(Placement with a signed grant, Rejection, Revoke, Evict). Deadlines, retries and reconciliation
are the book's (scheduler.calls). It also learns functions and nodes from etcd (watch), attaches
to each node (hands it the token key, learns the workers it runs), persists LRU lists, replicas,
GPU status and profiles to etcd (coalesced by one flusher task), and ticks the book's clock.
All scheduler state is touched from the event loop only, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_manager import CacheManager, eviction_policy
from gpufaas import grants
from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys, gpu_address, split_gpu_address
from gpufaas.profiles import paper_table1
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import KeyValue, LeaseKeeper, Store, StoreError, WatchEvent, list_and_watch
from gpufaas.types import GpuSpec, ModelSpec
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, RemoteError, Server, Unauthenticated, connect
from scheduler.adaptive_slots import DEFAULT_THRESHOLD, AdaptiveSlots
from scheduler.calls import (
    DEFAULT_CLAIM_S,
    DEFAULT_LOST_AFTER_S,
    Answer,
    Assignment,
    CallBook,
    CheckGrants,
    Effect,
    Evict,
    EvictHost,
    Rejected,
)
from scheduler.core import Scheduler
from scheduler.estimator import Estimator
from scheduler.evictions import EvictionLog
from scheduler.metrics import SchedulerMetrics
from scheduler.policies import PolicyConfig, make_policy
from scheduler.staging import GpuRoom, staging_targets

log = logging.getLogger("gpufaas.scheduler")

LEASE_TTL_S = 5
# Changes are written to etcd within this long, coalesced: a burst of calls costs one write per
# key that changed, not one per call (a GPU that went busy and idle again in between costs none).
# etcd is the record for observers and for recovery (which also asks the nodes), not the path of
# a call: a second of lag costs nothing, while writing per call would cost the scheduler and etcd
# more CPU than the call itself.
FLUSH_DELAY_S = 1.0
PROFILE_WRITE_INTERVAL_S = 5.0  # measured times move a little on every call: persist them calmly
TICK_S = 0.25  # how often deadlines and unconfirmed placements are looked at
UTILIZATION_SAMPLE_S = 0.02  # how often adaptive D samples the running calls (its period: 0.2 s)
NODE_TIMEOUT_S = 2.0  # a node that does not answer an Attach, Revoke or probe within this is out
RECONNECT_S = 0.5
RECONCILE_S = 5.0  # how often the GPUs' LRU lists are checked against the workers nodes run
RELEASE_CHECK_MIN_S = 0.25  # bounds of how often the staged exit looks for idle models
RELEASE_CHECK_MAX_S = 5.0
DEFAULT_SLOTS = 4
DEFAULT_PRESTAGE_NODES = 2  # nodes that get a new function's package before its first call
MAX_CLAIM_S = 30.0  # nodes remember grants (and revocations) for 60 s: a claim must fall well inside


@dataclass(frozen=True, slots=True)
class SlotConfig:
    """Concurrent calls per GPU (D), by GPU type, else `default`."""

    default: int = DEFAULT_SLOTS
    by_type: Mapping[str, int] = field(default_factory=dict)

    def for_type(self, gpu_type: str) -> int:
        return self.by_type.get(gpu_type, self.default)

    @classmethod
    def parse(cls, text: str) -> SlotConfig:
        """ "4" or "4,cpu=8,nvidia-h100-80gb-hbm3=2": a default and per-type values (each >= 1)."""
        default, by_type = DEFAULT_SLOTS, {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.rpartition("=")
            if not value.isdigit() or int(value) < 1 or (sep and not name):
                raise ValueError(f"slots: expected N or GPU_TYPE=N with N >= 1, got {part!r}")
            if sep:
                by_type[name] = int(value)
            else:
                default = int(value)
        return cls(default, by_type)


@dataclass(slots=True)
class _Node:
    record: NodeRecord
    conn: Connection | None = None
    gpu_ids: list[str] = field(default_factory=list)  # in the scheduler (attached) or empty
    holdings: pb.Holdings | None = None  # its latest report of what its disk and host pool hold


class SchedulerService:
    """Hosts the pure scheduler, cache manager and call book behind gpufaas.wire."""

    def __init__(
        self,
        store: Store,
        *,
        keys: Keys | None = None,
        policy: str = "lalb-o3",
        policy_config: PolicyConfig | None = None,
        queue_capacity: int = 10_000,
        slots: SlotConfig | None = None,
        claim_s: float = DEFAULT_CLAIM_S,
        lost_after_s: float = DEFAULT_LOST_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        wire_key: bytes | None = None,
        gpu_idle_release_s: float | None = None,
        host_idle_release_s: float | None = None,
        prestage_nodes: int = DEFAULT_PRESTAGE_NODES,
        eviction: str = "lru",
        adaptive_slots: int | None = None,
        utilization_threshold: float = DEFAULT_THRESHOLD,
    ) -> None:
        """`wire_key`: the cluster's wire key (gpufaas.credentials); gateways must prove it, and
        nodes are trusted only once they have. None: no handshake (tests of the logic only).
        `gpu_idle_release_s`, `host_idle_release_s`: EDAS's staged exit, None = that stage off: a
        model unused on a GPU this long leaves it (for its node's host tier, where the node has
        one), and one in a host tier this long leaves that too. `prestage_nodes`: how many nodes
        get a new function's package before its first call (0: none; calls fetch it). `eviction`:
        the registered eviction policy a miss chooses its victims by (cache_manager.eviction).
        `policy_config`: the policy's tunables, as the simulator takes them (default: theirs).
        `adaptive_slots`: each GPU's D moves between 1 and this from its utilization against
        `utilization_threshold` (scheduler.adaptive_slots; None: D fixed by `slots`)."""
        for name, value in (
            ("gpu_idle_release_s", gpu_idle_release_s),
            ("host_idle_release_s", host_idle_release_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds (or None: that stage off), got {value}")
        if prestage_nodes < 0:
            raise ValueError(f"prestage_nodes must be >= 0, got {prestage_nodes}")
        self.gpu_idle_release_s = gpu_idle_release_s
        self.host_idle_release_s = host_idle_release_s
        self.prestage_nodes = prestage_nodes
        self.store = store
        self.wire_key = wire_key
        self.keys = keys if keys is not None else Keys()
        self.policy_name = policy
        self.policy_config = policy_config if policy_config is not None else PolicyConfig()
        self.eviction = eviction
        self.slots = slots if slots is not None else SlotConfig()
        self.clock = clock
        self.scheduler = Scheduler(
            make_policy(policy, self.policy_config),
            estimator=Estimator(paper_table1()),
            cache=CacheManager(eviction_policy(eviction)),
        )
        adaptive = (
            AdaptiveSlots(adaptive_slots, threshold=utilization_threshold) if adaptive_slots is not None else None
        )
        self.book = CallBook(
            self.scheduler, queue_capacity, claim_s=claim_s, lost_after_s=lost_after_s, adaptive_slots=adaptive
        )
        self.metrics = SchedulerMetrics(self.scheduler)
        self.evictions = EvictionLog()  # for the cluster views
        self.scheduler_id = uuid.uuid4().hex
        self._token_key = grants.new_key()
        self._functions: dict[str, FunctionSpec] = {}
        self._prestaged: set[str] = set()  # packages pre-staging has placed (once each)
        self._nodes: dict[str, _Node] = {}
        self._recovered_lru: dict[str, list[str]] = {}  # "node/gpu" -> models, most recent first
        self._deleted_gpus: set[str] = set()
        self._flush_wanted = asyncio.Event()
        self._written: dict[str, bytes] = {}  # last value put per key: unchanged values are not rewritten
        self._profile_written_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server = Server(lambda: _GatewaySession(self), key=wire_key)
        self._lease: LeaseKeeper | None = None
        self.address = ""

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, listen: str = "127.0.0.1:0", *, advertise: str | None = None) -> str:
        """Recover state from etcd, start watching, serve; returns the address registered in etcd
        for gateways to find (`advertise`, else the bound listen address)."""
        revision = await self._recover()
        bound = await self._server.start(listen)
        self.address = advertise or bound
        self._lease = LeaseKeeper(self.store, LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())
        for prefix, on_list, on_event in (
            (self.keys.functions, self._functions_listed, self._on_function_event),
            (self.keys.nodes, self._nodes_listed, self._on_node_event),
        ):
            self._spawn(list_and_watch(self.store, prefix, on_list=on_list, on_event=on_event, listed_at=revision))
        self._spawn(self._flusher())
        self._spawn(self._ticker())
        self._spawn(self._reconciler())
        if self.book.adaptive_slots is not None:
            self._spawn(self._utilization_sampler())
        if (
            self.gpu_idle_release_s is not None
            or self.host_idle_release_s is not None
            or self.scheduler.policy.releases_memory
        ):
            self._spawn(self._releaser())
        log.info(
            "scheduler serving on %s (policy %s, %s; eviction %s)",
            self.address,
            self.policy_name,
            self.policy_config,
            self.eviction,
        )
        return self.address

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(StoreError):
            await self._flush()
        await self._server.close()
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        for node in self._nodes.values():
            if node.conn is not None:
                node.conn.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _register(self, lease: int) -> None:
        await self.store.put(self.keys.service("scheduler"), self.address.encode(), lease=lease)

    async def _recover(self) -> int:
        """Read functions, profiles, nodes and the persisted LRU lists; returns the revision read
        (the watches go on from there). A node's GPUs join once it is attached (its workers then
        re-populate the cache)."""
        revision = await self.store.revision()
        self._functions_listed(await self.store.get_prefix(self.keys.functions), revision)
        for kv in await self.store.get_prefix(self.keys.profiles):
            self._apply_profile(kv)
        self._nodes_listed(await self.store.get_prefix(self.keys.nodes), revision)
        live = {address for node in self._nodes.values() for address in _gpu_addresses(node.record)}
        for kv in await self.store.get_prefix(self.keys.gpus):
            parsed = self.keys.parse_gpu_key(kv.key)
            if parsed is None or parsed[2] != "lru":
                continue
            address = gpu_address(parsed[0], parsed[1])
            if address not in live:
                self._deleted_gpus.add(address)  # a GPU that left while no scheduler ran
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self._recovered_lru[address] = [item["model"] for item in json.loads(kv.value)]
        self._flush_wanted.set()
        return revision

    # --- mirrors of etcd (list, then watch) ------------------------------------------------
    def _functions_listed(self, kvs: list[KeyValue], revision: int) -> None:
        before = self._functions
        self._functions = {}
        for kv in kvs:
            self._apply_function(kv.key, kv.value)
        current = {spec.model for spec in self._functions.values()}
        effects: list[Effect] = []
        for spec in before.values():
            if spec.model not in current:
                effects += self.book.retire(spec.model)
        self._apply(effects)

    def _nodes_listed(self, kvs: list[KeyValue], revision: int) -> None:
        """The nodes registered now: new and changed ones are (re)attached, gone ones taken out."""
        listed = set()
        for kv in kvs:
            self._on_node_event(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
            listed.add(kv.key.removeprefix(self.keys.nodes))
        for name in set(self._nodes) - listed:
            log.info("node %s is no longer registered", name)
            self._node_gone(name)

    def _on_function_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self._apply_function(event.key, event.value)
            return
        gone = self._functions.pop(event.key.removeprefix(self.keys.functions), None)
        if gone is not None:
            log.info("function %s deleted: evicting its model %s", gone.name, gone.model)
            self._apply(self.book.retire(gone.model))

    def _apply_function(self, key: str, value: bytes) -> FunctionSpec | None:
        try:
            spec = FunctionSpec.from_json(value)
        except GpufaasError as exc:
            log.warning("ignoring invalid function spec at %s: %s", key, exc)
            return None
        old = self._functions.get(spec.name)
        self._functions[spec.name] = spec
        self.scheduler.register_model(ModelSpec(spec.model, spec.memory_mb, spec.required_gpu_type))
        self.book.revive(spec.model)
        if old is not None and old.model != spec.model:
            log.info("function %s updated: evicting its old model %s", spec.name, old.model)
            self._apply(self.book.retire(old.model))
        if spec.package_digest not in self._prestaged:  # a new package (a re-list finds old ones)
            self._learn_holdings()  # nodes may hold its package already (another function's)
            self._prestage([spec])
        return spec

    def _apply_profile(self, kv: KeyValue) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            gpu_type, model = kv.key.removeprefix(self.keys.profiles).split("/", 1)
            raw = json.loads(kv.value)
            if raw.get("load_time_s") is not None:
                self.scheduler.estimator.observe_load(model, gpu_type, float(raw["load_time_s"]))
            for batch, seconds in raw.get("inference_time_s", {}).items():
                self.scheduler.estimator.observe_inference(model, gpu_type, int(batch), float(seconds))

    def _on_node_event(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(self.keys.nodes)
        if event.kind == "delete":
            log.info("node %s left the cluster (lease expired or removed)", name)
            self._node_gone(name)
            return
        try:
            record = NodeRecord.from_json(event.value)
        except (ValueError, KeyError) as exc:
            log.warning("ignoring invalid node record for %s: %s", name, exc)
            return
        self._node_seen(record)

    # --- nodes ----------------------------------------------------------------------------
    def _node_seen(self, record: NodeRecord) -> None:
        known = self._nodes.get(record.node)
        if known is not None and known.record == record:
            return
        if known is not None:
            # A restarted GPU manager (a new incarnation): its workers, and so its models, are gone.
            log.info("node %s re-registered (incarnation %s)", record.node, record.incarnation)
            self._node_gone(record.node)
        node = _Node(record)
        self._nodes[record.node] = node
        self._spawn(self._keep_attached(node))

    def _node_gone(self, name: str) -> None:
        node = self._nodes.pop(name, None)
        if node is None:
            return
        self._detach(node)
        if node.conn is not None:
            node.conn.close()

    async def _keep_attached(self, node: _Node) -> None:
        """Connect to the node and attach (hand it the token key, learn its workers), then add
        its GPUs; when the connection drops, take them out and try again while the node is
        registered under the same incarnation."""
        session = _NodeSession(self, node)
        while self._nodes.get(node.record.node) is node:
            try:
                conn = await connect(node.record.address, session, timeout_s=NODE_TIMEOUT_S, key=self.wire_key)
                reply = (
                    await conn.request(
                        MessageType.ATTACH,
                        pb.Attach(scheduler_id=self.scheduler_id, token_key=self._token_key),
                        timeout_s=NODE_TIMEOUT_S,
                    )
                ).message(pb.AttachReply)
            except (ConnectionLost, TimeoutError, RemoteError) as exc:
                # A wrong secret is a misconfiguration an operator must see; the rest is routine.
                level = logging.WARNING if isinstance(exc, Unauthenticated) else logging.DEBUG
                log.log(level, "node %s at %s: %s", node.record.node, node.record.address, exc)
                await asyncio.sleep(RECONNECT_S)
                continue
            if self._nodes.get(node.record.node) is not node or reply.incarnation != node.record.incarnation:
                conn.close()  # it left or restarted meanwhile: the watch brings the new record
                return
            node.conn = conn
            self._attach(node, reply)
            lost = await conn.closed
            if self._nodes.get(node.record.node) is node:
                log.warning(
                    "lost the connection to node %s (%s); taking its GPUs out, %d placed call(s) go back to the queue",
                    node.record.node,
                    lost,
                    len(self.book.placed_on(node.record.node)),
                )
                self._detach(node)
            node.conn = None
            await asyncio.sleep(RECONNECT_S)

    def _attach(self, node: _Node, reply: pb.AttachReply) -> None:
        resident = _resident(node.record.node, reply)
        effects: list[Effect] = []
        for gpu in node.record.gpus:
            address = gpu_address(node.record.node, gpu.gpu)
            slots = self.slots.for_type(gpu.gpu_type)
            link = None if gpu.link is None else f"{node.record.node}/{gpu.link}"
            self.scheduler.add_gpu(
                GpuSpec(address, gpu.memory_mb, gpu.gpu_type, slots=slots, node=node.record.node, link=link)
            )
            node.gpu_ids.append(address)
            self._deleted_gpus.discard(address)
            workers = resident.get(address, {})
            # Oldest first, so the recency order persisted before a restart comes back.
            order = [m for m in reversed(self._recovered_lru.pop(address, [])) if m in workers]
            ordered = {m: workers[m] for m in order} | workers
            effects += self.book.reconcile(address, ordered, self.clock())
        effects += self.book.reconcile_host(node.record.node, reply.host_memory_mb, _parked(reply))
        log.info(
            "node %s attached: %d GPU(s), %d resident model(s)", node.record.node, len(node.gpu_ids), len(reply.workers)
        )
        self.holdings_reported(node, reply.holdings)
        self._apply(effects + self.book.schedule(self.clock()))
        self._prestage(self._functions.values())

    async def _reconciler(self) -> None:
        """Now and then, ask every attached node which models it runs and reconcile the GPUs' LRU
        lists, and its host tier, with that (phantoms dropped, orphans adopted or evicted): the
        cache follows what really runs, whatever was missed (a worker that died between calls, a
        lost Done, a model the node pushed out of its host tier)."""
        while True:
            await asyncio.sleep(RECONCILE_S)
            for node in list(self._nodes.values()):
                if node.conn is None or not node.gpu_ids:
                    continue
                try:
                    frame = await node.conn.request(MessageType.WORKERS, pb.WorkersRequest(), timeout_s=NODE_TIMEOUT_S)
                except (ConnectionLost, TimeoutError, RemoteError):
                    continue  # _keep_attached deals with a node that is gone
                if not node.gpu_ids:  # detached meanwhile
                    continue
                reply = frame.message(pb.AttachReply)
                resident = _resident(node.record.node, reply)
                effects: list[Effect] = []
                for address in node.gpu_ids:
                    effects += self.book.reconcile(address, resident.get(address, {}), self.clock())
                effects += self.book.reconcile_host(node.record.node, reply.host_memory_mb, _parked(reply))
                self.holdings_reported(node, reply.holdings)
                self._apply(effects + self.book.schedule(self.clock()))

    # --- what nodes hold below their GPUs, and pre-staging ---------------------------------
    def holdings_reported(self, node: _Node, holdings: pb.Holdings) -> None:
        """A node said what its disk and host pool hold (package digests): the cache manager
        learns it by model, so misses are priced and placed by the tier they come from."""
        node.holdings = holdings
        self._learn_holdings(node)

    def _learn_holdings(self, only: _Node | None = None) -> None:
        models_of: dict[str, list[str]] = {}
        for spec in self._functions.values():
            models_of.setdefault(spec.package_digest, []).append(spec.model)
        for node in [only] if only is not None else list(self._nodes.values()):
            if node.holdings is None or not node.gpu_ids:
                continue
            self.scheduler.cache.holdings.report(
                node.record.node,
                pooled={m for d in node.holdings.pooled for m in models_of.get(d, ())},
                staged={m for d in node.holdings.staged for m in models_of.get(d, ())},
            )

    def _prestage(self, specs: Iterable[FunctionSpec]) -> None:
        """Ask the nodes a function's misses are expected to land on to bring its package now
        (scheduler.staging), each node once for all it lacks."""
        if not self.prestage_nodes:
            return
        rooms: dict[str, list[GpuRoom]] = {}
        for name, node in self._nodes.items():
            if node.conn is None or not node.gpu_ids or node.holdings is None:
                continue
            rooms[name] = [
                GpuRoom(spec.memory_mb, spec.gpu_type, self.scheduler.cache.gpu(gpu_id).free_mb)
                for gpu_id in node.gpu_ids
                for spec in (self.scheduler.gpu(gpu_id).spec,)
            ]
        wanted: dict[str, list[str]] = {}
        for spec in specs:
            staged_on = {n for n in rooms if spec.package_digest in self._nodes[n].holdings.staged}  # type: ignore[union-attr]
            model = ModelSpec(spec.model, spec.memory_mb, spec.required_gpu_type)
            for target in staging_targets(model, rooms, staged_on, copies=self.prestage_nodes):
                wanted.setdefault(target, []).append(spec.package_digest)
                # Its miss is expected there: the next function's room is what is left of it, so
                # many functions deployed at once spread over the nodes rather than all go to one.
                gpus = rooms[target]
                best = max(range(len(gpus)), key=lambda i: gpus[i].free_mb)
                gpus[best] = dataclasses.replace(gpus[best], free_mb=gpus[best].free_mb - spec.memory_mb)
            if rooms:
                self._prestaged.add(spec.package_digest)
        for name, digests in wanted.items():
            self._spawn(self._stage(self._nodes[name], sorted(set(digests))))

    async def _stage(self, node: _Node, digests: list[str]) -> None:
        if node.conn is None:
            return
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.STAGE, pb.Stage(packages=digests), timeout_s=NODE_TIMEOUT_S)
            log.info("asked node %s to stage %d package(s)", node.record.node, len(digests))

    def _detach(self, node: _Node) -> None:
        """Take a node's GPUs out: their calls go back to the queue (and are placed again)."""
        if not node.gpu_ids:
            return
        gpu_ids, node.gpu_ids = node.gpu_ids, []
        self._deleted_gpus.update(gpu_ids)
        self._apply(self.book.gpus_removed(gpu_ids, self.clock()))

    async def _check_grants(self, effect: CheckGrants) -> None:
        node = self._nodes.get(effect.node)
        claim_by = self.book.claim_by(effect.grants)
        request = pb.Revoke(
            grants=[pb.GrantRef(call_id=c, attempt=a) for c, a in effect.grants],
            claim_by_unix_s=claim_by + time.time() - self.clock() if claim_by else 0.0,
        )
        try:
            if node is None or node.conn is None:
                raise ConnectionLost(f"node {effect.node} is not connected")
            reply = (await node.conn.request(MessageType.REVOKE, request, timeout_s=NODE_TIMEOUT_S)).message(
                pb.RevokeReply
            )
        except (ConnectionLost, TimeoutError, RemoteError) as exc:
            # The node cannot say: if it is gone its calls were requeued with its GPUs.
            log.warning("cannot check grants with node %s (%s); taking it out", effect.node, exc)
            if node is not None:
                self._disconnect(node)
            return
        self._apply(
            self.book.grants_checked(
                effect.node,
                [(g.call_id, g.attempt) for g in reply.unseen],
                [(g.call_id, g.attempt) for g in reply.seen],
                self.clock(),
            )
        )

    async def _evict(self, effect: Evict) -> None:
        node_name, gpu = split_gpu_address(effect.gpu_id)
        node = self._nodes.get(node_name)
        if node is None or node.conn is None:
            return
        request = pb.Evict(
            gpu=gpu, models=effect.models, to_host=effect.to_host, if_idle=effect.if_idle, gpu_seq=effect.gpu_seq
        )
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.EVICT, request, timeout_s=30.0)

    async def _evict_host(self, effect: EvictHost) -> None:
        node = self._nodes.get(effect.node)
        if node is None or node.conn is None:
            return
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.EVICT, pb.Evict(models=effect.models), timeout_s=30.0)

    def _disconnect(self, node: _Node) -> None:
        """Stop using a node that does not answer: `_keep_attached` takes its GPUs out and
        re-attaches it if it answers again (under the same incarnation)."""
        if node.conn is not None:
            node.conn.close()
        else:
            self._detach(node)

    # --- effects --------------------------------------------------------------------------
    def _apply(self, effects: Iterable[Effect]) -> None:
        now = self.clock()  # one reading for the batch: the effects were decided together
        for effect in effects:
            self.metrics.applied(effect)
            self.evictions.record(effect, now)
            if isinstance(effect, Assignment):
                self._place(effect)
            elif isinstance(effect, Answer):
                self._send(
                    effect.owner,
                    MessageType.REJECTION,
                    pb.Rejection(call_id=effect.call_id, status=effect.status, message=effect.message),  # type: ignore[arg-type]
                )
            elif isinstance(effect, CheckGrants):
                self._spawn(self._check_grants(effect))
            elif isinstance(effect, EvictHost):
                self._spawn(self._evict_host(effect))
            else:
                self._spawn(self._evict(effect))
        self._flush_wanted.set()

    def _place(self, a: Assignment) -> None:
        node_name, gpu = split_gpu_address(a.gpu_id)
        node = self._nodes[node_name]
        to_wall = time.time() - self.clock()
        spec = a.spec
        grant = pb.Grant(
            scheduler_id=self.scheduler_id,
            call_id=a.call_id,
            attempt=a.attempt,
            node=node_name,
            gpu=gpu,
            gpu_seq=a.gpu_seq,
            function=spec.name,
            model=spec.model,
            package_digest=spec.package_digest,
            memory_mb=spec.memory_mb,
            evict=a.evict,
            claim_by_unix_s=a.claim_by + to_wall,
            expires_unix_s=a.deadline + to_wall,
            max_batch_size=spec.max_batch_size,
            max_batch_wait_s=spec.max_batch_wait_ms / 1000.0,
            load_time_s=self.scheduler.estimator.load_time_s(
                spec.model, self.scheduler.gpu(a.gpu_id).spec.gpu_type, spec.memory_mb
            ),
            inference_time_s=a.est_inference_time_s,
            environment=spec.environment,
        )
        placement = pb.Placement(
            call_id=a.call_id,
            attempt=a.attempt,
            node=node_name,
            node_address=node.record.address,
            gpu=gpu,
            hit=a.hit,
            queue_s=a.queue_s,
            token=grants.sign(grant, self._token_key),
        )
        self._send(a.owner, MessageType.PLACEMENT, placement)

    @staticmethod
    def _send(owner: object, type_: int, message: Any) -> None:
        assert isinstance(owner, Connection)
        with contextlib.suppress(ConnectionLost):  # the owner is gone: owner_lost cleans up
            owner.send(type_, message)

    # --- from gateways --------------------------------------------------------------------
    def place(self, conn: Connection, request: pb.Place) -> None:
        spec = self._functions.get(request.function)
        if spec is None:
            # A deploy that just happened may not have reached the watch yet: read through once.
            self._spawn(self._place_unknown(conn, request))
            return
        self._submit(conn, request, spec)

    async def _place_unknown(self, conn: Connection, request: pb.Place) -> None:
        spec = None
        with contextlib.suppress(ValueError, StoreError):
            kv = await self.store.get(self.keys.function(request.function))
            if kv is not None:
                spec = self._apply_function(kv.key, kv.value)
        if spec is None:
            self._send(
                conn,
                MessageType.REJECTION,
                pb.Rejection(
                    call_id=request.call_id,
                    status=pb.NOT_FOUND,
                    message=f"function {request.function!r} is not deployed",
                ),
            )
            return
        self._submit(conn, request, spec)

    def _submit(self, conn: Connection, request: pb.Place, spec: FunctionSpec) -> None:
        timeout_s = request.timeout_s if request.timeout_s > 0 else spec.timeout_s
        try:
            effects = self.book.submit(conn, request.call_id, spec, timeout_s, self.clock())
        except Rejected as exc:
            self._send(
                conn,
                MessageType.REJECTION,
                pb.Rejection(call_id=request.call_id, status=exc.status, message=str(exc)),  # type: ignore[arg-type]
            )
            return
        self._apply(effects)

    def cluster(self) -> pb.ClusterReply:
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
                        running=list(state.running),
                        running_models=[r.model for r in state.running.values()],
                        gpu_type=state.spec.gpu_type,
                        slots=state.spec.slots,
                        host_tier=host.lru_list() if (host := self.scheduler.cache.host_of(address)) else [],
                    )
                )
        queue = [
            pb.QueuedCall(call_id=r.request_id, function=r.function, model=r.model, waited_s=now - r.arrival_s)
            for r in self.scheduler.queue
        ]
        evictions = [
            pb.EvictionRecord(gpu=e.gpu, model=e.model, reason=e.reason, age_s=now - e.at_s)
            for e in self.evictions.recent()
        ]
        return pb.ClusterReply(
            gpus=gpus,
            queue=queue,
            policy=self.policy_name,
            queue_capacity=self.book.queue_capacity,
            evictions=evictions,
        )

    # --- time and persistence -------------------------------------------------------------
    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._apply(self.book.tick(self.clock()))

    async def _utilization_sampler(self) -> None:
        """Adaptive D: what runs on each GPU, sampled a few times per controller period."""
        while True:
            await asyncio.sleep(UTILIZATION_SAMPLE_S)
            self._apply(self.book.observe_utilization(self.clock()))

    async def _releaser(self) -> None:
        """EDAS's staged exit and the policy's swap-out: now and then, release what has been idle
        past its stage's timeout or what the policy names idle (checked at a quarter of the
        shorter timeout, between RELEASE_CHECK_MIN_S and _MAX_S; at the shortest for the policy's)."""
        stages = [s for s in (self.gpu_idle_release_s, self.host_idle_release_s) if s is not None]
        period_s = RELEASE_CHECK_MIN_S
        if stages and not self.scheduler.policy.releases_memory:
            period_s = min(RELEASE_CHECK_MAX_S, max(RELEASE_CHECK_MIN_S, min(stages) / 4))
        while True:
            await asyncio.sleep(period_s)
            effects = self.book.release_idle(
                self.clock(), gpu_idle_s=self.gpu_idle_release_s, host_idle_s=self.host_idle_release_s
            )
            if effects:
                log.info("%d release(s) of idle models", len(effects))
                self.metrics.released(effects)
            self._apply(effects)

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
        book = self.book
        gpus, book.dirty_gpus = book.dirty_gpus, set()
        models, book.dirty_models = book.dirty_models, set()
        profiles, book.dirty_profiles = book.dirty_profiles, set()
        deleted, self._deleted_gpus = self._deleted_gpus, set()
        try:
            for address in deleted:
                node, gpu = split_gpu_address(address)
                for key in (self.keys.gpu_lru(node, gpu), self.keys.gpu_status(node, gpu)):
                    await self.store.delete(key)
                    self._written.pop(key, None)
            live = set(self.scheduler.cache.gpu_ids())
            for address in gpus & live:
                node, gpu = split_gpu_address(address)
                cache = self.scheduler.cache.gpu(address)
                state = self.scheduler.gpu(address)
                lru = [{"model": m, "memory_mb": cache.item(m).memory_mb} for m in cache.lru_list()]
                await self._put(self.keys.gpu_lru(node, gpu), json.dumps(lru).encode())
                status = {
                    "status": "idle" if state.idle else "busy",
                    "memory_used_mb": cache.used_mb,
                    "memory_capacity_mb": cache.capacity_mb,
                    "running": len(state.running),
                    "slots": state.spec.slots,
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
                    book.dirty_profiles.add((gpu_type, model, batch))  # later
                    continue
                self._profile_written_at[key] = now
                estimator = self.scheduler.estimator
                with contextlib.suppress(KeyError):
                    memory_mb = self.scheduler.model(model).memory_mb
                    record = {
                        "load_time_s": estimator.load_time_s(model, gpu_type, memory_mb),
                        "inference_time_s": {str(batch): estimator.inference_time_s(model, gpu_type, batch)},
                    }
                    await self.store.put(key, json.dumps(record).encode())
        except StoreError:
            # Put it all back: the next flush retries every key.
            book.dirty_gpus |= gpus
            book.dirty_models |= models
            book.dirty_profiles |= profiles
            self._deleted_gpus |= deleted
            raise

    async def _put(self, key: str, value: bytes) -> None:
        if self._written.get(key) == value:
            return
        await self.store.put(key, value)
        self._written[key] = value


def _resident(node: str, reply: pb.AttachReply) -> dict[str, dict[str, int]]:
    """ "node/gpu" -> {model: MiB} of what a node reports it runs."""
    resident: dict[str, dict[str, int]] = {}
    for worker in reply.workers:
        resident.setdefault(gpu_address(node, worker.gpu), {})[worker.model] = int(worker.memory_mb)
    return resident


def _parked(reply: pb.AttachReply) -> dict[str, int]:
    """{model: MiB} of a node's host tier, least recently parked first."""
    return {worker.model: int(worker.memory_mb) for worker in reply.parked}


def _gpu_addresses(record: NodeRecord) -> list[str]:
    return [gpu_address(record.node, gpu.gpu) for gpu in record.gpus]


class _GatewaySession:
    """One gateway's connection: its calls are owned by the connection itself."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        service = self.service
        if frame.type == MessageType.PLACE:
            service.place(conn, frame.message(pb.Place))
        elif frame.type == MessageType.ABANDON:
            abandon = frame.message(pb.Abandon)
            service._apply(
                service.book.abandon(conn, abandon.call_id, abandon.attempt, abandon.reason, service.clock())
            )
        elif frame.type == MessageType.CLUSTER:
            conn.reply(frame, MessageType.CLUSTER_REPLY, service.cluster())
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, f"the scheduler does not answer message type {frame.type}")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        service = self.service
        service._apply(service.book.owner_lost(conn, service.clock()))


class _NodeSession:
    """The scheduler's connection to one node: Done messages arrive on it."""

    def __init__(self, service: SchedulerService, node: _Node) -> None:
        self.service = service
        self.node = node

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.HOLDINGS:
            self.service.holdings_reported(self.node, frame.message(pb.Holdings))
            return
        if frame.type != MessageType.DONE:
            return
        done = frame.message(pb.Done)
        service = self.service
        placed = service.book.placement(done.call_id, done.attempt)
        if placed is not None and done.worker_lost and done.peak_memory_mb > 0:
            # The node stopped a worker it measured over its declared size, with no room for that on
            # its GPU (gpu_manager.pool): later admissions book what it measured, so that the next
            # call makes room for the model instead of loading it to be stopped again. (Otherwise
            # the book's `done` takes the size in, which it does not for a worker lost.)
            service.scheduler.observe_memory(placed[0], placed[1], int(done.peak_memory_mb))
        if placed is not None:
            model, gpu_id = placed
            try:
                gpu_type = service.scheduler.gpu(gpu_id).spec.gpu_type
            except KeyError:  # its node left meanwhile
                gpu_type = ""
            service.metrics.done(
                model,
                gpu_type,
                ok=done.outcome == pb.OK,
                outcome=pb.Outcome.Name(done.outcome).lower(),
                loaded=done.loaded,
                load_time_s=done.load_time_s,
                inference_time_s=done.inference_time_s,
            )
        service._apply(
            service.book.done(
                done.call_id,
                done.attempt,
                done.outcome,
                service.clock(),
                loaded=done.loaded,
                load_time_s=done.load_time_s,
                inference_time_s=done.inference_time_s,
                peak_memory_mb=int(done.peak_memory_mb),
                batch_calls=done.batch_calls,
                worker_lost=done.worker_lost,
            )
        )

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass  # _keep_attached sees `conn.closed` resolve
