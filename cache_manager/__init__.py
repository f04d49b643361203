"""Per-GPU model caches (LRU lists), victim selection, and the model -> GPUs directory."""

from gpufaas import native

native.install()  # before the submodules below: their compiled builds where built and current

from cache_manager.eviction import EvictionPolicy, HeavinessEviction, LruEviction, eviction_policy
from cache_manager.holdings import NodeHoldings, Tier
from cache_manager.manager import Admission, CacheItem, CacheManager, GpuCache, HostTier

__all__ = [
    "Admission",
    "CacheItem",
    "CacheManager",
    "EvictionPolicy",
    "GpuCache",
    "HeavinessEviction",
    "HostTier",
    "LruEviction",
    "NodeHoldings",
    "Tier",
    "eviction_policy",
]
