"""Placement tokens (gpufaas.grants) and the node's ledger of grants (gpu_manager.ledger)."""

from __future__ import annotations

import hmac
import math
import random
from typing import Any

import pytest

from gpu_manager.ledger import GrantLedger, Refused
from gpufaas.functions import WorkerSettings
from gpufaas.grants import KEY_BYTES, TAG_BYTES, BadToken, function_part, new_key, sign, verify
from gpufaas.proto import gpufaas_pb2 as pb

KEY = bytes(range(KEY_BYTES))
OTHER_KEY = bytes(range(1, KEY_BYTES + 1))
SCHEDULER = "sched-1"
NOW = 1_700_000_000.0  # wall-clock seconds, passed in: the ledger never reads a clock
CLAIM_S = 5.0


def make_grant(**fields: Any) -> pb.Grant:
    """A grant for call c1, attempt 1, on GPU 0 of node n1, claimable for CLAIM_S from NOW."""
    values: dict[str, Any] = {
        "scheduler_id": SCHEDULER,
        "call_id": "c1",
        "attempt": 1,
        "node": "n1",
        "gpu": "0",
        "gpu_seq": 1,
        "function": "resnet",
        "model": "resnet@0123456789ab",
        "memory_mb": 1000,
        "claim_by_unix_s": NOW + CLAIM_S,
        "expires_unix_s": NOW + 60.0,
    }
    values.update(fields)
    return pb.Grant(**values)


def make_ledger(*, keep_s: float = 60.0) -> GrantLedger:
    """Node n1 with GPUs 0 and 1, attached to SCHEDULER (signing with KEY)."""
    ledger = GrantLedger("n1", frozenset({"0", "1"}), keep_s=keep_s)
    ledger.attach(SCHEDULER, KEY)
    return ledger


def flip(token: bytes, index: int) -> bytes:
    return token[:index] + bytes([token[index] ^ 0x01]) + token[index + 1 :]


# --- sign / verify ----------------------------------------------------------------------------


def test_a_signed_grant_verifies_to_the_same_grant() -> None:
    grant = make_grant(evict=["old@aaaaaaaaaaaa"], worker=WorkerSettings(environment={"MODE": "fast"}).to_wire())
    token = sign(grant, KEY)
    assert len(token) == grant.ByteSize() + TAG_BYTES
    assert verify(token, KEY) == grant


def test_the_tag_is_hmac_sha256_of_the_body_under_each_key_in_turn() -> None:
    """The token's format (body + HMAC-SHA256 of it), whatever keys were used before: a node of
    another version checks it, and the keyed state kept per key is not another key's."""
    keys = [new_key(), new_key(), new_key()]
    for key in [*keys, *reversed(keys)]:
        token = sign(pb.Grant(call_id="c", node="n1"), key)
        body, tag = token[:-TAG_BYTES], token[-TAG_BYTES:]
        assert tag == hmac.digest(key, body, "sha256")
        assert verify(token, key).call_id == "c"
        for other in keys:
            if other != key:
                with pytest.raises(BadToken):
                    verify(token, other)


def test_a_grant_signed_with_its_function_part_verifies_to_the_whole_grant() -> None:
    worker = WorkerSettings(environment={"MODE": "fast"}).to_wire()
    whole = make_grant(evict=["old@aaaaaaaaaaaa"], package_digest="sha256:ab", worker=worker)
    per_call = pb.Grant()
    per_call.CopyFrom(whole)
    for name in ("function", "model", "package_digest", "memory_mb", "worker"):
        per_call.ClearField(name)
    part = function_part(whole.function, whole.model, whole.package_digest, whole.memory_mb, worker)
    assert part is function_part(whole.function, whole.model, whole.package_digest, whole.memory_mb, worker)
    token = sign(per_call, KEY, function_part=part)
    assert verify(token, KEY) == whole
    ledger = make_ledger()
    assert ledger.admit(token, now_unix_s=NOW).function == "resnet"


