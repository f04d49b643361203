"""Function specs (validation, JSON) and the etcd key layout."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.errors import InvalidInput
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys, gpu_address, split_gpu_address

DIGEST = "sha256:" + "ab" * 32


def test_spec_round_trips_and_names_its_model_by_package() -> None:
    spec = FunctionSpec.from_dict({"name": "resnet", "package_digest": DIGEST, "memory_mb": 1500, "labels": {"a": "b"}})
    assert FunctionSpec.from_json(spec.to_json()) == spec
    assert spec.model == "resnet@" + "ab" * 6
    assert spec.required_gpu_type is None
    assert FunctionSpec.from_dict({**json.loads(spec.to_json()), "gpu": "h100"}).required_gpu_type == "h100"
    other = FunctionSpec.from_dict({"name": "resnet", "package_digest": "sha256:" + "cd" * 32, "memory_mb": 1500})
    assert other.model != spec.model


def test_the_model_changes_with_what_its_workers_are_bound_to_only() -> None:
    """A worker reads its environment, batching and warm-up once, and runs on a GPU of one type: a
    change of them, or of the GPU type required, is a new model (no worker of the old version is
    reused); memory, timeout and SLO are not the worker's."""
    base = {"name": "resnet", "package_digest": DIGEST, "memory_mb": 1500}
    plain = FunctionSpec.from_dict(base)
    assert plain.model == "resnet@" + "ab" * 6  # the defaults: no tag
    same_model = [{"memory_mb": 3000}, {"timeout_s": 5}, {"slo_ms": 100}, {"labels": {"a": "b"}}, {"public": True}]
    assert {FunctionSpec.from_dict({**base, **change}).model for change in same_model} == {plain.model}
    changed = [
        {"environment": {"A": "1"}},
        {"environment": {"A": "2"}},
        {"max_batch_size": 4},
        {"max_batch_size": 4, "max_batch_wait_ms": 5},
        {"warmup": False},
        {"gpu": "h100"},
        {"gpu": "a100"},
    ]
    models = [FunctionSpec.from_dict({**base, **change}).model for change in changed]
    assert len({plain.model, *models}) == len(changed) + 1
    assert all(model.startswith(plain.model + "-") for model in models)
    # The environment's keys in another order are the same settings.
    one = FunctionSpec.from_dict({**base, "environment": {"A": "1", "B": "2"}})
    other = FunctionSpec.from_dict({**base, "environment": {"B": "2", "A": "1"}})
    assert one.model == other.model
    assert FunctionSpec.from_dict({**base, "gpu": "any"}).model == plain.model  # the default, written out


