"""A node's graceful stop over the real control plane: SIGTERM drains it (gpu_manager.drain)."""

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
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import wait_for
from tests.integration.test_faults import call

pytestmark = pytest.mark.integration

DRAIN_TIMEOUT_S = 20.0
CALL_S = 1.0  # what each call's handler sleeps


def test_a_sigterm_drains_the_node_and_loses_no_call(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """SIGTERM to a node while calls run on it: every call answers 200 (those running there end
    there, those queued behind its GPU run elsewhere), calls sent once the drain is seen run on the
    other node, and the node exits on its own, status 0, before its drain timeout."""
    cluster = make_cluster(
        nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, node_flags=["--drain-timeout-s", "20"]
    )
    deploy(cluster, "slow", "sleepy_function", tmp_path)
    first = call(cluster, "slow")
    assert first.status_code == 200, first.text
    draining = first.headers["X-Gpu"].partition("/")[0]  # it holds the model: the burst goes there first
    other = ({"node0", "node1"} - {draining}).pop()
    node = cluster.components[draining]
    answers: list[tuple[str, httpx.Response]] = []  # (batch, answer)
    lock = threading.Lock()

    def one(batch: str, client: httpx.Client) -> None:
        response = call(cluster, "slow", CALL_S, client)
        with lock:
            answers.append((batch, response))

    with httpx.Client() as client, ThreadPoolExecutor(16) as pool:
        before = [pool.submit(one, "before", client) for _ in range(8)]
        time.sleep(CALL_S / 2)  # the first calls run on the node now
        assert node.pid is not None
        os.kill(node.pid, signal.SIGTERM)  # its GPU manager only, as Kubernetes does (not its group)
        signalled_s = time.monotonic()
        # The drain is seen: the node's GPU leaves the cluster's view.
        wait_for(lambda: {g["node"] for g in _gpus(cluster)} == {other})
        assert node.alive(), "the node stopped before the calls running on it ended"
        after = [pool.submit(one, "after", client) for _ in range(8)]
        wait_for(lambda: not node.alive(), timeout_s=DRAIN_TIMEOUT_S)
        exited_after_s = time.monotonic() - signalled_s
        for future in before + after:
            future.result()

    failures = [(batch, r.status_code, r.text) for batch, r in answers if r.status_code != 200]
    assert not failures, failures
    served_by = {b: [r.headers["X-Gpu"].partition("/")[0] for b2, r in answers if b2 == b] for b in ("before", "after")}
    assert draining in served_by["before"], served_by  # some ran on the draining node
    assert set(served_by["after"]) == {other}, served_by
    print(f"drained node exited {exited_after_s:.2f} s after SIGTERM; served by {served_by}")
    assert node.exit_status() == 0, node.tail()
    assert exited_after_s < DRAIN_TIMEOUT_S, exited_after_s
    log = node.log_path.read_text()
    assert "draining:" in log and "drain ended (drained)" in log, node.tail(40)


def _gpus(cluster: LocalCluster) -> list[dict[str, object]]:
    response = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth)
    result: list[dict[str, object]] = response.json()
    return result
