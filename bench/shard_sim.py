"""Scheduler shards simulated: K real Schedulers over disjoint nodes, rendezvous homes, spills, CPU.

What it runs (docs/scheduler-shards.md reads the figures): the shipped Azure 2019 extract's first
minute (every function, `simulator.workload` with the paper's 325 requests per minute per 12 GPUs
scaled to the cluster), cut to its first `--window-s` seconds, on 100 to 10,000 GPUs of 8,192 MB,
4 per node, one call at a time per GPU (D = 1: a hit takes the model's inference time, a miss its
load time first, Table I's figures, no noise). The cluster's nodes are split into K contiguous
blocks; each block is one shard: a real `scheduler.core.Scheduler` with the real policy
(`lalb-o3`) and LRU cache, driven in virtual time as `simulator.engine` drives one. A call goes
to its home (`scheduler.shards.ShardMap`: rendezvous hashing, hot functions with several homes by
their share of the window's calls), which places it or forwards it by `SpillRule`: its own state
exact, the others' from summaries gossiped every `--gossip-ms` (each home also counts down the
idle GPUs of a summary it forwarded to). A forward costs `--spill-rtt-ms` before the other shard
has it.

CPU per placement (a model laid over the simulated run, not inside it): each shard is one process,
a single server taking its messages first come first served; a `Place` costs `c(n)` seconds (the
placement's whole CPU, its `Done` included, as docs/scheduler-throughput.md measures it), a
forward `--forward-cost-fraction` of that at the home. `c(n) = cost x growth ** log10(n / 1000)`
for a shard of n GPUs (measured: 15-45 % more from 100 to 1,000 GPUs; default growth 1.3 per
decade). Each message's response (waiting + service, Lindley's recursion over the shard's arrival
times) is added to the call's simulated wait for a GPU, so Place -> Placement = CPU response (plus
the home's forward and the round trip for a spilled call) + wait in the scheduler's queue. The
simulated decisions do not see the CPU's delays: a fair approximation while every shard's
utilization is below 1; a shard at or above 1 is reported `saturated` (its latency then grows
with the window: the figure is a lower bound). Capacity of the whole = the placements per second
at which its busiest shard reaches utilization 1 (K / c when the hash balances the shards).

Measured part: calls arriving after `--warmup-s` (the cold start's loads are left out); hit
ratio, loads, spills and latencies are over those.

Run: `python -m bench.shard_sim [--sizes 100,1000,...] [--shards 1,2,4,8,16] [--window-s 12]`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.machine import results_parser, run_metadata, write_results
from bench.sim_speed import uncommitted
from cache_manager import CacheManager, eviction_policy
from gpufaas.profiles import ModelProfile, paper_table1
from gpufaas.types import GpuSpec, Request
from scheduler import Dispatch, Estimator, PolicyConfig, Scheduler, make_policy
from scheduler.shards import ShardLoad, ShardMap, SpillRule
from simulator.engine import percentile
from simulator.report import shipped_trace
from simulator.workload import Workload, WorkloadConfig, build_workload, load_azure2019

PAPER_RPM, PAPER_GPUS = 325, 12  # the simulator's default load: 325 requests per minute on 12 GPUs
POLICY = "lalb-o3"
GPU_TYPE = "rtx2080"
MEASURED_COST_US = 450.0  # docs/scheduler-throughput.md: 413-511 us of CPU per placement at 1,000 GPUs
TARGET_COST_US = 50.0  # the same doc's 20,000 placements/s target on one core


@dataclass(frozen=True, slots=True)
class ShardSimConfig:
    """One simulated cluster and its sharding."""

    gpus: int
    shards: int
    gpus_per_node: int = 4
    gpu_memory_mb: int = 8192
    gossip_s: float = 0.1
    spill_rtt_s: float = 0.0005
    queue_bound: int = 0
    spill_for_hits: bool = True
    max_home_share: float = 0.5


@dataclass(slots=True)
class CallRecord:
    """One call's path: where it arrived, where it was placed, when, hit or load."""

    arrival_s: float
    home: str
    shard: str = ""
    at_shard_s: float = math.nan
    dispatch_s: float = math.nan
    hit: bool = False
    spilled: bool = False


