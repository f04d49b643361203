"""What nodes hold below their GPUs, through the scheduler: a miss priced by the tier it comes from
(pool swap-in, disk load, fetch and load), placed where the model is nearest, and pre-staging's
choice of nodes."""

from __future__ import annotations

import pytest

from cache_manager import NodeHoldings, Tier
from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec
from scheduler import Estimator, PolicyConfig, Scheduler, make_policy
from scheduler.estimator import DEFAULT_SWAP_IN_OVERHEAD_S
from scheduler.staging import GpuRoom, staging_targets
from tests.builders import make_request

LOAD_S, INFERENCE_S, MB_S = 2.0, 1.0, 1000.0
SWAP_S = DEFAULT_SWAP_IN_OVERHEAD_S + 1000 / MB_S


def three_nodes() -> Scheduler:
    """n0, n1, n2 with one 2000 MB GPU each (g0, g1, g2); models A, B of 1000 MB loading in 2 s."""
    estimator = Estimator(
        [ModelProfile(m, "rtx2080", 1000, LOAD_S, INFERENCE_S, 32) for m in "AB"], host_to_gpu_mb_s=MB_S
    )
    s = Scheduler(make_policy("lalb-o3", PolicyConfig()), estimator=estimator)
    for index in range(3):
        s.add_gpu(GpuSpec(f"g{index}", 2000, node=f"n{index}"))
    for model in "AB":
        s.register_model(ModelSpec(model, 1000))
    return s


def test_node_holdings_keep_their_directories() -> None:
    holdings = NodeHoldings()
    holdings.report("n0", pooled={"A"}, staged={"B"})
    holdings.report("n1", pooled=set(), staged={"A"})
    assert holdings.nodes_pooling("A") == {"n0"} and holdings.nodes_staging("A") == {"n0", "n1"}
    assert holdings.on_disk("A", "n0")  # pooled weights came from the disk
    holdings.report("n0", pooled=set(), staged=set())
    assert not holdings.nodes_pooling("A") and holdings.nodes_staging("A") == {"n1"}
    holdings.forget("n1")
    assert not holdings.nodes_staging("A") and not holdings.reports("n1") and holdings.reports("n0")


def test_a_miss_is_priced_by_its_tier() -> None:
    s = three_nodes()
    fetch_s = s.estimator.fetch_time_s(1000)
    # Before any node reports, every package counts as on disk (the simulator's world).
    assert s.cache.tier("A", "g0") is Tier.DISK and s.load_time_s("A", "g0") == pytest.approx(LOAD_S)
    s.cache.holdings.report("n0", pooled={"A"}, staged=set())
    s.cache.holdings.report("n1", pooled=set(), staged={"A"})
    s.cache.holdings.report("n2", pooled=set(), staged=set())
    assert [s.cache.tier("A", g) for g in ("g0", "g1", "g2")] == [Tier.POOL, Tier.DISK, Tier.REMOTE]
    assert s.load_time_s("A", "g0") == pytest.approx(SWAP_S)
    assert s.load_time_s("A", "g1") == pytest.approx(LOAD_S)
    assert s.load_time_s("A", "g2") == pytest.approx(LOAD_S + fetch_s)
    request = make_request("A")
    s.submit(request)
    decision = s.dispatch(request, "g0", 0.0)
    assert decision.from_pool and not decision.from_host and decision.est_load_time_s == pytest.approx(SWAP_S)
    s.on_complete(request.request_id, 1.0, load_time_s=0.05)  # measured: learnt as a swap-in, not a load
    assert s.estimator.swap_in_time_s("A", "rtx2080", 1000) == pytest.approx(0.05)
    assert s.estimator.load_time_s("A", "rtx2080", 1000) == pytest.approx(LOAD_S)
    # The pool is not exclusive: the model is still there for the next miss on the node.
    assert s.cache.holdings.in_pool("A", "n0")
    other = make_request("B")
    s.submit(other)
    remote = s.dispatch(other, "g2", 2.0)
    assert remote.est_load_time_s == pytest.approx(LOAD_S + s.estimator.fetch_time_s(1000))


@pytest.mark.parametrize(("pooled", "staged", "expected"), [({"n2"}, set(), "g2"), (set(), {"n1"}, "g1")])
def test_a_miss_goes_where_the_model_is_nearest(pooled: set[str], staged: set[str], expected: str) -> None:
    s = three_nodes()
    for node in ("n0", "n1", "n2"):
        s.cache.holdings.report(
            node, pooled={"A"} if node in pooled else set(), staged={"A"} if node in staged else set()
        )
    s.submit(make_request("A"))
    [decision] = s.schedule(0.0)
    assert decision.gpu_id == expected


def test_disk_does_not_move_a_miss_that_would_not_fetch() -> None:
    s = three_nodes()
    for node in ("n0", "n1", "n2"):
        s.cache.holdings.report(node, pooled=set(), staged={"A"} if node in ("n0", "n2") else set())
    s.submit(make_request("A"))
    [decision] = s.schedule(0.0)
    assert decision.gpu_id == "g0"  # the first idle GPU has it on disk: LALB's choice stands


def test_staging_targets_prefer_holders_then_room() -> None:
    model = ModelSpec("A", 1000)
    nodes = {
        "n0": [GpuRoom(2000, "t4", 500)],  # full: the model fits the GPU but not its free memory
        "n1": [GpuRoom(2000, "t4", 1500), GpuRoom(2000, "t4", 2000)],
        "n2": [GpuRoom(2000, "t4", 1800)],
        "small": [GpuRoom(500, "t4", 500)],  # too small for the model: never chosen
    }
    assert staging_targets(model, nodes, set(), copies=2) == ["n1", "n2"]
    assert staging_targets(model, nodes, {"n0"}, copies=2) == ["n1"]  # n0's copy counts
    assert staging_targets(model, nodes, {"n0", "n1"}, copies=2) == []
    assert staging_targets(model, nodes, set(), copies=0) == []
    assert staging_targets(ModelSpec("A", 1000, gpu_type="h100"), nodes, set(), copies=2) == []
