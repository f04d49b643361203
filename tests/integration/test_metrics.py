"""Prometheus metrics from every daemon of a real cluster, scraped as a Prometheus server would."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas import credentials
from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import invoke
from tests.scrape import sample


def scrape(cluster: LocalCluster, component: str, token: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(f"http://{cluster.metrics_addresses[component]}/metrics", headers=headers, timeout=10)


def eventually(read: object, expected: float, timeout_s: float = 10.0) -> float:
    """`read()` once it returns `expected` (Done messages reach the scheduler after the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()  # type: ignore[operator]
        if value == expected or time.monotonic() > deadline:
            return value  # type: ignore[no-any-return]
        time.sleep(0.1)


@pytest.mark.integration
def test_every_daemon_counts_the_calls_made_hits_misses_and_evictions(
    make_cluster: ClusterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One GPU that holds one 800 MB model: every change of model evicts the one before.
    # Spares exactly as configured (none made ahead for a burst of misses): the counts below are exact.
    cluster = make_cluster(
        nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, node_flags=["--extra-spares", "0"]
    )
    # Errors counted while the daemons found each other (one may dial another before it listens,
    # and retries) are startup's: the run below must add none.
    errors_at_start = error_counts(cluster)
    for name in ("lin-a", "lin-b", "lin-c"):
        deploy(cluster, name, "linear_function", tmp_path)
    calls = ["lin-a", "lin-a", "lin-b", "lin-b", "lin-c", "lin-a"]
    caches = []
    for name in calls:
        response = invoke(cluster, name)
        assert response.status_code == 200, response.text
        caches.append(response.headers["X-Cache"])
    misses = caches.count("miss")
    assert misses == 4  # a, b, c, then a again (from the node's host memory: still a miss)
    # The token a Prometheus server scrapes with, as an operator gets it.
    assert credentials.main(["--metrics-token", str(cluster.secrets.directory)]) == 0
    token = capsys.readouterr().out.strip()
    assert token == cluster.metrics_token

    gateway = httpx.get(f"{cluster.gateway_url}/metrics", auth=cluster.admin_auth, timeout=10).text
    assert sample(gateway, "gateway_function_invocation_total", code="200") == len(calls)
    assert sample(gateway, "gateway_functions_seconds_count", function_name="lin-a") == 3
    assert sample(gateway, "gateway_functions_deployed") == 3

    def scheduler(name: str, **labels: str) -> float:
        return sample(scrape(cluster, "scheduler", token).text, name, **labels)

    assert eventually(lambda: scheduler("gpufaas_scheduler_calls_total"), len(calls)) == len(calls)
    assert scheduler("gpufaas_scheduler_calls_total", cache="miss") == misses
    assert scheduler("gpufaas_scheduler_calls_total", cache="hit") == len(calls) - misses
    # What the GPU's LRU list lost: four models admitted, one resident now.
    (gpu,) = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10).json()
    assert scheduler("gpufaas_scheduler_evictions_total") == misses - len(gpu["lru"]) == 3
    assert scheduler("gpufaas_scheduler_queue_depth") == 0
    assert scheduler("gpufaas_load_seconds_count") == misses
    assert scheduler("gpufaas_inference_seconds_count") == len(calls)

    assert scheduler("gpufaas_scheduler_o3_skips_total") == 0  # one call at a time: nothing to overtake

    node = scrape(cluster, "node0", token).text
    assert sample(node, "gpufaas_node_calls_total", outcome="ok") == len(calls)
    assert sample(node, "gpufaas_node_calls_total", cache="miss") == misses
    assert sample(node, "gpufaas_node_loads_total", source="load") == 3
    assert sample(node, "gpufaas_node_loads_total", source="host") == 1
    assert sample(node, "gpufaas_node_workers_lost_total") == 0
    # One warm spare, and one started to replace it after each of the 3 loads; every evicted
    # worker was parked in the host tier (and lin-a taken back), so none has exited.
    assert sample(node, "gpufaas_node_worker_starts_total") == cluster.spares + 3
    assert sample(node, "gpufaas_node_worker_exits_total") == 0
    assert sample(node, "gpufaas_node_worker_processes") == cluster.spares + 3
    assert sample(node, "gpufaas_node_parked_workers") == 2
    # GPU memory: what the cache manager plans is what the node's worker measured (lin-a's).
    address = gpu["gpu"]
    planned = scheduler("gpufaas_gpu_memory_planned_bytes", gpu=address)
    assert planned == gpu["memory_used_mb"] * 1024 * 1024 > 0
    assert sample(node, "gpufaas_node_gpu_memory_workers_bytes", gpu=address) == planned
    # A clean run: no etcd or wire error anywhere.
    assert error_counts(cluster) == errors_at_start

    # The scrape endpoints ask for the metrics token; /healthz (what the watchdog probes) is open,
    # with the daemon's loop lag; nothing else is served.
    for component in ("scheduler", "node0"):
        assert scrape(cluster, component, None).status_code == 401
        assert scrape(cluster, component, "wrong").status_code == 401
        health = httpx.get(f"http://{cluster.metrics_addresses[component]}/healthz", timeout=10)
        assert health.status_code == 200 and health.headers["content-type"] == "application/json"
        assert set(health.json()) == {"status", "loop_lag_s", "loop_lag_max_s"} and health.json()["status"] == "ok"
    assert httpx.get(f"http://{cluster.metrics_addresses['scheduler']}/other", timeout=10).status_code == 404


@pytest.mark.integration
def test_o3_skips_and_worker_deaths_are_counted_as_they_happen(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    # One GPU, one call at a time: calls queue at the scheduler while it is busy.
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=4000, slots="1")
    deploy(cluster, "slow", "sleepy_function", tmp_path, memory_mb=300)
    deploy(cluster, "other", "linear_function", tmp_path)
    token = cluster.metrics_token

    def call_into(name: str, inputs: object, out: dict[str, httpx.Response]) -> None:
        out[name] = httpx.post(
            f"{cluster.gateway_url}/function/{name}", json=inputs, headers=cluster.invoke_headers, timeout=60
        )

    warm: dict[str, httpx.Response] = {}
    call_into("slow", {"sleep_s": 0}, warm)  # slow's model is now on the GPU
    assert warm["slow"].status_code == 200, warm["slow"].text
    # While slow holds the GPU, `other` (a miss) queues, then a second `slow` (a hit) behind it.
    first: dict[str, httpx.Response] = {}
    later: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=call_into, args=("slow", {"sleep_s": 3}, first))]
    threads.append(threading.Thread(target=call_into, args=("other", {"inputs": [[1.0, 2.0, 3.0, 4.0]]}, later)))
    threads.append(threading.Thread(target=call_into, args=("slow", {"sleep_s": 0}, later)))
    for thread in threads:
        thread.start()
        time.sleep(0.5)  # in this order at the scheduler
    for thread in threads:
        thread.join(timeout=60)
    assert {r.status_code for r in (first["slow"], later["slow"], later["other"])} == {200}
    assert (later["slow"].headers["X-Cache"], later["other"].headers["X-Cache"]) == ("hit", "miss")

    def scheduler(name: str) -> float:
        return sample(scrape(cluster, "scheduler", token).text, name)

    # lalb-o3 ran the younger hit ahead of the older miss: one out-of-order dispatch.
    assert eventually(lambda: scheduler("gpufaas_scheduler_calls_total"), 4) == 4
    assert scheduler("gpufaas_scheduler_o3_skips_total") == 1
    assert scheduler("gpufaas_scheduler_queue_head_skips") == 0  # the queue is empty again

    # A worker killed outside gpufaas is a death, not a stop.
    def node(name: str, **labels: str) -> float:
        return sample(scrape(cluster, "node0", token).text, name, **labels)

    assert node("gpufaas_node_worker_exits_total", cause="died") == 0
    os.kill(int(later["slow"].json()["pid"]), signal.SIGKILL)
    assert eventually(lambda: node("gpufaas_node_worker_exits_total", cause="died"), 1) == 1
    assert node("gpufaas_node_worker_starts_total") - node("gpufaas_node_worker_exits_total") == node(
        "gpufaas_node_worker_processes"
    )


