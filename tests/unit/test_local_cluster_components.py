"""gpufaas.dev.local_cluster's components over real processes: what a stop leaves behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpufaas.dev.local_cluster import ClusterError, Component, LocalCluster
from gpufaas.processes import pid_alive, survivors

# A component that starts a process in its own group (as a GPU manager forks its zygote and
# workers), writes that process's PID to the file it is given, and waits.
_LEADER = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def _started(tmp_path: Path) -> tuple[Component, int]:
    """A started component running _LEADER, and its child's PID."""
    pid_file = tmp_path / "child.pid"
    component = Component("node0", [sys.executable, "-c", _LEADER, str(pid_file)], tmp_path / "node0.log")
    component.start(dict(os.environ))
    deadline = time.monotonic() + 10.0
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the component did not start its child"
        time.sleep(0.01)
    return component, int(pid_file.read_text())


def test_a_component_that_died_alone_has_what_it_left_in_its_group_killed_when_stopped(tmp_path: Path) -> None:
    # A GPU manager killed by PID (the OOM killer, a crash) leaves its workers in its group: the
    # supervisor's restart_one, and the cluster's stop, stop the component before anything else.
    component, child = _started(tmp_path)
    assert component.process is not None
    try:
        os.kill(component.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while component.alive():
            assert time.monotonic() < deadline, "the component did not die"
            time.sleep(0.01)
        assert pid_alive(child)
        component.stop()
        assert survivors([child], grace_s=2.0) == [], "what the dead component left in its group outlived its stop"
        assert component.process.returncode == -signal.SIGKILL  # reaped by the stop
        component.stop()  # a second stop signals nothing (its PID may name another process by now)
    finally:
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)
        component.stop(kill=True)


