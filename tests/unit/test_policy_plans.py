"""A policy plans on a draft and returns its plan: the scheduler keeps exactly that plan, rolls
back what the policy reserved and dropped (its what-ifs), and everything when it raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufaas.profiles import paper_table1
from scheduler import Dispatch, Park, PolicyConfig, Scheduler, make_policy
from scheduler.decisions import Step
from scheduler.draft import Draft, PolicyError
from scheduler.policies.base import SchedulingContext, SchedulingPolicy
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_trace
from tests.builders import cache_on, make_scheduler, run_on, submit

PlanFn = Callable[[SchedulingContext, str, float], list[Step]]


class Scripted(SchedulingPolicy, name="test-scripted"):
    """A policy whose fill is whatever the test sets in `Scripted.script`."""

    script: PlanFn | None = None

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        assert Scripted.script is not None
        return Scripted.script(ctx, gpu_id, now)


class ProbingLalbO3(SchedulingPolicy, name="test-lalb-o3-probing"):
    """lalb-o3, after trying (and rolling back) every dispatch of the queue's head it could make:
    if rollback is exact, it decides exactly what lalb-o3 decides."""

    def __init__(self, config: PolicyConfig) -> None:
        self.inner = make_policy("lalb-o3", config)

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls(config)

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        head = ctx.queue.head
        if head is not None:
            for other in sorted(ctx.cache.gpu_ids()):
                if ctx.best_idle({other}) == other and ctx.fits(head.model, other):
                    mark = ctx.savepoint()
                    ctx.dispatch(head, other, now)
                    ctx.rollback(mark)
        return self.inner.fill(ctx, gpu_id, now)


# Registered only while this module's tests run: `--compare` elsewhere runs every registered policy.
TEST_POLICIES = {name: SchedulingPolicy.registry.pop(name) for name in ("test-scripted", "test-lalb-o3-probing")}


@pytest.fixture(autouse=True)
def _test_policies(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, cls in TEST_POLICIES.items():
        monkeypatch.setitem(SchedulingPolicy.registry, name, cls)
    Scripted.script = None


def state(s: Scheduler) -> tuple[object, ...]:
    """What a rollback must restore: queue order and skips, caches with recency, GPUs' work."""
    return (
        [(r.request_id, s.queue.num_skips(r.request_id)) for r in s.queue],
        s.cache.snapshot(),
        {g: sorted(s.cache.gpus_with(g)) for g in "ABCDEF"},
        [(g.spec.gpu_id, sorted(g.running), list(g.local_queue), g.idle, g.busy_until_s) for g in s.gpus()],
    )


