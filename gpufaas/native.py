"""Compiled builds of the decision core: mypyc builds of the modules every placement and every
simulated event runs through, loaded in place of their sources while they match them.

The modules in `NATIVE_MODULES` are ordinary, fully typed Python. `python -m gpufaas.native build`
(scripts/setup.sh runs it) compiles them with mypyc into `native_dir()`, next to a manifest of the
SHA-256 of each source it compiled. `install()`, called by the packages that hold them
(scheduler, cache_manager, simulator) before they import anything, puts a finder in front of the
import system that loads those builds, but only when every compiled source is unchanged since the
build: one edited file makes the whole group stale (they share one library), and then everything
runs from source, with one warning naming the rebuild command. Not built, or `GPUFAAS_NATIVE=0`:
everything runs from source, silently. The two decide alike; tests/unit/test_native.py runs the
simulator both ways and compares.

Why mypyc and these modules: the simulator replays a trace through the scheduler's real objects,
and one scheduler process places every call of the cluster. Both spend their time in plain Python
over dicts, heaps and small objects, which mypyc turns into direct C calls and native attribute
reads without a change to the code (docs/scheduler-throughput.md has the figures).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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
GROUP = "gpufaas_native"  # the shared library's name: `<GROUP>__mypyc`
MANIFEST = "manifest.json"
ENV_SWITCH = "GPUFAAS_NATIVE"  # "0": run from source even where built
ENV_DIR = "GPUFAAS_NATIVE_DIR"  # where the builds live (default: native_dir())
REBUILD = "python -m gpufaas.native build"
ROOT = Path(__file__).resolve().parent.parent  # the directory holding the packages


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one build compiled: each module's source digest and the file of its build (relative
    to the build directory), and the Python it was built for."""

    python: str
    modules: Mapping[str, str]  # module -> SHA-256 of its source when built
    files: Mapping[str, str]  # module (and the group's library) -> its extension, relative

    def to_json(self) -> str:
        return json.dumps(
            {"python": self.python, "modules": dict(self.modules), "files": dict(self.files)}, indent=2, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
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


def source_path(module: str, root: Path = ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


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


@dataclass(slots=True)
class _Installed:
    finder: _NativeFinder | None = None
    warned: bool = False  # the staleness warning, once a process


_INSTALLED = _Installed()


def install() -> bool:
    """Load the compiled modules from here on, where built for this Python and current with every
    source (see the module's docstring). Idempotent; True if the builds are in use. Call it before
    any of `NATIVE_MODULES` is imported: one already imported stays as it is."""
    if _INSTALLED.finder is not None:
        return True
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    directory = native_dir()
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return False  # not built: from source
    except MANIFEST_ERRORS as exc:
        logger.warning("ignoring the compiled modules in %s (%s): rebuild with `%s`", directory, exc, REBUILD)
        return False
    stale = stale_modules(manifest, digests(NATIVE_MODULES), python_tag())
    paths = {name: directory / file for name, file in manifest.files.items()}
    missing = [name for name, path in paths.items() if not path.is_file()]
    if stale or missing:
        if not _INSTALLED.warned:
            _INSTALLED.warned = True
            logger.warning(
                "the compiled modules in %s do not match the sources (%s): running from source; rebuild with `%s`",
                directory,
                ", ".join(stale or missing),
                REBUILD,
            )
        return False
    _INSTALLED.finder = _NativeFinder(paths)
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
    extra and the system's cc) into `directory` (default `native_dir()`), replacing what was
    there only once the whole build succeeded. Returns its manifest. Raises RuntimeError, saying
    what is missing, where it cannot build."""
    import shutil
    import tempfile

    try:
        from mypyc.build import mypycify
        from setuptools import Distribution  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            f"building the compiled modules needs mypy and setuptools ({exc}): pip install mypy"
        ) from exc
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(f"building the compiled modules needs a C compiler ({compiler}): install gcc")
    target = directory if directory is not None else native_dir()
    before = digests(NATIVE_MODULES)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpufaas-native-", dir=target.parent) as tmp:
        work = Path(tmp)
        out = work / "lib"
        paths = [str(source_path(name).relative_to(ROOT)) for name in NATIVE_MODULES]
        cwd = Path.cwd()
        os.chdir(ROOT)  # mypyc names the modules by their paths from here
        try:
            extensions = mypycify(paths, opt_level="3", target_dir=str(work / "c"), group_name=GROUP)
            distribution = Distribution({"name": GROUP, "ext_modules": extensions})
            distribution.script_args = ["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(work / "tmp")]
            distribution.parse_command_line()
            distribution.run_commands()
        finally:
            os.chdir(cwd)
        if digests(NATIVE_MODULES) != before:
            raise RuntimeError("a compiled module's source changed during the build: build again")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        files = {name: str(Path(*name.split(".")).with_suffix("")) + suffix for name in NATIVE_MODULES}
        files[f"{GROUP}__mypyc"] = f"{GROUP}__mypyc{suffix}"
        absent = [file for file in files.values() if not (out / file).is_file()]
        if absent:
            raise RuntimeError(f"mypyc's build did not write {', '.join(absent)}")
        manifest = Manifest(python=python_tag(), modules=before, files=files)
        (out / MANIFEST).write_text(manifest.to_json())
        old = work / "old"
        if target.exists():
            target.rename(old)  # (a process that loaded the old build keeps its mapped files)
        out.rename(target)
    return manifest


def current_build(directory: Path | None = None) -> Manifest | None:
    """The build in `directory` (default `native_dir()`) if it matches every source; else None."""
    try:
        manifest = read_manifest(directory if directory is not None else native_dir())
    except MANIFEST_ERRORS:
        return None
    return None if stale_modules(manifest, digests(NATIVE_MODULES), python_tag()) else manifest


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
        print(f"compiled {len(manifest.modules)} modules into {native_dir()}")
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
    raise SystemExit(main())
