"""Every branch of Algorithms 1 and 2 (lalb, lalb-o3) and of the lb baseline, on hand-built clusters."""

from __future__ import annotations

import dataclasses

import pytest

from gpufaas.errors import ModelTooLarge, UnknownModel, UnknownPolicy
from gpufaas.types import GpuSpec, ModelSpec
from scheduler import Dispatch, Park, PolicyConfig, Scheduler, make_policy
from tests.builders import cache_on, make_request, make_scheduler, run_on, submit


def decided(decisions: list[Dispatch | Park]) -> list[tuple[str, str, str, bool | None]]:
    """(kind, request model, gpu, hit) per decision: compact to assert on."""
    return [
        ("dispatch", d.request.model, d.gpu_id, d.hit)
        if isinstance(d, Dispatch)
        else ("park", d.request.model, d.gpu_id, None)
        for d in decisions
    ]


# --- Algorithm 1 ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_local_queue_runs_before_the_global_queue(policy: str) -> None:
    s = make_scheduler(policy, gpus=2)
    cache_on(s, "g1", "A")
    running = run_on(s, "g1", "A", now=0.0)  # g1 busy until t=1 (hit: inference only)
    other = run_on(s, "g0", "B", now=0.0)  # g0 busy too
    submit(s, "A", now=0.1)  # A is cached on busy g1, wait 0.9 s < load 2 s: park there
    # The park decision needs an idle GPU to trigger the policy: free g0 first.
    s.on_complete(other.request_id, 0.2)
    first = s.schedule(0.2)
    assert decided(first)[0] == ("park", "A", "g1", None)
    submit(s, "C", now=0.3)
    submit(s, "A", now=0.3)
    s.on_complete(running.request_id, 1.0)
    # g1 runs its parked A before anything in the global queue (and g0 is busy with C).
    assert decided(s.schedule(1.0))[0] == ("dispatch", "A", "g1", True)


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
@pytest.mark.parametrize(
    ("gpus", "holder"),
    [
        (2, "g0"),
        # g0 is offered work first; the model is on idle g2: Algorithm 2 line 5 sends it there.
        (3, "g2"),
    ],
    ids=["the-idle-gpu-offered-work", "another-idle-gpu"],
)
def test_a_request_goes_to_an_idle_gpu_that_holds_its_model(policy: str, gpus: int, holder: str) -> None:
    s = make_scheduler(policy, gpus=gpus)
    cache_on(s, holder, "A")
    submit(s, "A")
    assert decided(s.schedule(0.0)) == [("dispatch", "A", holder, True)]


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_park_on_busy_gpu_when_its_finish_time_beats_the_load_time(policy: str) -> None:
    s = make_scheduler(policy, gpus=2)
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A", now=0.0)  # busy until t=1.0
    submit(s, "A", now=0.5)
    decisions = s.schedule(0.5)  # wait 0.5 s < load 2 s
    assert decided(decisions) == [("park", "A", "g1", None)]
    assert isinstance(decisions[0], Park) and decisions[0].est_wait_s == pytest.approx(0.5)
    assert list(s.gpu("g1").local_queue) == [decisions[0].request]
    assert s.gpu("g0").idle


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_miss_on_idle_gpu_when_the_busy_gpu_would_finish_later_than_a_load(policy: str) -> None:
    s = make_scheduler(policy, gpus=2)
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A", now=0.0)
    cache_on(s, "g1", "B")
    (parked,) = submit(s, "B", now=0.0)
    s.park(parked, "g1", 0.0)  # g1: 1 s running + 1 s parked = 2 s of work
    submit(s, "A", now=0.0)
    decisions = s.schedule(0.0)  # wait 2.0 s is not < load 2.0 s: a miss that balances load
    assert decided(decisions) == [("dispatch", "A", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].false_miss


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_model_cached_nowhere_is_a_miss_on_the_first_idle_gpu(policy: str) -> None:
    s = make_scheduler(policy, gpus=3)
    submit(s, "A")
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "A", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and not decisions[0].false_miss
    assert decisions[0].est_load_time_s == pytest.approx(2.0)


def test_idle_gpus_are_offered_work_fastest_first_then_by_id() -> None:
    s = make_scheduler("lalb", gpus=3, speeds={"g2": 2.0})
    submit(s, "A", "B", "C")
    assert [d.gpu_id for d in s.schedule(0.0)] == ["g2", "g0", "g1"]


def test_in_order_lalb_does_not_let_a_hit_jump_the_queue() -> None:
    s = make_scheduler("lalb", gpus=1)
    cache_on(s, "g0", "A")
    submit(s, "B", "A")
    # B is older: in-order LALB serves it (a miss) although A would hit.
    assert decided(s.schedule(0.0)) == [("dispatch", "B", "g0", False)]


def test_o3_dispatches_a_younger_hit_and_counts_skips() -> None:
    s = make_scheduler("lalb-o3", gpus=1, max_num_skips=25)
    cache_on(s, "g0", "A")
    b, c, _ = submit(s, "B", "C", "A")
    assert decided(s.schedule(0.0)) == [("dispatch", "A", "g0", True)]
    assert s.queue.num_skips(b.request_id) == 1
    assert s.queue.num_skips(c.request_id) == 1


def passed_over(s: Scheduler, times: int) -> float:
    """On a one-GPU scheduler: cache A on g0 and submit B; then `times` times submit A, which is
    dispatched to g0 (a hit) ahead of B, whose count of skips (or visits) goes 1, 2, ..., and
    completes a second later. Then submit A once more; the time it is."""
    cache_on(s, "g0", "A")
    (b,) = submit(s, "B")
    now = 0.0
    for expected_skips in range(1, times + 1):
        (a,) = submit(s, "A", now=now)
        assert decided(s.schedule(now)) == [("dispatch", "A", "g0", True)]
        assert s.queue.num_skips(b.request_id) == expected_skips
        now += 1.0
        s.on_complete(a.request_id, now)
    submit(s, "A", now=now)
    return now


def test_o3_skip_limit_forces_the_starving_request() -> None:
    s = make_scheduler("lalb-o3", gpus=1, max_num_skips=2)
    now = passed_over(s, 2)
    # B has been passed over twice (the limit): it goes now, hit or miss (here a miss).
    assert decided(s.schedule(now)) == [("dispatch", "B", "g0", False)]


def test_o3_forced_request_still_uses_locality_elsewhere() -> None:
    s = make_scheduler("lalb-o3", gpus=2, max_num_skips=0)
    cache_on(s, "g0", "A")
    cache_on(s, "g1", "B")
    submit(s, "B", "A")
    # Limit 0: g0 must place B first; B's model is on idle g1 (hit there), then A hits on g0.
    assert decided(s.schedule(0.0)) == [("dispatch", "B", "g1", True), ("dispatch", "A", "g0", True)]


def _scenario(policy: str, max_num_skips: int) -> list[tuple[str, str, str, bool | None]]:
    s = make_scheduler(policy, gpus=3, max_num_skips=max_num_skips)
    cache_on(s, "g0", "A", "B")
    cache_on(s, "g1", "C")
    run_on(s, "g1", "C", now=0.0)
    submit(s, "D", "C", "E", "A", "C", "B", "F", now=0.0)
    log = decided(s.schedule(0.0))
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        for gpu in list(s.gpus()):
            for request_id, finish_s in list(gpu.expected_finish_s.items()):
                if finish_s <= t:
                    s.on_complete(request_id, t)
        submit(s, "A", "D", now=t)
        log += decided(s.schedule(t))
    return log


def test_limit_zero_is_exactly_lalb() -> None:
    assert _scenario("lalb-o3", 0) == _scenario("lalb", 0)
    assert _scenario("lalb-o3", 25) != _scenario("lalb", 0)


# --- Algorithm 1 read literally (literal_visits) ---------------------------------------------


def test_literal_visits_count_every_pass_even_without_a_dispatch_ahead() -> None:
    s = make_scheduler("lalb-o3", gpus=1, max_num_skips=25, literal_visits=True)
    _, c = submit(s, "B", "C")
    # No request's model is cached on g0: the scan visits B and C (+1 each), then Algorithm 2
    # places B (a miss here). The default counting would count nothing: nothing jumped ahead.
    assert decided(s.schedule(0.0)) == [("dispatch", "B", "g0", False)]
    assert s.queue.num_skips(c.request_id) == 1
    default = make_scheduler("lalb-o3", gpus=1, max_num_skips=25)
    _, c2 = submit(default, "B", "C")
    default.schedule(0.0)
    assert default.queue.num_skips(c2.request_id) == 0


def test_literal_limit_zero_still_lets_a_hit_pass_a_request_once() -> None:
    # Limit 0 read literally: a request is forced only when its visits are *higher* than 0, so
    # the first scan visits B and dispatches the younger hit A; the next scan forces B.
    s = make_scheduler("lalb", gpus=1, literal_visits=True)
    cache_on(s, "g0", "A")
    b, a = submit(s, "B", "A")
    assert decided(s.schedule(0.0)) == [("dispatch", "A", "g0", True)]
    assert s.queue.num_skips(b.request_id) == 1
    s.on_complete(a.request_id, 1.0)
    submit(s, "A", now=1.0)
    assert decided(s.schedule(1.0)) == [("dispatch", "B", "g0", False)]
    # The default reading of limit 0 is strict arrival order.
    strict = make_scheduler("lalb", gpus=1)
    cache_on(strict, "g0", "A")
    submit(strict, "B", "A")
    assert decided(strict.schedule(0.0)) == [("dispatch", "B", "g0", False)]


def test_literal_limit_is_exceeded_not_reached() -> None:
    s = make_scheduler("lalb-o3", gpus=1, max_num_skips=2, literal_visits=True)
    now = passed_over(s, 3)  # at 2 visits (= the limit) B may still be passed
    assert decided(s.schedule(now)) == [("dispatch", "B", "g0", False)]  # 3 > 2: forced


# --- lb ------------------------------------------------------------------------------------


def test_lb_takes_the_head_regardless_of_locality() -> None:
    s = make_scheduler("lb", gpus=2)
    cache_on(s, "g1", "A")
    submit(s, "A")
    # g0 is offered the head first and takes it: a miss although idle g1 holds A.
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "A", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].false_miss


