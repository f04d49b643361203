"""The node's ledger of grants: which placement tokens it accepts, once each, and which it revoked.

Pure: wall-clock time (`now_unix_s`) is an argument. A grant is accepted when its signature
verifies under the attached scheduler's key, its epoch is not older than the newest leader's
epoch the node has seen, it names this node and one of its GPUs, it is presented by its claim
time (which may be at most `keep_s` ahead), and neither it (call id, attempt) nor its revocation
is in the ledger. A grant seen is kept `keep_s` past its claim time; a revocation `keep_s` past
the latest claim time of the grants revoked (the scheduler says it), or past the revocation
itself; then they are pruned: an older token is refused by its claim time alone.

Fencing: the newest epoch seen (from an Attach, or from etcd's leader key: `saw_epoch`) only
grows; a scheduler of an older epoch may not attach, and its grants are refused, so that a
deposed leader back from a pause places nothing here. The ledger counts what it admitted, and a
call admitted again under another attempt or scheduler (`admitted_again`: a retry after its
worker died, or a call placed twice, which fencing prevents).

Leases (docs/hit-leases.md): a grant with `lease_s` is admitted once as any grant, for its own
call; from then on the same token admits further calls of its function (`admit_under_lease`),
one at a time, each within `lease_s` of the end of the one before (`lease_call_ended`), until
the scheduler revokes it (`revoke` ends a lease it names), or until a call under it ends in a
way that loses the worker. A lease's token is checked once: later calls find it by its bytes.
A lease's grant is kept `keep_s` past its last call's end, as a grant past its claim time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpufaas.grants import GRANT_KEEP_S, BadToken, verify
from gpufaas.proto import gpufaas_pb2 as pb

GrantRef = tuple[str, int]  # (call id, attempt)
K = TypeVar("K")
# Expired entries an admission prunes, at most (`GrantLedger.admit`): more than it adds (two), so
# that the books shrink to what is kept while calls come, with no walk of them all.
PRUNED_PER_ADMISSION = 4


class _KeptUntil(Generic[K]):
    """Keys each kept until a time (`until[key]`; math.inf while a call runs under it), pruned
    in the order they came: a prune walks what is due, not every key. Each key has one entry in
    that order, due at the time it was first kept until (or at once, for math.inf); a key found
    set to a later time when its entry comes due is due again then (math.inf: at the next prune
    after `now`). Times come in nearly increasing order (now plus a claim time plus `keep_s`), so a
    key may outlive its time by the spread of the times ahead of it (seconds; `keep_s` at most):
    it is kept at least until its time, never pruned before."""

    __slots__ = ("until", "_due")

    def __init__(self) -> None:
        self.until: dict[K, float] = {}
        self._due: deque[tuple[float, K]] = deque()

    def set(self, key: K, until: float, *, due_by: float = math.inf) -> None:
        """Keep `key` until `until`; a new key's entry comes due at `until`, or `due_by` if sooner."""
        if key not in self.until:
            due = min(until, due_by)
            self._due.append((due if due != math.inf else 0.0, key))
        self.until[key] = until

    def prune(self, now_unix_s: float, limit: int = -1) -> None:
        """Drop the keys whose time passed before `now_unix_s` (at most `limit` of them, if >= 0)."""
        due, until = self._due, self.until
        while limit and due and due[0][0] < now_unix_s:
            key = due.popleft()[1]
            kept_until = until[key]
            if kept_until < now_unix_s:
                del until[key]
                limit -= 1
            else:  # kept longer since its entry was made: due again then
                due.append((kept_until if kept_until != math.inf else now_unix_s, key))


class Refused(Exception):
    """A token the node will not run, or a scheduler it will not take; the message says why."""


class LeaseClosed(Refused):
    """A call sent under a lease that has ended, or under which a call runs: routine (its gateway
    places it instead), unlike a token that is bad or not a lease."""


@dataclass(slots=True)
class _Lease:
    grant: pb.Grant
    token: bytes
    running: bool = True  # a call runs under it (the grant's own, from its admission)
    done_pending: bool = False  # a call under it ended, and its Done is not sent yet
    ended: bool = False  # no call is admitted under it any more
    until_unix_s: float = math.inf  # the next call must start by then (the end of the last + lease_s)


