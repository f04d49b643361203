"""The CLI's side of a gateway (`gpufaas.cli.client`, `uploads`): which gateway and password a
command uses, what it sends where, and what it says when the other end is not a gateway."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from gpufaas.cli import app, uploads
from gpufaas.cli.client import DEFAULT_GATEWAY, GatewayClient, gateway_url
from gpufaas.errors import GpufaasError
from gpufaas.packages import DigestCache

FUNCTION = {"name": "f", "memory_mb": 100, "batch_size": 1, "timeout_s": 5.0, "gpu": "any"}
FUNCTION |= {"invocationCount": 0, "replicas": 0}
GPU = {"node": "n", "gpu": "n/0", "gpu_type": "t", "status": "idle", "memory_used_mb": 0}
GPU |= {"memory_capacity_mb": 10, "local_queue": 0, "lru": []}


@dataclass
class Stand:
    """A real HTTP server on loopback standing in for a gateway: it answers every request with
    `answers[path]` (status, body, content type; by default a 200 fit for the route), or 401 when
    `password` is set and not given, and records
    each request's method, path and Authorization."""

    url: str = ""
    password: str | None = None  # set: a request without admin:password is a 401
    answers: dict[str, tuple[int, bytes, str]] = field(default_factory=dict)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)  # each request's body, as seen

    def answer(self, path: str, status: int, document: object) -> None:
        self.answers[path] = (status, json.dumps(document).encode(), "application/json")


DEFAULT_ANSWERS = {
    "/system/functions": [FUNCTION],
    "/system/function/f": FUNCTION,
    "/system/gpus": [GPU],
    "/system/info": {"provider": "gpufaas"},
    "/function/f": {"out": 1},
}


