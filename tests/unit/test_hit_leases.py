"""Hit leases (docs/hit-leases.md), layer by layer: the call book grants them and takes them back
(scheduler.calls), the node's ledger admits calls under them (gpu_manager.ledger), the gateway
holds them (gateway.leases), the simulator models them (simulator.engine)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from gateway.leases import USABLE_SHARE, Leases
from gpu_manager.ledger import GrantLedger, Refused
from gpufaas import grants
from gpufaas.functions import FunctionSpec
from gpufaas.profiles import ModelProfile
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import Request
from scheduler import PolicyConfig, make_policy
from scheduler.adaptive_slots import AdaptiveSlots
from scheduler.calls import DEFAULT_CLAIM_S, Answer, Assignment, CallBook, CheckGrants, Effect, Evict
from scheduler.policies.torpor import TorporPolicy
from simulator.engine import ClusterConfig, Meter, SimResult, _make_scheduler, _Run, simulate
from simulator.workload import Workload
from tests.builders import make_scheduler

LEASE_S = 1.0
N1, N2 = "n1/g0", "n2/g0"


def spec(name: str) -> FunctionSpec:
    return FunctionSpec(name=name, package_digest="sha256:" + hashlib.sha256(name.encode()).hexdigest(), memory_mb=1000)


A, B, C, D, E = spec("fn-a"), spec("fn-b"), spec("fn-c"), spec("fn-d"), spec("fn-e")


def make_book(
    *, gpus: tuple[str, ...] = (N1, N2), slots: int = 1, lease_s: float = LEASE_S, memory_mb: int = 8000
) -> CallBook:
    scheduler = make_scheduler(
        "lalb",
        gpus={gpu: memory_mb for gpu in gpus},
        models={s.model: s.memory_mb for s in (A, B, C, D, E)},
        slots=slots,
    )
    return CallBook(scheduler, claim_s=5.0, lost_after_s=5.0, lease_s=lease_s)


def assignment(effects: list[Effect]) -> Assignment:
    (effect,) = effects
    assert isinstance(effect, Assignment), effects
    return effect


def leased_hit(book: CallBook, call_id: str = "c1", now: float = 1.0) -> Assignment:
    """A hit of A placed with a lease: A loaded on N1 by an earlier call first."""
    first = assignment(book.submit("gw1", "c0", A, 30.0, now=0.0, lease=True))
    assert not first.hit and first.lease_s == 0.0  # a miss is never leased
    assert book.done("c0", 1, pb.OK, now=0.5, inference_time_s=0.1) == []
    hit = assignment(book.submit("gw1", call_id, A, 30.0, now=now, lease=True))
    assert hit.hit and hit.gpu_id == N1
    return hit


def running(book: CallBook, gpu_id: str) -> list[str]:
    return list(book.scheduler.gpu(gpu_id).running)


# --- the call book ------------------------------------------------------------------------------


def test_a_hit_placed_while_nothing_waits_is_a_lease_and_calls_under_it_keep_the_slot() -> None:
    book = make_book()
    hit = leased_hit(book)
    assert hit.lease_s == LEASE_S
    estimator = book.scheduler.estimator
    # Its own call, then two more under the lease: each Done is a use, the slot stays the lease's.
    for index, inference_s in enumerate((0.2, 0.3, 0.4)):
        assert book.done("c1", 1, pb.OK, now=1.1 + index / 10, inference_time_s=inference_s) == []
        assert running(book, N1) == ["c1"]
    assert estimator.inference_time_s(A.model, "rtx2080", A.batch_size) != pytest.approx(1.0)  # it learnt them
    assert (A.model, A.batch_size) in {(m, b) for _, m, b in book.dirty_profiles}
    assert len(book) == 1  # nobody is answered for it: the node answered its gateway


def test_adaptive_d_reads_an_idle_lease_as_an_idle_slot_not_a_running_call() -> None:
    # N1 (D 2 of at most 2) holds a lease whose own call ended at 1.1; no call comes under it. Its
    # slot is still the lease's running request, but nothing runs there: D stays at 2. (Counted as
    # a running call, the idle lease read as a GPU busy all the time and took D down to 1.)
    book = make_book(gpus=(N1,), slots=2)
    book.adaptive_slots = AdaptiveSlots(2, period_s=0.2)
    assignment(book.submit("gw1", "c0", A, 30.0, now=0.0, lease=True))
    book.done("c0", 1, pb.OK, now=0.5)
    assert assignment(book.submit("gw1", "c1", A, 30.0, now=1.0, lease=True)).lease_s == LEASE_S
    assert book.done("c1", 1, pb.OK, now=1.1, inference_time_s=0.1) == []
    for step in range(6):
        book.observe_utilization(1.1 + step * 0.2)
    assert running(book, N1) == ["c1"] and book.scheduler.gpu(N1).spec.slots == 2


def test_no_lease_for_an_owner_that_takes_none_nor_when_no_gpu_would_keep_a_free_slot() -> None:
    book = make_book()
    assignment(book.submit("gw1", "c0", A, 30.0, now=0.0))
    book.done("c0", 1, pb.OK, now=0.5)
    assert assignment(book.submit("gw1", "c1", A, 30.0, now=1.0)).lease_s == 0.0  # lease=False
    lone = make_book(gpus=(N1,))
    assignment(lone.submit("gw1", "c0", A, 30.0, now=0.0, lease=True))
    lone.done("c0", 1, pb.OK, now=0.5)
    # The only slot: leased, the next arrival would queue behind a lease its gateway may not use.
    assert assignment(lone.submit("gw1", "c1", A, 30.0, now=1.0, lease=True)).lease_s == 0.0
    # Two slots: the first hit is leased, the second would leave none free for other models there.
    pair = make_book(gpus=(N1,), slots=2)
    assignment(pair.submit("gw1", "c0", A, 30.0, now=0.0, lease=True))
    pair.done("c0", 1, pb.OK, now=0.5)
    assert assignment(pair.submit("gw1", "c1", A, 30.0, now=1.0, lease=True)).lease_s == LEASE_S
    assert assignment(pair.submit("gw1", "c2", A, 30.0, now=1.1, lease=True)).lease_s == 0.0


def test_a_wait_no_lease_holds_up_keeps_leases_back_for_a_lease_time() -> None:
    book = make_book(gpus=(N1, N2))
    assignment(book.submit("gw1", "c0", A, 30.0, now=0.0))
    book.done("c0", 1, pb.OK, now=0.5)
    assignment(book.submit("gw1", "c1", A, 30.0, now=1.0))  # a hit on N1, not leased (its owner takes none)
    assignment(book.submit("gw2", "c2", B, 30.0, now=1.1))  # on N2
    assert book.submit("gw2", "c3", C, 30.0, now=1.2) == []  # c3 waits: every slot runs a call
    book.done("c1", 1, pb.OK, now=1.3)  # c3 runs on N1
    book.done("c3", 1, pb.OK, now=1.4)
    book.done("c2", 1, pb.OK, now=1.5)
    # Calls waited at 1.2: a hit within a lease time of it is placed without a lease, one after with.
    assert assignment(book.submit("gw1", "c4", A, 30.0, now=1.2 + LEASE_S - 0.1, lease=True)).lease_s == 0.0
    book.done("c4", 1, pb.OK, now=2.15)
    assert assignment(book.submit("gw1", "c5", A, 30.0, now=1.2 + LEASE_S, lease=True)).lease_s == LEASE_S


def test_a_wait_that_ending_leases_clears_does_not_keep_leases_back() -> None:
    book = make_book(gpus=(N1, N2))
    leased_hit(book, now=1.0)  # A leased on N1, idle once its call is done
    book.done("c1", 1, pb.OK, now=1.05)
    assignment(book.submit("gw2", "c2", B, 30.0, now=1.1))  # on N2
    assert book.submit("gw2", "c3", C, 30.0, now=1.2) == [CheckGrants("n1", (("c1", 1),))]  # c3 waits on the lease
    effects = book.grants_checked("n1", [], [("c1", 1)], now=1.3)
    assert [(e.call_id, e.gpu_id) for e in effects if isinstance(e, Assignment)] == [("c3", N1)]
    book.done("c3", 1, pb.OK, now=1.4)
    book.done("c2", 1, pb.OK, now=1.45)
    # The wait was the lease's doing, and it ended: the next hit is leased at once (on a memory-
    # pressed cluster every miss that must evict a leased model is such a wait).
    assert assignment(book.submit("gw1", "c4", A, 30.0, now=1.5, lease=True)).lease_s == LEASE_S


def test_a_wait_that_outlasts_the_leases_it_ended_keeps_leases_back_from_then() -> None:
    book = make_book(gpus=(N1, N2))
    leased_hit(book, now=1.0)
    book.done("c1", 1, pb.OK, now=1.05)
    assignment(book.submit("gw2", "c2", B, 30.0, now=1.1))  # on N2
    book.submit("gw2", "c3", C, 30.0, now=1.2)  # waits; the lease on N1 ends
    book.submit("gw2", "c4", D, 30.0, now=1.21)  # waits too
    book.grants_checked("n1", [], [("c1", 1)], now=1.3)  # c3 runs on N1; c4 still waits, no lease left
    book.done("c3", 1, pb.OK, now=1.4)  # c4 runs on N1
    book.done("c4", 1, pb.OK, now=1.5)
    book.done("c2", 1, pb.OK, now=1.6)
    assert assignment(book.submit("gw1", "c5", A, 30.0, now=1.3 + LEASE_S - 0.1, lease=True)).lease_s == 0.0
    book.done("c5", 1, pb.OK, now=2.25)
    assert assignment(book.submit("gw1", "c6", A, 30.0, now=1.31 + LEASE_S, lease=True)).lease_s == LEASE_S


def test_a_wait_on_running_calls_counts_though_a_busy_lease_is_still_ending() -> None:
    book = make_book(gpus=(N1, N2), slots=2)
    leased_hit(book, now=1.0)  # A leased on N1 (one slot stays free there)
    book.done("c1", 1, pb.OK, now=1.05)  # gw1 runs its next call under the lease at n1
    for call_id, fn in (("b1", B), ("c2", C), ("d1", D)):  # calls of a gateway that takes none fill the rest
        assignment(book.submit("gw2", call_id, fn, 30.0, now=1.1))
    assert book.submit("gw2", "e1", B, 30.0, now=1.2) == [CheckGrants("n1", (("c1", 1),))]
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.21, busy=[("c1", 1)]) == []
    book.done("c2", 1, pb.OK, now=1.3)  # e1 runs on N2: the wait ended with a call, not the lease
    for call_id, at in (("b1", 1.4), ("d1", 1.45), ("e1", 1.5)):
        book.done(call_id, 1, pb.OK, now=at)
    assert assignment(book.submit("gw1", "g1", C, 30.0, now=1.3 + LEASE_S - 0.1, lease=True)).lease_s == 0.0


def test_a_miss_that_waits_for_room_ends_only_the_lease_whose_model_makes_it() -> None:
    # GPUs of two models each, all four leased: a miss of E finds nothing it may evict.
    book = make_book(gpus=(N1, N2), slots=3, memory_mb=2000)
    where = four_leases(book)
    assert sorted(where.values()) == sorted([N1, N1, N2, N2])
    # Only A's lease ends (the least recently used, and its GPU has a free slot): not the other
    # three, whose gateways keep sending their calls straight to the node.
    node = where["fn-a"].split("/")[0]
    assert book.submit("gw2", "e1", E, 30.0, now=1.5) == [CheckGrants(node, (("fn-a-1", 1),))]
    assert book.tick(now=1.55) == []  # nothing more is ended while that answer is awaited
    effects = book.grants_checked(node, [], [("fn-a-1", 1)], now=1.6)
    (placed,) = [e for e in effects if isinstance(e, Assignment)]
    assert (placed.call_id, placed.gpu_id, placed.evict) == ("e1", where["fn-a"], (A.model,))
    assert sorted(book._leases) == ["fn-b-1", "fn-c-1", "fn-d-1"]
    # That wait was the lease's doing: E's next hit is leased at once.
    book.done("e1", 1, pb.OK, now=1.7)
    assert assignment(book.submit("gw2", "e2", E, 30.0, now=1.8, lease=True)).lease_s == LEASE_S


def four_leases(book: CallBook) -> dict[str, str]:
    """Models A to D loaded and each leased by a gateway of its own ("gw-fn-a", ...): where each is."""
    for index, fn in enumerate((A, B, C, D)):
        assignment(book.submit("gw1", f"{fn.name}-0", fn, 30.0, now=index / 10))
        book.done(f"{fn.name}-0", 1, pb.OK, now=index / 10 + 0.05)
    where = {}
    for index, fn in enumerate((A, B, C, D)):
        hit = assignment(book.submit(f"gw-{fn.name}", f"{fn.name}-1", fn, 30.0, now=1.0 + index / 10, lease=True))
        assert hit.hit and hit.lease_s == LEASE_S
        book.done(f"{fn.name}-1", 1, pb.OK, now=1.05 + index / 10)
        where[fn.name] = hit.gpu_id
    return where


def test_a_lease_its_node_answers_busy_is_a_running_call_and_the_next_one_is_ended_for_the_wait() -> None:
    book = make_book(gpus=(N1, N2), slots=3, memory_mb=2000)
    where = four_leases(book)
    (check,) = book.submit("gw2", "e1", E, 30.0, now=1.5)
    assert check == CheckGrants(where["fn-a"].split("/")[0], (("fn-a-1", 1),))
    # A call runs under A's lease: it ends at that call's Done. The least recently used lease
    # after it, on a GPU with a free slot, is ended for E meanwhile; E does not wait for A's call.
    effects = book.grants_checked(check.node, [], [("fn-a-1", 1)], now=1.6, busy=[("fn-a-1", 1)])
    (next_check,) = effects
    assert isinstance(next_check, CheckGrants) and next_check.grants == (("fn-b-1", 1),)
    placed = assignment(book.grants_checked(next_check.node, [], [("fn-b-1", 1)], now=1.7))
    assert (placed.call_id, placed.evict) == ("e1", (B.model,))


def test_a_lease_ending_for_another_reason_does_not_hold_up_a_waiting_miss() -> None:
    book = make_book(gpus=(N1, N2), slots=3, memory_mb=2000)
    where = four_leases(book)
    book.done("fn-a-1", 1, pb.OK, now=1.5, lease_call_id="a2")  # A used again: B is the least recent
    (check,) = book.owner_lost("gw-fn-d", now=1.6)  # D's gateway left while a call ran under its lease
    book.grants_checked(check.node, [], [("fn-d-1", 1)], now=1.65, busy=[("fn-d-1", 1)])
    (check,) = book.submit("gw2", "e1", E, 30.0, now=1.7)
    assert check == CheckGrants(where["fn-b"].split("/")[0], (("fn-b-1", 1),))
    placed = assignment(book.grants_checked(check.node, [], [("fn-b-1", 1)], now=1.8))
    assert (placed.call_id, placed.evict) == ("e1", (B.model,))


def test_a_call_parked_while_a_miss_waits_for_room_ends_the_leases_of_its_gpu() -> None:
    scheduler = make_scheduler(
        "lalb", gpus={N1: 2000, N2: 8000}, models={s.model: 1000 for s in (A, B, C, E)}, slots={N1: 3, N2: 1}
    )
    book = CallBook(scheduler, claim_s=5.0, lost_after_s=5.0, lease_s=LEASE_S)
    for index, fn in enumerate((A, B, C)):  # A and B fill N1, C goes to N2
        assignment(book.submit("gw1", f"{fn.name}-0", fn, 30.0, now=index / 10))
        book.done(f"{fn.name}-0", 1, pb.OK, now=index / 10 + 0.05)
    for index, fn in enumerate((A, B, C)):  # each leased (N2's one slot too: N1 has a free one)
        assert assignment(book.submit("gw1", f"{fn.name}-1", fn, 30.0, now=1.0 + index / 10, lease=True)).lease_s
        book.done(f"{fn.name}-1", 1, pb.OK, now=1.05 + index / 10)
    assert book.submit("gw2", "e1", E, 30.0, now=1.3) == [CheckGrants("n1", (("fn-a-1", 1),))]
    # While E waits for A's lease to end, a call of C parks behind C's lease on N2: that lease ends
    # too (before, the wait's pass skipped the park's rule, and a lease in steady use never ended).
    assert book.submit("gw3", "x1", C, 30.0, now=1.31) == [CheckGrants("n2", (("fn-c-1", 1),))]
    assert assignment(book.grants_checked("n2", [], [("fn-c-1", 1)], now=1.32)).call_id == "x1"


def test_a_queue_forming_ends_every_lease_and_the_slot_frees_once_the_node_says_so() -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2, inference_time_s=0.1)
    assert assignment(book.submit("gw2", "c2", B, 30.0, now=1.3)).gpu_id == N2  # the free GPU
    assert book.submit("gw2", "c3", C, 30.0, now=1.4) == [CheckGrants("n1", (("c1", 1),))]  # c3 waits
    assert book.tick(now=1.5) == []  # asked once
    # The node ended the lease with nothing running under it: the slot is free, and c3 takes it.
    effects = book.grants_checked("n1", [], [("c1", 1)], now=1.6)
    assert [(e.call_id, e.gpu_id) for e in effects if isinstance(e, Assignment)] == [("c3", N1)]
    assert book.done("c1", 1, pb.OK, now=1.7) == []  # a late Done for the ended lease changes nothing


def test_a_call_parked_on_a_gpu_ends_the_leases_there_and_no_other() -> None:
    book = make_book(gpus=(N1, N2, "n3/g0"))
    leased_hit(book, now=1.0)  # A leased on N1
    assignment(book.submit("gw2", "b0", B, 30.0, now=1.01, lease=True))  # B loads on another GPU
    book.done("b0", 1, pb.OK, now=1.02)
    b1 = assignment(book.submit("gw2", "b1", B, 30.0, now=1.03, lease=True))
    assert b1.lease_s == LEASE_S and b1.gpu_id != N1
    # A call of A parks behind N1 (its one slot frees sooner than A would load elsewhere): N1's
    # lease ends, B's does not, and N1 is leased to nobody for a lease time.
    assert book.submit("gw3", "c2", A, 30.0, now=1.2, lease=True) == [CheckGrants("n1", (("c1", 1),))]
    effects = book.grants_checked("n1", [], [("c1", 1)], now=1.3)
    assert [(e.call_id, e.gpu_id, e.lease_s) for e in effects if isinstance(e, Assignment)] == [("c2", N1, 0.0)]
    assert book.tick(now=1.4) == []


def test_a_lease_ended_while_a_call_runs_under_it_frees_its_slot_at_that_calls_done() -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    book.submit("gw2", "c2", B, 30.0, now=1.3)
    book.submit("gw2", "c3", C, 30.0, now=1.4)
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.5, busy=[("c1", 1)]) == []
    assert running(book, N1) == ["c1"]
    effects = book.done("c1", 1, pb.OK, now=1.8, inference_time_s=0.1, lease_ended=True)
    assert [(e.call_id, e.gpu_id) for e in effects if isinstance(e, Assignment)] == [("c3", N1)]


def test_a_leases_own_call_still_running_when_it_ends_completes_as_a_plain_placement() -> None:
    book = make_book()
    leased_hit(book)
    book.submit("gw2", "c2", B, 30.0, now=1.3)
    book.submit("gw2", "c3", C, 30.0, now=1.4)  # the lease is ended before c1 is done
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.5, busy=[("c1", 1)]) == []
    effects = book.done("c1", 1, pb.OK, now=1.8, inference_time_s=0.1, lease_ended=True)
    assert [(e.call_id, e.gpu_id) for e in effects if isinstance(e, Assignment)] == [("c3", N1)]
    assert "c1" not in running(book, N1)


def test_a_lease_never_presented_when_it_ends_is_revoked_and_its_call_placed_again() -> None:
    book = make_book()
    leased_hit(book)
    book.submit("gw2", "c2", B, 30.0, now=1.3)
    book.submit("gw2", "c3", C, 30.0, now=1.4)
    effects = book.grants_checked("n1", [("c1", 1)], [], now=1.5)
    # c1 goes back to the queue ahead of c3 (it arrived first) and takes its freed slot, no lease.
    assert [(e.call_id, e.attempt, e.gpu_id, e.lease_s) for e in effects if isinstance(e, Assignment)] == [
        ("c1", 2, N1, 0.0)
    ]


def test_a_lease_with_no_call_for_its_time_is_ended_at_the_tick() -> None:
    book = make_book()
    leased_hit(book, now=1.0)
    assert book.tick(now=1.0 + 4 * LEASE_S) == []  # its own call runs: its time has not begun
    book.done("c1", 1, pb.OK, now=5.1)
    book.done("c1", 1, pb.OK, now=5.5)  # a call under it: its time starts again
    assert book.tick(now=5.5 + LEASE_S - 0.01) == []
    assert book.tick(now=5.5 + LEASE_S) == [CheckGrants("n1", (("c1", 1),), if_idle=True)]
    assert book.tick(now=5.5 + LEASE_S + 0.3) == []
    # A call runs under it at the node (the scheduler learns of it at its Done): it goes on.
    assert book.grants_checked("n1", [], [("c1", 1)], now=6.6, busy=[("c1", 1)]) == []
    assert running(book, N1) == ["c1"] and book.tick(now=6.6 + LEASE_S - 0.01) == []
    assert book.tick(now=6.6 + LEASE_S) == [CheckGrants("n1", (("c1", 1),), if_idle=True)]
    assert book.grants_checked("n1", [], [("c1", 1)], now=7.7) == []
    assert running(book, N1) == [] and len(book) == 0


def test_a_gateway_gone_has_its_leases_ended_at_their_nodes() -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    assert book.owner_lost("gw1", now=1.3) == [CheckGrants("n1", (("c1", 1),))]
    book.grants_checked("n1", [], [("c1", 1)], now=1.4)
    assert running(book, N1) == [] and len(book) == 0


def test_a_retired_models_leases_end_and_it_leaves_once_they_have() -> None:
    """A function updated (or deleted): a call under a lease on its old model would reach a worker
    of the old version, so the leases end, and the model is evicted when their slots are free."""
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    assert book.retire(A.model) == [CheckGrants("n1", (("c1", 1),))]  # pinned by the lease: no Evict yet
    assert book.grants_checked("n1", [], [("c1", 1)], now=1.3) == [Evict(N1, (A.model,))]
    assert running(book, N1) == [] and len(book) == 0
    assert A.model not in book.scheduler.cache.gpu(N1)


def test_a_call_placed_again_after_its_model_was_retired_takes_no_lease_on_it() -> None:
    """The retirement's revoke reached the node before the lease's first call did (unseen): the
    call came before its function's update and is placed again on the old model, but not leased."""
    book = make_book()
    leased_hit(book)
    assert book.retire(A.model) == [CheckGrants("n1", (("c1", 1),))]
    effects = book.grants_checked("n1", [("c1", 1)], [], now=1.3)
    (again,) = [e for e in effects if isinstance(e, Assignment)]
    assert again.call_id == "c1" and again.hit and again.lease_s == 0.0


