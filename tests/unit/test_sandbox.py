"""gpu_manager.sandbox's decisions: package users, the environment passed on, memory allowances,
the output budget, and which directories others can reach."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_manager.sandbox import (
    MEMORY_HEADROOM_MB,
    PACKAGE_UID_BASE,
    Isolation,
    LogBudget,
    _open_to_others,
    data_allowance_mb,
    lock_package,
    package_uid,
    worker_environment,
)


def test_a_package_user_is_fixed_by_its_digest_and_clear_of_host_ids() -> None:
    digests = [f"sha256:{i:064x}" for i in range(2000)] + ["sha256:" + "f" * 64]
    uids = [package_uid(d) for d in digests]
    assert uids == [package_uid(d) for d in digests]  # the same on every node, every time
    assert all(PACKAGE_UID_BASE <= uid < 2**31 - 1 for uid in uids)
    assert len(set(uids)) == len(uids)
    assert package_uid("sha256:" + "ab" * 32) == package_uid("ab" * 32)


def test_only_the_runtimes_variables_reach_a_worker() -> None:
    node = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/src",
        "GPUFAAS_SECRET_FILE": "/run/gpufaas/cluster-secret",
        "GPUFAAS_PASSWORD": "hunter2",
        "AWS_SECRET_ACCESS_KEY": "x",
        "ETCDCTL_ENDPOINTS": "etcd:2379",
        "HOME": "/root",
        "SSH_AUTH_SOCK": "/tmp/agent",
    }
    assert worker_environment(node) == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/src",
    }


def test_memory_is_bounded_by_the_declaration_on_cpu_only() -> None:
    assert data_allowance_mb("cpu", 100) == 200 + MEMORY_HEADROOM_MB
    assert data_allowance_mb("cuda", 100) is None  # the model is in GPU memory; docker limits the host side
    assert data_allowance_mb("emulated", 100) is None


def test_the_output_budget_allows_a_burst_then_the_rate_and_counts_the_rest() -> None:
    budget = LogBudget(rate_bytes_s=100, burst_bytes=1000, now=0.0)
    assert budget.take(800, now=0.0) == 800
    assert budget.take(800, now=0.0) == 200
    assert budget.dropped == 600
    assert budget.take(500, now=2.0) == 200  # 2 s at 100 B/s
    assert budget.take(10_000, now=1000.0) == 1000  # refilled to the burst, no more
    assert budget.dropped == 600 + 300 + 9000


def test_a_directory_is_open_to_others_only_if_every_one_above_may_be_passed(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    inner = closed / "inner"
    inner.mkdir(parents=True)
    for directory in [tmp_path, *tmp_path.parents]:
        directory.chmod(directory.stat().st_mode | 0o001)
    inner.chmod(0o755)
    closed.chmod(0o700)
    assert not _open_to_others(str(inner))
    closed.chmod(0o711)
    assert _open_to_others(str(inner))
    inner.chmod(0o750)
    assert not _open_to_others(str(inner))


@pytest.mark.parametrize(("users", "expected"), [(True, True), (False, False), (None, os.geteuid() == 0)])
def test_package_users_follow_the_setting_or_whether_the_node_is_root(users: bool | None, expected: bool) -> None:
    assert Isolation(users=users).per_package_users is expected


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root (CI runs as root)")
def test_locking_a_package_leaves_the_blobs_it_shares_as_they_are(tmp_path: Path) -> None:
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "handler.py").write_text("def load(d): ...\n")
    blob = tmp_path / "blob"
    blob.write_bytes(b"weights")
    blob.chmod(0o444)
    os.link(blob, package / "sub" / "weights.bin")  # as staging links a large file to its blob

    lock_package(package, 4242)

    handler = (package / "handler.py").stat()
    assert (handler.st_uid, handler.st_gid, handler.st_mode & 0o777) == (0, 4242, 0o640)
    assert ((package / "sub").stat().st_gid, (package / "sub").stat().st_mode & 0o777) == (4242, 0o750)
    shared = blob.stat()
    assert (shared.st_uid, shared.st_gid, shared.st_mode & 0o777) == (0, 0, 0o444)  # another package's too
