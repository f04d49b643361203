"""torpor: required request counts, priority groups, serving order, and SLOs end to end in the
simulator and in function specs."""

from __future__ import annotations

import pytest

from gpufaas.errors import InvalidInput
from gpufaas.functions import FunctionSpec
from gpufaas.profiles import ModelProfile, paper_table1
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Dispatch, Estimator, PolicyConfig, Scheduler, make_policy
from scheduler.policies.torpor import SloRecord, TorporPolicy
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_trace
from tests.builders import cache_on, make_scheduler

DIGEST = "sha256:" + "a" * 64


def call(function: str, arrival_s: float, slo_s: float | None = 1.0) -> Request:
    return Request(f"{function}-{arrival_s}", function, f"m-{function}", arrival_s, slo_s=slo_s)


def torpor(alpha: float = 0.5) -> TorporPolicy:
    policy = make_policy("torpor", PolicyConfig(torpor_alpha=alpha))
    assert isinstance(policy, TorporPolicy)
    return policy


def test_required_request_count_is_what_a_function_must_still_meet_to_reach_the_tail() -> None:
    assert SloRecord(served=100, met=98).rrc() == pytest.approx(0.0)
    assert SloRecord(served=100, met=90).rrc() == pytest.approx(400.0)  # (98 - 90) / 0.02
    assert SloRecord(served=100, met=100).rrc() == pytest.approx(-100.0)  # ahead: negative
    # (m + RRC) / (n + RRC) == p: meeting RRC more calls in a row reaches the tail exactly.
    record = SloRecord(served=50, met=45)
    rrc = record.rrc()
    assert (45 + rrc) / (50 + rrc) == pytest.approx(0.98)


def test_served_calls_count_only_with_an_slo_and_only_when_they_completed() -> None:
    policy = torpor()
    policy.on_finish(call("f", 0.0, slo_s=1.0), 0.5, inference_time_s=0.4)  # met
    policy.on_finish(call("f", 1.0, slo_s=1.0), 3.0, inference_time_s=0.4)  # missed
    policy.on_finish(call("f", 2.0, slo_s=1.0), 2.1, inference_time_s=None)  # failed: not counted
    policy.on_finish(call("g", 0.0, slo_s=None), 9.0, inference_time_s=0.4)  # no SLO
    assert (policy.record("f").served, policy.record("f").met) == (2, 1)
    assert policy.record("g").served == 0


def test_high_priority_functions_go_first_in_descending_rrc_then_low_ascending_then_no_slo() -> None:
    policy = torpor(alpha=0.5)
    # RRCs: a -50 (ahead), b 50, c 150, d 300: positive total 500, high budget 250 -> a, b, c.
    for function, served, met in (("a", 100, 99), ("b", 100, 97), ("c", 100, 95), ("d", 100, 92)):
        policy.record(function).served, policy.record(function).met = served, met
    assert [policy.record(f).rrc() for f in "abcd"] == pytest.approx([-50.0, 50.0, 150.0, 300.0])
    oldest = [call("d", 0.0), call("none", 0.5, slo_s=None), call("a", 1.0), call("c", 2.0), call("b", 3.0)]
    assert [r.function for r in policy.order(oldest)] == ["c", "b", "a", "d", "none"]


def test_alpha_one_puts_every_function_in_the_high_group_and_zero_only_those_at_or_under_zero() -> None:
    everyone, strict = torpor(alpha=1.0), torpor(alpha=0.0)
    for policy in (everyone, strict):
        for function, served, met in (("a", 100, 99), ("b", 100, 97), ("d", 100, 92)):
            policy.record(function).served, policy.record(function).met = served, met
    oldest = [call("a", 0.0), call("b", 1.0), call("d", 2.0)]
    assert [r.function for r in everyone.order(oldest)] == ["d", "b", "a"]  # all high: descending
    assert [r.function for r in strict.order(oldest)] == ["a", "b", "d"]  # a high; b, d low: ascending