def test_a_retired_model_a_revoked_grant_pinned_is_evicted_when_its_call_is_not_placed_again() -> None:
    book = make_book()
    leased_hit(book)
    book.retire(A.model)
    effects = book.grants_checked("n1", [("c1", 1)], [], now=100.0)  # past its deadline: answered
    assert Evict(N1, (A.model,)) in effects
    assert running(book, N1) == [] and len(book) == 0 and A.model not in book.scheduler.cache.gpu(N1)


@pytest.mark.parametrize(("outcome", "worker_lost"), [(pb.WORKER_DIED, True), (pb.TIMEOUT, True)])
def test_a_worker_lost_under_a_lease_frees_the_slot_and_drops_the_model_without_a_retry(
    outcome: int, worker_lost: bool
) -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    assert book.done("c1", 1, outcome, now=1.5, worker_lost=worker_lost, lease_ended=True) == []
    assert running(book, N1) == [] and len(book) == 0
    assert A.model not in book.scheduler.cache.models_on(N1)


def test_a_timeout_under_a_lease_that_killed_no_worker_ends_the_lease_and_keeps_the_model() -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    assert book.done("c1", 1, pb.TIMEOUT, now=1.5, lease_ended=True) == []
    assert running(book, N1) == [] and len(book) == 0
    assert A.model in book.scheduler.cache.models_on(N1)


