"""Benchmark: the scheduler's placement throughput, one real scheduler process at saturation.

It starts etcd and ONE `python -m scheduler` with the argv gpufaas.dev.local_cluster gives it
(`LocalCluster.scheduler_settings`, insecure: no wire handshake, no TLS, no etcd password; the
handshake costs one exchange per connection, never per call), registers synthetic nodes (default
50 x 20 = 1,000 GPUs of 8192 MB) and runs closed-loop synthetic gateways (`--concurrency` calls
outstanding each), all in client processes (bench.placement_peers: what those peers send and
answer, and in which order). Every call is a real call to the scheduler: Place, the policy's
decision, a signed grant in a Placement, the node's ledger admitting the token, the node's Done, the
slot freed; only the node's work (loading, running) is not done (answered at once). After a
warm-up, it counts for `--seconds` the Placements the gateways receive, the time from each Place
sent to its Placement received (p50, p99), and the scheduler process's CPU seconds (utime + stime
from /proc/PID/stat) per placement. Then it checks that the scheduler accounted every call: its Done
counter equals the Dones the nodes sent, and every GPU slot is free again (a ClusterRequest, as
`gpufaas top` asks).

The load generator shares the host's cores with the scheduler. A gateway sends a node an Execute
on the wire, as gateway/router.py does; with `--execute direct` it hands a node of its own client
process the call's token in the process instead (the scheduler sees the same Place, Placement and
Done either way), which saves the client about a fifth of its CPU: an open loop at a high rate
needs it on a small host. The clients' garbage collector is off while the calls run.

A closed loop's latency at saturation is set by the loop: Place -> Placement is about the calls
outstanding over the throughput (Little's law), so `--concurrency` moves it. `--rate R` adds a
second phase (same cluster, warm) in which calls arrive as a Poisson process of R per second however
many are outstanding, as a cluster's users send them: its figures are under `offered_load`, with
how late the client released its calls after their arrival times (`p99_release_lag_ms`: its own
loop's lag, which each Placement's arrival waits out too; a call is timed from its release), and
the calls of the window the scheduler refused (`rejected_per_s`: an overloaded one sheds Places).

The mix: the functions of the shipped Azure Functions 2019 extract (simulator/traces, the one
`gpufaas sim` replays), the `--functions` most invoked, each call's function drawn with weight its
invocations over the extract's 8 hours (`--mix trace`); or Zipf weights (`--mix zipf`). Each
function gets its own model with a Table I model's size (simulator.workload.assign_models, 1.3-3.9
GB), so every model fits a GPU and, after the warm-up, most calls are hits; the miss share is
reported.

With `--profile FILE` the scheduler runs under cProfile (on its CPU time) for the measured window
only (bench.profiled_main) and the JSON gains the top of the profile; its throughput is then the
profiled one (cProfile makes each placement about 6 times dearer). `--profile-attach FILE` profiles
instead from the scheduler's start until every node attached. The JSON also has the scheduler's
event-loop lag (its /healthz) during the attaches and in the window, and its log's count of terms
and step-downs: at the local cluster's 1 s leader lease a scheduler of 1,000 GPUs on a 2-core host
loses its lease while it attaches the nodes, again and again (docs/scheduler-throughput.md);
`--scheduler-flags "--lease-ttl-s 30"` measures the placements beyond that.

Run: `python -m bench.placement_bench [--gpus 1000] [--seconds 10] [--concurrency 16] [--rate R]
[--execute direct|wire] [--json] [--out FILE] [--profile FILE | --profile-attach FILE]
[--scheduler-flags FLAGS]`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import pstats
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from bench.machine import REPO, run_metadata
from gpufaas.dev.etcd_server import EtcdServer
from gpufaas.dev.local_cluster import Component, LocalCluster
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.profiles import paper_table1
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import EtcdStore
from gpufaas.wire import ConnectionLost, MessageType, RemoteError, connect
from simulator.engine import percentile
from simulator.report import shipped_trace
from simulator.workload import assign_models, load_trace

ROOT = "/gpufaas"
READY_TIMEOUT_S = 90.0  # etcd, the scheduler's election and 50 attaches
ACCOUNTING_TIMEOUT_S = 10.0
PROFILE_TOP = 25
LAG_SAMPLE_S = 1.0  # how often the window samples the scheduler's loop lag


@dataclass(frozen=True)
class Mix:
    """The functions and how often each is called."""

    source: str
    functions: list[FunctionSpec]
    weights: list[float]


def trace_mix(count: int) -> Mix:
    """The `count` functions invoked most in the shipped Azure 2019 extract, weighted by their
    invocations over its 8 hours."""
    trace = load_trace(shipped_trace(), "azure2019")
    totals = {function: sum(minutes.values()) for function, minutes in trace.counts.items()}
    ranked = sorted((f for f in totals if totals[f] > 0), key=lambda f: (-totals[f], f))[:count]
    return Mix(
        f"azure2019 extract ({shipped_trace().parent.name}): the {len(ranked)} most invoked functions",
        _specs(ranked),
        [float(totals[f]) for f in ranked],
    )


def zipf_mix(count: int, exponent: float) -> Mix:
    ids = [f"zipf{rank}" for rank in range(count)]
    return Mix(
        f"zipf {exponent:g} over {count} functions", _specs(ids), [1.0 / r**exponent for r in range(1, count + 1)]
    )


def _specs(function_ids: list[str]) -> list[FunctionSpec]:
    """One function per id (fn000, fn001, ... in popularity order), each its own model sized as a
    Table I model (assign_models: sizes spread evenly, from both ends of the popularity order)."""
    profiles = assign_models(function_ids, paper_table1())
    specs = []
    for rank, profile in enumerate(profiles):
        name = f"fn{rank:03d}"
        digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
        specs.append(FunctionSpec(name=name, package_digest=digest, memory_mb=profile.memory_mb, public=True))
    return specs


@dataclass
class Layout:
    """How many of what, and where."""

    nodes: int
    gpus_per_node: int
    gpu_memory_mb: int
    gateways: int
    concurrency: int  # outstanding calls per gateway
    clients: int  # client processes
    execute: Literal["wire", "direct"]  # "direct": a gateway hands its own process's nodes their calls

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _put_functions(endpoint: str, functions: list[FunctionSpec]) -> None:
    store = await EtcdStore.open(endpoint)
    try:
        for spec in functions:
            await store.put(Keys(ROOT).function(spec.name), spec.to_json())
    finally:
        await store.close()


async def _cluster(address: str) -> pb.ClusterReply:
    """The scheduler's ClusterReply, asked as a gateway asks it (ConnectionLost: not leading yet)."""
    conn = await connect(address, None, timeout_s=2.0)
    try:
        frame = await conn.request(MessageType.CLUSTER, pb.ClusterRequest(), timeout_s=10.0)
        return frame.message(pb.ClusterReply)
    finally:
        conn.close()


