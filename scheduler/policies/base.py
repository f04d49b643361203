"""The scheduling-policy interface, its registry by name, and the draft a policy plans on.

A policy is offered one idle GPU at a time (`fill`) and returns its plan: the steps it wants, in
order. It plans on a draft of the scheduler's committed state (`scheduler.draft.Draft`, one per
fill): it reads the queue, the cache and the GPUs, and reserves a step (`dispatch`, `park`,
`pass_over`, `visit`) to see the state that step leads to (the GPU it dispatched to is busier,
the model is cached there); Kubernetes' scheduling framework reserves the same way. The scheduler
keeps exactly the plan the policy returns: a reservation the plan leaves out (a what-if the
policy tried and dropped) is rolled back, and so is every reservation when the policy raises.
Reservations are cheap (a journal entry each), so a policy may score alternatives: `savepoint()`,
reserve one, read what it did (a Dispatch says what it would evict), `rollback(savepoint)`, try
the next, then reserve the one it keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Protocol

from pydantic import Field

from gpufaas.types import Registry, Request

if TYPE_CHECKING:
    from cache_manager import CacheManager
    from scheduler.decisions import Dispatch, Park, PassOver, Step, Visit
    from scheduler.queues import QueueView
    from scheduler.state import ClusterState

DEFAULT_MAX_NUM_SKIPS = 25
"""The paper's default out-of-order limit: how often a queued request may be passed over."""


