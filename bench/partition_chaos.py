"""Partitions and host loss under load: a cluster with a daemon per host (gpufaas.dev.host_cluster), a
steady load of short calls, and one fault at a time (applied, held, healed), tallied per fault.

`python -m bench.partition_chaos --json` writes bench/results/partition_chaos.json (and prints it).

The faults, in order (`fault_schedule`): isolate a node; isolate the leading scheduler's host (the
only scheduler's before leader election); cut the leading scheduler from etcd, nothing else; cut
one gateway -> node direction only; 50 ms more on everything a node sends; SIGKILL every process
of a node's host at once, then start it again. Each is held `hold_s`, healed, and the load runs on
until calls are served normally again.

Per fault: calls answered 200, failed by status ("503", "timeout", ...) and how many of the failed
were answered 502 "outcome unknown" (a call that may have run on a node the gateway lost: never run
again), calls run twice (and which of those first ran on a killed host, in flight there when it was
killed), calls lost (no answer at all) and which of those were in flight on a killed host, and the
seconds until calls succeed again after the fault and after the heal (`recovery_s`). What ran is read from the
nodes: the bench's function prints `chaos-ran CALL_ID` when it starts, which the node logs
(gpufaas.worker), so executions are counted across nodes and across a node's restarts. (The
nodes' grant ledgers, gpu_manager.ledger, live in each node's memory only, per (call, attempt):
a call placed again under a new attempt on another node is in neither.)

The pure parts (the schedule, the tally, the recovery time) take the times they need as
arguments; the I/O (the cluster, the clients, the faults) is in `ChaosRun` and `main`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from gpufaas.dev.host_cluster import HostCluster

LEADER = "@leader"  # in a fault's hosts: the scheduler that leads when the fault is applied
BUSIEST = "@busiest-node"  # the node that served the most calls just before the fault
BUSIEST_WINDOW_S = 5.0
OK = "200"
# What a gateway's answer says when a call may have run on a node it lost (gateway.router,
# scheduler.calls): "the outcome of call ... is unknown: ..., so it was not run again".
OUTCOME_UNKNOWN_MARK = "is unknown"
NO_ANSWER = frozenset({"timeout", "connection-error"})  # statuses of a call that got no answer
RAN_MARK = "chaos-ran"
HURT_LISTED = 12
DETAIL_CHARS = 160
PROBE_CLIENT = 1000  # the probes' client numbers start here (call ids chaos-TAG-CLIENT-SEQUENCE)

# The bench's function: says which call it runs (the node logs what its workers print), then
# sleeps as its payload says.
HANDLER = f'''"""Partition chaos bench: prints the call it runs, then sleeps sleep_s."""

import time


def load(device):
    return {{"device": device}}


def predict(model, inputs):
    print("{RAN_MARK}", inputs.get("call_id", "-"), flush=True)
    time.sleep(float(inputs.get("sleep_s", 0)))
    return {{"call_id": inputs.get("call_id"), "device": model["device"]}}
'''


# --- the pure parts --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: `action` on `hosts` ("isolate": hosts[0] reaches and is reached by no one;
    "cut": hosts[0] <-> hosts[1]; "cut-one-way": hosts[0] -> hosts[1] dropped; "delay": `delay_ms`
    on all hosts[0] sends; "kill": every process of hosts[0] SIGKILLed, started again at the heal)."""

    name: str
    action: str
    hosts: tuple[str, ...]
    what: str
    delay_ms: float = 0.0

    def resolved(self, leader: str, busiest: str) -> Fault:
        """The fault with LEADER replaced by the host of the scheduler that leads now, BUSIEST by
        the busiest node's."""
        named = {LEADER: leader, BUSIEST: busiest}
        return dataclasses.replace(self, hosts=tuple(named.get(host, host) for host in self.hosts))


