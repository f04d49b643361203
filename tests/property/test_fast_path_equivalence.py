"""Property test of the scheduler's fast path: with it (`Scheduler(fast_path=True)`) and without it,
the same random events give the same decisions and the same committed state after every event.

Two schedulers built alike, one taking `SchedulingPolicy.lone_target` where it answers and one
always running the full fill (the `Draft`), go through one random sequence of events drawn as it
runs: arrivals (one or a burst), completions (with measured times), failures (dropping the model,
retrying, avoiding the GPU), cancellations, GPUs joining and leaving, changes of D, the staged
exit's releases, and time passing. After each event the two must have returned the same thing
(decisions, requeued requests, releases, or the same exception) and hold the same state
(`snapshot`). Every policy, D = 1 and D = 4 (or a mix), with and without host tiers and shared
host links, Algorithm 1 literal or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Estimator, PolicyConfig, Scheduler, make_policy

POLICIES = ("lb", "lalb", "lalb-o3", "mqfq-sticky", "torpor")
GPU_TYPE = "rtx2080"
MODELS = {"m0": 1000, "m1": 1500, "m2": 2500, "m3": 3000, "m4": 800, "m5": 2000}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Setup:
    """One configuration: the policy and its switches, the GPUs' D, host tiers, shared links."""

    policy: str
    slots: tuple[int, ...]  # D of each initial GPU
    memories_mb: tuple[int, ...]
    host_tier: bool
    links: bool
    literal_visits: bool
    max_num_skips: int


@dataclass(frozen=True)
class Config:
    """What each run of one configuration shares: D (an int, or "mixed": 1 to 4 per GPU), host
    tiers, shared host links, Algorithm 1 literal."""

    slots: int | str
    host_tier: bool = False
    links: bool = False
    literal_visits: bool = False

    def __str__(self) -> str:
        switches = [name for name in ("host_tier", "links", "literal_visits") if getattr(self, name)]
        return "-".join([f"D{self.slots}", *switches])


CONFIGS = (
    Config(1),
    Config(4),
    Config(1, host_tier=True),
    Config(4, host_tier=True, links=True),
    Config("mixed", host_tier=True, links=True),
    Config(4, literal_visits=True),
)


@st.composite
def setups(draw: st.DrawFn, policy: str, config: Config) -> Setup:
    """1 to 6 GPUs of mixed memory sizes (some models fit only some), in `config`."""
    count = draw(st.integers(1, 6))
    slots = tuple(draw(st.integers(1, 4)) if config.slots == "mixed" else int(config.slots) for _ in range(count))
    memories = tuple(draw(st.sampled_from([3000, 4000, 6000, 8000])) for _ in range(count))
    return Setup(
        policy=policy,
        slots=slots,
        memories_mb=memories,
        host_tier=config.host_tier,
        links=config.links,
        literal_visits=config.literal_visits,
        max_num_skips=draw(st.sampled_from([0, 1, 3, 25])),
    )


def gpu_spec(index: int, memory_mb: int, slots: int, setup: Setup) -> GpuSpec:
    node = f"n{index // 2}"  # two GPUs per node: they share its host tier (and link)
    return GpuSpec(
        f"g{index}",
        memory_mb,
        speed=(1.0, 2.0)[index % 2],
        slots=slots,
        node=node,
        link=f"{node}-switch" if setup.links else None,
    )


def build(setup: Setup, *, fast_path: bool) -> Scheduler:
    estimator = Estimator(ModelProfile(name, GPU_TYPE, mb, 2.0 + mb / 1000, 0.5, 32) for name, mb in MODELS.items())
    config = PolicyConfig(max_num_skips=setup.max_num_skips, literal_visits=setup.literal_visits)
    scheduler = Scheduler(make_policy(setup.policy, config), estimator=estimator, fast_path=fast_path)
    for index, (memory_mb, slots) in enumerate(zip(setup.memories_mb, setup.slots, strict=True)):
        add_gpu(scheduler, gpu_spec(index, memory_mb, slots, setup), setup)
    for name, memory_mb in MODELS.items():
        scheduler.register_model(ModelSpec(name, memory_mb))
    return scheduler


def add_gpu(scheduler: Scheduler, spec: GpuSpec, setup: Setup) -> None:
    assert spec.node is not None
    if setup.host_tier and scheduler.cache.host(spec.node) is None:
        scheduler.add_host(spec.node, 4000)
    scheduler.add_gpu(spec)


# --- what the two must agree on ------------------------------------------------------------------
def fields(obj: object, *, but: str) -> dict[str, Any]:
    """Every field of `obj` but `but`: its `__dict__`, or a compiled class's declared attributes
    (gpufaas.native), so that a field added later is compared too."""
    names = getattr(type(obj), "__mypyc_attrs__", None) or vars(obj)
    return {name: getattr(obj, name) for name in names if name != but and hasattr(obj, name)}


