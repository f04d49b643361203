"""Function specs: what a deployed function is, as stored in etcd and validated at every boundary."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gpufaas.errors import InvalidInput
from gpufaas.types import DEFAULT_BATCH_SIZE

NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
GPU_TYPE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
MAX_BATCH_SIZE = 1024
MAX_BATCH_WAIT_MS = 10_000.0


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A deployed inference function.

    `memory_mb` is the declared *peak* GPU occupancy of its model at `batch_size` (what the cache
    manager sizes it by until a measurement replaces it). Each (function, package) pair is its own
    cache item: `model` changes when the package does, so an update never reuses stale workers.

    Dynamic batching is opt-in: with `max_batch_size` > 1 the worker merges up to that many calls
    that are waiting into one `predict(model, [inputs, ...])`, which returns a list of outputs;
    with fewer waiting it waits up to `max_batch_wait_ms` for more.

    `public`: anyone who reaches the gateway may call it. By default a call needs the cluster's
    invoke token or the admin credentials (docs/security.md).

    `slo_ms`: the latency a call should meet (end to end, from arrival); policies that know SLOs
    (`torpor`) put first the functions most likely to meet theirs. None: no SLO.
    """

    name: str
    package_digest: str
    memory_mb: int
    gpu: str = "any"  # a GPU type the function must run on, or "any"
    batch_size: int = DEFAULT_BATCH_SIZE
    timeout_s: float = DEFAULT_TIMEOUT_S
    labels: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    max_batch_size: int = 1
    max_batch_wait_ms: float = 0.0
    public: bool = False
    slo_ms: float | None = None

    @property
    def required_gpu_type(self) -> str | None:
        return None if self.gpu == "any" else self.gpu

    @property
    def model(self) -> str:
        return f"{self.name}@{self.package_digest.removeprefix('sha256:')[:12]}"

    def deadline_message(self) -> str:
        """What a caller is told when this function's `timeout_s` passed."""
        return (
            f"function {self.name!r} did not finish within its timeout of {self.timeout_s:g} s; "
            "raise its timeout_s or send it less work"
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> FunctionSpec:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"function spec is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Any, *, path: str = "") -> FunctionSpec:
        """Validate user input; errors name the offending field and say what is expected."""
        if not isinstance(raw, dict):
            raise InvalidInput(f"{path or 'function spec'}: expected an object")
        known = set(FUNCTION_SPEC_SCHEMA["properties"])
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidInput(f"{_at(path, unknown[0])}: unknown field; known fields: {', '.join(sorted(known))}")
        name = _string(raw, "name", path)
        if not NAME_PATTERN.match(name):
            raise InvalidInput(
                f"{_at(path, 'name')}: {name!r} is not a valid function name; use lower-case letters, digits and "
                "'-' (at most 63 characters, starting and ending with a letter or digit)"
            )
        digest = _string(raw, "package_digest", path)
        if not DIGEST_PATTERN.match(digest):
            raise InvalidInput(f"{_at(path, 'package_digest')}: expected 'sha256:' and 64 hex digits, got {digest!r}")
        return cls(
            name=name,
            package_digest=digest,
            memory_mb=_positive_int(raw, "memory_mb", path, required=True),
            gpu=_gpu(raw, path),
            batch_size=_positive_int(raw, "batch_size", path, default=DEFAULT_BATCH_SIZE),
            timeout_s=_timeout(raw, path),
            labels=_str_map(raw, "labels", path),
            environment=_str_map(raw, "environment", path),
            public=_bool(raw, "public", path),
            slo_ms=slo_ms(raw, path),
            **batching(raw, path),
        )


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

# The JSON Schema of a function spec as the gateway takes it (POST/PUT /system/functions), for its
# OpenAPI document. `FunctionSpec.from_dict` is what enforces it (tests/unit/test_functions_and_keys.py
# checks that the two agree on fields and bounds).
FUNCTION_SPEC_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "FunctionSpec",
    "required": ["name", "package_digest", "memory_mb"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN.pattern, "maxLength": 63, "description": "the function"},
        "package_digest": {
            "type": "string",
            "pattern": DIGEST_PATTERN.pattern,
            "description": "an uploaded package (POST /system/packages)",
        },
        "memory_mb": {"type": "integer", "minimum": 1, "description": "the model's peak GPU memory at batch_size"},
        "gpu": {"type": "string", "pattern": f"^any$|{GPU_TYPE_PATTERN.pattern}", "default": "any"},
        "batch_size": {"type": "integer", "minimum": 1, "default": DEFAULT_BATCH_SIZE},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S, "default": DEFAULT_TIMEOUT_S},
        "labels": _STRING_MAP,
        "environment": {**_STRING_MAP, "description": "set in the worker before the handler is imported"},
        "max_batch_size": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH_SIZE, "default": 1},
        "max_batch_wait_ms": {"type": "number", "minimum": 0, "maximum": MAX_BATCH_WAIT_MS, "default": 0},
        "public": {"type": "boolean", "default": False, "description": "callable without credentials"},
        "slo_ms": {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "maximum": MAX_TIMEOUT_S * 1000,
            "default": None,
            "description": "the latency (ms) a call should meet; SLO-aware policies order by it",
        },
    },
}


