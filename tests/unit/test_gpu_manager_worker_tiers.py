"""The worker pool's two tiers as plain bookkeeping (no process): which GPU worker a grant may
evict or release (gpu_manager.gpu_workers), and what the host tier parks, takes back and pushes
out (gpu_manager.parked_workers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gpu_manager.gpu_workers import GpuWorkers
from gpu_manager.parked_workers import ParkedWorkers
from gpu_manager.runtimes import Runtime
from gpu_manager.sandbox import Isolation
from gpu_manager.worker_processes import WorkerProcesses
from gpu_manager.workers import ModelRun, Worker, WorkerState


def make_worker(model: str, gpu_id: str = "gpu0", *, state: WorkerState = WorkerState.READY, **fields: Any) -> Worker:
    """A worker as the pool holds it once it took `model` (no process behind it)."""
    worker = Worker(gpu_id)
    worker.run = ModelRun(model=model, package_digest=fields.pop("digest", "d1"), memory_mb=fields.pop("mb", 100))
    worker.memory_mb = worker.run.memory_mb
    worker.state = state
    for name, value in fields.items():
        setattr(worker, name, value)
    return worker


def run(scenario: Callable[[], None]) -> None:
    """Run `scenario` where a Worker can be made (its futures need a running loop)."""

    async def main() -> None:
        scenario()

    asyncio.run(main())


def test_a_grant_evicts_only_an_idle_worker_it_is_not_behind() -> None:
    def scenario() -> None:
        workers = GpuWorkers()
        idle = make_worker("idle", last_seq=3)
        busy = make_worker("busy")
        busy.pending["c1"] = asyncio.get_running_loop().create_future()
        loading = make_worker("loading", state=WorkerState.LOADING)
        later = make_worker("later", last_seq=9)
        for worker in (idle, busy, loading, later):
            workers.add(worker)
        assert workers.victim("idle", "gpu0", seq=5) is idle
        assert workers.victim("idle", "gpu1", seq=5) is None  # another GPU's
        assert workers.victim("busy", "gpu0", seq=5) is None  # calls in flight
        assert workers.victim("loading", "gpu0", seq=5) is None
        assert workers.victim("later", "gpu0", seq=5) is None  # a later grant used it
        assert workers.idle("loading", "gpu0", seq=5) is None  # a release takes READY ones only
        assert workers.idle("idle", "gpu0", seq=5) is idle
        workers.forget_grant_order()
        assert workers.victim("later", "gpu0", seq=5) is later  # a new scheduler numbers afresh

    run(scenario)


def test_forgetting_a_replaced_worker_keeps_its_successor_and_books_count_one_gpu() -> None:
    def scenario() -> None:
        workers = GpuWorkers()
        old, new = make_worker("m"), make_worker("m", mb=300)
        workers.add(old)
        workers.add(new)  # a redeploy's new worker took the key
        workers.forget(old)
        assert workers.get("m", "gpu0") is new
        workers.add(make_worker("n", state=WorkerState.LOADING, mb=50))
        workers.add(make_worker("m", "gpu1", mb=1000))
        assert workers.booked_mb("gpu0") == 350  # loading and ready ones, of this GPU only
        assert [(model, gpu) for model, gpu, _, _ in workers.ready()] == [("m", "gpu0"), ("m", "gpu1")]

    run(scenario)


def test_the_host_tier_takes_back_the_same_package_and_stops_a_stale_one() -> None:
    stopped: list[Worker] = []

    def scenario() -> None:
        tier = ParkedWorkers(1000, measure_host_mb=lambda pid: None, stop=stopped.append, track=lambda task: None)
        worker = make_worker("m", last_seq=7)
        tier.park(worker)
        assert worker.state is WorkerState.PARKED and tier.models() == [("m", 100)]
        taken = tier.take_back(ModelRun("m", "d1", 100), "gpu3")
        assert taken is worker and (worker.state, worker.gpu_id, worker.last_seq) == (WorkerState.READY, "gpu3", 0)
        assert tier.models() == []

        stale = make_worker("m")
        tier.park(stale)
        assert tier.take_back(ModelRun("m", "d2", 100), "gpu0") is None  # redeployed: its code is stale
        assert stopped == [stale] and tier.models() == []

    run(scenario)


def test_the_host_tier_pushes_out_the_oldest_past_its_budget_and_forgets_an_exited_worker() -> None:
    stopped: list[Worker] = []

    def scenario() -> None:
        tier = ParkedWorkers(250, measure_host_mb=lambda pid: None, stop=stopped.append, track=lambda task: None)
        first, second, third = make_worker("a"), make_worker("b"), make_worker("c")
        tier.park(first)
        tier.park(second)
        assert stopped == []
        tier.park(third)  # 300 MiB charged (declared sizes: none measured) against 250
        assert stopped == [first] and [model for model, _ in tier.models()] == ["b", "c"]
        tier.exited(second)
        assert [model for model, _ in tier.models()] == ["c"]
        assert tier.pop("c") is third and tier.pop("c") is None

    run(scenario)


class ExitsWhenTold(Runtime):
    """A runtime whose workers run until the test resolves their `exited` (no process)."""

    name = "exits-when-told"
    keeps_spares = True

    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        await worker.exited

    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        return {}


def test_a_stopped_worker_uses_its_package_until_its_process_exits() -> None:
    # Its process still maps its weights in the host pool (and reads its package) while it stops:
    # an entry dropped then would not free its memory, and the pool would count it freed.
    async def main() -> None:
        runtime = ExitsWhenTold(
            backend="cpu", gpus={"gpu0": 0}, isolation=Isolation(), max_body_bytes=1024, closing=lambda: False
        )
        processes = WorkerProcesses(
            runtime, closing=lambda: False, on_hello=lambda _: None, on_exit=lambda _: None, network_isolation=False
        )
        worker = processes.spawn("gpu0")
        worker.run, worker.state = ModelRun("m", "d1", 100), WorkerState.READY
        signals: list[int] = []
        worker.on_signal = signals.append  # (SIGTERM sent, the process not gone yet)
        stopping = asyncio.create_task(processes.stop(worker))
        await asyncio.sleep(0)
        assert signals and worker.is_gone and processes.packages_in_use() == {"d1"}
        worker.exited.set_result(None)
        await stopping
        assert processes.packages_in_use() == set()

    asyncio.run(main())
