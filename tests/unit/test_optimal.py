"""The offline optimum (simulator.optimal) against a brute force over every eviction choice, on
small random sequences, with one size and with several."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

import pytest

from simulator.optimal import Optimum, belady_misses, optimal_misses

pytest.importorskip("scipy")


def brute_force_misses(sequence: Sequence[tuple[str, int]], capacity_mb: int) -> int:
    """Every way of choosing victims, breadth first: the states after each request (what the
    cache holds) with the fewest misses to reach each. Evicting only on a miss loses nothing."""
    sizes = dict(sequence)
    states: dict[frozenset[str], int] = {frozenset(): 0}
    for model, mb in sequence:
        following: dict[frozenset[str], int] = {}
        for held, misses in states.items():
            if model in held:
                options, cost = [held], 0
            else:
                options, cost = [], 1
                for k in range(len(held) + 1):
                    for kept in itertools.combinations(sorted(held), k):
                        if sum(sizes[m] for m in kept) + mb <= capacity_mb:
                            options.append(frozenset(kept) | {model})
            for state in options:
                if misses + cost < following.get(state, len(sequence) + 1):
                    following[state] = misses + cost
        states = following
    return min(states.values())


def random_sequence(rng: random.Random, models: int, length: int, sizes: Sequence[int]) -> list[tuple[str, int]]:
    size_of = {f"m{i}": rng.choice(sizes) for i in range(models)}
    weights = [1 / (i + 1) for i in range(models)]  # skewed, as traces are
    return [(m, size_of[m]) for m in rng.choices(sorted(size_of), weights=weights, k=length)]


@pytest.mark.parametrize("seed", range(40))
def test_models_of_one_size_belady_is_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    sequence = random_sequence(rng, models=6, length=14, sizes=[100])
    capacity_mb = rng.choice([100, 200, 300, 400])
    optimum = optimal_misses(sequence, capacity_mb)
    assert optimum == Optimum(14, brute_force_misses(sequence, capacity_mb), True, "belady")


@pytest.mark.parametrize("seed", range(60))
def test_models_of_several_sizes_the_integer_program_is_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(1000 + seed)
    sequence = random_sequence(rng, models=6, length=14, sizes=[1, 2, 3])
    capacity_mb = rng.choice([3, 4, 5, 6])
    optimum = optimal_misses(sequence, capacity_mb)
    assert optimum.exact and optimum.method in ("integer-program", "belady")
    assert optimum.misses == brute_force_misses(sequence, capacity_mb)


def test_belady_beats_lru_on_a_loop_and_sizes_make_furthest_first_wrong() -> None:
    cyclic = ["a", "b", "c"] * 4
    assert belady_misses(cyclic, 2) == 7  # LRU misses all 12 on this loop
    # With sizes, evicting the model needed furthest away is not optimal: when big2 arrives, MIN
    # evicts small (needed last), which frees too little, then big1 as well: 5 misses. Evicting
    # big1 alone keeps small for its hit: 4.
    sequence = [("big1", 2), ("small", 1), ("big2", 2), ("big1", 2), ("small", 1)]
    assert optimal_misses(sequence, 3) == Optimum(5, 4, True, "integer-program")
    assert brute_force_misses(sequence, 3) == 4


def test_what_cannot_fit_is_left_out_and_a_bad_capacity_is_refused() -> None:
    assert optimal_misses([("huge", 500), ("a", 100), ("a", 100)], 200) == Optimum(2, 1, True, "belady")
    assert optimal_misses([], 100) == Optimum(0, 0, True, "belady")
    with pytest.raises(ValueError, match="capacity_mb"):
        optimal_misses([("a", 1)], 0)


def test_no_eviction_policy_goes_below_the_floor_and_frequency_beats_recency_on_zipf() -> None:
    from simulator.engine import ClusterConfig, simulate
    from simulator.report import workload_optimum
    from simulator.workload import zipf_workload

    # One call at a time (10 s apart, each done in 3 s): the service order is the arrival order.
    workload = zipf_workload(calls=1500, models=60, zipf_exponent=1.1, memory_mb=1000, gap_s=10.0, seed=3)
    cluster = ClusterConfig(gpus=4, gpu_memory_mb=4096)
    floor = workload_optimum(workload, cluster)
    assert floor.exact and floor.method == "belady"
    ratios = {
        eviction: simulate(workload, "lalb-o3", cluster=dataclasses.replace(cluster, eviction=eviction)).miss_ratio
        for eviction in ("lru", "heaviness", "tinylfu")
    }
    assert all(ratio >= floor.miss_ratio for ratio in ratios.values()), (ratios, floor)
    assert ratios["tinylfu"] < ratios["lru"]
