"""The scheduler service: the CallBook behind gpufaas.wire, wired to etcd and the GPU managers.

It only translates: frames from gateways (Place, Abandon, ClusterRequest) and from nodes (Done,
Holdings; scheduler.sessions) become CallBook calls; the effects the book returns become frames
(Placement with a signed grant, Rejection) or node requests (Revoke, Evict). Deadlines, retries
and reconciliation are the book's (scheduler.calls). The service wires three parts around the
book and ticks its clock:
- the catalog (scheduler.catalog): functions, profiles and nodes mirrored from etcd;
- the node links (scheduler.node_links): each node attached (handed the token key, its workers
  learnt), reconciled, pre-staged, and sent the book's grant checks and evictions;
- the state persister (scheduler.persister): LRU lists, replicas, GPU status and profiles written
  to etcd by one coalescing flusher, and read back after a restart.
Several instances may run: one leads (scheduler.election, scheduler.leadership) and the others
stand by, their catalogs kept current, until the leader's lease lapses. A term (from taking
office to leaving it) is what one scheduler used to do from start to stop: recover the persisted
state, attach the nodes (handing them the term's epoch), place what gateways ask. A standby closes
gateways' connections; an unsure leader holds what it decides until its lease is confirmed.
All scheduler state is touched from the event loop only, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import Callable, Container, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_manager import CacheManager, eviction_policy
from gpufaas import grants
from gpufaas.functions import FunctionSpec, not_deployed
from gpufaas.keys import Keys, split_gpu_address
from gpufaas.profiles import paper_table1
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import Store, StoreError
from gpufaas.tls import LinkTls
from gpufaas.wire import Connection, ConnectionLost, MessageType, Server, Unauthenticated, connect
from gpufaas.wire_local import serve_here, withdraw
from scheduler.adaptive_slots import DEFAULT_THRESHOLD, AdaptiveSlots
from scheduler.calls import (
    DEFAULT_CLAIM_S,
    DEFAULT_LOST_AFTER_S,
    Answer,
    Assignment,
    CallBook,
    CheckGrants,
    Effect,
    EvictHost,
    Rejected,
)
from scheduler.catalog import Catalog
from scheduler.core import Scheduler
from scheduler.election import Election, LeadershipCollector, TetherRefused
from scheduler.estimator import Estimator
from scheduler.evictions import EvictionLog
from scheduler.leadership import Leadership, Role
from scheduler.metrics import SchedulerMetrics
from scheduler.node_drain import none_to_attach
from scheduler.node_links import NodeLink, NodeLinks
from scheduler.persister import StatePersister
from scheduler.policies import PolicyConfig, make_policy
from scheduler.sessions import GatewaySession, NodeSession
from scheduler.staged_exit import release_check_period_s

log = logging.getLogger("gpufaas.scheduler")

LEASE_TTL_S = 1  # the leadership lease (--lease-ttl-s); etcd may grant more (docs/failover.md)
TICK_S = 0.25  # how often deadlines and unconfirmed placements are looked at
UTILIZATION_SAMPLE_S = 0.02  # how often adaptive D samples the running calls (its period: 0.2 s)
DEFAULT_SLOTS = 4
DEFAULT_PRESTAGE_NODES = 2  # nodes that get a new function's package before its first call
ATTACH_WAIT_S = 2.0  # a new term takes calls once its registered nodes attached, or this long after it began
ATTACH_POLL_S = 0.02
EARLY_PER_SLICE = 256  # Places that waited for the attaches, placed between two turns of the loop
# How long a hit's placement leases its slot to its gateway when nothing waits (docs/hit-leases.md):
# long enough that a busy function asks again about once a second, short enough that an idle one
# gives its slot back soon without being asked (the lease is revoked anyway as soon as a call waits).
DEFAULT_HIT_LEASE_S = 1.0


@dataclass(slots=True)
class _Term:
    """One term of leadership: who signs its grants (its scheduler id) with which key, what it
    decided while unsure of the leadership (`held`), whether it takes calls yet (`open`: not
    while its nodes attach, nor while it places the Places that waited meanwhile in `early`),
    and its tasks."""

    scheduler_id: str = ""
    token_key: bytes = b""
    held: list[Effect] = field(default_factory=list)
    open: bool = True
    early: list[tuple[Connection, pb.Place]] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # (owner, call id) -> how many Places waited in `early` when the owner cancelled it (not open)
    cancelled: dict[tuple[Connection, str], int] = field(default_factory=dict)

    def cancel(self, conn: Connection, call_id: str) -> None:
        """The gateway on `conn` cancelled a call. While the term is not open its Place may wait
        in `early`, which the book has not taken yet: the book drops the cancel of a call it does
        not know, and the call was placed once the term opened, for nobody. Noted, it is not."""
        if not self.open:
            self.cancelled[(conn, call_id)] = len(self.early)

    def to_take(self, start: int, stop: int) -> list[tuple[Connection, pb.Place]]:
        """The Places of `early[start:stop]` to take now: not one whose gateway left, nor one it
        cancelled after (a Place of the same id that came after the cancel is taken: the id named
        again, X-Call-Id, though no Place of it waited when the cancel came)."""
        return [
            (conn, request)
            for index, (conn, request) in enumerate(self.early[start:stop], start)
            if not conn.is_closed and index >= self.cancelled.get((conn, request.call_id), 0)
        ]

    def opened(self) -> None:
        """The Places that waited were taken: the term takes calls as they come."""
        self.early.clear()
        self.cancelled.clear()
        self.open = True


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
            if not value.isdecimal() or int(value) < 1 or (sep and not name):
                raise ValueError(f"slots: expected N or GPU_TYPE=N with N >= 1, got {part!r}")
            if sep:
                by_type[name] = int(value)
            else:
                default = int(value)
        return cls(default, by_type)


class SchedulerService:
    """Hosts the pure scheduler, cache manager and call book behind gpufaas.wire, and wires the
    catalog, the node links and the state persister around them. It owns the effects: `apply`
    carries out what the book decides, wherever the book was called from."""

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
        name: str | None = None,
        lease_ttl_s: int = LEASE_TTL_S,
        tls: LinkTls | bool = True,
        in_process: bool = False,
        hit_lease_s: float = DEFAULT_HIT_LEASE_S,
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
        `utilization_threshold` (scheduler.adaptive_slots; None: D fixed by `slots`). `name`, `lease_ttl_s`:
        this instance's among several (default: its address), its leadership lease (scheduler.leadership).
        `tls`: its links' (gpufaas.wire's); `in_process`: in a gateway's process, whose dials reach it in memory.
        `hit_lease_s`: how long a hit's placement leases its slot when nothing waits (0: never; CallBook.lease_s)."""
        _check_settings(gpu_idle_release_s, host_idle_release_s, prestage_nodes)
        self.gpu_idle_release_s, self.host_idle_release_s = gpu_idle_release_s, host_idle_release_s
        self.prestage_nodes, self.in_process = prestage_nodes, in_process
        self.store, self.wire_key, self.clock, self.tls, self.keys = store, wire_key, clock, tls, keys or Keys()
        self.policy_name = policy
        self.policy_config = policy_config if policy_config is not None else PolicyConfig()
        self.eviction = eviction
        self.slots = slots if slots is not None else SlotConfig()
        self.scheduler = _make_scheduler(policy, self.policy_config, eviction)
        adaptive = None if adaptive_slots is None else AdaptiveSlots(adaptive_slots, threshold=utilization_threshold)
        self.book = CallBook(self.scheduler, queue_capacity, claim_s, lost_after_s, adaptive, hit_lease_s)
        self.metrics = SchedulerMetrics(self.scheduler)
        self.evictions = EvictionLog()  # for the cluster views
        self.name = name or ""
        self.leadership = Leadership("", lease_ttl_s)
        self.metrics.registry.register(LeadershipCollector(self.leadership, self.clock))
        self.election: Election | None = None  # from start()
        self.term = _Term()  # a standby's: nothing
        self._tasks: set[asyncio.Task[None]] = set()
        self.persister, self.links, self.catalog = self._wire_parts()
        self._server = Server(lambda: GatewaySession(self), key=wire_key, tls=tls)
        self.address = ""

    def _wire_parts(self) -> tuple[StatePersister, NodeLinks, Catalog]:
        """The persister, the node links and the catalog, sharing the book and `apply`."""
        persister = StatePersister(self.store, self.keys, self.scheduler, self.book, self.clock)
        persister.may_write = self._may_write
        functions: dict[str, FunctionSpec] = {}  # the catalog's mirror; the node links read it
        links = NodeLinks(
            self.scheduler,
            self.book,
            persister,
            functions=functions,
            apply=self.apply,
            spawn=self._spawn,
            session_for=lambda node: NodeSession(self, node),
            slots_for=self.slots.for_type,
            clock=self.clock,
            wire_key=self.wire_key,
            tls=self.tls,
            prestage_nodes=self.prestage_nodes,
            fenced=self._fenced,
        )
        store, scheduler, book = self.store, self.scheduler, self.book
        catalog = Catalog(store, self.keys, scheduler, book, links, functions=functions, apply=self.apply)
        persister.models_run = lambda: {spec.model for spec in functions.values()}
        catalog.retired = self.metrics.forget_model  # (a model's series go with it)
        return persister, links, catalog

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, listen: str = "127.0.0.1:0", *, advertise: str | None = None) -> str:
        """Serve, mirror etcd's catalog (functions, profiles, nodes) and run for the leadership;
        returns the address the leader key names while this scheduler leads (`advertise`, else
        the bound listen address). It places calls only while it leads (`take_office`)."""
        bound = await self._server.start(listen)
        self.address = advertise or bound
        self.name = self.name or self.address
        self.leadership.address = self.address
        if self.in_process:  # before it can lead: a gateway of this process never dials it over TCP
            serve_here(self.address, self._server, role="scheduler")
        try:
            revision = await self.catalog.recover()
        except BaseException:
            if self.in_process:  # (a start that fails is not stopped: nothing else withdraws it)
                withdraw(self.address)
            raise
        for watch in self.catalog.watches(revision):
            self._spawn(watch)
        self.election = Election(
            self.store, self.keys.scheduler_leader, self.leadership, self, clock=self.clock, dial=self._dial_leader
        )
        self._spawn(self.election.run())
        log.info(
            "scheduler %s serving on %s (policy %s, %s; eviction %s); running for the leadership",
            self.name,
            self.address,
            self.policy_name,
            self.policy_config,
            self.eviction,
        )
        return self.address

    async def _dial_leader(self, address: str, timeout_s: float) -> Connection:
        """A standby's tether to the leader (scheduler.election): a link that carries nothing."""
        try:
            return await connect(address, timeout_s=timeout_s, key=self.wire_key, tls=self.tls, peer_role="scheduler")
        except Unauthenticated as exc:
            raise TetherRefused(str(exc)) from None

    async def stop(self) -> None:
        leading = self.leadership.leading(self.clock())
        await _cancel(self._tasks)
        if leading:
            with contextlib.suppress(StoreError):
                await self.persister.flush(final=True)  # profiles too, however recently written
        if self.in_process:
            withdraw(self.address)
        await self._server.close()
        if self.election is not None:
            await self.election.resign()  # the key goes at once: a standby takes over
        self.links.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], *, term: bool = False) -> None:
        """Run `coro` as a task until stop(); a `term` one only until the term ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if term:
            self.term.tasks.add(task)
            task.add_done_callback(self.term.tasks.discard)

    # --- terms (scheduler.election) -----------------------------------------------------------
    async def take_office(self, epoch: int) -> None:
        """Lead as `epoch`, as a restarted scheduler: read the persisted profiles and LRU lists, attach the nodes
        under a new grant key, run the term's loops; gateways find it in etcd and send the calls they hold."""
        self.term = term = _Term(uuid.uuid4().hex, grants.new_key(), open=False)
        # Under an election every write of the term is fenced on the leader key being this term's.
        self.persister.new_term(fence=(self.keys.scheduler_leader, epoch) if self.election is not None else None)
        await self.catalog.read_profiles(epoch)  # the last leader's measurements, not those of our start
        self.links.recovered_lru = await self.persister.recover(self.links.registered_gpu_ids())
        self.links.activate(term.scheduler_id, term.token_key, epoch)
        for work in self._term_work():
            self._spawn(work, term=True)
        log.info("scheduler %s leads (epoch %d): attaching %d node(s)", self.name, epoch, len(self.links.nodes))

    def _term_work(self) -> list[Coroutine[Any, Any, None]]:
        work = [self._open_when_attached(), self.persister.run(), self._ticker(), self.links.reconciler()]
        if self.book.adaptive_slots is not None:
            work.append(self._utilization_sampler())
        if (
            self.gpu_idle_release_s is not None
            or self.host_idle_release_s is not None
            or self.scheduler.policy.releases_memory
        ):
            work.append(self._releaser())
        return work

    async def _open_when_attached(self) -> None:
        """Take calls once every registered node has attached or drains (or after ATTACH_WAIT_S):
        a call placed sooner would find no GPU, or not the one that holds its model."""
        term, deadline = self.term, self.clock() + ATTACH_WAIT_S
        while not none_to_attach(self.links) and self.clock() < deadline:
            await asyncio.sleep(ATTACH_POLL_S)
        gc.collect()  # first, so that no cycle left over from an earlier term is frozen for good
        gc.freeze()  # what lives now (the attached cluster) leaves the collector's walks: O(1)
        # The Places that waited, oldest first, EARLY_PER_SLICE at a time with the loop's other
        # work between (the lease's keep-alives among it: a new leader under a flood has
        # thousands); then, in one go, those that arrived meanwhile, and the term is open.
        waited, taken = len(term.early), 0
        while taken < waited:
            self._take_early(taken, min(taken + EARLY_PER_SLICE, waited))
            taken += EARLY_PER_SLICE
            await asyncio.sleep(0)
        self._take_early(waited, len(term.early))
        term.opened()

    def _take_early(self, start: int, stop: int) -> None:
        for conn, request in self.term.to_take(start, stop):
            self._take(conn, request)

    def confirmed(self) -> None:
        """Sure of the leadership again: carry out what was decided meanwhile (`still_due`)."""
        held, self.term.held = self.term.held, []
        self.apply(still_due(held, self.book, self.scheduler.cluster.gpus, self.clock()))

    async def leave_office(self, reason: str) -> None:
        """A standby again (the leadership says so already, so nothing decided now goes out):
        end the term's loops, take every node's GPUs out and close its link, close every
        gateway's connection (its calls are the next leader's to place) and forget the term."""
        await _cancel(self.term.tasks)
        self.term = _Term()  # what it held, and the Places it kept waiting, are dropped
        self.links.deactivate()
        now = self.clock()
        for conn in list(self._server.connections):
            conn.close()
            self.book.owner_lost(conn, now)  # the gateway sends its calls to the next leader
        self.persister.new_term()
        if len(self.book):
            log.warning("%d call(s) left in the book after stepping down", len(self.book))
        log.info("scheduler %s stands by (%s)", self.name, reason)

    def serves_gateways(self) -> bool:
        """A gateway's connection is served while this scheduler leads (a standby closes it)."""
        return self.leadership.role is Role.LEADER

    def _may_write(self) -> bool:
        """The persister writes while this scheduler leads and is sure of it (or, not started,
        in tests of its parts)."""
        return self.election is None or self.leadership.leading(self.clock())

    def _fenced(self) -> None:
        """A node has seen a newer leader: step down now."""
        self.leadership.fenced()
        if self.election is not None:
            self.election.wake()

    # --- effects --------------------------------------------------------------------------
    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out what the book decided: placements and rejections to their gateways, grant
        checks and evictions to the nodes (as tasks); the changes are flushed to etcd soon."""
        now = self.clock()  # one reading for the batch: the effects were decided together
        if not self.leadership.leading(now):
            # An unsure leader holds them until its lease is confirmed (or drops them when it
            # steps down); a standby's (its catalog retiring a model) are the leader's to do.
            if self.leadership.unsure(now):
                self.term.held.extend(effects)
            return
        for effect in effects:
            self.metrics.applied(effect)
            self.evictions.record(effect, now)
            if isinstance(effect, Assignment):
                self._place(effect)
            elif isinstance(effect, Answer):
                self._reject(effect.owner, effect.call_id, effect.status, effect.message)
            elif isinstance(effect, CheckGrants):
                self._spawn(self.links.check_grants(effect))
            elif isinstance(effect, EvictHost):
                self._spawn(self.links.evict_host(effect))
            else:
                self._spawn(self.links.evict(effect))
        self.persister.want_flush()

    def _place(self, a: Assignment) -> None:
        node_name, gpu = split_gpu_address(a.gpu_id)
        node = self.links.nodes[node_name]
        to_wall = time.time() - self.clock()
        spec = a.spec
        epoch = self.leadership.epoch
        grant = pb.Grant(
            scheduler_id=self.term.scheduler_id,
            epoch=epoch,
            call_id=a.call_id,
            attempt=a.attempt,
            node=node_name,
            gpu=gpu,
            gpu_seq=a.gpu_seq,
            evict=a.evict,
            claim_by_unix_s=a.claim_by + to_wall,
            expires_unix_s=a.deadline + to_wall,
            load_time_s=self.scheduler.estimator.load_time_s(
                spec.model, self.scheduler.gpu(a.gpu_id).spec.gpu_type, spec.memory_mb
            ),
            inference_time_s=a.est_inference_time_s,
            lease_s=a.lease_s,  # (a call under the lease carries its own deadline: Execute.timeout_s)
        )
        # The function's own fields are encoded once per function version (`grants.function_part`).
        function_part = grants.function_part(
            spec.name, spec.model, spec.package_digest, spec.memory_mb, spec.worker_wire
        )
        placement = pb.Placement(
            call_id=a.call_id,
            attempt=a.attempt,
            node=node_name,
            node_address=node.record.address,
            gpu=gpu,
            hit=a.hit,
            queue_s=a.queue_s,
            token=grants.sign(grant, self.term.token_key, function_part=function_part),
            epoch=epoch,
            lease_s=a.lease_s,
        )
        self._send(a.owner, MessageType.PLACEMENT, placement)

    def _reject(self, owner: object, call_id: str, status: int, message: str) -> None:
        """The call's answer without a result: a Rejection."""
        rejection = pb.Rejection(call_id=call_id, status=status, message=message)  # type: ignore[arg-type]
        self._send(owner, MessageType.REJECTION, rejection)

    @staticmethod
    def _send(owner: object, type_: int, message: Any) -> None:
        assert isinstance(owner, Connection)
        with contextlib.suppress(ConnectionLost):  # the owner is gone: owner_lost cleans up
            owner.send(type_, message)

    # --- from gateways and nodes ------------------------------------------------------------
    def place(self, conn: Connection, request: pb.Place) -> None:
        """A gateway's Place: submitted now, or kept in arrival order while the term is not open."""
        if not self.term.open:
            self.term.early.append((conn, request))
            return
        self._take(conn, request)

    def _take(self, conn: Connection, request: pb.Place) -> None:
        """Submit a Place to the book (a function not known yet is read through etcd first)."""
        spec = self.catalog.functions.get(request.function)
        if spec is None:
            # A deploy that just happened may not have reached the watch yet: read through once.
            self._spawn(self._place_unknown(conn, request))
            return
        self._submit(conn, request, spec)

    async def _place_unknown(self, conn: Connection, request: pb.Place) -> None:
        term = self.term
        spec = await self.catalog.read_through(request.function)
        if conn.is_closed or self.term is not term:
            return  # its gateway, or the term, ended meanwhile: the next leader places it
        if spec is None:
            self._reject(conn, request.call_id, pb.NOT_FOUND, not_deployed(request.function))
            return
        self._submit(conn, request, spec)

    def _submit(self, conn: Connection, request: pb.Place, spec: FunctionSpec) -> None:
        timeout_s = request.timeout_s if request.timeout_s > 0 else spec.timeout_s
        try:
            # While a registered node is not attached (a new leader attaching them, a node linking
            # again), a call that finds no GPU waits for one rather than being refused. The book
            # reads it only when no GPU is attached: asked then only (it walks every node).
            attaching = not self.scheduler.cache.num_gpus and not self.links.all_attached()
            effects = self.book.submit(
                conn,
                request.call_id,
                spec,
                timeout_s,
                self.clock(),
                nodes_attaching=attaching,
                lease=request.lease,
                named=request.given_call_id,
                worker_died=request.worker_died,
            )
        except Rejected as exc:
            self._reject(conn, request.call_id, exc.status, str(exc))
            return
        self.apply(effects)

    def holdings_reported(self, node: NodeLink, holdings: pb.Holdings) -> None:
        """A node said what its disk and host pool hold (scheduler.node_links)."""
        self.links.holdings_reported(node, holdings)

    # --- time -----------------------------------------------------------------------------
    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.apply(self.book.tick(self.clock()))

    async def _utilization_sampler(self) -> None:
        """Adaptive D: what runs on each GPU, sampled a few times per controller period."""
        while True:
            await asyncio.sleep(UTILIZATION_SAMPLE_S)
            self.apply(self.book.observe_utilization(self.clock()))

    async def _releaser(self) -> None:
        """EDAS's staged exit and the policy's swap-out: now and then (`release_check_period_s`),
        release what has been idle past its stage's timeout or what the policy names idle."""
        period_s = release_check_period_s(
            self.gpu_idle_release_s, self.host_idle_release_s, policy_releases=self.scheduler.policy.releases_memory
        )
        while True:
            await asyncio.sleep(period_s)
            effects = self.book.release_idle(
                self.clock(), gpu_idle_s=self.gpu_idle_release_s, host_idle_s=self.host_idle_release_s
            )
            if effects:
                log.info("%d release(s) of idle models", len(effects))
                self.metrics.released(effects)
            self.apply(effects)


