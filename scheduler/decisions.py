"""Scheduling decisions as data: what the service executes and the simulator replays."""

from __future__ import annotations

from dataclasses import dataclass

from gpufaas.types import Request


# Not frozen: one is made per call, and a frozen one costs 3x to make (never changed once made).
@dataclass(slots=True)
class Dispatch:
    """Run `request` on `gpu_id` now. On a miss, first evict `evict` (least recently used first)
    and load the model (`from_host`: take it back from the node's host tier, a swap-in;
    `from_pool`: map its weights from the node's host model pool, a swap-in too); `false_miss`
    marks a miss although another GPU held the model."""

    request: Request
    gpu_id: str
    hit: bool
    evict: tuple[str, ...] = ()
    false_miss: bool = False
    est_load_time_s: float = 0.0  # a swap-in's time when `from_host` or `from_pool`
    est_inference_time_s: float = 0.0
    from_host: bool = False
    from_pool: bool = False


@dataclass(frozen=True, slots=True)
class Park:
    """Queue `request` on busy `gpu_id`, which holds its model and should free up within
    `est_wait_s`: sooner than loading the model on an idle GPU would take."""

    request: Request
    gpu_id: str
    est_wait_s: float


Decision = Dispatch | Park


@dataclass(frozen=True, slots=True)
class Release:
    """An idle model frees what it holds (EDAS's staged exit). Stage "gpu": it leaves `gpu_id`
    (its weights go to the node's host tier when `to_host`, else its worker goes); stage "host":
    it leaves the host tier of `node` (its worker goes)."""

    stage: str  # "gpu" or "host"
    model: str
    node: str | None
    gpu_id: str | None = None
    to_host: bool = False


# --- what else a policy's plan may hold (the scheduler's own bookkeeping; not sent anywhere) -----


@dataclass(frozen=True, slots=True)
class PassOver:
    """Count one skip for every request queued ahead of `request_id` (it is dispatched ahead of
    them), except `exempt` ones (requests it could not have been dispatched to instead)."""

    request_id: str
    exempt: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Visit:
    """Count one visit (a skip) for one queued request: Algorithm 1 read literally."""

    request_id: str


Step = Dispatch | Park | PassOver | Visit
"""One step of a policy's plan for an idle GPU (`SchedulingPolicy.fill`)."""
