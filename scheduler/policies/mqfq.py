"""`mqfq-sticky`: multi-queue fair queuing with locality (Algorithm 1 of the MQFQ-Sticky paper).

One flow per model (each function has a model of its own here), holding that model's queued
requests in arrival order. A flow's virtual time (VT) grows by tau / w each time one of its calls
is dispatched: tau is the model's average execution time (the estimator's, which learns from
every measured call), w its weight (1). Global_VT is the least VT of the backlogged flows (with
queued calls). A flow more than T ahead of Global_VT is throttled: it waits while the
others catch up, so a popular function cannot monopolise the GPUs, yet runs small "mini-batches"
of up to T seconds of work back to back, which keeps its model warm (locality).

Among the flows that may run, an idle GPU takes the longest queue (the most batching and locality
to gain, and the largest backlog), ties to the flow with the fewest calls running (so that flows
progress side by side), then the least VT, then by name. Stickiness (the paper binds a function
to the GPU it was launched on): the GPU takes its own flows (models it holds, whose worker there
is free) first; of the others, a flow held by another idle GPU sends one call there and the next
flow is looked at; a flow held only by busy GPUs parks its calls, oldest first, in the local
queue of the one that frees up first while that would reach them before the model could load
here (at most MAX_PARKED_FLOWS such flows per decision), and the first call that cannot wait so
runs here (a miss), which ends the decision.

Cost per decision: O(models cached here + flows looked at), not O(backlogged flows): the queue
keeps its models bucketed by queued count, and Global_VT is the top of a heap of the flows' VTs
(stale entries dropped when they reach the top).

Anticipatory keep-alive: a flow that empties keeps its VT for TTL = alpha x its mean inter-arrival
time; a flow that comes back within TTL resumes where it was, one that comes back later restarts
at Global_VT (fair queuing's rule: no credit hoarded while idle).

Deviations from the paper, on purpose: the paper's line 22 reads "VT - Global_VT < T -> throttled",
which inverts its own text ("throttled if its VT exceeds the global VT by T"); the text is
implemented. Global_VT ranges over backlogged flows (as in MQFQ), not over every flow (line 2):
a running or empty flow holding Global_VT down would leave GPUs idle with calls queued until the
next event, since the scheduler runs at arrivals and completions only.

Proactive swap-out (section 4.3; `swap_out`, PolicyConfig.mqfq_swap_out, off by default): a flow
whose keep-alive expires (empty for its TTL; a flow with one call so far has a TTL of 0) is named
by `idle_models`, and the scheduler moves its model off every GPU that holds it idle into the
node's host tier (where the node keeps one; without a tier the model stays and LRU evicts it when
room is needed): its GPU memory is free for others, and its next call is a swap-in, not a load.
So alpha decides how much GPU memory a flow holds between bursts. Measured on the Azure trace
(bench/mqfq_keepalive.py) it frees 20-45 GB of 72 at the price of latency, since nothing else
here wants that memory: hence off unless asked for. Not built: swapping out throttled flows (a
throttled flow has calls queued that run once the others catch up; moving its model off would
turn them into swap-ins) and prefetching a flow's model onto a GPU when the flow turns active
(the scheduler places models only with calls; a miss from the host tier is the prefetch).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from gpufaas.types import Request
from scheduler.decisions import Dispatch, Step
from scheduler.policies.base import PolicyConfig, SchedulingContext, SchedulingPolicy
from scheduler.policies.lalb import hits_here
from scheduler.queues import QueueView

DEFAULT_OVERRUN_S = 10.0  # T: seconds of service a flow may run ahead of Global_VT
DEFAULT_TTL_ALPHA = 1.5  # the paper's best keep-alive multiple of the inter-arrival time
IAT_ALPHA = 0.2  # EWMA weight of a new inter-arrival time
# Flows an idle GPU parks on their busy GPUs before it takes the next one anyway (a miss): bounds
# the cost of a decision.
MAX_PARKED_FLOWS = 8


@dataclass(slots=True)
class Flow:
    """One model's flow: its virtual time and what the keep-alive needs."""

    model: str
    vt_s: float = 0.0
    in_flight: int = 0
    queued: int = 0  # calls submitted and not yet dispatched (deadline cancellations are not told)
    last_arrival_s: float | None = None
    mean_iat_s: float | None = None  # EWMA of inter-arrival times
    last_active_s: float = -math.inf  # when it last had work (queued or running)
    heap_vt_s: float | None = None  # the VT of its newest entry in the policy's VT heap, if any

    def ttl_s(self, alpha: float) -> float:
        return 0.0 if self.mean_iat_s is None else alpha * self.mean_iat_s


