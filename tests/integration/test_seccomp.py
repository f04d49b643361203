"""A worker's seccomp filter (gpu_manager.seccomp), probed from inside a real function on a real
cluster (fixture `syscall_function`): each call it tries is refused, and the worker still serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_manager import seccomp
from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(seccomp.unavailable_reason() is not None, reason="no seccomp filter on this machine"),
]
TRIED = ("ptrace_attach", "ptrace_traceme", "unshare_user", "mount", "bpf", "keyctl", "io_uring_setup")


def call(cluster: LocalCluster, name: str) -> dict[str, Any]:
    response = httpx.post(
        f"{cluster.gateway_url}/function/{name}", json={}, headers=cluster.invoke_headers, timeout=120
    )
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


def test_a_function_is_refused_what_it_never_needs_and_its_worker_still_serves(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """Without the filter these calls succeed (ptrace of its own child, a user namespace, a
    keyring id, an io_uring) or fail otherwise (mount: ENOENT, bpf: EINVAL); with it, EPERM."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=4000)
    deploy(cluster, "syscalls", "syscall_function", tmp_path, memory_mb=200)
    first = call(cluster, "syscalls")
    print(f"calls from inside a worker: {first['calls']}")
    assert first["calls"] == dict.fromkeys(TRIED, "EPERM")
    assert first["seccomp"] == "2" and first["torch"] == 64 * 64 * 64
    second = call(cluster, "syscalls")  # the same worker, still serving after every refusal
    assert second["pid"] == first["pid"] and second["calls"] == first["calls"]
