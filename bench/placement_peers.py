"""The scheduler placement benchmark's synthetic peers: nodes that speak a GPU manager's side of the
wire but run no workers, and gateways that speak a gateway's; one client process hosts
some of each (`python -m bench.placement_peers`, started by bench.placement_bench).

A `SyntheticNode` is what gpu_manager/daemon.py is to the scheduler and the gateways, minus the
workers: it registers its record in etcd under a lease, answers Attach and WorkersRequest with the
models it holds (`AttachReply`), Revoke through the real `GrantLedger`, Evict, Stage; it admits
every Execute's token through that ledger (signature, node, GPU, claim time, once), applies the
grant's victims (not one a later grant used, by `gpu_seq`, as gpu_manager.gpu_workers) and load to
its per-GPU table of resident models, counting a load that leaves a GPU over its memory (an
overcommit: the scheduler's plan and the node's disagree), answers `ExecuteReply` at once
(no inference is emulated: the calls cost the scheduler what they cost it, nothing more) and sends
the scheduler the `Done`, in that order, as the daemon does. Its holdings say every package is
staged on its disk (a warm cluster: a miss is priced as a disk load).

A `SyntheticGateway` is what gateway/router.py is per call: `Place` (call id, function, its
timeout, the payload's size) on its one scheduler connection, wait for the `Placement` (or a
`Rejection`), `Execute` (token) + payload on its connection to the node named, `ExecuteReply`;
a refused token is reported with `Abandon(REFUSED)` and the call waits for its next placement,
and a lost scheduler link is dialled again and the waiting calls asked again, as the router (at
this commit) does. It keeps `concurrency` calls outstanding (closed loop) and picks each call's
function from the mix's popularity weights; or, given a rate, it sends calls as they arrive (a
Poisson process), however many are outstanding (an open loop).

The client process speaks JSON lines with the driver: it prints `{"event": "registered"}` once its
nodes are in etcd; then, for each `{"go": ...}` line it reads (when to start, when the measured
window opens and closes, in `time.monotonic()` seconds: CLOCK_MONOTONIC is one clock for every
process of the machine; and `calls_per_s_per_gateway` for an open loop), it runs a phase with new
gateways and prints `{"event": "stats", ...}` after the window closed and its calls drained. It
leaves (deregistering its nodes) when its standard input closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.router import Mailbox, SchedulerSession
from gpu_manager.daemon import admit_scheduler, done_message, measured
from gpu_manager.ledger import GrantLedger, Refused
from gpu_manager.workers import RunResult
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore, LeaseKeeper
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, Server, connect

NODE_LEASE_TTL_S = 3  # gpu_manager.daemon's LEASE_TTL_S
GPU_TYPE = "cpu"  # what a cpu-backend GPU manager registers (gpu_manager/__main__.py)
BACKEND = "cpu"
PAYLOAD = b'{"x": [1, 2, 3, 4]}'  # a small JSON call, as the peer benchmark sends
CONTENT_TYPE = "application/json"
OUTPUT = b'{"y": 0}'
DRAIN_S = 10.0  # after the window: how long outstanding calls may take to finish
RECONNECT_S = 0.2  # gateway.router's
CHOICE_BLOCK = 4096  # functions drawn at once (one random.choices call per block)
RELEASE_TICK_S = 0.001  # an open loop wakes at most this often (the loop's timers have milliseconds)
MAX_LOGGED = 5  # overcommits described on stderr (the client's log)


@dataclass
class NodeCounts:
    """What one client process's nodes saw."""

    attaches: int = 0
    executes: int = 0
    loads: int = 0  # Executes whose model was not resident on the GPU (the node loaded it)
    dones: int = 0  # Done messages sent to the scheduler
    refused: int = 0  # tokens the ledger refused
    overcommits: int = 0  # a load left the GPU's resident models over its memory
    out_of_order: int = 0  # grants presented after a later grant (higher gpu_seq) for the same GPU
    evict_requests: int = 0
    revokes: int = 0


