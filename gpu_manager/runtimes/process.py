"""How a node's worker processes are started, connected to and stopped: one `Runtime` per way of
running them, chosen once when the node starts (`make_runtime`).

- `ProcessRuntime` (`--runtime process`): workers forked from the node's zygote
  (gpu_manager.zygote), which imported the backend's runtime (torch) once; they start as warm
  spares before any model is known, and confine themselves when they take one (gpu_manager.sandbox).
- `DockerRuntime` (`--runtime docker`): one container per worker, made for a model (its package
  and weights mounted read-only), so it keeps no spares (gpu_manager.containers).

A runtime's `run(worker, model)` starts the process, connects `worker` to it, and returns once it
has exited (`worker.exited` resolved); the worker pool does everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

from gpu_manager.cgroups import Cgroups, Unavailable, open_cgroups, resident_mb, worker_group, worker_limits
from gpu_manager.containers import (
    LAYER_MOUNT,
    PACKAGE_MOUNT,
    POOL_MOUNT,
    SOCKET_NAME,
    DockerLauncher,
    container_environment,
    container_spec,
)
from gpu_manager.sandbox import (
    LOG_LINE_BYTES,
    Isolation,
    LogBudget,
    clear_homes,
    data_allowance_mb,
    package_uid,
    private_home,
    remove_home,
    worker_environment,
)
from gpu_manager.workers import ModelRun, WeightsPlan, Worker
from gpufaas.processes import pid_alive
from gpufaas.wire import Connection, ConnectionLost, max_frame_bytes_for

log = logging.getLogger("gpufaas.gpu_manager.pool")
worker_log = logging.getLogger("gpufaas.worker")  # what workers print

RUNTIMES = ("process", "docker")  # how workers run: forked from the zygote, or in containers
SPARE_START_TIMEOUT_S = 120.0  # importing torch and creating a CUDA context, on a busy machine
SPARE_RETRY_S = 5.0  # after a spare (or the zygote) died warming up (a broken runtime), before another
STOP_GRACE_S = 2.0
"""How long a stopped worker has to exit after SIGTERM before it gets SIGKILL."""
KILL_WAIT_S = 30.0  # tearing down a large CUDA context can take seconds; past this, log and move on
_DROP_REPORT_S = 10.0  # how often a worker's dropped output is told of, at most
_OUTPUT_GRACE_S = 1.0  # a worker's output is read this long after it exits (then its pipe is closed)
_EXIT_POLL_S = 0.005
# How often the worker groups' OOM-kill counters are read: a small file each, read in a thread, so
# that hundreds of parked workers cost the node's event loop nothing (a call's own answer reads its
# worker's counter at once; this only clears what is left of a group the kernel cut into).
OOM_POLL_S = 1.0

# A container's package, owner and weights, made ready by the worker pool before it starts.
Prepare = Callable[[ModelRun], Awaitable[tuple[Path, int, WeightsPlan]]]


class Runtime(ABC):
    """One way of running a node's workers (see the module docstring)."""

    name: ClassVar[str]
    keeps_spares: ClassVar[bool]  # whether a worker starts before its model is known

    def __init__(
        self,
        *,
        backend: str,
        gpus: dict[str, int],
        isolation: Isolation,
        max_body_bytes: int,
        closing: Callable[[], bool],
    ) -> None:
        """`gpus`: node-local GPU id -> device index; `closing()`: whether the node is shutting
        down (a worker that cannot start then is no error)."""
        self.backend = backend
        self.gpus = gpus
        self.isolation = isolation
        self.max_frame_bytes = max_frame_bytes_for(max_body_bytes)
        self._closing = closing

    async def check(self) -> None:  # noqa: B027  (an optional hook)
        """Refuse to start (with an error that says what to do) where this runtime cannot run."""

    @abstractmethod
    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        """Start `worker`'s process (for `model`, where the runtime makes a worker for a model),
        connect it (`worker.conn`), and return once it is gone, `worker.exited` resolved."""

    def package_dir(self, directory: Path) -> str:
        """Where the worker finds its package (what LoadModel says)."""
        return str(directory)

    def worker_view(self, weights: WeightsPlan) -> WeightsPlan:
        """`weights` at the paths the worker sees them (what LoadModel says)."""
        return weights

    @abstractmethod
    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        """The LoadModel fields that confine `worker`, taking `run` (gpu_manager.sandbox); what
        the node itself holds it to is set up here, before its handler runs (OSError if not)."""

    def over_memory(self, worker: Worker) -> bool:
        """Whether `worker` (or a process it started) was killed for its memory limit."""
        return worker.exit_cause == "over_memory"

    async def release_package(self, digest: str, in_use: Callable[[], bool]) -> None:  # noqa: B027
        """No worker of package `digest` is left on this node: what the runtime keeps for it goes."""

    async def stop_starting(self) -> None:  # noqa: B027  (an optional hook)
        """The node is shutting down: cancel what would still start workers."""

    async def shutdown(self) -> None:  # noqa: B027  (an optional hook)
        """After every worker stopped: what the runtime itself holds goes."""

    def _start_failed(self, worker: Worker, exc: BaseException | None, what: str) -> None:
        if not self._closing():
            log.error("cannot start %s: %s", what, exc)
        worker.exit_cause = worker.exit_cause or ("shutdown" if self._closing() else "start_failed")
        worker.gone(ConnectionLost(f"cannot start {what}: {exc or 'the pool shut down'}"))


