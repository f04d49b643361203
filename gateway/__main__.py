"""`python -m gateway`: run the HTTP gateway (uvicorn) against an etcd and a scheduler."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.lifespan.on import LifespanOn

from gateway.app import GatewayConfig, create_app
from gateway.auth import Credentials
from gateway.embedded import EmbeddedNode, EmbeddedScheduler, embedded_flags_error, split_argv
from gateway.http import server_config
from gateway.settings import DESCRIPTION, PROG, GatewaySettings
from gpufaas.credentials import CredentialError, node_token, read_secret, wire_key
from gpufaas.keys import Keys
from gpufaas.service_main import (
    ListenError,
    daemon_start,
    open_store,
    own_state_dir,
    run_daemon,
    state_dir_held,
    warn_if_insecure,
)

if TYPE_CHECKING:
    from gpufaas.store import EtcdCredentials, Store


def credentials(parser: argparse.ArgumentParser, settings: GatewaySettings, secret: str | None) -> Credentials | None:
    """Who may use the gateway (None: anyone, an insecure cluster); a usage error if the admin
    password is missing or a file is unsafe, or a credential file is given with --insecure (which
    would ignore it: the gateway open to anyone though told of a password)."""
    if secret is None:
        for flag, path in (
            ("--admin-password-file", settings.admin_password_file),
            ("--invoke-token-file", settings.invoke_token_file),
        ):
            if path is not None:
                parser.error(f"--insecure and {flag} exclude each other")
        return None
    if settings.admin_password_file is None:
        parser.error("--admin-password-file is required (`gpufaas up` makes STATE/secrets/admin-password)")
    try:
        return Credentials(
            admin_password=read_secret(settings.admin_password_file),
            invoke_token=read_secret(settings.invoke_token_file) if settings.invoke_token_file else None,
            node_token=node_token(secret),
        )
    except CredentialError as exc:
        parser.error(str(exc))


def gateway_config(settings: GatewaySettings, secret: str | None, who: Credentials | None) -> GatewayConfig:
    return GatewayConfig(
        state_dir=settings.state_dir,
        public_url=settings.public_url
        or f"{'https' if settings.public_cert_file else 'http'}://{settings.host}:{settings.port}",
        scheduler_address=settings.scheduler,
        blob_listen=settings.blob_listen or f"{settings.host}:0",
        blob_advertise=settings.blob_advertise,
        max_payload_bytes=int(settings.max_payload_mb * 1024 * 1024),
        max_unpacked_bytes=settings.max_unpacked_mb * 1024 * 1024,
        keys=Keys(settings.root),
        credentials=who,
        wire_key=wire_key(secret) if secret is not None else None,
    )


async def serve(
    settings: GatewaySettings,
    config: GatewayConfig,
    etcd_creds: EtcdCredentials | None,
    scheduler: EmbeddedScheduler | None = None,
    node: EmbeddedNode | None = None,
) -> None:
    """Serve until uvicorn stops (SIGTERM, SIGINT), with the node of `--with-node` and the
    scheduler of `--with-scheduler` running beside it (started first, in that order; stopped
    last, in the other). A SIGTERM or SIGINT while they start stops them once started, unserved;
    one while they stop (a second: uvicorn's handlers are gone by then) lets them stop."""
    store = await open_store(settings.etcd, etcd_creds)
    try:
        # Uvicorn's handlers replace these while it serves, and restore them when it stops.
        with state_dir_held(settings.state_dir, "gateway", "gateway"), _signals_noted() as signalled:
            async with contextlib.AsyncExitStack() as stack:
                if node is not None:
                    await stack.enter_async_context(node.run())
                if scheduler is not None:
                    await stack.enter_async_context(scheduler.run())
                if not signalled:  # (else told to stop while they started: stopped now, by the stack)
                    await _serve_http(settings, config, store, signalled)
    finally:
        await store.close()


async def _serve_http(settings: GatewaySettings, config: GatewayConfig, store: Store, noted: list[int]) -> None:
    """The gateway's app and blob server on `store`, served by uvicorn until it stops (at once
    for a signal in `noted`, which grows until uvicorn's handlers are in place)."""
    app = create_app(store, config)
    try:
        app.state.gateway.serve_blobs()  # (its failure in the app's startup: a traceback)
    except OSError as exc:
        raise ListenError(f"gateway cannot start: blob server on {config.blob_listen}: {exc}") from None
    limits = settings.http_limits
    tls: dict[str, str] = {}
    if settings.public_cert_file is not None and settings.public_key_file is not None:
        tls = {"ssl_certfile": str(settings.public_cert_file), "ssl_keyfile": str(settings.public_key_file)}
    # No access log: at level warning uvicorn drops its lines, but built each one's arguments
    # (the client's address, the quoted path) per request first, 2.5 % of the gateway's CPU.
    server = _Server(
        server_config(
            app,
            host=settings.host,
            port=settings.port,
            limits=limits,
            log_level="warning",
            access_log=False,
            **tls,
        ),
        noted,
    )
    await server.serve()


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """SIGTERM and SIGINT noted in the body, not acted on (the list: those received), their
    handlers restored after it: the embedded node and scheduler start whole before a signal stops
    them, as a daemon apart does (`run_until_signalled`), and stop whole when a second comes (after
    uvicorn stopped, its handlers restored: a SIGTERM killed the process midway). Uvicorn's handlers come only once it
    serves: before, a SIGTERM while they started killed the process (SIG_DFL), their stop never
    ran (the node's key and lease stayed in etcd, its host pool in /dev/shm), and a SIGINT
    cancelled the start midway, which is not stopped either. Outside the main thread: nothing noted."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # (signal.signal would raise)
        yield noted
        return
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda sig, _frame: noted.append(sig)) for sig in signals}
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM or SIGINT it stopped for is not raised again once
    it stopped: with its handler restored to the default, that killed the process before the node
    and scheduler it runs (`--with-node`, `--with-scheduler`) and the etcd client were stopped (the
    node's key and holder record stayed in etcd until its lease ran out, a standby scheduler
    waited out the leader's, the host pool stayed in /dev/shm); and a signal `noted` before its
    handlers came is acted on once they do."""

    def __init__(self, config: uvicorn.Config, noted: list[int]) -> None:
        super().__init__(config)
        self._noted = noted  # SIGTERM and SIGINT received before its own handlers came

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            for sig in self._noted:  # (else forgotten: the gateway served on, told to stop)
                self.handle_exit(sig, None)
            yield
            self._captured_signals.clear()  # the process exits from `main`, having stopped all

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Uvicorn's; where it cannot bind (having logged why, and stopped the app), `ListenError`,
        the daemons' one line and status 1, not its exit with status 3. An app whose start failed
        still exits so (uvicorn logged its traceback)."""
        try:
            await super().startup(sockets)
        except SystemExit:
            if self.lifespan.should_exit:
                raise
            address = f"{self.config.host}:{self.config.port}"
            raise ListenError(
                f"gateway cannot start: --host/--port: cannot listen on {address} (uvicorn logged the reason)"
            ) from None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Uvicorn's, and the app's shutdown even where a second SIGINT forced the exit (which
        skips waiting for connections, and in uvicorn the app's shutdown too: the gateway's
        registration and holder record stayed in etcd until its lease ran out, and its stop ran as
        the loop closed, on the closed etcd client, in a traceback)."""
        await super().shutdown(sockets)
        if isinstance(self.lifespan, LifespanOn) and not self.lifespan.shutdown_event.is_set():
            await self.lifespan.shutdown()


def main(argv: list[str] | None = None) -> int:
    try:
        own, sections = split_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        GatewaySettings.parser(PROG, DESCRIPTION).error(str(exc))
    parser, settings, secret, etcd_creds = daemon_start(GatewaySettings, PROG, DESCRIPTION, own)
    for flag, path in (
        ("--public-cert-file", settings.public_cert_file),
        ("--public-key-file", settings.public_key_file),
    ):
        if path is not None and not path.is_file():
            parser.error(f"{flag} {path}: no such file (a PEM file, the certificate chain or its key)")
    unasked = embedded_flags_error(sections, {"scheduler": settings.with_scheduler, "node": settings.with_node})
    if unasked is not None:
        parser.error(unasked)
    scheduler, node = None, None
    if settings.with_scheduler:
        scheduler = EmbeddedScheduler.from_flags(parser, settings, sections.get("scheduler", []))
    if settings.with_node:
        node = EmbeddedNode.from_flags(parser, settings, sections.get("node", []))
    # Every function's code is stored there: nobody but the gateway's user may look in.
    own_state_dir(parser, (settings.state_dir,), 0o700)
    config = gateway_config(settings, secret, credentials(parser, settings, secret))
    warn_if_insecure(settings, "the gateway")
    return run_daemon(lambda: serve(settings, config, etcd_creds, scheduler, node), settings.etcd)


if __name__ == "__main__":
    sys.exit(main())
