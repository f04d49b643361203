"""The discrete-event engine: replays a workload through the real Scheduler and CacheManager.

The scheduler and the cache manager are the objects the control plane runs; what the simulator
adds is the ground truth of the GPUs, on a virtual clock:

- Each GPU has D slots (`ClusterConfig.slots`): the scheduler dispatches up to D calls to it at
  once. D = 1 is the paper's testbed: one call at a time per GPU.
- Each (GPU, model) worker runs one batch at a time. When it is free (its model loaded, no batch
  of it queued or running), it takes up to `Batching.max_batch_size` of the calls dispatched to
  it that are waiting, in dispatch order. With fewer waiting than that, a free worker waits up to
  `Batching.max_batch_wait_ms` for more (from when it is free with a call waiting), then takes
  what it has. Calls dispatched at one instant reach it together. Batching needs D > 1: only then
  can several calls reach one worker at once.
- A GPU computes one batch at a time: the batches of its workers run in the order they were
  formed (time-slicing the GPU among processes adds no compute). With `ClusterConfig.interference`
  = i instead, the batches of different workers run at once, each slowed down by 1 + i (k - 1)
  while k run (processor sharing): i = 0 is no interference (D calls in the time of one), i = 1
  gains nothing over one at a time (the default's throughput, in a different order), i > 1 is
  contention that costs throughput. The time a call reports is then what it took, slowdowns
  included, as a node measures it.
- A miss's load is a transfer: it does not hold the GPU's compute, but its worker cannot run until
  the load is done. It takes the profile's load time; evictions are immediate.
- The transfer-bandwidth model (`ClusterConfig.gpus_per_link` > 0): the GPUs of a node sit behind
  shared host links (PCIe switches), `gpus_per_link` GPUs each, and a load's bytes (the model's
  memory) cross them. A load is a fixed part (for a load from disk: the profile's load time less
  its bytes at `host_to_gpu_mb_s`; for a swap-in: 5 ms) and then a copy of its bytes; copies in
  flight share bandwidth: each runs at the lesser of an equal share of its GPU's own link
  (`host_to_gpu_mb_s`) and an equal share of its shared link (`link_mb_s`, default the same: a
  switch whose uplink is as wide as one GPU's link). Alone on its link a load takes exactly what
  it takes without the model; two at once behind one switch take up to twice as long.
- A host tier (`ClusterConfig.host_memory_mb` > 0 per node of `gpus_per_node` GPUs): what a GPU
  evicts stays in its node's host memory (the cache manager's `HostTier`), and a miss that takes
  it back is a swap-in: 5 ms plus the model's memory over `host_to_gpu_mb_s` (Torpor's pipelined
  copy from pinned memory), instead of the profile's load time. Off by default (the paper's testbed).
- EDAS's staged exit (`gpu_idle_release_s`, `host_idle_release_s`): a model unused on its GPU
  that long leaves it (into the host tier when there is one), one that long in the host tier
  leaves it, at the first check after: the clock stops for a check every release period, as the
  service's releaser makes them (`scheduler.staged_exit.release_check_period_s`: a quarter of the
  shorter timeout, 0.25-5 s). `avg_gpu_memory_gb` measures what that saves: the GPU memory held,
  averaged over time.
- Timing noise (`ClusterConfig.timing_spread` = c > 0): every load and every batch takes its time
  above times a factor drawn from a log-normal of mean 1 and coefficient of variation c, from
  random.Random(`timing_seed`) in event order (so a run is reproducible). Without it (c = 0, the
  default) the scheduler's estimates are exact, which no real cluster's are.
- A batch of k calls of b samples each takes t(k) = t(1) * k**beta, where t(1) is the profile's
  inference time scaled linearly to b samples and beta is `ClusterConfig.batch_exponent`. The
  default beta = 1 makes batching gain nothing, which keeps the paper's figures honest; real GPUs
  are sublinear (beta < 1: a batch of 4 costs less than 4 batches of 1) up to their saturation.
- Every call of a batch completes when its batch does; its slot is free then. The scheduler is
  told (`on_complete`) with the batch's inference time at batch size k x b samples, and the load
  time on the call whose dispatch loaded the model, so its estimator follows the ground truth as
  the service's follows the nodes' measurements.

- Deadlines, as on the real path (`scheduler.calls.CallBook.tick`): each call's is its function's
  timeout from arrival (`Workload.timeout_s`, FunctionSpec's default 60 s). A call still waiting
  for a GPU at its deadline, in the global queue or parked behind a GPU, is withdrawn from the
  scheduler (`Scheduler.cancel`, as the call book does), never runs, and counts as timed out
  (`SimResult.timed_out`), not among the latencies; the scheduler schedules again then. A call
  dispatched before its deadline and not done by it is cut there, as the node cuts it
  (`gpu_manager.pool`): it times out too, its slot freed then (`_cut_overdue`). One its worker
  runs (in its batch, or the load its dispatch started) has the worker killed: its batch stops
  (the compute not done uncounted), the scheduler hears the node's Done as the call book passes
  it on (`Scheduler.on_failure`, dropping the model from that GPU: the next call there is a
  miss), and the calls the worker held die with it (WORKER_DIED: placed again, elsewhere where
  the model fits, or time out if their deadline has come). One queued at its worker behind
  another is answered TIMEOUT (`Scheduler.on_complete`, nothing measured) and still runs there
  later, unreported. Not cut: calls under hit leases, and a load in flight on a shared link
  (`gpus_per_link`), whose call is treated as queued. (The call book's limit of two worker
  deaths per call, past which it answers UNAVAILABLE, is not modelled: such a call is placed
  again each time.)

- Hit leases (`ClusterConfig.hit_lease_s` > 0, docs/hit-leases.md): the calls come through one
  gateway that takes leases. A hit dispatched while nothing waits leases its slot by the call
  book's rules (`scheduler.leases`): the slot stays its request's after its call, and the
  function's next arrivals run there one at a time without the scheduler (each one's time fed to
  the estimator and the cache as a hit's: `Scheduler.on_lease_use`), those that come within the
  share of a lease time after the last that the gateway uses (`gateway.leases.USABLE_SHARE`).
  A lease ends, its slot freed once the call under it completes, when calls wait in the global
  queue (those in the way of the first, `leases_to_end`, or every lease), when a call is parked
  on its GPU (that GPU's), and when no call came for a lease time after the last; none is
  granted for a lease time after calls waited on running calls (not on idle leases, which such
  a wait ends: once their slots serve it, it is over). Ending one takes no time here (in the
  service, a round trip to its node).

With D = 1 and no batching this is exactly the one-call-at-a-time model: a miss takes load +
inference, a hit its inference.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypedDict, Unpack, cast

from mypy_extensions import mypyc_attr

from cache_manager import CacheManager, eviction_policy
from gateway.leases import USABLE_SHARE
from gpufaas.errors import ModelTooLarge
from gpufaas.functions import DEFAULT_TIMEOUT_S
from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, Request, check_positive
from scheduler import Dispatch, Estimator, Park, PolicyConfig, Scheduler, SchedulingPolicy, make_policy
from scheduler.adaptive_slots import AdaptiveSlots
from scheduler.calls import DEFAULT_CLAIM_S
from scheduler.estimator import DEFAULT_HOST_TO_GPU_MB_S, DEFAULT_SWAP_IN_OVERHEAD_S
from scheduler.leases import leases_to_end, may_lease, may_lease_on, running_seen
from scheduler.policies import DEFAULT_MAX_NUM_SKIPS
from scheduler.staged_exit import release_check_period_s
from simulator.workload import Workload


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated cluster; the default is the paper's testbed: 3 nodes x 4 RTX 2080 (8 GB),
    one call at a time per GPU. `batch_exponent` is beta of the module docstring."""

    gpus: int = 12
    gpu_memory_mb: int = 8192
    gpu_type: str = "rtx2080"
    eviction: str = "lru"
    slots: int = 1
    batch_exponent: float = 1.0
    timing_spread: float = 0.0  # c: coefficient of variation of load and batch times (0: exact)
    timing_seed: int = 0
    gpus_per_node: int = 4  # the paper's testbed: 3 nodes x 4 GPUs
    host_memory_mb: int = 0  # each node's host tier (0: none)
    host_to_gpu_mb_s: float = DEFAULT_HOST_TO_GPU_MB_S
    # EDAS's staged exit: a model unused this long leaves its GPU (for the host tier), and one
    # this long in the host tier leaves it (None: the stage is off). Checked on the service's period.
    gpu_idle_release_s: float | None = None
    host_idle_release_s: float | None = None
    # Concurrent batches on a GPU (D > 1): None, one at a time; i >= 0, all at once, each slowed
    # down by 1 + i (k - 1) while k run (see the module docstring).
    interference: float | None = None
    # The transfer-bandwidth model (see the module docstring): GPUs per shared host link (0: off,
    # every load takes its fixed time), and that link's bandwidth (None: host_to_gpu_mb_s).
    gpus_per_link: int = 0
    link_mb_s: float | None = None
    # Adaptive D (MQFQ-Sticky's controller, scheduler.adaptive_slots): each GPU's D moves between 1
    # and this, starting at `slots`, from its utilization against `utilization_threshold` every
    # 200 ms (None: D fixed at `slots`).
    adaptive_slots: int | None = None
    utilization_threshold: float = 0.9
    # Hit leases (the module docstring): how long a hit's lease lasts (0: none, the default).
    hit_lease_s: float = 0.0

    def __post_init__(self) -> None:
        check_positive("", gpus=self.gpus, gpu_memory_mb=self.gpu_memory_mb)
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}")
        if not (self.batch_exponent > 0 and math.isfinite(self.batch_exponent)):
            raise ValueError(f"batch_exponent must be a positive number, got {self.batch_exponent}")
        if self.gpus_per_node < 1 or self.host_memory_mb < 0 or not self.host_to_gpu_mb_s > 0:
            raise ValueError(
                f"gpus_per_node must be >= 1, host_memory_mb >= 0 and host_to_gpu_mb_s > 0, got "
                f"{self.gpus_per_node}, {self.host_memory_mb}, {self.host_to_gpu_mb_s}"
            )
        for name in ("gpu_idle_release_s", "host_idle_release_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds (or None: off), got {value}")
        if self.adaptive_slots is not None and (self.adaptive_slots < 1 or not 0 < self.utilization_threshold <= 1):
            raise ValueError(
                f"adaptive_slots must be >= 1 and utilization_threshold in (0, 1], got {self.adaptive_slots}, "
                f"{self.utilization_threshold}"
            )
        if self.gpus_per_link < 0 or (self.link_mb_s is not None and not self.link_mb_s > 0):
            raise ValueError(
                f"gpus_per_link must be >= 0 (0: no transfer model) and link_mb_s > 0, got {self.gpus_per_link}, "
                f"{self.link_mb_s}"
            )
        if self.interference is not None and not (0 <= self.interference <= 100):
            raise ValueError(f"interference must be in [0, 100] (None: one batch at a time), got {self.interference}")
        if not (0 <= self.hit_lease_s < math.inf):
            raise ValueError(f"hit_lease_s must be >= 0 seconds (0: no leases), got {self.hit_lease_s}")
        if not (0 <= self.timing_spread <= 10):
            raise ValueError(f"timing_spread must be in [0, 10] (a coefficient of variation), got {self.timing_spread}")


