"""Scheduler shards: rendezvous homes (balance, stability, hot functions), spills, and the simulation's parts."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.shard_sim import (
    ShardSimConfig,
    cpu_figures,
    lindley_responses,
    one_scheduler_limit_gpus,
    run_figures,
    shard_cost_s,
    simulate_shards,
)
from scheduler.shards import ShardLoad, ShardMap, SpillRule, home_count, rendezvous_rank
from simulator.workload import zipf_workload

FUNCTIONS = [f"fn-{index}" for index in range(6_000)]


def shard_names(count: int) -> tuple[str, ...]:
    return tuple(f"shard{index:02d}" for index in range(count))


def homes_of(shards: tuple[str, ...]) -> dict[str, str]:
    plain = ShardMap(shards, {})
    return {function: plain.homes(function)[0] for function in FUNCTIONS}


@pytest.mark.parametrize("count", [2, 8, 16])
def test_functions_spread_evenly_over_the_shards(count: int) -> None:
    per_shard = Counter(homes_of(shard_names(count)).values())
    fair = len(FUNCTIONS) / count
    assert set(per_shard) == set(shard_names(count))
    # 6,000 keys: a binomial's spread is ~sqrt(fair): 5 % of the 375 keys a shard has at 16.
    assert max(per_shard.values()) < fair * 1.15
    assert min(per_shard.values()) > fair * 0.85


@pytest.mark.parametrize("count", [1, 4, 8])
def test_adding_a_shard_moves_about_one_in_k_plus_one_functions_and_only_to_it(count: int) -> None:
    before = homes_of(shard_names(count))
    after = homes_of(shard_names(count + 1))
    moved = [function for function in FUNCTIONS if before[function] != after[function]]
    assert {after[function] for function in moved} == {shard_names(count + 1)[-1]}
    share = len(moved) / len(FUNCTIONS)
    assert share == pytest.approx(1 / (count + 1), rel=0.1)


def test_removing_a_shard_moves_only_its_functions() -> None:
    before = homes_of(shard_names(6))
    kept = tuple(shard for shard in shard_names(6) if shard != "shard03")
    after = homes_of(kept)
    moved = {function for function in FUNCTIONS if before[function] != after[function]}
    assert moved == {function for function in FUNCTIONS if before[function] == "shard03"}


def test_the_rank_is_the_same_whatever_the_order_of_the_shards() -> None:
    shards = list(shard_names(5))
    assert rendezvous_rank("fn-7", shards) == rendezvous_rank("fn-7", list(reversed(shards)))


def test_a_hot_function_gets_homes_in_proportion_to_its_share() -> None:
    assert home_count(0.0, 8) == 1
    assert home_count(0.05, 8) == 1  # 0.05 * 8 / 0.5 = 0.8
    assert home_count(0.1, 8) == 2
    assert home_count(0.68, 8) == 8  # the trace's hottest function: every shard
    assert home_count(0.68, 16) == 16
    with pytest.raises(ValueError):
        home_count(0.1, 0)


def test_a_hot_functions_calls_spread_over_its_homes_which_prefix_its_rank() -> None:
    shards = shard_names(8)
    hot = ShardMap(shards, {"fn-hot": 0.2})
    homes = hot.homes("fn-hot")
    assert homes == rendezvous_rank("fn-hot", shards)[:4]
    calls = Counter(hot.home_of_call("fn-hot", f"call-{index}") for index in range(8_000))
    assert set(calls) == set(homes)
    assert min(calls.values()) > 2_000 * 0.9
    cold = ShardMap(shards, {"fn-hot": 0.2})
    assert {cold.home_of_call("fn-cold", f"call-{index}") for index in range(100)} == {cold.homes("fn-cold")[0]}


def load(shard: str, idle_gpus: int, queued: int = 0, *models: str) -> ShardLoad:
    return ShardLoad(shard, idle_gpus, queued, frozenset(models))


def test_a_home_with_the_model_on_an_idle_gpu_keeps_the_call() -> None:
    home = load("a", 1, 5, "m")
    assert SpillRule().target("m", home, [load("b", 40, 0, "m")]) == "a"


def test_a_remote_idle_holder_beats_a_local_load_when_spilling_for_hits() -> None:
    home = load("a", 3, 0, "other")
    others = [load("b", 2, 0, "m"), load("c", 9, 0, "m"), load("d", 50, 0)]
    assert SpillRule().target("m", home, others) == "c"
    assert SpillRule(spill_for_hits=False).target("m", home, others) == "a"


def test_a_full_home_spills_to_a_holder_else_the_roomiest_shard() -> None:
    home = load("a", 0, 3)
    assert SpillRule(spill_for_hits=False).target("m", home, [load("b", 1, 0, "m"), load("c", 9)]) == "b"
    assert SpillRule().target("m", home, [load("b", 4, 2), load("c", 4, 1), load("d", 0, 0)]) == "c"


def test_a_full_home_below_its_queue_bound_or_with_nowhere_to_go_keeps_the_call() -> None:
    home = load("a", 0, 3)
    assert SpillRule(queue_bound=4).target("m", home, [load("b", 9)]) == "a"
    assert SpillRule(queue_bound=3).target("m", home, [load("b", 9)]) == "b"
    assert SpillRule().target("m", home, [load("b", 0, 0), load("c", 0, 7)]) == "a"
    assert SpillRule().target("m", home, []) == "a"
    with pytest.raises(ValueError):
        SpillRule(queue_bound=-1)


def test_a_shard_process_queues_its_messages_first_come_first_served() -> None:
    responses = lindley_responses([(0.0, 1.0, "a"), (0.0, 1.0, "b"), (0.5, 1.0, "c"), (10.0, 1.0, "d")])
    assert responses == {"a": 1.0, "b": 2.0, "c": 2.5, "d": 1.0}


def test_one_scheduler_serves_the_gpus_whose_calls_fill_its_core() -> None:
    # No growth with size: n x 0.45 calls/s x 450 us = 1 at n = 4,938.
    assert one_scheduler_limit_gpus(450.0, 0.45, 1.0, 1.0) == pytest.approx(4938, abs=1)
    assert shard_cost_s(450.0, 10_000, 1.3) == pytest.approx(585e-6)
    assert shard_cost_s(450.0, 100, 1.3) == pytest.approx(450e-6 / 1.3)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_the_sharded_run_places_every_call_once_on_its_own_shards_gpus(shards: int) -> None:
    workload = zipf_workload(calls=300, models=6, zipf_exponent=1.0, memory_mb=3000, gap_s=0.02, seed=0)
    run = simulate_shards(workload, ShardSimConfig(gpus=16, shards=shards), window_s=10.0)
    assert len(run.calls) == 300
    assert sum(run.shard_gpus.values()) == 16 and len(run.shard_gpus) == shards
    for call in run.calls.values():
        assert call.shard in run.shard_gpus and call.arrival_s <= call.at_shard_s <= call.dispatch_s
        assert call.spilled == (call.shard != call.home)
    figures = run_figures(run, warmup_s=0.0)
    assert figures["spills"] == sum(call.spilled for call in run.calls.values())
    if shards == 1:
        assert figures["spill_rate"] == 0.0 and figures["busiest_shard_share"] == 1.0
    else:
        assert figures["spills"] > 0  # 6 models on 16 GPUs: some home lacks an idle copy another shard has
    cpu = cpu_figures(run, 450.0, 1.0, 0.25, 0.0)
    assert cpu["capacity_placements_per_s"] <= shards / 450e-6


def test_a_run_without_measured_calls_says_so_rather_than_divide_by_zero() -> None:
    workload = zipf_workload(calls=20, models=3, zipf_exponent=1.0, memory_mb=3000, gap_s=0.02, seed=0)
    run = simulate_shards(workload, ShardSimConfig(gpus=16, shards=2), window_s=10.0)  # all arrive by 0.4 s
    with pytest.raises(ValueError, match="no call arrived between 5 s and 10 s"):
        run_figures(run, warmup_s=5.0)
