"""EtcdStore against a real etcd: the Store contract, checked on etcd and on MemoryStore alike, and
what only a real server shows (an outage, a hung server, reconnecting)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import pytest

from gpufaas import store as store_module
from gpufaas.dev.etcd_server import EtcdServer, free_port
from gpufaas.processes import survivors
from gpufaas.store import (
    MAX_TXN_BYTES,
    MAX_TXN_OPS,
    EtcdCredentials,
    EtcdStore,
    LeaseKeeper,
    LeaseLost,
    Store,
    StoreError,
    WatchEvent,
)
from tests.fakes import ManualClock, MemoryStore
from tests.integration.conftest import EtcdTarget

# etcd's smallest lease TTL with its default raft timings (it raises shorter ones to this).
TTL_S = 2


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop (pytest-asyncio is not a dependency)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=30))

    return wrapper


@dataclass
class Harness:
    """One Store implementation under test, with its notion of time."""

    kind: str
    root: str
    open_store: Callable[[], Awaitable[Store]]
    # Let time pass for the store (virtual for memory, real for etcd) ...
    pass_time: Callable[[float], Awaitable[None]]
    # ... and what a LeaseKeeper sleeps on.
    keeper_sleep: Callable[[float], Awaitable[None]]

    async def eventually(self, check: Callable[[], Awaitable[bool]], within_s: float) -> None:
        """Poll `check` until true, letting time pass in 0.1 s steps; fail after `within_s`."""
        for _ in range(int(within_s / 0.1)):
            if await check():
                return
            await self.pass_time(0.1)
        assert await check(), f"not true within {within_s} s"

    async def open_with_a_lease(self) -> tuple[Store, str, int]:
        """A store opened, the root to write under, and a lease of TTL_S granted there."""
        store = await self.open_store()
        return store, self.root, await store.grant_lease(TTL_S)


@pytest.fixture(params=["memory", "etcd"])
def harness(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        clock = ManualClock()
        memory = MemoryStore(clock=clock)

        async def open_memory() -> Store:
            return memory

        return Harness("memory", "/t-memory", open_memory, clock.advance, clock.sleep)
    target: EtcdTarget = request.getfixturevalue("etcd_endpoint")

    async def open_etcd() -> Store:
        return await EtcdStore.open(target.endpoint, timeout_s=2)

    return Harness("etcd", target.root, open_etcd, asyncio.sleep, asyncio.sleep)


async def take(events: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    return [await asyncio.wait_for(anext(events), timeout=5) for _ in range(n)]


# --- the contract, on both implementations --------------------------------------------------


@async_test
async def test_revisions_and_key_fields(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    start = await store.revision()
    assert await store.put(f"{r}/a", b"1") == start + 1
    kv = await store.get(f"{r}/a")
    assert kv is not None
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease) == (
        f"{r}/a",
        b"1",
        start + 1,
        start + 1,
        0,
    )
    assert await store.put(f"{r}/a", b"2") == start + 2
    kv = await store.get(f"{r}/a")
    assert kv is not None and (kv.create_revision, kv.mod_revision) == (start + 1, start + 2)
    assert await store.delete(f"{r}/missing") is False
    assert await store.revision() == start + 2
    assert await store.delete(f"{r}/a") is True
    assert await store.revision() == start + 3
    assert await store.get(f"{r}/a") is None
    await store.close()


@async_test
async def test_prefix_reads_and_deletes(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    for key in ["n/b", "n/a", "nx", "n/c/d"]:
        await store.put(f"{r}/{key}", b"")
    assert [kv.key for kv in await store.get_prefix(f"{r}/n/")] == [f"{r}/n/a", f"{r}/n/b", f"{r}/n/c/d"]
    start = await store.revision()
    assert await store.delete_prefix(f"{r}/n/") == 3
    assert await store.revision() == start + 1
    assert [kv.key for kv in await store.get_prefix(f"{r}/")] == [f"{r}/nx"]
    await store.close()


@async_test
async def test_compare_and_swap(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    key = f"{r}/k"
    assert await store.compare_and_put(key, b"first", mod_revision=0) is True
    assert await store.compare_and_put(key, b"second", mod_revision=0) is False
    seen = await store.get(key)
    assert seen is not None and seen.value == b"first"
    await store.put(key, b"other writer")
    assert await store.compare_and_put(key, b"stale", mod_revision=seen.mod_revision) is False
    current = await store.get(key)
    assert current is not None and current.value == b"other writer"
    assert await store.compare_and_put(key, b"mine", mod_revision=current.mod_revision) is True
    assert await store.compare_and_delete(key, mod_revision=current.mod_revision) is False
    mine = await store.get(key)
    assert mine is not None and mine.value == b"mine"
    assert await store.compare_and_delete(key, mod_revision=mine.mod_revision) is True
    assert await store.get(key) is None
    await store.close()


@async_test
async def test_a_fenced_write_goes_through_only_while_the_guard_is_the_same_key(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    guard, key = f"{r}/leader", f"{r}/state"
    await store.put(guard, b"me")
    mine = await store.get(guard)
    assert mine is not None
    await store.put(guard, b"me again")  # a put keeps the key's create_revision: still my term
    assert await store.put_fenced(key, b"1", guard_key=guard, guard_create_revision=mine.create_revision) is True
    await store.delete(guard)
    await store.put(guard, b"my successor")  # a new term: a new create_revision
    assert await store.put_fenced(key, b"2", guard_key=guard, guard_create_revision=mine.create_revision) is False
    assert await store.put_fenced(key, None, guard_key=guard, guard_create_revision=mine.create_revision) is False
    kept = await store.get(key)
    assert kept is not None and kept.value == b"1"
    successor = await store.get(guard)
    assert successor is not None
    assert await store.put_fenced(key, None, guard_key=guard, guard_create_revision=successor.create_revision)
    assert await store.get(key) is None
    await store.close()


@async_test
async def test_a_batch_writes_and_deletes_at_one_revision_and_only_under_its_guard(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    guard, a, b, gone = f"{r}/leader", f"{r}/a", f"{r}/b", f"{r}/gone"
    await store.put(gone, b"old")
    await store.put(guard, b"me")
    mine = await store.get(guard)
    assert mine is not None
    before = await store.revision()
    assert await store.write_batch({a: b"1", b: b"2", gone: None}) is True
    written = [await store.get(key) for key in (a, b)]
    assert [kv.value for kv in written if kv] == [b"1", b"2"]
    assert {kv.mod_revision for kv in written if kv} == {before + 1} == {await store.revision()}
    assert await store.get(gone) is None
    assert await store.write_batch({}) is True and await store.revision() == before + 1
    epoch = mine.create_revision
    assert await store.write_batch({a: b"3", b: None}, guard_key=guard, guard_create_revision=epoch) is True
    await store.delete(guard)
    await store.put(guard, b"my successor")
    assert await store.write_batch({a: b"4", b: b"4"}, guard_key=guard, guard_create_revision=epoch) is False
    kept = await store.get(a)
    assert kept is not None and kept.value == b"3" and await store.get(b) is None
    with pytest.raises(ValueError, match="at most 128 keys"):
        await store.write_batch({f"{r}/k{i}": b"x" for i in range(129)})
    with pytest.raises(ValueError, match="create_revision"):
        await store.write_batch({a: b"5"}, guard_key=guard)
    await store.close()


@async_test
async def test_a_lost_lease_is_refused_only_where_it_would_be_used(harness: Harness) -> None:
    store, r, lease = await harness.open_with_a_lease()
    await store.revoke_lease(lease)
    await store.revoke_lease(lease)  # idempotent
    with pytest.raises(LeaseLost):
        await store.refresh_lease(lease)
    with pytest.raises(LeaseLost):
        await store.put(f"{r}/k", b"v", lease=lease)
    await store.put(f"{r}/k", b"v")
    assert await store.compare_and_put(f"{r}/k", b"x", mod_revision=0, lease=lease) is False
    with pytest.raises(LeaseLost):
        await store.compare_and_put(f"{r}/new", b"x", mod_revision=0, lease=lease)
    await store.close()


@async_test
async def test_lease_expiry_deletes_its_keys_and_a_watcher_sees_it(harness: Harness) -> None:
    store, r, lease = await harness.open_with_a_lease()
    await store.put(f"{r}/live/a", b"a", lease=lease)
    await store.put(f"{r}/live/b", b"b", lease=lease)
    await store.put(f"{r}/live/c", b"c")
    kv = await store.get(f"{r}/live/a")
    assert kv is not None and kv.lease == lease
    events = store.watch_prefix(f"{r}/live/", start_revision=await store.revision() + 1)

    async def expired() -> bool:
        return await store.get(f"{r}/live/a") is None

    assert not await expired()
    await harness.pass_time(TTL_S)
    await harness.eventually(expired, within_s=3)  # etcd checks for expired leases every 0.5 s
    deletes = await take(events, 2)
    assert [(e.kind, e.key, e.value) for e in deletes] == [
        ("delete", f"{r}/live/a", b""),
        ("delete", f"{r}/live/b", b""),
    ]
    assert deletes[0].mod_revision == deletes[1].mod_revision == await store.revision()
    assert [kv.key for kv in await store.get_prefix(f"{r}/live/")] == [f"{r}/live/c"]
    with pytest.raises(LeaseLost):
        await store.refresh_lease(lease)
    await events.aclose()
    await store.close()


@async_test
async def test_refreshing_keeps_a_lease_past_its_ttl(harness: Harness) -> None:
    store, r, lease = await harness.open_with_a_lease()
    await store.put(f"{r}/k", b"v", lease=lease)
    for _ in range(4):
        await harness.pass_time(TTL_S / 3)
        await store.refresh_lease(lease)
    assert await store.get(f"{r}/k") is not None
    await store.revoke_lease(lease)
    assert await store.get(f"{r}/k") is None
    await store.close()


@async_test
async def test_watch_replays_from_start_revision_then_follows(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    first = await store.put(f"{r}/w/a", b"1")
    await store.put(f"{r}/elsewhere", b"x")
    await store.put(f"{r}/w/a", b"2")
    await store.delete(f"{r}/w/a")
    events = store.watch_prefix(f"{r}/w/", start_revision=first)
    assert await take(events, 3) == [
        WatchEvent("put", f"{r}/w/a", b"1", first),
        WatchEvent("put", f"{r}/w/a", b"2", first + 2),
        WatchEvent("delete", f"{r}/w/a", b"", first + 3),
    ]
    revision = await store.put(f"{r}/w/b", b"3")
    assert await take(events, 1) == [WatchEvent("put", f"{r}/w/b", b"3", revision)]
    await events.aclose()
    await store.close()


@async_test
async def test_a_watch_stops_with_its_consumer(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    seen: list[WatchEvent] = []
    got_one = asyncio.Event()

    async def consume() -> None:
        async for event in store.watch_prefix(f"{r}/w/", start_revision=await store.revision() + 1):
            seen.append(event)
            got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # the watch starts
    await store.put(f"{r}/w/a", b"")
    await asyncio.wait_for(got_one.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.put(f"{r}/w/b", b"")  # nobody left to receive it; nothing breaks
    assert [e.key for e in seen] == [f"{r}/w/a"]
    await store.close()


@async_test
async def test_keeper_regrants_after_the_lease_is_revoked_from_outside(harness: Harness) -> None:
    store, r = await harness.open_store(), harness.root
    key = f"{r}/nodes/n1"

    async def register(lease: int) -> None:
        await store.put(key, b"alive", lease=lease)

    keeper = LeaseKeeper(store, TTL_S, on_regrant=register, sleep=harness.keeper_sleep)
    first = await keeper.start()
    await register(first)
    await store.revoke_lease(first)
    assert await store.get(key) is None

    async def reregistered() -> bool:
        kv = await store.get(key)
        return kv is not None and kv.lease == keeper.lease != first

    await harness.eventually(reregistered, within_s=3)
    assert keeper.num_regrants == 1
    await harness.pass_time(TTL_S + 0.5)  # the new lease is kept alive too
    assert await reregistered()
    await keeper.stop()
    assert await store.get(key) is None
    await store.close()


# --- etcd only ------------------------------------------------------------------------------


async def fill(store: Store, prefix: str, count: int, value_bytes: int) -> dict[str, bytes]:
    """`count` keys of `value_bytes` each under `prefix`, written in batches under etcd's request
    limit; what was written."""
    values = {f"{prefix}{index:04d}": bytes([index % 251]) * value_bytes for index in range(count)}
    per_batch = max(1, min(MAX_TXN_OPS, (MAX_TXN_BYTES // 2) // value_bytes))
    keys = list(values)
    for first in range(0, count, per_batch):
        assert await store.write_batch({key: values[key] for key in keys[first : first + per_batch]})
    return values


@async_test
async def test_a_prefix_larger_than_a_grpc_answer_is_read_whole_as_one_snapshot(
    etcd_endpoint: EtcdTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over gRPC's default 4 MiB answer, a whole-prefix read failed for good: "Received message
    # larger than max" (holders/ of ~130 nodes; models/ on a thousand GPUs).
    store = await EtcdStore.open(etcd_endpoint.endpoint, timeout_s=5)
    prefix = f"{etcd_endpoint.root}/big/"
    try:
        values = await fill(store, prefix, 600, 9 * 1024)  # 5.3 MiB
        kvs = await store.get_prefix(prefix)
        assert [kv.key for kv in kvs] == sorted(values) and {kv.key: kv.value for kv in kvs} == values
        real_range, pages = store_module._range, 0

        async def racing(*args: Any, **kwargs: Any) -> Any:
            # Between the first page and the next, others write: a page of its own revision would
            # see a changed key, a new one, and miss a deleted one.
            nonlocal pages
            pages += 1
            reply = await real_range(*args, **kwargs)
            if pages == 1:
                await store.put(f"{prefix}0599", b"changed")
                await store.put(f"{prefix}0600", b"new")
                await store.delete(f"{prefix}0598")
            return reply

        monkeypatch.setattr(store_module, "_range", racing)
        kvs = await store.get_prefix(prefix)
        assert pages > 1
        assert [kv.key for kv in kvs] == sorted(values)
        assert {kv.key: kv.value for kv in kvs} == values
    finally:
        await store.close()


@async_test
async def test_a_page_too_large_to_take_is_read_in_smaller_pages(
    etcd_endpoint: EtcdTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Values may be up to etcd's 1.5 MiB each: a page of them may exceed any cap on an answer.
    monkeypatch.setitem(store_module.ETCD_CHANNEL_OPTIONS, "grpc.max_receive_message_length", 256 * 1024)
    store = await EtcdStore.open(etcd_endpoint.endpoint, timeout_s=5)
    prefix = f"{etcd_endpoint.root}/wide/"
    try:
        values = await fill(store, prefix, 40, 100 * 1024)  # 4 MiB, two values to an answer at most
        kvs = await store.get_prefix(prefix)
        assert {kv.key: kv.value for kv in kvs} == values and [kv.key for kv in kvs] == sorted(values)
    finally:
        await store.close()


@async_test
async def test_a_key_that_is_not_utf8_is_skipped_by_reads_and_watches_with_a_warning(
    etcd_endpoint: EtcdTarget, caplog: pytest.LogCaptureFixture
) -> None:
    # Put by hand (etcdctl takes any bytes), it raised UnicodeDecodeError out of every read and
    # watch of its prefix: under the scheduler's gpus/ no scheduler could take office.
    prefix = f"{etcd_endpoint.root}/gpus/"
    bad_key = prefix.encode() + b"n\xff/gpu0/lru"
    store = await EtcdStore.open(etcd_endpoint.endpoint, timeout_s=5)
    try:
        first = await store.revision() + 1
        await store._client.put(bad_key, b"[]")
        good = await store.put(f"{prefix}n/gpu0/lru", b"[]")
        assert [kv.key for kv in await store.get_prefix(prefix)] == [f"{prefix}n/gpu0/lru"]
        events = store.watch_prefix(prefix, start_revision=first)
        assert await take(events, 1) == [WatchEvent("put", f"{prefix}n/gpu0/lru", b"[]", good)]
        await events.aclose()
        warnings = [r.getMessage() for r in caplog.records if r.name == "gpufaas.store"]
        assert warnings == [f"ignoring etcd key {bad_key!r}: it is not UTF-8"] * 2
    finally:
        await store.close()


@async_test
async def test_open_fails_with_store_error_when_nothing_listens() -> None:
    started = time.monotonic()
    with pytest.raises(StoreError):
        await EtcdStore.open(f"127.0.0.1:{free_port()}", timeout_s=2)
    assert time.monotonic() - started < 2


def test_store_error_while_etcd_is_down_and_recovery_after(tmp_path: Path) -> None:
    """A private etcd: stopped (calls and watches fail fast), restarted (the same store and lease
    keeper carry on), suspended (calls time out)."""
    server = EtcdServer(name="outage").start(tmp_path)
    pid = server.pid

    async def scenario() -> None:
        store = await EtcdStore.open(server.endpoint, timeout_s=1)

        async def register(lease: int) -> None:
            await store.put("/nodes/n1", b"", lease=lease)

        keeper = LeaseKeeper(store, TTL_S, on_regrant=register)
        await register(await keeper.start())
        await store.put("/kept", b"v")
        watch = store.watch_prefix("/", start_revision=await store.revision() + 1)
        watching = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.2)

        await asyncio.to_thread(server.stop)
        with pytest.raises(StoreError):
            await asyncio.wait_for(watching, timeout=5)
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.get("/kept")
        with pytest.raises(StoreError):
            await store.put("/kept", b"w")
        assert time.monotonic() - started < 1  # refused, not timed out

        await asyncio.sleep(0.5)  # the keeper fails a refresh or two meanwhile, and carries on
        await asyncio.to_thread(server.start, tmp_path, client_port=server.client_port, peer_port=server.peer_port)
        for _ in range(100):  # gRPC reconnects with backoff
            try:
                kv = await store.get("/kept")
                break
            except StoreError:
                await asyncio.sleep(0.1)
        assert kv is not None and kv.value == b"v"
        await asyncio.sleep(TTL_S / 3 + 0.5)  # a refresh after the restart
        node = await store.get("/nodes/n1")
        assert node is not None and node.lease == keeper.lease
        assert keeper.running
        await keeper.stop()

        server.suspend()
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.get("/kept")
        assert 0.5 < time.monotonic() - started < 3  # the call's deadline (timeout_s=1)
        server.resume()
        await store.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=40))
    finally:
        server.stop()
    assert not survivors([pid])


def test_etcd_authentication_bootstrap_renewal_and_restart(tmp_path: Path) -> None:
    """With credentials, the first store turns etcd's auth on; then nothing without the password
    gets in; tokens (1 s here) expire while idle and are renewed for unary calls and new watches;
    an etcd restart (which forgets every token) is survived the same way."""
    server = EtcdServer(name="auth", extra_args=["--auth-token-ttl=1"]).start(tmp_path)
    root = EtcdCredentials("root", "s3cret-password")

    async def scenario() -> None:
        store = await EtcdStore.open(server.endpoint, timeout_s=2, credentials=root, enable_auth=True)
        await store.put("/a", b"1")

        bare = EtcdStore(server.endpoint, timeout_s=2)
        with pytest.raises(StoreError, match="user name is empty"):
            await bare.get("/a")
        await bare.close()
        with pytest.raises(StoreError, match="authentication failed"):
            await EtcdStore.open(server.endpoint, timeout_s=2, credentials=EtcdCredentials("root", "guess"))
        with pytest.raises(StoreError, match="authentication failed"):
            await EtcdStore.open(
                server.endpoint, timeout_s=2, credentials=EtcdCredentials("someone", "x"), enable_auth=True
            )

        # A second daemon with the same password (bootstrap already done) gets in.
        other = await EtcdStore.open(server.endpoint, timeout_s=2, credentials=root, enable_auth=True)
        old_watch = store.watch_prefix("/", start_revision=await store.revision() + 1)
        old_next = asyncio.ensure_future(anext(old_watch))
        await asyncio.sleep(2.5)  # every token is idle past its TTL
        assert (kv := await store.get("/a")) is not None and kv.value == b"1"
        new_watch = store.watch_prefix("/", start_revision=await store.revision() + 1)
        new_next = asyncio.ensure_future(anext(new_watch))
        await asyncio.sleep(2.5)
        await other.put("/b", b"2")
        assert (await asyncio.wait_for(old_next, 5)).key == "/b"  # an open stream outlives its token
        assert (await asyncio.wait_for(new_next, 5)).key == "/b"  # a new watch after expiry works
        await old_watch.aclose()
        await new_watch.aclose()

        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start, tmp_path, client_port=server.client_port, peer_port=server.peer_port)
        for _ in range(100):  # gRPC reconnects with backoff; the token is renewed on the way
            try:
                await store.put("/c", b"3")
                break
            except StoreError:
                await asyncio.sleep(0.1)
        assert (kv := await other.get("/c")) is not None and kv.value == b"3"
        # A burst of calls that all find the token expired logs in once, not once each.
        await asyncio.sleep(2.5)
        logins = []
        request_type = aetcd.rpc.AuthenticateRequest

        def counted(**fields: Any) -> Any:
            logins.append(fields["name"])
            return request_type(**fields)

        aetcd.rpc.AuthenticateRequest = counted
        try:
            await asyncio.gather(*(store.get("/a") for _ in range(30)))
        finally:
            aetcd.rpc.AuthenticateRequest = request_type
        assert logins == ["root"]
        await store.close()
        await other.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=40))
    finally:
        server.stop()


def test_closing_a_store_with_credentials_ends_its_running_watches(tmp_path: Path) -> None:
    """With credentials each watch has a client of its own: close() must end those watches too
    (the Store contract), or a mirror (list_and_watch) outlives its store, its channel open."""
    server = EtcdServer(name="auth-close").start(tmp_path)

    async def scenario() -> None:
        root = EtcdCredentials("root", "s3cret-password")
        store = await EtcdStore.open(server.endpoint, timeout_s=2, credentials=root, enable_auth=True)
        watch = store.watch_prefix("/", start_revision=await store.revision() + 1)
        watching = asyncio.ensure_future(anext(watch))
        await store.put("/a", b"1")
        assert (await asyncio.wait_for(watching, 5)).key == "/a"  # the watch runs
        watching = asyncio.ensure_future(anext(watch))
        await store.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(watching, 5)

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    finally:
        server.stop()


@async_test
async def test_an_etcd_on_loopback_is_reached_whatever_proxy_the_environment_names(
    etcd_endpoint: EtcdTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC took the channel to 127.0.0.1 through the proxy (none answers there): "failed to connect".
    for variable in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9")  # the discard port: nothing answers
    for variable in ("no_proxy", "NO_PROXY", "no_grpc_proxy"):
        monkeypatch.delenv(variable, raising=False)
    store = await EtcdStore.open(etcd_endpoint.endpoint, timeout_s=2)
    try:
        assert await store.revision() > 0
    finally:
        await store.close()


def test_the_etcd_channel_keeps_alive_and_reconnects_quickly() -> None:
    # A partition drops packets without a reset: only gRPC keepalive tells the channel its
    # connection is gone, and a short backoff brings it back soon after the heal (docs/hosts.md).
    client = EtcdStore("127.0.0.1:2379")._new_client()
    options = dict(client._options)
    assert options["grpc.keepalive_time_ms"] >= 5_000  # etcd refuses pings more often than 5 s
    assert options["grpc.keepalive_timeout_ms"] <= 5_000
    assert options["grpc.max_reconnect_backoff_ms"] <= 2_000
    assert "grpc.keepalive_permit_without_calls" not in options  # etcd refuses pings on idle connections
