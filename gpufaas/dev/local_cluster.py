"""A whole gpufaas cluster on one machine, as real processes: etcd, schedulers, gateways (several
behind a load balancer), GPU managers."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx

from gpufaas.credentials import ADMIN_USER, SecretFiles, ensure_secrets, metrics_token, read_secret, wire_key
from gpufaas.dev.balancer import BALANCER_HEALTH_PATH, BalancerConfig, balancer_argv
from gpufaas.dev.etcd_server import EtcdServer, free_port
from gpufaas.dev.supervision import Supervision
from gpufaas.errors import GpufaasError
from gpufaas.liveness import Watchdog
from gpufaas.logfiles import LOG_ROTATE_BYTES, rotate, tail_lines
from gpufaas.mounts import detach_under
from gpufaas.processes import pid_alive, started
from gpufaas.tls import TlsFiles

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings
    from gpu_manager.settings import NodeSettings
    from gpufaas.settings import DaemonSettings
    from gpufaas.store import EtcdCredentials, EtcdTls
    from scheduler.settings import SchedulerSettings

log = logging.getLogger("gpufaas.dev.local_cluster")
SUPERVISE_POLL_S = 0.1


class ClusterError(GpufaasError):
    """A component failed to start or to become healthy; the message names its log file."""


@dataclass
class Component:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate(self.log_path, LOG_ROTATE_BYTES)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # signals to the cluster's shell do not reach it
        )

    def alive(self) -> bool:
        return self.process is not None and self.exit_status() is None

    def exit_status(self) -> int | None:
        """Its exit status once it exited (negative: the signal that killed it), else None. An exited
        process is not reaped here but by `stop`: until then its PID, its process group's ID, names
        no other process, and `stop` can still kill what is left in its group."""
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        try:
            exited = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return process.poll()
        if exited is None:
            return None
        return exited.si_status if exited.si_code == os.CLD_EXITED else -exited.si_status

    def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        """SIGTERM its process (or SIGKILL its process group), SIGKILL the group after `timeout_s`,
        and SIGKILL what is left in it once its process exited: a GPU manager's workers go with it,
        those of one that died alone (killed by the OOM killer, crashed) included, which would
        otherwise outlive the cluster, unknown to its next incarnation. The SIGTERM goes to the
        process alone, as Kubernetes and Docker send it: a GPU manager drains on it, running its
        calls to their end (gpu_manager.drain), which its workers, signalled too, would not do."""
        process = self.process
        if process is not None and process.returncode is None:  # not reaped yet (a second stop does nothing)
            if self.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if kill:
                        os.killpg(process.pid, signal.SIGKILL)
                    else:
                        os.kill(process.pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.01)
            # Its group by the PID of its leader, exited or not: unreaped (exit_status), that PID
            # still names this group and no other.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(tail_lines(self.log_path, lines))
        except OSError:
            return ""


class ClusterCredentials:
    """What a local cluster's credentials open, read from its state directory (`secure` False: an
    insecure cluster, where they open nothing and nothing asks for them)."""

    state_dir: Path
    secure: bool
    etcd_auth: bool | None
    etcd_tls: bool | None

    @property
    def secrets(self) -> SecretFiles:
        return SecretFiles(self.state_dir / "secrets")

    @property
    def admin_auth(self) -> httpx.BasicAuth | None:
        """HTTP basic auth as admin (None for an insecure cluster)."""
        return httpx.BasicAuth(ADMIN_USER, read_secret(self.secrets.admin_password)) if self.secure else None

    @property
    def metrics_token(self) -> str | None:
        """The bearer token the scheduler's and the nodes' metrics endpoints ask for (None for an
        insecure cluster)."""
        return metrics_token(read_secret(self.secrets.cluster_secret)) if self.secure else None

    @property
    def wire_key(self) -> bytes | None:
        """The key the daemons' wire handshake proves (None for an insecure cluster)."""
        return wire_key(read_secret(self.secrets.cluster_secret)) if self.secure else None

    @property
    def etcd_credentials(self) -> EtcdCredentials | None:
        """What opens this cluster's etcd (None: etcd asks for nothing, reachable on loopback only)."""
        from gpufaas.store import EtcdCredentials

        if not (self.secure and self.etcd_auth):
            return None
        return EtcdCredentials("root", read_secret(self.secrets.etcd_password))

    @property
    def etcd_client_tls(self) -> EtcdTls | None:
        """What a client shows this cluster's etcd over TLS (the scheduler's certificate, as the
        host harness's tools do); None: etcd serves plain."""
        from gpufaas.store import EtcdTls
        from gpufaas.tls import etcd_client_files

        if not (self.secure and self.etcd_tls):
            return None
        return EtcdTls(*etcd_client_files(self.secrets.tls.directory, "scheduler"))

    def probe_tls(self) -> ssl.SSLContext | None:
        """What the watchdog's TLS probe of this cluster's etcd shows it (`_handshakes`): the
        certificate its daemons show (etcd asks each client for one, and logs a warning for every
        handshake without: one each probe, four a second, for as long as the cluster runs); None:
        etcd serves plain. Nothing of the server is checked: a handshake answered is all it asks."""
        if not (self.secure and self.etcd_tls):
            return None
        files = TlsFiles(self.secrets.tls.directory)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(files.cert("scheduler"), files.key("scheduler"))
        return context

    @property
    def invoke_headers(self) -> dict[str, str]:
        """Headers that may call any function (none needed for an insecure cluster)."""
        if not self.secure:
            return {}
        return {"authorization": f"Bearer {read_secret(self.secrets.invoke_token)}"}


