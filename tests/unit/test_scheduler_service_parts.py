"""The scheduler service's parts, on a MemoryStore: the state persister (what reaches etcd, what
a failed flush keeps) and the catalog (its function mirror, shared with the node links)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

import scheduler.persister as persister_mod
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import MAX_TXN_BYTES, MAX_TXN_OPS, StoreError, WatchEvent
from gpufaas.types import GpuSpec
from gpufaas.wire import Connection, Frame, MessageType, Unauthenticated
from gpufaas.wire_local import PEER_NAME, link_here
from scheduler.leadership import Role
from scheduler.persister import GPUS_PER_SLICE, _batches
from scheduler.service import EARLY_PER_SLICE, SchedulerService
from scheduler.sessions import GatewaySession
from tests.builders import stored_spec
from tests.fakes import MemoryStore

GPU = "n1/g0"


def make_spec(name: str, memory_mb: int = 1000) -> FunctionSpec:
    """A function whose package digest is derived from its name (so its model is stable)."""
    return FunctionSpec(
        name=name, package_digest="sha256:" + hashlib.sha256(name.encode()).hexdigest(), memory_mb=memory_mb
    )


def run(scenario: Callable[[SchedulerService, MemoryStore], Awaitable[None]]) -> None:
    """`scenario` against a service that is built, not started (no watches, no flusher task),
    with prestaging off (no node is attached)."""

    async def main() -> None:
        store = MemoryStore()
        await scenario(SchedulerService(store, keys=Keys("/t"), prestage_nodes=0), store)

    asyncio.run(main())


def with_model_on_gpu(service: SchedulerService, spec: FunctionSpec) -> None:
    """`spec`'s model registered, and resident on GPU (as a node's report adopts it)."""
    service.catalog.learn_function(stored_spec(service.keys, spec))
    service.scheduler.add_gpu(GpuSpec(GPU, 8000, "cpu", node="n1"))
    service.book.reconcile(GPU, {spec.model: spec.memory_mb}, 0.0)


def run_with_a_model(scenario: Callable[[SchedulerService, MemoryStore, FunctionSpec], Awaitable[None]]) -> None:
    """`run` `scenario(service, store, spec)` with `spec` (function fn-a)'s model on GPU already."""
    spec = make_spec("fn-a")

    async def with_a_model(service: SchedulerService, store: MemoryStore) -> None:
        with_model_on_gpu(service, spec)
        await scenario(service, store, spec)

    run(with_a_model)


def test_a_flush_writes_what_changed_and_nothing_twice() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        await service.persister.flush()
        lru = await store.get(keys.gpu_lru("n1", "g0"))
        status = await store.get(keys.gpu_status("n1", "g0"))
        replicas = await store.get(keys.replicas(spec.model))
        assert lru is not None and json.loads(lru.value) == [{"model": spec.model, "memory_mb": 1000}]
        assert status is not None and json.loads(status.value)["memory_used_mb"] == 1000
        assert replicas is not None and json.loads(replicas.value) == [GPU]
        revision = await store.revision()
        service.book.dirty_gpus.add(GPU)  # marked again, but unchanged: not rewritten
        service.book.dirty_models.add(spec.model)
        await service.persister.flush()
        assert await store.revision() == revision

    run_with_a_model(scenario)


def test_a_flush_of_many_gpus_takes_one_transaction_per_max_txn_ops_keys() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        gpus = [GpuSpec(f"n1/g{i}", 8000, "cpu", node="n1") for i in range(100)]
        for spec in gpus:
            service.scheduler.add_gpu(spec)
            service.book.dirty_gpus.add(spec.gpu_id)
        before = await store.revision()
        await service.persister.flush()
        # 200 keys (an LRU list and a status per GPU): two transactions, two revisions.
        assert await store.revision() == before + math.ceil(2 * len(gpus) / MAX_TXN_OPS) == before + 2
        for spec in gpus:
            assert await store.get(service.keys.gpu_status("n1", spec.gpu_id.split("/")[1])) is not None

    run(scenario)


def test_a_flush_of_many_gpus_lets_the_loop_run_between_slices_of_them() -> None:
    """Encoding a thousand GPUs' keys is milliseconds of CPU: the calls being placed meanwhile
    get the loop every GPUS_PER_SLICE GPUs, before the first write and not only at it."""

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        gpus = [GpuSpec(f"n1/g{i}", 8000, "cpu", node="n1") for i in range(3 * GPUS_PER_SLICE + 1)]
        for spec in gpus:
            service.scheduler.add_gpu(spec)
            service.book.dirty_gpus.add(spec.gpu_id)
        before = await store.revision()
        turns_before_a_write = 0

        async def other_work() -> None:
            nonlocal turns_before_a_write
            while await store.revision() == before:  # (the read is a turn of the loop too)
                turns_before_a_write += 1

        watcher = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        await service.persister.flush()
        await watcher
        # 3 yields between the 4 slices; the first write's own turn is not counted.
        assert turns_before_a_write >= 3
        for spec in gpus:
            assert await store.get(service.keys.gpu_status("n1", spec.gpu_id.split("/")[1])) is not None

    run(scenario)


