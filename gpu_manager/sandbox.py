"""What a worker process may touch (the `process` runtime): its own user, no network, resource
limits, a clean environment. Decisions are pure functions; the few calls that change a process
(`close_descriptors`, `drop_controlling_terminal`, `own_namespaces`, `confine`, `lock_package`) are
at the bottom.

A worker is confined in three steps:
- when it is made (`close_descriptors`): it keeps no descriptor but its stdio (a pipe of its own,
  read by the node within a budget) and its channel to the node; whatever its parent held (the
  node's log, which an event loop's spawn hands down as copies of its stdio) is closed.
- as a spare, right after the zygote forks it: a network namespace of its own with nothing in it
  (`own_namespaces`), so a function reaches neither etcd, nor the daemons' ports, nor anything
  else (it talks to its node over the socket pair it was born with); and an IPC namespace of its
  own, so that the System V shared memory, semaphores and message queues it makes go with its
  last process (in the host's, a segment it never removed held host memory past its cgroup, its
  function and the node, until a reboot).
- when it takes a model, before the handler is imported (`confine`): resource limits, no new
  privileges and a seccomp filter that refuses the system calls a handler never needs
  (gpu_manager.seccomp), then, where the node runs as root, the package's own user and group, so
  that it reads its package (owned root:that group, read-only) and nothing of the node's or
  another function's.

Each package has its own user id on a node (`PackageUsers`): drawn at random, in a range no host
account uses, never one another package holds, and kept across the node's restarts.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import json
import logging
import os
import resource
import secrets
import shutil
import stat
import sys
import tempfile
import termios
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpu_manager import seccomp
from gpufaas.mounts import detach, mounted_under

log = logging.getLogger(__name__)

PACKAGE_UID_BASE = 1 << 24  # 16,777,216: above system, user and container subordinate id ranges
PACKAGE_UID_SPAN = (1 << 31) - PACKAGE_UID_BASE - 1
PACKAGE_USERS_FILE = "package-users.json"  # in a node's state directory
DEFAULT_MAX_PROCESSES = 512  # tasks (processes and threads) of one package's user
DEFAULT_MAX_FILE_MB = 1024  # largest file a worker may write (its home, /tmp)
# Descriptors one worker process may hold (the node's own limit is often 20,000 or more, and a
# descriptor's kernel memory is charged to no cgroup: 512 tasks of one package each holding the
# node's limit pinned hundreds of MB of kernel memory and could fill the host's file table).
MAX_OPEN_FILES = 4096
DEFAULT_HOME_MB = 1024  # all a package's workers on a node may write (its home: HOME, /tmp, /var/tmp, /dev/shm)
# The host's world-writable places (those here that are): a worker sees its home there instead.
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/var/crash")
MEMORY_HEADROOM_MB = 512  # above twice the declared memory: loading often holds two copies
# What a worker inherits from its node's environment (everything else is dropped: no cluster
# addresses or secrets reach a function). Exact names, then prefixes.
ENVIRONMENT_NAMES = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONUNBUFFERED", "VIRTUAL_ENV"})
ENVIRONMENT_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "LD_LIBRARY_PATH")

_CLONE_NEWUSER = 0x10000000
_DESCRIPTOR_END = 2**31 - 1  # above any descriptor (close_range closes only those open)
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_PR_SET_NO_NEW_PRIVS = 38


class PackageUsers:
    """The user (and group) id each package's workers run as on one node: drawn at random from a
    range of ~2.1 billion ids no host account uses, never one that another package holds, and
    kept in `path` (JSON; None: in memory only), so that a restarted node finds the packages it
    staged owned as it left them.

    Drawn, not derived from the digest: the author of a package chooses its digest (any file's
    bytes change it), and every worker's uid is public (/proc), so a package could be made to hash
    to another's id and run as its user: its home, its files, its processes."""

    def __init__(self, path: Path | None = None, *, draw: Callable[[int], int] = secrets.randbelow) -> None:
        self._path = path
        self._draw = draw
        self._uids = _read_users(path)
        self._taken = set(self._uids.values())

    def get(self, digest: str) -> int | None:
        """The id package `digest` was given on this node, if any."""
        return self._uids.get(digest.removeprefix("sha256:"))

    def uid(self, digest: str) -> int:
        """Package `digest`'s id: the one it holds, else a new one, kept (raises OSError where it
        cannot be written: a package never runs as an id that a restart could give another)."""
        key = digest.removeprefix("sha256:")
        uid = self._uids.get(key)
        if uid is None:
            uid = PACKAGE_UID_BASE + self._draw(PACKAGE_UID_SPAN)
            while uid in self._taken:
                uid = PACKAGE_UID_BASE + self._draw(PACKAGE_UID_SPAN)
            self._uids[key] = uid
            self._taken.add(uid)
            try:
                self._save()
            except OSError:
                del self._uids[key]
                self._taken.discard(uid)
                raise
        return uid

    def _save(self) -> None:
        if self._path is None:
            return
        temporary = self._path.with_name(f".{self._path.name}.{os.getpid()}")
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
            json.dump(self._uids, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self._path)


