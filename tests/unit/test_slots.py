"""GPUs with D concurrent slots: filling, local queues, the request lifecycle, estimates, set_slots."""

from __future__ import annotations

import math

import pytest

from gpufaas.types import GpuSpec
from scheduler import Dispatch, Park
from tests.builders import cache_on, fill_slots, make_scheduler, run_on, submit


def placed(decisions: list[Dispatch | Park]) -> list[tuple[str, str, str]]:
    """(kind, model, gpu) per decision."""
    return [(type(d).__name__.lower(), d.request.model, d.gpu_id) for d in decisions]


def test_slots_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="slots must be at least 1"):
        GpuSpec("g0", 1000, slots=0)


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_gpu_with_several_free_slots_takes_several_requests_in_one_call(policy: str) -> None:
    s = make_scheduler(policy, gpus=1, slots=3)
    submit(s, "A", "B", "C", "D")
    assert placed(s.schedule(0.0)) == [("dispatch", "A", "g0"), ("dispatch", "B", "g0"), ("dispatch", "C", "g0")]
    state = s.gpu("g0")
    assert not state.idle and state.free_slots == 0
    assert [r.model for r in state.running.values()] == ["A", "B", "C"]  # dispatch order
    assert [r.model for r in s.queue] == ["D"]
    assert s.schedule(0.0) == []


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_burst_spreads_over_the_idle_gpus_before_any_takes_a_second_request(policy: str) -> None:
    s = make_scheduler(policy, gpus=2, slots=2, speeds={"g1": 2.0})
    submit(s, "A", "B", "C", "D", "E")
    # One request per GPU per pass, fastest first: g1, g0, then again; E waits for a slot.
    assert [d.gpu_id for d in s.schedule(0.0)] == ["g1", "g0", "g1", "g0"]
    assert [r.model for r in s.queue] == ["E"]


def test_mixed_slot_counts_fill_every_free_slot() -> None:
    s = make_scheduler("lb", gpus=2, slots={"g0": 1, "g1": 3})
    submit(s, "A", "B", "C", "D", "E")
    assert [d.gpu_id for d in s.schedule(0.0)] == ["g0", "g1", "g1", "g1"]


def test_local_queue_heads_take_the_free_slots_before_the_global_queue() -> None:
    s = make_scheduler("lalb", gpus=1, slots=2)
    cache_on(s, "g0", "A")
    first, second = fill_slots(s, "g0", "A", now=0.0)  # both end at t=1
    parked = submit(s, "A", "A", now=0.1)
    for request in parked:
        s.park(request, "g0", 0.1)
    submit(s, "B", now=0.2)
    s.on_complete(first.request_id, 1.0)
    assert placed(s.schedule(1.0)) == [("dispatch", "A", "g0")]  # the parked head, not B
    assert list(s.gpu("g0").local_queue) == parked[1:]
    s.on_complete(second.request_id, 1.0)
    assert [d.request for d in s.schedule(1.0)] == parked[1:]
    assert [r.model for r in s.queue] == ["B"]


def test_two_slots_freed_at_once_run_two_parked_requests() -> None:
    s = make_scheduler("lalb", gpus=1, slots=2)
    cache_on(s, "g0", "A")
    running = fill_slots(s, "g0", "A")
    parked = submit(s, "A", "A", now=0.1)
    for request in parked:
        s.park(request, "g0", 0.1)
    for request in running:
        s.on_complete(request.request_id, 1.0)
    decisions = s.schedule(1.0)
    assert [d.request for d in decisions] == parked
    assert all(isinstance(d, Dispatch) and d.hit for d in decisions)


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_hit_goes_to_a_gpu_with_a_free_slot_and_parks_only_on_a_full_one(policy: str) -> None:
    s = make_scheduler(policy, gpus=2, slots={"g0": 1, "g1": 2})
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A", now=0.0)  # g1: one of two slots busy until t=1
    submit(s, "A", now=0.5)
    # g0 is offered work first; A is cached on g1, which still has a free slot: a hit there.
    assert placed(s.schedule(0.5)) == [("dispatch", "A", "g1")]
    blocker = run_on(s, "g0", "B", now=0.5)  # both GPUs full now
    (third,) = submit(s, "A", now=0.6)
    s.on_complete(blocker.request_id, 0.7)
    # g0 is idle again, but g1 frees a slot in 0.3 s, sooner than A loads on g0 (2 s).
    decisions = s.schedule(0.7)
    assert placed(decisions) == [("park", "A", "g1")]
    assert isinstance(decisions[0], Park) and decisions[0].est_wait_s == pytest.approx(0.3)
    assert list(s.gpu("g1").local_queue) == [third]