def test_a_deposed_leaders_flush_writes_nothing_over_its_successors() -> None:
    spec = make_spec("fn-a")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        await store.put(keys.scheduler_leader, b"this scheduler")
        term = await store.get(keys.scheduler_leader)
        assert term is not None
        service.persister.new_term(fence=(keys.scheduler_leader, term.create_revision))
        with_model_on_gpu(service, spec)
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None
        # Deposed while it paused: it still believes it leads (may_write), the key says otherwise.
        await store.delete(keys.scheduler_leader)
        await store.put(keys.scheduler_leader, b"its successor")
        await store.put(keys.gpu_lru("n1", "g0"), b"the successor's")
        service.book.reconcile(GPU, {}, 1.0)
        with pytest.raises(StoreError, match="newer leader"):
            await service.persister.flush()
        written = await store.get(keys.gpu_lru("n1", "g0"))
        assert written is not None and written.value == b"the successor's"

    run(scenario)


def test_a_gpu_that_left_loses_its_keys() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        await service.persister.flush()
        service.persister.gpus_left([GPU])
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is None
        assert await store.get(keys.gpu_status("n1", "g0")) is None

    run_with_a_model(scenario)


def test_a_failed_flush_keeps_everything_for_the_next() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        await store.put(keys.gpu_lru("n9", "g0"), b"[]")  # a GPU that left
        service.persister.gpus_left(["n9/g0"])
        store.set_reachable(False)
        with pytest.raises(StoreError):
            await service.persister.flush()
        assert GPU in service.book.dirty_gpus and spec.model in service.book.dirty_models
        store.set_reachable(True)
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None
        assert await store.get(keys.gpu_lru("n9", "g0")) is None
        assert not service.book.dirty_gpus and not service.book.dirty_models

    run_with_a_model(scenario)


def test_a_name_no_key_can_hold_is_passed_over_and_the_rest_persisted(caplog: pytest.LogCaptureFixture) -> None:
    # A node's GPU type (its --gpu-type) or GPU name with a '/': the key's ValueError went out of
    # the flush and killed the flusher, and nothing of the term was persisted again.
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        service.scheduler.add_gpu(GpuSpec("n1/g/1", 8000, "rtx/2080", node="n1"))
        service.book.reconcile("n1/g/1", {spec.model: spec.memory_mb}, 0.0)
        service.scheduler.estimator.observe_inference(spec.model, "rtx/2080", 1, 0.1)
        service.scheduler.estimator.observe_inference(spec.model, "cpu", 1, 0.2)
        service.book.dirty_profiles |= {("rtx/2080", spec.model, 1), ("cpu", spec.model, 1)}
        service.persister.gpus_left(["n2/g/0"])
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None
        assert await store.get(keys.profile("cpu", spec.model)) is not None
        kv = await store.get(keys.replicas(spec.model))
        assert kv is not None and json.loads(kv.value) == ["n1/g/1", GPU]
        assert "cannot persist the state of GPU type rtx/2080" in caplog.text
        assert "cannot persist the state of GPU n1/g/1" in caplog.text

    run_with_a_model(scenario)


def test_recovery_returns_the_lru_lists_of_registered_gpus_and_deletes_the_rest() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        for node in ("n1", "gone"):
            await store.put(keys.gpu_lru(node, "g0"), json.dumps([{"model": "m2"}, {"model": "m1"}]).encode())
        await store.put(keys.gpu_status("gone", "g1"), b"{}")  # its LRU list was never written
        recovered = await service.persister.recover({GPU})
        assert recovered == {GPU: ["m2", "m1"]}
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("gone", "g0")) is None
        assert await store.get(keys.gpu_status("gone", "g1")) is None  # (it was kept for good)
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None

    run(scenario)


def test_recovery_passes_over_an_lru_list_naming_something_that_is_no_model(caplog: pytest.LogCaptureFixture) -> None:
    # [{"model": ["m1"]}] was recovered as it was: the attach of n1 then looked the list up among
    # its workers (TypeError: unhashable type), and n1's GPUs never finished attaching.
    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        await store.put(keys.gpu_lru("n1", "g0"), json.dumps([{"model": ["m1"]}]).encode())
        await store.put(keys.gpu_lru("n1", "g1"), b"{not json")
        await store.put(keys.gpu_lru("n1", "g2"), json.dumps([{"model": "m2"}]).encode())
        recovered = await service.persister.recover({GPU, "n1/g1", "n1/g2"})
        assert recovered == {"n1/g2": ["m2"]}
        assert f"ignoring an invalid LRU list at {keys.gpu_lru('n1', 'g0')}" in caplog.text
        assert f"ignoring an invalid LRU list at {keys.gpu_lru('n1', 'g1')}" in caplog.text

    run(scenario)


def test_a_stray_key_under_models_does_not_stop_the_flushes_after_recovery(caplog: pytest.LogCaptureFixture) -> None:
    # A key models/org/m@1/replicas (not one a scheduler writes) was read back as model 'org/m@1'
    # to write again; its key's ValueError went out of every flush: nothing persisted all term.
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        await store.put(f"{keys.models}org/m@1/replicas", b'["n1/g0"]')
        await service.persister.recover({GPU})
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None
        assert await store.get(keys.replicas(spec.model)) is not None
        assert "cannot persist the state of model org/m@1" in caplog.text

    run_with_a_model(scenario)


