"""The scheduler service's Place path on a MemoryStore (built, not started): what it tells the call
book about the nodes (a registered node not attached yet: calls wait for it rather than being
refused) and what it answers a gateway at once."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import GpuSpec
from gpufaas.wire import Connection, MessageType
from scheduler.service import SchedulerService
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
