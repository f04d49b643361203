"""Function specs: what a deployed function is — one pydantic schema, used by stack.yml, the gateway's
routes (and its OpenAPI document) and the copies in etcd."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Self, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from gpufaas.errors import InvalidInput, shown
from gpufaas.types import DEFAULT_BATCH_SIZE

NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
GPU_TYPE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
MAX_BATCH_SIZE = 1024
MAX_BATCH_WAIT_MS = 10_000.0
MAX_MEMORY_MB = 10_000_000  # 10 TB: far past any GPU, well inside the wire's int64
# Of a function's labels, and of its environment, in all (names and values, UTF-8): settings, not
# data. The environment travels in every call's grant (scheduler to gateway to node); a spec past
# etcd's request limit (1.5 MiB) was refused by etcd on every try, answered as "etcd unreachable".
MAX_MAP_BYTES = 64 * 1024
# The batch `memory_mb` is declared at: far past any model's, and small enough that the scheduler's
# estimates (seconds per sample times the batch) stay finite floats.
MAX_DECLARED_BATCH_SIZE = 1_000_000

# What each field takes, in words: every error about a field says it (and where, and what it got).
EXPECTED: dict[str, str] = {
    "name": (
        "a function name: lower-case letters, digits and '-', at most 63 characters, starting and ending with a "
        "letter or digit"
    ),
    "package_digest": "expected 'sha256:' and 64 hex digits (the digest POST /system/packages answered)",
    "memory_mb": f"expected a positive whole number, at most {MAX_MEMORY_MB}: the model's peak GPU memory in MB",
    "gpu": "expected 'any' or a GPU type such as 'nvidia-h100-80gb-hbm3' (see GET /system/gpus)",
    "batch_size": f"expected a positive whole number, at most {MAX_DECLARED_BATCH_SIZE}",
    "timeout_s": f"expected seconds in (0, {MAX_TIMEOUT_S:g}]",
    "labels": f"expected a map of strings to strings (UTF-8 text), at most {MAX_MAP_BYTES // 1024} KiB in all",
    "environment": (
        "expected a map of variable names (not empty, without '=' or NUL) to strings (without NUL), in UTF-8 text, "
        f"at most {MAX_MAP_BYTES // 1024} KiB in all (put data in the package)"
    ),
    "max_batch_size": f"expected a positive whole number, at most {MAX_BATCH_SIZE} calls per batch",
    "max_batch_wait_ms": f"expected milliseconds in [0, {MAX_BATCH_WAIT_MS:g}]",
    "public": "expected true or false",
    "warmup": "expected true or false",
    "slo_ms": f"expected milliseconds in (0, {MAX_TIMEOUT_S * 1000:g}], or null for none",
}


def _utf8(strings: dict[str, str]) -> dict[str, str]:
    # A lone surrogate (JSON can escape one) has no UTF-8: stored, it would come back as U+FFFD,
    # a spec other than the one validated (another model tag, another environment).
    size_bytes = 0
    for text in (*strings, *strings.values()):
        try:
            size_bytes += len(text.encode())
        except UnicodeEncodeError:
            raise ValueError(f"{text!r} is not UTF-8 text") from None
    if size_bytes > MAX_MAP_BYTES:
        raise ValueError(f"{size_bytes} bytes in all, over {MAX_MAP_BYTES}")
    return strings


StringMap = Annotated[dict[str, str], AfterValidator(_utf8)]


def _environment(variables: dict[str, str]) -> dict[str, str]:
    # What the worker's os.environ can take: anything else would fail every load of the function.
    for name, value in variables.items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            raise ValueError(f"{name!r} cannot be set in a process's environment")
    return variables


Environment = Annotated[StringMap, AfterValidator(_environment)]


def _whole(value: Any) -> Any:
    # JSON Schema's "integer" takes 2.0 (a number whose fraction is zero): so does the spec.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


WHOLE = BeforeValidator(_whole)


class WorkerSettings(BaseModel):
    """The settings a function's worker runs by: the one record that travels, unread, from the
    scheduler's grant through the node to the worker (`to_wire` / `from_wire`). A setting the
    worker needs is a field here and is read where it is used (gpu_manager.backends, .worker).

    Dynamic batching is opt-in: with `max_batch_size` > 1 the worker merges up to that many calls
    that are waiting into one `predict(model, [inputs, ...])`, which returns a list of outputs;
    with fewer waiting it waits up to `max_batch_wait_ms` for more.

    `warmup`: run the handler's `warmup(model)` (where it has one) after `load`, before the first
    call; false makes a miss shorter by what the warm-up costs, and the first call pays it instead.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    environment: Environment = Field(
        default_factory=dict,
        description="set in the worker before the handler is imported",
        # What `_environment` checks, said in the schema too (the API's documentation, and what
        # clients generated from it send).
        json_schema_extra={
            "propertyNames": {"pattern": "^[^=\\u0000]+$"},
            "additionalProperties": {"type": "string", "pattern": "^[^\\u0000]*$"},
        },
    )
    max_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE), WHOLE] = 1
    max_batch_wait_ms: Annotated[float, Field(ge=0, le=MAX_BATCH_WAIT_MS)] = 0.0
    warmup: Annotated[bool, Field(description="run the handler's warmup(model) after it loads")] = True

    @property
    def max_batch_wait_s(self) -> float:
        return self.max_batch_wait_ms / 1000.0

    def to_wire(self) -> bytes:
        """What a grant and a worker's load carry (JSON; `from_wire` reads it)."""
        return self.model_dump_json().encode()

    @classmethod
    def from_wire(cls, data: bytes) -> WorkerSettings:
        """Read what `to_wire` wrote; empty means the defaults."""
        return cls.model_validate_json(data) if data else cls()


