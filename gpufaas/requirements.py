"""A function's requirements.txt: parsed, resolved once at deploy into a pinned layer, installed once per node.

The flow, and who runs what:

- the gateway, at deploy: `parse_requirements(text)` checks the file (names and version specifiers only:
  no options, no URLs, no local paths), then `resolve(lines, base, run=pip_runner())` asks pip's resolver,
  without installing anything, which distributions the function needs *beyond* the worker's base
  environment (`base_environment()`: torch and the rest stay shared). The answer is a `Layer`: exact
  `name==version` pins and the interpreter they are for, named by its digest.
- each node: `LayerCache.ensure(layer)` installs those pins once (`pip install --no-deps --only-binary=:all:
  --target ...`) into `root/<hex of the digest>`; the function's worker puts that directory first on
  `sys.path`.

Security: only wheels are ever used (`--only-binary=:all:`), so no package's build code runs on the gateway
or on a node, and nodes install the gateway's exact pins with `--no-deps`, so what a node installs is what
the gateway resolved. The pins are validated (a pin can never become a pip option) wherever a Layer is built.

RequirementsError (a GpufaasError)
└── UnresolvableRequirements   pip found no set of wheels satisfying the requirements; names the packages
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from gpufaas.errors import GpufaasError, shown

__all__ = [
    "MAX_REQUIREMENTS",
    "REQUIREMENTS_FILE",
    "Layer",
    "LayerCache",
    "PipRunner",
    "RequirementsError",
    "UnresolvableRequirements",
    "base_environment",
    "install",
    "parse_requirements",
    "pip_runner",
    "python_tag",
    "resolve",
]

REQUIREMENTS_FILE = "requirements.txt"
MAX_REQUIREMENTS = 200

_TMP_PREFIX = ".tmp-"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
# A pin as a Layer holds it: a canonical name, "==", a normalized PEP 440 version. Neither part can start
# with "-", so a pin handed to pip's command line is never read as an option.
_PIN = re.compile(r"([a-z0-9](?:[a-z0-9-]*[a-z0-9])?)==([0-9][0-9a-z.!+]*)")
_PYTHON = re.compile(r"[a-z]+[0-9]+-[a-z0-9_]+")
# pip's own comment rule (pip._internal.req.req_file.COMMENT_RE): "#" at the start or after whitespace.
_COMMENT = re.compile(r"(^|\s+)#.*$")
# pip's ARCHIVE_EXTENSIONS (pip._internal.utils.filetypes): a requirement ending in one is a local file to pip.
_ARCHIVE_SUFFIXES = (
    ".whl",
    ".zip",
    ".tar",
    ".tar.gz",
    ".tgz",
    ".tar.bz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tlz",
    ".tar.lz",
    ".tar.lzma",
)
_VCS = re.compile(r"(git|hg|svn|bzr)\+", re.IGNORECASE)
_IMPLEMENTATION_ABBREVIATIONS = {"cpython": "cp", "pypy": "pp", "ironpython": "ip", "jython": "jy"}
_MESSAGE_PART_CHARS = 300  # a quoted piece of pip's output in an error message is cut to this


class RequirementsError(GpufaasError):
    """A function's requirements cannot be used as given (or pip could not be run); says what to change."""


class UnresolvableRequirements(RequirementsError):
    """pip found no set of wheels that satisfies the requirements with the base environment's versions.

    `packages` are the requirements pip named (as the user wrote them, e.g. "tabulate==9.9"), `reason`
    pip's reason in one line; the message holds both.
    """

    def __init__(self, message: str, *, packages: Sequence[str], reason: str) -> None:
        super().__init__(message)
        self.packages = tuple(packages)
        self.reason = reason


# --- requirements.txt ------------------------------------------------------------------------------------