def test_a_model_dropped_by_another_calls_failure_ends_the_lease_on_it_and_is_not_admitted_again() -> None:
    book = make_book(gpus=(N1, N2), slots=2)
    leased_hit(book)  # c1 leases one of N1's two slots
    book.done("c1", 1, pb.OK, now=1.2)
    beside = assignment(book.submit("gw2", "c2", A, 30.0, now=1.3))  # the other slot, not leased
    assert beside.gpu_id == N1 and beside.lease_s == 0.0
    effects = book.done("c2", 1, pb.WORKER_DIED, now=1.4, worker_lost=True)  # A's worker there is gone
    assert CheckGrants("n1", (("c1", 1),)) in effects
    assert A.model not in book.scheduler.cache.models_on(N1)
    book.done("c1", 1, pb.OK, now=1.5, inference_time_s=0.1)  # a call under it, run before the node heard
    assert A.model not in book.scheduler.cache.models_on(N1), "admitted again, unpinned, under the lease"


def test_a_call_retried_after_its_worker_died_under_a_lease_is_answered_at_a_second_death() -> None:
    book = make_book()
    first = assignment(book.submit("gw1", "c9", A, 30.0, now=0.0, worker_died=True))
    (answer,) = book.done("c9", first.attempt, pb.WORKER_DIED, now=0.5, worker_lost=True)
    assert answer == Answer("gw1", "c9", pb.UNAVAILABLE, "the function's worker died twice; see the node's log")


