"""Chaos, bounded: under a steady load on a supervised local cluster, kill in turn a worker, a node,
the scheduler, etcd and the gateway, and count every call.

Per kill it reports calls sent, answered (by status), failed to connect, and the time from the kill
to the first success of a call sent after it (JSON: the test's tmp dir, or $GPUFAAS_CHAOS_REPORT).
It fails if a call is never answered, if a call fails with anything but a retryable status (502,
503, 504) or a connection error at the gateway's own kill, if service does not come back within
RECOVERY_BOUND_S, or if the scheduler's LRU lists do not come to equal the workers the nodes run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.cluster import NodeRecord
from gpufaas.keys import Keys
from gpufaas.local_cluster import LocalCluster
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore
from gpufaas.wire import MessageType, connect
from tests.integration.conftest import deploy, descendants
from tests.integration.test_control_plane import wait_for

pytestmark = pytest.mark.integration

RECOVERY_BOUND_S = 5.0  # from a kill to the first success of a call sent after it
CONVERGE_S = 12.0  # LRU lists equal the running workers within this (reconciliation runs every 5 s)
STEADY_S = 2.0  # load before each kill
CLIENTS = 4
CALL_TIMEOUT_S = 30.0
RETRYABLE = {502, 503, 504}


@dataclass
class Call:
    sent_s: float
    done_s: float = 0.0
    status: int | None = None  # HTTP status, None if no answer came
    error: str = ""  # a connection error instead of a status


@dataclass
class Load:
    """CLIENTS threads calling in a loop; every call recorded."""

    cluster: LocalCluster
    functions: list[str]
    calls: list[Call] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(CALL_TIMEOUT_S + 5)

    def _client(self, index: int) -> None:
        url = self.cluster.gateway_url
        headers = self.cluster.invoke_headers
        with httpx.Client(timeout=CALL_TIMEOUT_S, headers=headers) as client:
            count = 0
            while not self.stopping.is_set():
                name = self.functions[(index + count) % len(self.functions)]
                count += 1
                call = Call(sent_s=time.monotonic())
                self.calls.append(call)
                try:
                    call.status = client.post(f"{url}/function/{name}", json={"sleep_s": 0.05}).status_code
                except httpx.TimeoutException as exc:
                    call.error = f"timeout: {type(exc).__name__}"
                except httpx.TransportError as exc:
                    call.error = type(exc).__name__
                    time.sleep(0.05)  # the gateway is down: do not spin
                call.done_s = time.monotonic()


def worker_pid(cluster: LocalCluster) -> int:
    response = httpx.post(
        f"{cluster.gateway_url}/function/fa", json={}, headers=cluster.invoke_headers, timeout=CALL_TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    return int(response.json()["pid"])


def kills(cluster: LocalCluster) -> list[tuple[str, Callable[[], None]]]:
    def component(name: str) -> Callable[[], None]:
        return lambda: os.kill(cluster.pids()[name], signal.SIGKILL)

    return [
        ("worker", lambda: os.kill(worker_pid(cluster), signal.SIGKILL)),
        ("node", component("node0")),
        ("scheduler", component("scheduler")),
        ("etcd", component("etcd")),
        ("gateway", component("gateway")),
    ]


def lru_and_workers(cluster: LocalCluster) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The scheduler's LRU lists (via the gateway) and the workers each node says it runs."""
    gpus = httpx.get(f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10).json()
    lru = {g["gpu"]: set(g["lru"]) for g in gpus}

    async def ask() -> dict[str, set[str]]:
        assert cluster.etcd_endpoint is not None
        store = await EtcdStore.open(cluster.etcd_endpoint)
        try:
            records = [NodeRecord.from_json(kv.value) for kv in await store.get_prefix(Keys(cluster.root).nodes)]
        finally:
            await store.close()
        running: dict[str, set[str]] = {f"{r.node}/{g.gpu}": set() for r in records for g in r.gpus}
        for record in records:
            conn = await connect(record.address, key=cluster.wire_key, timeout_s=5)
            try:
                reply = (await conn.request(MessageType.WORKERS, pb.WorkersRequest(), timeout_s=5)).message(
                    pb.AttachReply
                )
            finally:
                conn.close()
            for worker in reply.workers:
                running[f"{record.node}/{worker.gpu}"].add(worker.model)
        return running

    return lru, asyncio.run(ask())


def converged(cluster: LocalCluster) -> bool:
    try:
        lru, running = lru_and_workers(cluster)
    except (httpx.HTTPError, OSError, ValueError):
        return False
    return lru == running


def test_every_call_is_answered_and_service_returns_after_each_kill(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    watched: list[int] = []
    cluster.start()
    try:
        cluster.supervise_in_background()
        for name in ("fa", "fb", "fc"):
            deploy(cluster, name, "sleepy_function", tmp_path, memory_mb=300)
        load = Load(cluster, ["fa", "fb", "fc"])
        load.start()
        report: dict[str, Any] = {"recovery_bound_s": RECOVERY_BOUND_S, "clients": CLIENTS, "kills": []}
        try:
            time.sleep(STEADY_S)
            for what, kill in kills(cluster):
                for component in cluster.components.values():
                    if component.pid is not None:
                        watched.extend([component.pid, *descendants(component.pid)])
                before = len(load.calls)
                killed_s = time.monotonic()
                kill()
                # Until a call sent after the kill succeeds (bounded), then a steady spell.
                deadline = killed_s + RECOVERY_BOUND_S + 10
                recovered_s = None
                while recovered_s is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                    done = [c for c in list(load.calls) if c.sent_s > killed_s and c.status == 200]
                    recovered_s = min((c.done_s for c in done), default=None)
                time.sleep(STEADY_S)
                wait_for(lambda: converged(cluster), timeout_s=CONVERGE_S)
                window = load.calls[before:]
                report["kills"].append(
                    {
                        "killed": what,
                        "calls_sent": len(window),
                        "answered_by_status": dict(Counter(str(c.status) for c in window if c.status is not None)),
                        "connection_errors": dict(Counter(c.error for c in window if c.error)),
                        "recovery_s": None if recovered_s is None else round(recovered_s - killed_s, 3),
                        "restarts": dict(cluster.supervision.restarts),
                    }
                )
        finally:
            load.stop()
        unfinished = [c for c in load.calls if c.status is None and not c.error]
        out = Path(os.environ.get("GPUFAAS_CHAOS_REPORT", tmp_path / "chaos.json"))
        report["calls"] = len(load.calls)
        report["unanswered"] = len(unfinished)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))

        assert not unfinished, f"{len(unfinished)} calls never answered"
        for entry in report["kills"]:
            what = entry["killed"]
            assert entry["recovery_s"] is not None and entry["recovery_s"] <= RECOVERY_BOUND_S, entry
            statuses = {int(s) for s in entry["answered_by_status"]}
            assert statuses <= {200} | RETRYABLE, entry
            if what != "gateway":  # only the gateway's own kill may cut connections
                assert not entry["connection_errors"], entry
            assert not [e for e in entry["connection_errors"] if e.startswith("timeout")], entry
        # Every component that was killed came back (the worker's node replaces it itself).
        restarts = report["kills"][-1]["restarts"]
        assert {
            name: restarts.get(name, 0) >= 1 for name in ("node0", "scheduler", "etcd", "gateway")
        } == dict.fromkeys(("node0", "scheduler", "etcd", "gateway"), True), restarts
    finally:
        cluster.stop()
        from gpufaas.local_cluster import pid_alive

        leftovers = [pid for pid in watched if pid_alive(pid)]
        assert not leftovers, f"processes left running: {leftovers}"
