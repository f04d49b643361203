"""EDAS's staged exit: the clocks of idle models on GPUs and in host tiers, and the releases they
and a policy's swap-out call for."""

from __future__ import annotations

from scheduler.decisions import Dispatch, Release
from scheduler.policies.base import SchedulingPolicy
from scheduler.state import ClusterState

RELEASE_CHECK_MIN_S = 0.25  # bounds of how often the staged exit looks for idle models
RELEASE_CHECK_MAX_S = 5.0


def release_check_period_s(gpu_idle_s: float | None, host_idle_s: float | None, *, policy_releases: bool) -> float:
    """How often the scheduler looks for idle models to release (the service's releaser, and the
    simulator's clock as it): a quarter of the shorter stage's timeout, between RELEASE_CHECK_MIN_S
    and _MAX_S; at the shortest where the policy swaps out (`releases_memory`)."""
    stages = [s for s in (gpu_idle_s, host_idle_s) if s is not None]
    if not stages or policy_releases:
        return RELEASE_CHECK_MIN_S
    return min(RELEASE_CHECK_MAX_S, max(RELEASE_CHECK_MIN_S, min(stages) / 4))


class StagedExit:
    """When each cached model was last used on its GPU, and when each host-tier model entered its
    tier, kept as the scheduler hears of dispatches and completions; `release_idle` frees what has
    been idle too long."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self._last_used_s: dict[tuple[str, str], float] = {}  # (GPU, model) -> last used
        self._host_since_s: dict[tuple[str, str], float] = {}  # (node, model) -> entered its host tier

    def used(self, gpu_id: str, model: str, now: float) -> None:
        """`model` was used on `gpu_id` now (a call of it finished there): idle from now."""
        self._last_used_s[(gpu_id, model)] = now

    def forget(self, gpu_id: str, model: str) -> None:
        """`model`'s entry left `gpu_id` (its worker died, or the GPU left)."""
        self._last_used_s.pop((gpu_id, model), None)

    def dispatched(self, decision: Dispatch, now: float) -> None:
        """A kept dispatch: its model was used now; what it evicted entered the host tier now."""
        cache = self.cluster.cache
        self._last_used_s[(decision.gpu_id, decision.request.model)] = now
        node = self.cluster.gpus[decision.gpu_id].spec.node
        for victim in decision.evict:
            self._last_used_s.pop((decision.gpu_id, victim), None)
            if node is not None and cache.in_host(victim, decision.gpu_id):
                self._host_since_s[(node, victim)] = now
        if decision.from_host and node is not None:
            self._host_since_s.pop((node, decision.request.model), None)

    def release_idle(
        self, now: float, policy: SchedulingPolicy, *, gpu_idle_s: float | None, host_idle_s: float | None
    ) -> list[Release]:
        """See `Scheduler.release_idle`: the policy's swap-out, then the GPU stage, then the host
        stage."""
        releases: list[Release] = []
        cache, gpus = self.cluster.cache, self.cluster.gpus
        if policy.releases_memory:
            for model in policy.idle_models(now):
                for gpu_id in list(cache.gpus_with(model)):
                    node = gpus[gpu_id].spec.node
                    if node is None or cache.host(node) is None or cache.gpu(gpu_id).is_pinned(model):
                        continue
                    releases.append(self._release_from_gpu(gpu_id, model, now))
        if gpu_idle_s is not None:
            for gpu_id in gpus:
                gpu_cache = cache.gpu(gpu_id)
                for model in list(gpu_cache):
                    used_s = self._last_used_s.setdefault((gpu_id, model), now)  # untracked: from now
                    if gpu_cache.is_pinned(model) or now - used_s < gpu_idle_s:
                        continue
                    releases.append(self._release_from_gpu(gpu_id, model, now))
        if host_idle_s is not None:
            releases += self._release_from_hosts(now, host_idle_s)
        return releases

    def _release_from_hosts(self, now: float, host_idle_s: float) -> list[Release]:
        """The host stage: models in a host tier for `host_idle_s` leave it (their worker goes)."""
        cache = self.cluster.cache
        # Clocks of models no longer in a host tier (pushed out by a later demotion, or their
        # tier left with its node) go first.
        stale = [(node, model) for node, model in self._host_since_s if node not in cache.nodes_holding(model)]
        for key in stale:
            del self._host_since_s[key]
        releases: list[Release] = []
        for node in {state.spec.node for state in self.cluster.gpus.values() if state.spec.node is not None}:
            host = cache.host(node)
            for model in list(host.items) if host is not None else ():
                since_s = self._host_since_s.setdefault((node, model), now)
                if now - since_s >= host_idle_s and cache.release_from_host(node, model):
                    del self._host_since_s[(node, model)]
                    releases.append(Release("host", model, node))
        return releases

    def _release_from_gpu(self, gpu_id: str, model: str, now: float) -> Release:
        """Unpinned `model` leaves `gpu_id`, for its node's host tier if it has one (whose clock
        for the staged exit's second stage starts now)."""
        self._last_used_s.pop((gpu_id, model), None)
        to_host = self.cluster.cache.release(gpu_id, model)
        node = self.cluster.gpus[gpu_id].spec.node
        if to_host and node is not None:
            self._host_since_s[(node, model)] = now
        return Release("gpu", model, node, gpu_id, to_host)
