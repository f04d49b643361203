"""The scheduler's state persister: the GPUs' LRU lists and status, replicas and profiles, written
to etcd by one coalescing flusher, and read back by a restarted scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection

from gpufaas.keys import Keys, gpu_address, split_gpu_address
from gpufaas.store import MAX_TXN_BYTES, MAX_TXN_OPS, Store, StoreError
from scheduler.calls import CallBook
from scheduler.core import Scheduler

log = logging.getLogger("gpufaas.scheduler")

# Changes are written to etcd within this long, coalesced: a burst of calls costs one write per
# key that changed, not one per call (a GPU that went busy and idle again in between costs none).
# etcd is the record for observers and for recovery (which also asks the nodes), not the path of
# a call: a second of lag costs nothing, while writing per call would cost the scheduler and etcd
# more CPU than the call itself.
FLUSH_DELAY_S = 1.0
PROFILE_WRITE_INTERVAL_S = 5.0  # measured times move a little on every call: persist them calmly
RETRY_S = 0.5  # after a flush etcd refused
# After a flush that failed of a bug (any error but StoreError): one that repeats on every try
# logs a traceback this often, not twice a second.
BUG_RETRY_S = 30.0
# GPUs encoded between two yields to the event loop: a flush of a thousand busy GPUs is about 7 ms
# of JSON, which in one piece would hold every call the scheduler is placing for as long.
GPUS_PER_SLICE = 64
DELETED = b""  # in `_written`: this scheduler deleted the key (every value it puts is JSON, never empty)


class NotLeading(StoreError):
    """A write refused because this scheduler does not lead now (or is unsure of it): another
    scheduler may lead, and these keys are its to write."""


class StatePersister:
    """The single writer of the scheduler's keys in etcd (`gpus/`, `models/`, `profiles/`): it
    writes what the book marked dirty and the GPUs that left, at most once per FLUSH_DELAY_S,
    and never rewrites a value it last put unchanged. No read-modify-write: no one else writes
    these keys. Each write first asks `may_write` (whether this scheduler leads and is sure of it),
    and under an election each goes in a transaction fenced on the term's leader key (`new_term`'s
    `fence`: the key and the epoch, its create_revision), so a leader that paused between the
    question and the write, and was deposed meanwhile, writes nothing over its successor's."""

    def __init__(
        self, store: Store, keys: Keys, scheduler: Scheduler, book: CallBook, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.may_write: Callable[[], bool] = lambda: True  # the service says whether it leads
        self.keys = keys
        self.scheduler = scheduler
        self.book = book
        self.clock = clock
        self._wanted = asyncio.Event()
        self._deleted_gpus: set[str] = set()  # "node/gpu" whose keys go at the next flush
        self._written: dict[str, bytes] = {}  # last value put per key (or DELETED): unchanged ones are not rewritten
        self._profile_written_at: dict[str, float] = {}
        self._fence: tuple[str, int] | None = None  # (leader key, epoch) under an election
        self._unkeyable: set[str] = set()  # what `_key` warned of already
        # The models some function runs now (the catalog's); None: every model (no catalog). A
        # profile of any other model is deleted, and not written again.
        self.models_run: Callable[[], Collection[str]] | None = None
        self._profile_keys: dict[str, set[str]] = {}  # model -> its profile keys in etcd, as known this term
        self._retiring: set[str] = set()  # models whose profile keys go at the next flush, if still run by none

    def new_term(self, fence: tuple[str, int] | None = None) -> None:
        """A term begins or ends: what is pending is dropped, and what was written is no longer
        known to be there (another leader may have written since). `fence`: the term's leader key
        and epoch, which every write of the term requires (None: plain writes, one scheduler)."""
        self._fence = fence
        self.book.dirty_gpus, self.book.dirty_models, self.book.dirty_profiles = set(), set(), set()
        self._deleted_gpus.clear()
        self._written.clear()
        self._profile_keys.clear()  # (`recover` reads them again)
        self._retiring.clear()
        self._wanted.clear()

    def want_flush(self) -> None:
        """Something may have changed: flush within FLUSH_DELAY_S."""
        self._wanted.set()

    def gpus_left(self, gpu_ids: list[str]) -> None:
        """These GPUs left the scheduler: their keys are deleted at the next flush."""
        self._deleted_gpus.update(gpu_ids)

    def gpu_joined(self, gpu_id: str) -> None:
        """A GPU (re)joined: its keys stay (the flushes rewrite them)."""
        self._deleted_gpus.discard(gpu_id)

    def model_retired(self, model: str) -> None:
        """No function runs `model` any more: its profile keys are deleted at the next flush
        (unless a function runs it again by then). Kept, they grew by a key per GPU type with
        every model ever deployed, each read back at every term's start."""
        self._retiring.add(model)
        self._wanted.set()

    async def recover(self, live_gpu_ids: set[str]) -> dict[str, list[str]]:
        """Read the persisted LRU lists: "node/gpu" -> models, most recent first, for the GPUs of
        nodes registered now; those of any other GPU (one that left while no scheduler ran) are
        deleted at the next flush, which is wanted now. Every model with a replicas key is
        written again from the cache as its nodes attach: a worker that died, or a node that
        restarted or left, while no scheduler ran left it naming GPUs that no longer hold it.
        The profile keys are noted per model; those of a model no function runs (deleted while no
        scheduler led) are deleted at that flush."""
        for kv in await self.store.get_prefix(self.keys.profiles):
            model = kv.key.removeprefix(self.keys.profiles).partition("/")[2]
            self._profile_keys.setdefault(model, set()).add(kv.key)
        self._retiring.update(self._profile_keys)  # (the flush keeps those a function runs)
        for kv in await self.store.get_prefix(self.keys.models):
            model, _, leaf = kv.key.removeprefix(self.keys.models).rpartition("/")
            if leaf == "replicas" and model:
                self.book.dirty_models.add(model)
        recovered: dict[str, list[str]] = {}
        for kv in await self.store.get_prefix(self.keys.gpus):
            parsed = self.keys.parse_gpu_key(kv.key)
            if parsed is None:
                continue
            address = gpu_address(parsed[0], parsed[1])
            # Its status key alone counts too: its LRU list may never have been written (cut off
            # from it by a crash between two transactions, or deleted as too large).
            if address not in live_gpu_ids:
                self._deleted_gpus.add(address)
                continue
            if parsed[2] != "lru":
                continue
            models = _lru_models(kv.value)
            if models is None:
                log.warning("ignoring an invalid LRU list at %s", kv.key)
            else:
                recovered[address] = models
        self._wanted.set()
        return recovered

    async def run(self) -> None:
        """The flusher: wait for a change, let more gather for FLUSH_DELAY_S, write; on a StoreError
        retry everything soon; on any other error (a bug) log it, and retry after BUG_RETRY_S."""
        while True:
            await self._wanted.wait()
            await asyncio.sleep(FLUSH_DELAY_S)
            self._wanted.clear()
            try:
                await self.flush()
            except StoreError as exc:
                level = logging.DEBUG if isinstance(exc, NotLeading) else logging.WARNING
                log.log(level, "could not persist cache state (%s); retrying", exc)
                self._wanted.set()
                await asyncio.sleep(RETRY_S)
            except Exception:
                # The flusher goes on (it ended silently, and nothing was persisted for the rest of
                # the term): etcd's keys are a record for observers and a successor's recovery,
                # which asks the nodes too, not the path of a call, and `flush` kept what it took.
                # Ending the term instead would cut every call off, and hand a successor the bug.
                log.exception("could not persist cache state (a bug); retrying in %.0f s", BUG_RETRY_S)
                self._wanted.set()
                await asyncio.sleep(BUG_RETRY_S)

    async def flush(self, *, final: bool = False) -> None:
        """Write what changed since the last flush, up to MAX_TXN_OPS keys (and about
        MAX_TXN_BYTES) per etcd transaction: one round trip and one revision each, not one per key.
        StoreError (or a cancellation, as at stop): nothing is lost, the next flush retries every
        key this one took. `final` (the last flush, at a stop): every profile measured anew is
        written, however recently its key was."""
        book = self.book
        gpus, book.dirty_gpus = book.dirty_gpus, set()
        models, book.dirty_models = book.dirty_models, set()
        profiles, book.dirty_profiles = book.dirty_profiles, set()
        deleted, self._deleted_gpus = self._deleted_gpus, set()
        writes: dict[str, bytes | None] = {}  # key -> value (None: delete), in the order decided
        retiring: set[str] = set()
        try:
            self._delete_gpus(deleted, writes)
            await self._write_gpus(gpus, writes)
            self._write_replicas(models, writes)
            # (every function's model, as a set: built only where a profile is to be written or deleted)
            models_run = self.models_run if profiles or self._retiring else None
            running = None if models_run is None else models_run()
            self._write_profiles(profiles, writes, running, calm=not final)
            retiring = self._delete_profiles(writes, running)
            await self._write_all(writes)
            if running is not None:
                for model in retiring.difference(running):
                    self._profile_keys.pop(model, None)  # (deleted)
        except BaseException:
            # Put it all back: the next flush retries every key (stop's last flush too, when the
            # flusher was cancelled in the middle of this one).
            book.dirty_gpus |= gpus
            book.dirty_models |= models
            book.dirty_profiles |= profiles
            self._deleted_gpus |= deleted
            self._retiring |= retiring
            raise

    def _delete_gpus(self, deleted: set[str], writes: dict[str, bytes | None]) -> None:
        for address in deleted:
            keys = self._gpu_keys(address)
            if keys is not None:
                writes[keys[0]] = writes[keys[1]] = None

    def _gpu_keys(self, address: str) -> tuple[str, str] | None:
        """The LRU list's and the status's keys of GPU `address`; None (warned of once) where its
        node's record names it with a '/' in its node or GPU name, which no key segment holds:
        a ValueError raised out of a flush killed the flusher, and nothing was persisted again."""
        try:
            node, gpu = split_gpu_address(address)
            return self.keys.gpu_lru(node, gpu), self.keys.gpu_status(node, gpu)
        except ValueError as exc:
            self._cannot_key(f"GPU {address}", exc)
            return None

    def _cannot_key(self, what: str, exc: ValueError) -> None:
        if what not in self._unkeyable:
            self._unkeyable.add(what)
            log.warning("cannot persist the state of %s: %s", what, exc)

    async def _write_gpus(self, gpus: set[str], writes: dict[str, bytes | None]) -> None:
        """Each GPU's LRU list and status (a GPU that left meanwhile is skipped), GPUS_PER_SLICE at
        a time between the event loop's other work; each as it is when encoded."""
        for index, address in enumerate(gpus):
            if index and not index % GPUS_PER_SLICE:
                await asyncio.sleep(0)
            try:
                cache, state = self.scheduler.cache.gpu(address), self.scheduler.gpu(address)
            except KeyError:
                continue  # it left
            keys = self._gpu_keys(address)
            if keys is None:
                continue
            lru = [{"model": m, "memory_mb": cache.item(m).memory_mb} for m in cache.lru_list()]
            self._put(writes, keys[0], json.dumps(lru).encode())
            status = {
                "status": "idle" if state.idle else "busy",
                "memory_used_mb": cache.used_mb,
                "memory_capacity_mb": cache.capacity_mb,
                "running": len(state.running),
                "slots": state.spec.slots,
                "local_queue": len(state.local_queue),
            }
            self._put(writes, keys[1], json.dumps(status).encode())

    def _write_replicas(self, models: set[str], writes: dict[str, bytes | None]) -> None:
        """Which GPUs hold each model; a model no GPU holds loses its key."""
        for model in models:
            try:
                key = self.keys.replicas(model)
            except ValueError as exc:  # a stray key under `models/` that `recover` read: see `_gpu_keys`
                self._cannot_key(f"model {model}", exc)
                continue
            holders = sorted(self.scheduler.cache.gpus_with(model))
            if holders:
                self._put(writes, key, json.dumps(holders).encode())
            elif self._written.get(key) != DELETED:
                writes[key] = None

    def _delete_profiles(self, writes: dict[str, bytes | None], running: Collection[str] | None) -> set[str]:
        """Delete the profile keys of the retiring models no function runs (`running`; None: all
        run); returns the retiring models taken (the caller puts them back if the flush fails,
        and forgets the keys of those no function runs once it succeeds)."""
        retiring, self._retiring = self._retiring, set()
        for model in retiring:
            if running is not None and model not in running:
                writes.update(dict.fromkeys(self._profile_keys.get(model, ())))
        return retiring

    def _write_profiles(
        self,
        profiles: set[tuple[str, str, int]],
        writes: dict[str, bytes | None],
        running: Collection[str] | None,
        *,
        calm: bool = True,
    ) -> None:
        """Each (GPU type, model) key with a batch size measured anew, with `calm` at most once per
        PROFILE_WRITE_INTERVAL_S (a later one goes back to the book's dirty set, and the flusher
        looks again after FLUSH_DELAY_S until its interval has passed). The key holds
        every figure the estimator knows of the pair, each batch size's with the others: one
        written with the dirty batch size alone lost the rest, for a restarted scheduler and a
        standby that takes over; so is its measured swap-in time (from a host tier). A load or
        swap-in time never measured nor profiled is written as null, not the size-based guess
        (which a successor would take for known). A model no function runs
        (`running`; None: all run) is not written: its keys are deleted (`_delete_profiles`)."""
        now = self.clock()
        # One dirty entry per key stands for all of its batch sizes: the write takes every one.
        pairs = {(gpu_type, model): batch for gpu_type, model, batch in profiles}
        if running is not None:
            pairs = {pair: batch for pair, batch in pairs.items() if pair[1] in running}
        for (gpu_type, model), batch in pairs.items():
            try:
                key = self.keys.profile(gpu_type, model)
            except ValueError as exc:  # a GPU type with a '/' (a node's setting): see `_gpu_keys`
                self._cannot_key(f"GPU type {gpu_type}", exc)
                continue
            if calm and now - self._profile_written_at.get(key, -PROFILE_WRITE_INTERVAL_S) < PROFILE_WRITE_INTERVAL_S:
                self.book.dirty_profiles.add((gpu_type, model, batch))  # later
                # Look again at the next flush: no later call may come to wake the flusher, and
                # this figure must still reach etcd. A look is a pass over the dirty sets; the
                # interval is read on `clock`, so a test's manual clock drives it.
                self._wanted.set()
                continue
            self._profile_written_at[key] = now
            load_time_s, inference_time_s = self.scheduler.estimator.known_times_s(model, gpu_type)
            record = {
                "load_time_s": load_time_s,
                "swap_in_time_s": self.scheduler.estimator.known_swap_in_s(model, gpu_type),
                "inference_time_s": {str(batch): seconds for batch, seconds in sorted(inference_time_s.items())},
            }
            writes[key] = json.dumps(record).encode()
            self._profile_keys.setdefault(model, set()).add(key)

    def _put(self, writes: dict[str, bytes | None], key: str, value: bytes) -> None:
        # A value this scheduler last put unchanged is not rewritten, unless this flush was to
        # delete the key (a GPU that left and came back): the put replaces the delete.
        if key in writes or self._written.get(key) != value:
            writes[key] = value

    async def _write_all(self, writes: dict[str, bytes | None]) -> None:
        """Write `writes` in transactions (`_batches`), each only if this scheduler leads, and
        fenced on its term's key; remember what each one wrote."""
        self._delete_oversized(writes)
        for batch in _batches(writes):
            if not self.may_write():
                raise NotLeading("this scheduler does not lead now: it writes nothing")
            if self._fence is None:
                await self.store.write_batch(batch)
            else:
                guard_key, epoch = self._fence
                if not await self.store.write_batch(batch, guard_key=guard_key, guard_create_revision=epoch):
                    raise NotLeading(f"the leader key is no longer epoch {epoch}'s: a newer leader writes these keys")
            self._written.update((key, DELETED if value is None else value) for key, value in batch.items())

    def _delete_oversized(self, writes: dict[str, bytes | None]) -> None:
        """A value over MAX_TXN_BYTES (a GPU's LRU list of many small models, a profile of many
        batch sizes) is not put: its key is deleted instead, with a warning (once per key), so
        that no stale value is read back. Put, it passed etcd's --max-request-bytes: etcd
        refused every flush, which retried forever, and no key after it was written again."""
        for key, value in writes.items():
            if value is not None and len(key) + len(value) > MAX_TXN_BYTES:
                self._cannot_key(key, ValueError(f"{len(value)} bytes, over the {MAX_TXN_BYTES} one write may hold"))
                writes[key] = None


def _lru_models(value: bytes) -> list[str] | None:
    """The models of a persisted LRU list (`_write_gpus`), most recent first; None for a value of
    another shape. Names only: a model that is not one (a list, say) failed the attach of its
    GPU's node, where each is looked up among the node's workers."""
    try:
        models = [item["model"] for item in json.loads(value)]
    except (ValueError, KeyError, TypeError):
        return None
    return models if all(isinstance(model, str) for model in models) else None


def _batches(writes: dict[str, bytes | None]) -> list[dict[str, bytes | None]]:
    """`writes` in order, cut into batches of at most MAX_TXN_OPS keys and, but for a single key
    larger than that, MAX_TXN_BYTES of keys and values: etcd refuses a request over its
    --max-request-bytes (1.5 MiB by default), and a replicas list of a model on thousands of GPUs
    is tens of KiB."""
    batches: list[dict[str, bytes | None]] = []
    batch: dict[str, bytes | None] = {}
    size = 0
    for key, value in writes.items():
        item = len(key) + (len(value) if value is not None else 0)
        if batch and (len(batch) == MAX_TXN_OPS or size + item > MAX_TXN_BYTES):
            batches.append(batch)
            batch, size = {}, 0
        batch[key] = value
        size += item
    if batch:
        batches.append(batch)
    return batches
