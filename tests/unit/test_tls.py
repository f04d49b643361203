"""The cluster CA and role certificates (gpufaas.tls), and wire links over TLS on loopback:
mutual authentication, roles checked on both sides, expiry, another CA refused."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import stat
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cryptography import x509

from gpufaas import wire
from gpufaas.credentials import ensure_secrets
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.tls import ROLES, LinkTls, PeerRefused, TlsError, TlsFiles, ensure_tls, issue, role_of
from gpufaas.wire import Connection, Frame, MessageType, Server, connect

KEY = b"k" * 32
WAIT_S = 5.0
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    def run_(scenario: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            return runner.run(asyncio.wait_for(scenario, 30.0))

    return run_


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tls(tmp_path_factory.mktemp("cluster") / "tls").directory


class Echo:
    def __init__(self) -> None:
        self.frames: list[Frame] = []

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        conn.reply(frame, MessageType.EXECUTE_REPLY, frame.header, frame.body)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass


@contextlib.asynccontextmanager
async def node_server(tls_dir: Path) -> AsyncIterator[tuple[Server, Echo]]:
    """A wire server holding the node's certificate, answering by echo; closed at the end."""
    echo = Echo()
    server = Server(lambda: echo, key=KEY, tls=LinkTls.load(tls_dir, "node"))
    await server.start("127.0.0.1:0")
    try:
        yield server, echo
    finally:
        await server.close()


async def _until(predicate: Callable[[], object]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.005)


async def _call(conn: Connection) -> bytes:
    answer = await conn.request(MessageType.EXECUTE, pb.Execute(token=b"t"), b"payload", timeout_s=WAIT_S)
    return answer.body


# --- files ----------------------------------------------------------------------------------------


def test_ensure_secrets_makes_a_ca_and_a_certificate_per_role_with_private_keys(tmp_path: Path) -> None:
    files = TlsFiles(ensure_secrets(tmp_path / "secrets").directory / "tls")
    assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
    for role in ROLES:
        assert stat.S_IMODE(files.key(role).stat().st_mode) == 0o600
        assert files.cert(role).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert stat.S_IMODE(files.ca_key.stat().st_mode) == 0o600
    before = files.cert("node").read_bytes()
    ensure_secrets(tmp_path / "secrets")  # a restart keeps them
    assert files.cert("node").read_bytes() == before


def test_a_lost_ca_file_remakes_the_ca_and_reissues_every_role_and_a_lost_key_its_role(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path / "tls")
    first = {role: files.cert(role).read_bytes() for role in ROLES}
    files.key("gateway").unlink()
    ensure_tls(files.directory)
    assert files.cert("gateway").read_bytes() != first["gateway"]  # a new pair: the key was gone
    assert files.cert("node").read_bytes() == first["node"]
    LinkTls.load(files.directory, "gateway")
    ca = files.ca.read_bytes()
    files.ca.unlink()  # the CA's key is left: the pair is made again, and every role with it
    ensure_tls(files.directory)
    assert files.ca.read_bytes() != ca
    for role in ROLES:
        assert files.cert(role).read_bytes() != first[role]
    new_ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    for role in ROLES:  # each signed by the new CA (raises otherwise)
        x509.load_pem_x509_certificate(files.cert(role).read_bytes()).verify_directly_issued_by(new_ca)


