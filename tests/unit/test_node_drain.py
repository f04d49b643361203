"""A node's graceful stop: its decision (gpu_manager.drain, manual clock), the first and second
signal (gpufaas.service_main), and the leader's side (scheduler.node_drain)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from gpu_manager.daemon import GpuManagerDaemon
from gpu_manager.drain import NodeDrain, drain
from gpu_manager.ledger import GrantLedger
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.service_main import run_until_signalled
from gpufaas.store import StoreError
from gpufaas.wire import Connection, Frame, MessageType
from scheduler.node_drain import none_to_attach, same_manager
from scheduler.service import SchedulerService
from tests.fakes import MemoryStore
from tests.unit.test_calls import A
from tests.unit.test_node_links import _Node, linked_to

# --- the node's decision ------------------------------------------------------------------------


def test_a_node_not_draining_never_stops_on_its_own() -> None:
    assert NodeDrain().verdict(1e9, "s1") is None


def attached() -> NodeDrain:
    """A node's drain state with a scheduler attached."""
    state = NodeDrain()
    state.attached = True
    return state


def test_a_drained_node_waits_for_its_calls_and_the_schedulers_word() -> None:
    state = attached()
    state.running = 2
    state.start(100.0, 30.0)
    assert state.draining and state.verdict(101.0, "s1") is None  # calls run, no word yet
    state.revoked(pb.Revoke(if_idle=True), "s1")  # an ordinary Revoke says nothing of the drain
    state.running = 0
    assert state.verdict(102.0, "s1") is None  # idle, but a grant may still be presented
    state.revoked(pb.Revoke(drained=True), "s1")
    assert state.verdict(102.0, "s1") == "drained"


def test_a_word_from_a_scheduler_no_longer_attached_does_not_count() -> None:
    state = attached()
    state.start(0.0, 30.0)
    state.revoked(pb.Revoke(drained=True), "s1")
    assert state.verdict(1.0, "s2") is None  # s2 attached since: its grants may come still
    state.revoked(pb.Revoke(drained=True), "s2")
    assert state.verdict(1.0, "s2") == "drained"


def test_the_drain_timeout_stops_a_node_whose_calls_still_run() -> None:
    state = attached()
    state.running = 1
    state.revoked(pb.Revoke(drained=True), "s1")
    state.start(10.0, 5.0)
    assert state.verdict(14.999, "s1") is None
    assert state.verdict(15.0, "s1") == "timed out"


def test_a_node_with_no_scheduler_attached_stops_once_its_calls_end() -> None:
    # None is there to acknowledge the drain (the schedulers stopped first: `gpufaas down`,
    # `docker compose down`), and none can place more here: waiting out the timeout gains nothing.
    state = NodeDrain()
    state.running = 1
    state.start(0.0, 30.0)
    assert state.verdict(1.0, "s1") is None  # its call runs
    state.running = 0
    assert state.verdict(1.0, "s1") == "no scheduler attached"
    state.attached = True  # one attaches: it is waited for
    assert state.verdict(1.0, "s1") is None


def test_an_execute_counts_as_running_until_its_done_is_sent() -> None:
    # The Done goes out on a callback the Execute's handling schedules as it ends (daemon._ran):
    # the node must not count itself idle, and stop, before that callback ran.
    async def scenario() -> None:
        state = NodeDrain()
        release = asyncio.Event()
        seen_by_done: list[int] = []

        async def execute() -> None:
            await release.wait()
            asyncio.get_running_loop().call_soon(lambda: seen_by_done.append(state.running))

        task = asyncio.ensure_future(state.tracked(execute()))
        await asyncio.sleep(0)
        assert state.running == 1
        state.start(0.0, 30.0)
        release.set()
        await task
        await asyncio.sleep(0)
        assert seen_by_done == [1]
        assert (state.running, state.ran) == (0, 1)

    asyncio.run(scenario())


def test_an_execute_counts_as_running_from_the_moment_its_frame_is_taken() -> None:
    # Its handling runs as a task: counted only once that task began, a drain that looked in
    # between found nothing running and stopped the node, cancelling the call it had just taken.
    async def scenario() -> None:
        state = NodeDrain()
        state.start(0.0, 30.0)
        release = asyncio.Event()
        task = asyncio.ensure_future(state.tracked(release.wait()))  # (its task has not run yet)
        assert state.running == 1 and state.verdict(1.0, "s1") is None
        release.set()
        await task
        await asyncio.sleep(0)
        assert (state.running, state.verdict(1.0, "s1")) == (0, "no scheduler attached")

    asyncio.run(scenario())


