"""`park_now`, a park applied for good (the fast path's, `Scheduler.park`): the same `Park` and the
same scheduler state as `reserve_park`, whose undo it does without."""

from __future__ import annotations

from scheduler import Scheduler
from scheduler.reservations import park_now, reserve_park
from tests.builders import cache_on, make_request, make_scheduler, run_on

NOW_S = 0.25


def with_a_busy_holder() -> tuple[Scheduler, list[str]]:
    """D = 1: A runs on g0, which holds A and B; three requests queue (A, B, A). Returns the
    scheduler and the queued requests' ids."""
    scheduler = make_scheduler("lalb", gpus=2)
    cache_on(scheduler, "g0", "B", "A")
    run_on(scheduler, "g0", "A")
    queued = [make_request(model, NOW_S, request_id=f"q{index}") for index, model in enumerate("ABA")]
    for request in queued:
        scheduler.submit(request)
    return scheduler, [request.request_id for request in queued]


def standing(scheduler: Scheduler, queued: list[str]) -> dict[str, object]:
    """What a park may change: the queue and its skip counts, g0's local queue, work, version and
    pins, where requests are placed, and the busy holder each model's heap names."""
    cluster, g0 = scheduler.cluster, scheduler.gpu("g0")
    return {
        "queue": [(r.request_id, cluster.queue.num_skips(r.request_id)) for r in cluster.queue],
        "local": [r.request_id for r in g0.local_queue],
        "local_work_s": g0.local_work_s,
        "version": g0.version,
        "pinned_mb": scheduler.cache.gpu("g0").pinned_mb,
        "placed_on": {r: cluster.placed_on.get(r) for r in queued},  # (the running call's id differs)
        "busy_holders": [cluster.soonest_busy_holder(model, NOW_S) for model in "AB"],
        "known": [request_id in cluster.queue for request_id in queued],
    }


def test_park_now_parks_as_reserve_park_does() -> None:
    reserved, queued = with_a_busy_holder()
    applied, _ = with_a_busy_holder()
    # The queue's second request (not its head): the queue is relinked around it.
    target = next(r for r in reserved.cluster.queue if r.request_id == queued[1])
    park, _undo = reserve_park(reserved.cluster, target, "g0", NOW_S)
    assert park_now(applied.cluster, target, "g0", NOW_S) == park
    assert standing(applied, queued) == standing(reserved, queued)
    assert [r.request_id for r in applied.gpu("g0").local_queue] == [queued[1]]
    assert queued[1] not in applied.cluster.queue


def test_a_request_parked_for_good_runs_when_its_gpu_frees_up() -> None:
    reserved, queued = with_a_busy_holder()
    applied, _ = with_a_busy_holder()
    head = next(r for r in reserved.cluster.queue if r.request_id == queued[0])
    reserve_park(reserved.cluster, head, "g0", NOW_S)
    park_now(applied.cluster, head, "g0", NOW_S)
    for scheduler in (reserved, applied):
        (running,) = scheduler.gpu("g0").running
        scheduler.on_complete(running, 1.0)
    decisions = applied.schedule(1.0)
    assert decisions == reserved.schedule(1.0)
    assert decisions[0].request.request_id == queued[0]
    assert decisions[0].gpu_id == "g0"
