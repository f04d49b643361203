"""stack.yml parsing: the OpenFaaS layout plus GPU fields; bad keys and values named by path."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufaas.cli.stack import load_stack
from gpufaas.errors import InvalidInput
from gpufaas.functions import FunctionSpec

GOOD = """
version: 1.0
provider:
  name: gpufaas
  gateway: http://127.0.0.1:8080
functions:
  resnet:
    template: pytorch-image-classifier
    handler: ./resnet
    gpu: any
    memory_mb: 1700
    batch_size: 16
    timeout_s: 30
    labels: {team: vision}
    environment: {MODE: fast}
    max_batch_size: 8
    max_batch_wait_ms: 2.5
    public: true
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yml"
    path.write_text(text)
    return path


def test_a_good_stack_parses_with_handlers_relative_to_the_file(tmp_path: Path) -> None:
    stack = load_stack(write(tmp_path, GOOD))
    assert stack.gateway == "http://127.0.0.1:8080"
    (function,) = stack.functions
    assert function.handler == (tmp_path / "resnet").resolve()
    given = {
        "name": "resnet",
        "package_digest": "sha256:" + "0" * 64,
        "memory_mb": 1700,
        "batch_size": 16,
        "timeout_s": 30.0,
        "labels": {"team": "vision"},
        "environment": {"MODE": "fast"},
        "max_batch_size": 8,
        "max_batch_wait_ms": 2.5,
        "public": True,
    }
    # What the file sets, and every other setting at its default.
    defaults = FunctionSpec(name="resnet", package_digest="sha256:" + "0" * 64, memory_mb=1).model_dump()
    assert function.spec("sha256:" + "0" * 64) == {**defaults, **given}
    assert defaults["gpu"] == "any" and defaults["slo_ms"] is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("memory_mb: 1700", "memroy_mb: 1700"), "functions.resnet.memroy_mb: unknown key"),
        (("memory_mb: 1700", "memory_mb: -1"), "functions.resnet.memory_mb: expected a positive whole number"),
        (("timeout_s: 30", "timeout_s: 0"), "functions.resnet.timeout_s: expected seconds"),
        (("batch_size: 16", "batch_size: lots"), "functions.resnet.batch_size: expected a positive"),
        (("gpu: any", "gpu: [a, b]"), "functions.resnet.gpu: expected 'any' or a GPU type"),
        (("max_batch_size: 8", "max_batch_size: 0"), "functions.resnet.max_batch_size: expected a positive"),
        (
            ("max_batch_size: 8", "max_batch_size: 5000"),
            "functions.resnet.max_batch_size: expected a positive whole number, at most 1024",
        ),
        (
            ("max_batch_wait_ms: 2.5", "max_batch_wait_ms: -1"),
            "functions.resnet.max_batch_wait_ms: expected milliseconds",
        ),
        (("handler: ./resnet", "handler: ''"), "functions.resnet.handler: required"),
        (("  resnet:", "  ResNet:"), "functions.ResNet: not a valid function name"),
        (("gateway: http://127.0.0.1:8080", "gateway: 127.0.0.1"), "provider.gateway: expected an http"),
        (("version: 1.0", "versoin: 1.0"), "versoin: unknown key"),
        (("labels: {team: vision}", "labels: [vision]"), "functions.resnet.labels: expected a map"),
        (("public: true", "public: sometimes"), "functions.resnet.public: expected true or false"),
        (("public: true", "public: true\n    slo_ms: 0"), "functions.resnet.slo_ms: expected milliseconds"),
    ],
)
def test_bad_keys_and_values_are_named_by_path(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(InvalidInput, match=message) as caught:
        load_stack(path)
    assert str(path) in str(caught.value)


def test_an_slo_reaches_the_function_spec(tmp_path: Path) -> None:
    (function,) = load_stack(write(tmp_path, GOOD.replace("public: true", "public: true\n    slo_ms: 250"))).functions
    assert function.settings.slo_ms == 250.0
    assert function.spec("sha256:" + "b" * 64)["slo_ms"] == 250.0


def test_missing_and_malformed_files_are_explained(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="no such stack file"):
        load_stack(tmp_path / "nope.yml")
    with pytest.raises(InvalidInput, match=r"stack.yml:\d+: not valid YAML"):
        load_stack(write(tmp_path, "functions: [unclosed\n"))
    with pytest.raises(InvalidInput, match="functions: expected a mapping"):
        load_stack(write(tmp_path, "version: 1.0\nfunctions: {}\n"))


def test_empty_and_dated_yaml_values_are_taken_as_yaml_means_them(tmp_path: Path) -> None:
    text = GOOD.replace("labels: {team: vision}", "labels:\n      # none yet").replace(
        "environment: {MODE: fast}", "environment: {EMPTY: , SINCE: 2024-01-01, DEBUG: true}"
    )
    (function,) = load_stack(write(tmp_path, text)).functions
    assert function.settings.labels == {}
    assert function.settings.environment == {"EMPTY": "", "SINCE": "2024-01-01", "DEBUG": "true"}


def test_a_handler_path_with_a_nul_is_a_clear_error(tmp_path: Path) -> None:
    """YAML's "\\0" is a NUL, which no path holds: an error naming the key, not a ValueError."""
    path = tmp_path / "stack.yml"
    path.write_text('functions:\n  fn:\n    handler: "./a\\0b"\n    memory_mb: 100\n')
    with pytest.raises(InvalidInput, match=r"functions\.fn\.handler: .* holds a NUL character"):
        load_stack(path)


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        ("./loop", r"functions\.fn\.handler: './loop' is a symbolic link loop"),
        ('"./a\\ud800"', r"functions\.fn\.handler: .* not a path this system can open"),
    ],
)
def test_a_handler_path_that_cannot_be_resolved_is_a_clear_error(tmp_path: Path, handler: str, message: str) -> None:
    """A symlink loop, or a YAML escape of a lone surrogate (no file name encodes it): an error
    naming the key, not the RuntimeError or UnicodeEncodeError resolving it raises."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    path = tmp_path / "stack.yml"
    path.write_text(f"functions:\n  fn:\n    handler: {handler}\n    memory_mb: 100\n")
    with pytest.raises(InvalidInput, match=message):
        load_stack(path)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two `functions.fn`: the first was dropped unsaid (faas-cli refuses)."""
    text = "functions:\n  fn:\n    handler: ./a\n    memory_mb: 100\n  fn:\n    handler: ./b\n    memory_mb: 100\n"
    with pytest.raises(
        InvalidInput, match=r"stack\.yml:5: not valid YAML \(key 'fn' given twice \(first on line 2\)\)"
    ):
        load_stack(write(tmp_path, text))


