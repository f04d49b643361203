"""Backends and the worker: the registry, device strings, emulated profiles, predict_batch's
contract, input decoding, output encoding, and one emulated worker driven over its socket (frames
in, frames out, batches merged, torch and numpy never imported)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_manager.backends import (
    Backend,
    EmulatedBackend,
    ModelLoad,
    UnknownBackend,
    WorkerDevice,
    backend_class,
    backend_names,
    emulated_times,
    import_handler,
    make_backend,
)
from gpu_manager.devices import Device, discover_nvml, logical_devices, normalize_gpu_type, visible_devices
from gpu_manager.worker import PayloadRefused, decode_inputs, encode_result
from gpufaas.functions import FunctionSpec, WorkerSettings

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: the emulated backend prepared as the zygote prepares it, then one
# worker (gpu_manager.worker.run_worker, as a forked worker runs it) on one end of a socket pair.
# The node's frames (LoadModel, then the calls) are all queued before the worker starts and the
# node's end is then shut for writing, so the worker serves them and exits; what it answered is
# printed as JSON, with whichever of torch and numpy the process imported.
WORKER_SCRIPT = r"""
import json, socket, struct, sys

import gpu_manager.pool, gpu_manager.zygote  # what the node and the zygote import
from google.protobuf.json_format import MessageToDict
from gpu_manager.backends import WorkerDevice, backend_class
from gpu_manager.worker import run_worker
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import PREFIX_BYTES, MessageType, encode

load, calls = json.loads(sys.argv[1])
backend = backend_class("emulated")
backend.setup()
backend.import_runtime()
node, worker_end = socket.socketpair()
load["worker"] = load["worker"].encode()  # JSON carries it as text
frames = [encode(MessageType.LOAD_MODEL, pb.LoadModel(**load), b"")]
for call_id, content_type, payload in calls:
    body = payload.encode("latin-1")
    frames.append(encode(MessageType.CALL, pb.Call(call_id=call_id, content_type=content_type), body) + body)
node.sendall(b"".join(frames))
node.shutdown(socket.SHUT_WR)
status = run_worker(worker_end, backend(WorkerDevice("emulated", "gpu0", 0)), import_s=0.25)
worker_end.close()
data = b""
while chunk := node.recv(1 << 16):
    data += chunk
messages = {MessageType.WORKER_HELLO: pb.WorkerHello, MessageType.MODEL_LOADED: pb.ModelLoaded,
            MessageType.CALL_RESULT: pb.CallResult}
replies = []
while data:
    length, type_, _, _, header_len = struct.unpack_from("!IHHII", data)
    header = data[PREFIX_BYTES:PREFIX_BYTES + header_len]
    body = data[PREFIX_BYTES + header_len:4 + length]
    data = data[4 + length:]
    message = messages[MessageType(type_)].FromString(header)
    fields = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    replies.append({"type": MessageType(type_).name, **fields, "body": body.decode("latin-1")})
