"""Scheduler shards: which shard is a function's home (rendezvous hashing) and when a call spills.

Pure: no I/O, no clock. K scheduler shards each own a disjoint set of nodes; a gateway sends a call
to one of its function's homes, and the home either places it (the `Scheduler` over its GPUs) or
forwards it once to another shard by the spill rule. docs/scheduler-shards.md is the design.

- Homes. Every function ranks the shards by rendezvous (highest random weight) hashing:
  blake2b(shard, function) as a 64-bit weight, highest first. A function's home is the first of
  its ranking; a hot function (a share of all calls above `max_home_share / K`) has the first
  `ceil(share * K / max_home_share)` shards of its ranking as homes, and each call picks one of
  them by a hash of its call id. Adding a shard moves only the functions that rank the new shard
  first (about 1/(K+1) of them), and each to the new shard; removing one moves only its own.
- Spill (`SpillRule`). A home places a call itself when it holds the model on an idle GPU;
  otherwise it may forward it to a shard whose last load summary (gossiped every few ms, so
  possibly stale) shows the model on an idle GPU, or, when it has no idle GPU and `queue_bound`
  calls or more wait there, to the shard with the most idle GPUs. A forwarded call is never
  forwarded again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

DEFAULT_MAX_HOME_SHARE = 0.5  # a function may fill at most half of one shard's fair share per home


def rendezvous_weight(shard: str, key: str) -> int:
    """The 64-bit weight of `shard` for `key`: the same on every gateway and shard, no state."""
    digest = hashlib.blake2b(f"{shard}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_rank(key: str, shards: Sequence[str]) -> list[str]:
    """`shards` by their weight for `key`, highest first (ties, practically never, by name)."""
    return sorted(shards, key=lambda shard: (-rendezvous_weight(shard, key), shard))


def home_count(share: float, shards: int, max_home_share: float = DEFAULT_MAX_HOME_SHARE) -> int:
    """How many homes a function with `share` (0..1) of all calls gets among `shards`: enough that
    each home takes at most `max_home_share` of a shard's fair share (1 / shards), at least 1 and
    at most `shards`."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if not 0 < max_home_share <= 1:
        raise ValueError(f"max_home_share must be in (0, 1], got {max_home_share}")
    return max(1, min(shards, math.ceil(share * shards / max_home_share)))


@dataclass(frozen=True, slots=True)
class ShardMap:
    """The shards by name and each function's share of the calls (what the shards measure and
    publish; a function absent from `shares` is cold: one home). Same inputs, same homes,
    everywhere."""

    shards: tuple[str, ...]
    shares: dict[str, float]
    max_home_share: float = DEFAULT_MAX_HOME_SHARE

    def __post_init__(self) -> None:
        if not self.shards or len(set(self.shards)) != len(self.shards):
            raise ValueError(f"shards must be distinct names, at least one, got {self.shards}")

    def homes(self, function: str) -> list[str]:
        """The function's homes, first the one a single-home function would have."""
        count = home_count(self.shares.get(function, 0.0), len(self.shards), self.max_home_share)
        return rendezvous_rank(function, self.shards)[:count]

    def home_of_call(self, function: str, call_id: str) -> str:
        """The home a gateway sends this call to: one of the function's homes, by the call id's
        hash (a hot function's calls spread evenly over its homes)."""
        homes = self.homes(function)
        if len(homes) == 1:
            return homes[0]
        return max(homes, key=lambda shard: rendezvous_weight(shard, call_id))


@dataclass(frozen=True, slots=True)
class ShardLoad:
    """A shard's load as the spill rule reads it: at the home its exact state now, for the others
    their last gossiped summary. `idle_models`: models cached on at least one of its idle GPUs."""

    shard: str
    idle_gpus: int
    queued: int  # calls waiting in its global queue
    idle_models: frozenset[str]


@dataclass(frozen=True, slots=True)
class SpillRule:
    """Where a home sends a call it is offered. In order: home, if it holds the model on an idle
    GPU; with `spill_for_hits`, the roomiest other shard whose summary shows the model on an idle
    GPU (a remote hit instead of a local load); home, if it has an idle GPU (a local load, as one
    scheduler would load it on some idle GPU); when `queue_bound` or more calls already wait at
    home, the roomiest other shard showing the model idle, else the roomiest with an idle GPU;
    else home (the call waits there, as it would with one scheduler). Roomiest: most idle GPUs,
    then fewest calls waiting, then by name."""

    queue_bound: int = 0
    spill_for_hits: bool = True

    def __post_init__(self) -> None:
        if self.queue_bound < 0:
            raise ValueError(f"queue_bound must be >= 0, got {self.queue_bound}")

    def target(self, model: str, home: ShardLoad, others: Collection[ShardLoad]) -> str:
        """The shard that should place a call for `model` first offered to `home`."""
        if model in home.idle_models:
            return home.shard
        holders = [load for load in others if model in load.idle_models]
        if self.spill_for_hits and holders:
            return max(holders, key=_roomiest).shard
        if home.idle_gpus > 0 or home.queued < self.queue_bound:
            return home.shard
        roomy = holders or [load for load in others if load.idle_gpus > 0]
        return max(roomy, key=_roomiest).shard if roomy else home.shard


def _roomiest(load: ShardLoad) -> tuple[int, int, str]:
    """Most idle GPUs first, then fewest waiting, then by name (deterministic)."""
    return (load.idle_gpus, -load.queued, load.shard)