@dataclass
class LocalCluster(ClusterCredentials):
    """Starts and stops the control plane as separate OS processes bound to 127.0.0.1.

    `etcd_endpoint` None starts a private etcd in `state_dir/etcd`. Every PID is written to
    `state_dir/pids.json`; `stop()` stops exactly those processes. One gateway and one scheduler
    are named `gateway` and `scheduler`; several are `gateway0`, `gateway1`, ... (behind HAProxy,
    named `balancer`, at `gateway_url`) and `scheduler0`, `scheduler1`, ...
    """

    state_dir: Path
    nodes: int = 2
    gpus_per_node: int = 2
    backend: str = "cpu"
    gpu_memory_mb: int = 8192
    gpu_type: str | None = None
    policy: str = "lalb-o3"
    eviction: str = "lru"  # which models a miss evicts (scheduler --eviction)
    root: str = "/gpufaas"
    etcd_endpoint: str | None = None
    gateways: int = 1  # more than one: behind a load balancer (gpufaas.dev.balancer) at `gateway_port`
    # More than one: each on its own ports, and the gateways follow the scheduler's key in etcd.
    schedulers: int = 1
    # The first scheduler runs in the first gateway's process (`python -m gateway --with-scheduler`),
    # which reaches it in memory while it leads: no process of its own (the others, if any, have).
    scheduler_in_gateway: bool = False
    # The first node runs in the first gateway's process too (`python -m gateway --with-node`),
    # reached in memory by that gateway and by a scheduler in that process.
    node_in_gateway: bool = False
    gateway_port: int = 0  # where calls go: the one gateway's port, or the balancer's (0: any free port)
    scheduler_port: int = 0  # the first scheduler's
    # The other gateways' and schedulers' ports by component name, kept across restarts (filled at start).
    ports: dict[str, int] = field(default_factory=dict)
    # Where the scheduler and each node serve Prometheus metrics ("scheduler", "node0", ...:
    # HOST:PORT), filled in at start; a scrape asks for `metrics_token` (a secure cluster).
    metrics_addresses: dict[str, str] = field(default_factory=dict)
    queue_capacity: int = 10_000
    max_payload_mb: float = 16.0
    slots: str = "4"  # concurrent calls per GPU (scheduler --slots)
    spares: int = 1  # warm spare workers per GPU
    claim_s: float = 5.0  # a placement not used within this long is checked with its node
    secure: bool = True  # credentials on every interface (state_dir/secrets); False: --insecure daemons
    tls: bool = True  # with `secure`: TLS on the daemons' links (state_dir/secrets/tls); False: --no-tls
    # etcd's own authentication too (the daemons log in as root with STATE/secrets/etcd-password):
    # any local process could otherwise rewrite the cluster's state (a function made public).
    # None: on when this cluster runs its own etcd; an etcd given by `etcd_endpoint` is its
    # owner's to lock (the tests' shared etcd serves many clusters that read it directly).
    etcd_auth: bool | None = None
    # etcd over TLS, each client showing its certificate (`--client-cert-auth`), as the host
    # harness and compose run it. None: on when this cluster runs its own etcd with TLS on (`tls`).
    etcd_tls: bool | None = None
    runtime: str = "process"  # how GPU managers run workers: "process" or "docker" (then spares must be 0)
    docker_image: str | None = None  # the docker runtime's image (default: the GPU manager's)
    # EDAS's staged exit (scheduler --gpu-idle-release-s / --host-idle-release-s); None: off.
    gpu_idle_release_s: float | None = None
    host_idle_release_s: float | None = None
    # Any other setting, as the daemon's flags (the policy's knobs: `--o3-limit 0`), read by its
    # settings model over the fields above (node_settings, scheduler_settings): a later flag wins.
    node_flags: list[str] = field(default_factory=list)
    scheduler_flags: list[str] = field(default_factory=list)
    components: dict[str, Component] = field(default_factory=dict)
    supervision: Supervision = field(default_factory=Supervision)
    # Liveness: every component's health endpoint probed; one that stops answering is killed
    # (and so restarted). None: restart only what exits.
    watchdog: Watchdog | None = field(default_factory=Watchdog)
    supervisor_pid: int | None = None  # the process that supervises this cluster (gpufaas up), if any
    _etcd: EtcdServer | None = None
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.etcd_auth is None:
            self.etcd_auth = self.etcd_endpoint is None
        if self.etcd_tls is None:
            self.etcd_tls = self.etcd_endpoint is None and self.secure and self.tls

    @property
    def gateway_url(self) -> str:
        """Where calls go: the gateway, or the balancer in front of several."""
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def scheduler_address(self) -> str:
        """The (first) scheduler's wire address."""
        return f"127.0.0.1:{self.scheduler_port}"

    @property
    def gateway_names(self) -> list[str]:
        return numbered("gateway", self.gateways)

    @property
    def scheduler_names(self) -> list[str]:
        return numbered("scheduler", self.schedulers)

    @property
    def gateway_urls(self) -> dict[str, str]:
        """Each gateway's own URL, by name (the balancer's backends)."""
        return {name: f"http://127.0.0.1:{self._port(name)}" for name in self.gateway_names}

    @property
    def scheduler_addresses(self) -> dict[str, str]:
        return {name: f"127.0.0.1:{self._port(name)}" for name in self.scheduler_names}

    def _port(self, name: str) -> int:
        """The port of gateway or scheduler `name`: chosen once, so that a restart keeps it."""
        if name == "gateway":  # the one gateway, where calls go
            self.gateway_port = self.gateway_port or free_port()
            return self.gateway_port
        if name == self.scheduler_names[0]:
            self.scheduler_port = self.scheduler_port or free_port()
            return self.scheduler_port
        if name not in self.ports:
            self.ports[name] = free_port()
        return self.ports[name]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _common(self) -> dict[str, Any]:
        """The settings every daemon of this cluster shares: its etcd, its key root, its credentials."""
        assert self.etcd_endpoint is not None
        common: dict[str, Any] = {"etcd": self.etcd_endpoint, "root": self.root, "insecure": not self.secure}
        if self.secure:
            common["secret_file"] = self.secrets.cluster_secret
            common["tls"] = self.tls
        if self.secure and self.etcd_auth:
            common["etcd_password_file"] = self.secrets.etcd_password
        if self.secure and self.etcd_tls:
            common["etcd_tls"] = True
        return common

    def scheduler_settings(self, name: str | None = None) -> SchedulerSettings:
        """What scheduler `name` (default: the first) runs with: this cluster's fields, then
        `scheduler_flags` on top."""
        from scheduler.settings import SchedulerSettings

        name = name or self.scheduler_names[0]
        # Its name among several, where schedulers elect a leader (else each has its address).
        elects = self.schedulers > 1 and "name" in SchedulerSettings.model_fields
        named: dict[str, Any] = {"name": name} if elects else {}
        return SchedulerSettings(
            **self._common(),
            **named,
            listen=self.scheduler_addresses[name],
            metrics_listen=self._metrics_address(name),
            policy=self.policy,
            eviction=self.eviction,
            queue_capacity=self.queue_capacity,
            slots=self.slots,
            claim_s=self.claim_s,
            gpu_idle_release_s=self.gpu_idle_release_s,
            host_idle_release_s=self.host_idle_release_s,
        ).with_flags(self.scheduler_flags)

    def gateway_settings(self, name: str | None = None) -> GatewaySettings:
        """What gateway `name` (default: the first) runs with. With several schedulers it is given
        none: it dials the one whose address is in etcd (services/scheduler), and follows it."""
        from gateway.settings import GatewaySettings

        name = name or self.gateway_names[0]
        values = self._common()
        if self.secure:
            values.update(admin_password_file=self.secrets.admin_password, invoke_token_file=self.secrets.invoke_token)
        return GatewaySettings(
            **values,
            port=self._port(name),
            state_dir=self.state_dir / name,
            scheduler=self.scheduler_address if self.schedulers == 1 else None,
            max_payload_mb=self.max_payload_mb,
        )

    def node_settings(self, name: str) -> NodeSettings:
        """What node `name` runs with: this cluster's fields, then `node_flags` on top."""
        from gpu_manager.settings import NodeSettings

        values = self._common()
        if self.docker_image:
            values["docker_image"] = self.docker_image
        values.update(backend=self.backend, runtime=self.runtime)
        return NodeSettings(
            **values,
            node=name,
            gpus=self.gpus_per_node,
            gpu_memory_mb=self.gpu_memory_mb,
            gpu_type=self.gpu_type,
            state_dir=self.state_dir / name,
            spares=self.spares,
            max_payload_mb=self.max_payload_mb,
            metrics_listen=self._metrics_address(name),
            pool_dir=pool_dir(self.state_dir, name),
        ).with_flags(self.node_flags)

    def start(self, timeout_s: float = 60.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Workers (other users) pass through to their own package; nobody else lists or reads here.
        os.chmod(self.state_dir, 0o711)
        (self.state_dir / "logs").mkdir(mode=0o700, exist_ok=True)
        adopt_gateway_blobs(self.state_dir, self.gateway_names)
        if self.secure:
            ensure_secrets(self.secrets.directory)
        if self.etcd_endpoint is None:
            # A 500 ms election timeout makes etcd grant the schedulers' 1 s leader lease as asked
            # (its least TTL is 1.5 election timeouts, whole seconds: 2 s at its default 1000 ms).
            tls_dir = self.secrets.tls.directory if self.secure and self.etcd_tls else None
            etcd = EtcdServer(extra_args=("--election-timeout=500",), tls_dir=tls_dir)
            etcd.start(self.state_dir / "etcd")
            self._etcd = etcd
            self.etcd_endpoint = etcd.endpoint
        self.gateway_port = self.gateway_port or free_port()
        self.scheduler_port = self.scheduler_port or free_port()
        for name in self.scheduler_names[1 if self.scheduler_in_gateway else 0 :]:
            self._add(name, "scheduler", self.scheduler_settings(name))
        nodes = [self.node_settings(f"node{index}") for index in range(self.nodes)]
        for node in nodes:
            if node.pool_dir == pool_dir(self.state_dir, node.node):
                node.pool_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for index, name in enumerate(self.gateway_names):
            self._add_gateway(name, first=index == 0, node=nodes[0] if nodes else None)
        for node in nodes[1 if self.node_in_gateway else 0 :]:
            self._add(node.node, "gpu_manager", node)
        if self.gateways > 1:  # last: stopped first, so that no call reaches a gateway on its way out
            self._add_balancer()
        env = self._env()
        for component in self.components.values():
            component.start(env)
        self.write_pids()
        self.wait_healthy(timeout_s)

    def _add_gateway(self, name: str, *, first: bool, node: NodeSettings | None) -> None:
        """Gateway `name`; the `first` with the first scheduler and `node` (the first node) in its
        process where `scheduler_in_gateway` and `node_in_gateway` say."""
        settings = self.gateway_settings(name)
        sections: list[str] = []
        if first and self.scheduler_in_gateway:
            settings = settings.model_copy(update={"with_scheduler": True})
            sections += ["--", "scheduler", *self.scheduler_settings().to_argv()]
        if first and node is not None and self.node_in_gateway:
            settings = settings.model_copy(update={"with_node": True})
            sections += ["--", "node", *node.to_argv()]
        self._add(name, "gateway", settings, sections)

    def _add(self, name: str, module: str, settings: DaemonSettings, more: Sequence[str] = ()) -> None:
        """Component `name`: `python -m module` with the flags that give it `settings`, then `more`."""
        argv = [sys.executable, "-m", module, *settings.to_argv(), *more]
        self.components[name] = Component(name, argv, self.state_dir / "logs" / f"{name}.log")

    def _add_balancer(self) -> None:
        """HAProxy at `gateway_port`, round robin over the gateways (ClusterError if it is not
        installed)."""
        backends = {name: url.removeprefix("http://") for name, url in self.gateway_urls.items()}
        config = BalancerConfig(listen=f"127.0.0.1:{self.gateway_port}", gateways=backends)
        path = self.state_dir / "haproxy.cfg"
        path.write_text(config.render())
        try:
            argv = balancer_argv(path)
        except GpufaasError as exc:
            raise ClusterError(str(exc)) from None
        self.components["balancer"] = Component("balancer", argv, self.state_dir / "logs" / "balancer.log")

    def _metrics_address(self, component: str) -> str:
        """The metrics listener of `component`: kept across restarts, so a scraper need not follow."""
        if component not in self.metrics_addresses:
            self.metrics_addresses[component] = f"127.0.0.1:{free_port()}"
        return self.metrics_addresses[component]

    def wait_healthy(self, timeout_s: float = 60.0, *, gpus: int | None = None) -> None:
        """Until every gateway (and the balancer in front of several) answers and sees, through
        the scheduler, every node's GPUs."""
        expected = self.nodes * self.gpus_per_node if gpus is None else gpus
        urls = [*self.gateway_urls.values(), *([self.gateway_url] if self.gateways > 1 else [])]
        deadline = time.monotonic() + timeout_s
        last = "none"
        while time.monotonic() < deadline and not self._stopping.is_set():  # (set: gpufaas down)
            for component in self.components.values():
                if component.process is not None and not component.alive():
                    raise ClusterError(
                        f"{component.name} exited with status {component.exit_status()}; "
                        f"its log ({component.log_path}) ends:\n{component.tail()}"
                    )
            last = _unseen_gpus(urls, expected, self.admin_auth)
            if not last:
                return
            time.sleep(0.2)
        if self._stopping.is_set():
            raise ClusterError("the cluster was stopped while it started")
        raise ClusterError(f"the cluster did not become healthy in {timeout_s:g} s (last answer: {last})")

    def restart(self, name: str, *, kill: bool = False, timeout_s: float = 60.0) -> None:
        component = self.components[name]
        component.stop(kill=kill)
        component.start(self._env())
        self.write_pids()
        self.wait_healthy(timeout_s)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        for component in reversed(list(self.components.values())):
            component.stop()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        for index in range(self.nodes):  # a node that was killed could not remove its pool
            shutil.rmtree(pool_dir(self.state_dir, f"node{index}"), ignore_errors=True)
        # Nor its packages' homes (tmpfs mounts in its state directory): they would hold memory and
        # keep the directory from being removed.
        detach_under(self.state_dir)
        self.write_pids()

    # --- supervision ----------------------------------------------------------------------
    def supervise(self, stopping: threading.Event, *, poll_s: float = SUPERVISE_POLL_S) -> None:
        """Until `stopping` is set: restart every component that exits (and the private etcd,
        on its ports and data), after the backoff `self.supervision` says; with a `watchdog`,
        probe every component's health endpoint and SIGKILL one that stops answering (a stalled
        loop, SIGSTOP), which is then restarted like one that exited."""
        ClusterSupervisor(self).run(stopping, poll_s)

    def health_url(self, name: str) -> str | None:
        """Where `name` answers when its event loop runs: the gateway's /livez, the scheduler's and the
        nodes' /healthz on their metrics listeners, etcd's /version (any answer: its /health waits on a
        quorum read), or its TLS handshake where it serves TLS only (`tls://`, `_handshakes`)."""
        if name == "etcd":
            scheme = "tls" if self.secure and self.etcd_tls else "http"
            return None if self.etcd_endpoint is None else f"{scheme}://{self.etcd_endpoint}/version"
        if name == "balancer":
            return f"{self.gateway_url}{BALANCER_HEALTH_PATH}"
        if name in self.gateway_names:
            return f"{self.gateway_urls[name]}/livez"
        address = self.metrics_addresses.get(name)
        return None if address is None else f"http://{address}/healthz"

    def kill(self, name: str) -> None:
        """SIGKILL `name` (a stopped process dies of SIGKILL too); the next poll sees it exited."""
        if name == "etcd":
            if self._etcd is not None:
                self._etcd.kill()
            return
        process = self.components[name].process
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its workers too, as a stop would

    def supervise_in_background(self) -> None:
        """Supervise from a thread of this process until `stop()`."""
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self.supervise, args=(self._stopping,), daemon=True)
        self._supervisor.start()

    def supervised(self) -> list[str]:
        return [*(["etcd"] if self._etcd is not None else []), *self.components]

    def is_alive(self, name: str) -> bool:
        if name == "etcd":
            return self._etcd is not None and self._etcd.is_running()
        return self.components[name].alive()

    def restart_one(self, name: str) -> None:
        if name == "etcd":
            assert self._etcd is not None
            self._etcd.restart()
            return
        component = self.components[name]
        component.stop()  # reaps it and closes its log
        component.start(self._env())

    def pids(self) -> dict[str, int]:
        pids = {name: c.pid for name, c in self.components.items() if c.pid is not None and c.alive()}
        if self._etcd is not None and self._etcd.is_running():
            pids["etcd"] = self._etcd.pid
        if self.supervisor_pid is not None:
            pids["supervisor"] = self.supervisor_pid
        return pids

    def write_pids(self) -> None:
        write_atomically(self.state_dir / "pids.json", pid_record(self.pids()))
        write_atomically(self.state_dir / "cluster.json", json.dumps(cluster_record(self), indent=2) + "\n")

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_record(cluster: LocalCluster) -> dict[str, object]:
    """cluster.json's content: where the cluster's parts listen, how it was started, and the
    supervisor's count of each component's restarts (a crash loop shows in `gpufaas status`)."""
    return {
        "gateway_url": cluster.gateway_url,  # the balancer's, in front of several gateways
        "scheduler_address": cluster.scheduler_address,
        "gateways": cluster.gateway_urls,
        "schedulers": cluster.scheduler_addresses,
        "metrics": cluster.metrics_addresses,
        "etcd_endpoint": cluster.etcd_endpoint,
        "logs": str(cluster.state_dir / "logs"),
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "backend": cluster.backend,
        "policy": cluster.policy,
        "secrets": str(cluster.secrets.directory) if cluster.secure else None,
        "in_gateway": in_gateway(cluster),
        "restarts": dict(cluster.supervision.restarts),
    }