class Jitter:
    """Multiplicative timing noise: log-normal factors with mean 1 and coefficient of variation
    `spread`, from random.Random(seed); exactly 1.0 (and no draw) when `spread` is 0."""

    def __init__(self, spread: float, seed: int) -> None:
        self._rng = random.Random(seed)
        # For a log-normal, CV**2 = exp(sigma**2) - 1 and mean = exp(mu + sigma**2 / 2).
        self._sigma = math.sqrt(math.log1p(spread * spread))
        self._mu = -self._sigma * self._sigma / 2

    def factor(self) -> float:
        return self._rng.lognormvariate(self._mu, self._sigma) if self._sigma > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Batching:
    """How a function's calls may be merged on a worker (opt-in: the default merges nothing).

    `max_batch_size`: calls merged into one batch at most. `max_batch_wait_ms`: how long a free
    worker with fewer calls waiting than that waits for more before it runs what it has.
    """

    max_batch_size: int = 1
    max_batch_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if not (self.max_batch_wait_ms >= 0 and math.isfinite(self.max_batch_wait_ms)):
            raise ValueError(f"max_batch_wait_ms must be a non-negative number, got {self.max_batch_wait_ms}")


NO_BATCHING = Batching()


@dataclass(frozen=True, slots=True)
class SimResult:
    """The paper's metrics for one run (times in seconds, ratios in [0, 1])."""

    policy: str
    max_num_skips: int
    room_aware_misses: bool
    coldest_victim_misses: bool  # in effect only with room_aware_misses
    working_set: int
    gpus: int
    slots: int  # D: calls a GPU runs at once
    requests: int
    completed: int
    avg_latency_s: float
    # The mean time the calls' own batches ran on their GPUs: no policy can average less (no
    # queueing, no load, nothing else); a policy's latency above it is what scheduling costs.
    floor_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    miss_ratio: float
    false_miss_ratio: float  # false misses / misses: a miss although another GPU held the model
    avg_top_model_replicas: float  # time-weighted number of GPUs holding the most popular model
    # compute seconds (batches, each as if alone on its GPU) / (GPUs x makespan); loading does not
    # count. With interference below 1 overlapped batches do more than one GPU-second per second,
    # so it can exceed 1.
    gpu_utilization: float
    function_latency_variance: float  # population variance of per-function average latency (s^2)
    hits: int
    misses: int
    false_misses: int
    parks: int
    makespan_s: float
    max_queue_len: int
    max_batch_size: int  # the largest of any function's (1: no batching)
    max_batch_wait_ms: float  # the largest of any function's
    batch_exponent: float
    batches: int
    avg_batch_calls: float  # calls per batch
    timing_spread: float = 0.0
    mapping: str = "ends"  # how models were dealt to functions: "ends", or "seed K"
    host_memory_mb: int = 0  # per node
    swap_ins: int = 0  # misses that took the model back from the host tier
    eviction: str = "lru"
    # With SLOs (requests carrying slo_s): the share of calls answered within their SLO, and the
    # share of functions whose p98 latency is (Torpor's "SLO-compliant functions"); 1.0 without.
    slo_attainment: float = 1.0
    slo_functions_met: float = 1.0
    avg_gpu_memory_gb: float = 0.0  # time-averaged GPU memory the caches hold, cluster-wide
    releases: int = 0  # staged-exit releases (GPU -> host, host -> gone)
    literal_visits: bool = False  # Algorithm 1's visit counting read literally (PolicyConfig)
    interference_aware_loads: bool = True  # PolicyConfig's
    interference: float | None = None  # ClusterConfig's: None, D calls on a GPU run one at a time
    adaptive_slots: int | None = None  # ClusterConfig's: the most D may reach (None: D fixed)
    avg_slots: float = 1.0  # D, averaged over the GPUs and time
    slot_changes: int = 0  # steps of D the adaptive controller took
    # The floor (simulator.optimal): the fewest misses per request any eviction could have on this
    # workload's arrival order in the pooled GPU memory; None where it was not computed.
    optimal_miss_ratio: float | None = None
    optimal_exact: bool | None = None  # False: a bound the solver proved before its time limit
    gpus_per_link: int = 0  # ClusterConfig's: 0, no transfer model
    # With the transfer model: loads whose copy overlapped another copy on its shared link, and the
    # mean time a load took (fixed part and copy), in seconds.
    contended_loads: int = 0
    avg_load_s: float = 0.0
    # Waits from arrival until a call starts on a GPU (a parked call starts when its slot frees):
    # the longest of all, and each function's longest, in seconds (starvation shows here).
    max_wait_s: float = 0.0
    function_max_wait_s: dict[str, float] = field(default_factory=dict)
    hit_lease_s: float = 0.0  # ClusterConfig's: 0, no leases
    leases: int = 0  # hit placements that leased their slot
    lease_calls: int = 0  # calls run under a lease (without the scheduler; counted among the hits)
    # Calls still waiting for a GPU at their deadline, or dispatched and cut at it (the module
    # docstring): not in `completed` nor in the latency figures (those cover completed calls
    # only); their share of `requests`.
    timed_out: int = 0
    timeout_rate: float = 0.0
    # Calls refused at once because their model is larger than every simulated GPU (the service
    # answers them 503 at submit): never queued, not in `completed` nor the latencies; their share
    # of `requests`.
    rejected: int = 0
    rejection_rate: float = 0.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class Meter:
    """A run's live counts, for progress lines and benchmarks (read them while it runs, from its
    `on_progress`, or after). Brought up to date at every instant of the virtual clock. Runs that
    share one in turn (a comparison, a sweep) add to what the earlier ones counted; `now_s` is
    the running one's clock."""

    submitted: int = 0  # requests handed to the scheduler
    completed: int = 0
    # Arrivals submitted plus GPU events handled (batch ends, loads done, batching waits over,
    # copies starting and ending, stale ones included): the events of the discrete-event loop.
    events: int = 0
    instants: int = 0  # distinct times the clock stopped at (its own checks among them: _Run._on_timer)
    now_s: float = 0.0  # the virtual clock


# The policies that read PolicyConfig.max_num_skips (a call passed over that often goes first).
SKIP_LIMITED_POLICIES = ("lalb-o3", "mqfq-sticky", "torpor")


class PolicyOptions(TypedDict, total=False):
    """The PolicyConfig fields a simulation may set by keyword: every one but max_num_skips (a
    sweep varies it per run); one left out keeps PolicyConfig's default."""

    room_aware_misses: bool
    coldest_victim_misses: bool
    literal_visits: bool
    tier_aware_misses: bool
    interference_aware_loads: bool
    mqfq_overrun_s: float
    mqfq_ttl_alpha: float
    mqfq_swap_out: bool
    torpor_alpha: float
    torpor_alpha_period_s: float | None


def policy_options(config: PolicyConfig) -> PolicyOptions:
    """The PolicyOptions of `config` (every one PolicyOptions names), to pass on by keyword."""
    return cast(PolicyOptions, {name: getattr(config, name) for name in PolicyOptions.__annotations__})