def test_a_dead_components_status_is_told_and_its_pid_kept_until_it_is_stopped(tmp_path: Path) -> None:
    component, child = _started(tmp_path)
    assert component.process is not None
    pid = component.process.pid
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while component.exit_status() is None:
            assert time.monotonic() < deadline, "the component did not die"
            time.sleep(0.01)
        assert component.exit_status() == -signal.SIGKILL and not component.alive()
        assert Path(f"/proc/{pid}").exists()  # not reaped: its PID, its group's, names no other process
        component.stop()
        assert component.process.returncode == -signal.SIGKILL  # reaped by the stop
    finally:
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_running_component_is_stopped_with_its_group(tmp_path: Path) -> None:
    component, child = _started(tmp_path)
    assert component.process is not None
    try:
        component.stop(timeout_s=5.0)
        assert component.process.returncode == -signal.SIGTERM
        assert survivors([child], grace_s=2.0) == []
    finally:
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_component_that_died_as_the_cluster_started_is_named_with_its_exit_status(tmp_path: Path) -> None:
    """What `gpufaas up` prints when a daemon dies while it starts: its status, not 'None' (the
    exited process is left unreaped until it is stopped, so its returncode is not set)."""
    cluster = LocalCluster(tmp_path / "state")
    component = Component("node0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "node0.log")
    component.start(dict(os.environ))
    cluster.components["node0"] = component
    deadline = time.monotonic() + 10
    while component.exit_status() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        with pytest.raises(ClusterError, match="node0 exited with status 3"):
            cluster.wait_healthy(timeout_s=5)
    finally:
        component.stop()


def test_pids_json_is_never_seen_half_written(tmp_path: Path) -> None:
    """The supervisor rewrites pids.json at each restart: written in place (truncated, then
    written), a `gpufaas down` reading it meanwhile found no PID, said 'nothing is running' and
    left the whole cluster up."""
    import threading

    from gpufaas.dev.local_cluster import recorded_pids

    cluster = LocalCluster(tmp_path, watchdog=None, supervisor_pid=os.getpid())
    cluster.write_pids()
    done = threading.Event()

    def rewrite() -> None:
        while not done.is_set():
            cluster.write_pids()

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen = [recorded_pids(tmp_path) for _ in range(3000)]
    finally:
        done.set()
        writer.join()
    assert all(pids == {"supervisor": os.getpid()} for pids in seen), [p for p in seen if not p][:1]


def test_cluster_json_counts_the_restarts_of_each_component(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, watchdog=None, supervisor_pid=os.getpid())
    cluster.supervision.restarts["scheduler"] = 3  # (as `Supervision.due` counts them)
    cluster.write_pids()
    assert json.loads((tmp_path / "cluster.json").read_text())["restarts"] == {"scheduler": 3}


def test_a_components_log_over_its_bound_is_moved_aside_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each start (gpufaas up, each restart of a component that keeps crashing) appended to the same
    log, which grew for as long as the state directory lived: one over LOG_ROTATE_BYTES is now
    STATE/logs/NAME.log.1 (an older .1 replaced), and the new run's log starts empty."""
    from gpufaas.dev import local_cluster

    monkeypatch.setattr(local_cluster, "LOG_ROTATE_BYTES", 100)
    log_path = tmp_path / "node0.log"
    log_path.write_text("old run\n" * 20)
    component = Component("node0", [sys.executable, "-c", "print('new run')"], log_path)
    component.start(dict(os.environ))
    assert component.process is not None
    component.process.wait(timeout=10)
    component.stop()
    assert log_path.read_text() == "new run\n"
    assert (tmp_path / "node0.log.1").read_text() == "old run\n" * 20
    component.start(dict(os.environ))  # under the bound: appended to
    assert component.process is not None
    component.process.wait(timeout=10)
    component.stop()
    assert log_path.read_text() == "new run\n" * 2


def test_down_does_not_signal_a_pid_reused_while_it_waited_for_the_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpufaas down checks each recorded PID's start time when it reads pids.json, then waits up to
    15 s for the supervisor to stop the cluster, which reaps its components: a PID freed so and
    taken by another process meanwhile was then SIGTERMed (its whole group, if it leads one)."""
    import subprocess

    from gpufaas import processes
    from gpufaas.dev import local_cluster

    supervisor = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # holds node0's recorded PID now
    try:
        (tmp_path / "pids.json").write_text(
            local_cluster.pid_record({"supervisor": supervisor.pid, "node0": other.pid})
        )
        real_started = processes.started
        signalled: list[int] = []
        real_signal = local_cluster._signal_group

        def signal_group(pid: int, sig: signal.Signals) -> None:
            signalled.append(pid)
            real_signal(pid, sig)

        def started(pid: int) -> int | None:  # node0 exited once the supervisor was told to stop; reused
            value = real_started(pid)
            return value + 1 if pid == other.pid and signalled and value is not None else value

        monkeypatch.setattr(local_cluster, "_signal_group", signal_group)
        monkeypatch.setattr(local_cluster, "started", started, raising=True)
        local_cluster.stop_recorded(tmp_path, timeout_s=5.0)
        supervisor.wait(timeout=5)
        assert other.poll() is None, "down signalled the process that took a stopped component's PID"
        assert signalled == [supervisor.pid]
    finally:
        for process in (supervisor, other):
            process.kill()
            process.wait()


def test_the_packages_of_an_earlier_clusters_gateways_are_served_by_the_first_gateway_now(tmp_path: Path) -> None:
    # `up` with one gateway keeps the packages deployed through it in STATE/gateway; `up --gateways 2`
    # on the same state dir runs gateway0 and gateway1, and no holder served those blobs any more.
    from gpufaas.blobs import BlobStore
    from gpufaas.dev.local_cluster import adopt_gateway_blobs

    weights, handler = b"w" * 100_000, b"def load(d): ...\n"
    held = BlobStore(tmp_path / "gateway" / "blobs").put(weights)
    also = BlobStore(tmp_path / "gateway1" / "blobs").put(handler)  # a cluster of two before that
    BlobStore(tmp_path / "node0" / "blobs").put(b"a node's, not a gateway's")
    assert adopt_gateway_blobs(tmp_path, ["gateway0", "gateway1"]) == 1
    first = BlobStore(tmp_path / "gateway0" / "blobs")
    assert first.path(held) is not None and first.path(held).read_bytes() == weights  # type: ignore[union-attr]
    assert set(first.digests()) == {held}
    assert adopt_gateway_blobs(tmp_path, ["gateway0", "gateway1"]) == 0  # once
    # Back to one gateway: what either of the two held.
    assert adopt_gateway_blobs(tmp_path, ["gateway"]) == 1
    assert set(BlobStore(tmp_path / "gateway" / "blobs").digests()) == {held, also}


# A component whose child (as a GPU manager's worker) notes a SIGTERM in the file it is given; the
# component, told to stop, has its child end (SIGUSR1: it exits after its handlers ran) and exits.
_DRAINING_LEADER = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "w").write("SIGTERM"))
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
open(sys.argv[2], "w").write("ready")
while not stop:
    time.sleep(0.01)
''', sys.argv[1] + ".term", sys.argv[1]])
def stop(*_):
    child.send_signal(signal.SIGUSR1)
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.pause()
"""


def test_a_stop_signals_the_component_not_its_workers(tmp_path: Path) -> None:
    # A GPU manager drains on SIGTERM, running its calls to their end: a SIGTERM to its whole group
    # (`gpufaas down`, `LocalCluster.restart`) killed its workers with it, and their calls.
    ready = tmp_path / "child"
    component = Component("node0", [sys.executable, "-c", _DRAINING_LEADER, str(ready)], tmp_path / "node0.log")
    component.start(dict(os.environ))
    assert component.process is not None
    try:
        deadline = time.monotonic() + 10.0
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline, "the component did not start its child"
            time.sleep(0.01)
        component.stop(timeout_s=10.0)
        assert component.process.returncode == 0  # it stopped on its own
        assert not (tmp_path / "child.term").exists(), "its worker got the SIGTERM too"
    finally:
        component.stop(kill=True)