def test_a_certificate_names_its_role_and_the_hosts_it_was_made_for(tls_dir: Path) -> None:
    from cryptography import x509

    files = TlsFiles(tls_dir)
    now = datetime.datetime.now(datetime.UTC)
    cert_pem, _ = issue(files.ca.read_bytes(), files.ca_key.read_bytes(), "node", now, name="n1", hosts=["10.231.0.2"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["gpufaas://node/n1"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1", "10.231.0.2"]
    with pytest.raises(ValueError, match="role must be one of"):
        issue(files.ca.read_bytes(), files.ca_key.read_bytes(), "admin", now)


def test_role_of_reads_one_role_and_refuses_none_or_two() -> None:
    assert role_of({"subjectAltName": (("URI", "gpufaas://scheduler/s"), ("DNS", "x"))}) == "scheduler"
    assert role_of({"subjectAltName": (("DNS", "scheduler"),)}) is None
    assert role_of({"subjectAltName": (("URI", "gpufaas://node/a"), ("URI", "gpufaas://scheduler/b"))}) is None
    assert role_of(None) is None


def test_a_peer_of_a_role_that_does_not_belong_is_refused_by_the_check(tls_dir: Path) -> None:
    gateway = LinkTls.load(tls_dir, "gateway", pinned={"10.0.0.1:7000": "scheduler"})
    node_cert = {"subjectAltName": (("URI", "gpufaas://node/node"),)}
    assert gateway.check(node_cert, "wire-client", "10.0.0.2:7001") == "node"
    with pytest.raises(PeerRefused, match=r"role node.*accepts scheduler"):
        gateway.check(node_cert, "wire-client", "10.0.0.1:7000")


def test_a_key_open_to_others_or_missing_is_refused_with_what_to_do(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path / "tls")
    files.key("node").chmod(0o644)
    with pytest.raises(TlsError, match="chmod 600"):
        LinkTls.load(files.directory, "node")
    files.key("node").unlink()
    with pytest.raises(TlsError, match=r"gpufaas\.credentials"):
        LinkTls.load(files.directory, "node")


# --- links ----------------------------------------------------------------------------------------


def test_scheduler_and_node_talk_over_tls_and_each_knows_the_others_role(run: Run, tls_dir: Path) -> None:
    async def scenario() -> None:
        server = Server(Echo, key=KEY, tls=LinkTls.load(tls_dir, "node"))
        await server.start("127.0.0.1:0")
        try:
            conn = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"))
            assert await _call(conn) == b"payload"
            assert conn.peer_role == "node"
            assert conn.transport is not None and conn.transport.get_extra_info("cipher") is not None
            (server_end,) = server.connections
            assert server_end.peer_role == "scheduler"
            await conn.aclose()
        finally:
            await server.close()

    run(scenario())


def test_a_flood_of_requests_over_tls_is_answered_whole_and_in_order(run: Run, tls_dir: Path) -> None:
    """Far more requests than one turn handles (wire.FRAMES_PER_TURN), sent at once over TLS: the
    server's reading pauses and resumes through the TLS layer, and each request gets its answer."""
    count = 20 * wire.FRAMES_PER_TURN + 3

    async def scenario() -> None:
        async with node_server(tls_dir) as (server, echo):
            conn = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"))
            answers = await asyncio.gather(
                *(
                    conn.request(MessageType.EXECUTE, pb.Execute(token=b"t"), str(i).encode(), timeout_s=WAIT_S)
                    for i in range(count)
                )
            )
            assert [answer.body for answer in answers] == [str(i).encode() for i in range(count)]
            assert [frame.body for frame in echo.frames] == [str(i).encode() for i in range(count)]
            await conn.aclose()

    run(scenario())


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_what_a_peer_sent_before_it_closed_is_all_handled_before_the_close(run: Run, tls_dir: Path, tls: bool) -> None:
    """A receiver that reads a flood and its sender's close in one go (TLS reads the close_notify
    with the data) handles every frame before it hears the close, though the frames take it
    several turns (wire.FRAMES_PER_TURN at a time)."""
    count = 50 * wire.FRAMES_PER_TURN
    heard: list[str] = []

    class Tally:
        def on_frame(self, conn: Connection, frame: Frame) -> None:
            heard.append(frame.message(pb.Done).call_id)

        def on_close(self, conn: Connection, exc: BaseException | None) -> None:
            heard.append("closed")

    async def scenario() -> None:
        server = Server(Tally, key=KEY, tls=LinkTls.load(tls_dir, "node") if tls else False)
        await server.start("127.0.0.1:0")
        try:
            conn = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler") if tls else False)
            (server_end,) = server.connections
            assert server_end.transport is not None
            server_end.transport.pause_reading()  # busy: everything below waits in its socket
            for i in range(count):
                conn.send(MessageType.DONE, pb.Done(call_id=f"c{i}"))
            await asyncio.sleep(0)  # the frames leave in one write
            conn.close()
            await asyncio.sleep(0.05)
            server_end.transport.resume_reading()
            await asyncio.wait_for(asyncio.shield(server_end.closed), WAIT_S)
        finally:
            await server.close()

    run(scenario())
    assert heard == [f"c{i}" for i in range(count)] + ["closed"]


def test_a_node_certificate_cannot_act_as_the_scheduler(run: Run, tls_dir: Path) -> None:
    async def scenario() -> None:
        async with node_server(tls_dir) as (server, echo):
            # A node dialling a node's wire port as if it were the scheduler: the node refuses it.
            with pytest.raises(wire.ConnectionLost):
                conn = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "node"), timeout_s=WAIT_S)
                await _call(conn)
            assert echo.frames == []
            # A node listening where the gateway expects its scheduler: the gateway refuses it.
            gateway = LinkTls.load(tls_dir, "gateway", pinned={server.address: "scheduler"})
            with pytest.raises(wire.Unauthenticated, match="role node"):
                await connect(server.address, key=KEY, tls=gateway)
            # What the gateway's router says it dials, where no address is pinned.
            with pytest.raises(wire.Unauthenticated, match="accepts scheduler"):
                await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "gateway"), peer_role="scheduler")

    run(scenario())