def in_gateway(cluster: LocalCluster) -> list[str]:
    """The components that run in the first gateway's process rather than a process of their own."""
    embedded = (("scheduler", cluster.scheduler_in_gateway), ("node0", cluster.node_in_gateway and cluster.nodes > 0))
    return [name for name, inside in embedded if inside]


class ClusterSupervisor:
    """The loop of `LocalCluster.supervise`: the cluster's components watched (exits, and the
    watchdog's probes) and restarted on `cluster.supervision`'s schedule."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.supervision = cluster.supervision
        self.watchdog = cluster.watchdog
        self._probe_tls = cluster.probe_tls() if cluster.watchdog is not None else None

    def run(self, stopping: threading.Event, poll_s: float) -> None:
        cluster = self.cluster
        now = time.monotonic()
        for name in cluster.supervised():
            self.supervision.started(name, now)
            if self.watchdog is not None:
                self.watchdog.started(name, now)
        probes: dict[str, Future[bool]] = {}
        with ThreadPoolExecutor(max_workers=len(cluster.supervised()), thread_name_prefix="probe") as prober:
            while not stopping.wait(poll_s):
                now = time.monotonic()
                if self.watchdog is not None:
                    self._watch(self.watchdog, prober, probes, now)
                for name in cluster.supervised():
                    if not self.supervision.waiting(name) and not cluster.is_alive(name):
                        delay_s = self.supervision.exited(name, now) - now
                        if self.watchdog is not None:
                            self.watchdog.forget(name)
                        log.warning("%s exited (%s); restarting it in %.1f s", name, self._exit_status(name), delay_s)
                for name in self.supervision.due(now):
                    if stopping.is_set():
                        return
                    self._restart(name)

    def _exit_status(self, name: str) -> str:
        code = None if name == "etcd" else self.cluster.components[name].exit_status()
        return f"status {code}" if code is not None else "gone"

    def _restart(self, name: str) -> None:
        try:
            self.cluster.restart_one(name)
            log.info("%s restarted (restart %d)", name, self.supervision.restarts[name])
        except Exception as exc:  # seen gone again at the next poll: backed off further
            log.error("%s did not restart: %s", name, exc)
        self.supervision.started(name, time.monotonic())
        if self.watchdog is not None:
            self.watchdog.started(name, time.monotonic())
        self.cluster.write_pids()

    def _watch(
        self, watchdog: Watchdog, prober: ThreadPoolExecutor, probes: dict[str, Future[bool]], now: float
    ) -> None:
        """Collect the probes that finished (killing what the watchdog condemns), send those due."""
        for name, probe in list(probes.items()):
            if not probe.done():
                continue
            del probes[name]
            if watchdog.probed(name, probe.result(), now) and self.cluster.is_alive(name):
                log.error(
                    "%s stopped answering (%d probes of %.1f s unanswered); killing it to restart it (kill %d)",
                    name,
                    watchdog.failing[name],
                    watchdog.policy.timeout_s,
                    watchdog.kills[name],
                )
                self.cluster.kill(name)
        for name in watchdog.due(now):
            url = self.cluster.health_url(name)
            if url is None:  # nothing to probe (no health endpoint): judged by its exit only
                watchdog.forget(name)
                continue
            probes[name] = prober.submit(_answers, url, watchdog.policy.timeout_s, self._probe_tls)


# The watchdog's TLS probe (`_handshakes`) where it is given no context: no CA loaded (it checks
# nothing), no certificate shown.
_PROBE_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
_PROBE_TLS.check_hostname = False
_PROBE_TLS.verify_mode = ssl.CERT_NONE


def pool_dir(state_dir: Path, node: str) -> Path:
    """Where `node` of the cluster in `state_dir` makes its host model pool: memory (/dev/shm)
    where the machine has it, in a directory of this cluster's, removed when it stops."""
    tag = hashlib.sha256(str((state_dir / node).resolve()).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else state_dir / node) / f"gpufaas-cluster-{tag}"


