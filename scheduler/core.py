"""The scheduler: global queue, per-GPU local queues and state, driving a policy and the cache."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence

from cache_manager import Admission, CacheManager, Tier
from gpufaas.errors import ModelTooLarge, UnknownModel
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler.decisions import Decision, Dispatch, Park, PassOver, Release, Step, Visit
from scheduler.estimator import Estimator
from scheduler.placement import PlacementPieces
from scheduler.policies.base import SchedulingPolicy
from scheduler.state import ClusterState, GpuState

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


class Scheduler(PlacementPieces):
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
        self.cluster = ClusterState(
            cache if cache is not None else CacheManager(), estimator if estimator is not None else Estimator()
        )
        self.queue = self.cluster.queue
        self._seq = itertools.count()
        self._seq_of: dict[str, int] = {}  # every request queued, parked or running
        # When each cached model was last used on its GPU, and when each host-tier model entered
        # its tier: the clocks of the staged exit (`release_idle`).
        self._last_used_s: dict[tuple[str, str], float] = {}
        self._host_since_s: dict[tuple[str, str], float] = {}
        self._journal: _Journal | None = None  # open while a policy fills a GPU
        self._spare_journal = _Journal()  # the one journal, reused fill after fill

    @property
    def cache(self) -> CacheManager:
        return self.cluster.cache

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
        state = GpuState(spec)
        self.cluster.gpus[spec.gpu_id] = state
        self.cache.add_gpu(spec.gpu_id, spec.memory_mb, node=spec.node)
        self.cluster.enter_idle(state)

    def remove_gpu(self, gpu_id: str, now: float = 0.0) -> list[Request]:
        """Take a GPU out (its node left): its running and parked requests go back to the global
        queue in arrival order, its cache entries are dropped. Returns the requeued requests. The
        policy hears each running one end (`on_finish`, failed) and each returned one requeued
        (`on_requeue`), as of `now`."""
        state = self.cluster.gpus.pop(gpu_id)
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
        state = self.cluster.gpus[gpu_id]
        was_idle = state.idle
        state.spec = dataclasses.replace(state.spec, slots=slots)
        state.update_busy_until()
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
        """Declare (or re-declare, e.g. with a measured size) a model's peak GPU occupancy."""
        self.cluster.models[spec.name] = spec

    def observe_memory(self, model: str, gpu_id: str, peak_memory_mb: int) -> bool:
        """A model's measured peak GPU memory replaces its declared size: for every later
        admission, and for its entry on `gpu_id` now if that needs no eviction. Returns whether
        the size changed."""
        spec = self.cluster.models.get(model)
        if spec is None or peak_memory_mb <= 0 or peak_memory_mb == spec.memory_mb:
            return False
        self.cluster.models[model] = ModelSpec(model, peak_memory_mb, spec.gpu_type, spec.labels)
        if gpu_id in self.cluster.gpus and model in self.cache.gpu(gpu_id):
            self.cache.gpu(gpu_id).resize(model, peak_memory_mb)
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
        spec = self.model(request.model)
        if spec.gpu_type is not None and not any(
            self.cluster.fits_spec(spec, state) for state in self.cluster.gpus.values()
        ):
            raise ModelTooLarge(
                f"model {spec.name!r} needs a {spec.gpu_type} GPU with {spec.memory_mb} MB and the cluster has "
                f"none; GPU types here: {', '.join(sorted({s.spec.gpu_type for s in self.gpus()})) or 'none'}"
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
        for gpu_id in sorted(self.cluster.ready_local):
            state = self.cluster.gpus[gpu_id]
            while state.idle and state.local_queue:
                started = self._dispatch_local(state, now)
                decisions.append(started)
                self._note_dispatch(started, now)
        self.cluster.ready_local.clear()
        offered = list(self.cluster.idle)  # (order key, GPU id), in idle order
        while self.queue:
            self.cluster.refill.clear()
            for _, gpu_id in offered:
                if not self.queue:
                    break
                if self.cluster.gpus[gpu_id].idle:
                    for decision in self._fill(gpu_id, now):
                        decisions.append(decision)
                        if isinstance(decision, Dispatch):
                            self._note_dispatch(decision, now)
            if not self.cluster.refill:
                break
            offered = sorted(
                (self.cluster.gpus[g].order_key, g) for g in self.cluster.refill if self.cluster.gpus[g].idle
            )
        return decisions

    def _note_dispatch(self, decision: Dispatch, now: float) -> None:
        """A kept dispatch: its model was used now; what it evicted entered the host tier now."""
        self._last_used_s[(decision.gpu_id, decision.request.model)] = now
        node = self.cluster.gpus[decision.gpu_id].spec.node
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
                    node = self.cluster.gpus[gpu_id].spec.node
                    if node is None or self.cache.host(node) is None or self.cache.gpu(gpu_id).is_pinned(model):
                        continue
                    releases.append(self._release_from_gpu(gpu_id, model, now))
        if gpu_idle_s is not None:
            for gpu_id in self.cluster.gpus:
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
            for node in {state.spec.node for state in self.cluster.gpus.values() if state.spec.node is not None}:
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
        node = self.cluster.gpus[gpu_id].spec.node
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
            if step.gpu_id not in self.cluster.gpus or not self.cluster.gpus[step.gpu_id].idle:
                raise PolicyError(f"{type(self.policy).__name__}: its plan dispatches to {step.gpu_id!r}, not idle")
            if not self.fits(step.request.model, step.gpu_id):
                raise PolicyError(
                    f"{type(self.policy).__name__}: its plan runs {step.request.model!r} on {step.gpu_id!r}, "
                    "where it does not fit now"
                )
            return self.dispatch(step.request, step.gpu_id, now)
        if isinstance(step, Park):
            state = self.cluster.gpus.get(step.gpu_id)
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
        del self.cluster.placed_on[request_id]
        del self._seq_of[request_id]
        gpu_type = state.spec.gpu_type
        swapped_in = request_id in self.cluster.swapped_in
        self.cluster.swapped_in.discard(request_id)
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
        self.cluster.free_slot(state, request_id)
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
            self.cache.drop(gpu_id, request.model)
            self._last_used_s.pop((gpu_id, request.model), None)
        else:
            self._unpin_running(state, request)
        if requeue:
            retry = (
                dataclasses.replace(request, avoid_gpu=gpu_id) if avoid_gpu and len(self.cluster.gpus) > 1 else request
            )
            self.queue.insert(retry, self._seq_of[request_id])
        else:
            del self._seq_of[request_id]
        self.cluster.free_slot(state, request_id)
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
        gpu_id = self.cluster.placed_on.get(request_id)
        if gpu_id is None:
            return None
        state = self.cluster.gpus[gpu_id]
        for parked in state.local_queue:
            if parked.request_id == request_id:
                state.local_queue.remove(parked)
                state.local_work_s = max(0.0, state.local_work_s - self.cluster.call_time_s(parked, state))
                self.cache.unpin(gpu_id, parked.model)
                del self.cluster.placed_on[request_id]
                del self._seq_of[request_id]
                if not state.idle:
                    self.cluster.advertise(state)  # it frees up sooner now
                return parked
        return None  # running: it will complete or fail on its own

    # --- what policies may ask (SchedulingContext; the idle-GPU choices from PlacementPieces) ------
    def running_calls(self, gpu_id: str) -> int:
        return self.cluster.running_calls(gpu_id)

    def models_busy(self, gpu_id: str, now: float) -> set[str]:
        return self.cluster.models_busy(gpu_id, now)

    def worker_wait_s(self, model: str, gpu_id: str, now: float) -> float:
        return self.cluster.worker_wait_s(model, gpu_id, now)

    def soonest_busy_holder(self, model: str, now: float) -> tuple[str, float] | None:
        return self.cluster.soonest_busy_holder(model, now)

    def estimated_wait_s(self, gpu_id: str, now: float) -> float:
        return self.cluster.estimated_wait_s(gpu_id, now)

    def load_time_s(self, model: str, gpu_id: str) -> float:
        return self.cluster.load_time_s(model, gpu_id)

    def copies_overlapping(self, model: str, gpu_id: str, now: float) -> int:
        return self.cluster.copies_overlapping(model, gpu_id, now)

    def inference_time_s(self, model: str, gpu_id: str, batch_size: int) -> float:
        return self.cluster.inference_time_s(model, gpu_id, batch_size)

    def fits(self, model: str, gpu_id: str) -> bool:
        return self.cluster.fits(model, gpu_id)

    def dispatch(self, request: Request, gpu_id: str, now: float) -> Dispatch:
        """Run a globally queued request in a free slot of `gpu_id` (admitting its model to the
        cache; the model must fit there now, see `fits`). Reserved while a policy fills."""
        state = self.cluster.gpus[gpu_id]
        journal = self._journal
        taken = self.queue.take(request.request_id)
        if journal is None:
            try:
                return self._start(request, state, now, pinned=False)
            except BaseException:
                self.queue.untake(taken)
                raise
        busy_until_before, refilled_before = state.busy_until_s, gpu_id in self.cluster.refill
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
            del self.cluster.placed_on[request_id]
            self.cluster.swapped_in.discard(request_id)
            self.cluster.links.end(state.spec.link, request_id)
            state.busy_until_s = busy_until_before
            state.version += 1  # what it advertised while full no longer holds
            if left_idle:
                self.cluster.enter_idle(state)
            if not refilled_before:
                self.cluster.refill.discard(gpu_id)
            self.cache.unpin(gpu_id, request.model)
            cache_undo()
            self.queue.untake(taken)

        journal.record(decision, undo)
        return decision

    def park(self, request: Request, gpu_id: str, now: float) -> Park:
        """Move a globally queued request to the local queue of `gpu_id`, a GPU with no free slot
        (its model is cached there and stays pinned until the request runs). Reserved while a
        policy fills."""
        state = self.cluster.gpus[gpu_id]
        work_before = state.local_work_s
        wait_s = self.estimated_wait_s(gpu_id, now)
        taken = self.queue.take(request.request_id)
        self.cache.pin(gpu_id, request.model)
        state.local_queue.append(request)
        state.local_work_s += self.cluster.call_time_s(request, state)
        self.cluster.advertise(state)
        self.cluster.placed_on[request.request_id] = gpu_id
        decision = Park(request, gpu_id, wait_s)
        if self._journal is not None:
            request_id = request.request_id

            def undo() -> None:
                state.local_queue.pop()
                state.local_work_s = work_before
                del self.cluster.placed_on[request_id]
                self.cache.unpin(gpu_id, request.model)
                self.cluster.advertise(state)  # busy, and free when it was before the park
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
        self.cluster.dispatched_ahead += ahead
        step = PassOver(request_id, tuple(exempt))
        if self._journal is not None:

            def undo() -> None:
                self.queue.unpass(request_id, exempt=exempt)
                self.cluster.dispatched_ahead -= ahead

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
        state.local_work_s = max(0.0, state.local_work_s - self.cluster.call_time_s(request, state))
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
        return self.cluster.models[request.model]

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
            self.cluster.swapped_in.add(request.request_id)
        else:
            load_s = self.estimator.load_time_s(spec.name, state.spec.gpu_type, spec.memory_mb)
            if self.cache.tier(spec.name, gpu_id) is Tier.REMOTE:
                load_s += self.estimator.fetch_time_s(spec.memory_mb)
        link = state.spec.link
        if load_s and link is not None:
            # The copy shares the link with the loads in flight there (an equal share each).
            transfer_s = self.estimator.transfer_time_s(spec.memory_mb)
            load_s += self.cluster.links.overlapping(link, now + load_s - transfer_s, now + load_s, now) * transfer_s
            self.cluster.links.add(link, request.request_id, now + load_s - transfer_s, now + load_s)
        inference_s = self.cluster.call_time_s(request, state)
        # Behind the calls of its model running there (they share a worker), or its load.
        start_s = max(now + load_s, self.cluster.worker_busy_until_s(spec.name, state)) if running else now + load_s
        running[request.request_id] = request
        state.expected_finish_s[request.request_id] = start_s + inference_s
        if len(running) < slots:
            self.cluster.refill.add(gpu_id)
        else:
            state.update_busy_until()
            self.cluster.leave_idle(state)
            self.cluster.advertise(state)
        self.cluster.placed_on[request.request_id] = gpu_id
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
        gpu_id = self.cluster.placed_on.get(request_id)
        state = None if gpu_id is None else self.cluster.gpus[gpu_id]
        request = None if state is None else state.running.get(request_id)
        if state is None or request is None:
            where = "anywhere" if gpu_id is None else f"on GPU {gpu_id!r} (it is parked there)"
            raise KeyError(f"request {request_id!r} is not running {where}")
        return state, request

    def _unpin_running(self, state: GpuState, request: Request) -> None:
        if request.request_id in self.cluster.pin_dropped:
            self.cluster.pin_dropped.discard(request.request_id)  # its pin went with the dropped entry
        else:
            self.cache.unpin(state.spec.gpu_id, request.model)
