"""`torpor`: SLO-aware queuing by required request count (Torpor, section 5.2), placing each call
with LALB's locality (Algorithm 2, host-tier aware).

A function with an SLO (`slo_ms` in stack.yml) has served n calls, m of them within the SLO. Its
required request count RRC = (p n - m) / (1 - p), p = 0.98 (the tail Torpor checks), is how many
more calls it must meet in a row to reach p: the smaller, the likelier it meets its SLO. The
functions with calls queued are sorted by RRC; the first k form the high-priority group, k the
largest with sum(max(RRC, 0)) over them <= alpha x the sum over all. High-priority functions go
first, in descending RRC (those still short of p but closest to it before those already there),
then the low-priority ones in ascending RRC. An idle GPU first takes the first function in that
order whose model it holds (a hit: locality before priority, so a low-priority hit here goes ahead
of a high-priority load, which Torpor would place first; docs/policies.md); if none, it takes the functions in
that order and places each one's calls, oldest first, by Algorithm 2 (a hit here, a hit on another idle GPU,
parked on a busy holder that frees up before a load, or a miss where the host tier or room makes
it cheapest) until one lands on it. What is left (functions without an SLO, and SLO calls that
could not be placed) is filled as lalb-o3 fills it (Algorithm 1 with out-of-order dispatch: a hit
here before an older call elsewhere). Walking those function by function in the order of their
oldest call instead, as an earlier version did, skipped Algorithm 1's hit-first scan: with no SLO
given, torpor averaged 7.4x lalb-o3 on the shipped trace at 450 rpm and 6 GB per GPU, where it
now matches it. With SLOs (4x each model's inference time) at that point it went from 2.6-5.0x
lalb-o3 to 1.3-1.6x.

A function without an SLO never starves: a call placed ahead of older ones for its SLO counts a
skip for each of them (as lalb-o3's out-of-order hits do), and once the oldest call has been
passed over `max_num_skips` times (25, PolicyConfig's, lalb-o3's) the calls at the limit are
placed first, in arrival order, as lalb-o3 places them. Without it, with half the functions of
the shipped trace given SLOs at 450 rpm on 6 GB GPUs, a call of a function without one waited up
to 29-33 s for a GPU, against 6-8 s under lalb-o3: SLO calls overtook it without end.

Cost per decision: O(functions with an SLO and calls queued) to order them, then lalb-o3's.

With `alpha_period_s`, alpha is tuned at run time by Torpor's Algorithm 2, a congestion-control
loop: every period (by the completions' clock) the share of functions that met their SLO over
the period (p of their calls in it within the SLO) is compared with the previous period's: up by
more than 0.04, alpha doubles (at most 1); down by more than 0.04, it halves (at least
MIN_ALPHA, so that it can grow again); else it stays. It starts at `torpor_alpha` (0.5). The
paper gives no period. Off by default (alpha fixed): on the shipped trace it did not pay
(docs/policies.md has the figures).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gpufaas.types import Request
from scheduler.decisions import Step
from scheduler.policies.base import (
    DEFAULT_MAX_NUM_SKIPS,
    PolicyConfig,
    SchedulingContext,
    SchedulingPolicy,
    checked_max_num_skips,
)
from scheduler.policies.lalb import OutOfOrderLocalityAwarePolicy, Placement, hits_here, locality_load_balance
from scheduler.queues import QueueView

SLO_TAIL = 0.98  # p: the share of calls a function must answer within its SLO
DEFAULT_ALPHA = 0.5
DEFAULT_ALPHA_PERIOD_S: float | None = None  # alpha fixed: Algorithm 2 did not pay here (docs/policies.md)
ALPHA_SCALAR = 2.0  # Torpor's defaults for Algorithm 2
ALPHA_THRESHOLD = 0.04
MIN_ALPHA = 1.0 / 64


@dataclass(slots=True)
class SloRecord:
    """A function's calls served (n) and served within its SLO (m)."""

    served: int = 0
    met: int = 0

    def rrc(self, tail: float = SLO_TAIL) -> float:
        return (tail * self.served - self.met) / (1.0 - tail)


