"""Every `gpufaas COMMAND --flag` that README.md, deploy/README.md, docs/*.md and the function
templates' READMEs name is a flag that command takes: one of its own options, or, for `up` (which
hands them to its scheduler) any flag of `python -m scheduler`, and for `sim` any of the policy's
flags as the scheduler declares them. A flag renamed or removed in the CLI fails here, naming the
document and line that still cites it. (The daemons' command lines: tests/unit/test_deploy_files.py.)"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import typer
from typer.core import TyperGroup

from gpufaas.cli import app
from gpufaas.policy_flags import POLICY_FIELDS
from gpufaas.settings import options_of
from scheduler.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "deploy" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "function_templates").glob("*/README.md")),
]
# `gpufaas COMMAND` and what follows it in the same code span or shell line: flags, their values,
# and `[optional]` groups; it ends at a backtick, a comment, a pipe, `;` or `)`.
_MENTION = re.compile(r"\bgpufaas[ \t]+([a-z]+)((?:[ \t]*\\?\n?[ \t]*[^\s`#|;)]+)*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*|-[a-zA-Z](?![\w-]))")


def _scheduler_flags(fields: tuple[str, ...] | None = None) -> set[str]:
    """`python -m scheduler`'s flags (with each boolean's `--no-` form), of `fields` only if given."""
    flags: set[str] = set()
    for option in options_of(SchedulerSettings):
        if fields is None or option.path[0] in fields:
            flags |= {option.flag, "--no-" + option.flag.removeprefix("--")}
    return flags


@functools.cache
def accepted() -> dict[str, set[str]]:
    """Command name -> every flag its parser takes (`--help` included)."""
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    flags: dict[str, set[str]] = {}
    for name, command in group.commands.items():
        flags[name] = {"--help"}
        for param in command.params:
            flags[name] |= {*param.opts, *param.secondary_opts}
    flags["up"] |= _scheduler_flags()
    flags["sim"] |= _scheduler_flags(POLICY_FIELDS)
    return flags


def cited_flags() -> list[tuple[str, str, str]]:
    """(where, command, flag) for every flag the documents give a `gpufaas` command."""
    commands = accepted()
    found: list[tuple[str, str, str]] = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for mention in _MENTION.finditer(text):
            if mention[1] not in commands:
                continue  # prose ("gpufaas runs ...") or a command the CLI lacks (test below)
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, mention.start()) + 1}"
            found += [(where, mention[1], flag) for flag in _FLAG.findall(mention[2])]
    return found


def test_the_documents_cite_flags_of_several_commands() -> None:
    """The matcher finds what it should (a broken pattern would pass every check below)."""
    commands = {command for _, command, _ in cited_flags()}
    assert {"up", "sim", "new", "login", "deploy", "invoke", "top"} <= commands


def test_every_flag_the_documents_give_a_command_is_one_it_takes() -> None:
    commands = accepted()
    wrong = [f"{where}: gpufaas {cmd} {flag}" for where, cmd, flag in cited_flags() if flag not in commands[cmd]]
    assert not wrong, "flags the CLI does not take:\n" + "\n".join(wrong)


def test_every_command_the_documents_run_exists() -> None:
    """`gpufaas X` in a code span or a shell line, X a lower-case word followed by a flag or the
    span's end, is one of the CLI's commands."""
    commands = accepted()
    unknown: list[str] = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"`(?:\.venv/bin/)?gpufaas ([a-z]+)(?=[ `])", text):
            if match[1] not in commands:
                unknown.append(f"{path.relative_to(ROOT)}: gpufaas {match[1]}")
    assert not unknown, "\n".join(unknown)