def test_estimated_wait_counts_the_slot_that_frees_first_and_parked_work_d_at_a_time() -> None:
    s = make_scheduler("lalb", gpus=1, slots=2)
    cache_on(s, "g0", "A")
    state = s.gpu("g0")
    assert state.busy_until_s == -math.inf and s.estimated_wait_s("g0", 0.0) == 0.0
    hit = run_on(s, "g0", "A", now=0.0)  # ends at 0 + 1
    assert state.idle and s.estimated_wait_s("g0", 0.0) == 0.0  # a slot is still free
    run_on(s, "g0", "B", now=0.5)  # a miss: ends at 0.5 + 2 + 1
    assert state.expected_finish_s == {hit.request_id: 1.0, next(reversed(state.running)): 3.5}
    assert state.busy_until_s == 1.0
    assert s.estimated_wait_s("g0", 0.6) == pytest.approx(0.4)
    (parked,) = submit(s, "A", now=0.6)
    s.park(parked, "g0", 0.6)  # 1 s of parked work over 2 slots
    assert s.estimated_wait_s("g0", 0.6) == pytest.approx(0.4 + 0.5)
    assert state.free_at_s == pytest.approx(1.5)
    assert s.estimated_wait_s("g0", 2.0) == pytest.approx(0.5)  # overdue: the slot is due now


def test_completing_one_of_several_keeps_the_others_and_their_pins() -> None:
    s = make_scheduler("lalb", gpus=1, slots=3)
    cache_on(s, "g0", "A")
    first, second, third = fill_slots(s, "g0", "A")
    cache = s.cache.gpu("g0")
    assert s.on_complete(second.request_id, 1.0) == second
    assert list(s.gpu("g0").running) == [first.request_id, third.request_id]
    assert s.gpu("g0").idle and s.gpu("g0").free_slots == 1 and cache.is_pinned("A")
    s.on_complete(first.request_id, 1.0)
    assert cache.is_pinned("A")  # each running request pins its model once
    s.on_complete(third.request_id, 1.0)
    assert not cache.is_pinned("A") and cache.pinned_mb == 0
    with pytest.raises(KeyError, match="not running"):
        s.on_complete(third.request_id, 1.0)


def test_completion_feeds_the_estimator_at_the_batch_size_of_its_batch() -> None:
    s = make_scheduler("lalb", gpus=1, slots=3)
    requests = fill_slots(s, "g0", "A")
    for request in requests:  # three calls merged into one batch of 3 x 32 samples
        s.on_complete(request.request_id, 5.0, inference_time_s=2.4, batch_size=96)
    assert s.estimator.inference_time_s("A", "rtx2080", 96) == pytest.approx(2.4)
    assert s.estimator.inference_time_s("A", "rtx2080", 32) == pytest.approx(1.0)  # the profile's, untouched


def test_a_worker_death_drops_the_model_but_not_the_other_requests_running_there() -> None:
    s = make_scheduler("lalb", gpus=1, slots=3)
    cache_on(s, "g0", "A")
    dying, survivor = run_on(s, "g0", "A"), run_on(s, "g0", "A")
    other = run_on(s, "g0", "B")
    s.on_failure(dying.request_id, 0.5, drop_model=True, requeue=False)
    assert list(s.gpu("g0").running) == [survivor.request_id, other.request_id]
    assert not s.cache.is_cached("A", "g0")
    # A new A request loads the model again and pins it; the survivor's completion must not
    # release that pin (its own went with the dropped entry).
    fresh = run_on(s, "g0", "A", now=0.6)
    s.on_complete(survivor.request_id, 1.0)
    assert s.cache.gpu("g0").is_pinned("A")
    s.on_complete(fresh.request_id, 3.6)
    assert not s.cache.gpu("g0").is_pinned("A")
    s.on_complete(other.request_id, 3.6)
    assert s.cache.gpu("g0").pinned_mb == 0


