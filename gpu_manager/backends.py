"""Execution backends: how a worker process loads a function onto its device, runs it and measures it.

A backend object lives inside one worker process (see `gpu_manager.worker`) and serves one
(model, device) pair: `setup()` before anything else is imported, `load()` once, then `predict()`
per request, with `peak_memory_mb()` read after the load and after every inference.

- `cuda`: the function's handler on `cuda:{index}`; peak memory measured (see `CudaBackend`).
- `cpu`: the function's handler on the CPU, one thread; peak memory is the declared `memory_mb`.
- `emulated`: no handler and no torch; load and inference sleep their profiled times, so the
  paper's workload can run through the real control plane on a machine without GPUs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gpu_manager.devices import Nvml
from gpufaas.errors import GpufaasError
from gpufaas.profiles import paper_table1

if TYPE_CHECKING:
    from gpu_manager.worker import WorkerSpec

PACKAGE_DIR_ENV = "GPUFAAS_PACKAGE_DIR"
"""Set in a worker to its package directory, for handlers that read files beside `handler.py`."""

_MIB = 1024 * 1024


class UnknownBackend(GpufaasError):
    pass


class Backend(ABC):
    """What a worker process needs from its execution backend. Subclasses register themselves by
    name (`class X(Backend, name="x")`); `make_backend(name, spec)` builds one."""

    name: ClassVar[str]
    _registry: ClassVar[dict[str, type[Backend]]] = {}

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:  # intermediate bases (no name) are not selectable
            cls.name = name
            Backend._registry[name] = cls

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec

    @property
    @abstractmethod
    def device(self) -> str:
        """The device string handed to the handler's `load(device)`."""

    def setup(self) -> None:  # noqa: B027  an optional hook: most backends need no setup
        """Runs first in the worker process, before the handler (and torch) is imported."""

    @abstractmethod
    def load(self) -> None:
        """Load the function's model onto the device; an exception means the load failed."""

    @abstractmethod
    def predict(self, inputs: object) -> object:
        """Run one inference; returns when its result is complete (device work included)."""

    @abstractmethod
    def peak_memory_mb(self) -> int:
        """The most device memory this worker has held so far (MiB), the figure the cache charges."""


def backend_names() -> list[str]:
    return sorted(Backend._registry)


def backend_class(name: str) -> type[Backend]:
    """The backend registered as `name`; UnknownBackend (listing the valid names) otherwise."""
    try:
        return Backend._registry[name]
    except KeyError:
        raise UnknownBackend(f"unknown backend {name!r}; valid backends: {', '.join(backend_names())}") from None


def make_backend(name: str, spec: WorkerSpec) -> Backend:
    return backend_class(name)(spec)


# --- the function's handler ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Handler:
    """The two entry points of a function package's `handler.py`."""

    load: Callable[[str], object]
    predict: Callable[[object, object], object]


def import_handler(package_dir: str) -> Handler:
    """Import `handler.py` of `package_dir` under a module name unique to that directory, with the
    directory first on `sys.path` so the handler can import its sibling modules."""
    path = Path(package_dir) / "handler.py"
    module_name = "gpufaas_handler_" + "".join(c if c.isalnum() else "_" for c in Path(package_dir).resolve().name)
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot import {path}")
    if package_dir not in sys.path:
        sys.path.insert(0, package_dir)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    load, predict = getattr(module, "load", None), getattr(module, "predict", None)
    if not callable(load) or not callable(predict):
        raise TypeError(f"{path} must define load(device) and predict(model, inputs)")
    return Handler(load=load, predict=predict)


class _HandlerBackend(Backend):
    """Runs the package's handler: `load(device)` once, `predict(model, inputs)` per request."""

    _handler: Handler
    _model: object

    def load(self) -> None:
        package_dir = self.spec.package_dir
        # Handlers find their weights by `GPUFAAS_PACKAGE_DIR` or by relative path: give them both.
        os.environ[PACKAGE_DIR_ENV] = package_dir
        os.chdir(package_dir)
        self._handler = import_handler(package_dir)
        self._model = self._handler.load(self.device)

    def predict(self, inputs: object) -> object:
        return self._handler.predict(self._model, inputs)


class CpuBackend(_HandlerBackend, name="cpu"):
    """Real torch on the CPU, one thread per worker so that the workers of one node (standing in
    for its GPUs) do not fight over cores. There is no device memory to measure: the peak reported
    is the function's declared `memory_mb`, which is what the cache manager already assumes."""

    @property
    def device(self) -> str:
        return "cpu"

    def setup(self) -> None:
        # Set before torch is imported (torch sizes its thread pools at import), and again below
        # through torch's own call in case the handler imported torch some other way.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = "1"

    def load(self) -> None:
        super().load()
        torch = sys.modules.get("torch")
        if torch is not None:  # a handler without torch pays no torch import for this
            torch.set_num_threads(1)

    def peak_memory_mb(self) -> int:
        return self.spec.memory_mb


