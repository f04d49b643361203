"""Every failure between a placement and its execution, over a real cluster: a test client plays the
gateway (it speaks gpufaas.wire to the scheduler and the nodes) so that it can fail on purpose.

- a gateway that dies after a placement: the placement's slot is freed at once (not after the
  claim time), and a miss's model entry dropped;
- a node that never hears from the gateway: the grant is revoked at the node after the claim
  time and the call placed again; the old token is then refused;
- a token reused or forged: refused by the node, which runs nothing;
- a placement for a GPU that has since left: the scheduler notices the node is gone (its own
  connection to it breaks); the gateway, which could not send it the Execute, says so (Abandon
  REFUSED: never sent), and the call is placed on another node well before the node's lease
  expires;
- a node the gateway lost after sending it the Execute while the scheduler can reach it: the
  gateway's report (Abandon NODE_UNREACHABLE: it may run there) has the scheduler ask the node,
  which never saw the grant: revoked there, and the call placed elsewhere at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, ConnectionLost, Frame, MessageType, connect
from tests.integration.conftest import ClusterFactory, deploy

pytestmark = pytest.mark.integration

CLAIM_S = 2.0


class FakeGateway:
    """Speaks to the scheduler as a gateway does, collecting what it answers per call."""

    def __init__(self) -> None:
        self.messages: dict[str, list[pb.Placement | pb.Rejection]] = {}
        self.arrived = asyncio.Event()
        self.scheduler: Connection | None = None

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        message: pb.Placement | pb.Rejection
        if frame.type == MessageType.PLACEMENT:
            message = frame.message(pb.Placement)
        elif frame.type == MessageType.REJECTION:
            message = frame.message(pb.Rejection)
        else:
            return
        self.messages.setdefault(message.call_id, []).append(message)
        self.arrived.set()

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass

    async def open(self, cluster: LocalCluster) -> None:
        self.scheduler = await connect(cluster.scheduler_address, self, key=cluster.wire_key)

    @classmethod
    async def placing(cls, cluster: LocalCluster, call_id: str) -> tuple[FakeGateway, pb.Placement]:
        """A gateway linked to the cluster's scheduler that sent a Place of `call_id` (of sleepy):
        it, and the call's first placement."""
        gateway = cls()
        await gateway.open(cluster)
        gateway.place(call_id, "sleepy")
        return gateway, await gateway.placement(call_id)

    def place(self, call_id: str, function: str, timeout_s: float = 30.0, *, given_call_id: bool = False) -> None:
        assert self.scheduler is not None
        place = pb.Place(call_id=call_id, function=function, timeout_s=timeout_s, given_call_id=given_call_id)
        self.scheduler.send(MessageType.PLACE, place)

    def abandon(self, call_id: str, attempt: int, reason: int) -> None:
        assert self.scheduler is not None
        self.scheduler.send(MessageType.ABANDON, pb.Abandon(call_id=call_id, attempt=attempt, reason=reason))  # type: ignore[arg-type]

    async def placement(self, call_id: str, attempt: int = 1, timeout_s: float = 10.0) -> pb.Placement:
        """The call's placement number `attempt`, once it has come."""
        deadline = time.monotonic() + timeout_s
        while True:
            for message in self.messages.get(call_id, []):
                if isinstance(message, pb.Rejection):
                    raise AssertionError(f"call {call_id} was rejected: {message.message}")
                if message.attempt == attempt:
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no placement {attempt} for {call_id}; got {self.messages.get(call_id)}")
            self.arrived.clear()
            await asyncio.wait([asyncio.ensure_future(self.arrived.wait())], timeout=remaining)


async def execute(
    placement: pb.Placement, payload: bytes = b'{"sleep_s": 0}', *, token: bytes | None = None, key: bytes | None
) -> Any:
    """Send the payload to the placement's node as the gateway does; (ExecuteReply, body)."""
    conn = await connect(placement.node_address, key=key)
    try:
        frame = await conn.request(
            MessageType.EXECUTE,
            pb.Execute(token=placement.token if token is None else token, content_type="application/json"),
            payload,
            timeout_s=30,
        )
        return frame.message(pb.ExecuteReply), frame.body
    finally:
        conn.close()


