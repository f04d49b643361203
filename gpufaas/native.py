"""Compiled builds of the decision core: mypyc builds of the modules every placement and every
simulated event runs through, loaded in place of their sources while they match them.

The modules in `NATIVE_MODULES` are ordinary, fully typed Python. `python -m gpufaas.native build`
(scripts/setup.sh runs it) compiles them with mypyc into a new directory under `.native/`, points
`native_dir()` at it (a symbolic link, swapped in one step), and writes a manifest of the SHA-256
of each source the build depends on: the compiled modules and every first-party module they import,
directly or not (the compiled code checks values against the types those declare). `install()`,
called by the packages that hold them (scheduler, cache_manager, simulator) before they import
anything, decides once per process: it puts a finder in front of the import system that loads those
builds only when every one of those sources is unchanged since the build and none of the group is
imported yet. One edited file makes the whole group stale (they share one library), and then
everything runs from source, with one warning naming the rebuild command. Not built, or
`GPUFAAS_NATIVE=0`: everything runs from source, silently. The two decide alike;
tests/unit/test_native.py runs the simulator both ways and compares.

Why mypyc and these modules: the simulator replays a trace through the scheduler's real objects,
and one scheduler process places every call of the cluster. Both spend their time in plain Python
over dicts, heaps and small objects, which mypyc turns into direct C calls and native attribute
reads (docs/scheduler-throughput.md has the figures). What it asks of the code: a compiled class
cannot be patched at run time, one that interpreted code extends says so (`mypyc_attr`), and the
declared types are checked at run time (an int field refuses a float).
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

# The compiled set: the scheduler's decision core, the cache manager and the simulator's engine.
# A module here may not be subclassed or monkeypatched from uncompiled code unless its class says
# so (mypyc's `allow_interpreted_subclasses`).
NATIVE_MODULES: tuple[str, ...] = (
    "cache_manager.manager",
    "scheduler.calls",
    "scheduler.core",
    "scheduler.decisions",
    "scheduler.estimator",
    "scheduler.queues",
    "scheduler.reservations",
    "scheduler.staged_exit",
    "scheduler.state",
    "simulator.engine",
)
GROUP = "gpufaas_native"  # mypyc's group name
LIBRARY = f"{GROUP}__mypyc"  # the group's shared library, a module of its own
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 2: `modules` holds every source of `build_sources`, not only the compiled ones
ENV_SWITCH = "GPUFAAS_NATIVE"  # "0": run from source even where built
ENV_DIR = "GPUFAAS_NATIVE_DIR"  # where the builds live (default: native_dir())
REBUILD = "python -m gpufaas.native build"
ROOT = Path(__file__).resolve().parent.parent  # the directory holding the packages


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one build compiled: the digest of each source it depends on (`build_sources`), the file
    of each module's build (relative to the build directory), and the Python it was built for."""

    python: str
    modules: Mapping[str, str]  # module -> SHA-256 of its source when built (compiled or imported)
    files: Mapping[str, str]  # module (and the group's library) -> its extension, relative

    def to_json(self) -> str:
        fields = {"python": self.python, "modules": dict(self.modules), "files": dict(self.files)}
        return json.dumps({"format": MANIFEST_FORMAT, **fields}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Raises ValueError for a manifest of another format (an older build: rebuild)."""
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {raw.get('format')!r}, expected {MANIFEST_FORMAT}")
        return cls(python=str(raw["python"]), modules=dict(raw["modules"]), files=dict(raw["files"]))


# What reading a manifest may raise: missing or unreadable, not JSON, or not a manifest's shape.
MANIFEST_ERRORS = (OSError, ValueError, KeyError, TypeError)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of the build in `directory`; raises one of MANIFEST_ERRORS where there is none."""
    return Manifest.from_json((directory / MANIFEST).read_text())


def python_tag() -> str:
    """The interpreter a build is for: its cache tag and extension suffix (ABI and platform)."""
    return f"{sys.implementation.cache_tag}{sysconfig.get_config_var('EXT_SUFFIX')}"


def native_dir() -> Path:
    """Where the builds for this interpreter live: $GPUFAAS_NATIVE_DIR, else `.native/<tag>` next to
    the packages (in a checkout, the repository's root; ignored by git)."""
    configured = os.environ.get(ENV_DIR)
    base = Path(configured) if configured else ROOT / ".native"
    return base / str(sysconfig.get_config_var("EXT_SUFFIX")).removesuffix(".so").strip(".")


FIRST_PARTY = ("gpufaas", "scheduler", "cache_manager", "simulator")  # what a build may depend on


def source_path(module: str, root: Path = ROOT) -> Path:
    """The file of `module` under `root`: its `__init__.py` for a package."""
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def first_party_imports(module: str, root: Path = ROOT) -> set[str]:
    """The first-party modules `module` imports anywhere in its source (in functions and under
    TYPE_CHECKING too), with the packages above each (their `__init__` runs first)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source_path(module, root).read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in FIRST_PARTY:
                found.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return {name for name in found if source_path(name, root).is_file()}


def build_sources(modules: Sequence[str] = NATIVE_MODULES, root: Path = ROOT) -> list[str]:
    """What a build of `modules` depends on: they and every first-party module they import,
    directly or not, sorted; not this loader, which the packages import only to install it."""
    seen, todo = {*modules, __name__}, list(modules)
    while todo:
        for name in first_party_imports(todo.pop(), root) - seen:
            seen.add(name)
            todo.append(name)
    return sorted(seen - {__name__})


def digests(modules: Sequence[str], root: Path = ROOT) -> dict[str, str]:
    """Each module's source SHA-256 (a module without a source file is left out)."""
    found = {}
    for module in modules:
        path = source_path(module, root)
        if path.is_file():
            found[module] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def stale_modules(manifest: Manifest, current: Mapping[str, str], python: str) -> list[str]:
    """Why a build may not be used, as the modules it does not match (all of them for another
    Python): a module compiled from another source, compiled but gone, or in the set but not
    compiled. Empty: the build matches every source."""
    if manifest.python != python:
        return sorted(set(manifest.modules) | set(current))
    names = set(manifest.modules) | set(current)
    return sorted(name for name in names if manifest.modules.get(name) != current.get(name))


class _NativeFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and their shared library) at their builds' paths."""

    def __init__(self, paths: Mapping[str, Path]) -> None:
        self.paths = dict(paths)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.paths.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


