"""The worker pool on the docker runtime, over a fake container engine: a container per model, made
with its package, pooled weights and layer mounted where LoadModel says they are, spoken to on a
socket of its own, stopped through the engine and removed. The fake plays the worker's side of the
protocol on that socket (what `python -m gpu_manager.worker --connect` does in a real container);
tests/integration/test_docker_runtime.py runs the real engine."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpu_manager import seccomp
from gpu_manager.containers import (
    LAYER_MOUNT,
    PACKAGE_MOUNT,
    POOL_MOUNT,
    SOCKET_MOUNT,
    SOCKET_NAME,
    UNCONFINED_UID,
    ContainerSpec,
)
from gpu_manager.pool import ModelRun, RunResult, WeightsPlan, WorkerPool
from gpu_manager.runtimes import make_runtime
from gpu_manager.runtimes.base import log
from gpu_manager.runtimes.process import ProcessRuntime
from gpu_manager.sandbox import Isolation, package_locked
from gpufaas.packages import InvalidPackage
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, Frame, MessageType

OCTETS = "application/octet-stream"
TIMEOUT_S = 10.0
FAKE_PID = 999_999_999  # beyond pid_max: a signal sent to it by mistake reaches nobody
NODE = "node7"


@dataclass
class _Container:
    spec: ContainerSpec
    connect: bool
    signals: list[int] = field(default_factory=list)
    removed: bool = False
    conn: Connection | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    status: int = 0


class FakeEngine:
    """The container engine's contract (gpu_manager.runtimes.docker.ContainerEngine) in memory. A
    started container connects to the socket its spec mounts at SOCKET_MOUNT and answers as a
    worker: hello, ModelLoaded for LoadModel (recorded in `loads`), each call's payload echoed
    back. SIGTERM or SIGKILL ends it (its socket closes); `connect=False` makes containers that
    exit at once, before connecting."""

    image = "gpufaas/worker:test"
    instance = "node7-instance"

    def __init__(self, *, connect: bool = True) -> None:
        self.connect = connect
        self.containers: dict[str, _Container] = {}
        self.loads: list[pb.LoadModel] = []
        self.checked = False
        self.closed = False
        self.out_of_memory: set[str] = set()  # containers the engine reported an oom event for
        self.cleared_nodes: list[str] = []
        self._ids = itertools.count(1)

    async def check(self) -> None:
        self.checked = True

    async def remove_node_containers(self, node: str) -> int:
        self.cleared_nodes.append(node)
        return 0

    async def start(self, spec: ContainerSpec) -> str:
        targets = [target for _, target, _ in spec.mounts]
        if len(set(targets)) < len(targets):  # dockerd's refusal (an APIError, an OSError)
            raise OSError(f"500 Server Error: Duplicate mount point: {targets}")
        container_id = f"c{next(self._ids):063d}"
        container = self.containers[container_id] = _Container(spec, self.connect)
        if container.connect:
            (socket_dir,) = [source for source, target, _ in spec.mounts if target == SOCKET_MOUNT]
            _, container.conn = await asyncio.get_running_loop().create_unix_connection(
                lambda: Connection(_PlayedWorker(self, container)), str(Path(socket_dir) / SOCKET_NAME)
            )
            container.conn.send(MessageType.WORKER_HELLO, pb.WorkerHello(pid=FAKE_PID, network_isolated=True))
        else:
            container.status = 1
            container.done.set()
        return container_id

    async def exited(self, container_id: str) -> str:
        container = self.containers[container_id]
        await container.done.wait()
        return f"status {container.status}; it printed nothing"

    async def kill(self, container_id: str, signum: int) -> None:
        container = self.containers[container_id]
        container.signals.append(signum)
        if container.conn is not None:
            container.conn.close()  # the worker exits: its end of the socket closes
        container.status = 128 + signum
        container.done.set()

    def over_memory(self, container_id: str) -> bool:
        return container_id in self.out_of_memory

    def close(self) -> None:
        self.closed = True

    async def wait_and_remove(self, container_id: str, timeout_s: float) -> int | None:
        container = self.containers[container_id]
        try:
            await asyncio.wait_for(container.done.wait(), timeout_s)
        except TimeoutError:
            await self.kill(container_id, signal.SIGKILL)
        container.removed = True
        return container.status


@dataclass
class _PlayedWorker:
    """The worker's side of the protocol (gpu_manager.worker), in the fake container."""

    engine: FakeEngine
    container: _Container

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.LOAD_MODEL:
            self.engine.loads.append(frame.message(pb.LoadModel))
            conn.send(MessageType.MODEL_LOADED, pb.ModelLoaded(ok=True, load_s=0.01, peak_memory_mb=1))
        elif frame.type == MessageType.CALL:
            call = frame.message(pb.Call)
            if frame.body == b"hog":  # the engine's oom event, then the container killed whole
                self.engine.out_of_memory.update(i for i, c in self.engine.containers.items() if c is self.container)
                conn.close()
                return
            result = pb.CallResult(call_id=call.call_id, outcome=pb.OK, content_type=OCTETS, batch_calls=1)
            conn.send(MessageType.CALL_RESULT, result, b"echo:" + frame.body)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.container.done.set()


