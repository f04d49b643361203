"""What a caller's payload can do to a worker's decoding (gpu_manager.worker): JSON nested past
MAX_JSON_DEPTH is refused as the caller's error, before json's recursive decoder sees it."""

from __future__ import annotations

import json

import pytest

from gpu_manager.worker import MAX_JSON_DEPTH, PayloadRefused, decode_inputs, json_depth_over


def nested(depth: int, inner: bytes = b"") -> bytes:
    return (
        b'{"a":' * (depth // 2)
        + b"[" * (depth - depth // 2)
        + inner
        + b"]" * (depth - depth // 2)
        + b"}" * (depth // 2)
    )


def test_depth_counts_arrays_and_objects_but_not_brackets_in_strings() -> None:
    assert not json_depth_over(nested(MAX_JSON_DEPTH))
    assert json_depth_over(nested(MAX_JSON_DEPTH + 1))
    assert json.loads(nested(MAX_JSON_DEPTH, b"1"))  # what is let through parses
    # Brackets inside strings (escaped quotes included) do not nest.
    assert not json_depth_over(json.dumps(["[" * 1000, '"[' * 1000, "{" * 1000]).encode())
    # Many brackets side by side are shallow.
    assert not json_depth_over(json.dumps([[i, [i]] for i in range(10_000)]).encode())


@pytest.mark.parametrize("content_type", ["application/json", "application/problem+json", "text/x+json"])
def test_declared_json_nested_too_deep_is_invalid_input_not_a_recursion_error(content_type: str) -> None:
    with pytest.raises(PayloadRefused, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        decode_inputs(b"[" * 100_000 + b"]" * 100_000, content_type)


def test_undeclared_payloads_too_deep_for_json_are_given_as_bytes() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert decode_inputs(deep) == deep
    binary = bytes([0x5B]) * 600 + b"\xff\x00"  # binary data may hold more "[" than "]"
    assert decode_inputs(binary) == binary