def test_lb_hits_when_the_head_lands_on_a_gpu_holding_it() -> None:
    s = make_scheduler("lb", gpus=1)
    cache_on(s, "g0", "A")
    submit(s, "A")
    assert decided(s.schedule(0.0)) == [("dispatch", "A", "g0", True)]


# --- evictions through the scheduler ----------------------------------------------------------


def test_miss_evicts_from_the_lru_tail_and_never_a_pinned_model() -> None:
    s = make_scheduler("lalb", gpus={"g0": 3000, "g1": 3000}, models={"A": 1000, "B": 1000, "C": 1000, "D": 2000})
    cache_on(s, "g0", "A", "B", "C")  # LRU order: A (oldest), B, C
    cache_on(s, "g1", "A")
    run_on(s, "g1", "A", now=0.0)
    submit(s, "D")
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "D", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("A", "B")
    assert s.cache.gpu("g0").lru_list() == ["D", "C"]
    assert s.cache.gpus_with("A") == {"g1"}


# --- refusals -------------------------------------------------------------------------------


def test_model_larger_than_every_gpu_is_refused_at_submit() -> None:
    s = make_scheduler("lalb", gpus={"g0": 4000}, models={"huge": 5000})
    with pytest.raises(ModelTooLarge, match=r"5000 MB.*4000 MB"):
        submit(s, "huge")
    assert len(s.queue) == 0


