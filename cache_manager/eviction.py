"""Eviction policies: which cached models leave a GPU so that a new one fits."""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

from gpufaas.types import Registry


class EvictionPolicy(ABC):
    """Chooses victims on one GPU. Pure: it reads only its arguments.

    Subclasses register under a short name: `class Foo(EvictionPolicy, name="foo")`.
    """

    registry: ClassVar[Registry[EvictionPolicy]] = Registry("eviction")
    name: ClassVar[str]
    # How many GPUs hold a model, for policies that weigh replicas (the cache manager sets it;
    # None: not known, count one).
    replicas_of: Callable[[str], int] | None = None

    def __init_subclass__(cls, *, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        EvictionPolicy.registry.register(name, cls)
        cls.name = name

    @abstractmethod
    def victim_order(
        self, lru_order: Iterable[tuple[str, int]], is_pinned: Callable[[str], bool]
    ) -> Iterable[tuple[str, int]]:
        """The unpinned (model, memory_mb) of `lru_order` (least to most recently used), in the
        order this policy evicts them. Lazy where it can be: `first_victim` takes only the first."""

    def choose_victims(
        self,
        lru_order: Sequence[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> list[str] | None:
        """Return models whose removal frees at least `needed_mb`, or None if no choice can.

        `lru_order` lists (model, memory_mb) from least to most recently used. Pinned models
        must never be returned.
        """
        return _take_until(self.victim_order(lru_order, is_pinned), needed_mb)

    def record_access(self, model: str) -> Callable[[], None]:
        """`model` was admitted to a GPU (a hit or a miss). For policies that count accesses;
        returns how to take the count back (the scheduler's drafts undo admissions)."""
        return _nothing

    def first_victim(
        self,
        lru_order: Iterable[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> str | None:
        """The first model `choose_victims` would return, or None if it would return none. The
        caller has checked that the unpinned models can free `needed_mb`.

        Asked once per idle GPU when a miss must evict somewhere (to compare what each GPU would
        give up): O(pinned models before it) with LRU, whose order is lazy.
        """
        if needed_mb <= 0:
            return None
        return next((model for model, _ in self.victim_order(lru_order, is_pinned)), None)


class LruEviction(EvictionPolicy, name="lru"):
    """The paper's policy: victims come from the LRU tail, skipping pinned models."""

    def victim_order(
        self, lru_order: Iterable[tuple[str, int]], is_pinned: Callable[[str], bool]
    ) -> Iterable[tuple[str, int]]:
        return ((model, mb) for model, mb in lru_order if not is_pinned(model))


DEFAULT_HEAVY_MB = 2048  # a model at least this large is "heavy": slow to swap back in


class HeavinessEviction(EvictionPolicy, name="heaviness"):
    """Torpor's eviction: under pressure, keep one replica of each model across the GPUs (evict
    models that another GPU also holds first), then evict light models (cheap to swap back in)
    before heavy ones, least recently used first within each group. Heavy: `memory_mb` at
    least `heavy_mb` (Torpor measures swap interference; size stands for it here)."""

    def __init__(self, heavy_mb: int = DEFAULT_HEAVY_MB) -> None:
        self.heavy_mb = heavy_mb

    def victim_order(
        self, lru_order: Iterable[tuple[str, int]], is_pinned: Callable[[str], bool]
    ) -> list[tuple[str, int]]:
        replicas_of = self.replicas_of
        candidates = [(rank, model, mb) for rank, (model, mb) in enumerate(lru_order) if not is_pinned(model)]
        candidates.sort(
            key=lambda c: (
                (replicas_of(c[1]) if replicas_of is not None else 1) <= 1,  # replicated ones first
                c[2] >= self.heavy_mb,  # then light before heavy
                c[0],  # then least recently used first
            )
        )
        return [(model, mb) for _, model, mb in candidates]


class FrequencySketch:
    """How often each key was seen lately, approximately, in fixed memory (TinyLFU's count-min
    sketch): `depth` rows of `width` counters, each key counted in one counter per row (picked by
    a stable hash, so runs repeat), its estimate the smallest of them. Counters stop at 15, and
    every `10 x width` additions all of them halve, so that old popularity fades."""

    MAX_COUNT = 15

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        if width < 1 or width > 1 << 16 or depth < 1 or depth > 4:
            raise ValueError(f"width must be 1..65536 and depth 1..4, got {width} and {depth}")
        self.width = width
        self.depth = depth
        self.sample_size = 10 * width
        self._rows = [[0] * width for _ in range(depth)]
        self._additions = 0
        self._slots: dict[str, tuple[int, ...]] = {}  # key -> its counter in each row

    def estimate(self, key: str) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots_of(key), strict=True))

    def add(self, key: str) -> Callable[[], None]:
        """Count `key` once; returns how to undo exactly that (last-in first-out)."""
        slots = self._slots_of(key)
        before = [row[slot] for row, slot in zip(self._rows, slots, strict=True)]
        for row, slot in zip(self._rows, slots, strict=True):
            if row[slot] < self.MAX_COUNT:
                row[slot] += 1
        self._additions += 1
        if self._additions < self.sample_size:

            def undo() -> None:
                self._additions -= 1
                for row, slot, value in zip(self._rows, slots, before, strict=True):
                    row[slot] = value

            return undo
        snapshot = [row[:] for row in self._rows]
        for row, slot, value in zip(snapshot, slots, before, strict=True):
            row[slot] = value
        self._age()

        def undo_with_aging() -> None:
            self._rows = snapshot
            self._additions = self.sample_size - 1

        return undo_with_aging

    def _age(self) -> None:
        for row in self._rows:
            row[:] = [count >> 1 for count in row]
        self._additions //= 2

    def _slots_of(self, key: str) -> tuple[int, ...]:
        slots = self._slots.get(key)
        if slots is None:
            digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
            slots = tuple(int.from_bytes(digest[2 * i : 2 * i + 2], "little") % self.width for i in range(self.depth))
            self._slots[key] = slots
        return slots


class TinyLfuEviction(EvictionPolicy, name="tinylfu"):
    """Frequency-aware eviction after TinyLFU (Einziger et al.; Caffeine's W-TinyLFU): every
    admission is counted in a `FrequencySketch` that forgets with time, and victims are the
    models used least often lately, least recently used first among equals. The most recently
    used `window` share of a GPU's models (at least one) is a window that goes last, so a model
    just loaded is not evicted by the next miss for having no history yet. A miss cannot be
    refused here (the call needs its model on the GPU), so TinyLFU's admission filter becomes the
    victim choice."""

    def __init__(self, width: int = 1024, window: float = 0.1) -> None:
        if not 0.0 <= window < 1.0:
            raise ValueError(f"window must be in [0, 1), got {window}")
        self.sketch = FrequencySketch(width)
        self.window = window

    def record_access(self, model: str) -> Callable[[], None]:
        return self.sketch.add(model)

    def victim_order(
        self, lru_order: Iterable[tuple[str, int]], is_pinned: Callable[[str], bool]
    ) -> list[tuple[str, int]]:
        lru_order = list(lru_order)  # its length places the window
        protected_from = len(lru_order) - max(1, math.ceil(len(lru_order) * self.window))
        candidates = [
            (rank >= protected_from, self.sketch.estimate(model), rank, model, mb)
            for rank, (model, mb) in enumerate(lru_order)
            if not is_pinned(model)
        ]
        candidates.sort()
        return [(model, mb) for *_, model, mb in candidates]


def _nothing() -> None:
    pass


def _take_until(candidates: Iterable[tuple[str, int]], needed_mb: int) -> list[str] | None:
    """The first candidates, in order, that free `needed_mb` together; None if all of them cannot."""
    victims: list[str] = []
    freed_mb = 0
    for model, memory_mb in candidates:
        if freed_mb >= needed_mb:
            break
        victims.append(model)
        freed_mb += memory_mb
    return victims if freed_mb >= needed_mb else None


def eviction_policy(name: str) -> EvictionPolicy:
    """Instantiate a registered eviction policy by name; unknown names list the valid ones."""
    return EvictionPolicy.registry.lookup(name)()