def test_a_new_term_writes_again_the_replicas_an_earlier_one_left() -> None:
    # The last leader wrote that n1/g0 holds m and m2; while no scheduler ran, n1 restarted (its
    # workers gone). Its attach adopts nothing, so nothing marks m dirty: the key said n1/g0 for
    # good (GET /system/functions, the replica gauge). Recovery has every such key written again.
    gone, kept = make_spec("fn-a"), make_spec("fn-b")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        await store.put(keys.gpu_lru("n1", "g0"), json.dumps([{"model": gone.model, "memory_mb": 1000}]).encode())
        for spec in (gone, kept):
            service.catalog.learn_function(stored_spec(keys, spec))
            await store.put(keys.replicas(spec.model), json.dumps([GPU]).encode())
        service.persister.new_term()
        assert await service.persister.recover({GPU}) == {GPU: [gone.model]}
        service.scheduler.add_gpu(GpuSpec(GPU, 8000, "cpu", node="n1"))
        service.persister.gpu_joined(GPU)
        service.book.reconcile(GPU, {kept.model: kept.memory_mb}, 0.0)  # n1 runs fn-b's model only now
        await service.persister.flush()
        assert await store.get(keys.replicas(gone.model)) is None
        replicas = await store.get(keys.replicas(kept.model))
        assert replicas is not None and json.loads(replicas.value) == [GPU]

    run(scenario)


def test_a_restarted_scheduler_recovers_every_batch_size_measured() -> None:
    # A (GPU type, model) key held one batch size, the one dirty last: a restarted scheduler got
    # the other sizes back by interpolation (batch 1 as 0.4 / 8 = 0.05 s, measured 0.1 s).
    spec = make_spec("fn-a")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        service.catalog.learn_function(stored_spec(keys, spec))
        estimator = service.scheduler.estimator
        estimator.observe_load(spec.model, "cpu", 9.0)
        estimator.observe_swap_in(spec.model, "cpu", 0.7)
        estimator.observe_inference(spec.model, "cpu", 1, 0.1)
        estimator.observe_inference(spec.model, "cpu", 8, 0.4)
        estimator.observe_inference(spec.model, "gpu", 4, 0.3)  # measured, never loaded there
        service.book.dirty_profiles |= {("cpu", spec.model, 1), ("cpu", spec.model, 8), ("gpu", spec.model, 4)}
        await service.persister.flush()
        assert not service.book.dirty_profiles  # every batch size went in its key's one write
        restarted = SchedulerService(store, keys=keys, prestage_nodes=0)
        await restarted.catalog.recover()
        known = restarted.scheduler.estimator.known_times_s
        assert known(spec.model, "cpu") == (9.0, {1: 0.1, 8: 0.4})
        assert known(spec.model, "gpu") == (None, {4: 0.3})  # not the size-based guess, taken for known
        # A measured swap-in (from a host tier) was lost: the successor took the size-based guess.
        assert restarted.scheduler.estimator.known_swap_in_s(spec.model, "cpu") == 0.7
        assert restarted.scheduler.estimator.known_swap_in_s(spec.model, "gpu") is None

    run(scenario)


def test_the_profiles_of_a_model_no_function_runs_any_more_are_deleted() -> None:
    # They were never deleted: a key per GPU type for every model ever deployed (each redeploy
    # of a function is a new model), all read back at every term's start.
    a, b = make_spec("fn-a"), make_spec("fn-b")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys, catalog, estimator = service.keys, service.catalog, service.scheduler.estimator
        for spec in (a, b):
            catalog.learn_function(stored_spec(keys, spec, 1))
            for gpu_type in ("cpu", "gpu"):
                estimator.observe_inference(spec.model, gpu_type, 1, 0.1)
                service.book.dirty_profiles.add((gpu_type, spec.model, 1))
        await service.persister.flush()
        assert len(await store.get_prefix(keys.profiles)) == 4
        catalog.function_changed(WatchEvent("delete", keys.function(a.name), b"", 2))
        estimator.observe_inference(a.model, "cpu", 2, 0.2)  # its last call's, after the delete
        service.book.dirty_profiles.add(("cpu", a.model, 2))
        await service.persister.flush(final=True)
        assert [kv.key for kv in await store.get_prefix(keys.profiles)] == [
            keys.profile("cpu", b.model),
            keys.profile("gpu", b.model),
        ]
        # Those an earlier leader left of a model deleted while no scheduler led go at recovery.
        await store.put(keys.profile("cpu", "gone@1"), b'{"load_time_s": 1.0, "inference_time_s": {}}')
        service.persister.new_term()
        await service.persister.recover(set())
        await service.persister.flush()
        assert len(await store.get_prefix(keys.profiles)) == 2  # b's stay: a function runs it

    run(scenario)


