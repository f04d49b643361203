"""Benchmark: the CPU each process of the serving path spends per call (gateway, scheduler, node, workers).

`gpufaas up` runs the scheduler and the node in the gateway's process by default: their CPU is then
the gateway's ("scheduler" and "node" are 0); `--scheduler-apart` and `--node-apart` give them
processes of their own, measured apart.

The workload is bench/peer_bench.py's (8 tiny torch models of the pytorch-custom template, Zipf
1.1, `gpufaas up` with 1 node and 2 cpu GPUs, calls with the invoke token, the same closed-loop
client), with GPUs large enough that all 8 models stay resident: every measured call is a hit, the
path this measures (`--gpu-memory-mb 300` gives peer_bench's GPUs instead, whose misses count too).
Per round, after a warm-up that loads every model: each process's utime + stime (/proc/PID/stat)
is read, the client makes exactly `--calls` calls at `--concurrency`, and
the CPU read again; the difference over the calls is that process's CPU per call. "workers" is
every process below the node (its zygote, spares and model workers); "client" is the load
client's own CPU, as it reports it. Rounds are reported one by one and by their median.

With `--profile`, a last round runs with the gateway, the scheduler and the node under cProfile (process CPU
time, between the signals bench/profiled_main.py uses; not counted in the CPU figures), and their
top functions go into the results as `profile`. (py-spy was tried first: sampling uvloop's
processes without stopping them, it charged most samples to the event loop's frame.)

Run: `python -m bench.hop_cpu [--calls 3000] [--rounds 3] [--concurrency 8] [--no-tls] [--profile]
[--scheduler-apart] [--node-apart]
[--out bench/results/hop_cpu.json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import REPO, run_metadata, write_results
from bench.peer_bench import NUM_MODELS, ZIPF, RunningCluster, gpufaas_cluster, load
from gpufaas.dev.local_cluster import node_pid, recorded_pids
from gpufaas.processes import descendants

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROCESSES = ("gateway", "scheduler", "node", "workers", "etcd")
TOP_FUNCTIONS = 25


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` in seconds (0 for a process gone meanwhile)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # fields 14 and 15 of stat(5)


def cluster_pids(state_dir: Path) -> dict[str, list[int]]:
    """The serving path's processes of a `gpufaas up` cluster by role (workers: the node's
    descendants; the scheduler or the node none where they run in the gateway's process)."""
    pids = recorded_pids(state_dir)
    node = node_pid(pids)
    return {
        "gateway": [pids["gateway"]],
        "scheduler": [pids["scheduler"]] if "scheduler" in pids else [],
        "node": [pids["node0"]] if "node0" in pids else [],
        "workers": descendants(node),
        "etcd": [pids["etcd"]] if "etcd" in pids else [],
    }


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_s(pid) for pid in role_pids) for role, role_pids in pids.items()}


def client(cluster: RunningCluster, body: Path, *, calls: int, concurrency: int, warmup_s: float) -> dict[str, Any]:
    """One run of bench/peer's closed-loop client (peer_bench's `load`, peer_bench's workload):
    exactly `calls` calls after `warmup_s`, each posting `body` with the invoke token."""
    extra = ["-n", str(calls), "--body-file", str(body), "--count-header", "X-Cache"]
    extra += ["-H", f"Authorization: Bearer {cluster.invoke_token}"]
    timing = argparse.Namespace(duration=0, warmup=warmup_s)  # (-n overrides the duration)
    return load(f"{cluster.url}/function/{{model}}", concurrency, timing, *extra)


def measured_round(cluster: RunningCluster, body: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round: the CPU per call of each role over exactly `args.calls` calls."""
    pids = cluster_pids(cluster.state_dir)
    before = cpu_by_role(pids)
    point = client(cluster, body, calls=args.calls, concurrency=args.concurrency, warmup_s=0)
    after = cpu_by_role(pids)
    calls = point["requests"]
    us_per_call = {role: round((after[role] - before[role]) / calls * 1e6, 1) for role in pids}
    us_per_call["client"] = round(point["client_cpu_pct"] / 100 * point["duration_s"] / calls * 1e6, 1)
    misses = point.get("header_counts", {}).get("X-Cache", {}).get("miss", 0)
    return {
        "calls": calls,
        "errors": point["errors"],
        "misses": misses,
        "throughput_rps": point["throughput_rps"],
        "p50_ms": point["p50_ms"],
        "p99_ms": point["p99_ms"],
        "host_cpu_busy_pct": point["host_cpu_busy_pct"],
        "cpu_us_per_call": us_per_call,
    }


# Installed with --profile as every cluster process's sitecustomize: cProfile on process CPU time
# between SIGUSR1 and SIGUSR2 (bench/profiled_main.py's signals), written to PROFILES/PID.prof.
PROFILER = """
import cProfile, os, signal, time
_profile = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda signum, frame: _profile.enable())
def _stop(signum, frame):
    _profile.disable()
    path = os.path.join({directory!r}, f"{{os.getpid()}}.prof")
    _profile.dump_stats(path + ".part")
    os.replace(path + ".part", path)  # whole, or not there yet
