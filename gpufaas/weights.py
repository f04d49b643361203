"""Handlers' weight loading: safetensors files served from the node's host model pool, zero-copy on
the cpu and through pinned, chunked, pipelined copies to a cuda device.

The worker calls `configure()` once, before the handler's `load(device)`, with the function's package
directory and a read-only fd on the pool's copy (a tmpfs file) of each pooled weight file. Handlers
call `load_file()` where they would call `safetensors.torch.load_file()`; it returns the same tensors:

- cpu: tensors over a private copy-on-write mapping of the pool's copy (`mmap.ACCESS_COPY`). Nothing
  is copied; a handler writing into a tensor changes only its own pages, never the pool.
- cuda: the tensors' host ranges are page-locked one chunk (about `chunk_bytes`) at a time and copied
  with non-blocking copies on a side stream, so the next chunk's registration overlaps the last
  chunk's transfer; at the end the stream is synchronized and every registration undone.
- a file that is not pooled, or another device: `safetensors.torch.load_file()` itself.

torch is imported inside functions: the daemons import this package without it.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import logging
import mmap
import os
import posixpath
import re
import struct
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpufaas.weights")

CHUNK_BYTES = 64 * 1024 * 1024
"""Host bytes page-locked and copied per step of the cuda path (one or a few layers of a large model)."""

# safetensors' dtype names -> torch's attribute names, as safetensors.torch maps them; the float8 ones
# exist from torch 2.1 on, U16-U64 from 2.3 (a name torch lacks reads as an unsupported dtype).
_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


@dataclass(frozen=True)
class LoadStats:
    """What one `load_file()` did: `bytes` of tensor data in `tensors` tensors over `seconds`, of which
    `register_s` page-locking and unlocking host memory and `copy_s` issuing and waiting on copies,
    in `chunks` chunks (cuda path only; 0 otherwise)."""

    file: str
    pooled: bool
    device: str
    bytes: int
    tensors: int
    seconds: float
    register_s: float
    copy_s: float
    chunks: int


@dataclass
class _WorkerState:
    """The worker process's configuration, set by configure() before the handler runs (configure({})
    clears it), and the last load's figures."""

    package_real: str | None = None  # realpath of the package directory at configure time
    pooled: dict[str, int] = field(default_factory=dict)  # normalized package-relative path -> pool fd
    h2d_factory: Callable[[str], HostToDevice] | None = None  # None: CudaHostToDevice
    last_stats: LoadStats | None = None


_state = _WorkerState()


class HostToDevice(Protocol):
    """The CUDA calls of the cuda path, behind one seam so that tests run it without a GPU."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock host memory [address, address + nbytes) (page-aligned, never overlapping a live one)."""

    def unregister(self, address: int) -> None:
        """Undo the registration that began at `address`."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new, uninitialized destination tensor on the device."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue dst <- src (same number of bytes, both uint8) without waiting for it."""

    def synchronize(self) -> None:
        """Wait until every enqueued copy has finished."""


CUDA_HOST_REGISTER_READ_ONLY = 0x08
"""cudaHostRegisterReadOnly: the device only reads the pages. The pool's copy is mapped read-only
and shared (no page is copied privately); pinning it for writing would break that."""


