"""gpu_manager.containers: what a worker's container is (no engine needed)."""

from __future__ import annotations

from pathlib import Path

from gpu_manager.containers import (
    HOST_HEADROOM_MB,
    PACKAGE_MOUNT,
    RUNTIME_MB,
    SOCKET_MOUNT,
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
    assert kwargs["cap_drop"] == ["ALL"] and kwargs["security_opt"] == ["no-new-privileges"]
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == f"{RUNTIME_MB + 200 + HOST_HEADROOM_MB}m"
    assert kwargs["pids_limit"] == 512
    mounts = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in kwargs["mounts"]}
    assert mounts == {PACKAGE_MOUNT: ("/state/packages/ff", True), SOCKET_MOUNT: ("/tmp/s/abc123", False)}
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
