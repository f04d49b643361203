"""The process runtime's confinement, probed from inside a real function on a real cluster: what
a function can read, write, reach and use (gpu_manager.sandbox; docs/security.md)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.cluster import NodeRecord
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.keys import Keys
from gpufaas.store import EtcdStore
from tests.builders import package_user
from tests.integration.conftest import ClusterFactory, EtcdTarget, deploy, stop_clusters

pytestmark = pytest.mark.integration
AS_ROOT = os.geteuid() == 0


def call(cluster: LocalCluster, name: str, **inputs: Any) -> dict[str, Any]:
    """Function `name`'s JSON answer to `inputs` (which must succeed)."""
    response = httpx.post(
        f"{cluster.gateway_url}/function/{name}", json=inputs, headers=cluster.invoke_headers, timeout=120
    )
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


def probe(cluster: LocalCluster, **probes: Any) -> dict[str, Any]:
    return call(cluster, "prowler", **probes)


def package_dir(cluster: LocalCluster, digest: str) -> Path:
    return cluster.state_dir / "node0" / "packages" / digest.removeprefix("sha256:")


def node_address(cluster: LocalCluster) -> tuple[str, int]:
    async def read() -> str:
        assert cluster.etcd_endpoint is not None
        store = await EtcdStore.open(cluster.etcd_endpoint, tls=cluster.etcd_client_tls)
        try:
            kv = await store.get(Keys(cluster.root).node("node0"))
        finally:
            await store.close()
        assert kv is not None
        return NodeRecord.from_json(kv.value).address

    host, port = asyncio.run(read()).rsplit(":", 1)
    return host, int(port)


@pytest.fixture
def state_outside_tmp() -> Iterator[Path]:
    """A state directory under /var/lib, as a deployment's: under /tmp (pytest's), a worker would
    not see the node's paths at all (its /tmp is its own home), and this test probes them."""
    state = Path(tempfile.mkdtemp(prefix="gpufaas-test-", dir="/var/lib"))
    state.chmod(0o711)
    try:
        yield state
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.skipif(not AS_ROOT, reason="workers get users of their own only where the node runs as root (CI does)")
def test_a_function_reads_its_own_package_only_and_writes_none(
    etcd_endpoint: EtcdTarget, state_outside_tmp: Path, tmp_path: Path
) -> None:
    cluster = LocalCluster(
        state_dir=state_outside_tmp / "cluster0",
        etcd_endpoint=etcd_endpoint.endpoint,
        root=etcd_endpoint.root,
        nodes=1,
        gpus_per_node=1,
        backend="cpu",
        gpu_memory_mb=2000,
    )
    cluster.start()
    watched = list(cluster.pids().values())
    try:
        probe_own_package_only(cluster, tmp_path)
    finally:
        stop_clusters([cluster], watched)


def probe_own_package_only(cluster: LocalCluster, tmp_path: Path) -> None:
    deploy(cluster, "victim", "echo_function", tmp_path, memory_mb=100)
    victim = httpx.post(f"{cluster.gateway_url}/function/victim", json={}, headers=cluster.invoke_headers, timeout=60)
    assert victim.status_code == 200
    deploy(cluster, "prowler", "prowler_function", tmp_path, memory_mb=100)
    specs = {
        f["name"]: f
        for f in httpx.get(f"{cluster.gateway_url}/system/functions", auth=cluster.admin_auth, timeout=30).json()
    }
    victim_dir = package_dir(cluster, specs["victim"]["package_digest"])
    own_dir = package_dir(cluster, specs["prowler"]["package_digest"])
    secrets = cluster.secrets
    report = probe(
        cluster,
        read=[
            str(own_dir / "handler.py"),
            str(victim_dir / "handler.py"),
            str(secrets.cluster_secret),
            str(secrets.admin_password),
            str(cluster.state_dir / "logs" / "gateway.log"),
        ],
        write=[str(own_dir / "handler.py"), str(own_dir / "new.py"), str(victim_dir / "handler.py")],
        list=[
            str(cluster.state_dir),
            str(cluster.state_dir / "node0" / "packages"),
            str(cluster.state_dir / "gateway" / "packages"),
            str(secrets.directory),
        ],
    )
    assert (
        report["uid"] == report["gid"] == package_user(cluster.state_dir / "node0", specs["prowler"]["package_digest"])
    )
    assert report["read"] == {
        str(own_dir / "handler.py"): "ok",
        str(victim_dir / "handler.py"): "PermissionError",
        str(secrets.cluster_secret): "PermissionError",
        str(secrets.admin_password): "PermissionError",
        str(cluster.state_dir / "logs" / "gateway.log"): "PermissionError",
    }
    assert set(report["write"].values()) == {"PermissionError"}, report["write"]
    assert set(report["list"].values()) == {"PermissionError"}, report["list"]
    # The victim is untouched and serves as before.
    again = httpx.post(f"{cluster.gateway_url}/function/victim", json={}, headers=cluster.invoke_headers, timeout=60)
    victim_uid = package_user(cluster.state_dir / "node0", specs["victim"]["package_digest"])
    assert again.status_code == 200 and again.json()["uid"] == victim_uid != report["uid"]


