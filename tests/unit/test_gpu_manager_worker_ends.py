"""How a node's workers end, over real processes (the helpers of test_gpu_manager_pool): a worker's
exit is seen even where a process its handler started holds its socket, and its group goes with
it; a worker that writes frames its node did not ask for is killed, and one whose calls timed out
is not."""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

import pytest

from gpu_manager import loads, worker_processes
from gpu_manager.runtimes import process
from gpu_manager.runtimes.process import ProcessRuntime
from gpu_manager.sandbox import LOG_LINE_BYTES, Isolation, LogBudget
from gpu_manager.workers import UNASKED_FRAMES_ALLOWED, ModelRun, Worker
from gpufaas.processes import pid_alive
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost
from tests.unit.test_gpu_manager_pool import Node, Shelf, eventually, ok, on_cpu, on_own_pool, open_pool, run


class FakeCgroups:
    """Stands in for gpu_manager.cgroups' writer (what `ProcessRuntime.check` finds on a root node):
    a group's processes are those attached and those the test says were forked inside it (the
    kernel puts a forked process in its parent's group); killing the group SIGKILLs them. Moving a
    PID that no longer exists into a group fails as the kernel's write to cgroup.procs does."""

    version = 2

    def __init__(self) -> None:
        self.groups: dict[str, list[int]] = {}
        self.killed: list[str] = []

    def create(self, name: str, limits: object) -> None:
        self.groups.setdefault(name, [])

    def attach(self, name: str, pid: int) -> None:
        if not pid_alive(pid):
            raise ProcessLookupError(3, "No such process")  # ESRCH
        self.groups[name].append(pid)

    def kill(self, name: str, timeout_s: float = 5.0) -> int:
        self.killed.append(name)
        pids = [pid for pid in self.groups.pop(name, []) if pid_alive(pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return len(pids)

    def oom_kills(self, name: str) -> int:
        return 0

    def names(self) -> list[str]:
        return sorted(self.groups)

    def clear(self) -> int:
        return sum(self.kill(name) for name in list(self.groups))

    def remove_base(self) -> None:
        pass


def exited_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def grouped(node: Node) -> FakeCgroups:
    """Give `node`'s process runtime a FakeCgroups; returns it."""
    runtime = node.pool._processes.runtime
    assert isinstance(runtime, ProcessRuntime)
    cgroups = FakeCgroups()
    runtime._cgroups = cgroups  # type: ignore[assignment]
    return cgroups


def test_a_worker_whose_forked_child_holds_its_socket_is_seen_to_exit_and_its_group_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shorter than the node's 30 s (the waits a worker never seen to exit cost): the test fails in seconds.
    monkeypatch.setattr(worker_processes, "KILL_WAIT_S", 2.0)
    monkeypatch.setattr(loads, "KILL_WAIT_S", 3.0)

    async def scenario(node: Node) -> None:
        cgroups = grouped(node)
        out = ok(await node.call(on_cpu("forking", node.shelf.digest("forking_function")), {}))
        worker, (child,) = out["pid"], out["children"]
        [group] = cgroups.names()
        cgroups.groups[group].append(child)  # forked inside its worker's group
        try:
            started = time.monotonic()
            assert await node.pool.evict("forking", "gpu0")  # SIGTERM: the worker exits at once
            evict_s = time.monotonic() - started
            assert evict_s < 1.5, evict_s  # not STOP_GRACE_S + KILL_WAIT_S
            assert (node.pool.worker_exits["stopped"], cgroups.killed) == (1, [group])
            assert not pid_alive(worker)
            await eventually(lambda: not pid_alive(child), "its child is killed with its group")
            assert node.pool.live_workers() == 1  # the spare
            assert node.pool._processes.exiting("gpu0") == set()
            assert node.pool.packages_in_use() == set()
            started = time.monotonic()
            ok(await node.call(on_cpu("echo", node.shelf.digest("echo_function")), {}))
            assert time.monotonic() - started < 2.0  # a later miss there waits for no exit
        finally:
            if pid_alive(child):
                os.kill(child, signal.SIGKILL)

    on_own_pool(tmp_path, "cpu", scenario, wait_for_victims=True)


def test_a_worker_killed_while_the_zygote_starts_is_never_forked(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path)

    async def main() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("cpu", shelf, spares_per_gpu=0, warm=False) as node:
            # The node's first call: its zygote is still importing torch when the call times out.
            result = await node.call(on_cpu("echo", digest), {}, timeout_s=0.1)
            assert (result.outcome, result.worker_killed) == (pb.TIMEOUT, True)
            await eventually(lambda: node.pool.live_workers() == 0, "the killed worker is seen gone")
            assert node.zygotes() and not node.forked_workers()
            assert node.pool.worker_exits == {"killed": 1}
            ok(await node.call(on_cpu("echo", digest), {}))

    run(main)


def test_a_burst_of_forks_past_what_the_zygotes_socket_holds_waits_for_it_to_read() -> None:
    """A node asks its zygote for each worker on one socket; its buffer holds about 280 requests.
    A burst past that (hundreds of spares at start, the misses that waited on a restarting
    zygote) failed every start over it (EAGAIN): each now waits its turn for room."""
    bursts = 1000
    pool_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker_end, other_end = socket.socketpair()
    output_read, output_write = os.pipe()

    zygote_end.settimeout(10)  # (a request that never comes fails the test, not hangs it)

    def zygote() -> int:  # reads (and closes) every request, as the zygote does, only once asked
        for _ in range(bursts):
            _, fds, _, _ = socket.recv_fds(zygote_end, 1024, 2)
            for fd in fds:
                os.close(fd)
        return bursts

    async def main() -> None:
        pool_end.setblocking(False)
        control = process._Zygote(cast(asyncio.subprocess.Process, None), pool_end, 0.0)

        async def ask() -> None:
            asked = control.fork("gpu0", 0, worker_end, output_write)
            if inspect.isawaitable(asked):  # (a send that could not wait raised EAGAIN here)
                await asked

        forks = [asyncio.ensure_future(ask()) for _ in range(bursts)]
        await asyncio.sleep(0)  # each send that fits is done by now; the rest wait
        refused = [f.exception() for f in forks if f.done() and f.exception() is not None]
        assert not refused, f"{len(refused)} refused: {refused[0]}"
        assert not all(f.done() for f in forks)  # (the burst is more than the socket holds)
        async with asyncio.timeout(30):
            assert await asyncio.to_thread(zygote) == bursts
            await asyncio.gather(*forks)  # every request went through, none refused

    try:
        asyncio.run(main())
    finally:
        for end in (pool_end, zygote_end, worker_end, other_end):
            end.close()
        os.close(output_read)
        os.close(output_write)


def padded(sleep_s: float, pad_bytes: int) -> bytes:
    """sleepy_function's input, padded to over `pad_bytes`: more than the socket takes at once."""
    return json.dumps({"sleep_s": sleep_s, "pad": "x" * pad_bytes}).encode()


def test_a_large_call_queued_behind_a_long_one_times_out_at_its_deadline_and_the_worker_stays(tmp_path: Path) -> None:
    async def scenario(node: Node) -> None:
        sleepy = on_cpu("sleepy", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(sleepy, {}))["pid"]
        running = asyncio.ensure_future(node.call(sleepy, {"sleep_s": 2.5}))
        await asyncio.sleep(0.3)  # the worker is in it
        started = time.monotonic()
        queued = await node.call(sleepy, padded(0, 4 << 20), timeout_s=0.5)  # waits for the worker to read it
        assert time.monotonic() - started < 1.0  # answered at its deadline, not once the worker read it
        assert (queued.outcome, queued.worker_killed) == (pb.TIMEOUT, False), queued.message
        assert "still queued at the worker" in queued.message
        assert ok(await running)["pid"] == pid
        assert ok(await node.call(sleepy, {}))["pid"] == pid  # the same worker: never killed
        assert node.pool.worker_exits == {}

    on_own_pool(tmp_path, "cpu", scenario, max_body_bytes=8 << 20)


def test_a_worker_stuck_in_a_call_with_a_large_call_behind_it_is_killed_at_the_calls_deadline(tmp_path: Path) -> None:
    async def scenario(node: Node) -> None:
        sleepy = on_cpu("sleepy", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(sleepy, {}))["pid"]
        # Both written in one turn: the second's bytes wait in the node's buffer behind the first's.
        stuck = asyncio.ensure_future(node.call(sleepy, padded(60, 1 << 20), timeout_s=1.0))
        behind = asyncio.ensure_future(node.call(sleepy, padded(0, 4 << 20)))
        timed_out = await stuck
        assert (timed_out.outcome, timed_out.worker_killed) == (pb.TIMEOUT, True), timed_out.message
        assert (await behind).outcome == pb.WORKER_DIED
        await eventually(lambda: not pid_alive(pid), "the stuck worker is killed")

    on_own_pool(tmp_path, "cpu", scenario, max_body_bytes=8 << 20)


def test_a_worker_that_reads_nothing_with_a_large_call_first_in_line_is_killed_at_its_deadline(tmp_path: Path) -> None:
    # Stopped between calls (a handler's thread holding the interpreter, a debugger): the call's
    # bytes stay in the node's buffer. Nothing is ahead of it, so the worker is stuck; were it
    # judged queued, it would stay, and every call to it would time out behind those bytes.
    async def scenario(node: Node) -> None:
        sleepy = on_cpu("sleepy", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(sleepy, {}))["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            timed_out = await node.call(sleepy, padded(0, 4 << 20), timeout_s=0.5)
            assert (timed_out.outcome, timed_out.worker_killed) == (pb.TIMEOUT, True), timed_out.message
            await eventually(lambda: not pid_alive(pid), "the stuck worker is killed")
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
        assert ok(await node.call(sleepy, {}))["pid"] != pid

    on_own_pool(tmp_path, "cpu", scenario, max_body_bytes=8 << 20)


def test_a_load_whose_worker_was_killed_while_its_package_was_fetched_makes_it_no_group(tmp_path: Path) -> None:
    shelf = Shelf(tmp_path, fetch_delay_s=1.0)  # a large package, from a peer: longer than the call may wait

    async def main() -> None:
        digest = shelf.digest("echo_function")
        async with open_pool("emulated", shelf, isolation=Isolation(users=False)) as node:
            cgroups = grouped(node)
            result = await node.call(on_cpu("echo", digest), {}, timeout_s=0.3)  # through the warm spare
            assert (result.outcome, result.worker_killed) == (pb.TIMEOUT, True)
            await eventually(lambda: digest in shelf._ready, "the fetch ends")
            await asyncio.sleep(0.2)  # what the load would do next
            assert cgroups.names() == [] and cgroups.killed == []  # no group made for the dead worker
            assert node.pool.worker_exits["killed"] == 1

    run(main)


def test_a_worker_gone_before_it_is_confined_gets_no_group_and_no_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    homes: list[int] = []

    def private_home(homes_dir: Path, uid: int, home_mb: int) -> tuple[Path, bool]:
        homes.append(uid)
        return homes_dir / str(uid), True

    monkeypatch.setattr(process, "private_home", private_home)

    async def main() -> None:
        isolation = Isolation(users=True, homes_dir=tmp_path)
        runtime = ProcessRuntime(
            backend="cpu", gpus={"gpu0": 0}, isolation=isolation, max_body_bytes=1 << 20, closing=lambda: False
        )
        cgroups = FakeCgroups()
        runtime._cgroups = cgroups  # type: ignore[assignment]
        model = ModelRun("m", "d1", memory_mb=100)
        worker = Worker("gpu0")
        worker.pid = exited_pid()
        with pytest.raises(ProcessLookupError):  # exited, not yet seen to: the group made for it goes
            await runtime.confinement(worker, model)
        assert cgroups.names() == [] and worker.cgroup == ""
        worker.gone(ConnectionLost("killed"))  # let go of (its exit may have run already)
        fields = await runtime.confinement(worker, model)
        assert "home_dir" not in fields and runtime._homes == {} and homes == []
        assert cgroups.names() == []

    run(main)


class RefusingCgroups(FakeCgroups):
    """A kernel that makes the group's directory, then refuses a limit (v1: a CPU quota above
    the node's own group's is EINVAL)."""

    def create(self, name: str, limits: object) -> None:
        super().create(name, limits)
        raise OSError(errno.EINVAL, "Invalid argument")


def test_a_group_whose_limits_are_refused_is_removed_and_the_load_fails(tmp_path: Path) -> None:
    async def main() -> None:
        runtime = ProcessRuntime(
            backend="cpu", gpus={"gpu0": 0}, isolation=Isolation(), max_body_bytes=1 << 20, closing=lambda: False
        )
        cgroups = RefusingCgroups()
        runtime._cgroups = cgroups  # type: ignore[assignment]
        worker = Worker("gpu0")
        worker.pid = os.getpid()  # alive; never attached (the group is refused first), never killed
        with pytest.raises(OSError, match="Invalid argument"):
            await runtime.confinement(worker, ModelRun("m", "d1", memory_mb=100))
        assert cgroups.names() == [] and worker.cgroup == "" and runtime._grouped == {}

    run(main)


class ThreadNotingDict(dict[str, Worker]):
    """The runtime's groups by name, noting which thread adds each."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def __setitem__(self, key: str, value: Worker) -> None:
        self.threads.append(threading.get_ident())
        super().__setitem__(key, value)


def test_a_workers_group_is_noted_on_the_event_loop_where_the_oom_watcher_iterates_them() -> None:
    """The OOM watcher iterates the runtime's groups on the loop; one added from the thread that
    writes the group to cgroupfs could end that iteration, and the watcher with it, with
    "dictionary changed size during iteration"."""

    async def main() -> None:
        runtime = ProcessRuntime(
            backend="cpu", gpus={"gpu0": 0}, isolation=Isolation(), max_body_bytes=1 << 20, closing=lambda: False
        )
        runtime._cgroups = FakeCgroups()  # type: ignore[assignment]
        runtime._grouped = grouped = ThreadNotingDict()
        worker = Worker("gpu0")
        worker.pid = os.getpid()  # alive: attached to the fake group, which is never killed here
        await runtime.confinement(worker, ModelRun("m", "d1", memory_mb=100))
        assert worker.cgroup == f"worker-{os.getpid()}" and worker.cgroup_limit_mb > 200
        assert grouped == {worker.cgroup: worker} and grouped.threads == [threading.get_ident()]

    run(main)


# A node in a process of its own (as LocalCluster starts one: a session of its own), which loads an
# emulated model, starts a call of it that lasts a minute, prints its worker's PID and its zygote's,
# then waits.
_NODE = """
import asyncio, os, sys
from pathlib import Path
from tests.unit.test_gpu_manager_pool import Shelf, emulated, open_pool

async def main() -> None:
    shelf = Shelf(Path(sys.argv[1]))
    run = emulated("slow", shelf.digest("echo_function"), inference_s=60)
    async with open_pool("emulated", shelf) as node:
        busy = asyncio.ensure_future(node.call(run))
        while not node.pool.workers():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the worker is in the call
        [zygote] = node.zygotes()
        print(node.pid_of("slow"), zygote.pid, flush=True)
        await busy

asyncio.run(main())
"""


def test_a_node_that_dies_alone_takes_its_busy_worker_with_it(tmp_path: Path) -> None:
    # The node is killed by PID, not its process group (the OOM killer, a crash): its worker, busy in
    # a call for another minute, would read its socket's EOF only then, a stuck one never.
    node = subprocess.Popen(
        [sys.executable, "-c", _NODE, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert node.stdout is not None
        pids = [int(pid) for pid in node.stdout.readline().split()]
        worker, zygote = pids
        assert pid_alive(worker)
        node.kill()
        node.wait(timeout=5)
        deadline = time.monotonic() + 3.0
        while (pid_alive(worker) or pid_alive(zygote)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(worker), "the busy worker outlived its node"
        assert not pid_alive(zygote)
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def test_a_worker_flooding_its_node_with_frames_it_was_not_asked_for_is_killed_and_others_answer(
    tmp_path: Path,
) -> None:
    # Its handler writes CallResults for a call the node never wrote, from a thread, for 20 s:
    # each is parsed on the node's loop (94 % of a core, another function's p50 3x, as found).
    async def scenario(node: Node) -> None:
        echo = on_cpu("echo", node.shelf.digest("echo_function"))
        flood = on_cpu("flood", node.shelf.digest("flood_function"))
        ok(await node.call(echo, {}))
        pid = ok(await node.call(flood, {"flood_s": 20}))["pid"]
        await eventually(lambda: node.pool.worker_exits["misbehaved"] == 1, "the flooding worker is killed", 3.0)
        await eventually(lambda: not pid_alive(pid), "its process is gone")
        for _ in range(20):
            ok(await node.call(echo, {}))
        assert ok(await node.call(flood, {}))["pid"] != pid  # a worker of its own again, from a spare
        assert node.pool.worker_exits == {"misbehaved": 1}

    on_own_pool(tmp_path, "cpu", scenario)


def test_every_kind_of_frame_not_asked_for_counts_and_the_calls_at_the_worker_are_answered(tmp_path: Path) -> None:
    kinds = ("result", "hello", "loaded", "unknown", "reply")

    async def scenario(node: Node) -> None:
        digest = node.shelf.digest("flood_function")
        # Up to the allowance: the worker stays.
        within = on_cpu("within", digest)
        pid = ok(await node.call(within, {"flood": UNASKED_FRAMES_ALLOWED}))["pid"]
        assert ok(await node.call(within, {}))["pid"] == pid
        for kind in kinds:
            model = on_cpu(f"flood-{kind}", digest)
            ok(await node.call(model, {}))
            # One call floods; the one queued behind it is at the same worker when it is killed.
            flooding = asyncio.ensure_future(node.call(model, {"flood": 40, "kind": kind}))
            behind = asyncio.ensure_future(node.call(model, {}))
            for result in await asyncio.gather(flooding, behind):
                assert (result.outcome, result.worker_killed) == (pb.HANDLER_ERROR, True), (kind, result)
                assert "frames the node had not asked for" in result.message
        # During its load: a failed load (its handler's doing, not placed again).
        loading = await node.call(on_cpu("flood-load", digest, environment={"FLOOD_AT_LOAD": "40"}), {})
        assert (loading.outcome, loading.loaded) == (pb.LOAD_FAILED, True), loading
        assert "frames the node had not asked for" in loading.message and "while loading" in loading.message
        await eventually(lambda: node.pool.worker_exits["misbehaved"] == len(kinds) + 1, "every flooder exits")
        assert node.pool.worker_exits == {"misbehaved": len(kinds) + 1}
        assert ok(await node.call(within, {}))["pid"] == pid

    on_own_pool(tmp_path, "cpu", scenario)


def test_the_late_results_of_calls_that_timed_out_queued_are_expected_and_the_worker_stays(tmp_path: Path) -> None:
    # An honest worker runs the calls its node gave up on all the same, and answers each: more
    # results than the allowance, none of them for a call the node still waits on.
    async def scenario(node: Node) -> None:
        sleepy = on_cpu("sleepy", node.shelf.digest("sleepy_function"))
        pid = ok(await node.call(sleepy, {}))["pid"]
        running = asyncio.ensure_future(node.call(sleepy, {"sleep_s": 1.0}))
        await asyncio.sleep(0.2)  # the worker is in it
        count = 2 * UNASKED_FRAMES_ALLOWED
        queued = await asyncio.gather(*(node.call(sleepy, {}, timeout_s=0.3) for _ in range(count)))
        assert {(r.outcome, r.worker_killed) for r in queued} == {(pb.TIMEOUT, False)}
        assert ok(await running)["pid"] == pid
        assert ok(await node.call(sleepy, {}))["pid"] == pid  # behind every late result
        [worker] = [w for w in node.pool._processes.live if w.model == "sleepy"]
        assert worker.unasked_frames == 0 and worker._given_up == set()
        assert node.pool.worker_exits == {}

    on_own_pool(tmp_path, "cpu", scenario)


def test_a_printed_line_over_the_limit_is_logged_once_cut_and_its_rest_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # print("x" * 100_000) reached the pipe as 65,536 bytes then the rest: logged as a 16 KiB line
    # marked cut, then its 34,465 last bytes as a line of their own, uncut (over the limit) and
    # reading as another print.
    async def relayed(chunks: list[bytes]) -> list[str]:
        relay = process._OutputRelay(Worker("gpu0"), LogBudget(1 << 30, 1 << 30, time.monotonic()))
        caplog.clear()
        with caplog.at_level("INFO", logger="gpufaas.worker"):
            for chunk in chunks:
                relay.data_received(chunk)
            relay.connection_lost(None)
        return [record.getMessage().split(": ", 1)[1] for record in caplog.records]

    cut = "x" * LOG_LINE_BYTES + " [line cut]"
    line = b"x" * 100_000 + b"\n"
    assert asyncio.run(relayed([line[:65536], line[65536:] + b"next\n"])) == [cut, "next"]
    assert asyncio.run(relayed([line + b"next"])) == [cut, "next"]  # one read: cut too
    assert asyncio.run(relayed([b"x" * 20_000])) == [cut]  # never ended
