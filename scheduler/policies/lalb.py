"""`lalb` and `lalb-o3`: locality-aware load balancing (Algorithms 1 and 2 of the LALB paper)."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import TYPE_CHECKING, ClassVar

from gpufaas.types import Request
from scheduler.decisions import Dispatch, Park, Step
from scheduler.policies.base import (
    DEFAULT_MAX_NUM_SKIPS,
    PolicyConfig,
    SchedulingContext,
    SchedulingPolicy,
    checked_max_num_skips,
)

if TYPE_CHECKING:
    from scheduler.state import ClusterState


class Placement(enum.Enum):
    HERE = "here"  # dispatched to the idle GPU being filled (Algorithm 2 returns True)
    ELSEWHERE = "elsewhere"  # dispatched to another idle GPU, or parked on a busy one (False)
    NOWHERE = "nowhere"  # left queued: no idle GPU is large enough for the model (mixed memory sizes)


def locality_load_balance(
    ctx: SchedulingContext,
    gpu_id: str,
    request: Request,
    now: float,
    *,
    room_aware: bool = True,
    coldest_victim: bool = True,
    tier_aware: bool = True,
    interference_aware: bool = True,
) -> tuple[Placement, Dispatch | Park | None]:
    """Algorithm 2: place `request` given that idle `gpu_id` (one with a free slot) wants work.

    Model cached nowhere -> miss here. Cached on another idle GPU -> hit there. Cached on busy
    GPUs -> park on the one that frees up soonest if that beats loading the model here
    (waiting + inference < load + inference). Otherwise a miss that balances load: on an idle GPU
    with room for the model if there is one (this GPU first), so no warm model is evicted while
    another idle GPU has space; else (`coldest_victim`) on the idle GPU whose first victim is the
    least recently used model of those GPUs; else here; and if the model may not run here now
    (clusters of mixed memory sizes, models pinned by requests running here), on the first idle
    GPU it may, so that a younger request never takes the only GPU an older one could use.
    `room_aware=False` is Algorithm 2 to the letter (and ignores `coldest_victim`). With
    `tier_aware`, a miss first goes to an idle GPU whose node holds the model in host memory (a
    swap-in instead of a load), this GPU first, else on disk when this GPU's node would fetch it.
    With `interference_aware`, each of those choices takes a GPU whose shared host link carries no
    load in flight before one whose link does (Torpor: concurrent copies behind one PCIe switch
    share its bandwidth). Returns where the request went and the step reserved for it (None for NOWHERE).
    """
    avoid = request.avoid_gpu  # a retry after its worker died: never there again
    model = request.model
    quiet_at = now if interference_aware else None
    holders = ctx.cache.gpus_with(model)
    if gpu_id in holders and gpu_id != avoid and not ctx.worker_wait_s(model, gpu_id, now):
        return Placement.HERE, ctx.dispatch(request, gpu_id, now)
    if holders:
        placed = _place_with_holders(ctx, gpu_id, request, now=now, quiet_at=quiet_at)
        if placed is not None:
            return placed
    target = _miss_target(
        ctx, gpu_id, request, quiet_at, room_aware=room_aware, coldest_victim=coldest_victim, tier_aware=tier_aware
    )
    if target is None:
        return Placement.NOWHERE, None
    step = ctx.dispatch(request, target, now)
    return (Placement.HERE if target == gpu_id else Placement.ELSEWHERE), step


def _place_with_holders(
    ctx: SchedulingContext, gpu_id: str, request: Request, *, now: float, quiet_at: float | None
) -> tuple[Placement, Dispatch | Park] | None:
    """Algorithm 2 where GPUs hold the model: a hit on the best idle holder (or a new replica
    when its worker's wait is longer than a load), else a park on the busy holder that frees up
    soonest when that beats a load here; None when neither applies (a miss, then)."""
    avoid, model = request.avoid_gpu, request.model
    idle_holder = ctx.best_idle_holder(model, exclude=avoid)
    if idle_holder is not None:
        # With D > 1 an idle holder may be running calls of the model, which its worker
        # serves one at a time: when the wait for them is longer than a load, a new replica
        # serves the call sooner and spreads the model's load, where it evicts nothing
        # (here first); a replica that would throw out a warm model is not worth it.
        wait_s = ctx.worker_wait_s(model, idle_holder, now)
        # (Most waits are milliseconds and loads seconds: then no replica can win, and the
        # O(idle GPUs) search for one is skipped.)
        if wait_s and wait_s > ctx.least_load_time_s(model):
            replica = ctx.idle_for_replica(model, prefer=gpu_id, exclude=avoid, quiet_links_at=quiet_at)
            if replica is not None and wait_s > ctx.load_time_s(model, replica):
                placement = Placement.HERE if replica == gpu_id else Placement.ELSEWHERE
                return placement, ctx.dispatch(request, replica, now)
        placement = Placement.HERE if idle_holder == gpu_id else Placement.ELSEWHERE
        return placement, ctx.dispatch(request, idle_holder, now)
    soonest = ctx.soonest_busy_holder(model, now)
    if soonest is not None and soonest[0] != avoid:
        # A parked call waits for a slot there, and (D > 1) for the calls of its model ahead.
        wait_s = max(soonest[1], ctx.worker_wait_s(model, soonest[0], now))
        if wait_s < ctx.load_time_s(model, gpu_id):
            return Placement.ELSEWHERE, ctx.park(request, soonest[0], now)
    return None


def _miss_target(
    ctx: SchedulingContext,
    gpu_id: str,
    request: Request,
    quiet_at: float | None,
    *,
    room_aware: bool,
    coldest_victim: bool,
    tier_aware: bool,
) -> str | None:
    """Where Algorithm 2's miss goes; None if no idle GPU may run the model now."""
    avoid = request.avoid_gpu
    # The miss goes where it evicts nothing if an idle GPU has room (the paper misses on the GPU
    # being filled, which throws out a warm model while another idle GPU sits empty); else where
    # it evicts the coldest model; else here; else, on clusters of mixed memory sizes, on the
    # first idle GPU large enough.
    target = None
    if tier_aware:
        # A swap-in from a node's host memory costs a copy, not a load, and a package on a node's
        # disk needs no fetch: take an idle GPU there.
        target = ctx.idle_nearest_copy(request.model, prefer=gpu_id, exclude=avoid, quiet_links_at=quiet_at)
    if target is None and room_aware:
        target = ctx.idle_with_room(request.model, prefer=gpu_id, exclude=avoid, quiet_links_at=quiet_at)
        if target is None and coldest_victim:
            target = ctx.idle_with_coldest_victim(request.model, exclude=avoid, quiet_links_at=quiet_at)
    if target is None:
        here = gpu_id != avoid and ctx.fits(request.model, gpu_id)
        target = gpu_id if here else ctx.first_idle_fitting(request.model, exclude=avoid)
    return target


def hits_here(ctx: SchedulingContext, gpu_id: str, now: float) -> Collection[str]:
    """The models a call may hit on `gpu_id` straight away: those cached there, less (with
    D > 1) those with a call running there that is expected to end after `now`, whose worker
    would make it wait; their calls go through `locality_load_balance`, which weighs that wait
    against a free worker elsewhere or a new replica. O(1) while the GPU runs nothing (always,
    with one slot per GPU), else O(D)."""
    cached = ctx.cache.models_on(gpu_id)
    if not ctx.running_calls(gpu_id):
        return cached
    busy = ctx.models_busy(gpu_id, now)
    return set(cached) - busy if busy else cached


class LocalityAwarePolicy(SchedulingPolicy, name="lalb"):
    """Algorithm 1 for one idle GPU, with an out-of-order limit `max_num_skips`.

    1. Requests that have been passed over `max_num_skips` times may not be passed over again:
       from the head, in arrival order, each is a hit here if its model is cached here, else is
       placed by `locality_load_balance`, until one lands here.
    2. Otherwise the oldest queued request whose model is cached here is dispatched (a hit) ahead
       of older requests, each of which counts one skip.
    3. If no queued request's model is cached here, `locality_load_balance` in arrival order.

    Skip counts never grow from head to tail (the queue's invariant), so step 1 stops at the
    first request under the limit, and with `max_num_skips == 0` step 1 covers the whole queue:
    strict arrival order, which is `lalb`. Cost: O(models cached here) for step 2, plus O(1)
    per request placed (each request is placed once).

    `literal_visits=True` runs Algorithm 1 as printed instead (`_fill_literal`): O(queue) per fill.
    """

    out_of_order: ClassVar[bool] = False  # lalb dispatches in order: no request is passed over

    def __init__(
        self,
        max_num_skips: int | None = None,
        *,
        room_aware_misses: bool = True,
        coldest_victim_misses: bool = True,
        literal_visits: bool = False,
        tier_aware_misses: bool = True,
        interference_aware_loads: bool = True,
    ) -> None:
        if max_num_skips is None:
            max_num_skips = DEFAULT_MAX_NUM_SKIPS if self.out_of_order else 0
        self.max_num_skips = checked_max_num_skips(max_num_skips)
        self.room_aware_misses = room_aware_misses
        self.coldest_victim_misses = coldest_victim_misses
        self.literal_visits = literal_visits
        self.tier_aware_misses = tier_aware_misses
        self.interference_aware_loads = interference_aware_loads
        # `lone_target` answers for this class's `fill` only: a subclass may fill otherwise.
        self._lone_fill = type(self) in (LocalityAwarePolicy, OutOfOrderLocalityAwarePolicy)

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls(
            config.max_num_skips if cls.out_of_order else 0,
            room_aware_misses=config.room_aware_misses,
            coldest_victim_misses=config.coldest_victim_misses,
            literal_visits=config.literal_visits,
            tier_aware_misses=config.tier_aware_misses,
            interference_aware_loads=config.interference_aware_loads,
        )

    def _balance(
        self, ctx: SchedulingContext, gpu_id: str, request: Request, now: float
    ) -> tuple[Placement, Dispatch | Park | None]:
        return locality_load_balance(
            ctx,
            gpu_id,
            request,
            now,
            room_aware=self.room_aware_misses,
            coldest_victim=self.coldest_victim_misses,
            tier_aware=self.tier_aware_misses,
            interference_aware=self.interference_aware_loads,
        )

    def lone_target(self, cluster: ClusterState, request: Request, gpu_id: str, now: float) -> str | None:
        """What `fill` does with a lone queued request (see `SchedulingPolicy.lone_target`), where
        it is a hit on a free worker or a park: here, when the model is cached here and no call of
        it runs here past `now` (`hits_here`; in `lalb-o3` the head's pass-over then counts no
        skip, there being no request ahead), else on the best idle holder (`best_idle_holder`, but
        `avoid_gpu`) when its worker of the model is free or busy for no longer than any load
        takes (`least_load_time_s`), `_place_with_holders`' choice when no replica can win; with no
        idle holder, a park on the busy holder that frees up soonest when that beats a load here,
        as `_place_with_holders` decides it. None for the rest: a worker busy for longer (a
        replica may win), a miss (no holder, or a park that does not pay), and
        `literal_visits` (its scan visits the request first). `worker_wait_s` is 0 exactly when
        `models_busy` leaves the model out: both compare the last expected finish of its calls
        there with `now`."""
        if self.literal_visits or not self._lone_fill:
            return None
        model, avoid = request.model, request.avoid_gpu
        cache = cluster.cache
        if gpu_id != avoid and model in cache.models_on(gpu_id) and not cluster.worker_wait_s(model, gpu_id, now):
            return gpu_id
        if not cache.gpus_with(model):
            return None  # a miss: the fill asks the index nothing then, and neither do we
        holder = cluster.best_idle_holder(model, exclude=avoid)
        if holder is not None:
            wait_s = cluster.worker_wait_s(model, holder, now)
            return holder if not wait_s or wait_s <= cluster.least_load_time_s(model) else None
        soonest = cluster.soonest_busy_holder(model, now)
        if soonest is None or soonest[0] == avoid:
            return None
        wait_s = max(soonest[1], cluster.worker_wait_s(model, soonest[0], now))
        return soonest[0] if wait_s < cluster.load_time_s(model, gpu_id) else None

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        if self.literal_visits:
            return self._fill_literal(ctx, gpu_id, now)
        queue = ctx.queue
        cached_here = hits_here(ctx, gpu_id, now)
        plan: list[Step] = []
        # Requests at the limit that no idle GPU can hold: the dispatch below goes to a GPU they
        # cannot use, so it does not pass them over.
        waiting_for_a_fit: list[str] = []
        for request, num_skips in queue.walk():
            if num_skips < self.max_num_skips:
                break
            if request.model in cached_here and request.avoid_gpu != gpu_id:
                plan.append(ctx.dispatch(request, gpu_id, now))
                return plan
            placement, step = self._balance(ctx, gpu_id, request, now)
            if step is not None:
                plan.append(step)
            if placement is Placement.HERE:
                return plan
            if placement is Placement.NOWHERE:
                waiting_for_a_fit.append(request.request_id)
        else:
            return plan  # every queued request was placed (or waits for a GPU large enough)
        candidate = queue.oldest_of(cached_here)
        if candidate is not None and candidate.avoid_gpu != gpu_id:
            plan.append(ctx.pass_over(candidate.request_id, exempt=waiting_for_a_fit))
            plan.append(ctx.dispatch(candidate, gpu_id, now))
            return plan
        return plan + self._balance_in_order(ctx, gpu_id, now)

    def _balance_in_order(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        """Algorithm 2 for each queued request in arrival order until one lands on `gpu_id`."""
        plan: list[Step] = []
        for request, _ in ctx.queue.walk():
            placement, step = self._balance(ctx, gpu_id, request, now)
            if step is not None:
                plan.append(step)
            if placement is Placement.HERE:
                break
        return plan

    def _fill_literal(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        """Algorithm 1, lines 6-21, as printed: scan in arrival order; a request whose model is
        cached here is dispatched (a hit); one whose visits are higher than the limit is placed
        by Algorithm 2 (the scan ends if it landed here); any other is visited (+1) and passed.
        If the scan found no hit, Algorithm 2 places requests in arrival order until one lands
        here. So even with limit 0 a request may be passed over once."""
        cached_here = hits_here(ctx, gpu_id, now)
        plan: list[Step] = []
        for request, visits in ctx.queue.walk():
            if request.model in cached_here and request.avoid_gpu != gpu_id:
                plan.append(ctx.dispatch(request, gpu_id, now))
                return plan
            if visits > self.max_num_skips:
                placement, step = self._balance(ctx, gpu_id, request, now)
                if step is not None:
                    plan.append(step)
                if placement is Placement.HERE:
                    return plan
            else:
                plan.append(ctx.visit(request.request_id))
        return plan + self._balance_in_order(ctx, gpu_id, now)


class OutOfOrderLocalityAwarePolicy(LocalityAwarePolicy, name="lalb-o3"):
    """`lalb` with out-of-order dispatch: a request may be passed over up to `max_num_skips`
    times (default 25) in favour of younger requests whose model is cached on an idle GPU."""

    out_of_order = True