def test_the_chosen_call_is_placed_with_locality() -> None:
    s = make_scheduler("torpor", gpus=2)
    cache_on(s, "g1", "B")
    for model, slo_s in (("A", 5.0), ("B", 5.0)):
        s.submit(Request(f"r-{model}", f"fn-{model}", model, 0.0, slo_s=slo_s))
    decisions = s.schedule(0.0)  # g0 offered first: the first call in order is placed by Algorithm 2
    placed = {d.request.model: (d.gpu_id, d.hit) for d in decisions if isinstance(d, Dispatch)}
    assert placed["B"] == ("g1", True)


def test_slos_reach_the_simulator_and_its_report() -> None:
    counts = load_trace(shipped_trace(), "azure2019")
    plain = build_workload(counts, WorkloadConfig(working_set=35, minutes=2), paper_table1())
    assert all(r.slo_s is None for r in plain.requests)
    assert simulate(plain, "lalb-o3").slo_attainment == 1.0
    with_slo = build_workload(counts, WorkloadConfig(working_set=35, minutes=2, slo_factor=2.0), paper_table1())
    profiles = {p.model: p for p in with_slo.profiles}
    assert all(r.slo_s == pytest.approx(2.0 * profiles[r.model].inference_time_s) for r in with_slo.requests)
    tight = simulate(with_slo, "torpor", cluster=ClusterConfig(gpu_memory_mb=6144))
    assert 0.0 < tight.slo_attainment < 1.0 and 0.0 <= tight.slo_functions_met <= 1.0
    with pytest.raises(InvalidInput, match="slo_factor"):
        build_workload(counts, WorkloadConfig(working_set=35, slo_factor=-1.0), paper_table1())


@pytest.mark.parametrize(
    ("value", "ok"), [(250, True), (0.5, True), (None, True), (0, False), (-3, False), ("x", False), (True, False)]
)
def test_a_functions_slo_ms_is_validated(value: object, ok: bool) -> None:
    raw = {"name": "f", "package_digest": DIGEST, "memory_mb": 100, "slo_ms": value}
    if ok:
        assert FunctionSpec.from_dict(raw).slo_ms == (None if value is None else float(value))  # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidInput, match="slo_ms"):
            FunctionSpec.from_dict(raw)


def test_alpha_follows_the_share_of_functions_within_their_slo_period_by_period() -> None:
    """Torpor's Algorithm 2: the share of SLO-compliant functions up by more than 0.04 over the
    last period doubles alpha, down by more than that halves it, else it stays."""
    policy = TorporPolicy(alpha=0.5, alpha_period_s=10.0)

    def period(start_s: float, f2_meets: bool) -> None:
        for offset_s in (0.0, 5.0):
            now = start_s + offset_s
            policy.on_finish(call("f1", now - 0.5), now, inference_time_s=0.1)  # within its 1 s SLO
            arrival_s = now - (0.5 if f2_meets else 2.0)
            policy.on_finish(call("f2", arrival_s), now, inference_time_s=0.1)

    period(0.0, f2_meets=True)  # ratio 1.0: the first period only sets the reference
    period(10.0, f2_meets=False)  # 0.5: down
    period(20.0, f2_meets=True)  # 1.0: up
    period(30.0, f2_meets=True)  # 1.0: unchanged
    period(40.0, f2_meets=True)  # (closes the period before)
    assert policy.alpha_changes == [(20.0, 0.25), (30.0, 0.5)]
    assert policy.alpha == 0.5


def test_alpha_stays_within_its_bounds_and_fixed_without_a_period() -> None:
    policy = TorporPolicy(alpha=1.0, alpha_period_s=1.0)
    for step in range(20):  # alternate all-miss / all-meet periods: down, up, down, ...
        now = float(step)
        late = step % 2 == 0
        policy.on_finish(call("f", now - (2.0 if late else 0.5)), now, inference_time_s=0.1)
    assert all(0.0 < alpha <= 1.0 for _, alpha in policy.alpha_changes)
    fixed = TorporPolicy(alpha=0.5, alpha_period_s=None)
    for step in range(20):
        fixed.on_finish(call("f", step - 2.0 * (step % 2)), float(step), inference_time_s=0.1)
    assert fixed.alpha == 0.5 and fixed.alpha_changes == []
    with pytest.raises(ValueError, match="alpha_period_s"):
        TorporPolicy(alpha_period_s=0.0)