def parse_requirements(text: str) -> list[str]:
    """The requirement lines of a requirements.txt, normalized, in file order.

    Comments (a "#" at the start of a line or after whitespace), blank lines and trailing comments are
    removed; lines ending in a backslash are joined with the next, as pip does. Each line is returned in
    packaging's canonical spelling (`str(Requirement(line))`), environment markers kept.

    Refused with RequirementsError naming the (first physical) line number: option lines (-r, -c, -e,
    --index-url, -f, --extra-index-url, ...) and per-requirement options (--hash ...); direct references
    (URLs, local paths and archives, VCS links, 'name @ url'); environment variables (`${VAR}`, which pip
    would expand from the resolving machine's environment); lines that are not PEP 508 requirements; and
    more than MAX_REQUIREMENTS requirements.
    """
    requirements: list[str] = []
    for line_number, raw in _logical_lines(text.removeprefix("\ufeff")):
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        requirements.append(_parse_line(line, line_number))
        if len(requirements) > MAX_REQUIREMENTS:
            raise RequirementsError(
                f"{REQUIREMENTS_FILE} lists more than {MAX_REQUIREMENTS} requirements (line {line_number}): "
                "list only the function's direct dependencies; pip finds the rest"
            )
    return requirements


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number of the first physical line, the line) after joining backslash continuations like pip's
    `join_lines`: a whole-line comment never continues (and is joined after a space, so it stays a
    comment), backslashes are stripped from both ends of a continued line, a trailing continuation ends
    at end of file."""
    pending: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.endswith("\\") and not _COMMENT.match(line):
            if not pending:
                start = number
            pending.append(line.strip("\\"))
            continue
        logical = " " + line if _COMMENT.match(line) else line
        if pending:
            pending.append(logical)
            yield start, "".join(pending)
            pending = []
        else:
            yield number, logical
    if pending:
        yield start, "".join(pending)


def _parse_line(line: str, line_number: int) -> str:
    where = f"{REQUIREMENTS_FILE} line {line_number}"
    if "${" in line:
        raise RequirementsError(
            f"{where}: {line!r} uses an environment variable; write its value instead (variables are not expanded)"
        )
    if line.startswith("-"):
        option = line.split(maxsplit=1)[0].split("=", 1)[0]
        raise RequirementsError(
            f"{where}: {option!r} is a pip option; {REQUIREMENTS_FILE} may hold only requirements "
            "(no -r, -c, -e, --index-url, -f, ...): packages come from the cluster's package indexes"
        )
    if _is_direct_reference(line):
        raise RequirementsError(
            f"{where}: {line!r} is a URL, path or VCS link; name a published package and its versions instead "
            "(e.g. 'tabulate>=0.9')"
        )
    try:
        requirement = Requirement(line)
    except InvalidRequirement as exc:
        if any(token.startswith("-") for token in line.split()[1:]):
            raise RequirementsError(
                f"{where}: per-requirement options such as --hash are not supported; keep only "
                f"'name<specifiers>; markers' (got {line!r})"
            ) from None
        first_line = str(exc).splitlines()[0] if str(exc) else "invalid"
        raise RequirementsError(
            f"{where}: {line!r} is not a valid requirement ({first_line}); write e.g. 'name>=1.2,<2'"
        ) from None
    if requirement.url is not None:
        raise RequirementsError(
            f"{where}: {line!r} is a direct reference ('name @ url'); name a published version instead"
        )
    normalized = str(requirement)
    # pip reads the part before ";" as a local path or archive when it looks like one: '===' (arbitrary
    # equality) takes any string, so "pkg===dir/pkg-1.0-py3-none-any.whl" would be a file to pip.
    if _looks_like_file(normalized.split(";", 1)[0].strip()):
        raise RequirementsError(
            f"{where}: {line!r} is a URL, path or VCS link to pip; name a published package and its versions "
            "instead (e.g. 'tabulate>=0.9')"
        )
    # pip splits a requirements-file line at the first token starting with "-" and reads the rest as
    # options; a marker literal such as "a -b" would smuggle one in.
    if any(token.startswith("-") for token in normalized.split()):
        raise RequirementsError(f"{where}: {line!r} holds a token starting with '-', which pip reads as an option")
    return normalized


def _is_direct_reference(line: str) -> bool:
    """Whether pip would take `line` as a URL, VCS link or local path/archive rather than a name."""
    if "://" in line or _VCS.match(line) or line.startswith((".", "/", "~", "file:")):
        return True
    return _looks_like_file(re.split(r"[\s;\[<>=!~@]", line, maxsplit=1)[0])


def _looks_like_file(text: str) -> bool:
    """Whether pip would take `text` (a requirement without its markers) as a local path or archive."""
    return "/" in text or "\\" in text or text.startswith(".") or text.lower().endswith(_ARCHIVE_SUFFIXES)


# --- the base environment and the interpreter -----------------------------------------------------------


def base_environment() -> dict[str, str]:
    """Canonical name -> version of every distribution this interpreter has installed.

    When one name is installed twice (two sys.path entries), the first one wins, as it does for import.
    """
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:  # a broken install without metadata: nothing pip could pin
            continue
        found.setdefault(canonicalize_name(name), dist.version)
    return found


def python_tag() -> str:
    """This interpreter's tag as a Layer records it: implementation, version and machine ("cp311-x86_64")."""
    implementation = sys.implementation.name
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return _tag(implementation, version, platform.machine())


