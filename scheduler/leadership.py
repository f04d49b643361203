"""Which scheduler leads: the election among scheduler instances, decided from observed facts.

Pure: no I/O, no clock (`now` and the send times are arguments, monotonic seconds). The etcd edge
(scheduler.election) campaigns, keeps the lease alive and watches the leader key, and tells this
object what it saw; the service asks it whether it may place calls now.

The leader key (`Keys.scheduler_leader`) is created only if absent, under the candidate's lease,
and never written again during the term: its etcd create_revision is the term's *epoch*, unique
and increasing cluster-wide. The leader is sure of its office until `ttl_s` after it sent the
last keep-alive that etcd answered (etcd expires the lease at least that late: it counts from
when the keep-alive arrived, and grants at least the TTL asked); past that it is *unsure*: it
holds what it decides, places nothing, and steps down once unsure `patience_s` longer, or at
once when the lease is known lost, the key is gone or someone else's, or a node has seen a newer
epoch. A standby campaigns whenever the key is absent. One that stepped down only for want of
answers keeps its lease in mind (`kept`): should a keep-alive of it be answered later (etcd was
restarting, not gone for good), no one else can have led meanwhile, and it resumes its term.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# How long a leader stays unsure (holding, placing nothing) before it steps down, in TTLs: long
# enough to ride out an etcd restart without a new term; a leader cut off from etcd while another
# leads is deposed sooner, by the nodes that the new leader attached (they refuse its epoch).
PATIENCE_TTLS = 5


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"


@dataclass(frozen=True, slots=True)
class Holder:
    """The leader key as read: whose it is (`address`), its term's epoch and the lease it is under."""

    address: str
    epoch: int
    lease: int


class Leadership:
    """One scheduler's view of the election (see the module's doc).

    Facts: `observed` (the leader key as read or watched), `won` (our campaign created the key),
    `renewed` (a keep-alive was answered), `lease_lost`, `fenced` (a node has seen a newer epoch),
    `stepped_down`. Decisions: `leading(now)`, `unsure(now)`, `campaign_due()`,
    `step_down_reason(now)`."""

    def __init__(self, address: str, ttl_s: float, *, patience_s: float | None = None) -> None:
        if not ttl_s > 0:
            raise ValueError(f"the leadership TTL must be > 0 seconds, got {ttl_s}")
        self.address = address
        self.ttl_s = ttl_s
        self.patience_s = PATIENCE_TTLS * ttl_s if patience_s is None else patience_s
        self.role = Role.STANDBY
        self.epoch = 0  # our term's, while we lead (0 as a standby)
        self.lease = 0  # the lease our term's key is under
        self.highest_epoch = 0  # the newest term seen anywhere (our own, the key's, a node's)
        self.holder: Holder | None = None  # the leader key as last seen (None: absent or not read yet)
        self._key_read = False  # the key has been read at least once (absent means absent)
        self._revision = 0  # the etcd revision of the newest observation of the key
        self._valid_until = -math.inf
        self._down: str | None = None  # why we must step down (lease lost, key gone, fenced)
        self.kept: Holder | None = None  # the term left for want of answers, which may resume

    # --- facts ------------------------------------------------------------------------------
    def observed(self, holder: Holder | None, revision: int) -> None:
        """The leader key as of etcd revision `revision`: None if it was absent. What is older
        than what was seen already (a watch catching up on our own campaign) is no news."""
        if holder is not None:
            self.highest_epoch = max(self.highest_epoch, holder.epoch)
        if revision < self._revision:
            return
        self._revision = revision
        self.holder, self._key_read = holder, True
        if self.role is not Role.LEADER:
            return
        if holder is None:
            self._down = "the leader key is gone"
        elif holder.epoch != self.epoch or holder.lease != self.lease:
            self._down = f"the leader key is {holder.address}'s now (epoch {holder.epoch})"

    def won(self, epoch: int, lease: int, sent_at: float) -> None:
        """Our campaign took the key (epoch: its create_revision) under `lease`, whose grant was
        asked for at `sent_at`: the lease cannot expire before `sent_at + ttl_s`."""
        self.role, self.epoch, self.lease = Role.LEADER, epoch, lease
        self.kept = None
        self.highest_epoch = max(self.highest_epoch, epoch)
        self.holder, self._key_read = Holder(self.address, epoch, lease), True
        self._revision = max(self._revision, epoch)
        self._valid_until = sent_at + self.ttl_s
        self._down = None

    def renewed(self, sent_at: float) -> None:
        """A keep-alive sent at `sent_at` was answered: the lease lives at least `ttl_s` past it."""
        if self.role is Role.LEADER:
            self._valid_until = max(self._valid_until, sent_at + self.ttl_s)

    def lease_lost(self) -> None:
        """etcd says our lease is gone (expired or revoked): its key went with it."""
        self.must_leave("the leadership lease expired")

    def fenced(self) -> None:
        """A node refused us: it has seen a newer epoch than ours. Someone else leads."""
        self.must_leave("a node has seen a newer leader's epoch")

    def must_leave(self, reason: str) -> None:
        """Whatever we lead, we leave it (`reason`: why)."""
        if self.role is Role.LEADER:
            self._down = reason

    def stepped_down(self) -> None:
        """We left office (sessions closed, nothing placed): a standby again. Left for want of
        answers alone, the term is `kept`: its lease may live still."""
        unanswered = self.role is Role.LEADER and self._down is None
        self.kept = Holder(self.address, self.epoch, self.lease) if unanswered else None
        self.role, self.epoch, self.lease = Role.STANDBY, 0, 0
        self._valid_until = -math.inf
        self._down = None

    # --- decisions --------------------------------------------------------------------------
    def leading(self, now: float) -> bool:
        """We lead and are sure of it: we may place calls and write the scheduler's state."""
        return self.role is Role.LEADER and self._down is None and now < self._valid_until

    def unsure(self, now: float) -> bool:
        """We lead but cannot be sure (no keep-alive answered lately): hold, place nothing."""
        return self.role is Role.LEADER and not self.leading(now)

    def forget_kept(self) -> None:
        """The kept term's lease is gone (or its key is not ours): it cannot resume."""
        self.kept = None

    def resume_due(self) -> bool:
        """A standby that left a term for want of answers tries to resume it before anything else."""
        return self.role is Role.STANDBY and self.kept is not None

    def campaign_due(self) -> bool:
        """A standby that has read the key and found it absent campaigns."""
        return self.role is Role.STANDBY and self._key_read and self.holder is None

    def step_down_reason(self, now: float) -> str | None:
        """Why we must leave office now (None: we need not)."""
        if self.role is not Role.LEADER:
            return None
        if self._down is not None:
            return self._down
        if now >= self._valid_until + self.patience_s:
            return f"no keep-alive answered for {now - self._valid_until + self.ttl_s:.1f} s"
        return None
