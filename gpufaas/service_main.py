"""What every gpufaas daemon shares at start: its credentials checked, its links' TLS configured,
logging, signals, a clean stop (its flags are its settings model: gpufaas.settings)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpufaas.credentials import TLS_DIR, CredentialError, read_secret
from gpufaas.errors import GpufaasError
from gpufaas.tls import LinkTls, TlsError, TlsFiles, configure, etcd_client_files

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gpufaas.metrics import MetricsServer
    from gpufaas.settings import DaemonSettings
    from gpufaas.store import EtcdCredentials, EtcdStore, EtcdTls

S = TypeVar("S", bound="DaemonSettings")
# The role each daemon's certificate names (gpufaas.tls), by the package its settings live in.
_ROLES = {"gateway": "gateway", "scheduler": "scheduler", "gpu_manager": "node"}
_etcd_tls: dict[str, EtcdTls] = {}  # "tls": what `open_store` reaches etcd with, set by `configure_tls`


class ListenError(GpufaasError):
    """A daemon's listener (its port, or its metrics') that cannot be bound; the message says which."""


class StateDirInUse(GpufaasError):
    """A daemon's state directory that another daemon of its kind holds now (`state_dir_held`)."""


@contextlib.contextmanager
def state_dir_held(directory: Path, kind: str, name: str) -> Iterator[None]:
    """`directory` (a daemon's --state-dir, made) held by this `kind` of daemon ("node",
    "gateway"), here `name`, for the body: StateDirInUse if another holds it now. A daemon clears
    at start what it finds there of an earlier run (a node its host pool, its workers' cgroups and
    homes; a gateway its unfinished uploads), which would be the running one's."""
    with (directory / f"{kind}.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (released when the file closes)
        except BlockingIOError:
            raise StateDirInUse(
                f"{name} cannot start: its --state-dir {directory} is in use by another {kind} running now; stop "
                "that one first, or give this one a state directory of its own"
            ) from None
        yield


async def start_metrics(registry: CollectorRegistry, listen: str | None, secret: str | None) -> MetricsServer | None:
    """The daemon's metrics listener on `listen` (None: none), asking for the metrics token
    derived from `secret` (None, an insecure cluster: for anyone)."""
    if listen is None:
        return None
    from gpufaas.credentials import metrics_token
    from gpufaas.metrics import MetricsServer

    server = MetricsServer(registry, token=metrics_token(secret) if secret is not None else None)
    address = await server.start(listen)
    logging.getLogger("gpufaas").info("metrics at http://%s/metrics", address)
    return server


def cluster_secret(parser: argparse.ArgumentParser, args: DaemonSettings) -> str | None:
    """The cluster secret named by --secret-file (None with --insecure); a usage error if it is
    missing or unsafe. Safe by default: a daemon does not start open unless told to."""
    if args.insecure:
        if args.secret_file is not None:
            parser.error("--insecure and --secret-file exclude each other")
        return None
    if args.secret_file is None:
        parser.error(
            "--secret-file is required: the cluster secret every daemon shares (`gpufaas up` makes one in "
            "STATE/secrets/cluster-secret); --insecure runs without credentials (development only)"
        )
    try:
        return read_secret(args.secret_file)
    except CredentialError as exc:
        parser.error(str(exc))


def etcd_credentials(parser: argparse.ArgumentParser, args: DaemonSettings) -> EtcdCredentials | None:
    """etcd's credentials from --etcd-password-file (None without it); a usage error if the file
    is missing or unsafe, or given with --insecure."""
    from gpufaas.store import EtcdCredentials

    if args.etcd_password_file is None:
        return None
    if args.insecure:
        parser.error("--insecure and --etcd-password-file exclude each other")
    try:
        return EtcdCredentials("root", read_secret(args.etcd_password_file))
    except CredentialError as exc:
        parser.error(str(exc))


def tls_directory(parser: argparse.ArgumentParser, settings: DaemonSettings, role: str) -> Path | None:
    """Where the daemon's TLS files are: --tls-dir, else the secret file's directory's tls/ where
    it holds this role's certificate (None: plain links, said in the log; with --insecure or
    --no-tls, always)."""
    if settings.insecure:
        if settings.tls_dir is not None or settings.etcd_tls:
            parser.error("--insecure excludes --tls-dir and --etcd-tls")
        return None
    if not settings.tls:
        if settings.tls_dir is not None or settings.etcd_tls:
            parser.error("--no-tls excludes --tls-dir and --etcd-tls")
        logging.getLogger("gpufaas").warning("--no-tls: links to the other daemons are not encrypted")
        return None
    if settings.tls_dir is not None:
        return settings.tls_dir
    default = settings.secret_file.parent / TLS_DIR if settings.secret_file is not None else None
    if default is None or not TlsFiles(default).cert(role).exists():
        if settings.etcd_tls:
            parser.error("--etcd-tls needs the cluster's TLS files: pass --tls-dir")
        logging.getLogger("gpufaas").warning(
            "no TLS files at %s: links to the other daemons are not encrypted (`python -m gpufaas.credentials "
            "SECRETS_DIR` makes them)",
            default,
        )
        return None
    return default


def link_tls(parser: argparse.ArgumentParser, settings: DaemonSettings, role: str) -> LinkTls | None:
    """The TLS of `role`'s links from the daemon's TLS files (None: plain links; `tls_directory`);
    a usage error naming the file where one is missing or unsafe."""
    return _links_in(parser, settings, role, tls_directory(parser, settings, role))


def configure_tls(parser: argparse.ArgumentParser, settings: DaemonSettings, role: str) -> LinkTls | None:
    """`link_tls`, set as this process's link TLS (gpufaas.tls.configure), and with --etcd-tls
    what `open_store` reaches etcd with."""
    from gpufaas.store import EtcdTls

    directory = tls_directory(parser, settings, role)
    links = _links_in(parser, settings, role, directory)
    if directory is not None and settings.etcd_tls:
        try:
            _etcd_tls["tls"] = EtcdTls(*etcd_client_files(directory, role))
        except TlsError as exc:
            parser.error(str(exc))
    configure(links)
    return links


def _links_in(
    parser: argparse.ArgumentParser, settings: DaemonSettings, role: str, directory: Path | None
) -> LinkTls | None:
    """`role`'s link TLS from `directory` (None: plain). The gateway expects the scheduler's role
    at --scheduler's address."""
    if directory is None:
        return None
    scheduler = getattr(settings, "scheduler", None)
    pinned = {scheduler: "scheduler"} if role == "gateway" and isinstance(scheduler, str) else {}
    try:
        return LinkTls.load(directory, role, pinned=pinned)
    except TlsError as exc:
        parser.error(str(exc))


async def open_store(endpoint: str, credentials: EtcdCredentials | None) -> EtcdStore:
    """The daemon's etcd handle; with credentials, etcd's authentication is turned on if it is off.
    Over TLS when the daemon was started with --etcd-tls (`configure_tls`)."""
    from gpufaas.store import EtcdStore

    return await EtcdStore.open(
        endpoint, credentials=credentials, enable_auth=credentials is not None, tls=_etcd_tls.get("tls")
    )


def own_state_dir(parser: argparse.ArgumentParser, directories: Sequence[Path], mode: int) -> None:
    """Make each of `directories` (with its parents) and give it `mode`; a usage error where that
    cannot be done, such as a volume's root another user owns (only a directory's owner may change
    its mode: Kubernetes mounts an emptyDir or a fresh claim owned by root, group fsGroup)."""
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(mode)
        except OSError as exc:
            parser.error(
                f"--state-dir: cannot make {directory} a directory of mode {mode:o} for this user (uid "
                f"{os.getuid()}): {exc.strerror or exc}; name one this user owns or may create, such as a "
                "subdirectory of a mounted volume"
            )


def warn_if_insecure(args: DaemonSettings, name: str) -> None:
    if args.insecure:
        logging.getLogger("gpufaas").warning("%s runs with --insecure: anyone who reaches its port may use it", name)


def configure_logging(level: str) -> None:
    """Write log lines of `level` and above to stderr, but what workers print (the logger
    gpufaas.worker, which the node relays at INFO within each worker's LogBudget) at INFO whatever
    `level`: it is the function author's output, a handler's traceback included, not the daemon's
    chatter, and a node run with --log-level warning left `gpufaas logs` empty of it."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("gpufaas.worker").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))


async def run_until_signalled(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Start a daemon, wait for SIGTERM/SIGINT, stop it. `drain`: run on the first signal, before
    the stop, until it returns or a second signal comes (then it is cancelled: stop at once)."""
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    await start()
    try:
        await signalled.wait()
        if drain is not None:
            signalled.clear()
            await _until_signalled(drain(), signalled)
    finally:
        with contextlib.suppress(Exception):
            await stop()


async def _until_signalled(work: Awaitable[None], signalled: asyncio.Event) -> None:
    """Run `work` until it returns or `signalled` is set (it is cancelled then)."""
    working = asyncio.ensure_future(work)
    waiting = asyncio.ensure_future(signalled.wait())
    try:
        await asyncio.wait((working, waiting), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, waiting):
            task.cancel()
        await asyncio.gather(working, waiting, return_exceptions=True)
    if waiting.done() and not waiting.cancelled():
        logging.getLogger("gpufaas").warning("a second signal: stopping at once")


class _HasRegistry(Protocol):
    registry: CollectorRegistry


class WireDaemon(Protocol):
    """A daemon that listens on the wire and exports metrics: the scheduler service, a node."""

    @property
    def address(self) -> str: ...

    @property
    def metrics(self) -> _HasRegistry: ...

    async def start(self, listen: str, *, advertise: str | None = None) -> str: ...

    async def stop(self) -> None: ...


class ListenSettings(Protocol):
    listen: str
    advertise: str | None
    metrics_listen: str | None


def daemon_start(
    settings_class: type[S], prog: str, description: str, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, S, str | None, EtcdCredentials | None]:
    """A daemon's first steps: its settings from `argv`, its cluster secret, etcd credentials and
    TLS (a usage error where they are missing or unsafe; `configure_tls`), logging configured."""
    parser = settings_class.parser(prog, description)
    settings = settings_class.from_namespace(parser, parser.parse_args(argv))
    secret = cluster_secret(parser, settings)
    etcd_creds = etcd_credentials(parser, settings)
    configure_logging(settings.log_level)
    configure_tls(parser, settings, _ROLES.get(settings_class.__module__.partition(".")[0], "node"))
    return parser, settings, secret, etcd_creds


@contextlib.asynccontextmanager
async def wire_daemon_running(
    daemon: WireDaemon, settings: ListenSettings, secret: str | None, name: str
) -> AsyncIterator[None]:
    """`daemon` started (listening and advertised as `settings` say, its metrics beside it) for
    the body; then its metrics and it stopped, in that order. A listener that cannot be bound (a
    port in use, an address not this host's) is `ListenError`, one line for `run_daemon`. A start
    that fails, at any step, is stopped first: what it had started before the step that failed (a
    node's workers and host pool, its etcd lease) does not outlive it."""
    try:
        await daemon.start(settings.listen, advertise=settings.advertise)
        metrics = await start_metrics(daemon.metrics.registry, settings.metrics_listen, secret)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await daemon.stop()
        if isinstance(exc, socket.gaierror):  # (a bind's other errors name the address, this one not)
            cause = f"--listen: cannot listen on {settings.listen}: {exc.strerror}"
            raise ListenError(f"{name} cannot start: {cause}") from None
        if isinstance(exc, OSError):  # the bind's message names the address
            raise ListenError(f"{name} cannot start: {exc}") from None
        raise
    print(f"{name} listening on {daemon.address}", flush=True)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            if metrics is not None:
                await metrics.close()
            await daemon.stop()


async def serve_wire_daemon(
    daemon: WireDaemon,
    store: EtcdStore,
    settings: ListenSettings,
    secret: str | None,
    name: str,
    *,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run `daemon` (`wire_daemon_running`) until SIGTERM or SIGINT (`drain`, if given, first:
    `run_until_signalled`); then stop it and `store`."""
    running = wire_daemon_running(daemon, settings, secret, name)

    async def stop() -> None:
        await running.__aexit__(None, None, None)
        await store.close()

    await run_until_signalled(running.__aenter__, stop, drain)


def run_daemon(main: Callable[[], Coroutine[Any, Any, None]], etcd_endpoint: str) -> int:
    """Run a daemon's main coroutine on uvloop when it is installed (faster event loop and I/O),
    else on asyncio; an unreachable etcd is one clear line and exit status 1."""
    from gpufaas.store import StoreError

    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    except StoreError as exc:
        if "authentication failed" in str(exc) or "user name is empty" in str(exc):
            print(
                f"error: etcd at {etcd_endpoint} refused this daemon: {exc}; pass the cluster's "
                "--etcd-password-file (the one the other daemons use)",
                file=sys.stderr,
            )
        else:
            print(f"error: cannot reach etcd at {etcd_endpoint}: {exc}; start etcd or pass --etcd", file=sys.stderr)
        return 1
    except GpufaasError as exc:  # a setup the daemon cannot run with; the message says what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