heavy = sorted({"torch", "numpy"} & set(sys.modules))
print(json.dumps({"status": status, "pid": __import__("os").getpid(), "replies": replies, "heavy": heavy}))
"""


def run_script(script: str, *arguments: str) -> Any:
    """Run `script` in a fresh interpreter at the repository's root; the JSON it printed."""
    done = subprocess.run(
        [sys.executable, "-c", script, *arguments], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def run_emulated_worker(load: dict[str, Any], calls: list[tuple[str, str, bytes]]) -> dict[str, Any]:
    """Drive one emulated worker in a fresh interpreter (see WORKER_SCRIPT); what it did."""
    argument = json.dumps([load, [(call_id, ct, payload.decode("latin-1")) for call_id, ct, payload in calls]])
    result: dict[str, Any] = run_script(WORKER_SCRIPT, argument)
    return result


def load_model(max_batch_size: int = 1, **fields: Any) -> dict[str, Any]:
    """A LoadModel for an emulated model with a tiny profile of its own."""
    return {
        "worker": WorkerSettings(max_batch_size=max_batch_size).to_wire().decode(),
        "model": "resnet18",
        "package_dir": "/nowhere",
        "memory_mb": 100,
        "load_time_s": 0.001,
        "inference_time_s": 0.001,
        "max_result_bytes": 1 << 20,
        **fields,
    }


# --- the registry and device strings ---------------------------------------------------------------


def test_backends_are_registered_by_name_and_an_unknown_one_lists_the_valid_ones() -> None:
    assert backend_names() == ["cpu", "cuda", "emulated"]
    assert backend_class("emulated") is EmulatedBackend
    with pytest.raises(UnknownBackend, match="unknown backend 'tpu'; valid backends: cpu, cuda, emulated"):
        backend_class("tpu")


def test_device_strings() -> None:
    assert make_backend(WorkerDevice("cuda", "gpu3", 3)).device == "cuda:3"
    assert make_backend(WorkerDevice("cpu", "gpu3", 3)).device == "cpu"
    assert make_backend(WorkerDevice("emulated", "gpu3", 3)).device == "emulated:3"


# --- the emulated backend --------------------------------------------------------------------------


def test_emulated_times_come_from_table1_then_from_size() -> None:
    assert emulated_times("resnet18", 1) == (2.52, 1.25)  # Table I row, whatever the declared size
    small_load_s, small_inference_s = emulated_times("my-model", 1000)
    big_load_s, big_inference_s = emulated_times("my-model", 2000)
    assert big_load_s == pytest.approx(2 * small_load_s)
    assert big_inference_s == pytest.approx(2 * small_inference_s)
    assert 0.5 < small_load_s < 5.0  # Table I loads ~1.3 GB models in ~2.5 s


def test_the_spec_overrides_the_emulated_profile_and_a_batch_takes_one_inference_per_call() -> None:
    backend = EmulatedBackend(WorkerDevice("emulated", "gpu1", 1))
    assert backend.init_device() == 0  # no device context to hold
    backend.load(ModelLoad("resnet18", "", 100, load_time_s=0.0, inference_time_s=0.05))

    assert (backend.load_time_s, backend.inference_time_s) == (0.0, 0.05)  # not Table I's 2.52 and 1.25
    assert backend.predict(b"abc") == {
        "model": "resnet18",
        "backend": "emulated",
        "device": "emulated:1",
        "input_bytes": 3,
    }
    started = time.perf_counter()
    outputs = backend.predict_batch([{"x": 1}, b"ab", [2]])
    assert time.perf_counter() - started >= 3 * 0.05
    assert outputs == [
        {"model": "resnet18", "backend": "emulated", "device": "emulated:1", "echo": {"x": 1}},
        {"model": "resnet18", "backend": "emulated", "device": "emulated:1", "input_bytes": 2},
        {"model": "resnet18", "backend": "emulated", "device": "emulated:1", "echo": [2]},
    ]
    assert backend.peak_memory_mb() == 100  # declared


class Scripted(Backend):
    """A backend whose predict returns what it is told (no name: never registered)."""

    device = "scripted"

    def __init__(self, outputs: object) -> None:
        super().__init__(WorkerDevice("scripted", "gpu0", 0))
        self.outputs = outputs
        self.seen: list[object] = []

    def load(self, spec: ModelLoad) -> None:
        self.spec = spec

    def predict(self, inputs: object) -> object:
        self.seen.append(inputs)
        return self.outputs

    def peak_memory_mb(self) -> int:
        return 0


def test_predict_batch_hands_predict_the_list_and_wants_as_many_outputs_back() -> None:
    assert "scripted" not in backend_names()

    assert Scripted(("a", "b")).predict_batch([1, 2]) == ["a", "b"]
    with pytest.raises(TypeError, match="given a batch of 2 inputs and returned 1 outputs; return a list"):
        Scripted(["a"]).predict_batch([1, 2])
    with pytest.raises(TypeError, match="given a batch of 1 inputs and returned dict; return a list"):
        Scripted({"a": 1}).predict_batch([1])
    one = Scripted([None])
    one.predict_batch([{"x": 1}])
    assert one.seen == [[{"x": 1}]]


# --- input decoding and output encoding ------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "content_type", "inputs"),
    [
        (b'{"inputs": [[1, 2]]}', "", {"inputs": [[1, 2]]}),  # undeclared: JSON when it parses
        (b"3", "", 3),
        (b"\xff\xfe", "", b"\xff\xfe"),  # not UTF-8: raw bytes
        (b"not json", "", b"not json"),
        (b"", "", b""),
        (b'{"a": 1}', "application/json", {"a": 1}),
        (b'{"a": 1}', "Application/JSON; charset=utf-8", {"a": 1}),
        (b"[1]", "application/vnd.api+json", [1]),
        (b"", "application/json", None),
        (b'{"a": 1}', "text/plain", b'{"a": 1}'),  # declared otherwise: never parsed
        (b"3", "application/octet-stream", b"3"),
    ],
)
def test_payloads_decode_as_their_content_type_says(payload: bytes, content_type: str, inputs: object) -> None:
    assert decode_inputs(payload, content_type) == inputs


