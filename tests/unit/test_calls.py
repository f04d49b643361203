"""scheduler.calls.CallBook: every transition of a call, step by step, over the real Scheduler."""

from __future__ import annotations

import hashlib

import pytest

from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.grants import GRANT_KEEP_S
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import GpuSpec
from scheduler.calls import (
    CLOCK_SKEW_S,
    MAX_PLACEMENTS,
    OUTCOME_UNKNOWN,
    Answer,
    Assignment,
    CallBook,
    CheckGrants,
    Effect,
    Evict,
    EvictHost,
    Rejected,
)
from scheduler.node_links import NodeLink, NodeLinks
from scheduler.persister import StatePersister
from tests.builders import INFERENCE_S, LOAD_S, cache_on, make_scheduler
from tests.fakes import MemoryStore

CLAIM_S = 5.0
LOST_AFTER_S = 5.0
N1, N2 = "n1/g0", "n2/g0"


def make_spec(name: str, memory_mb: int = 1000) -> FunctionSpec:
    """A function whose package digest is derived from its name (so its model is stable)."""
    return FunctionSpec(
        name=name, package_digest="sha256:" + hashlib.sha256(name.encode()).hexdigest(), memory_mb=memory_mb
    )


A, B, C = make_spec("fn-a"), make_spec("fn-b"), make_spec("fn-c")


def make_book(
    *specs: FunctionSpec,
    gpus: tuple[str, ...] = (N1, N2),
    memory_mb: int = 8000,
    slots: int = 1,
    queue_capacity: int = 10_000,
) -> CallBook:
    """A CallBook over a `lalb` scheduler with `gpus` ("node/gpu", each `memory_mb` and `slots`)
    and the functions' models registered (load 2 s, inference 1 s, as tests.builders profiles)."""
    scheduler = make_scheduler(
        "lalb",
        gpus={gpu: memory_mb for gpu in gpus},
        models={s.model: s.memory_mb for s in specs or (A, B, C)},
        slots=slots,
    )
    return CallBook(scheduler, queue_capacity, claim_s=CLAIM_S, lost_after_s=LOST_AFTER_S)


def placed(effects: list[Effect]) -> list[tuple[str, int, str, int, bool]]:
    """(call id, attempt, GPU, gpu_seq, hit) of each Assignment; fails on any other effect."""
    assert all(isinstance(e, Assignment) for e in effects), effects
    return [(e.call_id, e.attempt, e.gpu_id, e.gpu_seq, e.hit) for e in effects if isinstance(e, Assignment)]


def running(book: CallBook, gpu_id: str) -> list[str]:
    return list(book.scheduler.gpu(gpu_id).running)


def cached(book: CallBook, spec: FunctionSpec) -> set[str]:
    return set(book.scheduler.cache.gpus_with(spec.model))


def queued(book: CallBook) -> list[str]:
    return [r.request_id for r in book.scheduler.queue]


# --- submit -----------------------------------------------------------------------------------


def test_submit_places_the_call_and_says_where_and_until_when() -> None:
    book = make_book(slots=2)
    assert book.submit("gw1", "c1", A, 10.0, now=100.0) == [
        Assignment(
            owner="gw1",
            call_id="c1",
            attempt=1,
            gpu_id=N1,
            gpu_seq=1,
            hit=False,
            evict=(),
            spec=A,
            queue_s=0.0,
            deadline=110.0,
            claim_by=100.0 + CLAIM_S,
            est_load_time_s=LOAD_S,
            est_inference_time_s=INFERENCE_S,
        )
    ]
    assert len(book) == 1
    assert book.placed_on("n1") == [("c1", 1)] and book.placed_on("n2") == []
    assert running(book, N1) == ["c1"]


def test_gpu_seq_counts_grants_per_gpu() -> None:
    book = make_book(slots=2)
    assert placed(book.submit("gw1", "c1", A, 10.0, now=0.0)) == [("c1", 1, N1, 1, False)]
    assert placed(book.submit("gw1", "c2", A, 10.0, now=1.0)) == [("c2", 1, N1, 2, True)]  # second slot, a hit
    assert placed(book.submit("gw2", "c3", B, 10.0, now=2.0)) == [("c3", 1, N2, 1, False)]
    assert placed(book.submit("gw2", "c4", B, 10.0, now=3.0)) == [("c4", 1, N2, 2, True)]
    assert book.dirty_gpus == {N1, N2}
    assert book.dirty_models == {A.model, B.model}


def test_claim_by_is_the_deadline_when_that_comes_first() -> None:
    book = make_book()
    (assignment,) = book.submit("gw1", "c1", A, 2.0, now=50.0)
    assert isinstance(assignment, Assignment)
    assert assignment.claim_by == assignment.deadline == 52.0


def test_a_queued_call_is_placed_when_a_slot_frees_with_its_queue_time() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.submit("gw1", "c2", A, 60.0, now=1.0) == []
    assert queued(book) == ["c2"]
    (assignment,) = book.done("c1", 1, pb.OK, 4.0)
    assert isinstance(assignment, Assignment)
    assert (assignment.call_id, assignment.attempt, assignment.gpu_seq, assignment.hit) == ("c2", 1, 2, True)
    assert assignment.queue_s == 3.0
    assert assignment.claim_by == 4.0 + CLAIM_S


def test_a_call_id_already_in_flight_is_rejected() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    with pytest.raises(Rejected, match="already in flight") as caught:
        book.submit("gw2", "c1", B, 10.0, now=1.0)
    assert caught.value.status == pb.INVALID
    assert len(book) == 1 and queued(book) == [] and running(book, N2) == []


def test_a_full_queue_rejects_with_overloaded() -> None:
    book = make_book(gpus=(N1,), queue_capacity=1)
    book.submit("gw1", "c1", A, 10.0, now=0.0)  # runs
    book.submit("gw1", "c2", A, 10.0, now=0.0)  # waits
    with pytest.raises(Rejected, match="queue is full") as caught:
        book.submit("gw1", "c3", A, 10.0, now=0.0)
    assert caught.value.status == pb.OVERLOADED
    assert len(book) == 2 and queued(book) == ["c2"]


def test_no_gpu_rejects_with_unavailable() -> None:
    book = make_book(gpus=())
    with pytest.raises(Rejected, match="no GPU manager") as caught:
        book.submit("gw1", "c1", A, 10.0, now=0.0)
    assert caught.value.status == pb.UNAVAILABLE
    assert len(book) == 0


def test_a_call_waits_for_registered_nodes_that_are_not_attached_yet() -> None:
    # A new leader takes calls before its nodes attach: they wait, then are placed in arrival order.
    book = make_book(gpus=())
    assert book.submit("gw1", "c1", A, 10.0, now=0.0, nodes_attaching=True) == []
    assert book.submit("gw2", "c2", B, 10.0, now=0.5, nodes_attaching=True) == []
    assert len(book) == 2 and queued(book) == []
    assert book.tick(now=1.0) == []  # nothing to place on, nothing answered before the deadlines
    book.scheduler.add_gpu(GpuSpec(N1, 8000, slots=1))
    effects = book.schedule(now=1.5)  # what the service does once a node attached
    assert placed(effects) == [("c1", 1, N1, 1, False)]
    assert isinstance(effects[0], Assignment) and effects[0].queue_s == 1.5 and effects[0].deadline == 10.0
    assert queued(book) == ["c2"]
    assert placed(book.done("c1", 1, pb.OK, now=4.0)) == [("c2", 1, N1, 2, False)]


def test_a_waiting_call_is_answered_at_its_deadline_or_forgotten_when_withdrawn() -> None:
    book = make_book(gpus=())
    book.submit("gw1", "c1", A, 2.0, now=0.0, nodes_attaching=True)
    book.submit("gw1", "c2", B, 60.0, now=0.0, nodes_attaching=True)
    book.submit("gw2", "c3", C, 60.0, now=0.0, nodes_attaching=True)
    assert book.tick(now=2.0) == [Answer("gw1", "c1", pb.DEADLINE, A.deadline_message())]
    assert book.abandon("gw1", "c2", 0, pb.Abandon.CANCELLED, now=2.5) == []
    assert book.owner_lost("gw2", now=2.6) == []
    assert len(book) == 0
    book.scheduler.add_gpu(GpuSpec(N1, 8000, slots=1))
    assert book.schedule(now=3.0) == [] and queued(book) == []


