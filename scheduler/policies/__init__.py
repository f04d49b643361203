"""Scheduling policies, one file each, registered by name (importing this package registers them)."""

from scheduler.policies.base import (
    DEFAULT_MAX_NUM_SKIPS,
    PolicyConfig,
    SchedulingContext,
    SchedulingPolicy,
    make_policy,
    registered_policies,
)
from scheduler.policies.lalb import LocalityAwarePolicy, OutOfOrderLocalityAwarePolicy
from scheduler.policies.lb import LoadBalancePolicy
from scheduler.policies.mqfq import MqfqStickyPolicy
from scheduler.policies.torpor import TorporPolicy

__all__ = [
    "DEFAULT_MAX_NUM_SKIPS",
    "LoadBalancePolicy",
    "MqfqStickyPolicy",
    "LocalityAwarePolicy",
    "OutOfOrderLocalityAwarePolicy",
    "PolicyConfig",
    "SchedulingContext",
    "SchedulingPolicy",
    "TorporPolicy",
    "make_policy",
    "registered_policies",
]
