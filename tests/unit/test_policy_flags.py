"""gpufaas.policy_flags: the scheduler's flags as `gpufaas sim` and `gpufaas up` take them."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from gpufaas.policy_flags import POLICY_FIELDS, checked_scheduler, policy_flags, policy_flags_help
from gpufaas.settings import options_of
from scheduler.policies import PolicyConfig
from scheduler.settings import SchedulerSettings


def test_no_flags_give_the_schedulers_defaults() -> None:
    assert policy_flags([]) == (PolicyConfig(), SchedulerSettings.model_fields["eviction"].default)


def test_every_knob_and_the_eviction_choice_is_a_flag_and_listed_in_the_help() -> None:
    flags = [option.flag for option in options_of(SchedulerSettings) if option.path[0] in POLICY_FIELDS]
    assert len(flags) == len(dataclasses.fields(PolicyConfig)) + 1
    listed = policy_flags_help()
    assert all(flag in listed for flag in flags)
    config, eviction = policy_flags(["--torpor-alpha", "0.25", "--no-tier-aware-misses", "--eviction", "heaviness"])
    assert (config.torpor_alpha, config.tier_aware_misses, eviction) == (0.25, False, "heaviness")


def test_checked_scheduler_puts_flags_over_the_given_settings() -> None:
    settings = checked_scheduler({"policy": "torpor", "eviction": "lru"}, ["--eviction", "tinylfu", "--o3-limit", "3"])
    assert (settings.policy, settings.eviction, settings.policy_config.max_num_skips) == ("torpor", "tinylfu", 3)
    with pytest.raises(typer.BadParameter, match=r"^--o3-limit must be >= 0$"):
        checked_scheduler({}, ["--o3-limit", "-1"])
    with pytest.raises(typer.BadParameter, match="unknown scheduling policy 'x'"):
        checked_scheduler({"policy": "x"}, [])