def test_a_grant_its_node_saw_and_then_forgot_is_never_placed_again() -> None:
    book = make_book()
    leased_hit(book, now=1.0)  # c1's own call runs long
    assert book.tick(now=6.5) == [CheckGrants("n1", (("c1", 1),))]  # the claim check: seen, running
    assert book.grants_checked("n1", [], [("c1", 1)], now=6.6, busy=[("c1", 1)]) == []
    book.submit("gw2", "c2", B, 30.0, now=6.7)
    assert book.submit("gw2", "c3", C, 30.0, now=6.8) == [CheckGrants("n1", (("c1", 1),))]  # ends the lease
    effects = book.grants_checked("n1", [("c1", 1)], [], now=6.9)  # "unseen": the node forgot it
    assert [e for e in effects if isinstance(e, Assignment) and e.call_id == "c1"] == [], "it may run: twice"


def test_a_gpu_that_leaves_takes_its_lease_with_it() -> None:
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)
    assert book.gpus_removed([N1], now=1.3) == []
    assert len(book) == 0
    # Nothing of it is left to end: a queue forming asks no node.
    book.submit("gw2", "c2", B, 30.0, now=1.4)
    assert book.submit("gw2", "c3", C, 30.0, now=1.5) == []


def test_a_lease_whose_own_call_is_running_on_a_gpu_that_left_is_stranded_as_any_placement() -> None:
    book = make_book()
    leased_hit(book)
    assert book.gpus_removed([N1], now=1.3) == []
    assert len(book) == 1  # its gateway says whether it sent the Execute (the book's usual rule)