@pytest.mark.parametrize(
    ("payload", "content_type", "media"),
    [(b"{", "application/json; charset=utf-8", "application/json"), (b"\xff", "application/problem+json", "")],
)
def test_declared_json_that_does_not_parse_is_invalid_input(payload: bytes, content_type: str, media: str) -> None:
    media = media or content_type
    with pytest.raises(PayloadRefused, match=re.escape(f"the payload is declared {media} but is not valid JSON: ")):
        decode_inputs(payload, content_type)


def test_outputs_encode_bytes_as_is_text_as_utf8_and_the_rest_as_json() -> None:
    assert encode_result(b"\x00\x01") == (b"\x00\x01", "application/octet-stream")
    assert encode_result(bytearray(b"ab")) == (b"ab", "application/octet-stream")
    assert encode_result(memoryview(b"cd")) == (b"cd", "application/octet-stream")
    assert encode_result("héllo") == ("héllo".encode(), "text/plain; charset=utf-8")
    assert encode_result({"a": [1, 2.5, None]}) == (b'{"a":[1,2.5,null]}', "application/json")
    assert encode_result(None) == (b"null", "application/json")
    with pytest.raises(TypeError, match="object is not bytes, str or JSON-serializable"):
        encode_result({"a": object()})


def test_tensors_and_arrays_encode_as_nested_lists() -> None:
    torch = pytest.importorskip("torch")
    numpy = pytest.importorskip("numpy")
    assert encode_result({"t": torch.tensor([[1.0, 2.0]]), "n": numpy.arange(3), "s": numpy.float32(0.5)}) == (
        b'{"t":[[1.0,2.0]],"n":[0,1,2],"s":0.5}',
        "application/json",
    )


# --- one emulated worker, over its socket ----------------------------------------------------------


def test_the_emulated_worker_says_hello_loads_answers_and_never_imports_torch_or_numpy() -> None:
    done = run_emulated_worker(
        load_model(),
        [("c1", "application/json", b'{"x": 1}'), ("c2", "application/octet-stream", b"abc")],
    )

    assert done["heavy"] == []
    assert done["status"] == 0  # the node closed its end: the worker exits
    hello, loaded, *results = done["replies"]
    assert (hello["type"], int(hello["pid"]), hello["import_s"]) == ("WORKER_HELLO", done["pid"], 0.25)
    assert (loaded["type"], loaded["ok"], int(loaded["peak_memory_mb"])) == ("MODEL_LOADED", True, 100)
    assert [(r["type"], r["call_id"], r["outcome"], r["content_type"]) for r in results] == [
        ("CALL_RESULT", "c1", "OK", "application/json"),
        ("CALL_RESULT", "c2", "OK", "application/json"),
    ]
    assert json.loads(results[0]["body"]) == {
        "model": "resnet18",
        "backend": "emulated",
        "device": "emulated:0",
        "echo": {"x": 1},
    }
    assert json.loads(results[1]["body"])["input_bytes"] == 3


