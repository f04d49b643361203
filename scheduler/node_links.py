"""The scheduler's links to its nodes: attach each registered node (hand it the token key, learn
the workers it runs), keep it attached, reconcile with what it runs, learn what it holds below its
GPUs, pre-stage packages, and carry the book's node effects (grant checks, evictions)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufaas.cluster import NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import gpu_address, split_gpu_address
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.tls import LinkTls
from gpufaas.types import GpuSpec, ModelSpec
from gpufaas.wire import (
    Connection,
    ConnectionLost,
    Handler,
    MessageType,
    RemoteError,
    Unauthenticated,
    connect,
)
from gpufaas.wire_local import link_here
from scheduler.calls import CallBook, CheckGrants, Effect, Evict, EvictHost
from scheduler.core import Scheduler
from scheduler.node_drain import drain_node, same_manager
from scheduler.persister import StatePersister
from scheduler.reconciler import NODE_TIMEOUT_S, parked_of, reconcile_nodes, resident_of
from scheduler.staging import GpuRoom, fits, staging_targets

log = logging.getLogger("gpufaas.scheduler")

EVICT_TIMEOUT_S = 30.0  # stopping workers may take a while: an Evict is not a liveness probe
RECONNECT_S = 0.5
PRESTAGE_SETTLE_S = 0.2  # attaches within this long of one another are pre-staged for together


@dataclass(slots=True)
class NodeLink:
    """One registered node (one incarnation) and the scheduler's link to it."""

    record: NodeRecord
    conn: Connection | None = None
    gpu_ids: list[str] = field(default_factory=list)  # in the scheduler (attached) or empty
    holdings: pb.Holdings | None = None  # its latest report of what its disk and host pool hold
    holdings_frames: int = 0  # Holdings frames taken from it (`holdings_answered` counts on them)


def _attach_failed(node: NodeLink, exc: BaseException, fenced: Callable[[], None]) -> None:
    """An attach of `node` failed with `exc`: logged as it deserves; `fenced` called if it was
    refused for a newer leader's epoch."""
    if isinstance(exc, RemoteError) and exc.status == pb.FENCED:
        log.warning("node %s refused to attach: %s", node.record.node, exc)
        fenced()
        return
    # A wrong secret, or a node that answers with an error (a certificate of another role, an
    # address that is no node's), is a misconfiguration an operator must see; the rest (a node
    # down or not answering) is routine.
    level = logging.WARNING if isinstance(exc, (Unauthenticated, RemoteError)) else logging.DEBUG
    log.log(level, "node %s at %s: %s", node.record.node, node.record.address, exc)