def test_unknown_model_is_refused() -> None:
    s = make_scheduler("lalb")
    with pytest.raises(UnknownModel, match="'nope'"):
        submit(s, "nope")


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(UnknownPolicy, match="valid policies: lalb, lalb-o3, lb"):
        make_policy("nonsense")


def test_model_that_fits_only_some_gpus_waits_for_one_that_fits() -> None:
    s = make_scheduler("lalb", gpus={"g0": 1000, "g1": 4000}, models={"A": 1000, "big": 3000})
    run_on(s, "g1", "A", now=0.0)
    submit(s, "big", "A")
    # g0 cannot hold "big": it stays queued, and the younger A runs on g0 instead.
    assert decided(s.schedule(0.0)) == [("dispatch", "A", "g0", False)]
    assert [r.model for r in s.queue] == ["big"]


def test_park_on_the_busy_holder_that_frees_up_first() -> None:
    s = make_scheduler("lalb", gpus=4)
    for gpu_id, start_s in (("g1", 0.0), ("g2", 0.6), ("g3", 0.3)):
        cache_on(s, gpu_id, "A")
        run_on(s, gpu_id, "A", now=start_s)  # busy until start + 1 s
    submit(s, "A", now=0.8)
    decisions = s.schedule(0.8)
    assert decided(decisions) == [("park", "A", "g1", None)]
    assert isinstance(decisions[0], Park) and decisions[0].est_wait_s == pytest.approx(0.2)
    # g1 now has 1 s of parked work: the next A request parks on g3 (free at 1.3 s).
    submit(s, "A", now=0.8)
    assert decided(s.schedule(0.8)) == [("park", "A", "g3", None)]


