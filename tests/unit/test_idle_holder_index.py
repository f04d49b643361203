"""The index of each model's idle holders (`ClusterState.best_idle_holder`) and the per-(GPU, model)
worker busy time answer exactly what the scans they replace answer, after every kind of event and
inside a fill's reservations and rollbacks."""

from __future__ import annotations

import math
import random

import pytest

from gpufaas.types import GpuSpec, Request
from scheduler import PolicyConfig, make_policy
from scheduler.decisions import Step
from scheduler.placement import PlacementPieces
from scheduler.policies.base import SchedulingContext, SchedulingPolicy
from scheduler.state import ClusterState
from tests.builders import cache_on, make_request, make_scheduler, run_on

MODELS = {m: 2500 for m in "ABCDEFG"}  # three fit on a GPU of 8000 MB


def brute_best_idle(cluster: ClusterState, model: str, exclude: str | None) -> str | None:
    """The scan the index replaces: `PlacementPieces.best_idle` over the model's holders."""
    pieces = PlacementPieces()
    pieces.cluster = cluster
    return pieces.best_idle(set(cluster.cache.gpus_with(model)), exclude, model=model)


def brute_worker_busy_until_s(cluster: ClusterState, model: str, gpu_id: str) -> float:
    state = cluster.gpus[gpu_id]
    finishes = state.expected_finish_s
    return max((finishes[r] for r, req in state.running.items() if req.model == model), default=-math.inf)


def check_against_brute_force(cluster: ClusterState) -> None:
    for model in MODELS:
        for exclude in (None, *sorted(cluster.gpus)):
            assert cluster.best_idle_holder(model, exclude) == brute_best_idle(cluster, model, exclude), (
                model,
                exclude,
            )
        for gpu_id in cluster.gpus:
            assert ClusterState.worker_busy_until_s(model, cluster.gpus[gpu_id]) == brute_worker_busy_until_s(
                cluster, model, gpu_id
            )


class CheckingLalbO3(SchedulingPolicy, name="test-lalb-o3-index-checking"):
    """lalb-o3 that, before it plans, tries a dispatch of the queue's head on every idle GPU and
    rolls it back, checking the index against the scan inside each reservation and after it."""

    def __init__(self, config: PolicyConfig) -> None:
        self.inner = make_policy("lalb-o3", config)
        self.checks = 0

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls(config)

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        cluster = ctx.cluster  # type: ignore[attr-defined]  # the Draft under test
        head = ctx.queue.head
        if head is not None:
            for other in sorted(cluster.gpus):
                if cluster.gpus[other].idle and ctx.fits(head.model, other):
                    mark = ctx.savepoint()
                    ctx.dispatch(head, other, now)
                    check_against_brute_force(cluster)
                    ctx.rollback(mark)
        check_against_brute_force(cluster)
        self.checks += 1
        return self.inner.fill(ctx, gpu_id, now)


_CHECKING = SchedulingPolicy.registry.pop("test-lalb-o3-index-checking")  # not for `--compare` elsewhere