def test_new_keys_are_random_and_of_the_key_size() -> None:
    first, second = new_key(), new_key()
    assert len(first) == len(second) == KEY_BYTES
    assert first != second


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_token_with_a_tampered_body_byte_is_refused(where: str) -> None:
    token = sign(make_grant(), KEY)
    body_bytes = len(token) - TAG_BYTES
    index = {"first": 0, "middle": body_bytes // 2, "last": body_bytes - 1}[where]
    with pytest.raises(BadToken, match="signature does not match"):
        verify(flip(token, index), KEY)


@pytest.mark.parametrize("index", [-TAG_BYTES, -1])
def test_a_token_with_a_tampered_tag_is_refused(index: int) -> None:
    token = sign(make_grant(), KEY)
    with pytest.raises(BadToken, match="signature does not match"):
        verify(flip(token, len(token) + index), KEY)


def test_a_token_signed_with_another_key_is_refused() -> None:
    with pytest.raises(BadToken, match="signature does not match"):
        verify(sign(make_grant(), OTHER_KEY), KEY)


def test_a_grant_with_changed_fields_under_the_old_tag_is_refused() -> None:
    # A gateway that rewrites the node (or the claim time) cannot keep the scheduler's tag.
    token = sign(make_grant(), KEY)
    forged = make_grant(node="n2", claim_by_unix_s=NOW + 3600).SerializeToString() + token[-TAG_BYTES:]
    with pytest.raises(BadToken, match="signature does not match"):
        verify(forged, KEY)


@pytest.mark.parametrize("length", [0, 1, TAG_BYTES])
def test_a_token_no_longer_than_a_tag_is_refused(length: int) -> None:
    token = sign(make_grant(), KEY)[-length:] if length else b""
    with pytest.raises(BadToken, match="too short"):
        verify(token, KEY)


def test_no_key_refuses_every_token() -> None:
    with pytest.raises(BadToken, match="no scheduler has attached"):
        verify(sign(make_grant(), KEY), b"")


def test_a_correctly_signed_body_that_is_not_a_grant_is_refused() -> None:
    body = b"\x0a\x05ab"  # field 1 announces 5 bytes and holds 2
    token = body + hmac.digest(KEY, body, "sha256")
    with pytest.raises(BadToken, match="does not hold a grant"):
        verify(token, KEY)


# --- the ledger -------------------------------------------------------------------------------


def test_the_ledger_admits_a_valid_grant_once_and_records_it() -> None:
    ledger = make_ledger()
    grant = make_grant()
    assert ledger.admit(sign(grant, KEY), NOW) == grant
    assert len(ledger) == 1


def test_the_ledger_refuses_everything_before_a_scheduler_attaches() -> None:
    ledger = GrantLedger("n1", frozenset({"0"}))
    with pytest.raises(Refused, match="no scheduler has attached"):
        ledger.admit(sign(make_grant(), KEY), NOW)
    assert len(ledger) == 0


@pytest.mark.parametrize(
    "token",
    [
        pytest.param(sign(make_grant(), OTHER_KEY), id="other-key"),
        pytest.param(flip(sign(make_grant(), KEY), 3), id="tampered-body"),
        pytest.param(flip(sign(make_grant(), KEY), -1), id="tampered-tag"),
        pytest.param(b"short", id="too-short"),
    ],
)
def test_the_ledger_refuses_forged_tokens_without_recording_them(token: bytes) -> None:
    ledger = make_ledger()
    with pytest.raises(Refused):
        ledger.admit(token, NOW)
    assert len(ledger) == 0


def test_a_grant_of_the_scheduler_before_a_reattach_is_refused() -> None:
    ledger = make_ledger()
    old = sign(make_grant(call_id="c1"), KEY)
    # The new incarnation happens to reuse the key: the scheduler id still tells them apart.
    ledger.attach("sched-2", KEY)
    with pytest.raises(Refused, match="no longer attached"):
        ledger.admit(old, NOW)
    new = make_grant(call_id="c2", scheduler_id="sched-2")
    assert ledger.admit(sign(new, KEY), NOW) == new


def test_a_grant_under_the_previous_key_is_refused_after_a_reattach_with_a_new_key() -> None:
    ledger = make_ledger()
    old = sign(make_grant(), KEY)
    ledger.attach(SCHEDULER, OTHER_KEY)
    with pytest.raises(Refused, match="signature does not match"):
        ledger.admit(old, NOW)


def test_a_grant_for_another_node_is_refused() -> None:
    ledger = make_ledger()
    with pytest.raises(Refused, match="n2/0, not a GPU of node n1"):
        ledger.admit(sign(make_grant(node="n2"), KEY), NOW)
    assert len(ledger) == 0


def test_a_grant_for_an_unknown_gpu_of_this_node_is_refused() -> None:
    ledger = make_ledger()
    with pytest.raises(Refused, match="n1/7, not a GPU of node n1"):
        ledger.admit(sign(make_grant(gpu="7"), KEY), NOW)
    assert ledger.admit(sign(make_grant(gpu="1"), KEY), NOW).gpu == "1"


def test_a_grant_is_refused_when_presented_again() -> None:
    ledger = make_ledger()
    token = sign(make_grant(), KEY)
    ledger.admit(token, NOW)
    with pytest.raises(Refused, match="used already"):
        ledger.admit(token, NOW + 1.0)
    # Re-signing the same (call, attempt) does not help; the next attempt is a new grant.
    with pytest.raises(Refused, match="used already"):
        ledger.admit(sign(make_grant(gpu_seq=9), KEY), NOW + 1.0)
    assert ledger.admit(sign(make_grant(attempt=2), KEY), NOW + 1.0).attempt == 2


def test_revoke_splits_unseen_from_seen_and_refuses_the_unseen_for_good() -> None:
    ledger = make_ledger()
    ledger.admit(sign(make_grant(call_id="ran"), KEY), NOW)
    unseen, seen = ledger.revoke([("ran", 1), ("never", 1), ("never", 2)], NOW + 1.0)
    assert unseen == [("never", 1), ("never", 2)]
    assert seen == [("ran", 1)]
    with pytest.raises(Refused, match="was revoked"):
        ledger.admit(sign(make_grant(call_id="never", attempt=2), KEY), NOW + 2.0)
    # Only the revoked attempts: a later placement of the same call is a new grant.
    assert ledger.admit(sign(make_grant(call_id="never", attempt=3), KEY), NOW + 2.0).attempt == 3


def test_revoking_a_grant_that_ran_does_not_mark_it_revoked() -> None:
    ledger = make_ledger()
    token = sign(make_grant(), KEY)
    ledger.admit(token, NOW)
    assert ledger.revoke([("c1", 1)], NOW) == ([], [("c1", 1)])
    assert ledger.revoke([("c1", 1)], NOW) == ([], [("c1", 1)])  # asking twice answers the same
    assert len(ledger) == 1
    with pytest.raises(Refused, match="used already"):
        ledger.admit(token, NOW)


def test_a_grant_is_admitted_up_to_its_claim_time_and_refused_after() -> None:
    ledger = make_ledger()
    claim_by = NOW + CLAIM_S
    assert ledger.admit(sign(make_grant(call_id="on-time"), KEY), claim_by).call_id == "on-time"
    with pytest.raises(Refused, match="expired"):
        ledger.admit(sign(make_grant(call_id="late"), KEY), claim_by + 0.001)
    assert len(ledger) == 1  # the late one is not recorded


def test_prune_drops_only_entries_past_their_keep_time() -> None:
    ledger = make_ledger(keep_s=10.0)
    ledger.admit(sign(make_grant(call_id="early", claim_by_unix_s=NOW + 1.0), KEY), NOW)  # kept to NOW + 11
    ledger.admit(sign(make_grant(call_id="later", claim_by_unix_s=NOW + 5.0), KEY), NOW)  # kept to NOW + 15
    ledger.revoke([("revoked", 1)], NOW + 2.0)  # kept to NOW + 12
    ledger.prune(NOW + 11.0)
    assert len(ledger) == 3  # nothing is past its time yet
    ledger.prune(NOW + 11.5)
    assert len(ledger) == 2
    # "later" is still remembered, so it is still refused as reused (not merely as expired).
    with pytest.raises(Refused, match="used already"):
        ledger.admit(sign(make_grant(call_id="later", claim_by_unix_s=NOW + 5.0), KEY), NOW + 11.5)
    ledger.prune(NOW + 12.5)
    assert len(ledger) == 1
    ledger.prune(NOW + 15.5)
    assert len(ledger) == 0


def test_a_pruned_grant_is_still_refused_by_its_claim_time() -> None:
    ledger = make_ledger(keep_s=10.0)
    token = sign(make_grant(), KEY)
    ledger.admit(token, NOW)
    ledger.prune(NOW + CLAIM_S + 10.5)
    assert len(ledger) == 0
    with pytest.raises(Refused, match="expired"):
        ledger.admit(token, NOW + CLAIM_S + 10.5)


def test_a_revoked_grant_stays_refused_while_it_could_still_be_presented() -> None:
    # A grant revoked at once (its gateway died) must not become usable when the revocation is
    # pruned before the grant's own claim time has passed: the scheduler says how long to keep it.
    ledger = make_ledger(keep_s=60.0)
    token = sign(make_grant(claim_by_unix_s=NOW + 50.0), KEY)
    assert ledger.revoke([("c1", 1)], NOW, claim_by_unix_s=NOW + 50.0) == ([("c1", 1)], [])
    ledger.prune(NOW + 61.0)
    with pytest.raises(Refused, match="revoked"):
        ledger.admit(token, NOW + 49.0)


def test_a_grant_claimable_further_ahead_than_the_ledger_remembers_is_refused() -> None:
    ledger = make_ledger(keep_s=60.0)
    with pytest.raises(Refused, match="more than 60 s ahead"):
        ledger.admit(sign(make_grant(claim_by_unix_s=NOW + 120.0), KEY), NOW)


# --- fencing: the schedulers' epochs ----------------------------------------------------------


def test_a_scheduler_of_an_older_epoch_may_not_attach_and_the_attached_one_stays() -> None:
    ledger = GrantLedger("n1", frozenset({"0"}))
    ledger.attach("leader-2", KEY, epoch=20)
    with pytest.raises(Refused, match="epoch 10, but the leader of epoch 20 has been seen"):
        ledger.attach("leader-1", OTHER_KEY, epoch=10)  # a deposed leader back from a pause
    assert (ledger.scheduler_id, ledger.key, ledger.scheduler_epoch) == ("leader-2", KEY, 20)
    ledger.attach("leader-2b", OTHER_KEY, epoch=20)  # the same epoch re-attaching is the leader
    ledger.attach("leader-3", KEY, epoch=30)
    assert ledger.epoch == 30


def test_once_a_newer_leader_is_seen_in_etcd_the_attached_ones_grants_are_refused() -> None:
    ledger = GrantLedger("n1", frozenset({"0"}))
    ledger.attach(SCHEDULER, KEY, epoch=10)
    assert ledger.admit(sign(make_grant(call_id="c1", epoch=10), KEY), NOW).call_id == "c1"
    assert not ledger.saw_epoch(10)  # its own key: nothing new
    assert ledger.saw_epoch(12)  # a newer leader: the attached one is deposed
    with pytest.raises(Refused, match="epoch 10, deposed by the leader of epoch 12: place the call again"):
        ledger.admit(sign(make_grant(call_id="c2", epoch=10), KEY), NOW)
    assert ledger.refused_stale == 1 and ledger.admitted == 1
    assert ledger.saw_epoch(11)  # still deposed: the epoch seen only grows
    assert ledger.epoch == 12


def test_the_ledger_counts_a_call_admitted_again_under_another_attempt_or_scheduler() -> None:
    ledger = GrantLedger("n1", frozenset({"0"}))
    ledger.attach("leader-1", KEY, epoch=1)
    ledger.admit(sign(make_grant(scheduler_id="leader-1", call_id="c1", epoch=1), KEY), NOW)
    ledger.admit(sign(make_grant(scheduler_id="leader-1", call_id="c2", epoch=1), KEY), NOW)
    assert (ledger.admitted, ledger.admitted_again) == (2, 0)
    ledger.attach("leader-2", OTHER_KEY, epoch=2)
    same = make_grant(scheduler_id="leader-2", call_id="c1", epoch=2)
    with pytest.raises(Refused, match="used already"):  # the same attempt, whoever signs it
        ledger.admit(sign(same, OTHER_KEY), NOW)
    again = make_grant(scheduler_id="leader-2", call_id="c1", attempt=2, epoch=2)  # it runs twice
    ledger.admit(sign(again, OTHER_KEY), NOW)
    assert (ledger.admitted, ledger.admitted_again) == (3, 1)
    later = NOW + CLAIM_S + 61
    ledger.prune(later)  # remembered as long as its grants are
    ledger.admit(
        sign(
            make_grant(scheduler_id="leader-2", call_id="c1", attempt=3, epoch=2, claim_by_unix_s=later + CLAIM_S),
            OTHER_KEY,
        ),
        later,
    )
    assert ledger.admitted_again == 1


def test_the_books_keep_every_key_until_its_time_and_not_much_longer() -> None:
    # Keys set out of order, set again (a lease's grant after each call, or kept while a call
    # runs: math.inf), pruned a few at a time or all: each is present while now <= its last time,
    # and a full prune leaves none more than the spread of the times set (19 s here) past its time.
    from gpu_manager.ledger import _KeptUntil

    rng = random.Random(7)
    book: _KeptUntil[int] = _KeptUntil()
    expected: dict[int, float] = {}
    now = 0.0
    for step in range(3000):
        now += rng.uniform(0.0, 0.2)
        key = rng.randrange(200)
        expected[key] = math.inf if rng.random() < 0.1 else now + rng.uniform(1.0, 20.0)
        book.set(key, expected[key])
        book.prune(now, limit=-1 if step % 50 == 0 else rng.choice((0, 1, 4)))
        assert all(book.until.get(k) == t for k, t in expected.items() if t >= now), now
        if step % 50 == 0:
            assert all(t >= now - 19.0 for t in book.until.values()), now
        expected = {k: t for k, t in expected.items() if k in book.until}
    book.prune(now + 100.0)
    assert set(book.until) == {k for k, t in expected.items() if t == math.inf}


def test_admissions_prune_what_expired_without_a_sweep() -> None:
    # A busy node's ledger stays the size of what it must keep, with no walk of every entry: each
    # admission drops a few expired entries (the periodic sweep is then only for quiet spells).
    ledger = make_ledger(keep_s=10.0)
    for index in range(5000):
        now = NOW + index * 0.01  # 100 grants a second, each kept CLAIM_S + 10 s
        ledger.admit(sign(make_grant(call_id=f"c{index}", claim_by_unix_s=now + CLAIM_S), KEY), now)
    assert len(ledger) <= 1600  # (15 s of grants, against 5000 admitted)
    with pytest.raises(Refused, match="used already"):  # a grant still within its keep time is remembered
        ledger.admit(sign(make_grant(call_id="c4000", claim_by_unix_s=NOW + 40.0 + CLAIM_S), KEY), NOW + 49.99)


def test_a_leases_grant_is_kept_while_a_call_runs_under_it_and_keep_s_after_its_last() -> None:
    ledger = make_ledger(keep_s=10.0)
    token = sign(make_grant(lease_s=1.0), KEY)
    ledger.admit(token, NOW)
    ledger.lease_call_ended(("c1", 1), NOW + 0.5, keep=True)  # kept to NOW + 0.5 + 1 + 10
    ledger.admit_under_lease(token, NOW + 1.0)  # a call runs under it: kept however long it runs
    ledger.prune(NOW + 100.0)
    assert len(ledger) == 1
    ledger.lease_call_ended(("c1", 1), NOW + 100.0, keep=True)  # kept to NOW + 111
    ledger.prune(NOW + 110.9)
    assert len(ledger) == 1
    ledger.prune(NOW + 111.1)
    assert len(ledger) == 0


def test_a_grant_whose_times_are_not_numbers_is_refused_and_holds_nothing_up() -> None:
    # A NaN passes no comparison: kept, it would never come due, and the pruning behind it stop.
    ledger = make_ledger(keep_s=10.0)
    with pytest.raises(Refused, match="claim time"):
        ledger.admit(sign(make_grant(call_id="nan", claim_by_unix_s=math.nan), KEY), NOW)
    with pytest.raises(Refused, match="lease time"):
        ledger.admit(sign(make_grant(call_id="nan-lease", lease_s=math.nan), KEY), NOW)
    with pytest.raises(Refused, match="lease time"):
        ledger.admit(sign(make_grant(call_id="inf-lease", lease_s=math.inf), KEY), NOW)
    assert len(ledger) == 0


def test_a_revocation_kept_long_does_not_hold_up_the_pruning_of_those_after_it() -> None:
    # The scheduler's claim time may be far ahead (its clock): that revocation is kept till then,
    # and the revocations after it are pruned at their own times, not after it.
    ledger = make_ledger(keep_s=10.0)
    ledger.revoke([("far", 1)], NOW, claim_by_unix_s=NOW + 3600.0)
    for index in range(100):
        ledger.revoke([(f"r{index}", 1)], NOW + index)
    ledger.prune(NOW + 200.0)
    assert len(ledger) == 1  # "far" alone
    with pytest.raises(Refused, match="revoked"):
        ledger.admit(sign(make_grant(call_id="far", claim_by_unix_s=NOW + 205.0), KEY), NOW + 200.0)
