"""Function specs (validation, JSON) and the etcd key layout."""

from __future__ import annotations

import json

import pytest

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
    ],
)
def test_invalid_specs_say_which_field_and_what_is_expected(raw: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        FunctionSpec.from_dict(raw)


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