def _tag(implementation_name: str, python_version: str, machine: str) -> str:
    abbreviation = _IMPLEMENTATION_ABBREVIATIONS.get(implementation_name, implementation_name)
    return f"{abbreviation}{python_version.replace('.', '')}-{machine.lower()}"


# --- the layer ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    """The distributions a function needs beyond the base environment, pinned exactly.

    `pins` are sorted "name==version" strings (canonical names, normalized versions, one per name);
    `python` is the interpreter and machine the wheels were resolved for ("cp311-x86_64"). Both are
    checked on construction (RequirementsError), so a Layer read from anywhere is safe to hand to pip.
    Two Layers with the same pins and python are the same layer: `digest` names it.
    """

    pins: tuple[str, ...]
    python: str

    def __post_init__(self) -> None:
        if not isinstance(self.python, str) or not _PYTHON.fullmatch(self.python):
            raise RequirementsError(f"layer python {self.python!r} is not of the form 'cp311-x86_64'")
        names: list[str] = []
        for pin in self.pins:
            match = _PIN.fullmatch(pin) if isinstance(pin, str) else None
            if match is None or canonicalize_name(match.group(1)) != match.group(1):
                raise RequirementsError(f"layer pin {pin!r} is not of the form 'canonical-name==version'")
            names.append(match.group(1))
        if list(self.pins) != sorted(self.pins) or len(set(names)) != len(names):
            raise RequirementsError(f"layer pins {list(self.pins)} are not sorted with one pin per name")

    @property
    def digest(self) -> str:
        """The layer's name on every node: "sha256:<hex>" of its canonical JSON (`to_json`)."""
        return "sha256:" + hashlib.sha256(self.to_json()).hexdigest()

    @property
    def empty(self) -> bool:
        """Whether the base environment already holds everything (nothing to install)."""
        return not self.pins

    def to_json(self) -> bytes:
        """The canonical JSON (sorted keys, no spaces) the digest is computed over."""
        return json.dumps(
            {"pins": list(self.pins), "python": self.python}, sort_keys=True, separators=(",", ":")
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Layer:
        """The Layer `to_json` wrote; RequirementsError for anything else."""
        try:
            value = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequirementsError(f"layer is not JSON: {exc}") from None
        if not isinstance(value, dict) or set(value) != {"pins", "python"} or not isinstance(value["pins"], list):
            raise RequirementsError('layer JSON must be an object {"pins": [...], "python": "..."}')
        return cls(tuple(value["pins"]), value["python"])


# --- pip ------------------------------------------------------------------------------------------------

PipRunner = Callable[[Sequence[str], float], tuple[int, str, str]]
"""Runs `python -m pip <argv>` with a timeout in seconds; returns (returncode, stdout, stderr)."""


def pip_runner(python: str = sys.executable) -> PipRunner:
    """The real PipRunner: `python -m pip` in a subprocess with no stdin and this process's environment
    (so pip's own configuration, indexes and constraints apply). A timeout kills pip and raises
    RequirementsError, as does an interpreter that cannot be started."""

    def run(argv: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
        command = [python, "-m", "pip", *argv]
        try:
            done = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RequirementsError(
                f"pip {' '.join(argv[:1])} did not finish within {timeout_s:g} s: the package index may be slow "
                "or unreachable; try again later"
            ) from None
        except OSError as exc:
            raise RequirementsError(f"cannot run pip with {python}: {exc}") from exc
        return done.returncode, done.stdout, done.stderr

    return run


def resolve(requirements: Sequence[str], base: Mapping[str, str], *, run: PipRunner, timeout_s: float = 300.0) -> Layer:
    """The layer that `requirements` need on top of `base` (canonical name -> version), found by pip's
    resolver without installing anything.

    pip runs as `install --dry-run --ignore-installed --only-binary=:all: --report <json> -r <requirements>
    -c <constraints>`, and the constraints pin every base distribution to its base version unless the
    requirements name it directly *and* exclude the base version. So transitive dependencies reuse the
    base's versions (torch is never pulled in again), a plain `torch` or `numpy>=1.20` that the base
    satisfies costs nothing, and `numpy==2.1` when the base has 2.0 installs 2.1 into the layer. Pip's
    configured constraints (pip.conf's `constraint`) still apply on top. The layer is the report's
    "install" entries minus those at their base version.

    Requirements are re-checked with `parse_requirements` (they become a requirements file pip obeys).
    No requirements: the empty layer for this interpreter, without running pip. Raises
    UnresolvableRequirements naming the package(s) and pip's reason when pip finds no solution, and
    RequirementsError when pip cannot be run or writes no report.
    """
    lines = parse_requirements("\n".join(requirements))
    if not lines:
        return Layer((), python_tag())
    canonical_base: dict[str, str] = {canonicalize_name(name): version for name, version in base.items()}
    with tempfile.TemporaryDirectory(prefix="gpufaas-resolve-") as tmp:
        requirements_path = Path(tmp) / "requirements.txt"
        constraints_path = Path(tmp) / "constraints.txt"
        report_path = Path(tmp) / "report.json"
        requirements_path.write_text("".join(f"{line}\n" for line in lines))
        constraints = _constraints(lines, canonical_base)
        constraints_path.write_text("".join(f"{pin}\n" for pin in constraints))
        argv = [
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            "--no-input",
            # Not --quiet: pip prints the cause of a conflict ("The conflict is caused by: ...") on stdout at
            # its normal level, and the user needs it in the error message.
            "--progress-bar=off",
            "--report",
            str(report_path),
            "-r",
            str(requirements_path),
            "-c",
            str(constraints_path),
        ]
        returncode, stdout, stderr = run(argv, timeout_s)
        if returncode != 0:
            raise _unresolvable(stdout, stderr, lines, constraints, returncode)
        try:
            report = json.loads(report_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise RequirementsError(
                f"pip resolved the requirements but wrote no readable report ({exc}); pip 22.2 or newer is needed"
            ) from None
    return _layer_from_report(report, canonical_base)


def _constraints(lines: Sequence[str], base: Mapping[str, str]) -> list[str]:
    """Sorted "name==version" pins of the base distributions pip must keep (see `resolve`)."""
    named: dict[str, list[Requirement]] = {}
    for line in lines:
        requirement = Requirement(line)
        named.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    pins = []
    for name, version in sorted(base.items()):
        if not _is_version(version):  # pip refuses a constraints file with a legacy version in it
            continue
        requirements = [r for r in named.get(name, []) if _applies(r)]
        if all(r.specifier.contains(version, prereleases=True) for r in requirements):
            pins.append(f"{name}=={version}")
    return pins


def _applies(requirement: Requirement) -> bool:
    """Whether the requirement's marker holds for this interpreter (unknown: assume it does)."""
    if requirement.marker is None:
        return True
    try:
        return requirement.marker.evaluate({"extra": ""})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
        return True


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def _normalized(version: str) -> str:
    """PEP 440's spelling of `version` ("2.0" stays, "1.0-post1" becomes "1.0.post1"); a legacy one as is."""
    try:
        return str(Version(version))
    except InvalidVersion:
        return version


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _layer_from_report(report: Any, base: Mapping[str, str]) -> Layer:
    """The Layer of a pip installation report (format version 1): its "install" entries whose version
    differs from the base's, for the interpreter its "environment" describes."""
    try:
        environment = report["environment"]
        python = _tag(
            environment["implementation_name"], environment["python_version"], environment["platform_machine"]
        )
        pins: dict[str, str] = {}
        for item in report["install"]:
            name = canonicalize_name(item["metadata"]["name"])
            version = item["metadata"]["version"]
            if name in base and _same_version(base[name], version):
                continue
            pins[name] = f"{name}=={Version(version)}"
    except (KeyError, TypeError, AttributeError, InvalidVersion) as exc:
        raise RequirementsError(f"pip's installation report is not in the expected format ({exc!r})") from None
    return Layer(tuple(sorted(pins.values())), python)


# Forms of pip's failure output (pip 23), most specific first.
_CONFLICT = re.compile(r"Cannot install (.+?) because these package versions have conflicting dependencies")
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")
_NO_VERSION = re.compile(r"Could not find a version that satisfies the requirement (\S+)(?: \(from versions: (.*)\))?")
_OTHER_PYTHON = re.compile(r"Ignored the following versions that require a different python version: (.+)")
_REQUIREMENTS_FILE_LINE = re.compile(r"-r \S+ \(line (\d+)\)")


def _unresolvable(
    stdout: str, stderr: str, lines: Sequence[str], constraints: Sequence[str], returncode: int
) -> UnresolvableRequirements:
    """The error for a failed resolution, from pip's output: which requirements, and why, in two lines."""

    def by_name(text: str) -> str:
        # pip names a requirement that came from a file by its place ("-r /tmp/.../requirements.txt (line 2)");
        # the user knows it by its text.
        def line_text(match: re.Match[str]) -> str:
            index = int(match.group(1)) - 1
            return lines[index] if 0 <= index < len(lines) else match.group(0)

        return _REQUIREMENTS_FILE_LINE.sub(line_text, text)

    raw_output = stderr + "\n" + stdout
    output = by_name(raw_output)
    packages: list[str]
    advice = f"change {REQUIREMENTS_FILE} (other versions, or fewer pins) and deploy again"
    if (match := _CONFLICT.search(raw_output)) is not None:
        # Split before naming: a requirement's marker may itself hold " and ".
        packages = [by_name(part) for part in re.split(r", | and ", match.group(1))]
        causes, held_by_base = _conflict_causes(output, constraints)
        reason = "conflicting dependencies" + (f": {causes}" if causes else "")
        if held_by_base:
            advice = (
                "the base environment's version of a package is kept unless you name it: add it to "
                f"{REQUIREMENTS_FILE} with the version you need, or pick versions that accept the base's"
            )
    elif (match := _NO_MATCH.search(output) or _NO_VERSION.search(output)) is not None:
        packages = [match.group(1)]
        versions = _NO_VERSION.search(output)
        available = versions.group(2) if versions is not None else None
        if available and available != "none":
            reason = f"no version with a wheel for this Python matches (versions found: {available})"
        else:
            reason = (
                "no wheel for this Python on the package indexes: no such package, or it publishes only source "
                "distributions, which gpufaas never builds"
            )
        if (other := _OTHER_PYTHON.search(output)) is not None:
            reason += f"; ignored for requiring another Python: {other.group(1)}"
    else:
        packages = list(lines)
        errors = [line.removeprefix("ERROR: ") for line in output.splitlines() if line.startswith("ERROR:")]
        last = errors[-1] if errors else next((s for s in reversed(stderr.splitlines()) if s.strip()), "")
        reason = last.strip() or f"pip exited with status {returncode}"
    reason = shown(reason, _MESSAGE_PART_CHARS)
    message = f"cannot resolve {', '.join(packages)}: {reason}\n{advice}"
    return UnresolvableRequirements(message, packages=packages, reason=reason)


def _conflict_causes(output: str, base_pins: Sequence[str]) -> tuple[str, bool]:
    """pip's "The conflict is caused by:" block in one line (the first two dependency lines, then the
    constraints, each labelled with where it came from: `base_pins`, or else pip's own configuration),
    and whether a base pin is among the causes."""
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "The conflict is caused by:")
    except StopIteration:
        return "", False
    depends: list[str] = []
    constraints: list[str] = []
    held_by_base = False
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        text = line.strip()
        if text.startswith("The user requested (constraint) "):
            constraint = text.removeprefix("The user requested (constraint) ")
            held_by_base = held_by_base or constraint in base_pins
            origin = "the base environment" if constraint in base_pins else "pip's configured constraints"
            constraints.append(f"{constraint} ({origin})")
        elif text.startswith("The user requested "):
            constraints.append("requested " + text.removeprefix("The user requested "))
        else:
            depends.append(text)
    shown = depends[:2] + ([f"{len(depends) - 2} more like these"] if len(depends) > 2 else [])
    return "; ".join(shown + constraints), held_by_base


# --- installing a layer ---------------------------------------------------------------------------------


def install(layer: Layer, target: Path, *, run: PipRunner, timeout_s: float = 600.0) -> Path:
    """Install the layer's pins into the directory `target` (created whole or not at all); returns it.

    pip runs as `install --no-deps --only-binary=:all: --target <temporary sibling of target> <pins>`;
    the result is checked to hold exactly the pins, made readable to everyone (directories 0755, files
    a+r), and renamed into `target`, so a crash leaves at worst a `.tmp-*` sibling, never a half-installed
    layer. An existing `target` means done (idempotent; an identical install racing this one is fine).
    pip byte-compiles the wheels' modules as it installs (no --no-compile): the layer is read-only to the
    workers, which could not write `__pycache__` there, and every cold start would compile again.
    Compiling parses the code and runs none of it. An empty layer is an empty directory.
    Raises RequirementsError naming the pins that failed.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name[:12]}-", dir=target.parent))
    try:
        if layer.pins:
            argv = [
                "install",
                "--no-deps",
                "--only-binary=:all:",
                "--no-input",
                "--quiet",
                "--progress-bar=off",
                "--target",
                str(tmp),
                *layer.pins,
            ]
            returncode, stdout, stderr = run(argv, timeout_s)
            if returncode != 0:
                raise _install_failed(layer, stdout, stderr, returncode)
            _check_installed(layer, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, target)  # atomic on one filesystem: the layer appears whole or not at all
        except OSError:
            if not target.is_dir():  # lost a race to an identical install, which is fine; else real
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install_failed(layer: Layer, stdout: str, stderr: str, returncode: int) -> RequirementsError:
    output = stderr + "\n" + stdout
    failed = [m.group(1) for m in _NO_MATCH.finditer(output)] or list(layer.pins)
    errors = [line.removeprefix("ERROR: ") for line in output.splitlines() if line.startswith("ERROR:")]
    reason = shown(errors[-1] if errors else f"pip exited with status {returncode}", _MESSAGE_PART_CHARS)
    return RequirementsError(
        f"cannot install {', '.join(failed)} of layer {layer.digest}: {reason}\n"
        "the package index may have lost these versions or be unreachable; deploy the function again to re-resolve"
    )


def _check_installed(layer: Layer, directory: Path) -> None:
    """RequirementsError unless `directory` holds exactly the layer's pins (what pip said it did)."""
    installed = {
        f"{canonicalize_name(d.metadata['Name'])}=={_normalized(d.version)}"
        for d in importlib.metadata.distributions(path=[str(directory)])
        if d.metadata["Name"]
    }
    if installed != set(layer.pins):
        missing = sorted(set(layer.pins) - installed)
        extra = sorted(installed - set(layer.pins))
        raise RequirementsError(
            f"pip installed a different set than layer {layer.digest} pins (missing {missing}, unexpected {extra}); "
            "deploy the function again to re-resolve"
        )


def _make_readable(directory: Path) -> None:
    """Directories 0755, files readable by all and writable by the owner only: workers may run as other users
    (and the daemon's umask may be stricter than 022)."""
    os.chmod(directory, 0o755)
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):  # chmod would follow the link
                mode = os.stat(path).st_mode
                os.chmod(path, (mode | 0o444) & 0o755)  # also drops setuid/setgid, should a wheel carry them


# --- the node's cache -----------------------------------------------------------------------------------


class LayerCache:
    """Installed layers under `root`, one directory per layer digest (`root/<hex>`).

    `root` is 0711 and each layer 0755: a worker that knows its layer's path can read it, but no worker
    can list `root` to find the others. A directory named by a digest exists only once its layer is fully
    installed (see `install`); `.tmp-*` leftovers of a crash are removed when the cache opens. Layers for
    another interpreter than `python` (default: this one's `python_tag()`) are refused: their wheels
    would not import. `root` belongs to one cache (one gpu_manager) at a time.
    """

    def __init__(
        self,
        root: Path,
        *,
        run: PipRunner,
        python: str | None = None,
        install_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.python = python if python is not None else python_tag()
        self._run = run
        self._install_timeout_s = install_timeout_s
        self._clock = clock
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for stale in self.root.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        # Installs in flight, by digest: concurrent `ensure`s of one layer await the same task.
        # An entry lives from the first `ensure` that finds the layer absent until that task ends.
        self._pending: dict[str, asyncio.Task[Path]] = {}
        self._used_at: dict[str, float] = {}  # digest -> when a worker last asked for it (wall clock)

    def path_for(self, layer: Layer) -> Path | None:
        """The installed directory of `layer`, or None if it is not installed."""
        path = self.root / _hex_of(layer.digest)
        return path if path.is_dir() else None

    async def ensure(self, layer: Layer) -> Path:
        """The installed directory of `layer`, installing it (in a thread) only if absent.

        Concurrent calls for one layer share one install; a caller giving up does not cancel it for the
        others; a failed install is not remembered, so the next call tries again. RequirementsError if
        the layer is for another interpreter or pip fails.
        """
        if layer.python != self.python:
            raise RequirementsError(
                f"layer {layer.digest} was resolved for {layer.python}, but this node's workers run {self.python}: "
                "deploy the function again from a gateway with the workers' Python"
            )
        digest = layer.digest
        self._used_at[digest] = self._clock()
        path = self.path_for(layer)
        if path is not None:
            return path
        task = self._pending.get(digest)
        if task is None:
            target = self.root / _hex_of(digest)
            task = asyncio.create_task(
                asyncio.to_thread(install, layer, target, run=self._run, timeout_s=self._install_timeout_s),
                name=f"layer {digest}",
            )
            self._pending[digest] = task
            task.add_done_callback(lambda _: self._pending.pop(digest, None))
        # Shielded: one caller giving up must not cancel the install the others are waiting for.
        return await asyncio.shield(task)

    def collect(self, in_use: set[str], now_unix_s: float, grace_s: float) -> list[str]:
        """Delete the installed layers whose digest is not `in_use` and that nobody asked for in `grace_s`
        (or, if none has since this cache opened, whose directory is that old); the digests deleted."""
        removed = []
        for path in self.root.iterdir():
            digest = f"sha256:{path.name}"
            if path.name.startswith(_TMP_PREFIX) or not _DIGEST.fullmatch(digest):
                continue
            try:
                last = self._used_at.get(digest, path.stat().st_mtime)
            except FileNotFoundError:
                continue
            if digest not in in_use and digest not in self._pending and now_unix_s - last > grace_s:
                shutil.rmtree(path, ignore_errors=True)
                self._used_at.pop(digest, None)
                removed.append(digest)
        return removed


def _hex_of(digest: str) -> str:
    match = _DIGEST.fullmatch(digest)
    if match is None:  # a Layer's digest always matches; a guard for the directory name
        raise RequirementsError(f"layer digest {digest!r} is not of the form 'sha256:<64 lowercase hex digits>'")
    return match.group(1)
