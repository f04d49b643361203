"""The node's zygote (gpu_manager.zygote) in a process of its own, driven over its control socket as
the process runtime drives it: what it does when it cannot fork a worker."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import termios
from pathlib import Path

from gpu_manager.worker import Channel
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import MessageType

REPO = Path(__file__).resolve().parents[2]

# The zygote, its first fork refused by the kernel as under a full PID table or RLIMIT_NPROC (EAGAIN).
ZYGOTE_SCRIPT = r"""
import errno, os, sys
from gpu_manager import zygote
real_fork, refusals = os.fork, [OSError(errno.EAGAIN, "Resource temporarily unavailable")]
def fork():
    if refusals:
        raise refusals.pop()
    return real_fork()
os.fork = fork
sys.exit(zygote.main(sys.argv[1:]))
"""


def ask_for_worker(control: socket.socket) -> socket.socket:
    """Ask the zygote for a worker, as the process runtime does; the node's end of its socket."""
    node, child = socket.socketpair()
    output_read, output_write = os.pipe()
    try:
        socket.send_fds(control, [b"gpu0 0"], [child.fileno(), output_write])
    finally:
        child.close()
        os.close(output_write)
        os.close(output_read)  # its output is not read here (a worker that writes gets EPIPE)
    node.settimeout(30)
    return node


def test_a_fork_the_kernel_refuses_fails_that_worker_only_and_the_zygote_forks_the_next() -> None:
    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE_SCRIPT, "--fd", str(theirs.fileno()), "--backend", "emulated"],
        cwd=REPO,
        pass_fds=[theirs.fileno()],
        stderr=subprocess.PIPE,
    )
    theirs.close()
    try:
        control.settimeout(30)
        assert control.recv(64).startswith(b"ready ")
        refused = ask_for_worker(control)
        assert refused.recv(1) == b""  # no worker: its socket closes, which the node reads as a failed start
        refused.close()
        node = ask_for_worker(control)
        frame = Channel(node).recv()
        assert frame is not None and frame.type == MessageType.WORKER_HELLO
        assert pb.WorkerHello.FromString(frame.header).pid > 0
        node.close()
        control.close()  # the zygote kills its workers and exits
        _, stderr = zygote.communicate(timeout=30)
        assert zygote.returncode == 0, stderr.decode()
        assert b"could not fork a worker" in stderr
    finally:
        control.close()
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()


def _terminal(pid: int) -> int:
    """Process `pid`'s controlling terminal (stat's tty_nr; 0: none)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[4])


def test_a_worker_has_no_controlling_terminal_when_its_node_was_started_in_one() -> None:
    """A node run by hand in a root shell had its terminal as the zygote's and every worker's
    controlling terminal: a handler, as the package's user, opened /dev/tty (mode 0666, whoever
    owns the terminal) and pushed `TIOCSTI` keystrokes into root's shell. The zygote lets go of it."""
    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    leader, follower = os.openpty()
    zygote = subprocess.Popen(
        # The shell leads the session (a node started by hand in it); the zygote is its child, as a node's is.
        ["sh", "-c", f'"{sys.executable}" -m gpu_manager.zygote --fd {theirs.fileno()} --backend emulated; :'],
        cwd=REPO,
        pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(follower, termios.TIOCSCTTY, 0),  # noqa: PLW1509  one thread here
    )
    theirs.close()
    os.close(follower)
    try:
        control.settimeout(30)
        assert control.recv(64).startswith(b"ready ")
        node = ask_for_worker(control)
        frame = Channel(node).recv()
        assert frame is not None and frame.type == MessageType.WORKER_HELLO
        assert _terminal(pb.WorkerHello.FromString(frame.header).pid) == 0
        node.close()
    finally:
        control.close()
        zygote.wait(timeout=30)
        os.close(leader)