def test_a_value_too_large_for_etcd_is_deleted_not_retried_and_the_rest_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # etcd refuses a request over its --max-request-bytes (1.5 MiB by default): a profile of that
    # many batch sizes failed every flush, retried forever, and no change was persisted again.
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        write_batch = store.write_batch

        async def like_etcd(writes: dict[str, bytes | None], **guard: Any) -> bool:
            if sum(len(key) + len(value or b"") for key, value in writes.items()) > 1536 * 1024:
                raise StoreError("etcdserver: request is too large")
            return await write_batch(writes, **guard)

        store.write_batch = like_etcd  # type: ignore[method-assign]
        await store.put(keys.profile("cpu", spec.model), b'{"load_time_s": 1.0, "inference_time_s": {}}')
        huge = {batch: 0.1 for batch in range(1, 200_000)}
        service.scheduler.estimator.restore(spec.model, "cpu", None, huge)
        service.book.dirty_profiles.add(("cpu", spec.model, 1))
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None  # the rest is written
        assert await store.get(keys.profile("cpu", spec.model)) is None  # not the stale figures
        assert f"cannot persist the state of {keys.profile('cpu', spec.model)}" in caplog.text

    run_with_a_model(scenario)


def test_a_restarted_scheduler_passes_over_a_profile_with_impossible_figures(caplog: pytest.LogCaptureFixture) -> None:
    # A batch size of 0 was taken in: every size-based estimate of its GPU type divided by it
    # (ZeroDivisionError placing any model not profiled there); negative or NaN times were too.
    spec = make_spec("fn-a")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        keys = service.keys
        await store.put(keys.function(spec.name), spec.to_json())
        bad = {
            "zero@1": {"load_time_s": 2.0, "inference_time_s": {"0": 0.2}},
            "negative@1": {"load_time_s": -5.0, "inference_time_s": {"1": 0.2}},
            "nan@1": {"load_time_s": None, "inference_time_s": {"1": math.nan}},
        }
        for model, record in bad.items():
            await store.put(keys.profile("cpu", model), json.dumps(record).encode())
        good = {"load_time_s": 3.0, "inference_time_s": {"2": 0.4}}
        await store.put(keys.profile("cpu", "good@1"), json.dumps(good).encode())
        await service.catalog.recover()
        estimator = service.scheduler.estimator
        for model in bad:
            assert estimator.known_times_s(model, "cpu") == (None, {})
            assert f"ignoring invalid profile at {keys.profile('cpu', model)}" in caplog.text
        assert estimator.known_times_s("good@1", "cpu") == (3.0, {2: 0.4})
        assert estimator.inference_time_s(spec.model, "cpu", 1) == pytest.approx(0.2)  # good@1's per sample

    run(scenario)


def test_a_standby_takes_office_with_the_profiles_the_leader_measured_since_its_start() -> None:
    # The standby read the profiles at its start (load 5 s) and kept them: in office it planned
    # with them, then its first flush wrote them back over the 9 s the leader had measured since.
    # Read again, they are taken as they are, not averaged into its own (5 + 0.2 * 4 = 5.8 s).
    spec = make_spec("fn-a")

    async def main() -> None:
        store, keys, now = MemoryStore(), Keys("/t"), [0.0]
        await store.put(keys.function(spec.name), spec.to_json())
        earlier = {"load_time_s": 5.0, "inference_time_s": {"1": 0.2}}
        await store.put(keys.profile("cpu", spec.model), json.dumps(earlier).encode())
        standby = SchedulerService(store, keys=keys, prestage_nodes=0)
        await standby.catalog.recover()  # starts beside the leader
        leader = SchedulerService(store, keys=keys, prestage_nodes=0, clock=lambda: now[0])
        await leader.catalog.recover()
        estimator = leader.scheduler.estimator
        estimator.restore(spec.model, "cpu", 9.0, {1: 0.1, 8: 0.4})  # what hours of calls measured
        leader.book.dirty_profiles.add(("cpu", spec.model, 8))
        await leader.persister.flush()
        await standby.take_office(7)
        try:
            assert standby.scheduler.estimator.known_times_s(spec.model, "cpu") == (9.0, {1: 0.1, 8: 0.4})
            standby.book.dirty_profiles.add(("cpu", spec.model, 1))  # its first call's Done
            await standby.persister.flush()
        finally:
            await standby.leave_office("test")
        kv = await store.get(keys.profile("cpu", spec.model))
        assert kv is not None and json.loads(kv.value) == {
            "load_time_s": 9.0,
            "swap_in_time_s": None,
            "inference_time_s": {"1": 0.1, "8": 0.4},
        }

    asyncio.run(main())


def test_a_flush_failing_of_a_bug_is_logged_and_the_flusher_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The flusher caught StoreError alone: any other error of a flush ended it, unlogged, and
    # nothing was persisted for the rest of the term.
    monkeypatch.setattr(persister_mod, "FLUSH_DELAY_S", 0.0)
    monkeypatch.setattr(persister_mod, "BUG_RETRY_S", 0.0)

    async def main() -> None:
        store, keys = MemoryStore(), Keys("/t")
        await store.put(keys.gpu_lru("n", "gpu0"), b"[]")
        service = SchedulerService(store, keys=keys, prestage_nodes=0)
        persister, write_batch = service.persister, store.write_batch
        bug = RuntimeError("a bug")
        bugs = [bug]

        async def buggy(*args: Any, **kwargs: Any) -> bool:
            if bugs:
                raise bugs.pop()
            return await write_batch(*args, **kwargs)

        monkeypatch.setattr(store, "write_batch", buggy)
        flusher = asyncio.ensure_future(persister.run())
        try:
            persister.gpus_left(["n/gpu0"])
            persister.want_flush()
            for _ in range(100):
                if await store.get(keys.gpu_lru("n", "gpu0")) is None:
                    break
                await asyncio.sleep(0)
            assert await store.get(keys.gpu_lru("n", "gpu0")) is None and not flusher.done()
        finally:
            flusher.cancel()
        assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [bug]  # logged, with its traceback

    asyncio.run(main())