def test_model_too_big_for_the_gpu_being_filled_misses_on_an_idle_gpu_it_fits() -> None:
    s = make_scheduler("lalb", gpus={"g0": 1000, "g1": 4000}, models={"A": 1000, "big": 3000}, speeds={"g0": 2.0})
    cache_on(s, "g1", "A")
    submit(s, "big", "A")
    # g0 is offered work first but cannot hold "big": in arrival order, big takes g1 (a miss that
    # evicts nothing, 1000 + 3000 fit), then A misses on g0.
    assert decided(s.schedule(0.0)) == [("dispatch", "big", "g1", False), ("dispatch", "A", "g0", False)]


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_miss_goes_to_an_idle_gpu_with_room_rather_than_evicting(policy: str) -> None:
    s = make_scheduler(policy, gpus={"g0": 1000, "g1": 1000}, models={"A": 1000, "B": 1000})
    cache_on(s, "g0", "A")
    submit(s, "B")
    # g0 is offered work first but holds A; g1 is idle and empty: B loads there, A stays warm.
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "B", "g1", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ()


def test_algorithm_2_to_the_letter_misses_on_the_gpu_being_filled() -> None:
    s = make_scheduler("lalb", gpus={"g0": 1000, "g1": 1000}, models={"A": 1000, "B": 1000})
    s.policy = make_policy("lalb", PolicyConfig(room_aware_misses=False))
    cache_on(s, "g0", "A")
    submit(s, "B")
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "B", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("A",)


@pytest.mark.parametrize("policy", ["lb", "lalb", "lalb-o3"])
def test_a_required_gpu_type_is_honoured(policy: str) -> None:
    s = make_scheduler(policy, gpus=0, models={})
    s.add_gpu(GpuSpec("t4", 8000, gpu_type="t4"))
    s.add_gpu(GpuSpec("h100", 8000, gpu_type="h100"))
    s.register_model(ModelSpec("needs-h100", 1000, gpu_type="h100"))
    submit(s, "needs-h100")
    # "t4" is offered work first (by id), but the model may only run on the h100.
    assert [d.gpu_id for d in s.schedule(0.0)] == ["h100"]


def test_a_gpu_type_the_cluster_lacks_is_refused_at_submit() -> None:
    s = make_scheduler("lalb", gpus=1, models={})
    s.register_model(ModelSpec("needs-a100", 1000, gpu_type="a100"))
    with pytest.raises(ModelTooLarge, match=r"needs a a100 GPU.*GPU types here: rtx2080"):
        submit(s, "needs-a100")


# --- coldest victim ------------------------------------------------------------------------------


def two_full_gpus(policy: str = "lalb", **kwargs: bool) -> Scheduler:
    """g0 and g1 (3000 MB) each full with three 1000 MB models; g1's were used long ago."""
    s = make_scheduler(policy, gpus={"g0": 3000, "g1": 3000}, models={m: 1000 for m in "ABCDEFG"}, **kwargs)
    cache_on(s, "g1", "A", "B", "C")
    cache_on(s, "g0", "D", "E", "F")
    return s


