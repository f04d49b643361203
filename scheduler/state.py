"""The scheduler's committed state: each GPU's slots and local queue, the idle order, the catalog,
and the reads a policy's draft makes of them."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from mypy_extensions import mypyc_attr

from cache_manager import CacheManager, Tier
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler.estimator import Estimator
from scheduler.links import LinkCopies
from scheduler.queues import GlobalQueue


@dataclass(slots=True)
class GpuState:
    """One GPU's scheduling state: D = `spec.slots` slots, each running at most one request.

    Lifecycle: a dispatch adds a request to `running` and its expected finish to
    `expected_finish_s`; `on_complete`/`on_failure` remove both. `local_queue` holds parked
    requests (all hits here), which take free slots before anything from the global queue.
    Read-only outside the scheduler.
    """

    spec: GpuSpec
    # Request id -> request, in dispatch order; at most `spec.slots` of them, unless `set_slots`
    # lowered D below the count (then nothing more starts here until enough finish).
    running: dict[str, Request] = field(default_factory=dict)
    # Request id -> when it is expected to finish: its estimated inference after the later of
    # its estimated load (on a miss) and the expected finish of the calls of its model dispatched
    # here before it (they share the model's worker, which serves them one at a time).
    expected_finish_s: dict[str, float] = field(default_factory=dict)
    # When a slot is expected to free up (an absolute time): the expected finish of the running
    # request whose end gives a full GPU a free slot (the earliest one, or a later one while D is
    # below the running count); -inf while a slot is free. Kept as `running` changes.
    busy_until_s: float = -math.inf
    local_queue: deque[Request] = field(default_factory=deque)
    local_work_s: float = 0.0  # estimated inference time of the parked requests, summed
    # Bumped whenever the GPU gets a free slot, and whenever it is advertised in the per-model
    # free-time heaps (full, with a new free time): marks older entries there as stale.
    version: int = 0
    # Model -> when the last of its calls running here is expected to finish (its worker serves
    # them one at a time); only models with a call running. Kept by `start` and `stop`.
    worker_busy_until_s: dict[str, float] = field(default_factory=dict)
    # Set anew (by `ClusterState.reindex`) whenever `running` or D changes: entries of the idle-holder
    # index that carry another stamp are stale. Unique over every GPU's lifetime.
    stamp: int = 0
    # The stamp at which every model it held got an index entry (`reindex` without `grew`).
    indexed_stamp: int = 0

    @property
    def idle(self) -> bool:
        """Whether the GPU has a free slot, i.e. can start one more request now. The paper's
        "idle GPU" (the one policies fill) runs nothing; with D slots the GPU that can take work
        is the one with a free slot. With D = 1 the two are the same."""
        return len(self.running) < self.spec.slots

    @property
    def free_slots(self) -> int:
        return max(0, self.spec.slots - len(self.running))

    @property
    def free_at_s(self) -> float:
        """When this GPU is expected to be able to start one more request beyond its parked ones,
        which run D at a time; -inf while a slot is free."""
        return self.busy_until_s + self.local_work_s / self.spec.slots

    @property
    def order_key(self) -> tuple[float, str]:
        """Idle GPUs are offered work in this order: fastest first, then by id."""
        return (-self.spec.speed, self.spec.gpu_id)

    def start(self, request: Request, finish_s: float) -> None:
        """`request` takes a slot, expected to finish at `finish_s` (the caller keeps the rest)."""
        self.running[request.request_id] = request
        self.expected_finish_s[request.request_id] = finish_s
        model = request.model
        self.worker_busy_until_s[model] = max(self.worker_busy_until_s.get(model, -math.inf), finish_s)

    def stop(self, request_id: str) -> Request:
        """Take `request_id` out of its slot (the caller keeps the rest): O(D)."""
        running, finishes = self.running, self.expected_finish_s
        request = running.pop(request_id)
        del finishes[request_id]
        model = request.model
        # (Nothing left running, the common case with D = 1: no scan.)
        last_s = (
            max((finishes[r] for r, other in running.items() if other.model == model), default=None)
            if running
            else None
        )
        if last_s is None:
            del self.worker_busy_until_s[model]
        else:
            self.worker_busy_until_s[model] = last_s
        return request

    def update_busy_until(self) -> None:
        """Recompute `busy_until_s` after `running` or D changed: O(D)."""
        excess = len(self.running) - self.spec.slots
        if excess < 0:
            self.busy_until_s = -math.inf
        elif excess == 0:
            self.busy_until_s = min(self.expected_finish_s.values())
        else:
            self.busy_until_s = heapq.nsmallest(excess + 1, self.expected_finish_s.values())[-1]


class ClusterState:
    """What the scheduler has committed to: the GPUs and their slots, the idle order, the models
    registered, the global queue and where every placed request is. `Scheduler` changes it at
    events (submit, complete, fail, a GPU joins or leaves); a policy's fill changes it through a
    `Draft`'s reservations (`scheduler.reservations`), which it keeps or takes back. Read-only
    outside those two.
    """

    def __init__(self, cache: CacheManager, estimator: Estimator) -> None:
        self.cache = cache
        self.estimator = estimator
        self.queue = GlobalQueue()
        self.gpus: dict[str, GpuState] = {}
        self.gpu_types: dict[str, int] = {}  # GPU type -> how many of `gpus` are of it
        self.idle: list[tuple[tuple[float, str], str]] = []  # GPUs with a free slot, by GpuState.order_key
        self.models: dict[str, ModelSpec] = {}
        self.placed_on: dict[str, str] = {}  # parked or running request -> GPU
        self.ready_local: set[str] = set()  # idle GPUs whose local queue is not empty
        # Running requests whose model entry went with an `on_failure(drop_model=True)` of another
        # request of that model on their GPU: their pin went with it, so they must not unpin a
        # later admission's.
        self.pin_dropped: set[str] = set()
        # Per model, (free_at_s, gpu_id, version) of busy GPUs holding it: finding the busy holder
        # that frees up first is O(log) instead of a scan of every replica. Entries go stale (GPU
        # idle, model evicted, version bumped) and are dropped lazily, or compacted.
        self._free_at: dict[str, list[tuple[float, str, int]]] = {}
        # Per model, its idle holders in `best_idle_holder`'s order: heaps of (worker busy until,
        # -free slots, -speed, gpu_id, stamp), pushed whenever a GPU's calls or D change (`reindex`)
        # and whenever a GPU comes to hold a model (the cache's `on_holder_added`). An entry whose
        # stamp is not its GPU's, whose GPU is not idle or no longer holds the model, is stale and
        # dropped lazily, or compacted. Invariant: every idle holder has an entry whose key is at most
        # its current one (exactly it, if the entry carries its stamp).
        self._idle_holders: dict[str, list[tuple[float, int, float, str, int]]] = {}
        self._stamps = itertools.count(1)
        # GPU id -> the last `version` of a GPU of that id that left (`join`, `leave`).
        self._left_versions: dict[str, int] = {}
        cache.on_holder_added = self._holder_added
        self.swapped_in: set[str] = set()  # running requests whose model came from the host tier
        self.links = LinkCopies()
        # GPUs that received a dispatch in the current pass of `Scheduler.schedule` and had a free
        # slot left: the next pass offers them work again (cleared when a pass starts).
        self.refill: set[str] = set()
        # Kept out-of-order dispatches (a `pass_over` of a request that was not the queue's head):
        # read by the service's metrics; a pass-over the policy drops is taken back with it.
        self.dispatched_ahead = 0

    # --- the idle order and the busy GPUs' free times ---------------------------------------
    def enter_idle(self, state: GpuState) -> None:
        bisect.insort(self.idle, (state.order_key, state.spec.gpu_id))

    def leave_idle(self, state: GpuState) -> None:
        # bisect, not list.remove: O(log n) to find among thousands of GPUs.
        entry = (state.order_key, state.spec.gpu_id)
        index = bisect.bisect_left(self.idle, entry)
        if index == len(self.idle) or self.idle[index] != entry:
            raise KeyError(f"GPU {state.spec.gpu_id!r} is not idle")
        del self.idle[index]

    def join(self, spec: GpuSpec) -> GpuState:
        """A GPU's state, registered. One that joins again under the id of one that left (its
        node restarted) goes on from its predecessor's `version`: the free-time entries that one
        left must stay stale."""
        state = GpuState(spec)
        state.version = self._left_versions.pop(spec.gpu_id, 0)
        self.gpus[spec.gpu_id] = state
        return state

    def leave(self, gpu_id: str) -> GpuState:
        """Unregister a GPU (KeyError if unknown); its `version` is kept for `join`."""
        state = self.gpus.pop(gpu_id)
        self._left_versions[gpu_id] = state.version
        return state

    def advertise(self, state: GpuState) -> None:
        """Publish a full GPU's new free time to the heaps of every model it holds."""
        state.version += 1
        entry = (state.free_at_s, state.spec.gpu_id, state.version)
        cache, free_at = self.cache, self._free_at
        for model in cache.models_on(state.spec.gpu_id):
            heap = free_at.get(model)
            if heap is None:  # (not setdefault: that makes a list per call)
                heap = free_at[model] = []
            heapq.heappush(heap, entry)
            # Rebuilds cost O(replicas): rare enough (a hot model's heap every ~8x its replicas
            # pushes) to stay out of the per-decision tail, and amortized O(1). (The length alone
            # first: the holders are not counted for a heap of 64 or fewer.)
            if len(heap) > 64 and len(heap) > 8 * len(cache.gpus_with(model)) + 64:
                self._compact(model)

    def _compact(self, model: str) -> None:
        """Rebuild one model's heap from its live entries (amortized O(1) per push)."""
        live = [
            (state.free_at_s, gpu_id, state.version)
            for gpu_id in self.cache.gpus_with(model)
            if not (state := self.gpus[gpu_id]).idle
        ]
        heapq.heapify(live)
        self._free_at[model] = live

    # --- the idle holders of each model ---------------------------------------------------------
    def reindex(self, state: GpuState, *, grew: bool = False) -> None:
        """After `state`'s running calls or D changed: a new stamp (its older index entries go stale)
        and, while it is idle, a fresh entry for every model it holds: O(models on it x log).
        `grew`: it only took a call, so each of its keys grew (one free slot less, a worker busy
        as long or longer) and its entries stay below where it now stands: they are put right
        when they reach the top (`best_idle_holder`), and nothing is pushed now."""
        stamp = state.stamp = next(self._stamps)
        if grew:
            return
        state.indexed_stamp = stamp
        spec = state.spec
        free = spec.slots - len(state.running)
        if free <= 0:
            return  # not idle: no entries
        # `_idle_holder_entry`'s key, with the GPU's part (the same for every model on it) made
        # once: a completion reindexes every model its GPU holds (about 4 per call at 1,000 GPUs).
        neg_free, neg_speed, gpu_id = -free, -spec.speed, spec.gpu_id
        busy_until, push = state.worker_busy_until_s, self._push_entry
        for model in self.cache.models_on(gpu_id):
            push(model, (busy_until.get(model, -math.inf), neg_free, neg_speed, gpu_id, stamp))

    def _holder_added(self, model: str, gpu_id: str) -> None:
        state = self.gpus.get(gpu_id)
        if state is not None and state.idle:
            self._push_idle_holder(model, state)

    @staticmethod
    def _idle_holder_entry(model: str, state: GpuState) -> tuple[float, int, float, str, int]:
        spec = state.spec
        return (
            state.worker_busy_until_s.get(model, -math.inf),
            len(state.running) - spec.slots,  # -free slots, while idle
            -spec.speed,
            spec.gpu_id,
            state.stamp,
        )

    def _push_idle_holder(self, model: str, state: GpuState) -> None:
        self._push_entry(model, self._idle_holder_entry(model, state))

    def _push_entry(self, model: str, entry: tuple[float, int, float, str, int]) -> None:
        heap = self._idle_holders.get(model)
        if heap is None:
            heap = self._idle_holders[model] = []
        heapq.heappush(heap, entry)
        if len(heap) > 64 and len(heap) > 8 * len(self.cache.gpus_with(model)) + 64:
            self._compact_idle_holders(model)

    def _compact_idle_holders(self, model: str) -> None:
        """Rebuild one model's index from its live holders, done at ~8x their count: amortized O(1)
        per push."""
        gpus = self.gpus
        live = [
            self._idle_holder_entry(model, holder)
            for gpu_id in self.cache.gpus_with(model)
            if (holder := gpus.get(gpu_id)) is not None and holder.idle
        ]
        heapq.heapify(live)
        self._idle_holders[model] = live

    def best_idle_holder(self, model: str, exclude: str | None = None) -> str | None:
        """`PlacementPieces.best_idle(cache.gpus_with(model), exclude, model=model)`, from the index:
        of the idle GPUs holding `model` (but `exclude`), the one whose worker of it is free soonest,
        then with the most free slots, then fastest, then by id; None if none. O(log holders)
        amortized (stale entries are popped on the way)."""
        heap = self._idle_holders.get(model)
        if not heap:
            return None
        holders, gpus = self.cache.gpus_with(model), self.gpus
        skipped = None
        found = None
        while heap:
            _, _, _, gpu_id, stamp = heap[0]
            state = gpus.get(gpu_id)
            if state is None or not state.idle or gpu_id not in holders:
                heapq.heappop(heap)
            elif state.stamp != stamp:
                if state.indexed_stamp == state.stamp:
                    heapq.heappop(heap)  # it has an entry with its current stamp
                else:  # its key grew since (`reindex(grew=True)`): where it stands now
                    heapq.heapreplace(heap, self._idle_holder_entry(model, state))
            elif gpu_id == exclude:
                skipped = heapq.heappop(heap)  # valid, but not for this call: put back below
            else:
                found = gpu_id
                break
        if skipped is not None:
            heapq.heappush(heap, skipped)
        return found

    def free_slot(self, state: GpuState, request_id: str) -> None:
        """Take a finished (or failed) request out of its slot and update the GPU's standing."""
        spec, running = state.spec, state.running
        was_full = len(running) >= spec.slots  # not idle
        state.stop(request_id)
        if spec.link is not None:
            self.links.end(spec.link, request_id)
        state.update_busy_until()
        state.version += 1
        self.reindex(state)
        if len(running) >= spec.slots:
            self.advertise(state)  # still full (D was lowered): the slot it waits for moved
            return
        if was_full:
            self.enter_idle(state)
        if state.local_queue:
            self.ready_local.add(spec.gpu_id)

    # --- reads (what a policy's draft may ask: `SchedulingContext`) ---------------------------
    def running_calls(self, gpu_id: str) -> int:
        """How many calls `gpu_id` runs now (at most its D)."""
        return len(self.gpus[gpu_id].running)

    def models_busy(self, gpu_id: str, now: float) -> set[str]:
        """The models with a call running on `gpu_id` that is expected to end after `now` (a
        further call of one would wait for its worker): O(D)."""
        state = self.gpus[gpu_id]
        finishes = state.expected_finish_s
        return {request.model for r, request in state.running.items() if finishes[r] > now}

    def worker_wait_s(self, model: str, gpu_id: str, now: float) -> float:
        """How long a call of `model` started on `gpu_id` now would wait for the model's worker
        there: the calls of it running there go one at a time (one process per model per GPU,
        unless they batch), so until the last is expected to finish; 0 if none runs. O(1)."""
        return max(0.0, self.worker_busy_until_s(model, self.gpus[gpu_id]) - now)

    @staticmethod
    def worker_busy_until_s(model: str, state: GpuState) -> float:
        """When the last call of `model` running on `state` is expected to finish; -inf if none runs. O(1)."""
        return state.worker_busy_until_s.get(model, -math.inf)

    def soonest_busy_holder(self, model: str, now: float) -> tuple[str, float] | None:
        """The busy GPU holding `model` that is expected to free up first, with its estimated
        wait (ties to the lower id); None if no busy GPU holds it. O(log replicas) amortized, and
        O(holders overdue) where the first to free up is overdue (its calls overran their
        estimates: its wait is its parked work alone, which free times do not order)."""
        heap = self._free_at.get(model)
        holders = self.cache.gpus_with(model)
        while heap:
            _, gpu_id, version = heap[0]
            state = self.gpus.get(gpu_id)
            if state is None or state.version != version or state.idle or gpu_id not in holders:
                heapq.heappop(heap)
                continue
            if state.busy_until_s >= now:  # its wait is its free time's distance: no other's is less
                return gpu_id, self.estimated_wait_s(gpu_id, now)
            return self._soonest_of_overdue(heap, holders, now)
        return None

    def _soonest_of_overdue(
        self, heap: list[tuple[float, str, int]], holders: Set[str], now: float
    ) -> tuple[str, float] | None:
        """`soonest_busy_holder` where its heap's first live entry is overdue: the entries walked
        best first (a GPU's wait is at least its free time less `now`), until none can wait less."""
        best: tuple[float, str] | None = None
        frontier = [(heap[0][0], 0)]
        while frontier:
            free_at_s, index = heapq.heappop(frontier)
            if best is not None and free_at_s - now > best[0]:
                break
            _, gpu_id, version = heap[index]
            state = self.gpus.get(gpu_id)
            if state is not None and state.version == version and not state.idle and gpu_id in holders:
                candidate = (self.estimated_wait_s(gpu_id, now), gpu_id)
                if best is None or candidate < best:
                    best = candidate
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return None if best is None else (best[1], best[0])

    def estimated_wait_s(self, gpu_id: str, now: float) -> float:
        """Time until a GPU could start one more request: until a slot frees up (0 if one is
        free), plus the work already parked in its local queue, which runs D at a time."""
        state = self.gpus[gpu_id]
        return max(0.0, state.busy_until_s - now) + state.local_work_s / state.spec.slots

    def load_time_s(self, model: str, gpu_id: str) -> float:
        """What a miss of `model` on `gpu_id` would take, by the tier it comes from: a swap-in
        from its node's host tier or host model pool, a load from its disk, or a fetch and a load."""
        spec = self.models[model]
        gpu_type = self.gpus[gpu_id].spec.gpu_type
        tier = self.cache.tier(model, gpu_id)
        if tier <= Tier.POOL:
            load_s = self.estimator.swap_in_time_s(model, gpu_type, spec.memory_mb)
        else:
            load_s = self.estimator.load_time_s(model, gpu_type, spec.memory_mb)
            if tier is Tier.REMOTE:
                load_s += self.estimator.fetch_time_s(spec.memory_mb)
        return load_s

    def least_load_time_s(self, model: str) -> float:
        """At most `load_time_s(model, g)` for every GPU g: the least load of `model` on a GPU type
        attached, or swap-in where a node's host tier or model pool holds it (a fetch only adds to
        a load); 0.0 with no GPU. O(GPU types), where a search for the GPU that loads it soonest is
        O(GPUs): a wait no load can beat needs no search."""
        memory_mb = self.models[model].memory_mb
        estimator, cache = self.estimator, self.cache
        swaps_in = bool(cache.nodes_holding(model) or cache.holdings.nodes_pooling(model))
        least = math.inf
        for gpu_type in self.gpu_types:
            least = min(least, estimator.load_time_s(model, gpu_type, memory_mb))
            if swaps_in:
                least = min(least, estimator.swap_in_time_s(model, gpu_type, memory_mb))
        return 0.0 if least == math.inf else least

    def copies_overlapping(self, model: str, gpu_id: str, now: float) -> int:
        """How many copies expected in flight on `gpu_id`'s shared host link would overlap the
        copy of `model` if it were loaded there now (0 for a GPU with a link of its own): each
        would share the link's bandwidth with it. O(copies on that link)."""
        link = self.gpus[gpu_id].spec.link
        if link is None or not self.links.on(link):
            return 0
        end_s = now + self.load_time_s(model, gpu_id)
        return self.links.overlapping(
            link, end_s - self.estimator.transfer_time_s(self.models[model].memory_mb), end_s, now
        )

    def inference_time_s(self, model: str, gpu_id: str, batch_size: int) -> float:
        """The estimated time of one call of `model` with `batch_size` samples on `gpu_id`."""
        return self.estimator.inference_time_s(model, self.gpus[gpu_id].spec.gpu_type, batch_size)

    def call_time_s(self, request: Request, state: GpuState) -> float:
        """The estimated inference time of `request` on `state`'s GPU."""
        return self.estimator.inference_time_s(request.model, state.spec.gpu_type, request.batch_size)

    def fits(self, model: str, gpu_id: str) -> bool:
        """Whether the model may run on this GPU now: large enough, of the required type, and,
        while other requests run there, with room beside the models they pin. O(1)."""
        spec, state = self.models[model], self.gpus[gpu_id]
        if not self.fits_spec(spec, state):
            return False
        # Only running and parked requests pin models: without them all of the GPU is for the taking.
        return not (state.running or state.local_queue) or self.cache.gpu(gpu_id).can_admit(model, spec.memory_mb)

    @staticmethod
    def fits_spec(spec: ModelSpec, state: GpuState) -> bool:
        """Whether the GPU is large enough for the model and of the type it requires (if any)."""
        return spec.memory_mb <= state.spec.memory_mb and spec.gpu_type in (None, state.spec.gpu_type)