class CudaBackend(_HandlerBackend, name="cuda"):
    """The handler on `cuda:{index}`.

    Peak memory = `torch.cuda.max_memory_reserved(device)` (the caching allocator's high-water mark
    since the worker started; the pool is kept, so it stays charged) + the memory the process holds
    outside the allocator (CUDA context, cuBLAS/cuDNN handles, lazily loaded kernels). That overhead
    is measured with NVML: first as the growth of the device's used memory across context creation
    (nothing else loads on this GPU meanwhile: the pool holds the GPU's lock during a start), then,
    after the load and each inference, as NVML's figure for this PID minus the allocator's current
    reservation, keeping the largest seen. Where NVML cannot see this PID (containers with their own
    PID namespace) the context figure stands; without NVML at all, `DEFAULT_CONTEXT_MB` is assumed.
    """

    DEFAULT_CONTEXT_MB: ClassVar[int] = 500

    _overhead_mb: int = 0
    _nvml: Nvml | None = None

    @property
    def device(self) -> str:
        return f"cuda:{self.spec.device_index}"

    def setup(self) -> None:
        # NVML numbers GPUs in PCI bus order and so does the gpu_manager's Device.index; CUDA's
        # default order is "fastest first". Make `cuda:{index}` the same GPU NVML calls `index`.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        self._nvml = Nvml.open()

    def load(self) -> None:
        import torch

        index = self.spec.device_index
        used_before_mb = self._nvml.used_mb(index) if self._nvml is not None else None
        torch.cuda.set_device(index)
        free, total = torch.cuda.mem_get_info(index)  # creates this process's CUDA context
        if used_before_mb is None:
            self._overhead_mb = self.DEFAULT_CONTEXT_MB
        else:
            self._overhead_mb = max(0, (total - free) // _MIB - used_before_mb)
        super().load()
        torch.cuda.synchronize(index)

    def predict(self, inputs: object) -> object:
        import torch

        outputs = super().predict(inputs)
        # Kernels run asynchronously: the inference is over when the device says so.
        torch.cuda.synchronize(self.spec.device_index)
        return outputs

    def peak_memory_mb(self) -> int:
        import torch

        index = self.spec.device_index
        if self._nvml is not None:
            process_mb = self._nvml.process_mb(index, os.getpid())
            if process_mb is not None:
                reserved_mb = torch.cuda.memory_reserved(index) // _MIB
                self._overhead_mb = max(self._overhead_mb, process_mb - reserved_mb)
        return math.ceil(torch.cuda.max_memory_reserved(index) / _MIB) + self._overhead_mb


class EmulatedBackend(Backend, name="emulated"):
    """Stands in for a GPU: no handler, no torch. Load sleeps `load_time_s` and inference sleeps
    `inference_time_s`, from the spec when it gives them, else from `emulated_times`. The output
    is a small JSON echo of the request; the peak memory is the declared `memory_mb`."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.load_time_s, self.inference_time_s = emulated_times(spec.model, spec.memory_mb)
        if spec.load_time_s is not None:
            self.load_time_s = spec.load_time_s
        if spec.inference_time_s is not None:
            self.inference_time_s = spec.inference_time_s

    @property
    def device(self) -> str:
        return f"emulated:{self.spec.device_index}"

    def load(self) -> None:
        time.sleep(self.load_time_s)

    def predict(self, inputs: object) -> object:
        time.sleep(self.inference_time_s)
        reply: dict[str, object] = {"model": self.spec.model, "backend": self.name, "device": self.device}
        if isinstance(inputs, bytes):
            reply["input_bytes"] = len(inputs)
        else:
            reply["echo"] = inputs
        return reply

    def peak_memory_mb(self) -> int:
        return self.spec.memory_mb


def emulated_times(model: str, memory_mb: int) -> tuple[float, float]:
    """(load_time_s, inference_time_s) of `model` from the paper's Table I (RTX 2080, batch 32); a
    model not in the table gets both in proportion to its size, at the table's median seconds per MB."""
    by_model, load_s_per_mb, inference_s_per_mb = _table1()
    known = by_model.get(model)
    if known is not None:
        return known
    return load_s_per_mb * memory_mb, inference_s_per_mb * memory_mb


@cache
def _table1() -> tuple[dict[str, tuple[float, float]], float, float]:
    profiles = paper_table1()
    by_model = {p.model: (p.load_time_s, p.inference_time_s) for p in profiles}
    load_s_per_mb = statistics.median(p.load_time_s / p.memory_mb for p in profiles)
    inference_s_per_mb = statistics.median(p.inference_time_s / p.memory_mb for p in profiles)
    return by_model, load_s_per_mb, inference_s_per_mb
