"""`ClusterState.least_load_time_s`, the bound that spares LALB its search for a replica: it is at
most the load of the model on every GPU, whatever the GPU types, tiers and measurements, and the
search for a replica is made only where a wait is longer than it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec
from scheduler import Estimator, PolicyConfig, Scheduler, make_policy
from scheduler.draft import Draft
from scheduler.state import ClusterState
from tests.builders import cache_on, make_scheduler, run_on, submit

TYPES = ("a100", "h100", "t4")


def cluster_of(gpu_types: list[str], *, host_nodes: set[int], pooled_on: set[int], staged_on: set[int]) -> Scheduler:
    """One GPU per node n0, n1, ... of the given types; model M (1500 MB) in the host tiers of
    `host_nodes`, the model pools of `pooled_on`, on the disks of `staged_on` (nodes that report)."""
    estimator = Estimator([ModelProfile("M", "a100", 1500, 3.0, 0.5, 32)])
    scheduler = Scheduler(make_policy("lalb-o3", PolicyConfig()), estimator=estimator)
    for index, gpu_type in enumerate(gpu_types):
        node = f"n{index}"
        if index in host_nodes:
            scheduler.add_host(node, 4000)
        scheduler.add_gpu(GpuSpec(f"g{index}", 8000, gpu_type=gpu_type, node=node))
    scheduler.register_model(ModelSpec("M", 1500))
    for index in host_nodes:
        assert scheduler.cache.adopt_in_host(f"n{index}", "M", 1500)
    for index in pooled_on | staged_on:
        pooled = {"M"} if index in pooled_on else set()
        scheduler.cache.holdings.report(f"n{index}", pooled=pooled, staged={"M"} if index in staged_on else set())
    return scheduler


@st.composite
def clusters(draw: st.DrawFn) -> Scheduler:
    """1 to 5 GPUs of random types, M in random host tiers, pools and disks, random measured loads
    and swap-ins (on types attached or not), then some GPUs gone."""
    gpu_types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=5))
    nodes = st.sets(st.integers(0, len(gpu_types) - 1))
    scheduler = cluster_of(gpu_types, host_nodes=draw(nodes), pooled_on=draw(nodes), staged_on=draw(nodes))
    times_s = st.dictionaries(st.sampled_from(TYPES), st.floats(0.001, 30.0))
    for gpu_type, load_s in draw(times_s).items():
        scheduler.estimator.observe_load("M", gpu_type, load_s)
    for gpu_type, swap_in_s in draw(times_s).items():
        scheduler.estimator.observe_swap_in("M", gpu_type, swap_in_s)
    for index in sorted(draw(nodes) - {len(gpu_types) - 1}):  # one GPU stays
        scheduler.remove_gpu(f"g{index}")
    return scheduler


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_it_is_at_most_every_gpus_load(scheduler: Scheduler) -> None:
    cluster = scheduler.cluster
    loads_s = [cluster.load_time_s("M", gpu_id) for gpu_id in cluster.gpus]
    assert 0.0 < cluster.least_load_time_s("M") <= min(loads_s)
    assert cluster.gpu_types.keys() == {state.spec.gpu_type for state in cluster.gpus.values()}


def test_it_is_the_least_load_of_the_types_attached_and_a_swap_in_only_where_one_can_be() -> None:
    scheduler = cluster_of(["a100", "h100"], host_nodes=set(), pooled_on=set(), staged_on=set())
    estimator, cluster = scheduler.estimator, scheduler.cluster
    estimator.observe_load("M", "a100", 4.0)  # (with its profile's 3 s: 3.2 s)
    estimator.observe_load("M", "h100", 2.5)
    estimator.observe_load("M", "t4", 0.5)  # no GPU of this type: not a bound
    estimator.observe_swap_in("M", "a100", 0.2)
    estimator.observe_swap_in("M", "h100", 0.3)
    assert cluster.least_load_time_s("M") == 2.5  # no node holds M in host memory
    scheduler.cache.holdings.report("n1", pooled={"M"}, staged={"M"})
    assert cluster.least_load_time_s("M") == 0.2  # n1's pool does: a swap-in may be had
    scheduler.cache.holdings.report("n1", pooled=set(), staged={"M"})
    scheduler.remove_gpu("g1")  # the last h100
    assert cluster.least_load_time_s("M") == estimator.load_time_s("M", "a100", 1500) > 2.5
    scheduler.remove_gpu("g0")
    assert cluster.least_load_time_s("M") == 0.0  # no GPU: no bound


class CountingDraft(Draft):
    """A `Draft` that counts its searches for a replica."""

    searches = 0

    def idle_for_replica(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        CountingDraft.searches += 1
        return super().idle_for_replica(model, prefer, exclude, quiet_links_at=quiet_links_at)


@pytest.mark.parametrize(("running", "searched", "where"), [(1, 0, ("g0", True)), (3, 1, ("g1", False))])
def test_a_replica_is_searched_for_only_when_the_wait_is_longer_than_the_least_load(
    monkeypatch: pytest.MonkeyPatch, running: int, searched: int, where: tuple[str, bool]
) -> None:
    """A's worker on g0 is busy for 1 s (one call) or 3 s (three); a load of A takes 2 s: only the
    longer wait is worth a search (whose replica on g1 then wins). The full fill decides both."""
    monkeypatch.setattr("scheduler.core.Draft", CountingDraft)
    CountingDraft.searches = 0
    scheduler = make_scheduler("lalb", gpus=2, slots=4)
    scheduler.fast_path = False
    cache_on(scheduler, "g0", "A")
    for _ in range(running):
        run_on(scheduler, "g0", "A")
    submit(scheduler, "A")
    (decision,) = scheduler.schedule(0.0)
    assert (decision.gpu_id, decision.hit) == where
    assert CountingDraft.searches == searched


def test_the_gpu_types_are_counted_as_gpus_join_and_leave() -> None:
    scheduler = make_scheduler("lalb", gpus=0)
    cluster: ClusterState = scheduler.cluster
    scheduler.add_gpu(GpuSpec("x", 8000, gpu_type="t4"))
    scheduler.add_gpu(GpuSpec("y", 8000, gpu_type="t4"))
    scheduler.add_gpu(GpuSpec("z", 8000, gpu_type="h100"))
    assert cluster.gpu_types == {"t4": 2, "h100": 1}
    scheduler.remove_gpu("x")
    scheduler.remove_gpu("z")
    assert cluster.gpu_types == {"t4": 1}
