"""mqfq-sticky on hand-built clusters: virtual time, throttling, keep-alive, stickiness."""

from __future__ import annotations

import heapq
import random

import pytest

from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Dispatch, Estimator, Park, PolicyConfig, Scheduler, make_policy
from scheduler.policies.mqfq import MqfqStickyPolicy
from tests.builders import cache_on, make_request, make_scheduler, run_on

INFERENCE_S = 1.0  # the builders' models: 1 s a call, 2 s a load


def mqfq(
    gpus: int = 1, *, overrun_s: float = 10.0, ttl_alpha: float = 1.5, max_num_skips: int = 25, slots: int = 1
) -> tuple[Scheduler, MqfqStickyPolicy]:
    s = make_scheduler("lb", gpus=gpus, slots=slots)
    policy = make_policy(
        "mqfq-sticky",
        PolicyConfig(mqfq_overrun_s=overrun_s, mqfq_ttl_alpha=ttl_alpha, max_num_skips=max_num_skips),
    )
    assert isinstance(policy, MqfqStickyPolicy)
    s.policy = policy
    return s, policy


def submit_at(s: Scheduler, model: str, at_s: float, count: int = 1) -> list[str]:
    ids = []
    for _ in range(count):
        request = make_request(model, at_s)
        s.submit(request)
        ids.append(request.request_id)
    return ids


def run_one(s: Scheduler, now: float) -> Dispatch:
    (decision,) = s.schedule(now)
    assert isinstance(decision, Dispatch)
    s.on_complete(decision.request.request_id, now + INFERENCE_S, inference_time_s=INFERENCE_S)
    return decision


def test_each_dispatch_advances_its_flows_virtual_time_by_the_calls_service_time() -> None:
    s, policy = mqfq()
    cache_on(s, "g0", "A")
    submit_at(s, "A", 0.0, count=3)
    for _ in range(3):
        run_one(s, 0.0)
    assert policy.flow("A").vt_s == pytest.approx(3 * INFERENCE_S)


def test_the_longest_queue_goes_first_and_a_flow_too_far_ahead_is_throttled() -> None:
    s, policy = mqfq(overrun_s=2.0)
    cache_on(s, "g0", "A", "B")
    submit_at(s, "B", 0.0, count=2)
    submit_at(s, "A", 0.0, count=6)
    now = 0.0
    order = []
    for _ in range(8):
        order.append(run_one(s, now).request.model)
        now += INFERENCE_S
    # A (the longer queue) runs until it is more than T = 2 s of service ahead of B, then B
    # catches up, then A goes on.
    assert order[:3] == ["A", "A", "A"]
    assert order[3] == "B"
    assert sorted(order) == ["A"] * 6 + ["B"] * 2
    assert policy.global_vt_s >= 2.0


def test_the_least_backlogged_flow_is_never_throttled_so_no_gpu_idles_with_work_queued() -> None:
    s, policy = mqfq(overrun_s=0.0)
    cache_on(s, "g0", "A")
    submit_at(s, "A", 0.0, count=4)
    for step in range(4):  # A alone: always the least VT of the backlogged flows
        assert run_one(s, float(step)).request.model == "A"
    assert policy.flow("A").vt_s == pytest.approx(4.0)


def test_a_flow_back_within_its_ttl_keeps_its_virtual_time_and_one_back_later_restarts_at_global() -> None:
    s, policy = mqfq(ttl_alpha=2.0)
    cache_on(s, "g0", "A", "B")
    for at_s in (0.0, 1.0):  # A's inter-arrival time: 1 s, so its TTL is 2 s
        submit_at(s, "A", at_s)
        run_one(s, at_s)
    a_vt = policy.flow("A").vt_s
    submit_at(s, "B", 2.0, count=5)
    for step in range(5):
        run_one(s, 2.0 + step)
    assert policy.global_vt_s > a_vt
    submit_at(s, "A", 3.5)  # 1.5 s after its last call ended: within its TTL
    assert policy.flow("A").vt_s == pytest.approx(a_vt)
    s2, policy2 = mqfq(ttl_alpha=2.0)
    cache_on(s2, "g0", "A", "B")
    for at_s in (0.0, 1.0):
        submit_at(s2, "A", at_s)
        run_one(s2, at_s)
    submit_at(s2, "B", 2.0, count=5)
    for step in range(5):
        run_one(s2, 2.0 + step)
    submit_at(s2, "A", 30.0)  # long after its TTL: no credit kept
    assert policy2.flow("A").vt_s == pytest.approx(policy2.global_vt_s)