def adopt_gateway_blobs(state_dir: Path, gateway_names: Sequence[str]) -> int:
    """Link into the first of `gateway_names`' blob store the blobs of the gateways of an earlier
    cluster in `state_dir` that this one does not run (`up --gateways 2` after one: `gateway0`,
    `gateway1`, not `gateway`): each gateway keeps the packages deployed through it in its own
    directory, and no holder served those any more, so their functions failed once no node held
    their blobs. Returns how many blobs were linked; the earlier directories are left as they are."""
    from gpufaas.blobs import BlobStore

    earlier = [
        path / "blobs" / "sha256"
        for path in sorted(state_dir.glob("gateway*"))
        if path.name not in gateway_names and re.fullmatch(r"gateway\d*", path.name)
    ]
    target = None
    adopted = 0
    for blobs in (directory for directory in earlier if directory.is_dir()):
        target = target or BlobStore(state_dir / gateway_names[0] / "blobs").root / "sha256"
        for blob in blobs.iterdir():
            if len(blob.name) == 64 and not (target / blob.name).exists():
                try:
                    os.link(blob, target / blob.name)
                except OSError:  # (another file system: a copy)
                    shutil.copy2(blob, target / blob.name)
                adopted += 1
    return adopted


def numbered(kind: str, count: int) -> list[str]:
    """Component names: `kind` alone, or `kind0`, `kind1`, ... for several."""
    return [kind] if count == 1 else [f"{kind}{index}" for index in range(count)]