def test_a_waiting_call_counts_against_the_queue_capacity() -> None:
    book = make_book(gpus=(), queue_capacity=1)
    book.submit("gw1", "c1", A, 10.0, now=0.0, nodes_attaching=True)
    with pytest.raises(Rejected, match="queue is full"):
        book.submit("gw1", "c2", A, 10.0, now=0.0, nodes_attaching=True)


def test_a_waiting_call_that_can_never_run_on_the_attached_gpus_is_answered() -> None:
    huge = make_spec("fn-huge", memory_mb=9000)
    book = make_book(A, huge, gpus=())
    book.submit("gw1", "c1", huge, 10.0, now=0.0, nodes_attaching=True)
    book.scheduler.add_gpu(GpuSpec(N1, 8000, slots=1))
    (answer,) = book.schedule(now=1.0)
    assert isinstance(answer, Answer) and answer.status == pb.UNAVAILABLE and answer.call_id == "c1"
    assert "can never run" in answer.message and len(book) == 0


def test_a_model_larger_than_every_gpu_rejects_with_unavailable() -> None:
    huge = make_spec("fn-huge", memory_mb=9000)
    book = make_book(A, huge)
    with pytest.raises(Rejected, match="can never run on this cluster") as caught:
        book.submit("gw1", "c1", huge, 10.0, now=0.0)
    assert caught.value.status == pb.UNAVAILABLE
    assert len(book) == 0 and queued(book) == []


def test_a_model_the_scheduler_does_not_know_rejects_with_invalid() -> None:
    book = make_book(A)
    with pytest.raises(Rejected, match="not registered") as caught:
        book.submit("gw1", "c1", B, 10.0, now=0.0)
    assert caught.value.status == pb.INVALID
    assert len(book) == 0


# --- done -------------------------------------------------------------------------------------


def test_done_ok_frees_the_slot_learns_the_measurements_and_finishes() -> None:
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    book.dirty_models.clear()
    effects = book.done("c1", 1, pb.OK, 3.0, loaded=True, load_time_s=2.5, inference_time_s=0.5, peak_memory_mb=1200)
    assert effects == []
    assert len(book) == 0 and running(book, N1) == []
    assert cached(book, A) == {N1} and not book.scheduler.cache.gpu(N1).is_pinned(A.model)
    assert book.scheduler.load_time_s(A.model, N1) == pytest.approx(LOAD_S + 0.2 * (2.5 - LOAD_S))
    assert book.scheduler.model(A.model).memory_mb == 1200
    assert book.dirty_models == {A.model}  # its size changed
    assert book.dirty_profiles == {("rtx2080", A.model, 32)}
    # A second Done for the same attempt changes nothing (the call is gone).
    assert book.done("c1", 1, pb.OK, 3.5, inference_time_s=0.5) == []
    assert book.done("unknown", 1, pb.OK, 3.5) == []


def test_done_of_a_batch_counts_every_merged_call_in_the_profile() -> None:
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    book.done("c1", 1, pb.HANDLER_ERROR, 3.0, inference_time_s=0.8, batch_calls=4)
    assert book.dirty_profiles == {("rtx2080", A.model, 4 * 32)}
    assert book.scheduler.load_time_s(A.model, N1) == LOAD_S  # not loaded by this call: not learnt


@pytest.mark.parametrize(("outcome", "inference_time_s"), [(pb.OK, 0.0), (pb.TIMEOUT, 0.9), (pb.INVALID_INPUT, 0.9)])
def test_done_without_a_measured_inference_records_no_profile(outcome: int, inference_time_s: float) -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    assert book.done("c1", 1, outcome, 3.0, inference_time_s=inference_time_s) == []
    assert book.dirty_profiles == set()
    assert len(book) == 0 and running(book, N1) == []


def test_a_done_for_an_attempt_that_was_replaced_is_ignored() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert placed(book.abandon("gw1", "c1", 1, pb.Abandon.REFUSED, now=1.0)) == [("c1", 2, N2, 1, False)]
    assert book.done("c1", 1, pb.OK, 2.0, inference_time_s=1.0) == []
    assert len(book) == 1 and running(book, N2) == ["c1"]
    assert book.dirty_profiles == set()
    assert book.done("c1", 2, pb.OK, 3.0) == []
    assert len(book) == 0 and running(book, N2) == []


def test_a_worker_that_dies_is_retried_once_elsewhere_then_answered_unavailable() -> None:
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    # Its worker died on n1: the model goes from there and the retry avoids that GPU.
    assert placed(book.done("c1", 1, pb.WORKER_DIED, 1.0, worker_lost=True)) == [("c1", 2, N2, 1, False)]
    assert cached(book, A) == {N2}
    assert running(book, N1) == [] and running(book, N2) == ["c1"]
    assert book.done("c1", 2, pb.WORKER_DIED, 2.0, worker_lost=True) == [
        Answer("gw1", "c1", pb.UNAVAILABLE, "the function's worker died twice; see the node's log")
    ]
    assert len(book) == 0 and cached(book, A) == set()
    assert running(book, N1) == running(book, N2) == []


def test_a_worker_that_dies_after_the_deadline_is_not_retried() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 5.0, now=0.0)
    (answer,) = book.done("c1", 1, pb.WORKER_DIED, 5.0)
    assert isinstance(answer, Answer) and answer.status == pb.UNAVAILABLE
    assert len(book) == 0 and queued(book) == []


def test_a_worker_that_dies_under_a_withdrawn_call_is_neither_retried_nor_answered() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.abandon("gw1", "c1", 0, pb.Abandon.CANCELLED, now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    assert book.done("c1", 1, pb.WORKER_DIED, 2.0) == []
    assert len(book) == 0 and queued(book) == [] and running(book, N1) == running(book, N2) == []


@pytest.mark.parametrize(
    ("outcome", "worker_lost"),
    [(pb.LOAD_FAILED, False), (pb.LOAD_FAILED, True), (pb.TIMEOUT, True), (pb.HANDLER_ERROR, True)],
)
def test_a_lost_worker_drops_the_model_and_finishes_the_call(outcome: int, worker_lost: bool) -> None:
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.dirty_models.clear()
    assert book.done("c1", 1, outcome, 3.0, inference_time_s=0.5, worker_lost=worker_lost) == []
    assert cached(book, A) == set()
    assert book.dirty_models == {A.model}
    assert len(book) == 0 and running(book, N1) == [] and queued(book) == []
    assert book.dirty_profiles == set()


def test_a_timeout_without_a_lost_worker_keeps_the_model() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.done("c1", 1, pb.TIMEOUT, 60.0) == []
    assert cached(book, A) == {N1} and not book.scheduler.cache.gpu(N1).is_pinned(A.model)
    assert len(book) == 0 and running(book, N1) == []


# --- abandon ----------------------------------------------------------------------------------


def test_cancelling_a_queued_call_withdraws_it_silently() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    assert book.abandon("gw2", "c2", 0, pb.Abandon.CANCELLED, now=1.0) == []  # not its owner
    assert queued(book) == ["c2"]
    assert book.abandon("gw1", "c2", 0, pb.Abandon.CANCELLED, now=1.0) == []
    assert queued(book) == [] and len(book) == 1
    assert book.done("c1", 1, pb.OK, 2.0) == []  # nothing left to place


def test_cancelling_a_placed_call_checks_its_grant_once() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    assert book.abandon("gw1", "c1", 1, pb.Abandon.CANCELLED, now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    assert book.abandon("gw1", "c1", 1, pb.Abandon.CANCELLED, now=1.5) == []  # already being checked
    assert running(book, N1) == ["c1"]  # until the node answers
    # Never presented: revoked there; the slot goes to c2, and c1 is forgotten without an answer.
    assert placed(book.grants_checked("n1", [("c1", 1)], [], now=2.0)) == [("c2", 1, N1, 2, False)]
    assert len(book) == 1 and running(book, N1) == ["c2"]
    assert cached(book, A) == set()  # c1's miss never loaded it


def test_a_cancelled_call_whose_grant_was_presented_waits_for_its_done() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.abandon("gw1", "c1", 0, pb.Abandon.CANCELLED, now=1.0)
    assert book.grants_checked("n1", [], [("c1", 1)], now=2.0) == []
    assert running(book, N1) == ["c1"] and len(book) == 1
    assert book.tick(3.0 + CLAIM_S) == []  # claimed: not checked again
    assert book.done("c1", 1, pb.OK, 9.0) == []
    assert len(book) == 0 and running(book, N1) == []


def test_a_node_lost_after_the_execute_was_sent_is_asked_first_and_a_grant_it_never_saw_is_placed_elsewhere() -> None:
    # The gateway lost node n1 after sending it the Execute: the call may run there. It is placed
    # again only once n1 says it never saw the grant (which revokes it there, so it cannot run late).
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    assert running(book, N1) == ["c1"] and queued(book) == []  # nothing placed meanwhile
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.2) == []  # being checked
    assert book.tick(CLAIM_S + 1.0) == []  # not checked twice
    assert placed(book.grants_checked("n1", [("c1", 1)], [], now=1.5)) == [("c1", 2, N2, 1, False)]
    assert running(book, N1) == [] and running(book, N2) == ["c1"]
    assert cached(book, A) == {N2}  # the miss on n1 never happened
    assert book.placed_on("n1") == [] and book.placed_on("n2") == [("c1", 2)]
    # The node's answer about the old attempt changes nothing, whatever it says.
    assert book.grants_checked("n1", [("c1", 1)], [], now=1.6) == []
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.6) == []
    assert running(book, N2) == ["c1"] and len(book) == 1