def simulate(
    workload: Workload,
    policy: str,
    *,
    cluster: ClusterConfig | None = None,
    max_num_skips: int = DEFAULT_MAX_NUM_SKIPS,
    batching: Mapping[str, Batching] | None = None,
    on_progress: Callable[[int], None] | None = None,
    meter: Meter | None = None,
    **options: Unpack[PolicyOptions],
) -> SimResult:
    """Run every request of `workload` to completion under `policy` (the ground truth is in the
    module docstring). The scheduler's estimator starts from the same profiles as the ground
    truth and is fed every "measured" time, as the service feeds it. `room_aware_misses` and
    `coldest_victim_misses` are PolicyConfig's (False = Algorithm 2 to the letter), and so is
    `literal_visits` (True = Algorithm 1's visit counting to the letter), and
    `torpor_alpha_period_s` (None: torpor's alpha fixed), and `interference_aware_loads` (misses
    prefer GPUs whose shared host link is quiet; in effect with `ClusterConfig.gpus_per_link`). `batching`
    maps a function to how its calls may be merged; functions absent from it are not batched.
    `on_progress(ended)` is called per completion, and once more at the end if a call timed out or
    was refused, with the calls ended so far (completed, timed out, refused: `ended` reaches the
    workload's request count at the end); `meter`, if given, is kept up to date.
    """
    cluster = cluster if cluster is not None else ClusterConfig()
    check_runnable(workload, cluster)
    config = PolicyConfig(max_num_skips=max_num_skips, **options)
    run = _Run(
        workload,
        _make_scheduler(workload, make_policy(policy, config), cluster),
        cluster,
        batching if batching is not None else {},
    )
    run.run(on_progress, meter if meter is not None else Meter())
    return run.result(policy, config)


def oversized_models(workload: Workload, cluster: ClusterConfig) -> list[ModelProfile]:
    """The models `workload`'s functions use that no simulated GPU can hold (larger than
    `cluster.gpu_memory_mb`: every GPU has that much), in profile order; [] if all fit."""
    used = set(workload.function_models.values())
    return [p for p in workload.profiles if p.model in used and p.memory_mb > cluster.gpu_memory_mb]


def check_runnable(workload: Workload, cluster: ClusterConfig) -> None:
    """Raise ModelTooLarge, before any simulation, if no model `workload` uses fits a simulated
    GPU (every call would be refused), naming the memory a GPU needs. Where only some are too
    large the run goes ahead and their calls count as rejected (`SimResult.rejected`)."""
    oversized = oversized_models(workload, cluster)
    if oversized and len(oversized) == len(set(workload.function_models.values())):
        smallest = min(p.memory_mb for p in oversized)
        largest = max(p.memory_mb for p in oversized)
        raise ModelTooLarge(
            f"no model of the workload fits a GPU of {cluster.gpu_memory_mb} MB (they need {smallest}-{largest} MB): "
            f"give the GPUs at least {smallest} MB (gpufaas sim --gpu-memory-mb), {largest} MB to run every model"
        )


def _release_period_s(cluster: ClusterConfig, policy: SchedulingPolicy) -> float:
    """How often a run checks for idle models to release, as the service's releaser does: EDAS's
    staged exit, or the policy's swap-out (mqfq-sticky's keep-alive), which needs host tiers to
    move models into; inf where neither is on."""
    gpu_idle_s, host_idle_s = cluster.gpu_idle_release_s, cluster.host_idle_release_s
    swaps_out = policy.releases_memory and cluster.host_memory_mb > 0
    if gpu_idle_s is None and host_idle_s is None and not swaps_out:
        return math.inf
    return release_check_period_s(gpu_idle_s, host_idle_s, policy_releases=policy.releases_memory)


def _make_scheduler(workload: Workload, policy: SchedulingPolicy, cluster: ClusterConfig) -> Scheduler:
    """The scheduler the services run, over the simulated cluster: its GPUs (named `gpuNNN`, in
    nodes of `gpus_per_node`, behind links of `gpus_per_link`), its nodes' host tiers, and the
    workload's models, with an estimator that starts from the workload's profiles."""
    scheduler = Scheduler(
        policy,
        estimator=Estimator(
            _as_gpu_type(workload.profiles, cluster.gpu_type), host_to_gpu_mb_s=cluster.host_to_gpu_mb_s
        ),
        cache=CacheManager(eviction_policy(cluster.eviction)),
    )
    # Under adaptive D, within its bound from the first call (`AdaptiveSlots.start_slots`), as the
    # service registers GPUs.
    slots = cluster.slots if cluster.adaptive_slots is None else min(cluster.slots, cluster.adaptive_slots)
    for index in range(cluster.gpus):
        node = f"node{index // cluster.gpus_per_node}"
        link = (
            f"{node}/link{(index % cluster.gpus_per_node) // cluster.gpus_per_link}" if cluster.gpus_per_link else None
        )
        scheduler.add_gpu(
            GpuSpec(f"gpu{index:03d}", cluster.gpu_memory_mb, cluster.gpu_type, slots=slots, node=node, link=link)
        )
    if cluster.host_memory_mb > 0:
        for node_index in range(math.ceil(cluster.gpus / cluster.gpus_per_node)):
            scheduler.add_host(f"node{node_index}", cluster.host_memory_mb)
    for profile in workload.profiles:
        scheduler.register_model(profile.spec())
    return scheduler


