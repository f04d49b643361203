"""The scheduler service's Place path on a MemoryStore (built, not started): what it tells the call
book about the nodes (a registered node not attached yet: calls wait for it rather than being
refused) and what it answers a gateway at once."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import GpuSpec
from gpufaas.wire import Connection, MessageType
from scheduler.service import SchedulerService
from scheduler.sessions import cluster_reply
from tests.builders import stored_spec
from tests.fakes import MemoryStore

SPEC = FunctionSpec(name="fn-a", package_digest="sha256:" + hashlib.sha256(b"fn-a").hexdigest(), memory_mb=1000)
NODE = NodeRecord("n1", "127.0.0.1:1", "cpu", "incarnation-1", [GpuRecord("g0", 8000, "cpu")])


class Gateway(Connection):
    """A gateway's connection that keeps what the scheduler sends it."""

    def __init__(self) -> None:
        super().__init__(None)
        self.sent: list[tuple[int, Any]] = []

    def send(self, type_: int, header: Any, body: bytes = b"") -> None:
        self.sent.append((type_, header))


def run(scenario: Callable[[SchedulerService, Gateway], Awaitable[None]]) -> None:
    async def main() -> None:
        service = SchedulerService(MemoryStore(), keys=Keys("/t"), prestage_nodes=0)
        service.catalog.learn_function(stored_spec(service.keys, SPEC))
        await scenario(service, Gateway())

    asyncio.run(main())


def place(service: SchedulerService, gateway: Gateway, call_id: str) -> None:
    service.place(gateway, pb.Place(call_id=call_id, function=SPEC.name, timeout_s=30.0))


def test_a_call_waits_while_a_registered_node_is_not_attached_and_is_refused_when_none_is_registered() -> None:
    async def scenario(service: SchedulerService, gateway: Gateway) -> None:
        place(service, gateway, "c1")
        ((type_, rejection),) = gateway.sent
        assert type_ == MessageType.REJECTION and rejection.status == pb.UNAVAILABLE
        assert "no GPU manager is registered" in rejection.message
        assert len(service.book) == 0

        service.links.seen(NODE)  # registered, not attached (no term: nothing attaches)
        assert not service.links.all_attached()
        place(service, gateway, "c2")
        assert len(gateway.sent) == 1, "a call is not refused while a registered node attaches"
        assert len(service.book) == 1

        # The node attaches: its GPU enters the scheduler and the waiting call is placed there.
        service.scheduler.add_gpu(GpuSpec("n1/g0", 8000, "cpu", node="n1"))
        service.links.nodes["n1"].gpu_ids.append("n1/g0")
        assert service.links.all_attached()
        (assignment,) = service.book.schedule(service.clock())
        assert (assignment.call_id, assignment.gpu_id) == ("c2", "n1/g0")  # type: ignore[union-attr]

    run(scenario)


NODE_2 = NodeRecord("n2", "127.0.0.1:2", "cpu", "incarnation-1", [GpuRecord("g0", 8000, "cpu")])


@pytest.mark.parametrize("leaves", ["unregistered", "detached"])
def test_a_placement_held_while_unsure_whose_node_left_is_placed_again(leaves: str) -> None:
    # An unsure leader holds what it decides. A node that leaves meanwhile strands the held
    # placement's call; once sure again, the placement must not be sent (its GPU is gone: sending
    # it raised, and the leader gave up its term), and the call is placed again on a node left.
    async def main() -> None:
        now = [100.0]
        service = SchedulerService(MemoryStore(), keys=Keys("/t"), prestage_nodes=0, clock=lambda: now[0])
        service.catalog.learn_function(stored_spec(service.keys, SPEC))
        for record in (NODE, NODE_2):
            service.links.seen(record)
            service.scheduler.add_gpu(GpuSpec(f"{record.node}/g0", 8000, "cpu", node=record.node))
            service.links.nodes[record.node].gpu_ids.append(f"{record.node}/g0")
        service.leadership.won(7, 1, sent_at=now[0])
        now[0] += 1.5  # a keep-alive late: unsure
        gateway = Gateway()
        service.place(gateway, pb.Place(call_id="c1", function=SPEC.name, timeout_s=30.0))
        assert gateway.sent == [] and len(service.term.held) == 1
        (held,) = service.term.held
        leaving = service.links.nodes[held.gpu_id.split("/")[0]]
        if leaves == "unregistered":
            service.links.gone(leaving.record.node)
        else:
            service.links.detach(leaving)
        service.leadership.renewed(now[0])
        service.confirmed()
        placements = [m for t, m in gateway.sent if t == MessageType.PLACEMENT]
        assert [(p.call_id, p.attempt) for p in placements] == [("c1", held.attempt + 1)]
        assert placements[0].node != leaving.record.node

    asyncio.run(main())


def test_a_summary_of_the_cluster_lists_neither_gpus_nor_queue() -> None:
    # What a readiness probe asks for: the full answer costs O(GPUs + calls queued) of the loop.
    async def scenario(service: SchedulerService, gateway: Gateway) -> None:
        service.links.seen(NODE)
        service.scheduler.add_gpu(GpuSpec("n1/g0", 8000, "cpu", node="n1"))
        service.links.nodes["n1"].gpu_ids.append("n1/g0")
        full, summary = cluster_reply(service), cluster_reply(service, pb.ClusterRequest(summary=True))
        assert [g.gpu for g in full.gpus] == ["n1/g0"] and not summary.gpus and not summary.queue
        assert (summary.scheduler, summary.policy) == (full.scheduler, full.policy)

    run(scenario)


def test_a_cluster_answer_lists_as_many_queued_calls_as_asked_and_says_how_many_wait() -> None:
    # The dashboard's overview, polled every second, shows the 20 oldest: the whole queue (up to its
    # capacity) cost the scheduler's loop O(calls queued) at every poll.
    async def scenario(service: SchedulerService, gateway: Gateway) -> None:
        service.links.seen(NODE)
        service.scheduler.add_gpu(GpuSpec("n1/g0", 8000, "cpu", node="n1", slots=1))
        service.links.nodes["n1"].gpu_ids.append("n1/g0")
        for n in range(6):
            place(service, gateway, f"c{n}")
        waiting = [r.request_id for r in service.scheduler.queue]
        assert len(waiting) == 5, "one call runs on the GPU's one slot, five wait"
        some = cluster_reply(service, pb.ClusterRequest(queue_limit=2))
        assert [c.call_id for c in some.queue] == waiting[:2] and some.queue_length == 5
        every = cluster_reply(service, pb.ClusterRequest())
        assert [c.call_id for c in every.queue] == waiting and every.queue_length == 5

    run(scenario)