class _Zygote:
    """The zygote process (gpu_manager.zygote) and the pool's end of its control socket."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket, import_s: float) -> None:
        self.process = process
        self.control = control
        self.import_s = import_s

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def fork(self, gpu_id: str, device_index: int, sock: socket.socket, output_fd: int) -> None:
        """Ask for a worker for `gpu_id` on `sock`, writing its output to `output_fd` (raises
        OSError if the zygote is gone)."""
        socket.send_fds(self.control, [f"{gpu_id} {device_index}".encode()], [sock.fileno(), output_fd])


class _OutputRelay(asyncio.Protocol):
    """A worker's stdout and stderr (the read end of its pipe), logged line by line under
    `gpufaas.worker` within its LogBudget: a function that prints without end costs the node a
    bounded rate, and says how much it lost."""

    def __init__(self, worker: Worker, budget: LogBudget) -> None:
        self.worker = worker
        self.budget = budget
        self._buffer = bytearray()
        self._reported = 0  # bytes dropped already told of
        self._reported_at = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        allowed = self.budget.take(len(data), now)
        self._buffer += data[:allowed]
        while (end := self._buffer.find(b"\n")) >= 0:
            self._emit(bytes(self._buffer[:end]))
            del self._buffer[: end + 1]
        if len(self._buffer) > LOG_LINE_BYTES:
            self._emit(bytes(self._buffer[:LOG_LINE_BYTES]) + b" [line cut]")
            self._buffer.clear()
        if self.budget.dropped > self._reported and now - self._reported_at >= _DROP_REPORT_S:
            self._report_dropped(now)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buffer:
            self._emit(bytes(self._buffer))
            self._buffer.clear()
        if self.budget.dropped > self._reported:
            self._report_dropped(time.monotonic())

    def _emit(self, line: bytes) -> None:
        worker_log.info("%s (pid %d): %s", self.worker.model or "spare", self.worker.pid, line.decode(errors="replace"))

    def _report_dropped(self, now: float) -> None:
        worker_log.warning(
            "%s (pid %d) wrote more than %d bytes/s: %d bytes of its output dropped so far",
            self.worker.model or "spare",
            self.worker.pid,
            self.budget.rate_bytes_s,
            self.budget.dropped,
        )
        self._reported, self._reported_at = self.budget.dropped, now


class ProcessRuntime(Runtime):
    """Workers forked from the node's zygote (gpu_manager.zygote): warm spares, confined when they
    take a model. `python`: the interpreter the zygote runs."""

    name = "process"
    keeps_spares = True

    def __init__(self, *, python: str = sys.executable, **common: Any) -> None:
        super().__init__(**common)
        self._python = python
        self._zygote: _Zygote | None = None
        self._zygote_starting: asyncio.Future[_Zygote] | None = None
        self._cgroups: Cgroups | None = None
        self._grouped: dict[str, Worker] = {}  # group name -> its worker, while it lives
        self._oom_watch: asyncio.Task[None] | None = None
        self._homes: dict[str, Path] = {}  # package digest -> its home, while a worker may use it
        self._home_lock = asyncio.Lock()  # a home is not removed while another worker mounts it
        self._warned_home = False

    async def check(self) -> None:
        """Find the host's control groups (gpu_manager.cgroups) and clear what a previous
        incarnation of this node left in them (its workers' processes, detached ones included);
        where there are none, say once what that leaves unbounded."""
        homes = self.isolation.homes_dir
        if homes is not None and self.isolation.per_package_users:
            cleared = await asyncio.to_thread(clear_homes, homes)
            if cleared:
                log.info("removed %d package home(s) a previous run left", cleared)
        prefix = self.isolation.cgroup_prefix
        if prefix is None:
            return
        found = await asyncio.to_thread(open_cgroups, prefix, root=self.isolation.cgroup_root)
        if isinstance(found, Unavailable):
            log.warning(
                "worker cgroups unavailable (%s): a function's memory and tasks are bounded per process only "
                "(RLIMIT_DATA, RLIMIT_NPROC), it gets no CPU share of its own, and processes it starts are not "
                "killed with its worker; run the node as root with cgroups writable (or delegated)",
                found.reason,
            )
            return
        self._cgroups = found
        stale = await asyncio.to_thread(found.names)
        killed = await asyncio.to_thread(found.clear)
        if stale:
            log.info("removed %d worker cgroup(s) a previous run left, killing %d process(es)", len(stale), killed)
        log.info("worker cgroups: v%d under %s", found.version, prefix)
        self._oom_watch = asyncio.create_task(self._watch_memory())

    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        """Have the worker forked from the zygote, connect to it, and resolve `exited` once it is gone."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        output_read, output_write = os.pipe()
        output: asyncio.BaseTransport | None = None
        loop = asyncio.get_running_loop()
        try:
            zygote = await self._zygote_ready()
            zygote.fork(worker.gpu_id, self.gpus[worker.gpu_id], child, output_write)
            budget = LogBudget(self.isolation.log_rate_bytes_s, self.isolation.log_burst_bytes, time.monotonic())
            output, _ = await loop.connect_read_pipe(
                lambda: _OutputRelay(worker, budget), os.fdopen(output_read, "rb", buffering=0)
            )
            output_read = -1  # the transport owns it now
            max_frame_bytes = self.max_frame_bytes
            _, conn = await loop.create_unix_connection(
                lambda: Connection(worker, max_frame_bytes=max_frame_bytes), sock=parent
            )
        except (OSError, RuntimeError, asyncio.CancelledError) as exc:  # cancelled: shut down meanwhile
            parent.close()
            if output is not None:
                output.close()
            elif output_read >= 0:
                os.close(output_read)
            if not self._closing():
                log.error("cannot start a worker for %s: %s", worker.gpu_id, exc)
            worker.exit_cause = worker.exit_cause or ("shutdown" if self._closing() else "start_failed")
            worker.gone(ConnectionLost(f"cannot start a worker: {exc or 'the pool shut down'}"))
            worker.exited.set_result(None)
            return
        finally:
            child.close()  # the worker holds the only other end now: its exit reads as EOF here
            os.close(output_write)  # likewise
        worker.conn = conn
        await asyncio.shield(conn.closed)
        worker.gone(ConnectionLost(f"worker pid {worker.pid} exited"))
        assert output is not None
        loop.call_later(_OUTPUT_GRACE_S, output.close)  # what it printed last still reaches the log
        await self._kill_group(worker)  # its children too, detached or not (and itself, if it lingers)
        # The zygote reaps it; its device memory is free once the process is gone.
        for _ in range(int(KILL_WAIT_S / _EXIT_POLL_S)):
            if not worker.pid or not pid_alive(worker.pid):
                break
            await asyncio.sleep(_EXIT_POLL_S)
        else:
            log.warning("worker pid %d (%s on %s) is still running", worker.pid, worker.model, worker.gpu_id)
        worker.exited.set_result(None)

    async def _zygote_ready(self) -> _Zygote:
        if self._zygote is not None and self._zygote.alive:
            return self._zygote
        if self._closing():
            raise RuntimeError("the worker pool is shut down")
        if self._zygote_starting is None or self._zygote_starting.done():
            self._zygote_starting = asyncio.ensure_future(self._start_zygote())
        return await asyncio.shield(self._zygote_starting)

    async def _start_zygote(self) -> _Zygote:
        if self._zygote is not None:  # it died: not in a tight loop
            log.error("the worker zygote exited with status %s; restarting it", self._zygote.process.returncode)
            await asyncio.sleep(SPARE_RETRY_S)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "gpu_manager.zygote",
                "--fd",
                str(child.fileno()),
                "--backend",
                self.backend,
                *(["--isolate"] if self.isolation.network else []),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                # Workers inherit it: no cluster address or secret reaches a function.
                env={**worker_environment(os.environ), "PYTHONUNBUFFERED": "1"},
            )
        finally:
            child.close()
        parent.setblocking(False)
        try:
            async with asyncio.timeout(SPARE_START_TIMEOUT_S):
                ready = await asyncio.get_running_loop().sock_recv(parent, 64)
        except (TimeoutError, OSError):
            ready = b""
        except asyncio.CancelledError:  # shut down while it started
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            parent.close()
            raise
        if not ready.startswith(b"ready "):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            parent.close()
            raise RuntimeError(f"the worker zygote did not start (status {process.returncode}); see the log above")
        self._zygote = _Zygote(process, parent, float(ready.split()[1]))
        return self._zygote

    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        """Its control group, made and joined here (before the LoadModel these fields go in, so
        before its handler runs); resource limits and, where the node is root, the package's own
        user and a private home."""
        if self._cgroups is not None and worker.pid and not worker.cgroup:
            await asyncio.to_thread(self._group, worker, run)
        isolation = self.isolation
        fields: dict[str, Any] = {
            "data_limit_mb": data_allowance_mb(self.backend, run.memory_mb) or 0,
            "max_processes": isolation.max_processes,
            "max_file_mb": isolation.max_file_mb,
        }
        if isolation.per_package_users:
            uid = package_uid(run.package_digest)
            fields |= {"uid": uid, "gid": uid}
            if isolation.homes_dir is not None:
                async with self._home_lock:
                    home, bounded = await asyncio.to_thread(private_home, isolation.homes_dir, uid, isolation.home_mb)
                    self._homes[run.package_digest] = home
                if not bounded and not self._warned_home:
                    self._warned_home = True
                    log.warning(
                        "cannot mount a tmpfs for a package's home (%s): what a function writes there is bounded per "
                        "file only (RLIMIT_FSIZE), not in total",
                        home,
                    )
                fields["home_dir"] = str(home)
        return fields

    def _group(self, worker: Worker, run: ModelRun) -> None:
        """Make `worker`'s group and move it in (in a thread: a few writes to cgroupfs)."""
        assert self._cgroups is not None
        name = worker_group(worker.pid)
        limits = worker_limits(
            memory_mb=run.memory_mb,
            runtime_mb=resident_mb(worker.pid),
            max_processes=self.isolation.max_processes,
            cpus=self.isolation.worker_cpus,
        )
        self._cgroups.create(name, limits)
        self._cgroups.attach(name, worker.pid)
        worker.cgroup = name
        worker.cgroup_limit_mb = (limits.memory_bytes or 0) // (1024 * 1024)
        self._grouped[name] = worker

    def over_memory(self, worker: Worker) -> bool:
        if worker.exit_cause != "over_memory" and worker.cgroup and self._cgroups is not None:
            with contextlib.suppress(OSError):
                if self._cgroups.oom_kills(worker.cgroup):
                    self._note_over_memory(worker)
        return worker.exit_cause == "over_memory"

    def _over_memory_among(self, grouped: list[tuple[str, Worker]]) -> list[tuple[str, Worker]]:
        """Those of `grouped` whose group's OOM-kill counter moved (in a thread: a file read each)."""
        assert self._cgroups is not None
        over = []
        for name, worker in grouped:
            with contextlib.suppress(OSError):
                if self._cgroups.oom_kills(name):
                    over.append((name, worker))
        return over

    def _note_over_memory(self, worker: Worker) -> None:
        worker.exit_cause = "over_memory"
        log.error(
            "%s on %s (pid %d): its processes went over their %d MiB of host memory (declared %d MiB); the kernel "
            "killed one, and its whole group is stopped",
            worker.model,
            worker.gpu_id,
            worker.pid,
            worker.cgroup_limit_mb,
            worker.run.memory_mb if worker.run is not None else 0,
        )

    async def _watch_memory(self) -> None:
        """Kill the whole group of a worker whose group met its memory limit: the kernel killed
        one of its processes (perhaps a child the worker waits on); what is left of it goes too,
        so that its call fails now and its model is loaded afresh."""
        cgroups = self._cgroups
        assert cgroups is not None
        while True:
            await asyncio.sleep(OOM_POLL_S)
            grouped = [(name, worker) for name, worker in self._grouped.items() if worker.exit_cause != "over_memory"]
            over = await asyncio.to_thread(self._over_memory_among, grouped)
            for name, worker in over:
                if self._grouped.get(name) is not worker or worker.exit_cause == "over_memory":
                    continue  # gone, or judged by its own call's answer, while the thread read
                self._note_over_memory(worker)
                worker.gone(ConnectionLost(f"worker pid {worker.pid} went over its memory limit"))
                try:
                    await asyncio.to_thread(cgroups.kill, name)
                except OSError as exc:
                    log.error("cannot kill worker cgroup %s: %s", name, exc)

    async def _kill_group(self, worker: Worker) -> None:
        """Kill what is left of `worker`'s group (the processes it started, detached or not) and
        remove the group."""
        cgroups, name = self._cgroups, worker.cgroup
        if cgroups is None or not name:
            return
        self.over_memory(worker)  # read before the group goes: the call's answer depends on it
        try:
            killed = await asyncio.to_thread(cgroups.kill, name)
        except OSError as exc:
            log.error("cannot kill worker cgroup %s (%s): %s", name, worker.model, exc)
            return
        finally:
            self._grouped.pop(name, None)
        if killed:
            log.info("killed %d process(es) left in the group of %s (pid %d)", killed, worker.model, worker.pid)

    async def release_package(self, digest: str, in_use: Callable[[], bool]) -> None:
        """No worker of package `digest` is left on this node (`in_use()` says whether one took
        it meanwhile): its home goes, with all its workers wrote there."""
        async with self._home_lock:
            home = self._homes.get(digest)
            if home is None or in_use():
                return
            del self._homes[digest]
            await asyncio.to_thread(remove_home, home)

    async def stop_starting(self) -> None:
        """A zygote still starting is cancelled: it would fork spares nobody stops."""
        if self._zygote_starting is not None and not self._zygote_starting.done():
            self._zygote_starting.cancel()
            with contextlib.suppress(BaseException):
                await self._zygote_starting

    async def shutdown(self) -> None:
        """The zygote exits when its control socket closes; every worker group goes (what is left
        in them is killed)."""
        if self._oom_watch is not None:
            self._oom_watch.cancel()
        if self._cgroups is not None:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._cgroups.clear)
                await asyncio.to_thread(self._cgroups.remove_base)
        for digest in list(self._homes):
            await self.release_package(digest, lambda: False)
        zygote = self._zygote
        if zygote is not None:
            zygote.control.close()
            try:
                await asyncio.wait_for(zygote.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    zygote.process.kill()
                await zygote.process.wait()


class DockerRuntime(Runtime):
    """A container per worker, made for its model by `launcher` (gpu_manager.containers): its
    package, pooled weights and requirements layer mounted read-only, a Unix socket of its own to
    talk on. `prepare(run)` brings the package and says its directory, its user and its weights;
    `track(task)` keeps a background task (a signal sent through the engine)."""

    name = "docker"
    keeps_spares = False

    def __init__(
        self,
        *,
        launcher: DockerLauncher,
        node: str,
        prepare: Prepare,
        track: Callable[[asyncio.Task[Any]], None],
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.launcher = launcher
        self.node = node
        self._prepare = prepare
        self._track = track
        self._sockets: Path | None = None

    async def check(self) -> None:
        """The engine answers and has the image (DockerUnavailable if not), and the containers a
        previous run of this node left are removed."""
        await self.launcher.check()
        removed = await self.launcher.remove_node_containers(self.node)
        if removed:
            log.info("removed %d worker container(s) a previous run of node %s left", removed, self.node)

    def package_dir(self, directory: Path) -> str:
        return PACKAGE_MOUNT

    def worker_view(self, weights: WeightsPlan) -> WeightsPlan:
        return dataclasses.replace(
            weights,
            pooled={path: _pool_mount(host) for path, host in weights.pooled.items()},
            layer_dir=LAYER_MOUNT if weights.layer_dir else "",
        )

    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        return {"max_file_mb": self.isolation.max_file_mb}  # the container is the rest: user, limits, tmpfs

    async def shutdown(self) -> None:
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)

    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        """A container for `model` on `worker.gpu_id`, connected to, and `exited` resolved once it
        is gone and removed."""
        assert model is not None, "the docker runtime starts a worker for a model"
        run = model
        launcher = self.launcher
        worker_id = uuid.uuid4().hex[:12]
        socket_dir = self._socket_root() / worker_id
        listener: socket.socket | None = None
        loop = asyncio.get_running_loop()
        try:
            directory, uid, weights = await self._prepare(run)
            # The container sees its pool files and layer at paths of its own (`worker_view`).
            mounts = [(host, _pool_mount(host)) for host in weights.pooled.values()]
            if weights.layer_dir:
                mounts.append((weights.layer_dir, LAYER_MOUNT))
            socket_dir.mkdir(parents=True, mode=0o700)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(socket_dir / SOCKET_NAME))
            listener.listen(1)
            listener.setblocking(False)
            if os.geteuid() == 0:
                os.chown(socket_dir, uid, uid)
                os.chown(socket_dir / SOCKET_NAME, uid, uid)
            spec = container_spec(
                image=launcher.image,
                node=self.node,
                worker_id=worker_id,
                backend=self.backend,
                gpu_id=worker.gpu_id,
                gpu_index=self.gpus[worker.gpu_id],
                memory_mb=run.memory_mb,
                uid=uid,
                package_dir=directory,
                socket_dir=socket_dir,
                max_processes=self.isolation.max_processes,
                environment=container_environment(os.environ),
                read_only_mounts=mounts,
            )
            worker.container = await launcher.start(spec)
            worker.on_signal = lambda signum: self._track(
                asyncio.ensure_future(launcher.kill(worker.container, signum))
            )
            accepting = asyncio.ensure_future(loop.sock_accept(listener))
            exiting = asyncio.ensure_future(launcher.exited(worker.container))
            try:
                done, _ = await asyncio.wait(
                    {accepting, exiting}, timeout=SPARE_START_TIMEOUT_S, return_when="FIRST_COMPLETED"
                )
            finally:
                exiting.cancel()
                if not accepting.done():
                    accepting.cancel()
            if accepting not in done:
                why = exiting.result() if exiting in done and exiting.exception() is None else "no answer"
                raise RuntimeError(f"the worker container did not connect ({why})")
            accepted, _ = accepting.result()
            max_frame_bytes = self.max_frame_bytes
            _, conn = await loop.create_unix_connection(
                lambda: Connection(worker, max_frame_bytes=max_frame_bytes), sock=accepted
            )
        except (OSError, RuntimeError, TimeoutError, asyncio.CancelledError) as exc:
            if not self._closing():
                log.error("cannot start a container for %s on %s: %s", run.model, worker.gpu_id, exc)
            worker.exit_cause = worker.exit_cause or ("shutdown" if self._closing() else "start_failed")
            worker.gone(ConnectionLost(f"cannot start a worker container: {exc or 'the pool shut down'}"))
            await self._remove_container(worker, socket_dir)
            return
        finally:
            if listener is not None:
                listener.close()  # one worker per socket: nobody else may connect
        worker.conn = conn
        await asyncio.shield(conn.closed)
        worker.gone(ConnectionLost(f"worker container {worker.container[:12]} exited"))
        await self._remove_container(worker, socket_dir)

    async def _remove_container(self, worker: Worker, socket_dir: Path) -> None:
        if worker.container:
            status = await self.launcher.wait_and_remove(worker.container, KILL_WAIT_S)
            if status not in (None, 0, -signal.SIGKILL, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
                log.info("worker container %s (%s) exited with status %s", worker.container[:12], worker.model, status)
        shutil.rmtree(socket_dir, ignore_errors=True)
        if not worker.exited.done():
            worker.exited.set_result(None)

    def _socket_root(self) -> Path:
        """Where the containers' sockets go: a short path of this pool's own (a Unix socket's path
        may not pass 107 bytes, which a state directory's easily would)."""
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="gpufaas-sockets-"))
            self._sockets.chmod(0o711)
        return self._sockets


def _pool_mount(host_path: str) -> str:
    """Where a container sees one of the host pool's files (one bind mount each)."""
    return f"{POOL_MOUNT}/{Path(host_path).name}"