def _read_users(path: Path | None) -> dict[str, int]:
    """What `PackageUsers._save` wrote at `path` ({} where nothing was, or it cannot be read:
    then each package is given an id afresh, and its staged directory locked to it again)."""
    if path is None or not path.exists():
        return {}
    try:
        loaded = json.loads(path.read_text())
        users = {str(key): int(uid) for key, uid in loaded.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("cannot read the packages' users in %s (%s): each is given a new one", path, exc)
        return {}
    if not all(PACKAGE_UID_BASE <= uid < PACKAGE_UID_BASE + PACKAGE_UID_SPAN for uid in users.values()) or len(
        set(users.values())
    ) != len(users):
        log.warning("the packages' users in %s are out of range or shared: each is given a new one", path)
        return {}
    return users


def worker_environment(node_environment: Mapping[str, str]) -> dict[str, str]:
    """The environment a node passes on to its workers: the allow-list above, nothing else."""
    return {
        name: value
        for name, value in node_environment.items()
        if name in ENVIRONMENT_NAMES or name.startswith(ENVIRONMENT_PREFIXES)
    }


def data_allowance_mb(backend: str, memory_mb: int) -> int | None:
    """How much private writable memory (RLIMIT_DATA) a worker may add to what its runtime holds
    when it takes a model (measured then, in the worker), or None for no limit.

    On `cpu` the model lives in host memory, so its declared `memory_mb` bounds what the worker
    may add: twice the declaration (a load often holds the file's bytes and the tensors at once),
    plus a margin.
    On `cuda` the model's memory is the GPU's (measured and reported per call); the CUDA driver's
    mappings make a host limit unsafe there: the `docker` runtime's container limit covers it.
    """
    if backend != "cpu":
        return None
    return 2 * memory_mb + MEMORY_HEADROOM_MB


LOG_RATE_BYTES_S = 64 * 1024  # what a worker may write to stdout/stderr, on average ...
LOG_BURST_BYTES = 1024 * 1024  # ... and at once; the rest is dropped (and counted)
LOG_LINE_BYTES = 16 * 1024  # a longer line is cut


@dataclass(frozen=True, slots=True)
class Isolation:
    """How a node confines its workers (the `process` runtime).

    `network`: each worker gets a network namespace of its own. `users`: each package's workers
    run as the package's own user (None: when the node runs as root, the only way it can).
    `homes_dir`: where the packages' private HOME/TMPDIR directories go (None: none): each a
    tmpfs of `home_mb` where the node can mount one.
    `package_users`: the ids the packages' users were given on this node.
    `cgroup_prefix`: the name of the node's directory of per-worker control groups
    (gpu_manager.cgroups' `group_prefix`; None: no groups), under `cgroup_root`; `worker_cpus`:
    the CPUs' worth of time each worker's group may use (None: no quota, only an equal weight)."""

    network: bool = True
    users: bool | None = None
    homes_dir: Path | None = None
    cgroup_prefix: str | None = None
    cgroup_root: Path = Path("/sys/fs/cgroup")
    worker_cpus: float | None = None
    max_processes: int = DEFAULT_MAX_PROCESSES
    max_file_mb: int = DEFAULT_MAX_FILE_MB
    home_mb: int = DEFAULT_HOME_MB
    log_rate_bytes_s: int = LOG_RATE_BYTES_S
    log_burst_bytes: int = LOG_BURST_BYTES
    package_users: PackageUsers = field(default_factory=PackageUsers)

    @property
    def per_package_users(self) -> bool:
        return os.geteuid() == 0 if self.users is None else self.users


class LogBudget:
    """A token bucket over a worker's output: `take(n, now)` says how many of `n` bytes may be
    written at time `now` (seconds); the rest is dropped and counted in `dropped`."""

    def __init__(self, rate_bytes_s: int, burst_bytes: int, now: float) -> None:
        self.rate_bytes_s = rate_bytes_s
        self.burst_bytes = burst_bytes
        self.tokens = float(burst_bytes)
        self.dropped = 0
        self._at = now

    def take(self, n: int, now: float) -> int:
        self.tokens = min(self.burst_bytes, self.tokens + (now - self._at) * self.rate_bytes_s)
        self._at = now
        allowed = min(n, int(self.tokens))
        self.tokens -= allowed
        self.dropped += n - allowed
        return allowed


@dataclass(frozen=True, slots=True)
class Confinement:
    """What a worker is held to once it takes a model. `uid` 0: it keeps the node's user (a node
    not running as root cannot give it another). With a `uid` and a `home`, the worker sees its
    home at /tmp, /var/tmp and /dev/shm too (a mount namespace of its own) and HOME is /tmp."""

    uid: int = 0
    gid: int = 0
    data_limit_mb: int | None = None
    max_processes: int = DEFAULT_MAX_PROCESSES
    max_file_mb: int = DEFAULT_MAX_FILE_MB
    home: str = ""  # a private writable directory: HOME and TMPDIR


def current_data_mb() -> int:
    """This process's private writable memory now (VmData), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmData:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# --- what changes a process -----------------------------------------------------------------


def close_descriptors(keep: Iterable[int] = ()) -> None:
    """Close every file descriptor of this process but 0, 1, 2 and `keep`. A Python object that
    owned one of the others must not be used (or collected) afterwards: close those first."""
    kept = sorted({0, 1, 2, *keep})
    for low, high in zip(kept, [*kept[1:], _DESCRIPTOR_END], strict=True):
        if high > low + 1:
            os.closerange(low + 1, high)


def drop_controlling_terminal() -> bool:
    """Let go of this process's controlling terminal, if it has one (a node run by hand in a
    shell hands its terminal down), so that nothing it forks has one: /dev/tty is open to every
    user and reaches the session's terminal, where a worker, whatever its uid, could read the
    operator's keystrokes or push its own into root's shell (TIOCSTI). The process keeps its
    process group (a stop of the node's group still reaches it). Whether it had one. Not for a
    session leader (TIOCNOTTY would hang up its foreground group)."""
    try:
        terminal = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # ENXIO: none
    try:
        fcntl.ioctl(terminal, termios.TIOCNOTTY)
    finally:
        os.close(terminal)
    return True


def own_namespaces() -> bool:
    """Move this process into a network namespace of its own (only a loopback, down: nothing
    outside is reachable, and sockets it already holds keep working), then into an IPC namespace
    of its own (what System V IPC it makes goes when its last process does). As root directly;
    otherwise through a user namespace where the kernel allows them. Whether the network one was
    had (False: neither way). The IPC one is asked apart, and its refusal (a kernel without IPC
    namespaces, a sandbox that allows only some) said on stderr: it must not cost the network's."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    if libc.unshare(flags) != 0:
        return False
    if libc.unshare(_CLONE_NEWIPC) != 0:
        said = f"no IPC namespace for this worker ({os.strerror(ctypes.get_errno())}): its System V IPC is the host's"
        print(said, file=sys.stderr, flush=True)
    return True


def no_new_privileges() -> None:
    """PR_SET_NO_NEW_PRIVS: nothing this process or its children execute gains privileges (no
    set-user-ID, set-group-ID or file capabilities), for good (OSError if refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) refused")


def filter_system_calls() -> bool:
    """Refuse this process, and every process and thread it starts, the system calls a function
    never needs (gpu_manager.seccomp), for good; no_new_privileges first. Where this kernel or
    an outer sandbox allows no seccomp filter, say so on stderr (a worker's goes to its node's
    log) and return False; OSError if one is allowed and this one is refused."""
    reason = seccomp.unavailable_reason()
    arch = seccomp.native_arch()
    if reason is not None or arch is None:
        print(f"no seccomp filter for this worker ({reason}): it may make any system call", file=sys.stderr, flush=True)
        return False
    seccomp.install(seccomp.program(arch))
    return True


_own_mounts = False  # whether this process is in a mount namespace of its own (own_mount_namespace)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what} refused")


def own_mount_namespace() -> None:
    """As root: move into a mount namespace of this process's own, private (nothing mounted here
    reaches the node's namespace, nor back). A worker does so before it opens its package's
    handles: a directory opened before would belong to the node's namespace, and a working
    directory there has no path here (getcwd fails)."""
    global _own_mounts  # noqa: PLW0603  this process's, once
    if _own_mounts:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / private")
    _own_mounts = True


def private_tmp(home: str) -> None:
    """As root, in a mount namespace of its own (`own_mount_namespace`): `home` is also each of
    PRIVATE_TMP_DIRS that is here and that others may write (/tmp, /var/tmp, /dev/shm, /run/lock...),
    so that the host's world-writable directories are out of its reach (what it leaves there would
    outlive it and pass to other packages) and what it writes there counts against its home's size
    (OSError if the kernel refuses). What it opened before (its package, weights and layer handles)
    stays reachable."""
    own_mount_namespace()
    libc = ctypes.CDLL(None, use_errno=True)
    source = home  # then the first place bound: `home` may be below /tmp (and hidden once /tmp is bound)
    for target in _world_writable(PRIVATE_TMP_DIRS):
        _check(libc.mount(source.encode(), target.encode(), None, _MS_BIND, None), f"binding its home on {target}")
        source = target


def _world_writable(paths: Sequence[str]) -> list[str]:
    """The first of `paths` (/tmp: the worker's HOME and TMPDIR, whoever may write it) where it is
    a directory, then those of the others here that others may write, each once (/var/lock is
    often a link to /run/lock)."""
    found: dict[str, None] = {}
    for index, path in enumerate(paths):
        real = os.path.realpath(path)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(mode := os.stat(real).st_mode) and (index == 0 or mode & stat.S_IWOTH):
                found.setdefault(real)
    return list(found)


def mount_home(path: Path, uid: int, size_mb: int) -> bool:
    """Mount a tmpfs of `size_mb` owned by `uid` (0700, nosuid, nodev) on `path`; False if the
    kernel refuses (not root, or no mount allowed here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size_mb}m,mode=0700,uid={uid},gid={uid}".encode()
    return bool(libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) == 0)


