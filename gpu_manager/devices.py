"""The GPUs of this node: discovered with NVML for the cuda backend, or configured logical devices."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU this node offers. `index` is the CUDA ordinal the worker opens (`cuda:{index}`);
    NVML numbers devices in PCI bus order, and the cuda backend sets `CUDA_DEVICE_ORDER=PCI_BUS_ID`
    in its workers so that both numberings agree."""

    gpu_id: str
    memory_mb: int
    gpu_type: str
    index: int


def normalize_gpu_type(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the form profiles and keys use."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def discover_nvml() -> list[Device]:
    """The GPUs NVML reports, as gpu0, gpu1, ... in NVML order; [] when nvidia-ml-py is not
    installed, no driver is loaded or NVML fails in any way (a CPU-only node is not an error)."""
    nvml = Nvml.open()
    if nvml is None:
        return []
    try:
        return nvml.devices()
    finally:
        nvml.close()


def logical_devices(count: int, memory_mb: int, gpu_type: str) -> list[Device]:
    """`count` identical devices gpu0..gpu{count-1} for the cpu and emulated backends."""
    if count < 0:
        raise ValueError(f"logical device count must be >= 0, got {count}")
    if memory_mb <= 0:
        raise ValueError(f"logical device memory_mb must be positive, got {memory_mb}")
    return [Device(gpu_id=f"gpu{i}", memory_mb=memory_mb, gpu_type=gpu_type, index=i) for i in range(count)]


class Nvml:
    """An open NVML session. Every query answers None (or []) instead of raising: NVML is a
    measurement aid here, and a node must keep serving when it misbehaves."""

    def __init__(self, module: Any) -> None:
        self._nvml = module  # the pynvml module, initialised; nvidia-ml-py ships no type hints

    @classmethod
    def open(cls) -> Nvml | None:
        """A session, or None when nvidia-ml-py is missing or no NVIDIA driver answers."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # ImportError, NVMLError (library not found, driver not loaded), OSError
            return None
        return cls(pynvml)

    def close(self) -> None:
        # Shutting down a broken session has nothing left to report.
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

    def devices(self) -> list[Device]:
        try:
            return [self._device(i) for i in range(int(self._nvml.nvmlDeviceGetCount()))]
        except Exception:
            return []

    def used_mb(self, index: int) -> int | None:
        """Memory in use on device `index` by every process (MiB)."""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used) // _MIB
        except Exception:
            return None

    def process_mb(self, index: int, pid: int) -> int | None:
        """Memory process `pid` holds on device `index` (MiB): its CUDA context, library workspaces
        and allocator pool together. None when NVML does not list `pid`: inside a container without
        the host's PID namespace NVML reports host PIDs, so callers need a fallback."""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        for process in processes:
            used = process.usedGpuMemory
            if process.pid == pid and used is not None:  # None: the driver withholds it (e.g. MIG)
                return int(used) // _MIB
        return None

    def _device(self, i: int) -> Device:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
        name = self._nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # older nvidia-ml-py releases return bytes
            name = name.decode("utf-8", "replace")
        memory_mb = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        return Device(gpu_id=f"gpu{i}", memory_mb=memory_mb, gpu_type=normalize_gpu_type(str(name)), index=i)
