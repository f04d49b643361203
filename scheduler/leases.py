"""The rules of hit leases (docs/hit-leases.md), shared by the call book and the simulator."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from scheduler.core import Scheduler
from scheduler.state import GpuState


def may_lease(scheduler: Scheduler, now: float, waited_at: float, lease_s: float) -> bool:
    """Whether hits dispatched now, while the global queue is empty, may lease their slots at all:
    leases are on (`lease_s` > 0), no call has waited in the global queue since `waited_at` for
    `lease_s` (a load that queues calls now and then would have its leases ended each time, and
    every gateway ask again), and some GPU has a free slot. The callers set `waited_at` for a wait
    on running calls only (a lease that a call runs under is one): a wait that finds idle leases
    ends those in its way (`leases_to_end`), and is over once their slots are free if they were
    what held it up (on a memory-pressed cluster, a miss whose eviction candidates were leased: it
    must not keep leases back from a load that never queues on its own)."""
    return lease_s > 0 and now - waited_at >= lease_s and bool(scheduler.cluster.idle)


def may_lease_on(state: GpuState, now: float, parked_at: float, lease_s: float) -> bool:
    """Whether the slot of a hit just dispatched on `state` may be leased (`may_lease` holding): no
    call is parked there, nor was since `parked_at` for `lease_s` (it would wait behind the
    lease), and a slot stays free there, so that a call of another model on that GPU is not
    parked behind idle leases (a GPU of one slot may be leased: `may_lease` found a free slot on
    another GPU)."""
    if state.local_queue or now - parked_at < lease_s:
        return False
    return state.free_slots > 0 or state.spec.slots == 1


def leases_to_end(scheduler: Scheduler, leased: Mapping[str, Sequence[tuple[str, str]]]) -> list[str] | None:
    """Which leases to end for the call at the head of the global queue, where none is ending yet:
    `leased` maps GPUs to their leases, (lease id, model). On a memory-pressed cluster that call
    is a miss whose eviction candidates are leased: ending every lease of the cluster for it would
    have each of their gateways ask for its next call again. So: the fewest leases, least recently
    used first, whose models (pinned by their lease alone) make room for its model on one GPU with
    a free slot (and that it may run on). None where no GPU is so (every slot runs a call, or a
    GPU has room for it already: it waits for something else): then every lease ends."""
    request = scheduler.queue.head
    if request is None or request.model not in scheduler.cluster.models:
        return None
    spec = scheduler.model(request.model)
    memory_mb = spec.memory_mb
    best: list[str] | None = None
    for gpu_id, leases in leased.items():
        state = scheduler.gpu(gpu_id)
        cache = scheduler.cache.gpu(gpu_id)
        if not state.free_slots or gpu_id == request.avoid_gpu or not scheduler.cluster.fits_spec(spec, state):
            continue
        if cache.can_admit(request.model, memory_mb):
            return None
        running = Counter(r.model for r in state.running.values())
        lease_of = {model: lease_id for lease_id, model in leases if running[model] == 1}
        lacking_mb = memory_mb - (cache.capacity_mb - cache.pinned_mb)
        chosen: list[str] = []
        for model in reversed(cache.lru_list()):  # least recently used first
            if model in lease_of and lacking_mb > 0:
                chosen.append(lease_of[model])
                lacking_mb -= cache.item(model).memory_mb
        if lacking_mb <= 0 and (best is None or len(chosen) < len(best)):
            best = chosen
    return best


def running_seen(scheduler: Scheduler, idle_leases: Iterable[str]) -> dict[str, tuple[int, int]]:
    """What adaptive D observes (`AdaptiveSlots.observe`): per GPU, (calls running on it, its D).
    `idle_leases` names the GPU of each leased slot whose own call has ended: such a slot stays a
    running request in the scheduler's state, but the calls under its lease start unseen by the
    scheduler (the node admits them), so it counts as idle here, in the call book and the
    simulator alike. (Counted as running, one idle lease read as a GPU busy all the time and
    took its D down to 1.)"""
    idle = Counter(idle_leases)
    return {g.spec.gpu_id: (len(g.running) - idle[g.spec.gpu_id], g.spec.slots) for g in scheduler.gpus()}
