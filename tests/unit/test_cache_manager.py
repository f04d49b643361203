"""The per-GPU LRU caches, pinning, victim selection and the model -> GPUs directory."""

from __future__ import annotations

import random

import pytest

from cache_manager import CacheManager, eviction_policy
from gpufaas.errors import CacheFull, ModelTooLarge, UnknownPolicy


def make_cache(*gpus: tuple[str, int]) -> CacheManager:
    cache = CacheManager()
    for gpu_id, capacity_mb in gpus or (("g0", 3000),):
        cache.add_gpu(gpu_id, capacity_mb)
    return cache


def test_hit_refreshes_recency_without_evicting() -> None:
    cache = make_cache()
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 1000)
    admission = cache.admit("g0", "A", 1000)
    assert admission.hit and admission.evicted == ()
    assert cache.gpu("g0").lru_list() == ["A", "B"]


def test_miss_evicts_from_the_lru_tail_until_the_model_fits() -> None:
    cache = make_cache()
    for model in "ABC":
        cache.admit("g0", model, 1000)
    admission = cache.admit("g0", "D", 1500)
    assert not admission.hit
    assert admission.evicted == ("A", "B")
    assert cache.gpu("g0").lru_list() == ["D", "C"]
    assert cache.gpu("g0").used_mb == 2500


def test_pinned_model_is_never_a_victim() -> None:
    cache = make_cache()
    for model in "ABC":
        cache.admit("g0", model, 1000)
    cache.pin("g0", "A")
    assert cache.admit("g0", "D", 1000).evicted == ("B",)
    cache.pin("g0", "C")
    cache.pin("g0", "D")
    with pytest.raises(CacheFull, match="held by models in use"):
        cache.admit("g0", "E", 1000)
    # A refused admission changes nothing.
    assert cache.gpu("g0").lru_list() == ["D", "C", "A"]


def test_pins_count_and_release() -> None:
    cache = make_cache()
    cache.admit("g0", "A", 3000)
    cache.pin("g0", "A")
    cache.pin("g0", "A")
    cache.unpin("g0", "A")
    with pytest.raises(CacheFull):
        cache.admit("g0", "B", 1000)
    cache.unpin("g0", "A")
    assert cache.admit("g0", "B", 1000).evicted == ("A",)


def test_model_larger_than_the_gpu_is_refused_with_a_message() -> None:
    cache = make_cache(("g0", 2000))
    with pytest.raises(ModelTooLarge, match=r"needs 2500 MB but GPU 'g0' holds at most 2000 MB"):
        cache.admit("g0", "huge", 2500)


def test_directory_tracks_replicas_across_gpus() -> None:
    cache = make_cache(("g0", 2000), ("g1", 2000))
    cache.admit("g0", "A", 1000)
    cache.admit("g1", "A", 1000)
    assert cache.gpus_with("A") == {"g0", "g1"}
    cache.admit("g0", "B", 2000)  # evicts A from g0
    assert cache.gpus_with("A") == {"g1"}
    assert cache.remove_gpu("g1") == ["A"]
    assert cache.gpus_with("A") == set()
    assert cache.gpus_with("never-seen") == set()


def test_drop_forgets_a_model_even_if_pinned() -> None:
    cache = make_cache()
    cache.admit("g0", "A", 1000)
    cache.pin("g0", "A")
    assert cache.drop("g0", "A")
    assert cache.gpus_with("A") == set()
    assert cache.gpu("g0").used_mb == 0
    assert not cache.drop("g0", "A")


def test_snapshot_lists_items_most_recent_first() -> None:
    cache = make_cache()
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 500)
    assert [(i.model, i.memory_mb) for i in cache.snapshot()["g0"]] == [("B", 500), ("A", 1000)]


def test_unknown_eviction_policy_lists_the_valid_ones() -> None:
    assert eviction_policy("lru").name == "lru"
    with pytest.raises(UnknownPolicy, match="valid policies: heaviness, lru"):
        eviction_policy("fifo")


