"""The scheduler: global queue, per-GPU local queues and state, driving a policy and the cache."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field

from cache_manager import Admission, CacheManager, Tier
from gpufaas.errors import ModelTooLarge, UnknownModel
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler.decisions import Decision, Dispatch, Park, PassOver, Release, Step, Visit
from scheduler.estimator import Estimator
from scheduler.policies.base import SchedulingPolicy
from scheduler.queues import GlobalQueue

_PLACEMENTS = (Dispatch, Park)  # the steps of a plan that are decisions (the rest is bookkeeping)


class PolicyError(RuntimeError):
    """A policy's plan cannot be applied (a step it did not reserve is not possible now): a bug in
    the policy. The scheduler is left as it was before that policy's fill."""


class _Journal:
    """The undo log of one policy fill: each reservation and how to undo it, undone last-in
    first-out. The policy's plan is what it keeps; `rollback` takes back the rest."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple[Step, Callable[[], None]]] = []

    def record(self, step: Step, undo: Callable[[], None]) -> None:
        self._entries.append((step, undo))

    def holds_exactly(self, plan: Sequence[Step]) -> bool:
        """Whether `plan` is every reservation, in order (the usual case: nothing to roll back)."""
        entries = self._entries
        if len(plan) != len(entries):
            return False
        return all(kept is entries[index][0] for index, kept in enumerate(plan))

    def savepoint(self) -> int:
        return len(self._entries)

    def rollback(self, savepoint: int = 0) -> None:
        """Undo every reservation made after `savepoint` (all of them by default)."""
        while len(self._entries) > savepoint:
            _, undo = self._entries.pop()
            undo()

    def clear(self) -> None:
        self._entries.clear()


@dataclass(slots=True)
class GpuState:
    """One GPU's scheduling state: D = `spec.slots` slots, each running at most one request.

    Lifecycle: a dispatch adds a request to `running` and its expected finish to
    `expected_finish_s`; `on_complete`/`on_failure` remove both. `local_queue` holds parked
    requests (all hits here), which take free slots before anything from the global queue.
    Read-only outside the scheduler.
    """

    spec: GpuSpec
    # Request id -> request, in dispatch order; at most `spec.slots` of them, unless `set_slots`
    # lowered D below the count (then nothing more starts here until enough finish).
    running: dict[str, Request] = field(default_factory=dict)
    # Request id -> when it is expected to finish: its estimated inference after the later of
    # its estimated load (on a miss) and the expected finish of the calls of its model dispatched
    # here before it (they share the model's worker, which serves them one at a time).
    expected_finish_s: dict[str, float] = field(default_factory=dict)
    # When a slot is expected to free up (an absolute time): the expected finish of the running
    # request whose end gives a full GPU a free slot (the earliest one, or a later one while D is
    # below the running count); -inf while a slot is free. Kept as `running` changes.
    busy_until_s: float = -math.inf
    local_queue: deque[Request] = field(default_factory=deque)
    local_work_s: float = 0.0  # estimated inference time of the parked requests, summed
    # Bumped whenever the GPU gets a free slot, and whenever it is advertised in the per-model
    # free-time heaps (full, with a new free time): marks older entries there as stale.
    version: int = 0

    @property
    def idle(self) -> bool:
        """Whether the GPU has a free slot, i.e. can start one more request now. The paper's
        "idle GPU" (the one policies fill) runs nothing; with D slots the GPU that can take work
        is the one with a free slot. With D = 1 the two are the same."""
        return len(self.running) < self.spec.slots

    @property
    def free_slots(self) -> int:
        return max(0, self.spec.slots - len(self.running))

    @property
    def free_at_s(self) -> float:
        """When this GPU is expected to be able to start one more request beyond its parked ones,
        which run D at a time; -inf while a slot is free."""
        return self.busy_until_s + self.local_work_s / self.spec.slots

    @property
    def order_key(self) -> tuple[float, str]:
        """Idle GPUs are offered work in this order: fastest first, then by id."""
        return (-self.spec.speed, self.spec.gpu_id)

    def update_busy_until(self) -> None:
        """Recompute `busy_until_s` after `running` or D changed: O(D)."""
        excess = len(self.running) - self.spec.slots
        if excess < 0:
            self.busy_until_s = -math.inf
        elif excess == 0:
            self.busy_until_s = min(self.expected_finish_s.values())
        else:
            self.busy_until_s = heapq.nsmallest(excess + 1, self.expected_finish_s.values())[-1]


class Scheduler:
    """Places requests on GPUs. Pure: time comes in as `now`, decisions go out as data.

    Flow: `submit()` appends to the global queue; `schedule(now)` returns the decisions that fill
    the GPUs' free slots (each GPU's local queue first, then the policy); the caller executes
    them and reports each finished request with `on_complete()` (or `on_failure()`). A GPU runs
    up to D = `GpuSpec.slots` requests at once (`set_slots` changes D at run time); a GPU with a
    free slot is what policies call idle.

    During `schedule()` the scheduler is the draft its policy plans on (`SchedulingContext`):
    `dispatch`, `park`, `pass_over` and `visit` reserve a step (applied, and journalled), and the
    policy's returned plan is what is kept; the rest is rolled back (see `SchedulingPolicy`).
    Called outside `schedule()` (tests, tools) they apply directly.
    """

    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        estimator: Estimator | None = None,
        cache: CacheManager | None = None,
    ) -> None:
        self.policy = policy
        self.estimator = estimator if estimator is not None else Estimator()
        self.cache = cache if cache is not None else CacheManager()
        self.queue = GlobalQueue()
        self._gpus: dict[str, GpuState] = {}
        self._idle: list[tuple[tuple[float, str], str]] = []  # sorted by GpuState.order_key
        self._models: dict[str, ModelSpec] = {}
        self._seq = itertools.count()
        self._seq_of: dict[str, int] = {}  # every request queued, parked or running
        self._placed_on: dict[str, str] = {}  # parked or running request -> GPU
        self._ready_local: set[str] = set()  # idle GPUs whose local queue is not empty
        # Running requests whose model entry went with an `on_failure(drop_model=True)` of another
        # request of that model on their GPU: their pin went with it, so they must not unpin a
        # later admission's.
        self._pin_dropped: set[str] = set()
        # Per model, (free_at_s, gpu_id, version) of busy GPUs holding it: finding the busy holder
        # that frees up first is O(log) instead of a scan of every replica. Entries go stale (GPU
        # idle, model evicted, version bumped) and are dropped lazily, or compacted.
        self._free_at: dict[str, list[tuple[float, str, int]]] = {}
        self._swapped_in: set[str] = set()  # running requests whose model came from the host tier
        # Copies expected in flight per shared host link (`GpuSpec.link`): request id -> (start,
        # end) of its load's host-to-GPU copy, the load's last `transfer_time_s` (a load from disk
        # spends its first seconds starting and reading, not copying). Added at a dispatch that
        # loads (or swaps in) on a GPU with a link, taken out when the request leaves its slot;
        # entries past their end are pruned as they are read.
        self._link_loads: dict[str, dict[str, tuple[float, float]]] = {}
        # When each cached model was last used on its GPU, and when each host-tier model entered
        # its tier: the clocks of the staged exit (`release_idle`).
        self._last_used_s: dict[tuple[str, str], float] = {}
        self._host_since_s: dict[tuple[str, str], float] = {}
        self._journal: _Journal | None = None  # open while a policy fills a GPU
        self._spare_journal = _Journal()  # the one journal, reused fill after fill
        # GPUs that received a dispatch in the current pass of `schedule()` and had a free slot
        # left: the next pass offers them work again (cleared when a pass starts).
        self._refill: set[str] = set()
        # Kept out-of-order dispatches (a `pass_over` of a request that was not the queue's head):
        # read by the service's metrics; a pass-over the policy drops is taken back with it.
        self.num_dispatched_ahead = 0

    # --- cluster and catalog ------------------------------------------------------------
    def add_gpu(self, spec: GpuSpec) -> None:
        if spec.gpu_id in self._gpus:
            raise ValueError(f"GPU {spec.gpu_id!r} is already registered")
        state = GpuState(spec)
        self._gpus[spec.gpu_id] = state
        self.cache.add_gpu(spec.gpu_id, spec.memory_mb, node=spec.node)
        bisect.insort(self._idle, (state.order_key, spec.gpu_id))

    def remove_gpu(self, gpu_id: str, now: float = 0.0) -> list[Request]:
        """Take a GPU out (its node left): its running and parked requests go back to the global
        queue in arrival order, its cache entries are dropped. Returns the requeued requests. The
        policy hears each running one end (`on_finish`, failed) and each returned one requeued
        (`on_requeue`), as of `now`."""
        state = self._gpus.pop(gpu_id)
        for request in state.running.values():
            self.policy.on_finish(request, now, inference_time_s=None)
        returned = [*state.running.values(), *state.local_queue]
        returned.sort(key=lambda r: self._seq_of[r.request_id])
        for request in returned:
            del self._placed_on[request.request_id]
            self._swapped_in.discard(request.request_id)
            self._end_link_load(state, request.request_id)
            self._pin_dropped.discard(request.request_id)
            self.queue.insert(request, self._seq_of[request.request_id])
            self.policy.on_requeue(request, now, ran=request.request_id in state.running)
        if state.idle:
            self._leave_idle(state)
        self._ready_local.discard(gpu_id)
        for model in self.cache.remove_gpu(gpu_id):
            self._last_used_s.pop((gpu_id, model), None)
        return returned

    def add_host(self, node: str, capacity_mb: int) -> None:
        """Give `node` a host tier: models its GPUs evict stay there, up to `capacity_mb`, and a
        miss on one of its GPUs takes them back (a swap-in, estimated far below a load)."""
        self.cache.add_host(node, capacity_mb)

    def set_slots(self, gpu_id: str, slots: int) -> None:
        """Change a GPU's D at run time (e.g. from its measured utilisation). Raising it lets the
        next `schedule()` fill the new slots, local queue first; lowering it below the running
        count starts nothing more there until enough of them finish. Raises ValueError below 1."""
        state = self._gpus[gpu_id]
        was_idle = state.idle
        state.spec = dataclasses.replace(state.spec, slots=slots)
        state.update_busy_until()
        if state.idle:
            state.version += 1
            if not was_idle:
                bisect.insort(self._idle, (state.order_key, gpu_id))
            if state.local_queue:
                self._ready_local.add(gpu_id)
        else:
            if was_idle:
                self._leave_idle(state)
            self._advertise(state)  # full, with a new free time

    def register_model(self, spec: ModelSpec) -> None:
        """Declare (or re-declare, e.g. with a measured size) a model's peak GPU occupancy."""
        self._models[spec.name] = spec

    def observe_memory(self, model: str, gpu_id: str, peak_memory_mb: int) -> bool:
        """A model's measured peak GPU memory replaces its declared size: for every later
        admission, and for its entry on `gpu_id` now if that needs no eviction. Returns whether
        the size changed."""
        spec = self._models.get(model)
        if spec is None or peak_memory_mb <= 0 or peak_memory_mb == spec.memory_mb:
            return False
        self._models[model] = ModelSpec(model, peak_memory_mb, spec.gpu_type, spec.labels)
        if gpu_id in self._gpus and model in self.cache.gpu(gpu_id):
            self.cache.gpu(gpu_id).resize(model, peak_memory_mb)
        return True

    def model(self, name: str) -> ModelSpec:
        try:
            return self._models[name]
        except KeyError:
            raise UnknownModel(f"model {name!r} is not registered with the scheduler") from None

    def gpu(self, gpu_id: str) -> GpuState:
        return self._gpus[gpu_id]

    def gpus(self) -> Iterable[GpuState]:
        return self._gpus.values()

    # --- the request lifecycle ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Append an arriving request to the global queue (arrival order = submit order)."""
        spec = self.model(request.model)
        if spec.gpu_type is not None and not any(self._fits(spec, state) for state in self._gpus.values()):
            raise ModelTooLarge(
                f"model {spec.name!r} needs a {spec.gpu_type} GPU with {spec.memory_mb} MB and the cluster has "
                f"none; GPU types here: {', '.join(sorted({s.spec.gpu_type for s in self._gpus.values()})) or 'none'}"
            )
        if spec.memory_mb > self.cache.max_capacity_mb:
            raise ModelTooLarge(
                f"model {spec.name!r} needs {spec.memory_mb} MB of GPU memory but the largest GPU "
                f"holds {self.cache.max_capacity_mb} MB; it can never run on this cluster"
            )
        if request.request_id in self._seq_of:
            raise ValueError(f"request {request.request_id!r} was already submitted")
        seq = next(self._seq)
        self._seq_of[request.request_id] = seq
        self.queue.push(request, seq)
        self.policy.on_submit(request)

    def schedule(self, now: float) -> list[Decision]:
        """Fill free slots while work is waiting; returns the decisions in order.

        First every GPU with a free slot and parked requests runs the heads of its local queue,
        as many as it has free slots. Then passes over the GPUs with a free slot, fastest first,
        then by id: in each pass every such GPU is offered work once (the policy's `fill`), so a
        burst spreads over the idle GPUs before any GPU takes a second request. A next pass
        offers work only to the GPUs that received a dispatch in this one and still have a free
        slot (a GPU that received nothing has just been offered the whole queue); passes end
        when there is no such GPU or the queue is empty, so there are at most as many as free
        slots, even when the policy can place nothing. With one slot per GPU a GPU that received
        a dispatch is full: one pass, as when a GPU ran one request at a time.
        """
        decisions: list[Decision] = []
        for gpu_id in sorted(self._ready_local):
            state = self._gpus[gpu_id]
            while state.idle and state.local_queue:
                started = self._dispatch_local(state, now)
                decisions.append(started)
                self._note_dispatch(started, now)
        self._ready_local.clear()
        offered = list(self._idle)  # (order key, GPU id), in idle order
        while self.queue:
            self._refill.clear()
            for _, gpu_id in offered:
                if not self.queue:
                    break
                if self._gpus[gpu_id].idle:
                    for decision in self._fill(gpu_id, now):
                        decisions.append(decision)
                        if isinstance(decision, Dispatch):
                            self._note_dispatch(decision, now)
            if not self._refill:
                break
            offered = sorted((self._gpus[g].order_key, g) for g in self._refill if self._gpus[g].idle)
        return decisions

    def _note_dispatch(self, decision: Dispatch, now: float) -> None:
        """A kept dispatch: its model was used now; what it evicted entered the host tier now."""
        self._last_used_s[(decision.gpu_id, decision.request.model)] = now
        node = self._gpus[decision.gpu_id].spec.node
        for victim in decision.evict:
            self._last_used_s.pop((decision.gpu_id, victim), None)
            if node is not None and self.cache.in_host(victim, decision.gpu_id):
                self._host_since_s[(node, victim)] = now
        if decision.from_host and node is not None:
            self._host_since_s.pop((node, decision.request.model), None)
        self.policy.on_dispatch(decision, now)

    def release_idle(self, now: float, *, gpu_idle_s: float | None, host_idle_s: float | None) -> list[Release]:
        """EDAS's staged exit: a model unused on its GPU for `gpu_idle_s` leaves it (for its
        node's host tier when there is one), and one in a host tier for `host_idle_s` leaves that
        too (None: that stage is off). And the policy's swap-out (`releases_memory`): a model it
        names idle (`idle_models`) leaves every GPU that holds it unpinned, for the node's host
        tier; where the node keeps none it stays. Models in use (pinned) stay. The caller frees
        what each Release names. O(models cached), so callers ask at events, not per call."""
        releases: list[Release] = []
        if self.policy.releases_memory:
            for model in self.policy.idle_models(now):
                for gpu_id in list(self.cache.gpus_with(model)):
                    node = self._gpus[gpu_id].spec.node
                    if node is None or self.cache.host(node) is None or self.cache.gpu(gpu_id).is_pinned(model):
                        continue
                    releases.append(self._release_from_gpu(gpu_id, model, now))
        if gpu_idle_s is not None:
            for gpu_id in self._gpus:
                cache = self.cache.gpu(gpu_id)
                for model in list(cache):
                    used_s = self._last_used_s.setdefault((gpu_id, model), now)  # untracked: from now
                    if cache.is_pinned(model) or now - used_s < gpu_idle_s:
                        continue
                    releases.append(self._release_from_gpu(gpu_id, model, now))
        if host_idle_s is not None:
            # Clocks of models no longer in a host tier (pushed out by a later demotion, or their
            # tier left with its node) go first.
            stale = [(node, model) for node, model in self._host_since_s if node not in self.cache.nodes_holding(model)]
            for key in stale:
                del self._host_since_s[key]
            for node in {state.spec.node for state in self._gpus.values() if state.spec.node is not None}:
                host = self.cache.host(node)
                for model in list(host.items) if host is not None else ():
                    since_s = self._host_since_s.setdefault((node, model), now)
                    if now - since_s >= host_idle_s and self.cache.release_from_host(node, model):
                        del self._host_since_s[(node, model)]
                        releases.append(Release("host", model, node))
        return releases

    def _release_from_gpu(self, gpu_id: str, model: str, now: float) -> Release:
        """Unpinned `model` leaves `gpu_id`, for its node's host tier if it has one (whose clock
        for the staged exit's second stage starts now)."""
        self._last_used_s.pop((gpu_id, model), None)
        to_host = self.cache.release(gpu_id, model)
        node = self._gpus[gpu_id].spec.node
        if to_host and node is not None:
            self._host_since_s[(node, model)] = now
        return Release("gpu", model, node, gpu_id, to_host)

    def _fill(self, gpu_id: str, now: float) -> list[Decision]:
        """Let the policy plan for `gpu_id` on the draft; keep its plan, roll back the rest."""
        journal = self._journal = self._spare_journal
        journal.clear()
        try:
            plan = self.policy.fill(self, gpu_id, now)
            if not journal.holds_exactly(plan):
                # The plan is not simply what was reserved (the policy tried what-ifs, or built
                # steps itself): take everything back, then apply the plan step by step.
                journal.rollback()
                plan = [self._reapply(step, now) for step in plan]
        except BaseException:
            journal.rollback()
            raise
        finally:
            self._journal = None
            journal.clear()
        return [step for step in plan if isinstance(step, _PLACEMENTS)]

    def _reapply(self, step: Step, now: float) -> Step:
        """Apply one step of a plan that was not reserved as such; PolicyError if it cannot be."""
        queued = step.request.request_id if isinstance(step, Dispatch | Park) else step.request_id
        if queued not in self.queue:
            raise PolicyError(f"{type(self.policy).__name__}: its plan has {step!r} for a request not queued")
        if isinstance(step, Dispatch):
            if step.gpu_id not in self._gpus or not self._gpus[step.gpu_id].idle:
                raise PolicyError(f"{type(self.policy).__name__}: its plan dispatches to {step.gpu_id!r}, not idle")
            if not self.fits(step.request.model, step.gpu_id):
                raise PolicyError(
                    f"{type(self.policy).__name__}: its plan runs {step.request.model!r} on {step.gpu_id!r}, "
                    "where it does not fit now"
                )
            return self.dispatch(step.request, step.gpu_id, now)
        if isinstance(step, Park):
            state = self._gpus.get(step.gpu_id)
            if state is None or state.idle or step.request.model not in self.cache.models_on(step.gpu_id):
                raise PolicyError(
                    f"{type(self.policy).__name__}: its plan parks {step.request.model!r} on {step.gpu_id!r}, "
                    "which is idle or does not hold the model"
                )
            return self.park(step.request, step.gpu_id, now)
        if isinstance(step, PassOver):
            return self.pass_over(step.request_id, exempt=step.exempt)
        return self.visit(step.request_id)

    def on_complete(
        self,
        request_id: str,
        now: float,
        *,
        load_time_s: float | None = None,
        inference_time_s: float | None = None,
        batch_size: int | None = None,
    ) -> Request:
        """A dispatched request finished and its slot is free; measured times (if given) refine
        the estimator. `inference_time_s` is that of the batch the request ran in, and
        `batch_size` the number of samples in that batch: the node may have merged several calls
        of the model into one (calls merged x `request.batch_size`); default `request.batch_size`.
        Raises KeyError (changing nothing) if the request is not running."""
        state, request = self._running(request_id)
        del self._placed_on[request_id]
        del self._seq_of[request_id]
        gpu_type = state.spec.gpu_type
        swapped_in = request_id in self._swapped_in
        self._swapped_in.discard(request_id)
        if load_time_s is not None:
            if swapped_in:
                self.estimator.observe_swap_in(request.model, gpu_type, load_time_s)
            else:
                self.estimator.observe_load(request.model, gpu_type, load_time_s)
        if inference_time_s is not None:
            samples = request.batch_size if batch_size is None else batch_size
            self.estimator.observe_inference(request.model, gpu_type, samples, inference_time_s)
        self._unpin_running(state, request)
        if request.model in self.cache.models_on(state.spec.gpu_id):
            self._last_used_s[(state.spec.gpu_id, request.model)] = now  # idle from now, if nothing else runs
        self._free_slot(state, request_id)
        self.policy.on_finish(request, now, inference_time_s=inference_time_s)
        return request

    def on_failure(
        self, request_id: str, now: float, *, drop_model: bool, requeue: bool, avoid_gpu: bool = False
    ) -> Request:
        """A dispatched request failed on its GPU, which is free again.

        `drop_model`: the model's worker is gone (it died or was killed), so its cache entry goes,
        and requests parked behind it for that model go back to the global queue. `requeue`: the
        request itself goes back to the global queue in arrival order (a retry); else it is done.
        `avoid_gpu`: the retry must run elsewhere (ignored when this is the only GPU). Other
        requests running there are untouched (their node reports them); with `drop_model`, those
        of the same model no longer pin it, and their own `drop_model` failures drop nothing more.
        Raises KeyError (changing nothing) if the request is not running.
        """
        state, request = self._running(request_id)
        gpu_id = state.spec.gpu_id
        del self._placed_on[request_id]
        self._swapped_in.discard(request_id)
        # A request whose entry already went with a sibling's failure (one worker death, several
        # calls) drops nothing more: the model there now, if any, is a later admission's.
        if drop_model and request_id not in self._pin_dropped:
            stranded = [r for r in state.local_queue if r.model == request.model]
            for parked in stranded:
                state.local_queue.remove(parked)
                del self._placed_on[parked.request_id]
                self.queue.insert(parked, self._seq_of[parked.request_id])
                self.policy.on_requeue(parked, now, ran=False)
            state.local_work_s = sum(self._inference_time_s(r, state) for r in state.local_queue)
            self._pin_dropped.update(
                other_id
                for other_id, other in state.running.items()
                if other.model == request.model and other_id != request_id
            )
            self.cache.drop(gpu_id, request.model)
            self._last_used_s.pop((gpu_id, request.model), None)
        else:
            self._unpin_running(state, request)
        if requeue:
            retry = dataclasses.replace(request, avoid_gpu=gpu_id) if avoid_gpu and len(self._gpus) > 1 else request
            self.queue.insert(retry, self._seq_of[request_id])
        else:
            del self._seq_of[request_id]
        self._free_slot(state, request_id)
        self.policy.on_finish(request, now, inference_time_s=None)
        if requeue:
            self.policy.on_requeue(retry, now, ran=True)
        return request

    def cancel(self, request_id: str) -> Request | None:
        """Withdraw a request that has not started (its deadline passed): from the global queue or
        a local queue. Returns None if it is running or unknown (a running request is not stopped)."""
        if request_id in self.queue:
            del self._seq_of[request_id]
            return self.queue.remove(request_id)
        gpu_id = self._placed_on.get(request_id)
        if gpu_id is None:
            return None
        state = self._gpus[gpu_id]
        for parked in state.local_queue:
            if parked.request_id == request_id:
                state.local_queue.remove(parked)
                state.local_work_s = max(0.0, state.local_work_s - self._inference_time_s(parked, state))
                self.cache.unpin(gpu_id, parked.model)
                del self._placed_on[request_id]
                del self._seq_of[request_id]
                if not state.idle:
                    self._advertise(state)  # it frees up sooner now
                return parked
        return None  # running: it will complete or fail on its own

    # --- what policies may ask (SchedulingContext) ----------------------------------------
    def best_idle(self, gpu_ids: Set[str], exclude: str | None = None, *, model: str | None = None) -> str | None:
        """Of `gpu_ids` (but `exclude`), the idle one with the most free slots, then the first in
        idle order (fastest, then by id); None if none is idle. With one slot per GPU that is
        the first in idle order; with several, hits of a model spread over the GPUs that hold it
        instead of queueing on the first. With `model`, the one whose worker of it would be free
        soonest comes first (`worker_wait_s`; with one slot per GPU that is every idle one).
        O(min(len(gpu_ids), idle GPUs)), times D with `model`."""
        # Usually a handful of GPUs are idle while a hot model sits on hundreds: walk the shorter.
        candidates: Iterable[str] = (
            (gpu_id for _, gpu_id in self._idle if gpu_id in gpu_ids) if len(self._idle) < len(gpu_ids) else gpu_ids
        )
        best: GpuState | None = None
        best_key: tuple[float, int, tuple[float, str]] | None = None
        for gpu_id in candidates:
            state = self._gpus[gpu_id]
            if not state.idle or gpu_id == exclude:
                continue
            busy_until_s = self._worker_busy_until_s(model, state) if model is not None and state.running else -math.inf
            key = (busy_until_s, -state.free_slots, state.order_key)
            if best_key is None or key < best_key:
                best, best_key = state, key
        return None if best is None else best.spec.gpu_id

    def running_calls(self, gpu_id: str) -> int:
        """How many calls `gpu_id` runs now (at most its D)."""
        return len(self._gpus[gpu_id].running)

    def models_busy(self, gpu_id: str, now: float) -> set[str]:
        """The models with a call running on `gpu_id` that is expected to end after `now` (a
        further call of one would wait for its worker): O(D)."""
        state = self._gpus[gpu_id]
        finishes = state.expected_finish_s
        return {request.model for r, request in state.running.items() if finishes[r] > now}

    def worker_wait_s(self, model: str, gpu_id: str, now: float) -> float:
        """How long a call of `model` started on `gpu_id` now would wait for the model's worker
        there: the calls of it running there go one at a time (one process per model per GPU,
        unless they batch), so until the last is expected to finish; 0 if none runs. O(D)."""
        return max(0.0, self._worker_busy_until_s(model, self._gpus[gpu_id]) - now)

    @staticmethod
    def _worker_busy_until_s(model: str, state: GpuState) -> float:
        finishes = state.expected_finish_s
        return max((finishes[r] for r, request in state.running.items() if request.model == model), default=-math.inf)

    def soonest_busy_holder(self, model: str, now: float) -> tuple[str, float] | None:
        """The busy GPU holding `model` that is expected to free up first, with its estimated
        wait (ties to the lower id); None if no busy GPU holds it. O(log replicas) amortized."""
        heap = self._free_at.get(model)
        holders = self.cache.gpus_with(model)
        while heap:
            _, gpu_id, version = heap[0]
            state = self._gpus.get(gpu_id)
            if state is None or state.version != version or state.idle or gpu_id not in holders:
                heapq.heappop(heap)
                continue
            return gpu_id, self.estimated_wait_s(gpu_id, now)
        return None

    def estimated_wait_s(self, gpu_id: str, now: float) -> float:
        """Time until a GPU could start one more request: until a slot frees up (0 if one is
        free), plus the work already parked in its local queue, which runs D at a time."""
        state = self._gpus[gpu_id]
        return max(0.0, state.busy_until_s - now) + state.local_work_s / state.spec.slots

    def load_time_s(self, model: str, gpu_id: str) -> float:
        """What a miss of `model` on `gpu_id` would take, by the tier it comes from: a swap-in
        from its node's host tier or host model pool, a load from its disk, or a fetch and a load."""
        spec = self._models[model]
        gpu_type = self._gpus[gpu_id].spec.gpu_type
        tier = self.cache.tier(model, gpu_id)
        if tier <= Tier.POOL:
            load_s = self.estimator.swap_in_time_s(model, gpu_type, spec.memory_mb)
        else:
            load_s = self.estimator.load_time_s(model, gpu_type, spec.memory_mb)
            if tier is Tier.REMOTE:
                load_s += self.estimator.fetch_time_s(spec.memory_mb)
        return load_s

    def copies_overlapping(self, model: str, gpu_id: str, now: float) -> int:
        """How many copies expected in flight on `gpu_id`'s shared host link would overlap the
        copy of `model` if it were loaded there now (0 for a GPU with a link of its own): each
        would share the link's bandwidth with it. O(copies on that link)."""
        link = self._gpus[gpu_id].spec.link
        if link is None or not self._link_loads.get(link):
            return 0
        end_s = now + self.load_time_s(model, gpu_id)
        return self._copies_overlapping(
            link, end_s - self.estimator.transfer_time_s(self._models[model].memory_mb), end_s, now
        )

    def _copies_overlapping(self, link: str, start_s: float, end_s: float, now: float) -> int:
        """Copies on `link` whose window meets [start_s, end_s]; those over by `now` are pruned."""
        copies = self._link_loads.get(link)
        if not copies:
            return 0
        for request_id in [r for r, (_, until_s) in copies.items() if until_s <= now]:
            del copies[request_id]
        return sum(1 for since_s, until_s in copies.values() if since_s < end_s and until_s > start_s)

    def _end_link_load(self, state: GpuState, request_id: str) -> None:
        link = state.spec.link
        if link is not None and link in self._link_loads:
            self._link_loads[link].pop(request_id, None)

    def _quiet_first(self, model: str, candidates: Iterable[str], quiet_links_at: float | None) -> str | None:
        """The first of `candidates` where `model`'s copy, loaded at `quiet_links_at`, would share
        its host link with no other copy, else the first of them (Torpor's interference-aware
        placement: two copies behind one PCIe switch each take up to twice as long). Without
        `quiet_links_at`, or while no link has a copy, the first: lazy, as cheap as taking it."""
        if quiet_links_at is None or not any(self._link_loads.values()):
            return next(iter(candidates), None)
        first: str | None = None
        for gpu_id in candidates:
            if not self.copies_overlapping(model, gpu_id, quiet_links_at):
                return gpu_id
            if first is None:
                first = gpu_id
        return first

    def inference_time_s(self, model: str, gpu_id: str, batch_size: int) -> float:
        """The estimated time of one call of `model` with `batch_size` samples on `gpu_id`."""
        return self.estimator.inference_time_s(model, self._gpus[gpu_id].spec.gpu_type, batch_size)

    def fits(self, model: str, gpu_id: str) -> bool:
        """Whether the model may run on this GPU now: large enough, of the required type, and,
        while other requests run there, with room beside the models they pin. O(1)."""
        spec, state = self._models[model], self._gpus[gpu_id]
        if not self._fits(spec, state):
            return False
        # Only running and parked requests pin models: without them all of the GPU is for the taking.
        return not (state.running or state.local_queue) or self.cache.gpu(gpu_id).can_admit(model, spec.memory_mb)

    @staticmethod
    def _fits(spec: ModelSpec, state: GpuState) -> bool:
        return spec.memory_mb <= state.spec.memory_mb and spec.gpu_type in (None, state.spec.gpu_type)

    def idle_with_room(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU whose cache has room for `model` without evicting anything: `prefer` if
        it has, else the first in idle order; None if every idle GPU would have to evict. With
        `quiet_links_at`, one whose host link carries no load then comes first (`_quiet_first`).
        O(1) when `prefer` has room (and a quiet link), else O(idle GPUs)."""
        spec = self._models[model]

        def room(gpu_id: str) -> bool:
            return (
                gpu_id != exclude
                and self.cache.gpu(gpu_id).free_mb >= spec.memory_mb
                and self._fits(spec, self._gpus[gpu_id])
            )

        with_room = (gpu_id for gpu_id in itertools.chain((prefer,), (g for _, g in self._idle)) if room(gpu_id))
        return self._quiet_first(model, with_room, quiet_links_at)

    def idle_nearest_copy(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU the model may run on now (see `fits`) whose node holds it nearer than the
        GPU being filled (`prefer`) would have it: in host memory (its host tier or host model
        pool: a swap-in, not a load), else, when `prefer`'s node would have to fetch it, on disk
        (a load without the fetch). The nearest tier wins; within it `prefer` if it is one, else
        one with room for the model (evicting nothing), else the first, in idle order. None if no
        node holds it nearer. With `quiet_links_at`, a GPU whose host link carries no load then
        comes first within a tier. O(1) without copies, else O(idle GPUs)."""
        holdings = self.cache.holdings
        in_memory: Set[str] = self.cache.nodes_holding(model)
        pooling = holdings.nodes_pooling(model)
        if pooling:
            in_memory = in_memory | pooling if in_memory else pooling
        if in_memory:
            found = self._idle_on(model, in_memory, prefer, exclude, quiet_links_at)
            if found is not None:
                return found
        staging = holdings.nodes_staging(model)
        if staging and self.cache.tier(model, prefer) is Tier.REMOTE:
            return self._idle_on(model, staging, prefer, exclude, quiet_links_at)
        return None

    def _idle_on(
        self, model: str, nodes: Set[str], prefer: str, exclude: str | None, quiet_links_at: float | None
    ) -> str | None:
        """`idle_nearest_copy`'s choice among the idle GPUs of `nodes`: `prefer`, else one with
        room, else the first. With `quiet_links_at`, a GPU with room on a quiet link (see
        `_quiet_first`) goes before `prefer` on a loaded one; a quiet link never outweighs room (an
        eviction costs a later load, contention a share of one copy)."""
        spec = self._models[model]

        def eligible(gpu_id: str) -> bool:
            return gpu_id != exclude and self._gpus[gpu_id].spec.node in nodes and self.fits(model, gpu_id)

        def others(with_room: bool) -> Iterable[str]:
            for _, gpu_id in self._idle:
                if (
                    gpu_id != prefer
                    and eligible(gpu_id)
                    and (self.cache.gpu(gpu_id).free_mb >= spec.memory_mb) == with_room
                ):
                    yield gpu_id

        head = (prefer,) if eligible(prefer) else ()
        found = self._quiet_first(model, itertools.chain(head, others(True)), quiet_links_at)
        return found if found is not None else self._quiet_first(model, others(False), quiet_links_at)

    def idle_for_replica(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU that does not hold `model` and has room for it now, evicting nothing
        (`prefer` if it is one, else the first in idle order; with `quiet_links_at` a quiet host
        link first, see `_quiet_first`); None if there is none. O(idle GPUs): asked only when the
        idle holders' workers of the model are busy."""
        holders = self.cache.gpus_with(model)
        spec = self._models[model]

        def room(gpu_id: str) -> bool:
            return (
                gpu_id != exclude
                and gpu_id not in holders
                and self._fits(spec, self._gpus[gpu_id])
                and self.cache.gpu(gpu_id).free_mb >= spec.memory_mb
            )

        first = (prefer,) if self._gpus[prefer].idle and room(prefer) else ()
        return self._quiet_first(
            model, itertools.chain(first, (gpu_id for _, gpu_id in self._idle if room(gpu_id))), quiet_links_at
        )

    def first_idle_fitting(self, model: str, exclude: str | None = None) -> str | None:
        """The first idle GPU (in idle order) the model may run on now (see `fits`): O(idle GPUs);
        only asked when it may not run on the GPU being filled (mixed memory sizes, a required
        GPU type, or models pinned by requests running there)."""
        for _, gpu_id in self._idle:
            if gpu_id != exclude and self.fits(model, gpu_id):
                return gpu_id
        return None

    def idle_with_coldest_victim(
        self, model: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """The idle GPU the model may run on now whose first eviction victim was used least
        recently, on the cache's clock shared by every GPU (a GPU that would evict nothing counts
        as coldest); None if the model may run on no idle GPU now. Ties (only between GPUs that
        evict nothing) go to the first in idle order. O(idle GPUs) with LRU eviction.

        Asked when no idle GPU has room for a miss: loading on the GPU being filled would always
        churn that GPU's LRU list while other GPUs' models stay frozen however cold; this evicts
        the cluster's coldest model instead. With `quiet_links_at`, a quiet host link breaks ties
        (GPUs that evict nothing): it never outweighs a colder victim."""
        spec = self._models[model]
        best_gpu: str | None = None
        best_key = (0, 0)
        weigh_at = quiet_links_at if any(self._link_loads.values()) else None
        for _, gpu_id in self._idle:
            if gpu_id == exclude or not self._fits(spec, self._gpus[gpu_id]):
                continue
            cache = self.cache.gpu(gpu_id)
            if not cache.can_admit(model, spec.memory_mb):
                continue
            victim = cache.first_victim(model, spec.memory_mb)
            tick = -1 if victim is None else cache.last_used_tick(victim)
            loading = min(1, self.copies_overlapping(model, gpu_id, weigh_at)) if weigh_at is not None else 0
            if best_gpu is None or (tick, loading) < best_key:
                best_gpu, best_key = gpu_id, (tick, loading)
        return best_gpu

    def dispatch(self, request: Request, gpu_id: str, now: float) -> Dispatch:
        """Run a globally queued request in a free slot of `gpu_id` (admitting its model to the
        cache; the model must fit there now, see `fits`). Reserved while a policy fills."""
        state = self._gpus[gpu_id]
        journal = self._journal
        taken = self.queue.take(request.request_id)
        if journal is None:
            try:
                return self._start(request, state, now, pinned=False)
            except BaseException:
                self.queue.untake(taken)
                raise
        busy_until_before, refilled_before = state.busy_until_s, gpu_id in self._refill
        try:
            decision, cache_undo = self._start_undoable(request, state, now)
        except BaseException:
            self.queue.untake(taken)
            raise
        left_idle = not state.idle
        request_id = request.request_id

        def undo() -> None:
            del state.running[request_id]
            del state.expected_finish_s[request_id]
            del self._placed_on[request_id]
            self._swapped_in.discard(request_id)
            self._end_link_load(state, request_id)
            state.busy_until_s = busy_until_before
            state.version += 1  # what it advertised while full no longer holds
            if left_idle:
                bisect.insort(self._idle, (state.order_key, gpu_id))
            if not refilled_before:
                self._refill.discard(gpu_id)
            self.cache.unpin(gpu_id, request.model)
            cache_undo()
            self.queue.untake(taken)

        journal.record(decision, undo)
        return decision

    def park(self, request: Request, gpu_id: str, now: float) -> Park:
        """Move a globally queued request to the local queue of `gpu_id`, a GPU with no free slot
        (its model is cached there and stays pinned until the request runs). Reserved while a
        policy fills."""
        state = self._gpus[gpu_id]
        work_before = state.local_work_s
        wait_s = self.estimated_wait_s(gpu_id, now)
        taken = self.queue.take(request.request_id)
        self.cache.pin(gpu_id, request.model)
        state.local_queue.append(request)
        state.local_work_s += self._inference_time_s(request, state)
        self._advertise(state)
        self._placed_on[request.request_id] = gpu_id
        decision = Park(request, gpu_id, wait_s)
        if self._journal is not None:
            request_id = request.request_id

            def undo() -> None:
                state.local_queue.pop()
                state.local_work_s = work_before
                del self._placed_on[request_id]
                self.cache.unpin(gpu_id, request.model)
                self._advertise(state)  # busy, and free when it was before the park
                self.queue.untake(taken)

            self._journal.record(decision, undo)
        return decision

    def savepoint(self) -> int:
        """A mark in the current fill's reservations, for `rollback` (a policy's what-if)."""
        if self._journal is None:
            raise RuntimeError("savepoint() is for a policy's fill: nothing is being reserved now")
        return self._journal.savepoint()

    def rollback(self, savepoint: int) -> None:
        """Undo the reservations made since `savepoint` (last first): the draft is as it was then."""
        if self._journal is None:
            raise RuntimeError("rollback() is for a policy's fill: nothing is being reserved now")
        self._journal.rollback(savepoint)

    def pass_over(self, request_id: str, *, exempt: Sequence[str] = ()) -> PassOver:
        """Count a skip for every request queued ahead of `request_id` but `exempt` (see
        `GlobalQueue.pass_over`). Reserved while a policy fills."""
        head = self.queue.head
        ahead = int(head is not None and head.request_id != request_id)
        self.queue.pass_over(request_id, exempt=exempt)
        self.num_dispatched_ahead += ahead
        step = PassOver(request_id, tuple(exempt))
        if self._journal is not None:

            def undo() -> None:
                self.queue.unpass(request_id, exempt=exempt)
                self.num_dispatched_ahead -= ahead

            self._journal.record(step, undo)
        return step

    def visit(self, request_id: str) -> Visit:
        """Count one visit for one queued request (Algorithm 1 read literally). Reserved while a
        policy fills."""
        self.queue.visit(request_id)
        step = Visit(request_id)
        if self._journal is not None:
            self._journal.record(step, lambda: self.queue.unvisit(request_id))
        return step

    # --- internals ------------------------------------------------------------------------
    def _dispatch_local(self, state: GpuState, now: float) -> Dispatch:
        request = state.local_queue.popleft()
        state.local_work_s = max(0.0, state.local_work_s - self._inference_time_s(request, state))
        if not state.local_queue:
            state.local_work_s = 0.0  # no drift from float sums
        return self._start(request, state, now, pinned=True)

    def _start(self, request: Request, state: GpuState, now: float, *, pinned: bool) -> Dispatch:
        spec = self._check_slot(request, state)
        holders = self.cache.gpus_with(spec.name)
        false_miss = state.spec.gpu_id not in holders and len(holders) > 0
        admission = self.cache.admit(state.spec.gpu_id, spec.name, spec.memory_mb)
        if not pinned:
            self.cache.pin(state.spec.gpu_id, spec.name)
        return self._occupy(request, state, spec, admission=admission, false_miss=false_miss, now=now)

    def _start_undoable(self, request: Request, state: GpuState, now: float) -> tuple[Dispatch, Callable[[], None]]:
        """`_start` of a globally queued request, and how to undo its admission (a reservation)."""
        spec = self._check_slot(request, state)
        holders = self.cache.gpus_with(spec.name)
        false_miss = state.spec.gpu_id not in holders and len(holders) > 0
        admission, cache_undo = self.cache.admit_undoable(state.spec.gpu_id, spec.name, spec.memory_mb)
        self.cache.pin(state.spec.gpu_id, spec.name)
        return self._occupy(request, state, spec, admission=admission, false_miss=false_miss, now=now), cache_undo

    def _check_slot(self, request: Request, state: GpuState) -> ModelSpec:
        if len(state.running) >= state.spec.slots:
            raise RuntimeError(
                f"GPU {state.spec.gpu_id!r} has no free slot ({len(state.running)} running, {state.spec.slots} "
                f"slots); cannot dispatch {request.request_id!r}"
            )
        return self._models[request.model]

    def _occupy(
        self, request: Request, state: GpuState, spec: ModelSpec, *, admission: Admission, false_miss: bool, now: float
    ) -> Dispatch:
        """The request takes a slot of `state`, its model admitted: estimates, idle list, adverts."""
        gpu_id, slots = state.spec.gpu_id, state.spec.slots
        running = state.running
        if admission.hit:
            load_s = 0.0
        elif admission.from_host or admission.from_pool:
            load_s = self.estimator.swap_in_time_s(spec.name, state.spec.gpu_type, spec.memory_mb)
            self._swapped_in.add(request.request_id)
        else:
            load_s = self.estimator.load_time_s(spec.name, state.spec.gpu_type, spec.memory_mb)
            if self.cache.tier(spec.name, gpu_id) is Tier.REMOTE:
                load_s += self.estimator.fetch_time_s(spec.memory_mb)
        link = state.spec.link
        if load_s and link is not None:
            # The copy shares the link with the loads in flight there (an equal share each).
            transfer_s = self.estimator.transfer_time_s(spec.memory_mb)
            load_s += self._copies_overlapping(link, now + load_s - transfer_s, now + load_s, now) * transfer_s
            self._link_loads.setdefault(link, {})[request.request_id] = (now + load_s - transfer_s, now + load_s)
        inference_s = self._inference_time_s(request, state)
        # Behind the calls of its model running there (they share a worker), or its load.
        start_s = max(now + load_s, self._worker_busy_until_s(spec.name, state)) if running else now + load_s
        running[request.request_id] = request
        state.expected_finish_s[request.request_id] = start_s + inference_s
        if len(running) < slots:
            self._refill.add(gpu_id)
        else:
            state.update_busy_until()
            self._leave_idle(state)
            self._advertise(state)
        self._placed_on[request.request_id] = gpu_id
        return Dispatch(
            request=request,
            gpu_id=gpu_id,
            hit=admission.hit,
            evict=admission.evicted,
            false_miss=false_miss,
            est_load_time_s=load_s,
            est_inference_time_s=inference_s,
            from_host=admission.from_host,
            from_pool=admission.from_pool,
        )

    def _running(self, request_id: str) -> tuple[GpuState, Request]:
        """The GPU a request runs on, and the request; KeyError if it is not running."""
        gpu_id = self._placed_on.get(request_id)
        state = None if gpu_id is None else self._gpus[gpu_id]
        request = None if state is None else state.running.get(request_id)
        if state is None or request is None:
            where = "anywhere" if gpu_id is None else f"on GPU {gpu_id!r} (it is parked there)"
            raise KeyError(f"request {request_id!r} is not running {where}")
        return state, request

    def _unpin_running(self, state: GpuState, request: Request) -> None:
        if request.request_id in self._pin_dropped:
            self._pin_dropped.discard(request.request_id)  # its pin went with the dropped entry
        else:
            self.cache.unpin(state.spec.gpu_id, request.model)

    def _free_slot(self, state: GpuState, request_id: str) -> None:
        """Take a finished (or failed) request out of its slot and update the GPU's standing."""
        was_full = not state.idle
        del state.running[request_id]
        del state.expected_finish_s[request_id]
        self._end_link_load(state, request_id)
        state.update_busy_until()
        state.version += 1
        if not state.idle:
            self._advertise(state)  # still full (D was lowered): the slot it waits for moved
            return
        if was_full:
            bisect.insort(self._idle, (state.order_key, state.spec.gpu_id))
        if state.local_queue:
            self._ready_local.add(state.spec.gpu_id)

    def _advertise(self, state: GpuState) -> None:
        """Publish a full GPU's new free time to the heaps of every model it holds."""
        state.version += 1
        entry_key = state.free_at_s
        gpu_id = state.spec.gpu_id
        for model in self.cache.models_on(gpu_id):
            heap = self._free_at.setdefault(model, [])
            heapq.heappush(heap, (entry_key, gpu_id, state.version))
            # Rebuilds cost O(replicas): rare enough (a hot model's heap every ~8x its replicas
            # pushes) to stay out of the per-decision tail, and amortized O(1).
            if len(heap) > 8 * len(self.cache.gpus_with(model)) + 64:
                self._compact(model)

    def _compact(self, model: str) -> None:
        """Rebuild one model's heap from its live entries (amortized O(1) per push)."""
        live = [
            (state.free_at_s, gpu_id, state.version)
            for gpu_id in self.cache.gpus_with(model)
            if not (state := self._gpus[gpu_id]).idle
        ]
        heapq.heapify(live)
        self._free_at[model] = live

    def _leave_idle(self, state: GpuState) -> None:
        # bisect, not list.remove: O(log n) to find among thousands of GPUs.
        entry = (state.order_key, state.spec.gpu_id)
        index = bisect.bisect_left(self._idle, entry)
        if index == len(self._idle) or self._idle[index] != entry:
            raise KeyError(f"GPU {state.spec.gpu_id!r} is not idle")
        del self._idle[index]

    def _inference_time_s(self, request: Request, state: GpuState) -> float:
        return self.estimator.inference_time_s(request.model, state.spec.gpu_type, request.batch_size)