def test_a_node_lost_after_the_execute_was_sent_that_saw_the_grant_makes_the_outcome_unknown() -> None:
    # n1 started the call (a partition cut the gateway off it): answered 502 "outcome unknown"
    # at once, never run again; the slot stays the call's until n1's Done (or the lost-call deadline).
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0)
    (answer,) = book.grants_checked("n1", [], [("c1", 1)], now=1.5)
    assert isinstance(answer, Answer) and (answer.owner, answer.call_id, answer.status) == (
        "gw1",
        "c1",
        OUTCOME_UNKNOWN,
    )
    assert "started on node n1" in answer.message and "not run again" in answer.message
    assert running(book, N1) == ["c1"] and queued(book) == ["c2"]
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.6) == []  # answered once
    assert placed(book.done("c1", 1, pb.OK, now=3.0)) == [("c2", 1, N1, 2, False)]
    assert len(book) == 1


def test_a_node_lost_after_the_execute_was_sent_that_cannot_answer_makes_the_outcome_unknown() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.grants_unchecked([("c1", 1)]) == []  # a check nobody was waiting on: nothing to say
    book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0)
    (answer,) = book.grants_unchecked([("c1", 1)])
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c1", OUTCOME_UNKNOWN)
    assert "cannot say whether it started it" in answer.message
    # The node is taken out next: its GPU leaves, and the call with it, silently.
    assert book.gpus_removed([N1], now=2.0) == []
    assert len(book) == 0 and queued(book) == [] and running(book, N2) == []


def test_a_call_seen_by_its_node_is_not_checked_again_when_the_gateway_loses_the_node() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.tick(CLAIM_S) == [CheckGrants("n1", (("c1", 1),))]
    assert book.grants_checked("n1", [], [("c1", 1)], now=CLAIM_S) == []  # claimed: it runs there
    (answer,) = book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=CLAIM_S + 1)
    assert isinstance(answer, Answer) and answer.status == OUTCOME_UNKNOWN and "started on node n1" in answer.message
    assert running(book, N1) == ["c1"] and queued(book) == []


def test_a_node_lost_during_a_claim_check_waits_for_that_checks_answer() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.tick(CLAIM_S) == [CheckGrants("n1", (("c1", 1),))]
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=CLAIM_S + 0.1) == []
    (answer,) = book.grants_checked("n1", [], [("c1", 1)], now=CLAIM_S + 0.2)
    assert isinstance(answer, Answer) and answer.status == OUTCOME_UNKNOWN


def test_a_refused_grant_places_the_call_again_elsewhere() -> None:
    book = make_book()
    cache_on(book.scheduler, N1, A.model)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    # The node refused the token: nothing to revoke there.
    assert placed(book.abandon("gw1", "c1", 0, pb.Abandon.REFUSED, now=1.0)) == [("c1", 2, N2, 1, False)]
    assert cached(book, A) == {N1, N2}  # a hit's model stays where it was


def test_an_abandon_for_a_call_already_done_says_its_outcome_is_unknown() -> None:
    # A one-way gateway -> node cut: the node ran the call and its Done reached the scheduler, but
    # its reply never reached the gateway, which then reports the node unreachable. The call is
    # not run again; the gateway hears at once that its outcome is unknown (502), not at its deadline.
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.done("c1", 1, pb.OK, now=2.0, inference_time_s=1.0) == []
    assert len(book) == 0
    for reason in (pb.Abandon.NODE_UNREACHABLE, pb.Abandon.REFUSED):
        (answer,) = book.abandon("gw1", "c1", 1, reason, now=7.0)
        assert isinstance(answer, Answer)
        assert (answer.owner, answer.call_id, answer.status) == ("gw1", "c1", OUTCOME_UNKNOWN)
        assert "is unknown" in answer.message and "not run again" in answer.message
    assert len(book) == 0 and queued(book) == [] and running(book, N1) == running(book, N2) == []


def test_an_abandon_for_a_call_never_seen_says_its_outcome_is_unknown_unless_cancelled() -> None:
    book = make_book()
    effects = book.abandon("gw1", "c9", 2, pb.Abandon.NODE_UNREACHABLE, now=1.0)
    assert [(e.call_id, e.status) for e in effects if isinstance(e, Answer)] == [("c9", OUTCOME_UNKNOWN)]
    assert len(effects) == 1
    assert book.abandon("gw1", "c9", 0, pb.Abandon.CANCELLED, now=1.0) == []  # nobody waits for it


def test_an_abandon_about_a_replaced_placement_is_ignored() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0)
    book.grants_checked("n1", [("c1", 1)], [], now=1.2)
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.5) == []
    assert book.abandon("gw1", "c1", 1, pb.Abandon.REFUSED, now=1.5) == []
    assert running(book, N2) == ["c1"] and book.placed_on("n2") == [("c1", 2)]


def test_a_placement_abandoned_after_its_call_was_cancelled_is_not_placed_again() -> None:
    # The gateway cancelled (its client went away) while its Execute was under way; the Execute
    # then fails and the gateway reports the node unreachable. Nobody wants the call any more.
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.abandon("gw1", "c1", 0, pb.Abandon.CANCELLED, now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    effects = book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.1)
    assert not [e for e in effects if isinstance(e, Assignment | Answer)], effects
    assert queued(book) == [] and running(book, N2) == []


def test_a_call_id_its_client_names_again_is_placed_past_the_attempts_before_it() -> None:
    # A node refuses a grant (call id, attempt) it has seen for GRANT_KEEP_S: a named call (an
    # X-Call-Id) used again after its first call ended starts past that one's last attempt, and
    # runs at its first placement instead of being refused there, attempt after attempt.
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0, named=True)
    assert placed(book.abandon("gw1", "c1", 0, pb.Abandon.REFUSED, now=0.5)) == [("c1", 2, N2, 1, False)]
    assert book.done("c1", 2, pb.OK, 1.0, inference_time_s=0.5) == []
    assert placed(book.submit("gw2", "c1", A, 10.0, now=2.0, named=True)) == [("c1", 3, N2, 2, True)]
    assert book.done("c1", 3, pb.OK, 3.0, inference_time_s=0.5) == []
    # Once no node can remember its grant (revoked by LOST_AFTER_S past its deadline, 12 s, at the
    # latest, and kept for GRANT_KEEP_S then; the clocks' skew), the id starts afresh, and what the
    # book kept of it is gone.
    forgotten_at = 12.0 + LOST_AFTER_S + GRANT_KEEP_S + CLOCK_SKEW_S + 0.1
    assert placed(book.submit("gw1", "c1", A, 10.0, now=forgotten_at, named=True))[0][1] == 1
    assert len(book._named) == 0  # (what the book remembers, not only what it places)


