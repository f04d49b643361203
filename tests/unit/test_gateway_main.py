"""`python -m gateway`'s command line with `--with-scheduler` and `--with-node`: each embedded
service's flags in a `--` section of its own, checked at start, with the gateway's shared flags
where they say nothing."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.embedded import EmbeddedNode, EmbeddedScheduler, split_argv
from gateway.settings import DESCRIPTION, PROG, GatewaySettings
from gpufaas.service_main import ListenError, StateDirInUse


def test_each_double_dash_opens_the_flags_of_the_service_it_names() -> None:
    assert split_argv(["--port", "1"]) == (["--port", "1"], {})
    assert split_argv(["--with-node", "--", "scheduler", "--slots", "2", "--", "node", "--gpus", "3"]) == (
        ["--with-node"],
        {"scheduler": ["--slots", "2"], "node": ["--gpus", "3"]},
    )
    assert split_argv(["--", "node", "--", "scheduler"]) == ([], {"node": [], "scheduler": []})


def test_a_first_section_that_opens_with_a_flag_is_the_schedulers() -> None:
    assert split_argv(["--with-scheduler", "--", "--slots", "2"]) == (
        ["--with-scheduler"],
        {"scheduler": ["--slots", "2"]},
    )
    assert split_argv(["--with-node", "--"]) == (["--with-node"], {})  # a trailing `--` says nothing
    assert split_argv(["--", "node", "--gpus", "2", "--"]) == ([], {"node": ["--gpus", "2"]})


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--", "--slots", "2", "--", "--gpus", "2"], "each `--` opens the flags of `scheduler` or `node`"),
        (["--", "nodes", "--gpus", "2"], "`-- nodes`"),
        (["--", "node", "--", "node"], "the node's flags are given twice"),
        (["--", "--slots", "1", "--", "scheduler"], "the scheduler's flags are given twice"),
    ],
)
def test_a_section_named_by_another_word_or_twice_is_refused(argv: list[str], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        split_argv(argv)


def usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `python -m gateway --insecure --state-dir TMP ARGV` says on stderr; it must exit 2."""
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--state-dir", str(tmp_path), *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # A section named by another word.
        (["--with-node", "--", "nod", "--gpus", "2"], ["`-- nod`"]),
        # A service's flags without its --with flag.
        (["--", "scheduler", "--log-level", "info"], ["pass --with-scheduler"]),
        (["--", "node", "--log-level", "info"], ["pass --with-node"]),
        # A node's flags given unnamed are taken for a scheduler's: the error says where they go.
        (["--with-node", "--", "--gpus", "2"], ["put a node's after `-- node`"]),
        # A flag the service refuses, named, and a node without its state directory.
        (["--with-scheduler", "--", "--claim-s", "-1"], ["the scheduler's flags (after `-- scheduler`)", "--claim-s"]),
        (["--with-node", "--", "node", "--gpus", "2"], ["the node's flags (after `-- node`)", "state"]),
    ],
)
def test_bad_embedded_flags_are_usage_errors_that_say_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: list[str]
) -> None:
    err = usage_error(tmp_path, capsys, *argv)
    assert all(part in err for part in said), err


@pytest.mark.parametrize("spelled", ["{gw}", "{gw}/", "{gw}/../gw"])
def test_an_embedded_node_on_the_gateways_own_state_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spelled: str
) -> None:
    # Both keep blobs in STATE_DIR/blobs: the node's cache collects every blob its packages do not
    # use, the packages uploaded to the gateway among them (lost, a grace after their upload).
    gw = tmp_path / "gw"
    gw.mkdir()
    node = ["--with-node", "--", "node", "--gpus", "1", "--backend", "cpu", "--state-dir", spelled.format(gw=gw)]
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--etcd", "127.0.0.1:3999", "--state-dir", str(gw), *node])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the node's --state-dir" in err and "directory of its own" in err, err


