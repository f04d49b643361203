"""Execution backends: how a worker process warms up, loads a function, runs it and measures it.

A backend's class prepares the node's zygote process once (see `gpu_manager.zygote`), and an
instance lives inside each worker process the zygote forks, serving one device. So a *warm
spare* has done everything but the model:

    Backend.setup()          in the zygote, before anything heavy is imported (thread counts, ...)
    Backend.import_runtime() in the zygote: torch and what every handler needs (paid once per node)
    init_device()            in the forked worker: the device context; returns the MiB it holds
    load(model)              on a miss: import the function's handler and run load(device)
    predict(inputs) / predict_batch([inputs, ...])   per call or merged batch
    peak_memory_mb()         after the load and after every batch

- `cuda`: the handler on `cuda:{index}`; peak memory measured (see `CudaBackend`).
- `cpu`: the handler on the CPU, one thread; peak memory is the declared `memory_mb`.
- `emulated`: no handler and no torch; load and inference sleep their profiled times, so the
  paper's workload can run through the real control plane on a machine without GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gpu_manager.devices import Nvml
from gpufaas import weights
from gpufaas.errors import GpufaasError
from gpufaas.functions import WorkerSettings
from gpufaas.profiles import paper_table1

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpu_manager.backends")

PACKAGE_DIR_ENV = "GPUFAAS_PACKAGE_DIR"
"""Set in a worker to its package directory, for handlers that read files beside `handler.py`."""

_MIB = 1024 * 1024


class UnknownBackend(GpufaasError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerDevice:
    """What a worker process is started with, before it has a model: its backend and device."""

    backend: str
    gpu_id: str
    device_index: int


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """The model a worker takes (on a miss): the function's package and how to run it.

    `memory_mb` is the function's declared peak; `settings` are the function's own for its worker
    (`max_batch_size` > 1 makes `predict` receive a list of inputs and return a list);
    `load_time_s` / `inference_time_s` are the emulated backend's profile (None: Table I or size)."""

    model: str
    package_dir: str
    memory_mb: int
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    load_time_s: float | None = None
    inference_time_s: float | None = None
    pooled: dict[str, int] = field(default_factory=dict)  # package path -> fd on its host-pool copy


class Backend(ABC):
    """What a worker process needs from its execution backend. Subclasses register themselves by
    name (`class X(Backend, name="x")`); `make_backend(device)` builds one."""

    name: ClassVar[str]
    _registry: ClassVar[dict[str, type[Backend]]] = {}

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:  # intermediate bases (no name) are not selectable
            cls.name = name
            Backend._registry[name] = cls

    def __init__(self, device: WorkerDevice) -> None:
        self.worker_device = device
        self.spec: ModelLoad | None = None

    @property
    @abstractmethod
    def device(self) -> str:
        """The device string handed to the handler's `load(device)`."""

    @classmethod  # noqa: B027  an optional hook: most backends need no setup
    def setup(cls) -> None:
        """Runs first in the zygote, before torch is imported."""

    @classmethod  # noqa: B027  the emulated backend imports nothing
    def import_runtime(cls) -> None:
        """Import what every handler of this backend needs (torch), so that a miss does not pay it.
        Must not start threads or touch a device: the zygote forks workers afterwards."""

    def init_device(self) -> int:
        """Create the device context now (a spare holds it while it waits); returns the device
        memory it holds, in MiB (0 where there is none to count)."""
        return 0

    @abstractmethod
    def load(self, spec: ModelLoad) -> None:
        """Load the function's model onto the device; an exception means the load failed."""

    @abstractmethod
    def predict(self, inputs: object) -> object:
        """Run one inference; returns when its result is complete (device work included)."""

    def predict_batch(self, inputs: list[object]) -> list[object]:
        """Run a merged batch (functions with max_batch_size > 1): the handler's predict takes the
        list and must return a list of as many outputs, in order."""
        outputs = self.predict(inputs)
        if not isinstance(outputs, list | tuple) or len(outputs) != len(inputs):
            got = f"{len(outputs)} outputs" if isinstance(outputs, list | tuple) else type(outputs).__name__
            raise TypeError(f"predict was given a batch of {len(inputs)} inputs and returned {got}; return a list")
        return list(outputs)

    @abstractmethod
    def peak_memory_mb(self) -> int:
        """The most device memory this worker has held so far (MiB), the figure the cache charges."""

    def usable(self) -> bool:
        """Whether the device still runs this worker's work after a call failed (False: every
        later call would fail as well, and the worker must give its model up)."""
        return True