class NodeLinks:
    """Every registered node's link. A node's GPUs are in the scheduler exactly while its link is
    attached (`gpu_ids` not empty); taking them out sends their calls back to the queue. Touched
    from the event loop only; what is decided is handed to `apply`, tasks to `spawn`."""

    def __init__(
        self,
        scheduler: Scheduler,
        book: CallBook,
        persister: StatePersister,
        *,
        functions: Mapping[str, FunctionSpec],
        apply: Callable[[Iterable[Effect]], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        session_for: Callable[[NodeLink], Handler],
        slots_for: Callable[[str], int],
        clock: Callable[[], float],
        wire_key: bytes | None,
        prestage_nodes: int,
        fenced: Callable[[], None] = lambda: None,
        tls: LinkTls | bool = True,
    ) -> None:
        """`functions`: the catalog's mirror, read here (which models a package digest backs).
        `session_for`: the handler of a node's connection (its Done and Holdings frames).
        `slots_for`: a GPU type's D. `prestage_nodes`: how many nodes get a new function's
        package (0: none). `fenced`: a node refused to attach because it has seen a newer
        leader's epoch. `tls`: the links' TLS (gpufaas.wire.connect's). Nodes are attached only
        between `activate` and `deactivate` (a term)."""
        self.scheduler = scheduler
        self.book = book
        self.persister = persister
        self.functions = functions
        self.apply = apply
        self.spawn = spawn
        self.session_for = session_for
        self.slots_for = slots_for
        self.clock = clock
        self.wire_key, self.tls = wire_key, tls
        self.prestage_nodes = prestage_nodes
        self.fenced = fenced
        # The term's: who signs its grants (handed to every node on Attach, with its epoch).
        self.scheduler_id = ""
        self.token_key = b""
        self.epoch = 0
        self.term = 0  # counts terms; 0 (and whenever `active` is off): nothing is attached
        self.active = False
        self.nodes: dict[str, NodeLink] = {}
        # "node/gpu" -> models, most recent first, as persisted before a restart: each GPU's
        # recency order, taken once when its node attaches.
        self.recovered_lru: dict[str, list[str]] = {}
        self._prestaged: set[str] = set()  # packages pre-staging has placed (once each)
        self._prestage_pending = False  # a pre-staging of every function waits for the attaches

    def all_attached(self) -> bool:
        """Whether every registered node is attached (its GPUs in the scheduler)."""
        return all(node.gpu_ids for node in self.nodes.values())

    def registered_gpu_ids(self) -> set[str]:
        """Every registered node's GPUs, attached or not."""
        return {gpu_address(node.record.node, gpu.gpu) for node in self.nodes.values() for gpu in node.record.gpus}

    def close(self) -> None:
        for node in self.nodes.values():
            if node.conn is not None:
                node.conn.close()

    # --- terms --------------------------------------------------------------------------------
    def activate(self, scheduler_id: str, token_key: bytes, epoch: int) -> None:
        """A term begins: attach every registered node, handing it this term's key and epoch."""
        self.scheduler_id, self.token_key, self.epoch = scheduler_id, token_key, epoch
        self.term += 1
        self.active = True
        self._prestaged.clear()  # a new term places packages afresh
        for node in self.nodes.values():
            self.spawn(self._keep_attached(node))

    def deactivate(self) -> None:
        """The term ends: every node's GPUs are taken out, all at once, and its connection
        closed; the registered nodes are kept (the catalog goes on watching them) for the next
        term. (Node by node, each node's calls would be placed again on the nodes not yet taken
        out: a scheduler stepping down with a long queue spent seconds placing it 50 times.)"""
        self.active = False
        self.detach(*self.nodes.values())
        for node in self.nodes.values():
            if node.conn is not None:
                node.conn.close()
                node.conn = None

    # --- registration -----------------------------------------------------------------------
    def seen(self, record: NodeRecord) -> None:
        """A node's record (new or changed): link to it, once per incarnation. A running GPU
        manager registers the same record under every lease; one changed under the same
        incarnation (by hand) is the same manager still running its calls: at another address
        only, its link and GPUs stay (its next connection goes there); else it is linked afresh."""
        known = self.nodes.get(record.node)
        if known is not None and known.record == record:
            return
        if known is not None and known.record.incarnation == record.incarnation:
            if same_manager(known.record, record):  # (`_keep_attached` dials `record.address` each time)
                if known.record.address != record.address:
                    log.info("node %s is now at %s (the same incarnation)", record.node, record.address)
                drains, known.record = record.draining and not known.record.draining, record
                if drains and self.active:
                    self.spawn(drain_node(self, known))
                return
            log.warning(
                "node %s's record changed under the same incarnation %s: linked afresh", record.node, record.incarnation
            )
        elif known is not None:
            # A restarted GPU manager (a new incarnation): its workers, and so its models, are gone.
            log.info("node %s re-registered (incarnation %s)", record.node, record.incarnation)
        if known is not None:
            self.gone(record.node)
        node = NodeLink(record)
        self.nodes[record.node] = node
        if self.active:
            self.spawn(self._keep_attached(node))

    def gone(self, name: str) -> None:
        """A node is no longer registered: take its GPUs out and drop its link."""
        node = self.nodes.pop(name, None)
        if node is None:
            return
        if self.active:
            # All its GPUs' keys go, not only those of the GPUs attached (`detach`): one that
            # left before it attached kept the last term's (recovery spared them, as registered).
            self.persister.gpus_left([gpu_address(node.record.node, gpu.gpu) for gpu in node.record.gpus])
            self.persister.want_flush()
        self.detach(node)
        if node.conn is not None:
            node.conn.close()

    # --- attachment -------------------------------------------------------------------------
    async def _keep_attached(self, node: NodeLink) -> None:
        """Connect to the node and attach (hand it the term's token key and epoch, learn its
        workers), then add its GPUs; when the connection drops, take them out and try again
        while the node is registered under the same incarnation and the term lasts."""
        session = self.session_for(node)
        term = self.term
        while self._linked(node, term):
            conn: Connection | None = None
            try:
                conn = await self._dial(node.record.address, session)
                if not self._linked(node, term):
                    # The term ended (or the node left) while dialling: an Attach now would make
                    # the node drop the link a later term (or incarnation) attached it on.
                    conn.close()
                    return
                frames = node.holdings_frames
                reply = (
                    await conn.request(
                        MessageType.ATTACH,
                        pb.Attach(scheduler_id=self.scheduler_id, token_key=self.token_key, epoch=self.epoch),
                        timeout_s=NODE_TIMEOUT_S,
                    )
                ).message(pb.AttachReply)
            except BaseException as exc:
                if conn is not None:
                    conn.close()  # (a node that refused the attach, FENCED, keeps its end open)
                if not isinstance(exc, (ConnectionLost, TimeoutError, RemoteError)):
                    raise  # cancelled: the term ended
                if not self._linked(node, term):
                    return  # (a refusal of an ended term's Attach says nothing of the term now)
                _attach_failed(node, exc, self.fenced)
                await asyncio.sleep(RECONNECT_S)
                continue
            if not self._linked(node, term) or reply.incarnation != node.record.incarnation:
                conn.close()  # it left or restarted meanwhile (the watch brings the new record), or the term ended
                return
            node.conn = conn
            self._attach(node, reply, frames)
            lost = await conn.closed
            if self._linked(node, term):
                log.warning(
                    "lost the connection to node %s (%s); taking its GPUs out, %d placed call(s) stranded there",
                    node.record.node,
                    lost,
                    len(self.book.placed_on(node.record.node)),
                )
                self.detach(node)
            if node.conn is conn:  # (a later term may have attached it again meanwhile)
                node.conn = None
            await asyncio.sleep(RECONNECT_S)

    async def _dial(self, address: str, session: Handler) -> Connection:
        # In memory where this process runs the node (a gateway run with --with-scheduler --with-node).
        here = link_here(address, session, client_role="scheduler", peer_role="node")
        if here is not None:
            return here
        return await connect(
            address, session, timeout_s=NODE_TIMEOUT_S, key=self.wire_key, tls=self.tls, peer_role="node"
        )

    def _linked(self, node: NodeLink, term: int) -> bool:
        """Whether `node` (this incarnation) is still to be kept attached in term `term`."""
        return self.active and self.term == term and self.nodes.get(node.record.node) is node

    def _attach(self, node: NodeLink, reply: pb.AttachReply, holdings_frames: int = 0) -> None:
        """Add the node's GPUs, as `reply` says (none where it drains); `holdings_frames`:
        `holdings_answered`'s."""
        if node.record.draining:
            self.spawn(drain_node(self, node))
            return
        resident = resident_of(node.record.node, reply)
        effects: list[Effect] = []
        for gpu in node.record.gpus:
            address = gpu_address(node.record.node, gpu.gpu)
            slots = self.slots_for(gpu.gpu_type)
            if self.book.adaptive_slots is not None:  # within adaptive D's bounds from its first call
                slots = self.book.adaptive_slots.start_slots(address, slots)
            link = None if gpu.link is None else f"{node.record.node}/{gpu.link}"
            self.scheduler.add_gpu(
                GpuSpec(address, gpu.memory_mb, gpu.gpu_type, slots=slots, node=node.record.node, link=link)
            )
            node.gpu_ids.append(address)
            self.persister.gpu_joined(address)
            workers = resident.get(address, {})
            # Oldest first, so the recency order persisted before a restart comes back.
            order = [m for m in reversed(self.recovered_lru.pop(address, [])) if m in workers]
            ordered = {m: workers[m] for m in order} | workers
            effects += self.book.reconcile(address, ordered, self.clock())
        effects += self.book.reconcile_host(node.record.node, reply.host_memory_mb, parked_of(reply))
        log.info(
            "node %s attached: %d GPU(s), %d resident model(s)", node.record.node, len(node.gpu_ids), len(reply.workers)
        )
        self.holdings_answered(node, reply.holdings, holdings_frames)
        self.apply(effects + self.book.schedule(self.clock()))
        self._prestage_all_soon()

    def detach(self, *nodes: NodeLink) -> None:
        """Take the nodes' GPUs out: their parked calls go back to the queue; their placed ones are
        placed again only where their gateway never sent them (scheduler.calls, STRANDED)."""
        gpu_ids = [gpu_id for node in nodes for gpu_id in node.gpu_ids]
        for node in nodes:
            node.gpu_ids = []
        if not gpu_ids:
            return
        self.persister.gpus_left(gpu_ids)
        self.apply(self.book.gpus_removed(gpu_ids, self.clock()))

    def _disconnect(self, node: NodeLink) -> None:
        """Stop using a node that does not answer: `_keep_attached` takes its GPUs out and
        re-attaches it if it answers again (under the same incarnation)."""
        if node.conn is not None:
            node.conn.close()
        else:
            self.detach(node)

    async def reconciler(self) -> None:
        """Reconcile every attached node with what it runs, now and then (scheduler.reconciler)."""
        await reconcile_nodes(self)

    # --- what nodes hold below their GPUs, and pre-staging ---------------------------------
    def holdings_reported(self, node: NodeLink, holdings: pb.Holdings) -> None:
        """A node said what its disk and host pool hold (package digests): the cache manager
        learns it by model, so misses are priced and placed by the tier they come from."""
        node.holdings_frames += 1
        node.holdings = holdings
        self.learn_holdings(node)

    def holdings_answered(self, node: NodeLink, holdings: pb.Holdings, frames_before: int) -> None:
        """A node's answer (AttachReply, WORKERS) said what it holds, `frames_before` its count of
        Holdings frames when asked. A frame that came since is kept: the answer's task resumes
        after the frames read with it, so taking the answer would undo a newer report (one sent
        before the answer is no loss: the node reports every change soon after, so its last frame
        is its newest)."""
        if node.holdings_frames == frames_before:
            node.holdings = holdings
        self.learn_holdings(node)

    def learn_holdings(self, only: NodeLink | None = None) -> None:
        """Tell the cache manager, by model, what `only` (else every attached node) last reported
        holding: call it again when the functions change (a digest may back a new model)."""
        models_of: dict[str, list[str]] = {}
        for spec in self.functions.values():
            models_of.setdefault(spec.package_digest, []).append(spec.model)
        for node in [only] if only is not None else list(self.nodes.values()):
            if node.holdings is None or not node.gpu_ids:
                continue
            self.scheduler.cache.holdings.report(
                node.record.node,
                pooled={m for d in node.holdings.pooled for m in models_of.get(d, ())},
                staged={m for d in node.holdings.staged for m in models_of.get(d, ())},
            )

    def is_prestaged(self, package_digest: str) -> bool:
        """Pre-staging has placed this package already (it is placed once)."""
        return package_digest in self._prestaged

    def _prestage_all_soon(self) -> None:
        """Pre-stage every function once the nodes attaching now have attached: one ranking per
        wave of attaches, not one per node (each ranks every function over every GPU: at 50
        nodes of 20 GPUs and 200 functions, once per attach held the event loop 10 s, past the
        leader's lease)."""
        if self._prestage_pending:
            return
        self._prestage_pending = True
        self.spawn(self._prestage_all_later())

    async def _prestage_all_later(self) -> None:
        try:
            await asyncio.sleep(PRESTAGE_SETTLE_S)
        finally:
            self._prestage_pending = False
        self.prestage(self.functions.values())

    def prestage(self, specs: Iterable[FunctionSpec]) -> None:
        """Ask the nodes a function's misses are expected to land on to bring its package now
        (scheduler.staging), each node once for all it lacks."""
        if not self.prestage_nodes:
            return
        rooms: dict[str, list[GpuRoom]] = {}
        for name, node in self.nodes.items():
            if node.conn is None or not node.gpu_ids or node.holdings is None:
                continue
            rooms[name] = [
                GpuRoom(spec.memory_mb, spec.gpu_type, self.scheduler.cache.gpu(gpu_id).free_mb)
                for gpu_id in node.gpu_ids
                for spec in (self.scheduler.gpu(gpu_id).spec,)
            ]
        staged = {n: set(self.nodes[n].holdings.staged) for n in rooms}  # type: ignore[union-attr]
        wanted: dict[str, list[str]] = {}
        for spec in specs:
            staged_on = {n for n in rooms if spec.package_digest in staged[n]}
            model = ModelSpec(spec.model, spec.memory_mb, spec.required_gpu_type)
            for target in staging_targets(model, rooms, staged_on, copies=self.prestage_nodes):
                wanted.setdefault(target, []).append(spec.package_digest)
                # Its miss is expected there, on the GPU it fits with the most room: the next function's
                # room is what is left, so functions deployed at once spread over the nodes, not all to one.
                gpus = rooms[target]
                best = max((i for i, gpu in enumerate(gpus) if fits(model, gpu)), key=lambda i: gpus[i].free_mb)
                gpus[best] = dataclasses.replace(gpus[best], free_mb=gpus[best].free_mb - spec.memory_mb)
            if rooms:
                self._prestaged.add(spec.package_digest)
        for name, digests in wanted.items():
            self.spawn(self._stage(self.nodes[name], sorted(set(digests))))

    async def _stage(self, node: NodeLink, digests: list[str]) -> None:
        if node.conn is None:
            return
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.STAGE, pb.Stage(packages=digests), timeout_s=NODE_TIMEOUT_S)
            log.info("asked node %s to stage %d package(s)", node.record.node, len(digests))

    # --- the book's node effects ------------------------------------------------------------
    async def check_grants(self, effect: CheckGrants) -> None:
        """Ask the node which of these grants it has seen (revoking the rest); a node that cannot
        answer is disconnected."""
        node = self.nodes.get(effect.node)
        claim_by = self.book.claim_by(effect.grants)
        request = pb.Revoke(
            if_idle=effect.if_idle,
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
            # The node cannot say: a call that may have reached it cannot be run again (its owner
            # hears that its outcome is unknown); the rest are the node's GPUs' (`gpus_removed`).
            log.warning("cannot check grants with node %s (%s); taking it out", effect.node, exc)
            self.apply(self.book.grants_unchecked(effect.grants))
            if node is not None:
                self._disconnect(node)
            return
        self.apply(
            self.book.grants_checked(
                effect.node,
                [(g.call_id, g.attempt) for g in reply.unseen],
                [(g.call_id, g.attempt) for g in reply.seen],
                self.clock(),
                busy=[(g.call_id, g.attempt) for g in reply.busy],
            )
        )

    async def evict(self, effect: Evict) -> None:
        node_name, gpu = split_gpu_address(effect.gpu_id)
        node = self.nodes.get(node_name)
        if node is None or node.conn is None:
            return
        request = pb.Evict(
            gpu=gpu, models=effect.models, to_host=effect.to_host, if_idle=effect.if_idle, gpu_seq=effect.gpu_seq
        )
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.EVICT, request, timeout_s=EVICT_TIMEOUT_S)

    async def evict_host(self, effect: EvictHost) -> None:
        node = self.nodes.get(effect.node)
        if node is None or node.conn is None:
            return
        with contextlib.suppress(ConnectionLost, TimeoutError, RemoteError):
            await node.conn.request(MessageType.EVICT, pb.Evict(models=effect.models), timeout_s=EVICT_TIMEOUT_S)
