"""Integration fixtures: a real etcd on loopback for the session, and a fresh key root per test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from gpufaas.dev.etcd_server import EtcdServer
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.processes import descendants, survivors
from gpufaas.tls import LinkTls, configure
from tests.fixtures.make_packages import build_package


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the whole session (stopped by PID at the end, and checked gone)."""
    server = EtcdServer().start(tmp_path_factory.mktemp("etcd"))
    pid = server.pid
    try:
        yield server
    finally:
        server.stop()
        assert not survivors([pid]), f"etcd (pid {pid}) is still running after stop()"


class EtcdTarget(NamedTuple):
    endpoint: str  # "127.0.0.1:PORT"
    root: str  # "/t-<hex>": this test's own key root (a Keys(root) or a store prefix)


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> EtcdTarget:
    """The session's etcd and a key root no other test uses, so tests need no cleanup."""
    return EtcdTarget(etcd_server.endpoint, f"/t-{uuid.uuid4().hex[:12]}")


# --- whole clusters -------------------------------------------------------------------------


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def make_cluster(etcd_endpoint: EtcdTarget, tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start LocalClusters (scheduler, gateway, GPU managers as real processes) on the session's
    etcd under this test's own key root; stops them by PID and checks that none survives."""
    clusters: list[LocalCluster] = []
    watched: list[int] = []

    def factory(**options: object) -> LocalCluster:
        cluster = LocalCluster(
            state_dir=tmp_path / f"cluster{len(clusters)}",
            etcd_endpoint=etcd_endpoint.endpoint,
            root=etcd_endpoint.root,
            **options,  # type: ignore[arg-type]
        )
        clusters.append(cluster)
        cluster.start()
        watched.extend(cluster.pids().values())
        if cluster.secure and cluster.tls:
            # Tests that speak the wire to the cluster's daemons do so as its gateway would: over
            # TLS with the gateway's certificate (the daemons refuse plain links).
            configure(LinkTls.load(cluster.secrets.directory / "tls", "gateway"))
        return cluster

    try:
        yield factory
    finally:
        configure(None)
        stop_clusters(clusters, watched)


def stop_clusters(clusters: list[LocalCluster], watched: list[int]) -> None:
    """Stop clusters by PID, then check that none of `watched` (their processes, recorded at start)
    nor any worker below them survives."""
    for cluster in clusters:
        for component in cluster.components.values():
            if component.pid is not None:
                watched.extend(descendants(component.pid))
        cluster.stop()
    leftovers = survivors(watched)
    assert not leftovers, f"processes left running: {leftovers}"


def deploy(cluster: LocalCluster, name: str, fixture: str, tmp_path: Path, **spec: object) -> dict[str, object]:
    """Upload a fixture package and deploy it as `name`; returns the gateway's answer."""
    package = tmp_path / f"{fixture}.tar.gz"
    if not package.exists():
        package = build_package(fixture, tmp_path)
    uploaded = httpx.post(
        f"{cluster.gateway_url}/system/packages", content=package.read_bytes(), timeout=30, auth=cluster.admin_auth
    )
    assert uploaded.status_code == 201, uploaded.text
    body = {"name": name, "package_digest": uploaded.json()["digest"], "memory_mb": 800, **spec}
    response = httpx.post(f"{cluster.gateway_url}/system/functions", json=body, timeout=30, auth=cluster.admin_auth)
    assert response.status_code == 202, response.text
    result: dict[str, object] = response.json()
    return result
