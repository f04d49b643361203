"""The cache manager: one LRU list per GPU, pinning, admission with victims, model -> GPUs directory,
per node a host tier that keeps what its GPUs evicted (Torpor), and what each node's host model
pool and disk hold (`NodeHoldings`): the tier a miss comes from."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass

from cache_manager.eviction import EvictionPolicy, LruEviction
from cache_manager.holdings import NodeHoldings, Tier
from gpufaas.errors import CacheFull, ModelTooLarge
from gpufaas.footprints import Footprints


@dataclass(frozen=True, slots=True)
class Admission:
    """What admitting a model to a GPU did: a hit, or a miss that evicted `evicted` (LRU first).
    `from_host`: the miss takes the model from its node's host tier (a swap-in, not a load);
    `from_pool`: its weights from its node's host model pool (a swap-in too)."""

    hit: bool
    evicted: tuple[str, ...] = ()
    from_host: bool = False
    from_pool: bool = False


HIT = Admission(hit=True)  # every hit's Admission (frozen: one serves them all)


@dataclass(frozen=True, slots=True)
class CacheItem:
    model: str
    memory_mb: int


class HostTier:
    """One node's host memory for models evicted from its GPUs (Torpor's host tier), least
    recently evicted first. Exclusive of the GPUs: a model taken back onto a GPU leaves it, a model
    evicted from a GPU of the node enters it (pushing out the oldest entries if it must). A model
    larger than the whole tier does not enter.

    An entry is charged the host memory its node measured for the model (`measured`: a parked
    worker's PSS, from the node's reports), else the median of what the node measured for other
    models, else the model's declared GPU memory (the simulator's case: it measures nothing).
    `items` hold the charged MiB."""

    __slots__ = ("_footprints", "capacity_mb", "items", "node", "used_mb")

    def __init__(self, node: str, capacity_mb: int) -> None:
        if capacity_mb < 0:
            raise ValueError(f"node {node!r}: host capacity_mb must be >= 0, got {capacity_mb}")
        self.node = node
        self.capacity_mb = capacity_mb
        self.items: OrderedDict[str, CacheItem] = OrderedDict()
        self.used_mb = 0
        self._footprints = Footprints()

    def __contains__(self, model: object) -> bool:
        return model in self.items

    def charge_mb(self, model: str, declared_mb: int) -> int:
        """What `model` counts against the capacity when it enters (see the class)."""
        return self._footprints.charge_mb(model, declared_mb)

    def measured(self, model: str, host_mb: int) -> None:
        """The node measured `model`'s footprint: its entry (if any) is charged that from now on.
        The caller trims the tier if this took it past its capacity."""
        self._footprints.record(model, host_mb)
        item = self.items.get(model)
        if item is not None:
            self.used_mb += host_mb - item.memory_mb
            self.items[model] = CacheItem(model, host_mb)

    def lru_list(self) -> list[str]:
        """Held models, most recently evicted first."""
        return list(reversed(self.items))