# --- the node's ledger --------------------------------------------------------------------------

KEY = grants.new_key()


def ledger() -> GrantLedger:
    book = GrantLedger("n1", frozenset({"g0"}))
    book.attach("sched-1", KEY, epoch=3)
    return book


def token(call_id: str = "c1", *, lease_s: float = 0.0, claim_by: float = 105.0) -> bytes:
    grant = pb.Grant(
        scheduler_id="sched-1",
        epoch=3,
        call_id=call_id,
        attempt=1,
        node="n1",
        gpu="g0",
        model="m",
        claim_by_unix_s=claim_by,
        expires_unix_s=200.0,
        lease_s=lease_s,
    )
    return grants.sign(grant, KEY)


def test_the_ledger_admits_calls_under_a_lease_one_at_a_time_each_within_its_time_of_the_last() -> None:
    book = ledger()
    lease = token(lease_s=1.0)
    with pytest.raises(Refused, match="has ended here"):
        book.admit_under_lease(lease, 100.0)  # its own call first
    book.admit(lease, 100.0)
    with pytest.raises(Refused, match="one at a time"):
        book.admit_under_lease(lease, 103.0)  # its own call runs (for as long as it takes)
    book.lease_call_ended(("c1", 1), 103.1, keep=True)
    assert book.lease_done_sent(("c1", 1)) is False
    assert book.admit_under_lease(lease, 104.0).call_id == "c1"  # within 1 s of the last call's end
    assert book.lease_busy(("c1", 1))
    book.lease_call_ended(("c1", 1), 104.5, keep=True)
    assert book.lease_done_sent(("c1", 1)) is False
    with pytest.raises(Refused, match="has ended"):
        book.admit_under_lease(lease, 105.51)
    assert book.admitted == 1 and book.admitted_under_leases == 1
    assert book.refused_under_leases == 3  # (each placed by its gateway instead)
    with pytest.raises(Refused, match="not a lease"):  # not routine: not counted with them
        book.admit_under_lease(token(call_id="c2"), 105.6)
    assert book.refused_under_leases == 3


def test_the_ledger_ends_a_lease_it_is_asked_about_and_says_whether_a_call_runs_under_it() -> None:
    book = ledger()
    lease = token(lease_s=50.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.05, keep=True)
    book.admit_under_lease(lease, 100.1)
    assert book.revoke([("c1", 1)], 100.2) == ([], [("c1", 1)])
    assert book.lease_busy(("c1", 1))
    book.lease_call_ended(("c1", 1), 100.25, keep=True)
    assert book.lease_done_sent(("c1", 1)) is True  # its last call: the Done says so
    with pytest.raises(Refused, match="has ended"):
        book.admit_under_lease(lease, 100.3)


def test_the_ledger_keeps_a_lease_while_a_call_runs_under_it_however_long() -> None:
    book = ledger()
    lease = token(lease_s=1.0)
    book.admit(lease, 100.0)
    book.prune(100.0 + 10 * book.keep_s)  # its own call runs long past its claim time
    assert book.revoke([("c1", 1)], 100.0 + 10 * book.keep_s) == ([], [("c1", 1)]), "forgotten: run again"
    other = ledger()
    other.admit(lease, 100.0)
    other.lease_call_ended(("c1", 1), 101.0, keep=True)
    other.admit_under_lease(lease, 101.5)
    other.prune(101.5 + 10 * other.keep_s)  # a call under it runs long
    assert other.lease_busy(("c1", 1))
    other.lease_call_ended(("c1", 1), 101.5 + 10 * other.keep_s, keep=True)
    other.prune(101.5 + 10 * other.keep_s + 1.0 + other.keep_s + 1)
    assert len(other) == 0