def test_a_named_call_is_remembered_as_long_as_a_revocation_of_its_grant_may_be_kept() -> None:
    # A grant the book checks late (its owner lost, up to LOST_AFTER_S past the deadline) is
    # revoked at its node then, which keeps the revocation GRANT_KEEP_S past it.
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0, named=True)
    book.done("c1", 1, pb.OK, 1.0, inference_time_s=0.5)
    revocation_kept_until = 10.0 + LOST_AFTER_S + GRANT_KEEP_S
    assert placed(book.submit("gw1", "c1", A, 10.0, now=revocation_kept_until - 0.5, named=True))[0][1] == 2


def test_a_call_id_the_gateway_made_is_not_remembered_once_its_call_ends() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    book.done("c1", 1, pb.OK, 1.0, inference_time_s=0.5)
    assert len(book._named) == 0  # (one per call would grow with the call rate)
    assert placed(book.submit("gw1", "c1", A, 10.0, now=2.0))[0][1] == 1


def test_the_book_forgets_named_call_ids_as_their_time_passes_while_calls_come() -> None:
    book = make_book(slots=4)
    for i in range(8):
        book.submit("gw1", f"n{i}", A, 1.0, now=float(i), named=True)
        book.done(f"n{i}", 1, pb.OK, float(i) + 0.5, inference_time_s=0.5)
    assert len(book._named) == 8
    later = 8.0 + LOST_AFTER_S + GRANT_KEEP_S + CLOCK_SKEW_S + 0.1  # the last one's deadline, and as long
    for i in range(3):  # each arrival forgets up to four whose time passed
        book.submit("gw1", f"u{i}", A, 1.0, now=later + i)
        book.done(f"u{i}", 1, pb.OK, later + i + 0.5, inference_time_s=0.5)
    assert len(book._named) == 0


def test_a_named_call_of_a_long_timeout_holds_back_the_forgetting_of_none_after_it() -> None:
    book = make_book(slots=4)
    book.submit("gw1", "long", A, 3600.0, now=0.0, named=True)  # remembered for over an hour
    book.done("long", 1, pb.OK, 0.5, inference_time_s=0.5)
    for i in range(3):
        book.submit("gw1", f"n{i}", A, 1.0, now=1.0 + i, named=True)
        book.done(f"n{i}", 1, pb.OK, 1.5 + i, inference_time_s=0.5)
    later = 4.0 + LOST_AFTER_S + GRANT_KEEP_S + CLOCK_SKEW_S + 0.1  # past the short ones' times
    book.submit("gw1", "u", A, 1.0, now=later)
    assert len(book._named) == 1  # the long one's alone
    assert placed(book.submit("gw1", "long", A, 10.0, now=later + 1, named=True))[0][1] == 2


def test_a_named_call_refused_at_its_arrival_leaves_the_attempts_of_its_id_remembered() -> None:
    # A Place refused at once (Rejected: nothing is queued) is no call of that id: the attempt the
    # nodes may remember from the call before it must still be placed past.
    big = make_spec("fn-big", memory_mb=100_000)  # fits no GPU here (8000 MiB each)
    book = make_book(A, big)
    book.submit("gw1", "c1", A, 10.0, now=0.0, named=True)
    assert book.done("c1", 1, pb.OK, 1.0, inference_time_s=0.5) == []
    with pytest.raises(Rejected):
        book.submit("gw1", "c1", big, 10.0, now=2.0, named=True)
    assert placed(book.submit("gw1", "c1", A, 10.0, now=3.0, named=True))[0][1] == 2


def test_a_named_lease_is_remembered_as_long_as_its_node_keeps_its_grant() -> None:
    # A node keeps a lease's grant GRANT_KEEP_S past its last call's end plus the lease time
    # (gpu_manager.ledger.lease_call_ended), also where its own call was its only one.
    lease_s = 30.0  # (the most: MAX_CLAIM_S)
    scheduler = make_scheduler("lalb", gpus={N1: 8000}, models={A.model: A.memory_mb}, slots=2)
    book = CallBook(scheduler, claim_s=CLAIM_S, lost_after_s=LOST_AFTER_S, lease_s=lease_s)
    book.submit("gw1", "c0", A, 30.0, now=0.0, lease=True)
    book.done("c0", 1, pb.OK, 0.5, inference_time_s=0.1)
    (hit,) = [
        e for e in book.submit("gw1", "c1", A, 30.0, now=1.0, lease=True, named=True) if isinstance(e, Assignment)
    ]
    assert hit.lease_s == lease_s
    ended_at = 30.0  # its own call ran to near its deadline (31), and the lease ended with it there
    book.done("c1", 1, pb.OK, ended_at, inference_time_s=29.0, lease_ended=True)
    node_keeps_until = ended_at + lease_s + GRANT_KEEP_S
    again = book.submit("gw1", "c1", A, 30.0, now=node_keeps_until - 1.0, named=True)
    assert [e.attempt for e in again if isinstance(e, Assignment)] == [2]


def test_the_attempts_of_a_call_id_used_again_and_again_stay_within_the_wire_s_int32() -> None:
    # Placement.attempt (and Grant's, Done's, Abandon's) is an int32: a call id a client uses
    # without a pause for weeks must not count its attempts past it (the nodes forgot the first
    # ones long before).
    book = make_book()
    book.submit("gw1", "c1", A, 10.0, now=0.0, named=True)
    book.done("c1", 1, pb.OK, 1.0, inference_time_s=0.5)
    book._named._kept["c1"] = (2**31 - 1, 100.0)  # (as after 2**31 calls of c1, each within a minute)
    (attempt,) = [
        e.attempt for e in book.submit("gw1", "c1", A, 10.0, now=2.0, named=True) if isinstance(e, Assignment)
    ]
    assert 0 < attempt <= 2**31 - 1
    pb.Placement(call_id="c1", attempt=attempt)  # (raises ValueError past the int32)


def test_placements_that_never_run_are_bounded() -> None:
    book = make_book()
    attempts = [placed(book.submit("gw1", "c1", A, 600.0, now=0.0))]
    for i in range(MAX_PLACEMENTS - 1):
        attempts.append(placed(book.abandon("gw1", "c1", 0, pb.Abandon.REFUSED, now=1.0 + i)))
    assert [a for ((_, a, _, _, _),) in attempts] == list(range(1, MAX_PLACEMENTS + 1))
    assert [g for ((_, _, g, _, _),) in attempts] == [N1, N2] * (MAX_PLACEMENTS // 2)  # never twice in a row
    assert book.abandon("gw1", "c1", 0, pb.Abandon.REFUSED, now=10.0) == [
        Answer("gw1", "c1", pb.UNAVAILABLE, f"no node could run the call ({MAX_PLACEMENTS} placements)")
    ]
    assert len(book) == 0 and running(book, N1) == running(book, N2) == []


def test_grants_never_presented_are_placed_again_a_bounded_number_of_times() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 600.0, now=0.0)
    now = 0.0
    for attempt in range(1, MAX_PLACEMENTS):
        now += CLAIM_S
        assert book.tick(now) == [CheckGrants("n1", (("c1", attempt),))]
        assert placed(book.grants_checked("n1", [("c1", attempt)], [], now)) == [
            ("c1", attempt + 1, N1, attempt + 1, False)
        ]
    now += CLAIM_S
    assert book.tick(now) == [CheckGrants("n1", (("c1", MAX_PLACEMENTS),))]
    (answer,) = book.grants_checked("n1", [("c1", MAX_PLACEMENTS)], [], now)
    assert answer == Answer(
        "gw1", "c1", pb.UNAVAILABLE, f"the call was placed {MAX_PLACEMENTS} times and never reached a node"
    )
    assert len(book) == 0 and running(book, N1) == []


# --- owner lost -------------------------------------------------------------------------------


