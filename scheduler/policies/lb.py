"""`lb`: the load-balancing baseline: an idle GPU takes the head of the global queue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufaas.types import Request
from scheduler.decisions import Step
from scheduler.policies.base import SchedulingContext, SchedulingPolicy

if TYPE_CHECKING:
    from scheduler.state import ClusterState


class LoadBalancePolicy(SchedulingPolicy, name="lb"):
    """The paper's baseline (and OpenFaaS-like default): locality is ignored; the cache still
    reports hits when the head's model happens to be resident on the GPU it lands on."""

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        head = ctx.queue.head
        if head is not None and head.avoid_gpu != gpu_id and ctx.fits(head.model, gpu_id):
            return [ctx.dispatch(head, gpu_id, now)]
        return []

    def lone_target(self, cluster: ClusterState, request: Request, gpu_id: str, now: float) -> str | None:
        """`fill`'s dispatch of the lone queued request (the head) to `gpu_id`, or None where the
        fill places nothing there (see `SchedulingPolicy.lone_target`); a subclass fills otherwise."""
        if type(self) is LoadBalancePolicy and request.avoid_gpu != gpu_id and cluster.fits(request.model, gpu_id):
            return gpu_id
        return None