def snapshot(scheduler: Scheduler, now: float) -> dict[str, Any]:
    """The committed state, as comparable values: queue, GPUs, cache and host tiers, placements,
    the staged exit's clocks, link copies, and the answers of the lazy indexes. (The indexes' heaps
    themselves are not compared: a read drops stale entries lazily, and the fast path may read the
    idle-holder index once more than the full fill would; their answers are what must agree.)"""
    cluster, cache = scheduler.cluster, scheduler.cache
    gpus = {
        gpu_id: (
            list(state.running),
            dict(state.expected_finish_s),
            state.busy_until_s,
            [r.request_id for r in state.local_queue],
            state.local_work_s,
            state.version,
            dict(state.worker_busy_until_s),
            state.stamp,
            state.indexed_stamp,
            state.spec,
        )
        for gpu_id, state in cluster.gpus.items()
    }
    caches = {}
    for gpu_id in cache.gpu_ids():
        gpu_cache = cache.gpu(gpu_id)
        items = fields(gpu_cache, but="_policy")
        caches[gpu_id] = {k: list(v.items()) if isinstance(v, dict) else v for k, v in items.items()}
    hosts = {}
    for node in {state.spec.node for state in cluster.gpus.values()}:
        host = None if node is None else cache.host(node)
        if host is not None:
            hosts[node] = (list(host.items.items()), host.used_mb)
    return {
        "queue": [(r.request_id, skips) for r, skips in scheduler.queue.walk()],
        "head_skips": scheduler.queue.head_skips(),
        "gpus": gpus,
        "caches": caches,
        "hosts": hosts,
        "tick": cache._tick,  # the LRU clock shared by every GPU
        "holders": {m: sorted(cache.gpus_with(m)) for m in MODELS},
        "in_host": {m: sorted(cache.nodes_holding(m)) for m in MODELS},
        "idle": list(cluster.idle),
        "placed_on": dict(cluster.placed_on),
        "ready_local": sorted(cluster.ready_local),
        "pin_dropped": sorted(cluster.pin_dropped),
        "swapped_in": sorted(cluster.swapped_in),
        "refill": sorted(cluster.refill),
        "dispatched_ahead": cluster.dispatched_ahead,
        "seq_of": dict(scheduler._seq_of),
        "exit": fields(scheduler._exit, but="cluster"),
        "links": {link: dict(copies) for link, copies in cluster.links._by_link.items()},
        "best_idle_holder": {m: cluster.best_idle_holder(m) for m in MODELS},
        "soonest_busy_holder": {m: cluster.soonest_busy_holder(m, now) for m in MODELS},
    }


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call returned, or the exception it raised (type and message)."""
    try:
        return "returned", call()
    except (KeyError, ValueError, RuntimeError) as exc:
        return "raised", (type(exc).__name__, str(exc))


class Twins:
    """The scheduler with the fast path and the one without, driven alike."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.fast = build(setup, fast_path=True)
        self.full = build(setup, fast_path=False)
        self.now = 0.0
        self.next_request = 0
        self.next_gpu = len(setup.slots)

    def event(self, change: Callable[[Scheduler], Any]) -> None:
        """Apply `change` and then `schedule(now)` to each, as the service and the simulator do after
        every event: they must return (or raise) the same and end in the same state."""
        now = self.now

        def action(scheduler: Scheduler) -> Any:
            return change(scheduler), scheduler.schedule(now)

        got = outcome(lambda: action(self.fast))
        want = outcome(lambda: action(self.full))
        assert got == want
        assert snapshot(self.fast, now) == snapshot(self.full, now)

    def running(self) -> list[str]:
        return sorted(rid for state in self.fast.gpus() for rid in state.running)

    def waiting(self) -> list[str]:
        parked = [r.request_id for state in self.fast.gpus() for r in state.local_queue]
        return sorted([r.request_id for r, _ in self.fast.queue.walk()] + parked)

    def request(self, model: str) -> Request:
        self.next_request += 1
        slo_s = None if self.next_request % 3 == 0 else 6.0
        return Request(f"r{self.next_request:04d}", f"fn-{model}", model, self.now, 32, slo_s=slo_s)


