"""The steps that place a request on committed state, each reserved: applied, with the function that
takes it back (Kubernetes' Reserve and Unreserve), which a `Draft` journals and may run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache_manager import Admission, Tier
from gpufaas.types import ModelSpec, Request
from scheduler.decisions import Dispatch, Park, PassOver, Visit
from scheduler.state import ClusterState, GpuState

Unreserve = Callable[[], None]
"""Takes one reservation back exactly; those of one fill run last-in first-out."""


def reserve_dispatch(cluster: ClusterState, request: Request, gpu_id: str, now: float) -> tuple[Dispatch, Unreserve]:
    """Run a globally queued request in a free slot of `gpu_id` (admitting its model to the cache
    and pinning it; the model must fit there now, see `ClusterState.fits`). Raises, changing
    nothing, if it cannot."""
    state = cluster.gpus[gpu_id]
    queue, cache = cluster.queue, cluster.cache
    taken = queue.take(request.request_id)
    busy_until_before, refilled_before = state.busy_until_s, gpu_id in cluster.refill
    try:
        spec = _check_slot(cluster, request, state)
        false_miss = _false_miss(cluster, spec.name, gpu_id)
        admission, cache_undo = cache.admit_undoable(gpu_id, spec.name, spec.memory_mb)
        cache.pin(gpu_id, spec.name)
        decision = _occupy(cluster, request, state, spec, admission=admission, false_miss=false_miss, now=now)
    except BaseException:
        queue.untake(taken)
        raise
    left_idle = not state.idle
    request_id = request.request_id

    def unreserve() -> None:
        state.stop(request_id)
        del cluster.placed_on[request_id]
        cluster.swapped_in.discard(request_id)
        cluster.links.end(state.spec.link, request_id)
        state.busy_until_s = busy_until_before
        state.version += 1  # what it advertised while full no longer holds
        if left_idle:
            cluster.enter_idle(state)
        cluster.reindex(state)  # before the cache's undo, which re-adds its victims to the index
        if not refilled_before:
            cluster.refill.discard(gpu_id)
        cache.unpin(gpu_id, request.model)
        cache_undo()
        queue.untake(taken)

    return decision, unreserve


def reserve_park(cluster: ClusterState, request: Request, gpu_id: str, now: float) -> tuple[Park, Unreserve]:
    """Move a globally queued request to the local queue of `gpu_id`, a GPU with no free slot (its
    model is cached there and stays pinned until the request runs)."""
    state = cluster.gpus[gpu_id]
    queue, cache = cluster.queue, cluster.cache
    work_before = state.local_work_s
    wait_s = cluster.estimated_wait_s(gpu_id, now)
    taken = queue.take(request.request_id)
    _enter_local_queue(cluster, request, state)
    request_id = request.request_id

    def unreserve() -> None:
        state.local_queue.pop()
        state.local_work_s = work_before
        del cluster.placed_on[request_id]
        cache.unpin(gpu_id, request.model)
        cluster.advertise(state)  # busy, and free when it was before the park
        queue.untake(taken)

    return Park(request, gpu_id, wait_s), unreserve


def park_now(cluster: ClusterState, request: Request, gpu_id: str, now: float) -> Park:
    """`reserve_park` applied for good, with nothing kept to take it back (neither the queue's
    `Taken` nor the undo closure): the same state and the same `Park`. For the scheduler's fast
    path (`Scheduler.schedule`) and for `Scheduler.park`."""
    state = cluster.gpus[gpu_id]
    wait_s = cluster.estimated_wait_s(gpu_id, now)
    cluster.queue.remove(request.request_id)
    _enter_local_queue(cluster, request, state)
    return Park(request, gpu_id, wait_s)


def _enter_local_queue(cluster: ClusterState, request: Request, state: GpuState) -> None:
    """A request just out of the global queue waits in `state`'s local queue, its model pinned there."""
    cluster.cache.pin(state.spec.gpu_id, request.model)
    state.local_queue.append(request)
    state.local_work_s += cluster.call_time_s(request, state)
    cluster.advertise(state)
    cluster.placed_on[request.request_id] = state.spec.gpu_id


def reserve_pass_over(cluster: ClusterState, request_id: str, exempt: Sequence[str] = ()) -> tuple[PassOver, Unreserve]:
    """Count a skip for every request queued ahead of `request_id` but `exempt` (see
    `GlobalQueue.pass_over`); one more out-of-order dispatch if it is not the head."""
    queue = cluster.queue
    head = queue.head
    ahead = int(head is not None and head.request_id != request_id)
    queue.pass_over(request_id, exempt=exempt)
    cluster.dispatched_ahead += ahead

    def unreserve() -> None:
        queue.unpass(request_id, exempt=exempt)
        cluster.dispatched_ahead -= ahead

    return PassOver(request_id, tuple(exempt)), unreserve


