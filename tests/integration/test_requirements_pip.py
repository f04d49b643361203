"""Function requirements against real pip and the package indexes this machine's pip configuration reaches.

The packages are small, pure Python, absent from the project's environment, and published with several
versions both on PyPI and on the local indexes of the project's machines (pip.conf's extra-index-url),
so the tests pass whichever of the two answers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gpufaas.requirements import (
    Layer,
    LayerCache,
    UnresolvableRequirements,
    base_environment,
    pip_runner,
    resolve,
)

pytestmark = pytest.mark.integration

ONE_PIN_PACKAGE = "more-itertools"  # no dependencies
ONE_PIN_MODULE = "more_itertools"
ONE_PIN_VERSION = "10.8.0"
TWO_VERSION_PACKAGE = "tabulate"  # no dependencies; both versions publish a py3-none-any wheel
TWO_VERSION_MODULE = "tabulate"
TWO_VERSIONS = ("0.8.10", "0.10.0")
# Depends on h11, which the project's environment has (for httpx and uvicorn): it must come
# from the base, not the layer.
WITH_BASE_DEPENDENCIES = "wsproto==1.3.2"
WITH_BASE_DEPENDENCIES_MODULE = "wsproto"
BASE_PACKAGE = "idna"  # in the project's environment (a dependency of httpx)
MISSING_PACKAGE = "gpufaas-no-such-package-zzz"


@pytest.fixture(scope="module")
def base() -> dict[str, str]:
    environment = base_environment()
    for module in (ONE_PIN_MODULE, TWO_VERSION_MODULE, WITH_BASE_DEPENDENCIES_MODULE):
        assert importlib.util.find_spec(module) is None, f"{module} is installed: the test would not see the layer"
    assert BASE_PACKAGE in environment
    return environment


def import_with_layer(layer_dir: Path, module: str) -> tuple[str, Path]:
    """(module.__version__, module.__file__) in a fresh interpreter with `layer_dir` first on sys.path,
    as a function's worker runs (-I: no current directory, PYTHONPATH or user site on the path)."""
    code = (
        f"import sys; sys.path.insert(0, {str(layer_dir)!r}); import {module} as m; "
        "print(m.__version__); print(m.__file__)"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    version, file = done.stdout.split()
    return version, Path(file)


def test_a_package_absent_from_the_base_resolves_into_a_layer_a_worker_can_import(
    base: dict[str, str], tmp_path: Path
) -> None:
    run = pip_runner()
    layer = resolve([f"{ONE_PIN_PACKAGE}=={ONE_PIN_VERSION}"], base, run=run)
    assert layer.pins == (f"{ONE_PIN_PACKAGE}=={ONE_PIN_VERSION}",)

    cache = LayerCache(tmp_path / "layers", run=run)
    assert layer.python == cache.python
    path = asyncio.run(cache.ensure(layer))
    assert path == cache.path_for(layer)
    version, file = import_with_layer(path, ONE_PIN_MODULE)
    assert version == ONE_PIN_VERSION
    assert file.is_relative_to(path)
    assert list(path.rglob("*.pyc")), "the layer ships its bytecode"


def test_dependencies_the_base_has_are_shared_not_installed_again(base: dict[str, str], tmp_path: Path) -> None:
    run = pip_runner()
    layer = resolve([WITH_BASE_DEPENDENCIES], base, run=run)
    assert layer.pins == (WITH_BASE_DEPENDENCIES,)  # not h11

    path = asyncio.run(LayerCache(tmp_path / "layers", run=run).ensure(layer))
    code = (
        f"import sys; sys.path.insert(0, {str(path)!r}); import {WITH_BASE_DEPENDENCIES_MODULE}, h11; "
        "print(h11.__file__)"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).is_relative_to(path)


def test_two_versions_of_one_package_install_side_by_side(base: dict[str, str], tmp_path: Path) -> None:
    run = pip_runner()
    cache = LayerCache(tmp_path / "layers", run=run)
    layers = [resolve([f"{TWO_VERSION_PACKAGE}=={version}"], base, run=run) for version in TWO_VERSIONS]
    assert layers[0].digest != layers[1].digest

    async def ensure_both() -> list[Path]:
        return await asyncio.gather(*(cache.ensure(layer) for layer in layers))

    paths = asyncio.run(ensure_both())
    for path, version in zip(paths, TWO_VERSIONS, strict=True):
        seen_version, file = import_with_layer(path, TWO_VERSION_MODULE)
        assert seen_version == version
        assert file.is_relative_to(path)


def test_an_unresolvable_name_is_named_in_the_error(base: dict[str, str]) -> None:
    with pytest.raises(UnresolvableRequirements) as info:
        resolve([f"{TWO_VERSION_PACKAGE}=={TWO_VERSIONS[0]}", MISSING_PACKAGE], base, run=pip_runner())
    assert info.value.packages == (MISSING_PACKAGE,)
    assert MISSING_PACKAGE in str(info.value)
    assert len(str(info.value).splitlines()) == 2


def test_conflicting_pins_are_named_in_the_error(base: dict[str, str]) -> None:
    requirements = [f"{TWO_VERSION_PACKAGE}=={version}" for version in TWO_VERSIONS]
    with pytest.raises(UnresolvableRequirements, match="conflicting dependencies") as info:
        resolve(requirements, base, run=pip_runner())
    assert set(info.value.packages) == set(requirements)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_base_package_the_base_satisfies_yields_the_empty_layer(
    base: dict[str, str], tmp_path: Path, pinned: bool
) -> None:
    requirement = f"{BASE_PACKAGE}=={base[BASE_PACKAGE]}" if pinned else BASE_PACKAGE
    run = pip_runner()
    layer = resolve([requirement], base, run=run)
    assert layer.empty
    assert layer == Layer((), layer.python)
    path = asyncio.run(LayerCache(tmp_path / "layers", run=run).ensure(layer))
    assert list(path.iterdir()) == []