def _cluster_when_leading(address: str, timeout_s: float = ACCOUNTING_TIMEOUT_S) -> pb.ClusterReply:
    """The ClusterReply, asked again while the scheduler stands by (a step-down closes the link)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return asyncio.run(_cluster(address))
        except (ConnectionLost, RemoteError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_ready(address: str, gpus: int, scheduler: Component) -> None:
    """Until the scheduler leads and has every node's GPUs."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = 0
    while time.monotonic() < deadline:
        if not scheduler.alive():
            raise RuntimeError(f"the scheduler exited; its log ends:\n{scheduler.tail()}")
        try:
            seen = len(asyncio.run(_cluster(address)).gpus)
        except (ConnectionLost, RemoteError, TimeoutError):
            seen = 0
        if seen == gpus:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the scheduler had {seen} of {gpus} GPUs after {READY_TIMEOUT_S:g} s")


class Client:
    """One client process (bench.placement_peers): some nodes, some gateways."""

    def __init__(self, config: dict[str, Any], directory: Path, index: int) -> None:
        path = directory / f"client{index}.json"
        path.write_text(json.dumps(config))
        self.log_path = directory / f"client{index}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.placement_peers", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO,
        )

    def expect(self, event: str) -> dict[str, Any]:
        """The next line it prints, which must be `event`."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"client exited before {event!r}; its log ends:\n{tail}")
        message: dict[str, Any] = json.loads(line)
        if message.get("event") != event:
            raise RuntimeError(f"client said {message!r}, expected {event!r}")
        return message

    def tell(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        """Close its stdin (it deregisters its nodes and exits); kill it if it lingers."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def client_configs(layout: Layout, mix: Mix, endpoint: str, scheduler: str, seed: int) -> list[dict[str, Any]]:
    """Nodes and gateways dealt round robin to the client processes."""
    nodes = [f"node{index}" for index in range(layout.nodes)]
    gateways = [f"gw{index}" for index in range(layout.gateways)]
    return [
        {
            "etcd": endpoint,
            "root": ROOT,
            "scheduler": scheduler,
            "nodes": nodes[index :: layout.clients],
            "gateways": gateways[index :: layout.clients],
            "gpus_per_node": layout.gpus_per_node,
            "gpu_memory_mb": layout.gpu_memory_mb,
            "concurrency": layout.concurrency,
            "execute": layout.execute,
            "functions": [spec.model_dump(mode="json") for spec in mix.functions],
            "weights": mix.weights,
            "seed": seed + 1000 * index,
        }
        for index in range(layout.clients)
    ]