# Draft, which is not compiled (gpufaas.native), reads through it too.
@mypyc_attr(allow_interpreted_subclasses=True)
class ClusterReads:
    """The reads of `ClusterState` that both the `Scheduler` (tests, tools) and a fill's `Draft`
    (the policy's `SchedulingContext`) answer, from their `cluster`."""

    cluster: ClusterState

    @property
    def cache(self) -> CacheManager:
        return self.cluster.cache

    def soonest_busy_holder(self, model: str, now: float) -> tuple[str, float] | None:
        """See `ClusterState.soonest_busy_holder`."""
        return self.cluster.soonest_busy_holder(model, now)

    def estimated_wait_s(self, gpu_id: str, now: float) -> float:
        """See `ClusterState.estimated_wait_s`."""
        return self.cluster.estimated_wait_s(gpu_id, now)

    def worker_wait_s(self, model: str, gpu_id: str, now: float) -> float:
        """See `ClusterState.worker_wait_s`."""
        return self.cluster.worker_wait_s(model, gpu_id, now)

    def load_time_s(self, model: str, gpu_id: str) -> float:
        """See `ClusterState.load_time_s`."""
        return self.cluster.load_time_s(model, gpu_id)

    def least_load_time_s(self, model: str) -> float:
        """See `ClusterState.least_load_time_s`."""
        return self.cluster.least_load_time_s(model)

    def copies_overlapping(self, model: str, gpu_id: str, now: float) -> int:
        """See `ClusterState.copies_overlapping`."""
        return self.cluster.copies_overlapping(model, gpu_id, now)
