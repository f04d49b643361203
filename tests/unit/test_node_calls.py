"""The GPU manager daemon's side of a call (gpu_manager.daemon): its answer, its Done to the
scheduler and its metrics, over stand-in links and a stand-in worker pool."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gpu_manager.daemon import GpuManagerDaemon
from gpu_manager.devices import logical_devices
from gpu_manager.sandbox import Isolation
from gpu_manager.storage import StorageOptions
from gpu_manager.workers import RunResult
from gpufaas.grants import new_key, sign
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost, Frame, MessageType, NotSent, connect
from tests.fakes import MemoryStore

KEY = new_key()


class Link:
    """A stand-in wire link: what was sent on it, or `fails` raised by each send."""

    def __init__(self, fails: ConnectionLost | None = None) -> None:
        self.is_closed = False
        self.fails = fails
        self.sent: list[tuple[int, object]] = []

    def send(self, type_: int, header: object, body: bytes = b"") -> None:
        if self.fails is not None:
            raise self.fails
        self.sent.append((type_, header))


def make_node(state_dir: Path, store: MemoryStore | None = None) -> GpuManagerDaemon:
    """Node n1 with one emulated GPU, attached to scheduler s1 (epoch 1), on `store` (None: a
    new one); nothing started."""
    node = GpuManagerDaemon(
        store if store is not None else MemoryStore(),
        node="n1",
        backend="emulated",
        devices=logical_devices(1, 1024, "emulated"),
        state_dir=state_dir,
        spares_per_gpu=0,
        tls=False,
        isolation=Isolation(network=False, users=False),
        storage=StorageOptions(pool_mb=0),
    )
    node.ledger.attach("s1", KEY, 1)
    return node


def grant() -> pb.Grant:
    now = time.time()
    return pb.Grant(
        scheduler_id="s1",
        epoch=1,
        call_id="c1",
        attempt=1,
        node="n1",
        gpu="gpu0",
        model="m",
        memory_mb=10,
        claim_by_unix_s=now + 5,
        expires_unix_s=now + 30,
    )


def calls_counted(node: GpuManagerDaemon) -> float | None:
    return node.metrics.registry.get_sample_value("gpufaas_node_calls_total", {"outcome": "ok", "cache": "hit"})


def test_a_done_the_scheduler_link_no_longer_takes_is_dropped_and_the_call_still_counted(tmp_path: Path) -> None:
    # A link lost while its last frames are still handled is not closed yet, but its send raises
    # NotSent: that failed the Done's callback with a traceback, and the call went uncounted.
    async def main() -> None:
        node = make_node(tmp_path)
        scheduler = Link(fails=NotSent("connection to the scheduler is closed"))
        node._scheduler = scheduler  # type: ignore[assignment]
        node._ran(grant(), RunResult(pb.OK, "", output=b"out"))
        assert calls_counted(node) == 1.0
        scheduler.fails = None
        node._ran(grant(), RunResult(pb.OK, "", output=b"out"))
        assert [type_ for type_, _ in scheduler.sent] == [MessageType.DONE]
        assert calls_counted(node) == 2.0

    asyncio.run(main())


@pytest.mark.parametrize("type_", [MessageType.EXECUTE, MessageType.EVICT])
def test_a_malformed_execute_or_evict_closes_the_link_as_any_malformed_message(
    tmp_path: Path, type_: MessageType
) -> None:
    # Both were parsed inside their task: its ConnectionLost failed the task, nothing answered,
    # and the sender waited out its own timeout on a link left open (here: TimeoutError).
    async def main() -> None:
        node = make_node(tmp_path)
        address = await node._server.start("127.0.0.1:0")
        conn = await connect(address, tls=False)
        try:
            with pytest.raises(ConnectionLost):
                await conn.request(type_, b"\xff\xff", timeout_s=10.0)
        finally:
            conn.close()
            await node._server.close()

    asyncio.run(main())


def test_the_drain_knows_whether_a_scheduler_is_attached(tmp_path: Path) -> None:
    # A draining node with nothing running stops at once when no scheduler is attached (none is
    # there to acknowledge the drain): that must follow the real link, attached and lost.
    async def main() -> None:
        node = make_node(tmp_path)
        address = await node._server.start("127.0.0.1:0")
        conn = await connect(address, tls=False)
        try:
            assert not node.drain.attached
            await conn.request(MessageType.ATTACH, pb.Attach(scheduler_id="s1", token_key=KEY, epoch=2), timeout_s=10.0)
            assert node.drain.attached
            conn.close()
            for _ in range(200):
                if not node.drain.attached:
                    break
                await asyncio.sleep(0.01)
            assert not node.drain.attached
        finally:
            conn.close()
            await node._server.close()

    asyncio.run(main())


def test_a_run_that_raises_is_answered_at_once_its_outcome_unknown_and_its_slot_freed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A run that raised (a bug, or an error the pool makes no RunResult of) failed the Execute's
    # task: nothing answered the gateway, which waited out the call's deadline (504), and the
    # scheduler had no Done (the slot held until it gave the call up as lost).
    async def main() -> None:
        node = make_node(tmp_path)
        scheduler = Link()
        node._scheduler = scheduler  # type: ignore[assignment]

        async def broken_run(*args: object, **kwargs: object) -> RunResult:
            raise RuntimeError("a bug in the pool")

        node.pool.run = broken_run  # type: ignore[method-assign]
        answers: list[tuple[int, pb.ExecuteReply]] = []

        class Gateway:
            peer = "gateway"

            def reply(self, to: Frame, type_: int, header: pb.ExecuteReply, body: bytes = b"") -> None:
                answers.append((type_, header))

        request = pb.Execute(token=sign(grant(), KEY))
        await node.execute(Gateway(), Frame(MessageType.EXECUTE, 0, 1, b"", b"in"), request)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # (the Done goes out a turn of the loop later)
        [(type_, reply)] = answers
        assert type_ == MessageType.EXECUTE_REPLY and reply.outcome == pb.OUTCOME_UNSPECIFIED  # the gateway's 502
        assert "the outcome of call 'c1' is unknown: node n1 failed while running it" in reply.message
        [(sent, done)] = scheduler.sent
        assert sent == MessageType.DONE and isinstance(done, pb.Done)
        assert (done.call_id, done.attempt, done.worker_lost) == ("c1", 1, False)

    with caplog.at_level("ERROR", logger="gpufaas.gpu_manager"):
        asyncio.run(main())
    assert any(r.exc_info and "a bug in the pool" in str(r.exc_info[1]) for r in caplog.records)
