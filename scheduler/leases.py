"""The rules of hit leases (docs/hit-leases.md), shared by the call book and the simulator."""

from __future__ import annotations

from scheduler.core import Scheduler
from scheduler.state import GpuState


def may_lease(scheduler: Scheduler, now: float, waited_at: float, lease_s: float) -> bool:
    """Whether hits dispatched now, while the global queue is empty, may lease their slots at all:
    leases are on (`lease_s` > 0), no call has waited in the global queue since `waited_at` for
    `lease_s` (a load that queues calls now and then would have its leases ended each time, and
    every gateway ask again), and some GPU has a free slot. The callers set `waited_at` for a wait
    on running calls only (a lease that a call runs under is one): a wait that finds idle leases
    ends them all, and is over once their slots are free if they were what held it up (on a
    memory-pressed cluster, a miss whose eviction candidates were leased: it must not keep leases
    back from a load that never queues on its own)."""
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
