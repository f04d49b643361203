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
        victims: list[str] = []
        freed_mb = 0
        for model, memory_mb in lru_order:
            if freed_mb >= needed_mb:
                break
            if is_pinned(model):
                continue
            victims.append(model)
            freed_mb += memory_mb
        return victims if freed_mb >= needed_mb else None

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


def eviction_policy(name: str) -> EvictionPolicy:
    """Instantiate a registered eviction policy by name; unknown names list the valid ones."""
    try:
        cls = EvictionPolicy.registry[name]
    except KeyError:
        valid = ", ".join(sorted(EvictionPolicy.registry))
        raise UnknownPolicy(f"unknown eviction policy {name!r}; valid policies: {valid}") from None
    return cls()
