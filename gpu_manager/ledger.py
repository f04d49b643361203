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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from gpufaas.grants import BadToken, verify
from gpufaas.proto import gpufaas_pb2 as pb

GrantRef = tuple[str, int]  # (call id, attempt)
K = TypeVar("K")


class Refused(Exception):
    """A token the node will not run, or a scheduler it will not take; the message says why."""


@dataclass
class GrantLedger:
    node: str
    gpus: frozenset[str]
    key: bytes = b""
    scheduler_id: str = ""
    keep_s: float = 60.0
    epoch: int = 0  # the newest leader's epoch seen
    scheduler_epoch: int = 0  # the attached scheduler's
    admitted: int = 0  # grants admitted
    admitted_again: int = 0  # of them, for a call admitted before (within keep_s)
    refused_stale: int = 0  # grants refused for an epoch older than `epoch`
    _seen: dict[GrantRef, float] = field(default_factory=dict)  # -> when it may be pruned
    _revoked: dict[GrantRef, float] = field(default_factory=dict)
    _calls: dict[str, float] = field(default_factory=dict)  # call ids admitted -> when they may be pruned

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

    def saw_epoch(self, epoch: int) -> bool:
        """A leader of `epoch` exists (etcd's leader key says so): whether the attached scheduler
        is older, and so deposed (its grants are refused from now on)."""
        self.epoch = max(self.epoch, epoch)
        return bool(self.scheduler_id) and self.scheduler_epoch < self.epoch

    def admit(self, token: bytes, now_unix_s: float) -> pb.Grant:
        """The grant `token` carries, recorded as seen; raises Refused."""
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
        ref = (grant.call_id, grant.attempt)
        if ref in self._revoked:
            raise Refused(f"the grant for call {grant.call_id} attempt {grant.attempt} was revoked")
        if ref in self._seen:
            raise Refused(f"the grant for call {grant.call_id} attempt {grant.attempt} was used already")
        if now_unix_s > grant.claim_by_unix_s:
            raise Refused(f"the grant for call {grant.call_id} expired {now_unix_s - grant.claim_by_unix_s:.3f} s ago")
        if grant.claim_by_unix_s > now_unix_s + self.keep_s:
            # A revocation is remembered for keep_s: a longer claim window could outlive it.
            raise Refused(f"the grant's claim time is more than {self.keep_s:g} s ahead; check the clocks")
        self._seen[ref] = grant.claim_by_unix_s + self.keep_s
        self.admitted += 1
        if grant.call_id in self._calls:
            self.admitted_again += 1
        self._calls[grant.call_id] = max(self._calls.get(grant.call_id, 0.0), self._seen[ref])
        return grant

    def revoke(
        self, refs: Iterable[GrantRef], now_unix_s: float, *, claim_by_unix_s: float = 0.0
    ) -> tuple[list[GrantRef], list[GrantRef]]:
        """(unseen, seen): grants never presented are refused from now on; presented ones ran.
        `claim_by_unix_s`: the latest claim time among the grants, so that the revocation
        outlives any of them."""
        unseen: list[GrantRef] = []
        seen: list[GrantRef] = []
        until = max(now_unix_s, claim_by_unix_s) + self.keep_s
        for ref in refs:
            if ref in self._seen:
                seen.append(ref)
            else:
                unseen.append(ref)
                self._revoked[ref] = until
        return unseen, seen

    def prune(self, now_unix_s: float) -> None:
        for book in (self._seen, self._revoked):
            _prune(book, now_unix_s)
        _prune(self._calls, now_unix_s)

    def __len__(self) -> int:
        return len(self._seen) + len(self._revoked)


def _prune(book: dict[K, float], now_unix_s: float) -> None:
    """Drop the entries whose keep time has passed."""
    for key in [key for key, until in book.items() if until < now_unix_s]:
        del book[key]
