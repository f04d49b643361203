"""The worker's serve loop (gpu_manager.worker.serve) against a handler that misbehaves: whatever one
call's handler does, every call the worker was given is answered, once, and the worker serves on."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpu_manager import worker
from gpu_manager.backends import PACKAGE_DIR_ENV, Backend, CpuBackend, ModelLoad, WorkerDevice
from gpufaas.functions import WorkerSettings
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import HEADER_ALLOWANCE_BYTES, MessageType, encode


class _Handler(Backend):
    """A backend whose predict is the test's `handler`."""

    device = "cpu"

    def __init__(self, handler: Callable[[object], object]) -> None:
        super().__init__(WorkerDevice("cpu", "g0", 0))
        self.handler = handler

    def load(self, spec: ModelLoad) -> None:
        pass

    def predict(self, inputs: object) -> object:
        return self.handler(inputs)

    def peak_memory_mb(self) -> int:
        return 0


def served(handler: Callable[[object], object], bodies: list[bytes], max_batch_size: int = 1) -> list[pb.CallResult]:
    """What the worker answers calls `c0`, `c1`, ... (JSON `bodies`), written before it serves; read
    while it serves (an answer larger than the socket's buffer would wait on the reader)."""
    node, end = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            spec = ModelLoad("m", "", 1, WorkerSettings(max_batch_size=max_batch_size))
            worker.serve(_Handler(handler), worker.Channel(end), spec, 1 << 20)
        except BaseException as exc:  # the test's failure, not the thread's
            errors.append(exc)
        finally:
            end.close()  # the node reads the end of the stream: served is done

    try:
        for i, body in enumerate(bodies):
            call = pb.Call(call_id=f"c{i}", content_type="application/json")
            node.sendall(encode(MessageType.CALL, call, body) + body)
        node.shutdown(socket.SHUT_WR)  # the node lets go once they are answered: serve returns
        thread = threading.Thread(target=serve)
        thread.start()
        channel = worker.Channel(node)
        results = []
        while (frame := channel.recv()) is not None:
            results.append(pb.CallResult.FromString(frame.header))
        thread.join()
        assert not errors, f"serve raised {errors[0]!r}"
        return results
    finally:
        node.close()


def test_a_handler_error_whose_message_is_not_utf8_fails_its_call_only() -> None:
    # A lone surrogate (a path decoded with surrogateescape, or the caller's JSON "\udcff"), which
    # protobuf refuses to encode: the worker's answer raised, and the worker died with its queue.
    def handler(inputs: object) -> object:
        if inputs == "bad":
            raise ValueError(f"no such file: /tmp/{chr(0xDCFF)}")
        return inputs

    first, second = served(handler, [b'"bad"', b'"good"'])
    assert (first.call_id, first.outcome) == ("c0", pb.INVALID_INPUT)
    assert first.message == "invalid input: ValueError: no such file: /tmp/\\udcff"
    assert (second.call_id, second.outcome) == ("c1", pb.OK)


def test_a_handler_error_whose_message_cannot_be_read_fails_its_call_only() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    def handler(inputs: object) -> object:
        if inputs == "bad":
            raise Unprintable
        return inputs

    first, second = served(handler, [b'"bad"', b'"good"'])
    assert (first.outcome, first.message) == (
        pb.HANDLER_ERROR,
        "predict raised Unprintable (its message could not be read)",
    )
    assert (second.call_id, second.outcome) == ("c1", pb.OK)


