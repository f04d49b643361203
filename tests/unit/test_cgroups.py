"""gpu_manager.cgroups on a fake /sys/fs/cgroup (a temporary directory laid out like one, v1 and
v2): the limits written, the kill loop, stale groups, and what is refused. The kernel's side (a
real group's memory limit, its OOM kills) is tests/integration/test_confinement.py's."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

import gpu_manager.cgroups as cgroups_module
from gpu_manager.cgroups import (
    CgroupsV1,
    CgroupsV2,
    GroupLimits,
    Unavailable,
    group_prefix,
    memory_limit_mb,
    open_cgroups,
    parse_proc_cgroup,
    worker_limits,
)

V1_SELF = "8:pids:/\n6:freezer:/\n4:memory:/outer/job\n1:cpu:/\n0::/\n"
MIB = 1024 * 1024


def v1_root(tmp_path: Path, *, freezer: bool = True) -> Path:
    root = tmp_path / "cgroup"
    for controller in ("memory", "pids", "cpu", *(["freezer"] if freezer else [])):
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("1\n")
    (root / "memory" / "outer" / "job").mkdir(parents=True)
    (root / "memory" / "outer" / "job" / "cgroup.procs").write_text("")
    return root


def v2_root(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.procs").write_text("1\n")
    return root


class FakeKernel:
    """What SIGKILL does to a fake group: the pid leaves every cgroup.procs under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.killed: list[int] = []

    @staticmethod
    def rmdir(path: Path) -> None:
        """A group's directory goes with its interface files (a real cgroupfs's rmdir)."""
        shutil.rmtree(path)

    def kill(self, pid: int, signum: int) -> None:
        assert signum == signal.SIGKILL
        self.killed.append(pid)
        for procs in self.root.rglob("cgroup.procs"):
            kept = [line for line in procs.read_text().split() if int(line) != pid]
            procs.write_text("".join(f"{p}\n" for p in kept))


def test_a_worker_group_is_held_to_its_runtime_plus_twice_its_declaration_plus_the_headroom() -> None:
    assert memory_limit_mb(600, runtime_mb=150) == 150 + 1200 + 512
    limits = worker_limits(memory_mb=100, runtime_mb=40, max_processes=512, cpus=None)
    assert limits == GroupLimits(memory_bytes=(40 + 200 + 512) * MIB, max_pids=512, cpu_quota_us=None)
    assert worker_limits(memory_mb=100, runtime_mb=0, max_processes=64, cpus=1.5).cpu_quota_us == 150_000


def test_proc_cgroup_names_each_controller_and_the_unified_path() -> None:
    assert parse_proc_cgroup("2:cpu,cpuacct:/a\n4:memory:/b/c\n0::/d\n") == {
        "cpu": "/a",
        "cpuacct": "/a",
        "memory": "/b/c",
        "": "/d",
    }


def test_a_nodes_prefix_is_stable_for_its_state_directory_and_distinct_across_them(tmp_path: Path) -> None:
    first = group_prefix("node0", tmp_path / "a")
    assert first == group_prefix("node0", tmp_path / "a")
    assert first != group_prefix("node0", tmp_path / "b")  # two clusters' node0 on one host
    assert group_prefix("../x y", tmp_path).startswith("gpufaas-.._x_y-")


def test_v1_groups_nest_under_the_nodes_own_cgroup_with_every_limit_written(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    cgroups = open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF)
    assert isinstance(cgroups, CgroupsV1)
    assert cgroups.bases["memory"] == root / "memory" / "outer" / "job" / "gpufaas-n"
    assert cgroups.bases["cpu"] == root / "cpu" / "gpufaas-n"
    (cgroups.bases["memory"] / "worker-7").mkdir()  # with swap accounting on (a fake makes no files itself)
    (cgroups.bases["memory"] / "worker-7" / "memory.memsw.limit_in_bytes").touch()
    cgroups.create("worker-7", GroupLimits(memory_bytes=900 * MIB, max_pids=512, cpu_quota_us=100_000))
    cgroups.attach("worker-7", 7)
    memory = cgroups.bases["memory"] / "worker-7"
    assert (memory / "memory.limit_in_bytes").read_text() == str(900 * MIB)
    assert (memory / "memory.memsw.limit_in_bytes").read_text() == str(900 * MIB)  # no swap past it
    assert (cgroups.bases["pids"] / "worker-7" / "pids.max").read_text() == "512"
    assert (cgroups.bases["cpu"] / "worker-7" / "cpu.shares").read_text() == "1024"
    assert (cgroups.bases["cpu"] / "worker-7" / "cpu.cfs_quota_us").read_text() == "100000"
    assert all((base / "worker-7" / "cgroup.procs").read_text() == "7" for base in cgroups.bases.values())
    assert cgroups.pids("worker-7") == [7]
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroups.oom_kills("worker-7") == 2