def test_a_copy_with_other_settings_names_its_own_model_and_worker_settings() -> None:
    # `model` and `worker_wire` are cached on the spec: a copy must not carry the original's.
    spec = FunctionSpec.from_dict({"name": "resnet", "package_digest": DIGEST, "memory_mb": 1500})
    assert spec.model == "resnet@" + "ab" * 6 and spec.worker_wire  # (both cached now)
    copy = spec.model_copy(update={"environment": {"A": "1"}})
    rebuilt = FunctionSpec.from_dict({**json.loads(spec.to_json()), "environment": {"A": "1"}})
    assert (copy.model, copy.worker_wire) == (rebuilt.model, rebuilt.worker_wire) != (spec.model, spec.worker_wire)
    assert spec.model_copy().model == spec.model


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"package_digest": DIGEST, "memory_mb": 1}, "name: required"),
        ({"name": "Bad_Name", "package_digest": DIGEST, "memory_mb": 1}, "not a valid function name"),
        ({"name": "f", "package_digest": "md5:x", "memory_mb": 1}, "package_digest: expected 'sha256:'"),
        ({"name": "f", "package_digest": DIGEST}, "memory_mb: required"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": -5}, "memory_mb: expected a positive whole number"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "timeout_s": 0}, "timeout_s: expected seconds"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "labels": {"a": 1}}, "labels: expected a map"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "gpus": 2}, "gpus: unknown field"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "gpu": None}, "gpu: expected 'any' or a GPU type"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "gpu": ["x"]}, "gpu: expected 'any' or a GPU type"),
        # Taken, these would fail later: every call's estimate (an int too large for a float
        # wedged the scheduler's queue), every load (os.environ refuses such names and values).
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "batch_size": 10**400}, "batch_size: expected a"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "environment": {"A=B": "1"}}, "environment: exp"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "environment": {"": "1"}}, "without '=' or NUL"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "environment": {"A\x00": "1"}}, "environment: "),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "environment": {"A": "1\x00"}}, "environment: "),
        # Settings, not data: the environment travels in every call's grant, and etcd refuses a
        # spec past 1.5 MiB (on every try: a deploy answered "etcd unreachable").
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "environment": {"A": "x" * 70_000}}, "64 KiB in all"),
        ({"name": "f", "package_digest": DIGEST, "memory_mb": 1, "labels": {"a": "x" * 2_000_000}}, "64 KiB in all"),
    ],
)
def test_invalid_specs_say_which_field_and_what_is_expected(raw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        FunctionSpec.from_dict(raw)


@pytest.mark.parametrize(
    "raw",
    [
        {"name": "x" * 1_000_000, "package_digest": DIGEST, "memory_mb": 1},
        {"name": "f", "package_digest": DIGEST, "memory_mb": "9" * 1_000_000},
        {"name": "f", "package_digest": DIGEST, "memory_mb": 1, "x" * 1_000_000: 1},
        {"name": "f", "package_digest": DIGEST, "memory_mb": 1, "labels": {"x" * 1_000_000: 1}},
    ],
)
def test_a_refused_value_or_key_is_quoted_cut_short_not_whole(raw: dict[str, object]) -> None:
    with pytest.raises(InvalidInput) as caught:
        FunctionSpec.from_dict(raw)
    assert len(str(caught.value)) < 500 and "..." in str(caught.value)


def test_key_layout_matches_the_design() -> None:
    keys = Keys("/gpufaas")
    assert keys.function("f") == "/gpufaas/functions/f"
    assert keys.node("n1") == "/gpufaas/nodes/n1"
    assert keys.gpu_status("n1", "gpu0") == "/gpufaas/gpus/n1/gpu0/status"
    assert keys.gpu_lru("n1", "gpu0") == "/gpufaas/gpus/n1/gpu0/lru"
    assert keys.profile("rtx2080", "m") == "/gpufaas/profiles/rtx2080/m"
    assert keys.replicas("m") == "/gpufaas/models/m/replicas"
    assert keys.parse_gpu_key("/gpufaas/gpus/n1/gpu0/lru") == ("n1", "gpu0", "lru")
    assert keys.parse_gpu_key("/gpufaas/gpus/n1/gpu0/other") is None


def test_keys_refuse_segments_that_would_change_the_layout() -> None:
    with pytest.raises(ValueError, match="no '/'"):
        Keys().function("a/b")
    with pytest.raises(ValueError, match="must start with '/'"):
        Keys("gpufaas")


def test_gpu_addresses() -> None:
    assert split_gpu_address(gpu_address("node0", "gpu1")) == ("node0", "gpu1")
    with pytest.raises(ValueError):
        split_gpu_address("nogpu")


# --- the spec's JSON Schema agrees with its validation ----------------------------------------------

SCHEMA_DIGEST = "sha256:" + "ab" * 32
FUNCTION_SPEC_SCHEMA = FunctionSpec.model_json_schema()  # what the gateway documents (FastAPI renders the same)


def test_the_schema_lists_exactly_the_fields_the_spec_takes() -> None:
    fields = set(FunctionSpec.model_fields)
    assert set(FUNCTION_SPEC_SCHEMA["properties"]) == fields
    assert FUNCTION_SPEC_SCHEMA["additionalProperties"] is False
    with pytest.raises(InvalidInput, match="unknown field"):
        FunctionSpec.from_dict({"name": "f", "package_digest": SCHEMA_DIGEST, "memory_mb": 1, "nope": 1})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_mb", FUNCTION_SPEC_SCHEMA["properties"]["memory_mb"]["minimum"] - 1),
        ("batch_size", 0),
        ("batch_size", FUNCTION_SPEC_SCHEMA["properties"]["batch_size"]["maximum"] + 1),
        ("timeout_s", FUNCTION_SPEC_SCHEMA["properties"]["timeout_s"]["maximum"] + 1),
        ("timeout_s", 0),
        ("max_batch_size", FUNCTION_SPEC_SCHEMA["properties"]["max_batch_size"]["maximum"] + 1),
        ("max_batch_wait_ms", FUNCTION_SPEC_SCHEMA["properties"]["max_batch_wait_ms"]["maximum"] + 1),
        ("max_batch_wait_ms", -1),
        ("public", "yes"),
        ("gpu", "Not A Type"),
        ("labels", {"a": 1}),
    ],
)
def test_a_value_outside_the_schema_is_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidInput, match=field):
        FunctionSpec.from_dict({"name": "f", "package_digest": SCHEMA_DIGEST, "memory_mb": 1, field: value})


@given(
    memory_mb=st.integers(min_value=1, max_value=10**6),
    timeout_s=st.floats(min_value=0.001, max_value=FUNCTION_SPEC_SCHEMA["properties"]["timeout_s"]["maximum"]),
    max_batch_size=st.integers(min_value=1, max_value=FUNCTION_SPEC_SCHEMA["properties"]["max_batch_size"]["maximum"]),
    public=st.booleans(),
)
def test_values_inside_the_schema_are_taken(
    memory_mb: int, timeout_s: float, max_batch_size: int, public: bool
) -> None:
    spec = FunctionSpec.from_dict(
        {
            "name": "f",
            "package_digest": SCHEMA_DIGEST,
            "memory_mb": memory_mb,
            "timeout_s": timeout_s,
            "max_batch_size": max_batch_size,
            "public": public,
        }
    )
    assert (spec.memory_mb, spec.max_batch_size, spec.public) == (memory_mb, max_batch_size, public)


def test_a_node_record_takes_gpu_fields_it_does_not_know_and_refuses_other_shapes() -> None:
    # A newer node (a rolling upgrade) may add fields to its GPUs; an older reader takes the rest.
    record = NodeRecord("n1", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 8000, "cpu")])
    raw = json.loads(record.to_json())
    raw["gpus"][0]["numa"] = 0
    assert NodeRecord.from_json(json.dumps(raw).encode()) == record
    for bad in (
        b"null",
        b"[]",
        b'{"node": "n1"}',
        b'{"node": "n1", "address": "a", "backend": "cpu", "incarnation": "i", "gpus": [1]}',
        b"not json",
        # Fields of other types: taken in, a string memory_mb failed the scheduler's attach of the
        # node (TypeError comparing it), where an invalid record is passed over with a warning.
        *(
            json.dumps({**raw, "gpus": [{**raw["gpus"][0], field: value}]}).encode()
            for field, value in (("memory_mb", "8000"), ("memory_mb", 8.5), ("memory_mb", -1), ("gpu", 0))
        ),
        json.dumps({**raw, "node": ["n1"]}).encode(),
    ):
        with pytest.raises(ValueError):
            NodeRecord.from_json(bad)