class FunctionSettings(WorkerSettings):
    """What a function's owner chooses (stack.yml's keys beside `handler` and `template`): the
    worker's settings (WorkerSettings) and what the scheduler and the gateway go by.

    `memory_mb` is the declared *peak* GPU occupancy of its model at `batch_size` (what the cache
    manager sizes it by until a measurement replaces it).

    `public`: anyone who reaches the gateway may call it. By default a call needs the cluster's
    invoke token or the admin credentials (docs/security.md).

    `slo_ms`: the latency a call should meet (end to end, from arrival); policies that know SLOs
    (`torpor`) put first the functions most likely to meet theirs. None: no SLO.

    Strict: no text or boolean stands for a number (`"5"` is not 5, `true` is not 1) nor a number
    for a boolean; a whole number may be written `5.0` (JSON Schema's integer) and a number of
    seconds or milliseconds `30`. Unknown fields are refused.
    """

    memory_mb: Annotated[
        int, Field(ge=1, le=MAX_MEMORY_MB, description="the model's peak GPU memory (MB) at batch_size"), WHOLE
    ]
    gpu: Annotated[
        str,
        Field(pattern=f"^any$|{GPU_TYPE_PATTERN.pattern}", description="a GPU type the function must run on, or any"),
    ] = "any"
    batch_size: Annotated[int, Field(ge=1, le=MAX_DECLARED_BATCH_SIZE), WHOLE] = DEFAULT_BATCH_SIZE
    timeout_s: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, description="a call's deadline")] = DEFAULT_TIMEOUT_S
    labels: StringMap = Field(default_factory=dict)
    public: Annotated[bool, Field(description="callable without credentials")] = False
    slo_ms: Annotated[
        float | None,
        Field(
            gt=0,
            le=MAX_TIMEOUT_S * 1000,
            description="the latency (ms) a call should meet; SLO-aware policies order by it",
        ),
    ] = None

    @classmethod
    def from_dict(cls, raw: Any, *, path: str = "") -> FunctionSettings:
        """Validate user input (InvalidInput naming the field, what it takes and what it got)."""
        return _validate(cls, raw, path)


_MODEL_BOUND = {*WorkerSettings.model_fields, "gpu"}
_MODEL_BOUND_DEFAULTS = {
    **WorkerSettings().model_dump(mode="json"),
    "gpu": FunctionSettings.model_fields["gpu"].default,
}


def not_deployed(name: str) -> str:
    """What a call to a function that is not deployed is answered (a gateway's 404, a scheduler's NOT_FOUND)."""
    return f"function {name!r} is not deployed; deploy it first (gpufaas deploy)"


def model_tag(settings: FunctionSettings) -> str:
    """A short name of what a function's workers are bound to beyond its package, where it is not
    the default ('' then): the worker settings (read once, at a worker's start) and the GPU type it
    requires (where its workers may run). The part of a model that tells them apart; the same
    settings in any order of their environment's keys give the same tag."""
    bound = settings.model_dump(mode="json", include=_MODEL_BOUND)
    if bound == _MODEL_BOUND_DEFAULTS:
        return ""
    return hashlib.sha256(json.dumps(bound, sort_keys=True).encode()).hexdigest()[:8]