class SyntheticNode:
    """One node's GPU-manager side of the wire, without workers (see the module's docstring)."""

    def __init__(
        self,
        store: EtcdStore,
        keys: Keys,
        name: str,
        *,
        gpus: int,
        memory_mb: int,
        digests: list[str],
        counts: NodeCounts,
    ) -> None:
        self.store, self.keys, self.name = store, keys, name
        self.memory_mb = memory_mb
        self.gpu_ids = [f"gpu{index}" for index in range(gpus)]
        # gpu -> {model: MiB}, least recently used first (insertion order).
        self.resident: dict[str, dict[str, int]] = {gpu: {} for gpu in self.gpu_ids}
        # gpu -> {model: the latest grant (gpu_seq) that used it}, and the newest grant seen per GPU.
        self.last_seq: dict[str, dict[str, int]] = {gpu: {} for gpu in self.gpu_ids}
        self.newest_seq: dict[str, int] = {}
        self.ledger = GrantLedger(name, frozenset(self.gpu_ids))
        self.digests = digests
        self.counts = counts
        self.incarnation = uuid.uuid4().hex
        self.scheduler: Connection | None = None
        self.address = ""
        self._server = Server(lambda: _NodeSession(self))
        self._lease: LeaseKeeper | None = None

    async def start(self) -> None:
        """Serve on loopback and register the node's record under its lease."""
        self.address = await self._server.start("127.0.0.1:0")
        self._lease = LeaseKeeper(self.store, NODE_LEASE_TTL_S, on_regrant=self._register)
        await self._register(await self._lease.start())

    async def stop(self) -> None:
        if self._lease is not None:
            await self._lease.stop(revoke=True)
        await self._server.close()

    async def _register(self, lease: int) -> None:
        record = NodeRecord(
            node=self.name,
            address=self.address,
            backend=BACKEND,
            incarnation=self.incarnation,
            gpus=[GpuRecord(gpu, self.memory_mb, GPU_TYPE) for gpu in self.gpu_ids],
        )
        await self.store.put(self.keys.node(self.name), record.to_json(), lease=lease)

    def workers(self) -> pb.AttachReply:
        """The models it holds now, and its holdings: every package staged on disk."""
        return pb.AttachReply(
            node=self.name,
            incarnation=self.incarnation,
            workers=[
                pb.Worker(gpu=gpu, model=model, memory_mb=mb)
                for gpu, models in self.resident.items()
                for model, mb in models.items()
            ],
            holdings=pb.Holdings(staged=self.digests, disk_used_bytes=0),
        )

    def attach(self, conn: Connection, frame: Frame) -> None:
        attached = admit_scheduler(self.ledger, conn, frame, self.scheduler)
        if attached is None:
            return
        if attached[1]:
            self.newest_seq.clear()  # a new scheduler numbers its grants from 1 (the pool forgets them)
            for seqs in self.last_seq.values():
                seqs.clear()
        self.scheduler = conn
        self.counts.attaches += 1
        conn.reply(frame, MessageType.ATTACH_REPLY, self.workers())

    def execute(self, conn: Connection, frame: Frame) -> None:
        """An Execute on the wire: `run` its token, answer, then tell the scheduler."""
        reply, done = self.run(frame.message(pb.Execute).token)
        conn.reply(frame, MessageType.EXECUTE_REPLY, reply, OUTPUT if reply.outcome == pb.OK else b"")
        self.report(done)

    def run(self, token: bytes) -> tuple[pb.ExecuteReply, pb.Done | None]:
        """Admit the token, apply the grant's victims and load: the answer, and the Done for its
        scheduler (None for a refused token, or one another scheduler granted)."""
        counts = self.counts
        counts.executes += 1
        try:
            grant = self.ledger.admit(token, time.time())
        except Refused as exc:
            counts.refused += 1
            return pb.ExecuteReply(outcome=pb.REFUSED, message=str(exc)), None
        models, seqs = self.resident[grant.gpu], self.last_seq[grant.gpu]
        counts.out_of_order += grant.gpu_seq < self.newest_seq.get(grant.gpu, 0)
        self.newest_seq[grant.gpu] = max(self.newest_seq.get(grant.gpu, 0), grant.gpu_seq)
        for victim in grant.evict:
            # As gpu_manager.gpu_workers' `victim`: a worker a later grant used stays.
            if seqs.get(victim, 0) <= grant.gpu_seq:
                models.pop(victim, None)
        loaded = models.pop(grant.model, None) is None
        models[grant.model] = int(grant.memory_mb)  # the most recently used last
        seqs[grant.model] = max(seqs.get(grant.model, 0), grant.gpu_seq)
        counts.loads += loaded
        if sum(models.values()) > self.memory_mb:
            counts.overcommits += 1
            if counts.overcommits <= MAX_LOGGED:  # what a reader needs to tell whose plan it was
                print(
                    f"overcommit {self.name}/{grant.gpu} seq {grant.gpu_seq} (newest {self.newest_seq[grant.gpu]}):"
                    f" loaded {grant.model} evicting {list(grant.evict)}; resident {models}",
                    file=sys.stderr,
                    flush=True,
                )
        result = RunResult(
            outcome=pb.OK,
            loaded=loaded,
            load_time_s=grant.load_time_s if loaded else 0.0,
            inference_time_s=grant.inference_time_s,
            batch_calls=1,
            peak_memory_mb=grant.memory_mb,
        )
        reply = pb.ExecuteReply(**measured(result), content_type=CONTENT_TYPE)
        return reply, done_message(grant, result) if grant.scheduler_id == self.ledger.scheduler_id else None

    def report(self, done: pb.Done | None) -> None:
        """Send the scheduler a call's Done (as the daemon, after the call's answer)."""
        scheduler = self.scheduler
        if done is not None and scheduler is not None and not scheduler.is_closed:
            scheduler.send(MessageType.DONE, done)
            self.counts.dones += 1

    def revoke(self, conn: Connection, frame: Frame) -> None:
        request = frame.message(pb.Revoke)
        self.counts.revokes += 1
        unseen, seen = self.ledger.revoke(
            ((g.call_id, g.attempt) for g in request.grants), time.time(), claim_by_unix_s=request.claim_by_unix_s
        )
        reply = pb.RevokeReply(
            unseen=[pb.GrantRef(call_id=c, attempt=a) for c, a in unseen],
            seen=[pb.GrantRef(call_id=c, attempt=a) for c, a in seen],
        )
        conn.reply(frame, MessageType.REVOKE_REPLY, reply)

    def evict(self, conn: Connection, frame: Frame) -> None:
        """Stop the models' workers (none has calls in flight here: calls end as they start)."""
        request = frame.message(pb.Evict)
        self.counts.evict_requests += 1
        models = self.resident.get(request.gpu, {})
        evicted = [model for model in request.models if models.pop(model, None) is not None]
        conn.reply(frame, MessageType.EVICT_REPLY, pb.EvictReply(evicted=evicted))