class NotUsable(Exception):
    """Why a build may not be loaded (the message says)."""


def usable_build(directory: Path) -> Manifest:
    """The build in `directory` if it may be loaded: built for this Python from the sources here
    (`build_sources`: every one unchanged), with a file for each module of `NATIVE_MODULES` and its
    library, and nothing else. Raises FileNotFoundError where none was built, NotUsable otherwise."""
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        raise
    except MANIFEST_ERRORS as exc:
        raise NotUsable(f"its manifest is damaged ({exc})") from exc
    if set(manifest.files) != {*NATIVE_MODULES, LIBRARY}:
        raise NotUsable("it was built for another set of modules")
    stale = stale_modules(manifest, digests(sorted({*manifest.modules, *NATIVE_MODULES})), python_tag())
    if stale:
        raise NotUsable(f"they do not match the sources ({', '.join(stale)})")
    missing = [name for name, file in manifest.files.items() if not (directory / file).is_file()]
    if missing:
        raise NotUsable(f"files are missing ({', '.join(missing)})")
    return manifest


@dataclass(slots=True)
class _Decision:
    decided: bool = False  # install() decides once per process
    finder: _NativeFinder | None = None


_INSTALLED = _Decision()


def install() -> bool:
    """Load the compiled modules from here on, where built for this Python and current with every
    source (see the module's docstring); True if the builds are in use. Decided at the first call
    of a process, the same for every later one: loading builds beside modules of the group already
    imported from source would mix two copies of the same classes, so then it stays from source."""
    if _INSTALLED.decided:
        return _INSTALLED.finder is not None
    _INSTALLED.decided = True
    if os.environ.get(ENV_SWITCH, "1") == "0" or any(name in sys.modules for name in NATIVE_MODULES):
        return False
    # Resolved: a rebuild swaps the link, and this process keeps to the build it checked.
    directory = native_dir().resolve()
    try:
        manifest = usable_build(directory)
    except FileNotFoundError:
        return False  # not built: from source
    except NotUsable as exc:
        logger.warning(
            "ignoring the compiled modules in %s: %s; running from source; rebuild with `%s`", directory, exc, REBUILD
        )
        return False
    _INSTALLED.finder = _NativeFinder({name: directory / file for name, file in manifest.files.items()})
    sys.meta_path.insert(0, _INSTALLED.finder)
    return True


def active() -> dict[str, bool]:
    """For each module of the compiled set already imported, whether it runs compiled."""
    return {
        name: module.__file__ is not None and not module.__file__.endswith(".py")
        for name in NATIVE_MODULES
        if (module := sys.modules.get(name)) is not None
    }