def test_a_tuned_alpha_starts_above_zero_so_that_it_can_grow() -> None:
    assert TorporPolicy(alpha=0.0, alpha_period_s=10.0).alpha > 0.0
    assert TorporPolicy(alpha=0.0).alpha == 0.0  # fixed: as given


def test_without_slos_torpor_decides_exactly_as_lalb_o3_off_its_tuned_point() -> None:
    # 450 rpm on 6 GB GPUs, no SLOs given: walking functions by their oldest call (no hit-first
    # scan) made torpor 7.4x lalb-o3 here; now it is lalb-o3 to the last figure.
    workload = build_workload(
        load_trace(shipped_trace(), "azure2019"), WorkloadConfig(working_set=35, rpm=450), paper_table1()
    )
    cluster = ClusterConfig(gpus=12, gpu_memory_mb=6144)
    reference, ours = (simulate(workload, policy, cluster=cluster) for policy in ("lalb-o3", "torpor"))
    assert (ours.avg_latency_s, ours.miss_ratio, ours.hits) == (
        reference.avg_latency_s,
        reference.miss_ratio,
        reference.hits,
    )


def test_an_idle_gpu_takes_the_highest_priority_function_whose_model_it_holds_first() -> None:
    policy = torpor(alpha=1.0)
    policy.record("b").served, policy.record("b").met = 100, 90  # b is further from its tail than a
    s = make_scheduler("lalb", gpus=1, models={"m-a": 1000, "m-b": 1000})
    s.policy = policy
    cache_on(s, "g0", "m-a")
    for request in (call("b", 0.0), call("a", 1.0)):
        s.submit(request)
    (decision,) = s.schedule(2.0)
    assert isinstance(decision, Dispatch) and decision.request.function == "a" and decision.hit


def test_a_function_without_an_slo_is_overtaken_at_most_max_num_skips_times() -> None:
    """One GPU holding B; a call of A (no SLO, not cached) waits at the head while calls of B
    (with an SLO, hits here) keep coming: each B placed ahead of it counts a skip, and once A has
    been passed over twice (the limit here) it runs next, before the B queued behind it."""
    scheduler = make_scheduler("torpor", gpus=1, models={"m-A": 1000, "m-B": 1000}, max_num_skips=2)
    cache_on(scheduler, "g0", "m-B")
    scheduler.submit(call("A", 0.0, slo_s=None))
    ran: list[str] = []
    for step in range(4):
        scheduler.submit(call("B", 1.0 + step))
        (decision,) = [d for d in scheduler.schedule(1.0 + step) if isinstance(d, Dispatch)]
        ran.append(decision.request.function)
        scheduler.on_complete(decision.request.request_id, 1.5 + step)
    assert ran == ["B", "B", "A", "B"]


def test_one_fill_passes_the_oldest_call_over_no_more_than_the_limit() -> None:
    # The oldest call has no SLO; 8 calls of an SLO function whose model a busy GPU holds come
    # after it. Parking them there passed the oldest over once each, 8 times against a limit of 2.
    estimator = Estimator([ModelProfile(m, "rtx2080", 1000, 5.0 if m == "s" else 3.0, 0.5, 32) for m in "smx"])
    sched = Scheduler(make_policy("torpor", PolicyConfig(max_num_skips=2)), estimator=estimator)
    sched.add_gpu(GpuSpec("g0", 8000, speed=2.0))
    sched.add_gpu(GpuSpec("g1", 8000))
    for name in "smx":
        sched.register_model(ModelSpec(name, 1000))
    sched.submit(Request("s0", "fs", "s", 0.0, 32, slo_s=2.0))
    sched.schedule(0.0)  # g0 holds s, busy
    sched.submit(Request("b0", "fb", "m", 0.0, 32))
    sched.schedule(0.0)  # g1 busy
    sched.submit(Request("h", "fh", "x", 0.1, 32))
    for i in range(1, 9):
        sched.submit(Request(f"s{i}", "fs", "s", 0.1, 32, slo_s=2.0))
    sched.on_complete("b0", 4.0)
    decisions = sched.schedule(4.0)
    assert "h" not in sched.queue or sched.queue.num_skips("h") <= 2, decisions