def backend_names() -> list[str]:
    return sorted(Backend._registry)


def backend_class(name: str) -> type[Backend]:
    """The backend registered as `name`; UnknownBackend (listing the valid names) otherwise."""
    try:
        return Backend._registry[name]
    except KeyError:
        raise UnknownBackend(f"unknown backend {name!r}; valid backends: {', '.join(backend_names())}") from None


def make_backend(device: WorkerDevice) -> Backend:
    return backend_class(device.backend)(device)


# --- the function's handler ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Handler:
    """The entry points of a function package's `handler.py`: `load(device)` and
    `predict(model, inputs)`, and optionally `warmup(model)`, run once after the load and before
    any call (a first inference that pays cuDNN's autotuning, say), so no caller pays it."""

    load: Callable[[str], object]
    predict: Callable[[object, object], object]
    warmup: Callable[[object], object] | None = None


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
    return Handler(
        load=_entry_point(module, "load(device)"),
        predict=_entry_point(module, "predict(model, inputs)"),
        warmup=_entry_point(module, "warmup(model)") if getattr(module, "warmup", None) is not None else None,
    )


def _entry_point(module: object, signature: str) -> Callable[..., object]:
    """The function `signature` names in the handler `module`; TypeError saying what to write where
    it is missing, not callable, or an `async def` or generator (the worker calls each once and uses
    what it returns: a coroutine or generator object was the model, or an output no encoder took).
    The message says `handler.py`: the path the worker sees may be a handle under /proc."""
    name = signature.split("(", 1)[0]
    function = getattr(module, name, None)
    if not callable(function):
        raise TypeError(f"handler.py must define {name} as a function: def {signature}")
    if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
        raise TypeError(f"handler.py: {name} is an `async def`; make it a plain `def {signature}`")
    if inspect.isgeneratorfunction(function):
        raise TypeError(f"handler.py: {name} yields (a generator); make it return its result")
    entry: Callable[..., object] = function
    return entry


def _import_torch() -> Any:
    """torch if it is installed (a handler may do without it), else None."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


class _HandlerBackend(Backend):
    """Runs the package's handler: `load(device)` once, `predict(model, inputs)` per call or batch."""

    _handler: Handler
    _model: object

    @classmethod
    def import_runtime(cls) -> None:
        torch = _import_torch()
        if torch is None:
            return
        # What the templates and most handlers use next, when installed: imported once here
        # instead of at every miss (a cold torchvision import takes seconds).
        for name in ("safetensors.torch", "torchvision.models"):
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                with contextlib.suppress(Exception):  # a broken optional package must not stop the node
                    importlib.import_module(name)

    def load(self, spec: ModelLoad) -> None:
        self.spec = spec
        package_dir = spec.package_dir
        # Handlers find their weights by `GPUFAAS_PACKAGE_DIR` or by relative path: give them both.
        os.environ.update(spec.settings.environment)
        os.environ[PACKAGE_DIR_ENV] = package_dir
        os.chdir(package_dir)
        weights.configure(package_dir, spec.pooled)  # what gpufaas.weights.load_file maps from the pool
        self._handler = import_handler(package_dir)
        self._model = self._handler.load(self.device)
        if spec.settings.warmup and self._handler.warmup is not None:
            self._handler.warmup(self._model)

    def predict(self, inputs: object) -> object:
        return self._handler.predict(self._model, inputs)


class CpuBackend(_HandlerBackend, name="cpu"):
    """Real torch on the CPU, one thread per worker so that the workers of one node (standing in
    for its GPUs) do not fight over cores. There is no device memory to measure: the peak reported
    is the function's declared `memory_mb`, which is what the cache manager already assumes."""

    @property
    def device(self) -> str:
        return "cpu"

    @classmethod
    def setup(cls) -> None:
        # Set before torch is imported (torch sizes its thread pools at import), and again below
        # through torch's own call in case the handler imported torch some other way.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = "1"

    def load(self, spec: ModelLoad) -> None:
        super().load(spec)
        torch = sys.modules.get("torch")
        if torch is not None:  # a handler without torch pays no torch import for this
            torch.set_num_threads(1)

    def peak_memory_mb(self) -> int:
        return self.spec.memory_mb if self.spec is not None else 0


