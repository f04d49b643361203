"""Fault injection over the real control plane: a node dies, the scheduler restarts, a worker dies."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, EtcdTarget, deploy
from tests.integration.test_control_plane import etcd_state_when, wait_for

pytestmark = pytest.mark.integration


def call(cluster: LocalCluster, name: str, sleep_s: float = 0.0, client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(
        f"{cluster.gateway_url}/function/{name}", json={"sleep_s": sleep_s}, timeout=60, headers=cluster.invoke_headers
    )


def sleepy_on_one_node(
    make_cluster: ClusterFactory, tmp_path: Path, name: str, *, gpus: int
) -> tuple[LocalCluster, str, httpx.Response]:
    """A cpu cluster of one node with `gpus` GPUs of 1000 MB, and `name` (sleepy_function) deployed
    there and called once: the cluster, the function's model and that first answer."""
    cluster = make_cluster(nodes=1, gpus_per_node=gpus, backend="cpu", gpu_memory_mb=1000)
    model = str(deploy(cluster, name, "sleepy_function", tmp_path)["model"])
    return cluster, model, call(cluster, name)


NOTICED_WITHIN_S = 0.5
"""How soon after a node's death its gateway's loop reads the close of its link to it (a few ms, on a loaded host)."""


def test_killing_a_gpu_manager_mid_burst_loses_no_invocation(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """Every call is answered: those sent after the kill run on the other node; one running on the
    killed node (or sent to it before its gateway saw it die) is answered 502 "outcome unknown"
    (at most once: it may have had effects, so it is not run again), and nothing else fails."""
    cluster = make_cluster(nodes=2, gpus_per_node=2, backend="cpu", gpu_memory_mb=1000)
    for name in ("slow-a", "slow-b"):
        deploy(cluster, name, "sleepy_function", tmp_path)
        assert call(cluster, name).status_code == 200
    completed: list[tuple[float, float, httpx.Response]] = []  # (sent, answered, response)
    lock = threading.Lock()
    killed_at: list[float] = []

    def one(i: int, client: httpx.Client) -> None:
        sent = time.monotonic()
        response = call(cluster, ("slow-a", "slow-b")[i % 2], 0.3, client)
        with lock:
            completed.append((sent, time.monotonic(), response))
            if len(completed) == 4 and not killed_at:
                # SIGKILL the whole node (its GPU manager and its workers), mid-burst.
                cluster.components["node0"].stop(kill=True)
                killed_at.append(time.monotonic())

    with httpx.Client() as client, ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: one(i, client), range(24)))

    assert killed_at, "the node was never killed"
    assert len(completed) == 24
    failures = [(sent, r.status_code, r.text) for sent, _, r in completed if r.status_code != 200]
    unknown = [f for f in failures if f[1] == 502 and "is unknown" in f[2] and "not run again" in f[2]]
    assert failures == unknown, failures  # only calls whose outcome is unknown
    # In flight at the kill, or sent before the gateway could see it: a call sent on its link to the
    # node in the moment between the node's death and the gateway's loop reading the link's close
    # is written into a socket the node never reads, and the gateway cannot tell that from a frame
    # the node read before it died (CI saw one sent 62 us after the kill answered so).
    assert all(sent < killed_at[0] + NOTICED_WITHIN_S for sent, _, _ in unknown), (killed_at, unknown)
    assert len(unknown) <= 6, unknown  # at most the calls in flight
    # Whatever finished after the kill ran on the surviving node.
    late = [r.headers["X-Gpu"] for _, t, r in completed if t > killed_at[0] + 0.2 and r.status_code == 200]
    assert late and all(gpu.startswith("node1/") for gpu in late), late
    # Once the dead node's lease expires, its GPUs are gone from the cluster view.
    wait_for(
        lambda: (
            {g["node"] for g in httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth).json()}
            == {"node1"}
        )
    )


