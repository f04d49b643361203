"""stack.yml: OpenFaaS's stack file plus GPU fields, parsed and validated with each key's path."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpufaas.errors import InvalidInput
from gpufaas.functions import NAME_PATTERN, FunctionSettings, FunctionSpec

TOP_KEYS = {"version", "provider", "functions", "configuration"}
PROVIDER_KEYS = {"name", "gateway"}
# A function's keys: where its code is, and the settings every function spec has (gpufaas.functions).
FUNCTION_KEYS = {"template", "handler", *FunctionSettings.model_fields}


@dataclass(frozen=True, slots=True)
class StackFunction:
    name: str
    handler: Path  # resolved against the stack file's directory
    settings: FunctionSettings
    template: str | None = None

    def spec(self, package_digest: str) -> dict[str, Any]:
        """The gateway's function spec for this function's uploaded package (its JSON form)."""
        spec = FunctionSpec(name=self.name, package_digest=package_digest, **self.settings.model_dump())
        return spec.model_dump(mode="json")


@dataclass(frozen=True, slots=True)
class Stack:
    path: Path
    gateway: str | None
    functions: list[StackFunction]


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (as OpenFaaS's faas-cli does):
    PyYAML keeps the last silently, so a second `functions.NAME` replaced the first unsaid. Keys a
    merge (`<<: *anchor`) brings may still be overridden, as YAML means them to be."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # unhashable: the constructor below says so
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice (first on line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def load_stack(path: Path, environ: Mapping[str, str] | None = None) -> Stack:
    """Read and validate a stack file; every error names the file and the key path. `${NAME}`
    in a value is the variable NAME of `environ` (the process's environment by default): see
    `substitute_variables`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such stack file; create one with `gpufaas new NAME --template T`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read it ({exc})") from None
    loader = _UniqueKeyLoader(text)  # (a SafeLoader: it builds only plain data)
    try:
        node = loader.get_single_node()
        raw = loader.construct_document(node) if node is not None else None
        written = _written_texts(loader, node)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise InvalidInput(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    finally:
        loader.dispose()
    raw = substitute_variables(
        raw, os.environ if environ is None else environ, lambda key, message: _fail(path, key, message)
    )
    return parse_stack(raw, path, written=written)


# `${NAME}`, `${NAME:-default}`, `${NAME-default}`, or `$${...}` (the text `${...}` itself).
_REFERENCE = re.compile(r"\$(\$?)\{([^}]*)\}")
_VARIABLE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?", re.DOTALL)


def substitute_variables(raw: Any, environ: Mapping[str, str], fail: Callable[[str, str], InvalidInput]) -> Any:
    """`raw` with the environment variables its string values name put in, as OpenFaaS's stack
    files have them (`gateway: ${GATEWAY:-http://127.0.0.1:8080}`, `environment: {TOKEN: ${TOKEN}}`):
    `${NAME:-default}` takes the default where NAME is unset or empty, `${NAME-default}` where it
    is unset, and `$${...}` is the text `${...}`. A variable unset without a default is refused
    (faas-cli puts '' in its place: a deploy then runs with an empty setting unsaid). Values only,
    after YAML has read the file: a variable's value is text, never YAML (it adds no keys), read as
    a number or a boolean where the whole setting is one (`memory_mb: ${MEMORY_MB}`), except in
    `labels` and `environment`, which are text."""

    def walk(value: Any, keys: tuple[str, ...]) -> Any:
        if isinstance(value, str):
            if "${" not in value:
                return value
            where = ".".join(keys)
            text = _REFERENCE.sub(lambda match: _resolve(match, where, environ, fail), value)
            return text if keys[2:3] in (("labels",), ("environment",)) else _scalar(text)
        if isinstance(value, dict):
            return {key: walk(item, (*keys, str(key))) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item, (*keys, str(index))) for index, item in enumerate(value)]
        return value

    return walk(raw, ())


def _scalar(text: str) -> Any:
    """A setting's text after substitution: the number or boolean YAML reads it as, else the text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, bool | int | float) else text


def _resolve(
    match: re.Match[str], where: str, environ: Mapping[str, str], fail: Callable[[str, str], InvalidInput]
) -> str:
    escaped, reference = match.groups()
    if escaped:
        return "${" + reference + "}"
    variable = _VARIABLE.fullmatch(reference)
    if variable is None:
        raise fail(
            where, f"${{{reference}}} is not a variable: write ${{NAME}} or ${{NAME:-default}} ($${{...}} for the text)"
        )
    name, operator, default = variable.groups()
    value = environ.get(name)
    if (operator == ":-" and not value) or (operator == "-" and value is None):
        return str(default)
    if value is None:
        raise fail(where, f"${{{name}}} is not set: export {name}, or write ${{{name}:-default}}")
    return value


def _fail(path: Path, key: str, message: str) -> InvalidInput:
    return InvalidInput(f"{path}: {key}: {message}")


Written = dict[tuple[Any, str, str], tuple[str, str | None]]


def _written_texts(loader: yaml.SafeLoader, root: yaml.Node | None) -> Written:
    """(function, "labels" or "environment", str(key)) -> its key's text and its value's, as
    written, for plain scalars (else str(key), None): YAML types `1.10` as 1.1, `0755` as 493
    and `yes`, `off` as booleans, and a label or variable is the text (as faas-cli passes it)."""

    def pairs(node: yaml.Node | None) -> list[tuple[Any, yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            return []
        return [(loader.construct_object(k, deep=True), k, v) for k, v in node.value]  # (merges flattened)

    def child(node: yaml.Node | None, name: str) -> yaml.Node | None:
        return next((value for key, _, value in pairs(node) if key == name), None)

    def plain(node: yaml.Node) -> str | None:
        return node.value if isinstance(node, yaml.ScalarNode) and node.style is None else None

    written: Written = {}
    for function, _, settings in pairs(child(root, "functions")):
        for field in ("labels", "environment"):
            for key, key_node, value in pairs(child(settings, field)):
                key_text = plain(key_node) if key is not None else None
                if _hashable(function):
                    written[(function, field, str(key))] = (key_text or str(key), plain(value))
    return written


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def parse_stack(raw: Any, path: Path, *, written: Written | None = None) -> Stack:
    """Validate a stack file's YAML value `raw`; `written`: `_written_texts` of its source."""

    def fail(key: str, message: str) -> InvalidInput:
        return _fail(path, key, message)

    if not isinstance(raw, dict):
        raise InvalidInput(f"{path}: expected a mapping with 'version', 'provider' and 'functions'")
    _reject_unknown(raw, TOP_KEYS, "", fail)
    provider = raw.get("provider", {})
    if not isinstance(provider, dict):
        raise fail("provider", "expected a mapping with 'name' and 'gateway'")
    _reject_unknown(provider, PROVIDER_KEYS, "provider", fail)
    if provider.get("name", "gpufaas") not in ("gpufaas", "openfaas"):
        raise fail("provider.name", f"expected 'gpufaas', got {provider.get('name')!r}")
    gateway = provider.get("gateway")
    if gateway is not None and (not isinstance(gateway, str) or not gateway.startswith(("http://", "https://"))):
        raise fail("provider.gateway", f"expected an http(s) URL, got {gateway!r}")
    functions = raw.get("functions")
    if not isinstance(functions, dict) or not functions:
        raise fail("functions", "expected a mapping of function names to their settings, with at least one")
    parsed = [_parse_function(name, settings, path, fail, written or {}) for name, settings in functions.items()]
    return Stack(path=path, gateway=gateway, functions=parsed)


def _parse_function(
    name: Any, settings: Any, path: Path, fail: Callable[[str, str], InvalidInput], written: Written
) -> StackFunction:
    """One entry of `functions:`: its name, handler directory (relative to the stack file),
    template and settings, checked."""
    where = f"functions.{name}"
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise fail(where, "not a valid function name: lower-case letters, digits and '-', at most 63")
    if not isinstance(settings, dict):
        raise fail(where, "expected a mapping of settings")
    _reject_unknown(settings, FUNCTION_KEYS, where, fail)
    handler = settings.get("handler")
    if not isinstance(handler, str) or not handler:
        raise fail(f"{where}.handler", "required: the directory with handler.py, relative to the stack file")
    if "\x00" in handler:  # no path holds one (resolve() would raise ValueError)
        raise fail(f"{where}.handler", f"{handler!r} is not a path: it holds a NUL character")
    template = settings.get("template")
    if template is not None and not isinstance(template, str):
        raise fail(f"{where}.template", f"expected a template name, got {template!r}")
    values = {key: value for key, value in settings.items() if key not in ("handler", "template")}
    for key in ("labels", "environment"):  # YAML types `version: 1.0` as a number; a label is text
        if key in values and values[key] is None:  # `labels:` with nothing (or only comments) under it
            del values[key]
        elif isinstance(values.get(key), dict):
            values[key] = dict(_entry(k, v, written.get((name, key, str(k)))) for k, v in values[key].items())
    try:
        function_settings = FunctionSettings.from_dict(values, path=where)
    except InvalidInput as exc:
        raise InvalidInput(f"{path}: {exc}") from None
    try:
        directory = (path.parent / handler).resolve()
    except RuntimeError:  # (Python before 3.13 says a symlink loop so; 3.13 raises OSError)
        raise fail(f"{where}.handler", f"{handler!r} is a symbolic link loop: point it at a directory") from None
    except (OSError, ValueError) as exc:  # a loop (3.13); a lone surrogate ("\ud800") no path can encode
        raise fail(f"{where}.handler", f"{handler!r} is not a path this system can open ({exc})") from None
    return StackFunction(name=name, handler=directory, template=template, settings=function_settings)


def _reject_unknown(raw: dict[Any, Any], known: set[str], where: str, fail: Callable[[str, str], InvalidInput]) -> None:
    for key in raw:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            raise fail(path, f"unknown key; known keys here: {', '.join(sorted(known))}")


def _entry(key: Any, value: Any, written: tuple[str, str | None] | None) -> tuple[str, Any]:
    """A label's or variable's name and value as text: as written where known (`_written_texts`)."""
    key_text, value_text = written or (str(key), None)
    return key_text, _text(value, value_text)


def _text(value: Any, written: str | None = None) -> Any:
    """A YAML scalar as text: as `written` where known (`yes`, `1.10`, `0755`), else `true`, `1.0`,
    `2024-01-01`, and an empty value as ''; anything else as it is (refused: a label is not a list
    or a mapping)."""
    if value is None:
        return ""
    if written is not None and isinstance(value, bool | int | float | datetime.date):
        return written
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str | datetime.date):
        return str(value)
    return value