def test_sticky_a_flow_runs_where_its_model_is_and_waits_for_a_busy_holder() -> None:
    s, _ = mqfq(gpus=2)
    cache_on(s, "g1", "A")
    submit_at(s, "A", 0.0)
    (decision,) = s.schedule(0.0)  # g0 is offered first: A goes to idle g1, which holds it
    assert isinstance(decision, Dispatch) and (decision.gpu_id, decision.hit) == ("g1", True)
    submit_at(s, "A", 0.1)  # g1 busy until 1.0 (0.9 s) < a 2 s load on g0: A waits for g1
    (park,) = s.schedule(0.1)
    assert isinstance(park, Park) and park.gpu_id == "g1" and park.est_wait_s == pytest.approx(0.9)
    assert s.schedule(0.2) == []  # nothing queued: g0 stays idle
    s.on_complete(decision.request.request_id, 1.0, inference_time_s=INFERENCE_S)
    (second,) = s.schedule(1.0)
    assert isinstance(second, Dispatch) and (second.gpu_id, second.hit) == ("g1", True)


def test_a_long_backlog_on_a_busy_holder_spills_onto_an_idle_gpu() -> None:
    s, _ = mqfq(gpus=2)
    cache_on(s, "g1", "A")
    submit_at(s, "A", 0.0)
    s.schedule(0.0)  # A runs on g1
    submit_at(s, "A", 0.1, count=4)  # 0.9 s + 3 calls x 1 s behind it > a 2 s load on g0
    decisions = s.schedule(0.1)
    assert [(d.gpu_id, d.hit) for d in decisions if isinstance(d, Dispatch)] == [("g0", False)]


@pytest.mark.parametrize(("max_num_skips", "b_runs_after"), [(3, 6), (25, 8)])
def test_a_throttled_flow_keeps_its_own_gpu_rather_than_it_loading_another_flows_model(
    max_num_skips: int, b_runs_after: int
) -> None:
    # g0 holds A. B (older, held nowhere) is eligible once A is T = 2 s ahead, but its call would
    # be a load here: A's hit goes instead and passes B over, until B has been passed over
    # max_num_skips times (then it goes first) or A has nothing left.
    s, _ = mqfq(overrun_s=2.0, max_num_skips=max_num_skips)
    cache_on(s, "g0", "A")
    (b_id,) = submit_at(s, "B", 0.0)
    submit_at(s, "A", 0.0, count=8)
    order = []
    for step in range(9):
        decision = run_one(s, float(step))
        order.append(decision.request.model)
        if decision.request.model == "A" and b_id in s.queue:
            assert s.queue.num_skips(b_id) == max(0, step - 2)  # 3 eligible A's pass nothing
    assert order == ["A"] * b_runs_after + ["B"] + ["A"] * (8 - b_runs_after)


def test_no_call_is_passed_over_more_than_max_num_skips_times() -> None:
    rng = random.Random(5)
    s, _ = mqfq(gpus=2, overrun_s=1.0, max_num_skips=4)
    cache_on(s, "g0", "A")
    cache_on(s, "g1", "A")
    running: list[tuple[float, str]] = []
    now = 0.0
    most = 0
    for _ in range(600):
        now += rng.uniform(0.0, 0.5)
        for model in rng.choices("ABCDEF", weights=[12, 2, 1, 1, 1, 1], k=rng.randint(0, 2)):
            submit_at(s, model, now)
        running.sort()
        while running and running[0][0] <= now:
            s.on_complete(running.pop(0)[1], now, inference_time_s=INFERENCE_S)
        for decision in s.schedule(now):
            if isinstance(decision, Dispatch):
                finish_s = now + decision.est_load_time_s + decision.est_inference_time_s
                running.append((finish_s, decision.request.request_id))
        most = max([most, *(skips for _, skips in s.queue.walk())])
    assert most == 4  # reached (A's hits do pass the others over), never passed