@contextmanager
def started_clients(configs: list[dict[str, Any]], directory: Path) -> Iterator[list[Client]]:
    clients: list[Client] = []
    try:
        for index, config in enumerate(configs):
            clients.append(Client(config, directory, index))
        for client in clients:
            client.expect("registered")
        yield clients
    finally:
        for client in clients:
            client.stop()


def scheduler_component(
    cluster: LocalCluster, profile: Path | None, directory: Path, *, from_start: bool = False
) -> Component:
    """`python -m scheduler` with the local cluster's argv (under bench.profiled_main with `profile`,
    profiling `from_start` or from its SIGUSR1)."""
    argv = cluster.scheduler_settings().to_argv()
    start = ["--from-start"] if from_start else []
    wrapper = [] if profile is None else ["-m", "bench.profiled_main", str(profile.resolve()), *start]
    module = ["scheduler"] if profile is not None else ["-m", "scheduler"]
    return Component("scheduler", [sys.executable, *wrapper, *module, *argv], directory / "scheduler.log")


def uncommitted_paths() -> list[str]:
    """Files of the code under test that differ from the commit (a shared checkout being edited)."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--", "scheduler", "cache_manager", "gpufaas"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    return [line[3:] for line in done.stdout.splitlines() if not line.startswith("??")]


def _sleep_until(monotonic_s: float) -> None:
    time.sleep(max(0.0, monotonic_s - time.monotonic()))


def loop_lag(metrics_address: str) -> dict[str, float]:
    """The scheduler's event-loop lag as its /healthz reports it: the latest reading and the worst
    of the last minute (gpufaas.liveness), in seconds; empty if it did not answer."""
    try:
        health = httpx.get(f"http://{metrics_address}/healthz", timeout=10.0).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {key: float(health[key]) for key in ("loop_lag_s", "loop_lag_max_s") if key in health}


def _sample_lag_until(metrics_address: str, until_s: float) -> float:
    """Until `until_s`: the worst of the scheduler's latest loop-lag readings, asked once a second."""
    worst_s = 0.0
    while time.monotonic() < until_s - LAG_SAMPLE_S:
        time.sleep(LAG_SAMPLE_S)
        worst_s = max(worst_s, loop_lag(metrics_address).get("loop_lag_s", 0.0))
    _sleep_until(until_s)
    return worst_s


def measure(
    clients: list[Client],
    pids: dict[str, int],
    window_s: tuple[float, float],
    metrics_address: str,
    profile: bool,
    *,
    calls_per_s_per_gateway: float | None = None,
) -> dict[str, Any]:
    """Start the gateways (closed-loop, or open-loop at `calls_per_s_per_gateway` each), warm up,
    measure; the clients' stats, each process's CPU seconds in the window (`pids`: name -> PID,
    "scheduler" among them) and the scheduler's loop lag sampled in it. `window_s`: (warm-up,
    measured) seconds."""
    warmup_s, seconds = window_s
    start_s = time.monotonic() + 0.3
    window = {"start_s": start_s, "open_s": start_s + warmup_s, "close_s": start_s + warmup_s + seconds}
    for client in clients:
        client.tell({"go": {**window, "calls_per_s_per_gateway": calls_per_s_per_gateway}})
    _sleep_until(window["open_s"])
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    if profile:
        os.kill(pids["scheduler"], signal.SIGUSR1)
    worst_lag_s = _sample_lag_until(metrics_address, window["close_s"])
    after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    if profile:
        os.kill(pids["scheduler"], signal.SIGUSR2)
    return {
        "stats": [client.expect("stats") for client in clients],
        "cpu_s": {name: round(after[name] - before[name], 3) for name in pids},
        "window_loop_lag_max_s": worst_lag_s,
    }


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def accounting(metrics_address: str, scheduler_address: str, dones_sent: int, placements: int) -> dict[str, Any]:
    """What the scheduler says it accounted, once the nodes' last Dones reached it: its Done and
    placement counters, the calls still running on its GPUs and waiting in its queue. A scheduler
    that does not answer (overloaded) is a result too: not accounted, and why."""
    try:
        return _accounting(metrics_address, scheduler_address, dones_sent, placements)
    except (httpx.HTTPError, ConnectionLost, RemoteError, TimeoutError) as exc:
        return {"every_done_accounted": False, "unanswered": repr(exc)[:300]}


