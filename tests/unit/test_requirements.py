"""Function requirements: parsing requirements.txt, resolving into a layer with a fake pip, installing and caching."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import packaging
import pytest
from packaging.utils import canonicalize_name

from gpufaas.errors import GpufaasError
from gpufaas.requirements import (
    MAX_REQUIREMENTS,
    Layer,
    LayerCache,
    RequirementsError,
    UnresolvableRequirements,
    base_environment,
    install,
    parse_requirements,
    pip_runner,
    python_tag,
    resolve,
)

PYTHON = "cp311-x86_64"
ENVIRONMENT = {  # the "environment" of a pip report, as pip 23.2 writes it on this kind of machine
    "implementation_name": "cpython",
    "implementation_version": "3.11.7",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "6.1.0",
    "platform_system": "Linux",
    "platform_version": "#1 SMP PREEMPT_DYNAMIC",
    "python_full_version": "3.11.7",
    "platform_python_implementation": "CPython",
    "python_version": "3.11",
    "sys_platform": "linux",
}
# pip 23.2's output lines that precede every failure on this kind of machine.
LOOKING = "Looking in indexes: https://pypi.org/simple, file:///opt/pypi/simple\nLooking in links: /opt/wheels\n"


def make_report(*installs: tuple[str, str], environment: dict[str, str] | None = None) -> dict[str, object]:
    """A pip installation report (format version 1) that would install (name, version) pairs."""
    return {
        "version": "1",
        "pip_version": "23.2.1",
        "install": [
            {
                "download_info": {
                    "url": f"https://files.example/{name}-{version}-py3-none-any.whl",
                    "archive_info": {"hash": "sha256=00", "hashes": {"sha256": "00"}},
                },
                "is_direct": False,
                "requested": True,
                "metadata": {"metadata_version": "2.1", "name": name, "version": version},
            }
            for name, version in installs
        ],
        "environment": environment if environment is not None else ENVIRONMENT,
    }


class FakePip:
    """A PipRunner playing pip's part: records each argv and the -r/-c files' text at call time; a dry run
    writes `report` to --report; a --target install writes a module and a .dist-info for each pin (or
    `installs`, when given). Fails with (returncode, stdout, stderr) when returncode is not 0; "{requirements}"
    in the output stands for the -r file's path, as pip prints it."""

    def __init__(
        self,
        *,
        report: object | None = None,
        returncode: int = 0,
        stdout: str = "",
        stderr: str = "",
        installs: Sequence[str] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.report = report if report is not None else make_report()
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.installs = installs
        self.gate = gate  # when set, the call waits for it (a slow pip)
        self.calls: list[list[str]] = []
        self.files: dict[str, str] = {}
        self.timeouts_s: list[float] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
        argv = list(argv)
        self.calls.append(argv)
        self.timeouts_s.append(timeout_s)
        if self.gate is not None:
            assert self.gate.wait(5), "the test never opened the gate"
        requirements_path = argv[argv.index("-r") + 1] if "-r" in argv else ""
        for flag in ("-r", "-c"):
            if flag in argv:
                self.files[flag] = Path(argv[argv.index(flag) + 1]).read_text()
        if self.returncode != 0:
            return (
                self.returncode,
                self.stdout.replace("{requirements}", requirements_path),
                self.stderr.replace("{requirements}", requirements_path),
            )
        if "--report" in argv:
            Path(argv[argv.index("--report") + 1]).write_text(json.dumps(self.report))
        if "--target" in argv:
            target = Path(argv[argv.index("--target") + 1])
            pins = self.installs if self.installs is not None else [a for a in argv if "==" in a]
            for pin in pins:
                name, version = pin.split("==")
                module = name.replace("-", "_")
                (target / f"{module}.py").write_text(f"VERSION = {version!r}\n")
                info = target / f"{module}-{version}.dist-info"
                info.mkdir()
                (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        return 0, self.stdout, self.stderr


def layer_of(*pins: str, python: str = PYTHON) -> Layer:
    return Layer(tuple(sorted(pins)), python)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# --- parse_requirements ---------------------------------------------------------------------------------


def test_comments_blank_lines_and_continuations_are_removed_and_lines_normalized() -> None:
    text = (
        "\ufeff# the function's dependencies\r\n"
        "\n"
        "tabulate >= 0.8 , < 1   # tables\n"
        "   \n"
        "more_itertools\\\n"
        "==10.8.0\n"
        "# a comment ending in a backslash does not continue \\\n"
        "Wcwidth[extra1] ; python_version >= '3.8'\n"
        "numpy==2.0.0\t#pinned\n"
    )
    assert parse_requirements(text) == [
        "tabulate<1,>=0.8",
        "more_itertools==10.8.0",
        'Wcwidth[extra1]; python_version >= "3.8"',
        "numpy==2.0.0",
    ]


def test_an_empty_file_has_no_requirements() -> None:
    assert parse_requirements("") == []
    assert parse_requirements("# nothing\n\n   \n") == []


def test_a_whole_line_comment_ends_a_continuation_as_pip_reads_it() -> None:
    # pip's join_lines puts a space before a comment line it joins, so the comment is still removed.
    assert parse_requirements("tabulate\\\n# the table printer\nwcwidth\n") == ["tabulate", "wcwidth"]
    assert parse_requirements("tabulate\\\\\n==0.9\n") == ["tabulate==0.9"]  # pip strips every "\\"


def test_a_continuation_on_the_last_line_is_kept() -> None:
    assert parse_requirements("tabulate\\") == ["tabulate"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-r other.txt", "'-r' is a pip option"),
        ("--requirement other.txt", "'--requirement' is a pip option"),
        ("-c constraints.txt", "'-c' is a pip option"),
        ("-e .", "'-e' is a pip option"),
        ("--index-url https://evil.example/simple", "'--index-url' is a pip option"),
        ("--extra-index-url=https://evil.example/simple", "'--extra-index-url' is a pip option"),
        ("-f /tmp/wheels", "'-f' is a pip option"),
        ("--trusted-host evil.example", "'--trusted-host' is a pip option"),
        ("https://evil.example/pkg-1.0-py3-none-any.whl", "URL, path or VCS link"),
        ("git+https://github.com/owner/repo@main#egg=repo", "URL, path or VCS link"),
        ("./vendored/pkg", "URL, path or VCS link"),
        ("/opt/pkg", "URL, path or VCS link"),
        ("~/pkg", "URL, path or VCS link"),
        ("pkg-1.0-py3-none-any.whl", "URL, path or VCS link"),
        ("pkg-1.0.tar.gz", "URL, path or VCS link"),
        ("pkg-1.0.tlz", "URL, path or VCS link"),  # pip's archives include .tlz and .tar.lzma
        ("pkg-1.0.tar.lzma", "URL, path or VCS link"),
        # '===' takes any string: pip reads the whole part before ';' as a path when it looks like one.
        ("pkg===wheels/pkg-1.0-py3-none-any.whl", "URL, path or VCS link"),
        ("pkg===pkg-1.0.tar.gz; python_version >= '3'", "URL, path or VCS link"),
        ("vendored/pkg", "URL, path or VCS link"),
        ("file:pkg.zip", "URL, path or VCS link"),
        ("pkg @ https://evil.example/pkg.whl", "URL, path or VCS link"),
        ("pkg@file:pkg", "direct reference"),
        ("pkg==1.0 --hash=sha256:0123abcd", "per-requirement options such as --hash"),
        ("pkg==${PKG_VERSION}", "environment variable"),
        ("pkg==", "is not a valid requirement"),
        ("two words", "is not a valid requirement"),
        ("pkg#no-space-before-the-hash", "is not a valid requirement"),
        ("pkg>=1; os_name == 'a -b'", "starting with '-'"),
    ],
)
def test_lines_that_are_not_plain_requirements_are_refused_with_their_line_number(line: str, message: str) -> None:
    with pytest.raises(RequirementsError, match="line 3") as info:
        parse_requirements(f"tabulate\n# fine\n{line}\nwcwidth\n")
    assert message in str(info.value)
    assert isinstance(info.value, GpufaasError)


def test_a_continued_line_is_reported_at_its_first_physical_line() -> None:
    text = "tabulate\nwcwidth==0.2 \\\n    --hash=sha256:0123\n"
    with pytest.raises(RequirementsError, match="line 2: per-requirement options"):
        parse_requirements(text)


def test_at_most_max_requirements_are_accepted() -> None:
    names = [f"pkg{i}" for i in range(MAX_REQUIREMENTS + 1)]
    assert len(parse_requirements("\n".join(names[:MAX_REQUIREMENTS]))) == MAX_REQUIREMENTS
    with pytest.raises(RequirementsError, match=f"more than {MAX_REQUIREMENTS} requirements"):
        parse_requirements("\n".join(names))


# --- the base environment and the interpreter -----------------------------------------------------------


def test_base_environment_maps_canonical_names_to_installed_versions() -> None:
    base = base_environment()
    assert base["packaging"] == packaging.__version__
    assert "pytest" in base
    assert all(name == canonicalize_name(name) for name in base)


def test_python_tag_names_implementation_version_and_machine() -> None:
    implementation, machine = python_tag().split("-", 1)
    assert implementation == f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert machine and machine == machine.lower()


# --- Layer ----------------------------------------------------------------------------------------------


def test_the_layer_digest_is_stable_across_releases() -> None:
    # A layer's digest names its directory on every node: changing its formula orphans every cache.
    layer = Layer(("tabulate==0.8.10", "wcwidth==0.2.13"), PYTHON)
    assert layer.to_json() == b'{"pins":["tabulate==0.8.10","wcwidth==0.2.13"],"python":"cp311-x86_64"}'
    assert layer.digest == "sha256:e41f7b3c33eb5c5271f22a3286153e400196a39714da206525ccef1281de6b8c"


def test_the_digest_depends_on_pins_and_python() -> None:
    layer = layer_of("tabulate==0.8.10")
    assert layer.digest == layer_of("tabulate==0.8.10").digest
    assert layer.digest != layer_of("tabulate==0.10.0").digest
    assert layer.digest != layer_of("tabulate==0.8.10", python="cp312-x86_64").digest


def test_a_layer_round_trips_through_json() -> None:
    layer = layer_of("tabulate==0.8.10", "torch==2.13.0+cpu")
    assert Layer.from_json(layer.to_json()) == layer
    assert Layer.from_json(layer.to_json().decode()) == layer
    assert Layer.from_json(Layer((), PYTHON).to_json()).empty


def test_empty_means_no_pins() -> None:
    assert Layer((), PYTHON).empty
    assert not layer_of("tabulate==0.8.10").empty


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "must be an object"),
        (b'{"pins": []}', "must be an object"),
        (b'{"pins": [], "python": "cp311-x86_64", "more": 1}', "must be an object"),
        (b'{"pins": "tabulate==1", "python": "cp311-x86_64"}', "must be an object"),
        (b'{"pins": [], "python": "python3"}', "is not of the form 'cp311-x86_64'"),
        (b'{"pins": [], "python": 311}', "is not of the form 'cp311-x86_64'"),
        (b'{"pins": ["Tabulate==1.0"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["more_itertools==1.0"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["tabulate>=1.0"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["--index-url==1"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["tabulate==--pre"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["tabulate==1.0 --hash"], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": [7], "python": "cp311-x86_64"}', "canonical-name==version"),
        (b'{"pins": ["wcwidth==1", "tabulate==1"], "python": "cp311-x86_64"}', "not sorted"),
        (b'{"pins": ["tabulate==1", "tabulate==2"], "python": "cp311-x86_64"}', "one pin per name"),
    ],
)
def test_a_malformed_layer_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(RequirementsError, match="layer") as info:
        Layer.from_json(data)
    assert message in str(info.value)