# tests/unit/test_sim_scale.py checks its running totals from a subclass (it is compiled: gpufaas.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class _Run:
    """One simulation: the scheduler under test, the ground truth of the GPUs it drives, the
    virtual clock, and the tallies the result is made of. Lifecycle: made by `simulate`, `run`
    once, then read with `result`.

    The loop advances the clock to the next arrival or GPU event; at each instant it hands the
    scheduler the completions, then the arrivals, then (only if either happened) asks it to
    schedule and carries out its decisions on the GPUs. It also stops, with no event due, where
    a check of its own is (`_on_timer`: what the service does on a timer).
    """

    def __init__(
        self, workload: Workload, scheduler: Scheduler, cluster: ClusterConfig, batching: Mapping[str, Batching]
    ) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.cluster = cluster
        self.batching = batching
        self.gpus = _Gpus.of(workload, cluster, batching)
        self.link_of = {g.spec.gpu_id: g.spec.link for g in scheduler.gpus()}
        self.top_model = workload.function_models[workload.top_function]
        self.gpus_with = scheduler.cache.gpus_with  # the cache manager's holders of a model, bound once
        # Arrivals are read as a stream (a trace's are drawn as read): the next one not yet submitted,
        # None once all are; `next_arrival` counts those submitted.
        self.requests_total = len(workload.requests)
        self.arrivals = iter(workload.requests)
        self.upcoming = next(self.arrivals, None)
        self.next_arrival = 0
        self.now = 0.0  # the virtual clock; the makespan once the run is over
        self.scheduled_at = 0.0  # when the scheduler was last asked to schedule
        self.dispatch_ties = itertools.count(1)
        slots_max, threshold = cluster.adaptive_slots, cluster.utilization_threshold
        self.adaptive = (
            None if slots_max is None else AdaptiveSlots(slots_max, threshold=threshold, track_next_step=True)
        )
        # The clock's own checks (_on_timer), made as the service's timers make them: the staged
        # exit's every release period, adaptive D's next step; inf while none is due.
        self.release_period_s = self.release_at = _release_period_s(cluster, scheduler.policy)
        self.adapt_at = math.inf
        self.lease_at = math.inf  # ... and the call book's tick ending a lapsed lease (`_lapse_leases`)
        self.timer_s = self.release_at  # the first of them
        # Per completed call (none timed out), in completion order: latencies (all of them, for the
        # percentiles), each function's (for its mean), and those with an SLO (for the SLO figures).
        # Arrays of doubles, 8 bytes a call: a run of millions of calls keeps no object per call.
        self.latencies = array("d")
        self.per_function: dict[str, array[float]] = defaultdict(lambda: array("d"))
        self.slo = _SloTally()
        self.function_max_wait_s: dict[str, float] = {}  # arrival to dispatch, the longest
        self.hits = self.misses = self.false_misses = self.parks = self.swap_ins = self.releases = 0
        self.max_queue_len = 0
        self.replica_area = 0.0  # integral of the top model's replica count over time
        self.memory_area = 0.0  # integral of the GPU memory the caches hold (MB x s)
        self.slots_area = 0.0  # integral of the GPUs' D over time
        # What _integrate sums, kept up to date instead of summed over every GPU at every instant (at 1,000 GPUs that
        # sum was 80% of a run): each GPU's cache, the memory it held when last read, their total, the GPUs whose cache
        # may have changed since (a call completed there, the scheduler placed or parked a call or released a model
        # there: nothing else changes a GPU's cache), and the GPUs' D summed (it changes only with adaptive D).
        self.gpu_caches = {g.spec.gpu_id: scheduler.cache.gpu(g.spec.gpu_id) for g in scheduler.gpus()}
        self.used_mb = {gpu_id: cache.used_mb for gpu_id, cache in self.gpu_caches.items()}
        self.used_mb_total = sum(self.used_mb.values())
        self.touched_gpus: set[str] = set()
        self.slots_total = sum(g.spec.slots for g in scheduler.gpus())
        self.inference_s_sum = 0.0  # what each completed call's batch took on its GPU: the latency floor
        # Hit leases (the module docstring): by function, and by the running call under each.
        self.lease_s = cluster.hit_lease_s
        self.leased: dict[str, list[_Lease]] = {}
        self.lease_of: dict[str, _Lease] = {}
        self.waited_at = -math.inf  # when calls last waited in the global queue
        self.parked_at: dict[str, float] = {}  # per GPU, when a call was last parked there
        self.leases = self.lease_calls = self.rejected = 0  # (rejected: refused at submit, the model fits no GPU)
        self.deadlines = _Deadlines(workload, cuts=cluster.hit_lease_s == 0)  # (under leases: waiting calls' only)

    def run(self, on_progress: Callable[[int], None] | None, meter: Meter) -> None:
        """Submit every arrival and run every call to completion, one instant at a time,
        keeping `meter` up to date."""
        gpus, latencies = self.gpus, self.latencies
        # Bound once: the loop runs twice per request.
        next_event_s, complete, submit_arrivals = gpus.next_event_s, self._complete, self._submit_arrivals
        schedule, form_batches = self._schedule, gpus.form_batches
        # What earlier runs sharing the meter counted: this one's counts add to theirs.
        submitted_before, completed_before, events_before = meter.submitted, meter.completed, meter.events
        while True:
            event_s, upcoming = next_event_s(), self.upcoming
            if upcoming is None and not gpus.events_pending():
                if on_progress is not None and self.deadlines.timed_out + self.rejected:  # they end the run too
                    on_progress(len(latencies) + self.deadlines.timed_out + self.rejected)
                return
            now = self.now = event_s if upcoming is None or event_s < upcoming.arrival_s else upcoming.arrival_s
            deadline_s = self.deadlines.next_s()
            if self.timer_s <= now or deadline_s <= now:  # the clock's own checks are due first (or now)
                now = self.now = min(now, self.timer_s, deadline_s)
                if self.timer_s <= now:
                    self._on_timer(now)
                if deadline_s <= now:
                    self._expire(now)
            # Completions at this instant first: a slot freed now can serve a request arriving now.
            # (Each is asked only if its next event is due: most instants have one of the two.)
            completed = event_s <= now and complete(now, on_progress)
            arrived = upcoming is not None and upcoming.arrival_s <= now and submit_arrivals(now)
            # After the completions: a call whose batch ends at its deadline completed.
            cut = deadline_s <= now and _cut_overdue(self, now)
            # Only completions, arrivals and cuts change what the scheduler sees (a finished load
            # or a worker's batch do not): it is asked at those instants and no others.
            if completed or arrived or cut:
                schedule(now)
            form_batches(now)
            submitted = self.next_arrival
            meter.submitted = submitted_before + submitted
            meter.completed = completed_before + len(latencies)
            meter.events = events_before + submitted + gpus.events
            meter.instants += 1
            meter.now_s = now

    def _complete(self, now: float, on_progress: Callable[[int], None] | None) -> bool:
        """Report every call whose batch ended by `now` to the scheduler, with the times it took;
        True if there was one."""
        completed = self.gpus.advance(now)
        if not completed:
            return False
        on_complete, latencies, per_function = self.scheduler.on_complete, self.latencies, self.per_function
        touched_gpus = self.touched_gpus
        lease_of = self.lease_of
        done = self.deadlines.done
        for call, batch in completed:
            if call.given_up:
                continue  # cut at its deadline while queued: its slot was freed then, its answer dropped
            done(call.request.request_id)
            inference_s = batch.elapsed_s(now)
            lease = lease_of.pop(call.request.request_id, None) if lease_of else None
            if lease is not None and lease.ended_under(call.request.request_id, now):
                self._drop_lease(lease)  # its own call completes as a plain placement, with its times
                lease = None
            if lease is None:
                request = on_complete(
                    call.request.request_id,
                    now,
                    load_time_s=call.load_s,
                    inference_time_s=inference_s,
                    batch_size=batch.samples,
                )
            else:
                request = call.request
                self._lease_used(lease, inference_s, batch.samples, now)
            latency_s = now - request.arrival_s
            latencies.append(latency_s)
            self.inference_s_sum += inference_s
            per_function[request.function].append(latency_s)
            if request.slo_s is not None:
                self.slo.add(request.function, latency_s, request.slo_s)
            touched_gpus.add(batch.worker.gpu_id)
            if on_progress is not None:  # every call ended so far: those timed out or refused too
                on_progress(len(latencies) + self.deadlines.timed_out + self.rejected)
        return True

    def _submit_arrivals(self, now: float) -> bool:
        """Submit every request that has arrived by `now`; True if there was one."""
        upcoming = self.upcoming
        if upcoming is None or upcoming.arrival_s > now:
            return False
        submit, arrivals, submitted = self.scheduler.submit, self.arrivals, 0
        leased = self.leased
        while upcoming is not None and upcoming.arrival_s <= now:
            if not (leased and self._run_leased(upcoming, now)):
                try:
                    submit(upcoming)
                except ModelTooLarge:  # refused at once, as the service answers 503: never queued
                    self.rejected += 1
                else:
                    self.deadlines.add(upcoming)
            submitted += 1
            upcoming = next(arrivals, None)
        self.upcoming = upcoming
        self.next_arrival += submitted
        return True

    def _schedule(self, now: float) -> None:
        """Ask the scheduler and carry out its decisions on the GPUs; then adaptive D observes
        what runs."""
        self._integrate(now)
        self.max_queue_len = max(self.max_queue_len, len(self.scheduler.queue))
        leasing = self.lease_s > 0
        if leasing and self.leased:
            self._lapse_leases(now)
        hits, parked = self._carry_out(now, leasing)
        if leasing:
            self._leases_after(hits, parked, now)
        if self.adaptive is not None:
            self._adapt(now)

    def _expire(self, now: float) -> None:
        """The call book's tick: withdraw the calls still waiting at their deadline from the
        scheduler (they time out, never run), then schedule again, as it does."""
        if self.deadlines.expire(self.scheduler, now):
            self._schedule(now)

    def _on_timer(self, now: float) -> None:
        """The clock's own checks due now (before any event of this instant): the staged exit's
        and the policy's swap-out, every release period as the service's releaser makes them
        (a model idle past its timeout leaves at the first check after: not exactly on time, and
        not at the next call); adaptive D's next step, as the service's sampler would take it; the
        end of an idle lease whose time is up, as the call book's tick makes it."""
        self._integrate(now)  # what the caches held until now, before the releases change it
        if self.lease_at <= now:
            self._lapse_leases(now)
        if self.release_at <= now:
            for release in self.scheduler.release_idle(
                now, gpu_idle_s=self.cluster.gpu_idle_release_s, host_idle_s=self.cluster.host_idle_release_s
            ):
                self.releases += 1
                if release.gpu_id is not None:
                    self.touched_gpus.add(release.gpu_id)
                    self.gpus.release(release.gpu_id, release.model, now)
            self.release_at = now + self.release_period_s
        if self.adapt_at <= now:
            self._adapt(now)
        self.timer_s = min(self.release_at, self.adapt_at, self.lease_at)

    def _adapt(self, now: float) -> None:
        """Adaptive D, after a pass or at its next step: the controller observes what runs on each
        GPU from now on (this pass's placements among them: a GPU kept busy back to back reads
        busy), and where it moves a GPU's D the scheduler follows and fills a slot it opened at
        once, as the service's sampler does. Its next step is the clock's next check."""
        assert self.adaptive is not None
        if self._adapt_slots(now):
            leasing = self.lease_s > 0
            hits, parked = self._carry_out(now, leasing)
            if leasing:
                self._leases_after(hits, parked, now)
            self._adapt_slots(now)  # what that pass placed runs from now on
        self.adapt_at = self.adaptive.next_step_s
        self.timer_s = min(self.release_at, self.adapt_at, self.lease_at)

    def _adapt_slots(self, now: float) -> bool:
        """Tell the controller what runs on each GPU now and apply the D it moves; True if it moved one."""
        assert self.adaptive is not None
        lease_of = self.lease_of  # (a lease's holder is there while its own call runs)
        idle_leases = [lease.gpu_id for ls in self.leased.values() for lease in ls if lease.holder not in lease_of]
        changes = self.adaptive.observe(now, running_seen(self.scheduler, idle_leases))
        for gpu_id, slots in changes.items():
            self.scheduler.set_slots(gpu_id, slots)
        if changes:
            self.slots_total = sum(g.spec.slots for g in self.scheduler.gpus())
        return bool(changes)

    def _carry_out(self, now: float, leasing: bool = False) -> tuple[list[Dispatch], list[str]]:
        """Ask the scheduler to schedule and carry out its decisions; with `leasing`, the hits
        dispatched and the GPUs calls were parked on."""
        touched_gpus = self.touched_gpus
        hits: list[Dispatch] = []
        parked: list[str] = []
        for decision in self.scheduler.schedule(now):
            touched_gpus.add(decision.gpu_id)
            if isinstance(decision, Park):
                self.parks += 1
                if leasing:
                    parked.append(decision.gpu_id)
            else:
                self._dispatch(decision, now)
                if leasing and decision.hit:
                    hits.append(decision)
        return hits, parked

    # --- hit leases (the module docstring) ------------------------------------------------------
    def _leases_after(self, hits: list[Dispatch], parked: list[str], now: float) -> None:
        """After the scheduler's pass, as the call book does: while calls wait in the global queue
        the leases that hold up the first end (every lease, where none in particular does); a call
        parked on a GPU ends the leases there; and where nothing waits, the pass's hits lease their
        slots as the rules allow. The slots freed at once serve what waits (another pass)."""
        for gpu_id in parked:
            self.parked_at[gpu_id] = now
        if self.scheduler.queue:
            ending = _leases_for_wait(self.scheduler, self.leased)
        else:
            self._grant(hits, now)
            ending = []
        if parked:
            parked_on = set(parked)
            ending += [lease for leases in self.leased.values() for lease in leases if lease.gpu_id in parked_on]
        freed = False
        for lease in ending:
            if not lease.ending:
                freed = self._end_lease(lease, now) or freed
        if freed:  # the slots freed serve what waits: that pass says whether calls still wait
            self._leases_after(*self._carry_out(now, True), now)
        elif self.scheduler.queue:  # they wait on running calls (a busy lease's among them)
            self.waited_at = now

    def _lapse_leases(self, now: float) -> None:
        """End the idle leases whose time is up, and have the clock stop when the next one's is
        (ended at the next arrival or completion instead, a lapsed lease kept its model pinned,
        the staged exit's clock for it stopped)."""
        lapsed, self.lease_at = _lapsed_leases(self.leased, now)
        for lease in lapsed:
            self._end_lease(lease, now)
        self.timer_s = min(self.release_at, self.adapt_at, self.lease_at)

    def _grant(self, hits: list[Dispatch], now: float) -> None:
        """The hits just dispatched lease their slots where the call book's rules allow."""
        if not hits or not may_lease(self.scheduler, now, self.waited_at, self.lease_s):
            return
        for hit in hits:
            gpu_id = hit.gpu_id
            if may_lease_on(self.scheduler.gpu(gpu_id), now, self.parked_at.get(gpu_id, -math.inf), self.lease_s):
                request = hit.request
                lease = _Lease(request.request_id, gpu_id, request.function, math.inf, math.inf, now + DEFAULT_CLAIM_S)
                self.leased.setdefault(request.function, []).append(lease)
                self.lease_of[request.request_id] = lease
                self.leases += 1

    def _run_leased(self, request: Request, now: float) -> bool:
        """Run an arrival under an idle lease of its function, if there is one (True): one the
        gateway still uses (`usable_until_s`: the router's share of the lease time)."""
        for lease in self.leased.get(request.function, ()):
            if not lease.busy and not lease.ending and lease.usable_until_s > now:
                lease.busy = True
                self.lease_of[request.request_id] = lease
                self.lease_calls += 1
                self._dispatch(Dispatch(request, lease.gpu_id, True), now)
                return True
        return False

    def _lease_used(self, lease: _Lease, inference_s: float, samples: int, now: float) -> None:
        """A call under `lease` completed (its holder's own first): a use, and its time starts
        again; the lease's end, if it was ended meanwhile."""
        self.scheduler.on_lease_use(lease.holder, inference_time_s=inference_s, batch_size=samples)
        lease.busy = False
        lease.until_s = now + self.lease_s  # the next call must come within a lease time
        # ... and the gateway sends one only within its share of that (gateway.leases): past it,
        # it asks the scheduler, while the lease holds its slot until the call book ends it.
        lease.usable_until_s = now + self.lease_s * USABLE_SHARE
        if lease.ending:
            self._end_lease(lease, now)

    def _end_lease(self, lease: _Lease, now: float) -> bool:
        """End `lease`: its slot is freed now (True), or when the call under it completes."""
        lease.ending = True
        if lease.busy:
            return False
        self.scheduler.on_complete(lease.holder, now)
        self._drop_lease(lease)
        return True

    def _drop_lease(self, lease: _Lease) -> None:
        """`lease` is no more (its holder's slot freed by the caller)."""
        self.touched_gpus.add(lease.gpu_id)
        leases = self.leased[lease.function]
        leases.remove(lease)
        if not leases:
            del self.leased[lease.function]

    def _integrate(self, now: float) -> None:
        """Add the time since the scheduler was last asked to the time-weighted figures: the cache
        changes only in schedule(), so what it holds now it held since then."""
        touched_gpus = self.touched_gpus
        if touched_gpus:
            gpu_caches, used_mb_of, used_mb_total = self.gpu_caches, self.used_mb, self.used_mb_total
            for gpu_id in touched_gpus:
                used_mb = gpu_caches[gpu_id].used_mb
                used_mb_total += used_mb - used_mb_of[gpu_id]
                used_mb_of[gpu_id] = used_mb
            self.used_mb_total = used_mb_total
            touched_gpus.clear()
        elapsed_s = now - self.scheduled_at
        self.replica_area += len(self.gpus_with(self.top_model)) * elapsed_s
        self.memory_area += self.used_mb_total * elapsed_s
        self.slots_area += self.slots_total * elapsed_s
        self.scheduled_at = now

    def _dispatch(self, decision: Dispatch, now: float) -> None:
        """Count a dispatch (hit, miss, false miss, swap-in, its call's wait) and start it on its GPU."""
        if decision.hit:
            self.hits += 1
        else:
            self.misses += 1
            self.false_misses += decision.false_miss
            self.swap_ins += decision.from_host
        self.deadlines.started(
            *self.gpus.dispatch(decision, now, next(self.dispatch_ties), link=self.link_of[decision.gpu_id])
        )
        function = decision.request.function
        waited_s = now - decision.request.arrival_s
        if waited_s > self.function_max_wait_s.get(function, -1.0):
            self.function_max_wait_s[function] = waited_s

    def result(self, policy: str, config: PolicyConfig) -> SimResult:
        """The run's figures (once `run` has returned); `config` is the policy's."""
        return _result(self, policy, config)


