"""The worker process: warms up as a spare, takes one model, serves its calls (merged into batches).

Forked by the node's zygote (gpu_manager.zygote) with one end of a socket pair from the node's
WorkerPool, on which it speaks gpufaas.wire frames:

    worker -> node, once ready:   WorkerHello(pid, import_s, context_s, context_mb)
                                  a warm spare: runtime imported, device context created
    node -> worker, once:         LoadModel(model, package_dir, ...)
    worker -> node:               ModelLoaded(ok, error, load_s, peak_memory_mb)
                                  ok=False: `load` raised; the worker then exits with status 1
    node -> worker, per call:     Call(call_id, content_type) + payload
    worker -> node, per call:     CallResult(call_id, outcome, ..., batch_calls) + output

Calls are run in the order they arrive. A function with max_batch_size > 1 has the calls that are
waiting merged into one `predict` (up to max_batch_size; when fewer are waiting, it waits up to
max_batch_wait_s for more, as Triton's dynamic batcher and Ray Serve's @serve.batch do).

The worker exits when the node closes its end of the socket. The node stops a worker by killing
it: that is what frees its device memory.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import json
import os
import re
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import NamedTuple

from pydantic import ValidationError

from gpu_manager.backends import Backend, ModelLoad
from gpu_manager.sandbox import (
    DEFAULT_MAX_FILE_MB,
    DEFAULT_MAX_PROCESSES,
    Confinement,
    close_descriptors,
    confine,
    current_data_mb,
    own_mount_namespace,
)
from gpufaas.functions import WorkerSettings
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import PREFIX_BYTES, MessageType, encode

JSON_TYPES = ("application/json", "application/problem+json")
MAX_JSON_DEPTH = 512
"""Deepest nesting of arrays and objects a JSON payload may have: json's decoder recurses once a
level, so a deeper one would exhaust the worker's stack (Python's limit is 1,000 frames)."""
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # brackets in strings do not nest
_NOT_PLAIN_UTF8 = (b"\xef", b"\xfe", b"\xff")  # first bytes of the byte-order marks json.loads reads
_decode_json = json.JSONDecoder().decode  # json.loads' decoder (json's defaults)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_DEPTH_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1, +1, -1, -1 as signed bytes


class PayloadRefused(ValueError):
    """The payload does not match its declared content type, or is nested too deep."""


def json_depth_over(payload: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `payload`, read as JSON, nests arrays and objects deeper than `limit` levels. Costs
    two byte counts for a payload with at most `limit` brackets, else a few passes in C over it."""
    if payload.count(b"[") + payload.count(b"{") <= limit:
        return False
    steps = array.array("b", _JSON_STRING.sub(b"", payload).translate(_DEPTH_STEPS, _NOT_BRACKETS))
    return max(itertools.accumulate(steps), default=0) > limit


def _parse_json(payload: bytes) -> object:
    """json.loads, with a payload nested past MAX_JSON_DEPTH refused (PayloadRefused), never a
    RecursionError. ValueError (UnicodeDecodeError included) if it is not JSON."""
    if json_depth_over(payload):
        raise _too_deep()
    try:
        if payload[:1] in _NOT_PLAIN_UTF8 or b"\x00" in payload[:4]:
            return json.loads(payload)  # a byte-order mark, or UTF-16 or UTF-32: json tells which
        # What json.loads does with the rest (json.detect_encoding says UTF-8), without its checks.
        return _decode_json(payload.decode("utf-8", "surrogatepass"))
    except RecursionError:  # a stack already deep: still the caller's payload, not the worker's end
        raise _too_deep() from None


def _too_deep() -> PayloadRefused:
    # Made only when refusing: _parse_json runs on every call's payload.
    return PayloadRefused(f"the payload is JSON nested deeper than {MAX_JSON_DEPTH} levels; send it flatter")


