"""A whole cluster on the netns harness (gpufaas.netns.Hosts): etcd, schedulers, gateways, GPU
managers and optionally an HAProxy balancer, each daemon on a host of its own, secured as `gpufaas
up` secures a cluster, TLS on every link (etcd's too); for the partition tests and the chaos bench."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from gpufaas.credentials import ADMIN_USER, SecretFiles, ensure_secrets, metrics_token, read_secret
from gpufaas.dev.etcd_server import find_etcd_binary
from gpufaas.netns import Hosts
from gpufaas.processes import descendants, pid_alive

ETCD_PORT = 2379
SCHEDULER_PORT = 50051
GATEWAY_PORT = 8080
NODE_PORT = 7000
METRICS_PORT = 9100
BALANCER_PORT = 8000
BALANCER_HOST = "balancer"


def _parent(pid: int) -> int | None:
    """`pid`'s parent (None if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def haproxy_available() -> bool:
    """Whether HAProxy is installed, so that a cluster can put its gateways behind it."""
    from gpufaas.dev.balancer import BalancerUnavailable, haproxy_binary

    try:
        haproxy_binary()
    except BalancerUnavailable:
        return False
    return True


def host_names(nodes: Sequence[str], schedulers: int = 1, gateways: int = 1, *, balancer: bool = False) -> list[str]:
    """The hosts a HostCluster of that shape needs: etcd, `scheduler`/`gateway` when there is one
    of each (`scheduler0`, `scheduler1`, ... when several), the nodes, and the balancer's."""
    named = ["etcd"]
    named += ["scheduler"] if schedulers == 1 else [f"scheduler{i}" for i in range(schedulers)]
    named += ["gateway"] if gateways == 1 else [f"gateway{i}" for i in range(gateways)]
    return [*named, *nodes, *([BALANCER_HOST] if balancer else [])]


