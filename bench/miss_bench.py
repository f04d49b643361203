"""Benchmark: what a miss costs in CPU, stage by stage, and what a miss from host memory costs.

Three parts, all with the pytorch-custom template (a tiny MLP in torch; its package on the node):

1. **A miss from a spare, by stage** (the node's `WorkerPool` driven in this process, one cpu
   GPU, no host tier, so each miss loads and each victim exits): the CPU each process spends on
   each stage, measured from outside (`/proc/<pid>/task/*/schedstat`, nanoseconds):
   - fork: the zygote's CPU per worker it forks;
   - spare start: the new worker's own CPU until it is a warm spare (off the critical path);
   - node: the node's CPU for the miss (this process: the call, LoadModel, bookkeeping);
   - load + first call: the worker's CPU from taking the model to answering its first call;
   - exit: the machine's CPU while a loaded worker is stopped and exits (all processes; the
     machine is otherwise idle; /proc/stat, summed over every exit, so its 10 ms ticks average out).
   Plus the stages' wall time (the pool's MissStages). Misses run one at a time, a spare warm
   before each, as between misses of a steady load.
2. **A miss from host memory** (the same pool with a host tier: victims parked; misses of a model
   parked there take its worker back): the node's and the worker's CPU per miss and its wall
   time, beside a hit's.
3. **End to end** (a local cluster: gateway, scheduler, one node with one cpu GPU that holds 2
   models, its default host tier; one client, calls one at a time over HTTP): p50 latency and the
   node's CPU per call (its process, every thread) for hits and for misses from host memory (the
   calls go round 6 functions, so each is a miss whose model the node parked).

Targets (issue: hundreds of functions per node): a miss from host memory <= 2 ms p50 end to end
and <= 1 ms of node CPU.

Run: `python -m bench.miss_bench [--out bench/results/miss_bench.json] [--misses 40]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.machine import results_parser, run_metadata, write_results
from bench.overhead_bench import template_package
from gpu_manager.pool import ModelRun, RunResult, WorkerPool
from gpu_manager.staging import LocalPackages
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.proto import gpufaas_pb2 as pb

BODY = json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}).encode()
TARGET_HOST_MISS_P50_MS = 2.0
TARGET_HOST_MISS_NODE_CPU_MS = 1.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """CPU time `pid` has run, every thread of it (0 if it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                total += int(file.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core; /proc/stat, 10 ms ticks)."""
    with open("/proc/stat") as file:
        fields = [int(v) for v in file.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _CLOCK_TICKS


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parent = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def zygote_pid() -> int:
    for pid in children_of(os.getpid()):
        try:
            if b"gpu_manager.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise RuntimeError("no worker zygote among this process's children")


def ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "mean": round(statistics.fmean(ordered), 3),
    }


async def call(pool: WorkerPool, run: ModelRun, index: int, evict: tuple[str, ...] = ()) -> RunResult:
    result = await pool.run(run, "gpu0", f"c{index}", BODY, content_type="application/json", timeout_s=60, evict=evict)
    if result.outcome != pb.OK:
        raise RuntimeError(f"{run.model}: {pb.Outcome.Name(result.outcome)} {result.message}")
    return result


async def spare_pid(pool: WorkerPool) -> int:
    """The warm spare's pid, once there is one (and the machine has settled)."""
    await pool.spares_ready()
    for _ in range(200):
        hellos = await pool.spares_ready()
        if hellos and pool.spare_count("gpu0"):
            await asyncio.sleep(0.2)  # what the spare's start left running (page faults, its hello) ends
            return hellos[0].pid
        await asyncio.sleep(0.05)
    raise RuntimeError("no warm spare")


async def misses_by_stage(local: LocalPackages, digest: str, misses: int) -> dict[str, Any]:
    pool = WorkerPool("cpu", gpus={"gpu0": 0}, fetch_package=local.fetch, spares_per_gpu=1)
    pool.start()
    stages: dict[str, list[float]] = {}
    node_ns: list[float] = []
    worker_ns: list[float] = []
    spare_ns: list[float] = []
    exit_s = 0.0
    try:
        await spare_pid(pool)
        zygote = zygote_pid()
        zygote_before = cpu_ns(zygote)
        forks_before = pool.worker_starts
        for index in range(misses + 1):  # the first is a warm-up: not counted
            pid = await spare_pid(pool)
            spare_at_warm = cpu_ns(pid)
            run = ModelRun(f"m{index}", digest, 100)
            node_before = time.process_time_ns()
            worker_before = cpu_ns(pid)
            result = await call(pool, run, index)
            node_after = time.process_time_ns()
            worker_after = cpu_ns(pid)
            await spare_pid(pool)  # the replacement spare is forked and warm: not in the exit's window
            busy_before, node_stop_before = machine_busy_s(), time.process_time()
            await pool.evict(run.model, "gpu0")
            busy_after, node_stop_after = machine_busy_s(), time.process_time()
            if index == 0:
                continue
            spare_ns.append(spare_at_warm)
            node_ns.append(node_after - node_before)
            worker_ns.append(worker_after - worker_before)
            # The machine's CPU during the stop, less this process's own (sending the signal, waiting).
            exit_s += (busy_after - busy_before) - (node_stop_after - node_stop_before)
            assert result.stages is not None
            for field in ("fetch_s", "start_s", "context_s", "load_s"):
                stages.setdefault(field.removesuffix("_s"), []).append(getattr(result.stages, field) * 1e3)
            stages.setdefault("first_call", []).append(result.inference_time_s * 1e3)
        forks = pool.worker_starts - forks_before
        fork_ns = (cpu_ns(zygote) - zygote_before) / max(1, forks)
    finally:
        await pool.shutdown()
    cpu_ms = {
        "fork (zygote)": ms(fork_ns),
        "spare start (worker, off the path)": ms(statistics.fmean(spare_ns)),
        "node": ms(statistics.fmean(node_ns)),
        "load + first call (worker)": ms(statistics.fmean(worker_ns)),
        "exit (machine, per stopped worker)": round(1e3 * exit_s / misses, 3),
    }
    return {
        "misses": misses,
        "cpu_ms_per_miss": cpu_ms | {"total": round(sum(cpu_ms.values()), 3)},
        "cpu_ms_on_the_path": round(cpu_ms["node"] + cpu_ms["load + first call (worker)"], 3),
        "node_cpu_ms": spread([v / 1e6 for v in node_ns]),
        "worker_load_and_first_call_cpu_ms": spread([v / 1e6 for v in worker_ns]),
        "wall_ms": {stage: spread(values) for stage, values in stages.items()},
    }


async def misses_from_host(local: LocalPackages, digest: str, misses: int, models: int = 6) -> dict[str, Any]:
    """`models` models loaded once, then called in turn, each call evicting the one before it into
    the host tier: every call a miss whose worker is taken back."""
    pool = WorkerPool("cpu", gpus={"gpu0": 0}, fetch_package=local.fetch, spares_per_gpu=1, host_cache_mb=4096)
    pool.start()
    runs = [ModelRun(f"h{i}", digest, 100) for i in range(models)]
    out: dict[str, Any] = {}
    try:
        await spare_pid(pool)
        index = 0
        for i, run in enumerate(runs):  # load each (the one before it parked)
            await call(pool, run, index, evict=(runs[i - 1].model,) if i else ())
            index += 1
            await spare_pid(pool)
        for kind in ("hit", "from_host"):
            node_ns, wall_ms = [], []
            current = runs[-1]
            for n in range(misses):
                target = current if kind == "hit" else runs[n % models]
                evict = (current.model,) if target is not current else ()
                before = time.process_time_ns()
                started = time.perf_counter()
                result = await call(pool, target, index, evict=evict)
                wall_ms.append((time.perf_counter() - started) * 1e3)
                node_ns.append(time.process_time_ns() - before)
                index += 1
                if kind == "from_host" and not (result.stages is not None and result.stages.from_host):
                    raise RuntimeError(f"{target.model}: expected a miss from host memory, got {result.stages}")
                current = target
            out[kind] = {
                "calls": misses,
                "node_cpu_ms": spread([v / 1e6 for v in node_ns]),
                "wall_ms": spread(wall_ms),
            }
        out["parked_after"] = len(pool.parked())
    finally:
        await pool.shutdown()
    return out


def end_to_end(state_dir: Path, package: bytes, calls: int) -> dict[str, Any]:
    """Hits and misses from host memory over HTTP, one call at a time (see the module docstring)."""
    cluster = LocalCluster(state_dir / "cluster", nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=200)
    cluster.start()
    try:
        url, auth = cluster.gateway_url, cluster.admin_auth
        digest = httpx.post(f"{url}/system/packages", content=package, timeout=30, auth=auth).json()["digest"]
        names = [f"e{i}" for i in range(6)]
        for name in names:
            spec = {"name": name, "package_digest": digest, "memory_mb": 100}
            httpx.post(f"{url}/system/functions", json=spec, timeout=30, auth=auth).raise_for_status()
        node_pid = cluster.pids()["node0"]
        out: dict[str, Any] = {}
        with httpx.Client(base_url=url, timeout=60, headers=cluster.invoke_headers) as client:

            def one(name: str) -> tuple[float, str]:
                started = time.perf_counter()
                response = client.post(f"/function/{name}", content=BODY, headers={"content-type": "application/json"})
                elapsed_ms = (time.perf_counter() - started) * 1e3
                response.raise_for_status()
                timing = response.headers.get("server-timing", "")
                return elapsed_ms, "host" if "host;" in timing else response.headers["x-cache"]

            for name in names * 3:  # each loaded once, then the tier and the GPU settle
                one(name)
                time.sleep(0.05)
            for kind, sequence in (("hit", [names[0]] * calls), ("from_host", [names[i % 6] for i in range(calls)])):
                if kind == "hit":
                    one(names[0])
                latencies = []
                seen: dict[str, int] = {}
                before = cpu_ns(node_pid)
                for name in sequence:
                    elapsed_ms, how = one(name)
                    latencies.append(elapsed_ms)
                    seen[how] = seen.get(how, 0) + 1
                out[kind] = {
                    "calls": calls,
                    "answers": seen,
                    "latency_ms": spread(latencies),
                    "node_cpu_ms_per_call": ms((cpu_ns(node_pid) - before) / calls),
                }
    finally:
        cluster.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = results_parser(__doc__, "miss_bench.json")
    parser.add_argument("--misses", type=int, default=40, help="misses per part")
    parser.add_argument("--calls", type=int, default=300, help="calls per kind, end to end")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpufaas-miss-bench-") as tmp:
        state_dir = Path(tmp)
        package = template_package(state_dir)
        local = LocalPackages(state_dir / "packages")
        digest = local.add_archive(package)
        by_stage = asyncio.run(misses_by_stage(local, digest, args.misses))
        from_host = asyncio.run(misses_from_host(local, digest, args.misses * 5))
        http = end_to_end(state_dir, package, args.calls)
    host = http["from_host"]
    report = {
        "metadata": run_metadata(misses=args.misses, calls=args.calls),
        "miss_from_a_spare": by_stage,
        "pool_hit_and_miss_from_host": from_host,
        "end_to_end": http,
        "targets": {
            "host_miss_p50_ms": TARGET_HOST_MISS_P50_MS,
            "host_miss_node_cpu_ms": TARGET_HOST_MISS_NODE_CPU_MS,
            "met": host["latency_ms"]["p50"] <= TARGET_HOST_MISS_P50_MS
            and host["node_cpu_ms_per_call"] <= TARGET_HOST_MISS_NODE_CPU_MS,
        },
    }
    write_results(args.out, report, _summary(report), indent=1)
    return 0


def _summary(report: dict[str, Any]) -> Iterator[str]:
    """The report's figures, a line each."""
    by_stage = report["miss_from_a_spare"]
    yield "CPU per miss from a spare (ms):"
    for stage, value in by_stage["cpu_ms_per_miss"].items():
        yield f"  {stage:<40} {value:>8}"
    yield "  wall p50 (ms): " + ", ".join(f"{k} {v['p50']}" for k, v in by_stage["wall_ms"].items())
    for kind, figures in report["pool_hit_and_miss_from_host"].items():
        if isinstance(figures, dict):
            cpu_ms, wall_ms = figures["node_cpu_ms"], figures["wall_ms"]
            yield f"pool {kind}: node CPU p50 {cpu_ms['p50']} ms, wall p50 {wall_ms['p50']} ms"
    for kind, figures in report["end_to_end"].items():
        yield (
            f"end to end {kind}: p50 {figures['latency_ms']['p50']} ms, node CPU {figures['node_cpu_ms_per_call']} ms "
            f"per call, answers {figures['answers']}"
        )
    yield f"targets met: {report['targets']['met']}"


if __name__ == "__main__":
    raise SystemExit(main())