def decode_inputs(payload: bytes, content_type: str = "") -> object:
    """The handler's `inputs`. Declared JSON is parsed (PayloadRefused if it does not parse or nests
    deeper than MAX_JSON_DEPTH); a body with no content type is parsed when it is UTF-8 JSON within
    that depth, else given as bytes (binary data may well hold more "[" than "]"); any other
    declared type is given as the raw bytes (never parsed)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in JSON_TYPES or media.endswith("+json"):
        try:
            return _parse_json(payload or b"null")
        except PayloadRefused:
            raise
        except ValueError as exc:
            raise PayloadRefused(f"the payload is declared {media} but is not valid JSON: {exc}") from None
    if media:
        return payload
    try:
        return _parse_json(payload)
    except ValueError:  # PayloadRefused included
        return payload


def encode_result(result: object) -> tuple[bytes, str]:
    """The handler's output as (bytes, content type): bytes as they are, str as UTF-8 text,
    anything else as JSON (torch tensors and numpy arrays become nested lists, numpy scalar dict
    keys Python numbers: _json_text). TypeError if it cannot be encoded; ValueError if it holds NaN
    or an infinity (in a tensor too), which JSON (RFC 8259) cannot carry, or refers to itself, or
    if it is a str holding a surrogate, which UTF-8 cannot carry (_utf8_text)."""
    if isinstance(result, _BINARY):
        return bytes(result), "application/octet-stream"
    if isinstance(result, str):
        return _utf8_text(result), "text/plain; charset=utf-8"
    try:
        return _json_text(result).encode("utf-8"), "application/json"
    except ValueError as exc:
        if not str(exc).startswith(_NOT_FINITE):  # a circular reference: json's own message
            raise
        raise ValueError(NOT_FINITE_OUTPUT) from None


def _utf8_text(text: str) -> bytes:
    """`text` as UTF-8. ValueError, in one line naming the code point and where it is, if it holds
    a surrogate (as text decoded with errors="surrogateescape" does), which UTF-8 cannot carry.
    Refused rather than sent some other way: written as JSON's \\udcff escape it would no longer be
    the text/plain body the caller expects of a str, and replaced by U+FFFD it would lose data
    unseen; the handler that knows what the text means says how to send it."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the output str holds U+{ord(text[exc.start]):04X} at index {exc.start}, a surrogate, which UTF-8 "
            "cannot carry; return bytes, or the str inside a list or dict to send it as JSON (as \\u escapes)"
        ) from None


def _json_text(result: object) -> str:
    """`result` as JSON text. A dict key that is a numpy scalar or a 0-d torch tensor (a class index
    such as numpy.int64(3)) is written as its Python number would be, as values of those types are:
    json refuses any key not str, int, float, bool or None, and has no hook for keys. TypeError,
    in one line naming its type, for any other such key."""
    try:
        return _encode_json(result)
    except TypeError as exc:
        if not str(exc).startswith(_BAD_KEY):
            raise
    # Only an output that json refused is walked (in Python, so slower): the common one is not.
    try:
        return _encode_json(_with_plain_keys(result, set()))
    except TypeError as exc:
        if not str(exc).startswith(_BAD_KEY):
            raise
        kind = str(exc).rpartition(" not ")[2]
        raise TypeError(
            f"the output holds a dict key of type {kind}; a JSON object's keys must be str, int, float, bool or "
            "None (numpy scalars and 0-d tensors are taken as their numbers)"
        ) from None


def _with_plain_keys(value: object, open_ids: set[int]) -> object:
    """`value` with each dict's numpy-scalar and 0-d tensor keys made Python numbers, its dicts,
    lists and tuples copied (a tuple becomes a list, as JSON writes it). `open_ids`: the containers
    being copied, for a cycle raises json's own ValueError rather than recursing without end."""
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) in open_ids:
        raise ValueError("Circular reference detected")
    open_ids.add(id(value))
    try:
        if isinstance(value, dict):
            return {_plain_key(key): _with_plain_keys(item, open_ids) for key, item in value.items()}
        return [_with_plain_keys(item, open_ids) for item in value]
    finally:
        open_ids.discard(id(value))