def test_a_lost_owner_withdraws_its_queued_calls_and_checks_its_placed_ones() -> None:
    book = make_book(gpus=(N1,), slots=2)
    cache_on(book.scheduler, N1, A.model)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", A, 60.0, now=0.0)
    book.submit("gw1", "c3", B, 60.0, now=0.0)
    book.submit("gw2", "c4", B, 60.0, now=0.0)
    assert queued(book) == ["c3", "c4"]
    assert book.owner_lost("gw1", now=1.0) == [CheckGrants("n1", (("c1", 1),)), CheckGrants("n1", (("c2", 1),))]
    assert queued(book) == ["c4"] and len(book) == 3
    assert book.owner_lost("gw1", now=1.5) == []  # being checked already
    # c1 never reached the node: its slot goes to gw2's call; c2 ran: it keeps its slot.
    assert placed(book.grants_checked("n1", [("c1", 1)], [("c2", 1)], now=2.0)) == [("c4", 1, N1, 3, False)]
    assert sorted(running(book, N1)) == ["c2", "c4"]
    assert cached(book, A) == {N1}  # c1 was a hit: the model stays
    assert book.done("c2", 1, pb.OK, 3.0) == []  # finished without an answer to anyone
    assert len(book) == 1


def test_a_call_asked_again_while_its_lost_owners_placement_is_checked_is_taken_over() -> None:
    # The gateway's link closed before c1's Placement reached it; it dials the same scheduler
    # and asks for c1 again before the node has answered the check of the placement lost with
    # the old link. It is not refused as "in flight": placed again once the node says it never
    # saw the grant.
    book = make_book(gpus=(N1,))
    assert placed(book.submit("gw1", "c1", A, 60.0, now=0.0)) == [("c1", 1, N1, 1, False)]
    assert book.owner_lost("gw1", now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    assert book.submit("gw1-relinked", "c1", A, 60.0, now=1.1) == []  # the check under way decides
    assert placed(book.grants_checked("n1", [("c1", 1)], [], now=1.2)) == [("c1", 2, N1, 2, False)]
    assert book.done("c1", 2, pb.OK, 2.0) == [] and len(book) == 0


def test_a_call_asked_again_after_its_placement_ran_for_a_lost_owner_is_answered_unknown() -> None:
    # Another gateway asks for the same call id (a client's retry with its X-Call-Id) after the
    # first one went away: the first placement ran there (its grant was seen), so the call is
    # not run again; the new owner is answered at once where the node had confirmed it already.
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.owner_lost("gw1", now=1.0)
    assert book.submit("gw2", "c1", A, 60.0, now=1.1) == []
    (answer,) = book.grants_checked("n1", [], [("c1", 1)], now=1.2)
    assert isinstance(answer, Answer) and (answer.owner, answer.status) == ("gw2", OUTCOME_UNKNOWN)
    assert "when it was asked before" in answer.message
    (again,) = book.submit("gw3", "c1", A, 60.0, now=1.3)  # confirmed seen: answered at once
    assert isinstance(again, Answer) and (again.owner, again.status) == ("gw3", OUTCOME_UNKNOWN)
    assert running(book, N1) == ["c1"]  # its slot is the first placement's until its Done
    assert book.done("c1", 1, pb.OK, 2.0) == [] and len(book) == 0


def test_a_taken_over_call_whose_done_comes_before_the_checks_answer_is_answered_at_once() -> None:
    # (Before, the Done forgot it and the check's answer found nothing: its new owner waited out
    # its deadline, then a 504.)
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.owner_lost("gw1", now=1.0)
    assert book.submit("gw2", "c1", A, 60.0, now=1.1) == []
    (answer,) = book.done("c1", 1, pb.OK, 1.2)
    assert isinstance(answer, Answer) and (answer.owner, answer.status) == ("gw2", OUTCOME_UNKNOWN)
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.3) == [] and len(book) == 0


def test_a_call_whose_owner_lost_its_node_is_answered_when_its_done_comes_before_the_check() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0) == [CheckGrants("n1", (("c1", 1),))]
    (answer,) = book.done("c1", 1, pb.OK, 1.2)
    assert isinstance(answer, Answer) and (answer.owner, answer.status) == ("gw1", OUTCOME_UNKNOWN)
    assert "gateway lost its connection" in answer.message


def test_the_new_owners_own_attempt_is_not_said_to_be_the_first_owners() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.owner_lost("gw1", now=1.0)
    book.submit("gw2", "c1", A, 60.0, now=1.1)
    assert placed(book.grants_checked("n1", [("c1", 1)], [], now=1.2)) == [("c1", 2, N1, 2, False)]
    book.abandon("gw2", "c1", 2, pb.Abandon.NODE_UNREACHABLE, now=2.0)
    (answer,) = book.grants_checked("n1", [], [("c1", 2)], now=2.1)
    assert isinstance(answer, Answer) and "when it was asked before" not in answer.message


def test_a_call_id_in_flight_for_an_owner_that_waits_is_refused() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    with pytest.raises(Rejected, match="already in flight"):
        book.submit("gw2", "c1", A, 60.0, now=0.5)
    book.owner_lost("gw1", now=1.0)
    with pytest.raises(Rejected, match="already in flight"):  # another function's call of that id
        book.submit("gw2", "c1", B, 60.0, now=1.1)


def test_an_unseen_grant_of_a_call_still_wanted_is_placed_again() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.tick(CLAIM_S) == [CheckGrants("n1", (("c1", 1),))]
    assert placed(book.grants_checked("n1", [("c1", 1)], [], now=CLAIM_S + 0.1)) == [("c1", 2, N1, 2, False)]
    # The answer about the old attempt, if repeated, is stale.
    assert book.grants_checked("n1", [("c1", 1)], [], now=CLAIM_S + 0.2) == []
    assert book.grants_checked("n1", [], [("c1", 1)], now=CLAIM_S + 0.2) == []
    assert book.tick(CLAIM_S + 0.2) == []  # the new attempt is not due for a check yet
    assert running(book, N1) == ["c1"]


def test_a_miss_never_presented_keeps_the_model_that_a_call_beside_it_uses() -> None:
    # Two slots: c1 misses (admits A), c2 is a hit on the same entry and presents its grant, so
    # the node loads A for it. c1's grant is never presented: its slot is freed, but A is
    # resident there and must stay in the cache (else n1 is overcommitted by A's memory). One
    # GPU: with another idle, c2 would rather load A there than wait for c1 on A's worker.
    book = make_book(gpus=(N1,), slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert placed(book.submit("gw2", "c2", A, 60.0, now=0.1)) == [("c2", 1, N1, 2, True)]
    book.owner_lost("gw1", now=1.0)
    book.grants_checked("n1", [("c1", 1)], [], now=1.5)
    assert running(book, N1) == ["c2"]
    assert cached(book, A) == {N1}
    assert book.scheduler.cache.gpu(N1).is_pinned(A.model)


# --- tick -------------------------------------------------------------------------------------


def test_a_call_queued_past_its_deadline_is_answered_deadline() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 2.0, now=0.0)
    assert book.tick(1.9) == []
    (answer,) = book.tick(2.0)
    assert isinstance(answer, Answer)
    assert (answer.owner, answer.call_id, answer.status) == ("gw1", "c2", pb.DEADLINE)
    assert answer.message == B.deadline_message()
    assert queued(book) == [] and len(book) == 1
    assert book.tick(3.0) == []


def test_unconfirmed_placements_are_checked_once_grouped_by_node() -> None:
    book = make_book(gpus=(N1, "n1/g1", N2))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    book.submit("gw1", "c3", C, 60.0, now=0.0)
    assert book.placed_on("n1") == [("c1", 1), ("c2", 1)] and book.placed_on("n2") == [("c3", 1)]
    book.done("c3", 1, pb.OK, 1.0)
    assert placed(book.submit("gw1", "c4", C, 60.0, now=1.0)) == [("c4", 1, N2, 2, True)]
    assert book.tick(CLAIM_S - 0.01) == []
    assert book.tick(CLAIM_S) == [CheckGrants("n1", (("c1", 1), ("c2", 1)))]
    assert book.tick(CLAIM_S + 0.5) == []  # being checked
    assert book.tick(CLAIM_S + 1.0) == [CheckGrants("n2", (("c4", 1),))]
    assert book.tick(CLAIM_S + 2.0) == []