# --- resolve --------------------------------------------------------------------------------------------

BASE = {"idna": "3.20", "numpy": "2.0.0", "torch": "2.13.0+cpu", "typing-extensions": "4.16.0", "legacy": "dev"}


def test_resolve_runs_a_dry_run_that_installs_only_wheels() -> None:
    pip = FakePip(report=make_report(("tabulate", "0.8.10")))
    resolve(["tabulate==0.8.10"], BASE, run=pip, timeout_s=42)
    [argv] = pip.calls
    assert argv[0] == "install"
    for flag in ("--dry-run", "--ignore-installed", "--only-binary=:all:", "--no-input", "--report", "-r", "-c"):
        assert flag in argv
    assert pip.timeouts_s == [42]
    assert pip.files["-r"] == "tabulate==0.8.10\n"


def test_constraints_pin_the_base_except_what_the_requirements_move_away_from() -> None:
    pip = FakePip()
    requirements = [
        "numpy==2.1.0",  # excludes the base's 2.0.0: the function gets its own numpy
        "torch>=2.3",  # the base's 2.13.0+cpu satisfies it: stays pinned, never pulled in again
        "IDNA; python_version < '3'",  # a marker that does not hold here: as if not named
        "tabulate",
    ]
    resolve(requirements, BASE, run=pip)
    # "legacy" has no PEP 440 version: pip would refuse the whole constraints file over it.
    assert pip.files["-c"] == "idna==3.20\ntorch==2.13.0+cpu\ntyping-extensions==4.16.0\n"