@pytest.fixture
def stand() -> Iterator[Stand]:
    gateway = Stand()

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            gateway.bodies.append(self.rfile.read(length))
            path = self.path.split("?")[0]
            gateway.seen.append((self.command, path, self.headers.get("Authorization")))
            document = {"name": "f", "deleted": True} if self.command == "DELETE" else DEFAULT_ANSWERS.get(path, {})
            status, body, kind = gateway.answers.get(path, (200, json.dumps(document).encode(), "application/json"))
            if gateway.password is not None and self.headers.get("Authorization") != basic(gateway.password):
                status, body = 401, b'{"error": "unauthorized"}'
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.answer()

        def do_POST(self) -> None:
            self.answer()

        def do_DELETE(self) -> None:
            self.answer()

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    gateway.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield gateway
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory ($GPUFAAS_STATE_DIR), no saved login, no $GPUFAAS_URL or $GPUFAAS_PASSWORD."""
    monkeypatch.setenv("GPUFAAS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GPUFAAS_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("GPUFAAS_URL", raising=False)
    monkeypatch.delenv("GPUFAAS_PASSWORD", raising=False)
    (tmp_path / "state").mkdir()
    return tmp_path / "state"


def local_cluster(state: Path, url: str, password: str, *, running: bool = True) -> None:
    """What `gpufaas up` leaves in `state`: cluster.json (its gateway at `url`), the admin
    password, and pids.json (this test's PID, alive, when `running`)."""
    secrets = state / "secrets"
    secrets.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(secrets / "admin-password", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    (state / "cluster.json").write_text(json.dumps({"gateway_url": url, "secrets": str(secrets)}))
    (state / "pids.json").write_text(json.dumps({"gateway": os.getpid() if running else 2**22 + 1}))


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()


def cli(*args: str) -> tuple[int, str, str]:
    """Run a command: its exit status, stdout and stderr (one line); a traceback fails the test."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"gpufaas {' '.join(args)}: a traceback") from result.exception
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


@pytest.fixture
def listener() -> Iterator[tuple[str, list[bytes]]]:
    """A raw TCP listener on loopback standing in for a blob server: its http:// URL, and what
    every connection to it sent (it answers nothing)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    heard: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    heard.append(conn.recv(65536))
                except OSError:
                    heard.append(b"")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", heard
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_a_deploy_to_an_https_gateway_sends_no_credential_to_its_plain_http_blob_server(
    tmp_path: Path, listener: tuple[str, list[bytes]]
) -> None:
    """The gateway advertises its blob server as http://; reached over https, the CLI uploads a
    large blob through the API instead, and the blob server hears nothing (no admin password)."""
    blob_url, heard = listener
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    (tmp_path / "fn" / "weights.bin").write_bytes(b"w" * (uploads.BATCH_MAX_BYTES + 1))
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    blobs = scanned[0].manifest.blobs()
    through_api: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/system/blobs/missing":
            asked = list(json.loads(request.read())["blobs"])
            return httpx.Response(200, json={"missing": asked, "offsets": {}, "upload_url": blob_url})
        if request.method == "HEAD":
            return httpx.Response(404)
        if request.method == "PUT":
            request.read()
            through_api.append(path.rsplit("/", 1)[1])
            return httpx.Response(201, json={})
        if path == "/system/packages":
            return httpx.Response(201, json={"digest": scanned[0].manifest.digest})
        return httpx.Response(200, json={})

    client = GatewayClient("https://127.0.0.1:1", password="the-admin-password")
    client._client = httpx.Client(base_url=client.url, transport=httpx.MockTransport(gateway))
    report = uploads.upload(client, scanned)
    assert report.via_api
    assert len(through_api) == 1 and blobs[through_api[0]] > uploads.BATCH_MAX_BYTES
    assert heard == [], heard  # not a byte: no HEAD, no Authorization


def test_a_blob_another_transfer_writes_is_waited_for_not_a_failed_deploy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two deploys sharing weights, at once: the gateway answers the second's HEAD 409 while the
    first writes the blob. The deploy waits and asks again (here it is there by then), sending
    none of the blob meanwhile; a PUT refused busy (the writer came after the HEAD) waits too."""
    monkeypatch.setattr(uploads, "BUSY_WAIT_S", 0.0)
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    (tmp_path / "fn" / "weights.bin").write_bytes(b"w" * (uploads.BATCH_MAX_BYTES + 1))
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    heads: list[int] = []
    puts: list[int] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/system/blobs/missing":
            asked = list(json.loads(request.read())["blobs"])
            return httpx.Response(200, json={"missing": asked, "offsets": {}, "upload_url": None})
        if request.method == "HEAD":
            heads.append(1)
            return httpx.Response({1: 409, 2: 409, 3: 404}.get(len(heads), 200))  # written by the other by then
        if request.method == "PUT":
            request.read()
            puts.append(1)
            return httpx.Response(409, json={"error": "blob is being written by another transfer"})
        if path == "/system/packages":
            return httpx.Response(201, json={"digest": scanned[0].manifest.digest})
        return httpx.Response(200, json={})

    client = GatewayClient("http://127.0.0.1:1", password="pw")  # pragma: allowlist secret
    client._client = httpx.Client(base_url=client.url, transport=httpx.MockTransport(gateway))
    assert uploads.upload(client, scanned).via_api
    assert len(heads) == 4 and len(puts) == 1  # a PUT only after the HEAD that found no writer


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["gpus"], ["describe", "f"], ["rm", "f"], ["invoke", "f", "-d", "{}"], ["top", "--once"]],
    ids=lambda argv: argv[0],
)
def test_every_command_finds_the_local_clusters_gateway(stand: Stand, state: Path, argv: list[str]) -> None:
    """`gpufaas up --port P` records its gateway in cluster.json: every command finds it there
    (not at the default port 8080), with the cluster's password."""
    local_cluster(state, stand.url, "cluster-pw")
    code, _, err = cli(*argv)
    assert code == 0 or argv[0] == "top", err  # (top: the stand's overview is not one)
    assert stand.seen and all(auth == basic("cluster-pw") for _, _, auth in stand.seen), stand.seen


def test_the_gateway_is_the_flag_else_the_stack_files_else_the_local_clusters(state: Path) -> None:
    from gpufaas.cli.client import gateway_url

    local_cluster(state, "http://127.0.0.1:9000/", "pw")
    assert gateway_url(None) == "http://127.0.0.1:9000"
    assert gateway_url(None, "http://stack:1") == "http://stack:1"
    assert gateway_url("http://flag:1", "http://stack:1") == "http://flag:1"
    (state / "cluster.json").unlink()
    assert gateway_url(None) == "http://127.0.0.1:8080"


def test_new_writes_the_running_clusters_gateway_into_the_stack_file(state: Path, tmp_path: Path) -> None:
    from gpufaas.cli.functions import _add_to_stack

    local_cluster(state, "http://127.0.0.1:9000", "pw")
    provider = yaml.safe_load(_add_to_stack(tmp_path / "a.yml", "f", "t", {}).read_text())["provider"]
    assert provider == {"name": "gpufaas", "gateway": "http://127.0.0.1:9000"}
    local_cluster(state, "http://127.0.0.1:9000", "pw", running=False)  # down: deploy decides when it runs
    provider = yaml.safe_load(_add_to_stack(tmp_path / "b.yml", "f", "t", {}).read_text())["provider"]
    assert provider == {"name": "gpufaas"}


def test_logout_forgets_what_login_kept_for_the_local_cluster(stand: Stand, state: Path) -> None:
    local_cluster(state, stand.url, "cluster-pw")
    code, out, err = cli("login", "--state-dir", str(state))
    assert code == 0 and stand.url in out, err
    code, out, err = cli("logout", "--state-dir", str(state))
    assert code == 0 and f"forgot the password for {stand.url}" in " ".join(out.split()), out


def test_the_local_clusters_own_password_wins_over_a_stale_login(stand: Stand, state: Path) -> None:
    """`gpufaas login`, then the cluster made again (a new password): commands use the cluster's
    new password, not the one kept, and `gpufaas login` (no --password-stdin) sends the new one."""
    local_cluster(state, stand.url, "old-pw")
    stand.password = "old-pw"  # pragma: allowlist secret
    assert cli("login", "--state-dir", str(state))[0] == 0
    local_cluster(state, stand.url, "new-pw")  # `rm -r STATE; gpufaas up`: a new password
    stand.password = "new-pw"  # pragma: allowlist secret
    code, _, err = cli("ls")
    assert code == 0, err
    code, out, err = cli("login", "--state-dir", str(state))
    assert code == 0 and "logged in" in out, err
    saved = json.loads((state.parent / "config" / "credentials.json").read_text())
    assert saved == {stand.url: "new-pw"}


PATHS = {"ls": "/system/functions", "gpus": "/system/gpus", "describe": "/system/function/f", "rm": "/system/functions"}
COMMANDS = [["ls"], ["gpus"], ["describe", "f"], ["rm", "f"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: argv[0])
@pytest.mark.parametrize(
    ("body", "says"),
    [(b"<html>a proxy's page</html>", "something other than JSON"), (b'{"status": "ok"}', "something other than")],
    ids=["html", "other-json"],
)
def test_something_that_is_not_a_gateway_is_one_clear_line(
    stand: Stand, state: Path, argv: list[str], body: bytes, says: str
) -> None:
    """A 200 that is not JSON, or JSON that is not the route's answer: one line that says so (no
    traceback), and `rm` never claims it removed anything."""
    stand.answers[PATHS[argv[0]]] = (200, body, "text/html" if body.startswith(b"<") else "application/json")
    code, out, err = cli(*argv, "--gateway", stand.url)
    assert code == 1 and out == "", out
    assert f"the gateway at {stand.url} answered {PATHS[argv[0]]} with {says}" in err, err
    assert "is it a gpufaas gateway?" in err


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "gw.example:8080", "ftp://gw"])
def test_a_malformed_gateway_url_says_what_one_looks_like(state: Path, url: str) -> None:
    code, _, err = cli("ls", "--gateway", url)
    assert code == 1 and "is not a gateway URL: give one like http://127.0.0.1:8080" in err, err


def test_a_stopped_local_clusters_url_and_password_are_used_no_more(stand: Stand, state: Path) -> None:
    # `gpufaas down` leaves cluster.json and the secrets. Another gateway answering at that URL
    # later (a port-forward, compose) got the stopped cluster's password, so its kept login was
    # refused (401) with advice to log in again; and with none there, commands went to the stopped
    # cluster's URL rather than the default.
    local_cluster(state, stand.url, "old-local-pw", running=False)
    stand.password = "remote-pw"  # pragma: allowlist secret
    login = CliRunner().invoke(app, ["login", "--gateway", stand.url, "--password-stdin"], input="remote-pw\n")
    assert login.exit_code == 0, login.output
    code, out, err = cli("ls", "--gateway", stand.url)
    assert code == 0, out + err
    local_cluster(state, "http://127.0.0.1:9", "old-local-pw", running=False)
    assert gateway_url(None, state_dir=state) == DEFAULT_GATEWAY
    local_cluster(state, "http://127.0.0.1:9", "old-local-pw", running=True)
    assert gateway_url(None, state_dir=state) == "http://127.0.0.1:9"


def test_a_stopped_local_cluster_is_named_where_no_gateway_answers(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `gpufaas up --port P` and a crash or `down`, commands given no --gateway went to port
    8080 and said only "no gateway answers" there: the stopped cluster and its port went unsaid."""
    from gpufaas.cli import client

    monkeypatch.setattr(client, "DEFAULT_GATEWAY", "http://127.0.0.1:9")  # (nothing answers at the default)
    local_cluster(state, "http://127.0.0.1:18780", "pw", running=False)
    stopped = f"the local cluster in {state} was at http://127.0.0.1:18780 and is stopped: `gpufaas up --port 18780`"
    for argv in (["ls"], ["invoke", "f", "-d", "{}"], ["status", "--state-dir", str(state)]):
        code, out, err = cli(*argv)
        assert code == 1 and stopped in " ".join((out + err).split()), out + err
    code, _, err = cli("ls", "--gateway", "http://127.0.0.1:9/other")  # another gateway: not the local cluster's
    assert code == 1 and "stopped" not in err and "start a local cluster with `gpufaas up`" in err, err


def test_new_does_not_replace_a_function_the_stack_file_has(state: Path, tmp_path: Path) -> None:
    """`gpufaas new echo` beside a stack.yml that has an `echo` (its handler elsewhere): refused,
    the file as it was; it rewrote the entry, and the next deploy replaced the function."""
    (tmp_path / "src" / "echo").mkdir(parents=True)
    stack = tmp_path / "stack.yml"
    stack.write_text(
        "# prod: do not change memory\nversion: 1.0\nprovider: {name: gpufaas}\n"
        "functions:\n  echo:\n    handler: ./src/echo\n    memory_mb: 20000\n"
    )
    before = stack.read_text()
    code, _, err = cli("new", "echo", "--dir", str(tmp_path))
    assert code == 1 and "has a function 'echo' already" in err, err
    assert stack.read_text() == before and not (tmp_path / "echo").exists()


@pytest.mark.parametrize("argv", [["invoke", "../system/functions", "-d", "{}"], ["describe", "../functions"]])
def test_a_function_name_cannot_steer_a_command_to_another_route(stand: Stand, state: Path, argv: list[str]) -> None:
    """httpx resolves `/function/../system/functions` to the admin route, with the admin's
    credential: a name that is not a function's is refused before anything is sent."""
    local_cluster(state, stand.url, "cluster-pw")
    code, _, err = cli(*argv)
    assert code == 2 and "is not a function name" in err, err
    assert stand.seen == []


def test_invoke_waits_as_long_as_a_call_may_run(stand: Stand, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A function may run for up to MAX_TIMEOUT_S: the CLI waited 120 s, and a longer call's result,
    computed, was lost (and a retry ran it again)."""
    from gpufaas.cli import functions
    from gpufaas.functions import MAX_TIMEOUT_S

    waits: list[float] = []

    class Recorded(functions.GatewayClient):
        def __init__(self, url: str, **options: Any) -> None:
            waits.append(options.get("timeout_s", 120.0))
            super().__init__(url, **options)

    monkeypatch.setattr(functions, "GatewayClient", Recorded)
    local_cluster(state, stand.url, "cluster-pw")
    code, _, err = cli("invoke", "f", "-d", "{}")
    assert code == 0, err
    assert waits and waits[0] > MAX_TIMEOUT_S


def test_invoke_sends_a_data_argument_that_is_not_utf8_as_its_bytes(stand: Stand, state: Path) -> None:
    """`-d $'\\xff\\xfe'`: Python hands such an argument over with surrogates for the bytes
    (surrogateescape), which str.encode() refused with a UnicodeEncodeError traceback."""
    local_cluster(state, stand.url, "cluster-pw")
    code, _, err = cli("invoke", "f", "-d", b"\xff\xfe".decode("utf-8", "surrogateescape"))
    assert code == 0, err
    assert stand.bodies == [b"\xff\xfe"]


def test_login_and_logout_keep_a_damaged_credentials_file_as_it_is(stand: Stand, state: Path) -> None:
    """A credentials file that does not parse (a stray comma) was read as empty and written over
    by the next login: every other gateway's password gone without a word. Now refused."""
    path = state.parent / "config" / "credentials.json"
    path.parent.mkdir()
    damaged = '{"https://prod:8443": "prod-pw", "https://staging:8443": "st-pw",}\n'  # pragma: allowlist secret
    path.write_text(damaged)
    local_cluster(state, stand.url, "cluster-pw")
    for command in ("login", "logout"):
        code, _, err = cli(command, "--state-dir", str(state))
        assert code == 1 and "is not a JSON object of passwords" in err, err
        assert path.read_text() == damaged
    path.unlink()
    code, _, err = cli("login", "--state-dir", str(state))
    assert code == 0 and json.loads(path.read_text()) == {stand.url: "cluster-pw"}, err
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_ctrl_c_ends_the_uploads_at_once() -> None:
    """Ctrl-C mid-deploy: the uploads' pool was joined on the way out, so every queued blob was
    still sent first (21.6 s after the Ctrl-C, 24 MB at 1 MB/s); now the deploy ends at once."""
    import _thread

    from gpufaas.cli import uploads

    release = threading.Event()
    started: list[str] = []

    def slow_upload(digest: str) -> None:
        started.append(digest)
        release.wait(30)

    # Python's Ctrl-C handler, whatever this process was started with (a background job of a
    # script starts with SIGINT ignored, and interrupt_main then does nothing).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.2, _thread.interrupt_main).start()
    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            uploads._parallel(slow_upload, [f"d{i}" for i in range(12)])
        assert time.monotonic() - began < 5
        assert len(started) == uploads.PARALLEL_UPLOADS  # (none of the queued ones began)
    finally:
        signal.signal(signal.SIGINT, handler)
        release.set()


@pytest.mark.parametrize(
    ("argv", "row"),
    [
        (["ls"], FUNCTION | {"timeout_s": "5"}),
        (["ls"], FUNCTION | {"replicas": None}),
        (["gpus"], GPU | {"lru": ["m", 3]}),
        (["gpus"], GPU | {"local_queue": True}),
    ],
    ids=["timeout-as-text", "replicas-null", "lru-not-names", "queue-a-boolean"],
)
def test_a_listing_whose_fields_are_not_of_their_kind_is_one_clear_line(
    stand: Stand, state: Path, argv: list[str], row: dict[str, object]
) -> None:
    """Each of these was a traceback in the table's formatting ('Unknown format code', a join of
    a number); a GPU named without its node's prefix is shown as it is."""
    stand.answer(PATHS[argv[0]], 200, [row])
    code, out, err = cli(*argv, "--gateway", stand.url)
    assert code == 1 and "is it a gpufaas gateway?" in err, (out, err)
    stand.answer("/system/gpus", 200, [GPU | {"gpu": "0"}])
    code, out, err = cli("gpus", "--gateway", stand.url)
    assert code == 0, err


@pytest.mark.parametrize(
    "answer",
    [
        {"missing": ["sha256:" + "0" * 64], "offsets": {}},  # a blob it was not asked of
        {"missing": [{"d": 1}], "offsets": {}},
        {"missing": [], "offsets": [], "limit_bytes": "big"},
    ],
    ids=["not-asked", "not-a-digest", "wrong-types"],
)
def test_a_deploy_to_a_gateway_that_answers_missing_blobs_oddly_is_one_clear_line(
    tmp_path: Path, answer: dict[str, object]
) -> None:
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    client = GatewayClient("http://127.0.0.1:1", password="pw")  # pragma: allowlist secret
    client._client = httpx.Client(
        base_url=client.url, transport=httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    )
    with pytest.raises(GpufaasError, match="is it a gpufaas gateway"):
        uploads.upload(client, scanned)


def test_up_with_a_state_dir_that_cannot_be_a_folder_is_one_clear_line(tmp_path: Path) -> None:
    """A file, a path under a file, a dangling link: each was a traceback."""
    taken = tmp_path / "state"
    taken.write_text("not a folder")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "at-all")
    for state_dir in (taken, taken / "sub", tmp_path / "dangling"):
        code, _, err = cli("up", "--state-dir", str(state_dir), "--backend", "emulated")
        assert code == 2 and "the cluster's state goes in a folder" in " ".join(err.replace("│", " ").split()), err


def test_a_ctrl_c_while_up_starts_waits_until_down_can_find_the_cluster(tmp_path: Path) -> None:
    """The supervisor records itself (pids.json) some 0.3 s after it starts: a `gpufaas down` run
    at once after the Ctrl-C would have found nothing to stop, the cluster coming up anyway."""
    from gpufaas.cli.local import _until_recorded

    class Starting:
        pid = os.getpid()

        def poll(self) -> None:
            return None

    threading.Timer(0.3, lambda: (tmp_path / "pids.json").write_text(json.dumps({"supervisor": os.getpid()}))).start()
    began = time.monotonic()
    _until_recorded(tmp_path, Starting())
    assert 0.25 <= time.monotonic() - began < 5 and (tmp_path / "pids.json").exists()


def test_login_writes_through_a_linked_credentials_file(stand: Stand, state: Path) -> None:
    """A dotfile manager's link stays a link, and the file it names gets the password."""
    target = state.parent / "dotfiles" / "credentials.json"
    target.parent.mkdir()
    target.write_text('{"http://other:8080": "pw-other"}')  # pragma: allowlist secret
    (state.parent / "config").mkdir()
    link = state.parent / "config" / "credentials.json"
    link.symlink_to(target)
    local_cluster(state, stand.url, "cluster-pw")
    code, _, err = cli("login", "--state-dir", str(state))
    assert code == 0, err
    assert link.is_symlink() and json.loads(target.read_text()) == {
        "http://other:8080": "pw-other",  # pragma: allowlist secret
        stand.url: "cluster-pw",
    }


def test_describe_shows_a_function_whose_environment_holds_brackets(stand: Stand, state: Path) -> None:
    stand.answer("/system/function/f", 200, FUNCTION | {"environment": {"PROMPT": "[INST] {prompt} [/INST]"}})
    code, out, err = cli("describe", "f", "--gateway", stand.url)
    assert code == 0, err
    assert "[INST] {prompt} [/INST]" in out


def test_describe_shows_a_label_as_it_is(stand: Stand, state: Path) -> None:
    stand.answer("/system/function/f", 200, FUNCTION | {"labels": {"note": "[bold]v2[/bold] [red]"}})
    code, out, err = cli("describe", "f", "--gateway", stand.url)
    assert code == 0, err
    assert "[bold]v2[/bold] [red]" in out, out


def proxy_that_refuses_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment names a proxy (every scheme, no no_proxy) where nothing listens."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_a_gateway_on_this_machine_is_reached_whatever_proxy_the_environment_names(
    stand: Stand, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A developer behind a corporate proxy (http_proxy set, no no_proxy) and a local cluster:
    every command went to the proxy, which cannot reach this machine's loopback, and said "no
    gateway answers". Loopback is reached directly, as etcdctl (every Go client) does."""
    proxy_that_refuses_everything(monkeypatch)
    for url in (stand.url, stand.url.replace("127.0.0.1", "localhost")):
        assert GatewayClient(url, password="").request("GET", "/system/functions").status_code == 200
    with pytest.raises(httpx.ConnectError):  # (the proxy is in force for others: this test's own premise)
        httpx.get(stand.url)


def test_ls_piped_shows_every_function_name_whole(stand: Stand, state: Path) -> None:
    """Piped (a script's `gpufaas ls | grep NAME`), a table at Rich's default 80 columns cut a long
    name short with '…'."""
    name = "an-image-classifier-with-a-long-descriptive-name-for-its-team"
    stand.answer("/system/functions", 200, [FUNCTION | {"name": name, "gpu": "nvidia-a100-80gb"}])
    code, out, err = cli("ls", "--gateway", stand.url)
    assert code == 0, err
    assert name in out and "nvidia-a100-80gb" in out, out


@pytest.mark.parametrize("interval", ["inf", "1e300"])
def test_top_with_an_interval_no_clock_can_sleep_is_refused_in_one_line(
    stand: Stand, state: Path, interval: str
) -> None:
    code, _, err = cli("top", "--interval", interval, "--gateway", stand.url)
    assert code == 2 and "--interval" in err, err


PROXY_PAGE = b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
PROXY_PAGE += b"</center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: argv[0])
def test_a_proxys_error_page_is_one_line_not_its_markup(stand: Stand, state: Path, argv: list[str]) -> None:
    stand.answers[PATHS[argv[0]]] = (502, PROXY_PAGE, "text/html")
    result = CliRunner().invoke(app, [*argv, "--gateway", stand.url])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "<" not in result.stderr, result.stderr
    assert f"the gateway at {stand.url} refused (Bad Gateway) with a web page" in result.stderr
    assert "(HTTP 502)" in result.stderr


def test_a_long_plain_text_refusal_is_one_line(stand: Stand, state: Path) -> None:
    stand.answers["/system/functions"] = (503, b"upstream connect error\n" + b"x" * 5000, "text/plain")
    result = CliRunner().invoke(app, ["ls", "--gateway", stand.url])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "upstream connect error" in result.stderr and len(result.stderr) < 500


def test_status_finds_a_gateway_on_this_machine_whatever_proxy_the_environment_names(
    stand: Stand, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` asked /healthz through the proxy: "does not answer" and exit status 1 for a gateway
    every other command reached."""
    proxy_that_refuses_everything(monkeypatch)
    code, out, err = cli("status", "--gateway", stand.url)
    assert code == 0, out + err
    assert f"gateway {stand.url}: answers" in " ".join(out.split())


def test_status_with_part_of_the_cluster_stopped_exits_1_and_names_it(stand: Stand, state: Path) -> None:
    """etcd (or a node, or the scheduler) gone while the gateway still answered /healthz: its row
    said "stopped", yet `gpufaas status` exited 0, and a script checking the cluster went on."""
    local_cluster(state, stand.url, "pw")
    pids = {"etcd": 2**22 + 1, "gateway": os.getpid(), "node0": 2**22 + 2}
    (state / "pids.json").write_text(json.dumps(pids))
    code, out, err = cli("status", "--state-dir", str(state))
    assert code == 1, out + err
    said = " ".join(out.split())
    assert f"gateway {stand.url}: answers" in said
    assert "not running: etcd, node0: `gpufaas logs etcd` says why" in said, said
    (state / "pids.json").write_text(json.dumps({"gateway": os.getpid()}))  # all of it runs
    assert cli("status", "--state-dir", str(state))[0] == 0


def test_gpus_lists_the_gpus_in_natural_order(stand: Stand, state: Path) -> None:
    """As `top` lists them: node2 before node10 (a string sort put node10 and node11 between node1
    and node2)."""
    nodes = ["node10", "node2", "node1", "node11"]
    stand.answer("/system/gpus", 200, [GPU | {"node": n, "gpu": f"{n}/0"} for n in nodes])
    code, out, err = cli("gpus", "--gateway", stand.url)
    assert code == 0, err
    shown = [word for line in out.splitlines() for word in line.split() if word[:4] == "node" and word != "node"]
    assert shown == ["node1", "node2", "node10", "node11"], out


def test_deploy_with_a_filter_naming_no_function_of_the_stack_deploys_nothing(
    stand: Stand, state: Path, tmp_path: Path
) -> None:
    """`--filter fn --filter tyop` deployed fn and said nothing of tyop."""
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    stack = {"version": 1.0, "provider": {"name": "gpufaas"}, "functions": {"fn": {"handler": "./fn", "memory_mb": 64}}}
    (tmp_path / "stack.yml").write_text(yaml.safe_dump(stack))
    argv = ["-f", str(tmp_path / "stack.yml"), "--filter", "fn", "--filter", "tyop", "--gateway", stand.url]
    code, out, err = cli("deploy", *argv)
    assert code == 1 and "--filter tyop: no such function in" in err and "(it has: fn)" in err, (out, err)
    assert stand.seen == []


@pytest.mark.parametrize("argv", [["down"], ["status"], ["logs"], ["logs", "[/x]"]], ids=" ".join)
def test_a_path_or_name_with_brackets_is_printed_as_text_not_markup(
    stand: Stand, tmp_path: Path, argv: list[str]
) -> None:
    """A state directory such as /data/[/old] (or a component typed so) was read as Rich markup: a
    MarkupError's traceback; '[old]' vanished from what was printed."""
    state_dir = tmp_path / "[/old]" / "[old]"
    state_dir.mkdir(parents=True)
    gateway = ["--gateway", stand.url] if argv == ["status"] else []
    result = CliRunner().invoke(app, [*argv, "--state-dir", str(state_dir), *gateway])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    said = " ".join((result.stdout + result.stderr).split())
    assert ("'[/x]'" if argv[-1] == "[/x]" else str(state_dir)) in said, said


def test_login_says_where_it_kept_the_password_whatever_the_path(
    stand: Stand, state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand.password = "pw"  # pragma: allowlist secret
    monkeypatch.setenv("GPUFAAS_CONFIG_DIR", str(tmp_path / "[/config]"))
    result = CliRunner().invoke(app, ["login", "--gateway", stand.url, "--password-stdin"], input="pw\n")
    assert result.exit_code == 0, result.exception
    assert str(tmp_path / "[/config]" / "credentials.json") in " ".join(result.stdout.split())


def test_describe_shows_values_as_json_not_python(stand: Stand, state: Path) -> None:
    extra = {"public": False, "slo_ms": None, "gpus": ["n/0"], "labels": {"team": "vision"}}
    stand.answer("/system/function/f", 200, FUNCTION | extra)
    code, out, err = cli("describe", "f", "--gateway", stand.url)
    assert code == 0, err
    shown = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines()}
    assert shown["public"] == "false" and shown["slo_ms"] == "null", out
    assert shown["gpus"] == '["n/0"]' and shown["labels"] == '{"team": "vision"}', out
    assert shown["name"] == "f" and shown["timeout_s"] == "5.0", out


def test_login_with_an_empty_stdin_says_so(stand: Stand, state: Path) -> None:
    """It said 'no password for URL: pass it with --password-stdin', to a user who had."""
    result = CliRunner().invoke(app, ["login", "--gateway", stand.url, "--password-stdin"], input="")
    assert result.exit_code == 1
    assert "--password-stdin: stdin held no password" in " ".join(result.stderr.split()), result.stderr
    assert stand.seen == []


@pytest.mark.parametrize("oddity", ["missing-again", "offset"])
def test_odd_answers_to_an_upload_through_the_api_are_one_clear_line(tmp_path: Path, oddity: str) -> None:
    """Through the API (an https gateway): a second /system/blobs/missing answered {} was a
    KeyError's traceback, an Upload-Offset that is not a number a ValueError's."""
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    (tmp_path / "fn" / "weights.bin").write_bytes(b"w" * (uploads.BATCH_MAX_BYTES + 1))
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    asked_missing: list[int] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/system/blobs/missing":
            asked_missing.append(1)
            if oddity == "missing-again" and len(asked_missing) > 1:
                return httpx.Response(200, json={})
            return httpx.Response(200, json={"missing": list(json.loads(request.read())["blobs"]), "offsets": {}})
        if request.method == "HEAD":
            return httpx.Response(404, headers={uploads.UPLOAD_OFFSET: "zz"})
        request.read()
        return httpx.Response(201, json={"digest": scanned[0].manifest.digest})

    client = GatewayClient("https://127.0.0.1:1", password="")
    client._client = httpx.Client(base_url=client.url, transport=httpx.MockTransport(gateway))
    with pytest.raises(GpufaasError, match="is it a gpufaas gateway"):
        uploads.upload(client, scanned)


def test_deploy_says_how_much_it_sent_in_a_unit_that_shows_it(stand: Stand, state: Path, tmp_path: Path) -> None:
    """A function of a few hundred bytes was 'sent 0.0 MB in 1 blob(s)' (in '0.0 MB in 1 files')."""
    handler = "def load(device):\n    return None\n"
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text(handler)
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    stand.answer("/system/blobs/missing", 200, {"missing": list(scanned[0].manifest.blobs()), "offsets": {}})
    stand.answer("/system/packages", 201, {"digest": scanned[0].manifest.digest})
    stand.answer("/system/functions", 201, {"model": "fn@0123"})
    stack = {"version": 1.0, "provider": {"name": "gpufaas"}, "functions": {"fn": {"handler": "./fn", "memory_mb": 64}}}
    (tmp_path / "stack.yml").write_text(yaml.safe_dump(stack))
    code, out, err = cli("deploy", "-f", str(tmp_path / "stack.yml"), "--gateway", stand.url)
    assert code == 0, err
    said = " ".join(out.split())
    assert f"{len(handler)} bytes in 1 file(s)" in said and f"sent {len(handler)} bytes in 1 blob(s)" in said, said


@pytest.fixture
def tls_stand(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An https server on loopback with a certificate of a private CA: its URL and the CA's file."""
    import ssl

    from gpufaas.tls import ensure_tls

    files = ensure_tls(tmp_path / "tls")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert("gateway"), files.key("gateway"))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", files.ca
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_an_https_gateway_on_this_machine_with_a_private_ca(
    tls_stand: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its certificate untrusted read 'no gateway answers ... start a local cluster'; and
    SSL_CERT_FILE, how one trusts its CA, was ignored for a gateway on loopback."""
    url, ca = tls_stand
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with pytest.raises(GpufaasError, match="certificate this machine does not trust") as refused:
        GatewayClient(url, password="").request("GET", "/system/functions")
    assert "no gateway answers" not in str(refused.value) and "SSL_CERT_FILE" in str(refused.value)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert GatewayClient(url, password="").request("GET", "/system/functions").status_code == 200
