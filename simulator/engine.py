"""The discrete-event engine: replays a workload through the real Scheduler and CacheManager."""

from __future__ import annotations

import heapq
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from cache_manager import CacheManager, eviction_policy
from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec
from scheduler import Dispatch, Estimator, Park, PolicyConfig, Scheduler, make_policy
from scheduler.policies import DEFAULT_MAX_NUM_SKIPS
from simulator.workload import Workload


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated cluster; the default is the paper's testbed: 3 nodes x 4 RTX 2080 (8 GB)."""

    gpus: int = 12
    gpu_memory_mb: int = 8192
    gpu_type: str = "rtx2080"
    eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise ValueError(f"gpus must be positive, got {self.gpus}")
        if self.gpu_memory_mb <= 0:
            raise ValueError(f"gpu_memory_mb must be positive, got {self.gpu_memory_mb}")


@dataclass(frozen=True, slots=True)
class SimResult:
    """The paper's metrics for one run (times in seconds, ratios in [0, 1])."""

    policy: str
    max_num_skips: int
    room_aware_misses: bool
    working_set: int
    gpus: int
    requests: int
    completed: int
    avg_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    miss_ratio: float
    false_miss_ratio: float  # false misses / misses: a miss although another GPU held the model
    avg_top_model_replicas: float  # time-weighted number of GPUs holding the most popular model
    gpu_utilization: float  # inference seconds / (GPUs x makespan); loading does not count
    function_latency_variance: float  # population variance of per-function average latency (s^2)
    hits: int
    misses: int
    false_misses: int
    parks: int
    makespan_s: float
    max_queue_len: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def simulate(
    workload: Workload,
    policy: str,
    *,
    cluster: ClusterConfig | None = None,
    max_num_skips: int = DEFAULT_MAX_NUM_SKIPS,
    room_aware_misses: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Run every request of `workload` to completion under `policy`.

    A GPU runs one request at a time; a miss costs the model's load time plus its inference time,
    a hit its inference time (the profiled figures: the simulator's ground truth); evictions are
    immediate. The scheduler's estimator starts from the same profiles and is fed every
    "measured" time, as the service feeds it. `room_aware_misses=False` runs Algorithm 2 to the
    letter (see PolicyConfig). `on_progress(completed)` is called per completion.
    """
    cluster = cluster if cluster is not None else ClusterConfig()
    scheduler = Scheduler(
        make_policy(policy, PolicyConfig(max_num_skips=max_num_skips, room_aware_misses=room_aware_misses)),
        estimator=Estimator(_as_gpu_type(workload.profiles, cluster.gpu_type)),
        cache=CacheManager(eviction_policy(cluster.eviction)),
    )
    for index in range(cluster.gpus):
        scheduler.add_gpu(GpuSpec(f"gpu{index:03d}", cluster.gpu_memory_mb, cluster.gpu_type))
    truth = {profile.model: profile for profile in workload.profiles}
    for profile in workload.profiles:
        scheduler.register_model(profile.spec())
    top_model = workload.function_models[workload.top_function]

    arrivals = workload.requests
    completions: list[tuple[float, int, str]] = []  # (time, tie-break, request_id)
    latencies: dict[str, float] = {}
    per_function: dict[str, list[float]] = defaultdict(list)
    hits = misses = false_misses = parks = 0
    inference_busy_s = 0.0
    replica_area = 0.0  # integral of the top model's replica count over time
    max_queue_len = 0
    # What each running request "measured" (load time on a miss, inference time), fed back on completion.
    measured: dict[str, tuple[float | None, float]] = {}
    now = 0.0
    next_arrival = 0
    tie = 0

    while next_arrival < len(arrivals) or completions:
        arrival_at = arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) else math.inf
        event_at = min(arrival_at, completions[0][0]) if completions else arrival_at
        replica_area += len(scheduler.cache.gpus_with(top_model)) * (event_at - now)
        now = event_at
        # Completions at this instant first: a GPU freed now can serve a request arriving now.
        while completions and completions[0][0] <= now:
            _, _, request_id = heapq.heappop(completions)
            load_s, inference_s = measured.pop(request_id)
            request = scheduler.on_complete(request_id, now, load_time_s=load_s, inference_time_s=inference_s)
            latency_s = now - request.arrival_s
            latencies[request_id] = latency_s
            per_function[request.function].append(latency_s)
            if on_progress is not None:
                on_progress(len(latencies))
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            scheduler.submit(arrivals[next_arrival])
            next_arrival += 1
        max_queue_len = max(max_queue_len, len(scheduler.queue))
        for decision in scheduler.schedule(now):
            if isinstance(decision, Park):
                parks += 1
                continue
            profile = truth[decision.request.model]
            inference_s = _inference_s(profile, decision)
            load_s = 0.0 if decision.hit else profile.load_time_s
            measured[decision.request.request_id] = (None if decision.hit else load_s, inference_s)
            if decision.hit:
                hits += 1
            else:
                misses += 1
                false_misses += decision.false_miss
            inference_busy_s += inference_s
            tie += 1
            heapq.heappush(completions, (now + load_s + inference_s, tie, decision.request.request_id))

    all_latencies = sorted(latencies.values())
    function_means = [statistics.fmean(values) for values in per_function.values()]
    dispatched = hits + misses
    makespan_s = now
    return SimResult(
        policy=policy,
        max_num_skips=max_num_skips if policy == "lalb-o3" else 0,
        room_aware_misses=room_aware_misses,
        working_set=len(workload.function_models),
        gpus=cluster.gpus,
        requests=len(arrivals),
        completed=len(latencies),
        avg_latency_s=statistics.fmean(all_latencies) if all_latencies else 0.0,
        p50_latency_s=percentile(all_latencies, 50),
        p99_latency_s=percentile(all_latencies, 99),
        miss_ratio=misses / dispatched if dispatched else 0.0,
        false_miss_ratio=false_misses / misses if misses else 0.0,
        avg_top_model_replicas=replica_area / makespan_s if makespan_s > 0 else 0.0,
        gpu_utilization=inference_busy_s / (cluster.gpus * makespan_s) if makespan_s > 0 else 0.0,
        function_latency_variance=statistics.pvariance(function_means) if len(function_means) > 1 else 0.0,
        hits=hits,
        misses=misses,
        false_misses=false_misses,
        parks=parks,
        makespan_s=makespan_s,
        max_queue_len=max_queue_len,
    )


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def _as_gpu_type(profiles: Sequence[ModelProfile], gpu_type: str) -> list[ModelProfile]:
    """The workload's profiles, relabelled for the simulated GPU type (the paper's testbed is
    homogeneous: one set of figures for every GPU)."""
    return [
        ModelProfile(p.model, gpu_type, p.memory_mb, p.load_time_s, p.inference_time_s, p.batch_size) for p in profiles
    ]


def _inference_s(profile: ModelProfile, decision: Dispatch) -> float:
    """Ground-truth inference time: the profile's, scaled linearly to the request's batch size."""
    return profile.inference_time_s * decision.request.batch_size / profile.batch_size
