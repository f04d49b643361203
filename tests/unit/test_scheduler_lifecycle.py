"""Request lifecycle beyond the happy path: failures, retries, cancellation, GPUs leaving."""

from __future__ import annotations

import pytest

from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Dispatch, Estimator, Park, PolicyConfig, Scheduler, make_policy
from tests.builders import cache_on, make_scheduler, run_on, submit


def running_and_parked(gpus: int) -> tuple[Scheduler, Request, Request]:
    """A lalb scheduler of `gpus` GPUs where "A", cached on g0, runs there since 0.0, and a second
    call of "A", submitted at 0.1, is parked behind it on g0."""
    s = make_scheduler("lalb", gpus=gpus)
    cache_on(s, "g0", "A")
    running = run_on(s, "g0", "A", now=0.0)
    (parked,) = submit(s, "A", now=0.1)
    s.park(parked, "g0", 0.1)
    return s, running, parked


def test_failure_with_drop_requeues_and_forgets_the_model() -> None:
    s, running, parked = running_and_parked(gpus=2)
    s.on_failure(running.request_id, 0.5, drop_model=True, requeue=True)
    assert not s.cache.is_cached("A", "g0")
    assert [r.request_id for r in s.queue] == [running.request_id, parked.request_id]
    assert s.gpu("g0").idle and not s.gpu("g0").local_queue
    decisions = s.schedule(0.5)
    assert [(d.request.request_id, d.gpu_id) for d in decisions] == [
        (running.request_id, "g0"),
        (parked.request_id, "g1"),
    ]


def test_failure_without_drop_keeps_the_model_and_ends_the_request() -> None:
    s = make_scheduler("lalb", gpus=1)
    cache_on(s, "g0", "A")
    running = run_on(s, "g0", "A", now=0.0)
    s.on_failure(running.request_id, 0.5, drop_model=False, requeue=False)
    assert s.cache.is_cached("A", "g0")
    assert not s.cache.gpu("g0").is_pinned("A")
    assert len(s.queue) == 0 and s.gpu("g0").idle


def test_cancel_withdraws_queued_and_parked_requests_but_not_running_ones() -> None:
    s = make_scheduler("lalb", gpus=1)
    cache_on(s, "g0", "A")
    running = run_on(s, "g0", "A", now=0.0)
    queued, parked = submit(s, "B", "A", now=0.1)
    s.park(parked, "g0", 0.1)
    assert s.cancel(queued.request_id) == queued
    assert s.cancel(parked.request_id) == parked
    assert s.cancel(running.request_id) is None
    assert len(s.queue) == 0 and not s.gpu("g0").local_queue
    assert s.gpu("g0").local_work_s == 0.0
    s.on_complete(running.request_id, 1.0)
    assert not s.cache.gpu("g0").is_pinned("A")


def test_removing_a_gpu_requeues_its_work_in_arrival_order() -> None:
    s, first, later = running_and_parked(gpus=2)
    (newest,) = submit(s, "B", now=0.2)
    assert s.remove_gpu("g0") == [first, later]
    assert [r.request_id for r in s.queue] == [first.request_id, later.request_id, newest.request_id]
    decisions = s.schedule(0.3)
    assert isinstance(decisions[0], Dispatch) and decisions[0].request == first and decisions[0].gpu_id == "g1"
    assert s.cache.gpus_with("A") == {"g1"}


def test_measured_peak_memory_resizes_the_model_for_later_admissions() -> None:
    s = make_scheduler("lalb", gpus={"g0": 3000, "g1": 3000}, models={"A": 1000, "B": 1000})
    cache_on(s, "g0", "A", "B")
    assert s.observe_memory("A", "g0", 1500)
    assert s.cache.gpu("g0").item("A").memory_mb == 1500 and s.cache.gpu("g0").used_mb == 2500
    assert s.model("A").memory_mb == 1500
    # Growing past the free memory would need an eviction: the entry keeps its size for now.
    assert s.observe_memory("B", "g0", 2000)
    assert s.cache.gpu("g0").item("B").memory_mb == 1000 and s.model("B").memory_mb == 2000
    assert not s.observe_memory("A", "g0", 1500)  # unchanged
    assert not s.observe_memory("A", "g0", 0)  # nothing measured (the cpu backend reports declared sizes)


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_retry_after_a_worker_death_runs_elsewhere(policy: str) -> None:
    s = make_scheduler(policy, gpus=2)
    running = run_on(s, "g0", "A", now=0.0)
    s.on_failure(running.request_id, 0.5, drop_model=True, requeue=True, avoid_gpu=True)
    # g0 is idle, empty and offered work first; the retry still goes to g1.
    decisions = s.schedule(0.5)
    assert [(d.request.request_id, d.gpu_id) for d in decisions] == [(running.request_id, "g1")]


