"""What a node books a worker's model at on its GPU: the node's own measurement (NVML, here a fake
one behind gpu_manager.devices.Nvml) or the declared size, never the worker's report; a model
measured over its declaration with no room for it on its GPU is stopped (gpu_manager.workers'
`book_memory`, gpu_manager.pool)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from gpu_manager.devices import Nvml
from gpu_manager.pool import MEASURE_EVERY_S
from gpu_manager.workers import MEMORY_MARGIN_MB, Worker, book_memory, memory_margin_mb
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import ModelSpec
from gpufaas.wire import Frame, MessageType
from tests.unit.test_gpu_manager_pool import Node, eventually, ok, on_cpu, on_own_pool


class FakeNvml(Nvml):
    """Answers for the first PID asked about with `mb` (None: NVML does not list it), and with
    `by_pid` for the others; keeps the PIDs it was asked about."""

    def __init__(self, mb: int | None) -> None:
        super().__init__(module=None)
        self.mb = mb
        self.by_pid: dict[int, int] = {}
        self.asked: list[tuple[int, int]] = []

    def processes_mb(self, index: int, pids: Iterable[int]) -> int | None:
        first, *others = pids
        self.asked += [(index, pid) for pid in (first, *others)]
        held = [mb for mb in (self.mb, *(self.by_pid.get(pid) for pid in others)) if mb is not None]
        return sum(held) if held else None


# --- the decision ---------------------------------------------------------------------------------
def test_the_margin_is_a_floor_or_a_tenth_of_the_declared_size() -> None:
    assert memory_margin_mb(100) == MEMORY_MARGIN_MB
    assert memory_margin_mb(1800) == 180


@pytest.mark.parametrize("reported_mb", [1, 1200, 1800, 1980, 1999, 10**9])
def test_without_a_measurement_the_declared_size_is_booked_whatever_the_worker_reports(reported_mb: int) -> None:
    booking = book_memory(1800, reported_mb, None)
    assert (booking.booked_mb, booking.measured) == (1800, False)
    assert booking.over_declared == (reported_mb > 1800 + 180)


@pytest.mark.parametrize(
    ("measured_mb", "over"), [(300, False), (1800, False), (1980, False), (1981, True), (5000, True)]
)
def test_a_measurement_is_booked_as_it_is_and_the_report_is_ignored(measured_mb: int, over: bool) -> None:
    for reported_mb in (1, 1800, 1999):
        booking = book_memory(1800, reported_mb, measured_mb)
        assert (booking.booked_mb, booking.measured, booking.over_declared) == (measured_mb, True, over)


def test_a_measurement_of_nothing_still_books_something() -> None:
    assert book_memory(100, 0, 0).booked_mb == 1


def test_a_worker_takes_its_first_hello_only() -> None:
    def hello(pid: int) -> Frame:
        return Frame(MessageType.WORKER_HELLO, 0, 0, pb.WorkerHello(pid=pid).SerializeToString(), b"")

    async def scenario() -> None:
        worker = Worker("gpu0")
        conn: Any = None  # the worker's handler does not use its connection
        worker.on_frame(conn, hello(4242))
        worker.on_frame(conn, hello(1))  # a handler's, naming another process for the node to measure
        assert worker.pid == 4242 and worker.hello.result().pid == 4242

    asyncio.run(scenario())


# --- the pool, over real cpu workers measured by a fake NVML -----------------------------------------
def test_a_measured_model_is_booked_at_its_measurement_and_one_over_its_declaration_is_counted(
    tmp_path: Path,
) -> None:
    nvml = FakeNvml(450)

    async def scenario(node: Node) -> None:
        model = on_cpu("liar", node.shelf.digest("memory_liar_function"), environment={"CLAIM_MB": "1999"})
        miss = await node.call(model)
        assert ok(miss)["claimed_mb"] == 1999
        assert miss.peak_memory_mb == 450  # NVML's figure, not the declared 300 nor the claimed 1,999
        ((name, gpu, pid, booked_mb),) = node.pool.workers()
        assert (name, gpu, booked_mb) == ("liar", "gpu0", 450) and (0, pid) in nvml.asked
        assert node.pool.models_over_declared == {"measured": 1}
        nvml.mb = 100  # it freed memory: the peak stays booked
        await asyncio.sleep(MEASURE_EVERY_S)
        hit = await node.call(model)
        assert hit.peak_memory_mb == 450 and not hit.worker_killed
        assert node.pool.models_over_declared == {"measured": 1}  # once per worker, not per call

    on_own_pool(tmp_path, "cpu", scenario, nvml=nvml, capacity_mb=lambda gpu_id: 2000)


def test_the_gpu_memory_of_a_process_the_worker_started_is_its_models(tmp_path: Path) -> None:
    # A handler may run its model in a process it starts (as vLLM's engine core): measuring the
    # worker's PID alone books its CUDA context only, and the scheduler then packs other models
    # onto the GPU (its measurement replaces the declared size).
    nvml = FakeNvml(400)

    async def scenario(node: Node) -> None:
        model = on_cpu("engine", node.shelf.digest("forking_function"), memory_mb=16000)
        (child,) = ok(await node.call(model))["children"]
        try:
            nvml.by_pid[child] = 15600
            await asyncio.sleep(MEASURE_EVERY_S)
            hit = await node.call(model)
            assert hit.peak_memory_mb == 16000 and (0, child) in nvml.asked
            ((_, _, _, booked_mb),) = node.pool.workers()
            assert booked_mb == 16000
        finally:
            os.kill(child, signal.SIGKILL)

    on_own_pool(tmp_path, "cpu", scenario, nvml=nvml, capacity_mb=lambda gpu_id: 80000)


def test_without_a_measurement_a_lying_worker_is_booked_at_its_declared_size_and_counted_once(
    tmp_path: Path,
) -> None:
    async def scenario(node: Node) -> None:
        for claim_mb, name in (("1", "under"), ("1999", "over")):
            model = on_cpu(name, node.shelf.digest("memory_liar_function"), environment={"CLAIM_MB": claim_mb})
            for _ in range(2):
                result = await node.call(model)
                assert ok(result)["claimed_mb"] == int(claim_mb)
                assert result.peak_memory_mb == 300
        assert sorted(mb for _, _, _, mb in node.pool.workers()) == [300, 300]
        assert node.pool.models_over_declared == {"claimed": 1}

    on_own_pool(tmp_path, "cpu", scenario, nvml=FakeNvml(None))


@pytest.mark.parametrize(
    ("declared_mb", "claims_over"),
    [
        # The margin is its floor (64 MiB over 300): 364 is within it, 365 over.
        (300, {"1": False, "300": False, "364": False, "365": True, "1999": True}),
        # A tenth of the declared size (100 MiB over 1,000): past the floor but within the tenth.
        (1000, {"1065": False, "1100": False, "1101": True}),
    ],
)
def test_with_no_nvml_at_all_every_claim_is_booked_at_the_declared_size_and_one_over_the_margin_counted_once(
    tmp_path: Path, declared_mb: int, claims_over: dict[str, bool]
) -> None:
    # The pool's booking after each call where nothing measures (the cpu backend's nodes): the
    # same decisions as gpu_manager.gpu_memory's, claim by claim, call after call.
    async def scenario(node: Node) -> None:
        for claim_mb in claims_over:
            model = on_cpu(
                f"claims-{claim_mb}",
                node.shelf.digest("memory_liar_function"),
                memory_mb=declared_mb,
                environment={"CLAIM_MB": claim_mb},
            )
            for _ in range(3):
                result = await node.call(model)
                assert ok(result)["claimed_mb"] == int(claim_mb)
                assert (result.peak_memory_mb, result.worker_killed) == (declared_mb, False)
            assert node.pool.workers()[0][3] == declared_mb
            await node.pool.evict(model.model, "gpu0")
        over = sum(claims_over.values())
        assert node.pool.models_over_declared == ({"claimed": over} if over else {})

    on_own_pool(tmp_path, "cpu", scenario, capacity_mb=lambda gpu_id: declared_mb)


def test_a_model_measured_over_its_declaration_with_no_room_on_its_gpu_is_stopped_at_its_load(
    tmp_path: Path,
) -> None:
    async def scenario(node: Node) -> None:
        echo = node.shelf.digest("echo_function")
        ok(await node.call(on_cpu("small", echo, memory_mb=100), {}))
        # Declared 300, holds 900: with the other model's 900 (it measures the same here) the
        # GPU's 1,000 MiB would book 1,800.
        result = await node.call(on_cpu("big", echo), {})
        assert result.outcome == pb.LOAD_FAILED and "declare memory_mb >= 900" in result.message
        assert result.peak_memory_mb == 900  # so that the scheduler books it at that from then on
        await eventually(lambda: node.pool.worker_exits["over_memory"] == 1, "the worker exits", 10.0)
        assert [name for name, *_ in node.pool.workers()] == ["small"]

    on_own_pool(tmp_path, "cpu", scenario, nvml=FakeNvml(900), capacity_mb=lambda gpu_id: 1000)


def test_a_model_that_grows_past_its_gpu_after_its_load_is_stopped_after_its_call(tmp_path: Path) -> None:
    nvml = FakeNvml(250)

    async def scenario(node: Node) -> None:
        model = on_cpu("grows", node.shelf.digest("echo_function"))
        assert ok(await node.call(model, {})) and node.pool.workers()[0][3] == 250
        nvml.mb = 1200
        await asyncio.sleep(MEASURE_EVERY_S)
        grown = await node.call(model, {"x": 1})
        assert ok(grown)["echo"] == {"x": 1}  # its call is answered ...
        assert grown.worker_killed and grown.peak_memory_mb == 1200  # ... its worker stopped
        await eventually(lambda: node.pool.worker_exits["over_memory"] == 1, "the worker exits", 10.0)
        assert node.pool.workers() == []

    on_own_pool(tmp_path, "cpu", scenario, nvml=nvml, capacity_mb=lambda gpu_id: 1000)


# --- the scheduler's end ----------------------------------------------------------------------------
@pytest.mark.parametrize(("worker_lost", "booked_mb"), [(True, 900), (False, 500)])
def test_the_scheduler_takes_in_the_size_of_a_worker_its_node_stopped_for_it(
    worker_lost: bool, booked_mb: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Done for a worker lost with a measured size: later admissions book that size (a Done
    for a worker kept is the book's to take in, as before)."""
    from scheduler.service import SchedulerService
    from scheduler.sessions import NodeSession
    from tests.fakes import MemoryStore, PlacedBook

    async def scenario() -> None:
        service = SchedulerService(MemoryStore())
        service.scheduler.register_model(ModelSpec("m", 500))  # declared 500 MB; its GPU g0 is gone
        monkeypatch.setattr(service, "book", PlacedBook(service.book, "m", "g0"))
        done = pb.Done(call_id="c", attempt=1, outcome=pb.OK, peak_memory_mb=900, worker_lost=worker_lost)
        session = NodeSession(service, None)  # type: ignore[arg-type]  # the node is not looked at
        conn: Any = None
        session.on_frame(conn, Frame(MessageType.DONE, 0, 0, done.SerializeToString(), b""))
        assert service.scheduler.model("m").memory_mb == booked_mb

    asyncio.run(scenario())