def fault_schedule(gateways: Sequence[str], *, election: bool, delay_ms: float = 50.0) -> list[Fault]:
    """The faults, one at a time, in order. A node fault strikes the node that served the most
    calls just before it (BUSIEST, resolved when applied: a fault on an idle node shows nothing).
    Without leader election (one scheduler) the scheduler's faults name it plainly and say so;
    the kill comes last (its node's restart is the slowest heal)."""
    scheduler = "the leading scheduler's host" if election else "the only scheduler's host (no election yet)"
    gateway = gateways[0]
    return [
        Fault("isolate-node", "isolate", (BUSIEST,), "the busiest node reaches and is reached by no host"),
        Fault("isolate-scheduler", "isolate", (LEADER,), f"{scheduler} reaches and is reached by no host"),
        Fault("cut-scheduler-etcd", "cut", (LEADER, "etcd"), f"{scheduler} <-> etcd only, both ways"),
        Fault(
            "cut-gateway-node-one-way",
            "cut-one-way",
            (gateway, BUSIEST),
            f"{gateway} -> the busiest node dropped; that node -> {gateway} passes",
        ),
        Fault(
            "delay-node", "delay", (BUSIEST,), f"{delay_ms:g} ms more on everything the busiest node sends", delay_ms
        ),
        Fault(
            "kill-node-host", "kill", (BUSIEST,), "every process of the busiest node's host SIGKILLed, then restarted"
        ),
    ]