def _result(run: _Run, policy: str, config: PolicyConfig) -> SimResult:
    """`_Run.result`'s work."""
    cluster, gpus, makespan_s = run.cluster, run.gpus, run.now
    all_latencies = sorted(run.latencies)
    slo_attainment, slo_functions_met = run.slo.figures()
    function_means = [statistics.fmean(values) for values in run.per_function.values()]
    dispatched = run.hits + run.misses
    return SimResult(
        policy=policy,
        max_num_skips=config.max_num_skips if policy in SKIP_LIMITED_POLICIES else 0,
        working_set=len(run.workload.function_models),
        requests=run.requests_total,
        completed=len(run.latencies),
        avg_latency_s=statistics.fmean(all_latencies) if all_latencies else 0.0,
        floor_latency_s=run.inference_s_sum / len(all_latencies) if all_latencies else 0.0,
        p50_latency_s=percentile(all_latencies, 50),
        p99_latency_s=percentile(all_latencies, 99),
        miss_ratio=run.misses / dispatched if dispatched else 0.0,
        false_miss_ratio=run.false_misses / run.misses if run.misses else 0.0,
        avg_top_model_replicas=run.replica_area / makespan_s if makespan_s > 0 else 0.0,
        avg_gpu_memory_gb=run.memory_area / makespan_s / 1024 if makespan_s > 0 else 0.0,
        gpu_utilization=gpus.compute_s() / (cluster.gpus * makespan_s) if makespan_s > 0 else 0.0,
        function_latency_variance=statistics.pvariance(function_means) if len(function_means) > 1 else 0.0,
        makespan_s=makespan_s,
        max_batch_size=max((b.max_batch_size for b in run.batching.values()), default=1),
        max_batch_wait_ms=max((b.max_batch_wait_ms for b in run.batching.values()), default=0.0),
        batches=gpus.batches,
        avg_batch_calls=gpus.batched_calls / gpus.batches if gpus.batches else 0.0,
        mapping=run.workload.mapping,
        slo_attainment=slo_attainment,
        slo_functions_met=slo_functions_met,
        avg_slots=run.slots_area / (makespan_s * cluster.gpus) if makespan_s > 0 else float(cluster.slots),
        slot_changes=run.adaptive.changes if run.adaptive is not None else 0,
        contended_loads=gpus.links.contended if gpus.links is not None else 0,
        avg_load_s=statistics.fmean(gpus.load_s) if gpus.load_s else 0.0,
        max_wait_s=max(run.function_max_wait_s.values(), default=0.0),
        timed_out=run.deadlines.timed_out,
        timeout_rate=run.deadlines.timed_out / run.requests_total if run.requests_total else 0.0,
        rejection_rate=run.rejected / run.requests_total if run.requests_total else 0.0,
        function_max_wait_s=dict(sorted(run.function_max_wait_s.items())),
        **{name: getattr(cluster, name) for name in _ECHOED_CLUSTER},
        **{name: getattr(config, name) for name in _ECHOED_CONFIG},
        **{name: getattr(run, name) for name in _COUNTED},
    )


# The result's fields that repeat the run's setting or a counter of the run under the same name.
_ECHOED_CLUSTER = (
    "gpus", "slots", "batch_exponent", "timing_spread", "host_memory_mb", "eviction", "interference",
    "adaptive_slots", "gpus_per_link", "hit_lease_s",
)  # fmt: skip
_ECHOED_CONFIG = ("room_aware_misses", "coldest_victim_misses", "literal_visits", "interference_aware_loads")
_COUNTED = (
    "releases", "hits", "misses", "false_misses", "parks", "max_queue_len", "swap_ins", "leases", "lease_calls",
    "rejected",
)  # fmt: skip