def _accounting(metrics_address: str, scheduler_address: str, dones_sent: int, placements: int) -> dict[str, Any]:
    deadline = time.monotonic() + ACCOUNTING_TIMEOUT_S
    while True:
        text = httpx.get(f"http://{metrics_address}/metrics", timeout=10.0).text
        dones = _metric(text, "gpufaas_scheduler_calls_total")
        if dones >= dones_sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    reply = _cluster_when_leading(scheduler_address)
    running = sum(len(gpu.running) for gpu in reply.gpus)
    result = {
        "dones_sent_by_nodes": dones_sent,
        "dones_accounted_by_scheduler": int(dones),
        "placements_received_by_gateways": placements,
        "placements_sent_by_scheduler": int(_metric(text, "gpufaas_scheduler_placements_total")),
        "calls_running_after": running,
        "calls_queued_after": len(reply.queue),
    }
    result["every_done_accounted"] = (
        result["dones_accounted_by_scheduler"] == dones_sent
        and result["placements_sent_by_scheduler"] == placements
        and running == 0
        and not reply.queue
    )
    return result


def accounting_failure(accounting: dict[str, Any]) -> str | None:
    """What `accounting`'s check found wrong, in one line; None where every call was accounted."""
    if accounting["every_done_accounted"]:
        return None
    if "unanswered" in accounting:
        return f"the accounting check failed: the scheduler did not answer ({accounting['unanswered']})"
    counts = ", ".join(f"{name} {value}" for name, value in accounting.items() if name != "every_done_accounted")
    return f"the accounting check failed: {counts}"