class _NodeSession:
    """One accepted connection of a synthetic node (the scheduler's or a gateway's)."""

    def __init__(self, node: SyntheticNode) -> None:
        self.node = node

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        node, kind = self.node, frame.type
        if kind == MessageType.EXECUTE:
            node.execute(conn, frame)
        elif kind == MessageType.ATTACH:
            node.attach(conn, frame)
        elif kind == MessageType.WORKERS:
            conn.reply(frame, MessageType.ATTACH_REPLY, node.workers())
        elif kind == MessageType.REVOKE:
            node.revoke(conn, frame)
        elif kind == MessageType.EVICT:
            node.evict(conn, frame)
        elif kind == MessageType.STAGE:
            staged = list(frame.message(pb.Stage).packages)  # every package is on its disk already
            conn.reply(frame, MessageType.STAGE_REPLY, pb.StageReply(staged=staged))
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, f"a synthetic node does not answer message type {frame.type}")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        if self.node.scheduler is conn:
            self.node.scheduler = None


@dataclass
class GatewayStats:
    """What one client process's gateways measured; latencies in microseconds."""

    placements: int = 0  # Placements received in the window
    misses: int = 0  # of them, those the scheduler placed as a miss (Placement.hit false)
    hit_mismatches: int = 0  # the Placement said hit and the node loaded, or the reverse
    completed: int = 0  # calls whose ExecuteReply was OK, all run long
    placements_total: int = 0  # Placements received, all run long
    place_us: list[int] = field(default_factory=list)  # Place sent -> first Placement, calls sent in the window
    call_us: list[int] = field(default_factory=list)  # Place sent -> ExecuteReply, the same calls
    release_lag_us: list[int] = field(default_factory=list)  # open loop: arrival time -> sent, in the window
    rejected: int = 0  # calls sent in the window that the scheduler answered with a Rejection
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Window:
    """When the gateways start, and the measured window, in time.monotonic() seconds."""

    start_s: float
    open_s: float
    close_s: float