def test_a_merged_key_may_still_be_overridden(tmp_path: Path) -> None:
    text = "functions:\n  a: &base\n    handler: ./a\n    memory_mb: 3\n  b:\n    <<: *base\n    memory_mb: 100\n"
    a, b = load_stack(write(tmp_path, text)).functions
    assert (a.settings.memory_mb, b.settings.memory_mb, b.handler) == (3, 100, tmp_path / "a")


def test_labels_and_environment_are_the_text_as_written(tmp_path: Path) -> None:
    """YAML types `1.10` as 1.1, `0755` as 493, `yes` and `off` as booleans: the worker saw REV=1.1,
    PERMS=493, FLAG=true. faas-cli passes the text as written; so does a value merged in."""
    text = GOOD.replace(
        "environment: {MODE: fast}", "environment: {<<: &e {REV: 1.10}, PERMS: 0755, FLAG: yes, OFF: off, DEBUG: true}"
    ).replace("labels: {team: vision}", "labels: {version: 2.50, quoted: '1.0'}")
    (function,) = load_stack(write(tmp_path, text)).functions
    assert function.settings.environment == {
        "REV": "1.10",
        "PERMS": "0755",
        "FLAG": "yes",
        "OFF": "off",
        "DEBUG": "true",
    }
    assert function.settings.labels == {"version": "2.50", "quoted": "1.0"}


VARIABLES = """
version: 1.0
provider: {name: gpufaas, gateway: "${GATEWAY:-http://127.0.0.1:8080}"}
functions:
  resnet:
    handler: ./${DIR}
    memory_mb: ${MEMORY_MB}
    environment:
      TOKEN: ${TOKEN}
      MODE: ${MODE-fast}
      EMPTY: ${EMPTY:-fallback}
      TEMPLATE: $${HOME}/x   # the text itself
    labels: {team: "${TEAM}-${REGION:-eu}"}
"""


def test_variables_in_values_come_from_the_environment_as_in_openfaas_stack_files(tmp_path: Path) -> None:
    environ = {"DIR": "resnet", "MEMORY_MB": "1700", "TOKEN": "s3cret: {not yaml}", "EMPTY": "", "TEAM": "vision"}
    stack = load_stack(write(tmp_path, VARIABLES), environ)
    assert stack.gateway == "http://127.0.0.1:8080"
    (function,) = stack.functions
    assert function.handler == (tmp_path / "resnet").resolve()
    assert function.settings.memory_mb == 1700
    assert function.settings.environment == {
        "TOKEN": "s3cret: {not yaml}",  # a value is text: it adds no keys
        "MODE": "fast",
        "EMPTY": "fallback",
        "TEMPLATE": "${HOME}/x",
    }
    assert function.settings.labels == {"team": "vision-eu"}
    # `${NAME-default}` takes the default only where NAME is unset: set but empty stays empty.
    stack = load_stack(write(tmp_path, VARIABLES), {**environ, "MODE": ""})
    assert stack.functions[0].settings.environment["MODE"] == ""


def test_an_unset_variable_without_a_default_is_refused_with_its_key_and_what_to_do(tmp_path: Path) -> None:
    path = write(tmp_path, VARIABLES)
    with pytest.raises(InvalidInput) as caught:
        load_stack(path, {"DIR": "resnet", "MEMORY_MB": "1700", "TEAM": "vision"})
    assert str(caught.value) == (
        f"{path}: functions.resnet.environment.TOKEN: ${{TOKEN}} is not set: export TOKEN, or write ${{TOKEN:-default}}"
    )
    path = write(tmp_path, GOOD.replace("gpu: any", "gpu: ${1GPU}"))
    with pytest.raises(InvalidInput, match=r"functions\.resnet\.gpu: \$\{1GPU\} is not a variable"):
        load_stack(path, {})