@asynccontextmanager
async def docker_pool(
    tmp_path: Path,
    engine: FakeEngine,
    *,
    fetch_s: float = 0.0,
    weight_files: tuple[str, ...] = ("model.safetensors",),
    fetch_error: Exception | None = None,
) -> AsyncIterator[WorkerPool]:
    """A pool on the docker runtime whose package (fetched in `fetch_s`, or failing with
    `fetch_error`) has weights in the host pool and a layer: `weight_files`, identical, so one
    pool file."""
    package_dir = tmp_path / "packages" / "p1"
    package_dir.mkdir(parents=True)
    (tmp_path / "layer").mkdir()

    async def fetch(digest: str) -> tuple[Path, float]:
        await asyncio.sleep(fetch_s)
        if fetch_error is not None:
            raise fetch_error
        return package_dir, fetch_s

    async def weights(digest: str, directory: Path) -> WeightsPlan:
        pooled = {name: str(tmp_path / "pool" / f"{digest}-model.safetensors") for name in weight_files}
        return WeightsPlan(pooled=pooled, layer_dir=str(tmp_path / "layer"), from_pool=True)

    pool = WorkerPool(
        "cpu",
        gpus={"gpu0": 0},
        fetch_package=fetch,
        prepare_weights=weights,
        spares_per_gpu=0,
        runtime="docker",
        launcher=engine,
        node=NODE,
        isolation=Isolation(users=False),  # no package users (as root: containers run as UNCONFINED_UID)
    )
    await pool.check_runtime()
    pool.start()
    try:
        yield pool
    finally:
        await asyncio.wait_for(pool.shutdown(), TIMEOUT_S)


async def call(pool: WorkerPool, payload: bytes, call_id: str = "c1", *, timeout_s: float = TIMEOUT_S) -> RunResult:
    run = ModelRun(model="m", package_digest="d1", memory_mb=100)
    return await pool.run(run, "gpu0", call_id, payload, content_type=OCTETS, timeout_s=timeout_s)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait (up to TIMEOUT_S) until `predicate()` holds: what happens after a call's answer."""
    async with asyncio.timeout(TIMEOUT_S):
        while not predicate():
            await asyncio.sleep(0.01)


