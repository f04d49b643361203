"""A policy knob set the way `gpufaas up` sets it changes the real scheduler's decisions as it
changes the simulator's: the same call pattern, on one GPU, under each eviction choice, gives the
real cluster the hits and misses the simulator predicts, and the two choices differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufaas.profiles import ModelProfile
from gpufaas.types import Request
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import invoke

pytestmark = pytest.mark.integration

# One GPU of 3000 MB, a heavy model (>= 2048 MB, the heaviness eviction's line) and two light ones:
# loading `light-b` after `heavy` and `light-a` must evict one. LRU evicts `heavy` (the least
# recently used), heaviness a light model (cheap to bring back), so `heavy`'s next call hits.
GPU_MEMORY_MB = 3000
MEMORY_MB = {"heavy": 2100, "light-a": 500, "light-b": 500}
CALLS = ["heavy", "light-a", "light-b", "heavy", "light-a"]


def simulated_misses(eviction: str) -> int:
    """The simulator's misses for CALLS, one at a time (each long done before the next arrives)."""
    profiles = [ModelProfile(name, "cpu", mb, 1.0, 0.1, 1) for name, mb in MEMORY_MB.items()]
    requests = [Request(f"r{i:06d}", name, name, arrival_s=100.0 * i, batch_size=1) for i, name in enumerate(CALLS)]
    workload = Workload(requests, profiles, {name: name for name in MEMORY_MB}, "heavy", 0, 1)
    cluster = ClusterConfig(gpus=1, gpus_per_node=1, gpu_memory_mb=GPU_MEMORY_MB, gpu_type="cpu", eviction=eviction)
    result = simulate(workload, "lalb-o3", cluster=cluster)
    assert result.completed == len(CALLS)
    return result.misses


@pytest.mark.parametrize(("eviction", "expected_misses"), [("lru", 5), ("heaviness", 4)])
def test_the_eviction_choice_reaches_the_real_scheduler_as_the_simulator_takes_it(
    make_cluster: ClusterFactory, tmp_path: Path, eviction: str, expected_misses: int
) -> None:
    assert simulated_misses(eviction) == expected_misses  # the prediction, and the two choices differ
    # As `gpufaas up --scheduler-args "--eviction heaviness"` passes it: a scheduler flag, checked
    # by the scheduler's settings and rendered into its command line by the local cluster.
    cluster = make_cluster(
        nodes=1,
        gpus_per_node=1,
        backend="cpu",
        gpu_memory_mb=GPU_MEMORY_MB,
        scheduler_flags=["--eviction", eviction],
        node_flags=["--extra-spares", "0", "--host-cache-mb", "0"],
    )
    assert cluster.scheduler_settings().eviction == eviction
    for name, memory_mb in MEMORY_MB.items():
        deploy(cluster, name, "linear_function", tmp_path, memory_mb=memory_mb)
    caches = []
    for name in CALLS:
        response = invoke(cluster, name)
        assert response.status_code == 200, response.text
        caches.append(response.headers["X-Cache"])
    assert caches.count("miss") == expected_misses, caches
    assert caches[3] == ("hit" if eviction == "heaviness" else "miss")  # `heavy` kept, or evicted