def test_a_deferred_profile_is_written_once_its_interval_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # A profile measured again within PROFILE_WRITE_INTERVAL_S of its last write went back to the
    # book, and with no traffic after it nothing woke the flusher: etcd kept the older profile.
    monkeypatch.setattr(persister_mod, "FLUSH_DELAY_S", 0.01)
    spec = make_spec("fn-a")

    async def main() -> None:
        store, keys, now = MemoryStore(), Keys("/t"), [0.0]
        service = SchedulerService(store, keys=keys, prestage_nodes=0, clock=lambda: now[0])
        service.catalog.learn_function(stored_spec(keys, spec))
        persister, estimator = service.persister, service.scheduler.estimator
        flusher = asyncio.ensure_future(persister.run())
        try:
            estimator.observe_inference(spec.model, "cpu", 1, 0.1)
            service.book.dirty_profiles.add(("cpu", spec.model, 1))
            persister.want_flush()
            await asyncio.sleep(0.1)
            now[0] = 1.0
            estimator.observe_inference(spec.model, "cpu", 8, 0.4)
            service.book.dirty_profiles.add(("cpu", spec.model, 8))
            persister.want_flush()
            await asyncio.sleep(0.1)  # deferred: written at 0 s
            now[0] = 3600.0  # no call since
            await asyncio.sleep(0.3)
        finally:
            flusher.cancel()
        kv = await store.get(keys.profile("cpu", spec.model))
        assert kv is not None and json.loads(kv.value)["inference_time_s"] == {"1": 0.1, "8": 0.4}, (
            f"etcd holds {kv!r}; pending in the book: {service.book.dirty_profiles}"
        )

    asyncio.run(main())


def test_a_stopping_leader_writes_the_profiles_it_deferred() -> None:
    spec = make_spec("fn-a")

    async def main() -> None:
        store, keys, now = MemoryStore(), Keys("/t"), [0.0]
        service = SchedulerService(store, keys=keys, prestage_nodes=0, tls=False, clock=lambda: now[0], lease_ttl_s=60)
        await service.start()
        try:
            for _ in range(200):
                if service.leadership.leading(now[0]):
                    break
                await asyncio.sleep(0.01)
            service.catalog.learn_function(stored_spec(keys, spec))
            estimator = service.scheduler.estimator
            estimator.observe_inference(spec.model, "cpu", 1, 0.1)
            service.book.dirty_profiles.add(("cpu", spec.model, 1))
            await service.persister.flush()
            now[0] = 1.0
            estimator.observe_inference(spec.model, "cpu", 8, 0.4)
            service.book.dirty_profiles.add(("cpu", spec.model, 8))
            await service.persister.flush()  # deferred: written a second ago
            assert service.leadership.leading(now[0])
        finally:
            await service.stop()  # its last flush
        kv = await store.get(keys.profile("cpu", spec.model))
        assert kv is not None and json.loads(kv.value)["inference_time_s"] == {"1": 0.1, "8": 0.4}, f"etcd holds {kv!r}"

    asyncio.run(main())


def test_the_catalog_relists_in_place_and_retires_models_no_function_runs() -> None:
    a, b = make_spec("fn-a"), make_spec("fn-b")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        with_model_on_gpu(service, a)
        mirror = service.catalog.functions
        assert service.links.functions is mirror  # the node links read the catalog's mirror
        await store.put(service.keys.function(b.name), b.to_json())
        service.catalog.functions_listed(await store.get_prefix(service.keys.functions), await store.revision())
        assert service.catalog.functions is mirror and list(mirror) == [b.name]
        assert a.model not in service.scheduler.cache.gpu(GPU)  # fn-a is gone: its model was retired

    run(scenario)


def test_a_model_no_function_runs_any_more_takes_its_metrics_series_with_it() -> None:
    # Its series are labelled by model (NAME@DIGEST), a new one at every redeploy: kept for good,
    # 100 redeploys of one function added 3,800 series to the exposition.
    old, new = make_spec("fn-a"), FunctionSpec(name="fn-a", package_digest="sha256:" + "b" * 64, memory_mb=1000)
    assert old.model != new.model

    def series_of(service: SchedulerService, model: str) -> list[str]:
        families = service.metrics.registry.collect()
        return [s.name for f in families for s in f.samples if s.labels.get("model") == model]

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        await store.put(service.keys.function(old.name), old.to_json())
        service.catalog.functions_listed(await store.get_prefix(service.keys.functions), await store.revision())
        service.metrics.done(old.model, "t", ok=True, outcome="ok", loaded=True, load_time_s=2, inference_time_s=1)
        assert series_of(service, old.model)
        await store.put(service.keys.function(old.name), new.to_json())  # updated to another package
        kv = await store.get(service.keys.function(old.name))
        assert kv is not None
        service.catalog.learn_function(kv)
        assert series_of(service, old.model) == []

    run(scenario)


