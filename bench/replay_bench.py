"""Replays the paper's workload through the real control plane (emulated GPUs) and the simulator.

A LocalCluster of 3 nodes x 4 emulated RTX 2080s (8192 MB, one call at a time each, as in the
paper) runs the real etcd, scheduler, gateway and GPU managers; each emulated worker sleeps its
model's Table I load and inference times (a miss also pays what the real system adds: taking a
warm spare, the handler's load, the control plane's hops). The
workload is the simulator's (shipped trace, working set, 325 requests/minute, seed 0), with every
time, arrivals and profiles alike, compressed by `--speedup` so a run takes seconds instead of
minutes. Each request is sent over HTTP at its arrival time; latency is arrival to answer, a miss
is `X-Cache: miss`. The same compressed workload goes through the simulator, so the two columns
differ only by what the real system adds: control-plane overhead, process starts, timing jitter.

Run: `python -m bench.replay_bench [--working-set 35] [--minutes 2] [--speedup 10]`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.machine import results_parser, write_results
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.packages import build_package
from gpufaas.profiles import ModelProfile, paper_table1
from simulator.engine import ClusterConfig, percentile, simulate
from simulator.report import shipped_trace
from simulator.workload import Workload, WorkloadConfig, build_workload, load_trace

HANDLER = "def load(device):\n    return None\n\n\ndef predict(model, inputs):\n    return {}\n"
# Every function's timeout_s, on the cluster and in the simulator alike: the longest a function may
# have, so that neither column drops a call the other completes.
TIMEOUT_S = 3600.0


def compressed(workload: Workload, speedup: float) -> Workload:
    """The same workload with every time divided by `speedup`, and every function's calls given
    the deployed functions' deadline (TIMEOUT_S): with the workload's own (60 s by default) the
    simulator timed out calls the cluster then answered, and its latencies left those out."""
    return replace(
        workload,
        timeouts_s=dict.fromkeys(workload.function_models, TIMEOUT_S),
        requests=[replace(r, arrival_s=r.arrival_s / speedup) for r in workload.requests],
        profiles=[
            replace(p, load_time_s=p.load_time_s / speedup, inference_time_s=p.inference_time_s / speedup)
            for p in workload.profiles
        ],
    )


def package() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "handler.py").write_text(HANDLER)
        return build_package(Path(tmp))


def deploy(cluster: LocalCluster, workload: Workload) -> dict[str, str]:
    """One function per working-set function, sized by its model; returns model -> function name."""
    auth = cluster.admin_auth
    digest = httpx.post(f"{cluster.gateway_url}/system/packages", content=package(), timeout=30, auth=auth).json()[
        "digest"
    ]
    names = {}
    for index, profile in enumerate(workload.profiles):
        name = f"f{index:02d}"
        spec = {"name": name, "package_digest": digest, "memory_mb": profile.memory_mb, "timeout_s": TIMEOUT_S}
        httpx.post(f"{cluster.gateway_url}/system/functions", json=spec, timeout=30, auth=auth).raise_for_status()
        names[profile.model] = name
    return names


async def seed_profiles(cluster: LocalCluster, workload: Workload, names: dict[str, str]) -> None:
    """Write each function's model profile (Table I, compressed) where the scheduler reads them."""
    from gpufaas.keys import Keys
    from gpufaas.store import EtcdStore

    functions = httpx.get(f"{cluster.gateway_url}/system/functions", timeout=30, auth=cluster.admin_auth).json()
    model_of = {f["name"]: f["model"] for f in functions}
    assert cluster.etcd_endpoint is not None
    store = await EtcdStore.open(
        cluster.etcd_endpoint, credentials=cluster.etcd_credentials, tls=cluster.etcd_client_tls
    )
    try:
        keys = Keys(cluster.root)
        for profile in workload.profiles:
            record = {
                "load_time_s": profile.load_time_s,
                "inference_time_s": {str(profile.batch_size): profile.inference_time_s},
            }
            key = keys.profile("rtx2080", model_of[names[profile.model]])
            await store.put(key, json.dumps(record).encode())
    finally:
        await store.close()


