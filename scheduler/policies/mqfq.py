"""`mqfq-sticky`: multi-queue fair queuing with locality (Algorithm 1 of the MQFQ-Sticky paper).

One flow per model (each function has a model of its own here), holding that model's queued
requests in arrival order. A flow's virtual time (VT) grows by tau / w each time one of its calls
is dispatched: tau is the model's average execution time (the estimator's, which learns from
every measured call), w its weight (1). Global_VT is the least VT of the backlogged flows (with
queued calls). A flow more than T ahead of Global_VT is throttled: it waits while the
others catch up, so a popular function cannot monopolise the GPUs, yet runs small "mini-batches"
of up to T seconds of work back to back, which keeps its model warm (locality).

An idle GPU decides in this order (`fill`):

1. Calls passed over `max_num_skips` times (25, PolicyConfig's, as lalb-o3's) are placed first,
   oldest first, by LALB's Algorithm 2 (`locality_load_balance`): the starvation bound.
2. Stickiness (the paper binds a function to the GPU it was launched on): the GPU's own flows,
   the models it holds whose worker there is free; an eligible one runs here, longest queue
   first (ties: fewest calls in flight, least VT, name).
3. The eligible flows, longest queue first (same ties), one call each, placed by Algorithm 2: on
   the idle holder whose worker of the model is free soonest (a new replica where that wait is
   longer than a load and one fits without evicting anything), else parked on the busy holder
   that frees up first when the slot and the model's worker there both come before a load here
   (the flow's next call is weighed the same way, so a long backlog spills onto an idle GPU; at
   most MAX_PARKED_FLOWS flows park more than one call per decision), else a miss where it
   evicts nothing, else the coldest victim, else here; until a call lands here. A call that
   would be a miss here gives way to a throttled own flow of this GPU (a hit), and is passed
   over (it counts a skip, as does every call ahead of the hit).
4. Work conservation: when no eligible flow took the GPU (their calls parked or went to other
   GPUs), a throttled own flow runs here, else the throttled flows are placed as in 3.

Cost per decision: O(models cached here + flows looked at), not O(backlogged flows): the queue
keeps its models bucketed by queued count, and Global_VT is the top of a heap of the flows' VTs
(stale entries dropped when they reach the top).

Anticipatory keep-alive: a flow that empties keeps its VT for TTL = alpha x its mean inter-arrival
time; a flow that comes back within TTL resumes where it was, one that comes back later restarts
at Global_VT (fair queuing's rule: no credit hoarded while idle).

Deviations from the paper, on purpose (figures: bench/policy_compare.py, working set 35 of the
shipped trace, 12 GPUs, four mappings, noise 0.2; and bench/policy_robustness.py on other windows):

- The paper's line 22 reads "VT - Global_VT < T -> throttled", which inverts its own text
  ("throttled if its VT exceeds the global VT by T"); the text is implemented.
- Global_VT ranges over backlogged flows (as in MQFQ), not over every flow (line 2): a running
  or empty flow holding Global_VT down would leave GPUs idle with calls queued until the next
  event, since the scheduler runs at arrivals and completions only.
- Stickiness outranks throttling against a load (step 3): a GPU holding a throttled flow's model
  runs that flow rather than load an eligible flow's model. To the letter, throttling the top
  function (65% of the calls) made the GPUs that held its model load the other flows' models,
  evicting it, while its queue grew: at 450 rpm on 6 GB GPUs 16.84 +- 13.89 s on average
  against lalb-o3's 3.91 s (4.3x; with T = 100 s 22.1 s, so no T fixes it), now 4.04 +- 1.33 s
  (p99 12.95 against 11.20 s); at the paper's point (325 rpm, 8 GB) 1.86 -> 1.76 s (lalb-o3
  1.81). The skip limit (step 1, lalb-o3's) bounds the deviation, so that a flow that no GPU
  holds is not starved by the hits of throttled flows: without it 3.47 s on average at 450 rpm,
  but a call waited 64 s; with it the longest wait is 19 s (lalb-o3's 14 s, the letter's 85 s).
- Work conservation (step 4), MQFQ's own rule: the letter left a GPU idle when the eligible
  flows' calls were parked on their busy holders and only throttled flows were left.
- Placement is Algorithm 2's, worker-aware, instead of "an idle holder, else here": with D > 1 an
  idle holder may be running the model already, and its worker serves calls one at a time, so
  the flow's calls piled up behind it: with D = 4 overlapped 3.18 s against lalb-o3's 1.65 at
  the paper's point and 4.53 against 1.95 s loaded, now 1.65 and 1.95 s (the same figures: with
  48 slots a call rarely waits behind another, and a lone call is placed by Algorithm 2 in both).

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
from scheduler.decisions import Dispatch, Park, Step
from scheduler.policies.base import (
    DEFAULT_MAX_NUM_SKIPS,
    PolicyConfig,
    SchedulingContext,
    SchedulingPolicy,
    checked_max_num_skips,
)
from scheduler.policies.lalb import Placement, hits_here, locality_load_balance
from scheduler.queues import QueueView

DEFAULT_OVERRUN_S = 10.0  # T: seconds of service a flow may run ahead of Global_VT
DEFAULT_TTL_ALPHA = 1.5  # the paper's best keep-alive multiple of the inter-arrival time
IAT_ALPHA = 0.2  # EWMA weight of a new inter-arrival time
# Flows of which an idle GPU parks more than one call on their busy holders per decision (the next
# flows get one call each): bounds the cost of a decision.
MAX_PARKED_FLOWS = 8


@dataclass(slots=True)
class Flow:
    """One model's flow: its virtual time and what the keep-alive needs."""

    model: str
    vt_s: float = 0.0
    in_flight: int = 0
    queued: int = 0  # calls submitted and neither dispatched nor withdrawn yet (`on_cancel`)
    last_arrival_s: float | None = None
    mean_iat_s: float | None = None  # EWMA of inter-arrival times
    last_active_s: float = -math.inf  # when it last had work (queued or running)
    heap_vt_s: float | None = None  # the VT of its newest entry in the policy's VT heap, if any

    def ttl_s(self, alpha: float) -> float:
        return 0.0 if self.mean_iat_s is None else alpha * self.mean_iat_s