def test_base_names_are_compared_canonically() -> None:
    pip = FakePip()
    resolve(["Typing_Extensions>=5"], {"typing_extensions": "4.16.0", "Py.YAML": "6.0"}, run=pip)
    assert pip.files["-c"] == "py-yaml==6.0\n"


def test_the_layer_is_what_pip_would_install_minus_the_base_versions() -> None:
    report = make_report(
        ("tabulate", "0.8.10"),
        ("numpy", "2.1.0"),  # another version than the base's: in the layer
        ("idna", "3.20"),  # the base's version: shared
        ("Typing_Extensions", "4.16"),  # the base's 4.16.0, spelled otherwise: shared
        ("More_Itertools", "10.8.0"),
    )
    layer = resolve(["tabulate==0.8.10", "numpy==2.1.0"], BASE, run=FakePip(report=report))
    assert layer == Layer(("more-itertools==10.8.0", "numpy==2.1.0", "tabulate==0.8.10"), PYTHON)


def test_a_requirement_the_base_satisfies_yields_the_empty_layer() -> None:
    layer = resolve(["torch"], BASE, run=FakePip(report=make_report(("torch", "2.13.0+cpu"))))
    assert layer.empty and layer.python == PYTHON


def test_the_layer_records_the_interpreter_pip_resolved_for() -> None:
    environment = {**ENVIRONMENT, "python_version": "3.12", "platform_machine": "aarch64"}
    report = make_report(("tabulate", "0.8.10"), environment=environment)
    assert resolve(["tabulate"], {}, run=FakePip(report=report)).python == "cp312-aarch64"


