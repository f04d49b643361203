"""The scheduler: global queue, per-GPU local queues and state, driving a policy and the cache."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from cache_manager import CacheManager
from gpufaas.errors import ModelTooLarge, UnknownModel
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler.decisions import Decision, Dispatch, Park, Release
from scheduler.draft import Draft
from scheduler.estimator import Estimator
from scheduler.policies.base import SchedulingPolicy
from scheduler.reservations import dispatch_now, park_now, start_parked
from scheduler.staged_exit import StagedExit
from scheduler.state import ClusterReads, ClusterState, GpuState


class Scheduler(ClusterReads):
    """Places requests on GPUs. Pure: time comes in as `now`, decisions go out as data.

    Flow: `submit()` appends to the global queue; `schedule(now)` returns the decisions that fill
    the GPUs' free slots (each GPU's local queue first, then the policy); the caller executes
    them and reports each finished request with `on_complete()` (or `on_failure()`). A GPU runs
    up to D = `GpuSpec.slots` requests at once (`set_slots` changes D at run time); a GPU with a
    free slot is what policies call idle.

    Committed state lives in `cluster` (`ClusterState`). During `schedule()` each fill of a GPU
    gets a `Draft` of it, the `SchedulingContext` its policy plans on: the draft's reservations
    are applied and journalled, the policy's returned plan is what is kept and the rest is rolled
    back (see `SchedulingPolicy`). The common case, one request queued that the policy places
    on an idle GPU holding its model or parks on a busy one (`SchedulingPolicy.lone_target`),
    skips the draft: the same step is applied directly (`fast_path`). `dispatch` and `park`
    here apply directly (tests, tools).
    """

    def __init__(
        self,
        policy: SchedulingPolicy,
        *,
        estimator: Estimator | None = None,
        cache: CacheManager | None = None,
        fast_path: bool = True,
    ) -> None:
        self.policy = policy
        # Whether `schedule` may take the policy's `lone_target` instead of a full fill; off only
        # to check that both decide alike (tests/property/test_fast_path_equivalence.py).
        self.fast_path = fast_path
        self.cluster = ClusterState(
            cache if cache is not None else CacheManager(), estimator if estimator is not None else Estimator()
        )
        self.queue = self.cluster.queue
        self._seq = itertools.count()
        self._seq_of: dict[str, int] = {}  # every request queued, parked or running
        self._exit = StagedExit(self.cluster)  # the clocks of `release_idle`
        self.fast_path_decisions = 0  # dispatches and parks `_place_lone` made (tests read it)

    @property
    def estimator(self) -> Estimator:
        return self.cluster.estimator

    @property
    def num_dispatched_ahead(self) -> int:
        """Kept out-of-order dispatches (a `pass_over` of a request that was not the queue's
        head): read by the service's metrics; a pass-over the policy drops is taken back with it."""
        return self.cluster.dispatched_ahead

    # --- cluster and catalog ------------------------------------------------------------
    def add_gpu(self, spec: GpuSpec) -> None:
        if spec.gpu_id in self.cluster.gpus:
            raise ValueError(f"GPU {spec.gpu_id!r} is already registered")
        state = self.cluster.join(spec)
        types = self.cluster.gpu_types
        types[spec.gpu_type] = types.get(spec.gpu_type, 0) + 1
        self.cache.add_gpu(spec.gpu_id, spec.memory_mb, node=spec.node)
        self.cluster.enter_idle(state)
        self.cluster.reindex(state)  # a stamp of its own: a GPU of this id before it had others

    def remove_gpu(self, gpu_id: str, now: float = 0.0) -> list[Request]:
        """Take a GPU out (its node left): its running and parked requests go back to the global
        queue in arrival order, its cache entries are dropped. Returns the requeued requests. The
        policy hears each running one end (`on_finish`, failed) and each returned one requeued
        (`on_requeue`), as of `now`."""
        state = self.cluster.leave(gpu_id)
        types = self.cluster.gpu_types
        types[state.spec.gpu_type] -= 1
        if not types[state.spec.gpu_type]:
            del types[state.spec.gpu_type]
        for request in state.running.values():
            self.policy.on_finish(request, now, inference_time_s=None)
        returned = [*state.running.values(), *state.local_queue]
        returned.sort(key=lambda r: self._seq_of[r.request_id])
        for request in returned:
            del self.cluster.placed_on[request.request_id]
            self.cluster.swapped_in.discard(request.request_id)
            self.cluster.links.end(state.spec.link, request.request_id)
            self.cluster.pin_dropped.discard(request.request_id)
            self.queue.insert(request, self._seq_of[request.request_id])
            self.policy.on_requeue(request, now, ran=request.request_id in state.running)
        if state.idle:
            self.cluster.leave_idle(state)
        self.cluster.ready_local.discard(gpu_id)
        for model in self.cache.remove_gpu(gpu_id):
            self._exit.forget(gpu_id, model)
        return returned

    def add_host(self, node: str, capacity_mb: int) -> None:
        """Give `node` a host tier: models its GPUs evict stay there, up to `capacity_mb`, and a
        miss on one of its GPUs takes them back (a swap-in, estimated far below a load)."""
        self.cache.add_host(node, capacity_mb)

    def set_slots(self, gpu_id: str, slots: int) -> None:
        """Change a GPU's D at run time (e.g. from its measured utilisation). Raising it lets the
        next `schedule()` fill the new slots, local queue first; lowering it below the running
        count starts nothing more there until enough of them finish. Raises ValueError below 1."""
        state = self.cluster.gpus[gpu_id]
        was_idle = state.idle
        state.spec = dataclasses.replace(state.spec, slots=slots)
        state.update_busy_until()
        self.cluster.reindex(state)
        if state.idle:
            state.version += 1
            if not was_idle:
                self.cluster.enter_idle(state)
            if state.local_queue:
                self.cluster.ready_local.add(gpu_id)
        else:
            if was_idle:
                self.cluster.leave_idle(state)
            self.cluster.advertise(state)  # full, with a new free time

    def register_model(self, spec: ModelSpec) -> None:
        """Declare (or re-declare) a model's peak GPU occupancy; its cache entries follow where that evicts nothing."""
        self.cluster.models[spec.name] = spec
        self.cache.resize(spec.name, spec.memory_mb)  # (else they keep their size, as `observe_memory` leaves them)

    def observe_memory(self, model: str, gpu_id: str, peak_memory_mb: int) -> bool:
        """A model's measured peak replaces its declared size, for later admissions and for its entry on
        `gpu_id` once that needs no eviction (as each GPU reports). Returns whether the size changed."""
        spec = self.cluster.models.get(model)
        if spec is None or peak_memory_mb <= 0:
            return False
        if gpu_id in self.cluster.gpus:
            self.cache.gpu(gpu_id).resize(model, peak_memory_mb)  # (absent, that size, or no room yet: kept)
        if peak_memory_mb == spec.memory_mb:
            return False
        self.cluster.models[model] = ModelSpec(model, peak_memory_mb, spec.gpu_type, spec.labels)
        return True

    def model(self, name: str) -> ModelSpec:
        try:
            return self.cluster.models[name]
        except KeyError:
            raise UnknownModel(f"model {name!r} is not registered with the scheduler") from None

    def gpu(self, gpu_id: str) -> GpuState:
        return self.cluster.gpus[gpu_id]

    def gpus(self) -> Iterable[GpuState]:
        return self.cluster.gpus.values()

    # --- the request lifecycle ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Append an arriving request to the global queue (arrival order = submit order)."""
        never = never_fits(self.cluster, self.model(request.model))
        if never:
            raise ModelTooLarge(never)
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
        if not self.queue and not self.cluster.ready_local:
            return []  # nothing waits (after most completions): what the passes below would find
        decisions: list[Decision] = []
        if self.cluster.ready_local:
            for gpu_id in sorted(self.cluster.ready_local):
                state = self.cluster.gpus[gpu_id]
                while state.idle and state.local_queue:
                    started = start_parked(self.cluster, state, now)
                    decisions.append(started)
                    self._note_dispatch(started, now)
            self.cluster.ready_local.clear()
        if self.fast_path and len(self.queue) == 1:
            lone = self._place_lone(now)
            if lone is not None:
                decisions.append(lone)
                return decisions
        offered = list(self.cluster.idle)  # (order key, GPU id), in idle order
        while self.queue:
            self.cluster.refill.clear()
            for _, gpu_id in offered:
                if not self.queue:
                    break
                if self.cluster.gpus[gpu_id].idle:
                    for decision in Draft(self.cluster).fill(self.policy, gpu_id, now):
                        decisions.append(decision)
                        if isinstance(decision, Dispatch):
                            self._note_dispatch(decision, now)
            if not self.cluster.refill:
                break
            offered = sorted(
                (self.cluster.gpus[g].order_key, g) for g in self.cluster.refill if self.cluster.gpus[g].idle
            )
        return decisions

    def _place_lone(self, now: float) -> Decision | None:
        """The fast path of `schedule` when one request waits (after most arrivals): the passes
        below would offer it first to the first idle GPU, whose fill either places it (the
        queue is then empty and the passes end) or not. Where the policy can say without a draft
        which GPU that fill dispatches it to, or parks it on (`SchedulingPolicy.lone_target`; a
        busy GPU means a park), apply that step directly: the same decision and state as the
        fill's, without the draft, its journal and (for a dispatch) undo closures. None (nothing
        changed) where the full passes must decide."""
        idle = self.cluster.idle
        if not idle:
            return None
        queue = self.queue
        request = queue.head
        assert request is not None  # one request is queued
        target = self.policy.lone_target(self.cluster, request, idle[0][1], now)
        if target is None:
            return None
        self.cluster.refill.clear()  # as the first pass starts
        self.fast_path_decisions += 1
        if not self.cluster.gpus[target].idle:
            return park_now(self.cluster, request, target, now)
        decision = dispatch_now(self.cluster, request, target, now)
        self._note_dispatch(decision, now)
        return decision

    def _note_dispatch(self, decision: Dispatch, now: float) -> None:
        """A kept dispatch: the staged exit's clocks, and the policy, hear of it."""
        self._exit.dispatched(decision, now)
        self.policy.on_dispatch(decision, now)

    def release_idle(self, now: float, *, gpu_idle_s: float | None, host_idle_s: float | None) -> list[Release]:
        """EDAS's staged exit: a model unused on its GPU for `gpu_idle_s` leaves it (for its
        node's host tier when there is one), and one in a host tier for `host_idle_s` leaves that
        too (None: that stage is off). And the policy's swap-out (`releases_memory`): a model it
        names idle (`idle_models`) leaves every GPU that holds it unpinned, for the node's host
        tier; where the node keeps none it stays. Models in use (pinned) stay. The caller frees
        what each Release names. O(models cached), so callers ask at events, not per call."""
        return self._exit.release_idle(now, self.policy, gpu_idle_s=gpu_idle_s, host_idle_s=host_idle_s)

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
        cluster, model = self.cluster, request.model
        estimator, gpu_type = cluster.estimator, state.spec.gpu_type
        del cluster.placed_on[request_id]
        del self._seq_of[request_id]
        swapped_in = request_id in cluster.swapped_in
        if swapped_in:
            cluster.swapped_in.discard(request_id)
        if load_time_s is not None:
            if swapped_in:
                estimator.observe_swap_in(model, gpu_type, load_time_s)
            else:
                estimator.observe_load(model, gpu_type, load_time_s)
        if inference_time_s is not None:
            samples = request.batch_size if batch_size is None else batch_size
            estimator.observe_inference(model, gpu_type, samples, inference_time_s)
        _unpin_running(self.cluster, self._exit, state, request, now)
        cluster.free_slot(state, request_id)
        self.policy.on_finish(request, now, inference_time_s=inference_time_s)
        return request

    def on_lease_use(self, request_id: str, *, inference_time_s: float | None, batch_size: int) -> None:
        """A call ran in running request `request_id`'s slot under its lease (docs/hit-leases.md:
        the slot stays the request's until `on_complete`): the model is used there as by a hit
        (its recency, and its eviction policy's count), and its measured time refines the
        estimator as `on_complete`'s does (a model whose entry went with another call's failure
        there is not admitted again: the lease is the caller's to end). Raises KeyError (changing
        nothing) if the request is not running."""
        state, request = self._running(request_id)
        model, gpu_id = request.model, state.spec.gpu_id
        if request_id not in self.cluster.pin_dropped:
            self.cache.admit(gpu_id, model, self.model(model).memory_mb)  # resident and pinned: a hit
        if inference_time_s is not None:
            self.cluster.estimator.observe_inference(model, state.spec.gpu_type, batch_size, inference_time_s)

    def on_failure(
        self, request_id: str, now: float, *, drop_model: bool, requeue: bool, avoid_gpu: bool = False
    ) -> Request:
        """A dispatched request failed on its GPU, which is free again.

        `drop_model`: the model's worker is gone (it died or was killed), so its cache entry goes,
        and requests parked behind it for that model go back to the global queue. `requeue`: the
        request itself goes back to the global queue in arrival order (a retry); else it is done.
        `avoid_gpu`: the retry must run elsewhere (ignored when no other GPU could hold its model). Other
        requests running there are untouched (their node reports them); with `drop_model`, those
        of the same model no longer pin it, and their own `drop_model` failures drop nothing more.
        Raises KeyError (changing nothing) if the request is not running.
        """
        state, request = self._running(request_id)
        gpu_id = state.spec.gpu_id
        del self.cluster.placed_on[request_id]
        self.cluster.swapped_in.discard(request_id)
        # A request whose entry already went with a sibling's failure (one worker death, several
        # calls) drops nothing more: the model there now, if any, is a later admission's.
        if drop_model and request_id not in self.cluster.pin_dropped:
            stranded = [r for r in state.local_queue if r.model == request.model]
            for parked in stranded:
                state.local_queue.remove(parked)
                del self.cluster.placed_on[parked.request_id]
                self.queue.insert(parked, self._seq_of[parked.request_id])
                self.policy.on_requeue(parked, now, ran=False)
            state.local_work_s = sum(self.cluster.call_time_s(r, state) for r in state.local_queue)
            self.cluster.pin_dropped.update(
                other_id
                for other_id, other in state.running.items()
                if other.model == request.model and other_id != request_id
            )
            self.drop(gpu_id, request.model)
        else:
            _unpin_running(self.cluster, self._exit, state, request, now)
        if requeue:
            elsewhere = avoid_gpu and _fits_elsewhere(self.cluster, request.model, gpu_id)
            retry = dataclasses.replace(request, avoid_gpu=gpu_id) if elsewhere else request
            self.queue.insert(retry, self._seq_of[request_id])
        else:
            del self._seq_of[request_id]
        self.cluster.free_slot(state, request_id)
        self.policy.on_finish(request, now, inference_time_s=None)
        if requeue:
            self.policy.on_requeue(retry, now, ran=True)
        return request

    def drop(self, gpu_id: str, model: str) -> bool:
        """Forget `model`'s entry on `gpu_id` whatever its pins, and its idle clock (see `CacheManager.drop`)."""
        self._exit.forget(gpu_id, model)  # a later admission there is idle from then, not from before the drop
        return self.cache.drop(gpu_id, model)

    def cancel(self, request_id: str, now: float | None = None) -> Request | None:
        """Withdraw a request that has not started (its deadline passed): from the global queue or
        a local queue (its model, pinned there, idle from `now` if given: the staged exit's clock).
        Returns None if it is running or unknown (a running request is not stopped)."""
        if request_id in self.queue:
            del self._seq_of[request_id]
            self.policy.on_cancel(queued := self.queue.remove(request_id))
            return queued
        gpu_id = self.cluster.placed_on.get(request_id)
        if gpu_id is None:
            return None
        state = self.cluster.gpus[gpu_id]
        for parked in state.local_queue:
            if parked.request_id == request_id:
                state.local_queue.remove(parked)
                state.local_work_s = sum(self.cluster.call_time_s(r, state) for r in state.local_queue)
                self.cache.unpin(gpu_id, parked.model)
                if now is not None:
                    self._exit.used(gpu_id, parked.model, now)  # wanted until now: idle from now
                del self.cluster.placed_on[request_id], self._seq_of[request_id]
                if not state.idle:
                    self.cluster.advertise(state)  # it frees up sooner now
                self.policy.on_cancel(parked)
                return parked
        return None  # running: it will complete or fail on its own

    # --- applied outside a fill (tests, tools); reads of the committed state: ClusterReads ----
    def dispatch(self, request: Request, gpu_id: str, now: float) -> Dispatch:
        """Run a globally queued request in a free slot of `gpu_id` now, for good (admitting its
        model to the cache; the model must fit there now). A policy reserves it on its `Draft`."""
        return dispatch_now(self.cluster, request, gpu_id, now)

    def park(self, request: Request, gpu_id: str, now: float) -> Park:
        """Move a globally queued request to the local queue of busy `gpu_id`, for good (its model
        is cached there and stays pinned until the request runs). A policy reserves it on its `Draft`."""
        return park_now(self.cluster, request, gpu_id, now)

    # --- internals ------------------------------------------------------------------------
    def _running(self, request_id: str) -> tuple[GpuState, Request]:
        """The GPU a request runs on, and the request; KeyError if it is not running."""
        gpu_id = self.cluster.placed_on.get(request_id)
        state = None if gpu_id is None else self.cluster.gpus[gpu_id]
        request = None if state is None else state.running.get(request_id)
        if state is None or request is None:
            where = "anywhere" if gpu_id is None else f"on GPU {gpu_id!r} (it is parked there)"
            raise KeyError(f"request {request_id!r} is not running {where}")
        return state, request