def test_a_function_reaches_no_network_sees_no_secrets_and_is_held_to_its_limits(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "prowler", "prowler_function", tmp_path, memory_mb=100, environment={"MINE": "yes"})
    assert cluster.etcd_endpoint is not None
    etcd_host, etcd_port = cluster.etcd_endpoint.rsplit(":", 1)
    targets = [
        [etcd_host, int(etcd_port)],
        ["127.0.0.1", cluster.scheduler_port],
        ["127.0.0.1", cluster.gateway_port],
        list(node_address(cluster)),
    ]
    report = probe(cluster, connect=targets, allocate_mb=4096, threads=2000)
    assert all(outcome != "ok" for outcome in report["connect"].values()), report["connect"]
    # Its environment: the function's own and the runtime's, nothing of the cluster's.
    assert "MINE" in report["environment"]
    assert not [name for name in report["environment"] if "SECRET" in name or "ETCD" in name], report["environment"]
    assert [name for name in report["environment"] if name.startswith("GPUFAAS_")] == ["GPUFAAS_PACKAGE_DIR"]
    # Memory: 4 GiB on a 100 MB declaration is refused (the worker lives on, the call answered).
    assert report["allocate"] == "MemoryError"
    if AS_ROOT:  # a task limit for the package's own user
        assert report["threads"]["stopped_by"] == "RuntimeError" and report["threads"]["started"] < 2000

    # Output: 200 MiB printed cost the node's log a bounded amount.
    log = cluster.state_dir / "logs" / "node0.log"
    before = log.stat().st_size
    printed = probe(cluster, print_mb=200)
    assert printed["printed_mb"] == 200
    grown_mb = (log.stat().st_size - before) / 1024 / 1024
    assert grown_mb < 8, f"the node's log grew by {grown_mb:.1f} MiB"
    assert "bytes of its output dropped" in log.read_text(errors="replace")


O_PATH = 0o10000000  # a handle that names a file or directory but cannot read or write it
SECRET = "card 4111 1111 1111 1111, planted by another function"


def test_a_worker_holds_nothing_but_its_stdio_and_channel(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """A handler that lists /proc/self/fd and tries every descriptor finds its stdio (/dev/null and
    a pipe of its own), one socket (its channel to the node) and the O_PATH handles its worker
    opened to reach its package and runtime: nothing it can read, reopen or write. Not the node's
    log (where another function's output goes), not another worker's pipe."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "victim", "prowler_function", tmp_path, memory_mb=100)
    deploy(cluster, "thief", "descriptor_function", tmp_path, memory_mb=100)
    victim = call(cluster, "victim", say=SECRET)
    report = call(cluster, "thief", look_for=SECRET)
    descriptors = {int(fd): entry for fd, entry in report["descriptors"].items()}
    assert report["found"] == [], descriptors
    sockets = [fd for fd, entry in descriptors.items() if entry["target"].startswith("socket:")]
    assert len(sockets) == 1, descriptors
    assert descriptors[0]["target"] == "/dev/null"
    stdout = descriptors[1]["target"]
    assert stdout.startswith("pipe:") and descriptors[2]["target"] == stdout, descriptors
    assert victim["stdout"].startswith("pipe:") and victim["stdout"] != stdout
    others = {fd: entry for fd, entry in descriptors.items() if fd not in (0, 1, 2, *sockets)}
    assert {fd: entry for fd, entry in others.items() if not entry["flags"] & O_PATH} == {}
    assert not [entry for entry in others.values() if "ok" in (entry["read"], entry["reopen"], entry["write"])]
    # Its output is its own pipe's, within its budget: nothing reached the node's log another way.
    assert "forged log line" not in (cluster.state_dir / "logs" / "node0.log").read_text(errors="replace")


def test_a_caller_cannot_break_a_warm_worker(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """JSON nested 100,000 deep is refused with a 400 (json's decoder would exhaust the worker's
    stack: RecursionError ended its serve loop, and each such call cost a reload), and a handler
    that calls sys.exit() gets its call a 500: the same warm worker serves the next call."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "prowler", "prowler_function", tmp_path, memory_mb=100)
    pid = call(cluster, "prowler")["pid"]
    deep = b"[" * 100_000 + b"]" * 100_000
    url = f"{cluster.gateway_url}/function/prowler"
    with httpx.Client(headers=cluster.invoke_headers, timeout=60) as client:
        for _ in range(20):
            response = client.post(url, content=deep, headers={"content-type": "application/json"})
            assert response.status_code == 400, response.text
            assert "nested deeper than 512 levels" in response.json()["error"]
        response = client.post(url, json={"exit": 3})
        assert response.status_code == 500 and "SystemExit: 3" in response.json()["error"], response.text
        response = client.post(url, json={})
        assert response.status_code == 200, response.text
        assert response.headers["X-Cache"] == "hit" and response.json()["pid"] == pid