class SyntheticGateway:
    """One gateway's scheduler link (re-established when it drops, as the router's) and node links,
    and its callers: `concurrency` in a closed loop, or an open loop's arrivals."""

    def __init__(
        self,
        name: str,
        scheduler_address: str,
        *,
        functions: list[FunctionSpec],
        weights: list[float],
        concurrency: int,
        seed: int,
        stats: GatewayStats,
        local_nodes: dict[str, SyntheticNode] | None = None,
    ) -> None:
        self.name, self.scheduler_address = name, scheduler_address
        # address -> a node of this process whose Executes it hands over directly (no wire hop)
        self.local_nodes = local_nodes or {}
        self.functions = functions
        self.cum_weights = _cumulative(weights)
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.stats = stats
        self.scheduler: Connection | None = None
        self.epoch = 0  # bumped on every new scheduler connection: attempts restart with it
        self._connected = asyncio.Event()
        self._calls: dict[str, Mailbox] = {}
        self._nodes: dict[str, Connection] = {}
        self._node_connects: dict[str, asyncio.Task[Connection]] = {}
        self._choices: list[FunctionSpec] = []
        self._running: set[asyncio.Task[None]] = set()  # an open loop's calls in flight
        self._sequence = 0

    async def run(self, window: Window, rate_per_s: float | None = None) -> None:
        """Call from `window.start_s` until it closes, then let the calls in flight finish: with
        `concurrency` calls outstanding (a closed loop), or, given `rate_per_s`, calls arriving at
        that rate whatever is outstanding (an open loop)."""
        link = asyncio.create_task(self._keep_linked())
        await asyncio.sleep(max(0.0, window.start_s - time.monotonic()))
        if rate_per_s is None:
            callers = [asyncio.create_task(self._caller(window)) for _ in range(self.concurrency)]
            for caller in callers:
                caller.add_done_callback(self._finished)
        else:
            callers = await self._arrivals(window, rate_per_s)
        pending: set[asyncio.Task[None]] = set()
        if callers:
            _, pending = await asyncio.wait(callers, timeout=window.close_s - time.monotonic() + DRAIN_S)
        for task in [*pending, link]:
            task.cancel()
        self.stats.errors["unfinished"] += len(pending)  # (a failure is counted as it ends: `_finished`)

    async def _arrivals(self, window: Window, rate_per_s: float) -> list[asyncio.Task[None]]:
        """Calls arriving as a Poisson process of `rate_per_s` until the window closes, each its own
        task; the tasks still running when it closed. The loop's timers wake it about once a
        millisecond, so the calls due since are sent together, each timed from when it is sent; how
        late that is after its arrival time goes into `stats.release_lag_us`."""
        stats = self.stats
        running = self._running
        due_s = window.start_s + self.rng.expovariate(rate_per_s)
        while due_s < window.close_s:
            now_s = time.monotonic()
            while due_s <= now_s and due_s < window.close_s:
                if window.open_s <= due_s:
                    stats.release_lag_us.append(round((now_s - due_s) * 1e6))
                task = asyncio.create_task(self._one_call(window))
                running.add(task)
                task.add_done_callback(self._finished)
                due_s += self.rng.expovariate(rate_per_s)
            await asyncio.sleep(max(due_s - now_s, RELEASE_TICK_S))
        return list(running)

    def _finished(self, task: asyncio.Task[None]) -> None:
        """A caller (closed loop) or a call (open loop) ended: its failure counted, once."""
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats.errors[f"caller: {task.exception()!r}"[:120]] += 1

    async def close(self) -> None:
        for conn in [self.scheduler, *self._nodes.values()]:
            if conn is not None:
                conn.close()

    async def _keep_linked(self) -> None:
        """As the router: connect, ask the new scheduler again for every call waiting for a
        placement, and reconnect when the link drops (a leader that steps down closes it)."""
        while True:
            try:
                conn = await connect(self.scheduler_address, SchedulerSession(self), timeout_s=2.0)
            except ConnectionLost:
                await asyncio.sleep(RECONNECT_S)
                continue
            self.epoch += 1
            self.scheduler = conn
            self._connected.set()
            for box in self._calls.values():
                if box.waiting:
                    box.attempt, box.epoch = 0, self.epoch
                    conn.send(MessageType.PLACE, box.place)
            await conn.closed
            self._connected.clear()
            self.scheduler = None
            self.stats.errors["scheduler link lost"] += 1
            await asyncio.sleep(RECONNECT_S)

    def on_scheduler_closed(self, conn: Connection) -> None:
        if conn is self.scheduler:
            self._connected.clear()  # at once, as the router: no call sent on a closed link

    def on_scheduler_message(self, message: pb.Placement | pb.Rejection, conn: Connection) -> None:
        if conn is not self.scheduler:
            return  # from a scheduler no longer linked (as the router)
        box = self._calls.get(message.call_id)
        if box is not None:
            box.put(message)
        elif isinstance(message, pb.Placement):
            # Nobody waits for it (as the router does): hand the slot back.
            conn.send(
                MessageType.ABANDON,
                pb.Abandon(call_id=message.call_id, attempt=message.attempt, reason=pb.Abandon.CANCELLED),
            )

    def _next_function(self) -> FunctionSpec:
        if not self._choices:
            self._choices = self.rng.choices(self.functions, cum_weights=self.cum_weights, k=CHOICE_BLOCK)
        return self._choices.pop()

    async def _caller(self, window: Window) -> None:
        """One outstanding call at a time until the window closes."""
        while time.monotonic() < window.close_s:
            await self._one_call(window)

    async def _one_call(self, window: Window) -> None:
        """One call, sent now, timed if sent in the window."""
        stats = self.stats
        sent_s = time.monotonic()
        spec = self._next_function()
        self._sequence += 1
        call_id = f"{self.name}-{self._sequence}"
        place = pb.Place(call_id=call_id, function=spec.name, timeout_s=spec.timeout_s, payload_bytes=len(PAYLOAD))
        box = self._calls[call_id] = Mailbox(place, math.inf, time.monotonic)
        try:
            placed_s, ok = await self._call(box, window, sent_s)
        finally:
            del self._calls[call_id]
        if ok:
            stats.completed += 1
        if window.open_s <= sent_s < window.close_s and placed_s is not None:
            done_s = time.monotonic()
            stats.place_us.append(round((placed_s - sent_s) * 1e6))
            stats.call_us.append(round((done_s - sent_s) * 1e6))

    async def _ask(self, box: Mailbox) -> None:
        """Send the call's Place (waiting for a scheduler that is reconnecting)."""
        await self._connected.wait()
        assert self.scheduler is not None
        box.waiting, box.attempt, box.epoch = True, 0, self.epoch
        self.scheduler.send(MessageType.PLACE, box.place)

    async def _call(self, box: Mailbox, window: Window, sent_s: float) -> tuple[float | None, bool]:
        """Place the call and run it where placed, as the router's `_run`: (when its first
        Placement came, whether it ran OK)."""
        stats = self.stats
        await self._ask(box)
        placed_s: float | None = None
        while True:
            message = await box.get()
            if isinstance(message, pb.Rejection):
                stats.errors[f"rejection {pb.Status.Name(message.status)}"] += 1
                stats.rejected += window.open_s <= sent_s < window.close_s
                return placed_s, False
            if message.attempt <= box.attempt:
                continue  # a placement already tried (or replaced)
            box.attempt, box.waiting = message.attempt, False
            arrived_s = time.monotonic()
            placed_s = arrived_s if placed_s is None else placed_s
            stats.placements_total += 1
            if window.open_s <= arrived_s < window.close_s:
                stats.placements += 1
                stats.misses += not message.hit
            local = self.local_nodes.get(message.node_address)
            if local is not None:
                reply, done = local.run(message.token)
                local.report(done)
            else:
                node = await self._node(message.node_address)
                frame = await node.request(
                    MessageType.EXECUTE, pb.Execute(token=message.token, content_type=CONTENT_TYPE), PAYLOAD
                )
                reply = frame.message(pb.ExecuteReply)
            if reply.outcome == pb.OK:
                stats.hit_mismatches += message.hit == reply.loaded
                return placed_s, True
            stats.errors[f"execute {pb.Outcome.Name(reply.outcome)}"] += 1
            if reply.outcome != pb.REFUSED:
                return placed_s, False
            box.waiting = True
            if box.epoch != self.epoch:
                await self._ask(box)  # the scheduler that placed it is gone: ask the new one
            elif self.scheduler is not None:
                # As the router: a refused token is reported, and the call waits for its next placement.
                abandon = pb.Abandon(
                    call_id=box.place.call_id, attempt=box.attempt, reason=pb.Abandon.REFUSED, detail=reply.message
                )
                self.scheduler.send(MessageType.ABANDON, abandon)

    async def _node(self, address: str) -> Connection:
        conn = self._nodes.get(address)
        if conn is not None and not conn.is_closed:
            return conn
        task = self._node_connects.get(address)
        if task is None:
            task = self._node_connects[address] = asyncio.create_task(connect(address, None, timeout_s=5.0))
            task.add_done_callback(lambda _: self._node_connects.pop(address, None))
        conn = await asyncio.shield(task)
        self._nodes[address] = conn
        return conn