def test_a_throttled_flow_runs_when_the_eligible_flows_calls_went_elsewhere() -> None:
    # B (eligible, behind) parks on its busy holder g1; A, on g0, is throttled: g0 runs A rather
    # than idle until the next event, as the letter did.
    s, policy = mqfq(gpus=2, overrun_s=0.0, ttl_alpha=1000.0)
    cache_on(s, "g1", "B")
    for at_s in (0.0, 1.0):  # B's flow: a keep-alive of 1000 s
        submit_at(s, "B", at_s)
        run_one(s, at_s)
    for at_s in (2.0, 3.0, 4.0):  # A on g0 (a miss, then hits) runs ahead of B
        submit_at(s, "A", at_s)
        assert run_one(s, at_s).gpu_id == "g0"
    submit_at(s, "B", 5.0)
    (b_runs,) = s.schedule(5.0)  # on g1, until 6.0
    assert isinstance(b_runs, Dispatch) and b_runs.gpu_id == "g1"
    submit_at(s, "B", 5.1)
    submit_at(s, "A", 5.1)
    decisions = s.schedule(5.1)
    assert policy.flow("A").vt_s - INFERENCE_S > policy.global_vt_s  # A was throttled
    assert [(type(d).__name__, d.request.model, d.gpu_id) for d in decisions] == [
        ("Park", "B", "g1"),  # 0.9 s < a 2 s load on g0
        ("Dispatch", "A", "g0"),
    ]


@pytest.mark.parametrize(("running", "expected"), [(2, "g0"), (3, "g1")])
def test_a_flows_calls_do_not_pile_on_a_busy_worker_when_a_load_is_sooner(running: int, expected: str) -> None:
    # D = 4: g0 holds A and runs `running` calls of it (1 s each, one at a time on A's worker).
    # One more waits 2 or 3 s there; a load on the idle g1 takes 2 s.
    s, _ = mqfq(gpus=2, slots=4)
    cache_on(s, "g0", "A")
    for _ in range(running):
        run_on(s, "g0", "A", now=0.0)
    submit_at(s, "A", 0.0)
    (decision,) = s.schedule(0.0)
    assert isinstance(decision, Dispatch) and decision.gpu_id == expected


def test_a_flow_with_calls_queued_keeps_its_virtual_time_whatever_the_gap() -> None:
    policy = MqfqStickyPolicy(overrun_s=100)
    for at_s in (0.0, 0.1):  # mean inter-arrival 0.1 s: TTL 0.15 s
        policy.on_submit(make_request("A", at_s))
    policy.flow("A").vt_s = 2.0
    policy.on_submit(make_request("B", 0.1))
    policy.flow("B").vt_s = 10.0
    policy._global_vt_s = 10.0  # as if B were the least backlogged flow
    policy.on_submit(make_request("A", 1.0))  # long after the TTL, but A still has 2 calls queued
    assert policy.flow("A").vt_s == pytest.approx(2.0)


def test_a_gpu_that_leaves_ends_its_running_calls_for_the_policy() -> None:
    s, policy = mqfq(gpus=2)
    cache_on(s, "g0", "A")
    submit_at(s, "A", 0.0)
    (decision,) = s.schedule(0.0)
    assert isinstance(decision, Dispatch) and policy.flow("A").in_flight == 1
    (requeued,) = s.remove_gpu("g0", 0.5)
    assert requeued.request_id == decision.request.request_id
    assert policy.flow("A").in_flight == 0


