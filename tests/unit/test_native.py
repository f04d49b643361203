"""The compiled decision core (gpufaas.native): a build is used only while it matches every source,
it is switched off by GPUFAAS_NATIVE=0, and the simulator decides alike compiled and from source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufaas import native
from gpufaas.native import NATIVE_MODULES, Manifest, current_build, python_tag, stale_modules

REPO = Path(__file__).resolve().parents[2]
BUILT = current_build() is not None
# CI builds the modules (scripts/setup.sh): there the tests that need a build must not skip.
needs_build = pytest.mark.skipif(
    not BUILT and os.environ.get("CI") != "true", reason="not built: python -m gpufaas.native build"
)

# Four runs of the simulator that between them reach every compiled module's branches that the
# shipped trace can: the policies, D > 1 with interference and adaptive D, host tiers with the
# staged exit and swap-ins, and shared host links.
SIMULATE = """
import json, sys
from dataclasses import asdict
from gpufaas import native
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_azure2019

workload = build_workload(
    load_azure2019(shipped_trace()), WorkloadConfig(minutes=4, working_set=50, rpm=1500, slo_factor=3.0), paper_table1()
)
runs = [
    ("lalb-o3", ClusterConfig(gpus=6)),
    ("lalb", ClusterConfig(gpus=6, host_memory_mb=8192, gpu_idle_release_s=5.0, host_idle_release_s=10.0)),
    ("mqfq-sticky", ClusterConfig(gpus=6, slots=2, host_memory_mb=16384, interference=0.5, adaptive_slots=4)),
    ("torpor", ClusterConfig(gpus=6, host_memory_mb=16384, gpus_per_link=2)),
]
results = [asdict(simulate(workload, policy, cluster=cluster)) for policy, cluster in runs]
print(json.dumps(native.active()))
print(json.dumps(results, sort_keys=True))  # compared as text: 0 and 0.0 differ there
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


def manifest_for(modules: dict[str, str], python: str | None = None) -> Manifest:
    files = {name: name.replace(".", "/") + ".so" for name in (*NATIVE_MODULES, native.LIBRARY)}
    return Manifest(python=python or python_tag(), modules=modules, files=files)


def imports_and_reports(module: str) -> str:
    """Code that imports `module` (so its package's install() runs) and prints which of the group run compiled."""
    return f"import {module}, json; from gpufaas import native; print(json.dumps(native.active()))"


def import_beside_build(tmp_path: Path, manifest_text: str, module: str) -> subprocess.CompletedProcess[str]:
    """`imports_and_reports(module)` in a new process whose build directory holds only a manifest
    of `manifest_text`."""
    directory = tmp_path / native.native_dir().name
    directory.mkdir()
    (directory / native.MANIFEST).write_text(manifest_text)
    return run_python(imports_and_reports(module), GPUFAAS_NATIVE_DIR=str(tmp_path), GPUFAAS_NATIVE="1")


def test_a_build_matches_only_the_sources_it_was_compiled_from() -> None:
    current = {"scheduler.state": "a", "scheduler.core": "b"}
    assert stale_modules(manifest_for(dict(current)), current, python_tag()) == []
    changed = manifest_for({**current, "scheduler.core": "old"})
    assert stale_modules(changed, current, python_tag()) == ["scheduler.core"]
    # A module added to the compiled set since the build, or one gone from it, makes it stale too.
    assert stale_modules(manifest_for({"scheduler.state": "a"}), current, python_tag()) == ["scheduler.core"]
    assert stale_modules(manifest_for(current), {"scheduler.state": "a"}, python_tag()) == ["scheduler.core"]
    # Built for another interpreter: nothing of it is usable.
    assert stale_modules(manifest_for(current), current, "cpython-312.so") == ["scheduler.core", "scheduler.state"]


def test_the_manifest_round_trips_through_its_json() -> None:
    manifest = manifest_for({"scheduler.state": "a"})
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_a_stale_build_is_not_loaded_and_says_how_to_rebuild(tmp_path: Path) -> None:
    digests = native.digests(NATIVE_MODULES)
    digests["scheduler.state"] = "0" * 64  # compiled from another source than the one here
    result = import_beside_build(tmp_path, manifest_for(digests).to_json(), "scheduler.state")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {False}  # the whole group: they share one library
    assert "do not match the sources (scheduler.state)" in result.stderr
    assert "python -m gpufaas.native build" in result.stderr


