"""The worker pool over real worker processes (cpu and emulated backends): start, reuse, one call per
GPU, handler errors, deaths, timeouts, eviction and shutdown. Every test checks on the way out that
no worker process it started is left running."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from gpu_manager.packages import PackageCache, package_digest
from gpu_manager.pool import HandlerError, RunResult, RunTimeout, WorkerDied, WorkerPool
from gpu_manager.worker import WorkerSpec
from tests.fixtures.make_packages import build_package

TIMEOUT_S = 30.0  # generous: a cold worker imports torch


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("gpufaas-worker")]


@asynccontextmanager
async def open_pool(backend: str, tmp_path: Path) -> AsyncIterator[WorkerPool]:
    """A pool that is shut down on exit, whatever happened, and leaves no worker behind."""
    pool = WorkerPool(backend, PackageCache(tmp_path / "packages"))
    try:
        yield pool
    finally:
        started = {pid for _, _, pid in pool.workers()} | {p.pid for p in worker_processes() if p.pid}
        await pool.shutdown()
        for pid in started:  # a failed assertion above must not leak processes either
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert pool.workers() == []
        assert worker_processes() == []
        assert not any(is_running(pid) for pid in started)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def emulated(
    model: str = "m", gpu: str = "gpu0", *, load_s: float = 0.0, inference_s: float = 0.0, memory_mb: int = 700
) -> WorkerSpec:
    return WorkerSpec(
        model=model,
        gpu_id=gpu,
        device_index=int(gpu.removeprefix("gpu")),
        backend="emulated",
        package_dir="",
        memory_mb=memory_mb,
        load_time_s=load_s,
        inference_time_s=inference_s,
    )


async def install(pool: WorkerPool, fixture: str, tmp_path: Path) -> str:
    data = build_package(fixture, tmp_path).read_bytes()
    return str(await pool.package_cache.install(package_digest(data), data))


def cpu(model: str, package_dir: str, gpu: str = "gpu0") -> WorkerSpec:
    return WorkerSpec(model, gpu, int(gpu.removeprefix("gpu")), "cpu", package_dir, memory_mb=300)


async def call(pool: WorkerPool, spec: WorkerSpec, inputs: object = None, *, timeout_s: float = TIMEOUT_S) -> RunResult:
    payload = inputs if isinstance(inputs, bytes) else json.dumps(inputs).encode()
    return await pool.run(spec, f"call-{time.monotonic_ns()}", payload, timeout_s=timeout_s)


async def pid_of(pool: WorkerPool, model: str, gpu: str) -> int:
    """The pid of a worker once it is ready (for calls still running)."""
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            for m, g, pid in pool.workers():
                if (m, g) == (model, gpu):
                    return pid
            await asyncio.sleep(0.01)


# --- emulated backend: process lifecycle without torch ------------------------------------------


def test_first_run_starts_a_worker_and_the_next_reuses_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            spec = emulated(inference_s=0.05)
            first = await call(pool, spec, {"x": 1})
            [(model, gpu, pid)] = pool.workers()
            second = await call(pool, spec, {"x": 2})

            assert (model, gpu) == ("m", "gpu0")
            assert first.loaded and first.load_time_s > 0
            assert not second.loaded and second.load_time_s == 0.0
            assert pool.workers() == [("m", "gpu0", pid)]
            assert json.loads(second.output) == {
                "model": "m",
                "backend": "emulated",
                "device": "emulated:0",
                "echo": {"x": 2},
            }
            assert second.inference_time_s == pytest.approx(0.05, abs=0.04)
            assert second.peak_memory_mb == 700

    run(scenario)


def test_one_call_at_a_time_per_gpu_while_gpus_run_in_parallel(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            a0, b0 = emulated("a", "gpu0", inference_s=0.2), emulated("b", "gpu0", inference_s=0.2)
            a1 = emulated("a", "gpu1", inference_s=0.2)
            await asyncio.gather(call(pool, a0), call(pool, a1))
            await call(pool, b0)  # every worker warm: what follows is inference time only

            started = time.perf_counter()
            await asyncio.gather(call(pool, a0), call(pool, b0))
            same_gpu_s = time.perf_counter() - started

            started = time.perf_counter()
            await asyncio.gather(call(pool, a0), call(pool, a1))
            two_gpus_s = time.perf_counter() - started

            assert same_gpu_s >= 0.4
            assert two_gpus_s < 0.35

    run(scenario)


def test_concurrent_first_calls_of_a_model_start_one_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            results = await asyncio.gather(*(call(pool, emulated(load_s=0.2)) for _ in range(4)))

            assert [r.loaded for r in results].count(True) == 1
            assert len(pool.workers()) == 1
            assert len(worker_processes()) == 1

    run(scenario)


def test_a_timeout_kills_the_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            slow = emulated(inference_s=30.0)
            calling = asyncio.create_task(call(pool, slow, timeout_s=1.0))
            pid = await pid_of(pool, "m", "gpu0")
            with pytest.raises(RunTimeout, match="no result within the 1 s timeout"):
                await calling

            assert pool.workers() == []
            async with asyncio.timeout(5):
                while is_running(pid):  # killed at once, reaped by the pool's reader thread
                    await asyncio.sleep(0.01)

            with pytest.raises(RunTimeout, match="not loaded"):  # stuck while loading: killed too
                await call(pool, emulated("loads-forever", load_s=30.0), timeout_s=0.3)
            assert pool.workers() == []

    run(scenario)


def test_a_call_that_cannot_get_the_gpu_in_time_kills_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            busy = emulated("busy", inference_s=0.5)
            holding = asyncio.create_task(call(pool, busy))
            pid = await pid_of(pool, "busy", "gpu0")
            with pytest.raises(RunTimeout, match="stayed busy"):
                await call(pool, emulated("other"), timeout_s=0.1)
            await holding

            assert pool.workers() == [("busy", "gpu0", pid)]

    run(scenario)


def test_a_worker_killed_from_outside_fails_the_next_call_and_the_one_after_restarts(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            spec = emulated()
            await call(pool, spec)
            [(_, _, pid)] = pool.workers()

            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerDied) as died:
                await call(pool, spec)
            assert died.value.exit_code == -signal.SIGKILL
            assert pool.workers() == []

            again = await call(pool, spec)
            [(_, _, new_pid)] = pool.workers()
            assert again.loaded
            assert new_pid != pid

    run(scenario)


def test_evict_kills_the_worker_and_is_idempotent(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            await call(pool, emulated("a"))
            await call(pool, emulated("b"))
            [pid_a] = [pid for m, _, pid in pool.workers() if m == "a"]

            assert await pool.evict("a", "gpu0")
            assert not is_running(pid_a)
            assert [m for m, _, _ in pool.workers()] == ["b"]
            assert not await pool.evict("a", "gpu0")
            assert not await pool.evict("never-loaded", "gpu0")
            assert (await call(pool, emulated("a"))).loaded

    run(scenario)


def test_a_redeployed_package_replaces_the_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            await call(pool, emulated())
            [(_, _, old_pid)] = pool.workers()
            redeployed = WorkerSpec("m", "gpu0", 0, "emulated", "/packages/v2", 700, 0.0, 0.0)

            assert (await call(pool, redeployed)).loaded
            [(_, _, new_pid)] = pool.workers()
            assert new_pid != old_pid
            assert not is_running(old_pid)

    run(scenario)


def test_a_cancelled_start_leaves_no_process(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            starting = asyncio.create_task(call(pool, emulated(load_s=30.0)))
            async with asyncio.timeout(TIMEOUT_S):
                while not worker_processes():
                    await asyncio.sleep(0.01)
            [process] = worker_processes()
            starting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await starting
            async with asyncio.timeout(5):
                while process.pid is not None and is_running(process.pid):
                    await asyncio.sleep(0.01)

    run(scenario)


def test_shutdown_stops_ready_and_loading_workers_and_refuses_later_calls(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            await asyncio.gather(call(pool, emulated("a", "gpu0")), call(pool, emulated("a", "gpu1")))
            loading = asyncio.create_task(call(pool, emulated("b", "gpu2", load_s=30.0)))
            async with asyncio.timeout(TIMEOUT_S):
                while len(worker_processes()) < 3:
                    await asyncio.sleep(0.01)
            pids = [p.pid for p in worker_processes()]

            await pool.shutdown()

            assert not any(pid is not None and is_running(pid) for pid in pids)
            with pytest.raises(WorkerDied):
                await loading
            with pytest.raises(RuntimeError, match="shut down"):
                await call(pool, emulated("a", "gpu0"))

    run(scenario)


def test_a_spec_for_another_backend_is_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("emulated", tmp_path) as pool:
            with pytest.raises(ValueError, match="this node runs 'emulated'"):
                await call(pool, cpu("m", "/nowhere"))

    run(scenario)


# --- cpu backend: the function's real handler ---------------------------------------------------


def test_cpu_handler_sees_its_package_and_round_trips_bytes_text_and_json(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("cpu", tmp_path) as pool:
            spec = cpu("echo", await install(pool, "echo_function", tmp_path))

            as_json = json.loads((await call(pool, spec, {"a": [1, 2]})).output)
            raw = await call(pool, spec, b"\xff\x00raw")
            text = await call(pool, spec, {"text": True})

            [(_, _, pid)] = pool.workers()
            assert as_json == {
                "echo": {"a": [1, 2]},
                "device": "cpu",
                "helper": "from helper.py",
                "package_dir": spec.package_dir,
                "cwd": spec.package_dir,
                "pid": pid,
            }
            assert raw.output == b"\xff\x00raw"
            assert text.output == b"plain text"
            assert text.peak_memory_mb == 300  # declared: there is no device memory to measure on the cpu

    run(scenario)


def test_cpu_linear_function_loads_its_safetensors_weights_and_is_deterministic(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    async def scenario() -> None:
        async with open_pool("cpu", tmp_path) as pool:
            spec = cpu("linear", await install(pool, "linear_function", tmp_path))
            inputs = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]]

            first = await call(pool, spec, {"inputs": inputs})
            second = await call(pool, spec, {"inputs": inputs})

            weights = load_file(str(tmp_path / "linear_function-src" / "weights.safetensors"))
            expected = (torch.tensor(inputs) @ weights["weight"].T + weights["bias"]).tolist()
            outputs = json.loads(first.output)["outputs"]
            assert len(outputs) == 2 and all(len(row) == 2 for row in outputs)
            for got, want in zip(outputs, expected, strict=True):
                assert got == pytest.approx(want, abs=1e-6)
            assert second.output == first.output
            assert first.loaded and not second.loaded

    run(scenario)


def test_a_predict_error_is_the_users_and_the_worker_keeps_serving(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("cpu", tmp_path) as pool:
            spec = cpu("flaky", await install(pool, "failing_function", tmp_path))
            with pytest.raises(
                HandlerError, match="model 'flaky' on gpu0: predict raised ValueError: bad input"
            ) as error:
                await call(pool, spec, {"fail": True})
            assert error.value.resident
            [(_, _, pid)] = pool.workers()

            after = await call(pool, spec, {"fail": False})

            assert after.output == b"ok" and not after.loaded
            assert pool.workers() == [("flaky", "gpu0", pid)]

    run(scenario)


def test_a_load_error_is_the_users_and_leaves_no_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with open_pool("cpu", tmp_path) as pool:
            spec = cpu("broken", await install(pool, "failing_load_function", tmp_path))
            with pytest.raises(HandlerError, match="load failed: RuntimeError: weights are missing") as error:
                await call(pool, spec, {})
            assert not error.value.resident
            assert pool.workers() == []
            assert worker_processes() == []

    run(scenario)