def test_a_retry_waits_for_another_gpu_rather_than_its_failed_one() -> None:
    s = make_scheduler("lalb", gpus=2)
    running = run_on(s, "g0", "A", now=0.0)
    other = run_on(s, "g1", "B", now=0.0)
    s.on_failure(running.request_id, 0.5, drop_model=True, requeue=True, avoid_gpu=True)
    assert s.schedule(0.5) == []  # only g0 is idle: the retry waits
    s.on_complete(other.request_id, 3.0)
    assert [(d.request.request_id, d.gpu_id) for d in s.schedule(3.0)] == [(running.request_id, "g1")]


def test_with_a_single_gpu_a_retry_runs_there_again() -> None:
    s = make_scheduler("lalb", gpus=1)
    running = run_on(s, "g0", "A", now=0.0)
    s.on_failure(running.request_id, 0.5, drop_model=True, requeue=True, avoid_gpu=True)
    assert [d.gpu_id for d in s.schedule(0.5)] == ["g0"]


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_retry_whose_model_fits_only_its_failed_gpu_runs_there_again(policy: str) -> None:
    # Avoiding g0, the only GPU `big` fits, the retry was never placed (both GPUs idle) until its
    # deadline; under `lb`, as the queue's head, it held the calls behind it too.
    s = make_scheduler(policy, gpus={"g0": 16000, "g1": 8000}, models={"big": 10000, "A": 1000})
    (big,) = submit(s, "big")
    assert [d.gpu_id for d in s.schedule(0.0)] == ["g0"]
    s.on_failure(big.request_id, 1.0, drop_model=True, requeue=True, avoid_gpu=True)
    submit(s, "A", now=2.0)
    placed = {d.request.model: d.gpu_id for d in s.schedule(2.0)}
    assert placed["big"] == "g0" and "A" in placed, placed


def test_a_measured_size_resizes_each_replica_as_its_gpu_reports_it() -> None:
    # Once the model's size equalled the reports, another GPU's entry (or one with no room to grow
    # at the first report) kept its old size for good: that GPU's memory overbooked.
    s = make_scheduler("lalb", gpus={"g0": 8000, "g1": 8000}, models={"A": 1000, "B": 6500})
    cache_on(s, "g0", "A")
    cache_on(s, "g1", "B", "A")
    assert s.observe_memory("A", "g0", 5000)
    assert s.cache.gpu("g0").item("A").memory_mb == 5000
    assert not s.observe_memory("A", "g1", 5000)  # the model's size is unchanged, but g1 has no room yet
    assert s.cache.gpu("g1").item("A").memory_mb == 1000
    s.cache.release("g1", "B")
    assert not s.observe_memory("A", "g1", 5000)
    assert s.cache.gpu("g1").item("A").memory_mb == 5000 and s.cache.gpu("g1").used_mb == 5000


def test_a_redeclared_size_resizes_the_cached_entries_where_they_fit() -> None:
    # A function updated with a larger memory_mb (same package, same model) kept its cached
    # entries at the old size: B was admitted beside A with room for A's old 1000 MB only.
    s = make_scheduler("lalb", gpus={"g0": 8000, "g1": 8000}, models={"A": 1000, "B": 6500, "C": 3000})
    cache_on(s, "g0", "A")
    cache_on(s, "g1", "C", "A")
    s.register_model(ModelSpec("A", 6000))
    assert s.cache.gpu("g0").item("A").memory_mb == 6000 and s.cache.gpu("g0").used_mb == 6000
    assert s.cache.gpu("g1").item("A").memory_mb == 1000  # no room to grow without an eviction: kept
    submit(s, "B")
    (decision,) = s.schedule(0.0)
    assert isinstance(decision, Dispatch) and decision.gpu_id == "g0" and decision.evict == ("A",)


def test_cancelling_a_parked_call_after_its_estimate_moved_leaves_no_work_behind() -> None:
    s = make_scheduler("lalb-o3", gpus={"g0": 8000, "g1": 8000}, models={"A": 1000, "B": 1000})
    cache_on(s, "g0", "A")
    submit(s, "A")
    s.schedule(0.0)
    (parked,) = submit(s, "A", now=0.1)
    (park,) = s.schedule(0.1)
    assert isinstance(park, Park) and park.gpu_id == "g0"
    s.estimator.observe_inference("A", s.gpu("g0").spec.gpu_type, 32, 0.1)  # its estimate moves
    s.cancel(parked.request_id)
    assert not s.gpu("g0").local_queue and s.gpu("g0").local_work_s == 0.0


