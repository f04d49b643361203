"""Eviction policies: which cached models leave a GPU so that a new one fits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

from gpufaas.errors import UnknownPolicy


class EvictionPolicy(ABC):
    """Chooses victims on one GPU. Pure: it reads only its arguments.

    Subclasses register under a short name: `class Foo(EvictionPolicy, name="foo")`.
    """

    registry: ClassVar[dict[str, type[EvictionPolicy]]] = {}
    name: ClassVar[str]
    # How many GPUs hold a model, for policies that weigh replicas (the cache manager sets it;
    # None: not known, count one).
    replicas_of: Callable[[str], int] | None = None

    def __init_subclass__(cls, *, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name in EvictionPolicy.registry:
            raise ValueError(f"eviction policy {name!r} is registered twice")
        cls.name = name
        EvictionPolicy.registry[name] = cls

    @abstractmethod
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

    def first_victim(
        self,
        lru_order: Iterable[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> str | None:
        """The first model `choose_victims` would return, or None if it would return none. The
        caller has checked that the unpinned models can free `needed_mb`.

        Asked once per idle GPU when a miss must evict somewhere (to compare what each GPU would
        give up), so a policy that can answer without listing every victim should override it.
        """
        victims = self.choose_victims(list(lru_order), needed_mb, is_pinned)
        return victims[0] if victims else None


class LruEviction(EvictionPolicy, name="lru"):
    """The paper's policy: victims come from the LRU tail, skipping pinned models."""

    def choose_victims(
        self,
        lru_order: Sequence[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> list[str] | None:
        return _take_until(((m, mb) for m, mb in lru_order if not is_pinned(m)), needed_mb)

    def first_victim(
        self,
        lru_order: Iterable[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> str | None:
        """The least recently used unpinned model: O(pinned models before it), not O(models).
        The caller has checked that the unpinned models can free `needed_mb`."""
        if needed_mb <= 0:
            return None
        return next((model for model, _ in lru_order if not is_pinned(model)), None)


DEFAULT_HEAVY_MB = 2048  # a model at least this large is "heavy": slow to swap back in


class HeavinessEviction(EvictionPolicy, name="heaviness"):
    """Torpor's eviction: under pressure, keep one replica of each model across the GPUs (evict
    models that another GPU also holds first), then evict light models (cheap to swap back in)
    before heavy ones, least recently used first within each group. Heavy: `memory_mb` at
    least `heavy_mb` (Torpor measures swap interference; size stands for it here)."""

    def __init__(self, heavy_mb: int = DEFAULT_HEAVY_MB) -> None:
        self.heavy_mb = heavy_mb

    def _order(self, lru_order: Iterable[tuple[str, int]], is_pinned: Callable[[str], bool]) -> list[tuple[str, int]]:
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

    def choose_victims(
        self,
        lru_order: Sequence[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> list[str] | None:
        return _take_until(self._order(lru_order, is_pinned), needed_mb)

    def first_victim(
        self,
        lru_order: Iterable[tuple[str, int]],
        needed_mb: int,
        is_pinned: Callable[[str], bool],
    ) -> str | None:
        if needed_mb <= 0:
            return None
        ordered = self._order(lru_order, is_pinned)
        return ordered[0][0] if ordered else None


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
    try:
        cls = EvictionPolicy.registry[name]
    except KeyError:
        valid = ", ".join(sorted(EvictionPolicy.registry))
        raise UnknownPolicy(f"unknown eviction policy {name!r}; valid policies: {valid}") from None
    return cls()
