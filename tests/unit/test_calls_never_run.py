"""scheduler.calls.CallBook: a queued call whose model the world changed under (its measured size
grew past every GPU, the GPUs big enough or of its type left, its size re-declared larger) is
answered at once, as a new call of it would be, and leaves the queue; placed calls are untouched.
Under `lb` (FIFO) such a call at the head held every call behind it until its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import GpuSpec, ModelSpec
from gpufaas.wire import Frame, MessageType
from scheduler.calls import Answer, Assignment, CallBook, Effect, Rejected
from scheduler.core import Scheduler
from scheduler.service import SchedulerService
from scheduler.sessions import NodeSession
from tests.builders import make_scheduler, stored_spec
from tests.fakes import MemoryStore
from tests.unit.test_calls import make_spec

BIG, SMALL = "n1/g0", "n2/g0"  # 8000 MB and 4000 MB
POLICIES = ("lb", "lalb-o3")
A, B = make_spec("fn-a", 3000), make_spec("fn-b", 1000)


def make_book(policy: str, *specs: FunctionSpec) -> CallBook:
    """Two GPUs of one slot each, BIG (8000 MB) and SMALL (4000 MB), under `policy`."""
    scheduler = make_scheduler(
        policy, gpus={BIG: 8000, SMALL: 4000}, models={s.model: s.memory_mb for s in specs or (A, B)}
    )
    return CallBook(scheduler, claim_s=5.0, lost_after_s=5.0)


def fill_both_gpus(book: CallBook) -> None:
    """Calls c1 (on one GPU) and c2 (on the other) of B, then c3 of B (the queue's head) and c4 of
    A queued behind."""
    for call_id in ("c1", "c2"):
        book.submit("gw1", call_id, B, 60.0, now=0.0)
    assert book.submit("gw1", "c3", B, 60.0, now=1.0) == []
    assert book.submit("gw1", "c4", A, 60.0, now=2.0) == []


def refusal(scheduler: Scheduler, spec: FunctionSpec) -> str:
    """What a new call of `spec` is refused with now (Rejected UNAVAILABLE)."""
    book = CallBook(scheduler)
    with pytest.raises(Rejected) as caught:
        book.submit("gw9", "probe", spec, 60.0, now=0.0)
    assert caught.value.status == pb.UNAVAILABLE
    return str(caught.value)


def answered(effects: list[Effect]) -> list[tuple[str, int, str]]:
    return [(e.call_id, e.status, e.message) for e in effects if isinstance(e, Answer)]


def placed(effects: list[Effect]) -> list[tuple[str, str]]:
    return [(e.call_id, e.gpu_id) for e in effects if isinstance(e, Assignment)]


def gpu_of(book: CallBook, call_id: str) -> str:
    return next(gpu for gpu in (BIG, SMALL) if call_id in book.scheduler.gpu(gpu).running)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_measured_peak_past_every_gpu_answers_the_models_queued_calls(policy: str) -> None:
    book = make_book(policy)
    fill_both_gpus(book)
    gpu = gpu_of(book, "c1")
    effects = book.done("c1", 1, pb.OK, now=3.0, inference_time_s=1.0, peak_memory_mb=9000)
    message = refusal(book.scheduler, B)
    assert "9000 MB" in message and B.model in message and "8000 MB" in message
    assert answered(effects) == [("c3", pb.UNAVAILABLE, message)]
    assert placed(effects) == [("c4", gpu)]  # the rest of the queue moves
    assert "c3" not in book._calls and not book.scheduler.queue
    assert "c2" in book.scheduler.gpu(gpu_of(book, "c2")).running  # a running call of B is untouched


@pytest.mark.parametrize("policy", POLICIES)
def test_a_worker_lost_over_its_size_answers_the_models_queued_calls_through_the_book(policy: str) -> None:
    book = make_book(policy)
    fill_both_gpus(book)
    gpu = gpu_of(book, "c1")
    # As scheduler.sessions does for a worker_lost Done, before the Done itself.
    effects = book.observe_memory(B.model, gpu, 9000, now=3.0)
    message = refusal(book.scheduler, B)
    assert answered(effects) == [("c3", pb.UNAVAILABLE, message)] and placed(effects) == []
    assert [r.request_id for r in book.scheduler.queue] == ["c4"]
    assert book.observe_memory(B.model, gpu, 9000, now=3.0) == []  # no change: nothing to check
    done = book.done("c1", 1, pb.OK, now=3.0, worker_lost=True)
    assert placed(done) == [("c4", gpu)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_only_gpu_big_enough_leaving_answers_the_models_queued_calls(policy: str) -> None:
    big_a = make_spec("fn-a", 6000)
    book = make_book(policy, big_a, B)
    for call_id in ("c1", "c2"):
        book.submit("gw1", call_id, B, 60.0, now=0.0)
    book.submit("gw1", "c3", big_a, 60.0, now=1.0)
    book.submit("gw1", "c4", B, 60.0, now=2.0)
    effects = book.gpus_removed([BIG], now=3.0)
    message = refusal(book.scheduler, big_a)
    assert "6000 MB" in message and "4000 MB" in message
    assert ("c3", pb.UNAVAILABLE, message) in answered(effects)
    assert "c3" not in book._calls and "c3" not in book.scheduler.queue
    # The call that ran on BIG is stranded (its owner says whether it sent it); SMALL's runs on.
    stranded = next(c for c in ("c1", "c2") if c not in book.scheduler.gpu(SMALL).running)
    assert book._calls[stranded].state.value == "stranded"
    done = book.done(next(c for c in ("c1", "c2") if c != stranded), 1, pb.OK, now=4.0, inference_time_s=1.0)
    assert placed(done) == [("c4", SMALL)]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_only_gpus_of_the_required_type_leaving_answers_the_models_queued_calls(policy: str) -> None:
    scheduler = make_scheduler(policy, gpus={}, models={B.model: 1000})
    scheduler.add_gpu(GpuSpec(BIG, 8000, "a100"))
    scheduler.add_gpu(GpuSpec(SMALL, 8000, "rtx2080"))
    typed = FunctionSpec(name="fn-t", package_digest=A.package_digest, memory_mb=1000, gpu="a100")
    scheduler.register_model(ModelSpec(typed.model, 1000, "a100"))
    book = CallBook(scheduler)
    book.submit("gw1", "c1", typed, 60.0, now=0.0)  # on BIG, the only a100
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    book.submit("gw1", "c3", typed, 60.0, now=1.0)
    book.submit("gw1", "c4", B, 60.0, now=2.0)
    effects = book.gpus_removed([BIG], now=3.0)
    message = refusal(book.scheduler, typed)
    assert "a100" in message
    assert answered(effects) == [("c3", pb.UNAVAILABLE, message)]
    done = book.done("c2", 1, pb.OK, now=4.0, inference_time_s=1.0)
    assert placed(done) == [("c4", SMALL)]


@pytest.mark.parametrize("policy", POLICIES)
def test_queued_calls_wait_for_nodes_to_come_back_when_every_gpu_left(policy: str) -> None:
    book = make_book(policy)
    fill_both_gpus(book)
    assert answered(book.gpus_removed([BIG, SMALL], now=3.0)) == []
    assert "c3" in book.scheduler.queue and "c4" in book.scheduler.queue


@pytest.mark.parametrize("policy", POLICIES)
def test_a_size_declared_larger_than_every_gpu_answers_the_models_queued_calls(policy: str) -> None:
    book = make_book(policy)
    fill_both_gpus(book)
    effects = book.register_model(ModelSpec(B.model, 12000), now=3.0)
    message = refusal(book.scheduler, B)
    assert "12000 MB" in message
    assert answered(effects) == [("c3", pb.UNAVAILABLE, message)]
    assert [r.request_id for r in book.scheduler.queue] == ["c4"]
    assert book.register_model(ModelSpec(A.model, 4000), now=3.0) == []  # still fits: nothing
    assert [r.request_id for r in book.scheduler.queue] == ["c4"]


# --- where the service hears of a new size ------------------------------------------------------
def service_with_a_queued_call(scenario: Callable[[SchedulerService, list[Effect]], None]) -> None:
    """`scenario(service, applied)`: fn-a's call c1 placed on the service's one GPU (8000 MB) and
    c2 queued behind it; `applied` collects what the service's parts hand to `apply` from then on."""

    async def main() -> None:
        service = SchedulerService(MemoryStore(), keys=Keys("/t"), prestage_nodes=0)
        service.scheduler.add_gpu(GpuSpec(BIG, 8000, "cpu", node="n1"))
        service.catalog.learn_function(stored_spec(service.keys, A))
        service.book.submit("gw1", "c1", A, 60.0, service.clock())
        service.book.submit("gw1", "c2", A, 60.0, service.clock())
        applied: list[Effect] = []
        service.apply = applied.extend  # type: ignore[method-assign]
        service.catalog.apply = applied.extend
        scenario(service, applied)

    asyncio.run(main())


def test_a_function_redeclared_larger_than_every_gpu_has_its_queued_calls_answered() -> None:
    def scenario(service: SchedulerService, applied: list[Effect]) -> None:
        resized = FunctionSpec.model_validate({**A.model_dump(), "memory_mb": 9000})
        service.catalog.learn_function(stored_spec(service.keys, resized))
        assert [(c, status) for c, status, _ in answered(applied)] == [("c2", pb.UNAVAILABLE)]
        assert not service.scheduler.queue and "c1" in service.scheduler.gpu(BIG).running

    service_with_a_queued_call(scenario)


def test_a_worker_lost_over_every_gpus_size_has_its_models_queued_calls_answered() -> None:
    def scenario(service: SchedulerService, applied: list[Effect]) -> None:
        done = pb.Done(call_id="c1", attempt=1, outcome=pb.OK, peak_memory_mb=9000, worker_lost=True)
        conn: Any = None
        NodeSession(service, None).on_frame(conn, Frame(MessageType.DONE, 0, 0, done.SerializeToString(), b""))  # type: ignore[arg-type]
        assert [(c, status) for c, status, _ in answered(applied)] == [("c2", pb.UNAVAILABLE)]
        assert not service.scheduler.queue

    service_with_a_queued_call(scenario)