def test_cancelling_a_parked_request_brings_its_gpus_free_time_forward() -> None:
    s = make_scheduler("lalb", gpus=3)
    cache_on(s, "g1", "A")
    cache_on(s, "g2", "A")
    run_on(s, "g1", "A", now=0.0)  # free at 1.0
    run_on(s, "g2", "A", now=0.5)  # free at 1.5
    (parked,) = submit(s, "A", now=0.5)
    s.park(parked, "g1", 0.5)  # g1 now free at 2.0: g2 frees up first
    assert s.soonest_busy_holder("A", 0.5) == ("g2", pytest.approx(1.0))
    s.cancel(parked.request_id)
    assert s.soonest_busy_holder("A", 0.5) == ("g1", pytest.approx(0.5))


def test_completing_a_request_that_is_not_running_changes_nothing() -> None:
    s, running, parked = running_and_parked(gpus=1)
    with pytest.raises(KeyError, match="parked"):
        s.on_complete(parked.request_id, 0.5)
    with pytest.raises(KeyError, match="not running anywhere"):
        s.on_failure("never-submitted", 0.5, drop_model=False, requeue=False)
    s.on_complete(running.request_id, 1.0)
    assert [d.request for d in s.schedule(1.0)] == [parked]


def test_a_gpu_registered_again_does_not_inherit_its_predecessors_free_time() -> None:
    # A node restart takes its GPUs out and brings them back under the same ids. A free-time entry
    # the old g0 left (free at 4.0) must stay stale for the new g0 (busy until 14.0): else the
    # soonest holder to free up is the new g0, and a call that should park on g1 (free at 5.0)
    # goes to an empty GPU as a miss.
    est = Estimator([ModelProfile(model, "rtx2080", 1000, 3.0, 1.0, 32) for model in ("m", "x")])
    s = Scheduler(make_policy("lalb-o3", PolicyConfig()), estimator=est)
    for gpu in ("g0", "g1", "g2"):
        s.add_gpu(GpuSpec(gpu, 8000))
    for model in ("m", "x"):
        s.register_model(ModelSpec(model, 1000))
    s.submit(Request("a", "f", "m", 0.0, 32))
    assert s.schedule(0.0)[0].gpu_id == "g0"
    s.remove_gpu("g0", 0.5)
    s.cancel("a")
    s.add_gpu(GpuSpec("g0", 8000))
    s.submit(Request("b", "f", "m", 1.0, 320))  # the new g0: busy until 14.0
    s.submit(Request("c", "f", "m", 1.0, 32))  # g1: until 5.0
    s.submit(Request("d", "f", "x", 1.0, 32))
    s.schedule(1.0)
    assert s.cluster.soonest_busy_holder("m", 1.0) == ("g1", 4.0)
    s.add_gpu(GpuSpec("g3", 8000))
    s.submit(Request("e", "f", "m", 3.0, 32))
    decision = s.schedule(3.0)[0]
    assert isinstance(decision, Park) and decision.gpu_id == "g1"


def test_the_soonest_holder_among_overdue_ones_is_the_one_without_parked_work() -> None:
    # Both holders' calls overran their estimates (expected to end at 1.0 and 2.2; it is 3.0). g1
    # has a call parked (1 s of work), g2 none: g2 can start one soonest (wait 0, against g1's 1 s),
    # though g1's free time (1.0 + 1.0 = 2.0) is the earlier (g2's: 2.2).
    s = make_scheduler("lalb", gpus=3)
    cache_on(s, "g1", "A")
    cache_on(s, "g2", "A")
    run_on(s, "g1", "A", now=0.0)
    (parked,) = submit(s, "A", now=0.1)
    s.park(parked, "g1", 0.1)
    run_on(s, "g2", "A", now=1.2)
    assert s.soonest_busy_holder("A", 0.5) == ("g1", pytest.approx(1.5))  # none overdue: by free time
    assert s.soonest_busy_holder("A", 3.0) == ("g2", 0.0)
    assert s.soonest_busy_holder("A", 2.1) == ("g2", pytest.approx(0.1))  # g1's wait is still 1 s
    s.cancel(parked.request_id)
    assert s.soonest_busy_holder("A", 3.0) == ("g1", 0.0)  # both overdue, neither with work: the lower id