class MqfqStickyPolicy(SchedulingPolicy, name="mqfq-sticky"):
    """See the module docstring. `overrun_s` is T, `ttl_alpha` is alpha; weights are 1."""

    def __init__(
        self, overrun_s: float = DEFAULT_OVERRUN_S, ttl_alpha: float = DEFAULT_TTL_ALPHA, *, swap_out: bool = False
    ) -> None:
        if not overrun_s >= 0 or not ttl_alpha >= 0:
            raise ValueError(f"overrun_s and ttl_alpha must be >= 0, got {overrun_s}, {ttl_alpha}")
        self.overrun_s = overrun_s
        self.ttl_alpha = ttl_alpha
        self.releases_memory = swap_out  # flows past their keep-alive are swapped out (idle_models)
        self._flows: dict[str, Flow] = {}
        self._global_vt_s = 0.0
        # (VT, model) of flows that may be backlogged; an entry is live while its flow still has
        # that VT and calls queued. Read by `_update_global_vt`, pushed to when a VT changes or
        # a flow may have become backlogged.
        self._vt_heap: list[tuple[float, str]] = []
        # (when its keep-alive ends, model) of flows that emptied; checked, and dropped if the
        # flow got work since, when `idle_models` reaches them.
        self._expiries: list[tuple[float, str]] = []

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls(config.mqfq_overrun_s, config.mqfq_ttl_alpha, swap_out=config.mqfq_swap_out)

    def flow(self, model: str) -> Flow:
        return self._flows[model]

    @property
    def global_vt_s(self) -> float:
        return self._global_vt_s

    # --- what the scheduler tells it --------------------------------------------------------
    def on_submit(self, request: Request) -> None:
        now = request.arrival_s
        flow = self._flows.get(request.model)
        if flow is None:
            flow = self._flows[request.model] = Flow(request.model, vt_s=self._global_vt_s)
        elif not flow.in_flight and flow.queued <= 0 and now - flow.last_active_s > flow.ttl_s(self.ttl_alpha):
            # Empty, and back after its TTL: no credit hoarded while idle.
            flow.vt_s = max(flow.vt_s, self._global_vt_s)
        if flow.last_arrival_s is not None:
            iat_s = max(0.0, now - flow.last_arrival_s)
            flow.mean_iat_s = (
                iat_s if flow.mean_iat_s is None else flow.mean_iat_s + IAT_ALPHA * (iat_s - flow.mean_iat_s)
            )
        flow.last_arrival_s = now
        flow.last_active_s = now
        flow.queued += 1
        self._note_vt(flow)

    def on_requeue(self, request: Request, now: float, *, ran: bool) -> None:
        flow = self._flows.get(request.model)
        if flow is None:
            flow = self._flows[request.model] = Flow(request.model, vt_s=self._global_vt_s)
        if ran:  # counted out by on_dispatch; a parked call never was
            flow.queued += 1
        flow.last_active_s = now
        self._note_vt(flow)

    def on_dispatch(self, decision: Dispatch, now: float) -> None:
        flow = self._flows.get(decision.request.model)
        if flow is None:  # submitted before this policy was in place
            flow = self._flows[decision.request.model] = Flow(decision.request.model, vt_s=self._global_vt_s)
        flow.vt_s += decision.est_inference_time_s  # tau / w, w = 1
        flow.queued = max(0, flow.queued - 1)
        flow.in_flight += 1
        flow.last_active_s = now
        self._note_vt(flow)

    def on_finish(self, request: Request, now: float, *, inference_time_s: float | None) -> None:
        flow = self._flows.get(request.model)
        if flow is None:
            return
        flow.in_flight = max(0, flow.in_flight - 1)
        flow.last_active_s = now
        if self.releases_memory and not flow.in_flight and flow.queued <= 0:
            heapq.heappush(self._expiries, (now + flow.ttl_s(self.ttl_alpha), flow.model))

    def idle_models(self, now: float) -> list[str]:
        expired = []
        while self._expiries and self._expiries[0][0] <= now:
            _, model = heapq.heappop(self._expiries)
            flow = self._flows.get(model)
            if (
                flow is not None
                and not flow.in_flight
                and flow.queued <= 0
                and now - flow.last_active_s >= flow.ttl_s(self.ttl_alpha)
            ):
                expired.append(model)
        return expired

    # --- Algorithm 1 ----------------------------------------------------------------------------
    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        queue = ctx.queue
        self._update_global_vt(queue)
        limit_s = self._global_vt_s + self.overrun_s
        flows = self._flows
        # This GPU's own flows first (stickiness), those whose worker here is free: O(models
        # cached here).
        own = [
            (-queue.count_for(model), flows[model].in_flight, flows[model].vt_s, model)
            for model in hits_here(ctx, gpu_id, now)
            if queue.count_for(model) and model in flows and flows[model].vt_s <= limit_s
        ]
        if own:
            request = queue.oldest_for(min(own)[3])
            if request is not None and request.avoid_gpu != gpu_id:
                return [ctx.dispatch(request, gpu_id, now)]
        # Then the flows that may run, longest queue first, until a call lands here.
        plan: list[Step] = []
        parked_flows = 0
        seen: set[str] = set()
        for _, models in queue.models_by_count():
            group = []
            for model in models:
                if model in seen:  # came again under a lower count after a call of it was placed
                    continue
                flow = flows.get(model)
                if flow is None:  # submitted before this policy was in place
                    flow = flows[model] = Flow(model, vt_s=self._global_vt_s)
                    self._note_vt(flow)
                if flow.vt_s <= limit_s:  # else throttled
                    group.append((flow.in_flight, flow.vt_s, model))
            group.sort()
            for _, _, model in group:
                seen.add(model)
                request = queue.oldest_for(model)
                parked_any = False
                while request is not None:
                    holders = ctx.cache.gpus_with(model)
                    avoid = request.avoid_gpu
                    if holders and parked_flows < MAX_PARKED_FLOWS and ctx.best_idle(holders, exclude=avoid) is None:
                        # Held only by busy GPUs: the call waits, parked, for the one that frees
                        # up first, if that gets to it (after the work parked there) before the
                        # model could load here; the flow's next call is looked at the same way.
                        soonest = ctx.soonest_busy_holder(model, now)
                        if soonest is not None and soonest[0] != avoid and soonest[1] < ctx.load_time_s(model, gpu_id):
                            plan.append(ctx.park(request, soonest[0], now))
                            parked_any = True
                            request = queue.oldest_for(model)
                            continue
                    target = self._sticky_target(ctx, gpu_id, request)
                    if target is not None:
                        plan.append(ctx.dispatch(request, target, now))
                        if target == gpu_id:
                            return plan
                    break  # one call of the flow placed elsewhere (or none): the next flow
                parked_flows += parked_any
        return plan

    def _sticky_target(self, ctx: SchedulingContext, gpu_id: str, request: Request) -> str | None:
        """Where the flow's call runs: an idle GPU that holds the model, else this GPU (a miss),
        else the first idle GPU the model may run on."""
        avoid = request.avoid_gpu
        holders = ctx.cache.gpus_with(request.model)
        if holders:
            idle_holder = ctx.best_idle(holders, exclude=avoid, model=request.model)
            if idle_holder is not None:
                return idle_holder
        if gpu_id != avoid and ctx.fits(request.model, gpu_id):
            return gpu_id
        return ctx.first_idle_fitting(request.model, exclude=avoid)

    # --- internals -------------------------------------------------------------------------------
    def _note_vt(self, flow: Flow) -> None:
        """Give `flow` a heap entry at its current VT unless it has one."""
        if flow.heap_vt_s != flow.vt_s:
            heapq.heappush(self._vt_heap, (flow.vt_s, flow.model))
            flow.heap_vt_s = flow.vt_s

    def _update_global_vt(self, queue: QueueView) -> None:
        """Global_VT: the least VT of the backlogged flows (with queued calls); it never goes
        back. The least backlogged flow is never throttled, so a GPU with a free slot never idles
        while calls wait. Amortized O(log flows): stale entries (an older VT of their flow, or a
        flow with nothing queued, which gets a new entry when a call of it is queued) are
        dropped as they reach the top; the heap is rebuilt when they pile up."""
        flows, heap = self._flows, self._vt_heap
        if len(heap) > 4 * len(flows) + 64:
            for flow in flows.values():
                flow.heap_vt_s = None
            heap.clear()
            for model in queue.models():
                if model in flows:
                    flows[model].heap_vt_s = flows[model].vt_s
                    heap.append((flows[model].vt_s, model))
            heapq.heapify(heap)
        while heap:
            vt_s, model = heap[0]
            flow = flows[model]
            if vt_s == flow.vt_s and queue.count_for(model):
                self._global_vt_s = max(self._global_vt_s, vt_s)
                return
            heapq.heappop(heap)
            if vt_s == flow.heap_vt_s:
                flow.heap_vt_s = None  # its newest entry is gone: the next call queued pushes one
