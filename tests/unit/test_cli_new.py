"""`gpufaas new` where a template's weights cannot be written (a module missing, as in an install
without the worker extra): one line that says what to install, no traceback, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufaas.cli import app
from gpufaas.cli.functions import _weights_failure

runner = CliRunner()


@pytest.fixture
def without_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """make_weights.py (a subprocess) finds a numpy that fails to import, as an absent one does."""
    fake = tmp_path / "no-numpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))


def test_a_missing_module_says_what_to_install_and_leaves_nothing(tmp_path: Path, without_numpy: None) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = runner.invoke(app, ["new", "hello", "--template", "pytorch-custom", "--dir", str(work / "fns" / "a")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    message = " ".join(result.stderr.split())
    assert "numpy" in message and "pip install 'gpufaas[worker]'" in message
    assert len(result.stderr.strip().splitlines()) <= 2  # one line (the console may wrap it)
    assert list(work.iterdir()) == []  # neither the function nor the folders made for it


def test_a_failure_keeps_the_existing_stack_file_as_it_was(tmp_path: Path, without_numpy: None) -> None:
    stack = tmp_path / "stack.yml"
    before = "version: 1.0\nfunctions:\n  other:\n    handler: ./other\n"
    stack.write_text(before)
    result = runner.invoke(app, ["new", "hello", "--template", "pytorch-text-classifier", "--dir", str(tmp_path)])
    assert result.exit_code == 1
    assert stack.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-numpy", "stack.yml"]


@pytest.mark.parametrize(
    "content",
    [b"functions: [oops\n", b"functions:\n  caf\xe9: {handler: ./x}\n"],  # not YAML; not UTF-8 (Latin-1)
    ids=["not-yaml", "not-utf8"],
)
def test_an_unreadable_stack_file_is_one_line_and_removes_the_function(tmp_path: Path, content: bytes) -> None:
    pytest.importorskip("numpy")
    pytest.importorskip("torch")
    (tmp_path / "stack.yml").write_bytes(content)
    result = runner.invoke(app, ["new", "hello", "--template", "pytorch-custom", "--dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "cannot read" in result.stderr
    assert not (tmp_path / "hello").exists()


def test_other_failures_name_the_script_and_its_last_line() -> None:
    stderr = "Traceback (most recent call last):\n  File ...\nOSError: [Errno 28] No space left on device\n"
    message = _weights_failure("pytorch-custom", stderr)
    assert "\n" not in message and message.endswith("OSError: [Errno 28] No space left on device")
    assert "pip install 'gpufaas[worker]'" in _weights_failure("x", "ModuleNotFoundError: No module named 'torch'\n")
    assert "pip install tokenizers" in _weights_failure("x", "ModuleNotFoundError: No module named 'tokenizers.x'\n")


def test_list_needs_no_name_and_a_missing_name_is_a_usage_error(tmp_path: Path) -> None:
    listed = runner.invoke(app, ["new", "--list"])
    assert listed.exit_code == 0
    assert {"pytorch-custom", "pytorch-image-classifier", "pytorch-text-classifier"} <= {
        line.split()[0] for line in listed.stdout.splitlines() if line.strip()
    }
    nameless = runner.invoke(app, ["new", "--dir", str(tmp_path)])
    assert nameless.exit_code == 2 and "name" in nameless.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_function_added_to_a_stack_file_leaves_the_rest_as_written(tmp_path: Path) -> None:
    """`gpufaas new` wrote the whole stack file again from its YAML values: comments and anchors
    were lost, and `REV: 1.10`, `PERMS: 0755` became 1.1 and 493 (what deploy then sent)."""
    from gpufaas.cli.functions import _add_to_stack
    from gpufaas.cli.stack import load_stack

    before = (
        "version: 1.0\n# our functions\nfunctions:\n    old:  # the first\n        handler: ./old\n"
        "        memory_mb: 100\n        environment: {REV: 1.10, PERMS: 0755}\n# the end\n"
    )
    stack = tmp_path / "stack.yml"
    stack.write_text(before)
    _add_to_stack(stack, "hello", "pytorch-custom", {"memory_mb": 600})
    assert stack.read_text().startswith(before)
    old, hello = load_stack(stack).functions
    assert old.settings.environment == {"REV": "1.10", "PERMS": "0755"}
    assert (hello.name, hello.settings.memory_mb, hello.handler) == ("hello", 600, tmp_path / "hello")


def test_new_in_a_folder_with_brackets_says_what_it_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's name was read as Rich markup: a traceback after the function was made."""
    template = tmp_path / "templates" / "plain"
    template.mkdir(parents=True)
    (template / "handler.py").write_text("def load(device):\n    return None\n")
    monkeypatch.setattr("gpufaas.cli.functions._templates", lambda: {"plain": template})
    monkeypatch.setenv("GPUFAAS_STATE_DIR", str(tmp_path / "state"))
    directory = tmp_path / "[/fns]"
    result = runner.invoke(app, ["new", "hello", "--template", "plain", "--dir", str(directory)])
    assert result.exit_code == 0, result.exception
    assert f"created {directory / 'hello'} from plain" in " ".join(result.stdout.split())