class TorporPolicy(SchedulingPolicy, name="torpor"):
    """See the module docstring. `alpha` in [0, 1]: the share of the total positive RRC the
    high-priority group may hold (1: every function is high priority)."""

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        *,
        tier_aware_misses: bool = True,
        interference_aware_loads: bool = True,
        alpha_period_s: float | None = DEFAULT_ALPHA_PERIOD_S,
        max_num_skips: int = DEFAULT_MAX_NUM_SKIPS,
        rest: SchedulingPolicy | None = None,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if alpha_period_s is not None and not alpha_period_s > 0:
            raise ValueError(f"alpha_period_s must be > 0 seconds (None: alpha fixed), got {alpha_period_s}")
        self.max_num_skips = checked_max_num_skips(max_num_skips)
        # Tuned alpha moves by factors of ALPHA_SCALAR: from 0 it could never grow.
        self.alpha = alpha if alpha_period_s is None else max(alpha, MIN_ALPHA)
        self.tier_aware_misses = tier_aware_misses
        self.interference_aware_loads = interference_aware_loads
        self.alpha_period_s = alpha_period_s
        self.alpha_changes: list[tuple[float, float]] = []  # (when, the new alpha)
        self._period_start_s: float | None = None
        self._period: dict[str, SloRecord] = {}  # function -> its calls in the current period
        self._last_ratio: float | None = None
        self._records: dict[str, SloRecord] = {}  # function -> its SLO record
        self._slo_models: dict[str, None] = {}  # models of functions with an SLO, as submitted
        # What fills the rest: the cluster's default policy, as configured.
        self._rest = (
            rest
            if rest is not None
            else OutOfOrderLocalityAwarePolicy(
                max_num_skips, tier_aware_misses=tier_aware_misses, interference_aware_loads=interference_aware_loads
            )
        )

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls(
            config.torpor_alpha,
            rest=OutOfOrderLocalityAwarePolicy.from_config(config),
            tier_aware_misses=config.tier_aware_misses,
            interference_aware_loads=config.interference_aware_loads,
            alpha_period_s=config.torpor_alpha_period_s,
            max_num_skips=config.max_num_skips,
        )

    def record(self, function: str) -> SloRecord:
        return self._records.setdefault(function, SloRecord())

    def on_submit(self, request: Request) -> None:
        if request.slo_s is not None:
            self._slo_models[request.model] = None

    def on_requeue(self, request: Request, now: float, *, ran: bool) -> None:
        self.on_submit(request)

    def on_finish(self, request: Request, now: float, *, inference_time_s: float | None) -> None:
        if request.slo_s is None or inference_time_s is None:  # no SLO, or failed (it may run again)
            return
        met = now - request.arrival_s <= request.slo_s
        record = self.record(request.function)
        record.served += 1
        record.met += met
        if self.alpha_period_s is not None:
            self._end_period_if_due(now)
            in_period = self._period.setdefault(request.function, SloRecord())
            in_period.served += 1
            in_period.met += met

    def _end_period_if_due(self, now: float) -> None:
        """Algorithm 2 (PeriodicConfig) once a period has passed: compare its share of
        SLO-compliant functions with the last period's and move alpha."""
        assert self.alpha_period_s is not None
        if self._period_start_s is None:
            self._period_start_s = now
            return
        if now - self._period_start_s < self.alpha_period_s:
            return
        if self._period:
            ratio = sum(r.met >= SLO_TAIL * r.served for r in self._period.values()) / len(self._period)
            if self._last_ratio is not None:
                alpha = self.alpha
                if ratio - self._last_ratio > ALPHA_THRESHOLD:
                    alpha = min(alpha * ALPHA_SCALAR, 1.0)
                elif ratio - self._last_ratio < -ALPHA_THRESHOLD:
                    alpha = max(alpha / ALPHA_SCALAR, MIN_ALPHA)
                if alpha != self.alpha:
                    self.alpha = alpha
                    self.alpha_changes.append((now, alpha))
            self._last_ratio = ratio
        self._period.clear()
        self._period_start_s = now

    def order(self, oldest: list[Request]) -> list[Request]:
        """The oldest queued call of each backlogged function, in the order they are served."""
        with_slo = sorted(
            ((self.record(r.function).rrc(), r) for r in oldest if r.slo_s is not None),
            key=lambda pair: (pair[0], pair[1].arrival_s, pair[1].request_id),
        )
        total = sum(max(rrc, 0.0) for rrc, _ in with_slo)
        budget = self.alpha * total
        high: list[tuple[float, Request]] = []
        taken = 0.0
        for rrc, request in with_slo:
            if taken + max(rrc, 0.0) > budget:
                break
            taken += max(rrc, 0.0)
            high.append((rrc, request))
        low = with_slo[len(high) :]
        high.sort(key=lambda pair: (-pair[0], pair[1].arrival_s, pair[1].request_id))
        without = sorted((r for r in oldest if r.slo_s is None), key=lambda r: (r.arrival_s, r.request_id))
        return [r for _, r in high] + [r for _, r in low] + without

    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        queue = ctx.queue
        if queue.head_skips() >= self.max_num_skips:
            # The starvation bound: calls passed over that often go first, as lalb-o3 places them.
            return self._rest.fill(ctx, gpu_id, now)
        plan: list[Step] = []
        ordered = list(self._first_calls(queue))
        # Locality before priority: the first function in the order whose model is here takes
        # this GPU (a hit), before any function is placed by Algorithm 2 (which may miss here).
        cached_here = hits_here(ctx, gpu_id, now)
        for first in ordered:
            if first.model in cached_here and first.avoid_gpu != gpu_id:
                return [ctx.pass_over(first.request_id), ctx.dispatch(first, gpu_id, now)]
        for first in ordered:
            # The function's calls in arrival order, while they land elsewhere (parked on a busy
            # holder, or a hit on another idle GPU); one that lands here ends the fill, one that
            # cannot be placed now moves on to the next function.
            request: Request | None = first
            while request is not None:
                if queue.head_skips() >= self.max_num_skips:
                    # The bound holds within a fill too: each call placed elsewhere passed the
                    # older ones over once more, so the calls at the limit now go first.
                    return plan + self._rest.fill(ctx, gpu_id, now)
                # Every older call waits once more (kept only with a placement: the plan drops it
                # otherwise, and the scheduler takes back what a plan leaves out).
                skip = ctx.pass_over(request.request_id)
                placement, step = locality_load_balance(
                    ctx,
                    gpu_id,
                    request,
                    now,
                    tier_aware=self.tier_aware_misses,
                    interference_aware=self.interference_aware_loads,
                )
                if step is not None:
                    plan += (skip, step)
                if placement is Placement.HERE:
                    return plan
                if placement is Placement.NOWHERE:
                    break
                request = queue.oldest_for(first.model)
        return plan + self._rest.fill(ctx, gpu_id, now)

    def _first_calls(self, queue: QueueView) -> Iterator[Request]:
        """`order` of the oldest queued call of each backlogged function with an SLO (O(those
        with calls queued))."""
        with_slo = []
        for model in list(self._slo_models):
            call = queue.oldest_for(model)
            if call is None:
                del self._slo_models[model]  # nothing queued: on_submit brings it back
            elif call.slo_s is not None:
                with_slo.append(call)
        yield from self.order(with_slo)
