"""The global queue in arrival order, its per-model index, and O(1) lazy skip counts."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from gpufaas.types import Request


class _Node:
    """A queued request. Lifecycle: created by `push`/`insert`, unlinked by `remove`."""

    __slots__ = ("request", "seq", "prev", "next", "own_skips", "pending")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        self.seq = seq
        self.prev: _Node | None = None
        self.next: _Node | None = None
        # skips(node) = own_skips + sum(pending of this node and every node behind it).
        self.own_skips = 0
        # "+pending to every node from the head up to and including this one" (a lazy range add).
        self.pending = 0


@dataclass(slots=True)  # not frozen: one per reserved dispatch, and frozen ones cost 3x to make
class Taken:
    """A request taken out of the queue by `take`, with what `untake` needs to put it back
    exactly (same place, same skip count, same marks): its node and its neighbours then."""

    node: _Node
    prev: _Node | None
    next: _Node | None


class QueueView(Protocol):
    """What a scheduling policy may read of the global queue (it changes it through its draft)."""

    @property
    def head(self) -> Request | None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __contains__(self, request_id: object) -> bool: ...
    def walk(self) -> Iterator[tuple[Request, int]]: ...
    def oldest_of(self, models: Iterable[str]) -> Request | None: ...
    def oldest_for(self, model: str) -> Request | None: ...
    def count_for(self, model: str) -> int: ...
    def models(self) -> Iterable[str]: ...
    def models_by_count(self) -> Iterator[tuple[int, list[str]]]: ...
    def models_by_oldest(self) -> Iterator[str]: ...
    def head_skips(self) -> int: ...
    def num_skips(self, request_id: str) -> int: ...


class GlobalQueue:
    """Queued requests in arrival order, also linked per model in arrival order.

    Passing over requests (out-of-order dispatch) adds one skip to *every* request ahead of the
    one dispatched. Doing that eagerly costs O(queue length), so it is recorded lazily as one
    range mark on the dispatched request's predecessor. Because marks only ever cover a prefix,
    skip counts never increase from head to tail: the head's count is the largest, and reading it
    costs O(1). Every operation the scheduler uses per decision is O(1) or O(models asked about).
    """

    def __init__(self) -> None:
        self._head: _Node | None = None
        self._tail: _Node | None = None
        self._nodes: dict[str, _Node] = {}
        self._by_model: dict[str, OrderedDict[str, _Node]] = {}
        # Models by how many requests they have queued, and those counts in ascending order:
        # policies that serve the longest queue first read it without sorting every model.
        self._models_with_count: dict[int, dict[str, None]] = {}
        self._counts: list[int] = []
        self._total_pending = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __bool__(self) -> bool:
        return self._head is not None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._nodes

    def __iter__(self) -> Iterator[Request]:
        node = self._head
        while node is not None:
            yield node.request
            node = node.next

    @property
    def head(self) -> Request | None:
        return None if self._head is None else self._head.request

    # --- mutations ------------------------------------------------------------------------
    def push(self, request: Request, seq: int) -> None:
        """Append a newly arrived request; `seq` must exceed every queued request's."""
        if self._tail is not None and seq <= self._tail.seq:
            raise ValueError(f"seq {seq} is not after the queue's tail ({self._tail.seq}); use insert()")
        self._link_after(self._tail, self._new_node(request, seq))
        self._index_append(self._nodes[request.request_id])

    def insert(self, request: Request, seq: int) -> None:
        """Put back a request in arrival order (a requeue after a failure).

        It takes the skip count of the request now behind it, so counts stay monotone (the head
        has the most) and its starvation clock is at least as far along as younger requests'.
        O(position from the head): requeues are rare and go near the front.
        """
        behind, suffix_pending = self._head, self._total_pending
        while behind is not None and behind.seq < seq:
            suffix_pending -= behind.pending
            behind = behind.next
        if behind is not None and behind.seq == seq:
            raise ValueError(f"seq {seq} is already queued")
        node = self._new_node(request, seq)
        # The marks at or behind the insertion point count for the new node as for `behind`.
        node.own_skips = 0 if behind is None else behind.own_skips
        self._link_after(self._tail if behind is None else behind.prev, node)
        self._index_insert(node)

    def remove(self, request_id: str) -> Request:
        node = self._nodes.pop(request_id)
        if node.prev is not None:
            # The range mark still covers the nodes ahead of this one.
            node.prev.pending += node.pending
            node.prev.next = node.next
        else:
            self._total_pending -= node.pending
            self._head = node.next
        if node.next is not None:
            node.next.prev = node.prev
        else:
            self._tail = node.prev
        index = self._by_model[node.request.model]
        del index[request_id]
        self._recount(node.request.model, len(index) + 1, len(index))
        if not index:
            del self._by_model[node.request.model]
        return node.request

    def take(self, request_id: str) -> Taken:
        """`remove`, keeping what `untake` needs to undo it."""
        node = self._nodes[request_id]
        taken = Taken(node, node.prev, node.next)
        self.remove(request_id)
        return taken

    def untake(self, taken: Taken) -> None:
        """Undo a `take`: exact when undone last-in first-out (the neighbours are adjacent again)."""
        node, prev, following = taken.node, taken.prev, taken.next
        if (prev.next if prev is not None else self._head) is not following:
            raise RuntimeError(f"cannot put back {node.request.request_id!r}: the queue changed around it")
        node.prev, node.next = prev, following
        if prev is not None:
            prev.next = node
            prev.pending -= node.pending  # remove() moved this node's mark onto its predecessor
        else:
            self._head = node
            self._total_pending += node.pending
        if following is not None:
            following.prev = node
        else:
            self._tail = node
        self._nodes[node.request.request_id] = node
        self._index_insert(node)

    def pass_over(self, request_id: str, *, exempt: Iterable[str] = ()) -> None:
        """Count one skip for every request queued ahead of `request_id`, except `exempt` ones
        (requests the dispatch could not have gone to: O(len(exempt)))."""
        node = self._nodes[request_id]
        if node.prev is not None:
            node.prev.pending += 1
            self._total_pending += 1
        for other in exempt:
            self._nodes[other].own_skips -= 1

    def unpass(self, request_id: str, *, exempt: Iterable[str] = ()) -> None:
        """Undo a `pass_over` with the same arguments (last-in first-out)."""
        node = self._nodes[request_id]
        if node.prev is not None:
            node.prev.pending -= 1
            self._total_pending -= 1
        for other in exempt:
            self._nodes[other].own_skips += 1

    def visit(self, request_id: str) -> None:
        """Count one visit (a skip) for one request: O(1). For Algorithm 1 read literally, which
        counts every request a scan passes; it visits a prefix of the queue (less the requests
        already over the limit, which are older and have more), so counts stay monotone."""
        self._nodes[request_id].own_skips += 1

    def unvisit(self, request_id: str) -> None:
        """Undo a `visit`."""
        self._nodes[request_id].own_skips -= 1

    # --- lookups --------------------------------------------------------------------------
    def oldest_of(self, models: Iterable[str]) -> Request | None:
        """The oldest queued request whose model is in `models`: O(len(models))."""
        best: _Node | None = None
        for model in models:
            index = self._by_model.get(model)
            if index:
                node = next(iter(index.values()))
                if best is None or node.seq < best.seq:
                    best = node
        return None if best is None else best.request

    def oldest_for(self, model: str) -> Request | None:
        index = self._by_model.get(model)
        return None if not index else next(iter(index.values())).request

    def ids_for(self, model: str) -> list[str]:
        """The ids of `model`'s queued requests in arrival order (a copy): O(their number)."""
        index = self._by_model.get(model)
        return [] if index is None else list(index)

    def count_for(self, model: str) -> int:
        """Queued requests of `model`: O(1)."""
        index = self._by_model.get(model)
        return 0 if index is None else len(index)

    def models(self) -> Iterable[str]:
        """The models with queued requests (a live view: do not change the queue while iterating)."""
        return self._by_model.keys()

    def models_by_count(self) -> Iterator[tuple[int, list[str]]]:
        """(count, the models with that many requests queued), largest count first. Each step is
        a snapshot: the consumer may change the queue between steps, and a model whose count
        dropped may then come again under its new count. O(1) per step plus the models yielded."""
        buckets = self._models_with_count
        for count in reversed(self._counts.copy()):
            models = buckets.get(count)
            if models:
                yield count, list(models)

    def models_by_oldest(self) -> Iterator[str]:
        """Each model with queued requests once, in the arrival order of its oldest queued
        request (the order a walk from the head meets them). Lazy, O(requests walked); the
        consumer may remove requests between steps (a removed node still leads to its old
        successor, and no node is added between them), not add any."""
        seen: set[str] = set()
        nodes = self._nodes
        node = self._head
        while node is not None:
            request = node.request
            if request.model not in seen and nodes.get(request.request_id) is node:
                seen.add(request.model)
                yield request.model
            node = node.next

    def walk(self) -> Iterator[tuple[Request, int]]:
        """(request, skips) from the head in arrival order; the consumer may remove the yielded request
        (and only that one) before asking for the next."""
        node, suffix_pending = self._head, self._total_pending
        while node is not None:
            following, pending_here = node.next, node.pending
            yield node.request, node.own_skips + suffix_pending
            # Removing the node moves its mark onto its predecessor: either way the mark no longer
            # counts for `following`.
            suffix_pending -= pending_here
            node = following

    def head_skips(self) -> int:
        return 0 if self._head is None else self._head.own_skips + self._total_pending

    def num_skips(self, request_id: str) -> int:
        """Exact skips of one queued request; O(queue length), for tests and introspection."""
        node = self._nodes[request_id]
        total = node.own_skips
        cursor: _Node | None = node
        while cursor is not None:
            total += cursor.pending
            cursor = cursor.next
        return total

    # --- internals ------------------------------------------------------------------------
    def _new_node(self, request: Request, seq: int) -> _Node:
        if request.request_id in self._nodes:
            raise ValueError(f"request {request.request_id!r} is already queued")
        node = _Node(request, seq)
        self._nodes[request.request_id] = node
        return node

    def _link_after(self, prev: _Node | None, node: _Node) -> None:
        node.prev = prev
        node.next = self._head if prev is None else prev.next
        if prev is None:
            self._head = node
        else:
            prev.next = node
        if node.next is None:
            self._tail = node
        else:
            node.next.prev = node

    def _index_append(self, node: _Node) -> None:
        model = node.request.model
        index = self._by_model.get(model)
        if index is None:  # (not setdefault: that makes an OrderedDict per call)
            index = self._by_model[model] = OrderedDict()
        index[node.request.request_id] = node
        self._recount(model, len(index) - 1, len(index))

    def _index_insert(self, node: _Node) -> None:
        """Put `node` in its model's index in arrival order: O(1) as its youngest or its oldest,
        else O(the model's requests older than it). A requeue goes near the front, and a node's
        calls requeued together (a node left, a scheduler stepped down) are each O(those ahead),
        where sorting the index each time was O(n log n): seconds for a long queue of one model."""
        index = self._by_model.get(node.request.model)
        youngest = None if index is None else next(reversed(index.values()), None)
        self._index_append(node)
        if youngest is None or youngest.seq < node.seq:
            return  # the youngest: where it was put
        index = self._by_model[node.request.model]
        older: list[str] = []
        for other in index.values():  # (the oldest: none, at once)
            if other.seq > node.seq:
                break
            older.append(other.request.request_id)
        # Ahead of the younger ones, behind `older`.
        index.move_to_end(node.request.request_id, last=False)
        for other_id in reversed(older):
            index.move_to_end(other_id, last=False)

    def _recount(self, model: str, old: int, new: int) -> None:
        """Move `model` from the bucket of `old` queued requests to that of `new` (0: none)."""
        buckets, counts = self._models_with_count, self._counts
        if old:
            bucket = buckets[old]
            del bucket[model]
            if not bucket:
                del buckets[old]
                del counts[bisect.bisect_left(counts, old)]
        if new:
            if new not in buckets:
                buckets[new] = {}
                bisect.insort(counts, new)
            buckets[new][model] = None