def _plain_key(key: object) -> object:
    """`key` as a Python scalar if it is a numpy scalar or a 0-d torch tensor, else itself."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(key, numpy.generic):
        return key.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(key, torch.Tensor) and key.dim() == 0:
        return key.item()
    return key


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


_BINARY = (bytes, bytearray, memoryview)
# json.dumps(result, default=_json_default, separators=(",", ":"), allow_nan=False), its encoder
# made once (still the C encoder: allow_nan=False is one check per float). Allowed, NaN and the
# infinities were written as bare NaN / Infinity tokens under application/json: not JSON, so a
# strict client (JSON.parse, Go's encoding/json, jq) failed on the whole answer.
_encode_json = json.JSONEncoder(default=_json_default, separators=(",", ":"), allow_nan=False).encode
_BAD_KEY = "keys must be str, int, float, bool or None"  # what json raises for a key it cannot write
_NOT_FINITE = "Out of range float values are not JSON compliant"  # what json raises for one
NOT_FINITE_OUTPUT = (
    "the output holds NaN or Infinity, which JSON cannot carry; return None (JSON null) or a string "
    '(such as "NaN") in its place, or check the inputs that produced it'
)
"""Why an output holding NaN, Infinity or -Infinity (a float, or in a tensor or array) is refused."""


MAX_MESSAGE_CHARS = 8192
"""The most of an exception's description a call's answer carries (the full traceback goes to the
node's log): a handler's message may quote its input (a repr of a binary payload is 4 times its
size), and an answer over the node's frame limit closed the worker's socket, failing its other calls."""


def describe(exc: BaseException) -> str:
    """`exc` in one line for a protobuf string: at most MAX_MESSAGE_CHARS characters and a note of
    what was cut, always valid UTF-8 (a lone surrogate, as in a path decoded with surrogateescape
    or a JSON payload's "\\ud800", is escaped: protobuf refuses to encode one), and never raising
    (an exception whose __str__ raises is named alone). A handler's exception is what this
    describes: it must not end the worker that answers it."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:
        text = f"{type(exc).__name__} (its message could not be read)"
    if len(text) > MAX_MESSAGE_CHARS:
        text = f"{text[:MAX_MESSAGE_CHARS]} ... [{len(text) - MAX_MESSAGE_CHARS} more characters cut]"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


READ_BYTES = 65536
"""What the worker's channel reads into (a larger frame gets a buffer of its own size while it is read)."""
_LENGTH = struct.Struct("!I")
_PREFIX = struct.Struct("!IHHII")  # gpufaas.wire's frame prefix: length, type, flags, correlation id, header length


class _Frame(NamedTuple):
    type: int
    header: bytes
    body: bytes


class Channel:
    """Blocking frames over the worker's end of the socket pair (the node side is a
    gpufaas.wire.Connection). Reads are buffered so that several waiting calls can be taken at once.

    The socket is read into one buffer kept for the worker's life (READ_BYTES, grown for a larger
    frame and given back once it is taken), not into a new bytes object per read: a read of up to
    a MiB into a fresh object cost the worker an mmap, an mremap and an munmap (and a page fault)
    per call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(READ_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # the first byte not yet taken
        self._end = 0  # past the last byte read

    def send(self, type_: int, header: pb.WorkerHello | pb.ModelLoaded | pb.CallResult, body: bytes = b"") -> None:
        # One-way frames (the node matches results to calls by call id); header and body are
        # joined into one write only when the body is small.
        prefix = encode(type_, header, body)
        if len(body) <= 65536:
            self.sock.sendall(prefix + body)
        else:
            self.sock.sendall(prefix)
            self.sock.sendall(body)

    def pending(self, timeout_s: float = 0.0) -> bool:
        """Whether a whole frame can be read without waiting longer than `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        while self._frame_end() < 0:
            remaining = deadline - time.perf_counter()
            readable, _, _ = select.select([self.sock], [], [], max(0.0, remaining))
            if not readable:
                return False
            if not self._fill():
                return self._frame_end() >= 0
        return True

    def recv(self) -> _Frame | None:
        """The next frame; None when the node closed its end."""
        while (frame_end := self._frame_end()) < 0:
            if not self._fill():
                return None
        start = self._start
        _, type_, _flags, _corr, header_len = _PREFIX.unpack_from(self._buf, start)
        header_at = start + PREFIX_BYTES
        body_at = header_at + header_len
        view = self._view
        frame = _Frame(type_, bytes(view[header_at:body_at]), bytes(view[body_at:frame_end]))
        if frame_end == self._end:  # all taken: the next read starts at the front
            self._start = self._end = 0
            if len(self._buf) > READ_BYTES:  # a large frame's buffer goes with it
                self._resize(READ_BYTES)
        else:
            self._start = frame_end
        return frame

    def _frame_end(self) -> int:
        """Where the first whole frame buffered ends; -1 if there is none yet."""
        start = self._start
        if self._end - start < 4:
            return -1
        frame_end: int = start + 4 + _LENGTH.unpack_from(self._buf, start)[0]
        return frame_end if frame_end <= self._end else -1

    def _fill(self) -> bool:
        """Read what the socket holds (up to the buffer's free room, made room enough for the
        frame under way); False at the end of the stream."""
        start, end = self._start, self._end
        needed = 4 + _LENGTH.unpack_from(self._buf, start)[0] if end - start >= 4 else READ_BYTES
        if start + needed > len(self._buf) or end == len(self._buf):
            # Move what is buffered to the front, into a larger buffer if the frame needs one.
            kept = end - start
            if needed > len(self._buf):
                self._resize(needed, keep=(start, end))
            elif start:
                self._buf[:kept] = self._buf[start:end]
            self._start, self._end = 0, kept
        try:
            count = self.sock.recv_into(self._view[self._end :])
        except ConnectionResetError:
            return False
        if not count:
            return False
        self._end += count
        return True

    def _resize(self, size: int, keep: tuple[int, int] = (0, 0)) -> None:
        """A buffer of `size` bytes instead, starting with the old one's bytes `keep`."""
        buf = bytearray(size)
        buf[: keep[1] - keep[0]] = self._view[keep[0] : keep[1]]
        self._view.release()
        self._buf, self._view = buf, memoryview(buf)


def _answer(channel: Channel, call: pb.Call, outcome: int, message: str = "", **fields: object) -> None:
    channel.send(
        MessageType.CALL_RESULT,
        pb.CallResult(call_id=call.call_id, outcome=outcome, message=message, **fields),  # type: ignore[arg-type]
    )


def serve(backend: Backend, channel: Channel, spec: ModelLoad, max_result_bytes: int) -> None:
    """Answer calls until the node closes the socket, or until a failed call leaves the device
    unusable (`Backend.usable`: a CUDA context lost to a kernel's fault), when the worker exits
    rather than fail every call its model is sent."""
    max_batch_size = spec.settings.max_batch_size
    while True:
        first = channel.recv()
        if first is None:
            return
        batch = [first]
        if max_batch_size > 1:
            wait_until = time.perf_counter() + spec.settings.max_batch_wait_s
            while len(batch) < max_batch_size and channel.pending(max(0.0, wait_until - time.perf_counter())):
                frame = channel.recv()
                if frame is None:
                    break
                batch.append(frame)
        if not _run(backend, channel, spec, batch, max_result_bytes):
            return


def _run(backend: Backend, channel: Channel, spec: ModelLoad, frames: list[_Frame], max_result_bytes: int) -> bool:
    """Answer each call of `frames`: whatever its payload or the handler does (an exception of any
    kind, SystemExit included) is the call's answer, never the end of the worker's serve loop.
    Returns whether the device can run the next calls (after a failure: `Backend.usable`)."""
    calls: list[pb.Call] = []
    inputs: list[object] = []
    for frame in frames:
        call = pb.Call.FromString(frame.header)
        try:
            inputs.append(decode_inputs(frame.body, call.content_type))
        except PayloadRefused as exc:
            _answer(channel, call, pb.INVALID_INPUT, str(exc))
            continue
        calls.append(call)
    if not calls:
        return True
    return _run_calls(backend, channel, spec, calls, inputs, max_result_bytes=max_result_bytes)


def _run_calls(
    backend: Backend,
    channel: Channel,
    spec: ModelLoad,
    calls: list[pb.Call],
    inputs: list[object],
    *,
    max_result_bytes: int,
) -> bool:
    """Run `calls` (their decoded `inputs`) as one predict and answer each; whether the device can
    run the next calls. A merged batch that raised is run again call by call (while the device is
    usable): any one caller's input may have failed it, and the others' calls are not theirs to fail."""
    started_s = time.perf_counter()
    try:
        outputs = backend.predict_batch(inputs) if spec.settings.max_batch_size > 1 else [backend.predict(inputs[0])]
    except BaseException as exc:  # the handler's sys.exit() too: it ends its calls, not the worker
        if len(calls) == 1 or not backend.usable():
            _answer_failure(channel, calls, exc, time.perf_counter() - started_s)
            return backend.usable()
        # Its traceback once (a bug of the batched path shows only here), then each call's own if
        # it fails alone too: not chained to this one, as they were when run inside this except.
        with contextlib.suppress(Exception):  # a handler may have closed its stderr
            print(f"a batch of {len(calls)} calls failed ({describe(exc)}): running each alone", file=sys.stderr)
        print_handler_error(exc)
    else:
        inference_s = time.perf_counter() - started_s
        _answer_outputs(
            channel,
            calls,
            outputs,
            inference_s=inference_s,
            peak_memory_mb=backend.peak_memory_mb(),
            max_result_bytes=max_result_bytes,
        )
        return True
    # Run alone outside the except: there, each call's failure was printed chained to the merged
    # batch's ("During handling of the above exception..."), a handler's bug twice per call, and once more.
    # A list, not a generator: all() must not stop at the first device lost, leaving calls unanswered.
    alone = [
        _run_calls(backend, channel, spec, [call], [one], max_result_bytes=max_result_bytes)
        for call, one in zip(calls, inputs, strict=True)
    ]
    return all(alone)


def _answer_outputs(
    channel: Channel,
    calls: list[pb.Call],
    outputs: list[object],
    *,
    inference_s: float,
    peak_memory_mb: int,
    max_result_bytes: int,
) -> None:
    """Answer each of `calls` with its output of a predict that returned: encoded, or why not."""
    for call, output in zip(calls, outputs, strict=True):
        # Its failure: unencodable, nested too deep (RecursionError), a tensor that would not copy;
        # or the handler's own code, which encoding runs (a dict subclass's items()), calling sys.exit().
        try:
            body, content_type = encode_result(output)
        except BaseException as exc:
            _answer(channel, call, pb.OUTPUT_INVALID, describe(exc), inference_s=inference_s)
            continue
        if len(body) > max_result_bytes:
            _answer(
                channel,
                call,
                pb.OUTPUT_TOO_LARGE,
                f"the result is {len(body)} bytes, over the node's limit of {max_result_bytes} bytes (its "
                "--max-payload-mb); return less, or raise --max-payload-mb on the nodes and the gateways alike "
                "(a result must fit both)",
                inference_s=inference_s,
            )
            continue
        channel.send(
            MessageType.CALL_RESULT,
            pb.CallResult(
                call_id=call.call_id,
                outcome=pb.OK,
                inference_s=inference_s,
                batch_calls=len(calls),
                peak_memory_mb=peak_memory_mb,
                content_type=content_type,
            ),
            body,
        )


_OWN_FILES = (os.path.dirname(__file__) + os.sep, "<frozen importlib.")  # the worker's frames, and importing's


def print_handler_error(exc: BaseException) -> None:
    """Print `exc`'s traceback to stderr (the node's log, which `gpufaas logs` shows) from its first
    frame outside the worker's own code: a handler's error began with up to 8 frames of
    gpu_manager and importlib, read before the handler's own (none, for a handler.py that does not
    parse or a predict called with the wrong arguments: then the exception alone, which for a
    SyntaxError still shows its file, line and caret). Never raises: a handler may have closed its stderr."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_OWN_FILES):
        tb = tb.tb_next
    with contextlib.suppress(Exception):
        traceback.print_exception(type(exc), exc, tb)


def _answer_failure(channel: Channel, calls: list[pb.Call], exc: BaseException, inference_s: float) -> None:
    """Answer `calls`, whose predict raised `exc`. A ValueError from a predict given one call is
    that call's input refused (INVALID_INPUT: HTTP 400), as the handler contract asks handlers to
    tell a bad input; any other exception, or one failing several merged calls (on a device no
    longer usable: whose input it was is not known), is HANDLER_ERROR (500)."""
    print_handler_error(exc)  # the traceback goes to the node's log; the caller gets one line
    if isinstance(exc, ValueError) and len(calls) == 1:
        outcome, message = pb.INVALID_INPUT, f"invalid input: {describe(exc)}"
    else:
        outcome, message = pb.HANDLER_ERROR, f"predict raised {describe(exc)}"
    for call in calls:
        _answer(channel, call, outcome, message, inference_s=inference_s)


def run_worker(sock: socket.socket, backend: Backend, *, import_s: float, network_isolated: bool = False) -> int:
    """A freshly forked worker (see gpu_manager.zygote): create the device context, say hello,
    take a model, confine itself as the node says (gpu_manager.sandbox), load the model, serve
    it. Returns the process's exit status."""
    # Ctrl-C in a terminal reaches the whole process group; the gpu_manager decides when workers
    # stop (it kills them), so a worker must not die half-way through an inference on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = Channel(sock)
    started_s = time.perf_counter()
    context_mb = backend.init_device()
    channel.send(
        MessageType.WORKER_HELLO,
        pb.WorkerHello(
            pid=os.getpid(),
            import_s=import_s,
            context_s=time.perf_counter() - started_s,
            context_mb=context_mb,
            network_isolated=network_isolated,
        ),
    )
    frame = channel.recv()
    if frame is None or frame.type != MessageType.LOAD_MODEL:
        return 0  # a spare that was never needed
    load = pb.LoadModel.FromString(frame.header)
    spec = _take_model(channel, load)
    if spec is None or not _load_model(channel, backend, spec, load):
        return 1
    serve(backend, channel, spec, int(load.max_result_bytes) or sys.maxsize)
    return 0


def _take_model(channel: Channel, load: pb.LoadModel) -> ModelLoad | None:
    """The model `load` names, its files reached through handles opened now (before the worker
    drops to its package's user); None, the node told, where its package, pooled weights or
    requirements layer cannot be opened."""
    package_dir = load.package_dir
    try:  # refused (no mount namespace here, its package gone): a failed load told, not a death
        if load.uid and load.home_dir:
            own_mount_namespace()  # before its handles are opened (gpu_manager.sandbox.private_tmp)
        if load.uid:
            # Held open from before the worker drops to the package's user: through it the package is
            # reached whatever the permissions of the directories above it (the node's, closed to it).
            package_dir = f"/proc/self/fd/{os.open(package_dir, os.O_PATH | os.O_DIRECTORY)}"
    except OSError as exc:
        channel.send(MessageType.MODEL_LOADED, pb.ModelLoaded(ok=False, error=f"its package: {describe(exc)}"))
        return None
    try:
        # Likewise its weights in the host model pool (whose directory is the node's alone).
        pooled = {path: os.open(pool_path, os.O_RDONLY | os.O_CLOEXEC) for path, pool_path in load.pooled.items()}
    except OSError as exc:
        channel.send(MessageType.MODEL_LOADED, pb.ModelLoaded(ok=False, error=f"its pooled weights: {describe(exc)}"))
        return None
    if load.layer_dir:
        # Its requirements first: they may shadow the base's versions. A handle too, once it runs
        # as the package's user (and its /tmp is its own: the state directory may be under /tmp).
        layer_dir = load.layer_dir
        if load.uid:
            try:
                layer_dir = f"/proc/self/fd/{os.open(layer_dir, os.O_PATH | os.O_DIRECTORY)}"
            except OSError as exc:  # as its package's: a failed load told, not a death
                error = f"its requirements layer: {describe(exc)}"
                channel.send(MessageType.MODEL_LOADED, pb.ModelLoaded(ok=False, error=error))
                return None
        sys.path.insert(0, layer_dir)
    try:
        settings = WorkerSettings.from_wire(load.worker)
    except ValidationError as exc:
        channel.send(MessageType.MODEL_LOADED, pb.ModelLoaded(ok=False, error=f"its settings: {exc}"))
        return None
    return ModelLoad(
        model=load.model,
        package_dir=package_dir,
        memory_mb=int(load.memory_mb),
        settings=settings,
        load_time_s=load.load_time_s or None,
        inference_time_s=load.inference_time_s or None,
        pooled=pooled,
    )


def _load_model(channel: Channel, backend: Backend, spec: ModelLoad, load: pb.LoadModel) -> bool:
    """Confine the worker as `load` says, then load `spec`; tell the node how that went (ModelLoaded).
    Whether it loaded."""
    load_started_s = time.perf_counter()
    try:
        confine(
            Confinement(
                uid=int(load.uid),
                gid=int(load.gid),
                # The allowance is on top of what the runtime holds now (measured here, not guessed).
                data_limit_mb=current_data_mb() + int(load.data_limit_mb) if load.data_limit_mb else None,
                max_processes=load.max_processes or DEFAULT_MAX_PROCESSES,
                max_file_mb=int(load.max_file_mb) or DEFAULT_MAX_FILE_MB,
                home=load.home_dir,
            )
        )
        backend.load(spec)
        peak_memory_mb = backend.peak_memory_mb()
    except BaseException as exc:  # the handler's sys.exit() too: a failed load, told as one (not a death)
        print_handler_error(exc)
        channel.send(
            MessageType.MODEL_LOADED,
            pb.ModelLoaded(ok=False, error=describe(exc), load_s=time.perf_counter() - load_started_s),
        )
        return False
    channel.send(
        MessageType.MODEL_LOADED,
        pb.ModelLoaded(ok=True, load_s=time.perf_counter() - load_started_s, peak_memory_mb=peak_memory_mb),
    )
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m gpu_manager.worker --connect SOCKET ...`: a worker on its own (the `docker`
    runtime's container command): import the runtime, connect to the node's socket, then as a
    forked worker does (run_worker)."""
    import argparse

    from gpu_manager.backends import WorkerDevice, backend_class

    close_descriptors()  # as a forked worker: its stdio (the container's log) and, soon, its socket

    parser = argparse.ArgumentParser(prog="python -m gpu_manager.worker", description=main.__doc__)
    parser.add_argument("--connect", required=True, help="the node's Unix socket for this worker")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--gpu-id", required=True)
    parser.add_argument("--device-index", type=int, default=0)
    parser.add_argument("--network-isolated", action="store_true", help="say so in the hello (no network here)")
    args = parser.parse_args(argv)
    backend = backend_class(args.backend)
    started_s = time.perf_counter()
    backend.setup()
    backend.import_runtime()
    import_s = time.perf_counter() - started_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.connect)
    try:
        return run_worker(
            sock,
            backend(WorkerDevice(args.backend, args.gpu_id, args.device_index)),
            import_s=import_s,
            network_isolated=args.network_isolated,
        )
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the node let go of this worker


if __name__ == "__main__":
    sys.exit(main())
