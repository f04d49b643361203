"""TLS with real processes: etcd taking only clients with a cluster certificate, a secure local
cluster whose links are TLS by default, and a capture between two network namespaces that shows
a payload in clear without TLS and not with it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpufaas import wire
from gpufaas.cluster import NodeRecord
from gpufaas.credentials import ensure_secrets
from gpufaas.dev.etcd_server import EtcdServer, free_port
from gpufaas.dev.local_cluster import LocalCluster, _answers
from gpufaas.keys import Keys
from gpufaas.netns import Hosts, NetnsUnavailable
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore, EtcdTls, StoreError
from gpufaas.tls import LinkTls, TlsFiles, ensure_tls
from tests.integration.conftest import ClusterFactory, EtcdTarget, deploy

pytestmark = pytest.mark.integration
REPOSITORY = Path(__file__).resolve().parents[2]
MARKER = b"gpufaas-marker-7f3a9c-in-the-payload"


def _etcd_tls(files: TlsFiles, role: str) -> EtcdTls:
    return EtcdTls(files.ca.read_bytes(), files.cert(role).read_bytes(), files.key(role).read_bytes())


def test_etcd_over_tls_takes_only_clients_with_a_certificate_of_the_cluster(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path / "tls")
    stranger = ensure_tls(tmp_path / "other")

    async def scenario(endpoint: str) -> None:
        store = await EtcdStore.open(endpoint, tls=_etcd_tls(files, "scheduler"))
        try:
            await store.put("/tls/k", b"v")
            assert (await store.get("/tls/k")) is not None
        finally:
            await store.close()
        for refused in (None, _etcd_tls(stranger, "scheduler")):
            with pytest.raises(StoreError):
                await EtcdStore.open(endpoint, tls=refused, timeout_s=2.0)

    with EtcdServer(tls_dir=files.directory).start(tmp_path / "etcd") as etcd:
        asyncio.run(scenario(etcd.endpoint))


def test_the_watchdogs_probe_of_a_tls_etcd_tells_a_running_one_from_a_stopped_one(tmp_path: Path) -> None:
    # The local cluster's etcd serves TLS only (client certificates asked for): a plain-HTTP probe
    # was never answered, so the watchdog killed the cluster's etcd every minute, for good.
    files = ensure_tls(tmp_path / "tls")
    with EtcdServer(tls_dir=files.directory).start(tmp_path / "etcd") as etcd:
        assert not _answers(f"http://{etcd.endpoint}/version", 0.5)  # the old probe
        assert _answers(f"tls://{etcd.endpoint}/version", 0.5)
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            assert not _answers(f"tls://{etcd.endpoint}/version", 0.5)  # accepted, never answered
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        assert _answers(f"tls://{etcd.endpoint}/version", 2.0)


def test_the_watchdogs_probe_of_a_local_clusters_etcd_leaves_no_warning_in_its_log(tmp_path: Path) -> None:
    # Four probes a second for as long as the cluster runs: one handshake without a certificate
    # is one "rejected connection" warning in etcd's log (about 47 MB a day of them).
    cluster = LocalCluster(tmp_path / "cluster")
    ensure_secrets(cluster.secrets.directory)
    probe_tls = cluster.probe_tls()
    assert probe_tls is not None
    with EtcdServer(tls_dir=cluster.secrets.tls.directory).start(tmp_path / "etcd") as etcd:
        log_path = tmp_path / "etcd" / "etcd.log"

        def rejected() -> int:
            return log_path.read_text(errors="replace").count("rejected connection")

        before = rejected()
        for _ in range(5):
            assert _answers(f"tls://{etcd.endpoint}/version", 2.0, probe_tls)
        time.sleep(0.5)  # (etcd writes its log as it goes)
        assert rejected() == before
        assert _answers(f"tls://{etcd.endpoint}/version", 2.0)  # no certificate shown: answered, and logged
        deadline = time.monotonic() + 5
        while rejected() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rejected() == before + 1


def test_a_secure_local_cluster_links_its_daemons_over_tls(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    deploy(cluster, "sealed", "echo_function", tmp_path, memory_mb=100)
    answered = httpx.post(
        f"{cluster.gateway_url}/function/sealed", json={"x": 1}, headers=cluster.invoke_headers, timeout=60
    )
    assert answered.status_code == 200 and answered.json()["echo"] == {"x": 1}, answered.text
    tls_dir = cluster.secrets.directory / "tls"
    gateway = LinkTls.load(tls_dir, "gateway")
    # A node's certificate shown where the scheduler takes gateways only.
    node_as_gateway = dataclasses.replace(LinkTls.load(tls_dir, "node"), role="gateway")

    async def probe() -> None:
        conn = await wire.connect(
            cluster.scheduler_address, key=cluster.wire_key, tls=gateway, peer_role="scheduler", timeout_s=10
        )
        assert conn.peer_role == "scheduler"
        await conn.aclose()
        for tls in (False, node_as_gateway):
            with pytest.raises(wire.ConnectionLost):
                conn = await wire.connect(cluster.scheduler_address, key=cluster.wire_key, tls=tls, timeout_s=3)
                await conn.request(MessageType.EXECUTE, pb.Execute(token=b"x" * 64), b"{}", timeout_s=3)

    asyncio.run(probe())

    async def attach_as_gateway() -> None:
        # A gateway's certificate and the cluster secret reach a node's port, as a gateway's calls
        # do; attaching with an epoch of its choosing (which would fence the real leader out) and
        # asking what runs there are the scheduler's alone.
        assert cluster.etcd_endpoint is not None
        store = await EtcdStore.open(
            cluster.etcd_endpoint, credentials=cluster.etcd_credentials, tls=cluster.etcd_client_tls
        )
        try:
            (node,) = [NodeRecord.from_json(kv.value) for kv in await store.get_prefix(Keys(cluster.root).nodes)]
        finally:
            await store.close()
        conn = await wire.connect(node.address, key=cluster.wire_key, tls=gateway, peer_role="node", timeout_s=10)
        try:
            for kind, message in (
                (MessageType.ATTACH, pb.Attach(scheduler_id="rogue", epoch=2**62)),
                (MessageType.WORKERS, pb.WorkersRequest()),
            ):
                with pytest.raises(wire.RemoteError) as refused:
                    await conn.request(kind, message, timeout_s=5)
                assert refused.value.status == pb.UNAUTHENTICATED and "only the scheduler" in refused.value.message
        finally:
            conn.close()

    asyncio.run(attach_as_gateway())
    again = httpx.post(
        f"{cluster.gateway_url}/function/sealed", json={"x": 2}, headers=cluster.invoke_headers, timeout=60
    )
    assert again.status_code == 200, again.text  # the leader is not fenced out


MessageType = wire.MessageType

_SERVER = """
import asyncio, sys
from pathlib import Path
from gpufaas import wire
from gpufaas.cluster import NodeRecord
from gpufaas.tls import LinkTls

