"""The leases a gateway holds: slots the scheduler lets it use for a function's calls without asking.

A hit's Placement may carry a lease (`lease_s`, docs/hit-leases.md): once its own call is answered,
the gateway may send the same token again with further calls of that function (the same package),
one at a time, straight to the node, each within `lease_s` of the answer to the one before. Pure:
time (monotonic seconds) is passed in. A lease is used until a little before that time is up by
this gateway's clock (the node, which ends it then by its own, ended the call before the gateway
had its answer), while the scheduler link it came on is the current one (`epoch`); the router
drops one whose node refused it or was lost. Whatever it is told, the node decides: a lease the
scheduler revoked is refused there and the call is placed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufaas.proto import gpufaas_pb2 as pb

# A lease is used until this share of its time is up: the node's clock, which ends it, started it
# before this gateway had the answer, and a call sent at the very end would be refused.
USABLE_SHARE = 0.9

LeaseKey = tuple[str, str]  # (function, model): a new version of the function is another key


@dataclass(slots=True, eq=False)
class Lease:
    """One leased slot: the placement whose token it reuses, and `answer`, the placement a call
    under it is answered with (its node and GPU; no queueing, first attempt)."""

    key: LeaseKey
    placement: pb.Placement
    answer: pb.Placement
    usable_until: float
    epoch: int  # the router's scheduler link it came on
    busy: bool = False  # a call runs under it (one at a time)


@dataclass
class Leases:
    """The leases held, by function: added when a leased placement's own call was answered,
    taken by a call (busy) and given back when it is answered, dropped when they cannot be used."""

    _by_key: dict[LeaseKey, list[Lease]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(leases) for leases in self._by_key.values())

    def add(self, key: LeaseKey, placement: pb.Placement, now: float, epoch: int) -> None:
        """`placement` (with `lease_s` > 0, received at `now` on link `epoch`) is a lease, idle now."""
        answer = pb.Placement(
            call_id=placement.call_id, attempt=1, node=placement.node, gpu=placement.gpu, hit=True, epoch=epoch
        )
        lease = Lease(key, placement, answer, now + placement.lease_s * USABLE_SHARE, epoch)
        # Leases are few and added seldom (one per lease): the idle ones past their time go now,
        # those of functions never called again among them.
        for other_key, leases in list(self._by_key.items()):
            leases[:] = [held for held in leases if held.busy or held.usable_until > now]
            if not leases:
                del self._by_key[other_key]
        self._by_key.setdefault(key, []).append(lease)

    def take(self, key: LeaseKey, now: float, epoch: int) -> Lease | None:
        """An idle lease for `key` (marked busy), or None. Idle leases past their time or from
        another scheduler link are dropped on the way."""
        leases = self._by_key.get(key)
        if not leases:
            return None
        found = None
        for lease in list(leases):
            if not lease.busy and (lease.usable_until <= now or lease.epoch != epoch):
                leases.remove(lease)  # (a busy one's call has its time start again when answered)
            elif found is None and not lease.busy:
                found = lease
        if not leases:
            del self._by_key[key]
        if found is not None:
            found.busy = True
        return found

    def give_back(self, lease: Lease, now: float) -> None:
        """The call under `lease` was answered at `now`: it may take the next one, within its time."""
        lease.busy = False
        lease.usable_until = now + lease.placement.lease_s * USABLE_SHARE

    @staticmethod
    def put_back(lease: Lease) -> None:
        """`lease` was taken for a call its node skipped unread (a payload over its limit): idle
        again as it was, its time not started again (no call ran under it)."""
        lease.busy = False

    def drop(self, lease: Lease) -> None:
        """`lease` cannot be used any more (refused, its node lost, its worker gone)."""
        leases = self._by_key.get(lease.key)
        if leases is not None and lease in leases:
            leases.remove(lease)
            if not leases:
                del self._by_key[lease.key]