def test_global_vt_from_the_heap_equals_the_least_vt_of_the_backlogged_flows(monkeypatch: pytest.MonkeyPatch) -> None:
    # A random run long enough that the heap of VTs is rebuilt several times, with failures that
    # requeue calls (the path that does not go through on_submit) and a GPU that leaves.
    rebuilds: list[int] = []
    heapify = heapq.heapify
    monkeypatch.setattr(heapq, "heapify", lambda heap: (rebuilds.append(len(heap)), heapify(heap)))
    rng = random.Random(3)
    s, policy = mqfq(gpus=3, overrun_s=3.0)
    expected_s = 0.0
    running: list[tuple[float, str]] = []
    now = 0.0
    for step in range(1_500):
        now += rng.uniform(0.0, 0.4)
        for model in rng.choices("ABCDEF", weights=[8, 4, 2, 1, 1, 1], k=rng.randint(0, 2)):
            submit_at(s, model, now)
        if step == 700:
            gone = {request.request_id for request in s.remove_gpu("g2", now)}
            running = [(finish_s, rid) for finish_s, rid in running if rid not in gone]
        running.sort()
        while running and running[0][0] <= now:
            finish_s, request_id = running.pop(0)
            if rng.random() < 0.05:
                s.on_failure(request_id, finish_s, drop_model=rng.random() < 0.5, requeue=True)
            else:
                s.on_complete(request_id, finish_s, inference_time_s=INFERENCE_S)
        for decision in s.schedule(now):
            if isinstance(decision, Dispatch):
                finish_s = now + decision.est_load_time_s + decision.est_inference_time_s
                running.append((finish_s, decision.request.request_id))
        backlogged = [policy.flow(m).vt_s for m in s.queue.models()]
        if backlogged:
            expected_s = max(expected_s, min(backlogged))
        policy._update_global_vt(s.queue)
        assert policy.global_vt_s == pytest.approx(expected_s), step
    assert len(rebuilds) >= 2


def mqfq_with_host_tier(ttl_alpha: float, *, host_mb: int | None = 8000) -> Scheduler:
    """One GPU g0 on node n0 (a host tier of `host_mb` there, or none), models A-F as the builders'."""
    from gpufaas.profiles import ModelProfile
    from gpufaas.types import GpuSpec, ModelSpec
    from scheduler import Estimator

    policy = make_policy("mqfq-sticky", PolicyConfig(mqfq_ttl_alpha=ttl_alpha, mqfq_swap_out=True))
    assert isinstance(policy, MqfqStickyPolicy)
    s = Scheduler(policy, estimator=Estimator([ModelProfile(m, "rtx2080", 1000, 2.0, 1.0, 32) for m in "ABCDEF"]))
    s.add_gpu(GpuSpec("g0", 8000, node="n0"))
    if host_mb is not None:
        s.add_host("n0", host_mb)
    for model in "ABCDEF":
        s.register_model(ModelSpec(model, 1000))
    return s


def test_a_flow_past_its_keep_alive_is_swapped_out_to_the_host_tier_once() -> None:
    s = mqfq_with_host_tier(ttl_alpha=2.0)
    for at_s in (0.0, 10.0):  # A every 10 s: its TTL is 2 x 10 = 20 s
        submit_at(s, "A", at_s)
        run_one(s, at_s)
    # A's flow emptied at 11 s (its call ended): kept until 31 s.
    assert s.release_idle(30.9, gpu_idle_s=None, host_idle_s=None) == []
    (release,) = s.release_idle(31.0, gpu_idle_s=None, host_idle_s=None)
    assert (release.model, release.gpu_id, release.to_host) == ("A", "g0", True)
    assert "A" not in s.cache.gpu("g0") and s.cache.nodes_holding("A") == {"n0"}
    assert s.release_idle(100.0, gpu_idle_s=None, host_idle_s=None) == []  # named once
    # It comes back by swap-in; a call before the TTL ends keeps it on the GPU.
    submit_at(s, "A", 40.0)
    assert run_one(s, 40.0).from_host
    submit_at(s, "A", 45.0)
    run_one(s, 45.0)
    assert s.release_idle(55.0, gpu_idle_s=None, host_idle_s=None) == []


def test_without_a_host_tier_nothing_is_swapped_out() -> None:
    s = mqfq_with_host_tier(ttl_alpha=0.0, host_mb=None)
    submit_at(s, "A", 0.0)
    run_one(s, 0.0)
    assert s.release_idle(50.0, gpu_idle_s=None, host_idle_s=None) == []
    assert "A" in s.cache.gpu("g0")  # LRU evicts it when room is needed, as before


