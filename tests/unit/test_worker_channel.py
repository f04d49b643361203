"""The worker's end of its socket (gpu_manager.worker.Channel) and its per-call decoding and
encoding, against what they stand for: frames as gpufaas.wire writes them however the socket cuts
them, and json.loads / json.dumps' answers for every payload and output."""

from __future__ import annotations

import codecs
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from gpu_manager import worker
from gpu_manager.worker import READ_BYTES, Channel, PayloadRefused, decode_inputs, encode_result
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import MessageType, encode


def call_frame(call_id: str, body: bytes, content_type: str = "application/json") -> bytes:
    return encode(MessageType.CALL, pb.Call(call_id=call_id, content_type=content_type), body) + body


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, Channel]]:
    node, worker_end = socket.socketpair()
    try:
        yield node, Channel(worker_end)
    finally:
        node.close()
        worker_end.close()


def received(channel: Channel) -> tuple[str, bytes]:
    frame = channel.recv()
    assert frame is not None and frame.type == MessageType.CALL
    return pb.Call.FromString(frame.header).call_id, frame.body


def test_frames_cut_anywhere_by_the_socket_are_read_whole_and_in_order(pair: tuple[socket.socket, Channel]) -> None:
    node, channel = pair
    bodies = [b"", b"x", b'{"inputs": [[1, 2, 3, 4]]}', bytes(range(256)) * 40]
    stream = b"".join(call_frame(f"c{i}", body) for i, body in enumerate(bodies))
    # One byte at a time, then in odd chunks: each frame comes out whole once its last byte is in.
    for chunk in (1, 7, 1000):
        taken = []
        for at in range(0, len(stream), chunk):
            node.sendall(stream[at : at + chunk])
            while channel.pending():
                taken.append(received(channel))
        assert taken == [(f"c{i}", body) for i, body in enumerate(bodies)]


def test_several_waiting_frames_are_read_in_one_go_and_taken_one_by_one(pair: tuple[socket.socket, Channel]) -> None:
    node, channel = pair
    node.sendall(b"".join(call_frame(f"c{i}", b"%d" % i) for i in range(50)))
    assert [received(channel) for _ in range(50)] == [(f"c{i}", b"%d" % i) for i in range(50)]
    assert not channel.pending()


@pytest.mark.parametrize("size", [READ_BYTES - 40, READ_BYTES, 3 * READ_BYTES + 5, 5 << 20])
def test_a_frame_larger_than_the_buffer_is_read_whole_and_its_buffer_goes_with_it(
    pair: tuple[socket.socket, Channel], size: int
) -> None:
    node, channel = pair
    big = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    stream = call_frame("small", b"a") + call_frame("big", big) + call_frame("after", b"b")
    sender = threading.Thread(target=node.sendall, args=(stream,))  # larger than the socket's buffer
    sender.start()
    try:
        assert received(channel) == ("small", b"a")
        assert received(channel) == ("big", big)
        assert received(channel) == ("after", b"b")
    finally:
        sender.join()
    assert len(channel._buf) == READ_BYTES  # not kept at the large frame's size


def test_the_end_of_the_stream_is_none_even_mid_frame(pair: tuple[socket.socket, Channel]) -> None:
    node, channel = pair
    frame = call_frame("c", b"payload")
    node.sendall(frame + frame[:10])
    node.shutdown(socket.SHUT_WR)
    assert received(channel) == ("c", b"payload")
    assert not channel.pending(0.01) and channel.recv() is None


def test_pending_waits_at_most_its_timeout_for_a_whole_frame(pair: tuple[socket.socket, Channel]) -> None:
    node, channel = pair
    frame = call_frame("c", b"x" * 100)
    node.sendall(frame[:50])
    assert not channel.pending(0.02)
    node.sendall(frame[50:])
    assert channel.pending(1.0) and received(channel) == ("c", b"x" * 100)


# --- decoding and encoding, against json's own answers ----------------------------------------------


def json_loads_answer(payload: bytes) -> tuple[Any, ...]:
    """What json.loads(payload) gives: the value, or the type and text of what it raises."""
    try:
        return ("value", json.loads(payload))
    except (ValueError, RecursionError) as exc:
        return ("raises", type(exc), str(exc))