# --- the drain's loop, with a node that has only what it reads -----------------------------------


@dataclass
class _FakeNode:
    node: str = "n1"
    drain: NodeDrain = field(default_factory=attached)
    ledger: GrantLedger = field(default_factory=lambda: GrantLedger("n1", frozenset({"gpu0"}), scheduler_id="s1"))
    registered: list[bool] = field(default_factory=list)

    async def register_now(self) -> None:
        self.registered.append(self.drain.draining)


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.5  # each look advances it: the loop meets its timeout without real waiting
        return self.now_s


def _drain(node: _FakeNode, timeout_s: float, clock: _Clock) -> None:
    asyncio.run(drain(cast(GpuManagerDaemon, node), timeout_s, clock=clock))


def test_a_drain_marks_the_record_ends_leases_and_stops_once_drained(caplog: pytest.LogCaptureFixture) -> None:
    node = _FakeNode()
    node.drain.revoked(pb.Revoke(drained=True), "s1")
    with caplog.at_level(logging.INFO, logger="gpufaas.gpu_manager"):
        _drain(node, 30.0, _Clock())
    assert node.registered == [True]  # its record put again, saying it drains
    assert "node n1 draining: 0 call(s) running" in caplog.text
    assert "node n1 drain ended (drained)" in caplog.text


def test_a_drain_that_gets_no_word_ends_at_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    node = _FakeNode()
    clock = _Clock()
    with caplog.at_level(logging.INFO, logger="gpufaas.gpu_manager"):
        _drain(node, 3.0, clock)
    assert "drain ended (timed out)" in caplog.text
    assert clock.now_s < 10.0


def test_a_drain_timeout_of_0_stops_at_once() -> None:
    node = _FakeNode()
    _drain(node, 0.0, _Clock())
    assert not node.drain.draining and node.registered == []


# --- the signals ---------------------------------------------------------------------------------


def _signal_soon(after_s: float) -> None:
    asyncio.get_running_loop().call_later(after_s, os.kill, os.getpid(), signal.SIGTERM)


def test_the_first_signal_drains_and_a_second_stops_at_once(caplog: pytest.LogCaptureFixture) -> None:
    steps: list[str] = []

    async def start() -> None:
        steps.append("start")
        _signal_soon(0.01)

    async def drain_forever() -> None:
        steps.append("drain")
        _signal_soon(0.01)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            steps.append("drain cancelled")
            raise

    async def stop() -> None:
        steps.append("stop")

    with caplog.at_level(logging.WARNING):
        asyncio.run(run_until_signalled(start, stop, drain_forever))
    assert steps == ["start", "drain", "drain cancelled", "stop"]
    assert "a second signal: stopping at once" in caplog.text


def test_a_drain_that_ends_stops_the_daemon() -> None:
    steps: list[str] = []

    async def start() -> None:
        _signal_soon(0.01)

    async def quick_drain() -> None:
        steps.append("drained")

    async def stop() -> None:
        steps.append("stop")

    asyncio.run(run_until_signalled(start, stop, quick_drain))
    assert steps == ["drained", "stop"]


# --- the leader's side ---------------------------------------------------------------------------


def test_a_record_that_begins_to_drain_is_the_same_manager() -> None:
    record = NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")])
    assert same_manager(record, dataclasses.replace(record, draining=True))
    assert not same_manager(record, dataclasses.replace(record, draining=True, gpus=[]))
    assert NodeRecord.from_json(dataclasses.replace(record, draining=True).to_json()).draining
    assert not NodeRecord.from_json(record.to_json()).draining
    with pytest.raises(ValueError, match="draining"):
        NodeRecord.from_json(record.to_json().replace(b'"draining": false', b'"draining": "yes"'))


class _DrainingNode(_Node):
    """A node that answers Revokes, saying it saw every grant, and keeps them."""

    def __init__(self) -> None:
        self.revokes: list[pb.Revoke] = []

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.REVOKE:
            request = frame.message(pb.Revoke)
            self.revokes.append(request)
            conn.reply(frame, MessageType.REVOKE_REPLY, pb.RevokeReply(seen=request.grants))
        else:
            super().on_frame(conn, frame)


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0.01)


