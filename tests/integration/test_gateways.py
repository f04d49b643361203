"""Several gateways behind HAProxy (gpufaas.dev.balancer): a gateway SIGKILLed under load fails at
most the calls it was serving, a deploy through one gateway is served through the other, its
package outlives the gateway that took it, and `gpufaas up --gateways 2` / `down` by the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpufaas.dev.balancer import BalancerUnavailable, haproxy_binary
from gpufaas.dev.local_cluster import LocalCluster, free_port, recorded_pids, stop_recorded
from gpufaas.processes import survivors
from tests.fixtures.make_packages import build_package
from tests.integration.conftest import ClusterFactory, EtcdTarget
from tests.integration.test_cli_e2e import cli_env, gpufaas  # noqa: F401 (a fixture)
from tests.integration.test_control_plane import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def haproxy() -> None:
    """HAProxy stands in front of the gateways: without it these tests skip, but under CI=true fail."""
    try:
        haproxy_binary()
    except BalancerUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and HAProxy is missing: {exc}")
        pytest.skip(str(exc))


CLIENTS = 8
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STEADY_S = 3.0  # load before the kill, and after it
CALL_TIMEOUT_S = 30.0


def deploy_via(cluster: LocalCluster, url: str, name: str, fixture: str, tmp_path: Path) -> None:
    """Upload a fixture package to the gateway at `url` (its blobs land there) and deploy it as `name`."""
    package = build_package(fixture, tmp_path)
    uploaded = httpx.post(f"{url}/system/packages", content=package.read_bytes(), timeout=60, auth=cluster.admin_auth)
    assert uploaded.status_code == 201, uploaded.text
    body = {"name": name, "package_digest": uploaded.json()["digest"], "memory_mb": 300}
    deployed = httpx.post(f"{url}/system/functions", json=body, timeout=30, auth=cluster.admin_auth)
    assert deployed.status_code == 202, deployed.text


def kill_group(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)


@dataclass
class Call:
    sent_s: float
    done_s: float = 0.0
    status: int | None = None  # None: no answer (a connection error)
    error: str = ""


def call_in_a_loop(url: str, headers: dict[str, str], calls: list[Call], stopping: threading.Event) -> None:
    """One client: calls `url` over a kept-alive connection until `stopping`, every call recorded."""
    with httpx.Client(timeout=CALL_TIMEOUT_S, headers=headers) as client:
        while not stopping.is_set():
            call = Call(sent_s=time.monotonic())
            calls.append(call)
            try:
                call.status = client.post(url, json={"x": 1}).status_code
            except httpx.HTTPError as exc:
                call.error = type(exc).__name__
            call.done_s = time.monotonic()


def test_a_gateway_killed_under_load_fails_at_most_the_calls_it_was_serving(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(gateways=2, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy_via(cluster, cluster.gateway_url, "echo", "echo_function", tmp_path)
    url = f"{cluster.gateway_url}/function/echo"
    wait_for(lambda: httpx.post(url, json={}, headers=cluster.invoke_headers, timeout=60).status_code == 200, 60)
    calls: list[Call] = []
    stopping = threading.Event()
    with ThreadPoolExecutor(CLIENTS) as clients:
        for _ in range(CLIENTS):
            clients.submit(call_in_a_loop, url, cluster.invoke_headers, calls, stopping)
        try:
            time.sleep(STEADY_S)
            killed_s = time.monotonic()
            kill_group(cluster.pids()["gateway0"])  # and no supervisor to restart it
            process = cluster.components["gateway0"].process
            assert process is not None
            process.wait()
            dead_s = time.monotonic()  # its sockets closed: a call sent later cannot have reached it
            time.sleep(STEADY_S)
        finally:
            stopping.set()
    failed = [c for c in calls if c.status != 200]
    in_flight = [c for c in calls if c.sent_s < dead_s and (c.done_s == 0.0 or c.done_s > killed_s)]
    after = [c for c in calls if c.sent_s > dead_s]
    before_rate = sum(1 for c in calls if c.done_s < killed_s) / STEADY_S
    after_rate = len(after) / STEADY_S
    worst_after_s = max(c.done_s - c.sent_s for c in after)
    print(
        f"\ngateway kill under {CLIENTS} clients: {len(calls)} calls, {len(failed)} failed "
        f"({sorted({c.status or c.error for c in failed}, key=str)}), {len(in_flight)} in flight at the kill "
        f"(on either gateway; it died {1000 * (dead_s - killed_s):.1f} ms after SIGKILL); "
        f"{before_rate:.0f} calls/s before, {after_rate:.0f} after; "
        f"slowest call sent after the kill {worst_after_s * 1000:.0f} ms"
    )
    for c in failed:
        sent_ms, done_ms = 1000 * (c.sent_s - killed_s), 1000 * (c.done_s - killed_s)
        print(f"  failed: sent {sent_ms:+.1f} ms from the kill, done {done_ms:+.1f}")
    assert all(c.done_s for c in calls), "a call was never answered"
    assert all(any(c is f for c in in_flight) for f in failed), "a call sent after the kill failed, or one before it"
    assert len(failed) <= CLIENTS  # each client has one call in flight at most
    assert all(c.status == 200 for c in after) and len(after) >= CLIENTS
    assert "gateway0" not in cluster.pids() and cluster.components["balancer"].alive()


def test_a_deploy_through_one_gateway_is_served_through_the_other_and_outlives_it(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """Deployed through gateway0: listed and invoked through gateway1 at once. Its package is
    staged by the running node (node0) at the deploy; gateway0, which took it, is SIGKILLed and
    kept down; node1, stopped until then, starts and gets the package from node0."""
    cluster = make_cluster(
        gateways=2, nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, policy="lb", slots="1"
    )
    first, second = cluster.gateway_urls["gateway0"], cluster.gateway_urls["gateway1"]
    late = cluster.components["node1"]
    late.stop()
    deploy_via(cluster, first, "sleepy", "sleepy_function", tmp_path)
    deployed_s = time.monotonic()
    listed = httpx.get(f"{second}/system/functions", auth=cluster.admin_auth, timeout=10).json()
    assert "sleepy" in [f["name"] for f in listed]
    called = httpx.post(f"{second}/function/sleepy", json={}, headers=cluster.invoke_headers, timeout=60)
    assert called.status_code == 200, called.text
    print(f"\ndeployed through gateway0; listed and invoked through gateway1 in {time.monotonic() - deployed_s:.2f} s")

    kill_group(cluster.pids()["gateway0"])  # no supervisor: it stays down
    late.start(dict(os.environ))
    gpus = lambda: httpx.get(f"{second}/system/gpus", auth=cluster.admin_auth, timeout=10).json()  # noqa: E731
    wait_for(lambda: len(gpus()) == 2, timeout_s=60)
    nodes: set[str] = set()
    with httpx.Client(timeout=60, headers=cluster.invoke_headers) as client:
        for _ in range(5):  # two calls at once, on two one-slot GPUs, load balanced: one runs on node1
            threads = [
                threading.Thread(
                    target=lambda: nodes.add(
                        client.post(f"{second}/function/sleepy", json={"sleep_s": 1.0}).headers.get("x-gpu", "")
                    )
                )
                for _ in range(2)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if any(n.startswith("node1/") for n in nodes):
                break
    assert any(n.startswith("node1/") for n in nodes), nodes
    staged = [line for line in late.log_path.read_text().splitlines() if "staged package" in line]
    print(f"node1, after gateway0's kill: {staged[-1] if staged else 'nothing staged'}")
    assert staged and "from node-node0)" in staged[-1]  # its peer, the one holder left


def test_up_with_two_gateways_writes_the_balancer_and_down_stops_everything(
    tmp_path: Path,
    cli_env: dict[str, str],  # noqa: F811 (the fixture)
) -> None:
    state = tmp_path / "state"
    port = free_port()
    try:
        up = gpufaas(
            "up", "--gateways", "2", "--schedulers", "1", "--backend", "cpu", "--nodes", "1", "--port", str(port),
            env=cli_env, cwd=tmp_path,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        info = json.loads((state / "cluster.json").read_text())
        assert info["gateway_url"] == f"http://127.0.0.1:{port}" and set(info["gateways"]) == {"gateway0", "gateway1"}
        pids = recorded_pids(state)
        assert set(pids) == {"etcd", "scheduler", "gateway0", "gateway1", "balancer", "node0", "supervisor"}
        assert httpx.get(f"{info['gateway_url']}/healthz", timeout=10).status_code == 200
        status = gpufaas("status", env=cli_env, cwd=tmp_path)
        assert status.returncode == 0 and "balancer" in status.stdout and "answers" in status.stdout
        # A deploy's steps (which blobs are missing, send them, register the package) are separate
        # calls: the balancer sends them to one gateway. Twice: round robin would split them.
        shutil.copytree(FIXTURES / "echo_function", tmp_path / "echo")
        stack = "version: 1.0\nfunctions:\n  echo:\n    handler: ./echo\n    memory_mb: 100\n"
        (tmp_path / "stack.yml").write_text(stack)
        for attempt in range(2):
            (tmp_path / "echo" / "helper.py").write_text(f"VALUE = {attempt}\n")  # new blobs to upload
            deployed = gpufaas("deploy", "-f", "stack.yml", "--gateway", info["gateway_url"], env=cli_env, cwd=tmp_path)
            assert deployed.returncode == 0, deployed.stderr
        called = gpufaas(
            "invoke", "echo", "-d", '{"x": 1}', "--gateway", info["gateway_url"], env=cli_env, cwd=tmp_path
        )
        assert called.returncode == 0 and '"helper":1' in called.stdout, called.stdout
        down = gpufaas("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0 and "balancer" in down.stdout
        assert not survivors(pids.values()), pids
    finally:
        stop_recorded(state)


def test_a_blob_port_in_use_is_one_line_and_status_1(etcd_endpoint: EtcdTarget, tmp_path: Path) -> None:
    # The blob server started in the app's startup, where uvicorn printed its OSError as a
    # traceback ("Application startup failed") and the gateway exited with status 3.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        port = free_port()
        argv = ["--etcd", etcd_endpoint.endpoint, "--root", etcd_endpoint.root, "--insecure", "--port", str(port)]
        argv += ["--public-url", f"http://127.0.0.1:{port}", "--blob-listen", taken, "--state-dir", str(tmp_path)]
        done = subprocess.run(
            [sys.executable, "-m", "gateway", *argv], capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    said = f"error: gateway cannot start: blob server on {taken}: [Errno 98] Address already in use"
    assert done.stderr.splitlines()[-1] == said, done.stderr