def test_a_dropped_reservation_is_rolled_back_and_the_plan_kept() -> None:
    s = make_scheduler("test-scripted", gpus=2)
    cache_on(s, "g1", "C")
    a, b = submit(s, "A", "B")

    def plan(ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        ctx.dispatch(a, "g0", now)  # tried, then left out of the plan
        return [ctx.dispatch(b, "g1", now)]

    Scripted.script = plan
    (only,) = s.schedule(0.0)
    assert isinstance(only, Dispatch) and (only.request, only.gpu_id, only.hit) == (b, "g1", False)
    assert list(s.queue) == [a]  # A is queued again, in its place
    assert "A" not in s.cache.models_on("g0") and s.gpu("g0").idle
    assert s.cache.gpu("g1").lru_list() == ["B", "C"]


def test_savepoint_and_rollback_let_a_policy_score_alternatives() -> None:
    # Pick the idle GPU where the head's miss evicts the least: reserve each, read, roll back.
    s = make_scheduler("test-scripted", gpus={"g0": 2000, "g1": 2000}, models={m: 1000 for m in "ABCDEF"})
    cache_on(s, "g0", "B", "C")  # full: a miss there evicts B
    cache_on(s, "g1", "D")  # room for one more
    (a,) = submit(s, "A")
    before = state(s)
    seen: list[tuple[str, tuple[str, ...]]] = []

    def plan(ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        for gpu in ("g0", "g1"):
            mark = ctx.savepoint()
            tried = ctx.dispatch(a, gpu, now)
            seen.append((gpu, tried.evict))
            ctx.rollback(mark)
            assert state(s) == before
        best = min(("g0", "g1"), key=lambda g: len(dict(seen)[g]))
        return [ctx.dispatch(a, best, now)]

    Scripted.script = plan
    (decision,) = s.schedule(0.0)
    assert seen == [("g0", ("B",)), ("g1", ())]
    assert isinstance(decision, Dispatch) and decision.gpu_id == "g1" and decision.evict == ()
    assert s.cache.gpu("g0").lru_list() == ["C", "B"]  # B was evicted only in the what-if


def test_a_policy_that_raises_leaves_the_scheduler_as_it_was() -> None:
    s = make_scheduler("test-scripted", gpus=2, slots=2)
    cache_on(s, "g1", "C")
    running = run_on(s, "g1", "C")
    submit(s, "A", "B", "C")
    before = state(s)

    def plan(ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        queued = list(ctx.queue.walk())
        ctx.pass_over(queued[1][0].request_id)
        ctx.visit(queued[0][0].request_id)
        ctx.dispatch(queued[0][0], "g0", now)
        ctx.dispatch(queued[2][0], "g1", now)  # fills g1 (2 slots)
        raise ValueError("the policy's own bug")

    Scripted.script = plan
    with pytest.raises(ValueError, match="own bug"):
        s.schedule(0.0)
    assert state(s) == before
    s.on_complete(running.request_id, 1.0)  # and it carries on
    assert s.gpu("g1").idle


def test_a_plan_step_that_cannot_be_applied_is_a_policy_error_and_changes_nothing() -> None:
    s = make_scheduler("test-scripted", gpus=2)
    run_on(s, "g1", "C")
    a, b = submit(s, "A", "B")
    before = state(s)

    def plan(ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        first = ctx.dispatch(a, "g0", now)
        # Made by hand, not reserved: g1 has no free slot.
        return [first, Dispatch(b, "g1", hit=False)]

    Scripted.script = plan
    with pytest.raises(PolicyError, match="not idle"):
        s.schedule(0.0)
    assert state(s) == before


def test_a_park_rolled_back_keeps_the_busy_gpu_advertised() -> None:
    s = make_scheduler("test-scripted", gpus=2)
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A")  # g1 busy with A until t=1
    (a,) = submit(s, "A")

    def plan(ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        mark = ctx.savepoint()
        ctx.park(a, "g1", now)
        ctx.rollback(mark)
        return []

    Scripted.script = plan
    assert s.schedule(0.0) == []
    assert list(s.queue) == [a] and not s.gpu("g1").local_queue
    # g1 still frees up first for A, 1 s from now: the rollback re-advertised it.
    assert s.soonest_busy_holder("A", 0.0) == ("g1", pytest.approx(1.0))
    later = s.park(a, "g1", 0.0)
    assert isinstance(later, Park) and later.est_wait_s == pytest.approx(1.0)


def test_only_a_fills_draft_reserves() -> None:
    """Outside a fill nothing is reserved: the scheduler has no savepoint or rollback. A fill's
    `Draft` reserves on the committed state, and its rollback takes that back exactly."""
    s = make_scheduler("lalb", gpus=1)
    assert not hasattr(s, "savepoint") and not hasattr(s, "rollback")
    (a,) = submit(s, "A")
    draft = Draft(s.cluster)
    mark = draft.savepoint()
    draft.dispatch(a, "g0", 0.0)
    assert not s.queue and not s.gpu("g0").idle
    draft.rollback(mark)
    assert list(s.queue) == [a] and s.gpu("g0").idle and not s.gpu("g0").running


@pytest.mark.parametrize("slots", [1, 3])
def test_what_ifs_rolled_back_on_the_paper_trace_change_no_decision(slots: int) -> None:
    """Every fill first tries and rolls back a dispatch of the head on each idle GPU; if the
    rollback is exact, the run equals lalb-o3's to the last figure."""
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=35, minutes=2), paper_table1())
    cluster = ClusterConfig(slots=slots, gpu_memory_mb=6144)
    plain = simulate(workload, "lalb-o3", cluster=cluster)
    probing = simulate(workload, "test-lalb-o3-probing", cluster=cluster)
    assert plain.misses > 0 and plain.parks > 0
    assert {**probing.to_json(), "policy": "lalb-o3"} == {**plain.to_json(), "max_num_skips": 0}