def _cumulative(weights: list[float]) -> list[float]:
    total, cumulative = 0.0, []
    for weight in weights:
        total += weight
        cumulative.append(total)
    return cumulative


# --- the client process -----------------------------------------------------------------------
def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def _read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _phase(
    go: dict[str, Any],
    phase: int,
    config: dict[str, Any],
    *,
    functions: list[FunctionSpec],
    local_nodes: dict[str, SyntheticNode],
    node_counts: NodeCounts,
) -> list[SyntheticGateway]:
    """One phase (`go`: its window, and a rate for an open loop) with new gateways; its stats
    printed; the gateways, still linked."""
    window = Window(go["start_s"], go["open_s"], go["close_s"])
    stats = GatewayStats()
    gateways = [
        SyntheticGateway(
            f"{name}p{phase}",  # call ids stay unique across phases (nodes admit a grant once)
            config["scheduler"],
            functions=functions,
            weights=config["weights"],
            concurrency=config["concurrency"],
            seed=config["seed"] + 100 * phase + i,
            stats=stats,
            local_nodes=local_nodes,
        )
        for i, name in enumerate(config["gateways"])
    ]
    # The collector off while the calls run: its full walks of this process's heap (the nodes'
    # ledgers, the calls) stalled the loop for milliseconds, and every call in flight with it.
    gc.disable()
    try:
        await asyncio.gather(*(gateway.run(window, go.get("calls_per_s_per_gateway")) for gateway in gateways))
    finally:
        gc.enable()
    # The last Dones leave with the replies; give the loop a moment to write them.
    await asyncio.sleep(0.05)
    _emit("stats", nodes=vars(node_counts), gateways={**vars(stats), "errors": dict(stats.errors)})
    return gateways