def random_events(seed: int, steps: int) -> int:
    """Drive a scheduler with random events, checking the index after each; returns the fills checked."""
    rng = random.Random(seed)
    speeds = {f"g{i}": rng.choice((1.0, 1.0, 2.0)) for i in range(5)}
    slots = {f"g{i}": rng.choice((1, 2, 3)) for i in range(5)}
    scheduler = make_scheduler("lalb-o3", gpus=5, models=MODELS, speeds=speeds, slots=slots)
    policy = _CHECKING.from_config(PolicyConfig())
    scheduler.policy = policy
    cluster = scheduler.cluster
    now = 0.0
    next_gpu = 5
    for _ in range(steps):
        now += rng.random()
        running = [r for state in cluster.gpus.values() for r in state.running]
        action = rng.random()
        if action < 0.45:
            for _ in range(rng.randint(1, 4)):
                scheduler.submit(make_request(rng.choice("ABCDEFG"), now))
            scheduler.schedule(now)
        elif action < 0.75 and running:
            scheduler.on_complete(rng.choice(running), now, inference_time_s=rng.uniform(0.2, 2.0))
            scheduler.schedule(now)
        elif action < 0.83 and running:
            scheduler.on_failure(
                rng.choice(running), now, drop_model=rng.random() < 0.5, requeue=rng.random() < 0.5, avoid_gpu=True
            )
            scheduler.schedule(now)
        elif action < 0.90:
            scheduler.set_slots(rng.choice(sorted(cluster.gpus)), rng.randint(1, 3))
            scheduler.schedule(now)
        elif action < 0.95 and len(cluster.gpus) > 2:
            scheduler.remove_gpu(rng.choice(sorted(cluster.gpus)), now)
            scheduler.schedule(now)
        else:
            gpu_id = f"g{rng.choice((next_gpu, 0, 1, 2))}"  # sometimes an id that was removed
            if gpu_id not in cluster.gpus:
                scheduler.add_gpu(GpuSpec(gpu_id, 8000, speed=rng.choice((1.0, 2.0)), slots=rng.randint(1, 3)))
                next_gpu += 1
        check_against_brute_force(cluster)
    assert isinstance(policy, CheckingLalbO3)
    return policy.checks


@pytest.mark.parametrize("seed", range(12))
def test_index_matches_brute_force_on_random_events(seed: int) -> None:
    assert random_events(seed, 150) > 20  # the checks inside fills ran too


def test_index_drops_an_evicted_holder_and_learns_a_new_one() -> None:
    scheduler = make_scheduler("lalb-o3", gpus=2, models={"A": 5000, "B": 5000})
    cluster = scheduler.cluster
    cache_on(scheduler, "g1", "A")
    assert cluster.best_idle_holder("A") == "g1"
    run_on(scheduler, "g1", "B")  # evicts A from g1 (no room for both)
    assert "g1" not in cluster.cache.gpus_with("A")
    assert cluster.best_idle_holder("A") is None
    cache_on(scheduler, "g0", "A")
    assert cluster.best_idle_holder("A") == "g0"
    assert cluster.best_idle_holder("A", exclude="g0") is None
    assert cluster.best_idle_holder("A") == "g0"  # an excluded holder stays in the index


def test_index_prefers_a_free_worker_then_free_slots_then_speed() -> None:
    scheduler = make_scheduler("lalb-o3", gpus=3, slots=3, speeds={"g2": 2.0})
    cluster = scheduler.cluster
    for gpu_id in ("g0", "g1", "g2"):
        cache_on(scheduler, gpu_id, "A", "B")
    assert cluster.best_idle_holder("A") == "g2"  # fastest
    run_on(scheduler, "g2", "B")
    assert cluster.best_idle_holder("A") == "g0"  # more free slots beat speed
    run_on(scheduler, "g0", "A")
    run_on(scheduler, "g1", "B")
    assert cluster.best_idle_holder("A") == "g2"  # A's worker busy on g0; g1 and g2 equal but for speed
    run_on(scheduler, "g2", "B")
    assert cluster.best_idle_holder("A") == "g1"  # now more free slots than g2
    scheduler.on_complete(next(iter(cluster.gpus["g2"].running)), 1.0)
    assert cluster.best_idle_holder("A") == "g2"


def test_worker_busy_until_follows_the_last_call_of_the_model() -> None:
    scheduler = make_scheduler("lalb-o3", gpus=1, slots=3)
    state = scheduler.cluster.gpus["g0"]
    first = run_on(scheduler, "g0", "A")
    second: Request = run_on(scheduler, "g0", "A")
    assert state.worker_busy_until_s["A"] == state.expected_finish_s[second.request_id]
    scheduler.on_complete(second.request_id, 0.5)
    assert state.worker_busy_until_s["A"] == state.expected_finish_s[first.request_id]
    scheduler.on_complete(first.request_id, 1.0)
    assert "A" not in state.worker_busy_until_s
