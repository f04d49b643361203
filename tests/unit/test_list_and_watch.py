"""list_and_watch over the in-memory store: list then watch, resume after an outage, list again
after compaction (a watch never goes blind)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpufaas.store import KeyValue, StoreError, WatchEvent, list_and_watch
from tests.fakes import MemoryStore

pytestmark = pytest.mark.anyio  # async tests run under anyio's pytest plugin, on asyncio (tests/conftest.py)


class Mirror:
    """What a daemon keeps: key -> value, rebuilt by a list, kept by events."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lists = 0
        self.changed = asyncio.Event()

    def on_list(self, kvs: list[KeyValue], revision: int) -> None:
        self.data = {kv.key: kv.value for kv in kvs}
        self.lists += 1
        self.changed.set()

    def on_event(self, event: WatchEvent) -> None:
        if event.kind == "put":
            self.data[event.key] = event.value
        else:
            self.data.pop(event.key, None)
        self.changed.set()

    def follow(self, store: MemoryStore, **options: Any) -> asyncio.Task[None]:
        """list_and_watch of /p/ into this mirror (`options`: its retry_s, sleep), as a task."""
        return asyncio.create_task(
            list_and_watch(store, "/p/", on_list=self.on_list, on_event=self.on_event, **options)
        )

    async def until(self, expected: dict[str, bytes], timeout_s: float = 2.0) -> None:
        async with asyncio.timeout(timeout_s):
            while self.data != expected:
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def mirrored(store: MemoryStore, **options: Any) -> AsyncIterator[Mirror]:
    """A Mirror of /p/ that list_and_watch keeps (`options`: its retry_s, sleep) while in the block;
    then the watch is cancelled and the store closed."""
    mirror = Mirror()
    task = mirror.follow(store, **options)
    try:
        yield mirror
    finally:
        task.cancel()
        await store.close()


async def test_lists_then_follows_every_change() -> None:
    store = MemoryStore()
    await store.put("/p/a", b"1")
    await store.put("/q/x", b"other prefix")
    async with mirrored(store) as mirror:
        await mirror.until({"/p/a": b"1"})
        await store.put("/p/b", b"2")
        await store.delete("/p/a")
        await mirror.until({"/p/b": b"2"})
        assert mirror.lists == 1


async def test_an_outage_resumes_the_watch_without_listing_again() -> None:
    store = MemoryStore()
    async with mirrored(store, retry_s=0.01) as mirror:
        await mirror.until({})
        store.set_reachable(False)
        await asyncio.sleep(0.05)
        store.set_reachable(True)
        await store.put("/p/a", b"1")
        await mirror.until({"/p/a": b"1"})
        assert mirror.lists == 1


async def test_a_compacted_revision_lists_again_so_the_mirror_never_goes_blind() -> None:
    store = MemoryStore()
    await store.put("/p/a", b"1")
    retrying = asyncio.Event()
    resume = asyncio.Event()

    async def held_sleep(_: float) -> None:  # the retry waits until the test says so
        retrying.set()
        await resume.wait()

    async with mirrored(store, sleep=held_sleep) as mirror:
        await mirror.until({"/p/a": b"1"})
        # The watch breaks; while it is down, keys change and their history is compacted away:
        # resuming after the last revision seen is impossible, so it lists again.
        store.set_reachable(False)
        await asyncio.wait_for(retrying.wait(), 2)
        store.set_reachable(True)
        await store.put("/p/b", b"2")
        await store.delete("/p/a")
        store.compact(await store.revision())
        resume.set()
        await mirror.until({"/p/b": b"2"})
        assert mirror.lists == 2
        await store.put("/p/c", b"3")
        await mirror.until({"/p/b": b"2", "/p/c": b"3"})


async def test_it_ends_when_the_store_is_closed() -> None:
    store = MemoryStore()
    mirror = Mirror()
    task = mirror.follow(store)
    await mirror.until({})
    while store.num_watchers == 0:  # watching
        await asyncio.sleep(0.01)
    await store.close()
    async with asyncio.timeout(2):
        await task


async def test_a_change_its_handler_cannot_take_is_logged_and_the_watch_goes_on() -> None:
    # One value a reader cannot parse (a newer node's record, during a rolling upgrade) ended the
    # watch task, unheard: every later change was missed for good.
    store = MemoryStore()
    mirror = Mirror()
    taken = mirror.on_event

    def fussy(event: WatchEvent) -> None:
        if event.value == b"unreadable":
            raise TypeError("unexpected field")
        taken(event)

    mirror.on_event = fussy  # type: ignore[method-assign]
    task = mirror.follow(store)
    try:
        await listed(mirror)
        await store.put("/p/a", b"unreadable")
        await store.put("/p/b", b"2")
        await mirror.until({"/p/b": b"2"})
        assert not task.done()
    finally:
        task.cancel()
        await store.close()