def test_a_placed_call_with_no_done_long_after_its_deadline_is_presumed_lost() -> None:
    book = make_book(gpus=(N1,), slots=2)
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    book.submit("gw1", "c2", A, 10.0, now=0.0)
    book.submit("gw1", "c3", B, 60.0, now=0.0)  # waits for a slot
    assert book.tick(CLAIM_S) == [CheckGrants("n1", (("c1", 1), ("c2", 1)))]
    assert book.grants_checked("n1", [], [("c1", 1), ("c2", 1)], now=CLAIM_S) == []
    assert placed(book.done("c2", 1, pb.OK, 6.0)) == [("c3", 1, N1, 3, False)]
    assert book.grants_checked("n1", [], [("c3", 1)], now=6.0) == []
    book.dirty_models.clear()
    assert book.tick(10.0 + LOST_AFTER_S - 0.01) == []
    (answer,) = book.tick(10.0 + LOST_AFTER_S)
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c1", pb.DEADLINE)
    assert running(book, N1) == ["c3"]
    assert cached(book, A) == set()  # the node timed it out: its worker was killed
    assert book.dirty_models == {A.model}
    assert len(book) == 1


def test_a_lost_call_frees_its_slot_for_a_queued_one() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 10.0, now=0.0)
    book.submit("gw2", "c2", B, 60.0, now=1.0)
    book.grants_checked("n1", [], [("c1", 1)], now=1.0)
    effects = book.tick(10.0 + LOST_AFTER_S)
    assert isinstance(effects[0], Answer) and effects[0].call_id == "c1"
    assert placed(effects[1:]) == [("c2", 1, N1, 2, False)]


# --- nodes ------------------------------------------------------------------------------------


def test_calls_placed_on_gpus_that_left_wait_for_their_owner_to_say_whether_it_sent_them() -> None:
    book = make_book(slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", C, 60.0, now=0.0)
    book.submit("gw2", "c3", B, 60.0, now=0.0)
    assert sorted(running(book, N1)) == ["c1", "c2"] and running(book, N2) == ["c3"]
    book.dirty_gpus.clear()
    book.dirty_models.clear()
    # n1 left: its placed calls are not placed again by themselves (they may be running there:
    # it may be cut off, not dead), nor answered: their owner says whether it sent them.
    assert book.gpus_removed([N1], now=1.0) == []
    assert queued(book) == [] and running(book, N2) == ["c3"] and len(book) == 3
    assert A.model in book.dirty_models and N1 not in book.dirty_gpus
    assert book.placed_on("n1") == [] and book.placed_on("n2") == [("c3", 1)]
    # c1's Execute was never sent (no connection to n1): placed again, where there is room.
    assert placed(book.abandon("gw1", "c1", 1, pb.Abandon.REFUSED, now=1.5)) == [("c1", 2, N2, 2, False)]
    # c2's was, before the gateway lost n1: whether it ran is unknown, and it is not run again.
    (answer,) = book.abandon("gw1", "c2", 1, pb.Abandon.NODE_UNREACHABLE, now=1.6)
    assert isinstance(answer, Answer) and (answer.owner, answer.call_id, answer.status) == (
        "gw1",
        "c2",
        OUTCOME_UNKNOWN,
    )
    assert "cannot say whether it started it" in answer.message
    assert book.abandon("gw1", "c2", 1, pb.Abandon.NODE_UNREACHABLE, now=1.7)[0].status == OUTCOME_UNKNOWN  # type: ignore[union-attr]
    assert len(book) == 2 and book.placed_on("n2") == [("c1", 2), ("c3", 1)]


def test_a_stranded_call_waits_for_a_slot_when_none_is_free() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.submit("gw1", "c2", B, 60.0, now=0.0)
    assert book.gpus_removed([N1], now=1.0) == []
    assert book.abandon("gw1", "c1", 0, pb.Abandon.REFUSED, now=1.1) == []
    assert queued(book) == ["c1"]
    assert placed(book.done("c2", 1, pb.OK, 2.0)) == [("c1", 2, N2, 2, False)]


def test_a_stranded_call_whose_worker_died_is_placed_again_as_its_retry() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)  # on n1
    book.submit("gw1", "c2", A, 60.0, now=0.0)  # on n2
    assert book.gpus_removed([N1], now=1.0) == []
    # The Done on its way from n1: the worker died, and the gateway, told so by the node, waits
    # for the retry (before, the call was forgotten and its gateway waited out its deadline).
    assert book.done("c1", 1, pb.WORKER_DIED, now=1.5) == []  # n2's one slot is c2's
    assert queued(book) == ["c1"]
    assert placed(book.done("c2", 1, pb.OK, now=2.0)) == [("c1", 2, N2, 2, True)]  # a hit there
    # A second death is its answer, as for a call placed on a GPU that stayed.
    (answer,) = book.done("c1", 2, pb.WORKER_DIED, now=2.5)
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c1", pb.UNAVAILABLE)
    assert len(book) == 0


def test_a_stranded_call_whose_worker_died_a_second_time_is_answered() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.done("c1", 1, pb.WORKER_DIED, now=0.5)  # placed again, on n2 (away from n1)
    assert book.placed_on("n2") == [("c1", 2)]
    assert book.gpus_removed([N2], now=1.0) == []
    (answer,) = book.done("c1", 2, pb.WORKER_DIED, now=1.5)
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c1", pb.UNAVAILABLE)
    assert len(book) == 0


def test_parked_calls_on_a_gpu_that_left_go_back_to_the_queue() -> None:
    book = make_book()
    cache_on(book.scheduler, N1, A.model, B.model)
    book.submit("gw1", "c1", B, 60.0, now=0.0)  # a hit on n1
    assert book.submit("gw1", "c2", A, 60.0, now=0.0) == []  # parked on n1, behind c1
    assert [r.request_id for r in book.scheduler.gpu(N1).local_queue] == ["c2"]
    # Never placed: it is placed at once on the GPU left, c1 waits for its owner's word.
    assert placed(book.gpus_removed([N1], now=1.0)) == [("c2", 1, N2, 1, False)]
    assert len(book) == 2


def test_a_stranded_call_is_forgotten_at_its_done_its_owners_departure_or_its_deadline() -> None:
    book = make_book(gpus=(N1,), slots=3)
    for call_id in ("c1", "c2", "c3"):
        book.submit("gw1", call_id, A, 10.0, now=0.0)
    book.gpus_removed([N1], now=1.0)
    assert len(book) == 3 and queued(book) == []
    # A Done that was on its way (the node finished it): the owner has its answer, or will ask.
    assert book.done("c1", 1, pb.OK, now=1.5) == []
    assert book.abandon("gw1", "c3", 0, pb.Abandon.CANCELLED, now=1.6) == []
    assert len(book) == 1
    assert book.tick(9.9) == []
    (answer,) = book.tick(10.0)
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c2", pb.DEADLINE)
    assert len(book) == 0


def test_a_call_whose_node_is_being_asked_is_answered_if_the_node_leaves_before_it_answers() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.abandon("gw1", "c1", 1, pb.Abandon.NODE_UNREACHABLE, now=1.0)
    (answer,) = book.gpus_removed([N1], now=1.5)
    assert isinstance(answer, Answer) and (answer.call_id, answer.status) == ("c1", OUTCOME_UNKNOWN)
    assert len(book) == 0 and queued(book) == [] and running(book, N2) == []


def test_a_withdrawn_call_on_a_gpu_that_left_is_forgotten() -> None:
    book = make_book()
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.abandon("gw1", "c1", 0, pb.Abandon.CANCELLED, now=0.5)
    assert book.gpus_removed([N1], now=1.0) == []
    assert len(book) == 0 and queued(book) == [] and running(book, N2) == []