class Echo:
    def on_frame(self, conn, frame):
        conn.reply(frame, wire.MessageType.EXECUTE_REPLY, frame.header, frame.body)
    def on_close(self, conn, exc):
        pass

async def main():
    tls = LinkTls.load(Path(sys.argv[2]), "node") if sys.argv[3] == "tls" else False
    server = wire.Server(Echo, key=b"k" * 32, tls=tls)
    await server.start(sys.argv[1])
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

_CLIENT = """
import asyncio, sys
from pathlib import Path
from gpufaas import wire
from gpufaas.cluster import NodeRecord
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.tls import LinkTls

async def main():
    tls = LinkTls.load(Path(sys.argv[2]), "scheduler") if sys.argv[3] == "tls" else False
    conn = await wire.connect(sys.argv[1], key=b"k" * 32, tls=tls, timeout_s=10)
    body = sys.argv[4].encode() * 100
    answer = await conn.request(wire.MessageType.EXECUTE, pb.Execute(token=b"t"), body, timeout_s=10)
    assert answer.body == body
    await conn.aclose()
    print("echoed", flush=True)

asyncio.run(main())
"""


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    if shutil.which("tcpdump") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true and tcpdump is not installed (scripts/test.sh installs it)")
        pytest.skip("tcpdump is not installed: `apt-get install -y tcpdump`")
    try:
        hosts = Hosts(["a", "b"])
    except NetnsUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the hosts harness cannot run: {exc}")
        pytest.skip(f"no network namespaces here: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()


def _captured(hosts: Hosts, tls_dir: Path, mode: str, capture: Path) -> bytes:
    """Run a wire echo server on host b and one call from host a carrying MARKER, in `mode`
    ("tls" or "plain"), with tcpdump capturing host b's traffic; the capture's bytes."""
    address = f"{hosts.address('b')}:7411"
    tcpdump = hosts.run(
        "b", ["tcpdump", "-i", "any", "--immediate-mode", "-U", "-s", "0", "-w", str(capture), "tcp port 7411"]
    )
    server = hosts.run(
        "b", [sys.executable, "-c", _SERVER, address, str(tls_dir), mode], cwd=REPOSITORY, stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        time.sleep(1.0)  # tcpdump has opened its capture (it prints nothing we could wait on in -w mode)
        client = [sys.executable, "-c", _CLIENT, address, str(tls_dir), mode, MARKER.decode()]
        done = subprocess.run(hosts.command("a", client), cwd=REPOSITORY, capture_output=True, timeout=60, check=False)
        assert done.stdout.strip() == b"echoed", done.stderr.decode()
        time.sleep(0.5)
    finally:
        for process in (server, tcpdump):
            os.kill(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
    data = capture.read_bytes()
    assert len(data) > 24 + 10 * 40, "the capture holds (almost) no packets"  # a pcap header is 24 bytes
    return data


def test_a_capture_between_two_hosts_shows_the_payload_without_tls_and_not_with_it(
    two_hosts: Hosts, tmp_path: Path
) -> None:
    tls_dir = ensure_tls(tmp_path / "tls").directory
    tmp_path.chmod(0o755)  # tcpdump drops to its own user on some builds; let it write there
    plain = _captured(two_hosts, tls_dir, "plain", tmp_path / "plain.pcap")
    assert MARKER in plain  # the capture sees payloads: the check below means something
    sealed = _captured(two_hosts, tls_dir, "tls", tmp_path / "tls.pcap")
    assert len(sealed) > len(MARKER) * 100  # the call crossed it
    assert MARKER not in sealed


def test_the_gateways_public_port_serves_https_with_a_users_certificate(
    etcd_endpoint: EtcdTarget, tmp_path: Path
) -> None:
    # The user's own CA and certificate (any the clients trust; made here with the same tool).
    user = ensure_tls(tmp_path / "user")
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "--insecure", "--etcd", etcd_endpoint.endpoint]
    argv += ["--root", etcd_endpoint.root, "--state-dir", str(tmp_path / "gw"), "--port", str(port)]
    argv += ["--scheduler", f"127.0.0.1:{free_port()}"]
    missing = subprocess.run(
        [*argv, "--public-cert-file", str(tmp_path / "none.pem"), "--public-key-file", str(user.key("gateway"))],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPOSITORY,
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    argv += ["--public-cert-file", str(user.cert("gateway")), "--public-key-file", str(user.key("gateway"))]
    gateway = subprocess.Popen(argv, cwd=REPOSITORY, stderr=(tmp_path / "gateway.log").open("wb"))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                answer = httpx.get(
                    f"https://127.0.0.1:{port}/openapi.json",
                    verify=ssl.create_default_context(cafile=user.ca),
                    timeout=2,
                )
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and gateway.poll() is None, "the gateway did not serve HTTPS"
                time.sleep(0.2)
        assert answer.status_code == 200
        with pytest.raises(httpx.TransportError):  # not plain HTTP any more
            httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=2)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