# The supervisor first (it stops the rest itself, and must not restart what is stopped), then
# workers' managers, the balancer before the gateways behind it, and the store last.
STOP_ORDER = ("supervisor", "node", "balancer", "gateway", "scheduler", "etcd")
STARTED_KEY = "started"  # in pids.json: each process's start time (`gpufaas.processes.started`)


def pid_record(pids: dict[str, int]) -> str:
    """pids.json's text: each process's PID, and its start time beside it. A PID recorded may name
    another process once this one is gone (a failed start's supervisor, a reboot), and `gpufaas
    down` signals what is recorded: `recorded_pids` drops those whose start time no longer matches."""
    record: dict[str, object] = {**pids, STARTED_KEY: {name: started(pid) for name, pid in pids.items()}}
    return json.dumps(record, indent=2) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Replace the file at `path` by one holding `text`, at once: a reader (`gpufaas down`, `status`,
    `up` waiting on supervisor.json) sees the old text or the new, never a file cut short."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_text(text)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)


def recorded_pids(state_dir: Path) -> dict[str, int]:
    """The PIDs a `LocalCluster` in `state_dir` recorded, alive or not ({} if none), but those
    alive as another process than the one recorded (its start time differs: the PID was reused)."""
    try:
        raw = json.loads((state_dir / "pids.json").read_text())
        starts = raw.pop(STARTED_KEY, {})
        pids = {str(name): int(pid) for name, pid in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}
    return {name: pid for name, pid in pids.items() if starts.get(name) is None or started(pid) in (None, starts[name])}


