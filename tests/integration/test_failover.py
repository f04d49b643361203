"""Scheduler failover over the real control plane: two or three schedulers (processes) on one etcd,
one leading, under a steady load of CLIENTS clients; the leader is killed (SIGKILL), stopped for
STOP_S (SIGSTOP, then SIGCONT) or cut off from etcd (a proxy that holds its bytes), and
every call is counted.

Each test prints a JSON report (calls by status, seconds from the fault until a call sent after
it succeeded, the longest spell without a success, what the nodes' grant ledgers admitted) and
writes it into its tmp dir (or $GPUFAAS_FAILOVER_REPORT_DIR). The etcd here runs with
--election-timeout=500, so that a 1 s lease is granted as 1 s (etcd's minimum TTL is 1.5
election timeouts, rounded up to whole seconds: 2 s with its default of 1000 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import GatewaySettings
from gpufaas.cluster import NodeRecord
from gpufaas.dev.etcd_server import EtcdServer, free_port
from gpufaas.dev.local_cluster import Component, LocalCluster
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore
from gpufaas.wire import MessageType, RemoteError, connect
from tests.integration.conftest import deploy
from tests.integration.test_control_plane import wait_for
from tests.scrape import sample

pytestmark = pytest.mark.integration

CLIENTS = 8
STEADY_S = 2.0
STOP_S = 10.0
RECOVERY_BOUND_S = 2.0  # from a SIGKILL to the first success of a call sent after it
CALL_TIMEOUT_S = 30.0
FUNCTIONS = ("fa", "fb")
FAST_ETCD = ("--election-timeout=500",)  # heartbeat 100 ms (the default): a minimum lease TTL of 1 s


# --- the cluster ------------------------------------------------------------------------------


class FollowingCluster(LocalCluster):
    """A LocalCluster whose gateway follows the leader key in etcd instead of one address."""

    def gateway_settings(self, *args: Any, **kwargs: Any) -> GatewaySettings:
        settings = super().gateway_settings(*args, **kwargs)
        return GatewaySettings(**{**settings.model_dump(exclude_unset=True), "scheduler": None})


@dataclass
class Failover:
    """The cluster and its schedulers by name: `scheduler` (the cluster's, the first leader) and
    those the test adds; their metrics listeners, to ask who leads."""

    cluster: LocalCluster
    etcd: EtcdServer
    tmp_path: Path
    metrics: dict[str, str] = field(default_factory=dict)

    def add_scheduler(self, name: str, *, etcd: str | None = None) -> None:
        """Start `python -m scheduler` as `name` beside the others (through `etcd` if given)."""
        self.metrics[name] = f"127.0.0.1:{free_port()}"
        flags = ["--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", self.metrics[name], "--name", name]
        settings = self.cluster.scheduler_settings().with_flags([*flags, *(["--etcd", etcd] if etcd else [])])
        argv = [sys.executable, "-m", "scheduler", *settings.to_argv()]
        component = Component(name, argv, self.cluster.state_dir / "logs" / f"{name}.log")
        component.start({**os.environ, "PYTHONUNBUFFERED": "1"})
        self.cluster.components[name] = component

    def scrape(self, name: str) -> str:
        address = self.metrics.get(name) or self.cluster.metrics_addresses[name]
        token = self.cluster.metrics_token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"http://{address}/metrics", headers=headers, timeout=2).text

    def leads(self, name: str) -> bool | None:
        """Whether `name` leads and is sure of it (None: it does not answer)."""
        try:
            return sample(self.scrape(name), "gpufaas_scheduler_leader") == 1
        except httpx.HTTPError:
            return None

    def role(self, name: str) -> str | None:
        """`name`'s role in the election: leader, unsure or standby (None: it does not answer)."""
        try:
            text = self.scrape(name)
        except httpx.HTTPError:
            return None
        roles = ("leader", "unsure", "standby")
        return next((role for role in roles if sample(text, "gpufaas_scheduler_role", role=role)), None)

    def epoch(self, name: str) -> int:
        return int(sample(self.scrape(name), "gpufaas_scheduler_epoch"))

    def pid(self, name: str) -> int:
        process = self.cluster.components[name].process
        assert process is not None
        return process.pid

    def overview(self) -> dict[str, Any]:
        response = httpx.get(f"{self.cluster.gateway_url}/system/overview", auth=self.cluster.admin_auth, timeout=10)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def ledgers(self) -> dict[str, dict[str, float]]:
        """What each node's grant ledger admitted and refused (its metrics)."""
        names = ("gpufaas_node_grants_admitted_total", "gpufaas_node_calls_admitted_again_total")
        names += ("gpufaas_node_calls_admitted_under_leases_total",)
        names += ("gpufaas_node_grants_refused_stale_total", "gpufaas_node_scheduler_epoch")
        return {
            node: {name: sample(self.scrape(node), name) for name in names}
            for node in (f"node{i}" for i in range(self.cluster.nodes))
        }

    def leader_key(self) -> tuple[str, int]:
        """The leader key in etcd: (address, epoch)."""

        async def read() -> tuple[str, int]:
            store = await EtcdStore.open(self.etcd.endpoint)
            try:
                kv = await store.get(Keys(self.cluster.root).scheduler_leader)
            finally:
                await store.close()
            assert kv is not None
            return kv.value.decode(), kv.create_revision

        return asyncio.run(read())


@pytest.fixture
def failover(tmp_path: Path) -> Iterator[Failover]:
    """A private etcd (fast elections), a cluster of two one-GPU nodes whose gateway follows the
    leader key, its scheduler leading, and the sleepy functions deployed. Without credentials:
    the test speaks to a node as a scheduler would, and what it tests is not the credentials."""
    etcd = EtcdServer(extra_args=FAST_ETCD).start(tmp_path / "etcd")
    cluster = FollowingCluster(
        tmp_path / "cluster",
        nodes=2,
        gpus_per_node=1,
        backend="cpu",
        gpu_memory_mb=1000,
        etcd_endpoint=etcd.endpoint,
        secure=False,
    )
    try:
        cluster.start()
        for name in FUNCTIONS:
            deploy(cluster, name, "sleepy_function", tmp_path, memory_mb=300)
            response = httpx.post(f"{cluster.gateway_url}/function/{name}", json={}, timeout=CALL_TIMEOUT_S)
            assert response.status_code == 200, response.text  # loaded: the load's calls are hits
        yield Failover(cluster, etcd, tmp_path)
    finally:
        for component in cluster.components.values():  # a stopped process would not act on SIGTERM
            if component.alive() and component.pid is not None:
                os.kill(component.pid, signal.SIGCONT)
        cluster.stop()
        etcd.stop()


# --- the load -----------------------------------------------------------------------------------


@dataclass
class Call:
    sent_s: float
    done_s: float = 0.0
    status: int | None = None
    error: str = ""
    body: str = ""


@dataclass
class Load:
    """CLIENTS threads calling the functions in a loop; every call recorded."""

    cluster: LocalCluster
    calls: list[Call] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for index in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(CALL_TIMEOUT_S + 5)

    def _client(self, index: int) -> None:
        url = self.cluster.gateway_url
        with httpx.Client(timeout=CALL_TIMEOUT_S, headers=self.cluster.invoke_headers) as client:
            count = 0
            while not self.stopping.is_set():
                name = FUNCTIONS[(index + count) % len(FUNCTIONS)]
                count += 1
                call = Call(sent_s=time.monotonic())
                self.calls.append(call)
                try:
                    payload = {"sleep_s": 0.05, "call_id": f"c{index}-{count}"}  # logged where it runs
                    response = client.post(f"{url}/function/{name}", json=payload)
                    call.status = response.status_code
                    call.body = "" if response.status_code == 200 else response.text[:200]
                except httpx.HTTPError as exc:
                    call.error = type(exc).__name__
                call.done_s = time.monotonic()

    def report(self, fault_s: float) -> dict[str, Any]:
        """The calls by status, and how service came back after the fault at `fault_s`."""
        calls = list(self.calls)
        ok = sorted(c.done_s for c in calls if c.status == 200)
        after = [c.done_s for c in calls if c.sent_s > fault_s and c.status == 200]
        spells = [b - a for a, b in itertools.pairwise(ok) if b > fault_s]
        return {
            "calls": len(calls),
            "by_status": dict(Counter(str(c.status) for c in calls if c.status is not None)),
            "errors": dict(Counter(c.error for c in calls if c.error)),
            "failed": [c.body or c.error for c in calls if c.status != 200][:5],
            "unanswered": sum(1 for c in calls if c.status is None and not c.error),
            "first_success_of_a_call_sent_after_the_fault_s": round(min(after) - fault_s, 3) if after else None,
            "longest_spell_without_a_success_s": round(max(spells, default=0.0), 3),
        }

    def steady(self) -> None:
        """Wait for STEADY_S of calls, at least CLIENTS of them answered."""
        time.sleep(STEADY_S)
        wait_for(lambda: sum(1 for c in list(self.calls) if c.status == 200) >= CLIENTS, timeout_s=30)


def until(predicate: Callable[[], object], timeout_s: float = 20.0) -> float:
    """Wait for `predicate`; when it held (monotonic seconds)."""
    wait_for(predicate, timeout_s=timeout_s)
    return time.monotonic()


def write_report(failover: Failover, name: str, report: dict[str, Any]) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    out = Path(os.environ.get("GPUFAAS_FAILOVER_REPORT_DIR", failover.tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(text + "\n")


def assert_every_call_succeeded(report: dict[str, Any]) -> None:
    assert report["calls"] > 0 and report["by_status"] == {"200": report["calls"]}, report


def assert_no_call_ran_twice(failover: Failover, ledgers: dict[str, dict[str, float]], succeeded: int) -> None:
    """No node admitted a grant twice (its ledger), and no call ran twice anywhere: the function
    logs each call it runs, and every node's log is counted together (a call run once on each of
    two nodes passes both ledgers)."""
    assert all(ledger["gpufaas_node_calls_admitted_again_total"] == 0 for ledger in ledgers.values()), ledgers
    admitted = sum(
        ledger["gpufaas_node_grants_admitted_total"] + ledger["gpufaas_node_calls_admitted_under_leases_total"]
        for ledger in ledgers.values()
    )
    assert admitted >= succeeded, ledgers  # every call ran through a ledger (the deploy's warm-ups too)
    runs: Counter[str] = Counter()
    for log_file in (failover.cluster.state_dir / "logs").glob("node*.log"):
        runs.update(re.findall(r"sleepy-ran (\S+)", log_file.read_text(errors="replace")))
    assert sum(runs.values()) >= succeeded, (sum(runs.values()), succeeded)  # the marks are there to count
    assert [call for call, count in runs.items() if count > 1] == []


# --- the tests ------------------------------------------------------------------------------------


def test_killing_the_leading_scheduler_fails_no_call_and_a_standby_takes_over(failover: Failover) -> None:
    failover.add_scheduler("standby")
    until(lambda: failover.leads("standby") is False and failover.epoch("standby") > 0)
    first_epoch = failover.epoch("scheduler")
    assert failover.leads("scheduler") is True
    with Load(failover.cluster) as load:
        load.steady()
        killed_s = time.monotonic()
        os.kill(failover.pid("scheduler"), signal.SIGKILL)
        took_over_s = until(lambda: failover.leads("standby"))
        time.sleep(STEADY_S)
    report = {"fault": "SIGKILL of the leader", "clients": CLIENTS, **load.report(killed_s)}
    report["standby_leads_after_s"] = round(took_over_s - killed_s, 3)
    report["ledgers"] = ledgers = failover.ledgers()
    report["overview_scheduler_leader"] = leader = failover.overview()["scheduler_leader"]
    write_report(failover, "failover_sigkill", report)

    assert_every_call_succeeded(report)
    assert report["first_success_of_a_call_sent_after_the_fault_s"] <= RECOVERY_BOUND_S, report
    assert_no_call_ran_twice(failover, ledgers, report["by_status"]["200"])
    assert leader["name"] == "standby" and leader["epoch"] > first_epoch, leader
    assert failover.leader_key() == (leader["address"], leader["epoch"])


def test_a_leader_stopped_and_continued_runs_no_call_twice_and_stands_by(failover: Failover) -> None:
    failover.add_scheduler("standby")
    until(lambda: failover.leads("standby") is False and failover.epoch("standby") > 0)
    old_epoch = failover.epoch("scheduler")
    with Load(failover.cluster) as load:
        load.steady()
        stopped_s = time.monotonic()
        os.kill(failover.pid("scheduler"), signal.SIGSTOP)
        took_over_s = until(lambda: failover.leads("standby"))
        time.sleep(max(0.0, stopped_s + STOP_S - time.monotonic()))
        os.kill(failover.pid("scheduler"), signal.SIGCONT)
        continued_s = time.monotonic()
        stood_by_s = until(lambda: failover.role("scheduler") == "standby")
        time.sleep(STEADY_S)
    report = {"fault": f"SIGSTOP of the leader for {STOP_S:g} s, then SIGCONT", "clients": CLIENTS}
    report |= load.report(stopped_s)
    report["standby_leads_after_s"] = round(took_over_s - stopped_s, 3)
    report["old_leader_stands_by_after_sigcont_s"] = round(stood_by_s - continued_s, 3)
    report["ledgers"] = ledgers = failover.ledgers()
    report["overview_scheduler_leader"] = leader = failover.overview()["scheduler_leader"]
    write_report(failover, "failover_sigstop", report)

    assert_every_call_succeeded(report)
    assert_no_call_ran_twice(failover, ledgers, report["by_status"]["200"])
    assert failover.role("scheduler") == "standby" and failover.role("standby") == "leader"
    assert leader["name"] == "standby" and failover.leader_key() == (leader["address"], leader["epoch"])
    assert all(ledger["gpufaas_node_scheduler_epoch"] == leader["epoch"] for ledger in ledgers.values()), ledgers
    assert "stepping down" in (failover.cluster.state_dir / "logs" / "scheduler.log").read_text()
    assert_a_node_refuses_an_older_epoch(failover, old_epoch)


def assert_a_node_refuses_an_older_epoch(failover: Failover, epoch: int) -> None:
    """A scheduler of `epoch` (a deposed leader's) attaching to a node is refused as FENCED."""

    async def attach() -> None:
        store = await EtcdStore.open(failover.etcd.endpoint)
        try:
            kv = await store.get(Keys(failover.cluster.root).node("node0"))
        finally:
            await store.close()
        assert kv is not None
        conn = await connect(NodeRecord.from_json(kv.value).address, key=failover.cluster.wire_key, timeout_s=5)
        try:
            with pytest.raises(RemoteError) as refused:
                await conn.request(
                    MessageType.ATTACH, pb.Attach(scheduler_id="deposed", token_key=b"k" * 32, epoch=epoch), timeout_s=5
                )
        finally:
            conn.close()
        assert refused.value.status == pb.FENCED and "no longer the leader" in refused.value.message

    asyncio.run(attach())


class HoldingProxy:
    """A TCP proxy on loopback to `target` that, while `cut`, holds every byte in both directions
    (as a partition does: nothing arrives, nothing is reset); healed, it delivers them."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.open = threading.Event()
        self.open.set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self.open.clear()

    def heal(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.open.set()
        for sock in self._sockets:
            with _quiet():
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            upstream = socket.create_connection((host, int(port)))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with _quiet():
            while data := source.recv(65536):
                self.open.wait()
                sink.sendall(data)
        with _quiet():
            sink.shutdown(socket.SHUT_WR)


class _quiet:  # noqa: N801 - a context manager used as a statement
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> bool:
        return isinstance(exc, OSError)


def test_a_leader_cut_off_from_etcd_is_replaced_and_after_the_heal_stands_by(failover: Failover) -> None:
    """The leader's link to etcd is cut (its links to gateways and nodes are not): it stops
    placing once its lease is unconfirmed, a standby takes over when etcd expires the lease, and
    after the heal the old leader stands by; at no sample do two schedulers lead."""
    proxy = HoldingProxy(failover.etcd.endpoint)
    try:
        failover.add_scheduler("cut", etcd=proxy.address)
        until(lambda: failover.leads("cut") is False and failover.epoch("cut") > 0)
        failover.cluster.components["scheduler"].stop()  # SIGTERM: it resigns, "cut" leads at once
        until(lambda: failover.leads("cut"))
        failover.add_scheduler("standby")
        until(lambda: failover.leads("standby") is False and failover.epoch("standby") > 0)
        samples: list[tuple[float, bool | None, bool | None]] = []
        with Load(failover.cluster) as load:
            load.steady()
            cut_s = time.monotonic()
            proxy.cut()

            def sampled(done: Callable[[], bool]) -> Callable[[], bool]:
                def check() -> bool:
                    samples.append((time.monotonic() - cut_s, failover.leads("cut"), failover.leads("standby")))
                    return done()

                return check

            took_over_s = until(sampled(lambda: samples[-1][2] is True))
            time.sleep(STEADY_S)
            healed_s = time.monotonic()
            proxy.heal()
            until(sampled(lambda: time.monotonic() > healed_s + 3 * STEADY_S), timeout_s=30)
        report = {"fault": "the leader cut off from etcd, then healed", "clients": CLIENTS, **load.report(cut_s)}
        report["standby_leads_after_s"] = round(took_over_s - cut_s, 3)
        report["ledgers"] = ledgers = failover.ledgers()
        report["samples"] = len(samples)
        report["two_leaders_at"] = [round(s, 3) for s, cut, standby in samples if cut and standby]
        write_report(failover, "failover_partition", report)

        assert_every_call_succeeded(report)
        assert_no_call_ran_twice(failover, ledgers, report["by_status"]["200"])
        assert not report["two_leaders_at"], report
        assert failover.role("cut") == "standby" and failover.role("standby") == "leader"
        assert failover.overview()["scheduler_leader"]["name"] == "standby"
    finally:
        proxy.close()