@pytest.mark.integration
def test_a_policys_tunables_reach_the_real_scheduler(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    # The knobs the simulator takes, passed to the scheduler of a running cluster (as
    # `gpufaas up --scheduler-args` does): the policy runs with them and calls are served.
    cluster = one_cpu_gpu(
        make_cluster,
        policy="mqfq-sticky",
        eviction="tinylfu",
        scheduler_flags=["--mqfq-ttl-alpha", "3.5", "--mqfq-overrun-s", "7.5"],
    )
    deploy(cluster, "lin", "linear_function", tmp_path)
    assert invoke(cluster, "lin").status_code == 200
    log = (cluster.state_dir / "logs" / "scheduler.log").read_text()
    assert "policy mqfq-sticky, PolicyConfig(max_num_skips=25" in log
    assert "mqfq_overrun_s=7.5, mqfq_ttl_alpha=3.5" in log and "eviction tinylfu" in log


@pytest.mark.integration
def test_mqfq_sticky_swaps_a_flow_past_its_keep_alive_out_to_the_host_tier(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    # A keep-alive of 0: once its call is done the flow is inactive, and its model leaves the GPU
    # for the node's host tier (the cpu backend keeps one) with no call asking; the next call
    # takes it back from there.
    cluster = one_cpu_gpu(
        make_cluster, policy="mqfq-sticky", scheduler_flags=["--mqfq-ttl-alpha", "0", "--mqfq-swap-out"]
    )
    deploy(cluster, "lin", "linear_function", tmp_path)
    assert invoke(cluster, "lin").status_code == 200
    wait_for_the_gpu(cluster, lambda gpu: not gpu["lru"] and gpu["host_tier"], "swapped out")
    back = invoke(cluster, "lin")
    assert back.status_code == 200 and "host;dur=" in back.headers["server-timing"]


@pytest.mark.integration
def test_adaptive_d_raises_an_idle_gpus_slots_in_a_real_scheduler(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    # D starts at 1 (--slots); nothing runs, so every 200 ms period is under the threshold and
    # D steps up to its maximum; calls are still served.
    cluster = one_cpu_gpu(make_cluster, slots="1", scheduler_flags=["--adaptive-slots", "3"])
    deploy(cluster, "lin", "linear_function", tmp_path)
    wait_for_the_gpu(cluster, lambda gpu: gpu["slots"] == 3, "D risen to 3")
    assert invoke(cluster, "lin").status_code == 200


def wait_for_the_gpu(cluster: LocalCluster, ready: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Poll the cluster's one GPU (GET /system/gpus) until `ready` says so, at most 15 s."""
    deadline = time.monotonic() + 15
    while True:
        (gpu,) = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10).json()
        if ready(gpu):
            return
        assert time.monotonic() < deadline, f"not {what} within 15 s: {gpu}"
        time.sleep(0.1)


def one_cpu_gpu(make_cluster: ClusterFactory, **options: Any) -> LocalCluster:
    """A cluster of one node with one cpu GPU of 1,000 MB, the scheduler set as `options` say."""
    return make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, **options)


def error_counts(cluster: LocalCluster) -> dict[str, tuple[float, float]]:
    """(etcd errors, wire errors) each daemon has counted so far."""
    texts = {
        "gateway": httpx.get(f"{cluster.gateway_url}/metrics", auth=cluster.admin_auth, timeout=10).text,
        **{name: scrape(cluster, name, cluster.metrics_token).text for name in ("scheduler", "node0")},
    }
    return {
        name: (sample(text, "gpufaas_etcd_errors_total"), sample(text, "gpufaas_wire_errors_total"))
        for name, text in texts.items()
    }