def test_the_catalog_reads_through_for_a_function_the_watch_has_not_brought() -> None:
    spec = make_spec("fn-a")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        assert await service.catalog.read_through(spec.name) is None
        await store.put(service.keys.function(spec.name), spec.to_json())
        assert await service.catalog.read_through(spec.name) == spec
        assert service.catalog.functions == {spec.name: spec}

    run(scenario)


def test_a_scheduler_in_a_gateways_process_is_offered_to_its_dialers_while_it_runs() -> None:
    """`in_process=True`: from its start this process's dials of its address get an in-memory link
    it serves as a gateway's (gpufaas.wire_local); after its stop they go over TCP again."""

    async def main() -> None:
        store = MemoryStore()
        apart = SchedulerService(store, keys=Keys("/t"), prestage_nodes=0, tls=False)
        inside = SchedulerService(store, keys=Keys("/t"), prestage_nodes=0, tls=False, in_process=True)
        apart_address, inside_address = await apart.start(), await inside.start()
        try:
            assert link_here(apart_address, None, client_role="gateway") is None
            conn = link_here(inside_address, None, client_role="gateway", peer_role="scheduler")
            assert conn is not None and conn.peer == PEER_NAME
            with pytest.raises(Unauthenticated, match="scheduler, not a node"):
                link_here(inside_address, None, client_role="gateway", peer_role="node")
        finally:
            await inside.stop()
            await apart.stop()
        assert conn.is_closed  # served as an accepted connection: closed with the server
        assert link_here(inside_address, None, client_role="gateway") is None

    asyncio.run(main())


def test_a_gpu_that_left_and_came_back_before_the_flush_keeps_its_keys() -> None:
    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        keys = service.keys
        await service.persister.flush()
        service.persister.gpus_left([GPU])  # its delete is pending when it is written again
        service.book.dirty_gpus.add(GPU)
        await service.persister.flush()
        assert await store.get(keys.gpu_lru("n1", "g0")) is not None
        assert await store.get(keys.gpu_status("n1", "g0")) is not None

    run_with_a_model(scenario)


def test_a_flush_cancelled_in_the_middle_keeps_everything_for_the_next() -> None:
    """As at stop: the flusher is cancelled while etcd has not answered; stop's own flush then
    still has every key."""

    async def scenario(service: SchedulerService, store: MemoryStore, spec: FunctionSpec) -> None:
        answered = asyncio.Event()
        write_batch = store.write_batch

        async def slow_write_batch(*args: Any, **kwargs: Any) -> bool:
            await answered.wait()
            return await write_batch(*args, **kwargs)

        store.write_batch = slow_write_batch  # type: ignore[method-assign]
        flush = asyncio.ensure_future(service.persister.flush())
        await asyncio.sleep(0.01)
        flush.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flush
        assert GPU in service.book.dirty_gpus and spec.model in service.book.dirty_models
        answered.set()
        await service.persister.flush()
        assert await store.get(service.keys.gpu_lru("n1", "g0")) is not None

    run_with_a_model(scenario)


def test_flush_batches_keep_to_etcds_count_and_size_limits() -> None:
    small = {f"/k{i}": b"x" for i in range(2 * MAX_TXN_OPS + 1)}
    assert [len(b) for b in _batches(small)] == [MAX_TXN_OPS, MAX_TXN_OPS, 1]
    big = MAX_TXN_BYTES // 2 + 1  # two do not fit one transaction; one over the limit goes alone
    writes: dict[str, bytes | None] = {"/a": b"x" * big, "/b": b"x" * big, "/c": None, "/d": b"x" * 3 * MAX_TXN_BYTES}
    assert [list(b) for b in _batches(writes)] == [["/a"], ["/b", "/c"], ["/d"]]
    assert _batches({}) == []


class OpenConn:
    """A gateway's connection as `_open_when_attached` reads it: open."""

    is_closed = False


def test_the_places_that_waited_for_the_attaches_go_first_in_slices_with_the_loop_between() -> None:
    """A new leader under a flood holds thousands of Places while its nodes attach: placed in
    one go they held the loop (and the lease's keep-alives) for a second. The ones arriving
    meanwhile wait behind them."""

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        taken: list[str] = []
        service._take = lambda conn, request: taken.append(request.call_id)  # type: ignore[method-assign]
        conn = cast(Connection, OpenConn())
        service.term.open = False  # as a term begins (take_office)
        early = [pb.Place(call_id=f"c{i}", function="fn") for i in range(2 * EARLY_PER_SLICE + 1)]
        for request in early:
            service.place(conn, request)
        assert taken == []  # the term is not open: every Place waits
        turns = 0

        async def other_work() -> None:
            nonlocal turns
            while not service.term.open:
                turns += 1
                if turns == 2:
                    service.place(conn, pb.Place(call_id="late", function="fn"))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(other_work())
        try:
            await service._open_when_attached()  # no node is registered: all attached
        finally:
            gc.unfreeze()  # (it froze the heap, as a new term does: not this test process's)
        await watcher
        assert turns >= 3  # between the three slices
        assert taken == [request.call_id for request in early] + ["late"]
        service.place(conn, pb.Place(call_id="open", function="fn"))
        assert taken[-1] == "open"

    run(scenario)