@pytest.mark.parametrize("policy", ["lalb", "lalb-o3"])
def test_a_miss_that_must_evict_evicts_the_coldest_model_of_the_idle_gpus(policy: str) -> None:
    s = two_full_gpus(policy)
    submit(s, "G")
    # g0 is offered work first, but g1's least recently used model (A) is colder than g0's (D).
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "G", "g1", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("A",)


@pytest.mark.parametrize(
    "config", [PolicyConfig(coldest_victim_misses=False), PolicyConfig(room_aware_misses=False)], ids=["off", "literal"]
)
def test_without_coldest_victim_or_room_awareness_the_miss_evicts_on_the_gpu_being_filled(
    config: PolicyConfig,
) -> None:
    s = two_full_gpus()
    s.policy = make_policy("lalb", config)
    submit(s, "G")
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "G", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("D",)


def test_a_hit_refreshes_recency_across_gpus() -> None:
    s = two_full_gpus()
    (a,) = submit(s, "A")
    assert decided(s.schedule(0.0)) == [("dispatch", "A", "g1", True)]  # A is now the hottest model
    s.on_complete(a.request_id, 1.0)
    submit(s, "G", now=1.0)
    # g1's coldest is B now, still colder than g0's D: G lands on g1 and evicts B.
    decisions = s.schedule(1.0)
    assert decided(decisions) == [("dispatch", "G", "g1", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("B",)


@pytest.mark.parametrize("coldest", [True, False])
def test_one_call_at_a_time_cycling_over_four_models_stops_thrashing(coldest: bool) -> None:
    """The low-load case that motivated it: with every GPU idle and full, misses always landed on
    the GPU being filled, whose three slots cannot hold a cycle of four models (LRU misses every
    time) while the other GPU's models stay frozen."""
    s = two_full_gpus(coldest_victim_misses=coldest)
    misses, now = 0, 0.0
    for model in "DEFG" * 6:
        (request,) = submit(s, model, now=now)
        (decision,) = s.schedule(now)
        assert isinstance(decision, Dispatch)
        misses += not decision.hit
        now += 10.0
        s.on_complete(request.request_id, now)
    # Coldest victim: G evicts g1's cold A once, then D, E, F, G all stay resident.
    assert misses == (1 if coldest else 21)


def test_the_coldest_victim_honours_avoid_gpu_and_required_gpu_types() -> None:
    s = two_full_gpus()
    s.submit(dataclasses.replace(make_request("G"), avoid_gpu="g1"))  # its worker just died on g1
    assert decided(s.schedule(0.0)) == [("dispatch", "G", "g0", False)]

    s = make_scheduler("lalb", gpus=0, models={})
    s.add_gpu(GpuSpec("fast", 1000, gpu_type="h100"))
    s.add_gpu(GpuSpec("old", 1000, gpu_type="t4"))
    for name, gpu_type in (("X", None), ("Y", None), ("Z", "h100")):
        s.register_model(ModelSpec(name, 1000, gpu_type=gpu_type))
    cache_on(s, "old", "X")  # the coldest model, on a GPU Z may not use
    cache_on(s, "fast", "Y")
    submit(s, "Z")
    assert [d.gpu_id for d in s.schedule(0.0)] == ["fast"]


def test_the_coldest_victim_skips_gpus_whose_models_in_use_leave_no_room() -> None:
    s = make_scheduler("lalb", gpus={"g0": 3000, "g1": 3000}, models={m: 1000 for m in "ABCDEFG"}, slots=3)
    s.register_model(ModelSpec("H", 2000))
    cache_on(s, "g1", "A", "B", "C")
    cache_on(s, "g0", "D", "E", "F")
    run_on(s, "g1", "B")  # g1 keeps a free slot, but B and C in use leave 1000 MB: H cannot load there
    run_on(s, "g1", "C")
    submit(s, "H")
    decisions = s.schedule(0.0)
    assert decided(decisions) == [("dispatch", "H", "g0", False)]
    assert isinstance(decisions[0], Dispatch) and decisions[0].evict == ("D", "E")