def remove_home(path: Path) -> None:
    """Unmount (lazily: a dying worker may hold it a moment longer) and delete a package's home."""
    for point in mounted_under(path.parent):
        if point == path.resolve():
            detach(point)
    shutil.rmtree(path, ignore_errors=True)


def clear_homes(parent: Path) -> int:
    """Remove every home under `parent` (at a node's start: what a previous run left). Returns how many."""
    if not parent.is_dir():
        return 0
    homes = [entry for entry in parent.iterdir() if entry.is_dir()]
    for home in homes:
        remove_home(home)
    return len(homes)


def confine(confinement: Confinement) -> None:
    """Apply `confinement` to this process for good (raises OSError if the kernel refuses)."""
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, confinement.max_file_mb * 1024 * 1024)
    _limit(resource.RLIMIT_NOFILE, MAX_OPEN_FILES)
    if confinement.data_limit_mb is not None:
        _limit(resource.RLIMIT_DATA, confinement.data_limit_mb * 1024 * 1024)
    if confinement.uid:
        keep_import_path()  # before /tmp is its home: an import directory there is reached by handle
    home = confinement.home
    if home and confinement.uid:
        private_tmp(home)
        home = PRIVATE_TMP_DIRS[0]
    if home:
        os.environ["HOME"] = os.environ["TMPDIR"] = home
        tempfile.tempdir = home  # it may have been looked up (and kept) before the fork
    os.umask(0o077)
    no_new_privileges()
    filter_system_calls()  # after the mount namespace and home above: it refuses mount and unshare
    if confinement.uid:
        # RLIMIT_NPROC counts the tasks of the real user: meaningful only for the package's own.
        _limit(resource.RLIMIT_NPROC, confinement.max_processes)
        os.setgroups([])
        os.setresgid(confinement.gid, confinement.gid, confinement.gid)
        os.setresuid(confinement.uid, confinement.uid, confinement.uid)