def test_v1_kill_freezes_kills_every_task_thaws_and_removes_the_group(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    kernel = FakeKernel(root)
    cgroups = open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF)
    assert isinstance(cgroups, CgroupsV1)
    cgroups._kill, cgroups._rmdir_fn = kernel.kill, kernel.rmdir
    cgroups.create("worker-7", GroupLimits(memory_bytes=None, max_pids=8, cpu_quota_us=None))
    for pid in (7, 8, 9):
        cgroups.attach("worker-7", pid)
        for base in cgroups.bases.values():  # a fake file keeps the last write: keep them all
            procs = base / "worker-7" / "cgroup.procs"
            procs.write_text("".join(f"{p}\n" for p in range(7, pid + 1)))
    assert cgroups.kill("worker-7") == 3
    assert sorted(kernel.killed) == [7, 8, 9]
    assert not any((base / "worker-7").exists() for base in cgroups.bases.values())
    assert cgroups.kill("worker-7") == 0  # gone already: nothing to do


def test_stale_groups_of_a_previous_incarnation_are_killed_and_removed(tmp_path: Path) -> None:
    root = v1_root(tmp_path, freezer=False)
    first = open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF)
    assert isinstance(first, CgroupsV1) and "freezer" not in first.bases
    first.create("worker-5", GroupLimits(memory_bytes=None, max_pids=8, cpu_quota_us=None))
    first.attach("worker-5", 5)
    again = open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF)  # the node restarted
    assert isinstance(again, CgroupsV1)
    kernel = FakeKernel(root)
    again._kill, again._rmdir_fn = kernel.kill, kernel.rmdir
    assert again.names() == ["worker-5"]
    assert again.clear() == 1 and kernel.killed == [5] and again.names() == []
    again.remove_base()
    assert not any(base.exists() for base in again.bases.values())


def test_v2_enables_the_controllers_and_writes_the_limits_and_kills_through_cgroup_kill(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    cgroups = open_cgroups("gpufaas-n", root=root, proc_cgroup="0::/\n")
    assert isinstance(cgroups, CgroupsV2)
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (root / "gpufaas-n" / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    group = root / "gpufaas-n" / "worker-3"
    group.mkdir()
    (group / "memory.swap.max").touch()
    cgroups.create("worker-3", GroupLimits(memory_bytes=512 * MIB, max_pids=100, cpu_quota_us=None))
    assert (group / "memory.max").read_text() == str(512 * MIB)
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "memory.oom.group").read_text() == "1"
    assert (group / "pids.max").read_text() == "100"
    assert (group / "cpu.weight").read_text() == "100"
    assert (group / "cpu.max").read_text() == "max 100000"
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert cgroups.oom_kills("worker-3") == 1
    cgroups.attach("worker-3", 3)
    (group / "cgroup.kill").touch()
    writes: list[str] = []

    def sleep(_: float) -> None:  # the kernel empties the group once cgroup.kill is written
        writes.append((group / "cgroup.kill").read_text())
        (group / "cgroup.procs").write_text("")

    cgroups._sleep, cgroups._rmdir_fn = sleep, FakeKernel.rmdir
    assert cgroups.kill("worker-3") == 1
    assert writes == ["1"] and not group.exists()


def test_where_groups_cannot_be_made_the_node_is_told_why(tmp_path: Path) -> None:
    nothing = tmp_path / "empty"
    nothing.mkdir()
    assert isinstance(open_cgroups("gpufaas-n", root=nothing, proc_cgroup="0::/\n"), Unavailable)
    undelegated = open_cgroups("gpufaas-n", root=v2_root(tmp_path, "memory pids"), proc_cgroup="0::/\n")
    assert isinstance(undelegated, Unavailable) and "cpu not delegated" in undelegated.reason


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only directory")
def test_a_read_only_hierarchy_is_unavailable(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    for path in (root, *root.iterdir()):
        path.chmod(0o555)
    try:
        assert isinstance(open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF), Unavailable)
    finally:
        for path in (root, *root.iterdir()):
            path.chmod(0o755)


def test_v1_kill_thaws_a_group_whose_freezer_did_not_settle_so_its_killed_tasks_die(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task that cannot be frozen (in uninterruptible sleep) leaves the group FREEZING; the
    tasks frozen meanwhile take a SIGKILL only once thawed, so the group is thawed whether or
    not it settled -- else they stay frozen for good, with the group and their memory."""
    root = v1_root(tmp_path)
    kernel = FakeKernel(root)
    cgroups = open_cgroups("gpufaas-n", root=root, proc_cgroup=V1_SELF)
    assert isinstance(cgroups, CgroupsV1)
    cgroups.create("worker-7", GroupLimits(memory_bytes=None, max_pids=8, cpu_quota_us=None))
    cgroups.attach("worker-7", 7)
    freezer = cgroups.bases["freezer"] / "worker-7" / "freezer.state"
    pending: list[int] = []  # SIGKILLed while frozen: they die when thawed

    def write(path: Path, value: str) -> None:
        if path.name == "freezer.state":
            value = "FREEZING" if value == "FROZEN" else value  # never settles
            if value == "THAWED":
                for pid in pending:
                    kernel.kill(pid, signal.SIGKILL)
                pending.clear()
        path.write_text(value)

    def kill(pid: int, signum: int) -> None:
        if freezer.read_text() == "THAWED":
            kernel.kill(pid, signum)
        else:
            pending.append(pid)

    monkeypatch.setattr(cgroups_module, "_write", write)
    cgroups._kill, cgroups._sleep, cgroups._rmdir_fn = kill, lambda _: None, kernel.rmdir
    assert cgroups.kill("worker-7", timeout_s=1.0) == 1
    assert kernel.killed == [7] and cgroups.names() == []