PAYLOADS = [
    b"",
    b" ",
    b"null",
    b"3",
    b'"\xc3\xa9t\xc3\xa9"',
    b'{"inputs": [[0.1, 0.2, 0.3, 0.4]]}',
    b"  [1, 2]  ",
    b"[1, 2] x",  # extra data
    b"{",
    b"\xff\xfe",
    b"\xff",
    b"\xc3",  # a truncated UTF-8 sequence
    b'"\xed\xa0\x80"',  # an encoded surrogate: json reads it ("surrogatepass")
    b"\x00",
    b"1\x00",
    b"NaN",
    b"[Infinity, -Infinity]",
    b'{"a": 1, "a": 2}',
    b"1" * 5000,  # a big integer
    codecs.BOM_UTF8 + b'{"bom": 1}',
    codecs.BOM_UTF8 + b"\xff",
    *(f'{{"enc": "{enc}"}}'.encode(enc) for enc in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le")),
    "[1]".encode("utf-32-be"),
    "7".encode("utf-16-be"),
    "7".encode("utf-16-le"),
    b"[" * 400 + b"]" * 400,
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_undeclared_and_declared_json_decode_exactly_as_json_loads_reads_them(payload: bytes) -> None:
    answer = json_loads_answer(payload)
    # Undeclared: the value, or the bytes as they are (compared by repr: NaN is not equal to itself).
    assert repr(decode_inputs(payload)) == repr(answer[1] if answer[0] == "value" else payload)
    # Declared JSON: the value, or refused with json's own message.
    if not payload:
        assert decode_inputs(payload, "application/json") is None  # an empty body is JSON null
    elif answer[0] == "value":
        assert repr(decode_inputs(payload, "application/json")) == repr(answer[1])
    else:
        with pytest.raises(PayloadRefused) as refused:
            decode_inputs(payload, "application/json")
        assert str(refused.value) == f"the payload is declared application/json but is not valid JSON: {answer[2]}"


def test_declared_json_keeps_floats_and_keys_as_json_does() -> None:
    payload = b'{"x": 1.5e300, "y": -0.0, "z": 12345678901234567890, "s": "\\u00e9\\ud83d\\ude00"}'
    decoded = decode_inputs(payload, "application/json")
    assert decoded == json.loads(payload)
    assert repr(decoded) == repr(json.loads(payload))


OUTPUTS: list[object] = [
    None,
    0,
    -1.5,
    1e308,
    -0.0,
    "text",
    {"outputs": [[0.12345678, -0.5, 0.25]]},
    {"é": ["\u2028", "\ud800"], 1: True, None: False, 2.5: None},
    [[[]]],
    (1, 2),
]


@pytest.mark.parametrize("output", OUTPUTS)
def test_outputs_encode_exactly_as_json_dumps_writes_them(output: object) -> None:
    if isinstance(output, str):
        assert encode_result(output) == (output.encode(), "text/plain; charset=utf-8")
        return
    expected = json.dumps(output, default=worker._json_default, separators=(",", ":"), allow_nan=False).encode()
    assert encode_result(output) == (expected, "application/json")


NOT_FINITE: list[object] = [float("nan"), float("inf"), {"a": [1.0, -float("inf")]}, (0.5, float("nan"))]


@pytest.mark.parametrize("output", NOT_FINITE)
def test_an_output_holding_nan_or_infinity_is_refused_for_json_cannot_carry_it(output: object) -> None:
    # Written once as bare NaN / Infinity tokens under application/json: no strict parser reads those.
    with pytest.raises(ValueError) as refused:
        encode_result(output)
    assert str(refused.value) == worker.NOT_FINITE_OUTPUT
    assert str(refused.value).startswith("the output holds NaN or Infinity, which JSON cannot carry; return None")


def test_tensors_and_arrays_holding_nan_or_infinity_are_refused_alike() -> None:
    torch = pytest.importorskip("torch")
    numpy = pytest.importorskip("numpy")
    for output in (
        torch.tensor([[1.0, float("inf")]]),
        {"t": torch.tensor([float("nan")], dtype=torch.float16)},
        numpy.array([-numpy.inf]),
        numpy.float32("nan"),
    ):
        with pytest.raises(ValueError) as refused:
            encode_result(output)
        assert str(refused.value) == worker.NOT_FINITE_OUTPUT
    assert encode_result(torch.tensor([1.0, -2.5])) == (b"[1.0,-2.5]", "application/json")


def test_an_unencodable_or_circular_output_fails_that_call_only_and_the_next_encodes() -> None:
    circular: list[object] = [1]
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular reference detected"):
        encode_result(circular)
    with pytest.raises(TypeError, match="object is not bytes, str or JSON-serializable"):
        encode_result({"a": [1, object()]})
    # What the failures left behind does not refuse a later output holding the same objects.
    inner = [1, 2]
    assert encode_result({"a": inner, "b": inner}) == (b'{"a":[1,2],"b":[1,2]}', "application/json")
    assert encode_result([circular[0]]) == (b"[1]", "application/json")


def test_numpy_scalar_and_0d_tensor_dict_keys_are_written_as_their_python_numbers() -> None:
    # {numpy.int64(3): 0.9}, a class index as key, failed with json's "keys must be str, int, ...
    # not numpy.int64", although numpy values were taken everywhere else in an output.
    numpy = pytest.importorskip("numpy")
    output = {numpy.int64(3): 0.9, "top": [{numpy.float64(0.5): 1, numpy.bool_(True): 2}], "t": ({numpy.uint8(7): 3},)}
    expected = {3: 0.9, "top": [{0.5: 1, True: 2}], "t": ({7: 3},)}
    assert encode_result(output) == (json.dumps(expected, separators=(",", ":")).encode(), "application/json")
    torch = pytest.importorskip("torch")
    assert encode_result({torch.tensor(2): "b"}) == (b'{"2":"b"}', "application/json")


def test_a_dict_key_json_cannot_write_is_refused_in_one_line_naming_its_type() -> None:
    with pytest.raises(TypeError) as refused:
        encode_result({"a": {(1, 2): 3}})
    assert str(refused.value).startswith("the output holds a dict key of type tuple; a JSON object's keys must be")
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="a dict key of type complex;"):
        encode_result({numpy.int64(1): 1, numpy.complex128(1j): 2})
    circular: dict[object, object] = {numpy.int64(1): 1}
    circular["self"] = circular
    with pytest.raises(ValueError, match="Circular reference detected"):
        encode_result(circular)


def test_a_str_output_holding_a_surrogate_is_refused_in_one_line_naming_it() -> None:
    # It failed with the raw "'utf-8' codec can't encode character '\udcff' in position 2:
    # surrogates not allowed", while the same str inside a list is sent, as JSON's \u escape.
    with pytest.raises(ValueError) as refused:
        encode_result("ab\udcff")
    assert not isinstance(refused.value, UnicodeError)
    assert str(refused.value).startswith(
        "the output str holds U+DCFF at index 2, a surrogate, which UTF-8 cannot carry; return bytes"
    )
    assert encode_result(["ab\udcff"]) == (b'["ab\\udcff"]', "application/json")
    assert encode_result("é") == ("é".encode(), "text/plain; charset=utf-8")