def test_no_requirements_resolve_to_the_empty_layer_without_pip() -> None:
    pip = FakePip()
    layer = resolve([], BASE, run=pip)
    assert layer == Layer((), python_tag())
    assert pip.calls == []


def test_resolve_rechecks_its_requirements_before_pip_sees_them() -> None:
    pip = FakePip()
    with pytest.raises(RequirementsError, match="'-r' is a pip option"):
        resolve(["tabulate", "-r /etc/passwd"], BASE, run=pip)
    assert pip.calls == []


def pip_without_report(argv: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
    """A pip that exits 0 but writes no report (one older than 22.2 does not know --report)."""
    return 0, "", ""


@pytest.mark.parametrize(
    "run",
    [
        pip_without_report,
        FakePip(report={"install": [{"metadata": {"name": "tabulate"}}], "environment": ENVIRONMENT}),
        FakePip(report={"install": [], "environment": {"python_version": "3.11"}}),
        FakePip(
            report={"install": [{"metadata": {"name": "x", "version": "not a version"}}], "environment": ENVIRONMENT}
        ),
        FakePip(report=["not", "an", "object"]),
    ],
)
def test_a_missing_or_malformed_report_is_an_error(run: Callable[[Sequence[str], float], tuple[int, str, str]]) -> None:
    with pytest.raises(RequirementsError) as info:
        resolve(["tabulate"], {}, run=run)
    assert not isinstance(info.value, UnresolvableRequirements)


# Realistic pip 23.2 failures, as it prints them with --report and -r on this kind of machine.
NO_SUCH_PACKAGE = (
    "WARNING: Location 'file:///opt/pypi/simple/gpufaas-no-such-package-zzz/' is ignored: it is neither a file "
    "nor a directory.\n"
    "ERROR: Could not find a version that satisfies the requirement gpufaas-no-such-package-zzz (from versions: "
    "none)\n"
    "ERROR: No matching distribution found for gpufaas-no-such-package-zzz\n"
)
NO_SUCH_VERSION = (
    "ERROR: Could not find a version that satisfies the requirement tabulate==9.9 (from versions: 0.7.7, 0.8.9, "
    "0.8.10, 0.9.0, 0.10.0)\n"
    "ERROR: No matching distribution found for tabulate==9.9\n"
)
SOURCE_ONLY = (
    "WARNING: Location 'file:///opt/pypi/simple/docopt/' is ignored: it is neither a file nor a directory.\n"
    "ERROR: Could not find a version that satisfies the requirement docopt (from versions: none)\n"
    "ERROR: No matching distribution found for docopt\n"
)
OTHER_PYTHON = (
    "ERROR: Ignored the following versions that require a different python version: 2.0.0 Requires-Python >=3.12\n"
    "ERROR: Could not find a version that satisfies the requirement futurelib>=2 (from versions: 1.0.0, 1.1.0)\n"
    "ERROR: No matching distribution found for futurelib>=2\n"
)
USER_CONFLICT_STDOUT = (
    LOOKING + "Processing /opt/pypi/files/tabulate-0.8.10-py3-none-any.whl (from -r {requirements} (line 1))\n"
    "\n"
    "The conflict is caused by:\n"
    "    The user requested tabulate==0.8.10\n"
    "    The user requested tabulate==0.10.0\n"
    "\n"
    "To fix this you could try to:\n"
    "1. loosen the range of package versions you've specified\n"
    "2. remove package versions to allow pip attempt to solve the dependency conflict\n"
    "\n"
)
USER_CONFLICT = (
    "ERROR: Cannot install tabulate==0.10.0 and tabulate==0.8.10 because these package versions have conflicting "
    "dependencies.\n"
    "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/"
    "#dealing-with-dependency-conflicts\n"
)
BASE_CONFLICT_STDOUT = (
    LOOKING + "Processing /opt/pypi/files/requests-2.34.2-py3-none-any.whl (from -r {requirements} (line 1))\n"
    "INFO: pip is looking at multiple versions of requests to determine which version is compatible with other "
    "requirements. This could take a while.\n"
    "Collecting requests>=2.32 (from -r {requirements} (line 1))\n"
    "  Downloading requests-2.34.1-py3-none-any.whl (73 kB)\n"
    "\n"
    "The conflict is caused by:\n"
    "    requests 2.34.2 depends on urllib3<3 and >=1.26\n"
    "    requests 2.34.1 depends on urllib3<3 and >=1.26\n"
    "    requests 2.32.5 depends on urllib3<3 and >=1.21.1\n"
    "    The user requested (constraint) urllib3==1.20\n"
    "\n"
    "To fix this you could try to:\n"
    "1. loosen the range of package versions you've specified\n"
    "2. remove package versions to allow pip attempt to solve the dependency conflict\n"
    "\n"
)
BASE_CONFLICT = (
    "WARNING: Location 'file:///opt/pypi/simple/urllib3/' is ignored: it is neither a file nor a directory.\n"
    "ERROR: Cannot install -r {requirements} (line 2) because these package versions have conflicting "
    "dependencies.\n"
    "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/"
    "#dealing-with-dependency-conflicts\n"
)
CONFIGURED_CONSTRAINT_STDOUT = (
    LOOKING + "\nThe conflict is caused by:\n"
    "    The user requested torch>2.14.1\n"
    "    The user requested (constraint) torch<=2.14.1\n"
    "\n"
)
CONFIGURED_CONSTRAINT = (
    "ERROR: Cannot install torch>2.14.1 because these package versions have conflicting dependencies.\n"
    "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/"
    "#dealing-with-dependency-conflicts\n"
)


@pytest.mark.parametrize(
    ("requirements", "stdout", "stderr", "packages", "reason"),
    [
        (
            ["gpufaas-no-such-package-zzz"],
            LOOKING,
            NO_SUCH_PACKAGE,
            ("gpufaas-no-such-package-zzz",),
            "no wheel for this Python on the package indexes: no such package, or it publishes only source",
        ),
        (
            ["tabulate==9.9"],
            LOOKING,
            NO_SUCH_VERSION,
            ("tabulate==9.9",),
            "no version with a wheel for this Python matches (versions found: 0.7.7, 0.8.9, 0.8.10, 0.9.0, 0.10.0)",
        ),
        (["docopt"], LOOKING, SOURCE_ONLY, ("docopt",), "publishes only source distributions"),
        (
            ["futurelib>=2"],
            LOOKING,
            OTHER_PYTHON,
            ("futurelib>=2",),
            "ignored for requiring another Python: 2.0.0 Requires-Python >=3.12",
        ),
        (
            ["tabulate==0.8.10", "tabulate==0.10.0"],
            USER_CONFLICT_STDOUT,
            USER_CONFLICT,
            ("tabulate==0.10.0", "tabulate==0.8.10"),
            "conflicting dependencies: requested tabulate==0.8.10; requested tabulate==0.10.0",
        ),
        (
            ["tabulate", "requests>=2.32"],
            BASE_CONFLICT_STDOUT,
            BASE_CONFLICT,
            ("requests>=2.32",),
            "conflicting dependencies: requests 2.34.2 depends on urllib3<3 and >=1.26; requests 2.34.1 depends on "
            "urllib3<3 and >=1.26; 1 more like these; urllib3==1.20 (the base environment)",
        ),
        (
            ["torch>2.14.1"],
            CONFIGURED_CONSTRAINT_STDOUT,
            CONFIGURED_CONSTRAINT,
            ("torch>2.14.1",),
            "requested torch>2.14.1; torch<=2.14.1 (pip's configured constraints)",
        ),
    ],
)
def test_pip_failures_name_the_packages_and_the_reason(
    requirements: list[str], stdout: str, stderr: str, packages: tuple[str, ...], reason: str
) -> None:
    pip = FakePip(returncode=1, stdout=stdout, stderr=stderr)
    base = {"urllib3": "1.20", "torch": "2.13.0+cpu"}
    with pytest.raises(UnresolvableRequirements) as info:
        resolve(requirements, base, run=pip)
    error = info.value
    assert error.packages == packages
    assert reason in error.reason
    message = str(error)
    assert all(package in message for package in packages)
    assert reason in message
    assert len(message.splitlines()) == 2
    assert "Traceback" not in message and "{requirements}" not in message and "/tmp" not in message


def test_a_conflict_with_the_base_says_how_to_move_away_from_it() -> None:
    pip = FakePip(returncode=1, stdout=BASE_CONFLICT_STDOUT, stderr=BASE_CONFLICT)
    with pytest.raises(UnresolvableRequirements) as info:
        resolve(["tabulate", "requests>=2.32"], {"urllib3": "1.20"}, run=pip)
    advice = str(info.value).splitlines()[1]
    assert "add it to requirements.txt with the version you need" in advice


def test_an_unexpected_failure_falls_back_to_pips_last_error_line() -> None:
    stderr = (
        "WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError'\n"
        "ERROR: Exception:\n"
        "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    )
    with pytest.raises(UnresolvableRequirements) as info:
        resolve(["tabulate", "wcwidth"], {}, run=FakePip(returncode=1, stderr=stderr))
    assert info.value.packages == ("tabulate", "wcwidth")
    assert info.value.reason == "Could not install packages due to an OSError: [Errno 28] No space left on device"


@pytest.mark.parametrize(
    ("returncode", "stderr", "reason"), [(-9, "Killed\n", "Killed"), (2, "", "pip exited with status 2")]
)
def test_a_failure_without_an_error_line_says_what_there_is(returncode: int, stderr: str, reason: str) -> None:
    with pytest.raises(UnresolvableRequirements) as info:
        resolve(["tabulate"], {}, run=FakePip(returncode=returncode, stderr=stderr))
    assert info.value.reason == reason


def test_a_very_long_reason_is_cut() -> None:
    versions = ", ".join(f"0.{i}.0" for i in range(500))
    stderr = (
        f"ERROR: Could not find a version that satisfies the requirement tabulate==9 (from versions: {versions})\n"
        "ERROR: No matching distribution found for tabulate==9\n"
    )
    with pytest.raises(UnresolvableRequirements) as info:
        resolve(["tabulate==9"], {}, run=FakePip(returncode=1, stderr=stderr))
    assert len(info.value.reason) <= 300 and info.value.reason.endswith("...")


# --- pip_runner -----------------------------------------------------------------------------------------


def fake_python(tmp_path: Path, script: str) -> str:
    """An executable standing in for an interpreter: `script` runs with pip's argv as "$@"."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def test_pip_runner_runs_python_dash_m_pip_without_stdin(tmp_path: Path) -> None:
    python = fake_python(tmp_path, 'echo "argv: $*"; cat; echo "to stderr" >&2; exit 3')
    assert pip_runner(python)(["install", "tabulate"], 10) == (3, "argv: -m pip install tabulate\n", "to stderr\n")


def test_pip_runner_turns_a_timeout_into_a_requirements_error(tmp_path: Path) -> None:
    python = fake_python(tmp_path, "exec sleep 10")
    with pytest.raises(RequirementsError, match=r"pip install did not finish within 0.2 s"):
        pip_runner(python)(["install", "tabulate"], 0.2)


def test_pip_runner_reports_an_interpreter_that_does_not_start(tmp_path: Path) -> None:
    with pytest.raises(RequirementsError, match="cannot run pip with"):
        pip_runner(str(tmp_path / "no-python"))(["--version"], 10)


# --- install --------------------------------------------------------------------------------------------


def test_install_puts_exactly_the_pins_into_target_with_wheels_only(tmp_path: Path) -> None:
    pip = FakePip()
    layer = layer_of("tabulate==0.8.10", "wcwidth==0.2.13")
    target = tmp_path / "layers" / "abc"
    assert install(layer, target, run=pip, timeout_s=7) == target
    [argv] = pip.calls
    assert argv[0] == "install"
    assert {"--no-deps", "--only-binary=:all:", "--no-input"} <= set(argv)
    assert "--no-compile" not in argv  # the layer ships its bytecode: workers cannot write there
    assert argv[-2:] == ["tabulate==0.8.10", "wcwidth==0.2.13"]
    staging = Path(argv[argv.index("--target") + 1])
    assert staging.parent == target.parent and staging.name.startswith(".tmp-")
    assert pip.timeouts_s == [7]
    assert (target / "tabulate.py").read_text() == "VERSION = '0.8.10'\n"
    assert leftovers(target.parent) == ["abc"]


def test_an_installed_layer_is_readable_by_everyone(tmp_path: Path) -> None:
    target = tmp_path / "layer"
    install(layer_of("tabulate==0.8.10"), target, run=FakePip())
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "tabulate-0.8.10.dist-info").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "tabulate.py").stat().st_mode) & 0o444 == 0o444
    assert stat.S_IMODE((target / "tabulate.py").stat().st_mode) & 0o022 == 0


def test_install_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "layer"
    install(layer_of("tabulate==0.8.10"), target, run=FakePip())
    pip = FakePip()
    assert install(layer_of("tabulate==0.8.10"), target, run=pip) == target
    assert pip.calls == []


def test_the_empty_layer_installs_as_an_empty_directory_without_pip(tmp_path: Path) -> None:
    pip = FakePip()
    target = install(Layer((), PYTHON), tmp_path / "empty", run=pip)
    assert target.is_dir() and list(target.iterdir()) == []
    assert pip.calls == []


def test_a_failed_install_names_the_pin_and_leaves_nothing(tmp_path: Path) -> None:
    stderr = (
        "ERROR: Could not find a version that satisfies the requirement wcwidth==0.2.13 (from versions: 0.2.14)\n"
        "ERROR: No matching distribution found for wcwidth==0.2.13\n"
    )
    layer = layer_of("tabulate==0.8.10", "wcwidth==0.2.13")
    with pytest.raises(RequirementsError, match=r"cannot install wcwidth==0.2.13 of layer sha256:") as info:
        install(layer, tmp_path / "layer", run=FakePip(returncode=1, stderr=stderr))
    assert "tabulate" not in str(info.value).splitlines()[0].split(" of layer")[0]
    assert leftovers(tmp_path) == []


def test_a_failure_without_a_named_package_names_every_pin(tmp_path: Path) -> None:
    stderr = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    layer = layer_of("tabulate==0.8.10", "wcwidth==0.2.13")
    with pytest.raises(RequirementsError, match=r"tabulate==0.8.10, wcwidth==0.2.13 .*No space left on device"):
        install(layer, tmp_path / "layer", run=FakePip(returncode=1, stderr=stderr))


def test_an_install_that_differs_from_the_pins_is_refused(tmp_path: Path) -> None:
    pip = FakePip(installs=["tabulate==0.9.0"])
    with pytest.raises(RequirementsError, match=r"missing \['tabulate==0.8.10'\], unexpected \['tabulate==0.9.0'\]"):
        install(layer_of("tabulate==0.8.10"), tmp_path / "layer", run=pip)
    assert leftovers(tmp_path) == []


# --- LayerCache -----------------------------------------------------------------------------------------


def test_the_cache_root_is_not_listable_and_its_layers_are_readable(tmp_path: Path) -> None:
    cache = LayerCache(tmp_path / "layers", run=FakePip(), python=PYTHON)
    path = asyncio.run(cache.ensure(layer_of("tabulate==0.8.10")))
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o711
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


def test_ensure_installs_a_layer_once_under_its_digest(tmp_path: Path) -> None:
    pip = FakePip()
    cache = LayerCache(tmp_path, run=pip, python=PYTHON)
    layer = layer_of("tabulate==0.8.10")
    assert cache.path_for(layer) is None
    path = asyncio.run(cache.ensure(layer))
    assert path == tmp_path / layer.digest.removeprefix("sha256:") == cache.path_for(layer)
    assert asyncio.run(cache.ensure(layer)) == path
    assert len(pip.calls) == 1


def test_concurrent_ensures_of_one_layer_share_one_install(tmp_path: Path) -> None:
    gate = threading.Event()
    pip = FakePip(gate=gate)
    cache = LayerCache(tmp_path, run=pip, python=PYTHON)
    layer = layer_of("tabulate==0.8.10")

    async def scenario() -> list[Path]:
        waiting = [asyncio.create_task(cache.ensure(layer)) for _ in range(5)]
        await asyncio.sleep(0.05)  # every caller arrives while pip is still running
        gate.set()
        return await asyncio.gather(*waiting)

    paths = asyncio.run(scenario())
    assert len(pip.calls) == 1
    assert set(paths) == {cache.path_for(layer)}


def test_a_failed_install_is_not_remembered(tmp_path: Path) -> None:
    stderr = "ERROR: No matching distribution found for tabulate==0.8.10\n"
    failing = FakePip(returncode=1, stderr=stderr)
    runs: list[FakePip] = [failing, FakePip()]

    def run(argv: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
        return runs.pop(0)(argv, timeout_s)

    cache = LayerCache(tmp_path, run=run, python=PYTHON)
    layer = layer_of("tabulate==0.8.10")

    async def scenario() -> Path:
        with pytest.raises(RequirementsError, match=r"cannot install tabulate==0\.8\.10"):
            await cache.ensure(layer)
        return await cache.ensure(layer)

    assert asyncio.run(scenario()) == cache.path_for(layer)
    assert runs == []


def test_a_caller_giving_up_does_not_cancel_the_install_of_the_others(tmp_path: Path) -> None:
    gate = threading.Event()
    cache = LayerCache(tmp_path, run=FakePip(gate=gate), python=PYTHON)
    layer = layer_of("tabulate==0.8.10")

    async def scenario() -> Path:
        impatient = asyncio.create_task(cache.ensure(layer))
        patient = asyncio.create_task(cache.ensure(layer))
        await asyncio.sleep(0.02)
        impatient.cancel()
        gate.set()
        return await patient

    assert asyncio.run(scenario()) == cache.path_for(layer)


def test_a_layer_for_another_interpreter_is_refused(tmp_path: Path) -> None:
    pip = FakePip()
    cache = LayerCache(tmp_path, run=pip, python=PYTHON)
    with pytest.raises(RequirementsError, match="resolved for cp312-aarch64, but this node's workers run cp311"):
        asyncio.run(cache.ensure(layer_of("tabulate==0.8.10", python="cp312-aarch64")))
    assert pip.calls == []


def test_the_cache_defaults_to_this_interpreter(tmp_path: Path) -> None:
    assert LayerCache(tmp_path, run=FakePip()).python == python_tag()


def test_a_new_cache_removes_temporary_directories_of_a_crashed_one(tmp_path: Path) -> None:
    (tmp_path / ".tmp-abc-123").mkdir()
    (tmp_path / ".tmp-abc-123" / "tabulate.py").write_text("")
    LayerCache(tmp_path, run=FakePip(), python=PYTHON)
    assert leftovers(tmp_path) == []


def test_collect_deletes_the_layers_no_worker_used_for_the_grace(tmp_path: Path) -> None:
    async def scenario() -> None:
        now = [1000.0]
        cache = LayerCache(tmp_path / "layers", run=FakePip(), python=PYTHON, clock=lambda: now[0])
        kept, idle, busy = (layer_of(f"pkg{i}==1.0") for i in range(3))
        for layer in (kept, idle, busy):
            await cache.ensure(layer)
        (cache.root / "not-a-layer").mkdir()
        assert cache.collect({busy.digest}, 1030, grace_s=60) == []  # all used within the grace
        now[0] = 1100
        await cache.ensure(kept)  # used again later than the others
        assert cache.collect({busy.digest}, 1120, grace_s=60) == [idle.digest]
        assert cache.path_for(idle) is None
        assert cache.path_for(kept) is not None and cache.path_for(busy) is not None
        assert (cache.root / "not-a-layer").is_dir()

    asyncio.run(scenario())


def test_collect_uses_the_directory_age_for_layers_not_asked_for_since_opening(tmp_path: Path) -> None:
    layer = layer_of("tabulate==0.8.10")
    path = asyncio.run(LayerCache(tmp_path, run=FakePip(), python=PYTHON).ensure(layer))
    reopened = LayerCache(tmp_path, run=FakePip(), python=PYTHON)
    mtime = path.stat().st_mtime
    assert reopened.collect(set(), mtime + 30, grace_s=60) == []
    assert reopened.collect(set(), mtime + 90, grace_s=60) == [layer.digest]