async def test_a_list_its_handler_cannot_take_is_logged_and_the_watch_goes_on() -> None:
    # The same value in a list (the first, or one after a compaction) ended the task, unheard.
    store = MemoryStore()
    await store.put("/p/a", b"unreadable")
    mirror = Mirror()

    def fussy(kvs: list[KeyValue], revision: int) -> None:
        mirror.lists += 1
        if any(kv.value == b"unreadable" for kv in kvs):
            raise TypeError("unexpected field")

    mirror.on_list = fussy  # type: ignore[method-assign]
    async with mirrored_with(store, mirror):
        await listed(mirror)
        await store.put("/p/b", b"2")
        await mirror.until({"/p/b": b"2"})  # the watch went on after the list


async def test_a_handler_whose_own_write_fails_is_given_its_change_again() -> None:
    # A handler that writes to etcd (a node registering again after its key was deleted) and
    # finds etcd unreachable: the watch resumes from before that change, not after it.
    store = MemoryStore()
    mirror = Mirror()
    taken = mirror.on_event
    failures = [StoreError("etcd unreachable")]

    def writing(event: WatchEvent) -> None:
        if failures:
            raise failures.pop()
        taken(event)

    mirror.on_event = writing  # type: ignore[method-assign]
    async with mirrored_with(store, mirror, retry_s=0.01):
        await listed(mirror)
        await store.put("/p/a", b"1")
        await mirror.until({"/p/a": b"1"})


async def test_a_handler_failing_inside_a_transaction_is_given_the_rest_of_it_again() -> None:
    # One etcd transaction (a batch, a prefix delete) gives its events one revision. A handler's
    # StoreError on the second resumed the watch after that revision: the second was lost for good.
    store = MemoryStore()
    mirror = Mirror()
    taken = mirror.on_event
    seen: list[str] = []
    failures = [StoreError("etcd unreachable")]

    def writing(event: WatchEvent) -> None:
        if event.key == "/p/b" and failures:
            raise failures.pop()
        seen.append(event.key)
        taken(event)

    mirror.on_event = writing  # type: ignore[method-assign]
    async with mirrored_with(store, mirror, retry_s=0.01):
        await listed(mirror)
        await store.write_batch({"/p/a": b"1", "/p/b": b"2", "/p/c": b"3"})
        await mirror.until({"/p/a": b"1", "/p/b": b"2", "/p/c": b"3"})
        await store.put("/p/d", b"4")
        await mirror.until({"/p/a": b"1", "/p/b": b"2", "/p/c": b"3", "/p/d": b"4"})
        assert seen == ["/p/a", "/p/b", "/p/c", "/p/d"]  # each once: /p/a not again after the break


async def test_a_list_whose_read_fails_is_read_again_not_skipped() -> None:
    # The revision was read, then the read of the keys failed (etcd went away between the two):
    # the retry took the revision as listed and watched on from it, so the mirror never had the
    # keys (after a compaction: the changes the watch had missed were lost for good).
    store = MemoryStore()
    await store.put("/p/a", b"1")
    read = store.get_prefix
    failures = [StoreError("etcd unreachable")]

    async def failing_once(prefix: str) -> list[KeyValue]:
        if failures:
            raise failures.pop()
        return await read(prefix)

    store.get_prefix = failing_once  # type: ignore[method-assign]
    mirror = Mirror()
    async with mirrored_with(store, mirror, retry_s=0.01):
        await mirror.until({"/p/a": b"1"})
        assert mirror.lists == 1


async def test_a_store_that_lost_its_history_is_listed_again() -> None:
    # etcd back without its data (a new cluster, its revisions counting from 1 again): the watch
    # resumed at the old revision, which the new etcd had not reached, and waited for it, blind.
    old, new = MemoryStore(), MemoryStore()
    for value in (b"1", b"2", b"3"):
        await old.put("/p/a", value)
    current = old

    class Either:  # the one etcd address, whichever etcd answers there
        def __getattr__(self, name: str) -> Any:
            return getattr(current, name)

    mirror = Mirror()
    task = asyncio.create_task(
        list_and_watch(Either(), "/p/", on_list=mirror.on_list, on_event=mirror.on_event, retry_s=0.01)  # type: ignore[arg-type]
    )
    try:
        await mirror.until({"/p/a": b"3"})
        current = new
        old.set_reachable(False)  # the watch breaks
        await new.put("/p/b", b"1")
        await mirror.until({"/p/b": b"1"})
        await new.put("/p/c", b"2")
        await mirror.until({"/p/b": b"1", "/p/c": b"2"})
    finally:
        task.cancel()
        await old.close()
        await new.close()


@contextlib.asynccontextmanager
async def mirrored_with(store: MemoryStore, mirror: Mirror, **options: Any) -> AsyncIterator[None]:
    task = mirror.follow(store, **options)
    try:
        yield
    finally:
        task.cancel()
        await store.close()


async def listed(mirror: Mirror) -> None:
    """Until the mirror's first list is in (the watch starts after it)."""
    async with asyncio.timeout(2.0):
        while not mirror.lists:
            await asyncio.sleep(0.005)