async def replay(url: str, workload: Workload, names: dict[str, str], headers: dict[str, str]) -> dict[str, Any]:
    # Idle connections are dropped after 2 s, before the gateway's 5 s keep-alive closes them: with
    # httpx's default (5 s, the same) a call could go out on a connection the gateway was closing
    # that instant, and fail with a ReadError that says nothing about the system under test.
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0)
    latencies: list[float] = []
    misses = errors = 0
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=3600, headers=headers) as client:
        start = time.monotonic()

        async def one(arrival_s: float, name: str) -> None:
            nonlocal misses, errors
            await asyncio.sleep(max(0.0, start + arrival_s - time.monotonic()))
            sent = time.monotonic()
            try:
                response = await client.post(f"/function/{name}", content=b"{}")
            except httpx.HTTPError:
                # A call the transport failed is an error of the run, as a non-200 answer is: raised
                # out of the gather, it ended the benchmark and lost every policy's results.
                errors += 1
                return
            if response.status_code != 200:
                errors += 1
                return
            # Latency from the scheduled arrival (a late send counts against the system); from the
            # send where the timer fired a hair early (asyncio runs timers due within its clock's
            # resolution), where this once recorded 0.0 however long the call took.
            latencies.append(time.monotonic() - max(sent, start + arrival_s))
            misses += response.headers.get("x-cache") == "miss"

        await asyncio.gather(*(one(r.arrival_s, names[r.model]) for r in workload.requests))
    ordered = sorted(latencies)
    return {
        "completed": len(latencies),
        "errors": errors,
        "avg_latency_s": statistics.fmean(latencies) if latencies else 0.0,
        "p50_latency_s": percentile(ordered, 50),
        "p99_latency_s": percentile(ordered, 99),
        "miss_ratio": misses / len(latencies) if latencies else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = results_parser(__doc__, "replay_bench.json")
    parser.add_argument("--working-set", type=int, default=35)
    parser.add_argument("--minutes", type=int, default=2)
    parser.add_argument("--rpm", type=int, default=325)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--policies", default="lb,lalb,lalb-o3,mqfq-sticky,torpor")
    args = parser.parse_args(argv)
    table: list[ModelProfile] = paper_table1()
    config = WorkloadConfig(working_set=args.working_set, minutes=args.minutes, rpm=args.rpm)
    workload = compressed(build_workload(load_trace(shipped_trace(), "azure2019"), config, table), args.speedup)
    rows = []
    for policy in args.policies.split(","):
        simulated = simulate(workload, policy, cluster=ClusterConfig())
        real = replay_on_cluster(workload, policy)
        rows.append(
            {
                "policy": policy,
                "simulated": {
                    k: getattr(simulated, k) for k in ("avg_latency_s", "p50_latency_s", "p99_latency_s", "miss_ratio")
                },
                "real": real,
            }
        )
        print(
            f"{policy:8} simulated avg {simulated.avg_latency_s:6.3f} s miss {simulated.miss_ratio:.4f} | "
            f"real avg {real['avg_latency_s']:6.3f} s miss {real['miss_ratio']:.4f} "
            f"({real['completed']} ok, {real['errors']} errors)",
            flush=True,
        )
    report = {
        "metadata": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "working_set": args.working_set,
            "minutes": args.minutes,
            "rpm": args.rpm,
            "speedup": args.speedup,
            "requests": len(workload.requests),
            "slots_per_gpu": 1,
            "note": "times are compressed by `speedup`: multiply latencies by it for the paper's scale",
        },
        "results": rows,
    }
    write_results(args.out, report)
    return 0


def replay_on_cluster(workload: Workload, policy: str) -> dict[str, Any]:
    """`workload` replayed over HTTP on a fresh local cluster of 3 nodes x 4 emulated RTX 2080s
    under `policy`, its functions deployed and their profiles seeded first: `replay`'s figures."""
    with tempfile.TemporaryDirectory(prefix="gpufaas-replay-") as tmp:
        # slots="1": the paper's GPUs run one call at a time (the simulator's default too)
        cluster = LocalCluster(
            Path(tmp), nodes=3, gpus_per_node=4, backend="emulated", gpu_memory_mb=8192, gpu_type="rtx2080",
            policy=policy, slots="1",
        )  # fmt: skip
        cluster.start()
        try:
            names = deploy(cluster, workload)
            asyncio.run(seed_profiles(cluster, workload, names))
            cluster.restart("scheduler")  # it reads profiles from etcd when it starts
            return asyncio.run(replay(cluster.gateway_url, workload, names, cluster.invoke_headers))
        finally:
            cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