def test_the_catalog_ignores_changes_older_than_those_it_took_in() -> None:
    # A re-list reads etcd's revision, then lists: a delete and redeploy in between are in the
    # list and replayed by the watch after it. A read-through can also answer ahead of the watch.
    # Neither may evict the live model, undo an update, or bring back a deleted function.
    spec = make_spec("fn-a")
    updated = FunctionSpec.model_validate({**spec.model_dump(), "environment": {"V": "2"}})

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        catalog, cache = service.catalog, service.scheduler.cache
        with_model_on_gpu(service, spec)
        catalog.functions_listed([stored_spec(service.keys, spec, 12)], 10)
        catalog.function_changed(WatchEvent("delete", service.keys.function(spec.name), b"", 11))
        catalog.function_changed(WatchEvent("put", service.keys.function(spec.name), spec.to_json(), 12))
        assert catalog.functions == {spec.name: spec} and spec.model in cache.gpu(GPU)
        # The update read through at 14; the watch then brings the put of 12 again, and the update.
        catalog.learn_function(stored_spec(service.keys, updated, 14))
        assert spec.model not in cache.gpu(GPU)  # retired by the update
        service.book.reconcile(GPU, {updated.model: updated.memory_mb}, 0.0)  # its worker loaded
        catalog.function_changed(WatchEvent("put", service.keys.function(spec.name), spec.to_json(), 12))
        assert catalog.functions == {spec.name: updated} and updated.model in cache.gpu(GPU)
        # A re-list at 13 cannot know of 14: the update stays.
        catalog.functions_listed([stored_spec(service.keys, spec, 12)], 13)
        assert catalog.functions == {spec.name: updated}
        # Deleted at 15; a read-through of 14 answered after it does not bring it back.
        catalog.function_changed(WatchEvent("delete", service.keys.function(spec.name), b"", 15))
        assert catalog.learn_function(stored_spec(service.keys, updated, 14)) is None
        assert catalog.functions == {}
        # A re-list past the delete forgets it: a deploy under the name again is taken.
        catalog.functions_listed([], 16)
        assert catalog.revisions == {}
        catalog.function_changed(WatchEvent("put", service.keys.function(spec.name), spec.to_json(), 17))
        assert catalog.functions == {spec.name: spec}
        # A function read through at 19, not in a list read at 18 (listed before it was deployed).
        other = make_spec("fn-b")
        catalog.learn_function(stored_spec(service.keys, other, 19))
        catalog.functions_listed([stored_spec(service.keys, spec, 17)], 18)
        assert catalog.functions == {spec.name: spec, other.name: other}

    run(scenario)


def test_a_put_of_a_function_that_changes_neither_its_model_nor_its_size_keeps_the_measured_size() -> None:
    # A worker's measured peak replaces the declared size (a function that under-declares its
    # memory must not skew placement); a put that changes neither (new labels, the same deployed
    # again) leaves it, and a new declared size is taken (and measured again at the next Done).
    spec = make_spec("fn-a", memory_mb=1000)

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        with_model_on_gpu(service, spec)
        assert service.scheduler.observe_memory(spec.model, GPU, 3000)
        relabelled = FunctionSpec.model_validate({**spec.model_dump(), "labels": {"team": "vision"}})
        assert relabelled.model == spec.model
        service.catalog.learn_function(stored_spec(service.keys, relabelled))
        assert service.scheduler.model(spec.model).memory_mb == 3000
        resized = FunctionSpec.model_validate({**spec.model_dump(), "memory_mb": 2000})
        assert resized.model == spec.model
        service.catalog.learn_function(stored_spec(service.keys, resized))
        assert service.scheduler.model(spec.model).memory_mb == 2000

    run(scenario)


def with_a_node_holding(service: SchedulerService, spec: FunctionSpec) -> None:
    """Node n1 (GPU) attached, its disk and host pool holding `spec`'s package, pre-staged already."""
    from gpufaas.cluster import NodeRecord
    from scheduler.node_links import NodeLink

    with_model_on_gpu(service, spec)
    holdings = pb.Holdings(staged=[spec.package_digest], pooled=[spec.package_digest])
    service.links.nodes["n1"] = NodeLink(NodeRecord("n1", "127.0.0.1:1", "cpu", "i1"), gpu_ids=[GPU], holdings=holdings)
    service.links._prestaged.add(spec.package_digest)  # (pre-staging placed it: no node is linked here)
    service.links.learn_holdings()


def test_a_new_model_of_a_package_the_nodes_hold_is_known_held_by_watch_or_by_relist() -> None:
    # Another function of the same package (by the watch), and a settings-only update (found by a
    # re-list): each a new model whose weights the node's disk and pool already hold.
    a = make_spec("fn-a")
    b = FunctionSpec.model_validate({**a.model_dump(), "name": "fn-b"})
    a2 = FunctionSpec.model_validate({**a.model_dump(), "environment": {"V": "2"}})

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        with_a_node_holding(service, a)
        holdings = service.scheduler.cache.holdings
        assert a.model in holdings.pooled("n1") and b.model not in holdings.staged("n1")
        service.catalog.learn_function(stored_spec(service.keys, b))
        assert b.model in holdings.pooled("n1") and b.model in holdings.staged("n1")
        await store.put(service.keys.function(a.name), a2.to_json())
        await store.put(service.keys.function(b.name), b.to_json())
        service.catalog.functions_listed(await store.get_prefix(service.keys.functions), await store.revision())
        assert a2.model != a.model and a2.model in holdings.pooled("n1")
        assert a.model not in service.scheduler.cache.gpu(GPU)  # the old model retired

    run(scenario)