def step(twins: Twins, data: st.DataObject) -> None:
    """Draw one event and apply it to both (each change followed by `schedule(now)`)."""
    kind = data.draw(
        st.sampled_from(
            ["arrive"] * 6
            + ["burst"]
            + ["complete"] * 5
            + ["fail", "advance", "advance"]
            + ["cancel", "add_gpu", "remove_gpu", "set_slots", "release"]
        )
    )
    now, models = twins.now, sorted(MODELS)
    gpu_ids = sorted(state.spec.gpu_id for state in twins.fast.gpus())
    if kind == "arrive":  # the first models are the popular ones (hits, as in a trace)
        request = twins.request(data.draw(st.sampled_from(models[:2] * 4 + models)))
        twins.event(lambda s: s.submit(request))
    elif kind == "burst":
        requests = [twins.request(m) for m in data.draw(st.lists(st.sampled_from(models), min_size=2, max_size=5))]
        twins.event(lambda s: [s.submit(r) for r in requests])
    elif kind == "complete" and twins.running():
        request_id = data.draw(st.sampled_from(twins.running()))
        load_s = data.draw(st.sampled_from([None, 1.5, 4.0]))
        inference_s = data.draw(st.sampled_from([None, 0.3, 0.9]))
        twins.event(lambda s: s.on_complete(request_id, now, load_time_s=load_s, inference_time_s=inference_s))
    elif kind == "fail" and twins.running():
        request_id = data.draw(st.sampled_from(twins.running()))
        drop, requeue, avoid = data.draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
        twins.event(lambda s: s.on_failure(request_id, now, drop_model=drop, requeue=requeue, avoid_gpu=avoid))
    elif kind == "advance":
        twins.now = now + data.draw(st.sampled_from([0.1, 0.5, 1.0, 3.0, 10.0]))
        twins.event(lambda s: None)
    elif kind == "cancel" and twins.waiting():
        request_id = data.draw(st.sampled_from(twins.waiting()))
        twins.event(lambda s: s.cancel(request_id))
    elif kind == "add_gpu":
        memory_mb, slots = data.draw(st.sampled_from([3000, 8000])), data.draw(st.integers(1, 4))
        spec = gpu_spec(twins.next_gpu, memory_mb, slots, twins.setup)
        twins.next_gpu += 1
        twins.event(lambda s: add_gpu(s, spec, twins.setup))
    elif kind == "remove_gpu" and len(gpu_ids) > 1:
        gpu_id = data.draw(st.sampled_from(gpu_ids))
        twins.event(lambda s: s.remove_gpu(gpu_id, now))
    elif kind == "set_slots":
        gpu_id, slots = data.draw(st.sampled_from(gpu_ids)), data.draw(st.integers(1, 4))
        twins.event(lambda s: s.set_slots(gpu_id, slots))
    elif kind == "release":
        idle_s, host_s = data.draw(st.sampled_from([None, 0.5, 5.0])), data.draw(st.sampled_from([None, 2.0]))
        twins.event(lambda s: s.release_idle(now, gpu_idle_s=idle_s, host_idle_s=host_s))


def drain(twins: Twins) -> None:
    """Everything running completes, one a second in id order (the end state is compared too)."""
    while twins.running():
        twins.now += 1.0
        request_id, now = twins.running()[0], twins.now
        twins.event(lambda s, request_id=request_id, now=now: s.on_complete(request_id, now))  # type: ignore[misc]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(data=st.data())
def test_the_fast_path_decides_and_leaves_the_state_as_the_full_fill_does(
    policy: str, config: Config, data: st.DataObject
) -> None:
    setup = data.draw(setups(policy, config))
    twins = Twins(setup)
    for _ in range(data.draw(st.integers(1, 80))):
        step(twins, data)
    drain(twins)
    fast = twins.fast.fast_path_decisions  # dispatches and parks the fast path made (none: an empty test)
    if setup.policy in ("mqfq-sticky", "torpor") or (setup.literal_visits and setup.policy != "lb"):
        assert fast == 0  # these always fill in full
    event(f"fast dispatches: {'none' if not fast else '1-9' if fast < 10 else '10+'}")


def test_the_fast_path_places_the_lone_hits() -> None:
    """The equivalence above is only worth something if the fast path runs: on a warm cluster with
    one call at a time, lalb-o3 places every hit without a full fill (the first call of each
    model is a miss, and fills in full)."""
    setup = Setup(
        "lalb-o3", (4,) * 4, (8000,) * 4, host_tier=False, links=False, literal_visits=False, max_num_skips=25
    )
    twins = Twins(setup)
    for index in range(40):
        request = twins.request(("m0", "m1", "m4")[index % 3])
        twins.event(lambda s, request=request: s.submit(request))  # type: ignore[misc]
        twins.now += 10.0  # every call has ended by the next
        request_id, now = twins.running()[0], twins.now
        twins.event(lambda s, request_id=request_id, now=now: s.on_complete(request_id, now))  # type: ignore[misc]
    assert twins.fast.fast_path_decisions == 40 - 3