def test_the_ledger_ends_an_idle_lease_past_its_time_when_asked_if_idle_and_keeps_one_in_use() -> None:
    book = ledger()
    lease = token(lease_s=1.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.5, keep=True)
    book.lease_done_sent(("c1", 1))
    assert book.revoke([("c1", 1)], 101.0, if_idle=True) == ([], [("c1", 1)])
    assert book.lease_busy(("c1", 1)), "within its time: it goes on"
    book.admit_under_lease(lease, 101.2)
    assert book.revoke([("c1", 1)], 103.0, if_idle=True) == ([], [("c1", 1)])
    assert book.lease_busy(("c1", 1)), "a call runs under it: it goes on"
    book.lease_call_ended(("c1", 1), 103.1, keep=True)
    book.lease_done_sent(("c1", 1))
    book.revoke([("c1", 1)], 104.2, if_idle=True)
    assert not book.lease_busy(("c1", 1))
    with pytest.raises(Refused, match="has ended"):
        book.admit_under_lease(lease, 104.3)


def test_the_ledgers_answer_to_a_revoke_waits_for_the_last_calls_done() -> None:
    book = ledger()
    lease = token(lease_s=50.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.5, keep=False)  # its worker was lost; its Done not sent yet
    book.revoke([("c1", 1)], 100.6)
    assert book.lease_busy(("c1", 1)), "answered not busy: the slot freed before the worker's loss is heard"
    assert book.lease_done_sent(("c1", 1)) is True
    assert not book.lease_busy(("c1", 1))


def test_the_ledger_ends_every_lease_when_a_scheduler_attaches_even_the_same_one() -> None:
    book = ledger()
    lease = token(lease_s=50.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.1, keep=True)
    book.attach("sched-1", KEY, epoch=3)  # its link dropped and came back: it counts the slot free
    with pytest.raises(Refused, match="has ended"):
        book.admit_under_lease(lease, 100.2)
    plain = token("c2")
    book.admit(plain, 100.2)  # grants are unaffected
    again = ledger()
    again.admit(lease, 100.0)
    again.lease_call_ended(("c1", 1), 100.1, keep=True)
    again.end_leases()  # the scheduler's link closed
    with pytest.raises(Refused, match="has ended"):
        again.admit_under_lease(lease, 100.2)


def test_the_ledger_ends_a_lease_whose_worker_was_lost_and_refuses_what_is_no_lease() -> None:
    book = ledger()
    lease = token(lease_s=50.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.05, keep=False)
    assert book.lease_done_sent(("c1", 1)) is True
    with pytest.raises(Refused, match="has ended"):
        book.admit_under_lease(lease, 100.1)
    plain = token("c2")
    book.admit(plain, 100.0)
    with pytest.raises(Refused, match="not a lease"):
        book.admit_under_lease(plain, 100.1)
    forged = bytearray(token("c3", lease_s=50.0))
    forged[5] ^= 0xFF
    with pytest.raises(Refused, match="signature"):
        book.admit_under_lease(bytes(forged), 100.1)


def test_the_ledger_refuses_a_lease_of_a_deposed_leader_and_forgets_leases_with_their_grants() -> None:
    book = ledger()
    lease = token(lease_s=50.0)
    book.admit(lease, 100.0)
    book.lease_call_ended(("c1", 1), 100.0, keep=True)  # the next call is due by 150
    book.saw_epoch(4)
    with pytest.raises(Refused, match="no longer the attached leader"):
        book.admit_under_lease(lease, 100.1)
    book.prune(105.0 + book.keep_s + 1)  # kept past its lease time, not only its claim time
    assert len(book) == 1
    book.prune(150.0 + book.keep_s + 1)
    assert len(book) == 0 and not book.lease_busy(("c1", 1))
    with pytest.raises(Refused, match="deposed"):
        book.admit_under_lease(lease, 100.2)


# --- the gateway's leases -----------------------------------------------------------------------


def placement(call_id: str, lease_s: float = LEASE_S) -> pb.Placement:
    token = b"t-" + call_id.encode()
    return pb.Placement(call_id=call_id, attempt=2, node="n1", gpu="g0", token=token, lease_s=lease_s)


def test_a_gateways_lease_serves_one_call_at_a_time_and_is_answered_as_a_first_hit() -> None:
    leases = Leases()
    key = ("fn", "model")
    leases.add(key, placement("c1"), now=10.0, epoch=1)
    taken = leases.take(key, 10.1, epoch=1)
    assert taken is not None and taken.placement.token == b"t-c1"
    assert (taken.answer.node, taken.answer.gpu, taken.answer.attempt, taken.answer.queue_s) == ("n1", "g0", 1, 0.0)
    assert leases.take(key, 10.1, epoch=1) is None  # busy
    assert leases.take(("fn", "other model"), 10.1, epoch=1) is None  # another version of the function
    leases.give_back(taken, 10.5)
    assert leases.take(key, 10.5 + LEASE_S * USABLE_SHARE - 0.01, epoch=1) is taken  # its time runs from the answer


def test_a_gateways_busy_lease_outlives_its_time_until_its_call_is_answered() -> None:
    leases = Leases()
    key = ("fn", "model")
    leases.add(key, placement("c1"), now=10.0, epoch=1)
    taken = leases.take(key, 10.1, epoch=1)
    assert taken is not None
    assert leases.take(key, 20.0, epoch=1) is None and len(leases) == 1  # its call runs long: kept
    leases.give_back(taken, 20.0)
    assert leases.take(key, 20.1, epoch=1) is taken


def test_a_gateway_forgets_the_idle_leases_past_their_time_of_functions_not_called_again() -> None:
    leases = Leases()
    for index in range(100):
        leases.add((f"fn-{index}", "model"), placement(f"c{index}"), now=10.0, epoch=1)
    assert len(leases) == 100
    leases.add(("fn-new", "model"), placement("new"), now=10.0 + LEASE_S, epoch=1)
    assert len(leases) == 1


