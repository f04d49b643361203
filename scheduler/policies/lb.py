"""`lb`: the load-balancing baseline: an idle GPU takes the head of the global queue."""

from __future__ import annotations

from scheduler.decisions import Step
from scheduler.policies.base import SchedulingContext, SchedulingPolicy


class LoadBalancePolicy(SchedulingPolicy, name="lb"):
    """The paper's baseline (and OpenFaaS-like default): locality is ignored; the cache still
    reports hits when the head's model happens to be resident on the GPU it lands on."""

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        head = ctx.queue.head
        if head is not None and head.avoid_gpu != gpu_id and ctx.fits(head.model, gpu_id):
            return [ctx.dispatch(head, gpu_id, now)]
        return []
