"""Frequency-aware eviction (cache_manager.eviction: FrequencySketch, TinyLfuEviction): counts
that fade, victims by frequency with a recency window, exact undo through the cache manager."""

from __future__ import annotations

import pytest

from cache_manager import CacheManager, eviction_policy
from cache_manager.eviction import FrequencySketch, TinyLfuEviction
from gpufaas.errors import CacheFull, ModelTooLarge


def test_the_sketch_counts_caps_and_halves_everything_after_its_sample() -> None:
    sketch = FrequencySketch(width=64)
    for _ in range(3):
        sketch.add("a")
    sketch.add("b")
    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.estimate("never")) == (3, 1, 0)
    for _ in range(40):
        sketch.add("a")
    assert sketch.estimate("a") == FrequencySketch.MAX_COUNT
    # 10 x 64 additions in all: at the 640th every counter halves.
    for _ in range(640 - 44 - 1):
        sketch.add("c")
    assert sketch.estimate("a") == 15
    sketch.add("b")
    assert (sketch.estimate("a"), sketch.estimate("b")) == (7, 1)  # 15 >> 1, (1 + 1) >> 1


def test_undoing_additions_restores_the_counts_exactly_even_across_aging() -> None:
    sketch = FrequencySketch(width=8)
    undos = [sketch.add(key) for key in "abcabca" * 11 + "ab"]  # 79 of them: aging at the 80th
    before = {key: sketch.estimate(key) for key in "abcz"}
    undo_aging = sketch.add("c")
    assert sketch.estimate("a") < before["a"]  # halved
    undo_aging()
    assert {key: sketch.estimate(key) for key in "abcz"} == before
    for undo in reversed(undos):
        undo()
    assert all(sketch.estimate(key) == 0 for key in "abc")


def test_victims_are_the_least_used_lately_and_the_newest_are_a_window() -> None:
    policy = TinyLfuEviction(window=0.25)
    for model, uses in (("hot", 9), ("warm", 3), ("cold", 1), ("new", 0)):
        for _ in range(uses):
            policy.record_access(model)
    lru = [("hot", 100), ("cold", 100), ("warm", 100), ("new", 100)]  # least recently used first
    free = lambda model: False  # noqa: E731
    assert policy.choose_victims(lru, 100, free) == ["cold"]
    # "new" has no history but is the most recent quarter: it goes last, after "hot".
    assert policy.choose_victims(lru, 400, free) == ["cold", "warm", "hot", "new"]
    assert policy.first_victim(iter(lru), 100, lambda m: m == "cold") == "warm"  # pinned: never
    assert policy.choose_victims(lru, 500, free) is None
    with pytest.raises(ValueError, match="window"):
        TinyLfuEviction(window=1.0)


def test_the_cache_manager_counts_every_admission_and_its_undo_takes_the_count_back() -> None:
    cache = CacheManager(eviction_policy("tinylfu"))
    cache.add_gpu("g0", 300)
    for model in ("a", "a", "a", "b", "c"):
        cache.admit("g0", model, 100)
    assert cache.admit("g0", "d", 100).evicted == ("b",)  # b and c once, c newer: b goes (not a, the LRU)
    policy = cache.gpu("g0")._policy
    assert isinstance(policy, TinyLfuEviction)
    before = policy.sketch.estimate("a"), policy.sketch.estimate("e")
    _, undo_hit = cache.admit_undoable("g0", "a", 100)
    _, undo_miss = cache.admit_undoable("g0", "e", 100)
    undo_miss()
    undo_hit()
    assert (policy.sketch.estimate("a"), policy.sketch.estimate("e")) == before


def test_an_admission_the_cache_refuses_is_not_counted() -> None:
    # `admit` counted the access before finding that the model could not be admitted, though a
    # refused admission "changes nothing": each refusal made the model look more used lately.
    policy = TinyLfuEviction()
    cache = CacheManager(policy)
    cache.add_gpu("g0", 1000)
    cache.admit("g0", "pinned", 600)
    cache.pin("g0", "pinned")
    with pytest.raises(ModelTooLarge):
        cache.admit("g0", "huge", 2000)
    with pytest.raises(CacheFull):
        cache.admit("g0", "blocked", 600)
    with pytest.raises(CacheFull):
        cache.admit_undoable("g0", "blocked", 600)
    assert policy.sketch.estimate("huge") == policy.sketch.estimate("blocked") == 0
