"""Backends and the worker's wire format: registry, emulated profiles, input decoding, output encoding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpu_manager.backends import UnknownBackend, backend_class, backend_names, emulated_times, make_backend
from gpu_manager.devices import Device, discover_nvml, logical_devices, normalize_gpu_type
from gpu_manager.worker import WorkerSpec, decode_inputs, encode_result

REPO = Path(__file__).resolve().parents[2]


def test_backends_are_registered_by_name_and_an_unknown_one_lists_the_valid_ones() -> None:
    assert backend_names() == ["cpu", "cuda", "emulated"]
    assert backend_class("emulated").name == "emulated"
    with pytest.raises(UnknownBackend, match="unknown backend 'tpu'; valid backends: cpu, cuda, emulated"):
        backend_class("tpu")


def test_device_strings() -> None:
    spec = WorkerSpec("m", "gpu3", 3, "cuda", "/p", 100)
    assert make_backend("cuda", spec).device == "cuda:3"
    assert make_backend("cpu", spec).device == "cpu"
    assert make_backend("emulated", spec).device == "emulated:3"


def test_emulated_times_come_from_table1_then_from_size() -> None:
    assert emulated_times("resnet18", 1) == (2.52, 1.25)  # Table I row, whatever the declared size
    small_load_s, small_inference_s = emulated_times("my-model", 1000)
    big_load_s, big_inference_s = emulated_times("my-model", 2000)
    assert big_load_s == pytest.approx(2 * small_load_s)
    assert big_inference_s == pytest.approx(2 * small_inference_s)
    assert 0.5 < small_load_s < 5.0  # Table I loads ~1.3 GB models in ~2.5 s


def test_the_spec_overrides_the_emulated_profile() -> None:
    backend = make_backend("emulated", WorkerSpec("resnet18", "gpu0", 0, "emulated", "", 100, 0.0, 0.01))
    backend.load()
    assert backend.predict(b"abc") == {
        "model": "resnet18",
        "backend": "emulated",
        "device": "emulated:0",
        "input_bytes": 3,
    }
    assert backend.peak_memory_mb() == 100


def test_the_emulated_worker_path_never_imports_torch_or_numpy() -> None:
    script = (
        "import sys\n"
        "from gpu_manager.pool import WorkerPool\n"
        "from gpu_manager.worker import WorkerSpec, encode_result\n"
        "from gpu_manager.backends import make_backend\n"
        "b = make_backend('emulated', WorkerSpec('resnet50', 'gpu0', 0, 'emulated', '', 100, 0.0, 0.0))\n"
        "b.setup(); b.load(); encode_result(b.predict({'x': 1})); b.peak_memory_mb()\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported torch or numpy'\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=60)


@pytest.mark.parametrize(
    ("payload", "inputs"),
    [
        (b'{"inputs": [[1, 2]]}', {"inputs": [[1, 2]]}),
        (b"3", 3),
        (b"\xff\xfe", b"\xff\xfe"),  # not UTF-8: raw bytes
        (b"not json", b"not json"),
        (b"", b""),
    ],
)
def test_payloads_decode_to_json_when_they_are_json_else_to_bytes(payload: bytes, inputs: object) -> None:
    assert decode_inputs(payload) == inputs


def test_outputs_encode_bytes_as_is_text_as_utf8_and_the_rest_as_json() -> None:
    assert encode_result(b"\x00\x01") == b"\x00\x01"
    assert encode_result(bytearray(b"ab")) == b"ab"
    assert encode_result("héllo") == "héllo".encode()
    assert encode_result({"a": [1, 2.5, None]}) == b'{"a":[1,2.5,null]}'
    with pytest.raises(TypeError, match="object is not bytes, str or JSON-serializable"):
        encode_result({"a": object()})


def test_tensors_and_arrays_encode_as_nested_lists() -> None:
    torch = pytest.importorskip("torch")
    numpy = pytest.importorskip("numpy")
    assert encode_result({"t": torch.tensor([[1.0, 2.0]]), "n": numpy.arange(3), "s": numpy.float32(0.5)}) == (
        b'{"t":[[1.0,2.0]],"n":[0,1,2],"s":0.5}'
    )


def test_logical_devices_and_gpu_type_names() -> None:
    assert logical_devices(2, 8000, "cpu") == [Device("gpu0", 8000, "cpu", 0), Device("gpu1", 8000, "cpu", 1)]
    with pytest.raises(ValueError, match="memory_mb must be positive"):
        logical_devices(1, 0, "cpu")
    assert normalize_gpu_type("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert normalize_gpu_type("NVIDIA GeForce RTX 2080") == "nvidia-geforce-rtx-2080"


def test_nvml_discovery_never_raises() -> None:
    devices = discover_nvml()  # [] on a machine without an NVIDIA driver
    assert all(d.gpu_id == f"gpu{d.index}" and d.memory_mb > 0 for d in devices)
