"""The process runtime (`--runtime process`): workers forked from the node's zygote
(gpu_manager.zygote), warm spares before any model is known, confined when they take one
(gpu_manager.sandbox, gpu_manager.cgroups)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_manager import seccomp
from gpu_manager.cgroups import Cgroups, Unavailable, open_cgroups, resident_mb, worker_group, worker_limits
from gpu_manager.runtimes.base import KILL_WAIT_S, SPARE_RETRY_S, SPARE_START_TIMEOUT_S, STOP_GRACE_S, Runtime, log
from gpu_manager.sandbox import (
    LOG_LINE_BYTES,
    LogBudget,
    clear_homes,
    data_allowance_mb,
    private_home,
    remove_home,
    worker_environment,
)
from gpu_manager.workers import ModelRun, Worker
from gpufaas.processes import pid_alive
from gpufaas.wire import Connection, ConnectionLost, read_what_is_left

worker_log = logging.getLogger("gpufaas.worker")  # what workers print
_DROP_REPORT_S = 10.0  # how often a worker's dropped output is told of, at most
_OUTPUT_GRACE_S = 1.0  # a worker's output is read this long after it exits (then its pipe is closed)
_EXIT_POLL_S = 0.005
# How often the worker groups' OOM-kill counters are read: a small file each, read in a thread, so
# that hundreds of parked workers cost the node's event loop nothing (a call's own answer reads its
# worker's counter at once; this only clears what is left of a group the kernel cut into).
OOM_POLL_S = 1.0


class _Zygote:
    """The zygote process (gpu_manager.zygote) and the pool's end of its control socket."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket, import_s: float) -> None:
        self.process = process
        self.control = control  # non-blocking
        self.import_s = import_s
        self._sending = asyncio.Lock()  # one request waits for room at a time (one writer per fd)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def fork(self, gpu_id: str, device_index: int, sock: socket.socket, output_fd: int) -> None:
        """Ask for a worker for `gpu_id` on `sock`, writing its output to `output_fd` (raises
        OSError if the zygote is gone). Waits, in order, while the socket's buffer is full: about
        280 requests fit, and a burst past that (hundreds of spares, the misses that waited on a
        restarting zygote) failed each start over it (EAGAIN), the zygote forking one at a time."""
        message = [f"{gpu_id} {device_index}".encode()]
        async with self._sending:
            while True:
                try:
                    socket.send_fds(self.control, message, [sock.fileno(), output_fd])
                    return
                except BlockingIOError:
                    await _writable(self.control)