class _Deadlines:
    """The deadlines of the calls submitted to the scheduler and not yet done: a heap of
    (deadline, request id), from which a call no longer waiting nor running is dropped when it
    reaches the top. With `cuts`, those of the calls dispatched are kept too (with their call and
    worker): one still running at its deadline is overdue, for `_cut_overdue`."""

    def __init__(self, workload: Workload, *, cuts: bool = True) -> None:
        self._timeout_s = {function: workload.timeout_s(function) for function in workload.function_models}
        self._heap: list[tuple[float, str]] = []
        self._waiting: set[str] = set()
        self._cuts = cuts
        self._running: dict[str, tuple[_Call, _Worker]] = {}  # dispatched, not done (with `cuts`)
        self._overdue: list[tuple[_Call, _Worker]] = []  # running at their deadline, not cut yet
        self.timed_out = 0  # calls withdrawn or cut at their deadline

    def deadline_s(self, request: Request) -> float:
        return request.arrival_s + self._timeout_s.get(request.function, DEFAULT_TIMEOUT_S)

    def add(self, request: Request) -> None:
        """`request` was submitted: it waits, until its deadline at the latest."""
        heapq.heappush(self._heap, (self.deadline_s(request), request.request_id))
        self._waiting.add(request.request_id)

    def started(self, call: _Call, worker: _Worker) -> None:
        """The call started on `worker` (with `cuts`: until its deadline at the latest)."""
        request_id = call.request.request_id
        self._waiting.discard(request_id)
        if self._cuts:
            self._running[request_id] = (call, worker)

    def done(self, request_id: str) -> None:
        """The call completed (before its deadline, or at it)."""
        if self._running:
            self._running.pop(request_id, None)

    def next_s(self) -> float:
        """The earliest deadline of a call still waiting or running (inf: none)."""
        heap, waiting, running = self._heap, self._waiting, self._running
        while heap and heap[0][1] not in waiting and heap[0][1] not in running:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def expire(self, scheduler: Scheduler, now: float) -> int:
        """Withdraw the calls still waiting at their deadline (`now` or earlier) from `scheduler`,
        in deadline order, as the call book's tick does: they time out. Returns how many did.
        The running ones whose deadline came are overdue (`take_overdue`)."""
        heap, waiting, expired = self._heap, self._waiting, 0
        while heap and heap[0][0] <= now:
            request_id = heapq.heappop(heap)[1]
            if request_id in waiting:
                waiting.discard(request_id)
                if scheduler.cancel(request_id, now) is not None:  # (None: it runs already)
                    expired += 1
            elif request_id in self._running:
                self._overdue.append(self._running[request_id])
        self.timed_out += expired
        return expired

    def take_overdue(self) -> list[tuple[_Call, _Worker]]:
        """The calls found running at their deadline since the last take, in deadline order."""
        overdue, self._overdue = self._overdue, []
        return overdue

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def cut(self, call: _Call, now: float) -> bool:
        """The call's worker lost it at `now` (cut at its deadline, or killed with another): True
        if its deadline has come (it timed out), else it waits again (the call book retries it)."""
        request = call.request
        del self._running[request.request_id]
        if self.deadline_s(request) <= now:
            self.timed_out += 1
            return True
        self._waiting.add(request.request_id)  # (its deadline is still on the heap)
        return False


def _cut_overdue(run: _Run, now: float) -> bool:
    """The node's timeout, for the calls still running at their deadline (`now`): as
    gpu_manager.pool does, one the worker runs (in its batch, or loading its model) has the worker
    killed: the call book hears TIMEOUT with `worker_lost` and drops the model from that GPU
    (`Scheduler.on_failure(drop_model=True)`), and the calls it held die with it (WORKER_DIED:
    retried elsewhere before their deadline, `avoid_gpu`). One still queued at its worker is
    answered TIMEOUT, its slot freed (`on_complete`, nothing measured), and still runs there
    later, unreported. True if a call was cut (the scheduler has slots to fill)."""
    overdue = run.deadlines.take_overdue()
    deadlines, scheduler = run.deadlines, run.scheduler
    for call, worker in overdue:
        request_id = call.request.request_id
        if not deadlines.is_running(request_id):
            continue  # it died with an earlier one's worker
        run.touched_gpus.add(worker.gpu_id)
        batch = worker.batch
        in_batch = batch is not None and any(other is call for other in batch.calls)
        loading = call.load_s is not None and now < worker.loaded_at_s and run.gpus.links is None
        if not (in_batch or loading):
            call.given_up = True
            deadlines.cut(call, now)
            scheduler.on_complete(request_id, now)
            continue
        for lost in run.gpus.kill(worker, now):
            if not lost.given_up:  # (a given-up one's slot was freed at its deadline)
                retry = not deadlines.cut(lost, now)
                scheduler.on_failure(lost.request.request_id, now, drop_model=True, requeue=retry, avoid_gpu=retry)
    return bool(overdue)


SLO_PERCENTILE = 98.0  # Torpor's: a function meets its SLO when its p98 latency does


@dataclass(slots=True, eq=False)
class _Lease:
    """A leased slot: its holder (the scheduler's running request that keeps the slot), its GPU
    and function, when its time is up (the call book's), until when the gateway sends calls under
    it, by when its holder's own call must be done (past it, the call book's claim check has the
    node end the lease: leases serve calls shorter than the claim time), whether a call runs under
    it, and whether it was ended (its slot is freed once that call completes)."""

    holder: str
    gpu_id: str
    function: str
    until_s: float
    usable_until_s: float
    claim_by_s: float
    busy: bool = True  # its holder's own call first
    ending: bool = False

    def ended_under(self, request_id: str, now: float) -> bool:
        """Whether `request_id`, done at `now`, is the lease's own call and the lease ended while it
        ran (for a wait, or by the call book's claim check): the call book then completes that call
        as a plain placement (`on_complete` with its times), not as a use of the lease."""
        return request_id == self.holder and (self.ending or now >= self.claim_by_s)


def _leases_for_wait(scheduler: Scheduler, leased: Mapping[str, list[_Lease]]) -> list[_Lease]:
    """Calls wait in `scheduler`'s global queue: the leases of `leased` to end for its head, as the
    call book chooses them (`leases_to_end`; every lease where it names none). One ending already
    runs a call (it ends when that call completes): a running call's, its model stays pinned."""
    idle: dict[str, list[tuple[str, str]]] = {}
    by_holder: dict[str, _Lease] = {}
    for leases in leased.values():
        for lease in leases:
            if lease.ending:
                continue
            model = scheduler.gpu(lease.gpu_id).running[lease.holder].model
            idle.setdefault(lease.gpu_id, []).append((lease.holder, model))
            by_holder[lease.holder] = lease
    chosen = leases_to_end(scheduler, idle) if idle else []
    return list(by_holder.values()) if chosen is None else [by_holder[holder] for holder in chosen]


def _lapsed_leases(leased: Mapping[str, list[_Lease]], now: float) -> tuple[list[_Lease], float]:
    """The idle leases of `leased` whose time is up by `now` (the call book's tick ends them; a
    busy one goes on, as the node's answer to its if-idle end says: its time starts again when
    its call completes), and when the next of the others' is up (inf: none)."""
    lapsed: list[_Lease] = []
    next_s = math.inf
    for leases in leased.values():
        for lease in leases:
            if lease.busy or lease.ending:
                continue
            if lease.until_s <= now:
                lapsed.append(lease)
            else:
                next_s = min(next_s, lease.until_s)
    return lapsed, next_s


class _SloTally:
    """The completed calls that carry an SLO, tallied as they complete: calls within it, and
    each function's latencies and SLO (one per function: the workload gives all its calls one)."""

    def __init__(self) -> None:
        self.met = self.total = 0
        self.per_function: dict[str, array[float]] = defaultdict(lambda: array("d"))
        self.slo_of: dict[str, float] = {}

    def add(self, function: str, latency_s: float, slo_s: float) -> None:
        self.total += 1
        self.met += latency_s <= slo_s
        self.per_function[function].append(latency_s)
        self.slo_of[function] = slo_s

    def figures(self) -> tuple[float, float]:
        """(share of calls within their SLO, share of functions whose p98 latency is within
        it); (1.0, 1.0) when no completed call carried an SLO."""
        if not self.total:
            return 1.0, 1.0
        compliant = sum(
            percentile(sorted(values), SLO_PERCENTILE) <= self.slo_of[f] for f, values in self.per_function.items()
        )
        return self.met / self.total, compliant / len(self.per_function)


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def batch_inference_s(profile: ModelProfile, samples: int, calls: int, exponent: float) -> float:
    """Ground-truth compute time of one batch of `calls` calls holding `samples` samples in all:
    the profile's time scaled linearly to the calls' mean size, times calls**exponent."""
    return profile.inference_time_s * (samples / calls) / profile.batch_size * math.pow(calls, exponent)


# --- the ground truth of the GPUs --------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Call:
    """A dispatched call. `tie` is its dispatch order; `load_s` the load its dispatch caused."""

    request: Request
    tie: int
    load_s: float | None
    batch: _Batch | None = None  # the batch it runs in, once its worker formed one
    given_up: bool = False  # cut at its deadline while queued at its worker: it runs, unreported