def busiest_node(records: Iterable[CallRecord], since_s: float, nodes: Sequence[str]) -> str:
    """The node that answered the most calls since `since_s` (the first node if none did)."""
    served = Counter(r.node for r in records if r.done_s >= since_s and r.status == OK and r.node in nodes)
    return max(nodes, key=lambda node: (served[node], -nodes.index(node)))


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call as its client saw it: sent and answered (monotonic seconds), the HTTP status or
    "timeout" / "connection-error", and the node that answered (X-Gpu's node, "" if none)."""

    call_id: str
    sent_s: float
    done_s: float
    status: str
    node: str = ""
    detail: str = ""  # a failed call's answer (its start), or the client's error
    probe: bool = False  # a longer call sent just before a fault (not counted for recovery)

    def good(self, slow_s: float) -> bool:
        """Answered 200 within `slow_s`: served as when nothing is wrong."""
        return self.status == OK and self.done_s - self.sent_s <= slow_s


@dataclass(frozen=True, slots=True)
class Phase:
    """When a fault's probes were sent, when it was applied and healed, and when the next one's
    probes were sent (or the run ended); `killed_s`: when its host's processes were killed (a
    kill fault)."""

    fault: Fault
    applied_s: float
    healed_s: float
    ended_s: float
    killed_s: float | None = None
    started_s: float = 0.0


def recovery_s(records: Iterable[CallRecord], since_s: float, until_s: float, slow_s: float) -> float | None:
    """Seconds from `since_s` (a fault applied, or healed) until calls succeed again: 0 if no
    call in flight at `since_s` or sent before `until_s` was hurt (failed, or slower than
    `slow_s`); else until the first good call sent after the last hurt one was answered; None if
    no good call followed it before `until_s` (not recovered). Probes do not count: they are
    slow by design."""
    affected = [r for r in records if r.done_s >= since_s and r.sent_s < until_s and not r.probe]
    hurt = [r for r in affected if not r.good(slow_s)]
    if not hurt:
        return 0.0
    last_hurt_sent_s = max(r.sent_s for r in hurt)
    followers = [r for r in affected if r.sent_s > last_hurt_sent_s and r.good(slow_s)]
    if not followers:
        return None
    return max(0.0, min(r.done_s for r in followers) - since_s)


@dataclass(frozen=True, slots=True)
class FaultTally:
    """What one fault did to the calls answered while it was on and until the next began."""

    fault: str
    what: str
    calls: int
    ok: int
    failed_by_status: dict[str, int]
    failed_outcome_unknown: int  # of the failed, answered 502 "outcome unknown" (not run again)
    run_twice: int
    run_twice_in_flight_on_kill: int  # of those, first run on the killed host while it was killed
    lost: int  # no answer at all (the client's timeout, or its connection broken)
    lost_in_flight_on_kill: int  # of those, in flight when the fault's host was killed
    slow: int  # answered 200 but slower than slow_s
    recovery_after_fault_s: float | None
    recovery_after_heal_s: float | None
    held_s: float
    served_by: dict[str, int]  # calls answered 200, by node
    median_s: float | None  # of the calls answered 200
    max_s: float | None
    hurt: list[str]  # the first HURT_LISTED hurt calls: "sent +S s, answered +S s: STATUS (NODE)"


def tally(
    records: Sequence[CallRecord],
    phase: Phase,
    runs: Mapping[str, int],
    slow_s: float,
    *,
    runs_on_killed: Mapping[str, int] | None = None,
) -> FaultTally:
    """The phase's calls (those answered from its fault's application until the next's), how many
    ran more than once (`runs`: executions by call id, on every node), lost, and the recovery
    times. A call run twice counts as in flight on a killed host if it was in flight (sent before
    the kill, answered after) and ran on that host (`runs_on_killed`: its executions by call id)."""
    mine = [r for r in records if phase.applied_s <= r.done_s < phase.ended_s]
    failed = Counter(r.status for r in mine if r.status != OK)
    lost = [r for r in mine if r.status in NO_ANSWER]
    killed_s = phase.killed_s
    latencies = [r.done_s - r.sent_s for r in mine if r.status == OK]
    spans_kill = [r for r in mine if killed_s is not None and r.sent_s <= killed_s < r.done_s]
    twice = {r.call_id for r in mine if runs.get(r.call_id, 0) > 1}
    on_killed = runs_on_killed or {}
    return FaultTally(
        fault=phase.fault.name,
        what=phase.fault.what,
        calls=len(mine),
        ok=sum(r.status == OK for r in mine),
        failed_by_status=dict(sorted(failed.items())),
        failed_outcome_unknown=sum(r.status == "502" and OUTCOME_UNKNOWN_MARK in r.detail for r in mine),
        run_twice=len(twice),
        run_twice_in_flight_on_kill=sum(r.call_id in twice and on_killed.get(r.call_id, 0) > 0 for r in spans_kill),
        lost=len(lost),
        lost_in_flight_on_kill=sum(r.status in NO_ANSWER for r in spans_kill),
        slow=sum(r.status == OK and not r.good(slow_s) for r in mine),
        recovery_after_fault_s=recovery_s(records, phase.applied_s, phase.healed_s, slow_s),
        recovery_after_heal_s=recovery_s(records, phase.healed_s, phase.ended_s, slow_s),
        held_s=phase.healed_s - phase.applied_s,
        served_by=dict(sorted(Counter(r.node for r in mine if r.status == OK).items())),
        median_s=statistics.median(latencies) if latencies else None,
        max_s=max(latencies, default=None),
        hurt=[_hurt_line(r, phase.applied_s) for r in mine if not r.good(slow_s)][:HURT_LISTED],
    )


def _hurt_line(record: CallRecord, since_s: float) -> str:
    return (
        f"{record.call_id} sent {record.sent_s - since_s:+.1f} s, answered {record.done_s - since_s:+.1f} s: "
        f"{record.status}"
        f" ({record.node or 'no node'}){': ' + record.detail if record.detail else ''}"
    )


def runs_in_log(text: str) -> Counter[str]:
    """Executions by call id from a node's log: one per `chaos-ran CALL_ID` its workers printed."""
    return Counter(re.findall(rf"{RAN_MARK} (\S+)", text))


def settled(
    records: Sequence[CallRecord], since_s: float, now_s: float, *, min_s: float, last: int, slow_s: float
) -> bool:
    """Whether the load is served normally again: at least `min_s` since `since_s`, and the
    `last` calls answered since then all good."""
    if now_s - since_s < min_s:
        return False
    answered = sorted((r for r in records if r.done_s >= since_s and not r.probe), key=lambda r: r.done_s)[-last:]
    return len(answered) == last and all(r.good(slow_s) for r in answered)


# --- the I/O: the cluster, the load, the faults ------------------------------------------------------


@dataclass(frozen=True)
class ChaosConfig:
    """How the run goes: clients in a closed loop of short calls, each fault held `hold_s`, then
    healed and the load watched until `settled` (at least `settle_min_s`, at most `settle_max_s`)."""

    clients: int = 8
    call_sleep_s: float = 0.01
    client_timeout_s: float = 30.0
    slow_s: float = 2.0
    baseline_s: float = 3.0
    hold_s: float = 8.0
    settle_min_s: float = 3.0
    settle_max_s: float = 30.0
    settle_calls: int = 16
    delay_ms: float = 50.0
    # Longer calls sent just before each fault, so that some run on its host as it strikes.
    probes: int = 4
    probe_sleep_s: float = 1.5
    probe_lead_s: float = 0.5
    functions: tuple[str, ...] = ("chaos-a", "chaos-b")
    # The probes' own function: its worker, not the load's, is held by them.
    probe_function: str = "chaos-probe"
    function_memory_mb: int = 300  # the three fit on a 1000 MB GPU: every node can hold them all


@dataclass
class Load:
    """`clients` threads calling in a closed loop, spread over the gateways (or the balancer),
    each call with a unique x-call-id; records every call."""

    call: Callable[[int, int], CallRecord]  # (client, sequence) -> its record
    clients: int
    records: list[CallRecord] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self.clients, thread_name_prefix="chaos-client")
        for client in range(self.clients):
            self._pool.submit(self._loop, client)

    def _loop(self, client: int) -> None:
        sequence = 0
        while not self._stop.is_set():
            record = self.call(client, sequence)
            with self._lock:
                self.records.append(record)
            sequence += 1

    def add(self, records: Iterable[CallRecord]) -> None:
        """Records of calls made beside the loop (the probes)."""
        added = list(records)
        with self._lock:
            self.records += added

    def snapshot(self) -> list[CallRecord]:
        with self._lock:
            return list(self.records)

    def stop(self) -> list[CallRecord]:
        """Stop sending; wait for the calls under way; every record."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return self.snapshot()


class ChaosRun:
    """The faults of `fault_schedule` applied one by one to a started HostCluster under a Load."""

    def __init__(self, cluster: HostCluster, config: ChaosConfig, *, election: bool) -> None:
        self.cluster = cluster
        self.config = config
        self.election = election
        self.tag = f"{time.time_ns():x}"[-8:]  # call ids unique across runs on one cluster
        self._clients: dict[int, httpx.Client] = {}  # one per client thread
        self.load = Load(self.call, config.clients)
        self._probes = ThreadPoolExecutor(config.probes, thread_name_prefix="chaos-probe")
        self.phases: list[Phase] = []
        self.notes: list[str] = []

    # --- one call -------------------------------------------------------------------------------
    def call(self, client: int, sequence: int, sleep_s: float | None = None) -> CallRecord:
        """One call of client `client`: to a gateway in turn (or the balancer), function in turn;
        its work `sleep_s` (default the config's)."""
        cluster, config = self.cluster, self.config
        call_id = f"chaos-{self.tag}-{client}-{sequence}"
        function = config.functions[(client + sequence) % len(config.functions)]
        if sleep_s is not None:
            function = config.probe_function
        urls = [cluster.gateway_url] if cluster.balancer else cluster.gateway_urls
        http = self._clients.get(client) or self._clients.setdefault(client, httpx.Client())
        work_s = config.call_sleep_s if sleep_s is None else sleep_s
        payload: dict[str, object] = {"call_id": call_id, "sleep_s": work_s}
        sent_s = time.monotonic()
        try:
            response = cluster.call(
                function,
                http,
                timeout_s=config.client_timeout_s,
                payload=payload,
                call_id=call_id,
                gateway_url=urls[(client + sequence) % len(urls)],
            )
            status, node = str(response.status_code), response.headers.get("X-Gpu", "").split("/")[0]
            detail = "" if response.status_code == 200 else response.text[:DETAIL_CHARS]
        except httpx.TimeoutException as exc:
            status, node, detail = "timeout", "", repr(exc)[:DETAIL_CHARS]
        except httpx.TransportError as exc:
            status, node, detail = "connection-error", "", repr(exc)[:DETAIL_CHARS]
            time.sleep(0.1)  # a gateway refusing connections: not a busy loop
        return CallRecord(call_id, sent_s, time.monotonic(), status, node, detail, probe=sleep_s is not None)

    # --- before the faults --------------------------------------------------------------------------
    def prepare(self, timeout_s: float = 30.0) -> None:
        """Deploy the functions, start the load and wait (at most `timeout_s`, else a note says
        so) until every node has answered calls of each load function: a fault then moves calls,
        not models. The probes' function is called once per probe, so its workers are up."""
        from gpufaas.packages import build_package

        with tempfile.TemporaryDirectory() as directory:
            (Path(directory) / "handler.py").write_text(HANDLER)
            package = build_package(Path(directory))
        for function in (*self.config.functions, self.config.probe_function):
            self.cluster.deploy(function, package, memory_mb=self.config.function_memory_mb)
        warm = [self._probes.submit(self.call, PROBE_CLIENT - 1 - i, 0, 0.0) for i in range(self.config.probes)]
        for probe in warm:  # its worker started before the faults: a probe is not a miss
            probe.result()
        self.load.start()
        started = time.monotonic()
        want = {(f, n) for f in self.config.functions for n in self.cluster.nodes}
        while time.monotonic() - started < timeout_s:
            served = {(self._function_of(r.call_id), r.node) for r in self.load.snapshot() if r.status == OK}
            if want <= served:
                return
            time.sleep(0.5)
        self.notes.append(f"after {timeout_s:g} s of load not every node had served every function: {sorted(served)}")

    def _function_of(self, call_id: str) -> str:
        client, sequence = (int(part) for part in call_id.rsplit("-", 2)[1:])
        return self.config.functions[(client + sequence) % len(self.config.functions)]

    # --- the faults --------------------------------------------------------------------------------
    def leader(self) -> str:
        """The host of the scheduler that leads (the only one without election)."""
        if not self.election:
            return self.cluster.schedulers[0]
        for _ in range(50):
            with contextlib.suppress(Exception):  # etcd busy or no leader for a moment: ask again
                found = self.cluster.leader()
                if found is not None:
                    return found
            time.sleep(0.2)
        raise RuntimeError("no scheduler leads: etcd's leader key names none of the schedulers")

    def apply(self, fault: Fault) -> float | None:
        """Apply `fault`; for a kill, when its host's processes were killed."""
        hosts = self.cluster.hosts
        if fault.action == "isolate":
            hosts.isolate(fault.hosts[0])
        elif fault.action in {"cut", "cut-one-way"}:
            hosts.cut(fault.hosts[0], fault.hosts[1], one_way=fault.action == "cut-one-way")
        elif fault.action == "delay":
            hosts.delay(fault.hosts[0], fault.delay_ms)
        elif fault.action == "kill":
            pids = self.cluster.kill_host(fault.hosts[0])
            killed_s = time.monotonic()
            if not self.cluster.wait_gone(pids):
                self.notes.append(f"some of {fault.hosts[0]}'s processes outlived SIGKILL by 10 s: {pids}")
            return killed_s
        else:
            raise ValueError(f"unknown fault action {fault.action!r}")
        return None

    def heal(self, fault: Fault) -> None:
        if fault.action == "kill":
            self.cluster.restart_host(fault.hosts[0])
        elif fault.action == "cut":
            self.cluster.hosts.heal(fault.hosts[0], fault.hosts[1])
        else:
            self.cluster.hosts.heal(fault.hosts[0])

    def run_fault(self, fault: Fault) -> dict[str, Any]:
        """Apply, hold, heal, and wait until the load is served normally and every node's GPUs
        are back; the phase is recorded (its end set by the next), what was seen is returned."""
        config = self.config
        started_s = time.monotonic()
        probes = self._send_probes(len(self.phases))
        time.sleep(config.probe_lead_s)
        leader = self.leader() if LEADER in fault.hosts else ""
        fault = fault.resolved(leader, self._struck_node() if BUSIEST in fault.hosts else "")
        applied_s = time.monotonic()
        killed_s = self.apply(fault)
        time.sleep(max(0.0, applied_s + config.hold_s - time.monotonic()))
        self.heal(fault)
        healed_s = time.monotonic()
        self.phases.append(Phase(fault, applied_s, healed_s, healed_s, killed_s, started_s))
        self.load.add(probe.result() for probe in probes)
        settle_s = self._settle(healed_s)
        back_s: float | None = None
        with contextlib.suppress(AssertionError):
            back_s = self.cluster.wait_for_gpus(set(self.cluster.nodes), timeout_s=config.settle_max_s)
        # After the heal one scheduler leads and the others stand by (a deposed leader does not
        # come back as a second one).
        roles = self.cluster.scheduler_roles() if self.election else {}
        return {
            "fault": fault.name,
            "hosts": list(fault.hosts),
            "settled_s": settle_s,
            "gpus_back_s": back_s,
            "scheduler_roles_after_heal": roles,
        }

    def _struck_node(self) -> str:
        """The node a node fault strikes: the one running the most probes now (the scheduler's
        view), so that calls are in flight there; else the one that served the most lately."""
        probe_prefix = f"chaos-{self.tag}-"
        running: dict[str, int] = {}
        with contextlib.suppress(httpx.HTTPError):
            for node in self.cluster.nodes:
                ids = self.cluster.running_on(node)
                running[node] = sum(c.startswith(probe_prefix) and int(c.split("-")[2]) >= PROBE_CLIENT for c in ids)
        busiest = busiest_node(self.load.snapshot(), time.monotonic() - BUSIEST_WINDOW_S, self.cluster.nodes)
        most = max(running.values(), default=0)
        return busiest if most == 0 or running.get(busiest) == most else max(running, key=running.__getitem__)

    def _send_probes(self, fault_index: int) -> list[Future[CallRecord]]:
        """`probes` calls of `probe_sleep_s`, as clients of their own (numbered from 1000)."""
        config = self.config
        return [
            self._probes.submit(self.call, PROBE_CLIENT + fault_index * config.probes + i, 0, config.probe_sleep_s)
            for i in range(config.probes)
        ]

    def _settle(self, healed_s: float) -> float | None:
        config = self.config
        while time.monotonic() - healed_s < config.settle_max_s:
            if settled(
                self.load.snapshot(),
                healed_s,
                time.monotonic(),
                min_s=config.settle_min_s,
                last=config.settle_calls,
                slow_s=config.slow_s,
            ):
                return time.monotonic() - healed_s
            time.sleep(0.2)
        return None

    # --- the whole run ----------------------------------------------------------------------------
    def run(self, faults: Sequence[Fault]) -> dict[str, Any]:
        """Prepare, a baseline, each fault in turn; the tallies (calls, executions, recovery)."""
        self.prepare()
        time.sleep(self.config.baseline_s)
        started_s = time.monotonic()
        seen = [self.run_fault(fault) for fault in faults]
        records = self.load.stop()
        self._probes.shutdown()
        for http in self._clients.values():
            http.close()
        ended = [p.started_s for p in self.phases[1:]] + [records_end(records)]
        phases = [dataclasses.replace(p, ended_s=end) for p, end in zip(self.phases, ended, strict=True)]
        runs: Counter[str] = Counter()
        runs_by_node = {node: runs_in_log(self.cluster.log_text(node)) for node in self.cluster.nodes}
        for node_runs in runs_by_node.values():
            runs.update(node_runs)
        tallies = [
            tally(
                records,
                phase,
                runs,
                self.config.slow_s,
                runs_on_killed=runs_by_node.get(phase.fault.hosts[0]) if phase.killed_s is not None else None,
            )
            for phase in phases
        ]
        baseline = [r for r in records if r.done_s < started_s]
        return {
            "faults": [dataclasses.asdict(t) | s for t, s in zip(tallies, seen, strict=True)],
            "baseline": {
                "calls": len(baseline),
                "ok": sum(r.status == OK for r in baseline),
                "median_s": statistics.median([r.done_s - r.sent_s for r in baseline]) if baseline else None,
            },
            "calls": len(records),
            "executions": sum(runs.values()),
            "run_twice_ids": sorted(call for call, count in runs.items() if count > 1),
            "notes": self.notes,
        }


def records_end(records: Sequence[CallRecord]) -> float:
    return max((r.done_s for r in records), default=time.monotonic()) + 1e-6


def main(argv: Sequence[str] | None = None) -> int:
    from bench.machine import results_parser, run_metadata, write_results
    from gpufaas.dev.host_cluster import HostCluster, haproxy_available, host_names
    from gpufaas.netns import Hosts

    parser = results_parser(__doc__, "partition_chaos.json")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--schedulers", type=int, default=None, help="default: 2 with leader election, else 1")
    parser.add_argument(
        "--balancer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="HAProxy (gpufaas.dev.balancer) before the gateways (default: where haproxy is installed; without "
        "it the clients spread their calls over the gateways)",
    )
    parser.add_argument("--hold-s", type=float, default=ChaosConfig.hold_s)
    parser.add_argument("--state-dir", type=Path, default=None, help="keep the cluster's state and logs here")
    parser.add_argument("--call-sleep-s", type=float, default=ChaosConfig.call_sleep_s, help="each call's work")
    args = parser.parse_args(argv)
    balancer = haproxy_available() if args.balancer is None else args.balancer
    schedulers = args.schedulers or 2
    nodes = [f"node{i}" for i in range(args.nodes)]
    config = ChaosConfig(hold_s=args.hold_s, call_sleep_s=args.call_sleep_s)
    with tempfile.TemporaryDirectory(prefix="partition-chaos-") as temporary:
        state = args.state_dir or Path(temporary)
        state.mkdir(parents=True, exist_ok=True)
        hosts = Hosts(host_names(nodes, schedulers, args.gateways, balancer=balancer))
        cluster = HostCluster.of_shape(hosts, state, nodes, balancer=balancer)
        try:
            document = run_chaos(cluster, config, election=schedulers > 1)
        finally:
            cluster.close()
    document = run_metadata(**document)
    write_results(args.out, document, summary_lines(document))
    if args.json:
        print(json.dumps(document, indent=2))
    return 0


def run_chaos(cluster: HostCluster, config: ChaosConfig, *, election: bool) -> dict[str, Any]:
    """Start `cluster`, run every fault of the schedule on it under load; the results document."""
    started = time.monotonic()
    cluster.start()
    up_s = time.monotonic() - started
    run = ChaosRun(cluster, config, election=election)
    faults = fault_schedule(cluster.gateways, election=election, delay_ms=config.delay_ms)
    results = run.run(faults)
    shape = {
        "nodes": cluster.nodes,
        "schedulers": cluster.schedulers,
        "gateways": cluster.gateways,
        "balancer": cluster.balancer,
        "election": election,
        "tls": "wire and blob links TLS 1.3 (SECRETS/tls); etcd over TLS" if cluster.etcd_tls else "links TLS",
        "clients_spread_over": "the balancer" if cluster.balancer else "the gateways, in turn (no balancer)",
    }
    return {"cluster": shape, "cluster_up_s": round(up_s, 1), "config": dataclasses.asdict(config), **results}


def _figure(value: float | None) -> str:
    return "not recovered" if value is None else f"{value:.1f} s"


def summary_lines(document: Mapping[str, Any]) -> Iterable[str]:
    for fault in document["faults"]:
        yield (
            f"{fault['fault']}: {fault['ok']}/{fault['calls']} ok, failed {fault['failed_by_status']} "
            f"({fault.get('failed_outcome_unknown', 0)} outcome unknown), run twice {fault['run_twice']} "
            f"({fault['run_twice_in_flight_on_kill']} first run on a killed host), lost {fault['lost']} "
            f"({fault['lost_in_flight_on_kill']} in flight on a killed host); recovery after the fault "
            f"{_figure(fault['recovery_after_fault_s'])}, after the heal "
            f"{_figure(fault['recovery_after_heal_s'])}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
