"""Scheduling decisions as data: what the service executes and the simulator replays."""

from __future__ import annotations

from dataclasses import dataclass

from gpufaas.types import Request


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Run `request` on `gpu_id` now. On a miss, first evict `evict` (least recently used first)
    and load the model; `false_miss` marks a miss although another GPU held the model."""

    request: Request
    gpu_id: str
    hit: bool
    evict: tuple[str, ...] = ()
    false_miss: bool = False
    est_load_time_s: float = 0.0
    est_inference_time_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Park:
    """Queue `request` on busy `gpu_id`, which holds its model and should free up within
    `est_wait_s`: sooner than loading the model on an idle GPU would take."""

    request: Request
    gpu_id: str
    est_wait_s: float


Decision = Dispatch | Park