def test_a_gateways_lease_is_dropped_past_its_usable_time_on_another_link_or_when_told() -> None:
    leases = Leases()
    key = ("fn", "model")
    leases.add(key, placement("c1"), now=10.0, epoch=1)
    assert leases.take(key, 10.0 + LEASE_S * USABLE_SHARE, epoch=1) is None
    assert len(leases) == 0
    leases.add(key, placement("c2"), now=20.0, epoch=1)
    assert leases.take(key, 20.1, epoch=2) is None and len(leases) == 0
    leases.add(key, placement("c3"), now=30.0, epoch=2)
    taken = leases.take(key, 30.1, epoch=2)
    assert taken is not None
    leases.drop(taken)
    leases.drop(taken)  # twice: nothing more
    assert len(leases) == 0


# --- the simulator ------------------------------------------------------------------------------


def lease_workload(arrivals: list[tuple[float, str]], names: tuple[str, ...], *, inference_time_s: float) -> Workload:
    """Models `names` of 1000 MB loading in 2 s, a function fn-M each; calls at `arrivals`."""
    return Workload(
        requests=[Request(f"r{i:03d}", f"fn-{m}", m, at_s, 32) for i, (at_s, m) in enumerate(arrivals)],
        profiles=[ModelProfile(m, "rtx2080", 1000, 2.0, inference_time_s, 32) for m in names],
        function_models={f"fn-{m}": m for m in names},
        top_function="fn-A",
        start_minute=0,
        minutes=1,
    )


def sim(
    arrivals: list[tuple[float, str]], *, lease_s: float, gpus: int = 1, slots: int = 2, gpu_memory_mb: int = 4000
) -> SimResult:
    """Models A, B, C of 1000 MB loading in 2 s and running a call in 1 s; calls at `arrivals`."""
    workload = lease_workload(arrivals, ("A", "B", "C"), inference_time_s=1.0)
    cluster = ClusterConfig(gpus=gpus, gpu_memory_mb=gpu_memory_mb, slots=slots, hit_lease_s=lease_s)
    return simulate(workload, "lalb", cluster=cluster)


def test_the_simulator_keeps_a_lease_whose_call_outlasts_its_time_as_the_call_book_does() -> None:
    # r2 (A) runs under the lease from 5.5 to 6.5, past its time (0.8 s after r1 ended at 5); an
    # arrival at 6.0 makes the simulator look at its leases. The call book's end at that time is
    # if idle: the node says a call runs under it, and it goes on; r4 at 7.0 runs under it too.
    arrivals = [(0.0, "A"), (0.1, "B"), (4.0, "A"), (5.5, "A"), (6.0, "B"), (7.0, "A")]
    result = sim(arrivals, lease_s=0.8, slots=3)
    assert result.lease_calls == 2, (result.leases, result.lease_calls)


def test_the_simulator_runs_a_functions_next_calls_under_its_hits_lease() -> None:
    arrivals = [(0.0, "A"), (4.0, "A"), (6.0, "A"), (8.0, "A")]
    result = sim(arrivals, lease_s=10.0)
    # r0 misses (0 -> 3); r1 hits at 4, leasing its slot (one stays free); r2 and r3 run under it.
    assert (result.misses, result.hits, result.leases, result.lease_calls) == (1, 3, 1, 2)
    assert result.completed == 4 and result.avg_latency_s == pytest.approx((3 + 1 + 1 + 1) / 4)
    assert sim(arrivals, lease_s=0.0).leases == 0


def test_the_simulator_ends_every_lease_when_a_call_waits_and_leases_again_once_that_wait_is_over() -> None:
    # r1 leases at 4; r2 (B) takes the GPU's other slot at 6; r3 (C) would wait at 6.5: the idle
    # lease ends and r3 starts at once. That wait was the lease's: r4 (A, at 10) leases again.
    result = sim([(0.0, "A"), (4.0, "A"), (6.0, "B"), (6.5, "C"), (10.0, "A")], lease_s=5.0)
    assert (result.leases, result.lease_calls, result.parks) == (2, 0, 0)
    assert result.function_max_wait_s["fn-C"] == 0.0
    assert result.completed == 5


def test_the_simulator_ends_only_the_lease_that_makes_room_for_a_waiting_miss() -> None:
    # One GPU of two models: A and B leased at 4 and 4.5; C (at 6) must evict one: A's lease (the
    # least recently used) ends, C loads in its place, and B (at 7) still runs under its lease.
    arrivals = [(0.0, "A"), (0.1, "B"), (4.0, "A"), (4.5, "B"), (6.0, "C"), (9.5, "B")]
    result = sim(arrivals, lease_s=10.0, slots=3, gpu_memory_mb=2000)
    assert (result.leases, result.lease_calls, result.misses) == (2, 1, 3)
    assert result.function_max_wait_s["fn-C"] == 0.0


def test_the_simulator_grants_no_lease_for_a_lease_time_after_a_wait_no_lease_held_up() -> None:
    # r2 (A) waits at 1 behind two misses and runs at 3 as a hit; r3 (A, at 5.5, the GPU idle) is
    # within a lease time of that wait: no lease; r4 (A, at 7) is past it, and leases.
    result = sim([(0.0, "A"), (0.5, "B"), (1.0, "A"), (5.5, "A"), (7.0, "A")], lease_s=5.0)
    assert (result.leases, result.lease_calls) == (1, 0)


def test_the_simulator_counts_a_wait_on_a_busy_lease_as_one_on_running_calls() -> None:
    # r2 leases at 5.3, its own call running; r4 (C, 6.2) and r5 (A, 6.8) wait on running calls,
    # the busy lease's among them; r6 (A, 9.6) is within a lease time of those waits: no lease.
    arrivals = [(0.3, "A"), (3.3, "C"), (5.3, "A"), (5.6, "B"), (6.2, "C"), (6.8, "A"), (9.6, "A"), (9.7, "A")]
    assert sim(arrivals, lease_s=3.0, gpus=1, slots=3).leases == 1


def test_the_simulator_ends_a_lease_with_no_call_for_its_time_and_leases_again() -> None:
    # r1 leases at 4 (4 -> 5), r2 runs under it at 6 (within 1.5 s of 5; 6 -> 7); r3 at 9 finds it
    # over (not within 1.5 s of 7), is placed, and leases anew.
    result = sim([(0.0, "A"), (4.0, "A"), (6.0, "A"), (9.0, "A")], lease_s=1.5)
    assert (result.leases, result.lease_calls) == (2, 1)
    assert result.completed == 4