class CudaHostToDevice:
    """HostToDevice over torch's cudart binding and one side stream of `device` ('cuda' or 'cuda:N').
    `register_flags` go to cudaHostRegister as they are (default: read-only registration)."""

    def __init__(self, device: str, register_flags: int = CUDA_HOST_REGISTER_READ_ONLY) -> None:
        import torch

        self.device = torch.device(device)
        self.register_flags = register_flags
        self._cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # likewise
        # Destinations come from the current stream's pool: blocks it freed may still be in use by its
        # pending kernels, so the side stream starts after them.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def register(self, address: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            code = self._cudart.cudaHostRegister(address, nbytes, self.register_flags)
        self._check(code, f"cudaHostRegister({address:#x}, {nbytes}, {self.register_flags})")

    def unregister(self, address: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            code = self._cudart.cudaHostUnregister(address)
        self._check(code, f"cudaHostUnregister({address:#x})")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        import torch

        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def _check(self, code: Any, call: str) -> None:
        # The binding returns a cudaError enum (only `success` is named) and raises nothing itself.
        if int(code) != 0:
            message = self._cudart.cudaGetErrorString(code)
            raise RuntimeError(f"{call} failed: {message} (cudaError {int(code)})")


def configure(package_dir: str, pooled: Mapping[str, int]) -> None:
    """Register the pooled files of the package at `package_dir` (a path or a '/proc/self/fd/N'
    handle, resolved now): `pooled` maps package-relative POSIX paths to read-only fds on the pool's
    copies, which the caller keeps open. Replaces any earlier configuration; `{}` clears it.
    Raises ValueError on a path that is absolute or leaves the package."""
    normalized: dict[str, int] = {}
    for rel_path, fd in pooled.items():
        key = posixpath.normpath(rel_path)
        if posixpath.isabs(key) or key == ".." or key.startswith("../"):
            raise ValueError(f"pooled path {rel_path!r} is not inside the package")
        normalized[key] = fd
    _state.package_real = os.path.realpath(package_dir) if normalized else None
    _state.pooled = normalized


def pooled_files() -> dict[str, int]:
    """A copy of what `configure()` registered: normalized package-relative path -> fd."""
    return dict(_state.pooled)


def set_host_to_device_factory(factory: Callable[[str], HostToDevice] | None) -> None:
    """Make the cuda path build its HostToDevice with `factory(device)`; None restores CudaHostToDevice."""
    _state.h2d_factory = factory


def last_load_stats() -> LoadStats | None:
    """The figures of the most recent `load_file()` in this process (None before the first)."""
    return _state.last_stats


def load_file(
    filename: str | os.PathLike[str], device: str | int = "cpu", *, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    """Same contract as `safetensors.torch.load_file()`: every tensor of `filename` (relative to the
    cwd) on `device`, in file order. A file registered by `configure()`, matched by its real path
    within the package's real path, is read from the pool; 'cpu' gives zero-copy tensors over a
    private mapping, 'cuda', 'cuda:N' or N a pinned, chunked copy of at most `chunk_bytes` per chunk
    (more for a single larger tensor). Raises ValueError naming the file on a corrupt header."""
    started = time.perf_counter()
    target = _target_device(device)
    fd = _pooled_fd(filename)
    real_path = os.path.realpath(filename)
    if fd is None or target is None:
        from safetensors.torch import load_file as safetensors_load_file

        tensors = safetensors_load_file(filename, device=device)
        nbytes = sum(t.nbytes for t in tensors.values())
        seconds = time.perf_counter() - started
        _state.last_stats = LoadStats(real_path, False, str(device), nbytes, len(tensors), seconds, 0.0, 0.0, 0)
        return tensors
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError(f"{real_path}: {size} bytes is too short for a safetensors file")
    # Never closed here: tensors keep it referenced, and it unmaps when the last goes. On the cpu the
    # tensors are the mapping, private (copy-on-write: a handler may write them); on cuda it is only
    # read, and shared, so that pinning it copies no page.
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY if target == "cpu" else mmap.ACCESS_READ)
    entries = _parse_header(mapping, real_path)
    register_s = copy_s = 0.0
    chunks = 0
    if target == "cpu":
        tensors = _map_on_cpu(mapping, entries)
    else:
        h2d = (_state.h2d_factory or CudaHostToDevice)(target)
        tensors, register_s, copy_s, chunks = _copy_to_device(mapping, entries, h2d, chunk_bytes)
    nbytes = sum(e.nbytes for e in entries)
    seconds = time.perf_counter() - started
    _state.last_stats = LoadStats(real_path, True, target, nbytes, len(entries), seconds, register_s, copy_s, chunks)
    return tensors


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a file: its bytes are mapping[begin:end] (offsets from the file's start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _target_device(device: str | int) -> str | None:
    """'cpu', 'cuda' or 'cuda:N' for the pool's paths; None for devices left to safetensors."""
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}" if device >= 0 else None
    text = str(device)
    return text if text == "cpu" or _CUDA_DEVICE.fullmatch(text) else None


def _pooled_fd(filename: str | os.PathLike[str]) -> int | None:
    if _state.package_real is None:
        return None
    rel_path = os.path.relpath(os.path.realpath(filename), _state.package_real)
    if rel_path == os.pardir or rel_path.startswith(os.pardir + os.sep):
        return None
    return _state.pooled.get(rel_path)


def _parse_header(mapping: mmap.mmap, file: str) -> list[_Entry]:
    """The tensors described by a safetensors header (8-byte little-endian length N, N bytes of JSON;
    data offsets count from byte 8 + N), checked against the file's size, sorted by offset."""
    import torch

    (header_len,) = struct.unpack("<Q", mapping[:8])
    data_start = 8 + header_len
    if data_start > len(mapping):
        raise ValueError(f"{file}: header length {header_len} runs past the end of the file")
    try:
        header = json.loads(mapping[8:data_start])
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{file}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file}: header is not a JSON object")
    entries = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_text, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{file}: tensor {name!r} has a malformed entry {spec!r}") from exc
        dtype = getattr(torch, _DTYPE_NAMES.get(dtype_text, ""), None) if isinstance(dtype_text, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{file}: tensor {name!r} has an unsupported dtype {dtype_text!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{file}: tensor {name!r} has a malformed shape {shape!r}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= len(mapping) - data_start):
            raise ValueError(f"{file}: tensor {name!r} has data offsets {[begin, end]} outside the file")
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name!r} spans {end - begin} bytes, not {numel * dtype.itemsize}")
        entries.append(_Entry(name, dtype, tuple(shape), data_start + begin, data_start + end))
    # safetensors returns tensors in file order (a stable sort keeps header order among empty ones).
    entries.sort(key=lambda e: (e.begin, e.end))
    return entries