class SchedulingContext(Protocol):
    """The draft of the scheduler a policy plans on (implemented by `scheduler.draft.Draft`, one per
    fill during `Scheduler.schedule`): reads, and reservations that return the step they made.
    Read the cache only: change it through reservations."""

    @property
    def queue(self) -> QueueView: ...
    @property
    def cache(self) -> CacheManager: ...

    def best_idle(self, gpu_ids: Set[str], exclude: str | None = None, *, model: str | None = None) -> str | None: ...
    def best_idle_holder(self, model: str, exclude: str | None = None) -> str | None: ...
    def running_calls(self, gpu_id: str) -> int: ...
    def models_busy(self, gpu_id: str, now: float) -> Set[str]: ...
    def worker_wait_s(self, model: str, gpu_id: str, now: float) -> float: ...
    def estimated_wait_s(self, gpu_id: str, now: float) -> float: ...
    def soonest_busy_holder(self, model: str, now: float) -> tuple[str, float] | None: ...
    def load_time_s(self, model: str, gpu_id: str) -> float: ...
    def least_load_time_s(self, model: str) -> float: ...
    def copies_overlapping(self, model: str, gpu_id: str, now: float) -> int: ...
    def inference_time_s(self, model: str, gpu_id: str, batch_size: int) -> float: ...
    def fits(self, model: str, gpu_id: str) -> bool: ...
    def first_idle_fitting(self, model: str, exclude: str | None = None) -> str | None: ...
    def idle_for_replica(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None: ...
    def idle_with_room(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None: ...
    def idle_with_coldest_victim(
        self, model: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None: ...
    def idle_nearest_copy(
        self, model: str, prefer: str, exclude: str | None = None, *, quiet_links_at: float | None = None
    ) -> str | None: ...
    def dispatch(self, request: Request, gpu_id: str, now: float) -> Dispatch: ...
    def park(self, request: Request, gpu_id: str, now: float) -> Park: ...
    def pass_over(self, request_id: str, *, exempt: Sequence[str] = ()) -> PassOver: ...
    def visit(self, request_id: str) -> Visit: ...
    def savepoint(self) -> int: ...
    def rollback(self, savepoint: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Tunables of every policy; each policy reads the ones it knows. Each field's `Field` is its
    description and bounds where a daemon takes it as a setting (`python -m scheduler --o3-limit`,
    `gpufaas up`): `scheduler.settings` derives those flags from this declaration."""

    max_num_skips: Annotated[
        int,
        Field(
            ge=0,
            json_schema_extra={"flag": "--o3-limit"},
            description="lalb-o3 and mqfq-sticky: how often a request may be passed over",
        ),
    ] = DEFAULT_MAX_NUM_SKIPS
    # Place a load-balancing miss on an idle GPU with room for the model when one exists, so no
    # warm model is evicted while another idle GPU has space. False = Algorithm 2 to the letter
    # (the miss goes to the GPU being filled), for reproducing the paper.
    room_aware_misses: Annotated[bool, Field(description="a miss goes to an idle GPU with room for it")] = True
    # When such a miss must evict (no idle GPU has room), place it on the idle GPU whose first
    # victim was used least recently across the cluster, rather than on the GPU being filled
    # (whose LRU list would otherwise churn while other GPUs' models stay frozen). Only with
    # room_aware_misses.
    coldest_victim_misses: Annotated[bool, Field(description="a miss that must evict takes the coldest victim")] = True
    # Algorithm 1 read literally: a scan for a hit counts a visit for every request it passes,
    # whether or not anything is dispatched ahead of it, and a request is forced once its visits
    # are *higher* than the limit. False (the default): a skip is counted only when a younger
    # request is dispatched ahead, and a request is forced once its skips *reach* the limit.
    literal_visits: Annotated[bool, Field(description="Algorithm 1's visit counting to the letter")] = False
    # A miss goes first to an idle GPU whose node keeps the model in host memory (its host tier or
    # host model pool: a swap-in, not a load), else on disk where the GPU being filled would have to
    # fetch it. No effect where nodes hold nothing but their GPUs' models.
    tier_aware_misses: Annotated[bool, Field(description="a miss prefers a GPU whose node holds it in RAM")] = True
    # Torpor's interference-aware placement: a miss goes to an idle GPU whose host link (the PCIe
    # switch it shares with other GPUs, `GpuSpec.link`) carries no other load, where the choice is
    # otherwise equal, so that two copies do not halve each other's bandwidth. No effect where
    # every GPU has a link of its own.
    interference_aware_loads: Annotated[
        bool,
        Field(
            description="misses prefer a GPU whose shared host link (PCIe switch) carries no other load "
            "(Torpor's interference-aware placement; in effect where nodes report shared links)"
        ),
    ] = True
    # mqfq-sticky: T, how many seconds of service a flow may run ahead of Global_VT before it is
    # throttled, and alpha, its keep-alive TTL in mean inter-arrival times.
    mqfq_overrun_s: Annotated[
        float,
        Field(ge=0, description="mqfq-sticky: T, seconds of service a flow may run ahead before it is throttled"),
    ] = 10.0
    mqfq_ttl_alpha: Annotated[
        float, Field(ge=0, description="mqfq-sticky: a flow's keep-alive, in mean inter-arrival times")
    ] = 1.5
    # mqfq-sticky: swap a flow's model out to its node's host tier once the flow is past its
    # keep-alive (the paper's proactive memory management). Off by default: where GPU memory is
    # wanted only by the next calls it costs latency (bench/results/mqfq_keepalive.json).
    mqfq_swap_out: Annotated[
        bool,
        Field(
            description="mqfq-sticky: move a flow's model to its node's host tier once the flow is past its keep-alive"
        ),
    ] = False
    # torpor: the share of the total positive required request count (RRC) the high-priority
    # group may hold (where it starts), and how often Torpor's Algorithm 2 retunes it (None: fixed).
    torpor_alpha: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            description="torpor: the share of the required request count the high-priority group starts with",
        ),
    ] = 0.5
    torpor_alpha_period_s: Annotated[
        float | None,
        Field(gt=0, description="torpor: retune alpha this often by Torpor's Algorithm 2 (default: alpha fixed)"),
    ] = None

    def __post_init__(self) -> None:
        checked_max_num_skips(self.max_num_skips)


def checked_max_num_skips(max_num_skips: int) -> int:
    """`max_num_skips` itself; ValueError if it is negative (PolicyConfig and the policies that
    take it directly both check it)."""
    if max_num_skips < 0:
        raise ValueError(f"max_num_skips must be >= 0, got {max_num_skips}")
    return max_num_skips


class SchedulingPolicy(ABC):
    """Decides what an idle GPU runs next. Subclasses register by name:
    `class Foo(SchedulingPolicy, name="foo")`. A policy reads only its arguments."""

    registry: ClassVar[Registry[SchedulingPolicy]] = Registry("scheduling")
    name: ClassVar[str]

    def __init_subclass__(cls, *, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        SchedulingPolicy.registry.register(name, cls)
        cls.name = name

    @classmethod
    def from_config(cls, config: PolicyConfig) -> SchedulingPolicy:
        return cls()

    # --- what a policy with state of its own hears (the scheduler calls these; no-ops here) ----
    def on_submit(self, request: Request) -> None:  # noqa: B027 (an optional hook)
        """A request joined the global queue (at `request.arrival_s`)."""

    def on_requeue(self, request: Request, now: float, *, ran: bool) -> None:  # noqa: B027 (an optional hook)
        """A request went back to the global queue: a retry after a failure, or a call parked on
        or running on a GPU that left or whose worker died. `ran`: it had been dispatched (the
        policy heard `on_dispatch` for it), else it was parked."""

    def on_cancel(self, request: Request) -> None:  # noqa: B027 (an optional hook)
        """A queued or parked request was withdrawn before it ran (`Scheduler.cancel`: its deadline
        passed, its client went, its GPU's node left and it is not placed again)."""

    def on_dispatch(self, decision: Dispatch, now: float) -> None:  # noqa: B027 (an optional hook)
        """A dispatch was kept (from a plan, or a parked request that started)."""

    def on_finish(  # noqa: B027 (an optional hook)
        self, request: Request, now: float, *, inference_time_s: float | None
    ) -> None:
        """A dispatched request completed (with its measured inference time, if any) or failed
        (`inference_time_s` None); a failed one may be queued again."""

    # Whether `idle_models` may name any: the scheduler asks it only then (at events).
    releases_memory: bool = False

    def idle_models(self, now: float) -> list[str]:
        """Models the policy no longer expects to run soon (MQFQ-Sticky: flows whose keep-alive
        expired), each named once when it becomes so: the scheduler moves them off their GPUs
        into their nodes' host tiers, where they are idle and the node keeps a tier."""
        return []

    def lone_target(self, cluster: ClusterState, request: Request, gpu_id: str, now: float) -> str | None:
        """The scheduler's fast path (`Scheduler.schedule`), for the common situation: `request`
        is the only request in the global queue, no GPU's local queue waits to start, and
        `gpu_id` is the first idle GPU, the first the scheduler offers work. Returns the GPU that
        `fill(ctx, gpu_id, now)` would dispatch `request` to (a GPU with a free slot) or park it
        on (a busy one) there, when that one step is the fill's whole effect (its plan and its
        reservations hold nothing else, and the policy changes no state of its own in `fill`);
        None whenever it is not sure. The scheduler then applies that step directly (no draft,
        no journal) and tells `on_dispatch` of a dispatch as for any kept one; on None it runs
        the full fill.

        The contract is exactness: the answer must be the fill's, in every state, so a policy
        that does not override this (None: always the full fill) is never wrong. Read only:
        `cluster` is the committed state (no reservation may be made on it here)."""
        return None

    @abstractmethod
    def fill(self, ctx: SchedulingContext, gpu_id: str, now: float) -> list[Step]:
        """Offer idle `gpu_id` (it has a free slot; its local queue is empty) work from the global
        queue; returns the plan: the steps to keep, in the order they were reserved on `ctx`.

        The plan may dispatch to `gpu_id`, and on the way place other requests elsewhere
        (dispatch to other idle GPUs, park on busy ones). It must not pass over a request
        without counting it. An empty plan leaves everything as it was.
        """


def registered_policies() -> list[str]:
    return sorted(SchedulingPolicy.registry)


def make_policy(name: str, config: PolicyConfig | None = None) -> SchedulingPolicy:
    """Build a registered policy by name; an unknown name is an error listing the valid ones."""
    cls = SchedulingPolicy.registry.lookup(name)
    return cls.from_config(config if config is not None else PolicyConfig())