def test_one_worker_death_reported_call_by_call_drops_the_model_once() -> None:
    s = make_scheduler("lalb", gpus=1, slots=3)
    cache_on(s, "g0", "A")
    first, second = run_on(s, "g0", "A"), run_on(s, "g0", "A")
    s.on_failure(first.request_id, 0.5, drop_model=True, requeue=False)
    fresh = run_on(s, "g0", "A", now=0.6)  # loads A again before the second failure is reported
    (parked,) = submit(s, "B", now=0.7)
    s.on_failure(second.request_id, 0.8, drop_model=True, requeue=False)
    # The second report is about the dead worker: the fresh entry and its pin stay.
    assert s.cache.is_cached("A", "g0") and s.cache.gpu("g0").is_pinned("A")
    assert list(s.gpu("g0").running) == [fresh.request_id]
    s.on_complete(fresh.request_id, 3.6)
    assert s.cache.gpu("g0").pinned_mb == 0
    assert [r.request_id for r in s.queue] == [parked.request_id]


def test_a_failure_requeues_in_arrival_order_and_frees_its_slot() -> None:
    s = make_scheduler("lalb", gpus=1, slots=2)
    older, younger = run_on(s, "g0", "A"), run_on(s, "g0", "B")
    (queued,) = submit(s, "C", now=0.2)
    s.on_failure(younger.request_id, 0.5, drop_model=False, requeue=True)
    assert [r.request_id for r in s.queue] == [younger.request_id, queued.request_id]
    assert s.gpu("g0").free_slots == 1 and list(s.gpu("g0").running) == [older.request_id]
    assert placed(s.schedule(0.5)) == [("dispatch", "B", "g0")]


def test_cancel_leaves_running_requests_alone_on_a_gpu_with_several() -> None:
    s = make_scheduler("lalb", gpus=1, slots=2)
    cache_on(s, "g0", "A")
    running = fill_slots(s, "g0", "A")
    (parked,) = submit(s, "A", now=0.1)
    s.park(parked, "g0", 0.1)
    assert all(s.cancel(r.request_id) is None for r in running)
    assert s.cancel(parked.request_id) == parked
    assert s.gpu("g0").local_work_s == 0.0 and len(s.gpu("g0").running) == 2


def test_removing_a_gpu_requeues_every_running_and_parked_request_in_arrival_order() -> None:
    s = make_scheduler("lalb", gpus=2, slots={"g0": 2, "g1": 1})
    cache_on(s, "g0", "A")
    first = run_on(s, "g0", "A", now=0.0)
    (queued,) = submit(s, "C", now=0.05)
    second = run_on(s, "g0", "A", now=0.1)
    (parked,) = submit(s, "A", now=0.2)
    s.park(parked, "g0", 0.2)
    assert s.remove_gpu("g0") == [first, second, parked]
    assert list(s.queue) == [first, queued, second, parked]


def test_raising_slots_fills_the_new_ones_local_queue_first() -> None:
    s = make_scheduler("lalb", gpus=1, slots=1)
    cache_on(s, "g0", "A")
    run_on(s, "g0", "A")
    (parked,) = submit(s, "A", now=0.1)
    s.park(parked, "g0", 0.1)
    submit(s, "B", "C", now=0.2)
    s.set_slots("g0", 3)
    assert s.gpu("g0").spec.slots == 3 and s.gpu("g0").free_slots == 2
    assert placed(s.schedule(0.2)) == [("dispatch", "A", "g0"), ("dispatch", "B", "g0")]
    assert [r.model for r in s.queue] == ["C"]


def test_lowering_slots_below_the_running_count_starts_nothing_until_enough_finish() -> None:
    s = make_scheduler("lb", gpus=1, slots=3)
    cache_on(s, "g0", "B", "C")
    # Three models (calls of one model would wait for its worker): end at 3, 1.5 and 2.
    missed, *hits = [run_on(s, "g0", model, now=t) for model, t in (("A", 0.0), ("B", 0.5), ("C", 1.0))]
    submit(s, "D", now=1.0)
    s.set_slots("g0", 1)
    state = s.gpu("g0")
    assert not state.idle and state.free_slots == 0
    assert state.busy_until_s == pytest.approx(3.0)  # all three must end for one slot to free
    for request, end_s in zip(hits, (1.5, 2.0), strict=True):
        s.on_complete(request.request_id, end_s)
        assert s.schedule(end_s) == [] and state.busy_until_s == pytest.approx(3.0)
    s.on_complete(missed.request_id, 3.0)
    assert placed(s.schedule(3.0)) == [("dispatch", "D", "g0")]
    with pytest.raises(ValueError, match="slots must be at least 1"):
        s.set_slots("g0", 0)


