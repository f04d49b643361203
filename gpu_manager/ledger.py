"""The node's ledger of grants: which placement tokens it accepts, once each, and which it revoked.

Pure: wall-clock time (`now_unix_s`) is an argument. A grant is accepted when its signature
verifies under the attached scheduler's key, it names this node and one of its GPUs, it is
presented by its claim time (which may be at most `keep_s` ahead), and neither it (call id,
attempt) nor its revocation is in the ledger. A grant seen is kept `keep_s` past its claim time;
a revocation `keep_s` past the latest claim time of the grants revoked (the scheduler says it),
or past the revocation itself; then they are pruned: an older token is refused by its claim
time alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpufaas.grants import BadToken, verify
from gpufaas.proto import gpufaas_pb2 as pb

GrantRef = tuple[str, int]  # (call id, attempt)


class Refused(Exception):
    """A token the node will not run; the message says why (for the gateway and the log)."""


@dataclass
class GrantLedger:
    node: str
    gpus: frozenset[str]
    key: bytes = b""
    scheduler_id: str = ""
    keep_s: float = 60.0
    _seen: dict[GrantRef, float] = field(default_factory=dict)  # -> when it may be pruned
    _revoked: dict[GrantRef, float] = field(default_factory=dict)

    def attach(self, scheduler_id: str, key: bytes) -> None:
        """A scheduler (re)attached: grants are checked with its key from now on."""
        self.scheduler_id, self.key = scheduler_id, key

    def admit(self, token: bytes, now_unix_s: float) -> pb.Grant:
        """The grant `token` carries, recorded as seen; raises Refused."""
        try:
            grant = verify(token, self.key)
        except BadToken as exc:
            raise Refused(str(exc)) from None
        if grant.scheduler_id != self.scheduler_id:
            raise Refused("the grant was signed by a scheduler that is no longer attached; place the call again")
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
            for ref in [ref for ref, until in book.items() if until < now_unix_s]:
                del book[ref]

    def __len__(self) -> int:
        return len(self._seen) + len(self._revoked)
