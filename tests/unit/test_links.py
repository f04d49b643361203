"""Shared host links (PCIe switches): the simulator's transfer-bandwidth model, and the scheduler's
interference-aware placement and contention estimate on top of it."""

from __future__ import annotations

import pytest

from gpu_manager.devices import Nvml, discover_nvml, logical_devices, shared_links
from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Dispatch, Estimator, PolicyConfig, Scheduler, make_policy
from scheduler.draft import Draft
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload
from tests.builders import make_request

MB_S = 1000.0  # host-to-GPU bandwidth: a 1000 MB model copies in 1 s alone
LOAD_S, INFERENCE_S = 3.0, 0.5  # a load from disk: 2 s of start and read, then 1 s of copy


def linked(aware: bool = True) -> Scheduler:
    """One node, GPUs g0 and g1 behind switch L0, g2 behind L1 (2000 MB each); models A-D of 1000 MB."""
    estimator = Estimator(
        [ModelProfile(m, "rtx2080", 1000, LOAD_S, INFERENCE_S, 1) for m in "ABCD"], host_to_gpu_mb_s=MB_S
    )
    s = Scheduler(make_policy("lalb-o3", PolicyConfig(interference_aware_loads=aware)), estimator=estimator)
    for gpu_id, link in (("g0", "n0/L0"), ("g1", "n0/L0"), ("g2", "n0/L1")):
        s.add_gpu(GpuSpec(gpu_id, 2000, node="n0", link=link))
    for model in "ABCD":
        s.register_model(ModelSpec(model, 1000))
    return s


def dispatches(s: Scheduler, now: float) -> list[Dispatch]:
    return [d for d in s.schedule(now) if isinstance(d, Dispatch)]


def test_a_second_miss_goes_behind_a_quiet_switch() -> None:
    s = linked()
    s.submit(make_request("A"))
    (first,) = dispatches(s, 0.0)
    assert first.gpu_id == "g0" and not first.hit
    s.submit(make_request("B"))
    (second,) = dispatches(s, 0.0)
    # g1 shares g0's switch, whose copy is expected from 2 s to 3 s: B's copy would overlap it.
    assert second.gpu_id == "g2"
    assert s.copies_overlapping("C", "g1", 0.0) == 1 and s.copies_overlapping("C", "g2", 0.0) == 1


def test_without_interference_awareness_the_miss_takes_the_next_gpu() -> None:
    s = linked(aware=False)
    s.submit(make_request("A"))
    s.submit(make_request("B"))
    assert [d.gpu_id for d in dispatches(s, 0.0)] == ["g0", "g1"]


def test_a_copy_that_would_not_overlap_is_not_avoided() -> None:
    s = linked()
    s.submit(make_request("A"))
    dispatches(s, 0.0)
    # At 1.5 s, B's copy on g1 would run 3.5-4.5 s, after A's (2-3 s): g1 is as good as g2, and
    # comes first.
    assert s.copies_overlapping("B", "g1", 1.5) == 0
    s.submit(make_request("B", arrival_s=1.5))
    (second,) = dispatches(s, 1.5)
    assert second.gpu_id == "g1"


def test_a_shared_copy_is_expected_to_take_longer() -> None:
    s = linked(aware=False)
    s.submit(make_request("A"))
    s.submit(make_request("B"))
    first, second = dispatches(s, 0.0)
    assert first.est_load_time_s == pytest.approx(LOAD_S)
    assert second.est_load_time_s == pytest.approx(LOAD_S + 1000 / MB_S)  # half the bandwidth for its copy
    # B's copy is expected 3-4 s: a copy of C loaded at 1.5 s (3.5-4.5 s) would share the link with
    # it, and no longer once B's call has left its slot.
    assert s.copies_overlapping("C", "g0", 1.5) == 1
    s.on_complete(second.request.request_id, 1.5)
    assert s.copies_overlapping("C", "g0", 1.5) == 0


def test_a_rolled_back_dispatch_leaves_no_copy() -> None:
    s = linked()
    s.submit(make_request("A"))
    draft = Draft(s.cluster)  # a policy's fill: reservations are journalled
    mark = draft.savepoint()
    draft.dispatch(s.queue.head or make_request("A"), "g0", 0.0)
    assert s.copies_overlapping("B", "g1", 0.0) == 1
    draft.rollback(mark)
    assert s.copies_overlapping("B", "g1", 0.0) == 0


# --- the simulator's ground truth ------------------------------------------------------------


def two_models_at_once(gap_s: float) -> Workload:
    """Two functions whose first calls arrive `gap_s` apart on a cold cluster."""
    profiles = [ModelProfile(m, "rtx2080", 1000, LOAD_S, INFERENCE_S, 1) for m in "AB"]
    requests = [
        Request("r0", "fn-A", "A", 0.0, batch_size=1),
        Request("r1", "fn-B", "B", gap_s, batch_size=1),
    ]
    return Workload(
        requests=requests,
        profiles=profiles,
        function_models={"fn-A": "A", "fn-B": "B"},
        top_function="fn-A",
        start_minute=0,
        minutes=1,
    )