def test_peers_that_close_during_tls_hold_no_handshake_slot_and_tls_peers_short_of_the_key_do(
    run: Run, tls_dir: Path
) -> None:
    """A TLS handshake that fails is never told to the wire (asyncio, uvloop): a connection counted
    toward `max_unauthenticated` from its TCP accept held its slot for the handshake time, so a
    burst of probes that connect and close (a port scan, a TCP readiness probe) locked every peer
    out. A slot is taken once TLS is done, and held until the key handshake is."""
    cap = 3

    async def scenario() -> None:
        server = Server(Echo, key=KEY, tls=LinkTls.load(tls_dir, "node"), max_unauthenticated=cap)
        await server.start("127.0.0.1:0")
        host, port = server.address.rsplit(":", 1)
        try:
            for _ in range(4 * cap):  # connect and close at once, TLS never started
                _, writer = await asyncio.open_connection(host, int(port))
                writer.close()
            await asyncio.sleep(0.2)
            assert not server.handshaking
            conn = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"), timeout_s=WAIT_S)
            assert await _call(conn) == b"payload"
            # Peers with a certificate that stop before the key handshake do take the slots.
            client_tls = LinkTls.load(tls_dir, "gateway").client
            silent = [await asyncio.open_connection(host, int(port), ssl=client_tls) for _ in range(cap)]
            await _until(lambda: len(server.handshaking) == cap)
            with pytest.raises(wire.ConnectionLost):
                await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"), timeout_s=1.0)
            silent[0][1].close()
            await _until(lambda: len(server.handshaking) == cap - 1)
            late = await connect(server.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"), timeout_s=WAIT_S)
            assert await _call(late) == b"payload"
            for connection in (conn, late):
                await connection.aclose()
            for _, writer in silent[1:]:
                writer.close()
        finally:
            await server.close()

    run(scenario())


def test_a_valid_certificate_without_the_cluster_secret_opens_nothing(run: Run, tls_dir: Path) -> None:
    """The key handshake inside TLS: a leaked certificate and key alone do not make a peer."""

    async def scenario() -> None:
        async with node_server(tls_dir) as (server, echo):
            scheduler = LinkTls.load(tls_dir, "scheduler")
            with pytest.raises(wire.Unauthenticated, match="wrong cluster secret"):
                await connect(server.address, key=b"x" * 32, tls=scheduler)
            assert echo.frames == []

    run(scenario())


def test_a_certificate_of_another_ca_is_refused_both_ways(run: Run, tls_dir: Path, tmp_path: Path) -> None:
    other = ensure_tls(tmp_path / "other").directory

    async def scenario() -> None:
        async with node_server(tls_dir) as (server, echo):
            with pytest.raises(wire.ConnectionLost):  # the server refuses the stranger's certificate
                conn = await connect(server.address, key=KEY, tls=LinkTls.load(other, "scheduler"), timeout_s=WAIT_S)
                await _call(conn)
            assert echo.frames == []
            with pytest.raises(wire.Unauthenticated, match="certificate verify failed"):
                await connect(server.address, key=KEY, tls=LinkTls.load(other, "scheduler"))
            with pytest.raises(wire.ConnectionLost):  # a client without TLS gets nothing either
                conn = await connect(server.address, key=KEY, tls=False, timeout_s=1.0)
                await _call(conn)
        assert all(c.is_closed for c in server.connections)

    run(scenario())


def test_an_expired_certificate_is_refused(run: Run, tls_dir: Path, tmp_path: Path) -> None:
    files = TlsFiles(tls_dir)
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    cert_pem, key_pem = issue(files.ca.read_bytes(), files.ca_key.read_bytes(), "scheduler", long_ago, valid_days=1)
    expired = TlsFiles(tmp_path / "expired")
    expired.directory.mkdir()
    expired.ca.write_bytes(files.ca.read_bytes())
    expired.cert("scheduler").write_bytes(cert_pem)
    expired.key("scheduler").write_bytes(key_pem)
    expired.key("scheduler").chmod(0o600)

    async def scenario() -> None:
        async with node_server(tls_dir) as (server, echo):
            with pytest.raises(wire.ConnectionLost):
                # (loaded as of a moment it was valid: a daemon refuses to start with it, below)
                then = long_ago + datetime.timedelta(hours=1)
                links = LinkTls.load(expired.directory, "scheduler", now=then)
                conn = await connect(server.address, key=KEY, tls=links)
                await _call(conn)
            assert echo.frames == []

    run(scenario())


def test_a_daemon_refuses_its_own_expired_certificate_and_ensure_tls_issues_it_again(tmp_path: Path) -> None:
    files = ensure_tls(tmp_path / "tls")
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=900)  # past the roles' 825 days
    before = {role: files.cert(role).read_bytes() for role in ROLES}
    with pytest.raises(TlsError, match=r"node\.pem expired on .*gpufaas\.credentials SECRETS_DIR` makes a new one"):
        LinkTls.load(files.directory, "node", now=later)
    ensure_tls(files.directory, now=later)
    LinkTls.load(files.directory, "node", now=later)
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    for role in ROLES:  # each issued again, by the same CA (still valid: 10 years)
        assert files.cert(role).read_bytes() != before[role]
        x509.load_pem_x509_certificate(files.cert(role).read_bytes()).verify_directly_issued_by(ca)
    much_later = later + datetime.timedelta(days=3650)  # past the CA's 10 years too
    with pytest.raises(TlsError, match=r"ca\.pem expired on .* makes a new CA"):
        LinkTls.load(files.directory, "node", now=much_later)
    ensure_tls(files.directory, now=much_later)
    assert x509.load_pem_x509_certificate(files.ca.read_bytes()) != ca
    LinkTls.load(files.directory, "node", now=much_later)


