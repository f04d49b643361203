"""Benchmark: functions per node against req/s and p99, gpufaas beside Ray Serve, one run.

The workload of many small models (per-customer classifiers, fine-tuned variants): N functions of
the pytorch-custom template, each declared at 100 MB and with weights of its own, on one node with
two cpu GPUs of 2,000 MB (40 models resident at once), Zipf 1.1 popularity over m0..m{N-1}, 8
closed-loop clients (bench/peer/load_client.py for both systems). Ray Serve runs the same shape: 2
replicas multiplexing a tiny torch model, 20 models each (`MUX_MODELS_PER_REPLICA`), the same 40
resident; its HAProxy mode (its fastest, which does not route by model id) and optionally its
default proxy. N sweeps `--functions` (default 40, 100, 200); the cluster holds the largest N
deployed throughout, and each point calls the first N.

Besides the client's figures, each gpufaas point reports what the node did (scraped from its
metrics before and after): misses served from host memory (a parked worker taken back) against
misses that loaded, worker processes started, and the CPU seconds each process spent per 1,000
requests (from /proc: gateway, scheduler, node, its workers).

Run: `python -m bench.density_bench [--out bench/results/density_bench.json] [--duration 15]
[--functions 40,100,200] [--systems gpufaas,ray-haproxy,ray-default] [--up "--spares 2"]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.peer_bench import (
    RunningCluster,
    bench_parser,
    count_misses,
    gpufaas_cluster,
    gpufaas_load,
    parse_systems,
    ray_point,
    ray_serve,
    run_and_report,
    throughput_ratio,
)
from gpufaas.credentials import SecretFiles, metrics_token, read_secret
from gpufaas.dev.local_cluster import node_pid, recorded_pids
from gpufaas.processes import descendants

REPO = Path(__file__).resolve().parent.parent
FUNCTIONS = (40, 100, 200)
CONCURRENCY = 8
ZIPF = 1.1
GPU_MEMORY_MB = 2000  # per logical GPU, 2 of them: 40 models of 100 MB resident
MODEL_MEMORY_MB = 100
RESIDENT_PER_GPU = GPU_MEMORY_MB // MODEL_MEMORY_MB  # Ray: models per replica, the same 40 in all
SYSTEMS = ("gpufaas", "ray-haproxy", "ray-default")
TARGET_RATIO_TO_RAY_HAPROXY = 0.5  # at 200 functions, 0 errors (the bar; its goal: 1.0)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU of `pid` (with `children`: of its reaped children too), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the name: state is field 0, utime 11, stime 12, cutime 13, cstime 14.
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _CLOCK_TICKS


def node_sample(cluster: RunningCluster) -> dict[str, float]:
    """The node's counters (from its metrics) and every component's CPU seconds so far."""
    info = json.loads((cluster.state_dir / "cluster.json").read_text())
    pids = recorded_pids(cluster.state_dir)
    token = metrics_token(read_secret(SecretFiles(cluster.state_dir / "secrets").cluster_secret))
    text = httpx.get(
        f"http://{info['metrics']['node0']}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).text
    sample: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for metric in family.samples:
            if metric.name == "gpufaas_node_loads_total":
                sample[f"misses_{metric.labels['source']}"] = metric.value
            elif metric.name == "gpufaas_node_worker_starts_total":
                sample["worker_starts"] = metric.value
            elif metric.name == "gpufaas_node_parked_workers":
                sample["parked_workers"] = metric.value
    # The scheduler and the node in the gateway's process (`gpufaas up`'s default with one gateway
    # and one node): their CPU is the gateway's, and 0 is recorded for them.
    for name in ("gateway", "scheduler", "node0"):
        sample[f"cpu_{name}_s"] = cpu_seconds(pids[name]) if name in pids else 0.0
    # Workers: the node's descendants (the zygote and what it forked); the zygote's reaped children
    # count the workers that exited.
    node = node_pid(pids)
    sample["cpu_workers_s"] = sum(cpu_seconds(pid, children=True) for pid in descendants(node))
    return sample


def gpufaas_point(cluster: RunningCluster, functions: int, args: argparse.Namespace, body: Path) -> dict[str, Any]:
    before = node_sample(cluster)
    point = count_misses(
        gpufaas_load(
            cluster, CONCURRENCY, args, body, f"gpufaas, {functions} functions", num_models=functions, zipf=ZIPF
        )
    )
    after = node_sample(cluster)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    # The metrics span warm-up and the measured seconds; the client's requests only the latter.
    span_requests = point["requests"] * (args.duration + args.warmup) / args.duration
    point["node"] = {
        "misses_from_host": int(delta.get("misses_host", 0)),
        "misses_loaded": int(delta.get("misses_load", 0)),
        "worker_starts": int(delta.get("worker_starts", 0)),
        "parked_workers_after": int(after.get("parked_workers", 0)),
        "cpu_ms_per_request": {
            name.removeprefix("cpu_").removesuffix("_s"): round(1000 * delta[name] / max(1.0, span_requests), 3)
            for name in delta
            if name.startswith("cpu_")
        },
    }
    return point


def run_gpufaas(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    body = work / "x.json"
    body.write_text(json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}))
    results: dict[str, Any] = {}
    with gpufaas_cluster(
        work,
        gpu_memory_mb=GPU_MEMORY_MB,
        functions=max(args.functions),
        model_memory_mb=MODEL_MEMORY_MB,
        up=tuple(shlex.split(args.up)),
    ) as cluster:
        for functions in args.functions:
            results[f"n{functions}"] = gpufaas_point(cluster, functions, args, body)
    return results


def run_ray(args: argparse.Namespace, work: Path, variant: str) -> dict[str, Any]:
    with ray_serve(args, work, variant, models_per_replica=RESIDENT_PER_GPU) as url:
        return {
            f"n{n}": ray_point(url, CONCURRENCY, args, work, f"ray-{variant}, {n} models", num_models=n, zipf=ZIPF)
            for n in args.functions
        }


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """The target, checked against this run. A point with no successful call (no throughput, or 0)
    has no ratio and fails the target instead of raising: the verdict is computed once every
    system ran, and an exception here lost the whole run's results."""
    out: dict[str, Any] = {"target_ratio_to_ray_haproxy": TARGET_RATIO_TO_RAY_HAPROXY}
    ours, ray = results.get("gpufaas"), results.get("ray-haproxy")
    if ours and ray:
        out["ratio_to_ray_haproxy"] = {n: throughput_ratio(ours[n], ray[n], 3) for n in ours if n in ray}
        if "n200" in ours and "n200" in ray:
            mine, theirs = ours["n200"]["throughput_rps"], ray["n200"]["throughput_rps"]
            out["n200_at_least_half_of_ray_haproxy_no_errors"] = (
                mine is not None
                and mine >= TARGET_RATIO_TO_RAY_HAPROXY * (theirs or 0.0)
                and ours["n200"]["errors"] == 0
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        __doc__, out_name="density_bench.json", duration_s=15.0, systems=SYSTEMS, default_systems="gpufaas,ray-haproxy"
    )
    parser.add_argument(
        "--functions",
        type=lambda text: sorted({int(n) for n in text.split(",")}),
        default=list(FUNCTIONS),
        help="function counts, a comma list",
    )
    parser.add_argument("--up", default="", help="extra `gpufaas up` flags, e.g. '--spares 2'")
    args, systems = parse_systems(parser, argv, SYSTEMS)
    return run_and_report(
        args,
        systems,
        lambda system, work: run_gpufaas(args, work) if system == "gpufaas" else run_ray(args, work, system[4:]),
        prefix="gpufaas-density-bench-",
        point_label="N",
        verdict=verdict,
        workload=(
            f"functions {args.functions}, Zipf {ZIPF}, {CONCURRENCY} clients, 2 GPUs x {GPU_MEMORY_MB} MB, "
            f"{MODEL_MEMORY_MB} MB per model ({2 * RESIDENT_PER_GPU} resident; Ray: 2 replicas x "
            f"{RESIDENT_PER_GPU} models)"
        ),
        gpufaas_up=args.up,
    )


if __name__ == "__main__":
    raise SystemExit(main())
