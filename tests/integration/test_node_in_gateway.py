"""A node in the gateway's process (`gpufaas up --node-in-gateway`, with the scheduler there too):
calls run over in-memory links, the node's workers go with a killed gateway and the node comes back
with it, and a scheduler apart and a second gateway reach that node over the wire (its TLS as a
node's)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from gateway.router import IN_PROCESS
from gpufaas.dev.local_cluster import LocalCluster, recorded_pids
from gpufaas.processes import descendants, survivors
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_scheduler_in_gateway import call, gateway_log, wait_for_log

pytestmark = pytest.mark.integration


def all_in_gateway(make_cluster: ClusterFactory, **options: object) -> LocalCluster:
    base: dict[str, object] = {"nodes": 1, "gpus_per_node": 1, "backend": "cpu", "gpu_memory_mb": 1000}
    return make_cluster(**{**base, **options, "scheduler_in_gateway": True, "node_in_gateway": True})


def test_calls_run_on_the_node_in_the_gateways_process_over_in_memory_links(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = all_in_gateway(make_cluster, gpus_per_node=2)
    assert sorted(cluster.components) == ["gateway"]  # neither the scheduler nor the node has a process
    assert json.loads((cluster.state_dir / "cluster.json").read_text())["in_gateway"] == ["scheduler", "node0"]
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    first, second = call(cluster, "sleepy"), call(cluster, "sleepy")
    assert (first.status_code, second.status_code) == (200, 200), (first.text, second.text)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
    # The scheduler attached the node, and the router reached it, without a socket.
    wait_for_log(cluster, "attached from in-process", 1)
    linked = [line for line in gateway_log(cluster).splitlines() if "linked to the node at" in line]
    assert linked and all(line.endswith(IN_PROCESS) for line in linked), linked
    # The worker that answered is the gateway's descendant; the node's metrics are served as a node's.
    gateway_pid = recorded_pids(cluster.state_dir)["gateway"]
    assert first.json()["pid"] in descendants(gateway_pid)
    assert httpx.get(f"http://{cluster.metrics_addresses['node0']}/healthz", timeout=10).status_code == 200


def test_a_killed_gateway_takes_its_nodes_workers_with_it_and_serves_again_once_restarted(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = all_in_gateway(make_cluster)
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    assert call(cluster, "sleepy").headers["X-Cache"] == "miss"
    gateway_pid = recorded_pids(cluster.state_dir)["gateway"]
    workers = descendants(gateway_pid)
    assert workers  # the zygote, a spare, the model's worker
    # SIGKILL to the gateway alone, not its process group (which its workers share): the node's pool
    # cannot stop them, so each (and the zygote) must see its socket to the pool close and exit.
    os.kill(gateway_pid, signal.SIGKILL)
    assert survivors(workers, grace_s=15.0) == []
    cluster.restart("gateway")
    wait_for_log(cluster, f"connected to the scheduler at {cluster.scheduler_address}{IN_PROCESS}", 2)
    response = call(cluster, "sleepy")
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "miss"  # a new incarnation of the node: its models load again


def test_a_scheduler_apart_and_another_gateway_reach_the_node_in_a_gateways_process_over_tls(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """The rest of the cluster reaches the embedded node as any node: its wire port shows the node's
    certificate (a scheduler and a gateway both dial it expecting one), only its own gateway links
    in memory."""
    cluster = make_cluster(
        gateways=2, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, node_in_gateway=True
    )
    assert cluster.tls and sorted(cluster.components) == ["balancer", "gateway0", "gateway1", "scheduler"]
    deploy(cluster, "sleepy", "sleepy_function", tmp_path)
    for name in ("gateway0", "gateway1", "gateway1"):
        response = call(cluster, "sleepy", cluster.gateway_urls[name])
        assert response.status_code == 200, (name, response.text)
    attached = [line for line in gateway_log(cluster, "gateway0").splitlines() if "attached from" in line]
    assert attached and "in-process" not in attached[-1], attached  # the scheduler's process, over TCP
    wait_for_log(cluster, "linked to the node at", 1, name="gateway1")
    assert IN_PROCESS not in gateway_log(cluster, "gateway1")
    linked = [line for line in gateway_log(cluster, "gateway0").splitlines() if "linked to the node at" in line]
    assert linked and all(line.endswith(IN_PROCESS) for line in linked), linked


def test_a_gateway_stopped_by_sigterm_stops_the_node_and_scheduler_in_it_first(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    # uvicorn raised the SIGTERM it stopped for again, its handler restored to the default: the
    # process died of it (status -15) before the node in it revoked its lease, shut its workers
    # down and removed its host pool.
    cluster = all_in_gateway(make_cluster)
    gateway = cluster.components["gateway"]
    process = gateway.process
    assert process is not None
    gateway.stop()
    assert process.returncode == 0
