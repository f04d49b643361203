"""The scheduler's fast path (`Scheduler.schedule` with `SchedulingPolicy.lone_target`): where it
places a lone request without a full fill, where it leaves the request to the full fill, and that
its decision is the full fill's in each case (tests/property/test_fast_path_equivalence.py checks
the same on random event sequences)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufaas.types import Request
from scheduler import Decision, Dispatch, Park, Scheduler
from scheduler.draft import Draft
from scheduler.policies.lalb import LocalityAwarePolicy
from scheduler.state import ClusterState
from tests.builders import cache_on, make_request, make_scheduler, run_on, submit


class CountedDraft(Draft):
    """A `Draft` that counts how many were made: one per full fill."""

    made = 0

    def __init__(self, cluster: ClusterState) -> None:
        CountedDraft.made += 1
        super().__init__(cluster)


@pytest.fixture
def drafts(monkeypatch: pytest.MonkeyPatch) -> type[CountedDraft]:
    CountedDraft.made = 0
    monkeypatch.setattr("scheduler.core.Draft", CountedDraft)
    return CountedDraft


def twins(policy: str, **kwargs: object) -> tuple[Scheduler, Scheduler]:
    """A scheduler with the fast path and one without, built alike."""
    fast = make_scheduler(policy, **kwargs)  # type: ignore[arg-type]
    full = make_scheduler(policy, **kwargs)  # type: ignore[arg-type]
    full.fast_path = False
    return fast, full


def alike(fast: Scheduler, full: Scheduler, prepare: Callable[[Scheduler], object]) -> None:
    """Apply `prepare(scheduler)` to both (it must make the same requests)."""
    prepare(fast)
    prepare(full)


def schedule_both(fast: Scheduler, full: Scheduler, request_id: str, model: str) -> list[Decision]:
    """Submit the same lone request to both and schedule; both must decide alike."""
    for scheduler in (fast, full):
        scheduler.submit(Request(request_id, f"fn-{model}", model, 0.0))
    decisions = fast.schedule(0.0)
    assert decisions == full.schedule(0.0)
    return decisions


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_lone_hit_on_the_first_idle_gpu_takes_no_draft(policy: str, drafts: type[CountedDraft]) -> None:
    fast, full = twins(policy, gpus=2, slots=4)
    alike(fast, full, lambda s: (cache_on(s, "g0", "A"), cache_on(s, "g1", "A")))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert (decision.gpu_id, decision.hit) == ("g0", True)
    assert drafts.made == made + 1  # the full scheduler's fill only


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_lone_hit_goes_to_the_best_idle_holder_when_the_first_idle_gpu_lacks_the_model(
    policy: str, drafts: type[CountedDraft]
) -> None:
    # g0 (first in idle order) holds B only; g1 and g2 hold A, g1 with a call of B running: g2 has
    # more free slots, so the best idle holder is g2, not the first holder in idle order.
    fast, full = twins(policy, gpus=3, slots=4)

    def prepare(s: Scheduler) -> None:
        cache_on(s, "g0", "B")
        cache_on(s, "g1", "A", "B")
        cache_on(s, "g2", "A")
        run_on(s, "g1", "B")

    alike(fast, full, prepare)
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert (decision.gpu_id, decision.hit) == ("g2", True)
    assert drafts.made == made + 1


def test_a_lone_call_whose_worker_is_busy_for_longer_than_a_load_fills_in_full(
    drafts: type[CountedDraft],
) -> None:
    # Three calls of A run on its only holder, one after another in its worker: until t = 3, longer
    # than a load (2 s). The fill weighs a replica on g1 against that wait (and takes it), so the
    # fast path leaves the call to it.
    fast, full = twins("lalb", gpus=2, slots=4)
    alike(fast, full, lambda s: (cache_on(s, "g0", "A"), *(run_on(s, "g0", "A") for _ in range(3))))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert (decision.gpu_id, decision.hit) == ("g1", False)  # the replica
    assert drafts.made == made + 2  # both filled in full


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_lone_call_whose_worker_is_busy_for_less_than_any_load_takes_no_draft(
    policy: str, drafts: type[CountedDraft]
) -> None:
    # A runs on its only holder until t = 1, less than any load of A (2 s): no replica can win, so
    # the call goes to that holder, and the fast path says so without a fill.
    fast, full = twins(policy, gpus=2, slots=4)
    alike(fast, full, lambda s: (cache_on(s, "g0", "A"), run_on(s, "g0", "A")))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert (decision.gpu_id, decision.hit) == ("g0", True)
    assert drafts.made == made + 1  # the full scheduler's fill only


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_lone_call_whose_holders_are_busy_parks_without_a_draft_when_that_beats_a_load(
    policy: str, drafts: type[CountedDraft]
) -> None:
    # D = 1: A runs on g0 (a hit: 1 s of inference left), g1 is idle and holds nothing: waiting
    # for g0 beats loading A on g1 (2 s), so the call parks on g0.
    fast, full = twins(policy, gpus=2)
    alike(fast, full, lambda s: (cache_on(s, "g0", "A"), run_on(s, "g0", "A")))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert isinstance(decision, Park)
    assert decision.gpu_id == "g0"
    assert drafts.made == made + 1  # the full scheduler's fill only


def test_a_park_that_does_not_beat_a_load_is_a_miss_and_fills_in_full(drafts: type[CountedDraft]) -> None:
    # A runs on g0 after its load (2 s + 1 s of inference): waiting 3 s for g0 loses to loading A
    # on g1 (2 s), so the fill loads it there.
    fast, full = twins("lalb", gpus=2)
    alike(fast, full, lambda s: run_on(s, "g0", "A"))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert isinstance(decision, Dispatch)
    assert (decision.gpu_id, decision.hit) == ("g1", False)
    assert drafts.made == made + 2


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3", "mqfq-sticky", "torpor"])
def test_a_miss_fills_in_full_but_for_lb(policy: str, drafts: type[CountedDraft]) -> None:
    fast, full = twins(policy, gpus=2)
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert not decision.hit
    # lb's fill takes the head on the first idle GPU it fits, hit or miss: it needs no draft.
    assert drafts.made == made + (1 if policy == "lb" else 2)


@pytest.mark.parametrize("policy", ["mqfq-sticky", "torpor"])
def test_policies_with_state_of_their_own_always_fill_in_full(policy: str, drafts: type[CountedDraft]) -> None:
    fast, full = twins(policy, gpus=2)
    alike(fast, full, lambda s: cache_on(s, "g0", "A"))
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert decision.hit
    assert drafts.made == made + 2


def test_literal_visits_and_two_queued_requests_fill_in_full(drafts: type[CountedDraft]) -> None:
    fast, full = twins("lalb-o3", gpus=2, literal_visits=True)
    alike(fast, full, lambda s: cache_on(s, "g0", "A"))
    made = drafts.made
    schedule_both(fast, full, "lone", "A")
    assert drafts.made == made + 2
    fast, full = twins("lalb-o3", gpus=2)
    alike(fast, full, lambda s: (cache_on(s, "g0", "A"), cache_on(s, "g1", "B")))
    for scheduler in (fast, full):
        scheduler.submit(Request("first", "fn-A", "A", 0.0))
        scheduler.submit(Request("second", "fn-B", "B", 0.0))
    made = drafts.made
    assert fast.schedule(0.0) == full.schedule(0.0)
    assert drafts.made > made + 2  # both filled in full, a fill per GPU


def test_a_subclass_of_lalb_does_not_inherit_the_fast_path(drafts: type[CountedDraft]) -> None:
    class Variant(LocalityAwarePolicy, name="test-lalb-variant-fast-path"):
        pass

    scheduler = make_scheduler("test-lalb-variant-fast-path", gpus=2)
    cache_on(scheduler, "g0", "A")
    made = drafts.made
    submit(scheduler, "A")
    (decision,) = scheduler.schedule(0.0)
    assert decision.hit
    assert drafts.made == made + 1


def test_lb_leaves_a_lone_call_that_does_not_fit_the_first_idle_gpu_to_the_full_fill(
    drafts: type[CountedDraft],
) -> None:
    fast, full = twins("lb", gpus={"g0": 1000, "g1": 8000}, models={"A": 4000})
    made = drafts.made
    (decision,) = schedule_both(fast, full, "lone", "A")
    assert decision.gpu_id == "g1"
    assert drafts.made == made + 4  # each fills g0 (nothing) and then g1


def test_dispatch_of_a_request_not_queued_raises_and_changes_nothing() -> None:
    scheduler = make_scheduler("lalb", gpus=1)
    before = scheduler.cache.snapshot()
    with pytest.raises(KeyError):
        scheduler.dispatch(make_request("A"), "g0", 0.0)
    assert scheduler.cache.snapshot() == before
    assert scheduler.gpu("g0").idle
