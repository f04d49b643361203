"""The call state machine: from a gateway's Place to the node's Done, with every failure in between.

Pure: no I/O, no clock (`now` is an argument, monotonic seconds). The scheduler service feeds it
what arrives (Place, Done, Abandon, a gateway or node gone, the answer to a grant check, the
workers a node reports) and carries out the effects it returns (send a placement or a rejection,
ask a node which grants it has seen (revoking the others), evict).

One call, from its owner's (the gateway connection's) Place:

    [WAITING --a GPU attached-->] QUEUED --dispatch--> PLACED(attempt k) --Done(k)--> finished
                                     ^                   |         |
                                     +----- requeued ----+      its GPU left
                                     |                             v
                                     +--- owner: never sent --- STRANDED --owner: maybe sent--> outcome unknown

    requeued: only once it is certain that attempt k never ran (at most once): the node refused
    the grant, the owner never sent it, or the node says it never saw it (CheckGrants, which
    revokes it there); or its worker died (Done WORKER_DIED, retried once). WAITING: arrived while
    GPU managers were registered but none attached (see `submit`). STRANDED: the GPU of a placed
    call left (its node's link or lease was lost); whether the Execute reached the node is the
    owner's to say.

A GPU slot belongs to an attempt: it is freed by that attempt's Done, or when it is certain the
attempt never ran (the node says it never saw the grant, refused it, or left). A Done for an
attempt that is no longer current is ignored. Failure handling, step by step:

- gateway dies after a placement (`owner_lost`): queued calls are withdrawn; placed ones are
  checked with their nodes (CheckGrants): a grant never presented is revoked there and its slot
  freed; a presented one runs to its Done.
- a node that never hears from the gateway (`tick`): a grant not answered by a Done within
  `claim_s` is checked with its node; if never presented it is revoked and the call placed again.
- a token reused or forged: the node refuses it (it checks the signature and keeps a ledger of
  grants seen); the gateway reports the refusal (Abandon REFUSED) and the call is placed again.
- the owner could not send the Execute (no connection to the node: Abandon REFUSED, "it did not
  run there"): the call is placed again at once, on another GPU.
- the owner lost the node after sending the Execute (Abandon NODE_UNREACHABLE: it may have
  reached the node, and may run there to its end): the call is placed again only once the node
  says it never saw the grant (CheckGrants, revoked there, so that it cannot run late). If the
  node saw it, or cannot answer, or has left, the owner is answered at once that the call's
  outcome is unknown (`OUTCOME_UNKNOWN`): a call is never run twice.
- a placement for a GPU that has since left (`gpus_removed`, when the scheduler loses its
  connection to the node or the node's lease expires): the GPU's parked calls go back to the
  queue; its placed ones are STRANDED until their owner says whether it sent the Execute (never
  sent: placed again; maybe sent: outcome unknown). A STRANDED call's owner that got its answer
  from the node says nothing: the call is forgotten at its Done or its deadline (a Done saying
  its worker died places it again, once, as on a GPU that stayed: its owner waits for that).
- a placed call with no Done long after its deadline (`tick`, `lost_after_s`): presumed lost
  with its node's answer; its slot is freed and the model's entry dropped (the node timed it out).
- an Abandon (NODE_UNREACHABLE, REFUSED) for a call the book does not hold for that owner (its
  Done finished it while its reply to the gateway was lost, or this scheduler never saw it): the
  owner is answered at once that the call's outcome is unknown (`OUTCOME_UNKNOWN`), never by
  running it again, so that it does not wait for a placement until its deadline.
- a call id submitted again while the book holds it: refused while its owner waits for it; one
  whose owner gave it up or was lost (a gateway whose link closed before the Placement reached it
  asks again on its next link) is taken over by the new owner as one that may have been sent:
  placed again once its node says it never saw the grant, else answered that its outcome is unknown.
- a call that arrives while no GPU is attached but GPU managers are registered (a new leader
  attaching its nodes, `submit(nodes_attaching=True)`): it waits (WAITING) and enters the
  scheduler's queue when the first GPU attaches, or is answered DEADLINE at its deadline.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from gpufaas.errors import GpufaasError, ModelTooLarge, UnknownModel, call_id_in_flight
from gpufaas.functions import FunctionSpec
from gpufaas.grants import GRANT_KEEP_S
from gpufaas.keys import split_gpu_address
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import ModelSpec, Request
from scheduler.adaptive_slots import AdaptiveSlots
from scheduler.core import Scheduler, never_fits
from scheduler.decisions import Dispatch
from scheduler.leases import leases_to_end, may_lease, may_lease_on, running_seen

MAX_WORKER_ATTEMPTS = 2  # a call whose worker died is retried once
MAX_PLACEMENTS = 6  # placements that never ran (node unreachable, grant refused) before giving up
DEFAULT_CLAIM_S = 5.0
DEFAULT_LOST_AFTER_S = 5.0
# How much longer than a node may remember a grant the book remembers its attempt (`_NamedIds`):
# the node times it by its own clock.
CLOCK_SKEW_S = 5.0
# The latest attempt a call of a remembered id starts past (`_NamedIds`): the wire's attempts are
# int32 (gpufaas.proto), and one call makes a handful (MAX_PLACEMENTS, a worker's death). An id used
# again and again, each within a minute, for as many placements starts afresh at 1: its nodes forgot
# those first attempts long before.
MAX_FIRST_ATTEMPT = 2**31 - 1 - 2**16
# The Rejection status for "the scheduler no longer holds this call, whether it ran is unknown".
# gpufaas.proto has no Status of that name yet; the gateway answers any status it does not map with
# 502 and the Rejection's message, which is what such a call needs (a retry could run it twice).
OUTCOME_UNKNOWN = pb.STATUS_UNSPECIFIED

Owner = Hashable


# Not frozen: one is made per call, and a frozen one costs 3x to make (never changed once made).
@dataclass(slots=True)
class Assignment:
    """Send the owner a placement: `call_id`'s attempt `attempt` runs on `gpu_id` ("node/gpu")."""

    owner: Owner
    call_id: str
    attempt: int
    gpu_id: str
    gpu_seq: int  # per-GPU order of grants
    hit: bool
    evict: tuple[str, ...]
    spec: FunctionSpec
    queue_s: float
    deadline: float  # the call's, monotonic
    claim_by: float  # the node refuses the grant after this, monotonic
    est_load_time_s: float
    est_inference_time_s: float
    lease_s: float = 0.0  # > 0: the placement is also a lease on its slot for this long (`CallBook.lease_s`)


@dataclass(frozen=True, slots=True)
class Answer:
    """Send the owner the call's final answer without a result (a Rejection)."""

    owner: Owner
    call_id: str
    status: int  # gpufaas.proto Status
    message: str


@dataclass(frozen=True, slots=True)
class CheckGrants:
    """Ask `node` which of these grants it has seen, revoking the others (then `grants_checked`);
    a lease among them ends (`if_idle`: only if no call runs under it and its time is up there)."""

    node: str
    grants: tuple[tuple[str, int], ...]
    if_idle: bool = False


