"""`gpufaas up --gateways 2 --schedulers 2`, as issue 21 asks it to hold: a steady load of 8 clients
through the balancer, the leading scheduler SIGKILLed (no call fails, calls succeed again within
2 s), then a gateway SIGKILLed (only calls in flight on it may fail)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.processes import pid_alive
from tests.integration.conftest import deploy
from tests.integration.test_failover import (
    CALL_TIMEOUT_S,
    FUNCTIONS,
    RECOVERY_BOUND_S,
    STEADY_S,
    Load,
    assert_every_call_succeeded,
)

pytestmark = pytest.mark.integration


def leader(cluster: LocalCluster) -> dict[str, Any]:
    """The overview's `scheduler_leader` (name, address, epoch)."""
    response = httpx.get(f"{cluster.gateway_url}/system/overview", auth=cluster.admin_auth, timeout=10)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()["scheduler_leader"]
    return found


def wait_for_leader(cluster: LocalCluster, *, not_named: str = "", timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = leader(cluster)
            if last and last.get("name") and last["name"] != not_named:
                return dict(last)  # type: ignore[arg-type]
        except (httpx.HTTPError, AssertionError, KeyError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"no leader other than {not_named!r} in {timeout_s} s (last: {last})")


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    """What `gpufaas up --gateways 2 --schedulers 2 --backend cpu` starts (credentials and TLS on,
    its own etcd), with two one-GPU nodes and the sleepy functions deployed and loaded."""
    cluster = LocalCluster(
        tmp_path / "cluster", nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, gateways=2, schedulers=2
    )
    try:
        cluster.start()
        for name in FUNCTIONS:
            deploy(cluster, name, "sleepy_function", tmp_path, memory_mb=300)
            response = httpx.post(
                f"{cluster.gateway_url}/function/{name}",
                json={},
                headers=cluster.invoke_headers,
                timeout=CALL_TIMEOUT_S,
            )
            assert response.status_code == 200, response.text
        yield cluster
    finally:
        cluster.stop()


def test_up_with_two_gateways_and_two_schedulers_loses_nothing_to_a_killed_leader_or_gateway(
    cluster: LocalCluster,
) -> None:
    assert {"gateway0", "gateway1", "scheduler0", "scheduler1", "balancer"} <= set(cluster.pids())
    first = wait_for_leader(cluster)
    with Load(cluster) as load:
        load.steady()
        killed_s = time.monotonic()
        os.kill(cluster.pids()[first["name"]], signal.SIGKILL)
        time.sleep(STEADY_S * 2)
    report = load.report(killed_s)
    print("leader killed:", report)
    assert_every_call_succeeded(report)
    assert report["first_success_of_a_call_sent_after_the_fault_s"] <= RECOVERY_BOUND_S, report
    second = wait_for_leader(cluster, not_named=first["name"])
    assert second["epoch"] > first["epoch"], (first, second)

    with Load(cluster) as load:
        load.steady()
        gateway0 = cluster.pids()["gateway0"]
        os.kill(gateway0, signal.SIGKILL)
        # Dying takes tens of ms, and its last thread holds the listening socket to the end (see
        # pid_alive): a call sent meanwhile can reach the gateway, and is one in flight on it.
        dying_until_s = time.monotonic() + 10
        while pid_alive(gateway0):
            assert time.monotonic() < dying_until_s, "gateway0 outlived its SIGKILL by 10 s"
            time.sleep(0.005)
        killed_s = time.monotonic()
        time.sleep(STEADY_S * 2)
    calls = list(load.calls)
    failed_after = [c for c in calls if c.status != 200 and c.sent_s > killed_s]
    failed_before = [c for c in calls if c.status != 200 and c.sent_s <= killed_s]
    print(f"gateway killed: {len(calls)} calls, {len(failed_before)} failed that were sent before it died")
    # Sent after the death, a call's connection to the dead gateway is refused and HAProxy retries it
    # on the other one (retry-on conn-failure): none may fail.
    assert not failed_after, [(c.status, c.error, c.body) for c in failed_after[:5]]
    assert len(failed_before) <= 8, failed_before  # at most the clients' calls in flight on it