def prime_kernels(device: torch.device) -> None:
    """Run the layers most models are made of once on `device`, on made-up inputs, so that a spare
    (which does not yet know its model) has created the cuBLAS and cuDNN handles and loaded those
    layers' kernels before a miss takes it. On an H100 this took a ResNet-18 miss's warm-up from
    530 ms (nothing primed) or 176 ms (the handles only) to 93 ms, and its first call from 134 to
    46 ms (bench/cuda_probe.py); a spare pays about 130 ms more while it waits, and keeps the
    loaded kernels (a few MiB, counted in its context's memory). A layer that fails here is only
    left unprimed: the model's own load will say what is wrong with the device."""
    import torch
    import torch.nn.functional as F  # noqa: N812  the conventional name

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device)

    try:
        with torch.inference_mode():
            # Convolutional nets (the common ImageNet stem and a 3x3 block, their preprocessing).
            image = randn(1, 3, 224, 224)
            F.interpolate(image, size=(112, 112), mode="bilinear", antialias=True)
            x = F.conv2d(image, randn(64, 3, 7, 7), stride=2, padding=3)
            x = F.relu(F.batch_norm(x, randn(64), randn(64).abs(), randn(64), randn(64)))
            x = F.max_pool2d(x, 3, 2, 1)
            x = F.conv2d(x, randn(64, 64, 3, 3), padding=1) + x
            features = F.adaptive_avg_pool2d(x, 1).flatten(1)
            # MLPs and transformers: dense layers, normalization, activations, attention.
            logits = F.linear(features, randn(1000, 64), randn(1000))
            torch.softmax(logits, dim=1).topk(5, dim=1)
            tokens = F.embedding(torch.arange(16, device=device).view(1, 16), randn(32, 64))
            hidden = F.gelu(F.layer_norm(tokens, (64,)))
            q = hidden.view(1, 16, 4, 16).transpose(1, 2)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            (hidden @ hidden.transpose(1, 2)).sum().item()  # the item() waits for all of it
    except Exception as exc:  # priming is an optimization, never a reason to fail a spare
        log.warning("priming the kernels of %s failed (a miss will load them): %s", device, exc)