class MqfqStickyPolicy(SchedulingPolicy, name="mqfq-sticky"):
    """See the module docstring. `overrun_s` is T, `ttl_alpha` is alpha; weights are 1.
    `max_num_skips` bounds how often a call may be passed over (PolicyConfig's, lalb-o3's 25)."""

    def __init__(
        self,
        overrun_s: float = DEFAULT_OVERRUN_S,
        ttl_alpha: float = DEFAULT_TTL_ALPHA,
        *,
        swap_out: bool = False,
        max_num_skips: int = DEFAULT_MAX_NUM_SKIPS,
    ) -> None:
        if not overrun_s >= 0 or not ttl_alpha >= 0:
            raise ValueError(f"overrun_s and ttl_alpha must be >= 0, got {overrun_s}, {ttl_alpha}")
        self.overrun_s = overrun_s
        self.max_num_skips = checked_max_num_skips(max_num_skips)
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
        return cls(
            config.mqfq_overrun_s,
            config.mqfq_ttl_alpha,
            swap_out=config.mqfq_swap_out,
            max_num_skips=config.max_num_skips,
        )

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
        elif not flow.in_flight and flow.queued <= 0 and now - flow.last_active_s >= flow.ttl_s(self.ttl_alpha):
            # Empty, and back once its TTL has run out (the paper's `now - last_exec >= TTL`, as
            # `idle_models` reads it): no credit hoarded while idle. With a TTL of 0 (alpha 0, or
            # one call so far) an empty flow is inactive at once, even for a call at that instant.
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

    def on_cancel(self, request: Request) -> None:
        # Counted out as a dispatch would: else its flow stays backlogged for good (never back at
        # Global_VT after its TTL, its model never swapped out).
        flow = self._flows.get(request.model)
        if flow is None:
            return
        flow.queued = max(0, flow.queued - 1)
        if self.releases_memory and not flow.in_flight and flow.queued <= 0:
            heapq.heappush(self._expiries, (flow.last_active_s + flow.ttl_s(self.ttl_alpha), flow.model))

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
        plan: list[Step] = []
        # The starvation bound: calls passed over max_num_skips times are placed first, oldest
        # first (skips never grow from head to tail, so they are the head of the queue).
        if queue.head_skips() >= self.max_num_skips:
            for request, skips in queue.walk():
                if skips < self.max_num_skips:
                    break
                placement, step = locality_load_balance(ctx, gpu_id, request, now)
                if step is not None:
                    plan.append(step)
                if placement is Placement.HERE:
                    return plan
            else:
                return plan
        # Stickiness: this GPU's own flows (models it holds whose worker here is free), eligible
        # ones first, longest queue first: O(models cached here).
        own = self._own_call(ctx, gpu_id, now, limit_s)
        if own is not None and not own[1]:
            plan.append(ctx.dispatch(own[0], gpu_id, now))
            return plan
        throttled_own = None if own is None else own[0]
        if self._place_flows(ctx, gpu_id, now, plan, limit_s, throttled=False, instead=throttled_own):
            return plan
        # Work conservation: no eligible flow took this GPU; a throttled one may, its own first.
        if throttled_own is not None and throttled_own.request_id in queue:
            plan.append(ctx.dispatch(throttled_own, gpu_id, now))
            return plan
        self._place_flows(ctx, gpu_id, now, plan, limit_s, throttled=True, instead=None)
        return plan

    def _own_call(self, ctx: SchedulingContext, gpu_id: str, now: float, limit_s: float) -> tuple[Request, bool] | None:
        """The oldest call of this GPU's best own flow, and whether that flow is throttled."""
        queue, flows = ctx.queue, self._flows
        best: tuple[bool, int, int, float, str] | None = None
        for model in hits_here(ctx, gpu_id, now):
            count = queue.count_for(model)
            flow = flows.get(model)
            if count and flow is not None:
                key = (flow.vt_s > limit_s, -count, flow.in_flight, flow.vt_s, model)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        request = queue.oldest_for(best[4])
        if request is None or request.avoid_gpu == gpu_id:
            return None
        return request, best[0]

    def _place_flows(
        self,
        ctx: SchedulingContext,
        gpu_id: str,
        now: float,
        plan: list[Step],
        limit_s: float,
        *,
        throttled: bool,
        instead: Request | None,
    ) -> bool:
        """Place calls of the eligible (or, `throttled`, the throttled) flows, longest queue first
        (ties: fewest calls in flight, least VT), one call per flow by Algorithm 2, appending the
        steps to `plan`, until one lands on `gpu_id`; returns whether one did. A flow whose call
        is parked on a busy holder parks its next call the same way (up to MAX_PARKED_FLOWS
        flows). A call that would be a miss here gives way to `instead` (a throttled own hit),
        which passes it over."""
        queue, flows = ctx.queue, self._flows
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
                if (flow.vt_s > limit_s) == throttled:
                    group.append((flow.in_flight, flow.vt_s, model))
            group.sort()
            for _, _, model in group:
                seen.add(model)
                request = queue.oldest_for(model)
                parked = False
                while request is not None:
                    mark = ctx.savepoint()
                    placement, step = locality_load_balance(ctx, gpu_id, request, now)
                    if instead is not None and isinstance(step, Dispatch) and step.gpu_id == gpu_id and not step.hit:
                        ctx.rollback(mark)
                        plan.append(ctx.pass_over(instead.request_id))
                        plan.append(ctx.dispatch(instead, gpu_id, now))
                        return True
                    if step is not None:
                        plan.append(step)
                    if placement is Placement.HERE:
                        return True
                    if isinstance(step, Park) and parked_flows < MAX_PARKED_FLOWS:
                        parked = True
                        request = queue.oldest_for(model)
                        continue
                    break
                parked_flows += parked
        return False

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