def test_a_value_error_from_predict_refuses_its_input_and_any_other_error_is_the_handlers() -> None:
    # The handler contract asks a handler to raise ValueError saying what to send: that was a 500
    # "predict raised ValueError: ...", the caller told the function failed when its input was wrong.
    def handler(inputs: object) -> object:
        if inputs == "bad":
            raise ValueError("expected a JSON object with 'text'")
        if inputs == "bug":
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return inputs

    bad, bug, good = served(handler, [b'"bad"', b'"bug"', b'"good"'])
    assert bad.outcome == pb.INVALID_INPUT
    assert bad.message == "invalid input: ValueError: expected a JSON object with 'text'"
    assert (bug.outcome, bug.message) == (
        pb.HANDLER_ERROR,
        "predict raised RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    )
    assert good.outcome == pb.OK


def test_one_bad_input_in_a_merged_batch_fails_only_its_own_call() -> None:
    # With max_batch_size > 1 a predict that raised on one caller's input failed every call merged
    # with it: the good calls' callers got a 500 for another caller's mistake.
    def handler(inputs: object) -> object:
        assert isinstance(inputs, list)
        if "bad" in inputs:
            raise ValueError("'text' must be a string")
        return [f"ok {one}" for one in inputs]

    results = {result.call_id: result for result in served(handler, [b'"a"', b'"bad"', b'"b"'], max_batch_size=4)}
    assert [results[c].outcome for c in ("c0", "c1", "c2")] == [pb.OK, pb.INVALID_INPUT, pb.OK]
    assert results["c1"].message == "invalid input: ValueError: 'text' must be a string"


def test_a_load_that_calls_sys_exit_is_a_failed_load_told_to_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # SystemExit is no Exception: it left the worker without its ModelLoaded, and the node took
    # the load for a worker that died (WORKER_DIED: transient, the call placed again, and again).
    class Exits(_Handler):
        def load(self, spec: ModelLoad) -> None:
            sys.exit("weights.safetensors not found")

    monkeypatch.setattr(worker, "confine", lambda confinement: None)  # this test process stays as it is
    node, end = socket.socketpair()
    with node, end:
        spec = ModelLoad("m", "", 1)
        assert not worker._load_model(worker.Channel(end), Exits(lambda inputs: inputs), spec, pb.LoadModel())
        frame = worker.Channel(node).recv()
    assert frame is not None and frame.type == MessageType.MODEL_LOADED
    loaded = pb.ModelLoaded.FromString(frame.header)
    assert (loaded.ok, loaded.error) == (False, "SystemExit: weights.safetensors not found")


def test_an_output_whose_encoding_runs_sys_exit_fails_its_call_only() -> None:
    # Encoding runs the handler's code too (json asks a dict subclass for its items()).
    class Exits(dict[str, object]):
        def items(self) -> Any:
            sys.exit(3)

    def handler(inputs: object) -> object:
        return Exits(a=1) if inputs == "bad" else inputs

    first, second = served(handler, [b'"bad"', b'"good"'])
    assert (first.call_id, first.outcome, first.message) == ("c0", pb.OUTPUT_INVALID, "SystemExit: 3")
    assert (second.call_id, second.outcome) == ("c1", pb.OK)


def test_a_handler_error_quoting_a_large_input_is_cut_and_fits_the_nodes_frame_limit() -> None:
    # A message quoting its input (a binary payload's repr is 4 times its size) was sent whole:
    # a CallResult header over the node's frame limit (its body limit + HEADER_ALLOWANCE_BYTES)
    # closed the worker's socket, and every other call on it failed with the worker.
    described = "ValueError: not an image: " + repr(bytes(HEADER_ALLOWANCE_BYTES // 2))

    def handler(inputs: object) -> object:
        if inputs == "bad":
            raise ValueError(described.removeprefix("ValueError: "))
        return inputs

    first, second = served(handler, [b'"bad"', b'"good"'])
    assert len(described) > HEADER_ALLOWANCE_BYTES
    assert first.outcome == pb.INVALID_INPUT
    assert first.ByteSize() < HEADER_ALLOWANCE_BYTES // 16
    cut = len(described) - worker.MAX_MESSAGE_CHARS
    assert first.message == f"invalid input: {described[: worker.MAX_MESSAGE_CHARS]} ... [{cut} more characters cut]"
    assert (second.call_id, second.outcome) == ("c1", pb.OK)


def test_a_package_the_worker_cannot_open_is_a_failed_load_told_to_the_node(tmp_path: Path) -> None:
    # os.open's OSError left the worker before its ModelLoaded: the node saw a worker that died
    # while loading (WORKER_DIED: transient, placed again to die again), and never why.
    node, end = socket.socketpair()
    with node, end:
        load = pb.LoadModel(model="m", package_dir=str(tmp_path / "gone"), uid=os.getuid() or 1)
        assert worker._take_model(worker.Channel(end), load) is None
        frame = worker.Channel(node).recv()
    assert frame is not None and frame.type == MessageType.MODEL_LOADED
    loaded = pb.ModelLoaded.FromString(frame.header)
    assert not loaded.ok and loaded.error.startswith("its package: FileNotFoundError: ")


def test_a_mount_namespace_refused_is_a_failed_load_told_to_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # As root in a container without CAP_SYS_ADMIN (docker's default seccomp refuses unshare).
    def refused() -> None:
        raise OSError(errno.EPERM, "unshare(CLONE_NEWNS) refused")

    monkeypatch.setattr(worker, "own_mount_namespace", refused)
    node, end = socket.socketpair()
    with node, end:
        load = pb.LoadModel(model="m", package_dir="/", uid=1, home_dir="/nowhere")
        assert worker._take_model(worker.Channel(end), load) is None
        frame = worker.Channel(node).recv()
    assert frame is not None and frame.type == MessageType.MODEL_LOADED
    loaded = pb.ModelLoaded.FromString(frame.header)
    assert (loaded.ok, loaded.error) == (False, "its package: PermissionError: [Errno 1] unshare(CLONE_NEWNS) refused")


def test_a_requirements_layer_the_worker_cannot_open_is_a_failed_load_told_to_the_node(tmp_path: Path) -> None:
    node, end = socket.socketpair()
    with node, end:
        load = pb.LoadModel(model="m", package_dir=str(tmp_path), layer_dir=str(tmp_path / "gone"), uid=1)
        assert worker._take_model(worker.Channel(end), load) is None
        frame = worker.Channel(node).recv()
    assert frame is not None and frame.type == MessageType.MODEL_LOADED
    loaded = pb.ModelLoaded.FromString(frame.header)
    assert not loaded.ok and loaded.error.startswith("its requirements layer: FileNotFoundError: ")


def test_a_merged_batch_that_fails_prints_each_calls_traceback_once(capsys: pytest.CaptureFixture[str]) -> None:
    # Each call run alone printed its traceback chained to the merged predict's ("During handling
    # of the above exception"), and the batch's once more: 7 tracebacks for 3 calls. Now the
    # batch's once (a bug of the batched path shows only there) and each call's once.
    def handler(inputs: object) -> object:
        raise RuntimeError("a bug in predict")

    results = served(handler, [b'"a"', b'"b"', b'"c"'], max_batch_size=4)

    assert [result.outcome for result in results] == [pb.HANDLER_ERROR] * 3
    printed = capsys.readouterr().err
    assert printed.count("Traceback (most recent call last)") == 4
    assert "During handling of the above exception" not in printed
    assert "a batch of 3 calls failed (RuntimeError: a bug in predict): running each alone" in printed


def test_a_handlers_traceback_starts_at_its_own_code_not_the_workers(capsys: pytest.CaptureFixture[str]) -> None:
    # What `gpufaas logs` showed of a handler's error began with the worker's own frames
    # (worker.py's _run_calls, backends.py's predict), read before the handler's.
    def handler(inputs: object) -> object:
        raise RuntimeError("a bug in predict")

    [result] = served(handler, [b'"a"'])

    assert result.outcome == pb.HANDLER_ERROR
    printed = capsys.readouterr().err
    assert "gpu_manager" not in printed
    assert 'raise RuntimeError("a bug in predict")' in printed


def test_a_handler_that_does_not_parse_prints_only_its_syntax_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its traceback was 16 lines of gpu_manager and importlib frames before the one that says where.
    monkeypatch.setattr(worker, "confine", lambda confinement: None)  # this test process stays as it is
    monkeypatch.setattr(sys, "path", list(sys.path))  # the load puts the package first
    monkeypatch.setenv(PACKAGE_DIR_ENV, "")  # the load sets it, and changes directory: both restored after
    monkeypatch.chdir(tmp_path)
    (tmp_path / "handler.py").write_text("def load(device)\n    return 1\n")
    node, end = socket.socketpair()
    with node, end:
        spec = ModelLoad("m", str(tmp_path), 1)
        assert not worker._load_model(
            worker.Channel(end), CpuBackend(WorkerDevice("cpu", "g0", 0)), spec, pb.LoadModel()
        )
    printed = capsys.readouterr().err.splitlines()
    assert printed == [
        f'  File "{tmp_path}/handler.py", line 1',
        "    def load(device)",
        "                    ^",
        "SyntaxError: expected ':'",
    ]
