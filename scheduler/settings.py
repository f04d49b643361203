"""The scheduler's settings, declared once: `python -m scheduler`'s flags and environment
(GPUFAAS_SCHEDULER_*), and what the local cluster and `gpufaas up` pass it."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from cache_manager import EvictionPolicy
from gpufaas.grants import MAX_CLAIM_S
from gpufaas.settings import MetricsSettings, host_and_port
from scheduler.adaptive_slots import DEFAULT_THRESHOLD
from scheduler.policies import PolicyConfig, registered_policies
from scheduler.service import DEFAULT_HIT_LEASE_S, DEFAULT_PRESTAGE_NODES, LEASE_TTL_S, SlotConfig

PROG = "python -m scheduler"
DESCRIPTION = "gpufaas scheduler service"


def _staged_exit(what: str) -> Any:
    """A stage of the staged exit: seconds (> 0), off unless given."""
    return Field(default=None, gt=0, description=f"staged exit: {what} (default: never)")


class SchedulerSettings(MetricsSettings):
    """Everything `python -m scheduler` takes. The policy's knobs are `policy_config`, one flag
    per `PolicyConfig` field (`--o3-limit`, `--mqfq-overrun-s`, ...), as the simulator takes them."""

    model_config = SettingsConfigDict(env_prefix="GPUFAAS_SCHEDULER_")

    listen: str = Field(default="127.0.0.1:50051", description="address to bind")
    advertise: str | None = Field(default=None, description="address gateways dial (default: the listen address)")
    name: str | None = Field(
        default=None,
        description="this scheduler's name among several (the leader's is in GET /system/overview; "
        "default: its advertised address)",
    )
    lease_ttl_s: int = Field(
        default=LEASE_TTL_S,
        ge=1,
        description="the leadership lease: a leader whose keep-alives go unanswered this long stops placing, and "
        "a standby takes over once etcd expires the lease (etcd grants at least 1.5 x its election timeout, "
        "rounded up to whole seconds)",
    )
    policy: str = Field(default="lalb-o3", description=f"the scheduling policy: {', '.join(registered_policies())}")
    policy_config: PolicyConfig = PolicyConfig()
    eviction: str = Field(
        default="lru",
        description="which models a miss evicts from a GPU: lru (the paper's), heaviness (Torpor's) or tinylfu "
        "(the least used lately; docs/policies.md)",
    )
    adaptive_slots: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra={"metavar": "MAX"},
        description="adaptive D (MQFQ-Sticky's): each GPU's concurrent calls move between 1 and MAX from its "
        "utilization every 200 ms, starting at --slots (at most MAX; default: D fixed)",
    )
    utilization_threshold: float = Field(
        default=DEFAULT_THRESHOLD,
        gt=0,
        le=1,
        description="adaptive D: above this share of time busy a GPU's D steps down, below it up",
    )
    queue_capacity: int = Field(default=10_000, gt=0, description="calls waiting before 429")
    slots: str = Field(default="4", description="concurrent calls per GPU: N, or N,GPU_TYPE=M,... per GPU type")
    claim_s: float = Field(
        default=5.0, gt=0, le=MAX_CLAIM_S, description="a placement not used within this long is checked with its node"
    )
    hit_lease_s: float = Field(
        default=DEFAULT_HIT_LEASE_S,
        ge=0,
        le=MAX_CLAIM_S,
        description="a hit's placement leases its slot to its gateway this long when nothing waits, so that the "
        "gateway runs the function's next calls there without asking (revoked as soon as a call waits; "
        "0: no leases; docs/hit-leases.md)",
    )
    gpu_idle_release_s: float | None = _staged_exit(
        "a model unused on a GPU this long leaves it, for its node's host tier where the node keeps one"
    )
    host_idle_release_s: float | None = _staged_exit("a model in a node's host tier unused this long leaves it too")
    prestage_nodes: int = Field(
        default=DEFAULT_PRESTAGE_NODES,
        ge=0,
        description="nodes that get a new function's package (and weights) before its first call; 0: none",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in registered_policies():
            raise ValueError(f"unknown scheduling policy {name!r}; valid policies: {', '.join(registered_policies())}")
        return name

    @field_validator("listen", "advertise")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        return host_and_port(address)

    @field_validator("eviction")
    @classmethod
    def _known_eviction(cls, name: str) -> str:
        if name not in EvictionPolicy.registry:
            raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(EvictionPolicy.registry))}")
        return name

    @field_validator("slots")
    @classmethod
    def _slots_parse(cls, text: str) -> str:
        SlotConfig.parse(text)  # its ValueError says what is wrong
        return text

    @property
    def slot_config(self) -> SlotConfig:
        return SlotConfig.parse(self.slots)