@dataclass(slots=True)
class _Worker:
    """One (GPU, model) worker. Lifecycle: created by the miss that loads its model, dropped
    when the model is evicted (never while it has calls: the scheduler pins their model)."""

    gpu_id: str
    profile: ModelProfile
    loaded_at_s: float  # it can run from then on
    waiting: deque[_Call] = field(default_factory=deque)  # dispatched here, not yet in a batch
    busy: bool = False  # a batch of it is queued for, or running on, the GPU's compute
    wait_until_s: float | None = None  # free with fewer calls than a batch: runs what it has then
    batch: _Batch | None = None  # its batch while busy (None at the batch's end: no lasting cycle)
    dead: bool = False  # killed for a call past its deadline (`_Gpus.kill`): its events do nothing


@dataclass(slots=True)
class _Batch:
    worker: _Worker
    calls: list[_Call]
    samples: int
    compute_s: float  # alone on the GPU
    # With interference: the compute seconds (alone) it has left, when it started, and the end
    # its latest event is for (other events for it are stale; inf once it is done).
    left_s: float = 0.0
    started_s: float = 0.0
    end_s: float = math.nan

    def elapsed_s(self, now: float) -> float:
        """What the call took on the GPU as measured: its compute alone, or with interference,
        the time since it started."""
        return self.compute_s if math.isnan(self.end_s) else now - self.started_s


@dataclass(slots=True)
class _Copy:
    """A load's copy over its GPU's links (the transfer model). Lifecycle: made at dispatch, it
    joins its link when the load's fixed part is over (`_COPY_START`), shares bandwidth while the
    copies beside it come and go (each change reschedules its end), and ends the load."""

    worker: _Worker
    call: _Call
    link: str
    dispatched_s: float
    left_mb: float
    rate_mb_s: float = 0.0
    since_s: float = 0.0  # when left_mb was last brought up to date
    end_s: float = math.nan  # the end its latest event is for (inf once done)
    contended: bool = False  # it shared its link with another copy at some point


class _Links:
    """Shared host links (PCIe switches) and the copies in flight on them: each copy runs at the
    lesser of an equal share of its GPU's own link and an equal share of its shared link."""

    def __init__(self, gpu_mb_s: float, link_mb_s: float) -> None:
        self.gpu_mb_s = gpu_mb_s
        self.link_mb_s = link_mb_s
        self._copies: dict[str, list[_Copy]] = defaultdict(list)
        self.contended = 0  # copies that shared their link with another

    def join(self, copy: _Copy, now: float) -> list[_Copy]:
        """`copy` starts on its link; returns the copies there whose end moved."""
        self._progress(copy.link, now)
        copy.since_s = now
        self._copies[copy.link].append(copy)
        return self._rerate(copy.link, now)

    def leave(self, copy: _Copy, now: float) -> list[_Copy]:
        """`copy` is done; returns the copies left on its link whose end moved."""
        self._progress(copy.link, now)
        self._copies[copy.link].remove(copy)
        copy.end_s = math.inf
        return self._rerate(copy.link, now)

    def _progress(self, link: str, now: float) -> None:
        for copy in self._copies[link]:
            copy.left_mb -= copy.rate_mb_s * (now - copy.since_s)
            copy.since_s = now

    def _rerate(self, link: str, now: float) -> list[_Copy]:
        copies = self._copies[link]
        on_gpu: dict[str, int] = defaultdict(int)
        for copy in copies:
            on_gpu[copy.worker.gpu_id] += 1
        moved: list[_Copy] = []
        for copy in copies:
            if len(copies) > 1 and not copy.contended:
                copy.contended = True
                self.contended += 1
            copy.rate_mb_s = min(self.gpu_mb_s / on_gpu[copy.worker.gpu_id], self.link_mb_s / len(copies))
            end_s = now + max(0.0, copy.left_mb) / copy.rate_mb_s
            if end_s != copy.end_s:
                copy.end_s = end_s
                moved.append(copy)
        return moved


# Event kinds, in the order they are handled at one instant: completions free compute first.
_BATCH_END, _LOAD_DONE, _WAIT_OVER, _COPY_START = 0, 1, 2, 3
# (time, kind, tie, subject); (time, kind, tie) is unique.
_Event = tuple[float, int, int, _Batch | _Worker | _Copy]