@dataclass(frozen=True, slots=True)
class Evict:
    """Stop these models' workers on `gpu_id` (they are not in the cache: orphans, or models no
    function runs any more). A staged exit's release (`if_idle`) moves them to the node's host
    tier when `to_host`, and leaves a worker that has calls in flight or that a grant later than
    `gpu_seq` (the GPU's latest when decided) uses."""

    gpu_id: str
    models: tuple[str, ...]
    to_host: bool = False
    if_idle: bool = False
    gpu_seq: int = 0


@dataclass(frozen=True, slots=True)
class EvictHost:
    """Stop these models' copies in `node`'s host tier (released, or not in the scheduler's)."""

    node: str
    models: tuple[str, ...]


Effect = Assignment | Answer | CheckGrants | Evict | EvictHost


class Rejected(GpufaasError):
    """A Place refused at once; `status` is the gpufaas.proto Status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _State(enum.Enum):
    WAITING = "waiting"  # arrived while no GPU was attached: held here, not yet in the scheduler
    QUEUED = "queued"  # in the global queue or parked in a local queue
    PLACED = "placed"  # a placement was sent; waiting for the node's Done
    STRANDED = "stranded"  # placed on a GPU that left: waiting for the owner to say if it sent the Execute


@dataclass(slots=True)
class _Call:
    """Lifecycle: created by `submit`, removed when it finishes (Done, answer, or withdrawal)."""

    call_id: str
    owner: Owner
    spec: FunctionSpec
    submitted_at: float
    deadline: float
    state: _State = _State.QUEUED
    attempt: int = 0  # the current (latest) placement
    worker_failures: int = 0
    placements: int = 0
    placed_at: float = 0.0
    gpu_id: str = ""
    hit: bool = False
    wanted: bool = True  # False once the owner gave up or went away: no answer is sent
    claimed: bool = False  # the node confirmed it has seen the current grant
    checking: bool = False  # a grant check for the current attempt is under way
    # The owner lost the node after sending it the current attempt's Execute: whether it ran
    # there is for the node's ledger to say (a check is under way).
    maybe_ran: bool = False
    lease_wanted: bool = False  # the owner takes a lease with a hit's placement
    asked_again: bool = False  # submitted again after its first owner gave it up (`_ask_again`)
    # > 0: the current placement is a lease, ended at this time (monotonic): `lease_s` after the
    # Done of its last call (infinite until its own call's Done).
    lease_until: float = 0.0
    lease_ending: bool = False  # its node was told to end it (a check is under way, or a Done will say)
    lease_if_idle: bool = False  # ... only if no call runs under it there (its time is up here)
    lease_uses: int = 0  # calls run to their end under the lease (its own first)
    named: bool = False  # its client named it (X-Call-Id): its last attempt is remembered (`_NamedIds`)


class _NamedIds:
    """The last attempt of the finished calls that their clients named (X-Call-Id), each kept
    until a time. A node refuses a grant (call id, attempt) it has seen for as long as it
    remembers it (`GRANT_KEEP_S`), so a later call of the same id starts past that attempt instead
    of being refused there, attempt after attempt. Pruned in the order of their times (a heap: one
    call of a long timeout holds back none kept after it), a few at a time."""

    __slots__ = ("_kept", "_due")

    def __init__(self) -> None:
        self._kept: dict[str, tuple[int, float]] = {}  # call id -> (last attempt, kept until)
        self._due: list[tuple[float, str]] = []  # a heap of (kept until, call id)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, call: _Call, book: CallBook) -> None:
        """Remember the call's last attempt for as long as its node may remember its grant: past
        its claim time (by the deadline) or, a lease's, past its last call's end (by the deadline
        too: `_lease_done` moves it past each call's) and a lease time (where its owner took
        leases: the node keeps a lease's grant that long after its last call, its own too), or
        past a revocation (sent by `lost_after_s` past the deadline at the latest), by the node's
        clock."""
        leased_s = book.lease_s if call.lease_wanted else 0.0
        last_s = max(call.deadline + book.lost_after_s, call.placed_at + book.claim_s)
        until = last_s + leased_s + GRANT_KEEP_S + CLOCK_SKEW_S
        self._kept[call.call_id] = (call.attempt, until)
        heapq.heappush(self._due, (until, call.call_id))

    def first_attempt(self, call_id: str, now: float, named: bool) -> int:
        """Where a new call's attempts start (its first placement is this plus one): past the
        last attempt of a named call of this id while a node may remember its grant, else 0 (also
        past MAX_FIRST_ATTEMPT). What is kept stays until the new call is forgotten (`keep` then
        replaces it) or its time passes: a Place refused at once (Rejected) leaves it as it was."""
        if not self._kept:
            return 0
        self.prune(now, limit=4)
        kept = self._kept.get(call_id) if named else None
        if kept is None or now > kept[1] or kept[0] > MAX_FIRST_ATTEMPT:
            return 0
        return kept[0]

    def prune(self, now: float, limit: int) -> None:
        """Forget at most `limit` ids whose time passed before `now`."""
        due, kept = self._due, self._kept
        while limit and due and due[0][0] < now:
            call_id = heapq.heappop(due)[1]
            entry = kept.get(call_id)
            if entry is not None and entry[1] < now:  # (else kept again since: due later)
                del kept[call_id]
                limit -= 1


class _Upkeep:
    """The models on the GPUs as the nodes report them and the catalog changes them (CallBook's
    half that is about models, not calls): retired models evicted, reports reconciled, idle
    models released. Its state is CallBook's."""

    scheduler: Scheduler
    _calls: dict[str, _Call]
    _seq: dict[str, int]
    _retired: set[str]
    dirty_gpus: set[str]
    dirty_models: set[str]

    def schedule(self, now: float) -> list[Effect]:
        raise NotImplementedError

    def _finish(self, call: _Call, status: int, message: str) -> list[Effect]:
        raise NotImplementedError

    # --- the catalog ------------------------------------------------------------------------
    def register_model(self, spec: ModelSpec, now: float) -> list[Effect]:
        """Declare (or re-declare) a model's size and GPU type (`Scheduler.register_model`); its
        queued calls that no GPU could hold now are answered (`_refuse_never_fitting`)."""
        self.scheduler.register_model(spec)
        return self._refuse_never_fitting((spec.name,), now)

    def observe_memory(self, model: str, gpu_id: str, peak_memory_mb: int, now: float) -> list[Effect]:
        """A worker's measured peak of `model` on `gpu_id` replaces its size (`Scheduler.observe_memory`);
        where it changed, its queued calls that no GPU could hold now are answered."""
        if not self.scheduler.observe_memory(model, gpu_id, peak_memory_mb):
            return []
        self.dirty_models.add(model)
        return self._refuse_never_fitting((model,), now)

    def _refuse_never_fitting(self, models: Iterable[str], now: float) -> list[Effect]:
        """The queued calls of `models` that no GPU here now could ever hold (their size grew, or
        the GPUs big enough or of their type left) are answered as a new call of theirs would be
        (UNAVAILABLE, `scheduler.core.never_fits`) and leave the global queue, so that the calls
        behind them move (under a FIFO policy the first held every other call until its deadline). Asked
        only for the models a change touched. None while no GPU is attached (the nodes may come
        back); parked and placed calls are left: their GPU holds the model already."""
        scheduler = self.scheduler
        effects: list[Effect] = []
        if not scheduler.cache.num_gpus:
            return effects
        for model in models:
            spec = scheduler.cluster.models.get(model)
            never = "" if spec is None else never_fits(scheduler.cluster, spec)
            if not never:
                continue
            for call_id in scheduler.queue.ids_for(model):
                scheduler.cancel(call_id, now)
                call = self._calls.get(call_id)
                if call is not None:
                    effects += self._finish(call, pb.UNAVAILABLE, never)
        return effects + self.schedule(now) if effects else effects

    def retire(self, model: str) -> list[Effect]:
        """No function runs `model` any more (it was deleted, or updated to a new package): evict
        it from every GPU where no call uses it now, and from the others as their calls finish."""
        self._retired.add(model)
        return self._evict_retired(model)

    def runs(self, model: str) -> bool:
        """Whether some function runs `model`: it was registered (the catalog registers every
        function's model) and not retired since. A worker left by a model no function knows (one
        of a version older than this scheduler's start, or named as an older gpufaas named them) is
        not adopted."""
        return model in self.scheduler.cluster.models and model not in self._retired

    def revive(self, model: str) -> None:
        """A function runs `model` again (deployed anew with the same package)."""
        self._retired.discard(model)

    def _evict_retired(self, model: str) -> list[Effect]:
        """Stop a model no function runs where no call uses it: on GPUs where it is not pinned,
        and in the host tiers that hold it (a copy there serves no one)."""
        cache = self.scheduler.cache
        effects: list[Effect] = []
        for gpu_id in sorted(cache.gpus_with(model)):
            if not cache.gpu(gpu_id).is_pinned(model):
                self.scheduler.drop(gpu_id, model)
                self.dirty_models.add(model)
                self.dirty_gpus.add(gpu_id)
                effects.append(Evict(gpu_id, (model,)))
        for node in sorted(cache.nodes_holding(model)):
            cache.release_from_host(node, model)
            self.dirty_models.add(model)
            effects.append(EvictHost(node, (model,)))
        return effects

    def reconcile(self, gpu_id: str, resident: dict[str, int], now: float) -> list[Effect]:
        """A node reported the models resident on `gpu_id` (model -> MiB). Cache entries with no
        worker and no work are dropped (phantoms); workers the cache does not know are adopted
        when they fit without evicting anything and some function still runs them, else evicted
        (orphans) unless a grant from now on uses them or they have calls in flight."""
        cache = self.scheduler.cache.gpu(gpu_id)
        busy = {self._calls[r].spec.model for r in self.scheduler.gpu(gpu_id).running if r in self._calls}
        for model in list(cache):
            # A retired model is dropped too (its last call ended some way without a Done): below,
            # its worker is then an orphan, as no function runs it.
            if (model not in resident or model in self._retired) and not cache.is_pinned(model) and model not in busy:
                self.scheduler.drop(gpu_id, model)
                self.dirty_models.add(model)
        orphans: list[str] = []
        for model, memory_mb in resident.items():
            if model in cache:
                continue
            if self.runs(model) and cache.free_mb >= memory_mb:
                self.scheduler.cache.admit(gpu_id, model, memory_mb)
                self.dirty_models.add(model)
            else:
                orphans.append(model)
        self.dirty_gpus.add(gpu_id)
        # Only if still idle then: the report may be older than a placement that uses the model
        # again (after a release, say), and that placement's worker must stay.
        return [Evict(gpu_id, tuple(orphans), if_idle=True, gpu_seq=self._seq.get(gpu_id, 0))] if orphans else []

    def reconcile_host(self, node: str, capacity_mb: int, parked: dict[str, int]) -> list[Effect]:
        """A node reported its host tier: `capacity_mb` (0: none) and the models parked there,
        least recently parked first (model -> MiB). The scheduler's tier for the node follows:
        created or resized to the node's size, entries the node does not hold dropped, parked
        models it does not know adopted while they fit, the others stopped at the node."""
        return _reconcile_host(self.scheduler, self.runs, node, capacity_mb, parked)

    def release_idle(self, now: float, *, gpu_idle_s: float | None, host_idle_s: float | None) -> list[Effect]:
        """EDAS's staged exit (see `Scheduler.release_idle`): what has been idle long enough
        leaves its GPU (for the host tier where the node has one), then the host tier; returns
        the releases for the nodes to carry out."""
        effects: list[Effect] = []
        for release in self.scheduler.release_idle(now, gpu_idle_s=gpu_idle_s, host_idle_s=host_idle_s):
            self.dirty_models.add(release.model)
            if release.gpu_id is not None:
                self.dirty_gpus.add(release.gpu_id)
                effects.append(
                    Evict(
                        release.gpu_id,
                        (release.model,),
                        to_host=release.to_host,
                        if_idle=True,
                        gpu_seq=self._seq.get(release.gpu_id, 0),
                    )
                )
            elif release.node is not None:
                effects.append(EvictHost(release.node, (release.model,)))
        return effects


class _Leasing(_Upkeep):
    """The leases of hit placements (docs/hit-leases.md; CallBook's half that is about them): a
    lease is a placed call whose slot stays its owner's after its Done, for further calls of its
    function run one at a time under its grant, until the book has its node end it. Its state
    is CallBook's."""

    lease_s: float
    _leases: dict[str, _Call]
    _waited_at: float
    _parked_at: dict[str, float]
    dirty_profiles: set[tuple[str, str, int]]

    def schedule(self, now: float) -> list[Effect]:
        raise NotImplementedError

    def _release(self, call: _Call, now: float, *, drop_model: bool, requeue: bool, avoid_gpu: bool = False) -> None:
        raise NotImplementedError

    def _forget(self, call: _Call) -> None:
        raise NotImplementedError

    def retire(self, model: str) -> list[Effect]:
        """`_Upkeep.retire`, and the leases on `model` end: a call under one would still reach a
        worker of the old version (the model is retired once the catalog learns of the update;
        the gateway that made it may have taken a lease for the new one's calls before)."""
        ending = self._end_leases([call for call in self._leases.values() if call.spec.model == model])
        return super().retire(model) + ending

    def _lease_done(
        self, call: _Call, now: float, lease_ended: bool, inference_time_s: float, batch_size: int, *, failed: bool
    ) -> list[Effect]:
        """A call ran to its end under `call`'s lease (not its own call's last word, which `done`
        takes as any placement's): a use, and the lease's end where the node ended it; one that
        lost its worker frees the slot and drops the model (no retry here: its owner places it)."""
        if failed:
            self._release(call, now, drop_model=True, requeue=False)
            return self.schedule(now)
        self._lease_used(call, now, inference_time_s, batch_size)
        if not lease_ended:
            return []
        return self._lease_over(call, now) + self.schedule(now)

    def _leases_after(self, effects: list[Effect], parked: list[str], now: float) -> list[Effect]:
        """After a pass of the policy: while calls wait in the global queue the leases that hold
        up the first end (`_leases_for_wait`: every lease, where none in particular does); a call
        parked on a GPU ends the leases there (it waits for that GPU's slots); a lease whose
        model's entry went with another call's failure on its GPU ends; and where nothing waits,
        the pass's hits lease their slots as the rules allow (`_grant_leases`)."""
        for gpu_id in parked:
            self._parked_at[gpu_id] = now
        ending: list[Effect] = []
        if self._leases and self.scheduler.cluster.pin_dropped:  # their model went with another call's failure
            ending = self._end_leases(
                [c for c in self._leases.values() if c.call_id in self.scheduler.cluster.pin_dropped]
            )
        if self.scheduler.queue:
            ending += self._leases_for_wait(now)
        else:
            self._grant_leases(effects, now)
        if not parked or not self._leases:
            return ending
        return ending + self._end_leases([c for c in self._leases.values() if c.gpu_id in parked])

    def _leases_for_wait(self, now: float) -> list[Effect]:
        """Calls wait in the global queue: end the leases that hold up its head (`leases_to_end`),
        or every lease, unless nodes are being asked to end some (the call waits for their
        answers). A lease its node answered busy is a running call (its model pinned until its
        Done). The wait counts for the hysteresis (`_waited_at`) unless leases are being ended
        for it: one that they were what held up is over once their slots are free."""
        idle: dict[str, list[tuple[str, str]]] = {}
        asking = False
        for call in self._leases.values():
            if call.lease_ending:
                asking = asking or call.checking
            else:
                idle.setdefault(call.gpu_id, []).append((call.call_id, call.spec.model))
        if asking or not idle:
            if not asking:
                self._waited_at = now
            return []
        chosen = leases_to_end(self.scheduler, idle)
        if chosen is None:
            return self._end_leases([self._leases[c] for leases in idle.values() for c, _ in leases])
        return self._end_leases([self._leases[c] for c in chosen])

    def _grant_leases(self, effects: list[Effect], now: float) -> None:
        """Each hit's placement whose owner takes leases leases its slot for `lease_s` where the
        rules allow (`may_lease`, `may_lease_on`). A leased slot stays occupied in the scheduler's
        state until the lease ends: nothing else is placed on it."""
        candidates = [e for e in effects if isinstance(e, Assignment) and e.hit and self._calls[e.call_id].lease_wanted]
        if not candidates or not may_lease(self.scheduler, now, self._waited_at, self.lease_s):
            return
        parked_at = self._parked_at
        for assignment in candidates:
            gpu_id = assignment.gpu_id
            if not may_lease_on(self.scheduler.gpu(gpu_id), now, parked_at.get(gpu_id, -math.inf), self.lease_s):
                continue
            call = self._calls[assignment.call_id]
            if call.spec.model in self._retired:
                continue  # a call that came before its function's update: no lease on the old version
            assignment.lease_s = self.lease_s
            call.lease_until = math.inf  # (its own call's Done starts the clock)
            self._leases[call.call_id] = call

    def _end_leases(self, calls: Iterable[_Call], *, if_idle: bool = False) -> list[Effect]:
        """Have the nodes end these leases (a CheckGrants each node: no call is admitted under
        them from then on; `if_idle`, their time being up here: only those with no call running
        there whose time is up there too); their slots are freed as `grants_checked` and `done` say."""
        checks: dict[str, list[tuple[str, int]]] = {}
        for call in calls:
            if call.lease_ending and (if_idle or not call.lease_if_idle):
                continue  # a check under way asks as much
            call.lease_ending = call.checking = True
            call.lease_if_idle = if_idle
            checks.setdefault(split_gpu_address(call.gpu_id)[0], []).append((call.call_id, call.attempt))
        return [CheckGrants(node, tuple(grants), if_idle) for node, grants in checks.items()]

    def _lease_used(self, call: _Call, now: float, inference_time_s: float, batch_size: int) -> None:
        """A call ran to its end under `call`'s lease (its own first): the model was used as by a
        hit, its time measured; the slot stays the lease's. Its owner has its answer from the node."""
        self.scheduler.on_lease_use(
            call.call_id, inference_time_s=inference_time_s if inference_time_s > 0 else None, batch_size=batch_size
        )
        self.dirty_models.add(call.spec.model)
        if inference_time_s > 0:
            self.dirty_profiles.add((self.scheduler.gpu(call.gpu_id).spec.gpu_type, call.spec.model, batch_size))
        call.lease_uses += 1
        call.wanted, call.claimed = False, True
        # The node admits the next call within lease_s of this one's end, and it may run its whole
        # timeout: no Done for that long is not a lost call.
        call.lease_until = now + self.lease_s
        call.deadline = max(call.deadline, call.lease_until + call.spec.timeout_s)

    def _lease_over(self, call: _Call, now: float) -> list[Effect]:
        """No call runs under the lease any more, and none will: its slot is free (and its model
        goes, if no function runs it any more)."""
        self.dirty_gpus.add(call.gpu_id)
        self.scheduler.on_complete(call.call_id, now)
        self._forget(call)
        return self._evict_retired(call.spec.model) if call.spec.model in self._retired else []


class _GrantChecks(_Leasing):
    """The nodes' answers about grants (CallBook's half that is about them): which a node saw
    (ran, or runs) and which it revoked, and what a call whose owner lost the node after sending
    it becomes. Its state is CallBook's."""

    def _current(self, call_id: str, attempt: int) -> _Call | None:
        raise NotImplementedError

    def _finish(self, call: _Call, status: int, message: str) -> list[Effect]:
        raise NotImplementedError

    @staticmethod
    def _unknown(call: _Call, message: str) -> list[Effect]:
        raise NotImplementedError

    def grants_checked(
        self,
        node: str,
        unseen: Iterable[tuple[str, int]],
        seen: Iterable[tuple[str, int]],
        now: float,
        busy: Iterable[tuple[str, int]] = (),
    ) -> list[Effect]:
        """`node`'s answer to CheckGrants: `unseen` grants are revoked there (never ran: placed
        again, elsewhere if the owner lost the node); `seen` ones ran or run there (a call whose
        owner lost the node after sending it is answered that its outcome is unknown). A seen
        lease has ended there: its slot is free, unless it is `busy` (a call still runs under it,
        whose Done says `lease_ended`)."""
        effects: list[Effect] = []
        still_running = set(busy)
        for call_id, attempt in seen:
            call = self._current(call_id, attempt)
            if call is not None:
                call.claimed, call.checking = True, False
                if call.maybe_ran:
                    effects += self._unknown(call, _ran_there_message(call))
                if not call.lease_until:
                    continue
                if (call_id, attempt) not in still_running:
                    effects += self._lease_over(call, now)
                elif call.lease_if_idle:  # a call runs under it there: it goes on, its Done due
                    call.lease_ending = call.lease_if_idle = False
                    call.lease_until = now + self.lease_s
                    # Alive at the node: not lost, however long that call runs (the gateway gives it
                    # its own timeout, which an update may have raised past this spec's).
                    call.deadline = max(call.deadline, call.lease_until + call.spec.timeout_s)
        for call_id, attempt in unseen:
            call = self._current(call_id, attempt)
            if call is None:
                continue
            call.checking = False
            if call.claimed:
                continue  # seen there before (the node forgot it): it may run, so never again
            retry = call.wanted and now < call.deadline and call.placements < MAX_PLACEMENTS
            drop_model = _never_loaded(self.scheduler, call)
            self._release(call, now, drop_model=drop_model, requeue=retry, avoid_gpu=call.maybe_ran)
            if not retry:
                effects += self._finish(
                    call, pb.UNAVAILABLE, f"the call was placed {call.placements} times and never reached a node"
                )
        return effects + self.schedule(now)

    def _maybe_ran(self, call: _Call) -> list[Effect]:
        """The owner lost the node after sending it the current attempt: the call may be running
        there. Its node is asked (CheckGrants, which revokes the grant if never seen); one that
        saw it, or has left (STRANDED), cannot have the call run again: its owner is answered
        that the outcome is unknown."""
        if call.state is _State.STRANDED:
            return self._finish(call, OUTCOME_UNKNOWN, _unknown_whether_ran_message(call))
        if call.claimed:  # seen there already: its Done (or the lost-call deadline) frees the slot
            return self._unknown(call, _ran_there_message(call))
        call.maybe_ran = True
        if call.checking:
            return []  # a check is under way already: its answer decides
        call.checking = True
        return [CheckGrants(split_gpu_address(call.gpu_id)[0], ((call.call_id, call.attempt),))]

    def grants_unchecked(self, grants: Iterable[tuple[str, int]]) -> list[Effect]:
        """A CheckGrants got no answer (the node is unreachable, or gone): a call whose owner lost
        the node after sending it the grant is answered that its outcome is unknown. (The node is
        taken out next: `gpus_removed` deals with the rest.)"""
        effects: list[Effect] = []
        for call_id, attempt in grants:
            call = self._current(call_id, attempt)
            if call is not None and call.maybe_ran:
                effects += self._unknown(call, _unknown_whether_ran_message(call))
        return effects


@dataclass
class CallBook(_GrantChecks):
    """Every call the scheduler holds, driving the pure `Scheduler` (queues, policy, cache)."""

    scheduler: Scheduler
    queue_capacity: int = 10_000
    claim_s: float = DEFAULT_CLAIM_S
    lost_after_s: float = DEFAULT_LOST_AFTER_S
    adaptive_slots: AdaptiveSlots | None = None  # D per GPU from its utilization (None: D fixed)
    lease_s: float = 0.0  # how long a hit's placement leases its slot to its owner when nothing waits (0: never)
    _calls: dict[str, _Call] = field(default_factory=dict)
    _leases: dict[str, _Call] = field(default_factory=dict)  # the calls whose placement is a lease
    _named: _NamedIds = field(default_factory=_NamedIds)  # finished calls' X-Call-Ids, for a while
    # When calls last waited in the global queue on running calls (not on leases being ended).
    _waited_at: float = -math.inf
    _parked_at: dict[str, float] = field(default_factory=dict)  # per GPU, when a call was last parked there
    _seq: dict[str, int] = field(default_factory=dict)  # per GPU, the latest grant's gpu_seq (kept if it leaves)
    _retired: set[str] = field(default_factory=set)  # models no function runs any more
    # The WAITING calls in arrival order: added by `submit` while no GPU is attached, moved into the
    # scheduler's queue by `schedule` once one is, removed at their deadline or withdrawal.
    _waiting: dict[str, _Call] = field(default_factory=dict)
    # What changed since the service last persisted (it drains these sets).
    dirty_gpus: set[str] = field(default_factory=set)
    dirty_models: set[str] = field(default_factory=set)
    dirty_profiles: set[tuple[str, str, int]] = field(default_factory=set)  # (gpu type, model, batch)

    def __len__(self) -> int:
        return len(self._calls)

    def claim_by(self, grants: Iterable[tuple[str, int]]) -> float:
        """The latest claim time among these grants (their calls' current placements), or 0.0."""
        times = [
            min(call.deadline, call.placed_at + self.claim_s)
            for call_id, _ in grants
            if (call := self._calls.get(call_id)) is not None and call.state is _State.PLACED
        ]
        return max(times, default=0.0)

    def placement(self, call_id: str, attempt: int) -> tuple[str, str] | None:
        """(model, GPU) of the call's attempt `attempt` while it is the current placement."""
        call = self._current(call_id, attempt)
        return None if call is None else (call.spec.model, call.gpu_id)

    def placed_on(self, node: str) -> list[tuple[str, int]]:
        """(call id, attempt) of the calls placed on `node`'s GPUs and not yet done."""
        return [
            (c.call_id, c.attempt)
            for c in self._calls.values()
            if c.state is _State.PLACED and split_gpu_address(c.gpu_id)[0] == node
        ]

    # --- arrivals ---------------------------------------------------------------------------
    def submit(
        self,
        owner: Owner,
        call_id: str,
        spec: FunctionSpec,
        timeout_s: float,
        now: float,
        *,
        nodes_attaching: bool = False,
        lease: bool = False,
        worker_died: bool = False,
        named: bool = False,
    ) -> list[Effect]:
        """Queue a call and schedule. Raises Rejected (nothing is queued then). `lease`: the owner
        takes a lease with the call's placement where one is granted (`lease_s`). `named`: its
        client named it (X-Call-Id); it is placed past the last attempt of that id (`_NamedIds`).

        `nodes_attaching`: some registered GPU manager is not attached yet (its GPUs are not in
        the scheduler). A call that finds no GPU then waits for one (until its deadline) instead of
        being refused; without it (default) no GPU means no GPU manager at all: UNAVAILABLE."""
        if (known := self._calls.get(call_id)) is not None:
            return self._ask_again(known, owner, spec, now + timeout_s, lease)
        if len(self.scheduler.queue) + len(self._waiting) >= self.queue_capacity:
            raise Rejected(
                pb.OVERLOADED, f"the global queue is full ({self.queue_capacity} calls waiting); retry later"
            )
        call = _Call(call_id, owner, spec, submitted_at=now, deadline=now + timeout_s, lease_wanted=lease)
        call.worker_failures = int(worker_died)  # (its worker died under a lease: this is its retry)
        call.named, call.attempt = named, self._named.first_attempt(call_id, now, named)
        if not self.scheduler.cache.num_gpus:
            if not nodes_attaching:
                raise Rejected(pb.UNAVAILABLE, "no GPU manager is registered: start a node")
            # The core cannot take it (no GPU to check the model against): it enters at the first attach.
            call.state = _State.WAITING
            self._waiting[call_id] = self._calls[call_id] = call
            return []
        _enqueue(self.scheduler, call)
        self._calls[call_id] = call
        return self.schedule(now)

    def _ask_again(self, call: _Call, owner: Owner, spec: FunctionSpec, deadline: float, lease: bool) -> list[Effect]:
        """A call id submitted again while the book still holds it. Refused (Rejected) while its
        owner waits for it, or it is a lease, or for another model. One its owner gave up or lost
        (a gateway whose link closed before the Placement reached it asks again on its next link)
        waits only to learn whether its placement ran: the new owner takes it over, as one that
        may have been sent (placed again once its node says it never saw the grant, else
        answered that its outcome is unknown: not run twice). An X-Call-Id is no idempotency key
        beyond that: one finished, or run under a lease (which the book never holds), runs again."""
        if call.wanted or call.lease_until or call.spec.model != spec.model:
            raise Rejected(pb.INVALID, call_id_in_flight(call.call_id))  # (a gateway answers 409)
        call.owner, call.wanted, call.lease_wanted, call.asked_again = owner, True, lease, True
        call.deadline = max(call.deadline, deadline)
        return self._maybe_ran(call)

    def observe_utilization(self, now: float) -> list[Effect]:
        """Adaptive D: tell the controller what runs on every GPU now; where it moves a GPU's D,
        the scheduler follows (and fills a slot it opened)."""
        if self.adaptive_slots is None:
            return []
        idle_leases = [call.gpu_id for call in self._leases.values() if call.lease_uses]  # (its own call done)
        changes = self.adaptive_slots.observe(now, running_seen(self.scheduler, idle_leases))
        for gpu_id, slots in changes.items():
            self.scheduler.set_slots(gpu_id, slots)
            self.dirty_gpus.add(gpu_id)
        return self.schedule(now) if changes else []

    def schedule(self, now: float) -> list[Effect]:
        """Run the policy for every GPU with a free slot; placements for what it dispatched (and
        answers for WAITING calls that can never run on the GPUs attached now)."""
        effects: list[Effect] = []
        if self._waiting and self.scheduler.cache.num_gpus:  # GPUs attached: the WAITING calls enter
            waiting, self._waiting = self._waiting, {}
            for call, refusal in _admit(self.scheduler, waiting.values()):
                effects += self._finish(call, refusal.status, str(refusal))
        parked: list[str] = []  # the GPUs calls were parked on
        for decision in self.scheduler.schedule(now):
            self.dirty_gpus.add(decision.gpu_id)
            if not isinstance(decision, Dispatch):
                parked.append(decision.gpu_id)
                continue  # parked: it is dispatched from the local queue later
            self.dirty_models.add(decision.request.model)
            self.dirty_models.update(decision.evict)
            call = self._calls[decision.request.request_id]
            call.attempt += 1
            call.placements += 1
            call.state = _State.PLACED
            call.placed_at = now
            call.gpu_id = decision.gpu_id
            call.hit = decision.hit
            call.claimed = call.checking = call.maybe_ran = call.asked_again = False
            seq = self._seq[decision.gpu_id] = self._seq.get(decision.gpu_id, 0) + 1
            effects.append(
                Assignment(
                    owner=call.owner,
                    call_id=call.call_id,
                    attempt=call.attempt,
                    gpu_id=decision.gpu_id,
                    gpu_seq=seq,
                    hit=decision.hit,
                    evict=decision.evict,
                    spec=call.spec,
                    queue_s=now - call.submitted_at,
                    deadline=call.deadline,
                    claim_by=min(call.deadline, now + self.claim_s),
                    est_load_time_s=decision.est_load_time_s,
                    est_inference_time_s=decision.est_inference_time_s,
                )
            )
        if self.lease_s > 0:
            effects += self._leases_after(effects, parked, now)
        return effects

    # --- answers from nodes -----------------------------------------------------------------
    def done(
        self,
        call_id: str,
        attempt: int,
        outcome: int,
        now: float,
        *,
        loaded: bool = False,
        load_time_s: float = 0.0,
        inference_time_s: float = 0.0,
        peak_memory_mb: int = 0,
        batch_calls: int = 1,
        worker_lost: bool = False,
        lease_ended: bool = False,
        lease_call_id: str = "",
    ) -> list[Effect]:
        """A node finished attempt `attempt` of `call_id` (the gateway has its result or error), or a
        call under that placement's lease (`lease_ended`: the lease's last; it ended at the node)."""
        call = self._calls.get(call_id)
        if call is not None and call.state is _State.STRANDED and call.attempt == attempt:
            return self._stranded_done(call, outcome, now)
        if call is None or call.state is not _State.PLACED or call.attempt != attempt:
            return []  # an attempt given up on already (its slot was freed then)
        if lease_call_id and not call.lease_until:
            return []  # under a lease ended since (its X-Call-Id taken again meanwhile)
        effects: list[Effect] = []
        gpu_id, model = call.gpu_id, call.spec.model
        self.dirty_gpus.add(gpu_id)
        batch_size = max(1, batch_calls) * call.spec.batch_size
        failed = outcome in (pb.WORKER_DIED, pb.LOAD_FAILED) or worker_lost
        if call.lease_until and (call.lease_uses or not (lease_ended or failed)):
            measured_s = inference_time_s if outcome in (pb.OK, pb.HANDLER_ERROR) else 0.0
            return self._lease_done(call, now, lease_ended, measured_s, batch_size, failed=failed)
        if call.maybe_ran and outcome != pb.WORKER_DIED:  # (a Done before the check's answer)
            effects += self._unknown(call, _ran_there_message(call))
        if outcome == pb.WORKER_DIED:
            call.worker_failures += 1
            retry = call.wanted and call.worker_failures < MAX_WORKER_ATTEMPTS and now < call.deadline
            self._release(call, now, drop_model=True, requeue=retry, avoid_gpu=True)
            if not retry:
                effects += self._finish(call, pb.UNAVAILABLE, "the function's worker died twice; see the node's log")
        elif outcome == pb.LOAD_FAILED or worker_lost:
            self._release(call, now, drop_model=True, requeue=False)
        else:
            measured = outcome in (pb.OK, pb.HANDLER_ERROR) and inference_time_s > 0
            self.scheduler.on_complete(
                call_id,
                now,
                load_time_s=load_time_s if loaded and measured else None,
                inference_time_s=inference_time_s if measured else None,
                batch_size=batch_size,
            )
            if measured:
                self.dirty_profiles.add((self.scheduler.gpu(gpu_id).spec.gpu_type, model, batch_size))
            self._forget(call)
            effects += self.observe_memory(model, gpu_id, peak_memory_mb, now)
        if model in self._retired:
            effects += self._evict_retired(model)
        return effects + self.schedule(now)

    # --- from the owner (gateway) -----------------------------------------------------------
    def abandon(self, owner: Owner, call_id: str, attempt: int, reason: int, now: float) -> list[Effect]:
        """The owner gave up on the call (CANCELLED) or on one placement of it: REFUSED, the grant
        did not run at its node and never will (the node refused it, or the owner never sent it):
        the call is placed again at once, elsewhere; NODE_UNREACHABLE, the owner lost the node
        after sending it the Execute, which may have reached it (`_maybe_ran`): placed again only
        once the node says it never saw the grant, else answered that its outcome is unknown."""
        call = self._calls.get(call_id)
        if call is None or call.owner != owner:
            if reason == pb.Abandon.CANCELLED:
                return []  # the owner has stopped waiting: nothing to answer
            return [Answer(owner, call_id, OUTCOME_UNKNOWN, _outcome_unknown_message(call_id))]
        if reason == pb.Abandon.CANCELLED:
            return self._withdraw(call, now)
        if call.state not in (_State.PLACED, _State.STRANDED) or (attempt and attempt != call.attempt):
            return []  # about a placement already replaced
        if reason == pb.Abandon.NODE_UNREACHABLE:
            return self._maybe_ran(call)
        retry = call.wanted and now < call.deadline and call.placements < MAX_PLACEMENTS
        if call.state is _State.STRANDED:  # its GPU left already: back to the queue
            return self._requeue_stranded(call, now) if retry else self._finish(call, *_no_node(call))
        self._release(call, now, drop_model=_never_loaded(self.scheduler, call), requeue=retry, avoid_gpu=True)
        effects = [] if retry else self._finish(call, *_no_node(call))
        return effects + self.schedule(now)

    def unsent(self, call_id: str, attempt: int, now: float) -> list[Effect]:
        """Placement `attempt` of the call never reached its owner (an unsure leader held it, and
        its GPU left meanwhile): the call is placed again, as one its owner never sent. Nothing
        for a call gone or placed again since."""
        call = self._calls.get(call_id)
        if call is None or call.attempt != attempt:
            return []
        return self.abandon(call.owner, call_id, attempt, pb.Abandon.REFUSED, now)

    def _stranded_done(self, call: _Call, outcome: int, now: float) -> list[Effect]:
        """The Done of a STRANDED call (its GPU left since: no slot to free). It ran to its end
        there: it is forgotten. Its worker died there: its owner, answered so by the node, waits
        for the scheduler to place it again or answer, as for a placed call (`done`)."""
        if outcome != pb.WORKER_DIED:
            self._forget(call)
            return []
        call.worker_failures += 1
        if call.wanted and call.worker_failures < MAX_WORKER_ATTEMPTS and now < call.deadline:
            return self._requeue_stranded(call, now)
        return self._finish(call, pb.UNAVAILABLE, "the function's worker died twice; see the node's log")

    def _requeue_stranded(self, call: _Call, now: float) -> list[Effect]:
        """A STRANDED call whose owner never sent its Execute goes back to the queue (WAITING while
        no GPU is attached: its node may come back)."""
        if not self.scheduler.cache.num_gpus:
            call.state = _State.WAITING
            self._waiting[call.call_id] = call
            return []
        try:
            _enqueue(self.scheduler, call)
        except Rejected as exc:  # it fits none of the GPUs left
            return self._finish(call, exc.status, str(exc))
        return self.schedule(now)

    def owner_lost(self, owner: Owner, now: float) -> list[Effect]:
        """The owner's connection closed: withdraw its calls (placed ones are checked first)."""
        effects: list[Effect] = []
        for call in [c for c in self._calls.values() if c.owner == owner]:
            effects += self._withdraw(call, now)
        return effects + self.schedule(now)

    # --- time -------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Effect]:
        """Deadlines: calls queued past theirs are answered; placements not confirmed within
        `claim_s` are checked with their node; placements with no Done `lost_after_s` past the
        deadline are presumed lost."""
        effects = self._end_leases([c for c in self._leases.values() if now >= c.lease_until], if_idle=True)
        checks: dict[str, list[tuple[str, int]]] = {}
        for call in list(self._calls.values()):
            if call.state is not _State.PLACED:
                if now >= call.deadline:
                    if call.state is _State.QUEUED:  # (a WAITING one is not in the scheduler yet)
                        self.scheduler.cancel(call.call_id, now)
                    effects += self._finish(call, pb.DEADLINE, call.spec.deadline_message())
            elif now >= call.deadline + self.lost_after_s:
                self._release(call, now, drop_model=True, requeue=False)
                effects += self._finish(call, pb.DEADLINE, call.spec.deadline_message())
            elif not call.claimed and not call.checking and now >= call.placed_at + self.claim_s:
                call.checking = True
                checks.setdefault(split_gpu_address(call.gpu_id)[0], []).append((call.call_id, call.attempt))
        effects += [CheckGrants(node, tuple(grants)) for node, grants in checks.items()]
        return effects + self.schedule(now)

    # --- nodes ------------------------------------------------------------------------------
    def gpus_removed(self, gpu_ids: Iterable[str], now: float) -> list[Effect]:
        """GPUs left (their node did): their parked calls go back to the queue; their placed ones
        are STRANDED: placed again only if their owner says it never sent the Execute (Abandon
        REFUSED), else answered that their outcome is unknown (the call may have run on the node,
        which is cut off, not dead, or was killed running it)."""
        effects: list[Effect] = []
        for gpu_id in gpu_ids:
            self.dirty_models.update(self.scheduler.cache.models_on(gpu_id))
            for request in self.scheduler.remove_gpu(gpu_id, now):
                call = self._calls.get(request.request_id)
                if call is None:
                    continue
                placed = call.state is _State.PLACED
                call.state = _State.QUEUED
                call.claimed = call.checking = call.lease_ending = False
                call.lease_until = 0.0
                self._leases.pop(call.call_id, None)
                if not call.wanted or placed:
                    self.scheduler.cancel(call.call_id, now)  # (remove_gpu put it back in the queue)
                if not call.wanted:
                    self._forget(call)
                elif placed and call.maybe_ran:  # its owner lost the node too, after sending it
                    effects += self._finish(call, OUTCOME_UNKNOWN, _unknown_whether_ran_message(call))
                elif placed:
                    call.state = _State.STRANDED
            self.dirty_gpus.discard(gpu_id)
            self._parked_at.pop(gpu_id, None)
        effects += self._refuse_never_fitting(list(self.scheduler.queue.models()), now)
        return effects + self.schedule(now)

    # --- internals --------------------------------------------------------------------------
    def _current(self, call_id: str, attempt: int) -> _Call | None:
        call = self._calls.get(call_id)
        if call is None or call.state is not _State.PLACED or call.attempt != attempt:
            return None
        return call

    def _withdraw(self, call: _Call, now: float) -> list[Effect]:
        call.wanted = False
        if call.state is not _State.PLACED:
            if call.state is _State.QUEUED:
                self.scheduler.cancel(call.call_id, now)
            self._forget(call)  # (placed before, and refused, it may have been what kept a retired model)
            return self._evict_retired(call.spec.model) if call.spec.model in self._retired else []
        if call.lease_until:  # its owner holds the lease no more: the node ends it
            return self._end_leases((call,))
        if call.claimed or call.checking:
            return []  # a Done (or the check's answer) will free its slot
        call.checking = True
        return [CheckGrants(split_gpu_address(call.gpu_id)[0], ((call.call_id, call.attempt),))]

    def _release(self, call: _Call, now: float, *, drop_model: bool, requeue: bool, avoid_gpu: bool = False) -> None:
        """Free the slot of the call's current attempt; requeue the call or leave it finished."""
        self.dirty_gpus.add(call.gpu_id)
        if drop_model:
            self.dirty_models.add(call.spec.model)
        self.scheduler.on_failure(call.call_id, now, drop_model=drop_model, requeue=requeue, avoid_gpu=avoid_gpu)
        call.state = _State.QUEUED
        call.claimed = call.checking = call.maybe_ran = call.lease_ending = False
        call.lease_until = 0.0
        self._leases.pop(call.call_id, None)
        if not requeue:
            self._forget(call)

    def _finish(self, call: _Call, status: int, message: str) -> list[Effect]:
        """Answer the call (if its owner still waits) and forget it; a model no function runs any
        more goes where this call was all that kept it."""
        self._forget(call)
        effects: list[Effect] = [Answer(call.owner, call.call_id, status, message)] if call.wanted else []
        return effects + self._evict_retired(call.spec.model) if call.spec.model in self._retired else effects

    @staticmethod
    def _unknown(call: _Call, message: str) -> list[Effect]:
        """Answer the owner that the call's outcome is unknown; the call stays placed (its Done,
        or the lost-call deadline, frees its slot) but nobody waits for it any more. (Also where
        its Done comes before the answer to the check of a call that may have been sent: the
        node's answer went to the link its owner lost, and the check's answer will find it gone.)"""
        answer: list[Effect] = [Answer(call.owner, call.call_id, OUTCOME_UNKNOWN, message)] if call.wanted else []
        call.wanted = False
        return answer

    def _forget(self, call: _Call) -> None:
        self._calls.pop(call.call_id, None)
        self._waiting.pop(call.call_id, None)
        self._leases.pop(call.call_id, None)
        if call.named and call.attempt:
            self._named.keep(call, self)


def _reconcile_host(
    scheduler: Scheduler, runs: Callable[[str], bool], node: str, capacity_mb: int, parked: dict[str, int]
) -> list[Effect]:
    """`CallBook.reconcile_host`'s work (`runs`: whether some function runs a model)."""
    cache = scheduler.cache
    host = cache.host(node)
    if host is None or host.capacity_mb != capacity_mb:
        if not capacity_mb:
            cache.remove_host(node)
            return [EvictHost(node, tuple(parked))] if parked else []
        scheduler.add_host(node, capacity_mb)
    tier = cache.host(node)
    for model in [m for m in (tier.items if tier is not None else ()) if m not in parked]:
        cache.release_from_host(node, model)
    cache.recharge_host(node, parked)  # every entry's charge before any adoption below
    # A model on one of the node's GPUs is not in its host tier (the tiers are exclusive): a
    # report that still lists it parked predates the grant that took it back.
    on_gpus = {m for gpu_id in cache.gpu_ids() if cache.node_of(gpu_id) == node for m in cache.models_on(gpu_id)}
    strays = [
        model
        for model, memory_mb in parked.items()
        if model not in on_gpus and (not runs(model) or not cache.adopt_in_host(node, model, memory_mb))
    ]
    return [EvictHost(node, tuple(strays))] if strays else []


def _enqueue(scheduler: Scheduler, call: _Call) -> None:
    """Put the call in the scheduler's global queue (arriving when it was submitted). Raises
    Rejected when it can never run (its model fits no GPU, or is unknown)."""
    spec = call.spec
    try:
        slo_s = None if spec.slo_ms is None else spec.slo_ms / 1000
        scheduler.submit(Request(call.call_id, spec.name, spec.model, call.submitted_at, spec.batch_size, slo_s=slo_s))
    except ModelTooLarge as exc:
        raise Rejected(pb.UNAVAILABLE, str(exc)) from None
    except (UnknownModel, ValueError) as exc:
        raise Rejected(pb.INVALID, str(exc)) from None
    call.state = _State.QUEUED


def _admit(scheduler: Scheduler, waiting: Iterable[_Call]) -> list[tuple[_Call, Rejected]]:
    """Put WAITING calls in the scheduler's queue in arrival order (GPUs are attached now); returns
    those that can never run on these GPUs, with the refusal `submit` would have raised."""
    refused: list[tuple[_Call, Rejected]] = []
    for call in waiting:
        try:
            _enqueue(scheduler, call)
        except Rejected as exc:
            refused.append((call, exc))
    return refused


def _never_loaded(scheduler: Scheduler, call: _Call) -> bool:
    """Whether the model's cache entry on the call's GPU goes with a placement that never ran:
    it does when the placement was the miss that admitted it, unless another call on that GPU
    uses the model meanwhile (its node loads the model for it then)."""
    if call.hit:
        return False
    state = scheduler.gpu(call.gpu_id)
    others = [r for r in state.running.values() if r.request_id != call.call_id] + list(state.local_queue)
    return not any(r.model == call.spec.model for r in others)


def _no_node(call: _Call) -> tuple[int, str]:
    return pb.UNAVAILABLE, f"no node could run the call ({call.placements} placements)"


def _ran_there_message(call: _Call) -> str:
    if call.asked_again:
        return (
            f"the outcome of call {call.call_id!r} is unknown: it started on node "
            f"{split_gpu_address(call.gpu_id)[0]} when it was asked before (through a gateway that went away or "
            "gave up on it), so it was not run again (check its effects before retrying)"
        )
    return (
        f"the outcome of call {call.call_id!r} is unknown: it started on node {split_gpu_address(call.gpu_id)[0]} "
        "(its grant was presented there), but the gateway lost its connection to that node before the answer "
        "came, so it was not run again (check its effects before retrying)"
    )


def _unknown_whether_ran_message(call: _Call) -> str:
    return (
        f"the outcome of call {call.call_id!r} is unknown: the gateway lost node {split_gpu_address(call.gpu_id)[0]} "
        "after sending it the call, and the node cannot say whether it started it (it is unreachable or gone), so "
        "it was not run again (check its effects before retrying)"
    )


def _outcome_unknown_message(call_id: str) -> str:
    return (
        f"the outcome of call {call_id!r} is unknown: the scheduler no longer holds it (it finished on its node "
        "but its answer did not reach the gateway, or it was never placed), so it was not run again (check its "
        "effects before retrying)"
    )