def test_in_the_simulator_a_shorter_keep_alive_swaps_out_more_with_host_tiers_only() -> None:
    from simulator.engine import ClusterConfig, simulate
    from simulator.workload import zipf_workload

    workload = zipf_workload(calls=600, models=12, zipf_exponent=1.1, memory_mb=1000, gap_s=0.4, seed=2)
    tiered = ClusterConfig(gpus=4, gpu_memory_mb=4000, gpus_per_node=4, host_memory_mb=16000)
    short, long_ = (
        simulate(workload, "mqfq-sticky", cluster=tiered, mqfq_ttl_alpha=a, mqfq_swap_out=True) for a in (0.5, 50.0)
    )
    assert short.releases > long_.releases and short.swap_ins > long_.swap_ins
    assert simulate(workload, "mqfq-sticky", cluster=tiered).releases == 0  # swap-out is asked for
    plain = ClusterConfig(gpus=4, gpu_memory_mb=4000)
    a, b = (simulate(workload, "mqfq-sticky", cluster=plain, mqfq_ttl_alpha=x, mqfq_swap_out=True) for x in (0.5, 50.0))
    assert a.releases == b.releases == 0  # alpha still decides when a flow's credit resets


def _swapping() -> Scheduler:
    est = Estimator([ModelProfile(m, "rtx2080", 1000, 3.0, 0.5, 32) for m in ("a", "b")])
    s = Scheduler(make_policy("mqfq-sticky", PolicyConfig(mqfq_swap_out=True)), estimator=est)
    s.add_host("n0", 8000)
    s.add_gpu(GpuSpec("g0", 8000, node="n0"))
    for m in ("a", "b"):
        s.register_model(ModelSpec(m, 1000))
    return s


def test_a_withdrawn_call_is_counted_out_of_its_flow() -> None:
    # A call cancelled before it ran (its deadline, its client gone, its GPU's node left) stayed
    # counted queued for good: its flow never went back to Global_VT after its TTL (hoarding
    # credit), and with --mqfq-swap-out its model was never swapped out.
    s = _swapping()
    s.submit(Request("a1", "fa", "a", 0.0, 32))
    s.schedule(0.0)
    s.submit(Request("a2", "fa", "a", 0.1, 32))
    s.schedule(0.1)
    assert s.cancel("a2") is not None
    s.on_complete("a1", 1.0)
    s.schedule(1.0)
    assert s.policy.flow("a").queued == 0
    assert s.release_idle(1000.0, gpu_idle_s=None, host_idle_s=None) != []
    s = _swapping()
    s.add_gpu(GpuSpec("g1", 8000, node="n0"))
    s.submit(Request("a1", "fa", "a", 0.0, 32))
    s.schedule(0.0)
    for request in s.remove_gpu("g0" if "a1" in s.gpu("g0").running else "g1", 0.5):
        s.cancel(request.request_id)  # as the call book does when it is not placed again
    assert s.policy.flow("a").queued == 0


def test_a_flow_back_exactly_when_its_ttl_runs_out_restarts_at_global_virtual_time() -> None:
    # MQFQ-Sticky's Algorithm 1 expires an empty flow when `now - last_exec >= TTL` (and
    # `idle_models` swaps it out then): a call at that instant finds it inactive.
    s, policy = mqfq(ttl_alpha=2.0)
    cache_on(s, "g0", "A", "B")
    for at_s in (0.0, 1.0):  # A's inter-arrival time: 1 s, so its TTL is 2 s; its last call ends at 2 s
        submit_at(s, "A", at_s)
        run_one(s, at_s)
    submit_at(s, "B", 2.0, count=5)
    for step in range(5):
        run_one(s, 2.0 + step)
    assert policy.global_vt_s > policy.flow("A").vt_s
    submit_at(s, "A", 4.0)  # 2 s after its last call ended: its TTL has just run out
    assert policy.flow("A").vt_s == pytest.approx(policy.global_vt_s)
