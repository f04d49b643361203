"""gpu_manager.containers: what a worker's container is (no engine needed)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpu_manager.containers import (
    CPU_SHARES,
    HOST_HEADROOM_MB,
    NODE_LABEL,
    OOM_REMEMBERED,
    PACKAGE_MOUNT,
    RUNTIME_MB,
    SOCKET_MOUNT,
    DockerLauncher,
    container_environment,
    container_spec,
    memory_limit_mb,
    node_instance,
)


def spec(backend: str = "cpu", **overrides: object) -> object:
    options: dict[str, object] = {
        "image": "gpufaas/worker:test",
        "node": "node0",
        "instance": "i0",
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
    assert kwargs["labels"] == {"gpufaas.node": "node0", "gpufaas.instance": "i0", "gpufaas.gpu": "gpu1"}
    assert kwargs["log_config"]["Config"] == {"max-size": "10m", "max-file": "1"}
    assert "device_requests" not in kwargs  # no GPU on the cpu backend
    assert kwargs["command"][:3] == ["python", "-m", "gpu_manager.worker"]
    assert kwargs["environment"] == {"HOME": "/tmp", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def test_a_worker_container_is_never_given_root() -> None:
    with pytest.raises(ValueError, match="never runs as root"):
        spec(uid=0)


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


def test_a_containers_name_is_one_the_engine_accepts_whatever_its_nodes_name() -> None:
    """The engine refuses a container name outside [a-zA-Z0-9][a-zA-Z0-9_.-]+ (400, "Invalid
    container name"), so a node named with a space, a colon or a slash could start no worker; its
    label keeps the name as given (what its cleanup filters on)."""
    made = spec(node="rack 1/gpu:0")
    assert re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+", made.name), made.name  # type: ignore[attr-defined]
    assert made.labels[NODE_LABEL] == "rack 1/gpu:0"  # type: ignore[attr-defined]
    assert spec().name == "gpufaas-node0-abc123"  # type: ignore[attr-defined]


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
    launcher._watch_memory("node0", "i0")
    launcher._watch_memory("node0", "i0")  # one watcher per node instance
    for _ in range(100):
        if len(engine.killed) == 2:
            break
        time.sleep(0.05)
    launcher.close()
    assert engine.killed == ["a", "b"]
    assert launcher.over_memory("a") and launcher.over_memory("b") and not launcher.over_memory("c")
    (asked,) = engine.asked
    labels = ["gpufaas.node=node0", "gpufaas.instance=i0"]  # this node of this cluster's only
    assert asked["filters"] == {"type": "container", "event": "oom", "label": labels}
    assert asked["decode"] is True
    assert engine.stream.closed.is_set()  # close() ends the watcher's stream


def test_it_remembers_the_latest_containers_killed_for_their_memory_only() -> None:
    launcher = DockerLauncher()
    launcher._client = FakeEngine([])
    for n in range(OOM_REMEMBERED + 1):
        launcher._kill_over_memory(f"c{n}")
    assert not launcher.over_memory("c0") and launcher.over_memory("c1") and launcher.over_memory(f"c{OOM_REMEMBERED}")


class ListedContainer:
    """A container as a sparse listing gives it: its labels in `attrs` only."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.attrs = {"Labels": labels}
        self.removed = False

    def remove(self, force: bool = False) -> None:
        self.removed = True


class ListingEngine:
    """What DockerLauncher's cleanup asks of the Docker SDK: `containers.list`, filtered by labels
    as dockerd does (`label=k=v`, every one given must hold)."""

    def __init__(self) -> None:
        self.all: list[ListedContainer] = []
        self.containers = self

    def list(self, *, all: bool, sparse: bool, filters: dict[str, list[str]]) -> list[ListedContainer]:
        wanted = [label.split("=", 1) for label in filters["label"]]
        return [c for c in self.all if not c.removed and all_hold(c.attrs["Labels"], wanted)]


def all_hold(labels: dict[str, str], wanted: list[list[str]]) -> bool:
    return all(labels.get(key) == value for key, value in wanted)


def test_a_node_starting_removes_what_its_previous_run_left_and_nothing_of_another_clusters(tmp_path: Path) -> None:
    # Two clusters on one engine (`gpufaas up --runtime docker` in two state directories), each
    # with a node0 on the default key root: A's is serving; B's starts.
    engine = ListingEngine()
    a, b = (node_instance("node0", root="/gpufaas", state_dir=tmp_path / name / "node0") for name in ("a", "b"))
    serving = ListedContainer(spec(instance=a).labels)  # type: ignore[attr-defined]
    # One a node0 left before containers named their instance (an upgrade): whoever starts next takes it.
    before_upgrade = ListedContainer({"gpufaas.node": "node0", "gpufaas.gpu": "gpu0"})
    engine.all += [serving, before_upgrade]
    for instance, expected in ((b, 1), (a, 1)):  # B's start, then A's node0 restarted
        launcher = DockerLauncher(instance=instance)
        launcher._client = engine
        assert asyncio.run(launcher.remove_node_containers("node0")) == expected
    assert serving.removed and before_upgrade.removed


def test_a_node_instance_is_its_name_key_root_and_state_directory(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "link").symlink_to(state)
    first = node_instance("node0", root="/gpufaas", state_dir=state)
    assert first == node_instance("node0", root="/gpufaas", state_dir=tmp_path / "link")  # its real path
    others = [("node1", "/gpufaas", state), ("node0", "/other", state), ("node0", "/gpufaas", tmp_path)]
    assert all(node_instance(node, root=root, state_dir=d) != first for node, root, d in others)