@dataclass(slots=True)
class ShardRun:
    """A finished run: each call's record, and each shard's GPU count (for its CPU cost)."""

    config: ShardSimConfig
    calls: dict[str, CallRecord]
    shard_gpus: dict[str, int]
    window_s: float
    wall_s: float = 0.0
    homes: dict[int, int] = field(default_factory=dict)  # functions per number of homes


def make_shards(workload: Workload, config: ShardSimConfig) -> dict[str, Scheduler]:
    """K Schedulers, shard i owning the i-th contiguous block of whole nodes, every model known
    to each (any shard may have to place any function: spills)."""
    profiles = [
        ModelProfile(p.model, GPU_TYPE, p.memory_mb, p.load_time_s, p.inference_time_s, p.batch_size)
        for p in workload.profiles
    ]
    nodes = math.ceil(config.gpus / config.gpus_per_node)
    if config.shards > nodes:
        raise ValueError(f"{config.shards} shards need at least as many nodes, got {nodes}")
    shards: dict[str, Scheduler] = {}
    for index in range(config.shards):
        scheduler = Scheduler(
            make_policy(POLICY, PolicyConfig()),
            estimator=Estimator(profiles),
            cache=CacheManager(eviction_policy("lru")),
        )
        for profile in profiles:
            scheduler.register_model(profile.spec())
        shards[f"shard{index:02d}"] = scheduler
    names = list(shards)
    for gpu in range(config.gpus):
        node = gpu // config.gpus_per_node
        shard = names[node * config.shards // nodes]
        shards[shard].add_gpu(GpuSpec(f"gpu{gpu:05d}", config.gpu_memory_mb, GPU_TYPE, node=f"node{node}"))
    return shards


def load_of(name: str, scheduler: Scheduler) -> ShardLoad:
    """A shard's summary as it gossips it: idle GPUs, calls waiting, models on its idle GPUs."""
    idle = [gpu_id for _, gpu_id in scheduler.cluster.idle]
    models = frozenset(model for gpu_id in idle for model in scheduler.cache.models_on(gpu_id))
    return ShardLoad(name, len(idle), len(scheduler.queue), models)


def home_load(name: str, scheduler: Scheduler, model: str) -> ShardLoad:
    """The home's exact state for one call (only whether `model` is on an idle GPU is needed)."""
    idle, holders = scheduler.cluster.idle, scheduler.cache.gpus_with(model)
    # Whichever side is shorter: a busy shard has few idle GPUs, a hot model thousands of holders.
    if len(idle) < len(holders):
        idle_holder = any(gpu_id in holders for _, gpu_id in idle)
    else:
        idle_holder = any(scheduler.gpu(gpu_id).idle for gpu_id in holders)
    return ShardLoad(name, len(idle), len(scheduler.queue), frozenset((model,)) if idle_holder else frozenset())


class _ShardedRun:
    """The event loop: arrivals at their home, forwards in flight, GPU completions, gossip."""

    def __init__(self, workload: Workload, config: ShardSimConfig, window_s: float) -> None:
        self.config = config
        self.shards = make_shards(workload, config)
        self.profiles = {p.model: p for p in workload.profiles}
        self.arrivals = [r for r in workload.requests if r.arrival_s < window_s]
        counts = Counter(r.function for r in self.arrivals)
        shares = {function: n / len(self.arrivals) for function, n in counts.items()}
        self.map = ShardMap(tuple(self.shards), shares, config.max_home_share)
        self.rule = SpillRule(config.queue_bound, config.spill_for_hits)
        self.calls: dict[str, CallRecord] = {}
        self.ties = itertools.count()
        self.forwards: list[tuple[float, int, Request, str]] = []  # (due, tie, request, shard)
        self.completions: list[tuple[float, int, str, str, float | None, float]] = []
        self.views: dict[str, dict[str, ShardLoad]] = {}  # per home: the others' summaries
        self.next_gossip_s = 0.0
        self.window_s = window_s

    def run(self) -> ShardRun:
        started = time.perf_counter()
        arrivals, index = self.arrivals, 0
        while index < len(arrivals) or self.forwards or self.completions:
            now = min(
                arrivals[index].arrival_s if index < len(arrivals) else math.inf,
                self.forwards[0][0] if self.forwards else math.inf,
                self.completions[0][0] if self.completions else math.inf,
            )
            if len(self.shards) > 1 and now >= self.next_gossip_s:
                self._gossip()
                self.next_gossip_s = now + self.config.gossip_s
            dirty = self._complete(now)
            while self.forwards and self.forwards[0][0] <= now:
                _, _, request, shard = heapq.heappop(self.forwards)
                self._submit(shard, request, now)
                dirty.add(shard)
            while index < len(arrivals) and arrivals[index].arrival_s <= now:
                dirty.add(self._arrive(arrivals[index], now))
                index += 1
            for shard in sorted(dirty):
                self._schedule(shard, now)
        homes = Counter(len(self.map.homes(f)) for f in self.map.shares)
        shard_gpus = {name: sum(1 for _ in s.gpus()) for name, s in self.shards.items()}
        wall_s = time.perf_counter() - started
        return ShardRun(self.config, self.calls, shard_gpus, self.window_s, wall_s, dict(sorted(homes.items())))

    def _gossip(self) -> None:
        loads = {name: load_of(name, scheduler) for name, scheduler in self.shards.items()}
        self.views = {home: {n: load for n, load in loads.items() if n != home} for home in self.shards}

    def _complete(self, now: float) -> set[str]:
        dirty: set[str] = set()
        while self.completions and self.completions[0][0] <= now:
            _, _, request_id, shard, load_s, inference_s = heapq.heappop(self.completions)
            self.shards[shard].on_complete(request_id, now, load_time_s=load_s, inference_time_s=inference_s)
            dirty.add(shard)
        return dirty

    def _arrive(self, request: Request, now: float) -> str:
        """A call reaches its home, which keeps it or forwards it; returns the shard to schedule."""
        home = self.map.home_of_call(request.function, request.request_id)
        self.calls[request.request_id] = CallRecord(request.arrival_s, home)
        target = home
        if len(self.shards) > 1:
            view = self.views[home]
            target = self.rule.target(request.model, home_load(home, self.shards[home], request.model), view.values())
        if target == home:
            self._submit(home, request, now)
            return home
        self.calls[request.request_id].spilled = True
        due = now + self.config.spill_rtt_s
        heapq.heappush(self.forwards, (due, next(self.ties), request, target))
        seen = self.views[home][target]  # the home counts down what it sent there until the next gossip
        idle = max(0, seen.idle_gpus - 1)
        self.views[home][target] = ShardLoad(target, idle, seen.queued, seen.idle_models if idle else frozenset())
        return home

    def _submit(self, shard: str, request: Request, now: float) -> None:
        record = self.calls[request.request_id]
        record.shard, record.at_shard_s = shard, now
        self.shards[shard].submit(request)

    def _schedule(self, shard: str, now: float) -> None:
        for decision in self.shards[shard].schedule(now):
            if not isinstance(decision, Dispatch):
                continue  # a Park: the call starts (a Dispatch) when that GPU's slot frees
            request, profile = decision.request, self.profiles[decision.request.model]
            record = self.calls[request.request_id]
            record.dispatch_s, record.hit = now, decision.hit
            load_s = None if decision.hit else profile.load_time_s
            end_s = now + (load_s or 0.0) + profile.inference_time_s
            entry = (end_s, next(self.ties), request.request_id, shard, load_s, profile.inference_time_s)
            heapq.heappush(self.completions, entry)


def simulate_shards(workload: Workload, config: ShardSimConfig, window_s: float) -> ShardRun:
    """Replay the workload's first `window_s` seconds through `config.shards` real Schedulers."""
    return _ShardedRun(workload, config, window_s).run()


def shard_cost_s(cost_us: float, gpus: int, growth_per_decade: float) -> float:
    """CPU seconds per placement of a scheduler over `gpus` GPUs: `cost_us` at 1,000 GPUs, times
    `growth_per_decade` per tenfold more GPUs (fewer: less)."""
    return cost_us * 1e-6 * math.pow(growth_per_decade, math.log10(gpus / 1000))


def lindley_responses(messages: Iterable[tuple[float, float, str]]) -> dict[str, float]:
    """Each message's response time (waiting + service) at a single first-come-first-served
    server: `messages` are (arrival_s, service_s, key); returns key -> response_s."""
    responses: dict[str, float] = {}
    free_at_s = -math.inf
    for arrival_s, service_s, key in sorted(messages):
        free_at_s = max(free_at_s, arrival_s) + service_s
        responses[key] = free_at_s - arrival_s
    return responses


def cpu_figures(
    run: ShardRun, cost_us: float, growth_per_decade: float, forward_fraction: float, warmup_s: float
) -> dict[str, Any]:
    """The CPU model laid over `run` at `cost_us` per placement (at 1,000 GPUs): latencies of the
    measured calls, each shard's utilization, and the placements per second the whole sustains."""
    cost_of = {shard: shard_cost_s(cost_us, gpus, growth_per_decade) for shard, gpus in run.shard_gpus.items()}
    messages: dict[str, list[tuple[float, float, str]]] = {shard: [] for shard in run.shard_gpus}
    for call_id, call in run.calls.items():
        messages[call.shard].append((call.at_shard_s, cost_of[call.shard], call_id))
        if call.spilled:
            messages[call.home].append((call.arrival_s, cost_of[call.home] * forward_fraction, "fwd:" + call_id))
    responses: dict[str, float] = {}
    for shard_messages in messages.values():
        responses.update(lindley_responses(shard_messages))
    work_s = {shard: sum(service for _, service, _ in m) for shard, m in messages.items()}
    # The scheduler processes' own part of Place -> Placement: the CPU's queueing and service,
    # and for a spilled call the home's forward and the round trip; then with the wait for a GPU.
    cpu_s = sorted(
        responses[call_id] + responses.get("fwd:" + call_id, 0.0) + (call.at_shard_s - call.arrival_s)
        for call_id, call in run.calls.items()
        if call.arrival_s >= warmup_s
    )
    latencies = sorted(
        responses[call_id] + responses.get("fwd:" + call_id, 0.0) + call.dispatch_s - call.arrival_s
        for call_id, call in run.calls.items()
        if call.arrival_s >= warmup_s
    )
    busiest_work_s = max(work_s.values())
    utilization = busiest_work_s / run.window_s
    return {
        "cost_us_at_1000_gpus": cost_us,
        "cost_us_per_shard": round(1e6 * statistics.fmean(cost_of.values()), 1),
        "capacity_placements_per_s": round(len(run.calls) / busiest_work_s),
        "max_shard_utilization": round(utilization, 3),
        "saturated": utilization >= 1.0,
        "p50_scheduler_ms": round(1e3 * percentile(cpu_s, 50), 3),
        "p99_scheduler_ms": round(1e3 * percentile(cpu_s, 99), 3),
        "p50_place_to_placement_ms": round(1e3 * percentile(latencies, 50), 3),
        "p99_place_to_placement_ms": round(1e3 * percentile(latencies, 99), 3),
    }


def run_figures(run: ShardRun, warmup_s: float) -> dict[str, Any]:
    """What the run decided, over the measured calls: hits, loads, spills, the shards' shares.
    ValueError when no call arrived after `warmup_s` (nothing to measure)."""
    measured = [call for call in run.calls.values() if call.arrival_s >= warmup_s]
    if not measured:
        raise ValueError(
            f"no call arrived between {warmup_s:g} s and {run.window_s:g} s: lower --warmup-s or raise --window-s"
        )
    loads = sum(not call.hit for call in measured)
    spilled = [call for call in measured if call.spilled]
    placed = Counter(call.shard for call in run.calls.values())
    queue_waits = sorted(call.dispatch_s - call.arrival_s for call in measured)
    return {
        "gpus": run.config.gpus,
        "shards": run.config.shards,
        "calls": len(run.calls),
        "measured_calls": len(measured),
        "offered_placements_per_s": round(len(run.calls) / run.window_s, 1),
        "hit_ratio": round(1 - loads / len(measured), 4),
        "loads": loads,
        "spill_rate": round(len(spilled) / len(measured), 4),
        "spills": len(spilled),
        "spilled_loads": sum(not call.hit for call in spilled),
        "busiest_shard_share": round(max(placed.values()) / len(run.calls), 4),
        "fair_share": round(1 / run.config.shards, 4),
        "functions_by_homes": run.homes,
        "p50_queue_wait_ms": round(1e3 * percentile(queue_waits, 50), 3),
        "p99_queue_wait_ms": round(1e3 * percentile(queue_waits, 99), 3),
        "sim_wall_s": round(run.wall_s, 1),
    }


def one_scheduler_limit_gpus(
    cost_us: float, calls_per_gpu_s: float, utilization: float, growth_per_decade: float
) -> int:
    """The largest cluster one scheduler serves at `utilization` of its core when each GPU offers
    `calls_per_gpu_s` placements per second (bisection on n: n x rate x c(n) = utilization)."""
    low, high = 1.0, 1e9
    for _ in range(200):
        middle = math.sqrt(low * high)
        if middle * calls_per_gpu_s * shard_cost_s(cost_us, round(middle), growth_per_decade) <= utilization:
            low = middle
        else:
            high = middle
    return int(low)


def sweep(
    sizes: Sequence[int], shard_counts: Sequence[int], args: Any, workload_for: dict[int, Workload]
) -> list[dict[str, Any]]:
    """Every (size, K) point: the run's figures, then the CPU model at each cost, and the
    comparison with K = 1 at the same size."""
    rows: list[dict[str, Any]] = []
    for gpus in sizes:
        baseline: dict[str, Any] | None = None
        for shards in shard_counts:
            if shards > math.ceil(gpus / 4) or gpus / shards < 4:
                continue
            config = ShardSimConfig(
                gpus,
                shards,
                gossip_s=args.gossip_ms / 1e3,
                spill_rtt_s=args.spill_rtt_ms / 1e3,
                queue_bound=args.queue_bound,
            )
            run = simulate_shards(workload_for[gpus], config, args.window_s)
            try:
                row = run_figures(run, args.warmup_s)
            except ValueError as exc:
                raise SystemExit(f"shard_sim: {gpus} GPUs, K = {shards}: {exc}") from None
            baseline = row if shards == 1 else baseline
            if baseline is not None:
                row["hit_ratio_minus_k1"] = round(row["hit_ratio"] - baseline["hit_ratio"], 4)
                row["extra_loads_vs_k1"] = row["loads"] - baseline["loads"]
            row["cpu"] = [
                cpu_figures(run, cost, args.growth_per_decade, args.forward_cost_fraction, args.warmup_s)
                for cost in args.costs_us
            ]
            rows.append(row)
            print(_row_line(row), flush=True)
    return rows


def _row_line(row: dict[str, Any]) -> str:
    cpu = " | ".join(
        f"{c['cost_us_at_1000_gpus']:.0f} us: cap {c['capacity_placements_per_s']:,}/s util "
        f"{c['max_shard_utilization']:.2f} sched p50/p99 {c['p50_scheduler_ms']:.2f}/"
        f"{c['p99_scheduler_ms']:.2f} ms, with GPU wait {c['p50_place_to_placement_ms']:.0f}/"
        f"{c['p99_place_to_placement_ms']:.0f} ms"
        for c in row["cpu"]
    )
    return (
        f"{row['gpus']:>6} GPUs K={row['shards']:>2}: {row['offered_placements_per_s']:,.0f}/s offered, hit "
        f"{row['hit_ratio']:.3f}, spill {row['spill_rate']:.3f}, busiest {row['busiest_shard_share']:.3f}, "
        f"sim {row['sim_wall_s']} s | {cpu}"
    )


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main() -> None:
    parser = results_parser(__doc__, "shard_sim.json")
    parser.add_argument("--sizes", default="100,1000,2000,5000,10000")
    parser.add_argument("--shards", default="1,2,4,8,16")
    parser.add_argument("--window-s", type=float, default=12.0, help="seconds of the trace's first minute")
    parser.add_argument("--warmup-s", type=float, default=4.0, help="calls arriving before are not measured")
    parser.add_argument("--costs-us", type=_floats, default=[MEASURED_COST_US, TARGET_COST_US])
    parser.add_argument("--growth-per-decade", type=float, default=1.3)
    parser.add_argument("--forward-cost-fraction", type=float, default=0.25)
    parser.add_argument("--gossip-ms", type=float, default=100.0)
    parser.add_argument("--spill-rtt-ms", type=float, default=0.5)
    parser.add_argument("--queue-bound", type=int, default=0)
    args = parser.parse_args()
    if not 0 <= args.warmup_s < args.window_s <= 60:
        parser.error("--warmup-s must be at least 0 and below --window-s, and --window-s at most 60 (one trace minute)")
    sizes = [int(size) for size in _floats(args.sizes)]
    shard_counts = [int(k) for k in _floats(args.shards)]
    trace = load_azure2019(shipped_trace())
    workload_for = {
        gpus: build_workload(
            trace,
            WorkloadConfig(minutes=1, working_set=len(trace.counts), rpm=round(PAPER_RPM * gpus / PAPER_GPUS)),
            paper_table1(),
        )
        for gpus in sizes
    }
    # Before the sweep: the commit and the edits the code it imports came from, not those at its end.
    meta = run_metadata(uncommitted=uncommitted(["scheduler", "cache_manager", "simulator"]))
    rows = sweep(sizes, shard_counts, args, workload_for)
    calls_per_gpu_s = PAPER_RPM / PAPER_GPUS / 60
    limits = [
        {
            "cost_us_at_1000_gpus": cost,
            "calls_per_gpu_s": rate,
            "utilization": utilization,
            "max_gpus": one_scheduler_limit_gpus(cost, rate, utilization, args.growth_per_decade),
        }
        for cost in args.costs_us
        for rate in (round(calls_per_gpu_s, 4), 2.0, 10.0)
        for utilization in (0.7, 1.0)
    ]
    document = {
        "meta": meta,
        "setup": {key: value for key, value in vars(args).items() if key != "out"}
        | {"policy": POLICY, "gpus_per_node": 4, "gpu_memory_mb": 8192, "slots": 1, "calls_per_gpu_s": calls_per_gpu_s},
        "rows": rows,
        "one_scheduler_limits": limits,
    }
    summary = [
        f"one scheduler at {lim['cost_us_at_1000_gpus']:.0f} us, {lim['calls_per_gpu_s']} calls/s per GPU, "
        f"utilization {lim['utilization']}: up to {lim['max_gpus']:,} GPUs"
        for lim in limits
    ]
    write_results(args.out, document, summary)


if __name__ == "__main__":
    main()