def build(directory: Path | None = None) -> Manifest:
    """Compile `NATIVE_MODULES` with mypyc (it needs mypy, setuptools and a C compiler: the `dev`
    extra and the system's cc) and point `directory` (default `native_dir()`) at the build once the
    whole build succeeded. Returns its manifest. Raises RuntimeError, saying what is missing,
    where it cannot build."""
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            f"building the compiled modules needs mypy and setuptools ({exc}): install the dev extra"
        ) from exc
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(f"building the compiled modules needs a C compiler ({compiler}): install gcc")
    link = directory if directory is not None else native_dir()
    link.parent.mkdir(parents=True, exist_ok=True)
    with (link.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time per directory
        manifest = _build_into(mypycify, Distribution, link)
    return manifest


def _build_into(mypycify: Any, distribution_class: Any, link: Path) -> Manifest:
    """Compile into a new directory beside `link`, then point `link` at it in one step (a process
    starting meanwhile sees the old build or the new one, never none), and remove the builds
    older than the one it replaced."""
    sources = build_sources()
    before = digests(sources)
    version = link.parent / f"{link.name}.{int(time.time())}-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="gpufaas-native-", dir=link.parent) as tmp:
        work = Path(tmp)
        paths = [str(source_path(name).relative_to(ROOT)) for name in NATIVE_MODULES]
        cwd = Path.cwd()
        os.chdir(ROOT)  # mypyc names the modules by their paths from here
        try:
            extensions = mypycify(paths, opt_level="3", target_dir=str(work / "c"), group_name=GROUP)
            distribution = distribution_class({"name": GROUP, "ext_modules": extensions})
            distribution.script_args = ["-q", "build_ext", "--build-lib", str(work / "lib"), "--build-temp", tmp]
            distribution.parse_command_line()
            distribution.run_commands()
        finally:
            os.chdir(cwd)
        if digests(sources) != before:
            raise RuntimeError("a source changed during the build: build again")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        files = {name: str(Path(*name.split(".")).with_suffix("")) + suffix for name in NATIVE_MODULES}
        files[LIBRARY] = f"{LIBRARY}{suffix}"
        absent = [file for file in files.values() if not (work / "lib" / file).is_file()]
        if absent:
            raise RuntimeError(f"mypyc's build did not write {', '.join(absent)}")
        manifest = Manifest(python=python_tag(), modules=before, files=files)
        (work / "lib" / MANIFEST).write_text(manifest.to_json())
        (work / "lib").rename(version)
    previous = link.resolve() if link.is_symlink() else None
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)  # a build of before the links
    pointer = link.parent / f"{link.name}.link-{os.getpid()}"
    pointer.unlink(missing_ok=True)
    pointer.symlink_to(version.name)
    os.replace(pointer, link)
    for old in link.parent.glob(f"{link.name}.*"):
        # Keep the new build and the one it replaced (a process running may still import from it).
        if old.is_dir() and not old.is_symlink() and old not in (version, previous):
            shutil.rmtree(old, ignore_errors=True)
    return manifest


def current_build(directory: Path | None = None) -> Manifest | None:
    """The build in `directory` (default `native_dir()`) if it may be loaded (`usable_build`); else None."""
    try:
        return usable_build((directory if directory is not None else native_dir()).resolve())
    except (FileNotFoundError, NotUsable):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gpufaas.native build [--force] | status`: build compiles (unless the build there
    matches every source already, or with --force); status says what runs compiled."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "status"
    if command == "build":
        if "--force" not in args and current_build() is not None:
            print(f"the compiled modules in {native_dir()} match the sources: nothing to build")
            return 0
        try:
            manifest = build()
        except RuntimeError as exc:
            print(f"gpufaas.native: {exc}", file=sys.stderr)
            return 1
        print(f"compiled {len(manifest.files) - 1} modules into {native_dir()}")
        return 0
    if command == "status":
        used = install()
        for name in NATIVE_MODULES:
            importlib.import_module(name)
        state = active()
        print(f"{native_dir()}: {'in use' if used else 'not in use'}")
        for name, compiled in sorted(state.items()):
            print(f"  {name}: {'compiled' if compiled else 'from source'}")
        return 0
    print("usage: python -m gpufaas.native build [--force] | status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    # Through the imported module, not this `__main__` copy: the packages' install() calls and
    # status's must share one decision.
    from gpufaas.native import main as imported_main

    raise SystemExit(imported_main())
