"""Per-worker control groups (the `process` runtime): one group per worker that took a model, so
that its memory, tasks and CPU are bounded together with every process it starts, and the whole
group can be killed at once.

Layout: under the node's own cgroup (what /proc/self/cgroup says, in each hierarchy: a delegated
subtree), a directory `gpufaas-<node>-<hash of the state directory>` (the same after a restart of
that node, distinct for two nodes of one host) holds one group per worker, `worker-<pid>`.

- cgroup v2 (`/sys/fs/cgroup/cgroup.controllers` exists): `memory.max`, `memory.swap.max` 0,
  `memory.oom.group` 1 (an OOM kill takes the whole group), `pids.max`, `cpu.weight` 100 and
  `cpu.max`; killed by `cgroup.kill`.
- cgroup v1 (hybrid): the same directory in the `memory`, `pids` and `cpu` hierarchies (and
  `freezer`, if mounted): `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`),
  `pids.max`, `cpu.shares` 1024, `cpu.cfs_quota_us`; killed by freezing the group, SIGKILLing
  every task in `cgroup.procs`, thawing, until it is empty.

Decisions (`worker_limits`, `parse_proc_cgroup`, `group_prefix`) are pure; `open_cgroups` finds
what the host offers, and the `Cgroups` classes do the writing, under a root that a test may
point at a temporary directory laid out like /sys/fs/cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gpu_manager.sandbox import MEMORY_HEADROOM_MB

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000
V1_SHARES = 1024  # every worker the same: a spinner gets its share of the CPUs, not the machine
V2_WEIGHT = 100
V1_REQUIRED = ("memory", "pids", "cpu")
V2_CONTROLLERS = ("memory", "pids", "cpu")
KILL_TIMEOUT_S = 5.0  # killing a group: past this, it is reported as not emptied
_POLL_S = 0.005

Kill = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class GroupLimits:
    """What one worker's group is held to: `memory_bytes` (None: no limit), `max_pids` (tasks:
    processes and threads), `cpu_quota_us` per CFS_PERIOD_US (None: no quota, only the equal
    weight)."""

    memory_bytes: int | None
    max_pids: int
    cpu_quota_us: int | None


def memory_limit_mb(memory_mb: int, runtime_mb: int) -> int:
    """A worker group's host memory: what its runtime held when it took its model (`runtime_mb`,
    its resident memory then) + 2 x the declared `memory_mb` + MEMORY_HEADROOM_MB -- the bound
    RLIMIT_DATA puts on each process on cpu (gpu_manager.sandbox), here on the worker and all its
    children together, and on every backend (on cuda the weights pass through host memory once,
    as the docker runtime's container limit allows for)."""
    return runtime_mb + 2 * memory_mb + MEMORY_HEADROOM_MB


def worker_limits(*, memory_mb: int, runtime_mb: int, max_processes: int, cpus: float | None) -> GroupLimits:
    """A worker's group limits: memory (`memory_limit_mb`), tasks (`max_processes`, as its
    RLIMIT_NPROC), and `cpus`: CPUs' worth of time the group may use (None: no quota)."""
    quota = None if cpus is None else max(1000, int(cpus * CFS_PERIOD_US))
    memory_bytes = memory_limit_mb(memory_mb, runtime_mb) * 1024 * 1024
    return GroupLimits(memory_bytes=memory_bytes, max_pids=max_processes, cpu_quota_us=quota)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/PID/cgroup as controller -> path ("" for the v2 hierarchy; a v1 line naming several
    controllers, as `2:cpu,cpuacct:/x`, gives each of them)."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def group_prefix(node: str, state_dir: Path) -> str:
    """The directory name of one node's groups: its name and its state directory's, so that a
    restarted node finds (and clears) what its previous incarnation left, and two nodes of one
    host, or two clusters, never touch each other's."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return f"gpufaas-{re.sub(r'[^A-Za-z0-9_.-]', '_', node)[:40]}-{digest}"


def worker_group(pid: int) -> str:
    return f"worker-{pid}"


class Cgroups(ABC):
    """One node's worker groups. Every method may raise OSError (the kernel refused)."""

    version: ClassVar[int]

    def __init__(
        self,
        kill: Kill = os.kill,
        sleep: Callable[[float], None] = time.sleep,
        rmdir: Callable[[Path], None] = Path.rmdir,
    ) -> None:
        """`kill`, `sleep` and `rmdir` are the kernel's (a test's fake cgroupfs has its own)."""
        self._kill = kill
        self._sleep = sleep
        self._rmdir_fn = rmdir

    def _rmdir(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._rmdir_fn(path)

    @abstractmethod
    def create(self, name: str, limits: GroupLimits) -> None:
        """Make group `name` (or reuse it) and set its limits."""

    @abstractmethod
    def attach(self, name: str, pid: int) -> None:
        """Move process `pid` (all its threads) into group `name`: what it and its children
        allocate and start from then on counts there."""

    @abstractmethod
    def pids(self, name: str) -> list[int]:
        """The processes in group `name` (none if it does not exist)."""

    @abstractmethod
    def oom_kills(self, name: str) -> int:
        """How many of the group's tasks the kernel killed for its memory limit."""

    @abstractmethod
    def names(self) -> list[str]:
        """The groups that exist (a previous incarnation's too)."""

    @abstractmethod
    def _kill_all(self, name: str) -> None:
        """Kill every task in group `name` now."""

    @abstractmethod
    def _remove_dirs(self, name: str) -> None:
        """Remove group `name`'s directories (it is empty)."""

    @abstractmethod
    def remove_base(self) -> None:
        """Remove the node's directory (every group is gone)."""

    def kill(self, name: str, timeout_s: float = KILL_TIMEOUT_S) -> int:
        """Kill every process in group `name`, repeatedly until it is empty (a process may fork
        while being killed), then remove the group. Returns how many processes it held; raises
        OSError if it is not empty after `timeout_s`. A group removed meanwhile (by another
        kill of it) is done with."""
        held = len(self.pids(name))
        deadline = time.monotonic() + timeout_s
        try:
            while self.pids(name):
                if time.monotonic() > deadline:
                    raise OSError(errno.EBUSY, f"cgroup {name} still holds processes after {timeout_s:g} s")
                self._kill_all(name)
                self._sleep(_POLL_S)
        except FileNotFoundError:
            return held
        self._remove_dirs(name)
        return held

    def clear(self) -> int:
        """Kill and remove every group (what a previous incarnation of the node left, or what
        is left at its stop). Returns how many processes were killed."""
        killed = 0
        for name in self.names():
            with contextlib.suppress(OSError):
                killed += self.kill(name)
        return killed

    def _signal_all(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                self._kill(pid, signal.SIGKILL)


def _read_pids(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except FileNotFoundError:
        return []


def _counter(path: Path, key: str) -> int:
    """The value of `key` in a flat keyed file (memory.events, memory.oom_control); 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (FileNotFoundError, ValueError):
        pass
    return 0


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:  # one write(2) per value, as the kernel expects
        file.write(value)


class CgroupsV1(Cgroups):
    """Groups in the v1 hierarchies: `bases` maps each controller (memory, pids, cpu, and
    freezer if mounted) to the node's directory in it."""

    version = 1

    def __init__(self, bases: dict[str, Path], **edges: Any) -> None:
        super().__init__(**edges)
        self.bases = bases

    def _dir(self, controller: str, name: str) -> Path:
        return self.bases[controller] / name

    def create(self, name: str, limits: GroupLimits) -> None:
        for controller in self.bases:
            self._dir(controller, name).mkdir(exist_ok=True)
        memory = self._dir("memory", name)
        if limits.memory_bytes is not None:
            _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # no swap past it either
                _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        _write(self._dir("pids", name) / "pids.max", str(limits.max_pids))
        cpu = self._dir("cpu", name)
        _write(cpu / "cpu.shares", str(V1_SHARES))
        if limits.cpu_quota_us is not None:
            _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(limits.cpu_quota_us))

    def attach(self, name: str, pid: int) -> None:
        for controller in self.bases:
            _write(self._dir(controller, name) / "cgroup.procs", str(pid))

    def pids(self, name: str) -> list[int]:
        found: set[int] = set()
        for controller in self.bases:  # a task moved into some hierarchies only counts too
            found.update(_read_pids(self._dir(controller, name) / "cgroup.procs"))
        return sorted(found)

    def oom_kills(self, name: str) -> int:
        return _counter(self._dir("memory", name) / "memory.oom_control", "oom_kill")

    def names(self) -> list[str]:
        found: set[str] = set()
        for base in self.bases.values():
            with contextlib.suppress(FileNotFoundError):
                found.update(entry.name for entry in base.iterdir() if entry.is_dir())
        return sorted(found)

    def _kill_all(self, name: str) -> None:
        freezer = self._dir("freezer", name) if "freezer" in self.bases else None
        if freezer is None or not freezer.is_dir():
            self._signal_all(self.pids(name))
            return
        _write(freezer / "freezer.state", "FROZEN")
        try:
            self._settle(freezer)
            self._signal_all(self.pids(name))
        finally:
            # A frozen task dies only once thawed: thawed whether or not the group settled (one
            # that did not holds tasks frozen meanwhile, which would stay frozen for good).
            _write(freezer / "freezer.state", "THAWED")

    def _settle(self, freezer: Path) -> bool:
        """Wait for the group to be frozen (no task forks while its siblings are killed); False
        if it did not settle within a second (it is killed part frozen then, and again until
        empty)."""
        for _ in range(int(1.0 / _POLL_S)):
            if (freezer / "freezer.state").read_text().strip() == "FROZEN":
                return True
            self._sleep(_POLL_S)
        return False

    def _remove_dirs(self, name: str) -> None:
        for controller in self.bases:
            self._rmdir(self._dir(controller, name))

    def remove_base(self) -> None:
        for base in self.bases.values():
            self._rmdir(base)


class CgroupsV2(Cgroups):
    """Groups in the unified hierarchy under `base` (the node's directory, its controllers
    enabled for its children)."""

    version = 2

    def __init__(self, base: Path, **edges: Any) -> None:
        super().__init__(**edges)
        self.base = base

    def create(self, name: str, limits: GroupLimits) -> None:
        group = self.base / name
        group.mkdir(exist_ok=True)
        if limits.memory_bytes is not None:
            _write(group / "memory.max", str(limits.memory_bytes))
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")
            _write(group / "memory.oom.group", "1")  # the kernel kills the whole group, not one child
        _write(group / "pids.max", str(limits.max_pids))
        _write(group / "cpu.weight", str(V2_WEIGHT))
        quota = "max" if limits.cpu_quota_us is None else str(limits.cpu_quota_us)
        _write(group / "cpu.max", f"{quota} {CFS_PERIOD_US}")

    def attach(self, name: str, pid: int) -> None:
        _write(self.base / name / "cgroup.procs", str(pid))

    def pids(self, name: str) -> list[int]:
        return _read_pids(self.base / name / "cgroup.procs")

    def oom_kills(self, name: str) -> int:
        events = self.base / name / "memory.events"
        return max(_counter(events, "oom_kill"), _counter(events, "oom_group_kill"))

    def names(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sorted(entry.name for entry in self.base.iterdir() if entry.is_dir())
        return []

    def _kill_all(self, name: str) -> None:
        group = self.base / name
        if (group / "cgroup.kill").exists():  # Linux 5.14: the kernel kills it all, forks included
            _write(group / "cgroup.kill", "1")
        else:
            self._signal_all(self.pids(name))

    def _remove_dirs(self, name: str) -> None:
        self._rmdir(self.base / name)

    def remove_base(self) -> None:
        self._rmdir(self.base)


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Why a node cannot give its workers groups (said once, at its start)."""

    reason: str


def open_cgroups(
    prefix: str, *, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None, pid: int | None = None
) -> Cgroups | Unavailable:
    """The node's worker groups under `root` (v2 if `root` is a unified hierarchy, else the v1
    hierarchies), made under the node's own cgroup (`proc_cgroup`: /proc/self/cgroup's text), or
    why there are none (not root, read-only, controllers not delegated)."""
    if proc_cgroup is None:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    own = parse_proc_cgroup(proc_cgroup)
    try:
        if (root / "cgroup.controllers").exists():
            return _open_v2(root, own.get("", "/"), prefix, os.getpid() if pid is None else pid)
        if all((root / c).is_dir() for c in V1_REQUIRED):
            return _open_v1(root, own, prefix)
    except OSError as exc:
        return Unavailable(f"{exc.strerror or exc} ({exc.filename or root})")
    return Unavailable(f"neither cgroup v2 nor the v1 memory, pids and cpu hierarchies are mounted at {root}")


def _open_v1(root: Path, own: dict[str, str], prefix: str) -> CgroupsV1:
    bases: dict[str, Path] = {}
    for controller in (*V1_REQUIRED, "freezer"):
        mount = root / controller
        if not mount.is_dir() or not (mount / "cgroup.procs").exists():
            if controller == "freezer":
                continue
            raise OSError(errno.ENOENT, f"the v1 {controller} hierarchy is not mounted", str(mount))
        base = mount / own.get(controller, "/").lstrip("/") / prefix
        base.mkdir(parents=True, exist_ok=True)
        bases[controller] = base
    if not os.access(bases["memory"], os.W_OK):
        raise OSError(errno.EACCES, "cannot write to the node's memory cgroup", str(bases["memory"]))
    return CgroupsV1(bases)


def _open_v2(root: Path, own: str, prefix: str, pid: int) -> CgroupsV2:
    parent = root / own.lstrip("/")
    available = (parent / "cgroup.controllers").read_text().split()
    missing = [c for c in V2_CONTROLLERS if c not in available]
    if missing:
        raise OSError(errno.ENOTSUP, f"controllers {', '.join(missing)} not delegated", str(parent))
    enable = " ".join(f"+{c}" for c in V2_CONTROLLERS)
    try:
        _write(parent / "cgroup.subtree_control", enable)
    except OSError as exc:
        if exc.errno != errno.EBUSY or own == "/":
            raise
        # "No internal processes": the node's own group holds processes, so its children cannot
        # get controllers until the node moves into a leaf of its own (systemd's delegation).
        leaf = parent / "gpufaas-daemon"
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", str(pid))
        _write(parent / "cgroup.subtree_control", enable)
    base = parent / prefix
    base.mkdir(exist_ok=True)
    _write(base / "cgroup.subtree_control", enable)
    return CgroupsV2(base)


def resident_mb(pid: int) -> int:
    """Process `pid`'s resident memory now (VmRSS), in MiB; 0 if unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0
