"""The scheduler's links to its nodes (scheduler.node_links): what an attach that fails leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import WatchEvent
from gpufaas.types import GpuSpec
from gpufaas.wire import AnswerTooLarge, Connection, Frame, MessageType, Server
from scheduler import reconciler
from scheduler.adaptive_slots import AdaptiveSlots
from scheduler.calls import CallBook
from scheduler.catalog import Catalog
from scheduler.node_links import NodeLink, NodeLinks
from scheduler.persister import StatePersister
from tests.fakes import MemoryStore
from tests.unit.test_calls import make_book, make_spec


class FencingNode:
    """A node that has seen a newer leader's epoch: it refuses every Attach (and, as a node does,
    leaves closing the link to the scheduler)."""

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.ATTACH:
            conn.reply_error(frame, pb.FENCED, "a newer leader's epoch has been seen")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass


def make_links(
    book: CallBook,
    *,
    spawn: Callable[[Coroutine[Any, Any, None]], object] = lambda coroutine: None,
    fenced: Callable[[], object] = lambda: None,
    prestage_nodes: int = 0,
) -> NodeLinks:
    """Links of a book's scheduler to nodes that fence (FencingNode), plain TCP, nothing applied."""
    return NodeLinks(
        book.scheduler,
        book,
        StatePersister(MemoryStore(), Keys("/t"), book.scheduler, book, lambda: 0.0),
        functions={},
        apply=lambda effects: None,
        spawn=spawn,  # type: ignore[arg-type]
        session_for=lambda node: FencingNode(),
        slots_for=lambda gpu_type: 1,
        clock=lambda: 0.0,
        wire_key=None,
        prestage_nodes=prestage_nodes,
        fenced=fenced,  # type: ignore[arg-type]
        tls=False,
    )


def test_an_attach_refused_as_fenced_leaves_no_connection_open() -> None:
    # The scheduler dropped its end of a refused attach without closing it: one link per node per
    # fenced term stayed open at the node for good.
    async def scenario() -> None:
        server = Server(FencingNode, tls=False)
        address = await server.start("127.0.0.1:0")
        tasks: set[asyncio.Future[Any]] = set()
        book = make_book(gpus=())
        fenced: list[int] = []
        links = make_links(
            book,
            spawn=lambda coroutine: tasks.add(asyncio.ensure_future(coroutine)),
            fenced=lambda: (fenced.append(1), links.deactivate()),  # type: ignore[func-returns-value]
        )
        links.seen(NodeRecord("n1", address, "cpu", "i1", []))
        try:
            for _ in range(3):
                links.activate("sched-a", b"k" * 32, epoch=1)
                await asyncio.sleep(0.3)
            await asyncio.sleep(0.3)
            open_at_node = [conn for conn in server.connections if not conn.is_closed]
            assert len(fenced) == 3
            assert not open_at_node, f"{len(open_at_node)} refused attach link(s) left open at the node"
        finally:
            for task in tasks:
                task.cancel()
            await server.close()

    asyncio.run(scenario())


class _AnswersTooLarge:
    """A node link whose every request fails as an answer over the scheduler's limit."""

    is_closed = False

    async def request(self, *args: Any, **kwargs: Any) -> Frame:
        raise AnswerTooLarge("an answer of 99999999 bytes is over this end's limit of 1000 bytes; it was not read")


