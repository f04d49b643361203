"""Pre-staging: which nodes should have a function's package on disk (and its weights in their
host pools) before its first call, chosen where its misses are expected to land. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass

from gpufaas.types import ModelSpec


@dataclass(frozen=True, slots=True)
class GpuRoom:
    """A GPU as the planner sees it: its size and type, and what its cache has free now."""

    memory_mb: int
    gpu_type: str
    free_mb: int


def staging_targets(
    model: ModelSpec, nodes: Mapping[str, Iterable[GpuRoom]], staged_on: Set[str], *, copies: int
) -> list[str]:
    """The nodes (at most `copies`) that should hold `model`'s package, nodes that hold it
    already first (their copy counts), then those whose fitting GPU has the most free memory
    (where LALB's room-aware miss goes first), then by name; of them, those that lack it.
    A node with no GPU the model fits is never chosen."""
    if copies <= 0:
        return []
    ranked = []
    for node, gpus in nodes.items():
        fitting = [g.free_mb for g in gpus if fits(model, g)]
        if fitting:
            ranked.append((node not in staged_on, -max(fitting), node))
    ranked.sort()
    return [node for _, _, node in ranked[:copies] if node not in staged_on]


def fits(model: ModelSpec, gpu: GpuRoom) -> bool:
    """Whether `model` may run on `gpu` (its size and required type)."""
    return model.memory_mb <= gpu.memory_mb and model.gpu_type in (None, gpu.gpu_type)