async def _writable(sock: socket.socket) -> None:
    """Once `sock` can be written to (or its peer is gone: the next send says so)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(sock.fileno())


class _OutputRelay(asyncio.Protocol):
    """A worker's stdout and stderr (the read end of its pipe), logged line by line under
    `gpufaas.worker` within its LogBudget: a function that prints without end costs the node a
    bounded rate, and says how much it lost. A line over LOG_LINE_BYTES is logged cut, once: the
    rest of it is dropped up to its end (it was logged as lines of its own, one of them uncut)."""

    def __init__(self, worker: Worker, budget: LogBudget) -> None:
        self.worker = worker
        self.budget = budget
        self._buffer = bytearray()
        self._cutting = False  # a line was logged cut: what is left of it is dropped
        self._reported = 0  # bytes dropped already told of
        self._reported_at = 0.0

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        allowed = self.budget.take(len(data), now)
        self._buffer += data[:allowed]
        while (end := self._buffer.find(b"\n")) >= 0:
            if not self._cutting:
                self._emit_at_most(bytes(self._buffer[:end]))
            self._cutting = False
            del self._buffer[: end + 1]
        if len(self._buffer) > LOG_LINE_BYTES:
            if not self._cutting:
                self._emit_at_most(bytes(self._buffer))
            self._cutting = True
            self._buffer.clear()
        if self.budget.dropped > self._reported and now - self._reported_at >= _DROP_REPORT_S:
            self._report_dropped(now)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buffer and not self._cutting:
            self._emit_at_most(bytes(self._buffer))
        self._buffer.clear()
        if self.budget.dropped > self._reported:
            self._report_dropped(time.monotonic())

    def _emit_at_most(self, line: bytes) -> None:
        """Log `line`, cut to LOG_LINE_BYTES (and said so) if it is longer."""
        self._emit(line if len(line) <= LOG_LINE_BYTES else line[:LOG_LINE_BYTES] + b" [line cut]")

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


async def _until_exit(worker: Worker, conn: Connection) -> None:
    """Wait until `worker`'s process is gone, then close its socket: its socket reached EOF, or,
    from its hello on, its PID exited. Its EOF alone would not do: a process its handler forked
    (os.fork, multiprocessing's fork start method, Popen with close_fds=False) holds a copy of the
    socket, and would keep a dead worker live for as long as it runs (its group never killed, its
    stop waited on for KILL_WAIT_S)."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    pidfd = -1

    def watch_pid(hello: asyncio.Future[Any]) -> None:
        # At its hello, before any handler code ran: the process that sent it is the worker, and
        # it cannot have exited and its PID been reused in the turn of the loop since (that takes
        # the kernel's whole PID space). From here on the pidfd names that process, whatever its PID
        # comes to mean.
        nonlocal pidfd
        if hello.cancelled() or hello.exception() is not None or exited.done():
            return
        try:
            pidfd = os.pidfd_open(worker.pid)
        except ProcessLookupError:
            exited.set_result(None)
            return
        except OSError:  # no pidfds (Linux before 5.3): its socket's EOF tells alone
            return
        loop.add_reader(pidfd, readable)

    def readable() -> None:  # the process exited
        if not exited.done():
            exited.set_result(None)

    worker.hello.add_done_callback(watch_pid)
    try:
        ends: set[asyncio.Future[Any]] = {conn.closed, exited}
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        # Its pidfd may be seen before what it wrote last (results of calls it finished before it
        # died or was killed): those are taken in before its socket is closed.
        await read_what_is_left(conn)
    finally:
        worker.hello.remove_done_callback(watch_pid)
        if pidfd >= 0:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        if not exited.done():
            exited.cancel()
    conn.close()  # a copy of its end may live on in what it started: the node lets go of its own


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
        where there are none, say once what that leaves unbounded; likewise where workers can get no
        seccomp filter."""
        no_filter = seccomp.unavailable_reason()
        if no_filter is not None:
            log.warning(
                "no seccomp filter for workers here (%s): a function may make any system call its user may; "
                "run the node on a Linux kernel with seccomp filters, outside a sandbox that refuses them",
                no_filter,
            )
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
            if worker.is_gone:  # killed or stopped (a call's timeout) while the zygote started
                raise RuntimeError("let go of before it was forked")
            await zygote.fork(worker.gpu_id, self.gpus[worker.gpu_id], child, output_write)
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
            if not worker.is_gone:  # else it was let go of: no failure
                self._start_failed(worker, exc, f"a worker for {worker.gpu_id}")
            worker.exited.set_result(None)
            return
        finally:
            child.close()  # the worker holds the only other end now: its exit reads as EOF here
            os.close(output_write)  # likewise
        worker.conn = conn
        if worker.is_gone:
            # Killed or stopped while it was connected to: its signal reached nobody (no PID, no
            # socket yet). Its socket's EOF is what makes it exit, as a spare let go of.
            conn.close()
        await _until_exit(worker, conn)
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
            # Its end of the control socket is the node's to close (kept, each restart leaked one).
            self._zygote.control.close()
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
        except BaseException:  # not started (its interpreter gone, a fork refused): no end of it is kept
            parent.close()
            raise
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

    def processes(self, worker: Worker) -> list[int]:
        """Its control group's processes where it has one (a double fork's too), else its tree."""
        if self._cgroups is not None and worker.cgroup:
            grouped = self._cgroups.pids(worker.cgroup)
            if grouped:
                return grouped
        return super().processes(worker)

    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        """Its control group, made and joined here (before the LoadModel these fields go in, so
        before its handler runs); resource limits and, where the node is root, the package's own
        user and a private home."""
        if self._cgroups is not None and worker.pid and not worker.cgroup and not worker.is_gone:
            name, limit_mb = await asyncio.to_thread(self._group, worker, run)
            # Noted here, on the loop: the OOM watcher iterates `_grouped` there, and an entry
            # added from the thread would end its iteration (and the watcher) with a RuntimeError.
            worker.cgroup, worker.cgroup_limit_mb = name, limit_mb
            self._grouped[name] = worker
            if worker.is_gone:  # let go of meanwhile: its exit may have found no group to kill
                await self._kill_group(worker)
        isolation = self.isolation
        fields: dict[str, Any] = {
            "data_limit_mb": data_allowance_mb(self.backend, run.memory_mb) or 0,
            "max_processes": isolation.max_processes,
            "max_file_mb": isolation.max_file_mb,
        }
        if isolation.per_package_users:
            uid = isolation.package_users.uid(run.package_digest)
            fields |= {"uid": uid, "gid": uid}
            if isolation.homes_dir is not None:
                async with self._home_lock:
                    if worker.is_gone:  # its exit may have released its package's home already: none made again
                        return fields
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

    def _group(self, worker: Worker, run: ModelRun) -> tuple[str, int]:
        """Make `worker`'s group and move it in (in a thread: a few writes to cgroupfs); the
        group's name and its memory limit in MiB."""
        assert self._cgroups is not None
        name = worker_group(worker.pid)
        limits = worker_limits(
            memory_mb=run.memory_mb,
            runtime_mb=resident_mb(worker.pid),
            max_processes=self.isolation.max_processes,
            cpus=self.isolation.worker_cpus,
        )
        try:
            self._cgroups.create(name, limits)
            self._cgroups.attach(name, worker.pid)
        except OSError:  # a limit refused, the worker gone (ESRCH), or the group refused it: the group goes
            with contextlib.suppress(OSError):
                self._cgroups.kill(name)
            raise
        return name, (limits.memory_bytes or 0) // (1024 * 1024)

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