class _Gpus:
    """The simulated GPUs: workers, batches, compute queues, on the caller's virtual clock."""

    @classmethod
    def of(cls, workload: Workload, cluster: ClusterConfig, batching: Mapping[str, Batching]) -> _Gpus:
        """The GPUs of `cluster` running `workload`'s models as their profiles say (the truth)."""
        return cls(
            {profile.model: profile for profile in workload.profiles},
            batching,
            cluster.batch_exponent,
            Jitter(cluster.timing_spread, cluster.timing_seed),
            cluster.host_to_gpu_mb_s,
            interference=cluster.interference,
            links=_Links(cluster.host_to_gpu_mb_s, cluster.link_mb_s or cluster.host_to_gpu_mb_s)
            if cluster.gpus_per_link
            else None,
        )

    def __init__(
        self,
        truth: dict[str, ModelProfile],
        batching: Mapping[str, Batching],
        exponent: float,
        jitter: Jitter,
        host_to_gpu_mb_s: float,
        *,
        interference: float | None = None,
        links: _Links | None = None,
    ) -> None:
        self._truth = truth
        self._interference = interference
        self.links = links
        self.load_s: list[float] = []  # what each load took, fixed part and copy (transfer model)
        self._running: dict[str, list[_Batch]] = defaultdict(list)  # with interference: per GPU
        self._progressed_s: dict[str, float] = {}  # when the GPU's running batches' left_s was last updated
        self._jitter = jitter
        self._host_to_gpu_mb_s = host_to_gpu_mb_s
        self._batching = batching
        self._exponent = exponent
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._ready: dict[str, deque[_Batch]] = defaultdict(deque)  # per GPU, batches waiting for compute
        self._computing: set[str] = set()  # GPUs running a batch
        self._events: list[_Event] = []
        # Workers that may form a batch at the current instant (a call came, a load or a batch
        # ended, a wait ran out), in the order that happened: they form it at the instant's end.
        self._stirred: dict[tuple[str, str], _Worker] = {}
        self._wait_ties = itertools.count()
        # Every batch's compute seconds, summed exactly (math.fsum) at the end: the total does not
        # depend on the order in which batches happened to start, and costs 8 bytes a batch (a
        # list of (tie, seconds) to sort held 1.5 GB over the shipped trace's whole span).
        self._compute_s = array("d")
        self.batches = 0
        # Calls the batches held: not the calls dispatched, some of which are cut at their
        # deadline before a batch takes them.
        self.batched_calls = 0
        self.events = 0  # events popped off the heap, stale ones included
        # Only interference reschedules batch ends, only shared links move copies' ends, and only a
        # batching wait can be ended early (by a full batch): without any, no event is ever stale.
        waits = any(b.max_batch_wait_ms > 0 for b in batching.values())
        self._may_go_stale = interference is not None or links is not None or waits

    def events_pending(self) -> bool:
        """Whether any event is due, stale ones dropped by the last `next_event_s`."""
        return bool(self._events)

    def next_event_s(self) -> float:
        if self._may_go_stale:
            self._drop_stale()
        return self._events[0][0] if self._events else math.inf

    def _drop_stale(self) -> None:
        """Pop batch ends and copy ends that a later reschedule replaced (with interference, or
        shared links), and batching waits that a full batch ended early, so that they neither
        wake the clock nor stretch the makespan."""
        events = self._events
        while events:
            at_s, kind, _, subject = events[0]
            # Live: a copy's start, a load done (its worker alive), a batch end without interference
            # (NaN; inf once its worker was killed), or the latest end or wait of its subject.
            if isinstance(subject, _Copy):
                if kind == _COPY_START or subject.end_s == at_s:
                    return
            elif isinstance(subject, _Worker):
                if (kind == _LOAD_DONE and not subject.dead) or subject.wait_until_s == at_s:
                    return
            elif math.isnan(subject.end_s) or subject.end_s == at_s:
                return
            heapq.heappop(events)
            self.events += 1

    def compute_s(self) -> float:
        return math.fsum(self._compute_s)

    def dispatch(self, decision: Dispatch, now: float, tie: int, *, link: str | None = None) -> tuple[_Call, _Worker]:
        """A call starts on its GPU: on a miss its model starts loading there (over `link` with
        the transfer model). Returns the call and its worker."""
        request, gpu_id = decision.request, decision.gpu_id
        for victim in decision.evict:
            self._remove(gpu_id, victim, now, "evicted")
        profile = self._truth[request.model]
        if decision.hit:
            call = _Call(request, tie, None)
            worker = self._workers[(gpu_id, request.model)]
        else:
            if decision.from_host:
                base_s = DEFAULT_SWAP_IN_OVERHEAD_S + profile.memory_mb / self._host_to_gpu_mb_s
            else:
                base_s = profile.load_time_s
            factor = self._jitter.factor()
            load_s = base_s * factor
            if self.links is not None and link is not None:
                # The copy of the model's bytes after the load's fixed part, at the links' pace.
                copy_s = profile.memory_mb / self._host_to_gpu_mb_s
                fixed_s = (DEFAULT_SWAP_IN_OVERHEAD_S if decision.from_host else max(0.0, base_s - copy_s)) * factor
                call = _Call(request, tie, load_s)
                worker = _Worker(gpu_id, profile, math.inf)
                copy = _Copy(worker, call, link, now, profile.memory_mb * factor)
                heapq.heappush(self._events, (now + fixed_s, _COPY_START, tie, copy))
            else:
                call = _Call(request, tie, load_s)
                worker = _Worker(gpu_id, profile, now + load_s)
                self.load_s.append(load_s)
                heapq.heappush(self._events, (worker.loaded_at_s, _LOAD_DONE, tie, worker))
            self._workers[(gpu_id, request.model)] = worker
        worker.waiting.append(call)
        self._stir(worker)
        return call, worker

    def release(self, gpu_id: str, model: str, now: float) -> None:
        """The scheduler released an idle model from a GPU: its worker goes."""
        self._remove(gpu_id, model, now, "released")

    def _remove(self, gpu_id: str, model: str, now: float, action: str) -> None:
        """The scheduler `action` (evicted, released) `model` from `gpu_id`: its worker goes, with
        the calls cut at their deadline while queued there (their slots free, their answers
        dropped: `_cut_overdue`). Any other call still there is a bug (RuntimeError)."""
        worker = self._workers.get((gpu_id, model))
        if worker is None:
            return
        held = list(worker.waiting) + (worker.batch.calls if worker.batch is not None else [])
        if not all(call.given_up for call in held):
            raise RuntimeError(f"the scheduler {action} {model!r} from {gpu_id!r} while calls use it")
        if held:
            self.kill(worker, now)
        else:
            del self._workers[(gpu_id, model)]

    def advance(self, now: float) -> list[tuple[_Call, _Batch]]:
        """Handle every event due by `now`; returns the calls completed, in completion order."""
        completed: list[tuple[_Call, _Batch]] = []
        events = self._events
        while events and events[0][0] <= now:
            at_s, kind, _, subject = heapq.heappop(events)
            self.events += 1
            if isinstance(subject, _Batch):
                worker = subject.worker
                if self._interference is not None:
                    if subject.end_s != at_s:
                        continue  # rescheduled since: a batch joined or left its GPU
                    self._progress(worker.gpu_id, at_s)
                    self._running[worker.gpu_id].remove(subject)
                    subject.end_s = math.inf  # done: any other event for it is stale
                    self._reschedule(worker.gpu_id, at_s)
                else:
                    if subject.end_s == math.inf:
                        continue  # its worker was killed (`kill`)
                    self._computing.discard(worker.gpu_id)
                    if self._ready[worker.gpu_id]:
                        self._start_next(worker.gpu_id, now)
                worker.busy = False
                worker.batch = None
                completed.extend((call, subject) for call in subject.calls)
                self._stir(worker)
            elif isinstance(subject, _Copy):
                self._copy_event(subject, kind, at_s)
            elif (kind == _LOAD_DONE or subject.wait_until_s == at_s) and not subject.dead:
                self._stir(subject)
            # else: a wait that a full batch ended early
        return completed

    def kill(self, worker: _Worker, now: float) -> list[_Call]:
        """The node killed `worker` at `now` (a call in it outlived its deadline: `_cut_overdue`):
        its batch stops (the compute it did not do uncounted), a load in flight is abandoned, and
        it is gone from its GPU. Returns the calls it held, its batch's and those waiting: none of
        them completes."""
        key = (worker.gpu_id, worker.profile.model)
        if self._workers.get(key) is worker:
            del self._workers[key]
        if self._stirred.get(key) is worker:
            del self._stirred[key]
        calls = list(worker.waiting)
        worker.waiting.clear()
        batch = worker.batch
        if batch is not None:
            calls = batch.calls + calls
            self._stop(batch, now)
        worker.batch, worker.busy, worker.wait_until_s, worker.dead = None, False, None, True
        self._may_go_stale = True  # its batch's end and its wait are stale events now
        return calls

    def _stop(self, batch: _Batch, now: float) -> None:
        """`batch` stops at `now`, before its end: its GPU goes on with the others."""
        gpu_id = batch.worker.gpu_id
        if self._interference is not None:
            self._progress(gpu_id, now)
            self._running[gpu_id].remove(batch)
            self._compute_s.append(-max(0.0, batch.left_s))
            batch.end_s = math.inf
            self._reschedule(gpu_id, now)
            return
        ready = self._ready[gpu_id]
        for index, other in enumerate(ready):
            if other is batch:
                del ready[index]  # it never started: none of its compute was counted
                return
        self._compute_s.append(-(batch.started_s + batch.compute_s - now))
        batch.end_s = math.inf
        self._computing.discard(gpu_id)
        if ready:
            self._start_next(gpu_id, now)

    def _copy_event(self, copy: _Copy, kind: int, at_s: float) -> None:
        """A copy joins its link, or ends (its load is done) unless a change since moved its end."""
        assert self.links is not None
        if kind == _COPY_START:
            moved = self.links.join(copy, at_s)
        elif copy.end_s == at_s:
            moved = self.links.leave(copy, at_s)
            copy.worker.loaded_at_s = at_s
            copy.call.load_s = at_s - copy.dispatched_s
            self.load_s.append(copy.call.load_s)
            if not copy.worker.dead:
                self._stir(copy.worker)
        else:
            return  # stale: rescheduled since
        for other in moved:
            heapq.heappush(self._events, (other.end_s, _LOAD_DONE, other.call.tie, other))

    def form_batches(self, now: float) -> None:
        """End the instant: every stirred worker that is free forms its batch, or starts waiting."""
        if not self._stirred:
            return
        stirred, self._stirred = self._stirred, {}
        try_batch = self._try_batch
        for worker in stirred.values():
            # _try_batch's first test, made here: most stirred workers (a batch just ended) have
            # nothing waiting.
            if worker.waiting and not worker.busy and now >= worker.loaded_at_s:
                try_batch(worker, now)

    def _stir(self, worker: _Worker) -> None:
        self._stirred[(worker.gpu_id, worker.profile.model)] = worker

    def _try_batch(self, worker: _Worker, now: float) -> None:
        """Form the worker's next batch if it is free and has calls (and no reason to wait)."""
        if worker.busy or not worker.waiting or now < worker.loaded_at_s:
            return
        batching = (
            self._batching.get(worker.waiting[0].request.function, NO_BATCHING) if self._batching else NO_BATCHING
        )
        if len(worker.waiting) < batching.max_batch_size and batching.max_batch_wait_ms > 0:
            if worker.wait_until_s is None:
                worker.wait_until_s = now + batching.max_batch_wait_ms / 1000.0
                heapq.heappush(self._events, (worker.wait_until_s, _WAIT_OVER, next(self._wait_ties), worker))
            if now < worker.wait_until_s:
                return
        if batching.max_batch_size == 1:  # the common case, one call a batch
            calls = [worker.waiting.popleft()]
            samples = calls[0].request.batch_size
        else:
            calls = [worker.waiting.popleft() for _ in range(min(len(worker.waiting), batching.max_batch_size))]
            samples = sum(call.request.batch_size for call in calls)
        compute_s = batch_inference_s(worker.profile, samples, len(calls), self._exponent) * self._jitter.factor()
        worker.busy = True
        worker.wait_until_s = None
        self.batches += 1
        self.batched_calls += len(calls)
        batch = worker.batch = _Batch(worker, calls, samples, compute_s)
        if self._interference is not None:
            self._compute_s.append(compute_s)
            self._progress(worker.gpu_id, now)
            batch.left_s, batch.started_s = compute_s, now
            self._running[worker.gpu_id].append(batch)
            self._reschedule(worker.gpu_id, now)
            return
        self._ready[worker.gpu_id].append(batch)
        if worker.gpu_id not in self._computing:
            self._start_next(worker.gpu_id, now)

    def _slowdown(self, running: int) -> float:
        assert self._interference is not None
        return 1.0 + self._interference * max(0, running - 1)

    def _progress(self, gpu_id: str, now: float) -> None:
        """Count the compute the GPU's running batches did since the last change."""
        running = self._running[gpu_id]
        since_s = self._progressed_s.get(gpu_id, now)
        if running and now > since_s:
            done_s = (now - since_s) / self._slowdown(len(running))
            for batch in running:
                batch.left_s -= done_s
        self._progressed_s[gpu_id] = now

    def _reschedule(self, gpu_id: str, now: float) -> None:
        """The running batches' ends at the GPU's new slowdown (an event each whose end moved)."""
        running = self._running[gpu_id]
        slowdown = self._slowdown(len(running))
        for batch in running:
            end_s = now + max(0.0, batch.left_s) * slowdown
            if end_s != batch.end_s:
                batch.end_s = end_s
                heapq.heappush(self._events, (end_s, _BATCH_END, batch.calls[0].tie, batch))

    def _start_next(self, gpu_id: str, now: float) -> None:
        batch = self._ready[gpu_id].popleft()
        batch.started_s = now  # (read only if its worker is killed before its end: `_stop`)
        self._computing.add(gpu_id)
        self._compute_s.append(batch.compute_s)
        heapq.heappush(self._events, (now + batch.compute_s, _BATCH_END, batch.calls[0].tie, batch))


def _as_gpu_type(profiles: Sequence[ModelProfile], gpu_type: str) -> list[ModelProfile]:
    """The workload's profiles, relabelled for the simulated GPU type (the paper's testbed is
    homogeneous: one set of figures for every GPU)."""
    return [
        ModelProfile(p.model, gpu_type, p.memory_mb, p.load_time_s, p.inference_time_s, p.batch_size) for p in profiles
    ]
