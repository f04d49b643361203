"""A handler that lies about its memory, on a real cluster (process runtime, cpu backend): the
scheduler's books keep the declared size whatever the worker reports (gpu_manager.workers'
`book_memory`; docs/security.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_metrics import scrape
from tests.scrape import sample

pytestmark = pytest.mark.integration

GPU_MB = 2000
SETTLE_S = 10.0


def call(cluster: LocalCluster, name: str) -> httpx.Response:
    response = httpx.post(f"{cluster.gateway_url}/function/{name}", json={}, headers=cluster.invoke_headers, timeout=60)
    assert response.status_code == 200, response.text
    return response


def the_gpu(cluster: LocalCluster) -> dict[str, Any]:
    (gpu,) = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10).json()
    return gpu  # type: ignore[no-any-return]


def settled(read: Callable[[], Any], expected: Any) -> Any:
    """`read()` once it gives `expected`, or what it gives after SETTLE_S (a Done reaches the
    scheduler after the call's reply, and the gateway's view follows the scheduler's)."""
    deadline = time.monotonic() + SETTLE_S
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def over_declared(cluster: LocalCluster) -> float:
    text = scrape(cluster, "node0", cluster.metrics_token).text
    return sample(text, "gpufaas_node_models_over_declared_total", source="claimed")


def test_a_worker_under_reporting_its_memory_is_booked_at_its_declared_size(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=GPU_MB)
    liar = deploy(cluster, "under", "memory_liar_function", tmp_path, memory_mb=1800, environment={"CLAIM_MB": "1"})
    assert call(cluster, "under").json()["claimed_mb"] == 1
    call(cluster, "under")  # a hit: its Done carries the worker's report too
    booked = {"lru": [liar["model"]], "memory_used_mb": 1800}
    view = settled(lambda: {k: the_gpu(cluster)[k] for k in booked}, booked)
    assert view == booked  # not 1 MB: room for 1,999 more that the GPU does not have
    # An 800 MB model does not fit beside it: the liar is evicted, nothing is overcommitted.
    other = deploy(cluster, "other", "echo_function", tmp_path, memory_mb=800)
    call(cluster, "other")
    after = {"lru": [other["model"]], "memory_used_mb": 800}
    assert settled(lambda: {k: the_gpu(cluster)[k] for k in after}, after) == after


def test_a_worker_over_reporting_its_memory_is_booked_at_its_declared_size_and_counted(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=GPU_MB)
    liar = deploy(cluster, "over", "memory_liar_function", tmp_path, memory_mb=100, environment={"CLAIM_MB": "1999"})
    call(cluster, "over")
    call(cluster, "over")
    booked = {"lru": [liar["model"]], "memory_used_mb": 100}
    assert settled(lambda: {k: the_gpu(cluster)[k] for k in booked}, booked) == booked  # not the whole GPU
    assert settled(lambda: over_declared(cluster), 1.0) == 1.0  # logged and counted once, not per call
    # A 1,800 MB model fits beside it: the liar keeps its place.
    other = deploy(cluster, "other", "echo_function", tmp_path, memory_mb=1800)
    call(cluster, "other")
    both = {"memory_used_mb": 1900, "models": {liar["model"], other["model"]}}
    assert (
        settled(
            lambda: {"memory_used_mb": the_gpu(cluster)["memory_used_mb"], "models": set(the_gpu(cluster)["lru"])}, both
        )
        == both
    )