def test_a_state_directory_that_cannot_be_made_private_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (As on a Kubernetes volume's root, which root owns: chmod is refused. Here: a path under a file.)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["--insecure", "--etcd", "127.0.0.1:3999", "--state-dir", str(tmp_path / "file" / "gw")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--state-dir: cannot make" in err and "subdirectory of a mounted volume" in err, err


def gateway_settings(tmp_path: Path, *more: str) -> GatewaySettings:
    return GatewaySettings.from_args(
        ["--insecure", "--etcd", "127.0.0.1:3999", "--root", "/r", "--state-dir", str(tmp_path / "gw"), *more],
        PROG,
        DESCRIPTION,
    )


def test_the_scheduler_takes_the_gateways_etcd_and_credentials_unless_its_flags_say_otherwise(tmp_path: Path) -> None:
    parser = GatewaySettings.parser(PROG, DESCRIPTION)
    gateway = gateway_settings(tmp_path, "--with-scheduler")
    embedded = EmbeddedScheduler.from_flags(parser, gateway, ["--slots", "2", "--root", "/other"])
    settings = embedded.settings
    assert (settings.etcd, settings.root, settings.insecure, settings.slots) == ("127.0.0.1:3999", "/other", True, "2")
    assert embedded.secret is None and embedded.tls is False  # --insecure: plain links


def test_the_node_takes_the_gateways_etcd_and_credentials_unless_its_flags_say_otherwise(tmp_path: Path) -> None:
    parser = GatewaySettings.parser(PROG, DESCRIPTION)
    gateway = gateway_settings(tmp_path, "--with-node")
    flags = ["--state-dir", str(tmp_path / "node"), "--node", "n7", "--gpus", "3", "--backend", "cpu", "--root", "/o"]
    embedded = EmbeddedNode.from_flags(parser, gateway, flags)
    settings = embedded.settings
    assert (settings.etcd, settings.root, settings.insecure, settings.node) == ("127.0.0.1:3999", "/o", True, "n7")
    assert [device.gpu_id for device in embedded.machine.devices] == ["gpu0", "gpu1", "gpu2"]
    assert embedded.secret is None and embedded.tls is False


@pytest.mark.parametrize("flag", ["--admin-password-file", "--invoke-token-file"])
def test_a_credential_file_with_insecure_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    # Before, --insecure dropped the file without a word: a gateway open to anyone, though given
    # the admin password (as --secret-file and --etcd-password-file with --insecure are refused).
    secret = tmp_path / "admin-password"
    secret.write_text("pw\n")
    secret.chmod(0o600)
    said = usage_error(tmp_path, capsys, "--etcd", "127.0.0.1:3999", flag, str(secret))
    assert f"--insecure and {flag} exclude each other" in said


class _Store:
    def __init__(self, happened: list[str]) -> None:
        self.happened = happened

    async def close(self) -> None:
        self.happened.append("gateway's store closed")


def _serve_gateway(monkeypatch: pytest.MonkeyPatch, node: object, happened: list[str], state_dir: Path) -> list[int]:
    """`gateway.__main__.serve` run with `node` embedded, over a stand-in store, app and uvicorn
    (which notes "uvicorn served" in `happened`); the SIGTERMs that reached the handler in place
    before it (a test's, standing for the default, which kills), checked in place after it."""
    import gateway.__main__ as gateway_main

    async def open_store(*_: object) -> _Store:
        return _Store(happened)

    class Server:
        def __init__(self, _config: object, _noted: list[int]) -> None:
            pass

        async def serve(self) -> None:
            happened.append("uvicorn served")

    app = types.SimpleNamespace(state=types.SimpleNamespace(gateway=types.SimpleNamespace(serve_blobs=lambda: None)))
    monkeypatch.setattr(gateway_main, "open_store", open_store)
    monkeypatch.setattr(gateway_main, "create_app", lambda *_: app)
    monkeypatch.setattr(gateway_main, "server_config", lambda *_, **__: None)
    monkeypatch.setattr(gateway_main, "_Server", Server)
    settings = types.SimpleNamespace(
        etcd="127.0.0.1:3999", state_dir=state_dir, http_limits=None, public_cert_file=None, host="h", port=1
    )
    config = types.SimpleNamespace(blob_listen="h:0")
    killed: list[int] = []

    def kill(sig: int, _frame: object) -> None:
        killed.append(sig)

    default = signal.signal(signal.SIGTERM, kill)
    try:
        asyncio.run(gateway_main.serve(settings, config, None, None, node))  # type: ignore[arg-type]
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, default)
    assert restored is kill  # the handler before the start is the handler after it
    return killed


def test_a_sigterm_while_the_embedded_node_starts_stops_it_once_started_and_serves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Uvicorn's signal handlers come only once it serves: a SIGTERM while the node in the gateway
    started went to the default handler, which killed the process, the node's stop never run (its
    key and lease left in etcd). Here a handler of the test's stands for that default."""
    happened: list[str] = []

    class Node:
        @contextlib.asynccontextmanager
        async def run(self) -> AsyncIterator[None]:
            signal.raise_signal(signal.SIGTERM)  # (`gpufaas down` as the node starts)
            await asyncio.sleep(0)
            happened.append("node started")
            try:
                yield
            finally:
                happened.append("node stopped")

    killed = _serve_gateway(monkeypatch, Node(), happened, tmp_path)
    assert killed == []
    assert happened == ["node started", "node stopped", "gateway's store closed"]


