"""A policy knob set the way `gpufaas up` sets it changes the real scheduler's decisions as it
changes the simulator's: the same calls, one at a time, give the real cluster the misses the
simulator predicts under each setting, and the settings differ. The knobs go in as `gpufaas up`
passes them: scheduler flags, read by the scheduler's settings model and rendered into its
command line by the local cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.profiles import ModelProfile
from gpufaas.types import Request
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import invoke

pytestmark = pytest.mark.integration


def simulated_misses(calls: list[str], memory_mb: dict[str, int], cluster: ClusterConfig, **knobs: Any) -> int:
    """The simulator's misses for `calls` under lalb-o3 (the local cluster's policy), each long
    done before the next arrives, as the real calls below are made."""
    profiles = [ModelProfile(name, "cpu", mb, 1.0, 0.1, 1) for name, mb in memory_mb.items()]
    requests = [Request(f"r{i:06d}", name, name, arrival_s=100.0 * i, batch_size=1) for i, name in enumerate(calls)]
    workload = Workload(requests, profiles, {name: name for name in memory_mb}, calls[0], 0, 1)
    result = simulate(workload, "lalb-o3", cluster=cluster, **knobs)
    assert result.completed == len(calls)
    return result.misses


def real_caches(cluster: LocalCluster, calls: list[str], memory_mb: dict[str, int], tmp_path: Path) -> list[str]:
    """X-Cache of each of `calls` on `cluster`, one at a time (the functions deployed first)."""
    for name, mb in memory_mb.items():
        deploy(cluster, name, "linear_function", tmp_path, memory_mb=mb)
    caches = []
    for name in calls:
        response = invoke(cluster, name)
        assert response.status_code == 200, response.text
        caches.append(response.headers["X-Cache"])
    return caches


# One GPU of 3000 MB, a heavy model (>= 2048 MB, the heaviness eviction's line) and two light ones:
# loading `light-b` after `heavy` and `light-a` must evict one. LRU evicts `heavy` (the least
# recently used), heaviness a light model (cheap to bring back), so `heavy`'s next call hits.
HEAVY_AND_LIGHT_MB = {"heavy": 2100, "light-a": 500, "light-b": 500}
HEAVY_AND_LIGHT_CALLS = ["heavy", "light-a", "light-b", "heavy", "light-a"]


@pytest.mark.parametrize(("eviction", "expected_misses"), [("lru", 5), ("heaviness", 4)])
def test_the_eviction_choice_reaches_the_real_scheduler_as_the_simulator_takes_it(
    make_cluster: ClusterFactory, tmp_path: Path, eviction: str, expected_misses: int
) -> None:
    one_gpu = ClusterConfig(gpus=1, gpus_per_node=1, gpu_memory_mb=3000, gpu_type="cpu", eviction=eviction)
    assert simulated_misses(HEAVY_AND_LIGHT_CALLS, HEAVY_AND_LIGHT_MB, one_gpu) == expected_misses
    cluster = make_cluster(
        nodes=1,
        gpus_per_node=1,
        backend="cpu",
        gpu_memory_mb=3000,
        scheduler_flags=["--eviction", eviction],  # `gpufaas up --eviction` / --scheduler-args
        node_flags=["--extra-spares", "0", "--host-cache-mb", "0"],
    )
    assert cluster.scheduler_settings().eviction == eviction
    caches = real_caches(cluster, HEAVY_AND_LIGHT_CALLS, HEAVY_AND_LIGHT_MB, tmp_path)
    assert caches.count("miss") == expected_misses, caches
    assert caches[3] == ("hit" if eviction == "heaviness" else "miss")  # `heavy` kept, or evicted


# Two GPUs that hold one model each, two models called in turn. Room-aware misses put the second
# model on the other idle GPU (then every call hits); Algorithm 2 to the letter loads each miss on
# the GPU being filled, evicting the other model every time.
ALTERNATING_MB = {"lin-a": 800, "lin-b": 800}
ALTERNATING_CALLS = ["lin-a", "lin-b", "lin-a", "lin-b", "lin-a"]


@pytest.mark.parametrize(
    ("flags", "room_aware_misses", "expected_misses"),
    [([], True, 2), (["--no-room-aware-misses"], False, 5)],
    ids=["room-aware", "literal"],
)
def test_a_policy_config_knob_reaches_the_real_scheduler_as_the_simulator_takes_it(
    make_cluster: ClusterFactory, tmp_path: Path, flags: list[str], room_aware_misses: bool, expected_misses: int
) -> None:
    two_gpus = ClusterConfig(gpus=2, gpus_per_node=2, gpu_memory_mb=1000, gpu_type="cpu")
    predicted = simulated_misses(ALTERNATING_CALLS, ALTERNATING_MB, two_gpus, room_aware_misses=room_aware_misses)
    assert predicted == expected_misses
    cluster = make_cluster(
        nodes=1,
        gpus_per_node=2,
        backend="cpu",
        gpu_memory_mb=1000,
        scheduler_flags=flags,  # `gpufaas up --no-room-aware-misses`
        node_flags=["--extra-spares", "0", "--host-cache-mb", "0"],
    )
    assert cluster.scheduler_settings().policy_config.room_aware_misses is room_aware_misses
    caches = real_caches(cluster, ALTERNATING_CALLS, ALTERNATING_MB, tmp_path)
    assert caches.count("miss") == expected_misses, caches