def never_fits(cluster: ClusterState, spec: ModelSpec) -> str:
    """Why no GPU of `cluster` now could ever hold `spec` (of its type, if it requires one, and
    large enough), naming the model, its size and what the GPUs offer; "" if one could. O(1), or
    O(GPUs) for a model that requires a GPU type."""
    gpus = cluster.gpus.values()
    if spec.gpu_type is not None and not any(cluster.fits_spec(spec, state) for state in gpus):
        return (
            f"model {spec.name!r} needs a {spec.gpu_type} GPU with {spec.memory_mb} MB and the cluster has "
            f"none; GPU types here: {', '.join(sorted({s.spec.gpu_type for s in gpus})) or 'none'}"
        )
    if spec.memory_mb > cluster.cache.max_capacity_mb:
        return (
            f"model {spec.name!r} needs {spec.memory_mb} MB of GPU memory but the largest GPU "
            f"holds {cluster.cache.max_capacity_mb} MB; it can never run on this cluster"
        )
    return ""


def _unpin_running(
    cluster: ClusterState, staged_exit: StagedExit, state: GpuState, request: Request, now: float
) -> None:
    """A request that ran leaves its slot: its model is idle from `now` (the staged exit's clock),
    if nothing else runs it, whether the request completed or failed."""
    if request.request_id in cluster.pin_dropped:
        cluster.pin_dropped.discard(request.request_id)  # its pin went with the dropped entry
    else:
        cluster.cache.unpin(state.spec.gpu_id, request.model)
    if request.model in cluster.cache.models_on(state.spec.gpu_id):
        staged_exit.used(state.spec.gpu_id, request.model, now)


def _fits_elsewhere(cluster: ClusterState, model: str, gpu_id: str) -> bool:
    """Whether a GPU other than `gpu_id` could hold `model` (its size and GPU type): a retry
    avoids its GPU only then. (One that avoided the only GPU it fits was never placed, both
    GPUs idle, till its deadline; under `lb`, as the queue's head, it held every call behind.)"""
    spec = cluster.models.get(model)
    return spec is not None and any(
        other != gpu_id and cluster.fits_spec(spec, state) for other, state in cluster.gpus.items()
    )
