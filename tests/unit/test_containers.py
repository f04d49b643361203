"""gpu_manager.containers: what a worker's container is (no engine needed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpu_manager.containers import (
    CPU_SHARES,
    HOST_HEADROOM_MB,
    OOM_REMEMBERED,
    PACKAGE_MOUNT,
    RUNTIME_MB,
    SOCKET_MOUNT,
    DockerLauncher,
    container_environment,
    container_spec,
    memory_limit_mb,
)


def spec(backend: str = "cpu", **overrides: object) -> object:
    options: dict[str, object] = {
        "image": "gpufaas/worker:test",
        "node": "node0",
        "worker_id": "abc123",
        "backend": backend,
        "gpu_id": "gpu1",
        "gpu_index": 3,
        "memory_mb": 100,
        "uid": 16777300,
        "package_dir": Path("/state/packages/ff"),
        "socket_dir": Path("/tmp/s/abc123"),
        "max_processes": 512,
        "environment": {"OMP_NUM_THREADS": "1"},
    }
    options.update(overrides)
    return container_spec(**options)  # type: ignore[arg-type]


def test_a_worker_container_is_unprivileged_offline_read_only_and_limited() -> None:
    kwargs = spec().run_kwargs()  # type: ignore[attr-defined]
    assert kwargs["user"] == "16777300:16777300"
    assert kwargs["network_mode"] == "none"
    assert kwargs["read_only"] is True and kwargs["tmpfs"] == {"/tmp": "rw,size=256m,mode=1777"}
    assert kwargs["shm_size"] == "64m"  # /dev/shm: the other place it may write
    assert kwargs["cap_drop"] == ["ALL"] and kwargs["security_opt"] == ["no-new-privileges"]
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == f"{RUNTIME_MB + 200 + HOST_HEADROOM_MB}m"
    assert kwargs["pids_limit"] == 512
    assert kwargs["cpu_shares"] == CPU_SHARES and "nano_cpus" not in kwargs  # a weight, no quota unless asked
    mounts = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in kwargs["mounts"]}
    # The socket's directory too is read-only: connecting needs no writable mount.
    assert mounts == {PACKAGE_MOUNT: ("/state/packages/ff", True), SOCKET_MOUNT: ("/tmp/s/abc123", True)}
    assert kwargs["labels"] == {"gpufaas.node": "node0", "gpufaas.gpu": "gpu1"}
    assert kwargs["log_config"]["Config"] == {"max-size": "10m", "max-file": "1"}
    assert "device_requests" not in kwargs  # no GPU on the cpu backend
    assert kwargs["command"][:3] == ["python", "-m", "gpu_manager.worker"]
    assert kwargs["environment"] == {"HOME": "/tmp", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def test_on_cuda_it_gets_exactly_its_gpu_and_sees_it_as_device_zero() -> None:
    kwargs = spec("cuda").run_kwargs()  # type: ignore[attr-defined]
    (request,) = kwargs["device_requests"]
    assert request["DeviceIDs"] == ["3"] and request["Capabilities"] == [["gpu"]]
    command = kwargs["command"]
    assert command[command.index("--device-index") + 1] == "0"


def test_the_memory_limit_follows_the_declaration_and_host_paths_stay_home() -> None:
    assert memory_limit_mb("cpu", 1000) - memory_limit_mb("cpu", 100) == 1800
    assert container_environment({"PATH": "/usr/bin", "PYTHONPATH": "/src", "OMP_NUM_THREADS": "1", "X": "y"}) == {
        "OMP_NUM_THREADS": "1"
    }


def test_a_cpu_quota_is_set_only_when_asked() -> None:
    assert spec(cpus=1.5).run_kwargs()["nano_cpus"] == 1_500_000_000  # type: ignore[attr-defined]


class FakeStream:
    """The engine's event stream: `events`, then blocks until closed (as the real one does)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self.events
        self.closed.wait(10)

    def close(self) -> None:
        self.closed.set()


class FakeEngine:
    """What DockerLauncher's OOM watcher asks of the Docker SDK: `events` and `containers.get(id).kill()`."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.stream = FakeStream(events)
        self.asked: list[dict[str, Any]] = []
        self.killed: list[str] = []
        self.containers = self

    def events(self, **options: Any) -> FakeStream:
        self.asked.append(options)
        return self.stream

    def get(self, container_id: str) -> Any:
        engine = self

        class Container:
            def kill(self) -> None:
                engine.killed.append(container_id)

        return Container()


def test_a_container_meeting_its_memory_limit_is_killed_whole_once_and_remembered() -> None:
    # The engine says `oom` once per process the kernel kills: "a" twice, then "b".
    engine = FakeEngine([{"id": "a", "time": 100}, {"id": "a", "time": 100}, {"id": "b", "time": 101}])
    launcher = DockerLauncher()
    launcher._client = engine
    launcher._watch_memory("node0")
    launcher._watch_memory("node0")  # one watcher per node
    for _ in range(100):
        if len(engine.killed) == 2:
            break
        time.sleep(0.05)
    launcher.close()
    assert engine.killed == ["a", "b"]
    assert launcher.over_memory("a") and launcher.over_memory("b") and not launcher.over_memory("c")
    (asked,) = engine.asked
    assert asked["filters"] == {"type": "container", "event": "oom", "label": "gpufaas.node=node0"}
    assert asked["decode"] is True
    assert engine.stream.closed.is_set()  # close() ends the watcher's stream


def test_it_remembers_the_latest_containers_killed_for_their_memory_only() -> None:
    launcher = DockerLauncher()
    launcher._client = FakeEngine([])
    for n in range(OOM_REMEMBERED + 1):
        launcher._kill_over_memory(f"c{n}")
    assert not launcher.over_memory("c0") and launcher.over_memory("c1") and launcher.over_memory(f"c{OOM_REMEMBERED}")