def test_the_worker_merges_waiting_calls_into_batches_of_at_most_max_batch_size() -> None:
    calls = [(f"c{i}", "application/json", json.dumps({"i": i}).encode()) for i in range(6)]
    calls.append(("bad", "application/json", b"{not json"))

    done = run_emulated_worker(load_model(max_batch_size=4), calls)

    results = {r["call_id"]: r for r in done["replies"] if r["type"] == "CALL_RESULT"}
    # All seven were waiting: the first four frames make one batch, the other three the next,
    # where the one that does not parse is answered on its own.
    assert {call_id: r["batch_calls"] for call_id, r in results.items() if r["outcome"] == "OK"} == {
        "c0": 4,
        "c1": 4,
        "c2": 4,
        "c3": 4,
        "c4": 2,
        "c5": 2,
    }
    assert results["bad"]["outcome"] == "INVALID_INPUT"
    assert [json.loads(results[f"c{i}"]["body"])["echo"] for i in range(6)] == [{"i": i} for i in range(6)]


def test_the_worker_refuses_a_result_over_its_limit() -> None:
    small = b'{"model":"resnet18","backend":"emulated","device":"emulated:0","echo":1}'  # its echo of 1
    done = run_emulated_worker(
        load_model(max_result_bytes=len(small)), [("small", "", b"1"), ("big", "", b'"' + b"x" * 200 + b'"')]
    )

    results = {r["call_id"]: r for r in done["replies"] if r["type"] == "CALL_RESULT"}
    assert (results["small"]["outcome"], results["small"]["body"]) == ("OK", small.decode())  # at the limit
    assert results["big"]["outcome"] == "OUTPUT_TOO_LARGE"
    assert results["big"]["body"] == ""


# --- devices ---------------------------------------------------------------------------------------


def test_logical_devices_and_gpu_type_names() -> None:
    assert logical_devices(2, 8000, "cpu") == [Device("gpu0", 8000, "cpu", 0), Device("gpu1", 8000, "cpu", 1)]
    with pytest.raises(ValueError, match="memory_mb must be positive"):
        logical_devices(1, 0, "cpu")
    with pytest.raises(ValueError, match="count must be >= 0"):
        logical_devices(-1, 100, "cpu")
    assert normalize_gpu_type("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert normalize_gpu_type("NVIDIA GeForce RTX 2080") == "nvidia-geforce-rtx-2080"


def test_nvml_discovery_never_raises() -> None:
    devices = discover_nvml()  # [] on a machine without an NVIDIA driver
    assert all(d.gpu_id == f"gpu{d.index}" and d.memory_mb > 0 for d in devices)


@pytest.mark.parametrize(
    ("visible", "offered"),
    [
        (None, [0, 1, 2, 3]),
        ("2", [2]),
        ("3,1", [1, 3]),  # whatever order it names them in, each is NVML's index (PCI bus order)
        ("0,2,-1,1", [0, 2]),  # as CUDA reads it: an entry naming no GPU ends the list
        ("0,7,1", [0]),
        ("", []),
        ("GPU-bbbb,GPU-dd", [1, 3]),  # UUIDs, or prefixes of them naming one GPU
        ("GPU-bbbb,GPU-", [1]),  # a prefix of several names none
        ("MIG-1234", []),
    ],
)
def test_the_node_offers_the_gpus_cuda_visible_devices_names_by_nvml_index(
    visible: str | None, offered: list[int]
) -> None:
    """NVML lists every GPU of the machine whatever CUDA_VISIBLE_DEVICES says (it is CUDA's
    setting, not NVML's): a node started with CUDA_VISIBLE_DEVICES=2 must offer NVML's GPU 2 only."""
    devices = logical_devices(4, 1000, "h200")
    uuids = ["GPU-aaaa-0", "GPU-bbbb-1", "GPU-cccc-2", "GPU-dddd-3"]
    assert [d.index for d in visible_devices(devices, visible, lambda i: uuids[i])] == offered


def test_cuda_workers_number_gpus_as_nvml_does_whatever_cuda_visible_devices_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES names (cuda:0 is the first of them), NVML
    all of them: with CUDA_VISIBLE_DEVICES=2 inherited, the worker of NVML's GPU 2 would open
    cuda:2, a GPU CUDA does not have ("invalid device ordinal"), and the node's NVML figures for GPU
    0 would be of another GPU than its worker's. The zygote (and a container's worker) drops it
    before CUDA starts; the node has chosen its GPUs by it already. Likewise CUDA numbers GPUs
    fastest first where CUDA_DEVICE_ORDER says so, NVML always in PCI bus order."""
    from gpu_manager.backends import CudaBackend

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # cuda:{index} would not be NVML's `index`
    CudaBackend.setup()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_priming_runs_every_layer_on_a_device_and_a_failing_layer_only_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from gpu_manager.backends import prime_kernels

    with caplog.at_level("WARNING", logger="gpu_manager.backends"):
        prime_kernels(torch.device("cpu"))  # the same calls a spare makes on cuda:N
    assert caplog.records == []

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    with caplog.at_level("WARNING", logger="gpu_manager.backends"):
        prime_kernels(torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [
        "priming the kernels of cpu failed (a miss will load them): no kernel image is available for execution "
        "on the device"
    ]


# --- the function's worker settings ------------------------------------------------------------------

WARMUP_HANDLER = """
def load(device):
    return {"warmups": 0}