def test_a_container_is_made_for_its_model_told_its_own_paths_served_and_removed_when_evicted(
    tmp_path: Path,
) -> None:
    engine = FakeEngine()

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine) as pool:
            assert engine.checked and engine.cleared_nodes == [NODE]  # what a previous run left goes
            assert pool.spare_count("gpu0") == 0 and pool.live_workers() == 0  # nothing before a model

            first = await call(pool, b"hi")
            second = await call(pool, b"again", "c2")
            assert (first.outcome, first.output, first.loaded) == (pb.OK, b"echo:hi", True)
            assert (second.outcome, second.output, second.loaded) == (pb.OK, b"echo:again", False)
            assert pool.workers() == [("m", "gpu0", FAKE_PID, 100)]
            (container,) = engine.containers.values()
            spec = container.spec
            assert spec.image == FakeEngine.image
            assert (spec.labels["gpufaas.node"], spec.labels["gpufaas.instance"]) == (NODE, FakeEngine.instance)
            mounts = {target: (Path(source), read_only) for source, target, read_only in spec.mounts}
            pooled_host = tmp_path / "pool" / "d1-model.safetensors"
            assert mounts[PACKAGE_MOUNT] == (tmp_path / "packages" / "p1", True)
            assert mounts[f"{POOL_MOUNT}/{pooled_host.name}"] == (pooled_host, True)
            assert mounts[LAYER_MOUNT] == (tmp_path / "layer", True)
            socket_dir = mounts[SOCKET_MOUNT][0]

            # LoadModel names what the container sees, not the node's paths.
            (load,) = engine.loads
            assert load.package_dir == PACKAGE_MOUNT and load.layer_dir == LAYER_MOUNT
            assert dict(load.pooled) == {"model.safetensors": f"{POOL_MOUNT}/{pooled_host.name}"}
            assert load.uid == 0 and load.max_file_mb > 0  # the container is its user and limits

            assert await asyncio.wait_for(pool.evict("m", "gpu0"), TIMEOUT_S)
            assert container.signals == [signal.SIGTERM] and container.removed
            assert not socket_dir.exists()
            assert pool.workers() == [] and pool.live_workers() == 0
            assert pool.worker_starts == 1 and pool.worker_exits["stopped"] == 1

    asyncio.run(scenario())


def test_a_package_with_two_identical_weight_files_mounts_their_one_pool_file_once(tmp_path: Path) -> None:
    engine = FakeEngine()
    files = ("a/model.safetensors", "b/model.safetensors")  # a checkpoint and a copy of it

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine, weight_files=files) as pool:
            result = await call(pool, b"hi")
            assert (result.outcome, result.output) == (pb.OK, b"echo:hi"), result.message
            (container,) = engine.containers.values()
            inside = f"{POOL_MOUNT}/d1-model.safetensors"
            assert [target for _, target, _ in container.spec.mounts].count(inside) == 1
            (load,) = engine.loads
            assert dict(load.pooled) == dict.fromkeys(files, inside)  # both paths, one file

    asyncio.run(scenario())


@pytest.mark.skipif(os.geteuid() != 0, reason="a node gives its containers another user only as root (CI runs as root)")
def test_a_root_node_without_package_users_never_runs_a_container_as_root(tmp_path: Path) -> None:
    engine = FakeEngine()

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine) as pool:  # --unconfined-workers: no package users
            result = await call(pool, b"hi")
            assert (result.outcome, result.output) == (pb.OK, b"echo:hi")
            (container,) = engine.containers.values()
            assert container.spec.user == f"{UNCONFINED_UID}:{UNCONFINED_UID}"
            assert package_locked(tmp_path / "packages" / "p1", UNCONFINED_UID)  # that user may read it

    asyncio.run(scenario())


def test_a_container_that_exits_before_it_connects_fails_its_call_and_is_removed(tmp_path: Path) -> None:
    engine = FakeEngine(connect=False)

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine) as pool:
            result = await call(pool, b"hi")
            assert result.outcome == pb.WORKER_DIED and result.loaded
            assert "exited while starting" in result.message
            (container,) = engine.containers.values()
            await until(lambda: container.removed and pool.live_workers() == 0)
            assert pool.worker_exits["start_failed"] == 1
            assert pool.workers() == []

    asyncio.run(scenario())