def test_a_second_sigterm_while_the_embedded_node_stops_lets_it_stop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Uvicorn restores the default handlers once it stopped serving: a second SIGTERM (`gpufaas
    down` or an init system asking again) while the node in the gateway stopped killed the process
    (status -15), its key and holder record left in etcd and a worker left running."""
    happened: list[str] = []

    class Node:
        @contextlib.asynccontextmanager
        async def run(self) -> AsyncIterator[None]:
            try:
                yield
            finally:
                signal.raise_signal(signal.SIGTERM)  # (asked again as the node stops)
                await asyncio.sleep(0)
                happened.append("node stopped")

    killed = _serve_gateway(monkeypatch, Node(), happened, tmp_path)
    assert killed == []
    assert happened == ["uvicorn served", "node stopped", "gateway's store closed"]


def test_a_second_sigint_as_the_gateway_stops_serving_still_stops_its_app() -> None:
    """A second SIGINT (Ctrl-C twice) while uvicorn stops makes it force-exit, which skips the app's
    shutdown: the gateway's registration and holder record stayed in etcd until its lease ran out,
    and its stop ran later, when the loop closed, on the closed etcd client (a traceback)."""
    import uvicorn

    from gateway.__main__ import _Server

    happened: list[str] = []

    async def app(scope: dict[str, object], receive: Callable[[], Awaitable[dict[str, object]]], send: object) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})  # type: ignore[operator]
                signal.raise_signal(signal.SIGINT)  # (Ctrl-C ...)
                signal.raise_signal(signal.SIGINT)  # (... twice)
            else:
                happened.append("app stopped")
                await send({"type": "lifespan.shutdown.complete"})  # type: ignore[operator]
                return

    async def main() -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
        await _Server(config, []).serve()
        happened.append("uvicorn returned")

    asyncio.run(main())
    assert happened == ["app stopped", "uvicorn returned"]


def test_a_sigterm_between_the_embedded_start_and_uvicorns_handlers_stops_the_gateway(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM and SIGINT are noted, not acted on, from the embedded services' start to their
    stop; one that came after their start but before uvicorn put its handlers in place (while the
    app was made) was noted and forgotten: the gateway served on, told to stop. (A second SIGTERM
    after 30 s stands in for the operator asking again, where it is forgotten.)"""
    import uvicorn

    import gateway.__main__ as gateway_main

    happened: list[str] = []

    def ask_again() -> None:
        happened.append("asked again")
        signal.raise_signal(signal.SIGTERM)

    async def app(scope: dict[str, object], receive: Callable[[], Awaitable[dict[str, object]]], send: object) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                asyncio.get_running_loop().call_later(30, ask_again)
                await send({"type": "lifespan.startup.complete"})  # type: ignore[operator]
            else:
                happened.append("app stopped")
                await send({"type": "lifespan.shutdown.complete"})  # type: ignore[operator]
                return

    def create_app(*_: object) -> object:
        signal.raise_signal(signal.SIGTERM)  # (`gpufaas down` as the gateway's app is made)
        app.state = types.SimpleNamespace(gateway=types.SimpleNamespace(serve_blobs=lambda: None))  # type: ignore[attr-defined]
        return app

    def server_config(app: object, **_: object) -> uvicorn.Config:
        return uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")  # type: ignore[arg-type]

    async def open_store(*_: object) -> _Store:
        return _Store(happened)

    class Node:
        @contextlib.asynccontextmanager
        async def run(self) -> AsyncIterator[None]:
            yield

    monkeypatch.setattr(gateway_main, "open_store", open_store)
    monkeypatch.setattr(gateway_main, "create_app", create_app)
    monkeypatch.setattr(gateway_main, "server_config", server_config)
    settings = types.SimpleNamespace(
        etcd="127.0.0.1:3999", state_dir=tmp_path, http_limits=None, public_cert_file=None, host="h", port=1
    )
    config = types.SimpleNamespace(blob_listen="h:0")
    asyncio.run(gateway_main.serve(settings, config, None, None, Node()))  # type: ignore[arg-type]
    assert happened == ["app stopped", "gateway's store closed"]


def test_a_gateway_port_in_use_is_a_listen_error_after_its_app_stopped() -> None:
    # Before, uvicorn exited the process with status 3 (its own line, not the daemons' `error:
    # ... cannot start`, status 1), as it does for an app whose startup failed.
    import uvicorn

    from gateway.__main__ import _Server

    happened: list[str] = []

    async def app(scope: dict[str, object], receive: Callable[[], Awaitable[dict[str, object]]], send: object) -> None:
        while True:
            message = await receive()
            happened.append(str(message["type"]))
            await send({"type": f"{message['type']}.complete"})  # type: ignore[operator]
            if message["type"] == "lifespan.shutdown":
                return

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="critical")
        with pytest.raises(
            ListenError, match=f"^gateway cannot start: --host/--port: cannot listen on 127.0.0.1:{port} "
        ):
            asyncio.run(_Server(config, []).serve())
    assert happened == ["lifespan.startup", "lifespan.shutdown"]


def test_a_second_gateway_on_a_state_directory_in_use_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a gateway started twice on one --state-dir removed, as it started, the running one's
    # unfinished uploads (its spool's *.part files), then failed on its port.
    import gateway.__main__ as gateway_main

    settings = types.SimpleNamespace(etcd="127.0.0.1:3999", state_dir=tmp_path)
    serving: list[bool] = []

    async def open_store(*_: object) -> _Store:
        return _Store([])

    async def serve_http(*_: object) -> None:
        if not serving:  # the first serves while the second starts
            serving.append(True)
            await gateway_main.serve(settings, None, None)  # type: ignore[arg-type]

    monkeypatch.setattr(gateway_main, "open_store", open_store)
    monkeypatch.setattr(gateway_main, "_serve_http", serve_http)
    with pytest.raises(StateDirInUse, match=f"^gateway cannot start: its --state-dir {tmp_path} is in use by another"):
        asyncio.run(gateway_main.serve(settings, None, None))  # type: ignore[arg-type]