def test_reconcile_drops_phantoms_adopts_workers_that_fit_and_evicts_the_rest() -> None:
    big = make_spec("fn-big", memory_mb=3000)
    book = make_book(A, B, C, big, gpus=(N1,), memory_mb=4000, slots=2)
    cache_on(book.scheduler, N1, C.model)  # believed resident, not reported: a phantom
    book.submit("gw1", "c1", A, 60.0, now=0.0)  # runs: its model is kept though not reported yet
    book.dirty_models.clear()
    book.dirty_gpus.clear()
    resident = {B.model: 1000, big.model: 3000}
    # Evicted only if still idle: a grant after this one (gpu_seq 1, c1's) may use it again.
    assert book.reconcile(N1, resident, now=1.0) == [Evict(N1, (big.model,), if_idle=True, gpu_seq=1)]
    cache = book.scheduler.cache.gpu(N1)
    assert set(cache) == {A.model, B.model}
    assert cache.free_mb == 2000
    assert book.dirty_models == {C.model, B.model} and book.dirty_gpus == {N1}
    # Reporting the same again changes nothing more.
    assert book.reconcile(N1, {A.model: 1000, B.model: 1000}, now=2.0) == []
    assert set(cache) == {A.model, B.model}


def test_reconcile_keeps_a_model_pinned_by_a_parked_call() -> None:
    book = make_book()
    cache_on(book.scheduler, N1, A.model, B.model)
    book.submit("gw1", "c1", B, 60.0, now=0.0)  # a hit on n1, done at t=1
    # n2 is idle, but waiting 1 s for n1 beats loading A there (2 s): parked on n1.
    assert book.submit("gw1", "c2", A, 60.0, now=0.0) == []
    assert [r.request_id for r in book.scheduler.gpu(N1).local_queue] == ["c2"]
    assert book.reconcile(N1, {B.model: 1000}, now=0.5) == []
    assert cached(book, A) == {N1}
    assert placed(book.done("c1", 1, pb.OK, 1.0)) == [("c2", 1, N1, 2, True)]


def test_claim_by_is_the_latest_claim_time_of_the_placed_calls_it_is_asked_about() -> None:
    book = make_book()
    book.submit("gw", "c1", A, 30.0, 10.0)
    book.submit("gw", "c2", A, 2.0, 11.0)  # its deadline (13 s) comes before its claim time (16 s)
    book.submit("gw", "c3", A, 30.0, 12.0)  # queued: both GPUs are busy, so it has no claim time
    assert book.claim_by([("c1", 1), ("c2", 1)]) == 10.0 + CLAIM_S
    assert book.claim_by([("c2", 1)]) == 13.0
    assert book.claim_by([("c3", 1), ("gone", 1)]) == 0.0


def test_a_retired_model_is_evicted_where_unused_and_where_used_once_its_calls_finish() -> None:
    book = make_book(gpus=(N1, N2), slots=2)
    cache_on(book.scheduler, N2, A.model)
    book.submit("gw1", "c1", A, 60.0, now=0.0)  # a hit on N2: A is pinned there while it runs
    cache_on(book.scheduler, N1, A.model)  # another replica, idle
    assert running(book, N2) == ["c1"]
    assert book.retire(A.model) == [Evict(N1, (A.model,))]
    assert cached(book, A) == {N2}
    assert book.done("c1", 1, pb.OK, now=1.0, inference_time_s=0.5) == [Evict(N2, (A.model,))]
    assert cached(book, A) == set()
    assert A.model in book.dirty_models and {N1, N2} <= book.dirty_gpus


def test_a_revived_model_is_kept() -> None:
    book = make_book(gpus=(N1,), slots=2)
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    assert book.retire(A.model) == []  # in use
    book.revive(A.model)  # deployed again with the same package meanwhile
    assert book.done("c1", 1, pb.OK, now=1.0, inference_time_s=0.5) == []
    assert cached(book, A) == {N1}


def test_reconcile_evicts_a_retired_model_a_node_still_reports() -> None:
    book = make_book(gpus=(N1,), slots=2)
    cache_on(book.scheduler, N1, A.model)
    assert book.retire(A.model) == [Evict(N1, (A.model,))]
    # The node reported before its evict finished: the model is not taken back into the cache.
    assert book.reconcile(N1, {A.model: 1000}, now=1.0) == [Evict(N1, (A.model,), if_idle=True)]
    assert cached(book, A) == set()


def test_reconcile_adopts_no_worker_of_a_model_no_function_runs() -> None:
    """A worker whose model this scheduler never heard of (a version older than its start, or a
    model named as an older gpufaas named them) is stopped, on a GPU and in a host tier, though it
    fits: no call would use it."""
    book = book_on_node(A, host_mb=4000)
    unknown = make_spec("fn-gone").model  # not registered
    assert book.reconcile(N1, {A.model: 1000, unknown: 1000}, now=1.0) == [Evict(N1, (unknown,), if_idle=True)]
    assert cached(book, A) == {N1}
    assert book.reconcile_host("n1", 4000, {unknown: 1000}) == [EvictHost("n1", (unknown,))]


# --- the host tier and the staged exit ----------------------------------------------------------


def book_on_node(*specs: FunctionSpec, host_mb: int = 0) -> CallBook:
    """A book over one GPU, N1, of node "n1" (with a host tier of `host_mb`)."""
    book = make_book(*specs, gpus=())
    book.scheduler.add_gpu(GpuSpec(N1, 8000, node="n1"))
    if host_mb:
        book.scheduler.add_host("n1", host_mb)
    return book


def test_reconcile_host_follows_the_nodes_tier_adopting_what_fits_and_stopping_the_rest() -> None:
    book = book_on_node(A, B, C)
    cache = book.scheduler.cache
    # The node keeps a 2500 MB tier the scheduler did not know of: made, and A, B adopted.
    parked = {A.model: 1000, B.model: 1000, C.model: 1000}
    assert book.reconcile_host("n1", 2500, parked) == [EvictHost("n1", (C.model,))]
    assert cache.host("n1") is not None and cache.host("n1").lru_list() == [B.model, A.model]  # type: ignore[union-attr]
    assert cache.in_host(A.model, N1)
    # A left the node's tier (pushed out there): it leaves the scheduler's too.
    assert book.reconcile_host("n1", 2500, {B.model: 1000}) == []
    assert not cache.in_host(A.model, N1) and cache.in_host(B.model, N1)
    # A model no function runs any more is stopped, not adopted.
    book.retire(C.model)
    assert book.reconcile_host("n1", 2500, {B.model: 1000, C.model: 1000}) == [EvictHost("n1", (C.model,))]
    # The node restarted without a tier: the scheduler's goes.
    assert book.reconcile_host("n1", 0, {}) == []
    assert cache.host("n1") is None and not cache.in_host(B.model, N1)


def test_reconcile_host_charges_every_entry_what_the_node_measured_before_pushing_any_out() -> None:
    # A and B entered the tier charged their declared 1000 MB; the node measured 1500 and 400
    # (1900 of its 2000). Re-charged one at a time, A's new charge beside B's old one came to
    # 2500: A, the oldest, was pushed out and stopped at the node, though the two fit together.
    book = book_on_node(A, B, host_mb=2000)
    cache = book.scheduler.cache
    cache_on(book.scheduler, N1, A.model, B.model)
    assert cache.release(N1, A.model) and cache.release(N1, B.model)
    assert book.reconcile_host("n1", 2000, {A.model: 1500, B.model: 400}) == []
    host = cache.host("n1")
    assert host is not None and host.lru_list() == [B.model, A.model] and host.used_mb == 1900


def test_a_miss_takes_a_model_back_from_the_host_tier_the_node_reported() -> None:
    book = book_on_node(A, B, host_mb=4000)
    book.reconcile_host("n1", 4000, {A.model: 1000})
    assert book.scheduler.load_time_s(A.model, N1) < LOAD_S / 10  # a swap-in, not a load
    assert book.scheduler.load_time_s(B.model, N1) == pytest.approx(LOAD_S)
    (assignment,) = book.submit("gw", "c1", A, 60.0, now=0.0)
    assert isinstance(assignment, Assignment) and not assignment.hit
    assert not book.scheduler.cache.in_host(A.model, N1)  # on the GPU now