def test_the_simulators_adaptive_d_reads_an_idle_lease_as_the_call_book_does() -> None:
    # A's calls (0.1 s) every 0.5 s from 4, all under the lease of the hit at 4: the GPU is busy a
    # fifth of the time, with a lease or without, and D stays near its maximum either way. (The
    # idle lease read as a running call: D fell to 1, 1.37 on average against 3.66 without.)
    arrivals = [(0.0, "A")] + [(4.0 + 0.5 * k, "A") for k in range(30)]
    workload = lease_workload(arrivals, ("A", "B"), inference_time_s=0.1)
    results = [
        simulate(workload, "lalb", cluster=ClusterConfig(gpus=1, slots=4, adaptive_slots=4, hit_lease_s=lease_s))
        for lease_s in (0.0, 1.0)
    ]
    assert results[1].lease_calls == 29
    assert results[1].avg_slots == pytest.approx(results[0].avg_slots) and results[0].avg_slots > 3.0


def test_a_lease_whose_call_outlasts_the_functions_timeout_here_stays_while_its_node_says_busy() -> None:
    # The function's timeout_s was raised (same model: the lease goes on): a call under the lease
    # runs longer than the spec here says. Each if-idle check finds it busy at the node, so the
    # lease and its slot stay the scheduler's, not freed as a lost call while the node runs it.
    book = make_book()
    leased_hit(book)
    book.done("c1", 1, pb.OK, now=1.2)  # the lease's own call; a long call under it starts at once
    node = ledger()
    lease = token(lease_s=LEASE_S, claim_by=105.0)
    node.admit(lease, 100.0)
    node.lease_call_ended(("c1", 1), 100.2, keep=True)
    node.admit_under_lease(lease, 100.3)  # runs with the gateway's (new, longer) timeout
    now = 1.2
    while now < 1.2 + LEASE_S + A.timeout_s + 30.0:
        now += 0.5
        for effect in book.tick(now):
            assert isinstance(effect, CheckGrants) and effect.if_idle
            unseen, seen = node.revoke(effect.grants, 100.0 + now, if_idle=effect.if_idle)
            book.grants_checked("n1", unseen, seen, now + 0.01, busy=[r for r in seen if node.lease_busy(r)])
    assert running(book, N1) == ["c1"] and len(book) == 1  # still the lease's slot
    node.lease_call_ended(("c1", 1), 100.0 + now, keep=True)  # the long call ends; its Done comes
    book.done("c1", 1, pb.OK, now=now + 0.1, lease_call_id="l1")
    assert running(book, N1) == ["c1"]  # the lease goes on, used again


def test_the_simulators_gateway_uses_a_lease_for_the_share_of_its_time_the_routers_does() -> None:
    # r1 leases at 4 (4 -> 5); r2 comes 0.95 s after that call's end: within the node's lease time
    # (1 s), past the share of it a gateway uses (0.9 s): the router places it, on the GPU's other
    # slot (the lease, not yet ended by the scheduler, still holds its own).
    result = sim([(0.0, "A"), (4.0, "A"), (5.0 + 0.95 * 1.0, "A")], lease_s=1.0)
    assert USABLE_SHARE < 0.95
    assert (result.leases, result.lease_calls, result.hits) == (1, 0, 2)
    # Within the share it runs under the lease.
    assert sim([(0.0, "A"), (4.0, "A"), (5.0 + 0.85 * 1.0, "A")], lease_s=1.0).lease_calls == 1


def test_the_simulator_ends_a_lapsed_lease_on_time_so_its_model_goes_idle_then_as_the_ticker_does() -> None:
    # r1 leases A's slot at 4 (4 -> 5; its time is up at 6). The call book's tick ends it then, and
    # A is idle from then: the staged exit takes it off the GPU 5 s later (about 11), long before
    # r2 (B) at 30. Ended only at r2's arrival, A stayed pinned, and idle from 30 it was never released.
    workload = lease_workload([(0.0, "A"), (4.0, "A"), (30.0, "B")], ("A", "B"), inference_time_s=1.0)
    cluster = ClusterConfig(gpus=1, slots=2, gpu_memory_mb=4000, hit_lease_s=1.0, gpu_idle_release_s=5.0)
    result = simulate(workload, "lalb", cluster=cluster)
    assert (result.leases, result.lease_calls, result.releases) == (1, 0, 1)


def test_the_simulator_ends_a_lease_whose_own_call_outlasts_the_claim_time_as_the_call_book_does() -> None:
    # r1 (A, a 6 s call) leases its slot at 9; its Done is not in 5 s after its placement
    # (DEFAULT_CLAIM_S): the call book checks its grant with the node, which ends the lease (leases
    # serve calls shorter than the claim time). r2 at 15.5 is placed, a hit that leases anew.
    workload = lease_workload([(0.0, "A"), (9.0, "A"), (15.5, "A")], ("A", "B"), inference_time_s=6.0)
    result = simulate(workload, "lalb", cluster=ClusterConfig(gpus=1, slots=2, gpu_memory_mb=4000, hit_lease_s=2.0))
    assert DEFAULT_CLAIM_S < 6.0
    assert (result.leases, result.lease_calls, result.hits) == (2, 0, 2)


def test_the_simulator_completes_a_leases_own_call_as_a_plain_placement_when_the_lease_ended_meanwhile() -> None:
    # r1 (A) leases its slot at 4 (4 -> 5); r3 (C, at 4.5) waits, B's miss in the other slot: the
    # lease ends while its own call runs, and that call's Done completes it as a plain placement
    # (with its times: torpor counts it against its SLO), as the call book does.
    arrivals = [(0.0, "A"), (4.0, "A"), (4.2, "B"), (4.5, "C")]
    base = lease_workload(arrivals, ("A", "B", "C"), inference_time_s=1.0)
    workload = dataclasses.replace(base, requests=[dataclasses.replace(r, slo_s=10.0) for r in base.requests])
    cluster = ClusterConfig(gpus=1, slots=2, gpu_memory_mb=4000, hit_lease_s=5.0)
    run = _Run(workload, _make_scheduler(workload, make_policy("torpor", PolicyConfig()), cluster), cluster, {})
    run.run(None, Meter())
    assert (run.leases, run.lease_calls, len(run.latencies)) == (1, 0, 4)
    policy = run.scheduler.policy
    assert isinstance(policy, TorporPolicy)
    assert policy.record("fn-A").served == 2
