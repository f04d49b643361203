"""What each node holds below its GPUs, as its reports say: models whose weights are in its host
model pool, and models whose package is staged on its disk. The scheduler prices a miss by the
tier it comes from (`Tier`); the nodes decide what they keep (within their own budgets)."""

from __future__ import annotations

import enum
from collections.abc import Set

_EMPTY: frozenset[str] = frozenset()


class Tier(enum.IntEnum):
    """Where a miss on a node takes a model from, cheapest first."""

    HOST = 0  # a parked worker in the node's host tier: taken back, nothing loaded
    POOL = 1  # its weights in the node's host model pool: mapped (cpu) or copied from pinned memory (cuda)
    DISK = 2  # its package staged on the node's disk: read and loaded
    REMOTE = 3  # nowhere on the node: fetched from a holder first


class NodeHoldings:
    """Per node, the pooled and the staged models (each set replaced whole by a report), with the
    reverse directories model -> nodes. Pure; O(1) lookups."""

    def __init__(self) -> None:
        self._pooled: dict[str, frozenset[str]] = {}
        self._staged: dict[str, frozenset[str]] = {}
        self._pooled_on: dict[str, set[str]] = {}  # model -> nodes
        self._staged_on: dict[str, set[str]] = {}

    def report(self, node: str, *, pooled: Set[str], staged: Set[str]) -> None:
        """What `node` holds now (a pooled model is staged too: its weights came from its disk)."""
        self._replace(node, frozenset(pooled), self._pooled, self._pooled_on)
        self._replace(node, frozenset(staged) | frozenset(pooled), self._staged, self._staged_on)

    def forget(self, node: str) -> None:
        """The node left: nothing of it counts any more."""
        self.report(node, pooled=_EMPTY, staged=_EMPTY)
        self._pooled.pop(node, None)
        self._staged.pop(node, None)

    def reports(self, node: str | None) -> bool:
        """Whether `node` has reported what it holds (a node that never does, as in the simulator,
        is priced as if every package were on its disk)."""
        return node is not None and node in self._staged

    def pooled(self, node: str) -> frozenset[str]:
        return self._pooled.get(node, _EMPTY)

    def staged(self, node: str) -> frozenset[str]:
        return self._staged.get(node, _EMPTY)

    def in_pool(self, model: str, node: str | None) -> bool:
        return node is not None and model in self._pooled.get(node, _EMPTY)

    def on_disk(self, model: str, node: str | None) -> bool:
        return node is not None and model in self._staged.get(node, _EMPTY)

    def nodes_pooling(self, model: str) -> Set[str]:
        return self._pooled_on.get(model, _EMPTY)

    def nodes_staging(self, model: str) -> Set[str]:
        return self._staged_on.get(model, _EMPTY)

    @staticmethod
    def _replace(
        node: str, models: frozenset[str], by_node: dict[str, frozenset[str]], by_model: dict[str, set[str]]
    ) -> None:
        old = by_node.get(node, _EMPTY)
        for model in old - models:
            nodes = by_model.get(model)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del by_model[model]
        for model in models - old:
            by_model.setdefault(model, set()).add(node)
        by_node[node] = models