def test_without_a_build_everything_runs_from_source_silently(tmp_path: Path) -> None:
    result = run_python(imports_and_reports("simulator.engine"), GPUFAAS_NATIVE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {False}
    assert result.stderr == ""


@needs_build
def test_every_module_of_the_set_runs_compiled_where_built() -> None:
    code = "import json, importlib; from gpufaas import native\n"
    code += "[importlib.import_module(m) for m in native.NATIVE_MODULES]; print(json.dumps(native.active()))"
    result = run_python(code, GPUFAAS_NATIVE="1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == dict.fromkeys(NATIVE_MODULES, True)
    switched_off = run_python(code, GPUFAAS_NATIVE="0")
    assert json.loads(switched_off.stdout) == dict.fromkeys(NATIVE_MODULES, False)


@needs_build
def test_the_simulator_decides_alike_compiled_and_from_source() -> None:
    compiled, source = (run_python(SIMULATE, GPUFAAS_NATIVE=switch) for switch in ("1", "0"))
    assert compiled.returncode == 0, compiled.stderr
    assert source.returncode == 0, source.stderr
    (compiled_active, compiled_results), (source_active, source_results) = (
        out.stdout.splitlines() for out in (compiled, source)
    )
    assert set(json.loads(compiled_active).values()) == {True}
    assert set(json.loads(source_active).values()) == {False}
    assert compiled_results == source_results
    # Every call completed or timed out waiting (1,500 rpm on 6 GPUs: some do), compiled as from source.
    outcomes = [(r["completed"], r["timed_out"], r["requests"]) for r in json.loads(compiled_results)]
    assert all(completed > 0 and completed + timed_out == requests for completed, timed_out, requests in outcomes)
    assert any(timed_out for _, timed_out, _ in outcomes)


def test_a_damaged_manifest_is_ignored_with_a_warning(tmp_path: Path) -> None:
    result = import_beside_build(tmp_path, '{"python": "x"', "scheduler.state")  # cut short
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {False}
    assert "ignoring the compiled modules" in result.stderr and "python -m gpufaas.native build" in result.stderr


def test_a_build_depends_on_what_its_modules_import_directly_or_not(tmp_path: Path) -> None:
    for name, text in {
        "gpufaas/__init__.py": "",
        "gpufaas/types.py": "from gpufaas.errors import Oops\n",
        "gpufaas/errors.py": "class Oops(Exception): ...\n",
        "gpufaas/unused.py": "",
        "scheduler/__init__.py": "",
        "scheduler/core.py": "import json\n\ndef f():\n    from gpufaas.types import Request\n",
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    got = native.build_sources(["scheduler.core"], root=tmp_path)
    assert got == ["gpufaas", "gpufaas.errors", "gpufaas.types", "scheduler.core"]
    # And the real set: what the compiled code checks values against is in it, the gateway is not.
    sources = native.build_sources()
    assert {"gpufaas.types", "scheduler.policies.base", *NATIVE_MODULES} <= set(sources)
    assert not any(name.startswith(("gateway", "gpu_manager")) for name in sources)
    assert "gpufaas.native" not in sources


def test_a_build_is_stale_when_a_module_it_imports_changed(tmp_path: Path) -> None:
    digests = native.digests(native.build_sources())
    digests["gpufaas.types"] = "0" * 64  # Request's fields as they were when built
    result = import_beside_build(tmp_path, manifest_for(digests).to_json(), "scheduler.core")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {False}
    assert "do not match the sources (gpufaas.types)" in result.stderr


@needs_build
def test_the_choice_is_made_once_a_process_and_never_mixes_builds_with_sources() -> None:
    # From source at the first import; the switch turned on later changes nothing (loading the
    # builds beside modules of the group already imported would mix two copies of its classes).
    code = "import os, json, scheduler\nos.environ['GPUFAAS_NATIVE'] = '1'\nimport simulator.engine\n"
    code += "from gpufaas import native\nprint(json.dumps([native.install(), native.active()]))"
    result = run_python(code, GPUFAAS_NATIVE="0")
    assert result.returncode == 0, result.stderr
    installed, active = json.loads(result.stdout)
    assert installed is False
    assert set(active.values()) == {False} and "simulator.engine" in active