class GpuCache:
    """The models resident on one GPU, least recently used first.

    Invariant: `used_mb <= capacity_mb` after every public call, and a pinned model (one with
    work running on, dispatched to, or parked for this GPU) is never evicted.
    """

    def __init__(self, gpu_id: str, capacity_mb: int, policy: EvictionPolicy) -> None:
        if capacity_mb <= 0:
            raise ValueError(f"GPU {gpu_id!r}: capacity_mb must be positive, got {capacity_mb}")
        self.gpu_id = gpu_id
        self.capacity_mb = capacity_mb
        self._policy = policy
        # Insertion order is recency: first = least recently used, last = most recently used.
        self._items: OrderedDict[str, CacheItem] = OrderedDict()
        # When each item was last admitted or hit, on the cache manager's clock shared by every
        # GPU: compares recency across GPUs (which GPU's victim is the coldest).
        self._last_used_tick: dict[str, int] = {}
        # Pin counts: a model may carry several pins (running and parked requests); never 0.
        self._pins: dict[str, int] = {}
        self.used_mb = 0
        self.pinned_mb = 0  # memory of the pinned models: what no eviction can free

    def __contains__(self, model: object) -> bool:
        return model in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    @property
    def free_mb(self) -> int:
        return self.capacity_mb - self.used_mb

    def item(self, model: str) -> CacheItem:
        return self._items[model]

    def lru_list(self) -> list[str]:
        """Resident models, most recently used first (the order stored in etcd and shown to users)."""
        return list(reversed(self._items))

    def last_used_tick(self, model: str) -> int:
        """When `model` was last admitted or hit here, on the cache manager's clock."""
        return self._last_used_tick[model]

    def is_pinned(self, model: str) -> bool:
        return model in self._pins  # counts that reach 0 are deleted

    def pin(self, model: str) -> None:
        item = self._items.get(model)
        if item is None:
            raise KeyError(f"cannot pin {model!r}: not cached on GPU {self.gpu_id!r}")
        count = self._pins.get(model, 0)
        if not count:
            self.pinned_mb += item.memory_mb
        self._pins[model] = count + 1

    def unpin(self, model: str) -> None:
        count = self._pins.get(model, 0)
        if count <= 0:
            raise KeyError(f"cannot unpin {model!r} on GPU {self.gpu_id!r}: it is not pinned")
        if count == 1:
            del self._pins[model]
            self.pinned_mb -= self._items[model].memory_mb
        else:
            self._pins[model] = count - 1

    def touch(self, model: str, *, tick: int) -> None:
        """Make `model` the most recently used here, as of `tick` on the cache manager's clock."""
        self._items.move_to_end(model)
        self._last_used_tick[model] = tick

    def can_admit(self, model: str, memory_mb: int) -> bool:
        """Whether `model` is resident, or could be made so now: the models in use leave room
        for it (other models may have to be evicted). O(1)."""
        return model in self._items or memory_mb <= self.capacity_mb - self.pinned_mb

    def first_victim(self, model: str, memory_mb: int) -> str | None:
        """The model this GPU would evict first to admit `model`; None if it needs no eviction
        (resident, or room to spare) or cannot be admitted now. O(pinned models) with LRU."""
        if model in self._items or not self.can_admit(model, memory_mb):
            return None
        needed_mb = memory_mb - self.free_mb
        lru_order = ((item.model, item.memory_mb) for item in self._items.values())
        return self._policy.first_victim(lru_order, needed_mb, self.is_pinned)

    def plan_victims(self, model: str, memory_mb: int) -> list[str]:
        """Victims (LRU first) whose eviction makes room for `model`; raises if none can.

        Raises ModelTooLarge when the model exceeds the GPU's whole capacity, CacheFull when only
        pinned models stand in the way (try again after running work finishes).
        """
        if memory_mb > self.capacity_mb:
            raise ModelTooLarge(
                f"model {model!r} needs {memory_mb} MB but GPU {self.gpu_id!r} holds at most "
                f"{self.capacity_mb} MB; declare a smaller memory_mb or add a larger GPU"
            )
        needed_mb = memory_mb - self.free_mb
        if needed_mb <= 0:
            return []
        victims = self._policy.choose_victims(
            [(item.model, item.memory_mb) for item in self._items.values()],
            needed_mb,
            self.is_pinned,
        )
        if victims is None:
            raise CacheFull(
                f"model {model!r} ({memory_mb} MB) does not fit on GPU {self.gpu_id!r}: "
                f"{self.used_mb} of {self.capacity_mb} MB are held by models in use"
            )
        return victims

    def insert(self, model: str, memory_mb: int, *, tick: int) -> None:
        """Add `model` as the most recently used here, as of `tick` on the cache manager's clock."""
        if model in self._items:
            raise KeyError(f"{model!r} is already cached on GPU {self.gpu_id!r}")
        if memory_mb > self.free_mb:
            raise CacheFull(f"{model!r} ({memory_mb} MB) exceeds the {self.free_mb} MB free on {self.gpu_id!r}")
        self._items[model] = CacheItem(model, memory_mb)
        self._last_used_tick[model] = tick
        self.used_mb += memory_mb

    def remove(self, model: str) -> CacheItem:
        if self.is_pinned(model):
            raise CacheFull(f"{model!r} is in use on GPU {self.gpu_id!r} and cannot be evicted")
        item = self._items.pop(model)
        del self._last_used_tick[model]
        self.used_mb -= item.memory_mb
        return item

    def resize(self, model: str, memory_mb: int) -> bool:
        """Re-size a resident model to what it was measured to use, if that fits without evicting
        anything; returns whether it did (else the old size stands until its next admission)."""
        item = self._items.get(model)
        if item is None or memory_mb <= 0 or memory_mb == item.memory_mb:
            return False
        if self.used_mb - item.memory_mb + memory_mb > self.capacity_mb:
            return False
        self.used_mb += memory_mb - item.memory_mb
        if self.is_pinned(model):
            self.pinned_mb += memory_mb - item.memory_mb
        self._items[model] = CacheItem(model, memory_mb)
        return True

    def drop(self, model: str) -> CacheItem | None:
        """Forget `model` whatever its pins (its worker died or its GPU left); None if absent."""
        item = self._items.pop(model, None)
        if item is not None:
            del self._last_used_tick[model]
            self.used_mb -= item.memory_mb
            if self._pins.pop(model, 0):
                self.pinned_mb -= item.memory_mb
        return item


