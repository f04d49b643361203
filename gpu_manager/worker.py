"""The worker process: loads one function's model onto one device and serves its inferences over a pipe.

Protocol on the `multiprocessing` connection (every message a picklable tuple):

    worker -> pool, once, first:  Ready(ok, error, load_time_s, peak_memory_mb)
                                  ok=False: `load` raised; `error` is "Type: message" and the
                                  worker then exits with status 1
    pool -> worker, per call:     Request(call_id, payload)                    payload: bytes
    worker -> pool, per call:     Reply(call_id, ok, result, inference_time_s, peak_memory_mb)
                                  ok=True: `result` is the output bytes; ok=False: `result` is the
                                  handler's "Type: message" and the worker keeps serving

The worker exits when the pool closes its end of the pipe (or sends None). The pool stops a worker by
killing it: that is what frees its device memory.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import NamedTuple

from gpu_manager.backends import Backend, make_backend


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker process needs, fixed for its lifetime. `package_dir` holds the extracted
    function package (unused by the emulated backend); `memory_mb` is the function's declared peak;
    `load_time_s` / `inference_time_s` are the emulated backend's profile (None: Table I or size)."""

    model: str
    gpu_id: str
    device_index: int
    backend: str
    package_dir: str
    memory_mb: int
    load_time_s: float | None = None
    inference_time_s: float | None = None


class Request(NamedTuple):
    call_id: str
    payload: bytes


class Ready(NamedTuple):
    ok: bool
    error: str
    load_time_s: float
    peak_memory_mb: int


class Reply(NamedTuple):
    call_id: str
    ok: bool
    result: bytes | str
    inference_time_s: float
    peak_memory_mb: int


def decode_inputs(payload: bytes) -> object:
    """The handler's `inputs`: the payload parsed as JSON when it is UTF-8 JSON, else the raw bytes."""
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return payload


def encode_result(result: object) -> bytes:
    """The handler's output as bytes: bytes as they are, str as UTF-8, anything else as JSON (torch
    tensors and numpy arrays become nested lists). TypeError if it cannot be encoded."""
    if isinstance(result, bytes | bytearray | memoryview):
        return bytes(result)
    if isinstance(result, str):
        return result.encode("utf-8")
    return json.dumps(result, default=_json_default, separators=(",", ":")).encode("utf-8")


def _json_default(value: object) -> object:
    # Look the array types up only if their library is loaded: the emulated backend never imports
    # torch or numpy, and a handler that returns a tensor has imported torch already.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray | numpy.generic):
        return value.tolist()
    raise TypeError(f"handler output of type {type(value).__name__} is not bytes, str or JSON-serializable")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of the worker process (started with the "spawn" context)."""
    # Ctrl-C in a terminal reaches the whole process group; the gpu_manager decides when workers
    # stop (it kills them), so a worker must not die half-way through an inference on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started_s = time.perf_counter()
    try:
        backend = make_backend(spec.backend, spec)
        backend.setup()
        backend.load()
        peak_memory_mb = backend.peak_memory_mb()
    except Exception as exc:
        traceback.print_exc()  # the full traceback goes to the node's log; the pool gets one line
        conn.send(Ready(ok=False, error=describe(exc), load_time_s=time.perf_counter() - started_s, peak_memory_mb=0))
        conn.close()
        sys.exit(1)
    conn.send(Ready(ok=True, error="", load_time_s=time.perf_counter() - started_s, peak_memory_mb=peak_memory_mb))
    _serve(backend, conn)


def _serve(backend: Backend, conn: Connection) -> None:
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the pool let go of this worker (or died): nobody is left to answer
            return
        if request is None:
            return
        call_id, payload = request
        started_s = time.perf_counter()
        try:
            outputs = backend.predict(decode_inputs(payload))
            inference_time_s = time.perf_counter() - started_s
            result: bytes | str = encode_result(outputs)
            ok = True
        except Exception as exc:
            inference_time_s = time.perf_counter() - started_s
            traceback.print_exc()
            result, ok = describe(exc), False
        try:
            conn.send(Reply(call_id, ok, result, inference_time_s, backend.peak_memory_mb()))
        except (BrokenPipeError, ConnectionResetError):  # the pool went away mid-call
            return