def _map_on_cpu(mapping: mmap.mmap, entries: Sequence[_Entry]) -> dict[str, torch.Tensor]:
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        if e.nbytes == 0:  # frombuffer refuses a count of 0
            tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
        elif e.begin % e.dtype.itemsize == 0:  # the mapping starts on a page, so this is the address's alignment
            count = e.nbytes // e.dtype.itemsize
            tensors[e.name] = torch.frombuffer(mapping, dtype=e.dtype, count=count, offset=e.begin).reshape(e.shape)
        else:
            # frombuffer accepts a misaligned address, but kernels may assume alignment: copy this one.
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=e.nbytes, offset=e.begin)
            tensors[e.name] = raw.clone().view(e.dtype).reshape(e.shape)
    return tensors


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Tensors copied after one registration of mapping[register_begin:register_end] (empty when
    their pages were all registered with an earlier chunk; the first tensor's first page may have been)."""

    entries: list[_Entry]
    register_begin: int
    register_end: int


def _plan_chunks(entries: Sequence[_Entry], chunk_bytes: int, page_bytes: int = mmap.PAGESIZE) -> list[_Chunk]:
    """Group the non-empty tensors, in file order, into chunks spanning at most `chunk_bytes` (a
    larger tensor alone), each with a page-aligned registration. Registrations tile without overlap,
    as CUDA refuses to register a page twice: each starts where the previous one ended."""
    groups: list[tuple[list[_Entry], int]] = []  # (tensors, end of the furthest one)
    for e in (e for e in entries if e.nbytes):
        if groups and max(e.end, groups[-1][1]) - groups[-1][0][0].begin <= chunk_bytes:
            groups[-1] = (groups[-1][0] + [e], max(e.end, groups[-1][1]))
        else:
            groups.append(([e], e.end))
    chunks, registered_end = [], 0
    for group, group_end in groups:
        begin = max(group[0].begin // page_bytes * page_bytes, registered_end)
        end = max(-(-group_end // page_bytes) * page_bytes, begin)
        chunks.append(_Chunk(group, begin, end))
        registered_end = end
    return chunks


class _Registrations:
    """The ranges of one mapping page-locked for a cuda copy (`HostToDevice.register`), in offset
    order. Lifecycle: made by `_copy_to_device`, which unregisters `addresses` once its copies end."""

    def __init__(self, h2d: HostToDevice, mapping: mmap.mmap, base_address: int) -> None:
        self.h2d = h2d
        self.mapping = mapping
        self.base_address = base_address  # the mapping's first byte
        self.addresses: list[int] = []  # registered, to unregister
        self.begins: list[int] = []  # their offsets in the mapping, ascending
        self.pinning = True  # False once the first registration failed: every copy is from pageable memory
        self.seconds = 0.0  # spent registering

    def register(self, chunk: _Chunk) -> None:
        """Page-lock `chunk`'s registration, if it has one and pinning is on. A failure on the first
        one turns pinning off (and is logged); a later one raises."""
        if not (self.pinning and chunk.register_end > chunk.register_begin):
            return
        started = time.perf_counter()
        try:
            self.h2d.register(self.base_address + chunk.register_begin, chunk.register_end - chunk.register_begin)
        except RuntimeError as exc:
            if self.addresses:
                raise
            # Read-only registration is missing on some devices and drivers: copy from
            # pageable memory (slower, still right) rather than fail the load.
            log.warning("cannot page-lock %s for its copy (%s); copying unpinned", self.mapping, exc)
            self.pinning = False
        else:
            self.addresses.append(self.base_address + chunk.register_begin)
            self.begins.append(chunk.register_begin)
        self.seconds += time.perf_counter() - started


def _copy_to_device(
    mapping: mmap.mmap, entries: Sequence[_Entry], h2d: HostToDevice, chunk_bytes: int
) -> tuple[dict[str, torch.Tensor], float, float, int]:
    """The cuda path: (tensors, register_s, copy_s, chunks). Every registration is undone, after the
    copies have finished, whether or not they succeeded."""
    import torch

    with warnings.catch_warnings():  # a read-only buffer: only ever copied from, never written
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # byte views: no dtype alignment to respect
    tensors = {e.name: h2d.empty(e.shape, e.dtype) for e in entries if e.nbytes == 0}
    pins = _Registrations(h2d, mapping, whole.data_ptr())
    copy_s = 0.0
    chunks = _plan_chunks(entries, chunk_bytes)
    try:
        for chunk in chunks:
            pins.register(chunk)
            # Enqueued without waiting: the next chunk's registration overlaps these transfers.
            started = time.perf_counter()
            tensors.update(_enqueue_copies(h2d, whole, chunk.entries, pins.begins))
            copy_s += time.perf_counter() - started
        started = time.perf_counter()
        h2d.synchronize()
        copy_s += time.perf_counter() - started
    except BaseException:
        # Copies in flight read the pinned pages: let them end before unpinning, and keep the first error.
        with contextlib.suppress(Exception):
            h2d.synchronize()
        with contextlib.suppress(Exception):
            _unregister_all(h2d, pins.addresses)
        raise
    started = time.perf_counter()
    _unregister_all(h2d, pins.addresses)
    register_s = pins.seconds + (time.perf_counter() - started)
    # In file order, as safetensors returns them (empty tensors were allocated first).
    return {e.name: tensors[e.name] for e in entries}, register_s, copy_s, len(chunks)


def _enqueue_copies(
    h2d: HostToDevice, whole: torch.Tensor, entries: Sequence[_Entry], register_begins: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Allocate each tensor on the device and enqueue its copy from `whole` (the mapping's bytes),
    without waiting; `register_begins` are the offsets of the page-locked ranges, ascending."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        dst = h2d.empty(e.shape, e.dtype)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        # A tensor whose first page went with the previous chunk spans two registrations: one
        # copy per registration, as a copy's source must lie within one page-locked range.
        first, last = (
            bisect.bisect_right(register_begins, e.begin),
            bisect.bisect_left(register_begins, e.end),
        )
        for begin, end in itertools.pairwise([e.begin, *register_begins[first:last], e.end]):
            h2d.copy(dst_bytes[begin - e.begin : end - e.begin], whole[begin:end])
        tensors[e.name] = dst
    return tensors


def _unregister_all(h2d: HostToDevice, addresses: Sequence[int]) -> None:
    """Unregister every address, even after one fails (pinned pages would stay locked for the
    worker's life); then raise the first failure."""
    first_error: Exception | None = None
    for address in addresses:
        try:
            h2d.unregister(address)
        except Exception as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