@dataclass(frozen=True)
class ImportPathPlan:
    """What `keep_import_path` must change, found once in the zygote before it forks: the import
    directories another user could not reach (`unreachable`), the modules whose `__path__` lists
    one (`affected`), and every module the zygote had imported (`seen`). A worker then touches only
    those (usually none) and the modules it imported itself, instead of every module of the
    runtime: looking at the ~1,200 modules of torch cost each worker 11 ms of CPU, most of it in
    `getattr` and in copying the pages that reading them wrote to (reference counts)."""

    unreachable: frozenset[str]
    affected: frozenset[str]
    seen: frozenset[str]


_import_plan: ImportPathPlan | None = None


def plan_import_path() -> ImportPathPlan:
    """Find what `keep_import_path` will need (see ImportPathPlan) and keep it for the processes
    this one forks. Call it where every worker's runtime is imported, as the user that can reach it."""
    global _import_plan  # noqa: PLW0603  the zygote's, inherited by every worker it forks
    passable: dict[str, bool] = {}
    unreachable: set[str] = set()
    affected: set[str] = set()

    def blocked(entry: str) -> bool:
        if entry in unreachable:
            return True
        if entry and os.path.isdir(entry) and not _open_to_others(entry, passable):
            unreachable.add(entry)
            return True
        return False

    for entry in sys.path:
        blocked(entry)
    modules = dict(sys.modules)
    for name, module in modules.items():
        path = getattr(module, "__path__", None)
        if isinstance(path, list) and any(blocked(entry) for entry in path if isinstance(entry, str)):
            affected.add(name)
    _import_plan = ImportPathPlan(frozenset(unreachable), frozenset(affected), frozenset(modules))
    return _import_plan