def test_scheduler_restart_rebuilds_its_cache_state_from_the_nodes_and_etcd(
    make_cluster: ClusterFactory, tmp_path: Path, etcd_endpoint: EtcdTarget
) -> None:
    cluster = make_cluster(nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    for name in ("warm-a", "warm-b"):
        deploy(cluster, name, "sleepy_function", tmp_path)
        assert call(cluster, name).headers["X-Cache"] == "miss"
    # Both halves written (the LRU lists and the replicas are separate keys, persisted together
    # but read one after the other here).
    lru_before, replicas_before = etcd_state_when(
        etcd_endpoint.endpoint,
        etcd_endpoint.root,
        lambda state: sum(len(m) for m in state[0].values()) == 2 and sum(len(g) for g in state[1].values()) == 2,
    )

    # No orderly shutdown: the new scheduler learns the resident models from the nodes that run
    # them (and their order from etcd).
    cluster.restart("scheduler", kill=True)

    def in_memory() -> dict[str, list[str]]:
        return {
            g["gpu"]: g["lru"] for g in httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth).json()
        }

    wait_for(lambda: in_memory() == lru_before)
    lru_after, replicas_after = etcd_state_when(
        etcd_endpoint.endpoint, etcd_endpoint.root, lambda state: state == (lru_before, replicas_before)
    )
    assert (lru_after, replicas_after) == (lru_before, replicas_before)
    # Invocations continue, and hit the workers that survived the scheduler's restart.
    for name in ("warm-a", "warm-b"):
        response = call(cluster, name)
        assert response.status_code == 200, response.text
        assert response.headers["X-Cache"] == "hit"


def test_a_worker_dying_mid_request_is_retried_elsewhere_and_its_cache_entry_dropped(
    make_cluster: ClusterFactory, tmp_path: Path, etcd_endpoint: EtcdTarget
) -> None:
    cluster, model, first = sleepy_on_one_node(make_cluster, tmp_path, "fragile", gpus=2)
    worker_pid = first.json()["pid"]
    results: list[httpx.Response] = []
    caller = threading.Thread(target=lambda: results.append(call(cluster, "fragile", 2.0)))
    caller.start()
    time.sleep(0.7)  # the call is inside predict() now
    os.kill(worker_pid, signal.SIGKILL)
    caller.join(timeout=60)

    (response,) = results
    assert response.status_code == 200, response.text
    assert response.json()["pid"] != worker_pid  # a fresh worker served the retry ...
    assert response.headers["X-Gpu"] != first.headers["X-Gpu"]  # ... on the other GPU
    assert response.headers["X-Cache"] == "miss"
    # The dead worker's entry was dropped and the retry's load recorded: one replica, in etcd too.
    lru, _ = etcd_state_when(
        etcd_endpoint.endpoint, etcd_endpoint.root, lambda state: state[1] == {model: [response.headers["X-Gpu"]]}
    )
    assert sum(models.count(model) for models in lru.values()) == 1


def test_a_worker_dying_between_calls_leaves_the_cache_within_a_reconcile_period(
    make_cluster: ClusterFactory, tmp_path: Path, etcd_endpoint: EtcdTarget
) -> None:
    from scheduler.reconciler import RECONCILE_S

    cluster, model, first = sleepy_on_one_node(make_cluster, tmp_path, "idle", gpus=1)
    etcd_state_when(etcd_endpoint.endpoint, etcd_endpoint.root, lambda state: model in state[1])
    killed_at = time.monotonic()
    os.kill(first.json()["pid"], signal.SIGKILL)  # no call runs: nothing tells the scheduler but reconciliation
    etcd_state_when(
        etcd_endpoint.endpoint, etcd_endpoint.root, lambda state: model not in state[1], timeout_s=RECONCILE_S + 5.0
    )
    assert time.monotonic() - killed_at < RECONCILE_S + 5.0
    response = call(cluster, "idle")
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "miss" and response.json()["pid"] != first.json()["pid"]


def test_a_node_key_deleted_by_hand_comes_back_with_its_gpus_and_their_models(
    make_cluster: ClusterFactory, tmp_path: Path, etcd_endpoint: EtcdTarget
) -> None:
    import asyncio

    from gpufaas.keys import Keys
    from gpufaas.store import EtcdStore

    cluster, _, first = sleepy_on_one_node(make_cluster, tmp_path, "steady", gpus=2)
    assert first.headers["X-Cache"] == "miss"

    async def delete_key() -> None:
        store = await EtcdStore.open(etcd_endpoint.endpoint)
        try:
            assert await store.delete(Keys(etcd_endpoint.root).node("node0"))
        finally:
            await store.close()

    started = time.monotonic()
    asyncio.run(delete_key())
    wait_for(
        lambda: len(httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth).json()) == 2, timeout_s=5.0
    )
    assert time.monotonic() - started < 5.0
    response = call(cluster, "steady")
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "hit"  # the worker survived, and the scheduler adopted it again
