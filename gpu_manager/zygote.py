"""The node's zygote: one process that has imported the runtime (torch) and forks workers from it.

A worker forked from here starts in milliseconds with torch already imported, where a fresh
interpreter takes a second or more (and its pages are shared with its siblings until written).
The zygote never runs torch itself: it must not have threads or a device context to fork.

`python -m gpu_manager.zygote --fd N --backend B`: fd N is a SOCK_SEQPACKET socket to the node's
WorkerPool. The zygote first sends b"ready <import seconds>". Then each message the pool sends is
b"<gpu id> <device index>" carrying two file descriptors (SCM_RIGHTS): the worker's end of a
socket pair, on which the forked worker then speaks to the pool (gpu_manager.worker), and the
write end of a pipe that becomes the worker's stdout and stderr (the pool reads it, within a
budget). A worker keeps no other descriptor (gpu_manager.sandbox.close_descriptors), nor does the
zygote keep any it was started with but its stdio and fd N, nor its node's controlling terminal.
With --isolate each worker first moves into a network namespace of its own (gpu_manager.sandbox):
it reaches nothing but its pool.
Children are reaped automatically (SIGCHLD ignored); the pool tells a worker's exit by its socket
closing or, from its hello on, by its PID (a pidfd: a process its handler forked may hold a copy of
its socket). The zygote exits when the pool closes its end, or the kernel does for a node that died
(killed by the OOM killer, crashed), and first SIGKILLs every worker it forked that still runs: an
idle one would exit at its socket's EOF, but one busy in a call reads it only once the call returns,
and one stuck in its handler never (keeping its host and device memory beyond the node, unknown to
the node's next incarnation). A zygote that dies itself leaves its workers serving their pool;
not covered: those of a zygote that died and was replaced before its node died (init's children
then, not the new zygote's), which only the node's cgroups clear.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from gpu_manager.backends import Backend, WorkerDevice, backend_class
from gpu_manager.sandbox import close_descriptors, drop_controlling_terminal, own_namespaces, plan_import_path
from gpu_manager.worker import run_worker

MAX_MESSAGE_BYTES = 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_manager.zygote", description="gpufaas worker zygote")
    parser.add_argument("--fd", type=int, required=True, help="the pool's control socket (SOCK_SEQPACKET)")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--isolate", action="store_true", help="give each worker a network namespace of its own")
    args = parser.parse_args(argv)
    # The node's event loop (uvloop) hands its children copies of the node's stdio (its log) that
    # it made while spawning; nothing but the control socket is this process's to keep.
    close_descriptors(keep=[args.fd])
    drop_controlling_terminal()  # a node run in a shell: no worker may reach that terminal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gpu_manager decides when this process stops
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they exit
    backend = backend_class(args.backend)
    started_s = time.perf_counter()
    backend.setup()
    backend.import_runtime()
    import_s = time.perf_counter() - started_s
    plan_import_path()  # what confining a worker will change, found once here (gpu_manager.sandbox)
    # Everything imported so far is shared with the workers until written; the garbage collector
    # would write to every object it scans (copying each page in each worker), so it leaves the
    # zygote's objects alone from now on (as Instagram's pre-fork servers do).
    gc.freeze()
    control = socket.socket(fileno=args.fd)
    control.sendall(f"ready {import_s:.6f}".encode())
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE_BYTES, 2)
        except ConnectionResetError:
            message, fds = b"", []
        if not message:  # the pool is gone: shut down, or its node died
            kill_workers()
            return 0
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        gpu_id, index = message.decode().split()
        try:
            pid = os.fork()
        except OSError as exc:
            # EAGAIN (a full PID table, RLIMIT_NPROC) or ENOMEM: that worker is not started (its
            # socket closes below, which its pool reads as a failed start), and the zygote serves on.
            # Dying here would orphan every worker it forked (no kill_workers at the node's end)
            # and cost the node a restart that imports the runtime again.
            print(f"gpu_manager.zygote: could not fork a worker for {gpu_id}: {exc}", file=sys.stderr, flush=True)
            pid = -1
        if pid == 0:
            control.close()
            _run_forked_worker(backend, gpu_id, int(index), fds, isolate=args.isolate, import_s=import_s)
        for fd in fds:
            os.close(fd)


def kill_workers() -> int:
    """SIGKILL every process this zygote forked that still runs (its workers); how many. Each is
    signalled through a pidfd, after checking that its PID still names a child of this process: the
    zygote forks nothing more, so such a child is one of its workers, never a process that reused
    the PID of one that exited (they are reaped as they exit)."""
    me = os.getpid()
    killed = 0
    for pid in _children(me):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # exited meanwhile
        except OSError:  # no pidfds (Linux before 5.3): by PID, checked just before
            pidfd = -1
        try:
            if _parent(pid) == me:
                if pidfd >= 0:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                killed += 1
        except ProcessLookupError:
            pass
        finally:
            if pidfd >= 0:
                os.close(pidfd)
    return killed


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` now (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent(int(entry.name)) == pid:
            found.append(int(entry.name))
    return found


def _parent(pid: int) -> int | None:
    """Process `pid`'s parent (None if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _run_forked_worker(
    backend: type[Backend], gpu_id: str, index: int, fds: list[int], *, isolate: bool, import_s: float
) -> NoReturn:
    """In the child just forked: become the worker of `gpu_id` on the channel `fds[0]`, its
    stdio the pipe `fds[1]`, and exit with its status (never returns into the zygote's loop)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[1], 1)  # its output goes to the pool, which caps it
        os.dup2(fds[1], 2)
        os.close(fds[1])
        # Its channel and stdio only: not the node's log, not another worker's pipe.
        close_descriptors(keep=[fds[0]])
        isolated = own_namespaces() if isolate else False
        worker = backend(WorkerDevice(backend.name, gpu_id, index))
        status = run_worker(socket.socket(fileno=fds[0]), worker, import_s=import_s, network_isolated=isolated)
    except (BrokenPipeError, ConnectionResetError):
        status = 0  # the pool let go of this worker (it shut down, or stopped a spare)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