def still_due(held: list[Effect], book: CallBook, gpus: Container[str], now: float) -> list[Effect]:
    """What an unsure leader held, to carry out now it is sure again. A placement whose GPU left
    meanwhile (its node detached or gone), so that the book stranded its call, is not sent: it
    never reached its owner, so the call is placed again as one the owner never sent."""
    due: list[Effect] = []
    for effect in held:
        if isinstance(effect, Assignment) and (
            effect.gpu_id not in gpus or book.placement(effect.call_id, effect.attempt) is None
        ):
            due += book.unsent(effect.call_id, effect.attempt, now)
        else:
            due.append(effect)
    return due


async def _cancel(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them to end."""
    for task in list(tasks):
        task.cancel()
    for task in list(tasks):
        with contextlib.suppress(BaseException):
            await task


def _make_scheduler(policy: str, policy_config: PolicyConfig, eviction: str) -> Scheduler:
    """The pure scheduler: the named policy, the paper's profiles as the estimator's prior, and a
    cache manager evicting by the named eviction policy."""
    return Scheduler(
        make_policy(policy, policy_config),
        estimator=Estimator(paper_table1()),
        cache=CacheManager(eviction_policy(eviction)),
    )


def _check_settings(gpu_idle_release_s: float | None, host_idle_release_s: float | None, prestage_nodes: int) -> None:
    """ValueError for a staged-exit timeout that is not > 0, or a negative `prestage_nodes`."""
    for name, value in (
        ("gpu_idle_release_s", gpu_idle_release_s),
        ("host_idle_release_s", host_idle_release_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 seconds (or None: that stage off), got {value}")
    if prestage_nodes < 0:
        raise ValueError(f"prestage_nodes must be >= 0, got {prestage_nodes}")
