"""The GPUs of this node: discovered with NVML for the cuda backend, or configured logical devices."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_MIB = 1024 * 1024
# NVML's topology levels (nvmlGpuTopologyLevel_t): two GPUs whose closest common ancestor is the
# same board (0), one PCIe switch (10) or several switches below one host bridge (20) share that
# switch's uplink for host-to-device copies; above it (30: host bridge, 40: NUMA node, 50: across
# sockets) each reaches the host on a link of its own.
_SHARED_UPLINK_LEVEL = 20


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU this node offers. `index` is the CUDA ordinal the worker opens (`cuda:{index}`);
    NVML numbers devices in PCI bus order, and the cuda backend sets `CUDA_DEVICE_ORDER=PCI_BUS_ID`
    in its workers and takes CUDA_VISIBLE_DEVICES out of their environment (the node has chosen
    its GPUs by it already: `discover_nvml`), so that both numberings agree. `link` names the host
    link (PCIe switch) it shares with other GPUs of the node, None when it has one of its own (see
    GpuSpec.link)."""

    gpu_id: str
    memory_mb: int
    gpu_type: str
    index: int
    link: str | None = None


def normalize_gpu_type(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the form profiles and keys use."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def discover_nvml() -> list[Device]:
    """The GPUs NVML reports that CUDA_VISIBLE_DEVICES lets this node use (all where it is unset),
    as gpu{NVML index}, in NVML order; [] when nvidia-ml-py is not installed, no driver is loaded
    or NVML fails in any way (a CPU-only node is not an error)."""
    nvml = Nvml.open()
    if nvml is None:
        return []
    try:
        return visible_devices(nvml.devices(), os.environ.get("CUDA_VISIBLE_DEVICES"), nvml.uuid)
    finally:
        nvml.close()


def visible_devices(devices: list[Device], visible: str | None, uuid: Callable[[int], str | None]) -> list[Device]:
    """Those of `devices` (NVML's: every GPU of the machine, whatever CUDA_VISIBLE_DEVICES says)
    that CUDA_VISIBLE_DEVICES=`visible` names (None: all), by NVML index (PCI bus order, as the
    cuda backend's workers number them) or by a prefix of the UUID `uuid(index)` NVML gives
    ('GPU-...'). As CUDA does, an entry naming no single GPU ends the list ('0,2,-1,1' is 0 and 2;
    '' is none); a MIG instance ('MIG-...') is not a GPU of this list either."""
    if visible is None:
        return devices
    by_index = {d.index: d for d in devices}
    chosen: set[int] = set()
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            matches = [int(entry)] if int(entry) in by_index else []
        elif entry.startswith("GPU-"):
            matches = [d.index for d in devices if (uuid(d.index) or "").startswith(entry)]
        else:
            matches = []
        if len(matches) != 1:
            break
        chosen.add(matches[0])
    return [d for d in devices if d.index in chosen]


def logical_devices(count: int, memory_mb: int, gpu_type: str, *, gpus_per_link: int = 0) -> list[Device]:
    """`count` identical devices gpu0..gpu{count-1} for the cpu and emulated backends; with
    `gpus_per_link` > 0 they sit behind shared links pcie0, pcie1, ... of that many GPUs each (a
    topology to place against, as NVML reports one on cuda)."""
    if count < 0:
        raise ValueError(f"logical device count must be >= 0, got {count}")
    if memory_mb <= 0:
        raise ValueError(f"logical device memory_mb must be positive, got {memory_mb}")
    if gpus_per_link < 0:
        raise ValueError(f"gpus_per_link must be >= 0 (0: a link per GPU), got {gpus_per_link}")
    return [
        Device(
            gpu_id=f"gpu{i}",
            memory_mb=memory_mb,
            gpu_type=gpu_type,
            index=i,
            link=f"pcie{i // gpus_per_link}" if gpus_per_link else None,
        )
        for i in range(count)
    ]


def shared_links(count: int, level: Callable[[int, int], int | None]) -> list[str | None]:
    """Each of `count` GPUs' shared host link from `level(i, j)`, the NVML topology level of GPUs i
    and j (None: unknown): GPUs joined by a level up to `_SHARED_UPLINK_LEVEL`, directly or through
    others, share a link named after the lowest index among them (pcie{k}); a GPU that shares with
    none has its own (None)."""
    group = list(range(count))  # union-find over the GPUs

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for i in range(count):
        for j in range(i + 1, count):
            shared = level(i, j)
            if shared is not None and shared <= _SHARED_UPLINK_LEVEL:
                group[max(root(i), root(j))] = min(root(i), root(j))
    roots = [root(i) for i in range(count)]
    return [f"pcie{r}" if roots.count(r) > 1 else None for r in roots]


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
            found = [self._device(i) for i in range(int(self._nvml.nvmlDeviceGetCount()))]
        except Exception:
            return []
        links = shared_links(len(found), self.topology_level)
        return [dataclasses.replace(device, link=link) for device, link in zip(found, links, strict=True)]

    def uuid(self, index: int) -> str | None:
        """Device `index`'s UUID ('GPU-...'), as CUDA_VISIBLE_DEVICES may name it."""
        try:
            uuid = self._nvml.nvmlDeviceGetUUID(self._nvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:
            return None
        return uuid.decode("ascii", "replace") if isinstance(uuid, bytes) else str(uuid)

    def topology_level(self, i: int, j: int) -> int | None:
        """The NVML topology level of the closest common ancestor of devices `i` and `j`."""
        try:
            first = self._nvml.nvmlDeviceGetHandleByIndex(i)
            second = self._nvml.nvmlDeviceGetHandleByIndex(j)
            return int(self._nvml.nvmlDeviceGetTopologyCommonAncestor(first, second))
        except Exception:  # not supported (e.g. some virtualised GPUs): no sharing known
            return None

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
        return self.processes_mb(index, (pid,))

    def processes_mb(self, index: int, pids: Iterable[int]) -> int | None:
        """Memory the processes `pids` hold on device `index` together (MiB), in one query; None
        when NVML lists none of them (see `process_mb`)."""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:
            return None
        wanted = set(pids)
        # None: the driver withholds it (e.g. MIG)
        held = [int(p.usedGpuMemory) for p in processes if p.pid in wanted and p.usedGpuMemory is not None]
        return sum(held) // _MIB if held else None

    def _device(self, i: int) -> Device:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
        name = self._nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # older nvidia-ml-py releases return bytes
            name = name.decode("utf-8", "replace")
        memory_mb = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        return Device(gpu_id=f"gpu{i}", memory_mb=memory_mb, gpu_type=normalize_gpu_type(str(name)), index=i)