def test_a_package_that_cannot_be_fetched_fails_its_calls_and_leaves_no_worker_behind(tmp_path: Path) -> None:
    engine = FakeEngine()
    missing = InvalidPackage("package d1 is not registered (deleted, or never uploaded)")

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine, fetch_error=missing) as pool:
            for call_id in ("c1", "c2"):
                result = await call(pool, b"hi", call_id)
                assert result.outcome == pb.LOAD_FAILED and "not registered" in result.message
            # Each worker's exit resolved: not live for good, nor waited on by the shutdown.
            await until(lambda: pool.live_workers() == 0)
            assert pool.worker_exits == {"load_failed": 2} and engine.containers == {}

    asyncio.run(scenario())  # docker_pool's shutdown waits at most TIMEOUT_S


def test_a_container_killed_while_its_package_is_fetched_is_never_started(tmp_path: Path) -> None:
    engine = FakeEngine()

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine, fetch_s=0.5) as pool:  # a large package, from a peer
            result = await call(pool, b"hi", timeout_s=0.1)
            assert (result.outcome, result.worker_killed) == (pb.TIMEOUT, True)
            await until(lambda: pool.live_workers() == 0)  # once the fetch ended
            assert engine.containers == {}  # no container started for nobody
            assert pool.worker_exits == {"killed": 1}
            again = await call(pool, b"hi", "c2")
            assert (again.outcome, again.output) == (pb.OK, b"echo:hi")

    asyncio.run(scenario())


def test_the_runtime_is_chosen_by_name_and_the_docker_one_keeps_no_spares() -> None:
    async def scenario() -> None:
        common = {
            "backend": "cpu",
            "gpus": {"gpu0": 0},
            "isolation": Isolation(),
            "max_body_bytes": 1024,
            "closing": lambda: False,
            "prepare": None,
            "track": lambda task: None,
        }
        assert make_runtime("process", **common).keeps_spares
        docker = make_runtime("docker", launcher=FakeEngine(), **common)
        assert not docker.keeps_spares and docker.package_dir(Path("/state/p")) == PACKAGE_MOUNT
        with pytest.raises(ValueError, match="keeps no spares"):
            make_runtime("docker", launcher=FakeEngine(), spares_per_gpu=1, **common)
        with pytest.raises(ValueError, match="unknown worker runtime 'podman'; use one of process, docker"):
            make_runtime("podman", **common)

    asyncio.run(scenario())


def test_a_container_over_its_memory_limit_answers_its_call_as_over_memory_and_is_replaced(tmp_path: Path) -> None:
    engine = FakeEngine()

    async def scenario() -> None:
        async with docker_pool(tmp_path, engine) as pool:
            result = await call(pool, b"hog")
            # Not a transient death (retried elsewhere): the function's own doing, named with its limit.
            assert result.outcome == pb.HANDLER_ERROR and result.worker_killed, result.message
            assert "went over their" in result.message and "MiB of host memory" in result.message
            await until(lambda: pool.live_workers() == 0)
            assert pool.worker_exits["over_memory"] == 1
            again = await call(pool, b"hi", "c2")
            assert (again.outcome, again.loaded) == (pb.OK, True)  # a new container
        assert engine.closed  # the node's shutdown stops watching the engine

    asyncio.run(scenario())


def test_a_node_whose_workers_can_get_no_seccomp_filter_says_so_once_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = ProcessRuntime(
        backend="cpu", gpus={"gpu0": 0}, isolation=Isolation(users=False), max_body_bytes=1 << 20, closing=lambda: False
    )
    monkeypatch.setattr(seccomp, "unavailable_reason", lambda: "PR_SET_SECCOMP: EPERM")
    with caplog.at_level(logging.WARNING, logger=log.name):
        asyncio.run(runtime.check())
    (warning,) = [r.getMessage() for r in caplog.records if "seccomp" in r.getMessage()]
    assert "no seccomp filter for workers here (PR_SET_SECCOMP: EPERM)" in warning

    caplog.clear()
    monkeypatch.setattr(seccomp, "unavailable_reason", lambda: None)
    with caplog.at_level(logging.WARNING, logger=log.name):
        asyncio.run(runtime.check())
    assert not [r for r in caplog.records if "seccomp" in r.getMessage()]
