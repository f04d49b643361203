"""A policy's draft: one fill's reservations on the committed state (`SchedulingContext`), its
journal, and what is kept of them: the policy's plan."""

from __future__ import annotations

from collections.abc import Sequence

from gpufaas.types import Request
from scheduler.decisions import Decision, Dispatch, Park, PassOver, Step, Visit
from scheduler.placement import PlacementPieces
from scheduler.policies.base import SchedulingPolicy
from scheduler.queues import QueueView
from scheduler.reservations import (
    Unreserve,
    reserve_dispatch,
    reserve_park,
    reserve_pass_over,
    reserve_visit,
)
from scheduler.state import ClusterReads, ClusterState

_PLACEMENTS = (Dispatch, Park)  # the steps of a plan that are decisions (the rest is bookkeeping)


class PolicyError(RuntimeError):
    """A policy's plan cannot be applied (a step it did not reserve is not possible now): a bug in
    the policy. The scheduler is left as it was before that policy's fill."""


class Journal:
    """The undo log of one policy fill: each reservation and how to undo it, undone last-in
    first-out. The policy's plan is what it keeps; `rollback` takes back the rest."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: list[tuple[Step, Unreserve]] = []

    def record(self, step: Step, undo: Unreserve) -> None:
        self._entries.append((step, undo))

    def holds_exactly(self, plan: Sequence[Step]) -> bool:
        """Whether `plan` is every reservation, in order (the usual case: nothing to roll back)."""
        entries = self._entries
        if len(plan) != len(entries):
            return False
        return all(kept is entries[index][0] for index, kept in enumerate(plan))

    def savepoint(self) -> int:
        return len(self._entries)

    def rollback(self, savepoint: int = 0) -> None:
        """Undo every reservation made after `savepoint` (all of them by default)."""
        while len(self._entries) > savepoint:
            _, undo = self._entries.pop()
            undo()


class Draft(ClusterReads, PlacementPieces):
    """The `SchedulingContext` of one fill: reads of the committed state `cluster` as this fill has
    reserved on it, and reservations (`dispatch`, `park`, `pass_over`, `visit`), each applied at
    once (the next read sees it) and journalled. `fill` keeps exactly the plan the policy returns
    and takes back the rest (see `SchedulingPolicy`). Made per fill; spent after it.
    """

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster
        self._journal = Journal()

    def fill(self, policy: SchedulingPolicy, gpu_id: str, now: float) -> list[Decision]:
        """Let `policy` plan for `gpu_id` on this draft; keep its plan, roll back the rest. The
        decisions of the plan, in order; on an exception nothing of the fill is kept."""
        journal = self._journal
        try:
            plan = policy.fill(self, gpu_id, now)
            if not journal.holds_exactly(plan):
                # The plan is not simply what was reserved (the policy tried what-ifs, or built
                # steps itself): take everything back, then apply the plan step by step.
                journal.rollback()
                plan = [self._reapply(policy, step, now) for step in plan]
        except BaseException:
            journal.rollback()
            raise
        return [step for step in plan if isinstance(step, _PLACEMENTS)]

    def _reapply(self, policy: SchedulingPolicy, step: Step, now: float) -> Step:
        """Apply one step of a plan that was not reserved as such; PolicyError if it cannot be."""
        name = type(policy).__name__
        queued = step.request.request_id if isinstance(step, Dispatch | Park) else step.request_id
        if queued not in self.queue:
            raise PolicyError(f"{name}: its plan has {step!r} for a request not queued")
        gpus = self.cluster.gpus
        if isinstance(step, Dispatch):
            if step.gpu_id not in gpus or not gpus[step.gpu_id].idle:
                raise PolicyError(f"{name}: its plan dispatches to {step.gpu_id!r}, not idle")
            if not self.fits(step.request.model, step.gpu_id):
                raise PolicyError(
                    f"{name}: its plan runs {step.request.model!r} on {step.gpu_id!r}, where it does not fit now"
                )
            return self.dispatch(step.request, step.gpu_id, now)
        if isinstance(step, Park):
            state = gpus.get(step.gpu_id)
            if state is None or state.idle or step.request.model not in self.cache.models_on(step.gpu_id):
                raise PolicyError(
                    f"{name}: its plan parks {step.request.model!r} on {step.gpu_id!r}, "
                    "which is idle or does not hold the model"
                )
            return self.park(step.request, step.gpu_id, now)
        if isinstance(step, PassOver):
            return self.pass_over(step.request_id, exempt=step.exempt)
        return self.visit(step.request_id)

    # --- reservations -------------------------------------------------------------------------
    def dispatch(self, request: Request, gpu_id: str, now: float) -> Dispatch:
        """Reserve `reserve_dispatch`: a queued request runs in a free slot of `gpu_id`."""
        decision, undo = reserve_dispatch(self.cluster, request, gpu_id, now)
        self._journal.record(decision, undo)
        return decision

    def park(self, request: Request, gpu_id: str, now: float) -> Park:
        """Reserve `reserve_park`: a queued request waits in busy `gpu_id`'s local queue."""
        decision, undo = reserve_park(self.cluster, request, gpu_id, now)
        self._journal.record(decision, undo)
        return decision

    def pass_over(self, request_id: str, *, exempt: Sequence[str] = ()) -> PassOver:
        """Reserve `reserve_pass_over`: a skip for every request queued ahead of `request_id`."""
        step, undo = reserve_pass_over(self.cluster, request_id, exempt)
        self._journal.record(step, undo)
        return step

    def visit(self, request_id: str) -> Visit:
        """Reserve `reserve_visit`: one visit for one queued request."""
        step, undo = reserve_visit(self.cluster, request_id)
        self._journal.record(step, undo)
        return step

    def savepoint(self) -> int:
        """A mark in this fill's reservations, for `rollback` (a policy's what-if)."""
        return self._journal.savepoint()

    def rollback(self, savepoint: int) -> None:
        """Undo the reservations made since `savepoint` (last first): the draft is as it was then."""
        self._journal.rollback(savepoint)

    # --- reads (the committed state's, as reserved on so far) ---------------------------------
    @property
    def queue(self) -> QueueView:
        return self.cluster.queue

    def running_calls(self, gpu_id: str) -> int:
        return self.cluster.running_calls(gpu_id)

    def models_busy(self, gpu_id: str, now: float) -> set[str]:
        return self.cluster.models_busy(gpu_id, now)

    def inference_time_s(self, model: str, gpu_id: str, batch_size: int) -> float:
        return self.cluster.inference_time_s(model, gpu_id, batch_size)

    def fits(self, model: str, gpu_id: str) -> bool:
        return self.cluster.fits(model, gpu_id)
