"""gpu_manager.sandbox's decisions: package users, the environment passed on, memory allowances,
the output budget, and which directories others can reach; a confined worker's seccomp filter."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import json
import os
import re
import resource
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpu_manager import sandbox, seccomp
from gpu_manager.sandbox import (
    MAX_OPEN_FILES,
    MEMORY_HEADROOM_MB,
    PACKAGE_UID_BASE,
    PACKAGE_UID_SPAN,
    Isolation,
    LogBudget,
    PackageUsers,
    _open_to_others,
    close_descriptors,
    data_allowance_mb,
    filter_system_calls,
    lock_package,
    no_new_privileges,
    worker_environment,
)

REPO = Path(__file__).resolve().parents[2]


def test_a_package_user_is_its_own_clear_of_host_ids_and_kept_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "package-users.json"
    users = PackageUsers(path)
    digests = [f"sha256:{i:064x}" for i in range(2000)]
    uids = [users.uid(d) for d in digests]
    assert uids == [users.uid(d) for d in digests]  # the same for as long as the node runs
    assert all(PACKAGE_UID_BASE <= uid < 2**31 - 1 for uid in uids)
    assert len(set(uids)) == len(uids)
    assert users.uid("sha256:" + "ab" * 32) == users.uid("ab" * 32) == users.get("ab" * 32)
    restarted = PackageUsers(path)  # the node again: its staged packages keep their owners
    assert [restarted.get(d) for d in digests] == uids
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other_node = PackageUsers(tmp_path / "other.json")  # drawn, not derived: nothing to aim a digest at
    assert sum(other_node.uid(d) == uid for d, uid in zip(digests[:100], uids, strict=False)) < 3


def test_a_package_is_never_given_an_id_another_holds() -> None:
    # A digest made to hash to another package's id (its author picks its bytes; every worker's id
    # is public in /proc) gets an id of its own: here every draw but the last names the taken one.
    draws = iter([5, 5, 5, 9])
    users = PackageUsers(draw=lambda span: next(draws))
    assert users.uid("sha256:" + "1" * 64) == PACKAGE_UID_BASE + 5
    assert users.uid("sha256:" + "2" * 64) == PACKAGE_UID_BASE + 9


def test_package_users_that_cannot_be_read_or_kept_are_given_afresh_and_never_half_kept(tmp_path: Path) -> None:
    path = tmp_path / "package-users.json"
    for bad in (
        "not json",
        '{"aa": "x"}',
        "[1]",
        f'{{"aa": {PACKAGE_UID_BASE - 1}}}',
        '{"aa": 20000000, "bb": 20000000}',
    ):
        path.write_text(bad)
        assert PackageUsers(path).get("aa") is None, bad
    unwritable = PackageUsers(tmp_path / "missing-dir" / "package-users.json")
    with pytest.raises(OSError):
        unwritable.uid("sha256:" + "1" * 64)
    assert unwritable.get("sha256:" + "1" * 64) is None  # not run as an id a restart could give another
    assert PACKAGE_UID_BASE + PACKAGE_UID_SPAN == 2**31 - 1


def test_only_the_runtimes_variables_reach_a_worker() -> None:
    passed = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C",
        "CUDA_VISIBLE_DEVICES": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": "/src",
    }
    withheld = {
        "GPUFAAS_SECRET_FILE": "/run/gpufaas/cluster-secret",
        "GPUFAAS_PASSWORD": "hunter2",
        "AWS_SECRET_ACCESS_KEY": "x",
        "ETCDCTL_ENDPOINTS": "etcd:2379",
        "HOME": "/root",
        "SSH_AUTH_SOCK": "/tmp/agent",
    }
    assert worker_environment({**passed, **withheld}) == passed


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


def test_closing_descriptors_keeps_stdio_and_those_named_only(tmp_path: Path) -> None:
    """In a child (as a worker is made): descriptors its parent held, inheritable or not, are
    gone, but its stdio and the one it keeps (its channel)."""
    held = [os.open(tmp_path / f"held{i}", os.O_CREAT | os.O_WRONLY) for i in range(3)]
    os.set_inheritable(held[0], True)  # as the copies of stdio an event loop's spawn hands down
    report_read, report_write = os.pipe()
    asked = [0, 1, 2, *held, report_read, report_write]
    pid = os.fork()
    if pid == 0:  # the child says which it still holds, then exits without Python's cleanup
        try:
            close_descriptors(keep=[report_write, held[1]])
            os.write(report_write, " ".join(str(fd) for fd in asked if _is_open(fd)).encode())
        finally:
            os._exit(0)
    os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        remaining = {int(fd) for fd in report.read().split()}
    os.waitpid(pid, 0)
    for fd in held:
        os.close(fd)
    assert remaining == {0, 1, 2, report_write, held[1]}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


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


PLANNED_CONFINEMENT = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from gpu_manager.sandbox import Confinement, confine, plan_import_path
root = sys.argv[1]
for name in ("early", "late"):  # packages in directories only root can reach
    package = os.path.join(root, "private", name, "pkg_" + name)
    os.makedirs(package)
    for file in ("__init__.py", "sub.py"):
        open(os.path.join(package, file), "w").write("VALUE = 1\n")
os.chmod(os.path.join(root, "private"), 0o700)
sys.path.insert(0, os.path.join(root, "private", "early"))
import pkg_early
plan = plan_import_path()  # as the zygote does, before it forks workers
assert os.path.join(root, "private", "early") in plan.unreachable, plan.unreachable
assert "pkg_early" in plan.affected and "pkg_late" not in plan.seen
sys.path.insert(0, os.path.join(root, "private", "late"))
import pkg_late  # imported after the plan (as a worker's backend may)
finders = set(sys.path_importer_cache)
confine(Confinement(uid=65534, gid=65534, data_limit_mb=None, max_processes=64, max_file_mb=64, home=root))
import pkg_early.sub, pkg_late.sub  # reached through handles, as the package's user
assert os.getuid() == 65534 and pkg_early.__path__[0].startswith("/proc/self/fd/")
kept = {d for d in finders if d not in plan.unreachable and not d.startswith(root)}
assert kept and kept <= set(sys.path_importer_cache)  # only the replaced directories' finders went
print("ok")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_a_planned_confinement_keeps_private_import_directories_reachable(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    out = subprocess.run(
        [sys.executable, "-c", PLANNED_CONFINEMENT, str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


CONFINED_WORKER = r"""
import ctypes, json, os, re, resource, sys, threading
sys.path.insert(0, sys.argv[1])
from gpu_manager.sandbox import Confinement, confine
confine(Confinement(max_processes=64, max_file_mb=64))  # the node's user: no root needed
libc = ctypes.CDLL(None, use_errno=True)
refusal = 0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno()  # CLONE_NEWUSER
seen = []
thread = threading.Thread(target=lambda: seen.append(1))
thread.start()
thread.join()
child = os.fork()
if child == 0:
    os._exit(5)
