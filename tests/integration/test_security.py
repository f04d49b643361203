"""Credentials over a real cluster: the gateway's routes, the daemons' wire, package downloads,
daemons that will not start open, and the CLI's login."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpufaas.credentials import derive, read_secret
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost, MessageType, Unauthenticated, connect
from tests.integration.conftest import ClusterFactory, EtcdTarget, deploy
from tests.integration.test_control_plane import etcd_state_when

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_without_credentials_nothing_is_deployed_listed_or_called(
    make_cluster: ClusterFactory, tmp_path: Path, etcd_endpoint: EtcdTarget
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    url = cluster.gateway_url
    package = deploy_package(cluster, tmp_path)
    refused = httpx.post(f"{url}/system/packages", content=package, timeout=30)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
    spec = {"name": "intruder", "package_digest": "sha256:" + "0" * 64, "memory_mb": 100}
    assert httpx.post(f"{url}/system/functions", json=spec, timeout=30).status_code == 401
    invoker = cluster.invoke_headers
    assert httpx.post(f"{url}/system/functions", json=spec, headers=invoker, timeout=30).status_code == 403
    assert httpx.get(f"{url}/system/functions", timeout=30).status_code == 401
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200

    model = deploy(cluster, "guarded", "echo_function", tmp_path, memory_mb=100)["model"]
    assert httpx.post(f"{url}/function/guarded", json={}, timeout=30).status_code == 401
    answered = httpx.post(f"{url}/function/guarded", json={"x": 1}, headers=invoker, timeout=60)
    assert answered.status_code == 200 and answered.json()["echo"] == {"x": 1}
    # Packages: a node's own token downloads (the call above was a miss: its node fetched the
    # package), an anonymous client does not.
    described = httpx.get(f"{url}/system/function/guarded", auth=cluster.admin_auth, timeout=30).json()
    assert httpx.get(f"{url}/system/packages/{described['package_digest']}", timeout=30).status_code == 401
    # The scheduler writes its cache lists to etcd after the dispatch, not before the reply.
    etcd_state_when(etcd_endpoint.endpoint, etcd_endpoint.root, lambda state: str(model) in state[1])
    assert "intruder" not in {f["name"] for f in list_functions(cluster)}


def test_a_public_function_needs_no_credential(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    deploy(cluster, "open", "echo_function", tmp_path, memory_mb=100, public=True)
    response = httpx.post(f"{cluster.gateway_url}/function/open", json={"y": 2}, timeout=60)
    assert response.status_code == 200 and response.json()["echo"] == {"y": 2}


def test_the_daemons_wire_reads_nothing_from_a_peer_without_the_cluster_secret(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    deploy(cluster, "target", "echo_function", tmp_path, memory_mb=100)
    (node_address,) = node_addresses(cluster)
    wrong = derive("not the secret", "wire/v1")

    async def probe() -> None:
        for address in (cluster.scheduler_address, node_address):
            with pytest.raises(Unauthenticated, match="wrong cluster secret"):
                await connect(address, key=wrong, timeout_s=5)
            # No key at all: the first message is the last (an Execute with any token, a Place).
            conn = await connect(address, timeout_s=5)
            with pytest.raises(ConnectionLost):
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"x" * 64), b"{}", timeout_s=5)
            # The genuine key gets in.
            genuine = await connect(address, key=cluster.wire_key, timeout_s=5)
            await genuine.aclose()

    asyncio.run(probe())
    # The cluster still serves.
    response = httpx.post(f"{cluster.gateway_url}/function/target", json={}, headers=cluster.invoke_headers, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("daemon", ["scheduler", "gateway", "gpu_manager"])
def test_a_daemon_does_not_start_open_unless_told_to(daemon: str, tmp_path: Path) -> None:
    extra = ["--state-dir", str(tmp_path)] if daemon != "scheduler" else []
    absent = run_daemon(daemon, *extra)
    assert absent.returncode == 2 and "--secret-file is required" in absent.stderr
    loose = tmp_path / "secret"
    loose.write_text("s3cret\n")
    os.chmod(loose, 0o644)
    opened = run_daemon(daemon, *extra, "--secret-file", str(loose))
    assert opened.returncode == 2 and f"chmod 600 {loose}" in opened.stderr
    assert "Traceback" not in absent.stderr + opened.stderr


def test_the_cli_finds_the_local_clusters_password_and_login_keeps_another(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    deploy(cluster, "listed", "echo_function", tmp_path, memory_mb=100)
    env = {**os.environ, "GPUFAAS_CONFIG_DIR": str(tmp_path / "config"), "GPUFAAS_PASSWORD": ""}
    gateway = ["--gateway", cluster.gateway_url]
    # Another state directory: the CLI has no password for this gateway.
    stranger = cli(["ls", *gateway], {**env, "GPUFAAS_STATE_DIR": str(tmp_path / "elsewhere")})
    assert stranger.returncode == 1 and "needs credentials" in stranger.stderr and "gpufaas login" in stranger.stderr
    # The cluster's own state directory: found there.
    local = cli(["ls", *gateway], {**env, "GPUFAAS_STATE_DIR": str(cluster.state_dir)})
    assert local.returncode == 0 and "listed" in local.stdout
    # login: a wrong password is refused and not kept; the right one is kept (0600) and used.
    elsewhere = {**env, "GPUFAAS_STATE_DIR": str(tmp_path / "elsewhere")}
    bad = cli(["login", *gateway, "--password-stdin"], elsewhere, stdin="guess\n")
    assert bad.returncode == 1 and "refused that password" in bad.stderr
    assert not (tmp_path / "config" / "credentials.json").exists()
    password = read_secret(cluster.secrets.admin_password)
    good = cli(["login", *gateway, "--password-stdin"], elsewhere, stdin=password + "\n")
    assert good.returncode == 0, good.stderr
    kept = tmp_path / "config" / "credentials.json"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert json.loads(kept.read_text()) == {cluster.gateway_url: password}
    assert "listed" in cli(["ls", *gateway], elsewhere).stdout


def test_etcd_authentication_locks_the_clusters_state_to_the_daemons(tmp_path: Path) -> None:
    """A cluster with etcd's own authentication (compose and k8s run this way): the daemons turn
    it on and serve; a client without the password reads nothing; a daemon with a wrong one says so."""
    from gpufaas.store import EtcdStore, StoreError
    from tests.integration.conftest import stop_clusters

    cluster = LocalCluster(
        state_dir=tmp_path / "cluster", etcd_auth=True, nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000
    )
    watched: list[int] = []
    try:
        cluster.start()
        watched.extend(cluster.pids().values())
        deploy(cluster, "behind", "echo_function", tmp_path, memory_mb=100)
        response = httpx.post(
            f"{cluster.gateway_url}/function/behind", json={"z": 3}, headers=cluster.invoke_headers, timeout=60
        )
        assert response.status_code == 200 and response.json()["echo"] == {"z": 3}
        assert cluster.etcd_endpoint is not None
        endpoint = cluster.etcd_endpoint

        async def probe() -> int:
            plain = EtcdStore(endpoint, timeout_s=5)  # its own etcd takes TLS clients with certificates only
            with pytest.raises(StoreError):
                await plain.get_prefix("/")
            await plain.close()
            # A certificate without the password: etcd takes the certificate's name for a user that
            # has no role, and refuses.
            bare = EtcdStore(endpoint, timeout_s=5, tls=cluster.etcd_client_tls)
            with pytest.raises(StoreError, match="permission denied"):
                await bare.get_prefix("/")
            with pytest.raises(StoreError):
                await bare.put(f"{cluster.root}/nodes/intruder", b"{}")
            await bare.close()
            store = await EtcdStore.open(
                endpoint, timeout_s=5, credentials=cluster.etcd_credentials, tls=cluster.etcd_client_tls
            )
            try:
                return len(await store.get_prefix(f"{cluster.root}/"))
            finally:
                await store.close()

        assert asyncio.run(probe()) > 0
        wrong = tmp_path / "wrong-etcd-password"
        wrong.write_text("guess\n")
        os.chmod(wrong, 0o600)
        refused = run_daemon(
            "scheduler",
            "--etcd",
            endpoint,
            "--secret-file",
            str(cluster.secrets.cluster_secret),
            "--etcd-password-file",
            str(wrong),
            "--etcd-tls",
        )
        assert refused.returncode == 1 and "--etcd-password-file" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        stop_clusters([cluster], watched)


# --- helpers ----------------------------------------------------------------------------------


def deploy_package(cluster: LocalCluster, tmp_path: Path) -> bytes:
    from tests.fixtures.make_packages import build_package

    return build_package("echo_function", tmp_path).read_bytes()


def list_functions(cluster: LocalCluster) -> list[dict[str, object]]:
    listed: list[dict[str, object]] = httpx.get(
        f"{cluster.gateway_url}/system/functions", auth=cluster.admin_auth, timeout=30
    ).json()
    return listed


def node_addresses(cluster: LocalCluster) -> list[str]:
    """The wire addresses the cluster's nodes registered in etcd."""
    from gpufaas.cluster import NodeRecord
    from gpufaas.keys import Keys
    from gpufaas.store import EtcdStore

    async def read() -> list[str]:
        assert cluster.etcd_endpoint is not None
        store = await EtcdStore.open(cluster.etcd_endpoint, tls=cluster.etcd_client_tls)
        try:
            kvs = await store.get_prefix(Keys(cluster.root).nodes)
        finally:
            await store.close()
        return [NodeRecord.from_json(kv.value).address for kv in kvs]

    return asyncio.run(read())


def run_daemon(daemon: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUFAAS_SECRET_FILE"}
    return subprocess.run(
        [sys.executable, "-m", daemon, *(["--etcd", "127.0.0.1:1"] if "--etcd" not in argv else []), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        check=False,
    )


def cli(argv: list[str], env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    gpufaas = Path(sys.executable).parent / "gpufaas"
    return subprocess.run(
        [str(gpufaas), *argv], capture_output=True, text=True, timeout=60, env=env, input=stdin, check=False
    )