def test_release_idle_moves_an_idle_model_to_the_host_tier_then_out_naming_the_gpus_latest_grant() -> None:
    book = book_on_node(A, B, host_mb=4000)
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))
    book.done("c1", 1, pb.OK, 1.0)
    placed(book.submit("gw", "c2", A, 60.0, now=2.0))
    book.done("c2", 1, pb.OK, 3.0)
    book.dirty_models.clear()
    book.dirty_gpus.clear()
    assert book.release_idle(5.5, gpu_idle_s=3.0, host_idle_s=None) == []  # idle since its call ended at 3.0
    assert book.release_idle(6.5, gpu_idle_s=3.0, host_idle_s=None) == [
        Evict(N1, (A.model,), to_host=True, if_idle=True, gpu_seq=2)
    ]
    assert not book.scheduler.cache.is_cached(A.model, N1) and book.scheduler.cache.in_host(A.model, N1)
    assert book.dirty_models == {A.model} and book.dirty_gpus == {N1}
    assert book.release_idle(16.0, gpu_idle_s=3.0, host_idle_s=10.0) == []
    assert book.release_idle(16.5, gpu_idle_s=3.0, host_idle_s=10.0) == [EvictHost("n1", (A.model,))]
    assert not book.scheduler.cache.in_host(A.model, N1)


def test_a_worker_adopted_after_its_phantom_entry_went_is_idle_from_its_adoption() -> None:
    # The dropped phantom's idle clock stayed behind: the worker adopted 98 s later was released
    # at the next check, as if idle since its last call before the drop.
    book = book_on_node(A)
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))
    book.done("c1", 1, pb.OK, 1.0)
    assert book.reconcile(N1, {}, now=2.0) == []  # no worker reported: the entry goes
    assert book.reconcile(N1, {A.model: 1000}, now=100.0) == []  # its worker reported: adopted
    assert book.scheduler.cache.is_cached(A.model, N1)
    assert book.release_idle(100.5, gpu_idle_s=30.0, host_idle_s=None) == []
    assert book.release_idle(131.0, gpu_idle_s=30.0, host_idle_s=None) == [
        Evict(N1, (A.model,), to_host=False, if_idle=True, gpu_seq=1)
    ]


def test_release_idle_without_a_host_tier_stops_the_idle_worker() -> None:
    book = book_on_node(A)
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))
    book.done("c1", 1, pb.OK, 1.0)
    assert book.release_idle(9.0, gpu_idle_s=5.0, host_idle_s=5.0) == [
        Evict(N1, (A.model,), to_host=False, if_idle=True, gpu_seq=1)
    ]


def test_reconcile_host_leaves_alone_a_model_a_grant_took_back_onto_a_gpu_of_the_node() -> None:
    book = book_on_node(A, host_mb=4000)
    book.reconcile_host("n1", 4000, {A.model: 1000})
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))  # a swap-in: A leaves the tier for N1
    # The node's next report predates c1's Execute and still lists A parked: not adopted back
    # (the tiers are exclusive), and not stopped (c1 is about to take it back).
    assert book.reconcile_host("n1", 4000, {A.model: 1000}) == []
    assert not book.scheduler.cache.in_host(A.model, N1) and book.scheduler.cache.is_cached(A.model, N1)


def test_a_stranded_call_never_sent_waits_for_a_gpu_when_none_is_left() -> None:
    book = make_book(gpus=(N1,))
    book.submit("gw1", "c1", A, 60.0, now=0.0)
    book.gpus_removed([N1], now=1.0)
    assert book.abandon("gw1", "c1", 1, pb.Abandon.REFUSED, now=1.5) == []  # WAITING, not refused
    assert len(book) == 1 and queued(book) == []
    book.scheduler.add_gpu(GpuSpec(N1, 8000, slots=1, node="n1"))  # its node attached again
    assert placed(book.schedule(2.0)) == [("c1", 2, N1, 2, False)]  # (grants on n1/g0 go on counting)


# --- a term's end (scheduler.node_links) --------------------------------------------------------


def test_a_term_that_ends_takes_every_gpu_out_at_once_and_places_nothing_meanwhile() -> None:
    """Node by node, the call parked on n1 would be placed on n2 (idle) before n2 is taken out
    too: wasted work, in the thousands of calls for a long queue at a step-down."""
    book = make_book(A)
    cache_on(book.scheduler, N1, A.model)
    first = placed(book.submit("gw", "c1", A, 60.0, 0.0))
    assert first == [("c1", 1, N1, 1, True)]
    assert book.submit("gw", "c2", A, 60.0, 0.0) == []  # parked behind c1: waiting beats loading
    assert [r.request_id for r in book.scheduler.gpu(N1).local_queue] == ["c2"]
    applied: list[Effect] = []
    links = NodeLinks(
        book.scheduler,
        book,
        StatePersister(MemoryStore(), Keys("/t"), book.scheduler, book, lambda: 0.0),
        functions={},
        apply=applied.extend,
        spawn=lambda coroutine: coroutine.close(),
        session_for=lambda node: pytest.fail("nothing is linked here"),
        slots_for=lambda gpu_type: 1,
        clock=lambda: 1.0,
        wire_key=None,
        prestage_nodes=0,
    )
    for gpu_id in (N1, N2):
        node = gpu_id.split("/")[0]
        record = NodeRecord(node, f"{node}:7001", "cpu", "i1", [GpuRecord("g0", 8000, "cpu")])
        links.nodes[node] = NodeLink(record, gpu_ids=[gpu_id])

    links.deactivate()

    assert not any(isinstance(effect, Assignment) for effect in applied), applied
    assert book.scheduler.cache.num_gpus == 0
    assert queued(book) == ["c2"]  # the next term's to place; c1 (sent) is stranded


def test_a_retired_model_goes_when_its_last_call_is_answered_without_a_done() -> None:
    # Its call pinned it when its function was updated; the node then refused the grant near the
    # deadline (no retry): the call is answered with no Done, and the old version must still go.
    book = make_book(gpus=(N1,), slots=1)
    cache_on(book.scheduler, N1, A.model)
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))
    assert book.retire(A.model) == []  # in use: evicted once its call ends
    effects = book.abandon("gw", "c1", 1, pb.Abandon.REFUSED, now=61.0)
    assert Evict(N1, (A.model,)) in effects and cached(book, A) == set()


def test_a_retired_model_goes_when_its_refused_call_is_then_given_up() -> None:
    # Refused at N1, placed again elsewhere (queued: N2 is busy), then given up by its client.
    book = make_book(gpus=(N1, N2), slots=1)
    cache_on(book.scheduler, N1, A.model)
    cache_on(book.scheduler, N2, B.model)
    placed(book.submit("gw", "c0", B, 600.0, now=0.0))  # a long call holds N2
    assert placed(book.submit("gw", "c1", A, 60.0, now=0.0)) == [("c1", 1, N1, 1, True)]
    assert book.retire(A.model) == []
    book.abandon("gw", "c1", 1, pb.Abandon.REFUSED, now=1.0)  # placed again, not on N1
    effects = book.abandon("gw", "c1", 0, pb.Abandon.CANCELLED, now=2.0)
    assert Evict(N1, (A.model,)) in effects and cached(book, A) == set()


def test_reconcile_stops_a_retired_model_the_cache_still_holds() -> None:
    # The reconciler's pass stops what no call uses of a model no function runs, however it got
    # left (here by hand: retired while cached, its eviction never applied).
    book = make_book(gpus=(N1,), slots=1)
    cache_on(book.scheduler, N1, A.model)
    book._retired.add(A.model)
    effects = book.reconcile(N1, {A.model: 1000}, now=70.0)
    assert cached(book, A) == set()
    assert [e for e in effects if isinstance(e, Evict)] == [Evict(N1, (A.model,), if_idle=True, gpu_seq=0)]


def test_retire_stops_the_copy_parked_in_a_host_tier() -> None:
    book = book_on_node(A, B, host_mb=4000)
    placed(book.submit("gw", "c1", A, 60.0, now=0.0))
    book.done("c1", 1, pb.OK, 1.0, inference_time_s=0.5)
    book.release_idle(10.0, gpu_idle_s=3.0, host_idle_s=None)  # A parked in n1's host tier
    assert book.scheduler.cache.in_host(A.model, N1)
    assert book.retire(A.model) == [EvictHost("n1", (A.model,))]
    assert not book.scheduler.cache.in_host(A.model, N1)
