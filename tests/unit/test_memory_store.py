"""Unit tests of MemoryStore (the in-memory fake of etcd) and LeaseKeeper, on a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpufaas.store import (
    KeyValue,
    LeaseKeeper,
    LeaseLost,
    RevisionCompacted,
    StoreError,
    WatchEvent,
)
from tests.fakes import ManualClock, MemoryStore

# Async tests run under anyio's pytest plugin, on asyncio (tests/conftest.py), each bounded in time.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


def make_store() -> tuple[MemoryStore, ManualClock]:
    clock = ManualClock(start_s=1000.0)
    return MemoryStore(clock=clock), clock


async def take(events: Any, n: int) -> list[WatchEvent]:
    """The next n events of a watch (an async generator), bounded in time."""
    return [await asyncio.wait_for(anext(events), timeout=1) for _ in range(n)]


# --- keys and revisions ---------------------------------------------------------------------


async def test_revisions_count_every_mutation_and_only_mutations() -> None:
    store, _ = make_store()
    assert await store.revision() == 1  # like a fresh etcd
    assert await store.put("/a", b"1") == 2
    assert await store.get("/a") == KeyValue("/a", b"1", create_revision=2, mod_revision=2, lease=0)
    assert await store.put("/a", b"2") == 3
    assert await store.get("/a") == KeyValue("/a", b"2", create_revision=2, mod_revision=3, lease=0)
    assert await store.delete("/missing") is False
    assert await store.revision() == 3
    assert await store.delete("/a") is True
    assert await store.revision() == 4
    assert await store.get("/a") is None
    assert await store.put("/a", b"3") == 5
    kv = await store.get("/a")
    assert kv is not None and kv.create_revision == 5  # a re-created key starts over


async def test_prefix_reads_are_sorted_and_bounded_by_the_prefix() -> None:
    store, _ = make_store()
    for key in ["/n/b", "/n/a", "/nx", "/n/c/d"]:
        await store.put(key, key.encode())
    assert [kv.key for kv in await store.get_prefix("/n/")] == ["/n/a", "/n/b", "/n/c/d"]
    assert await store.get_prefix("/none/") == []


async def test_delete_prefix_is_one_revision() -> None:
    store, _ = make_store()
    for key in ["/n/a", "/n/b", "/nx"]:
        await store.put(key, b"")
    before = await store.revision()
    events = store.watch_prefix("/n", start_revision=before + 1)
    assert await store.delete_prefix("/n/") == 2
    assert await store.revision() == before + 1
    assert await take(events, 2) == [
        WatchEvent("delete", "/n/a", b"", before + 1),
        WatchEvent("delete", "/n/b", b"", before + 1),
    ]
    assert await store.delete_prefix("/n/") == 0
    assert await store.revision() == before + 1
    assert [kv.key for kv in await store.get_prefix("/")] == ["/nx"]
    await events.aclose()


async def test_empty_key_or_prefix_is_refused() -> None:
    store, _ = make_store()
    with pytest.raises(ValueError):
        await store.put("", b"")
    with pytest.raises(ValueError):
        await store.delete_prefix("")


# --- compare-and-swap -----------------------------------------------------------------------


async def test_create_if_absent() -> None:
    store, _ = make_store()
    assert await store.compare_and_put("/k", b"first", mod_revision=0) is True
    assert await store.compare_and_put("/k", b"second", mod_revision=0) is False
    kv = await store.get("/k")
    assert kv is not None and kv.value == b"first"


async def test_compare_and_put_needs_the_current_mod_revision() -> None:
    store, _ = make_store()
    await store.put("/k", b"v1")
    seen = await store.get("/k")
    assert seen is not None
    await store.put("/k", b"v2")  # someone else wrote in between
    before = await store.revision()
    assert await store.compare_and_put("/k", b"mine", mod_revision=seen.mod_revision) is False
    assert await store.revision() == before  # a failed comparison changes nothing
    current = await store.get("/k")
    assert current is not None and current.value == b"v2"
    assert await store.compare_and_put("/k", b"mine", mod_revision=current.mod_revision) is True
    assert await store.compare_and_put("/absent", b"x", mod_revision=current.mod_revision) is False


async def test_compare_and_delete() -> None:
    store, _ = make_store()
    await store.put("/k", b"v")
    kv = await store.get("/k")
    assert kv is not None
    assert await store.compare_and_delete("/k", mod_revision=kv.mod_revision + 1) is False
    assert await store.compare_and_delete("/k", mod_revision=kv.mod_revision) is True
    assert await store.get("/k") is None
    assert await store.compare_and_delete("/k", mod_revision=kv.mod_revision) is False
    with pytest.raises(ValueError):
        await store.compare_and_delete("/k", mod_revision=0)


async def test_compare_and_put_checks_the_lease_only_when_the_comparison_holds() -> None:
    store, _ = make_store()
    lease = await store.grant_lease(5)
    await store.revoke_lease(lease)
    await store.put("/k", b"v")
    assert await store.compare_and_put("/k", b"x", mod_revision=0, lease=lease) is False
    with pytest.raises(LeaseLost):
        await store.compare_and_put("/new", b"x", mod_revision=0, lease=lease)
    assert await store.get("/new") is None


# --- leases ---------------------------------------------------------------------------------


async def test_expired_lease_deletes_its_keys_in_one_revision_and_watchers_see_it() -> None:
    store, clock = make_store()
    lease = await store.grant_lease(10)
    await store.put("/live/a", b"a", lease=lease)
    await store.put("/live/b", b"b", lease=lease)
    await store.put("/live/c", b"c")  # no lease: stays
    events = store.watch_prefix("/live/", start_revision=await store.revision() + 1)
    await clock.advance(9)
    await store.refresh_lease(lease)
    await clock.advance(9)  # 18 s after the grant, 9 s after the refresh: still alive
    assert len(await store.get_prefix("/live/")) == 3
    await clock.advance(1)
    assert store.expire_leases() == 1
    expired_at = await store.revision()
    assert await take(events, 2) == [
        WatchEvent("delete", "/live/a", b"", expired_at),
        WatchEvent("delete", "/live/b", b"", expired_at),
    ]
    assert [kv.key for kv in await store.get_prefix("/live/")] == ["/live/c"]
    with pytest.raises(LeaseLost):
        await store.refresh_lease(lease)
    with pytest.raises(LeaseLost):
        await store.put("/live/a", b"again", lease=lease)
    await events.aclose()


async def test_leases_expire_lazily_on_any_call() -> None:
    store, clock = make_store()
    lease = await store.grant_lease(3)
    await store.put("/k", b"v", lease=lease)
    await clock.advance(3)
    assert await store.get("/k") is None


async def test_a_put_without_lease_detaches_the_key() -> None:
    store, clock = make_store()
    lease = await store.grant_lease(3)
    await store.put("/k", b"leased", lease=lease)
    await store.put("/k", b"free")
    await clock.advance(5)
    kv = await store.get("/k")
    assert kv is not None and kv.lease == 0 and kv.value == b"free"


async def test_revoke_deletes_the_keys_and_is_idempotent() -> None:
    store, _ = make_store()
    lease = await store.grant_lease(30)
    await store.put("/k", b"v", lease=lease)
    kv = await store.get("/k")
    assert kv is not None and kv.lease == lease
    await store.revoke_lease(lease)
    assert await store.get("/k") is None
    await store.revoke_lease(lease)
    revision = await store.revision()
    await store.revoke_lease(await store.grant_lease(30))  # a lease with no keys: no revision
    assert await store.revision() == revision


# --- watches --------------------------------------------------------------------------------


async def test_watch_from_start_revision_replays_then_follows() -> None:
    store, _ = make_store()
    first = await store.put("/w/a", b"1")
    await store.put("/other", b"x")
    await store.put("/w/a", b"2")
    await store.delete("/w/a")
    events = store.watch_prefix("/w/", start_revision=first)
    assert await take(events, 3) == [
        WatchEvent("put", "/w/a", b"1", first),
        WatchEvent("put", "/w/a", b"2", first + 2),
        WatchEvent("delete", "/w/a", b"", first + 3),
    ]
    assert await store.put("/w/b", b"3") == first + 4
    assert await take(events, 1) == [WatchEvent("put", "/w/b", b"3", first + 4)]
    await events.aclose()


async def test_watch_without_start_revision_sees_only_later_changes() -> None:
    store, _ = make_store()
    await store.put("/w/old", b"")
    events = store.watch_prefix("/w/")
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.01)  # the watch exists once iteration has started
    revision = await store.put("/w/new", b"n")
    assert await asyncio.wait_for(first, 1) == WatchEvent("put", "/w/new", b"n", revision)
    await events.aclose()


async def test_get_then_watch_has_no_gap() -> None:
    store, _ = make_store()
    await store.put("/m/a", b"1")
    revision = await store.revision()
    snapshot = await store.get_prefix("/m/")
    written = await store.put("/m/b", b"2")  # lands between the snapshot and the watch
    events = store.watch_prefix("/m/", start_revision=revision + 1)
    assert [kv.key for kv in snapshot] == ["/m/a"]
    assert await take(events, 1) == [WatchEvent("put", "/m/b", b"2", written)]
    await events.aclose()


async def test_cancelling_the_consumer_removes_the_watch() -> None:
    store, _ = make_store()

    async def consume() -> None:
        async for _ in store.watch_prefix("/w/"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    assert store.num_watchers == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.num_watchers == 0


async def test_watch_of_compacted_history_fails() -> None:
    store, _ = make_store()
    first = await store.put("/w/a", b"1")
    await store.put("/w/a", b"2")
    store.compact(first + 1)
    with pytest.raises(RevisionCompacted):
        await anext(store.watch_prefix("/w/", start_revision=first))
    events = store.watch_prefix("/w/", start_revision=first + 1)
    assert await take(events, 1) == [WatchEvent("put", "/w/a", b"2", first + 1)]
    await events.aclose()


async def test_outage_fails_calls_and_watches_and_close_ends_watches() -> None:
    store, _ = make_store()
    broken = store.watch_prefix("/w/")
    pending = asyncio.ensure_future(anext(broken))
    await asyncio.sleep(0.01)
    store.set_reachable(False)
    with pytest.raises(StoreError):
        await pending
    with pytest.raises(StoreError):
        await store.get("/w/a")
    store.set_reachable(True)
    await store.put("/w/a", b"")

    ended = store.watch_prefix("/w/")
    pending = asyncio.ensure_future(anext(ended))
    await asyncio.sleep(0.01)
    await store.close()
    with pytest.raises(StopAsyncIteration):
        await pending


# --- LeaseKeeper ----------------------------------------------------------------------------


class Daemon:
    """A daemon's liveness registration: one key under the keeper's lease."""

    def __init__(self, store: MemoryStore, key: str = "/nodes/n1") -> None:
        self.store = store
        self.key = key
        self.registrations: list[int] = []

    async def register(self, lease: int) -> None:
        await self.store.put(self.key, b"alive", lease=lease)
        self.registrations.append(lease)

    async def lease_of_key(self) -> int | None:
        kv = await self.store.get(self.key)
        return None if kv is None else kv.lease


async def kept_registration() -> tuple[MemoryStore, ManualClock, Daemon, LeaseKeeper, int]:
    """A Daemon registered under the 3 s lease a started LeaseKeeper keeps (sleeping on the manual
    clock, registering the daemon again on a regrant): the store, the clock, the daemon, the keeper
    and its first lease."""
    store, clock = make_store()
    daemon = Daemon(store)
    keeper = LeaseKeeper(store, 3, on_regrant=daemon.register, sleep=clock.sleep)
    first = await keeper.start()
    await daemon.register(first)
    return store, clock, daemon, keeper, first


async def test_keeper_keeps_the_lease_alive() -> None:
    _, clock, daemon, keeper, lease = await kept_registration()
    await clock.advance(60)
    assert keeper.lease == lease and keeper.num_regrants == 0
    assert await daemon.lease_of_key() == lease
    await keeper.stop()
    assert await daemon.lease_of_key() is None  # revoked on stop


async def test_keeper_regrants_and_reregisters_after_the_lease_is_revoked() -> None:
    store, clock, daemon, keeper, first = await kept_registration()
    await store.revoke_lease(first)
    assert await daemon.lease_of_key() is None
    await clock.advance(1)  # one refresh period
    assert keeper.num_regrants == 1 and keeper.lease != first
    assert daemon.registrations == [first, keeper.lease]
    assert await daemon.lease_of_key() == keeper.lease
    await keeper.stop(revoke=False)
    assert await daemon.lease_of_key() == keeper.lease  # left to expire by itself


async def test_keeper_rides_out_a_short_outage_and_regrants_after_a_long_one() -> None:
    store, clock, daemon, keeper, first = await kept_registration()

    store.set_reachable(False)
    await clock.advance(2)  # shorter than the TTL
    store.set_reachable(True)
    await clock.advance(1)
    assert keeper.lease == first and keeper.num_regrants == 0
    assert await daemon.lease_of_key() == first

    store.set_reachable(False)
    await clock.advance(10)  # the lease expires meanwhile
    store.set_reachable(True)
    await clock.advance(1)
    assert keeper.num_regrants == 1 and keeper.lease != first
    assert await daemon.lease_of_key() == keeper.lease
    await keeper.stop()


async def test_keeper_retries_a_failed_registration() -> None:
    store, clock = make_store()
    failures = [StoreError("flaky"), RuntimeError("a bug, logged and retried")]
    registered: list[int] = []

    async def flaky_register(lease: int) -> None:
        if failures:
            raise failures.pop(0)
        await store.put("/nodes/n1", b"alive", lease=lease)
        registered.append(lease)

    keeper = LeaseKeeper(store, 3, on_regrant=flaky_register, sleep=clock.sleep)
    first = await keeper.start()
    await store.revoke_lease(first)
    await clock.advance(2)
    assert registered == [keeper.lease] and keeper.num_regrants == 1
    await keeper.stop()