def test_lowering_slots_of_a_gpu_with_a_free_slot_makes_it_a_busy_holder() -> None:
    s = make_scheduler("lalb", gpus=2, slots=2)
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A", now=0.0)  # ends at 1
    run_on(s, "g0", "B", now=0.0)
    run_on(s, "g0", "C", now=0.0)  # g0 full
    s.set_slots("g1", 1)  # g1 is full now too: an A request parks there (wait 0.5 < load 2)
    assert s.soonest_busy_holder("A", 0.5) == ("g1", pytest.approx(0.5))


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_model_that_does_not_fit_beside_the_pinned_ones_waits_without_looping(policy: str) -> None:
    s = make_scheduler(policy, gpus={"g0": 3000}, models={"A": 2000, "B": 2000}, slots=3)
    running = run_on(s, "g0", "A")
    submit(s, "B")
    # g0 has two free slots, but A (in use) leaves 1000 MB: B cannot be loaded until A ends.
    assert s.schedule(0.0) == []
    s.on_complete(running.request_id, 1.0)
    decisions = s.schedule(1.0)
    assert placed(decisions) == [("dispatch", "B", "g0")]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("A",)


def test_a_miss_goes_to_another_idle_gpu_when_pinned_models_leave_no_room_here() -> None:
    s = make_scheduler("lalb", gpus={"g0": 3000, "g1": 3000}, models={"A": 2000, "B": 2000}, slots=2)
    run_on(s, "g0", "A")  # g0 has a free slot, but A (in use) leaves 1000 MB there
    cache_on(s, "g1", "A")  # g1 holds A unpinned: B evicts it there
    submit(s, "B", now=1.0)
    decisions = s.schedule(1.0)
    assert placed(decisions) == [("dispatch", "B", "g1")]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("A",)


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_hit_elsewhere_goes_to_the_holder_with_more_free_slots(policy: str) -> None:
    s = make_scheduler(policy, gpus=3, slots=3)
    cache_on(s, "g1", "A")
    cache_on(s, "g2", "A")
    run_on(s, "g1", "A")  # g1 has 2 free slots left, g2 has 3
    submit(s, "A")
    # g0 is offered work first; A is not cached there, so it is a hit on an idle holder: the one
    # with more free slots (g2), not the first in idle order (g1).
    assert placed(s.schedule(0.0)) == [("dispatch", "A", "g2")]


# --- calls of one model share its worker -----------------------------------------------------


def test_a_call_of_a_model_already_running_there_is_expected_to_wait_for_its_worker() -> None:
    s = make_scheduler("lalb", gpus=1, slots=3)
    cache_on(s, "g0", "A", "B")
    first = run_on(s, "g0", "A", now=0.0)  # a hit: 0 -> 1
    second = run_on(s, "g0", "A", now=0.0)  # behind it on A's worker: 1 -> 2
    other = run_on(s, "g0", "B", now=0.0)  # its own worker: 0 -> 1
    finishes = s.gpu("g0").expected_finish_s
    assert [finishes[r.request_id] for r in (first, second, other)] == pytest.approx([1.0, 2.0, 1.0])
    assert s.worker_wait_s("A", "g0", 0.5) == pytest.approx(1.5)
    assert s.worker_wait_s("B", "g0", 0.5) == pytest.approx(0.5)
    assert s.worker_wait_s("C", "g0", 0.5) == 0.0


def test_a_hit_goes_to_the_holder_whose_worker_of_the_model_is_free() -> None:
    s = make_scheduler("lalb", gpus=3, slots=2)
    cache_on(s, "g0", "A")
    cache_on(s, "g1", "A")
    run_on(s, "g0", "A", now=0.0)  # g0 (first in idle order) has a free slot, but A's worker is busy
    (request,) = submit(s, "A", now=0.1)
    assert placed(s.schedule(0.1)) == [("dispatch", "A", "g1")]
    assert s.gpu("g1").running == {request.request_id: request}


@pytest.mark.parametrize(("running", "expected"), [(2, "g0"), (3, "g1")])
def test_when_the_holders_worker_is_busy_longer_than_a_load_a_new_replica_is_made(running: int, expected: str) -> None:
    # g0 holds A and runs `running` calls of it (1 s each, one at a time): one more waits 2 or
    # 3 s there. A load takes 2 s: at 2 s the call waits for the worker, at 3 s it loads A on
    # the idle g1 instead.
    s = make_scheduler("lalb", gpus=2, slots=4)
    cache_on(s, "g0", "A")
    for _ in range(running):
        run_on(s, "g0", "A", now=0.0)
    submit(s, "A", now=0.0)
    (decision,) = s.schedule(0.0)
    assert isinstance(decision, Dispatch) and decision.gpu_id == expected
    assert decision.hit == (expected == "g0")