def test_a_node_whose_workers_list_is_over_the_limit_says_so_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Such an answer cut the link before (the node detached and attached again, which showed); now
    # the link stays, and the reconciler would pass the node over on every round without a word.
    monkeypatch.setattr(reconciler, "RECONCILE_S", 0.0)
    book = make_book(gpus=())
    links = make_links(book)
    conn: Any = _AnswersTooLarge()  # (a Connection's `request` alone)
    links.nodes["n1"] = NodeLink(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1"), conn=conn, gpu_ids=["n1/0"])

    async def scenario() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(links.reconciler(), 0.05)

    with caplog.at_level(logging.WARNING, logger="gpufaas.scheduler"):
        asyncio.run(scenario())
    assert "node n1: its list of workers is not reconciled" in caplog.text


def test_a_node_that_leaves_before_it_attaches_loses_the_keys_the_last_term_left() -> None:
    # Registered at take-office, so recovery kept its GPUs' keys; it left before attaching: only
    # attached GPUs were told to the persister, and its keys stayed in etcd for the whole term.
    async def scenario() -> None:
        book = make_book(gpus=())
        spawned: list[Coroutine[Any, Any, None]] = []
        links = make_links(book, spawn=spawned.append)
        persister, keys = links.persister, Keys("/t")
        await persister.store.put(keys.gpu_lru("n1", "gpu0"), b'[{"model": "m", "memory_mb": 1}]')
        await persister.store.put(keys.gpu_status("n1", "gpu0"), b"{}")
        links.seen(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")]))
        assert await persister.recover(links.registered_gpu_ids()) == {"n1/gpu0": ["m"]}
        links.activate("sched-a", b"k" * 32, epoch=1)
        for coroutine in spawned:
            coroutine.close()  # (no attach: it leaves first)
        links.gone("n1")
        await persister.flush()
        assert await persister.store.get_prefix(keys.gpus) == []

    asyncio.run(scenario())


def test_a_gpu_attaches_within_adaptive_ds_bound() -> None:
    # Configured at D 4 (`--slots`) under `--adaptive-slots 2`: the GPU joins at 2, so the calls
    # placed at the attach stay within the bound. (It joined at 4 until the sampler's next look.)
    book = make_book(gpus=())
    book.adaptive_slots = AdaptiveSlots(2)
    links = make_links(book, spawn=lambda coroutine: coroutine.close())  # (no pre-staging here)
    links.slots_for = lambda gpu_type: 4
    node = NodeLink(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")]))
    links._attach(node, pb.AttachReply())
    assert [gpu.spec.slots for gpu in book.scheduler.gpus()] == [2]


class _Node:
    """A node's end of the scheduler's links, shared by all of them (`handler` serves each)."""

    def handler(self) -> _Node:
        return self

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.ATTACH:
            self.attach(conn, frame)

    def attach(self, conn: Connection, frame: Frame) -> None:
        conn.reply(frame, MessageType.ATTACH_REPLY, pb.AttachReply(node="n1", incarnation="i1"))

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass


@contextlib.asynccontextmanager
async def linked_to(node: _Node, fenced: Callable[[], object] = lambda: None) -> AsyncIterator[NodeLinks]:
    """Links (`make_links`, their tasks run) to "n1" (incarnation i1, one GPU) served by `node`;
    everything stopped after."""
    server = Server(node.handler, tls=False)
    address = await server.start("127.0.0.1:0")
    tasks: set[asyncio.Future[Any]] = set()
    links = make_links(
        make_book(gpus=()), spawn=lambda coroutine: tasks.add(asyncio.ensure_future(coroutine)), fenced=fenced
    )
    links.seen(NodeRecord("n1", address, "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")]))
    try:
        yield links
    finally:
        links.deactivate()
        for task in tasks:
            task.cancel()
        await server.close()


class _OneSchedulerNode(_Node):
    """A node as gpu_manager's `admit_scheduler` keeps it: one scheduler link at a time, the
    link of the latest Attach; the one it replaces is closed."""

    def __init__(self) -> None:
        self.current: Connection | None = None

    def attach(self, conn: Connection, frame: Frame) -> None:
        if self.current is not None and self.current is not conn:
            self.current.close()
        self.current = conn
        super().attach(conn, frame)


def test_a_dial_that_ends_after_its_term_does_not_attach_over_the_next_terms_link() -> None:
    # A term's dial to a slow node finished after the next term had attached the node: it still
    # sent its Attach, the node took that link for the scheduler's and closed the new term's, and
    # the node was taken out (its placed calls stranded) only to attach again.
    async def scenario() -> None:
        async with linked_to(_OneSchedulerNode()) as links:
            slow_dial_may_end = asyncio.Event()
            dials = 0
            real_dial = links._dial

            async def dial(address: str, session: Any) -> Connection:
                nonlocal dials
                dials += 1
                if dials == 1:  # the first term's dial: slow
                    await slow_dial_may_end.wait()
                return await real_dial(address, session)

            links._dial = dial  # type: ignore[method-assign]
            links.activate("sched-a", b"k" * 32, epoch=1)
            await asyncio.sleep(0.05)
            links.deactivate()
            links.activate("sched-a", b"l" * 32, epoch=2)
            while not links.nodes["n1"].gpu_ids:
                await asyncio.sleep(0.01)
            attached = links.nodes["n1"].conn
            slow_dial_may_end.set()
            await asyncio.sleep(0.3)
            assert attached is not None and not attached.is_closed, "the next term's link was closed"
            assert links.nodes["n1"].gpu_ids == ["n1/gpu0"]

    asyncio.run(scenario())


def catalog_and_links() -> tuple[NodeLinks, Catalog, Keys]:
    """A catalog handing node records to links (`make_links`) that attach none, and its keys."""
    book = make_book(gpus=())
    links = make_links(book, spawn=lambda coroutine: coroutine.close())
    keys = Keys("/t")
    return (
        links,
        Catalog(MemoryStore(), keys, book.scheduler, book, links, functions={}, apply=lambda effects: None),
        keys,
    )


def test_a_node_record_under_another_nodes_key_is_ignored_and_its_gpus_never_stay() -> None:
    # A record naming node "b" put under node "a"'s key was linked as "b": deleting the key then
    # took out "a" (nobody), so "b"'s link, and its GPUs once attached, stayed for good; a re-list
    # took "b" out and the next watch event put it back.
    links, catalog, keys = catalog_and_links()
    record = NodeRecord("b", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")])
    catalog.node_changed(WatchEvent("put", keys.node("a"), record.to_json(), 1))
    catalog.node_changed(WatchEvent("delete", keys.node("a"), b"", 2))
    assert list(links.nodes) == []


def test_a_node_record_that_names_a_gpu_twice_is_ignored() -> None:
    # Linked, its attach raised at the second GPU ("already registered") and ended the node's
    # keep-attached loop unseen: the first GPU stayed in the scheduler, its link never watched,
    # so calls went on being placed there after the node was gone.
    links, catalog, keys = catalog_and_links()
    record = NodeRecord(
        "a", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu"), GpuRecord("gpu0", 8000, "cpu")]
    )
    catalog.node_changed(WatchEvent("put", keys.node("a"), record.to_json(), 1))
    assert list(links.nodes) == []


class _RefusingNode(_Node):
    """A node that answers every Attach with an error other than FENCED (here: the scheduler's
    certificate names another role)."""

    def attach(self, conn: Connection, frame: Frame) -> None:
        conn.reply_error(frame, pb.UNAUTHENTICATED, "only the scheduler sends message type 3")


def test_a_node_that_answers_the_attach_with_an_error_says_so_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    # Such a node is never attached; its error was logged at DEBUG only, so an operator saw its
    # GPUs missing and nothing that said why.
    async def scenario() -> None:
        async with linked_to(_RefusingNode()) as links:
            links.activate("sched-a", b"k" * 32, epoch=1)
            await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING, logger="gpufaas.scheduler"):
        asyncio.run(scenario())
    assert "only the scheduler sends message type 3" in caplog.text


class _LateRefusalNode(_Node):
    """A node whose answer to the first Attach comes late, as FENCED (it has seen a newer epoch
    than that Attach's since); it takes the later ones."""

    def __init__(self) -> None:
        self.attaches = 0

    def attach(self, conn: Connection, frame: Frame) -> None:
        self.attaches += 1
        if self.attaches > 1:
            super().attach(conn, frame)
        else:
            asyncio.get_running_loop().call_later(0.1, conn.reply_error, frame, pb.FENCED, "epoch 2 has been seen")


def test_a_refusal_answered_after_its_term_does_not_depose_the_next_term() -> None:
    # A term's Attach refused as FENCED after that term had ended told the scheduler to step
    # down: the next term, of a newer epoch that the node took, was deposed for it.
    async def scenario() -> None:
        node, fenced = _LateRefusalNode(), []
        async with linked_to(node, fenced=lambda: fenced.append(1)) as links:
            links.activate("sched-a", b"k" * 32, epoch=1)
            while not node.attaches:
                await asyncio.sleep(0.01)
            links.deactivate()
            links.activate("sched-a", b"l" * 32, epoch=3)
            await asyncio.sleep(0.3)
            assert fenced == []
            assert links.nodes["n1"].gpu_ids == ["n1/gpu0"]

    asyncio.run(scenario())


class _Answers:
    """A node link whose every WORKERS request is answered with `header` (an AttachReply's bytes),
    counted in `asked`; one that `blocks` never answers (until cancelled)."""

    is_closed = False

    def __init__(self, header: bytes = b"", *, blocks: bool = False) -> None:
        self.header, self.blocks, self.asked = header, blocks, 0

    async def request(self, *args: Any, **kwargs: Any) -> Frame:
        self.asked += 1
        if self.blocks:
            await asyncio.Event().wait()
        return Frame(MessageType.ATTACH_REPLY, 0, 1, self.header, b"")


def reconciled_links(*answers: _Answers) -> NodeLinks:
    """Links (`make_links`) to nodes n1, n2, ... of one attached GPU each ("nK/g0"), on `answers`."""
    names = [f"n{i}" for i in range(1, len(answers) + 1)]
    links = make_links(make_book(gpus=tuple(f"{name}/g0" for name in names)))
    for name, conn in zip(names, answers, strict=True):
        record = NodeRecord(name, "127.0.0.1:1", "cpu", "i1", [GpuRecord("g0", 8000, "cpu")])
        links.nodes[name] = NodeLink(record, conn=conn, gpu_ids=[f"{name}/g0"])  # type: ignore[arg-type]
    return links


async def reconcile_until(links: NodeLinks, done: Callable[[], bool], *, turns: int = 1000) -> None:
    """Run the reconciler until `done` (checked at each of at most `turns` turns of the event
    loop), then stop it; it fails if the reconciler ended."""
    task = asyncio.ensure_future(links.reconciler())
    try:
        for _ in range(turns):
            if done() or task.done():
                break
            await asyncio.sleep(0)
        assert not task.done(), f"the reconciler ended: {task.exception()!r}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_a_malformed_workers_reply_does_not_end_the_reconciler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Its decoding raised out of the reconciler: the loop ended for the whole term ("Task
    # exception was never retrieved" at most), and no node was reconciled again.
    monkeypatch.setattr(reconciler, "RECONCILE_S", 0.0)
    malformed, fine = _Answers(b"\xff\xff"), _Answers(pb.AttachReply().SerializeToString())
    links = reconciled_links(malformed, fine)
    with caplog.at_level(logging.WARNING, logger="gpufaas.scheduler"):
        asyncio.run(reconcile_until(links, lambda: malformed.asked >= 3 and fine.asked >= 3))
    assert malformed.asked >= 3 and fine.asked >= 3
    assert "node n1: cannot reconcile its workers" in caplog.text


def test_a_node_that_does_not_answer_holds_up_no_other_nodes_reconcile(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nodes were asked one after another, each for up to 2 s: with 5 of 50 not answering, every
    # round took 10 s and more before the nodes after them were reconciled.
    monkeypatch.setattr(reconciler, "RECONCILE_S", 0.0)
    silent, fine = _Answers(blocks=True), _Answers(pb.AttachReply().SerializeToString())
    links = reconciled_links(silent, silent, fine)
    asyncio.run(reconcile_until(links, lambda: fine.asked >= 1))
    assert fine.asked == 1


def test_the_reconciler_asks_at_most_its_bound_of_nodes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconciler, "RECONCILE_S", 0.0)
    monkeypatch.setattr(reconciler, "RECONCILE_CONCURRENCY", 2)
    silent = [_Answers(blocks=True) for _ in range(3)]
    links = reconciled_links(*silent)
    asyncio.run(reconcile_until(links, lambda: False, turns=200))
    assert [node.asked for node in silent] == [1, 1, 0]  # (the third waits for one of them)


class _NodeThatReportsAtOnce(_Node):
    """A node whose holdings change just after it answers an Attach or WORKERS (with "old"): its
    Holdings frame ("new") follows the answer on the link, so both arrive in one read."""

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type in (MessageType.ATTACH, MessageType.WORKERS):
            answer = pb.AttachReply(node="n1", incarnation="i1", holdings=pb.Holdings(staged=["old"]))
            conn.reply(frame, MessageType.ATTACH_REPLY, answer)
            conn.send(MessageType.HOLDINGS, pb.Holdings(staged=["new"]))


class _TakesHoldings:
    """The scheduler's end of a node's link, as scheduler.sessions.NodeSession takes Holdings."""

    def __init__(self, links: NodeLinks, node: NodeLink) -> None:
        self.links, self.node = links, node

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.HOLDINGS:
            self.links.holdings_reported(self.node, frame.message(pb.Holdings))

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass


def test_holdings_reported_with_an_answer_do_not_undo_a_later_report() -> None:
    # The Holdings frame that came in the same read as the AttachReply (or a WORKERS answer) was
    # taken first; the attach (or reconcile) then overwrote it with the answer's older holdings,
    # until the next reconcile.
    async def scenario() -> None:
        async with linked_to(_NodeThatReportsAtOnce()) as links:
            links.session_for = lambda node: _TakesHoldings(links, node)
            links.activate("sched-a", b"k" * 32, epoch=1)
            node = links.nodes["n1"]
            while not node.gpu_ids:
                await asyncio.sleep(0.01)
            assert node.holdings is not None and list(node.holdings.staged) == ["new"], "after the attach"
            assert node.conn is not None
            await reconciler.reconcile_node(links, node, node.conn)
            assert list(node.holdings.staged) == ["new"], "after a reconcile"

    asyncio.run(scenario())


def test_a_node_record_that_moves_the_same_incarnation_keeps_its_gpus_and_links_at_the_new_address() -> None:
    # A running GPU manager never changes its record (gpu_manager.daemon registers the same one
    # under every lease); one edited to another address under the same incarnation was taken for a
    # restart: the node's GPUs taken out, its placed calls stranded though it still ran them.
    async def scenario() -> None:
        async with linked_to(_Node()) as links:
            links.activate("sched-a", b"k" * 32, epoch=1)
            node = links.nodes["n1"]
            while not node.gpu_ids:
                await asyncio.sleep(0.01)
            attached = node.conn
            moved_to = Server(_Node().handler, tls=False)
            address = await moved_to.start("127.0.0.1:0")
            try:
                links.seen(dataclasses.replace(node.record, address=address))
                assert links.nodes["n1"] is node and node.gpu_ids == ["n1/gpu0"] and node.conn is attached
                assert node.record.address == address
                assert attached is not None
                attached.close()  # (its next connection goes to the new address)
                while not moved_to.connections or not node.gpu_ids:
                    await asyncio.sleep(0.01)
            finally:
                await moved_to.close()

    asyncio.run(scenario())


def test_a_node_record_changed_under_the_same_incarnation_is_not_logged_as_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    links = make_links(make_book(gpus=()))
    links.seen(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")]))
    with caplog.at_level(logging.INFO, logger="gpufaas.scheduler"):
        links.seen(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 4000, "cpu")]))
    assert "re-registered" not in caplog.text
    assert "node n1's record changed under the same incarnation i1" in caplog.text
    assert links.nodes["n1"].record.gpus[0].memory_mb == 4000