def test_max_capacity_follows_gpus_joining_and_leaving() -> None:
    cache = make_cache(("g0", 2000), ("g1", 6000), ("g2", 6000))
    assert cache.max_capacity_mb == 6000
    cache.remove_gpu("g1")
    assert cache.max_capacity_mb == 6000
    cache.remove_gpu("g2")
    assert cache.max_capacity_mb == 2000
    cache.remove_gpu("g0")
    assert cache.max_capacity_mb == 0


def test_max_capacity_is_the_largest_gpu_left_after_random_joins_and_leaves() -> None:
    rng = random.Random(7)
    cache = CacheManager()
    sizes: dict[str, int] = {}
    for step in range(400):
        if sizes and rng.random() < 0.45:
            gone = rng.choice(sorted(sizes))
            cache.remove_gpu(gone)
            del sizes[gone]
        else:
            sizes[f"g{step}"] = rng.choice((2000, 4000, 6000, 8000))
            cache.add_gpu(f"g{step}", sizes[f"g{step}"])
        assert cache.max_capacity_mb == max(sizes.values(), default=0)
        assert cache.num_gpus == len(sizes)


def test_one_recency_clock_orders_admissions_and_hits_across_gpus() -> None:
    cache = make_cache(("g0", 3000), ("g1", 3000))
    cache.admit("g0", "A", 1000)
    cache.admit("g1", "B", 1000)
    cache.admit("g0", "C", 1000)
    ticks = [
        cache.gpu("g0").last_used_tick("A"),
        cache.gpu("g1").last_used_tick("B"),
        cache.gpu("g0").last_used_tick("C"),
    ]
    assert ticks == sorted(ticks) and len(set(ticks)) == 3
    cache.admit("g0", "A", 1000)  # a hit refreshes it
    assert cache.gpu("g0").last_used_tick("A") > cache.gpu("g0").last_used_tick("C")


def test_first_victim_is_the_least_recently_used_unpinned_model() -> None:
    cache = make_cache()
    for model in "ABC":
        cache.admit("g0", model, 1000)
    gpu = cache.gpu("g0")
    assert gpu.first_victim("D", 1000) == "A"
    cache.pin("g0", "A")
    assert gpu.first_victim("D", 1000) == "B"
    assert gpu.first_victim("B", 1000) is None  # resident: nothing to evict
    cache.unpin("g0", "A")
    cache.admit("g0", "D", 1000)  # evicts A
    assert gpu.first_victim("E", 500) == "B"


def test_can_admit_counts_the_memory_pinned_models_hold() -> None:
    cache = make_cache()
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 1500)
    gpu = cache.gpu("g0")
    cache.pin("g0", "B")
    cache.pin("g0", "B")  # two requests: counted once
    assert gpu.pinned_mb == 1500
    assert gpu.can_admit("C", 1500) and not gpu.can_admit("C", 1600)
    assert gpu.first_victim("C", 1600) is None  # cannot be admitted now
    assert gpu.can_admit("B", 1500)  # resident
    assert gpu.resize("B", 1800)
    assert gpu.pinned_mb == 1800
    cache.unpin("g0", "B")
    assert gpu.pinned_mb == 1800
    cache.unpin("g0", "B")
    assert gpu.pinned_mb == 0
    cache.pin("g0", "A")
    cache.drop("g0", "A")
    assert gpu.pinned_mb == 0 and gpu.used_mb == 1800


def full_state(cache: CacheManager) -> tuple[object, ...]:
    return (
        cache.snapshot(),
        {g: {m: cache.gpu(g).last_used_tick(m) for m in cache.gpu(g)} for g in cache.gpu_ids()},
        {m: sorted(cache.gpus_with(m)) for m in "ABCDE"},
        {g: (cache.gpu(g).used_mb, cache.gpu(g).pinned_mb) for g in cache.gpu_ids()},
    )