def keep_import_path() -> None:
    """Keep the runtime importable once this process is another user: an import directory that
    user could not reach (Python installed under root's home, say) is replaced, on `sys.path` and
    in the `__path__` of every package imported already, by a handle opened now:
    `/proc/self/fd/N`, which needs no permission on the directories above it. With a plan from
    `plan_import_path` (made in the zygote), only what it names and what was imported since."""
    handles: dict[str, str] = {}
    passable: dict[str, bool] = {}  # one stat per directory, however many packages live below it
    plan = _import_plan

    def reachable(entry: str) -> str:
        if entry not in handles:
            handles[entry] = entry
            blocked = entry in plan.unreachable if plan is not None else False
            if blocked or (os.path.isdir(entry) and not _open_to_others(entry, passable)):
                handles[entry] = f"/proc/self/fd/{os.open(entry, os.O_PATH | os.O_DIRECTORY)}"
        return handles[entry]

    if plan is None:
        names: Iterable[str] = list(sys.modules)
    else:
        # sys.modules keeps import order: those imported since the plan are at its end (with a
        # margin for modules removed meanwhile); reading only those leaves the rest untouched.
        recent = itertools.islice(reversed(sys.modules.keys()), max(0, len(sys.modules) - len(plan.seen)) + 64)
        names = [*plan.affected, *(name for name in recent if name not in plan.seen)]
    for entries in [sys.path, *(getattr(sys.modules.get(n), "__path__", None) for n in names)]:
        if isinstance(entries, list):
            replaced = [reachable(e) if isinstance(e, str) and e else e for e in entries]
            if replaced != entries:
                entries[:] = replaced
    # The finders of the replaced directories go (the handles get their own on first use); the
    # others stay: dropping all of them costs a worker 3 ms of freeing what it shares with the zygote.
    for entry, handle in handles.items():
        if handle != entry:
            sys.path_importer_cache.pop(entry, None)


