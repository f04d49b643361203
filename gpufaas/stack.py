"""stack.yml: OpenFaaS's stack file plus GPU fields, parsed and validated with each key's path."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufaas.errors import InvalidInput
from gpufaas.functions import DEFAULT_TIMEOUT_S, GPU_TYPE_PATTERN, MAX_TIMEOUT_S, NAME_PATTERN, batching, slo_ms
from gpufaas.types import DEFAULT_BATCH_SIZE

TOP_KEYS = {"version", "provider", "functions", "configuration"}
PROVIDER_KEYS = {"name", "gateway"}
FUNCTION_KEYS = {
    "template",
    "handler",
    "gpu",
    "memory_mb",
    "batch_size",
    "timeout_s",
    "labels",
    "environment",
    "max_batch_size",
    "max_batch_wait_ms",
    "public",
    "slo_ms",
}


@dataclass(frozen=True, slots=True)
class StackFunction:
    name: str
    handler: Path  # resolved against the stack file's directory
    template: str | None = None
    gpu: str = "any"
    memory_mb: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    timeout_s: float = DEFAULT_TIMEOUT_S
    labels: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    max_batch_size: int = 1
    max_batch_wait_ms: float = 0.0
    public: bool = False  # callable without credentials
    slo_ms: float | None = None  # the latency a call should meet (SLO-aware policies)

    def spec(self, package_digest: str) -> dict[str, Any]:
        """The gateway's function spec for this function's uploaded package."""
        return {
            "name": self.name,
            "package_digest": package_digest,
            "memory_mb": self.memory_mb,
            "gpu": self.gpu,
            "batch_size": self.batch_size,
            "timeout_s": self.timeout_s,
            "labels": self.labels,
            "environment": self.environment,
            "max_batch_size": self.max_batch_size,
            "max_batch_wait_ms": self.max_batch_wait_ms,
            "public": self.public,
            "slo_ms": self.slo_ms,
        }


@dataclass(frozen=True, slots=True)
class Stack:
    path: Path
    gateway: str | None
    functions: list[StackFunction]


def load_stack(path: Path) -> Stack:
    """Read and validate a stack file; every error names the file and the key path."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such stack file; create one with `gpufaas new NAME --template T`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: cannot read it ({exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise InvalidInput(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_stack(raw, path)


def parse_stack(raw: Any, path: Path) -> Stack:
    def fail(key: str, message: str) -> InvalidInput:
        return InvalidInput(f"{path}: {key}: {message}")

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
    parsed = []
    for name, settings in functions.items():
        where = f"functions.{name}"
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise fail(where, "not a valid function name: lower-case letters, digits and '-', at most 63")
        if not isinstance(settings, dict):
            raise fail(where, "expected a mapping of settings")
        _reject_unknown(settings, FUNCTION_KEYS, where, fail)
        handler = settings.get("handler")
        if not isinstance(handler, str) or not handler:
            raise fail(f"{where}.handler", "required: the directory with handler.py, relative to the stack file")
        gpu = settings.get("gpu", "any")
        if not isinstance(gpu, str) or not GPU_TYPE_PATTERN.match(gpu):
            raise fail(f"{where}.gpu", f"expected 'any' or a GPU type, got {gpu!r}")
        memory_mb = settings.get("memory_mb")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb <= 0:
            raise fail(f"{where}.memory_mb", f"required: the model's peak GPU memory in MB, got {memory_mb!r}")
        batch_size = settings.get("batch_size", DEFAULT_BATCH_SIZE)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise fail(f"{where}.batch_size", f"expected a positive whole number, got {batch_size!r}")
        timeout_s = settings.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise fail(f"{where}.timeout_s", f"expected seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        try:
            batch_settings = batching(settings, where)
            slo = slo_ms(settings, where)
        except InvalidInput as exc:
            raise InvalidInput(f"{path}: {exc}") from None
        public = settings.get("public", False)
        if not isinstance(public, bool):
            raise fail(f"{where}.public", f"expected true or false, got {public!r}")
        template = settings.get("template")
        if template is not None and not isinstance(template, str):
            raise fail(f"{where}.template", f"expected a template name, got {template!r}")
        parsed.append(
            StackFunction(
                name=name,
                handler=(path.parent / handler).resolve(),
                template=template,
                gpu=gpu,
                memory_mb=memory_mb,
                batch_size=batch_size,
                timeout_s=float(timeout_s),
                labels=_string_map(settings.get("labels"), f"{where}.labels", fail),
                environment=_string_map(settings.get("environment"), f"{where}.environment", fail),
                public=public,
                slo_ms=slo,
                **batch_settings,
            )
        )
    return Stack(path=path, gateway=gateway, functions=parsed)


def _reject_unknown(raw: dict[Any, Any], known: set[str], where: str, fail: Any) -> None:
    for key in raw:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            raise fail(path, f"unknown key; known keys here: {', '.join(sorted(known))}")


def _string_map(value: Any, where: str, fail: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(where, "expected a mapping of names to values")
    return {str(k): str(v) for k, v in value.items()}