def reserve_visit(cluster: ClusterState, request_id: str) -> tuple[Visit, Unreserve]:
    """Count one visit for one queued request (Algorithm 1 read literally)."""
    queue = cluster.queue
    queue.visit(request_id)
    return Visit(request_id), lambda: queue.unvisit(request_id)


def start_parked(cluster: ClusterState, state: GpuState, now: float) -> Dispatch:
    """The head of `state`'s local queue takes a free slot (its model, pinned there since it was
    parked, is admitted again). Applied for good: a parked request is the scheduler's, not a plan's."""
    request = state.local_queue.popleft()
    state.local_work_s = max(0.0, state.local_work_s - cluster.call_time_s(request, state))
    if not state.local_queue:
        state.local_work_s = 0.0  # no drift from float sums
    spec = _check_slot(cluster, request, state)
    false_miss = _false_miss(cluster, spec.name, state.spec.gpu_id)
    admission = cluster.cache.admit(state.spec.gpu_id, spec.name, spec.memory_mb)
    return _occupy(cluster, request, state, spec, admission=admission, false_miss=false_miss, now=now)


def dispatch_now(cluster: ClusterState, request: Request, gpu_id: str, now: float) -> Dispatch:
    """`reserve_dispatch` applied for good, with nothing kept to take it back: the same state
    and the same `Dispatch` (the cache's `admit` is `admit_undoable` without its undo), at the
    cost of neither the queue's `Taken` nor the undo closures. For the scheduler's fast path
    (`Scheduler.schedule`) and for `Scheduler.dispatch`. Raises, changing nothing, if it cannot."""
    state = cluster.gpus[gpu_id]
    if request.request_id not in cluster.queue:
        raise KeyError(request.request_id)
    spec = _check_slot(cluster, request, state)
    false_miss = _false_miss(cluster, spec.name, gpu_id)
    cache = cluster.cache
    admission = cache.admit(gpu_id, spec.name, spec.memory_mb)  # raises changing nothing
    cache.pin(gpu_id, spec.name)
    cluster.queue.remove(request.request_id)
    return _occupy(cluster, request, state, spec, admission=admission, false_miss=false_miss, now=now)


def _false_miss(cluster: ClusterState, model: str, gpu_id: str) -> bool:
    """Whether a dispatch of `model` to `gpu_id` misses although another GPU holds it."""
    holders = cluster.cache.gpus_with(model)
    return gpu_id not in holders and len(holders) > 0


def _check_slot(cluster: ClusterState, request: Request, state: GpuState) -> ModelSpec:
    if len(state.running) >= state.spec.slots:
        raise RuntimeError(
            f"GPU {state.spec.gpu_id!r} has no free slot ({len(state.running)} running, {state.spec.slots} "
            f"slots); cannot dispatch {request.request_id!r}"
        )
    return cluster.models[request.model]


def _occupy(
    cluster: ClusterState,
    request: Request,
    state: GpuState,
    spec: ModelSpec,
    *,
    admission: Admission,
    false_miss: bool,
    now: float,
) -> Dispatch:
    """The request takes a slot of `state`, its model admitted: estimates, idle list, adverts."""
    estimator, gpu = cluster.estimator, state.spec
    gpu_id, slots = gpu.gpu_id, gpu.slots
    running = state.running
    if admission.hit:
        load_s = 0.0
    elif admission.from_host or admission.from_pool:
        load_s = estimator.swap_in_time_s(spec.name, gpu.gpu_type, spec.memory_mb)
        cluster.swapped_in.add(request.request_id)
    else:
        load_s = estimator.load_time_s(spec.name, gpu.gpu_type, spec.memory_mb)
        if cluster.cache.tier(spec.name, gpu_id) is Tier.REMOTE:
            load_s += estimator.fetch_time_s(spec.memory_mb)
    link = gpu.link
    if load_s and link is not None:
        # The copy shares the link with the loads in flight there (an equal share each).
        transfer_s = estimator.transfer_time_s(spec.memory_mb)
        load_s += cluster.links.overlapping(link, now + load_s - transfer_s, now + load_s, now) * transfer_s
        cluster.links.add(link, request.request_id, now + load_s - transfer_s, now + load_s)
    inference_s = cluster.call_time_s(request, state)
    # Behind the calls of its model running there (they share a worker), or its load.
    start_s = max(now + load_s, cluster.worker_busy_until_s(spec.name, state)) if running else now + load_s
    state.start(request, start_s + inference_s)
    if len(running) < slots:
        cluster.refill.add(gpu_id)
    else:
        state.update_busy_until()
        cluster.leave_idle(state)
        cluster.advertise(state)
    cluster.reindex(state, grew=True)
    cluster.placed_on[request.request_id] = gpu_id
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
