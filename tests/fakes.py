"""In-memory fakes for tests: `MemoryStore` (a `Store` with etcd's semantics), `ManualClock`
(the virtual time that drives it and `LeaseKeeper`) and `PlacedBook` (a call book with one call placed)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufaas.store import (
    KeyValue,
    LeaseLost,
    RevisionCompacted,
    StoreError,
    WatchEvent,
    check_batch,
    check_key,
    check_prefix,
)


class ManualClock:
    """Virtual time for MemoryStore and LeaseKeeper in tests.

    `clock()` reads it, `await clock.sleep(s)` waits on it, and `await clock.advance(s)` moves it,
    waking sleepers in deadline order and letting the woken tasks run (a fixed number of event-loop
    turns) before moving on, so a task that sleeps in a loop runs once per period it covers.
    """

    _SETTLE_TURNS = 64

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s
        self._seq = itertools.count()
        # Lifecycle: pushed by sleep(), popped (and resolved) by advance(); a cancelled sleeper's
        # future stays until its deadline passes, then is skipped.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), future))
        await future

    async def advance(self, seconds: float) -> None:
        target = self._now + seconds
        await self._settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, future = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not future.done():
                future.set_result(None)
                await self._settle()
        self._now = max(self._now, target)
        await self._settle()

    async def _settle(self) -> None:
        for _ in range(self._SETTLE_TURNS):
            await asyncio.sleep(0)


@dataclass(slots=True)
class _Lease:
    ttl_s: int
    expires_at: float
    keys: set[str] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class _Watcher:
    prefix: str
    start_revision: int
    # Lifecycle: filled by mutations (events), by close() (None: end) or by set_reachable(False)
    # (a StoreError: raise); drained by the watch's generator, dropped when that generator ends.
    queue: asyncio.Queue[WatchEvent | StoreError | None] = field(default_factory=asyncio.Queue)


class MemoryStore:
    """`Store` in memory, with etcd's semantics, for unit tests.

    Time comes from `clock` (inject a fake one in tests). Leases expire lazily: every call first
    expires the leases whose TTL has passed, and `expire_leases()` does it on demand (a test that
    advances its clock calls it to make watchers see the deletions). The whole history is kept for
    watches with `start_revision` until `compact()`. Every call yields to the event loop once before
    acting, as a round trip to etcd would, so callers that forget to re-check state after an await
    fail here too. `set_reachable(False)` simulates an outage.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # etcd starts at revision 1 with no keys; every mutating call that changes something adds 1.
        self._revision = 1
        self._compacted = 0
        self._data: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x4D454D0000000001)
        self._history: list[WatchEvent] = []
        self._watchers: set[_Watcher] = set()
        self._reachable = True
        self._closed = False

    # --- test controls --------------------------------------------------------------------
    @property
    def num_watchers(self) -> int:
        """Watches currently open (a teardown check: every watch was closed)."""
        return len(self._watchers)

    def expire_leases(self) -> int:
        """Revoke every lease whose TTL has passed (deleting its keys); returns how many."""
        now = self._clock()
        expired = [lease for lease, state in self._leases.items() if state.expires_at <= now]
        for lease in expired:
            self._revoke(lease)
        return len(expired)

    def set_reachable(self, reachable: bool) -> None:
        """Simulate an outage: while unreachable every call raises StoreError and running watches
        fail with StoreError. Leases keep aging meanwhile, as they would in etcd."""
        self._reachable = reachable
        if not reachable:
            for watcher in self._watchers:
                watcher.queue.put_nowait(StoreError("memory store is unreachable"))

    def compact(self, revision: int) -> None:
        """Forget history before `revision`; a watch starting earlier raises RevisionCompacted."""
        self._compacted = max(self._compacted, min(revision, self._revision))
        self._history = [event for event in self._history if event.mod_revision >= self._compacted]

    # --- Store ----------------------------------------------------------------------------
    async def _enter(self) -> None:
        await asyncio.sleep(0)
        if self._closed:
            raise RuntimeError("MemoryStore used after close()")
        if not self._reachable:
            raise StoreError("memory store is unreachable")
        self.expire_leases()

    async def get(self, key: str) -> KeyValue | None:
        check_key(key)
        await self._enter()
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        check_prefix(prefix)
        await self._enter()
        return sorted((kv for key, kv in self._data.items() if key.startswith(prefix)), key=lambda kv: kv.key)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        check_key(key)
        await self._enter()
        self._check_lease(lease)
        self._revision += 1
        self._put(key, value, lease)
        return self._revision

    async def delete(self, key: str) -> bool:
        check_key(key)
        await self._enter()
        if key not in self._data:
            return False
        self._revision += 1
        self._delete(key)
        return True

    async def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        await self._enter()
        keys = sorted(key for key in self._data if key.startswith(prefix))
        if keys:
            self._revision += 1
            for key in keys:
                self._delete(key)
        return len(keys)

    async def compare_and_put(self, key: str, value: bytes, *, mod_revision: int, lease: int = 0) -> bool:
        check_key(key)
        await self._enter()
        current = self._data.get(key)
        if (current.mod_revision if current is not None else 0) != mod_revision:
            return False
        self._check_lease(lease)  # as in etcd: only on the branch that runs
        self._revision += 1
        self._put(key, value, lease)
        return True

    async def _guarded(self, key: str, method: str, revision: tuple[str, int]) -> KeyValue | None:
        """What `key` holds, for a call guarded by a revision (`revision`: its name and value),
        after the checks EtcdStore makes first: a key, and a revision > 0 (ValueError otherwise)."""
        check_key(key)
        name, value = revision
        if value <= 0:
            raise ValueError(f"{method} needs the {name} (> 0), got {value}")
        await self._enter()
        return self._data.get(key)

    async def put_fenced(self, key: str, value: bytes | None, *, guard_key: str, guard_create_revision: int) -> bool:
        check_key(key)
        guard = await self._guarded(guard_key, "put_fenced", ("guard's create_revision", guard_create_revision))
        if guard is None or guard.create_revision != guard_create_revision:
            return False
        if value is None:
            if key in self._data:
                self._revision += 1
                self._delete(key)
        else:
            self._revision += 1
            self._put(key, value, 0)
        return True

    async def write_batch(
        self, writes: Mapping[str, bytes | None], *, guard_key: str | None = None, guard_create_revision: int = 0
    ) -> bool:
        for key in writes:
            check_key(key)
        check_batch(len(writes), guard_key, guard_create_revision)
        if not writes:
            return True  # as EtcdStore: nothing to write, nothing asked
        await self._enter()
        if guard_key is not None:
            check_key(guard_key)
            guard = self._data.get(guard_key)
            if guard is None or guard.create_revision != guard_create_revision:
                return False
        changes = [(key, value) for key, value in writes.items() if value is not None or key in self._data]
        if changes:  # one transaction: one revision for every key it changed (none: none, as in etcd)
            self._revision += 1
        for key, value in changes:
            if value is None:
                self._delete(key)
            else:
                self._put(key, value, 0)
        return True

    async def compare_and_delete(self, key: str, *, mod_revision: int) -> bool:
        current = await self._guarded(key, "compare_and_delete", ("key's mod_revision", mod_revision))
        if current is None or current.mod_revision != mod_revision:
            return False
        self._revision += 1
        self._delete(key)
        return True

    async def grant_lease(self, ttl_s: int) -> int:
        if ttl_s <= 0:
            raise ValueError(f"a lease TTL must be positive, got {ttl_s}")
        await self._enter()
        lease = next(self._lease_ids)
        self._leases[lease] = _Lease(ttl_s=ttl_s, expires_at=self._clock() + ttl_s)
        return lease

    async def refresh_lease(self, lease: int) -> None:
        await self._enter()
        state = self._leases.get(lease)
        if state is None:
            raise LeaseLost(f"memory lease {lease:x} expired or was revoked")
        state.expires_at = self._clock() + state.ttl_s

    async def revoke_lease(self, lease: int) -> None:
        await self._enter()
        if lease in self._leases:
            self._revoke(lease)

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncGenerator[WatchEvent, None]:
        check_prefix(prefix)
        await self._enter()
        if start_revision and start_revision < self._compacted:
            raise RevisionCompacted(f"revision {start_revision} is compacted (history starts at {self._compacted})")
        # Replay and registration happen with no await in between: no event is lost or doubled.
        watcher = _Watcher(prefix, start_revision or self._revision + 1)
        for event in self._history:
            if event.mod_revision >= watcher.start_revision and event.key.startswith(prefix):
                watcher.queue.put_nowait(event)
        self._watchers.add(watcher)
        try:
            while True:
                item = await watcher.queue.get()
                if item is None:
                    return
                if isinstance(item, StoreError):
                    raise item
                yield item
        finally:
            self._watchers.discard(watcher)

    async def revision(self) -> int:
        await self._enter()
        return self._revision

    async def close(self) -> None:
        self._closed = True
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)

    # --- internals (callers have bumped self._revision for this change) -------------------
    def _check_lease(self, lease: int) -> None:
        if lease and lease not in self._leases:
            raise LeaseLost(f"memory lease {lease:x} expired or was revoked")

    def _put(self, key: str, value: bytes, lease: int) -> None:
        previous = self._data.get(key)
        if previous is not None and previous.lease and previous.lease != lease:
            self._leases[previous.lease].keys.discard(key)
        if lease:
            self._leases[lease].keys.add(key)
        create_revision = previous.create_revision if previous is not None else self._revision
        self._data[key] = KeyValue(key, value, create_revision, self._revision, lease)
        self._emit(WatchEvent("put", key, value, self._revision))

    def _delete(self, key: str) -> None:
        previous = self._data.pop(key)
        if previous.lease:
            self._leases[previous.lease].keys.discard(key)
        self._emit(WatchEvent("delete", key, b"", self._revision))

    def _revoke(self, lease: int) -> None:
        # One revision for all the lease's keys, and none if it had no keys (as in etcd).
        keys = sorted(self._leases.pop(lease).keys)
        if keys:
            self._revision += 1
            for key in keys:
                previous = self._data.pop(key)
                assert previous.lease == lease, "a key is attached to the lease that lists it"
                self._emit(WatchEvent("delete", key, b"", self._revision))

    def _emit(self, event: WatchEvent) -> None:
        self._history.append(event)
        for watcher in self._watchers:
            if event.key.startswith(watcher.prefix) and event.mod_revision >= watcher.start_revision:
                watcher.queue.put_nowait(event)


class PlacedBook:
    """A scheduler service's call book (`scheduler.calls.CallBook`, which is compiled and cannot be
    patched: gpufaas.native) in which every call is placed as `model` on `gpu_id` and a Done
    releases nothing; anything else is the real book's."""

    def __init__(self, book: Any, model: str, gpu_id: str) -> None:
        self._book = book
        self._placed = (model, gpu_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._book, name)

    def placement(self, call_id: str, attempt: int) -> tuple[str, str]:
        return self._placed

    def done(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []
