"""How fast `gpufaas sim` replays the shipped Azure trace at scale: events and requests per second.

The run is the one docs/simulation-scale.md defines: the shipped extract (azure2019-500fn, trace
minutes 480..959), every function of it, the paper's per-GPU load (325 requests per minute on 12
GPUs, so `round(325 * gpus / 12)` per minute), lalb-o3, D = 1, 8192 MB GPUs, seed 0, through the
real scheduler and cache manager. `--minutes N` replays the first N minutes of it (a slice);
`--whole-trace` all 480. The JSON records the simulated requests, the discrete-event loop's
events, wall seconds (the workload's building apart from the simulation's), events and requests
per wall second and per CPU second (the machine may be shared), peak RSS, the commit (and whether
the scheduler's code had uncommitted changes), the load average, and the run's own figures (so a
faster simulator can be checked to decide the same). `--profile` runs it under cProfile and adds
each code area's share of the time.

Run: `python -m bench.sim_speed [--gpus 1000] [--minutes 2 | --whole-trace] [--profile]`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.machine import REPO, results_parser, run_metadata, write_results
from gpufaas.errors import InvalidInput
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, Meter, SimResult, simulate
from simulator.report import shipped_trace
from simulator.workload import TraceCounts, Workload, WorkloadConfig, build_workload, load_azure2019

PAPER_RPM, PAPER_GPUS = 325, 12  # the CLI's default load: 325 requests per minute on 12 GPUs
POLICY = "lalb-o3"
AREAS = ("simulator/", "scheduler/", "cache_manager/", "gpufaas/")  # the code areas a profile splits


def scaled_rpm(gpus: int) -> int:
    """The paper's per-GPU load on `gpus` GPUs: 325 requests per minute per 12 GPUs, rounded."""
    return round(PAPER_RPM * gpus / PAPER_GPUS)


def area_shares(stats: pstats.Stats) -> dict[str, float]:
    """Each code area's share of the profiled time (own time of its functions, summed), plus
    "other" (the standard library, builtins); the shares add up to 1."""
    seconds: dict[str, float] = dict.fromkeys((*AREAS, "other"), 0.0)
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, _, tottime_s, _, _) in entries.items():
        relative = filename.removeprefix(str(REPO) + "/")
        seconds[next((area for area in AREAS if relative.startswith(area)), "other")] += tottime_s
    total_s = sum(seconds.values()) or 1.0
    return {area: round(value / total_s, 4) for area, value in seconds.items()}


def top_functions(stats: pstats.Stats, count: int = 25) -> list[dict[str, Any]]:
    """The `count` functions with the most own time: where, calls, own and cumulative seconds."""
    entries: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = sorted(entries.items(), key=lambda item: -item[1][2])[:count]
    return [
        {
            "function": f"{filename.removeprefix(str(REPO) + '/')}:{line}({name})",
            "calls": calls,
            "own_s": round(tottime_s, 3),
            "cumulative_s": round(cumtime_s, 3),
        }
        for (filename, line, name), (_, calls, tottime_s, cumtime_s, _) in rows
    ]


def uncommitted(paths: list[str]) -> list[str]:
    """The files under `paths` whose working copy differs from the commit (what the commit
    alone does not say about the code that ran)."""
    try:
        command = ["git", "status", "--porcelain", "--", *paths]
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in done.stdout.splitlines()]


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (0 GPUs or minutes ended in a traceback from the
    workload's own check, 0 GPUs as 'workload rpm is 0')."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main() -> None:
    parser = results_parser(__doc__, "sim_speed.json")
    parser.add_argument("--gpus", type=positive_int, default=1000)
    span = parser.add_mutually_exclusive_group()
    span.add_argument("--minutes", type=positive_int, default=2, help="replay the trace's first N minutes (a slice)")
    span.add_argument("--whole-trace", action="store_true", help="replay all of it")
    parser.add_argument("--profile", action="store_true", help="under cProfile: time shares per code area")
    args = parser.parse_args()

    trace = load_azure2019(shipped_trace())
    minutes = trace.minutes[-1] - trace.minutes[0] + 1 if args.whole_trace else args.minutes
    rpm = scaled_rpm(args.gpus)
    config = WorkloadConfig(minutes=minutes, working_set=len(trace.counts), rpm=rpm, seed=0)
    built_at_s = time.perf_counter()
    try:
        workload = build_workload(trace, config, paper_table1())
    except InvalidInput as exc:  # a slice longer than the trace: one line, not a traceback
        parser.error(f"--minutes {minutes}: {exc}")
    build_s = time.perf_counter() - built_at_s

    meter, profiler = Meter(), cProfile.Profile() if args.profile else None
    started_s, started_cpu_s = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    result = simulate(workload, POLICY, cluster=ClusterConfig(gpus=args.gpus), meter=meter)
    if profiler is not None:
        profiler.disable()
    wall_s, cpu_s = time.perf_counter() - started_s, time.process_time() - started_cpu_s
    document = speed_document(args, trace, workload, result, meter, wall_s=wall_s, cpu_s=cpu_s, build_s=build_s)
    if profiler is not None:
        stats = pstats.Stats(profiler)
        document["profile"] = {"area_shares": area_shares(stats), "top_functions": top_functions(stats)}
    summary = [
        f"{document['requests']:,} requests, {meter.events:,} events at {args.gpus} GPUs in {wall_s:,.1f} s: "
        f"{document['events_per_s']:,} events/s, {document['requests_per_s']:,} requests/s "
        f"({document['requests_per_cpu_s']:,} per CPU second), "
        f"peak RSS {document['peak_rss_mb']:,} MB (workload built in {build_s:,.1f} s)"
    ]
    if profiler is not None:
        summary.append(f"profile shares: {document['profile']['area_shares']}")
    write_results(Path(args.out), document, summary)


def speed_document(
    args: argparse.Namespace,
    trace: TraceCounts,
    workload: Workload,
    result: SimResult,
    meter: Meter,
    *,
    wall_s: float,
    cpu_s: float,
    build_s: float,
) -> dict[str, Any]:
    """The results document of one run (what ran, how fast, its headline figures)."""
    minutes = args.minutes if not args.whole_trace else trace.minutes[-1] - trace.minutes[0] + 1
    document: dict[str, Any] = {
        "meta": run_metadata(uncommitted=uncommitted(["simulator", "scheduler", "cache_manager"])),
        "run": {
            "trace": trace.path.relative_to(REPO).as_posix(),
            "start_minute": workload.start_minute,
            "minutes": minutes,
            "functions": len(workload.profiles),
            "gpus": args.gpus,
            "rpm": scaled_rpm(args.gpus),
            "policy": POLICY,
            "slots": 1,
            "seed": 0,
            "profiled": args.profile,
        },
        "requests": len(workload.requests),
        "completed": meter.completed,
        "events": meter.events,
        "instants": meter.instants,
        "build_s": round(build_s, 3),
        "wall_s": round(wall_s, 3),
        "events_per_s": round(meter.events / wall_s, 1),
        "requests_per_s": round(meter.completed / wall_s, 1),
        # On a shared machine wall time counts the other processes' turns too: CPU seconds do not.
        "cpu_s": round(cpu_s, 3),
        "events_per_cpu_s": round(meter.events / cpu_s, 1),
        "requests_per_cpu_s": round(meter.completed / cpu_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "result": {
            key: value
            for key, value in result.to_json().items()
            if key in ("avg_latency_s", "p99_latency_s", "miss_ratio", "gpu_utilization", "makespan_s", "hits")
        },
    }
    return document


if __name__ == "__main__":
    main()