def _open_to_others(path: str, passable: dict[str, bool] | None = None) -> bool:
    """Whether any user may list `path` and pass through it and every directory above it.
    `passable` memoizes the latter by directory (shared across calls)."""
    path = os.path.abspath(path)
    return bool(os.stat(path).st_mode & stat.S_IROTH) and _passable(path, {} if passable is None else passable)


def _passable(path: str, memo: dict[str, bool]) -> bool:
    if path not in memo:
        parent = os.path.dirname(path)
        memo[path] = bool(os.stat(path).st_mode & stat.S_IXOTH) and (parent == path or _passable(parent, memo))
    return memo[path]


def _limit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def lock_package(path: Path, gid: int) -> None:
    """Make a staged package readable by group `gid` only, and writable by nobody but root:
    owner root, directories 0750, files 0640 (0750 if executable). A file with other links (a
    blob another package shares: its weights) is left as the node's blob store made it, root's
    and read-only (0444): changing it would change it for every package, and only this
    package's group can pass its directories to reach it."""
    for directory, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            _lock(os.path.join(directory, name), gid)
    _lock(str(path), gid)


def package_locked(path: Path, gid: int) -> bool:
    """Whether `lock_package(path, gid)` finished on this directory (it locks the top last): a
    package staged again after it was unstaged is a new directory, mkdtemp's (root's, 0700)."""
    status = os.lstat(path)
    return (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (0, gid, 0o750)


def _lock(path: str, gid: int) -> None:
    status = os.lstat(path)
    mode = status.st_mode
    if stat.S_ISLNK(mode):
        return  # packages hold none (refused at upload); never follow one
    if stat.S_ISREG(mode) and status.st_nlink > 1:
        return  # shared with the blob store and other packages (see lock_package)
    os.chown(path, 0, gid, follow_symlinks=False)
    executable = stat.S_ISDIR(mode) or mode & stat.S_IXUSR
    os.chmod(path, 0o750 if executable else 0o640)


def private_home(parent: Path, uid: int, size_mb: int | None = None) -> tuple[Path, bool]:
    """A directory only `uid` may use (HOME and TMPDIR of that package's workers), and whether
    it is bounded: with `size_mb`, a tmpfs of that size (mounted once; False where the node
    cannot mount, then it is a plain directory)."""
    parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    home = parent / str(uid)
    home.mkdir(exist_ok=True)
    bounded = False
    if size_mb is not None:
        bounded = os.path.ismount(home) or mount_home(home, uid, size_mb)
    os.chown(home, uid, uid)
    os.chmod(home, 0o700)
    return home, bounded