def test_admit_undoable_undoes_hits_and_misses_last_in_first_out() -> None:
    cache = make_cache(("g0", 3000), ("g1", 3000))
    for model in "ABC":
        cache.admit("g0", model, 1000)
    cache.admit("g1", "A", 1000)
    cache.pin("g0", "C")
    before = full_state(cache)
    undos = []
    for gpu, model in (("g0", "A"), ("g0", "D"), ("g0", "E"), ("g1", "B"), ("g0", "D")):
        _, undo = cache.admit_undoable(gpu, model, 1000)
        undos.append(undo)
    assert cache.gpu("g0").lru_list() == ["D", "E", "C"]  # B then A were evicted, C is pinned
    for undo in reversed(undos):
        undo()
    assert full_state(cache) == before
    assert cache.admit("g0", "D", 1000).evicted == ("A",)  # the recency order came back too


def test_admit_undoable_that_cannot_admit_changes_nothing() -> None:
    cache = make_cache(("g0", 2000))
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 1000)
    cache.pin("g0", "A")
    cache.pin("g0", "B")
    before = full_state(cache)
    with pytest.raises(CacheFull):
        cache.admit_undoable("g0", "C", 1000)
    assert full_state(cache) == before


# --- the host tier -------------------------------------------------------------------------------


def tiered(host_mb: int = 2000) -> CacheManager:
    """Node n0 with GPUs g0, g1 (2000 MB each) and a host tier; node n1 with g2 and none."""
    cache = CacheManager()
    cache.add_gpu("g0", 2000, node="n0")
    cache.add_gpu("g1", 2000, node="n0")
    cache.add_gpu("g2", 2000, node="n1")
    cache.add_host("n0", host_mb)
    return cache


def test_an_evicted_model_stays_in_its_nodes_host_tier_and_comes_back_by_swap_in() -> None:
    cache = tiered()
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 1000)
    assert cache.admit("g0", "C", 1000).evicted == ("A",)
    host = cache.host("n0")
    assert host is not None and host.lru_list() == ["A"] and sorted(cache.nodes_holding("A")) == ["n0"]
    # Any GPU of the node takes it back (and the host tier lets it go: exclusive).
    assert cache.in_host("A", "g1") and not cache.in_host("A", "g2")
    admission = cache.admit("g1", "A", 1000)
    assert (admission.hit, admission.from_host) == (False, True)
    assert "A" not in host and not cache.nodes_holding("A")
    # Another node has no host tier: its misses are loads, and what it evicts is gone.
    assert cache.admit("g2", "A", 1000).from_host is False
    cache.admit("g2", "D", 1000)
    cache.admit("g2", "E", 1000)
    assert not cache.nodes_holding("A")  # g2 evicted it into no tier


def test_the_host_tier_pushes_out_its_oldest_and_refuses_what_cannot_fit() -> None:
    cache = tiered(host_mb=2500)
    for model in "ABCD":  # each evicts the one before last: A, then B
        cache.admit("g0", model, 1000)
    host = cache.host("n0")
    assert host is not None and host.lru_list() == ["B", "A"] and host.used_mb == 2000
    cache.admit("g0", "E", 1000)  # evicts C: A is pushed out to make room
    assert host.lru_list() == ["C", "B"] and not cache.nodes_holding("A")
    big = tiered(host_mb=500)
    big.admit("g0", "A", 1000)
    big.admit("g0", "B", 1000)
    big.admit("g0", "C", 1000)
    assert big.host("n0") is not None and big.host("n0").lru_list() == []  # type: ignore[union-attr]


def test_a_dropped_model_does_not_enter_the_host_tier_and_the_tier_leaves_with_its_node() -> None:
    cache = tiered()
    cache.admit("g0", "A", 1000)
    cache.drop("g0", "A")  # its worker died: nothing to keep
    assert not cache.nodes_holding("A")
    cache.admit("g0", "B", 1000)
    cache.admit("g0", "C", 1000)
    cache.admit("g0", "D", 1000)
    assert cache.nodes_holding("B") == {"n0"}
    cache.remove_gpu("g0")
    assert cache.host("n0") is not None  # g1 is still there
    cache.remove_gpu("g1")
    assert cache.host("n0") is None and not cache.nodes_holding("B")