def node_pid(pids: dict[str, int], node: str = "node0") -> int:
    """The process that runs `node`, in `recorded_pids`' record: its own, or the gateway's where the
    node runs inside it (`gpufaas up --node-in-gateway`); its workers are that process's descendants."""
    return pids[node] if node in pids else pids["gateway"]


def _unseen_gpus(urls: list[str], expected: int, auth: httpx.BasicAuth | None) -> str:
    """'' if every gateway at `urls` lists `expected` GPUs or more; else the first that does not,
    and its answer."""
    for url in urls:
        try:
            response = httpx.get(f"{url}/system/gpus", timeout=2.0, auth=auth)
        except httpx.HTTPError as exc:
            return f"{url}: {exc}"
        if response.status_code != 200 or len(response.json()) < expected:
            return f"{url}: {response.status_code} {response.text[:200]}"
    return ""


def _answers(url: str, timeout_s: float, tls: ssl.SSLContext | None = None) -> bool:
    """Whether `url` (plain http) answers a GET within `timeout_s` (any status: the process runs).
    http.client, not httpx: an httpx client per probe builds a TLS context (CA bundle and all),
    milliseconds of the launcher's CPU sixteen times a second beside the cluster it watches.
    A `tls://` URL: whether its TLS handshake (with `tls`) is answered (see `_handshakes`)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "tls":
        return _handshakes(parts.hostname or "127.0.0.1", parts.port or 443, timeout_s, tls or _PROBE_TLS)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        connection.request("GET", parts.path or "/")
        connection.getresponse().read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()
    return True


def _handshakes(host: str, port: int, timeout_s: float, tls: ssl.SSLContext) -> bool:
    """Whether a TLS server at host:port answers a handshake within `timeout_s`: a server whose
    process is stopped accepts the connection (the kernel does) but never sends its ServerHello.
    Nothing is checked: a refusal that follows (etcd asks for a client certificate, which `tls` may
    not show) is an answer too."""
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            tls.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError:
        return True  # it answered, refusing this client
    except OSError:  # refused, unreachable, or no answer in time
        return False


def stop_recorded(state_dir: Path, timeout_s: float = 15.0) -> list[str]:
    """Stop exactly the processes recorded in `state_dir/pids.json` (their process groups: a GPU
    manager's workers too), GPU managers first and etcd last; returns the names stopped."""
    pids = recorded_pids(state_dir)
    running = {name for name, pid in pids.items() if pid_alive(pid)}  # the supervisor stops some itself
    # Each process as it is now: one that exits while down waits (the supervisor reaps what it
    # stops) frees its PID, which another process may take before it would be signalled.
    identity = {name: started(pid) for name, pid in pids.items()}
    stopped: list[str] = []
    for prefix in STOP_ORDER:
        stopped.extend(sorted(name for name in running if name.startswith(prefix)))
        group = {
            name: pid
            for name, pid in pids.items()
            if name.startswith(prefix) and pid_alive(pid) and started(pid) == identity[name]
        }
        for pid in group.values():
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(pid_alive(pid) for pid in group.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for name, pid in group.items():
            if pid_alive(pid) and started(pid) == identity[name]:
                _signal_group(pid, signal.SIGKILL)
    detach_under(state_dir)  # a GPU manager's package homes, if it could not unmount them itself
    _remove_pools(state_dir)
    with contextlib.suppress(OSError):
        write_atomically(state_dir / "pids.json", "{}\n")
    return stopped


def _remove_pools(state_dir: Path) -> None:
    """The nodes' host model pools (weights in memory, /dev/shm): a node killed (its supervisor
    too, past `stop_recorded`'s wait, before its own stop removed them) could not remove its own."""
    try:
        nodes = json.loads((state_dir / "cluster.json").read_text()).get("nodes")
    except (OSError, ValueError, AttributeError):
        return
    for index in range(nodes if isinstance(nodes, int) else 0):
        shutil.rmtree(pool_dir(state_dir, f"node{index}"), ignore_errors=True)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


# --- the supervisor process (`gpufaas up`) ----------------------------------------------------

SUPERVISOR_STATUS = "supervisor.json"
SUPERVISED_OPTIONS = (
    "nodes",
    "gpus_per_node",
    "backend",
    "gpu_memory_mb",
    "gpu_type",
    "policy",
    "eviction",
    "gateway_port",
    "gateways",
    "schedulers",
    "scheduler_in_gateway",
    "node_in_gateway",
    "slots",
    "spares",
    "runtime",
    "docker_image",
    "gpu_idle_release_s",
    "host_idle_release_s",
    "scheduler_flags",
    "tls",
)


SUPERVISOR_LOCK = "supervisor.lock"


def _supervisor_lock(state_dir: Path) -> IO[bytes] | None:
    """The state directory's lock, held (open) for as long as the caller lives: one supervisor per
    directory (two `gpufaas up` at once shared etcd's data and each other's records); None where
    another holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = (state_dir / SUPERVISOR_LOCK).open("ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def supervised(state_dir: Path) -> bool:
    """Whether a supervisor holds `state_dir`'s lock now (a cluster starting or running there)."""
    lock = _supervisor_lock(state_dir)
    if lock is None:
        return True
    lock.close()
    return False


def read_supervisor_status(state_dir: Path) -> dict[str, object]:
    try:
        status: dict[str, object] = json.loads((state_dir / SUPERVISOR_STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return status


def main(argv: list[str] | None = None) -> int:
    """`python -m gpufaas.dev.local_cluster --state-dir DIR --options JSON`: start a LocalCluster and
    supervise it (restart what exits, with backoff) until SIGTERM or SIGINT, then stop it all.
    Its state (starting, up, or failed and why) is in DIR/supervisor.json."""
    parser = argparse.ArgumentParser(prog="python -m gpufaas.dev.local_cluster", description=main.__doc__)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--options", default="{}", help=f"JSON object of LocalCluster options: {SUPERVISED_OPTIONS}")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per liveness probe
    options = json.loads(args.options)
    unknown = set(options) - set(SUPERVISED_OPTIONS)
    if unknown:
        parser.error(f"unknown options {sorted(unknown)}; known: {', '.join(SUPERVISED_OPTIONS)}")
    lock = _supervisor_lock(args.state_dir)
    if lock is None:
        print(f"error: a cluster is already starting or running from {args.state_dir}", file=sys.stderr)
        return 2
    # Recorded before anything starts: a `gpufaas down` while it starts finds, and stops, it.
    write_atomically(args.state_dir / "pids.json", pid_record({"supervisor": os.getpid()}))
    cluster = LocalCluster(args.state_dir, supervisor_pid=os.getpid(), **options)
    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()
        cluster._stopping.set()  # a start under way gives up (`wait_healthy`)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    status_path = args.state_dir / SUPERVISOR_STATUS

    def report(state: str, **extra: object) -> None:
        # The options too: a later `gpufaas up` on this directory says which of its own differ.
        record = {"pid": os.getpid(), "status": state, "options": options, **extra}
        write_atomically(status_path, json.dumps(record) + "\n")

    report("starting")
    try:
        cluster.start(timeout_s=150)
    except ClusterError as exc:
        report("failed", error=str(exc))
        cluster.stop()
        return 1
    report("up", gateway_url=cluster.gateway_url)
    log.info("cluster up (gateway %s); supervising", cluster.gateway_url)
    try:
        cluster.supervise(stopping)
    finally:
        log.info("stopping the cluster")
        cluster.stop()
        report("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
