"""Placement pieces over the idle GPUs: where LALB's Algorithm 2 (and the policies built on it) may
put a call, as a mixin any policy's context can offer."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Set

from cache_manager import Tier
from scheduler.state import ClusterState, GpuState


class PlacementPieces:
    """The idle-GPU choices of `SchedulingContext` (best_idle, idle_with_room, idle_nearest_copy,
    idle_for_replica, idle_with_coldest_victim, first_idle_fitting), read from `self.cluster`,
    the committed state as the current fill has reserved on it. Only the LALB family asks them."""

    cluster: ClusterState

    def best_idle(self, gpu_ids: Set[str], exclude: str | None = None, *, model: str | None = None) -> str | None:
        """Of `gpu_ids` (but `exclude`), the idle one with the most free slots, then the first in
        idle order (fastest, then by id); None if none is idle. With one slot per GPU that is
        the first in idle order; with several, hits of a model spread over the GPUs that hold it
        instead of queueing on the first. With `model`, the one whose worker of it would be free
        soonest comes first (`worker_wait_s`; with one slot per GPU that is every idle one).
        O(min(len(gpu_ids), idle GPUs)), times D with `model`."""
        cluster = self.cluster
        idle, gpus = cluster.idle, cluster.gpus
        # Usually a handful of GPUs are idle while a hot model sits on hundreds: walk the shorter.
        candidates: Iterable[str] = (
            (gpu_id for _, gpu_id in idle if gpu_id in gpu_ids) if len(idle) < len(gpu_ids) else gpu_ids
        )
        best: GpuState | None = None
        best_key: tuple[float, int, tuple[float, str]] | None = None
        for gpu_id in candidates:
            state = gpus[gpu_id]
            if not state.idle or gpu_id == exclude:
                continue
            busy_until_s = (
                cluster.worker_busy_until_s(model, state) if model is not None and state.running else -math.inf
            )
            key = (busy_until_s, -state.free_slots, state.order_key)
            if best_key is None or key < best_key:
                best, best_key = state, key
        return None if best is None else best.spec.gpu_id

    def best_idle_holder(self, model: str, exclude: str | None = None) -> str | None:
        """`best_idle(cache.gpus_with(model), exclude, model=model)`, the same GPU, from the
        cluster's index of idle holders: O(log holders) amortized instead of O(holders x D)."""
        return self.cluster.best_idle_holder(model, exclude)

    def first_idle_fitting(self, model: str, exclude: str | None = None) -> str | None:
        """The first idle GPU (in idle order) the model may run on now (see `fits`): O(idle GPUs);
        only asked when it may not run on the GPU being filled (mixed memory sizes, a required
        GPU type, or models pinned by requests running there)."""
        for _, gpu_id in self.cluster.idle:
            if gpu_id != exclude and self.cluster.fits(model, gpu_id):
                return gpu_id
        return None

    def idle_with_coldest_victim(
        self, model: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """The idle GPU the model may run on now whose first eviction victim was used least
        recently, on the cache's clock shared by every GPU (a GPU that would evict nothing counts
        as coldest); None if the model may run on no idle GPU now. Ties (only between GPUs that
        evict nothing) go to the first in idle order. O(idle GPUs) with LRU eviction.

        Asked when no idle GPU has room for a miss: loading on the GPU being filled would always
        churn that GPU's LRU list while other GPUs' models stay frozen however cold; this evicts
        the cluster's coldest model instead. With `quiet_links_at`, a quiet host link breaks ties
        (GPUs that evict nothing): it never outweighs a colder victim."""
        cluster = self.cluster
        spec = cluster.models[model]
        best_gpu: str | None = None
        best_key = (0, 0)
        weigh_at = quiet_links_at if cluster.links.any() else None
        for _, gpu_id in cluster.idle:
            if gpu_id == exclude or not cluster.fits_spec(spec, cluster.gpus[gpu_id]):
                continue
            cache = cluster.cache.gpu(gpu_id)
            if not cache.can_admit(model, spec.memory_mb):
                continue
            victim = cache.first_victim(model, spec.memory_mb)
            tick = -1 if victim is None else cache.last_used_tick(victim)
            loading = min(1, cluster.copies_overlapping(model, gpu_id, weigh_at)) if weigh_at is not None else 0
            if best_gpu is None or (tick, loading) < best_key:
                best_gpu, best_key = gpu_id, (tick, loading)
        return best_gpu

    def idle_with_room(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU whose cache has room for `model` without evicting anything: `prefer` if
        it has, else the first in idle order; None if every idle GPU would have to evict. With
        `quiet_links_at`, one whose host link carries no load then comes first (`_quiet_first`).
        O(1) when `prefer` has room (and a quiet link), else O(idle GPUs)."""
        cluster = self.cluster
        spec = cluster.models[model]

        def room(gpu_id: str) -> bool:
            return (
                gpu_id != exclude
                and cluster.cache.gpu(gpu_id).free_mb >= spec.memory_mb
                and cluster.fits_spec(spec, cluster.gpus[gpu_id])
            )

        with_room = (gpu_id for gpu_id in itertools.chain((prefer,), (g for _, g in cluster.idle)) if room(gpu_id))
        return self._quiet_first(model, with_room, quiet_links_at)

    def idle_nearest_copy(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU the model may run on now (see `fits`) whose node holds it nearer than the
        GPU being filled (`prefer`) would have it: in host memory (its host tier or host model
        pool: a swap-in, not a load), else, when `prefer`'s node would have to fetch it, on disk
        (a load without the fetch). The nearest tier wins; within it one with room for the model
        (evicting nothing), else one that must evict, `prefer` first in each, then idle order. None if no
        node holds it nearer. With `quiet_links_at`, a GPU whose host link carries no load then
        comes first within a tier. O(1) without copies, else O(idle GPUs)."""
        cache = self.cluster.cache
        holdings = cache.holdings
        in_memory: Set[str] = cache.nodes_holding(model)
        pooling = holdings.nodes_pooling(model)
        if pooling:
            in_memory = in_memory | pooling if in_memory else pooling
        if in_memory:
            found = self._idle_on(model, in_memory, prefer, exclude, quiet_links_at)
            if found is not None:
                return found
        staging = holdings.nodes_staging(model)
        if staging and cache.tier(model, prefer) is Tier.REMOTE:
            return self._idle_on(model, staging, prefer, exclude, quiet_links_at)
        return None

    def _idle_on(
        self, model: str, nodes: Set[str], prefer: str, exclude: str | None, quiet_links_at: float | None
    ) -> str | None:
        """`idle_nearest_copy`'s choice among the idle GPUs of `nodes`: one with room for the
        model (`prefer` first), else one that must evict (`prefer` first). Room outranks `prefer`:
        a miss on the GPU being filled that evicts a warm model while another GPU holding the copy
        as near has room would throw it out for nothing (two models on a node's pool took turns
        on one GPU, every call a miss, beside an empty one). With `quiet_links_at`, a GPU on a
        quiet link (see `_quiet_first`) goes first within each; a quiet link never outweighs room
        (an eviction costs a later load, contention a share of one copy)."""
        cluster = self.cluster
        spec = cluster.models[model]

        def eligible(gpu_id: str) -> bool:
            return gpu_id != exclude and cluster.gpus[gpu_id].spec.node in nodes and cluster.fits(model, gpu_id)

        def candidates(with_room: bool) -> Iterable[str]:
            ordered = itertools.chain((prefer,), (gpu_id for _, gpu_id in cluster.idle if gpu_id != prefer))
            for gpu_id in ordered:
                if eligible(gpu_id) and (cluster.cache.gpu(gpu_id).free_mb >= spec.memory_mb) == with_room:
                    yield gpu_id

        found = self._quiet_first(model, candidates(True), quiet_links_at)
        return found if found is not None else self._quiet_first(model, candidates(False), quiet_links_at)

    def idle_for_replica(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None:
        """An idle GPU that does not hold `model` and has room for it now, evicting nothing
        (`prefer` if it is one, else the first in idle order; with `quiet_links_at` a quiet host
        link first, see `_quiet_first`); None if there is none. O(idle GPUs): asked only when the
        idle holders' workers of the model are busy."""
        cluster = self.cluster
        holders = cluster.cache.gpus_with(model)
        spec = cluster.models[model]

        def room(gpu_id: str) -> bool:
            return (
                gpu_id != exclude
                and gpu_id not in holders
                and cluster.fits_spec(spec, cluster.gpus[gpu_id])
                and cluster.cache.gpu(gpu_id).free_mb >= spec.memory_mb
            )

        first = (prefer,) if cluster.gpus[prefer].idle and room(prefer) else ()
        return self._quiet_first(
            model, itertools.chain(first, (gpu_id for _, gpu_id in cluster.idle if room(gpu_id))), quiet_links_at
        )

    def _quiet_first(self, model: str, candidates: Iterable[str], quiet_links_at: float | None) -> str | None:
        """The first of `candidates` where `model`'s copy, loaded at `quiet_links_at`, would share
        its host link with no other copy, else the first of them (Torpor's interference-aware
        placement: two copies behind one PCIe switch each take up to twice as long). Without
        `quiet_links_at`, or while no link has a copy, the first: lazy, as cheap as taking it."""
        if quiet_links_at is None or not self.cluster.links.any():
            return next(iter(candidates), None)
        first: str | None = None
        for gpu_id in candidates:
            if not self.cluster.copies_overlapping(model, gpu_id, quiet_links_at):
                return gpu_id
            if first is None:
                first = gpu_id
        return first