def test_the_host_tier_charges_what_its_node_measured_not_declared_gpu_memory() -> None:
    cache = tiered(host_mb=100)
    host = cache.host("n0")
    assert host is not None
    cache.admit("g0", "A", 1000)
    cache.admit("g0", "B", 1000)
    cache.admit("g0", "C", 1000)  # evicts A: 1000 MB declared, more than the tier
    assert host.lru_list() == []
    # The node reports A parked at 30 MB (its worker's PSS): adopted, and the figure remembered.
    assert cache.adopt_in_host("n0", "A", 30) and host.used_mb == 30
    cache.admit("g1", "A", 1000)  # taken back
    cache.admit("g0", "D", 1000)  # evicts B: not measured, charged the median of what was (30)
    cache.admit("g0", "E", 1000)  # evicts C: likewise
    assert host.lru_list() == ["C", "B"] and host.used_mb == 60
    # A later report measures B at 50: 80 MB; then C at 80: 130 > 100, B (the older) goes.
    assert cache.adopt_in_host("n0", "B", 50) and host.used_mb == 80
    assert cache.adopt_in_host("n0", "C", 80) and host.lru_list() == ["C"] and host.used_mb == 80
    assert not cache.nodes_holding("B")


def test_admit_undoable_restores_the_host_tier_too() -> None:
    cache = tiered(host_mb=1000)
    for model in "ABC":
        cache.admit("g0", model, 1000)  # A went to the host tier
    before = (full_state(cache), cache.host("n0").lru_list())  # type: ignore[union-attr]
    undos = [cache.admit_undoable("g1", "A", 1000)[1]]  # a swap-in
    undos.append(cache.admit_undoable("g0", "D", 1000)[1])  # evicts B into the tier
    undos.append(cache.admit_undoable("g0", "E", 1000)[1])  # evicts C, pushes B out
    for undo in reversed(undos):
        undo()
    assert (full_state(cache), cache.host("n0").lru_list()) == before  # type: ignore[union-attr]
    assert cache.nodes_holding("A") == {"n0"} and not cache.nodes_holding("B")


# --- heaviness-aware eviction (Torpor) ------------------------------------------------------------


def test_heaviness_eviction_takes_replicated_then_light_models_then_the_least_recent() -> None:
    cache = CacheManager(eviction_policy("heaviness"))
    cache.add_gpu("g0", 8000)
    cache.add_gpu("g1", 8000)
    # g0, least recent first: H1 (heavy), L1 (light), R (light, also on g1), H2 (heavy), L2 (light).
    for model, mb in (("H1", 2500), ("L1", 1000), ("R", 1000), ("H2", 2500), ("L2", 1000)):
        cache.admit("g0", model, mb)
    cache.admit("g1", "R", 1000)
    assert cache.gpu("g0").first_victim("N", 1000) == "R"  # full: the replicated model goes first
    victims = cache.gpu("g0").plan_victims("N", 3000)  # needs 3000: R (a replica), then L1, L2
    assert victims == ["R", "L1", "L2"]
    assert cache.gpu("g0").plan_victims("N", 4500) == ["R", "L1", "L2", "H1"]  # then heavy, LRU first
    lru = CacheManager()
    lru.add_gpu("g0", 8000)
    for model, mb in (("H1", 2500), ("L1", 1000), ("R", 1000), ("H2", 2500), ("L2", 1000)):
        lru.admit("g0", model, mb)
    assert lru.gpu("g0").plan_victims("N", 3000) == ["H1", "L1"]  # the paper's LRU, for contrast


def test_heaviness_eviction_never_takes_a_pinned_model() -> None:
    cache = CacheManager(eviction_policy("heaviness"))
    cache.add_gpu("g0", 3000)
    cache.admit("g0", "L1", 1000)
    cache.admit("g0", "H1", 2000)
    cache.pin("g0", "L1")
    assert cache.gpu("g0").plan_victims("N", 2000) == ["H1"]
    cache.pin("g0", "H1")
    with pytest.raises(CacheFull):
        cache.gpu("g0").plan_victims("N", 1000)