def profile_top(path: Path, placements: int, count: int = PROFILE_TOP) -> list[dict[str, Any]]:
    """The functions with the most own time in the profile, per placement (microseconds)."""
    stats = pstats.Stats(str(path))
    rows = []
    for (filename, line, function), (_, calls, own_s, cumulative_s, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = Path(filename)
        with_repo = where.relative_to(REPO) if where.is_relative_to(REPO) else Path(*where.parts[-2:])
        rows.append(
            {
                "function": f"{with_repo}:{line}({function})" if line else function,
                "calls_per_placement": round(calls / placements, 2),
                "own_us_per_placement": round(own_s / placements * 1e6, 2),
                "cumulative_us_per_placement": round(cumulative_s / placements * 1e6, 2),
            }
        )
    rows.sort(key=lambda row: -row["own_us_per_placement"])
    return rows[:count]


def leadership_events(log_path: Path) -> dict[str, int]:
    """How often the scheduler lost its certainty of leading, or stepped down (its log says)."""
    text = log_path.read_text(errors="replace")
    return {
        "terms": text.count("leads (epoch"),
        "unsure": text.count("unsure of the leadership"),
        "step_downs": text.count("stepping down as the scheduler leader"),
    }


def summarize(measured: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The figures, from every client's stats and the CPU seconds of the window."""
    gateways = [s["gateways"] for s in measured["stats"]]
    nodes = [s["nodes"] for s in measured["stats"]]
    place_us = sorted(us for g in gateways for us in g["place_us"])
    release_lag_us = sorted(us for g in gateways for us in g["release_lag_us"])
    call_us = sorted(us for g in gateways for us in g["call_us"])
    placements = sum(g["placements"] for g in gateways)
    errors: dict[str, int] = {}
    for g in gateways:
        for kind, count in g["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    node_counts = {key: sum(n[key] for n in nodes) for key in nodes[0]}
    scheduler_cpu_s = measured["cpu_s"]["scheduler"]

    def ms(samples: list[int], q: float) -> float | None:
        return round(percentile(samples, q) / 1000, 3) if samples else None

    return {
        "placements_per_s": round(placements / seconds, 1),
        # Calls sent in the window and answered with a Rejection (errors counts the warm-up's too).
        "rejected_per_s": round(sum(g["rejected"] for g in gateways) / seconds, 1),
        "p50_place_ms": ms(place_us, 50),
        "p99_place_ms": ms(place_us, 99),
        "p50_call_ms": ms(call_us, 50),
        "p99_call_ms": ms(call_us, 99),
        "cpu_us_per_placement": round(scheduler_cpu_s / placements * 1e6, 1) if placements else None,
        "scheduler_cpu_share": round(scheduler_cpu_s / seconds, 3),
        "placements": placements,
        "miss_share": round(sum(g["misses"] for g in gateways) / placements, 4) if placements else None,
        "errors": errors,
        "error_count": sum(errors.values()) + node_counts["refused"],
        "cpu_s": measured["cpu_s"],
        "nodes_saw": node_counts,
        "calls_completed": sum(g["completed"] for g in gateways),
        "hit_mismatches": sum(g["hit_mismatches"] for g in gateways),
        "placements_total": sum(g["placements_total"] for g in gateways),
        "p99_release_lag_ms": ms(release_lag_us, 99),
    }


def with_offered_load(saturated: dict[str, Any], offered: dict[str, Any], rate_per_s: float) -> dict[str, Any]:
    """The run's figures: the closed loop's, the open loop's (offered `rate_per_s`) in full under
    `offered_load`, and the counts the accounting checks summed over both."""
    figures = dict(saturated)
    # The nodes count across the phases: the open loop's own are the difference.
    across = offered["nodes_saw"]
    own = {key: across[key] - saturated["nodes_saw"][key] for key in across}
    figures["offered_load"] = {
        "offered_per_s": rate_per_s,
        **offered,
        "nodes_saw": own,
        "error_count": sum(offered["errors"].values()) + own["refused"],
    }
    figures["nodes_saw"] = across
    errors = Counter(saturated["errors"])
    errors.update(offered["errors"])
    figures["errors"] = dict(errors)
    figures["error_count"] = sum(errors.values()) + across["refused"]
    for key in ("calls_completed", "hit_mismatches", "placements_total"):
        figures[key] = saturated[key] + offered[key]
    return figures


def phases(
    args: argparse.Namespace, layout: Layout, clients: list[Client], pids: dict[str, int], metrics_address: str
) -> dict[str, Any]:
    """The closed loop's window, then (`--rate`) the open loop's: their figures."""
    window_s = (args.warmup, args.seconds)
    measured = measure(clients, pids, window_s, metrics_address, args.profile is not None)
    figures = summarize(measured, args.seconds)
    figures["loop_lag_max_s"] = {"window": measured["window_loop_lag_max_s"]}
    if args.rate > 0:
        offered = measure(
            clients, pids, window_s, metrics_address, False, calls_per_s_per_gateway=args.rate / layout.gateways
        )
        figures = with_offered_load(figures, summarize(offered, args.seconds), args.rate)
        figures["loop_lag_max_s"]["offered_window"] = offered["window_loop_lag_max_s"]
    return figures


def run(args: argparse.Namespace, mix: Mix, layout: Layout, directory: Path) -> dict[str, Any]:
    """Start everything in `directory`, measure, check the accounting, stop everything."""
    etcd = EtcdServer(extra_args=("--election-timeout=500",))  # as LocalCluster starts its own
    etcd.start(directory / "etcd")
    try:
        asyncio.run(_put_functions(etcd.endpoint, mix.functions))
        cluster = LocalCluster(
            state_dir=directory,
            nodes=0,
            gpu_memory_mb=layout.gpu_memory_mb,
            policy=args.policy,
            slots=str(args.slots),
            etcd_endpoint=etcd.endpoint,
            secure=False,
            watchdog=None,
            scheduler_flags=shlex.split(args.scheduler_flags),
        )
        profile = args.profile or args.profile_attach
        scheduler = scheduler_component(cluster, profile, directory, from_start=args.profile_attach is not None)
        configs = client_configs(layout, mix, etcd.endpoint, cluster.scheduler_address, args.seed)
        with started_clients(configs, directory) as clients:
            scheduler.start({**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                started_s = time.monotonic()
                assert scheduler.pid is not None
                wait_ready(cluster.scheduler_address, layout.gpus, scheduler)
                ready_s = time.monotonic() - started_s
                if args.profile_attach is not None:
                    os.kill(scheduler.pid, signal.SIGUSR2)  # the attaches profiled, not the calls
                pids = {"scheduler": scheduler.pid, "etcd": etcd.pid}
                pids |= {f"client{i}": c.process.pid for i, c in enumerate(clients)}
                metrics_address = cluster.metrics_addresses["scheduler"]
                # The worst of the last minute: its start-up and the attaches.
                attach_lag_s = loop_lag(metrics_address).get("loop_lag_max_s")
                figures = phases(args, layout, clients, pids, metrics_address)
                figures["ready_s"] = round(ready_s, 2)  # scheduler started -> leading with every GPU attached
                figures["loop_lag_max_s"]["attach"] = attach_lag_s
                figures["accounting"] = accounting(
                    cluster.metrics_addresses["scheduler"],
                    cluster.scheduler_address,
                    figures["nodes_saw"]["dones"],
                    figures["placements_total"],
                )
            finally:
                scheduler.stop()
        figures["scheduler_argv"] = scheduler.argv[1:]
        figures["scheduler_log"] = leadership_events(scheduler.log_path)
        return figures
    finally:
        etcd.stop()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1000, help="GPUs in all (a multiple of --gpus-per-node)")
    parser.add_argument("--gpus-per-node", type=int, default=20)
    parser.add_argument("--gpu-memory-mb", type=int, default=8192, help="each GPU's (the local cluster's default)")
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16, help="outstanding calls per gateway (closed loop)")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="then a second phase: calls offered at this rate (per second, Poisson) in an open loop",
    )
    parser.add_argument(
        "--execute",
        choices=("wire", "direct"),
        default="wire",
        help="how a gateway hands a node of its own client process its call (the scheduler sees neither)",
    )
    parser.add_argument("--clients", type=int, default=1, help="client processes hosting the nodes and gateways")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of calls before the window")
    parser.add_argument("--functions", type=int, default=200)
    parser.add_argument("--mix", choices=("trace", "zipf"), default="trace")
    parser.add_argument("--zipf", type=float, default=1.0, help="the exponent of --mix zipf")
    parser.add_argument("--policy", default="lalb-o3")
    parser.add_argument("--slots", type=int, default=4, help="concurrent calls per GPU (scheduler --slots)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--scheduler-flags", default="", help="more scheduler flags, over the local cluster's (e.g. '--lease-ttl-s 3')"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object, nothing else")
    parser.add_argument("--out", type=Path, help="write the same JSON there too")
    parser.add_argument("--profile", type=Path, help="profile the scheduler in the window (cProfile) into this file")
    parser.add_argument(
        "--profile-attach", type=Path, help="profile the scheduler from its start until every node attached"
    )
    parser.add_argument("--state-dir", type=Path, help="keep etcd's data and the logs there (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.profile and args.profile_attach:
        parser.error("--profile and --profile-attach profile different phases: give one")
    if args.gpus % args.gpus_per_node:
        parser.error(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mix = trace_mix(args.functions) if args.mix == "trace" else zipf_mix(args.functions, args.zipf)
    layout = Layout(
        args.gpus // args.gpus_per_node,
        args.gpus_per_node,
        args.gpu_memory_mb,
        args.gateways,
        args.concurrency,
        args.clients,
        args.execute,
    )
    with tempfile.TemporaryDirectory(prefix="placement-bench-") as temporary:
        directory = args.state_dir or Path(temporary)
        directory.mkdir(parents=True, exist_ok=True)
        figures = run(args, mix, layout, directory)
    if args.profile is not None and figures["placements"]:
        figures["profile_top"] = profile_top(args.profile, figures["placements"])
    result = run_metadata(
        benchmark="placement_bench",
        **figures,
        gpus=layout.gpus,
        nodes=layout.nodes,
        gpus_per_node=layout.gpus_per_node,
        gpu_memory_mb=layout.gpu_memory_mb,
        gateways=layout.gateways,
        concurrency_per_gateway=layout.concurrency,
        outstanding_calls=layout.gateways * layout.concurrency,
        client_processes=layout.clients,
        execute=layout.execute,
        seconds=args.seconds,
        warmup_s=args.warmup,
        policy=args.policy,
        slots=args.slots,
        mix=mix.source,
        functions=len(mix.functions),
        security="insecure (no wire handshake, no TLS, no etcd auth)",
        profiled=args.profile is not None,
        uncommitted_paths=uncommitted_paths(),
    )
    document = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(document + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(document)
    failure = accounting_failure(figures["accounting"])
    if failure is not None:  # recorded in the JSON, and said where a script running the benchmark sees it
        print(f"placement_bench: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