def test_the_leader_takes_a_draining_nodes_gpus_out_keeps_its_link_and_lists_its_grants() -> None:
    async def scenario() -> None:
        node_end = _DrainingNode()
        async with linked_to(node_end) as links:
            links.activate("sched-a", b"k" * 32, epoch=1)
            node = links.nodes["n1"]
            await _until(lambda: node.gpu_ids)
            links.book.submit("gw1", "c1", A, 10.0, now=0.0)
            assert links.book.placed_on("n1") == [("c1", 1)]
            linked = node.conn
            links.seen(dataclasses.replace(node.record, draining=True))
            await _until(lambda: node_end.revokes)
            assert node.gpu_ids == [] and not list(links.book.scheduler.gpus())  # nothing new goes there
            assert node.conn is linked and linked is not None and not linked.is_closed  # (for the Dones)
            (revoke,) = node_end.revokes
            assert revoke.drained and [(g.call_id, g.attempt) for g in revoke.grants] == [("c1", 1)]
            assert revoke.claim_by_unix_s > 0
            links.seen(node.record)  # the same record again: told once
            await asyncio.sleep(0.05)
            assert len(node_end.revokes) == 1

    asyncio.run(scenario())


def test_a_new_leader_attaches_a_draining_node_without_its_gpus_and_tells_it() -> None:
    async def scenario() -> None:
        node_end = _DrainingNode()
        async with linked_to(node_end) as links:
            node = links.nodes["n1"]
            links.seen(dataclasses.replace(node.record, draining=True))  # seen before its term began
            node = links.nodes["n1"]
            links.activate("sched-b", b"k" * 32, epoch=2)
            await _until(lambda: node_end.revokes)
            assert node.gpu_ids == [] and node.conn is not None
            assert node_end.revokes[0].drained and not node_end.revokes[0].grants

    asyncio.run(scenario())


# --- the drain's record, where etcd does not take it at once -------------------------------------


@dataclass
class _EtcdDownNode(_FakeNode):
    """A node whose record's puts fail `failures` times (etcd down), or hang (`hang`: etcd that
    does not answer); the leader, once it sees the record, acknowledges the drain."""

    failures: int = 0
    hang: bool = False

    async def register_now(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.failures:
            self.failures -= 1
            raise StoreError("etcd is down")
        await super().register_now()
        self.drain.revoked(pb.Revoke(drained=True), "s1")  # the leader saw it: nothing more goes here


@pytest.fixture
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpu_manager.drain.DRAIN_POLL_S", 0.0)
    monkeypatch.setattr("gpu_manager.drain.RECORD_RETRY_S", 0.0)


@pytest.mark.usefixtures("no_waits")
def test_a_drain_whose_record_put_fails_puts_it_again(caplog: pytest.LogCaptureFixture) -> None:
    # Once only, the leader never learnt of the drain: it went on placing calls here, and the node
    # waited for its word until the timeout (cutting what ran then).
    node = _EtcdDownNode(failures=2)
    with caplog.at_level(logging.INFO, logger="gpufaas.gpu_manager"):
        _drain(node, 100.0, _Clock())
    assert node.registered == [True]
    assert "drain ended (drained)" in caplog.text
    assert caplog.text.count("cannot record its drain in etcd") == 1  # said once, not each try


@pytest.mark.usefixtures("no_waits")
def test_a_record_put_that_hangs_does_not_hold_the_drain_past_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    node = _EtcdDownNode(hang=True)

    async def scenario() -> None:
        async with asyncio.timeout(5):  # (a safety net: the drain's own clock ends it at once)
            await drain(cast(GpuManagerDaemon, node), 3.0, clock=_Clock())

    with caplog.at_level(logging.INFO, logger="gpufaas.gpu_manager"):
        asyncio.run(scenario())
    assert "drain ended (timed out)" in caplog.text


def test_a_new_term_does_not_wait_for_a_draining_node_to_add_its_gpus() -> None:
    # A draining node attaches without its GPUs: a new leader taking over during a drain waited
    # for them its whole ATTACH_WAIT_S (2 s) before taking any call. (Its clock stands still here:
    # that wait would never end; `asyncio.timeout` is a safety net only.)
    async def scenario() -> None:
        service = SchedulerService(MemoryStore(), keys=Keys("/t"), prestage_nodes=0, clock=lambda: 100.0)
        record = NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")], draining=True)
        service.links.seen(record)
        service.links.seen(dataclasses.replace(record, node="n2", draining=False))
        assert not none_to_attach(service.links)  # n2 is yet to attach: waited for
        service.links.nodes["n2"].gpu_ids.append("n2/gpu0")
        service.term.open = False  # as a term begins (take_office)
        async with asyncio.timeout(5):
            await service._open_when_attached()
        gc.unfreeze()  # (it froze the heap, as a new term does: not this test process's)
        assert service.term.open

    asyncio.run(scenario())