def test_a_leader_that_resumes_its_term_keeps_what_it_measured_meanwhile() -> None:
    """A leader whose etcd stopped answering leaves office and takes the same term up again
    (the election's resume): its figures measured meanwhile, which it could not persist, are
    newer than etcd's and must not be replaced by them."""
    spec = make_spec("fn-a")

    async def main() -> None:
        store, keys = MemoryStore(), Keys("/t")
        await store.put(keys.function(spec.name), spec.to_json())
        persisted = {"load_time_s": 5.0, "inference_time_s": {"1": 0.2}}
        await store.put(keys.profile("cpu", spec.model), json.dumps(persisted).encode())
        leader = SchedulerService(store, keys=keys, prestage_nodes=0)
        await leader.catalog.recover()
        await leader.take_office(7)
        estimator = leader.scheduler.estimator
        estimator.observe_load(spec.model, "cpu", 9.0)
        estimator.observe_inference(spec.model, "cpu", 1, 0.1)
        measured = estimator.known_times_s(spec.model, "cpu")
        await leader.leave_office("etcd did not answer")
        await leader.take_office(7)
        try:
            assert estimator.known_times_s(spec.model, "cpu") == measured
        finally:
            await leader.leave_office("test")

    asyncio.run(main())


def test_a_function_spec_under_another_functions_key_is_ignored_and_its_model_never_stays() -> None:
    # A spec naming fn-b put under fn-a's key (by hand) was mirrored as fn-b: deleting the key
    # then took out fn-a (nobody), so fn-b, and its model in the cache, stayed until a re-list.
    b = make_spec("fn-b")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        catalog, keys = service.catalog, service.keys
        catalog.function_changed(WatchEvent("put", keys.function("fn-a"), b.to_json(), 1))
        catalog.function_changed(WatchEvent("delete", keys.function("fn-a"), b"", 2))
        assert list(catalog.functions) == []
        assert not service.book.runs(b.model)

    run(scenario)


def test_a_function_whose_spec_is_overwritten_with_an_invalid_one_is_taken_out() -> None:
    # The invalid value was ignored and the old spec kept, its model registered, until a re-list
    # (which finds no function there); the watch now does as the re-list does.
    a = make_spec("fn-a")

    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        catalog, key = service.catalog, service.keys.function("fn-a")
        catalog.function_changed(WatchEvent("put", key, a.to_json(), 1))
        assert service.book.runs(a.model)
        catalog.function_changed(WatchEvent("put", key, b"{not json", 2))
        assert list(catalog.functions) == [] and not service.book.runs(a.model)
        catalog.function_changed(WatchEvent("put", key, a.to_json(), 1))  # a replay of the older put
        assert list(catalog.functions) == []

    run(scenario)


async def _taken_as_the_term_opens(service: SchedulerService, frames: list[str]) -> list[str]:
    """The call ids of the Places the service takes as its term opens, a gateway having sent
    `frames` while it was not open: "place ID" or "cancel ID"."""
    taken: list[str] = []
    service._take = lambda conn, request: taken.append(request.call_id)  # type: ignore[method-assign]
    conn = cast(Connection, OpenConn())
    service.leadership.role = Role.LEADER  # (a standby closes a gateway's connection)
    service.term.open = False  # as a term begins (take_office)
    for frame in frames:
        kind, call_id = frame.split()
        if kind == "place":
            service.place(conn, pb.Place(call_id=call_id, function="fn"))
        else:
            cancel = pb.Abandon(call_id=call_id, reason=pb.Abandon.CANCELLED)
            GatewaySession(service).on_frame(conn, Frame(MessageType.ABANDON, 0, 0, cancel.SerializeToString(), b""))
    try:
        await service._open_when_attached()
    finally:
        gc.unfreeze()  # (it froze the heap, as a new term does: not this test process's)
    return taken


def test_a_call_cancelled_while_its_place_waits_for_the_term_to_open_is_never_placed() -> None:
    # The book had not taken it: the cancel found no call and was dropped, and once the term
    # opened the call was placed (a GPU slot booked, its model's room made) for nobody.
    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        # (the last: its id taken again, X-Call-Id)
        frames = ["place c1", "place c2", "place c3", "cancel c1", "place c1"]
        assert await _taken_as_the_term_opens(service, frames) == ["c2", "c3", "c1"]

    run(scenario)


def test_a_call_id_named_again_after_a_cancel_no_waiting_place_of_it_held_is_placed() -> None:
    # The cancel of a call whose Place did not wait in `early` (taken already, or from before the
    # term) was kept as a mark that dropped the next Place of its id: the id named again by its
    # client (X-Call-Id), that call was never placed and its gateway waited out its deadline.
    async def scenario(service: SchedulerService, store: MemoryStore) -> None:
        assert await _taken_as_the_term_opens(service, ["cancel c1", "place c1"]) == ["c1"]

    run(scenario)