class FunctionSpec(FunctionSettings):
    """A deployed inference function: its settings, its name and its uploaded package.

    Each (function, package, worker settings, GPU type required) is its own cache item: `model`
    changes when the package does, a setting its worker reads at its start (`WorkerSettings`: the
    environment, batching, warm-up) or the GPU type it must run on, so an update never reuses a
    worker of the old version, nor one on a GPU of a type no longer allowed. Other settings
    (memory, timeout, SLO) are the scheduler's and the gateway's, and keep the model.
    """

    name: Annotated[str, Field(pattern=NAME_PATTERN.pattern, max_length=63, description="the function")]
    package_digest: Annotated[
        str, Field(pattern=DIGEST_PATTERN.pattern, description="an uploaded package (POST /system/packages)")
    ]

    @model_validator(mode="before")
    @classmethod
    def _openfaas_names(cls, raw: Any) -> Any:
        # OpenFaaS's deploy request names the function "service" and its environment "envVars".
        if isinstance(raw, dict) and (("service" in raw and "name" not in raw) or "envVars" in raw):
            raw = dict(raw)
            if "service" in raw and "name" not in raw:
                raw["name"] = raw.pop("service")
            if "envVars" in raw and "environment" not in raw:
                raw["environment"] = raw.pop("envVars")
        return raw

    @property
    def required_gpu_type(self) -> str | None:
        return None if self.gpu == "any" else self.gpu

    @functools.cached_property
    def model(self) -> str:
        # Cached: the scheduler and the gateway ask for it several times per call (not a field:
        # neither dumped nor compared). `name@digest` (its first 12 hex digits), and with settings
        # other than the defaults `-tag` (model_tag).
        model = f"{self.name}@{self.package_digest.removeprefix('sha256:')[:12]}"
        tag = model_tag(self)
        return f"{model}-{tag}" if tag else model

    @functools.cached_property
    def worker_wire(self) -> bytes:
        # Cached: every grant carries it (not a field: neither dumped nor compared).
        return WorkerSettings.model_validate(self.model_dump(include=set(WorkerSettings.model_fields))).to_wire()

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy (pydantic's: not validated); with `update`, its cached `model` and `worker_wire`
        are made afresh from the copy's fields, not carried over from this spec's."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            for cached in ("model", "worker_wire"):
                copy.__dict__.pop(cached, None)
        return copy

    def deadline_message(self) -> str:
        """What a caller is told when this function's `timeout_s` passed."""
        return (
            f"function {self.name!r} did not finish within its timeout of {self.timeout_s:g} s; "
            "raise its timeout_s or send it less work"
        )

    def to_json(self) -> bytes:
        """The form stored in etcd (every field, defaults included)."""
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> FunctionSpec:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise InvalidInput(explain(exc.errors(), cls)) from None

    @classmethod
    def stored_at(cls, key: str, data: bytes | str, function_key: Callable[[str], str]) -> FunctionSpec:
        """The spec stored at the etcd `key` (`function_key`: the key a function's spec is kept
        under, `Keys.function`); InvalidInput for one that is invalid or names another function
        (put by hand): mirrored by its own name, its key's delete would take out nobody."""
        spec = cls.from_json(data)
        if key != function_key(spec.name):
            raise InvalidInput(f"it names function {spec.name!r}")
        return spec

    @classmethod
    def from_dict(cls, raw: Any, *, path: str = "") -> FunctionSpec:
        """Validate user input (InvalidInput naming the field, what it takes and what it got)."""
        return _validate(cls, raw, path)


M = TypeVar("M", bound=FunctionSettings)


def _validate(model: type[M], raw: Any, path: str) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput(explain(exc.errors(), model, path)) from None


def explain(errors: list[ErrorDetails], model: type[BaseModel] = FunctionSpec, path: str = "") -> str:
    """One line for the first of pydantic's `errors` about a `model`: where (`path`, then the
    field), what the field takes, and what it got."""
    if not errors:
        return f"{path or 'function spec'}: invalid"
    # Fields in the order a reader fills them in: the name first.
    error = min(errors, key=lambda e: _ORDER.get(str(e["loc"][0]) if e["loc"] else "", -1))
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "json_invalid":
        return f"{path or 'function spec'}: not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})"
    if not loc:
        return f"{path or 'function spec'}: expected an object with the fields {', '.join(_fields(model))}"
    field = shown(loc[0])
    where = f"{path}.{field}" if path else field
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field; known fields: {', '.join(_fields(model))}"
    expected = EXPECTED.get(field, error["msg"])
    if error["type"] == "missing":
        return f"{where}: required; {expected.removeprefix('expected ')}"
    value = shown(repr(error.get("input")))  # (a refused value is quoted cut short, not whole)
    if field == "name":
        if isinstance(error.get("input"), str):
            return f"{where}: {value} is not a valid function name; use {expected.removeprefix('a function name: ')}"
        return f"{where}: expected {expected}, got {value}"
    if len(loc) > 1:  # inside a mapping: say which entry
        return f"{where}: {expected}; {shown('.'.join(loc[1:]))} is {value}"
    return f"{where}: {expected}, got {value}"


_ORDER = {name: i for i, name in enumerate(["name", "package_digest", *EXPECTED])}


def _fields(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)