def warmup(model):
    model["warmups"] += 1

def predict(model, inputs):
    return model["warmups"]
"""

LOAD_WITH_SETTINGS = """
import json, sys
from gpu_manager.backends import CpuBackend, ModelLoad, WorkerDevice
from gpufaas.functions import FunctionSpec, WorkerSettings

package_dir, settings = sys.argv[1], WorkerSettings.from_wire(sys.argv[2].encode())
backend = CpuBackend(WorkerDevice("cpu", "gpu0", 0))
backend.load(ModelLoad("warm", package_dir, 100, settings=settings))
print(json.dumps(backend.predict(None)))
"""


@pytest.mark.parametrize(("settings", "warmups"), [(b"", 1), (b'{"warmup": true}', 1), (b'{"warmup": false}', 0)])
def test_the_warmup_setting_decides_whether_the_handlers_warmup_runs_after_the_load(
    tmp_path: Path, settings: bytes, warmups: int
) -> None:
    (tmp_path / "handler.py").write_text(WARMUP_HANDLER)
    assert run_script(LOAD_WITH_SETTINGS, str(tmp_path), settings.decode()) == warmups


def test_worker_settings_travel_as_json_and_a_spec_carries_only_its_workers_fields() -> None:
    spec = FunctionSpec(
        name="f", package_digest="sha256:" + "0" * 64, memory_mb=100, max_batch_size=4, warmup=False, public=True
    )
    settings = WorkerSettings.from_wire(spec.worker_wire)
    assert settings == WorkerSettings(max_batch_size=4, warmup=False)
    assert set(json.loads(spec.worker_wire)) == set(WorkerSettings.model_fields)  # no public, no memory_mb
    assert WorkerSettings.from_wire(b"") == WorkerSettings()


# --- the cuda backend's memory figures, over a fake device ---------------------------------------------

MIB = 1024 * 1024


class FakeCudaDevice:
    """One GPU as torch's caching allocator and NVML see it: a CUDA context outside the allocator,
    the allocator's reservation (what torch.cuda.memory_reserved says) and its high-water mark,
    reset only by reset_peak_memory_stats (max_memory_reserved counts from the process's start)."""

    def __init__(self, context_mb: int) -> None:
        self.context_mb, self.reserved_b, self.peak_b = context_mb, 0, 0

    def reserve(self, nbytes: int) -> None:
        self.reserved_b += nbytes
        self.peak_b = max(self.peak_b, self.reserved_b)

    def install(self, monkeypatch: pytest.MonkeyPatch, torch: Any) -> None:
        total_b = 141 * 1024 * MIB
        for name, fake in {
            "set_device": lambda index: None,
            "mem_get_info": lambda index=None: (total_b - self.context_mb * MIB - self.reserved_b, total_b),
            "empty_cache": lambda: None,
            "reset_peak_memory_stats": lambda index=None: setattr(self, "peak_b", self.reserved_b),
            "memory_reserved": lambda index=None: self.reserved_b,
            "max_memory_reserved": lambda index=None: self.peak_b,
            "synchronize": lambda index=None: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fake)


def test_the_cuda_peak_is_what_the_process_holds_not_primings_peak_nor_the_workspace_twice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A spare primes its kernels (300 MiB of made-up tensors, given back by empty_cache) and keeps
    cuBLAS's 32 MiB workspace in the caching allocator (empty_cache does not free it: torch's CUDA
    notes), so NVML sees 532 MiB for its PID; its model then reserves 200 MiB. The process holds
    732 MiB, the figure its peak must be: neither priming's 300 MiB high-water mark (max_memory_reserved
    counts from the process's start unless reset_peak_memory_stats is called) nor the workspace
    counted both in the context's figure and in the allocator's."""
    torch = pytest.importorskip("torch")
    from gpu_manager import backends
    from gpu_manager.backends import CudaBackend, Handler
    from gpu_manager.devices import Nvml
    from gpufaas import weights

    device = FakeCudaDevice(context_mb=500)
    device.install(monkeypatch, torch)

    class FakeNvml(Nvml):
        def used_mb(self, index: int) -> int | None:
            return device.context_mb + device.reserved_b // MIB

        def process_mb(self, index: int, pid: int) -> int | None:
            return device.context_mb + device.reserved_b // MIB

    def prime(_: object) -> None:
        device.reserve(300 * MIB)  # the made-up tensors ...
        device.reserved_b -= 300 * MIB  # ... given back by empty_cache
        device.reserve(32 * MIB)  # cuBLAS's workspace, kept

    monkeypatch.setattr(Nvml, "open", classmethod(lambda cls: FakeNvml(None)))
    monkeypatch.setattr(backends, "prime_kernels", prime)
    monkeypatch.setattr(weights, "prepare_staging", lambda device: None)
    handler = Handler(load=lambda _: device.reserve(200 * MIB), predict=lambda model, inputs: inputs)
    monkeypatch.setattr(backends, "import_handler", lambda package_dir: handler)
    monkeypatch.chdir(tmp_path)  # the load changes into the package's directory
    monkeypatch.setenv(backends.PACKAGE_DIR_ENV, str(tmp_path))

    backend = CudaBackend(WorkerDevice("cuda", "gpu0", 0))
    assert backend.init_device() == 532  # what the spare holds, its workspace included
    backend.load(ModelLoad("m", str(tmp_path), 300))
    assert backend.peak_memory_mb() == 732


class FaultingBackend(Backend):
    """Every call fails; `lost` says whether the failure took the device with it."""

    def __init__(self, lost: bool) -> None:
        super().__init__(WorkerDevice("cuda", "gpu0", 0))
        self.lost, self.calls = lost, 0

    @property
    def device(self) -> str:
        return "cuda:0"

    def load(self, spec: ModelLoad) -> None:
        pass

    def predict(self, inputs: object) -> object:
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def peak_memory_mb(self) -> int:
        return 0

    def usable(self) -> bool:
        return not self.lost


def serve_calls(backend: Backend, call_ids: list[str]) -> list[tuple[str, int]]:
    """`call_ids` queued to a worker serving `backend` in this process, the node's end then shut
    for writing: (call id, outcome) of every answer, in order."""
    import socket
    import struct

    from gpu_manager.worker import Channel, serve
    from gpufaas.proto import gpufaas_pb2 as pb
    from gpufaas.wire import PREFIX_BYTES, MessageType, encode

    node, worker_end = socket.socketpair()
    with node, worker_end:
        node.sendall(
            b"".join(encode(MessageType.CALL, pb.Call(call_id=c, content_type="text/plain"), b"") for c in call_ids)
        )
        node.shutdown(socket.SHUT_WR)
        serve(backend, Channel(worker_end), ModelLoad("m", "/nowhere", 100), 1 << 20)
        worker_end.shutdown(socket.SHUT_WR)
        data = b"".join(iter(lambda: node.recv(1 << 16), b""))
    answers = []
    while data:
        length, _, _, _, header_len = struct.unpack_from("!IHHII", data)
        result = pb.CallResult.FromString(data[PREFIX_BYTES : PREFIX_BYTES + header_len])
        answers.append((result.call_id, result.outcome))
        data = data[4 + length :]
    return answers


def test_a_worker_whose_device_a_call_lost_answers_that_call_and_gives_its_model_up() -> None:
    """A kernel's fault (an illegal address, a device-side assert: one bad input can cause it) is
    sticky: the process's CUDA context fails every later call with it. The call that hit it gets its
    HANDLER_ERROR and the worker exits (the node then loads the model afresh where it is next
    sent) instead of failing every call its model is sent; a failure that leaves the device
    usable (an out-of-memory, a Python error) ends only its own call, as on the cpu."""
    from gpufaas.proto import gpufaas_pb2 as pb

    assert serve_calls(FaultingBackend(lost=False), ["c1", "c2"]) == [
        ("c1", pb.HANDLER_ERROR),
        ("c2", pb.HANDLER_ERROR),
    ]
    lost = FaultingBackend(lost=True)
    assert serve_calls(lost, ["c1", "c2"]) == [("c1", pb.HANDLER_ERROR)]
    assert lost.calls == 1


def test_the_cuda_device_is_unusable_when_synchronizing_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from gpu_manager.backends import CudaBackend

    backend = CudaBackend(WorkerDevice("cuda", "gpu0", 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    assert backend.usable()

    def lost(index: object = None) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    assert not backend.usable()


NO_PREDICT = "handler.py must define predict as a function: def predict(model, inputs)"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        # Named by the path the worker saw (a handle such as /proc/self/fd/4/handler.py), not by what was missing.
        ("def load(device):\n    return 1\n", NO_PREDICT),
        ("predict = 3\ndef load(device):\n    return 1\n", NO_PREDICT),
        # An async predict answered every call "handler output of type coroutine is not bytes, str or JSON ...".
        (
            "def load(device):\n    return 1\nasync def predict(model, inputs):\n    return 1\n",
            "handler.py: predict is an `async def`; make it a plain `def predict(model, inputs)`",
        ),
        # An async load made the model a coroutine object (never run), handed to every predict.
        (
            "async def load(device):\n    return 1\ndef predict(model, inputs):\n    return 1\n",
            "handler.py: load is an `async def`; make it a plain `def load(device)`",
        ),
        (
            "def load(device):\n    return 1\ndef predict(model, inputs):\n    yield 1\n",
            "handler.py: predict yields (a generator); make it return its result",
        ),
        # A generator warmup never ran a step.
        (
            "def load(device):\n    return 1\ndef predict(model, inputs):\n    return 1\n"
            "def warmup(model):\n    yield\n",
            "handler.py: warmup yields (a generator); make it return its result",
        ),
    ],
)
def test_a_handler_without_plain_entry_points_is_refused_at_import_saying_what_to_write(
    tmp_path: Path, source: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_handler puts the package first
    monkeypatch.delitem(sys.modules, "gpufaas_handler_pkg", raising=False)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "handler.py").write_text(source)
    with pytest.raises(TypeError) as raised:
        import_handler(str(package))
    sys.modules.pop("gpufaas_handler_pkg", None)
    assert str(raised.value) == message
