"""The scheduler's catalog: its mirror of etcd's functions, profiles and nodes (list, then watch),
which registers models with the scheduler, seeds the estimator and hands node records to the
node links."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from gpufaas.cluster import NodeRecord
from gpufaas.errors import GpufaasError
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.store import KeyValue, Store, StoreError, WatchEvent, list_and_watch
from gpufaas.types import ModelSpec
from scheduler.calls import CallBook, Effect
from scheduler.core import Scheduler
from scheduler.node_links import NodeLinks

log = logging.getLogger("gpufaas.scheduler")


class Catalog:
    """Functions by name (`functions`), each function's model registered with the scheduler and
    revived in the book; a model no function runs any more is retired. Profiles persisted by the
    last leader seed the estimator, at start and on taking office (`read_profiles`). Node records
    go to the node links (`seen`, `gone`). Touched from the event loop only; what the book
    decides is handed to `apply`."""

    def __init__(
        self,
        store: Store,
        keys: Keys,
        scheduler: Scheduler,
        book: CallBook,
        links: NodeLinks,
        *,
        functions: dict[str, FunctionSpec],
        apply: Callable[[Iterable[Effect]], None],
    ) -> None:
        """`functions`: the mirror to keep, shared with its readers (the node links): it is
        updated in place, never replaced."""
        self.store = store
        self.keys = keys
        self.scheduler = scheduler
        self.book = book
        self.links = links
        self.functions = functions
        self.apply = apply
        # Told each model that no function runs any more (the service's metrics drop its series).
        self.retired: Callable[[str], None] = lambda model: None
        self._profiles_epoch: int | None = None  # the term `read_profiles` last read for
        # Function name -> the etcd revision of the last change to it taken in (a put or a
        # delete), so that a change older than one taken already is ignored: the watch replays
        # what a re-list read, and a read-through can answer ahead of the watch. Deleted names
        # stay until a re-list past them (one int each).
        self.revisions: dict[str, int] = {}

    async def recover(self) -> int:
        """Read functions, profiles and nodes; returns the revision read (the watches go on from
        there). A node's GPUs join once it is attached (its workers then re-populate the cache)."""
        revision = await self.store.revision()
        self.functions_listed(await self.store.get_prefix(self.keys.functions), revision)
        await self.read_profiles()
        self.nodes_listed(await self.store.get_prefix(self.keys.nodes), revision)
        return revision

    def watches(self, revision: int) -> list[Coroutine[Any, Any, None]]:
        """The tasks that keep the mirror current from `revision` on (re-listing when told to)."""
        return [
            list_and_watch(self.store, prefix, on_list=on_list, on_event=on_event, listed_at=revision)
            for prefix, on_list, on_event in (
                (self.keys.functions, self.functions_listed, self.function_changed),
                (self.keys.nodes, self.nodes_listed, self.node_changed),
            )
        ]

    # --- functions --------------------------------------------------------------------------
    def functions_listed(self, kvs: list[KeyValue], revision: int) -> None:
        """The functions deployed now: the mirror is replaced, the models of those gone retired.
        (The list may hold changes made after `revision`; the watch then replays them, ignored.)"""
        before = dict(self.functions)
        # What the list cannot know: changes taken in after `revision` (a read-through) stay.
        newer = {name: seen for name, seen in self.revisions.items() if seen > revision}
        listed = [self.learn_function(kv, relisting=True) for kv in kvs]  # (each against its old)
        self.functions.clear()
        self.functions.update((spec.name, spec) for spec in listed if spec is not None)
        self.functions.update((name, before[name]) for name in newer if name in before)
        self.revisions = {**{spec.name: self.revisions[spec.name] for spec in self.functions.values()}, **newer}
        current = {spec.model for spec in self.functions.values()}
        if current - {spec.model for spec in before.values()}:
            self.links.learn_holdings()  # new models of packages the nodes may hold: once, not per function
        effects: list[Effect] = []
        for spec in before.values():
            if spec.model not in current:
                effects += self._retire(spec.model)
        self.apply(effects)

    def function_changed(self, event: WatchEvent) -> None:
        kv = KeyValue(event.key, event.value, 0, event.mod_revision, 0)
        if event.kind == "put" and self.learn_function(kv) is not None:
            return
        # Deleted, or overwritten with no spec of it (invalid, or another function's): gone, as a
        # re-list finds it (it was kept until one, its model with it). A valid put older than the
        # mirror's change to its name, which `learn_function` passed over, is passed over here too.
        name = event.key.removeprefix(self.keys.functions)
        if event.mod_revision <= self.revisions.get(name, 0):
            return  # older than what the mirror holds (a re-list's replay, a read-through ahead)
        self.revisions[name] = event.mod_revision
        gone = self.functions.pop(name, None)
        if gone is not None:
            log.info("function %s deleted: evicting its model %s", gone.name, gone.model)
            self.apply(self._retire(gone.model))

    def _retire(self, model: str) -> list[Effect]:
        """No function runs `model` any more: the book retires it, `retired` is told, and its
        persisted profiles go."""
        self.retired(model)
        self.links.persister.model_retired(model)
        return self.book.retire(model)

    def learn_function(self, kv: KeyValue, *, relisting: bool = False) -> FunctionSpec | None:
        """Take in a function's spec as stored (None: invalid, ignored; or deleted since): its model
        is registered, an old model it replaced retired, and a new package pre-staged. A new model
        of a package pre-staged already has the nodes' holdings read again for it. A spec older
        than the last change taken in for its name is not taken: the mirror's is answered.
        (`relisting`: the caller retires the old models and reads the holdings again, once for
        the whole list.)"""
        try:
            spec = FunctionSpec.stored_at(kv.key, kv.value, self.keys.function)
        except GpufaasError as exc:
            log.warning("ignoring invalid function spec at %s: %s", kv.key, exc)
            return None
        if kv.mod_revision < self.revisions.get(spec.name, 0):
            return self.functions.get(spec.name)
        self.revisions[spec.name] = kv.mod_revision
        old = self.functions.get(spec.name)
        self.functions[spec.name] = spec
        if old is None or (old.model, old.memory_mb) != (spec.model, spec.memory_mb):
            # A size past every GPU: the calls of the model queued already are answered as new ones are.
            model = ModelSpec(spec.model, spec.memory_mb, spec.required_gpu_type)
            self.apply(self.book.register_model(model, self.links.clock()))
        # (Else the model keeps its size, which its workers' measured peak may have replaced: a put
        # that changed neither, such as new labels or a redeploy of the same, does not undo that.)
        self.book.revive(spec.model)
        if old is not None and old.model != spec.model and not relisting:  # (a re-list retires them after)
            log.info("function %s updated: evicting its old model %s", spec.name, old.model)
            self.apply(self._retire(old.model))
        if not self.links.is_prestaged(spec.package_digest):  # a new package (a re-list finds old ones)
            self.links.learn_holdings()  # nodes may hold its package already (another function's)
            self.links.prestage([spec])
        elif not relisting and (old is None or old.model != spec.model):
            # A package pre-staged already under a new model (other worker settings, or another
            # function of the same package): the nodes' disks and pools hold it under the old
            # model's name; their holdings are read again, as by the reconciler.
            self.links.learn_holdings()
        return spec

    async def read_through(self, name: str) -> FunctionSpec | None:
        """A function the mirror lacks, read from etcd (a deploy that just happened may not have
        reached the watch yet); None if it is not deployed or etcd cannot say now."""
        with contextlib.suppress(ValueError, StoreError):
            kv = await self.store.get(self.keys.function(name))
            if kv is not None:
                return self.learn_function(kv)
        return None

    async def read_profiles(self, epoch: int | None = None) -> None:
        """Take the profiles persisted in etcd into the estimator, as they are (StoreError: etcd
        cannot say now). Read at start, and again on taking office (`epoch`): a standby's own are
        those of its start, and the leader measured for hours since (its first writes would put
        them back over the leader's). But not for a term this scheduler led already, resumed after
        etcd failed to answer: what it measured meanwhile is newer than what it could persist. Not
        watched: only the leader writes them, and a standby plans nothing."""
        if epoch is not None and epoch == self._profiles_epoch:
            return
        for kv in await self.store.get_prefix(self.keys.profiles):
            self._apply_profile(kv)
        if epoch is not None:
            self._profiles_epoch = epoch

    def _apply_profile(self, kv: KeyValue) -> None:
        """One persisted profile into the estimator; one of another shape, or with a figure no
        measurement gives (a batch size below 1; a time negative, NaN or infinite), is passed over
        whole with a warning: a batch size of 0 divided every size-based estimate of its GPU type
        by zero, and the rest made estimates negative or NaN."""
        try:
            gpu_type, model = kv.key.removeprefix(self.keys.profiles).split("/", 1)
            raw = json.loads(kv.value)
            load_time_s = raw.get("load_time_s")
            load_time_s = None if load_time_s is None else _seconds(load_time_s)
            swap_in_time_s = raw.get("swap_in_time_s")  # (absent from those of older versions)
            swap_in_time_s = None if swap_in_time_s is None else _seconds(swap_in_time_s)
            inference_time_s = {
                _batch_size(batch): _seconds(seconds) for batch, seconds in raw.get("inference_time_s", {}).items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring invalid profile at %s: %r", kv.key, exc)
            return
        self.scheduler.estimator.restore(model, gpu_type, load_time_s, inference_time_s, swap_in_time_s)

    # --- nodes ------------------------------------------------------------------------------
    def nodes_listed(self, kvs: list[KeyValue], revision: int) -> None:
        """The nodes registered now: new and changed ones are (re)attached, gone ones taken out."""
        listed = set()
        for kv in kvs:
            self.node_changed(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
            listed.add(kv.key.removeprefix(self.keys.nodes))
        for name in set(self.links.nodes) - listed:
            log.info("node %s is no longer registered", name)
            self.links.gone(name)

    def node_changed(self, event: WatchEvent) -> None:
        name = event.key.removeprefix(self.keys.nodes)
        if event.kind == "delete":
            log.info("node %s left the cluster (lease expired or removed)", name)
            self.links.gone(name)
            return
        try:
            record = NodeRecord.from_json(event.value)
            # Linked by its own name, its key's delete would never take it out; and a name no key
            # segment holds (a '/') split its GPUs' addresses at the wrong place (`keys.node` raises).
            if event.key != self.keys.node(record.node):
                raise ValueError(f"it names node {record.node!r}")
            # A name JSON's "\ud800" gave (a lone surrogate) is no UTF-8: its GPU's keys and Grants
            # could not be encoded (UnicodeEncodeError, a ValueError, ended the persister's flusher).
            json.dumps(dataclasses.asdict(record), ensure_ascii=False).encode()
        except (ValueError, KeyError) as exc:
            log.warning("ignoring invalid node record for %s: %s", name, exc)
            return
        self.links.seen(record)


def _seconds(value: str | float) -> float:
    """A persisted time: a finite, non-negative number of seconds (ValueError, TypeError otherwise)."""
    seconds = float(value)
    if not 0.0 <= seconds < math.inf:
        raise ValueError(f"not a time in seconds: {value!r}")
    return seconds


def _batch_size(value: str) -> int:
    """A persisted batch size: a whole number of samples, at least 1 (ValueError otherwise)."""
    batch = int(value)
    if batch < 1:
        raise ValueError(f"not a batch size: {value!r}")
    return batch
