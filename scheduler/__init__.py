"""The global scheduler: queues, policies (lb, lalb, lalb-o3, mqfq-sticky, torpor), estimator, the call
state machine (scheduler.calls) and its service (scheduler.service, `python -m scheduler`)."""

from gpufaas import native

native.install()  # before the submodules below: their compiled builds where built and current

from scheduler.core import Scheduler
from scheduler.decisions import Decision, Dispatch, Park
from scheduler.estimator import Estimator
from scheduler.policies import PolicyConfig, SchedulingPolicy, make_policy, registered_policies
from scheduler.queues import GlobalQueue
from scheduler.state import GpuState

__all__ = [
    "Decision",
    "Dispatch",
    "Estimator",
    "GlobalQueue",
    "GpuState",
    "Park",
    "PolicyConfig",
    "Scheduler",
    "SchedulingPolicy",
    "make_policy",
    "registered_policies",
]