def slo_ms(raw: dict[str, Any], path: str = "") -> float | None:
    """`slo_ms`: None (no SLO), or milliseconds in (0, MAX_TIMEOUT_S x 1000], validated."""
    value = raw.get("slo_ms")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S * 1000:
        raise InvalidInput(
            f"{_at(path, 'slo_ms')}: expected milliseconds in (0, {MAX_TIMEOUT_S * 1000:g}], got {value!r}"
        )
    return float(value)


def batching(raw: dict[str, Any], path: str = "") -> dict[str, Any]:
    """`max_batch_size` (1 to MAX_BATCH_SIZE calls, default 1: no batching) and
    `max_batch_wait_ms` (0 to MAX_BATCH_WAIT_MS, default 0), validated."""
    size = _positive_int(raw, "max_batch_size", path, default=1)
    if size > MAX_BATCH_SIZE:
        raise InvalidInput(f"{_at(path, 'max_batch_size')}: at most {MAX_BATCH_SIZE} calls per batch, got {size}")
    wait = raw.get("max_batch_wait_ms", 0.0)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_BATCH_WAIT_MS:
        raise InvalidInput(
            f"{_at(path, 'max_batch_wait_ms')}: expected milliseconds in [0, {MAX_BATCH_WAIT_MS:g}], got {wait!r}"
        )
    return {"max_batch_size": size, "max_batch_wait_ms": float(wait)}


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _string(raw: dict[str, Any], key: str, path: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{_at(path, key)}: required, a non-empty string")
    return value


def _positive_int(raw: dict[str, Any], key: str, path: str, *, required: bool = False, default: int = 0) -> int:
    if key not in raw:
        if required:
            raise InvalidInput(f"{_at(path, key)}: required, a positive whole number")
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInput(f"{_at(path, key)}: expected a positive whole number, got {value!r}")
    return value


def _bool(raw: dict[str, Any], key: str, path: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"{_at(path, key)}: expected true or false, got {value!r}")
    return value


def _gpu(raw: dict[str, Any], path: str) -> str:
    value = raw.get("gpu", "any")
    if not isinstance(value, str) or not GPU_TYPE_PATTERN.match(value):
        raise InvalidInput(
            f"{_at(path, 'gpu')}: expected 'any' or a GPU type such as 'nvidia-h100-80gb-hbm3' "
            f"(see GET /system/gpus), got {value!r}"
        )
    return value


def _timeout(raw: dict[str, Any], path: str) -> float:
    value = raw.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidInput(f"{_at(path, 'timeout_s')}: expected seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return float(value)


def _str_map(raw: dict[str, Any], key: str, path: str) -> dict[str, str]:
    value = raw.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidInput(f"{_at(path, key)}: expected a map of strings to strings")
    return dict(value)