@dataclass
class HostCluster:
    """etcd, the schedulers, the gateways and GPU managers (cpu backend, one 1000 MB GPU each),
    each in its own host of `hosts`, secured as `gpufaas up` secures a cluster (cluster secret,
    etcd's root password, admin password, invoke token, TLS files in SECRETS/tls: the daemons' links
    are TLS by default, and with `etcd_tls` etcd serves its clients over TLS with client
    certificates). Hosts are named as `host_names` names them; `balancer`: HAProxy
    (gpufaas.dev.balancer) on host `balancer` in front of the gateways, and `gateway_url` is its.

    Each host's daemon is remembered with its command line, so that `kill_host` can end every
    process of a host at once (SIGKILL, no clean stop) and `restart_host` start it again."""

    hosts: Hosts
    state_dir: Path
    nodes: list[str]
    schedulers: list[str] = field(default_factory=lambda: ["scheduler"])
    gateways: list[str] = field(default_factory=lambda: ["gateway"])
    balancer: bool = False
    etcd_tls: bool = True
    logs: dict[str, IO[bytes]] = field(default_factory=dict)
    _argv: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def of_shape(
        cls, hosts: Hosts, state_dir: Path, nodes: list[str], *, balancer: bool = False, etcd_tls: bool = True
    ) -> HostCluster:
        """The cluster for hosts made from `host_names(...)`: its schedulers and gateways by name."""
        names = hosts.names
        schedulers = [name for name in names if name.startswith("scheduler")]
        gateways = [name for name in names if name.startswith("gateway")]
        return cls(hosts, state_dir, nodes, schedulers, gateways, balancer=balancer, etcd_tls=etcd_tls)

    # --- addresses and credentials ------------------------------------------------------------
    @property
    def secrets(self) -> SecretFiles:
        return SecretFiles(self.state_dir / "secrets")

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://{self.hosts.address(gateway)}:{GATEWAY_PORT}" for gateway in self.gateways]

    @property
    def gateway_url(self) -> str:
        """Where clients call: the balancer where there is one, else the first gateway."""
        if self.balancer:
            return f"http://{self.hosts.address(BALANCER_HOST)}:{BALANCER_PORT}"
        return self.gateway_urls[0]

    @property
    def scheduler_addresses(self) -> dict[str, str]:
        """Each scheduler's host -> the address it listens (and is advertised) at."""
        return {name: f"{self.hosts.address(name)}:{SCHEDULER_PORT}" for name in self.schedulers}

    @property
    def etcd_endpoint(self) -> str:
        return f"{self.hosts.address('etcd')}:{ETCD_PORT}"

    @property
    def admin_auth(self) -> httpx.BasicAuth:
        return httpx.BasicAuth(ADMIN_USER, read_secret(self.secrets.admin_password))

    @property
    def invoke_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {read_secret(self.secrets.invoke_token)}"}

    # --- starting ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 120) -> None:
        """Start every daemon, each on its host, and wait until every node's GPUs are seen."""
        os.chmod(self.state_dir, 0o711)  # workers (other users) pass through to their packages
        addresses = tuple(self.hosts.address(name) for name in self.hosts.names)
        ensure_secrets(self.secrets.directory, tls_hosts=addresses)  # etcd's certificate names them
        self._start("etcd", self._etcd_argv())
        self._wait_etcd()
        several = len(self.schedulers) > 1
        for name, address in self.scheduler_addresses.items():
            named = ["--name", name] if several else []
            self._start(name, [
                sys.executable, "-m", "scheduler", *self._common(), "--listen", address, *named,
                "--metrics-listen", f"{self.hosts.address(name)}:{METRICS_PORT}",
            ])  # fmt: skip
        for gateway in self.gateways:
            # One scheduler: dialled where it is; several: the leader, as etcd's leader key says.
            scheduler = [] if several else ["--scheduler", next(iter(self.scheduler_addresses.values()))]
            self._start(gateway, [
                sys.executable, "-m", "gateway", *self._common(), "--host", self.hosts.address(gateway),
                "--port", str(GATEWAY_PORT), "--state-dir", str(self.state_dir / gateway), *scheduler,
                "--admin-password-file", str(self.secrets.admin_password),
                "--invoke-token-file", str(self.secrets.invoke_token),
            ])  # fmt: skip
        for node in self.nodes:
            pool = self.state_dir / f"{node}-pool"
            pool.mkdir(mode=0o700, exist_ok=True)
            address = self.hosts.address(node)
            self._start(node, [
                sys.executable, "-m", "gpu_manager", *self._common(), "--node", node,
                "--listen", f"{address}:{NODE_PORT}", "--metrics-listen", f"{address}:{METRICS_PORT}",
                "--backend", "cpu", "--gpus", "1", "--gpu-memory-mb", "1000",
                "--state-dir", str(self.state_dir / node), "--pool-dir", str(pool),
            ])  # fmt: skip
        if self.balancer:
            self._start_balancer()
        self.wait_for_gpus(set(self.nodes), timeout_s=timeout_s)
        # The GPUs are seen through the balancer, which answers once one gateway does: each is
        # dialled directly too (deploy goes to the first), so every gateway must be serving.
        for url in self.gateway_urls:
            self._wait_live(url, timeout_s)

    def _wait_live(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/livez", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{url}/livez did not answer 200 within {timeout_s} s")
            time.sleep(0.1)

    def _etcd_argv(self) -> list[str]:
        scheme = "https" if self.etcd_tls else "http"
        etcd_url = f"{scheme}://{self.etcd_endpoint}"
        peer_url = "http://127.0.0.1:2380"  # a single member: its peer port stays on its host
        tls = self.secrets.tls
        tls_args = [
            f"--cert-file={tls.cert('etcd')}", f"--key-file={tls.key('etcd')}",
            f"--trusted-ca-file={tls.ca}", "--client-cert-auth",
        ]  # fmt: skip
        return [
            str(find_etcd_binary()), "--name=etcd", f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=etcd={peer_url}", "--initial-cluster-state=new",
            *(tls_args if self.etcd_tls else []),
        ]  # fmt: skip

    def _common(self) -> list[str]:
        return [
            "--etcd", self.etcd_endpoint, "--root", "/gpufaas", "--secret-file", str(self.secrets.cluster_secret),
            "--etcd-password-file", str(self.secrets.etcd_password), *(["--etcd-tls"] if self.etcd_tls else []),
        ]  # fmt: skip

    def _start_balancer(self) -> None:
        from gpufaas.dev.balancer import BalancerConfig, balancer_argv

        gateways = {name: f"{self.hosts.address(name)}:{GATEWAY_PORT}" for name in self.gateways}
        config = BalancerConfig(listen=f"{self.hosts.address(BALANCER_HOST)}:{BALANCER_PORT}", gateways=gateways)
        path = self.state_dir / "haproxy.cfg"
        path.write_text(config.render())
        self._start(BALANCER_HOST, balancer_argv(path))

    def _start(self, host: str, argv: list[str]) -> None:
        self._argv[host] = argv
        log = self.logs.get(host)
        if log is None or log.closed:
            log = self.logs[host] = (self.state_dir / f"{host}.log").open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.hosts.run(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def _wait_etcd(self, timeout_s: float = 30) -> None:
        """Until etcd answers /health (over TLS: checked against the cluster CA, with etcd's own
        certificate as the client's, as --client-cert-auth asks)."""
        scheme = "https" if self.etcd_tls else "http"
        verify: object = True
        if self.etcd_tls:
            import ssl

            tls = self.secrets.tls
            context = ssl.create_default_context(cafile=tls.ca)
            context.load_cert_chain(tls.cert("etcd"), tls.key("etcd"))
            verify = context
        url = f"{scheme}://{self.etcd_endpoint}/health"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2, verify=verify).status_code == 200:  # type: ignore[arg-type]
                    return
            time.sleep(0.2)
        raise AssertionError(f"etcd did not answer at {url}; its log ends:\n{self.tail('etcd')}")

    # --- faults of a host's processes -------------------------------------------------------------
    def host_pids(self, host: str) -> list[int]:
        """Every process of `host`: those in its network namespace and everything below them (a
        node's workers run in network namespaces of their own)."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.hosts.namespace(host)], capture_output=True, text=True, check=False
        ).stdout.split()
        pids = {int(pid) for pid in listed}
        # Below the namespace's roots only: one walk of /proc each, and a host has one or two.
        for root in [pid for pid in pids if _parent(pid) not in pids]:
            pids.update(descendants(root))
        return sorted(pids)

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process of `host` at once (a host lost: no process gets to say goodbye);
        returns their PIDs (`wait_gone` waits for them)."""
        pids = self.host_pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    @staticmethod
    def wait_gone(pids: Sequence[int], timeout_s: float = 10) -> bool:
        """Whether every one of `pids` is gone within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while any(pid_alive(pid) for pid in pids):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def restart_host(self, host: str) -> None:
        """Start `host`'s daemon again with the command line it had (after `kill_host`)."""
        self._start(host, self._argv[host])

    # --- asking the cluster -------------------------------------------------------------------------
    def gpu_nodes(self) -> set[str]:
        """The nodes whose GPUs the cluster sees (the gateway's view)."""
        response = httpx.get(f"{self.gateway_url}/system/gpus", timeout=5, auth=self.admin_auth)
        response.raise_for_status()
        return {gpu["node"] for gpu in response.json()}

    def wait_for_gpus(self, nodes: set[str], timeout_s: float) -> float:
        """Seconds until exactly `nodes` have GPUs in the cluster."""
        started = time.monotonic()
        last: object = None
        while time.monotonic() - started < timeout_s:
            try:
                last = self.gpu_nodes()
                if last == nodes:
                    return time.monotonic() - started
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.2)
        logs = "\n".join(f"--- {name}:\n{self.tail(name)}" for name in self.logs)
        raise AssertionError(f"GPUs of {nodes} not seen in {timeout_s} s (last: {last}); logs:\n{logs}")

    def leader(self, timeout_s: float = 5.0) -> str | None:
        """The host of the scheduler that leads now, as etcd's leader key names it (None: none)."""
        from gpufaas.keys import Keys
        from gpufaas.store import EtcdCredentials, EtcdStore, EtcdTls
        from gpufaas.tls import etcd_client_files

        credentials = EtcdCredentials("root", read_secret(self.secrets.etcd_password))
        tls = EtcdTls(*etcd_client_files(self.secrets.tls.directory, "scheduler")) if self.etcd_tls else None

        async def read() -> str | None:
            store = await EtcdStore.open(self.etcd_endpoint, credentials=credentials, tls=tls, timeout_s=timeout_s)
            try:
                kv = await store.get(Keys("/gpufaas").service("scheduler"))
            finally:
                await store.close()
            return None if kv is None else kv.value.decode()

        address = asyncio.run(read())
        return next((name for name, at in self.scheduler_addresses.items() if at == address), None)

    def deploy(self, name: str, package: bytes, memory_mb: int = 800, **spec: object) -> dict[str, object]:
        """Upload `package` (a .tar.gz, gpufaas.packages.build_package) to the first gateway and
        deploy it as `name`; the gateway's answer."""
        gateway = self.gateway_urls[0]
        uploaded = httpx.post(f"{gateway}/system/packages", content=package, timeout=60, auth=self.admin_auth)
        if uploaded.status_code != 201:
            raise AssertionError(f"upload: {uploaded.status_code} {uploaded.text}")
        body = {"name": name, "package_digest": uploaded.json()["digest"], "memory_mb": memory_mb, **spec}
        response = httpx.post(f"{gateway}/system/functions", json=body, timeout=60, auth=self.admin_auth)
        if response.status_code != 202:
            raise AssertionError(f"deploy: {response.status_code} {response.text}")
        answer: dict[str, object] = response.json()
        return answer

    def call(
        self,
        function: str,
        client: httpx.Client,
        *,
        timeout_s: float = 30,
        payload: dict[str, object] | None = None,
        call_id: str | None = None,
        gateway_url: str | None = None,
    ) -> httpx.Response:
        """POST a call to `function` through `gateway_url` (default `gateway_url`)."""
        headers = self.invoke_headers | ({"x-call-id": call_id} if call_id else {})
        return client.post(
            f"{gateway_url or self.gateway_url}/function/{function}",
            json=payload or {"x": 1},
            headers=headers,
            timeout=timeout_s,
        )

    def scheduler_roles(self) -> dict[str, str]:
        """Each scheduler's role in the election as its metrics say (`gpufaas_scheduler_role`:
        "leader", "unsure" or "standby"; "?" where its metrics do not answer)."""
        token = metrics_token(read_secret(self.secrets.cluster_secret))
        roles: dict[str, str] = {}
        for name in self.schedulers:
            url = f"http://{self.hosts.address(name)}:{METRICS_PORT}/metrics"
            try:
                text = httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=5).text
            except httpx.HTTPError:
                text = ""
            found = re.search(r'^gpufaas_scheduler_role\{role="(\w+)"\} 1(?:\.0)?$', text, re.MULTILINE)
            roles[name] = found.group(1) if found else "?"
        return roles

    def running_on(self, node: str) -> set[str]:
        """The ids of the calls running on `node`'s GPUs (the scheduler's view, through the gateway)."""
        response = httpx.get(f"{self.gateway_url}/system/gpus", timeout=5, auth=self.admin_auth)
        response.raise_for_status()
        return {call for gpu in response.json() if gpu["node"] == node for call in gpu["running"]}

    def tail(self, name: str, num_chars: int = 3000) -> str:
        return self.log_text(name)[-num_chars:]

    def log_text(self, name: str) -> str:
        """All that `name`'s daemon wrote (across its restarts), "" if nothing."""
        path = self.state_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        """Stop everything (the harness's close: by PID) and close the logs; the harness's
        namespaces are removed with it."""
        self.hosts.close()
        for log in self.logs.values():
            log.close()
        for node in self.nodes:  # a node killed before it could remove its pool
            shutil.rmtree(self.state_dir / f"{node}-pool", ignore_errors=True)
