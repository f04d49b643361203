"""The house's size limits, checked on the source tree: no class over 400 lines, no function over
60 (a typer command counts from the end of its option list), so a god-object cannot grow back
unnoticed. Ruff's complexity rules (pyproject.toml) bound branches and statements beside this."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
# Tests, generated protobuf code, what `gpufaas new` copies, and the peer bench (another project's
# client, kept as it is).
EXCLUDED = ("tests/", "gpufaas/proto/", "function_templates/", "bench/peer/")


def _sources() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / name for name in listed if not name.startswith(EXCLUDED)]


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's length; a typer command's option list (its signature) does not count: it is
    declarative, one parameter per flag."""
    end = node.end_lineno or node.lineno
    if any(_is_command_decorator(d) for d in node.decorator_list):
        return end - node.body[0].lineno + 1
    return end - node.lineno + 1


def _is_command_decorator(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr in {"command", "callback"}


def _oversized(path: Path, root: Path = REPO) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                yield f"{where}:{node.lineno} class {node.name}: {lines} lines (at most {MAX_CLASS_LINES})"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = _body_lines(node)
            if lines > MAX_FUNCTION_LINES:
                yield f"{where}:{node.lineno} {node.name}(): {lines} lines (at most {MAX_FUNCTION_LINES})"


def test_no_class_over_400_lines_and_no_function_over_60() -> None:
    sources = _sources()
    assert len(sources) > 50, "git ls-files found too few sources: is this a checkout?"
    oversized = [finding for path in sources for finding in _oversized(path)]
    assert not oversized, "split these along their seams (docs/architecture.md):\n" + "\n".join(oversized)


def test_the_size_check_finds_an_oversized_class_and_function(tmp_path: Path) -> None:
    # The checker itself: a 401-line class and a 61-line function are found; a typer command's
    # long option list is not counted.
    body = "\n".join(f"    x{i} = {i}" for i in range(400))
    function = "def f() -> None:\n" + "\n".join(f"    y{i} = {i}" for i in range(60))
    options = ",\n".join(f"    o{i}: int = {i}" for i in range(80))
    command = f"@app.command()\ndef cmd(\n{options},\n) -> None:\n    pass\n"
    source = tmp_path / "probe.py"
    source.write_text(f"class C:\n{body}\n\n\n{function}\n\n\n{command}")
    found = list(_oversized(source, tmp_path))
    assert [line.split(" ", 1)[1].split(":")[0] for line in found] == ["class C", "f()"]