class CacheManager:
    """Every GPU's cache plus the directory model -> GPUs that hold it.

    The single writer of cache state. Pure: no I/O, no wall clock; recency across GPUs is a
    logical clock that ticks on every admission (hit or miss). Lookups "where is this model
    cached" cost O(replicas) through the directory; one GPU's models cost O(models on it).
    """

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self._policy = policy if policy is not None else LruEviction()
        self._policy.replicas_of = lambda model: len(self._directory.get(model, _EMPTY))
        self._gpus: dict[str, GpuCache] = {}
        self._directory: dict[str, set[str]] = {}
        self._max_capacity_mb = 0  # kept as GPUs come and go: asked on every submit
        self._capacities: Counter[int] = Counter()  # capacity -> GPUs of it: the max after a removal
        self._tick = 0  # the recency clock: the last tick handed out
        self._hosts: dict[str, HostTier] = {}  # node -> its host tier (absent: the node has none)
        self._node_of: dict[str, str] = {}  # GPU -> its node, for GPUs added with one
        self._host_directory: dict[str, set[str]] = {}  # model -> nodes whose host tier holds it
        self.holdings = NodeHoldings()  # what nodes' host pools and disks hold, as they report it
        # Called with (model, gpu_id) whenever `gpu_id` joins `gpus_with(model)` (an admission that
        # missed, or an undone miss putting its victims back): the scheduler's index of idle
        # holders learns of a new holder from it. Leaving needs no call: readers check `gpus_with`.
        self.on_holder_added: Callable[[str, str], None] | None = None

    # --- GPUs -----------------------------------------------------------------------------
    def add_gpu(self, gpu_id: str, capacity_mb: int, *, node: str | None = None) -> GpuCache:
        """Add a GPU; `node` names the machine it is in, whose host tier (`add_host`) it shares."""
        if gpu_id in self._gpus:
            raise KeyError(f"GPU {gpu_id!r} is already known to the cache manager")
        cache = GpuCache(gpu_id, capacity_mb, self._policy)
        self._gpus[gpu_id] = cache
        if node is not None:
            self._node_of[gpu_id] = node
        self._max_capacity_mb = max(self._max_capacity_mb, capacity_mb)
        self._capacities[capacity_mb] += 1
        return cache

    def remove_gpu(self, gpu_id: str) -> list[str]:
        """Drop a GPU (its node left) and every cache entry on it; returns the models it held. The
        node's host tier goes with its last GPU."""
        cache = self._gpus.pop(gpu_id)
        # O(distinct capacities), not O(GPUs): a node's step-down removes every GPU in turn.
        self._capacities[cache.capacity_mb] -= 1
        if not self._capacities[cache.capacity_mb]:
            del self._capacities[cache.capacity_mb]
            if cache.capacity_mb == self._max_capacity_mb:
                self._max_capacity_mb = max(self._capacities, default=0)
        models = cache.lru_list()
        for model in models:
            self._forget(model, gpu_id)
        node = self._node_of.pop(gpu_id, None)
        if node is not None and node not in self._node_of.values():
            self.remove_host(node)
            self.holdings.forget(node)
        return models

    def add_host(self, node: str, capacity_mb: int) -> HostTier:
        """Give `node` a host tier of `capacity_mb` (0: none; replaces an existing one, emptied)."""
        self.remove_host(node)
        host = HostTier(node, capacity_mb)
        if capacity_mb > 0:
            self._hosts[node] = host
        return host

    def remove_host(self, node: str) -> None:
        host = self._hosts.pop(node, None)
        if host is not None:
            for model in host.items:
                self._forget_host(model, node)

    def host(self, node: str) -> HostTier | None:
        return self._hosts.get(node)

    def node_of(self, gpu_id: str) -> str | None:
        """The node a GPU was added with (None: added without one)."""
        return self._node_of.get(gpu_id)

    def host_of(self, gpu_id: str) -> HostTier | None:
        """The host tier of the GPU's node, if it has one."""
        node = self._node_of.get(gpu_id)
        return None if node is None else self._hosts.get(node)

    def in_host(self, model: str, gpu_id: str) -> bool:
        """Whether a miss of `model` on `gpu_id` would take it from its node's host tier. O(1)."""
        host = self.host_of(gpu_id) if self._hosts else None
        return host is not None and model in host.items

    def tier(self, model: str, gpu_id: str) -> Tier:
        """Where a miss of `model` on `gpu_id` would take it from. O(1)."""
        if self._hosts and self.in_host(model, gpu_id):
            return Tier.HOST
        node = self._node_of.get(gpu_id)
        holdings = self.holdings
        if holdings.in_pool(model, node):
            return Tier.POOL
        return Tier.DISK if holdings.on_disk(model, node) or not holdings.reports(node) else Tier.REMOTE

    def release(self, gpu_id: str, model: str) -> bool:
        """An idle model leaves its GPU (EDAS's staged exit): into its node's host tier if there is
        one (returns True), else gone. It must not be pinned."""
        cache = self._gpus[gpu_id]
        item = cache.remove(model)  # raises CacheFull if pinned
        self._forget(model, gpu_id)
        host = self.host_of(gpu_id)
        if host is None:
            return False
        self._demote(host, item)
        return model in host.items

    def adopt_in_host(self, node: str, model: str, host_mb: int) -> bool:
        """A model the node reports in its host tier, charged `host_mb` there (reconciliation): an
        entry this tier has is charged that from now on (the oldest pushed out if that takes the
        tier past its capacity); one it lacks enters as the most recent if it fits without pushing
        anything out. True if it is there."""
        host = self._hosts.get(node)
        if host is None:
            return False
        host.measured(model, host_mb)
        if model in host.items:
            self._trim_host(host)
            return model in host.items
        if host.used_mb + host_mb > host.capacity_mb:
            return False
        self._demote(host, CacheItem(model, host_mb))
        return True

    def recharge_host(self, node: str, host_mb: Mapping[str, int]) -> None:
        """The node measured the models in its host tier (model -> MiB): the entries it names are
        charged that from now on, all of them before the oldest are pushed out if the tier is then
        past its capacity. (One at a time, an interim sum over the capacity pushed out entries
        that fit together.)"""
        host = self._hosts.get(node)
        if host is None:
            return
        for model in [m for m in host.items if m in host_mb]:
            host.measured(model, host_mb[model])
        self._trim_host(host)

    def release_from_host(self, node: str, model: str) -> bool:
        """An idle model leaves its node's host tier; False if it was not there."""
        host = self._hosts.get(node)
        if host is None or model not in host.items:
            return False
        host.used_mb -= host.items.pop(model).memory_mb
        self._forget_host(model, node)
        return True

    def nodes_holding(self, model: str) -> Set[str]:
        """Nodes whose host tier holds `model` (a live read-only view)."""
        return self._host_directory.get(model, _EMPTY)

    def gpu(self, gpu_id: str) -> GpuCache:
        return self._gpus[gpu_id]

    def gpu_ids(self) -> list[str]:
        return list(self._gpus)

    @property
    def num_gpus(self) -> int:
        """How many GPUs are known: O(1), where `gpu_ids` copies them all."""
        return len(self._gpus)

    @property
    def max_capacity_mb(self) -> int:
        """The largest GPU's capacity: a model above it can never run here."""
        return self._max_capacity_mb

    # --- lookups --------------------------------------------------------------------------
    def is_cached(self, model: str, gpu_id: str) -> bool:
        return model in self._gpus[gpu_id]

    def gpus_with(self, model: str) -> Set[str]:
        """GPUs holding `model` (a live read-only view; copy it before mutating the cache)."""
        return self._directory.get(model, _EMPTY)

    def models_on(self, gpu_id: str) -> GpuCache:
        return self._gpus[gpu_id]

    # --- mutations ------------------------------------------------------------------------
    def admit(self, gpu_id: str, model: str, memory_mb: int) -> Admission:
        """Make `model` resident on `gpu_id` and most recently used there.

        A hit only refreshes recency. A miss evicts victims from the LRU tail until the model
        fits; pinned models are never victims. Raises ModelTooLarge / CacheFull and then changes
        nothing (the eviction policy's count of the access included).
        """
        undo_access = self._policy.record_access(model)
        try:
            return self._admit(gpu_id, model, memory_mb)
        except BaseException:  # refused (CacheFull, ModelTooLarge, an unknown GPU): changes nothing
            undo_access()
            raise

    def _admit(self, gpu_id: str, model: str, memory_mb: int) -> Admission:
        cache = self._gpus[gpu_id]
        if model in cache:
            self._tick += 1
            cache.touch(model, tick=self._tick)
            return HIT
        return self._admit_miss(cache, model, memory_mb, cache.plan_victims(model, memory_mb))

    def _admit_miss(self, cache: GpuCache, model: str, memory_mb: int, victims: list[str]) -> Admission:
        host = self.host_of(cache.gpu_id) if self._hosts else None
        from_host = host is not None and model in host.items
        if host is not None and from_host:
            host.used_mb -= host.items.pop(model).memory_mb
            self._forget_host(model, host.node)
        for victim in victims:
            item = cache.remove(victim)
            self._forget(victim, cache.gpu_id)
            if host is not None:
                self._demote(host, item)
        self._tick += 1
        cache.insert(model, memory_mb, tick=self._tick)
        self._add_holder(model, cache.gpu_id)
        from_pool = not from_host and self.holdings.in_pool(model, self._node_of.get(cache.gpu_id))
        return Admission(hit=False, evicted=tuple(victims), from_host=from_host, from_pool=from_pool)

    def _demote(self, host: HostTier, item: CacheItem) -> None:
        """An evicted model (`item` holds its GPU memory) enters its node's host tier, as the most
        recent, charged what it uses there, if it can fit."""
        charged = CacheItem(item.model, host.charge_mb(item.model, item.memory_mb))
        if charged.memory_mb > host.capacity_mb:
            return
        old = host.items.pop(item.model, None)  # a replica evicted from another GPU of the node
        if old is not None:
            host.used_mb -= old.memory_mb
        host.items[item.model] = charged
        host.used_mb += charged.memory_mb
        self._host_directory.setdefault(item.model, set()).add(host.node)
        self._trim_host(host)

    def _trim_host(self, host: HostTier) -> None:
        """Push out the least recently evicted entries until the tier is within its capacity."""
        while host.used_mb > host.capacity_mb:
            _, pushed_out = host.items.popitem(last=False)
            host.used_mb -= pushed_out.memory_mb
            self._forget_host(pushed_out.model, host.node)

    def pin(self, gpu_id: str, model: str) -> None:
        self._gpus[gpu_id].pin(model)

    def unpin(self, gpu_id: str, model: str) -> None:
        cache = self._gpus.get(gpu_id)
        if cache is not None and model in cache:
            cache.unpin(model)

    def drop(self, gpu_id: str, model: str) -> bool:
        """Forget `model` on `gpu_id` regardless of pins (its worker process died)."""
        cache = self._gpus.get(gpu_id)
        if cache is None or cache.drop(model) is None:
            return False
        self._forget(model, gpu_id)
        return True

    def resize(self, model: str, memory_mb: int) -> None:
        """Re-size `model`'s entry on every GPU that holds it, where that fits without evicting
        anything (`GpuCache.resize`; elsewhere the old size stands until its next admission)."""
        for gpu_id in self._directory.get(model, _EMPTY):
            self._gpus[gpu_id].resize(model, memory_mb)

    # --- tentative changes ------------------------------------------------------------------
    def admit_undoable(self, gpu_id: str, model: str, memory_mb: int) -> tuple[Admission, Callable[[], None]]:
        """`admit`, and a function that undoes it exactly (recency order, ticks, the directory, the
        clock); undos must run last-in first-out. The pin a caller adds is its own to undo."""
        cache = self._gpus[gpu_id]
        items, ticks = cache._items, cache._last_used_tick
        order = tuple(items)  # the keys only: what undo needs to put recency back
        clock_before = self._tick
        undo_access = self._policy.record_access(model)
        if model in items:
            tick_before = ticks[model]
            admission = self._admit(gpu_id, model, memory_mb)

            def undo_hit() -> None:
                ticks[model] = tick_before
                self._tick = clock_before
                _reorder(items, order, moved_from=order.index(model))
                undo_access()

            return admission, undo_hit
        try:
            victims = cache.plan_victims(model, memory_mb)
        except BaseException:  # refused: nothing to undo but the count
            undo_access()
            raise
        evicted = [(items[victim], ticks[victim]) for victim in victims]
        host = self.host_of(gpu_id) if self._hosts else None
        host_before = None if host is None else (tuple(host.items.values()), host.used_mb)
        admission = self._admit_miss(cache, model, memory_mb, victims)

        def undo_miss() -> None:
            if host is not None and host_before is not None:
                self._restore_host(host, *host_before)
            item = items.pop(model)
            del ticks[model]
            cache.used_mb -= item.memory_mb
            self._forget(model, gpu_id)
            for victim, tick in evicted:
                items[victim.model] = victim
                ticks[victim.model] = tick
                cache.used_mb += victim.memory_mb
                self._add_holder(victim.model, gpu_id)
            self._tick = clock_before
            _reorder(items, order, moved_from=0)
            undo_access()

        return admission, undo_miss

    def _restore_host(self, host: HostTier, items: tuple[CacheItem, ...], used_mb: int) -> None:
        for model in host.items:
            self._forget_host(model, host.node)
        host.items = OrderedDict((item.model, item) for item in items)
        host.used_mb = used_mb
        for model in host.items:
            self._host_directory.setdefault(model, set()).add(host.node)

    def _forget_host(self, model: str, node: str) -> None:
        _discard(self._host_directory, model, node)

    def _add_holder(self, model: str, gpu_id: str) -> None:
        self._directory.setdefault(model, set()).add(gpu_id)
        if self.on_holder_added is not None:
            self.on_holder_added(model, gpu_id)

    def _forget(self, model: str, gpu_id: str) -> None:
        _discard(self._directory, model, gpu_id)

    def snapshot(self) -> dict[str, list[CacheItem]]:
        """Every GPU's LRU list, most recent first (what is persisted and compared on recovery)."""
        return {gpu_id: [cache.item(model) for model in cache.lru_list()] for gpu_id, cache in self._gpus.items()}


def _discard(directory: dict[str, set[str]], model: str, holder: str) -> None:
    """Take `holder` off `model`'s holders in `directory`; a model held nowhere leaves it."""
    holders = directory.get(model)
    if holders is not None:
        holders.discard(holder)
        if not holders:
            del directory[model]


def _reorder(items: OrderedDict[str, CacheItem], order: tuple[str, ...], *, moved_from: int) -> None:
    """Put `items` back in `order` (the same keys), knowing that the keys before `moved_from`
    have not moved: move the rest to the end, in order. O(len(order) - moved_from)."""
    for key in order[moved_from:]:
        items.move_to_end(key)


_EMPTY: frozenset[str] = frozenset()
