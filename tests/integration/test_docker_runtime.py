"""The docker worker runtime on a real Docker engine: a function's worker in a container of its
own, checked from inside (its user, no network, a read-only filesystem) and from the engine (the
container's limits), and its memory limit enforced. CI starts dockerd and builds the image
(scripts/worker-image.sh); elsewhere these tests say why they skip."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_manager.containers import DEFAULT_IMAGE, NODE_LABEL, memory_limit_mb
from gpu_manager.sandbox import DEFAULT_MAX_PROCESSES, package_uid
from gpufaas.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_isolation import node_address


def engine() -> tuple[Any, str]:
    """(a Docker client, "") or (None, why not)."""
    try:
        import docker
        import docker.errors
    except ImportError:
        return None, "the docker package is not installed"
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        return None, f"the image {DEFAULT_IMAGE} is missing: bash scripts/worker-image.sh"
    except Exception as exc:
        return None, f"no Docker engine answers ({type(exc).__name__}); CI starts dockerd"
    return client, ""


CLIENT, WHY_NOT = engine()
REQUIRED = os.environ.get("GPUFAAS_REQUIRE_DOCKER") == "1"  # CI: a missing engine is a failure, not a skip
pytestmark = [pytest.mark.integration, pytest.mark.skipif(CLIENT is None and not REQUIRED, reason=WHY_NOT)]


def call(cluster: LocalCluster, **probes: Any) -> httpx.Response:
    return httpx.post(
        f"{cluster.gateway_url}/function/prowler", json=probes, headers=cluster.invoke_headers, timeout=180
    )


def containers(node: str) -> list[Any]:
    return list(CLIENT.containers.list(all=True, filters={"label": f"{NODE_LABEL}={node}"}))


def test_a_function_runs_in_a_container_of_its_own_held_to_its_limits(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    assert CLIENT is not None, WHY_NOT
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, runtime="docker", spares=0)
    deploy(cluster, "prowler", "prowler_function", tmp_path, memory_mb=100)
    digest = httpx.get(f"{cluster.gateway_url}/system/function/prowler", auth=cluster.admin_auth, timeout=30).json()[
        "package_digest"
    ]
    assert cluster.etcd_endpoint is not None
    etcd_host, etcd_port = cluster.etcd_endpoint.rsplit(":", 1)
    response = call(
        cluster,
        connect=[
            [etcd_host, int(etcd_port)],
            ["127.0.0.1", cluster.scheduler_port],
            ["127.0.0.1", cluster.gateway_port],
            list(node_address(cluster)),
        ],
        read=["/package/handler.py"],
        write=["/package/handler.py", "/package/new.py", "/usr/local/x", "/tmp/scratch"],
        show=["/proc/self/cgroup"],
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert response.headers["X-Cache"] == "miss"

    # From inside: its own user, no network, its package read-only, a writable /tmp only.
    expected_uid = package_uid(digest) if os.geteuid() == 0 else os.getuid()
    assert report["uid"] == report["gid"] == expected_uid != 0
    assert all(outcome != "ok" for outcome in report["connect"].values()), report["connect"]
    assert report["read"] == {"/package/handler.py": "ok"}
    assert report["write"]["/tmp/scratch"] == "ok"
    refused = {"OSError", "PermissionError"}  # a read-only filesystem, or files not the worker's
    assert {p for p, o in report["write"].items() if o in refused} == {
        "/package/handler.py",
        "/package/new.py",
        "/usr/local/x",
    }, report["write"]
    assert not [name for name in report["environment"] if "SECRET" in name or "ETCD" in name]

    # From the engine: the container's settings.
    (container,) = containers("node0")
    host = container.attrs["HostConfig"]
    assert container.attrs["Config"]["User"] == f"{expected_uid}:{expected_uid}"
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["Memory"] == memory_limit_mb("cpu", 100) * 1024 * 1024
    assert host["PidsLimit"] == DEFAULT_MAX_PROCESSES
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/package"]["RW"] is False

    # Its memory limit holds: 4 GiB on a 100 MB declaration ends the container, not the node.
    over = call(cluster, allocate_mb=4096)
    assert over.status_code >= 500, over.text
    again = call(cluster)
    assert again.status_code == 200 and again.headers["X-Cache"] == "miss"  # a new container

    cluster.stop()
    assert containers("node0") == []  # the node removes its containers when it stops


def test_a_container_maps_its_weights_from_the_host_pool(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    assert CLIENT is not None, WHY_NOT
    import torch
    from safetensors.torch import save_file

    from gpufaas import uploads
    from gpufaas.cli import GatewayClient
    from gpufaas.credentials import read_secret
    from gpufaas.packages import DigestCache
    from tests.integration.test_packages import POOLED_HANDLER, invoke

    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, runtime="docker", spares=0)
    directory = tmp_path / "fn"
    directory.mkdir()
    (directory / "handler.py").write_text(f"VERSION = 'docker'\n{POOLED_HANDLER}")
    weights = torch.randn(1 << 20)  # 4 MB: pooled
    save_file({"w": weights}, directory / "weights.safetensors")
    gateway = GatewayClient(cluster.gateway_url, password=read_secret(cluster.secrets.admin_password))
    report = uploads.upload(gateway, uploads.scan([("pooled", directory)], DigestCache(None)))
    (answer,) = report.packages.values()
    spec = {"name": "pooled", "package_digest": answer["digest"], "memory_mb": 300}
    assert gateway.request("POST", "/system/functions", json=spec).status_code == 202

    result = invoke(cluster, "pooled").json()
    assert result == {"sum": pytest.approx(float(weights.double().sum())), "pooled": True, "version": "docker"}
    (container,) = containers("node0")
    pool_mounts = [m for m in container.attrs["Mounts"] if m["Destination"].startswith("/gpufaas/pool/")]
    assert len(pool_mounts) == 1 and pool_mounts[0]["RW"] is False  # its own weights only, read-only