@dataclass
class GrantLedger:
    node: str
    gpus: frozenset[str]
    key: bytes = b""
    scheduler_id: str = ""
    keep_s: float = GRANT_KEEP_S
    epoch: int = 0  # the newest leader's epoch seen
    scheduler_epoch: int = 0  # the attached scheduler's
    admitted: int = 0  # grants admitted
    # Of them, for a call id admitted before (within keep_s): a retry, or an X-Call-Id used again.
    admitted_again: int = 0
    refused_stale: int = 0  # grants refused for an epoch older than `epoch`
    admitted_under_leases: int = 0  # calls admitted under a lease (its grant's own not counted)
    refused_under_leases: int = 0  # calls refused under a lease that ended or was in use (LeaseClosed)
    _seen: _KeptUntil[GrantRef] = field(default_factory=_KeptUntil)
    _revoked: _KeptUntil[GrantRef] = field(default_factory=_KeptUntil)
    _calls: _KeptUntil[str] = field(default_factory=_KeptUntil)  # call ids admitted
    _leases: dict[GrantRef, _Lease] = field(default_factory=dict)  # the leases admitted, while their grant is kept
    _lease_tokens: dict[bytes, GrantRef] = field(default_factory=dict)

    def attach(self, scheduler_id: str, key: bytes, epoch: int = 0) -> None:
        """A scheduler (re)attached as the leader of `epoch`: grants are checked with its key
        from now on. Refused if a newer leader's epoch has been seen."""
        if epoch < self.epoch:
            raise Refused(
                f"scheduler {scheduler_id} leads as epoch {epoch}, but the leader of epoch {self.epoch} "
                "has been seen since: it is no longer the leader"
            )
        self.epoch = epoch
        self.scheduler_id, self.key, self.scheduler_epoch = scheduler_id, key, epoch
        self.end_leases()  # (the same scheduler too: attaching again, it counts every slot free)

    def end_leases(self) -> None:
        """No call is admitted under any lease from now on (the scheduler that granted them lost
        this node, or attached again: it counts their slots free). Calls running under them end
        as they will."""
        for lease in self._leases.values():
            lease.ended = True

    def saw_epoch(self, epoch: int) -> bool:
        """A leader of `epoch` exists (etcd's leader key says so): whether the attached scheduler
        is older, and so deposed (its grants are refused from now on)."""
        self.epoch = max(self.epoch, epoch)
        return bool(self.scheduler_id) and self.scheduler_epoch < self.epoch

    def admit(self, token: bytes, now_unix_s: float) -> pb.Grant:
        """The grant `token` carries, recorded as seen (a lease's, with its lease running its own
        call); raises Refused."""
        grant = self._verified(token)
        ref = (grant.call_id, grant.attempt)
        if ref in self._revoked.until:
            raise Refused(f"the grant for call {grant.call_id} attempt {grant.attempt} was revoked")
        if ref in self._seen.until:
            raise Refused(f"the grant for call {grant.call_id} attempt {grant.attempt} was used already")
        if now_unix_s > grant.claim_by_unix_s:
            raise Refused(f"the grant for call {grant.call_id} expired {now_unix_s - grant.claim_by_unix_s:.3f} s ago")
        if not grant.claim_by_unix_s <= now_unix_s + self.keep_s:  # (not: NaN too, which no time passes)
            # A revocation is remembered for keep_s: a longer claim window could outlive it.
            raise Refused(f"the grant's claim time is more than {self.keep_s:g} s ahead; check the clocks")
        if grant.lease_s and not 0.0 < grant.lease_s < math.inf:
            raise Refused(f"the grant's lease time {grant.lease_s} is not a number of seconds")
        kept_until = grant.claim_by_unix_s + self.keep_s
        # A lease's grant is kept while a call runs under it (its own first), and keep_s after.
        self._seen.set(ref, math.inf if grant.lease_s else kept_until)
        self.admitted += 1
        calls = self._calls.until
        if grant.call_id in calls:
            self.admitted_again += 1
        self._calls.set(grant.call_id, max(calls.get(grant.call_id, 0.0), kept_until))
        if grant.lease_s:
            self._leases[ref] = _Lease(grant, token)
            self._lease_tokens[token] = ref
        self._prune_books(now_unix_s, PRUNED_PER_ADMISSION)
        return grant

    def admit_under_lease(self, token: bytes, now_unix_s: float) -> pb.Grant:
        """The lease `token` carries, admitting one more call under it; raises Refused (the
        caller places the call instead: nothing ran); LeaseClosed, the routine case, counted in
        `refused_under_leases`."""
        try:
            ref, lease = self._open_lease(token, now_unix_s)
        except LeaseClosed:
            self.refused_under_leases += 1
            raise
        lease.running = True
        self._seen.set(ref, math.inf)  # kept while the call runs, however long
        self.admitted_under_leases += 1
        return lease.grant

    def _open_lease(self, token: bytes, now_unix_s: float) -> tuple[GrantRef, _Lease]:
        """The lease `token` carries, if a call may run under it now; raises Refused."""
        ref = self._lease_tokens.get(token)
        lease = None if ref is None else self._leases.get(ref)
        if lease is None or ref is None:
            grant = self._verified(token)  # (to say why: a bad token, or no lease of this node's)
            if not grant.lease_s:
                raise Refused(f"the grant for call {grant.call_id} is not a lease: it runs its own call only")
            raise LeaseClosed(
                f"the lease of call {grant.call_id} attempt {grant.attempt} has ended here; place the call"
            )
        grant = lease.grant
        if grant.scheduler_id != self.scheduler_id or grant.epoch < self.epoch:
            raise Refused("the lease's scheduler is no longer the attached leader; place the call again")
        if lease.ended or ref in self._revoked.until or now_unix_s > lease.until_unix_s:
            lease.ended = True
            raise LeaseClosed(f"the lease of call {grant.call_id} attempt {grant.attempt} has ended; place the call")
        if lease.running:
            raise LeaseClosed(f"a call runs under the lease of call {grant.call_id} already: one at a time")
        return ref, lease

    def lease_call_ended(self, ref: GrantRef, now_unix_s: float, *, keep: bool, done: bool = True) -> None:
        """The call running under lease `ref` (its grant's own, or one admitted under it) ended at
        `now_unix_s`; `keep`: the lease goes on, for a next call within `lease_s` (else it ends:
        its worker is lost); `done`: its Done is to be sent (`lease_done_sent`)."""
        lease = self._leases.get(ref)
        if lease is None:
            return
        lease.running, lease.done_pending = False, done
        lease.ended = lease.ended or not keep
        lease.until_unix_s = now_unix_s + lease.grant.lease_s
        self._seen.set(ref, lease.until_unix_s + self.keep_s)

    def lease_done_sent(self, ref: GrantRef) -> bool:
        """The Done of the last call ended under lease `ref` is being sent: whether the lease has
        ended with it (no call runs under it, and none will: its slot is free at the scheduler)."""
        lease = self._leases.get(ref)
        if lease is None:
            return False
        lease.done_pending = False
        return lease.ended and not lease.running

    def lease_busy(self, ref: GrantRef) -> bool:
        """Whether lease `ref` is open: a call runs under it or its Done is yet to be sent (so a
        Revoke's answer cannot overtake that Done), or it has not ended."""
        lease = self._leases.get(ref)
        return lease is not None and (lease.running or lease.done_pending or not lease.ended)

    def _verified(self, token: bytes) -> pb.Grant:
        """The grant of a token this node may run: signed by the attached leader, for one of its GPUs."""
        try:
            grant = verify(token, self.key)
        except BadToken as exc:
            raise Refused(str(exc)) from None
        if grant.scheduler_id != self.scheduler_id:
            raise Refused("the grant was signed by a scheduler that is no longer attached; place the call again")
        if grant.epoch < self.epoch:
            self.refused_stale += 1
            raise Refused(
                f"the grant is from the leader of epoch {grant.epoch}, deposed by the leader of epoch "
                f"{self.epoch}: place the call again with the current leader"
            )
        if grant.node != self.node or grant.gpu not in self.gpus:
            raise Refused(f"the grant is for {grant.node}/{grant.gpu}, not a GPU of node {self.node}")
        return grant

    def revoke(
        self, refs: Iterable[GrantRef], now_unix_s: float, *, claim_by_unix_s: float = 0.0, if_idle: bool = False
    ) -> tuple[list[GrantRef], list[GrantRef]]:
        """(unseen, seen): grants never presented are refused from now on; presented ones ran
        (a lease among them ends: no call is admitted under it from now on). `claim_by_unix_s`:
        the latest claim time among the grants, so that the revocation outlives any of them."""
        unseen: list[GrantRef] = []
        seen: list[GrantRef] = []
        until = max(now_unix_s, claim_by_unix_s) + self.keep_s
        for ref in refs:
            if ref in self._seen.until:
                seen.append(ref)
                lease = self._leases.get(ref)
                if lease is not None and not (if_idle and (lease.running or now_unix_s <= lease.until_unix_s)):
                    lease.ended = True  # (`if_idle`: one in use, or within its time, goes on)
            else:
                unseen.append(ref)
                # (Looked at again keep_s on at the latest: a claim time far ahead, which the
                # scheduler's clock says, does not hold up the pruning of the revocations after it.)
                self._revoked.set(ref, until, due_by=now_unix_s + self.keep_s)
        return unseen, seen

    def prune(self, now_unix_s: float) -> None:
        """Forget what is kept no longer. (Admissions prune a few expired entries each as they
        come; this sweeps the rest, as after a quiet spell.)"""
        self._prune_books(now_unix_s)
        seen = self._seen.until
        for ref in [ref for ref in self._leases if ref not in seen]:
            del self._lease_tokens[self._leases.pop(ref).token]

    def _prune_books(self, now_unix_s: float, limit: int = -1) -> None:
        for book in (self._seen, self._revoked, self._calls):
            book.prune(now_unix_s, limit)

    def __len__(self) -> int:
        return len(self._seen.until) + len(self._revoked.until)
