"""The scheduler's flags where a command passes them on: `gpufaas up` and `gpufaas sim` take them
as `python -m scheduler` does, parsed and checked by the parser derived from its settings model.

`gpufaas up` checks every scheduler flag its scheduler will get (`checked_scheduler`); `gpufaas
sim` takes the policy's: each knob of `PolicyConfig` and the eviction choice (`policy_flags`),
with the scheduler's flag names, defaults, bounds and error messages. Either way a refused flag
is a usage error of one line in the scheduler's words (`--o3-limit must be >= 0`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from gpufaas.settings import SettingsError, options_of
from scheduler.policies import PolicyConfig
from scheduler.settings import SchedulerSettings

# The scheduler's settings a simulation takes: the policy's knobs and which models a miss evicts.
POLICY_FIELDS = ("policy_config", "eviction")


class _FlagsOnly(SchedulerSettings):
    """The scheduler's settings from flags alone: a simulation does not change with the
    environment a scheduler would read (GPUFAAS_SCHEDULER_*)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


@contextmanager
def _usage_errors(model: type[SchedulerSettings]) -> Iterator[None]:
    """What the scheduler would refuse becomes a usage error (exit status 2) in its words."""
    try:
        yield
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from None
    except ValidationError as exc:
        raise typer.BadParameter(model.refusal(exc)) from None


def checked_scheduler(scheduler: Mapping[str, Any], flags: Sequence[str]) -> SchedulerSettings:
    """The settings a scheduler started with `scheduler` (by field name) and `flags` on top will
    run with, checked by its settings model now; `typer.BadParameter` saying what it would refuse."""
    with _usage_errors(SchedulerSettings):
        return SchedulerSettings(**scheduler).with_flags(flags)


def _parser() -> argparse.ArgumentParser:
    return _FlagsOnly.parser("python -m scheduler", "", partial=True, raising=True)


def policy_flags(flags: Sequence[str]) -> tuple[PolicyConfig, str]:
    """The policy's knobs and the eviction policy's name that `flags` give, as `python -m
    scheduler` takes them (each left out: the scheduler's default); `typer.BadParameter` for a
    flag the scheduler would refuse, or one of its flags that is not the policy's (`--listen`)."""
    parser = _parser()
    with _usage_errors(_FlagsOnly):
        given = vars(parser.parse_args(list(flags)))
        for option in options_of(_FlagsOnly):
            if option.dest in given and option.path[0] not in POLICY_FIELDS:
                raise SettingsError(f"{option.flag} is a setting of the scheduler service, not of its policy")
        settings = _FlagsOnly.from_namespace(parser, argparse.Namespace(**given))
    return settings.policy_config, settings.eviction


def policy_flags_help() -> str:
    """The policy's flags as `python -m scheduler --help` lists them: flag, help, default."""
    parser = _parser()
    formatter = parser.formatter_class(prog=parser.prog)
    formatter.start_section("the policy's knobs and the eviction choice, as `python -m scheduler` takes them")
    # argparse lists its actions only through this attribute; the help lines are the scheduler's own.
    formatter.add_arguments([a for a in parser._actions if a.dest.partition(".")[0] in POLICY_FIELDS])
    formatter.end_section()
    return formatter.format_help()