class CudaBackend(_HandlerBackend, name="cuda"):
    """The handler on `cuda:{index}`.

    Peak memory = `torch.cuda.max_memory_reserved(device)` (the caching allocator's high-water mark
    since the worker started; the pool is kept, so it stays charged) + the memory the process holds
    outside the allocator (CUDA context, cuBLAS/cuDNN handles, lazily loaded kernels). That overhead
    is measured when the spare creates its context (and its cuBLAS and cuDNN handles): NVML's
    figure for this PID (or, where NVML cannot see this PID, e.g. in a container with its own PID
    namespace, the growth of the device's used memory across making them), less what the allocator
    still reserves then (cuBLAS's workspaces, which the high-water mark counts; priming's own peak is
    reset, not charged to the model); after the load and each batch that moved the allocator's
    reservation it is re-read as NVML's figure for this PID minus that reservation, keeping the
    largest seen. Without NVML at all, `DEFAULT_CONTEXT_MB` is assumed.
    """

    DEFAULT_CONTEXT_MB: ClassVar[int] = 500

    _overhead_mb: int = 0
    _nvml: Nvml | None = None
    _reserved_seen: int = -1  # the allocator's reservation when NVML was last asked

    @property
    def device(self) -> str:
        return f"cuda:{self.worker_device.device_index}"

    @classmethod
    def setup(cls) -> None:
        # NVML numbers GPUs in PCI bus order and so does the gpu_manager's Device.index; CUDA's
        # default order is "fastest first". Make `cuda:{index}` the same GPU NVML calls `index`,
        # whatever order the node's environment asked for (it would name another GPU).
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # NVML ignores CUDA_VISIBLE_DEVICES; CUDA would number only the GPUs it names (cuda:0 the
        # first of them). The node chose its GPUs by it already (discover_nvml), and a container
        # sees its own GPU only: here it would hide or shift the GPU `index` names.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

    def init_device(self) -> int:
        import torch

        self._nvml = Nvml.open()  # per process: an NVML session does not survive a fork
        index = self.worker_device.device_index
        used_before_mb = self._nvml.used_mb(index) if self._nvml is not None else None
        torch.cuda.set_device(index)
        torch.cuda.mem_get_info(index)  # creates this process's CUDA context
        prime_kernels(torch.device(f"cuda:{index}"))
        torch.cuda.empty_cache()
        # max_memory_reserved counts from the worker's start: priming's tensors, given back just
        # now, are not the model's high-water mark.
        torch.cuda.reset_peak_memory_stats(index)
        free, total = torch.cuda.mem_get_info(index)  # the context with its handles and kernels
        try:
            # The buffers a load from the host pool stages its weights through, made while the spare
            # waits rather than on the miss's path (host memory, page-locked: no device memory).
            weights.prepare_staging(self.device)
        except Exception as exc:  # an optimization, never a reason to fail a spare
            log.warning("making the weight staging buffers of %s failed (a load makes its own): %s", self.device, exc)
        process_mb = self._nvml.process_mb(index, os.getpid()) if self._nvml is not None else None
        if process_mb is not None:
            held_mb = process_mb
        elif used_before_mb is not None:
            # Other processes may allocate meanwhile: an estimate, corrected after the first batch.
            held_mb = max(0, (total - free) // _MIB - used_before_mb)
        else:
            self._overhead_mb = self.DEFAULT_CONTEXT_MB
            return self._overhead_mb
        # What the allocator still reserves (cuBLAS's workspaces, which empty_cache keeps) is held
        # by the spare, but peak_memory_mb counts it through max_memory_reserved: not twice.
        self._overhead_mb = max(0, held_mb - torch.cuda.memory_reserved(index) // _MIB)
        return held_mb

    def load(self, spec: ModelLoad) -> None:
        import torch

        try:
            super().load(spec)
        finally:
            weights.release_staging()  # the model is on the device: the staging buffers go back
        torch.cuda.synchronize(self.worker_device.device_index)

    def predict(self, inputs: object) -> object:
        import torch

        outputs = super().predict(inputs)
        # Kernels run asynchronously: the inference is over when the device says so.
        torch.cuda.synchronize(self.worker_device.device_index)
        return outputs

    def usable(self) -> bool:
        # A kernel's fault (an illegal address, a device-side assert) is sticky: CUDA answers every
        # later call of this process with it, unlike an out-of-memory, after which the device runs on.
        import torch

        try:
            torch.cuda.synchronize(self.worker_device.device_index)
        except Exception as exc:
            log.error("the CUDA context of %s is lost (%s): its worker gives its model up", self.device, exc)
            return False
        return True

    def peak_memory_mb(self) -> int:
        import torch

        index = self.worker_device.device_index
        reserved = torch.cuda.memory_reserved(index)
        # NVML's per-process query costs about as much as a small model's inference: ask it only
        # when the allocator's reservation moved (which is when the process's footprint does).
        if self._nvml is not None and reserved != self._reserved_seen:
            self._reserved_seen = reserved
            process_mb = self._nvml.process_mb(index, os.getpid())
            if process_mb is not None:
                self._overhead_mb = max(self._overhead_mb, process_mb - reserved // _MIB)
        return math.ceil(torch.cuda.max_memory_reserved(index) / _MIB) + self._overhead_mb


class EmulatedBackend(Backend, name="emulated"):
    """Stands in for a GPU: no handler, no torch. Load sleeps `load_time_s` and inference sleeps
    `inference_time_s` (per call of a merged batch), from the spec when it gives them, else from
    `emulated_times`. The output is a small JSON echo of the request; the peak memory is the
    declared `memory_mb`."""

    load_time_s: float = 0.0
    inference_time_s: float = 0.0

    @property
    def device(self) -> str:
        return f"emulated:{self.worker_device.device_index}"

    def load(self, spec: ModelLoad) -> None:
        self.spec = spec
        self.load_time_s, self.inference_time_s = emulated_times(spec.model, spec.memory_mb)
        if spec.load_time_s is not None:
            self.load_time_s = spec.load_time_s
        if spec.inference_time_s is not None:
            self.inference_time_s = spec.inference_time_s
        time.sleep(self.load_time_s)

    def predict(self, inputs: object) -> object:
        time.sleep(self.inference_time_s)
        return self._echo(inputs)

    def predict_batch(self, inputs: list[object]) -> list[object]:
        time.sleep(self.inference_time_s * len(inputs))
        return [self._echo(one) for one in inputs]

    def _echo(self, inputs: object) -> dict[str, object]:
        model = self.spec.model if self.spec is not None else ""
        reply: dict[str, object] = {"model": model, "backend": self.name, "device": self.device}
        if isinstance(inputs, bytes):
            reply["input_bytes"] = len(inputs)
        else:
            reply["echo"] = inputs
        return reply

    def peak_memory_mb(self) -> int:
        return self.spec.memory_mb if self.spec is not None else 0


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
