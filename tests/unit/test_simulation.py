"""The simulator on the shipped trace: the paper's qualitative results, and its own invariants."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from gpufaas.profiles import ModelProfile, paper_table1
from gpufaas.types import Request
from scheduler.policies import PolicyConfig
from simulator.engine import Batching, ClusterConfig, Jitter, PolicyOptions, SimResult, policy_options, simulate
from simulator.report import shipped_trace
from simulator.workload import Workload, WorkloadConfig, build_workload, load_trace, zipf_workload


def run(
    policy: str,
    *,
    working_set: int = 35,
    rpm: int = 325,
    memory_mb: int = 8192,
    seed: int = 0,
    room_aware_misses: bool = True,
) -> SimResult:
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=working_set, rpm=rpm, seed=seed), paper_table1())
    return simulate(
        workload, policy, cluster=ClusterConfig(gpu_memory_mb=memory_mb), room_aware_misses=room_aware_misses
    )


@pytest.mark.parametrize("working_set", [15, 25, 35])
def test_locality_beats_load_balancing_at_the_papers_operating_point(working_set: int) -> None:
    lb, lalb, o3 = (run(p, working_set=working_set) for p in ("lb", "lalb", "lalb-o3"))
    for result in (lb, lalb, o3):
        assert result.completed == result.requests == 1950
    assert lb.avg_latency_s > 1.5 * max(lalb.avg_latency_s, o3.avg_latency_s)
    assert lb.miss_ratio > 4 * max(lalb.miss_ratio, o3.miss_ratio)
    assert lb.avg_top_model_replicas > lalb.avg_top_model_replicas
    assert lb.false_miss_ratio > lalb.false_miss_ratio


@pytest.mark.parametrize("room_aware_misses", [False, True], ids=["algorithm-2-literal", "room-aware"])
def test_paper_ordering_when_queues_build_up(room_aware_misses: bool) -> None:
    """With memory pressure and load (the regime of the paper's Figure 4, where LB saturates),
    LB > LALB > LALB-O3 in both average latency and miss ratio at working set 35."""
    lb, lalb, o3 = (
        run(p, rpm=450, memory_mb=6144, room_aware_misses=room_aware_misses) for p in ("lb", "lalb", "lalb-o3")
    )
    assert lb.avg_latency_s > lalb.avg_latency_s > o3.avg_latency_s
    assert lb.miss_ratio > lalb.miss_ratio > o3.miss_ratio


def test_o3_limit_zero_reproduces_lalb_on_the_whole_trace() -> None:
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=35), paper_table1())
    lalb = simulate(workload, "lalb")
    o3_zero = simulate(workload, "lalb-o3", max_num_skips=0)
    assert lalb.to_json() | {"policy": "x"} == o3_zero.to_json() | {"policy": "x"}


def test_room_aware_misses_evict_less_than_algorithm_2_to_the_letter() -> None:
    literal, room_aware = run("lalb", room_aware_misses=False), run("lalb", room_aware_misses=True)
    assert room_aware.miss_ratio < literal.miss_ratio


def test_utilization_counts_inference_only() -> None:
    result = run("lb", working_set=15)
    # 1950 requests x Table I inference times (about 1.3 s) over 12 GPUs and the makespan.
    assert 0.4 < result.gpu_utilization < 0.7


def test_same_seed_same_result_and_other_seed_differs() -> None:
    assert run("lalb-o3", seed=3) == run("lalb-o3", seed=3)
    assert run("lalb-o3", seed=3) != run("lalb-o3", seed=4)


# --- the ground truth, on hand-built workloads --------------------------------------------------


def tiny(arrivals: list[tuple[float, str]], models: dict[str, int] | None = None) -> Workload:
    """Requests (arrival, model) of functions fn-<model>; every model takes 1000 MB, loads in
    2 s and runs a call of 32 samples in 1 s."""
    names = models if models is not None else {"A": 1000, "B": 1000}
    requests = [Request(f"r{i:06d}", f"fn-{m}", m, at_s, 32) for i, (at_s, m) in enumerate(arrivals)]
    return Workload(
        requests=requests,
        profiles=[ModelProfile(m, "rtx2080", size, 2.0, 1.0, 32) for m, size in names.items()],
        function_models={f"fn-{m}": m for m in names},
        top_function=f"fn-{next(iter(names))}",
        start_minute=0,
        minutes=1,
    )


def run_tiny(
    workload: Workload,
    *,
    slots: int = 1,
    exponent: float = 1.0,
    batching: Batching | None = None,
    gpus: int = 1,
    interference: float | None = None,
) -> SimResult:
    cluster = ClusterConfig(
        gpus=gpus, gpu_memory_mb=4000, slots=slots, batch_exponent=exponent, interference=interference
    )
    per_function = None if batching is None else dict.fromkeys(workload.function_models, batching)
    return simulate(workload, "lalb", cluster=cluster, batching=per_function)


def test_one_slot_runs_a_miss_for_load_plus_inference_and_a_hit_for_inference() -> None:
    result = run_tiny(tiny([(0.0, "A"), (0.5, "A"), (10.0, "A")]))
    # r0 misses (0 -> 3); r1 waits for the GPU and hits (3 -> 4); r2 hits (10 -> 11).
    assert (result.misses, result.hits, result.parks) == (1, 2, 0)
    assert result.avg_latency_s == pytest.approx((3.0 + 3.5 + 1.0) / 3)
    assert result.makespan_s == pytest.approx(11.0)
    assert (result.batches, result.avg_batch_calls, result.slots) == (3, 1.0, 1)
    assert result.gpu_utilization == pytest.approx(3.0 / 11.0)


def test_without_batching_calls_on_one_gpu_share_its_compute_in_turn() -> None:
    result = run_tiny(tiny([(0.0, "A")] * 4), slots=4)
    # All four start at once (one miss, three hits on the loading worker); the load takes 2 s,
    # then the GPU computes the four calls one after another: they end at 3, 4, 5 and 6.
    assert (result.misses, result.hits, result.parks) == (1, 3, 0)
    assert result.avg_latency_s == pytest.approx(4.5)
    assert result.batches == 4


@pytest.mark.parametrize(("exponent", "end_s"), [(1.0, 6.0), (0.5, 4.0)])
def test_a_batch_of_k_calls_takes_k_to_the_batch_exponent_times_one_call(exponent: float, end_s: float) -> None:
    result = run_tiny(tiny([(0.0, "A")] * 4), slots=4, exponent=exponent, batching=Batching(max_batch_size=4))
    # One batch of the four calls once the model is loaded at t=2: 4**exponent seconds.
    assert (result.batches, result.avg_batch_calls, result.max_batch_size) == (1, 4.0, 4)
    assert result.avg_latency_s == pytest.approx(end_s) and result.makespan_s == pytest.approx(end_s)
    assert result.gpu_utilization == pytest.approx((end_s - 2.0) / end_s)


def test_batches_hold_at_most_max_batch_size_calls_in_dispatch_order() -> None:
    result = run_tiny(tiny([(0.0, "A")] * 5), slots=5, batching=Batching(max_batch_size=2))
    # Loaded at 2: batches of 2, 2 and 1 calls (2 s, 2 s, 1 s): calls end at 4, 4, 6, 6 and 7.
    assert result.batches == 3
    assert result.avg_latency_s == pytest.approx((4 + 4 + 6 + 6 + 7) / 5)


def test_a_free_worker_waits_up_to_max_batch_wait_for_more_calls() -> None:
    warm = [(0.0, "A")]  # loads the model until 2, waits 5 ms for company, runs 2.005 -> 3.005
    arrivals = [*warm, (10.0, "A"), (10.004, "A"), (10.5, "A")]
    result = run_tiny(tiny(arrivals), slots=3, batching=Batching(max_batch_size=2, max_batch_wait_ms=5.0))
    # 10.0: the worker waits for a second call; 10.004: it comes, the batch of two runs 10.004 ->
    # 12.004. 10.5: a third call waits for the worker, which then waits 5 ms: 12.009 -> 13.009.
    assert result.batches == 3
    assert result.makespan_s == pytest.approx(13.009)
    assert result.avg_latency_s == pytest.approx((3.005 + 2.004 + 2.0 + 2.509) / 4)


def test_a_wait_that_a_full_batch_ended_early_does_not_stretch_the_makespan() -> None:
    # Loaded at 2, the worker waits up to 5 s (until 7) for a second call; it comes at 2.5 and the
    # batch of two runs 2.5 -> 4.5. The run ends there, not when the wait would have (7).
    result = run_tiny(tiny([(0.0, "A"), (2.5, "A")]), slots=2, batching=Batching(2, 5000.0))
    assert result.avg_latency_s == pytest.approx((4.5 + 2.0) / 2)
    assert result.makespan_s == pytest.approx(4.5)
    assert result.gpu_utilization == pytest.approx(2.0 / 4.5)


def test_with_one_slot_a_batching_worker_waits_in_vain() -> None:
    result = run_tiny(tiny([(0.0, "A"), (10.0, "A")]), batching=Batching(max_batch_size=4, max_batch_wait_ms=50.0))
    # D = 1: no second call can reach the worker, so every batch is one call, 50 ms late.
    assert result.avg_batch_calls == 1.0
    assert result.avg_latency_s == pytest.approx((3.05 + 1.05) / 2)


def test_batches_of_different_models_take_the_gpus_compute_in_turn() -> None:
    warm = [(0.0, "A"), (0.0, "B")]  # both load at once (a transfer each): done at 2, computed 2-3, 3-4
    result = run_tiny(tiny([*warm, (10.0, "A"), (10.0, "B")]), slots=2)
    assert result.avg_latency_s == pytest.approx((3.0 + 4.0 + 1.0 + 2.0) / 4)


@pytest.mark.parametrize(
    ("interference", "latencies"),
    [
        # Warm at 3 (one miss each, loaded together at 2, then computed side by side); at 10, A
        # and B run together: each at 1 + i times one call's time.
        (0.0, (3.0, 3.0, 1.0, 1.0)),  # no interference: D calls in the time of one
        (0.5, (3.5, 3.5, 1.5, 1.5)),
        (1.0, (4.0, 4.0, 2.0, 2.0)),  # no gain over one at a time: all end when the last would
    ],
)
def test_with_interference_batches_of_different_models_run_at_once_slowed_down(
    interference: float, latencies: tuple[float, ...]
) -> None:
    arrivals = [(0.0, "A"), (0.0, "B"), (10.0, "A"), (10.0, "B")]
    result = run_tiny(tiny(arrivals), slots=2, interference=interference)
    assert result.avg_latency_s == pytest.approx(sum(latencies) / 4)
    assert result.interference == interference
    # Utilization counts each call's compute alone, as without interference.
    assert result.gpu_utilization == pytest.approx(4.0 / result.makespan_s)


def test_with_interference_a_batch_that_joins_slows_the_one_running_and_speeds_up_when_it_ends() -> None:
    # A runs alone from 10 (hit); B (warm) joins at 10.5: both at half speed (i = 1) until A's
    # remaining 0.5 s of compute is done at 11.5; B then has 0.5 s left, alone: ends at 12.
    arrivals = [(0.0, "A"), (0.0, "B"), (10.0, "A"), (10.5, "B")]
    result = run_tiny(tiny(arrivals), slots=2, interference=1.0)
    assert result.avg_latency_s == pytest.approx((4.0 + 4.0 + 1.5 + 1.5) / 4)
    assert result.makespan_s == pytest.approx(12.0)


def test_interference_must_be_a_non_negative_number() -> None:
    with pytest.raises(ValueError, match="interference"):
        ClusterConfig(interference=-0.5)


def test_a_load_does_not_hold_the_gpus_compute() -> None:
    warm = [(0.0, "A")]  # 0 -> 3
    result = run_tiny(tiny([*warm, (10.0, "B"), (10.0, "A")]), slots=2)
    # At 10, B starts loading (until 12) while A computes (10 -> 11); B computes 12 -> 13.
    assert result.avg_latency_s == pytest.approx((3.0 + 3.0 + 1.0) / 3)


def test_calls_dispatched_at_one_instant_reach_the_worker_together() -> None:
    result = run_tiny(tiny([(0.0, "A")] * 2 + [(20.0, "A")] * 2), slots=2, batching=Batching(max_batch_size=2))
    # Two batches of two: at 2 (when the load ends) and at 20, with no wait needed.
    assert result.batches == 2 and result.avg_batch_calls == 2.0
    assert result.avg_latency_s == pytest.approx((4.0 + 4.0 + 2.0 + 2.0) / 4)


def test_adaptive_d_sees_a_gpu_busy_back_to_back_as_busy() -> None:
    """A call loads (0 -> 3), then one arrives as each completes (3, 4, ..., 20): the GPU never
    idles, so adaptive D steps down. (It read it as idle: the controller counted the calls before
    each pass placed the new one, so it saw none running and kept D at its maximum.)"""
    workload = tiny([(0.0, "A")] + [(3.0 + k, "A") for k in range(18)])
    cluster = ClusterConfig(gpus=1, gpu_memory_mb=4000, slots=2, adaptive_slots=2, utilization_threshold=0.9)
    result = simulate(workload, "lalb-o3", cluster=cluster)
    assert result.makespan_s == pytest.approx(21.0)
    assert result.slot_changes >= 1 and result.avg_slots < 1.5


def test_the_staged_exit_releases_at_its_checks_not_at_the_next_call() -> None:
    """A model used until 3 leaves its GPU at the first check (every 2.5 s: a quarter of 10 s, as
    the service's releaser) 10 s after, at 15, and the host tier 50 s after that, at 65: the call at
    100 loads it from disk. (The simulator checked only at events: both stages ran at 100, the
    call took it back from the host tier, and the GPU held it the whole gap.)"""
    cluster = ClusterConfig(gpus=1, host_memory_mb=4000, gpu_idle_release_s=10.0, host_idle_release_s=50.0)
    result = simulate(tiny([(0.0, "A"), (100.0, "A")]), "lalb-o3", cluster=cluster)
    assert (result.swap_ins, result.releases) == (0, 2)
    assert result.avg_latency_s == pytest.approx(3.0)
    assert result.avg_gpu_memory_gb == pytest.approx(1000 * (15.0 + 3.0) / 103.0 / 1024)


def test_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match="slots"):
        ClusterConfig(slots=0)
    with pytest.raises(ValueError, match="batch_exponent"):
        ClusterConfig(batch_exponent=0.0)
    with pytest.raises(ValueError, match="max_batch_size"):
        Batching(max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_wait_ms"):
        Batching(max_batch_wait_ms=-1.0)


# --- coldest victim at concurrency 1 --------------------------------------------------------------


def test_coldest_victim_lowers_misses_one_call_at_a_time_on_two_small_gpus() -> None:
    """Calls 10 s apart (a miss takes 3 s), Zipf 1.1 over 8 equal 100 MB models, on 2 GPUs x 300 MB
    (three models each), both idle and full at every call: a miss on the GPU being filled churns
    its three models while the other GPU's stay frozen, good or bad."""

    def miss_ratios(coldest: bool) -> list[float]:
        cluster = ClusterConfig(gpus=2, gpu_memory_mb=300)
        return [
            simulate(
                zipf_workload(calls=1000, models=8, zipf_exponent=1.1, memory_mb=100, gap_s=10.0, seed=seed),
                "lalb",
                cluster=cluster,
                coldest_victim_misses=coldest,
            ).miss_ratio
            for seed in range(20)
        ]

    filling, coldest = miss_ratios(False), miss_ratios(True)
    assert statistics.fmean(coldest) < 0.9 * statistics.fmean(filling)
    assert max(coldest) < 0.8 * max(filling)


def test_jitter_has_mean_one_and_the_asked_spread_and_none_at_zero() -> None:
    jitter = Jitter(0.3, seed=7)
    draws = [jitter.factor() for _ in range(40_000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.01)
    assert statistics.stdev(draws) / statistics.fmean(draws) == pytest.approx(0.3, abs=0.01)
    assert min(draws) > 0
    exact = Jitter(0.0, seed=7)
    assert {exact.factor() for _ in range(100)} == {1.0}


def test_timing_noise_makes_estimates_inexact_reproducibly() -> None:
    counts = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(counts, WorkloadConfig(working_set=25), paper_table1())

    def noisy(spread: float, seed: int) -> SimResult:
        return simulate(workload, "lalb-o3", cluster=ClusterConfig(timing_spread=spread, timing_seed=seed))

    exact = noisy(0.0, 0)
    assert exact == simulate(workload, "lalb-o3")  # spread 0 is the exact model, whatever the seed
    assert exact == noisy(0.0, 5)
    first = noisy(0.25, 1)
    assert first == noisy(0.25, 1)  # reproducible from its seed
    assert first != noisy(0.25, 2)
    assert first.timing_spread == 0.25 and first.completed == first.requests
    assert first.avg_latency_s != exact.avg_latency_s


def test_timing_noise_reaches_each_load_and_batch() -> None:
    # One GPU, A then B then A: with noise the load (2 s) and each call (1 s) take other times.
    workload = tiny([(0.0, "A"), (0.0, "A"), (10.0, "B")])
    exact = run_tiny(workload)
    assert exact.makespan_s == pytest.approx(10.0 + 2.0 + 1.0)
    noisy = simulate(workload, "lalb", cluster=ClusterConfig(gpus=1, gpu_memory_mb=4000, timing_spread=0.5))
    assert noisy.makespan_s != pytest.approx(exact.makespan_s)
    assert noisy.completed == 3


def test_the_latency_floor_is_the_calls_own_compute_and_no_policy_averages_below_it() -> None:
    # Equal models, 1 s of compute per call, no noise, one call at a time per GPU: the floor is 1 s.
    workload = zipf_workload(calls=400, models=12, zipf_exponent=1.1, memory_mb=1000, gap_s=0.3, seed=5)
    for policy in ("lb", "lalb", "lalb-o3", "mqfq-sticky", "torpor"):
        result = simulate(workload, policy, cluster=ClusterConfig(gpus=4, gpu_memory_mb=4000))
        assert result.floor_latency_s == pytest.approx(1.0)
        assert result.avg_latency_s >= result.floor_latency_s


def test_policy_options_carry_every_option_of_a_policy_config() -> None:
    config = PolicyConfig(mqfq_overrun_s=7.0, literal_visits=True, torpor_alpha_period_s=3.0)
    options = policy_options(config)
    # Every knob but the limit a sweep varies per run: a flag `gpufaas sim` takes reaches the policy.
    assert (
        set(options)
        == set(PolicyOptions.__annotations__)
        == {f.name for f in dataclasses.fields(PolicyConfig)} - {"max_num_skips"}
    )
    assert options["mqfq_overrun_s"] == 7.0 and options["literal_visits"] and options["torpor_alpha_period_s"] == 3.0
    assert PolicyConfig(max_num_skips=config.max_num_skips, **options) == config


def test_calls_per_batch_counts_the_calls_batches_held_not_those_cut_before() -> None:
    """600 calls a minute of 3 functions on 2 GPUs of D = 1, batches of up to 4: most calls are
    dispatched and cut at their deadline before a batch takes them. Calls per batch is what the
    batches held (1 each: D = 1); it divided every dispatched call by the batches, 5.9 calls a
    batch of at most 4."""
    config = WorkloadConfig(minutes=1, rpm=600, working_set=3)
    workload = build_workload(load_trace(shipped_trace(), "azure2019"), config, paper_table1())
    batching = dict.fromkeys(workload.function_models, Batching(4, 5.0))
    result = simulate(workload, "lalb-o3", cluster=ClusterConfig(gpus=2), batching=batching)
    assert result.timed_out > 0
    assert result.avg_batch_calls == 1.0
