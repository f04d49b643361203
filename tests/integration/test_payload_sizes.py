"""Large payloads and results over a real cluster: they travel gateway -> node -> worker and back
without the scheduler, up to the payload limit (16 MiB by default); above it a payload is a 413 and
a result a 502 that names its size, and neither is retried elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy

pytestmark = pytest.mark.integration

MIB = 1024 * 1024


@pytest.fixture
def cluster(make_cluster: ClusterFactory, tmp_path: Path) -> LocalCluster:
    cluster = make_cluster(nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=1000)
    deploy(cluster, "echo", "echo_function", tmp_path, memory_mb=100)
    deploy(cluster, "blob", "blob_function", tmp_path, memory_mb=100)
    return cluster


def post(cluster: LocalCluster, name: str, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}/function/{name}", timeout=60, **kwargs, auth=cluster.admin_auth)  # type: ignore[arg-type]


@pytest.mark.parametrize("size_mib", [5, 15])
def test_inputs_and_outputs_up_to_the_limit_go_through_intact(cluster: LocalCluster, size_mib: int) -> None:
    payload = os.urandom(size_mib * MIB)
    response = post(cluster, "echo", content=payload, headers={"content-type": "application/octet-stream"})
    assert response.status_code == 200, response.text[:200]
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == payload  # the echo function returns the bytes it got

    response = post(cluster, "blob", json={"bytes": size_mib * MIB})
    assert response.status_code == 200, response.text[:200]
    assert len(response.content) == size_mib * MIB


def test_a_payload_over_the_limit_is_a_413_before_anything_runs(cluster: LocalCluster) -> None:
    response = post(cluster, "echo", content=b"x" * (17 * MIB), headers={"content-type": "application/octet-stream"})
    assert response.status_code == 413, response.text[:200]
    assert "16777216 bytes" in response.json()["error"]
    gpus = httpx.get(f"{cluster.gateway_url}/system/gpus", timeout=10, auth=cluster.admin_auth).json()
    assert all(g["lru"] == [] for g in gpus), "a refused payload must not start the function"


def test_a_result_over_the_limit_is_a_502_naming_its_size_and_the_worker_stays(cluster: LocalCluster) -> None:
    warm = post(cluster, "blob", json={"bytes": 10})
    assert warm.status_code == 200, warm.text
    response = post(cluster, "blob", json={"bytes": 17 * MIB})
    assert response.status_code == 502, response.text[:200]
    error = response.json()["error"]
    assert f"{17 * MIB} bytes" in error and "limit" in error
    again = post(cluster, "blob", json={"bytes": 10})
    assert again.status_code == 200 and again.headers["X-Cache"] == "hit"
    assert again.headers["X-Gpu"] == warm.headers["X-Gpu"]