signal.signal(signal.SIGUSR2, _stop)
"""


def install_profiler(work: Path) -> Path:
    """Make the processes started from now on (the cluster's daemons) profilable: a sitecustomize
    on PYTHONPATH (see PROFILER). Returns where their profiles go."""
    site, profiles = work / "profiler", work / "profiles"
    site.mkdir()
    profiles.mkdir()
    (site / "sitecustomize.py").write_text(PROFILER.format(directory=str(profiles)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return profiles


def profile_round(cluster: RunningCluster, body: Path, args: argparse.Namespace, profiles: Path) -> dict[str, Any]:
    """One more round with the gateway, the scheduler and the node under cProfile (not counted in the CPU
    figures): each one's top functions, by own time and with callees, in us of CPU per call
    (cProfile's own cost included: compare them with each other, not with the measured rounds)."""
    pids = recorded_pids(cluster.state_dir)
    roles = {
        role: pids[name]
        for role, name in (("gateway", "gateway"), ("scheduler", "scheduler"), ("node", "node0"))
        if name in pids
    }
    for pid in roles.values():
        os.kill(pid, signal.SIGUSR1)
    point = client(cluster, body, calls=args.calls, concurrency=args.concurrency, warmup_s=0)
    for pid in roles.values():
        os.kill(pid, signal.SIGUSR2)
    report: dict[str, Any] = {"calls": point["requests"]}
    for role, pid in roles.items():
        path = profiles / f"{pid}.prof"
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        report[role] = top_functions(pstats.Stats(str(path)), point["requests"])
    return report


def top_functions(stats: pstats.Stats, calls: int) -> dict[str, Any]:
    """The TOP_FUNCTIONS functions of `stats` with the most own time and the most time with
    callees, in us per call."""
    table = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = [
        (f"{name} ({'/'.join(Path(file).parts[-2:])}:{line})", tt, ct)
        for (file, line, name), (_, _, tt, ct, _) in table.items()
    ]

    def per_call(seconds: float) -> float:
        return round(seconds / calls * 1e6, 1)

    return {
        "total_us_per_call": per_call(sum(row[1] for row in rows)),
        "own_us_per_call": {n: per_call(tt) for n, tt, _ in sorted(rows, key=lambda r: -r[1])[:TOP_FUNCTIONS]},
        "cumulative_us_per_call": {n: per_call(ct) for n, _, ct in sorted(rows, key=lambda r: -r[2])[:TOP_FUNCTIONS]},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/hop_cpu.json")
    parser.add_argument("--calls", type=int, default=3000, help="calls per measured round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--gpu-memory-mb",
        type=int,
        default=1000,
        help="each GPU's memory: 1000 (the default) holds all 8 models of 100 MB, so every call is a hit; "
        "300 is bench/peer_bench.py's (3 models a GPU: about one call in eight reloads a model)",
    )
    parser.add_argument("--no-tls", action="store_true", help="the daemons' links in plain (gpufaas up --no-tls)")
    parser.add_argument("--profile", action="store_true", help="a last round with the daemons under cProfile")
    parser.add_argument(
        "--scheduler-apart",
        action="store_true",
        help="the scheduler in a process of its own (gpufaas up --scheduler-apart); by default it runs in the "
        "gateway's, and its CPU counts as the gateway's",
    )
    parser.add_argument(
        "--node-apart",
        action="store_true",
        help="the node in a process of its own (gpufaas up --node-apart); by default it runs in the gateway's, "
        "and its CPU counts as the gateway's",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpufaas-hop-cpu-") as tmp:
        work = Path(tmp)
        body = work / "x.json"
        body.write_text(json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}))
        up = (
            *(("--no-tls",) if args.no_tls else ()),
            *(("--scheduler-apart",) if args.scheduler_apart else ()),
            *(("--node-apart",) if args.node_apart else ()),
        )
        profiles = install_profiler(work) if args.profile else None
        # 1000 MB GPUs (the default): all 8 models of 100 MB stay resident, so the measured calls are hits.
        with gpufaas_cluster(work, gpu_memory_mb=args.gpu_memory_mb, up=up) as cluster:
            client(cluster, body, calls=400, concurrency=args.concurrency, warmup_s=0)  # loads every model
            rounds = []
            for index in range(args.rounds):
                rounds.append(measured_round(cluster, body, args))
                print(f"round {index + 1}: {json.dumps(rounds[-1])}", flush=True)
            profile = profile_round(cluster, body, args, profiles) if profiles is not None else None
    median = {
        role: round(statistics.median(r["cpu_us_per_call"][role] for r in rounds), 1)
        for role in rounds[0]["cpu_us_per_call"]
    }
    report = {
        "meta": run_metadata(
            workload=f"{NUM_MODELS} models, Zipf {ZIPF}, GPUs of {args.gpu_memory_mb} MB"
            + (" (hits only)" if args.gpu_memory_mb >= 1000 else "")
            + f", concurrency {args.concurrency}",
            tls=not args.no_tls,
            scheduler_apart=args.scheduler_apart,
            node_apart=args.node_apart,
            calls_per_round=args.calls,
        ),
        "median": {
            "cpu_us_per_call": median,
            "throughput_rps": statistics.median(r["throughput_rps"] for r in rounds),
            "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        },
        "rounds": rounds,
        **({"profile": profile} if profile is not None else {}),
    }
    write_results(args.out, report, [f"median CPU us per call: {json.dumps(median)}"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