async def client(config: dict[str, Any]) -> None:
    """Host `config`'s nodes and gateways (the driver's JSON: see bench.placement_bench)."""
    store = await EtcdStore.open(config["etcd"])
    keys = Keys(config["root"])
    functions = [FunctionSpec.from_json(json.dumps(raw)) for raw in config["functions"]]
    digests = sorted({spec.package_digest for spec in functions})
    node_counts = NodeCounts()
    nodes = [
        SyntheticNode(
            store,
            keys,
            name,
            gpus=config["gpus_per_node"],
            memory_mb=config["gpu_memory_mb"],
            digests=digests,
            counts=node_counts,
        )
        for name in config["nodes"]
    ]
    for node in nodes:
        await node.start()
    _emit("registered", nodes=len(nodes))
    phase = 0
    gateways: list[SyntheticGateway] = []
    local_nodes = {node.address: node for node in nodes} if config["execute"] == "direct" else {}
    # One phase per `go` line; the driver closes our stdin when it has checked the scheduler.
    while line := await _read_line():
        phase += 1
        for gateway in gateways:  # the last phase's: open until now, as the driver checked the book
            await gateway.close()
        gateways = await _phase(
            json.loads(line)["go"], phase, config, functions=functions, local_nodes=local_nodes, node_counts=node_counts
        )
    for gateway in gateways:
        await gateway.close()
    for node in nodes:
        with contextlib.suppress(Exception):
            await node.stop()
    await store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a client process of bench.placement_bench")
    parser.add_argument("config", type=Path, help="the process's configuration (a JSON file)")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text())
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(client(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