def test_a_certificate_issued_again_keeps_the_hosts_the_expired_one_named(tmp_path: Path) -> None:
    # Made with --tls-host, an expired certificate was issued again with the hosts of the run that
    # found it expired: docker-compose's, every `up`, passes none, so etcd's lost its DNS name and
    # every daemon dialling etcd by it was refused once the renewal was in place.
    files = ensure_tls(tmp_path / "tls", hosts=("etcd.example", "10.0.0.5"))
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=900)  # past the roles' 825 days
    ensure_tls(files.directory, hosts=("10.0.0.6",), now=later)
    cert = x509.load_pem_x509_certificate(files.cert("etcd").read_bytes())
    assert cert.not_valid_after_utc > later
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    addresses = {str(address) for address in names.get_values_for_type(x509.IPAddress)}
    assert addresses == {"127.0.0.1", "::1", "10.0.0.5", "10.0.0.6"}
    assert sorted(names.get_values_for_type(x509.DNSName)) == ["etcd", "etcd.example", "localhost"]


def test_a_link_with_tls_at_one_end_only_is_refused_saying_so_at_both_ends(
    run: Run, tls_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: on uvloop a TLS client to a plain server got "cannot connect to ADDR: " (an empty
    # reason), the server logged a frame of 369295620 bytes, and a plain client to a TLS server
    # "closed during the handshake": nothing said that one daemon ran without TLS.
    same_setting = "one end runs with TLS and the other without"

    async def scenario() -> None:
        plain = Server(Echo, key=KEY, tls=False)
        with_tls = Server(Echo, key=KEY, tls=LinkTls.load(tls_dir, "node"), handshake_s=1.0)
        await plain.start("127.0.0.1:0")
        await with_tls.start("127.0.0.1:0")
        try:
            with pytest.raises(wire.ConnectionLost, match=same_setting):
                await connect(plain.address, key=KEY, tls=LinkTls.load(tls_dir, "scheduler"), timeout_s=WAIT_S)
            await _until(lambda: "began a TLS handshake, and this end reads plain frames" in caplog.text)
            with pytest.raises(wire.ConnectionLost, match=same_setting):
                await connect(with_tls.address, key=KEY, tls=False, timeout_s=WAIT_S)
        finally:
            await plain.close()
            await with_tls.close()

    caplog.set_level("WARNING", logger="gpufaas.wire")
    run(scenario())


# --- blob fetches ---------------------------------------------------------------------------------


def test_a_node_fetches_a_blob_over_tls_and_holders_refuse_the_wrong_roles(tmp_path: Path, tls_dir: Path) -> None:
    from gpufaas.blobnet import BlobServer, TransferError, fetch_blob
    from gpufaas.blobs import BlobStore

    node = LinkTls.load(tls_dir, "node")
    server = BlobServer(BlobStore(tmp_path / "holder"), lambda method, authorization: None, tls=node)
    url = f"http://{server.start('127.0.0.1:0')}"
    try:
        data = b"weights" * 300_000  # over the sendfile chunk path's first write
        digest = server.store.put(data)
        path = fetch_blob(url, digest, len(data), BlobStore(tmp_path / "mine"), tls=node)
        assert path.read_bytes() == data
        for refused in (False, LinkTls.load(tls_dir, "scheduler")):  # no certificate; a role not taken
            with pytest.raises(TransferError):
                fetch_blob(url, digest, len(data), BlobStore(tmp_path / f"other-{refused}"), tls=refused, timeout_s=5)
        # A holder showing a scheduler's certificate is no holder to a node.
        impostor = BlobServer(server.store, lambda method, authorization: None, tls=LinkTls.load(tls_dir, "scheduler"))
        impostor_url = f"http://{impostor.start('127.0.0.1:0')}"
        try:
            with pytest.raises(TransferError, match="not one of this cluster's"):
                fetch_blob(impostor_url, digest, len(data), BlobStore(tmp_path / "fooled"), tls=node, timeout_s=5)
        finally:
            impostor.stop()
    finally:
        server.stop()


def test_the_gateways_blob_server_takes_users_in_plain_http_and_nodes_in_tls(tmp_path: Path, tls_dir: Path) -> None:
    from gpufaas.blobnet import BlobServer, TransferError, fetch_blob, upload_blob
    from gpufaas.blobs import BlobStore
    from gpufaas.packages import sha256_digest

    gateway = LinkTls.load(tls_dir, "gateway")
    server = BlobServer(BlobStore(tmp_path / "gw"), lambda m, a: None, accept_uploads=True, tls=gateway)
    url = f"http://{server.start('127.0.0.1:0')}"
    try:
        data = b"package" * 10_000
        blob = tmp_path / "blob"
        blob.write_bytes(data)
        digest = sha256_digest(data)
        upload_blob(url, blob, digest)  # the CLI: no certificate, plain HTTP
        assert server.store.path(digest) is not None
        fetched = fetch_blob(url, digest, len(data), BlobStore(tmp_path / "n"), tls=LinkTls.load(tls_dir, "node"))
        assert fetched.read_bytes() == data
        with pytest.raises(TransferError):  # in TLS, the role is checked still
            fetch_blob(url, digest, len(data), BlobStore(tmp_path / "s"), tls=LinkTls.load(tls_dir, "scheduler"))
        # Another gateway fetches from it and pushes a copy to it over TLS (the admin's credential
        # it shows to push never crosses in clear).
        copied = fetch_blob(url, digest, len(data), BlobStore(tmp_path / "g2"), tls=gateway)
        assert copied.read_bytes() == data
        other = tmp_path / "other"
        other.write_bytes(b"second" * 1000)
        upload_blob(url, other, sha256_digest(other.read_bytes()), tls=gateway)
        assert server.store.path(sha256_digest(other.read_bytes())) is not None
    finally:
        server.stop()


# --- daemons --------------------------------------------------------------------------------------


def test_a_daemon_with_credentials_turns_tls_on_by_itself_and_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.settings import GatewaySettings
    from gpufaas.service_main import configure_tls
    from gpufaas.tls import configure, process_links

    secrets = ensure_secrets(tmp_path / "secrets")
    parser = GatewaySettings.parser("gateway", "")
    base = {"state_dir": tmp_path / "state", "scheduler": "127.0.0.1:7000"}
    try:
        links = configure_tls(parser, GatewaySettings(**base, secret_file=secrets.cluster_secret), "gateway")
        assert links is not None and process_links() is links
        assert links.role == "gateway" and links.pinned == {"127.0.0.1:7000": "scheduler"}
        bare = tmp_path / "bare"  # credentials made before TLS existed: plain links, said in the log
        bare.mkdir()
        (bare / "cluster-secret").write_text("s\n")
        assert configure_tls(parser, GatewaySettings(**base, secret_file=bare / "cluster-secret"), "gateway") is None
        assert process_links() is None
        told_off = GatewaySettings(**base, secret_file=secrets.cluster_secret, tls=False)
        assert configure_tls(parser, told_off, "gateway") is None
        for settings, message in [
            (GatewaySettings(**base, tls=False, tls_dir=tmp_path), "--no-tls excludes --tls-dir"),
            (GatewaySettings(**base, insecure=True, tls_dir=tmp_path), "--insecure excludes --tls-dir"),
            (GatewaySettings(**base, tls_dir=tmp_path / "nowhere"), "does not exist; `python -m gpufaas.credentials"),
            (GatewaySettings(**base, secret_file=bare / "cluster-secret", etcd_tls=True), "--etcd-tls needs"),
        ]:
            with pytest.raises(SystemExit):
                configure_tls(parser, settings, "gateway")
            assert message in capsys.readouterr().err
    finally:
        configure(None)