class _StageRequests:
    """A node link that records the packages each STAGE request asks its node for."""

    is_closed = False

    def __init__(self, node: str, asked: dict[str, list[str]]) -> None:
        self.node, self.asked = node, asked

    async def request(self, kind: MessageType, message: Any, **kwargs: Any) -> None:
        assert kind == MessageType.STAGE
        self.asked[self.node] = list(message.packages)


def test_prestaging_books_each_expected_miss_on_a_gpu_the_model_fits() -> None:
    # The planner took the room of a function's expected miss from the node's GPU with the most
    # free memory, an a100 the t4-only function never runs on: the t4 it would load on kept its
    # room, and the next t4 function was sent to the same node instead of the one with room.
    book = make_book(gpus=())
    spawned: list[Coroutine[Any, Any, None]] = []
    links = make_links(book, spawn=spawned.append, prestage_nodes=1)
    asked: dict[str, list[str]] = {}
    for node, t4_mb in (("n1", 16000), ("n2", 15000)):
        gpus = [GpuSpec(f"{node}/t4", t4_mb, "t4", node=node), GpuSpec(f"{node}/a100", 40000, "a100", node=node)]
        for gpu in gpus:
            book.scheduler.add_gpu(gpu)
        conn: Any = _StageRequests(node, asked)
        record = NodeRecord(node, "127.0.0.1:1", "cpu", "i1")
        links.nodes[node] = NodeLink(record, conn=conn, gpu_ids=[g.gpu_id for g in gpus], holdings=pb.Holdings())
    first, second = (
        FunctionSpec(name=spec.name, package_digest=spec.package_digest, memory_mb=10000, gpu="t4")
        for spec in (make_spec("fn-first"), make_spec("fn-second"))
    )
    links.prestage([first, second])

    async def run_spawned() -> None:
        await asyncio.gather(*spawned)

    asyncio.run(run_spawned())
    assert asked == {"n1": [first.package_digest], "n2": [second.package_digest]}


def test_a_node_record_whose_name_holds_a_slash_is_ignored() -> None:
    # Put by hand under "nodes/a/b", it was linked as node "a/b": its GPUs' addresses
    # ("a/b/gpu0") split as node "a", GPU "b/gpu0", so a call placed there raised KeyError out of
    # the placement (no node "a"), and its persisted keys could not be built.
    links, catalog, keys = catalog_and_links()
    record = NodeRecord("a/b", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")])
    catalog.node_changed(WatchEvent("put", keys.nodes + "a/b", record.to_json(), 1))
    assert list(links.nodes) == []


def test_a_node_record_with_a_name_no_utf8_holds_is_ignored() -> None:
    # JSON's "\ud800" (a lone surrogate) decodes to a str that UTF-8 cannot encode: linked, its
    # GPU's keys raised UnicodeEncodeError out of the state persister's flush (not a StoreError),
    # which ended the flusher for the term, and a Grant naming the GPU could not be encoded.
    links, catalog, keys = catalog_and_links()
    value = NodeRecord("a", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")]).to_json()
    catalog.node_changed(WatchEvent("put", keys.node("a"), value.replace(b"gpu0", b"gpu\\ud800"), 1))
    assert list(links.nodes) == []