status = open("/proc/self/status").read()
print(json.dumps({
    "seccomp": re.search(r"^Seccomp:\s+(\d)", status, re.M)[1],
    "no_new_privs": re.search(r"^NoNewPrivs:\s+(\d)", status, re.M)[1],
    "unshare": refusal,
    "thread": len(seen),
    "child": os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]),
    "open_files": resource.getrlimit(resource.RLIMIT_NOFILE),
}))
"""


@pytest.mark.skipif(seccomp.unavailable_reason() is not None, reason="no seccomp filter on this machine")
def test_a_confined_worker_has_the_seccomp_filter_and_still_starts_threads_and_children() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CONFINED_WORKER, str(REPO)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    open_files = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MAX_OPEN_FILES, hard)
    assert json.loads(out.stdout) == {
        "seccomp": "2",
        "no_new_privs": "1",
        "unshare": errno.EPERM,
        "thread": 1,
        "child": 5,
        "open_files": [open_files, open_files],  # not the node's (20,000 here, or more)
    }


@pytest.mark.skipif(seccomp.native_arch() is None or seccomp.unavailable_reason() is not None, reason="no seccomp")
def test_where_an_outer_sandbox_refuses_seccomp_a_worker_says_so_and_goes_on() -> None:
    """As inside a container whose profile refuses seccomp(2) and prctl(2): made here with a filter
    of our own that refuses both, in a child."""
    arch = seccomp.native_arch()
    assert arch is not None
    prctl = {"x86_64": 157, "aarch64": 167}[arch.name]
    outer = dataclasses.replace(arch, numbers={**arch.numbers, "prctl": prctl})
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            no_new_privileges()
            seccomp.install(seccomp.program(outer, [seccomp.Rule("seccomp"), seccomp.Rule("prctl")]))
            sys.stderr = io.StringIO()
            applied = filter_system_calls()
            filters = re.search(r"^Seccomp_filters:\s+(\d+)", Path("/proc/self/status").read_text(), re.M)
            report = {"applied": applied, "said": sys.stderr.getvalue(), "filters": filters[1] if filters else "?"}
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert report["applied"] is False and report["filters"] == "1"  # the outer one only
    assert (
        report["said"].count("\n") == 1
        and "no seccomp filter for this worker (PR_SET_SECCOMP: EPERM)" in report["said"]
    )


class _IpcRefusingLibc:
    """Stands in for libc where network namespaces are given and IPC namespaces refused (a kernel
    without CONFIG_IPC_NS, user.max_ipc_namespaces 0, a sandbox allowing some namespaces only)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def unshare(self, flags: int) -> int:
        self.calls.append(flags)
        return -1 if flags & sandbox._CLONE_NEWIPC else 0


def test_a_worker_keeps_its_network_namespace_where_ipc_namespaces_are_refused(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    libc = _IpcRefusingLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: libc)
    assert sandbox.own_namespaces(), f"network isolation lost with the IPC namespace (unshare calls: {libc.calls})"
    assert libc.calls[-1] == sandbox._CLONE_NEWIPC and "no IPC namespace for this worker" in capfd.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_workers_home_is_tmp_even_where_the_hosts_tmp_is_not_world_writable() -> None:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sandbox.own_mount_namespace()
            libc = ctypes.CDLL(None, use_errno=True)
            closed = tempfile.mkdtemp(dir="/var/tmp")
            os.chmod(closed, 0o755)
            assert libc.mount(closed.encode(), b"/tmp", None, 0x1000, None) == 0  # a /tmp of 0755, here only
            home = tempfile.mkdtemp(dir="/var/tmp")
            Path(home, "mark").touch()
            sandbox.private_tmp(home)
            code = 0 if Path(sandbox.PRIVATE_TMP_DIRS[0], "mark").exists() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "HOME (/tmp) is not the worker's home"