async def placed_elsewhere(gateway: FakeGateway, cluster: LocalCluster, first: pb.Placement, reason: int) -> float:
    """Abandon `first` for `reason`; the call's second placement must be on another node and run
    there. The seconds from the Abandon to that placement."""
    started = time.monotonic()
    gateway.abandon(first.call_id, first.attempt, reason)
    second = await gateway.placement(first.call_id, attempt=2, timeout_s=10)
    waited = time.monotonic() - started
    assert second.node != first.node
    reply, _ = await execute(second, key=cluster.wire_key)
    assert reply.outcome == pb.OK, reply.message
    return waited


def gpus(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    return {
        g["gpu"]: g for g in httpx.get(f"{cluster.gateway_url}/system/gpus", timeout=10, auth=cluster.admin_auth).json()
    }


async def eventually(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `predicate` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not await asyncio.to_thread(predicate):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not reached within {timeout_s:g} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def cluster(make_cluster: ClusterFactory, tmp_path: Path) -> LocalCluster:
    # One call per GPU, so that an occupied slot is visible; a short claim time.
    cluster = make_cluster(nodes=2, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, slots="1", claim_s=CLAIM_S)
    deploy(cluster, "sleepy", "sleepy_function", tmp_path, memory_mb=100)
    return cluster


@pytest.mark.anyio
async def test_a_gateway_dying_after_a_placement_frees_the_slot_at_once(cluster: LocalCluster) -> None:
    gateway, placement = await FakeGateway.placing(cluster, "orphan-1")
    assert not placement.hit  # a miss: the model's entry was admitted for it
    gpu = f"{placement.node}/{placement.gpu}"
    assert gpus(cluster)[gpu]["running"] == ["orphan-1"]
    assert gateway.scheduler is not None
    gateway.scheduler.close()  # the gateway dies before sending the payload

    # The scheduler asks the node, which never saw the grant: the slot is free, and the model's
    # entry (it never loaded) is gone, well before the claim time would have caught it.
    waited = await eventually(
        lambda: gpus(cluster)[gpu]["running"] == [] and gpus(cluster)[gpu]["lru"] == [], timeout_s=CLAIM_S * 3
    )
    assert waited < CLAIM_S / 4, f"freed after {waited:.2f} s, not at once"
    # The revoked token is refused if it turns up after all, and runs nothing.
    reply, _ = await execute(placement, key=cluster.wire_key)
    assert reply.outcome == pb.REFUSED and "revoked" in reply.message
    # The cluster serves as before.
    response = await asyncio.to_thread(
        httpx.post,
        f"{cluster.gateway_url}/function/sleepy",
        json={"sleep_s": 0},
        timeout=30,
        auth=cluster.admin_auth,
    )
    assert response.status_code == 200, response.text


@pytest.mark.anyio
async def test_a_placement_never_presented_is_revoked_and_placed_again(cluster: LocalCluster) -> None:
    gateway, first = await FakeGateway.placing(cluster, "stalled-1")
    started = time.monotonic()
    # The gateway keeps its connection but never sends the payload: after the claim time the
    # scheduler checks with the node (never seen: revoked there) and places the call again.
    second = await gateway.placement("stalled-1", attempt=2, timeout_s=CLAIM_S * 5)
    assert time.monotonic() - started >= CLAIM_S * 0.8
    old_reply, _ = await execute(first, key=cluster.wire_key)
    assert old_reply.outcome == pb.REFUSED and "revoked" in old_reply.message
    reply, body = await execute(second, key=cluster.wire_key)
    assert reply.outcome == pb.OK, reply.message
    assert b"slept_s" in body


@pytest.mark.anyio
async def test_a_call_id_its_client_names_again_runs_at_its_first_placement(cluster: LocalCluster) -> None:
    # The nodes remember every grant they saw (call id, attempt) for a minute and refuse it again.
    # A call the client named (X-Call-Id) whose id it uses again once the call ended is placed past
    # the attempts of the calls of that id before it: each runs at its first placement.
    gateway = FakeGateway()
    await gateway.open(cluster)
    for expected_attempt in (1, 2, 3):
        gateway.messages.clear()
        gateway.place("named-1", "sleepy", given_call_id=True)
        placement = await gateway.placement("named-1", attempt=expected_attempt)
        reply, _ = await execute(placement, key=cluster.wire_key)
        assert reply.outcome == pb.OK, reply.message
        await eventually(lambda: all(not g["running"] for g in gpus(cluster).values()), timeout_s=10)  # its Done came
    # A call id the gateway made is not remembered (it never comes again): were one used again, it
    # would start at attempt 1, which its node refuses (the gateway then has it placed again).
    gateway.messages.clear()
    gateway.place("named-1", "sleepy")
    placement = await gateway.placement("named-1", attempt=1)
    reply, _ = await execute(placement, key=cluster.wire_key)
    assert reply.outcome == pb.REFUSED and "used already" in reply.message


@pytest.mark.anyio
async def test_a_token_reused_or_forged_is_refused(cluster: LocalCluster) -> None:
    gateway, placement = await FakeGateway.placing(cluster, "once-1")
    reply, _ = await execute(placement, key=cluster.wire_key)
    assert reply.outcome == pb.OK, reply.message

    again, again_body = await execute(placement, key=cluster.wire_key)
    assert again.outcome == pb.REFUSED and "used already" in again.message
    assert again_body == b""

    gateway.place("forged-1", "sleepy")
    genuine = await gateway.placement("forged-1")
    forged = bytearray(genuine.token)
    forged[10] ^= 0xFF  # a byte of the grant: say, another call id or GPU
    refused, _ = await execute(genuine, token=bytes(forged), key=cluster.wire_key)
    assert refused.outcome == pb.REFUSED and "signature" in refused.message
    refused, _ = await execute(
        genuine, token=b"not a token at all, but long enough to look like one", key=cluster.wire_key
    )
    assert refused.outcome == pb.REFUSED
    # The genuine token still works: a refusal does not burn it.
    reply, body = await execute(genuine, key=cluster.wire_key)
    assert reply.outcome == pb.OK and b"slept_s" in body


@pytest.mark.anyio
async def test_a_placement_on_a_node_that_left_is_placed_elsewhere_before_its_lease_expires(
    cluster: LocalCluster,
) -> None:
    gateway, first = await FakeGateway.placing(cluster, "moved-1")
    cluster.components[first.node].stop(kill=True)  # the node dies between placement and payload
    with pytest.raises(ConnectionLost):
        await execute(first, key=cluster.wire_key)
    # Not even connected: the Execute was never sent, so it cannot have run there (REFUSED). A
    # NODE_UNREACHABLE (it may run there) would get a 502 "outcome unknown": the node is gone.
    waited = await placed_elsewhere(gateway, cluster, first, pb.Abandon.REFUSED)
    assert waited < 1.5, f"placed again after {waited:.2f} s; the node's lease (3 s) would have done it"


@pytest.mark.anyio
async def test_a_node_the_gateway_cannot_reach_gets_the_call_placed_elsewhere_and_the_grant_revoked(
    cluster: LocalCluster,
) -> None:
    gateway, first = await FakeGateway.placing(cluster, "cut-off-1")
    # As if the gateway's link to that node were cut after its Execute went, which the cut
    # dropped (the node itself is fine): the scheduler asks the node, which never saw it.
    waited = await placed_elsewhere(gateway, cluster, first, pb.Abandon.NODE_UNREACHABLE)
    assert waited < CLAIM_S * 0.75, f"placed again after {waited:.2f} s: that was the claim check, not the report"

    async def revoked() -> bool:
        old, _ = await execute(first, key=cluster.wire_key)
        assert old.outcome == pb.REFUSED, "the abandoned grant ran"
        return "revoked" in old.message

    assert await revoked()
    # The node stays in the cluster: only the gateway could not reach it.
    assert {g["node"] for g in gpus(cluster).values()} == {"node0", "node1"}


@pytest.mark.anyio
async def test_a_node_lost_after_it_started_the_call_gets_outcome_unknown_not_a_second_run(
    cluster: LocalCluster,
) -> None:
    """At most once: the gateway lost the node after the node had started the call (its grant is in
    the node's ledger). The scheduler asks the node, which saw it: the call is answered that its
    outcome is unknown (502 at the gateway), never placed again."""
    gateway, first = await FakeGateway.placing(cluster, "started-1")
    running = asyncio.ensure_future(execute(first, b'{"sleep_s": 1.5}', key=cluster.wire_key))
    await asyncio.sleep(0.5)  # the node has it
    gateway.abandon("started-1", first.attempt, pb.Abandon.NODE_UNREACHABLE)
    await eventually(lambda: bool(gateway.messages.get("started-1", [])[1:]), timeout_s=5)
    (answer,) = gateway.messages["started-1"][1:]
    assert isinstance(answer, pb.Rejection) and answer.status == pb.STATUS_UNSPECIFIED, answer
    assert "is unknown" in answer.message and f"started on node {first.node}" in answer.message
    reply, _ = await running  # it ran there, once
    assert reply.outcome == pb.OK, reply.message
    await asyncio.sleep(0.5)
    assert len(gateway.messages["started-1"]) == 2, "placed again"


@pytest.mark.parametrize(("scheduler_flags", "second_gpu"), [([], "gpu2"), (["--no-interference-aware-loads"], "gpu1")])
def test_two_misses_at_once_go_behind_different_switches(
    make_cluster: ClusterFactory, tmp_path: Path, scheduler_flags: list[str], second_gpu: str
) -> None:
    """A node reports its GPUs' shared host links (gpu0 and gpu1 behind pcie0, gpu2 behind pcie1):
    two misses placed at once go where their copies do not share a switch; without
    interference-aware loads the second takes the next GPU in order, beside the first."""
    cluster = make_cluster(
        nodes=1,
        gpus_per_node=3,
        backend="cpu",
        gpu_memory_mb=20_000,
        slots="1",
        node_flags=["--gpus-per-link", "2"],
        # Nothing pre-staged: both models are as far (fetch and load), so their copies are expected
        # at the same moments after their placements (a staged one's would come 15 s earlier).
        scheduler_flags=["--prestage-nodes", "0", *scheduler_flags],
    )
    # 15,000 MB each (declared; the handler holds nothing): one per GPU, and a copy the scheduler
    # expects to last 1.5 s at 10 GB/s, so that the two placements' copies overlap however slowly
    # the scheduler takes the second.
    for name in ("first", "second"):
        deploy(cluster, name, "sleepy_function", tmp_path, memory_mb=15_000)

    async def main() -> None:
        gateway = FakeGateway()
        await gateway.open(cluster)
        gateway.place("first-1", "first")
        gateway.place("second-1", "second")
        placed = [await gateway.placement(call_id) for call_id in ("first-1", "second-1")]
        assert [(p.gpu, p.hit) for p in placed] == [("gpu0", False), (second_gpu, False)]
        # Both at once, as a gateway runs them: one after the other, the second would wait out the
        # first's whole miss, past its claim time on a loaded machine (and be revoked).
        replies = await asyncio.gather(*(execute(placement, key=cluster.wire_key) for placement in placed))
        for reply, _ in replies:
            assert reply.outcome == pb.OK, reply.message

    asyncio.run(main())
