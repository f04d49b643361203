"""A deploy outlives the gateway that took it, whichever gateway each step reached: its commit is
answered once a second gateway holds its blobs, a gateway asked to commit blobs it lacks fetches
them from the others, and a call right after a deploy through another gateway finds the function
(real processes, real etcd, two gateways behind HAProxy)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.cli import uploads
from gpufaas.cli.client import GatewayClient
from gpufaas.credentials import read_secret
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.packages import DigestCache
from tests.integration.conftest import ClusterFactory
from tests.integration.test_control_plane import wait_for
from tests.integration.test_gateways import haproxy  # noqa: F401 (autouse: skips without HAProxy)

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOLDERS_HEADER = "x-package-holders"


def client(cluster: LocalCluster, gateway: str) -> GatewayClient:
    return GatewayClient(cluster.gateway_urls[gateway], password=read_secret(cluster.secrets.admin_password))


class SplitGateway:
    """The CLI's view of a gateway whose deploy steps land on two: blobs go to `uploads_to`, the
    commit (POST /system/packages) to `commits_to`, as a balancer without stickiness would send them."""

    def __init__(self, uploads_to: GatewayClient, commits_to: GatewayClient) -> None:
        self.uploads_to, self.commits_to = uploads_to, commits_to
        self.url, self.authorization = uploads_to.url, uploads_to.authorization
        self.commits: list[httpx.Response] = []

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if method == "POST" and path == "/system/packages":
            self.commits.append(self.commits_to.request(method, path, **kwargs))
            return self.commits[-1]
        return self.uploads_to.request(method, path, **kwargs)

    def ok(self, response: httpx.Response, *, accept: tuple[int, ...] = (200, 201, 202)) -> Any:
        return self.uploads_to.ok(response, accept=accept)


def upload(gateway: uploads.Gateway, fixture: str) -> str:
    """Send a fixture's package through `gateway` (which blobs are missing, the blobs, the commit); its digest."""
    report = uploads.upload(gateway, uploads.scan([(fixture, FIXTURES / fixture)], DigestCache(None)))
    (answer,) = report.packages.values()
    assert "warning" not in answer, answer
    return str(answer["digest"])


def deploy(gateway: GatewayClient, name: str, digest: str) -> None:
    body = {"name": name, "package_digest": digest, "memory_mb": 300}
    response = gateway.request("POST", "/system/functions", json=body)
    assert response.status_code == 202, response.text


def test_a_package_outlives_the_gateway_that_took_it_before_any_node_fetched_it(
    make_cluster: ClusterFactory,
) -> None:
    """Both nodes stopped at the deploy (nothing pre-stages it); the commit answered, gateway0,
    which took the upload, is SIGKILLed and kept down; the nodes start and each gets the package
    (from gateway1, the copy's holder) and serves calls."""
    cluster = make_cluster(
        gateways=2, nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, policy="lb", slots="1"
    )
    for node in ("node0", "node1"):
        cluster.components[node].stop()
    first, second = client(cluster, "gateway0"), client(cluster, "gateway1")
    watched = SplitGateway(first, first)  # (to read the commit's headers)
    digest = upload(watched, "sleepy_function")
    holders = watched.commits[-1].headers.get(HOLDERS_HEADER, "").split(", ")
    print(f"\ncommitted through gateway0; held by {holders}")
    assert len(holders) == 2, holders
    deploy(first, "sleepy", digest)

    os.killpg(cluster.pids()["gateway0"], signal.SIGKILL)  # no supervisor: it stays down
    process = cluster.components["gateway0"].process
    assert process is not None
    process.wait()
    for node in ("node0", "node1"):
        cluster.components[node].start(dict(os.environ))
    gpus = lambda: second.request("GET", "/system/gpus").json()  # noqa: E731
    wait_for(lambda: len(gpus()) == 2, timeout_s=60)
    served: set[str] = set()
    with httpx.Client(timeout=120, headers=cluster.invoke_headers) as calls:
        url = f"{second.url}/function/sleepy"

        def call() -> None:
            response = calls.post(url, json={"sleep_s": 1.0})
            assert response.status_code == 200, response.text
            served.add(response.headers.get("x-gpu", "").split("/")[0])

        for _ in range(6):  # two calls at once on two one-slot GPUs, load balanced: one runs on each node
            threads = [threading.Thread(target=call) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if served >= {"node0", "node1"}:
                break
    print(f"after gateway0's kill, calls served by {sorted(served)}")
    assert served >= {"node0", "node1"}, served
    for node in ("node0", "node1"):
        log_lines = cluster.components[node].log_path.read_text().splitlines()
        staged = [line for line in log_lines if "staged package" in line]
        assert staged, f"{node} staged nothing"
        print(f"{node}: {staged[-1]}")


def test_blobs_uploaded_to_one_gateway_commit_through_the_other(make_cluster: ClusterFactory) -> None:
    """Which blobs are missing and the blobs themselves go to gateway0, the commit to gateway1:
    gateway1 fetches the blobs from gateway0, and the function deployed through it runs."""
    cluster = make_cluster(gateways=2, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    first, second = client(cluster, "gateway0"), client(cluster, "gateway1")
    split = SplitGateway(first, second)
    digest = upload(split, "echo_function")
    assert split.commits[-1].status_code == 201, split.commits[-1].text
    holders = split.commits[-1].headers.get(HOLDERS_HEADER, "").split(", ")
    assert len(holders) == 2, holders
    deploy(second, "echo", digest)
    called = httpx.post(f"{second.url}/function/echo", json={"x": 1}, headers=cluster.invoke_headers, timeout=120)
    assert called.status_code == 200, called.text


def test_a_call_right_after_a_deploy_through_another_gateway_finds_the_function(make_cluster: ClusterFactory) -> None:
    """Deployed through gateway0, called through gateway1 at once, again and again: never a 404
    (gateway1 reads the function from etcd when its watch has not brought it yet)."""
    cluster = make_cluster(gateways=2, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    first, second = client(cluster, "gateway0"), client(cluster, "gateway1")
    digest = upload(first, "echo_function")
    statuses = []
    with httpx.Client(timeout=120, headers=cluster.invoke_headers) as calls:
        for i in range(8):
            deploy(first, f"echo{i}", digest)
            response = calls.post(f"{second.url}/function/echo{i}", json={"x": i})
            statuses.append(response.status_code)
            assert response.status_code != 404, f"echo{i}: {response.text}"
    print(f"\ncalls through gateway1 right after each deploy through gateway0: {statuses}")
    assert all(status == 200 for status in statuses), statuses