@pytest.mark.parametrize("gpus_per_link", [0, 1, 2])
def test_copies_behind_one_switch_share_its_bandwidth(gpus_per_link: int) -> None:
    """Two loads dispatched together on the two GPUs: behind one switch (2 GPUs per link) their
    copies (2-3 s alone) overlap entirely, each at half the bandwidth, and both end at 4 s; with a
    link each (1), or without the transfer model (0), each takes its 3 s."""
    workload = two_models_at_once(0.0)
    cluster = ClusterConfig(
        gpus=2, gpus_per_node=2, gpu_memory_mb=2000, host_to_gpu_mb_s=MB_S, gpus_per_link=gpus_per_link
    )
    result = simulate(workload, "lalb-o3", cluster=cluster, interference_aware_loads=False)
    assert result.completed == 2
    if gpus_per_link == 2:
        assert result.contended_loads == 2
        assert result.avg_load_s == pytest.approx(4.0)  # each copy 2 s at half of 1000 MB/s
        assert result.avg_latency_s == pytest.approx(4.0 + INFERENCE_S)
    else:
        assert result.contended_loads == 0
        assert result.avg_load_s == pytest.approx(LOAD_S)
        assert result.avg_latency_s == pytest.approx(LOAD_S + INFERENCE_S)


def test_a_copy_that_starts_later_shares_only_the_overlap() -> None:
    """B arrives 0.5 s after A: A copies alone 2-2.5 s (0.5 of its 1 s), then both share: A's
    other half takes 1 s (2.5-3.5), B's copy runs 2.5-3.5 at half and then alone: 0.5 left at
    3.5 s, done at 4.0 s. Loads: A 3.5 s, B 3.5 s."""
    result = simulate(
        two_models_at_once(0.5),
        "lalb-o3",
        cluster=ClusterConfig(gpus=2, gpus_per_node=2, gpu_memory_mb=2000, host_to_gpu_mb_s=MB_S, gpus_per_link=2),
        interference_aware_loads=False,
    )
    assert result.avg_load_s == pytest.approx(3.5)
    assert result.contended_loads == 2


def test_a_narrow_uplink_slows_a_copy_alone() -> None:
    result = simulate(
        two_models_at_once(10.0),
        "lalb-o3",
        cluster=ClusterConfig(
            gpus=2, gpus_per_node=2, gpu_memory_mb=2000, host_to_gpu_mb_s=MB_S, gpus_per_link=2, link_mb_s=500.0
        ),
    )
    assert result.contended_loads == 0
    assert result.avg_load_s == pytest.approx(2.0 + 1000 / 500.0)


def test_the_transfer_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="gpus_per_link"):
        ClusterConfig(gpus_per_link=-1)
    with pytest.raises(ValueError, match="link_mb_s"):
        ClusterConfig(gpus_per_link=2, link_mb_s=0.0)


# --- the node's topology -----------------------------------------------------------------------


def test_logical_devices_sit_behind_shared_links_when_asked() -> None:
    devices = logical_devices(3, 1000, "cpu", gpus_per_link=2)
    assert [d.link for d in devices] == ["pcie0", "pcie0", "pcie1"]
    assert all(d.link is None for d in logical_devices(2, 1000, "cpu"))
    with pytest.raises(ValueError, match="gpus_per_link"):
        logical_devices(2, 1000, "cpu", gpus_per_link=-1)


class FakeNvml:
    """pynvml's calls that `Nvml.devices` makes, over a fixed topology (levels by index pair)."""

    def __init__(self, levels: dict[tuple[int, int], int], count: int) -> None:
        self.levels, self.count = levels, count

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:
        return type("Memory", (), {"total": 80 * 1024**3, "used": 0})()

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        level = self.levels.get((min(first, second), max(first, second)))
        if level is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return level


def test_nvml_topology_groups_gpus_behind_one_switch() -> None:
    """A DGX-like node: GPUs 0-1 and 2-3 each behind a PCIe switch (levels 10 and 20), the pairs
    apart through the host bridge (30) and across sockets (50); GPU 4's level is unknown."""
    levels = {(0, 1): 10, (2, 3): 20, (0, 2): 30, (0, 3): 30, (1, 2): 30, (1, 3): 30}
    levels |= {(i, 4): 50 for i in range(3)}
    devices = Nvml(FakeNvml(levels, 5)).devices()
    assert [d.link for d in devices] == ["pcie0", "pcie0", "pcie2", "pcie2", None]
    assert devices[0].gpu_type == "nvidia-h100-80gb-hbm3"


def test_shared_links_join_gpus_through_each_other() -> None:
    # 0-1 and 1-2 share switches: all three are one group, whatever 0-2 says.
    assert shared_links(3, lambda i, j: {(0, 1): 10, (1, 2): 20}.get((i, j), 40)) == ["pcie0"] * 3
    assert shared_links(2, lambda i, j: None) == [None, None]


def test_nvml_names_each_gpus_uuid_and_a_failure_names_none() -> None:
    class WithUuids(FakeNvml):
        def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # older nvidia-ml-py releases return bytes
            if handle == 1:
                raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
            return f"GPU-{handle:04d}".encode()

    nvml = Nvml(WithUuids({}, 2))
    assert (nvml.uuid(0), nvml.uuid(1)) == ("GPU-0000", None)


def test_a_node_started_with_cuda_visible_devices_offers_only_those_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML ignores CUDA_VISIBLE_DEVICES (it lists every GPU of the machine): the node applies it."""

    class WithUuids(FakeNvml):
        def nvmlDeviceGetUUID(self, handle: int) -> str:
            return f"GPU-{handle:04d}"

        def nvmlShutdown(self) -> None:
            pass

    monkeypatch.setattr(Nvml, "open", classmethod(lambda cls: Nvml(WithUuids({}, 4))))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0003,1")
    assert [(d.gpu_id, d.index) for d in discover_nvml()] == [("gpu1", 1), ("gpu3", 3)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert len(discover_nvml()) == 4
