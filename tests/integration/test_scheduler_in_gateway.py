"""A scheduler in the gateway's process (`gpufaas up --scheduler-in-gateway`): calls are placed over
the in-memory link, and the gateway killed with its scheduler comes back to the models its nodes
kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from gateway.router import IN_PROCESS
from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import wait_for

pytestmark = pytest.mark.integration


def call(cluster: LocalCluster, name: str, gateway_url: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{gateway_url or cluster.gateway_url}/function/{name}",
        json={"sleep_s": 0},
        timeout=60,
        headers=cluster.invoke_headers,
    )


def gateway_log(cluster: LocalCluster, name: str = "gateway") -> str:
    return (cluster.state_dir / "logs" / f"{name}.log").read_text()


def wait_for_log(cluster: LocalCluster, text: str, count: int, timeout_s: float = 30.0, name: str = "gateway") -> None:
    deadline = time.monotonic() + timeout_s
    while gateway_log(cluster, name).count(text) < count:
        tail = gateway_log(cluster, name)[-2000:]
        assert time.monotonic() < deadline, f"{text!r} not logged {count} time(s) by {name}: {tail}"
        time.sleep(0.1)


def test_calls_are_placed_by_the_scheduler_in_the_gateways_process(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=1000, scheduler_in_gateway=True)
    assert "scheduler" not in cluster.components  # no process of its own
    wait_for_log(cluster, f"connected to the scheduler at {cluster.scheduler_address}{IN_PROCESS}", 1)
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    first, second = call(cluster, "sleepy"), call(cluster, "sleepy")
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
    # The cluster view is asked of the scheduler over the same link; its metrics are served as a
    # scheduler process's are.
    gpus = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10).json()
    assert {gpu["gpu"]: len(gpu["lru"]) for gpu in gpus}[first.headers["X-Gpu"]] == 1
    health = httpx.get(f"http://{cluster.metrics_addresses['scheduler']}/healthz", timeout=10)
    assert health.status_code == 200


def test_a_gateway_killed_with_its_scheduler_comes_back_to_the_models_the_node_kept(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, scheduler_in_gateway=True)
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    assert call(cluster, "sleepy").headers["X-Cache"] == "miss"
    cluster.restart("gateway", kill=True)  # SIGKILL: the scheduler's term ends with its process
    # The new scheduler leads once the dead one's leadership lease lapses, learns the resident
    # model from the node, and the gateway links to it in memory again.
    wait_for_log(cluster, f"connected to the scheduler at {cluster.scheduler_address}{IN_PROCESS}", 2)
    response = call(cluster, "sleepy")
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "hit"


def test_with_two_gateways_the_leader_moves_into_a_gateway_and_out_of_it_when_that_gateway_dies(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """scheduler0 runs in gateway0's process, scheduler1 apart. With scheduler1 stopped, scheduler0
    leads: gateway0 links to it in memory, gateway1 over TCP, and both serve. gateway0 SIGKILLed
    takes the leader with it: scheduler1, started again, leads, and gateway1 serves."""
    cluster = make_cluster(
        gateways=2, schedulers=2, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, scheduler_in_gateway=True
    )
    assert "scheduler0" not in cluster.components and "scheduler1" in cluster.components
    first, second = cluster.gateway_urls["gateway0"], cluster.gateway_urls["gateway1"]
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    cluster.components["scheduler1"].stop(kill=True)  # if it led, scheduler0 takes over
    embedded = cluster.scheduler_addresses["scheduler0"]
    wait_for_log(cluster, f"connected to the scheduler at {embedded}{IN_PROCESS}", 1, timeout_s=60, name="gateway0")
    for url in (first, second):
        response = call(cluster, "sleepy", url)
        assert response.status_code == 200, response.text

    cluster.components["gateway0"].stop(kill=True)
    cluster.components["scheduler1"].start(dict(os.environ))
    wait_for(lambda: call(cluster, "sleepy", second).status_code == 200, timeout_s=60)
    assert call(cluster, "sleepy", second).headers["X-Cache"] == "hit"  # the node kept its worker
