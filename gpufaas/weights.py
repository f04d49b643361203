"""Handlers' weight loading: safetensors files served from the node's host model pool, zero-copy on
the cpu and through pinned staging buffers, pipelined, to a cuda device.

The worker calls `configure()` once, before the handler's `load(device)`, with the function's package
directory and a read-only fd on the pool's copy (a tmpfs file) of each pooled weight file. Handlers
call `load_file()` where they would call `safetensors.torch.load_file()`; it returns the same tensors:

- cpu: tensors over a private copy-on-write mapping of the pool's copy (`mmap.ACCESS_COPY`). Nothing
  is copied; a handler writing into a tensor changes only its own pages, never the pool.
- cuda: the file's bytes go through two page-locked staging buffers of `chunk_bytes` each: torch's
  (multithreaded) copy fills one from the pool's mapping while the other's transfer runs on a side
  stream; at the end the stream is synchronized. Nothing of the pool is page-locked: locking its
  pages (cudaHostRegister) cost more than the copy itself (on an H200, 14 GB/s against 28-31 GB/s
  staged from a tmpfs of 4 KiB pages, 47-50 GB/s from one of huge pages; the device copies 55 GB/s
  from pinned memory: `bench/pool_copy_probe.py`). A worker waiting for a model (a spare) makes
  its staging buffers beforehand (`prepare_staging`) and gives them back once its model is loaded
  (`release_staging`); a load without them makes and frees its own.
- a file that is not pooled, or another device: `safetensors.torch.load_file()` itself.

torch is imported inside functions: the daemons import this package without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import posixpath
import re
import struct
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

log = logging.getLogger("gpufaas.weights")

CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes of each of the cuda path's two staging buffers: one step of the pipeline (on an H200, 16 MiB
staged 28 GB/s, 64 MiB 31 GB/s, 128 MiB 22 GB/s: `bench/pool_copy_probe.py`)."""

UNPREPARED_STAGE_BYTES = 16 * 1024 * 1024
"""The staging buffers' size for a load that finds none prepared: page-locking fresh memory costs
about 50 ms per 128 MiB on an H200, more than staging 1 GiB through smaller buffers loses."""

# safetensors' dtype names -> torch's attribute names, as safetensors.torch maps them; the float8 ones
# exist from torch 2.1 on, U16-U64 from 2.3 (a name torch lacks reads as an unsupported dtype).
_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}  # fmt: skip
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
_CUDART = re.compile(r"/libcudart[^/]*\.so")


@dataclass(frozen=True)
class LoadStats:
    """What one `load_file()` did: `bytes` of tensor data in `tensors` tensors over `seconds`, of which
    `pin_s` making and freeing staging buffers (0 when they were prepared beforehand), `stage_s`
    filling them from the pool's copy and `copy_s` issuing and waiting on transfers, in `chunks`
    fills of a staging buffer (cuda path only; 0 otherwise)."""

    file: str
    pooled: bool
    device: str
    bytes: int
    tensors: int
    seconds: float
    pin_s: float
    stage_s: float
    copy_s: float
    chunks: int


@dataclass
class _WorkerState:
    """The worker process's configuration, set by configure() before the handler runs (configure({})
    clears it), and the last load's figures."""

    package_real: str | None = None  # realpath of the package directory at configure time
    pooled: dict[str, int] = field(default_factory=dict)  # normalized package-relative path -> pool fd
    h2d_factory: Callable[[str], HostToDevice] | None = None  # None: CudaHostToDevice
    staging: _Staging | None = None  # made by prepare_staging(), until release_staging()
    # Counts prepare_staging() and release_staging() calls: a load gives back the buffers it took
    # only if neither ran meanwhile (else they are freed).
    staging_generation: int = 0
    last_stats: LoadStats | None = None


_state = _WorkerState()
_staging_lock = threading.Lock()  # handlers may load files from threads
_unfreeable: list[torch.Tensor] = []  # buffers that could not be unpinned: never freed while locked


class HostToDevice(Protocol):
    """The CUDA calls of the cuda path, behind one seam so that tests run it without a GPU."""

    def pin(self, nbytes: int) -> torch.Tensor:
        """A new page-locked host buffer of `nbytes` (uint8). Raises RuntimeError if the device
        cannot page-lock it."""

    def unpin(self, buffer: torch.Tensor) -> None:
        """Undo `pin(...)` of `buffer` (no transfer may still be reading it)."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new, uninitialized destination tensor on the device."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue dst <- src (same number of bytes, both uint8) without waiting for it."""

    def mark(self) -> object:
        """A point after every copy enqueued so far (for `wait`)."""

    def wait(self, mark: object) -> None:
        """Wait until the copies enqueued before `mark` have finished."""

    def synchronize(self) -> None:
        """Wait until every enqueued copy has finished."""


class CudaHostToDevice:
    """HostToDevice over torch's cudart binding and one side stream of `device` ('cuda' or 'cuda:N')."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = torch.device(device)
        self._cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]  # likewise
        # Destinations come from the current stream's pool: blocks it freed may still be in use by its
        # pending kernels, so the side stream starts after them.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def pin(self, nbytes: int) -> torch.Tensor:
        import torch

        # Ordinary memory, page-aligned, locked by cudaHostRegister and unlocked by `unpin`: a
        # buffer from torch's pinned allocator would stay cached, locked, for the worker's life.
        raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        offset = -raw.data_ptr() % mmap.PAGESIZE
        buffer = raw[offset : offset + nbytes]
        with torch.cuda.device(self.device):
            code = self._cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        self._check(code, f"cudaHostRegister({buffer.data_ptr():#x}, {nbytes}, 0)")
        return buffer

    def unpin(self, buffer: torch.Tensor) -> None:
        import torch

        with torch.cuda.device(self.device):
            code = self._cudart.cudaHostUnregister(buffer.data_ptr())
        self._check(code, f"cudaHostUnregister({buffer.data_ptr():#x})")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        import torch

        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> object:
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        event.record(self._stream)
        return event

    def wait(self, mark: object) -> None:
        import torch

        assert isinstance(mark, torch.cuda.Event)
        mark.synchronize()

    def synchronize(self) -> None:
        self._stream.synchronize()

    def _check(self, code: Any, call: str) -> None:
        # The binding returns a cudaError enum (only `success` is named) and raises nothing itself.
        if int(code) != 0:
            message = self._cudart.cudaGetErrorString(code)
            _clear_cuda_error()
            raise RuntimeError(f"{call} failed: {message} (cudaError {int(code)})")


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call of ours: the runtime keeps it, and
    torch's check after its next kernel launch would raise it as that kernel's (cudaGetLastError
    returns and resets it; torch's binding has no call for it, so through the libcudart this
    process loaded). Nothing is raised if that cannot be done."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            fields = (line.rstrip("\n").split(maxsplit=5) for line in maps)
            loaded = {f[5] for f in fields if len(f) == 6 and _CUDART.search(f[5]) and not f[5].endswith(" (deleted)")}
    except OSError as exc:
        log.debug("could not read this process's mappings to reset the CUDA runtime's last error: %s", exc)
        return
    if not loaded:
        log.debug("no libcudart among this process's mappings: the CUDA runtime's last error stays")
    for path in loaded:
        try:
            ctypes.CDLL(path).cudaGetLastError()  # dlopen of a loaded library: that same instance
        except Exception as exc:  # best effort: the error it could not clear is the one raised anyway
            log.debug("could not reset the last error of %s: %s", path, exc)


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


def prepare_staging(device: str, nbytes: int = CHUNK_BYTES) -> None:
    """Make the cuda path's staging buffers for `device` ('cuda' or 'cuda:N') now, ahead of a
    load (a spare, while it waits for its model): `load_file` on that device then uses them
    instead of making its own. Kept until `release_staging()`; a device that cannot page-lock
    them gets ordinary memory (slower copies, still right)."""
    if not _CUDA_DEVICE.fullmatch(device):
        raise ValueError(f"staging buffers are for a cuda device ('cuda' or 'cuda:N'), not {device!r}")
    device = _resolved(device)
    with _staging_lock:
        current = _state.staging
        if current is not None and current.device == device and current.nbytes >= nbytes:
            return
    release_staging()
    staging = _make_staging((_state.h2d_factory or CudaHostToDevice)(device), device, nbytes)
    with _staging_lock:
        _state.staging, replaced = staging, _state.staging
        _state.staging_generation += 1
    if replaced is not None:
        replaced.free()


def release_staging() -> None:
    """Give back the buffers `prepare_staging` made (a worker, once its model is loaded; a load
    running meanwhile frees them when it ends). Never raises: a buffer that cannot be unpinned is
    kept, and logged."""
    with _staging_lock:
        staging, _state.staging = _state.staging, None
        _state.staging_generation += 1
    if staging is not None:
        staging.free()


def staging_bytes() -> int:
    """The bytes of the buffers `prepare_staging` made that wait for a load now (0 while a load
    has them)."""
    staging = _state.staging
    return 2 * staging.nbytes if staging is not None else 0


def last_load_stats() -> LoadStats | None:
    """The figures of the most recent `load_file()` in this process (None before the first)."""
    return _state.last_stats


def load_file(
    filename: str | os.PathLike[str], device: str | int = "cpu", *, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    """Same contract as `safetensors.torch.load_file()`: every tensor of `filename` (relative to the
    cwd) on `device`, in file order. A file registered by `configure()`, matched by its real path
    within the package's real path, is read from the pool; 'cpu' gives zero-copy tensors over a
    private mapping, 'cuda', 'cuda:N' or N copies through staging buffers of `chunk_bytes` (those
    `prepare_staging` made for the device, used up to `chunk_bytes`; else new ones of at most
    UNPREPARED_STAGE_BYTES, freed at the end).
    Raises ValueError naming the file on a corrupt header."""
    started = time.perf_counter()
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    target = _target_device(device)
    fd = _pooled_fd(filename)
    real_path = os.path.realpath(filename)
    if fd is None or target is None:
        from safetensors.torch import load_file as safetensors_load_file

        tensors = safetensors_load_file(filename, device=device)
        nbytes = sum(t.nbytes for t in tensors.values())
        seconds = time.perf_counter() - started
        _state.last_stats = LoadStats(real_path, False, str(device), nbytes, len(tensors), seconds, 0.0, 0.0, 0.0, 0)
        return tensors
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError(f"{real_path}: {size} bytes is too short for a safetensors file")
    # Never closed here: it unmaps when nothing references it. On the cpu the tensors are the mapping,
    # private (copy-on-write: a handler may write them); on cuda it is only read, and shared.
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY if target == "cpu" else mmap.ACCESS_READ)
    entries = _parse_header(mapping, real_path)
    nbytes = sum(e.nbytes for e in entries)
    pin_s = stage_s = copy_s = 0.0
    chunks = 0
    if target == "cpu":
        tensors = _map_on_cpu(mapping, entries)
    else:
        tensors, pin_s, stage_s, copy_s, chunks = _load_on_cuda(mapping, entries, nbytes, target, chunk_bytes)
    seconds = time.perf_counter() - started
    _state.last_stats = LoadStats(
        real_path, True, target, nbytes, len(entries), seconds, pin_s, stage_s, copy_s, chunks
    )
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
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nested too deep
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


def _load_on_cuda(
    mapping: mmap.mmap, entries: Sequence[_Entry], nbytes: int, target: str, chunk_bytes: int
) -> tuple[dict[str, torch.Tensor], float, float, float, int]:
    """`load_file`'s cuda path for `entries` (`nbytes` of data): (tensors, pin_s, stage_s, copy_s,
    fills). Uses the prepared staging buffers for `target` when there are some and no other load has
    them, else makes its own."""
    target = _resolved(target)
    h2d = (_state.h2d_factory or CudaHostToDevice)(target)
    if nbytes == 0:  # nothing to stage: no buffer to make (a page-lock of 0 bytes is an error)
        return {e.name: h2d.empty(e.shape, e.dtype) for e in entries}, 0.0, 0.0, 0.0, 0
    taken = _take_staging(target)
    pin_s = 0.0
    if taken is None:
        pinned_at = time.perf_counter()
        stage_bytes = min(chunk_bytes, UNPREPARED_STAGE_BYTES, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        staging = _make_staging(h2d, target, stage_bytes)
        pin_s = time.perf_counter() - pinned_at
    else:
        staging = taken[0]
    try:
        tensors, stage_s, copy_s, fills = _copy_to_device(
            mapping, entries, h2d, staging, min(chunk_bytes, staging.nbytes)
        )
    finally:
        if taken is None:
            pinned_at = time.perf_counter()
            staging.free()
            pin_s += time.perf_counter() - pinned_at
        else:
            _give_back_staging(*taken)
    return tensors, pin_s, stage_s, copy_s, fills


def _take_staging(target: str) -> tuple[_Staging, int] | None:
    """The prepared buffers, if they are for `target` ('cuda:N', `_resolved`), taken for one load
    with the generation they belong to; None if there are none (or another load has them: it makes
    its own then)."""
    with _staging_lock:
        staging = _state.staging
        if staging is None or staging.device != target:
            return None
        _state.staging = None
        return staging, _state.staging_generation


def _give_back_staging(staging: _Staging, generation: int) -> None:
    """A load is done with the buffers it took: they are the prepared ones again, unless staging
    was prepared or released meanwhile (then they go)."""
    with _staging_lock:
        keep = _state.staging is None and _state.staging_generation == generation
        if keep:
            _state.staging = staging
    if not keep:
        staging.free()


def _resolved(device: str) -> str:
    """'cuda' as 'cuda:N' of the current device (staging buffers are page-locked for one device,
    and which one 'cuda' means can change); 'cuda' itself where no CUDA runtime answers."""
    if device != "cuda":
        return device
    try:
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    except Exception:  # no cuda here (the tests' fakes)
        return device


@dataclass(slots=True)
class _Staging:
    """The cuda path's two staging buffers of `nbytes` each, made by `h2d` for `device`: page-locked,
    or ordinary memory where the device could not lock them (`pinned` False)."""

    h2d: HostToDevice
    device: str
    nbytes: int
    buffers: list[torch.Tensor]
    pinned: bool

    def free(self) -> None:
        """Unlock and drop the buffers. Never raises: a buffer that cannot be unpinned is kept for
        the process's life (freeing locked memory would hand the allocator pages the device may
        still reach), and logged."""
        buffers, self.buffers = self.buffers, []
        for buffer in buffers if self.pinned else ():
            _unpin_or_keep(self.h2d, buffer, self.device)


def _unpin_or_keep(h2d: HostToDevice, buffer: torch.Tensor, device: str) -> None:
    """Unpin `buffer`; one that cannot be is kept for the process's life, never freed while locked."""
    try:
        h2d.unpin(buffer)
    except Exception as exc:
        _unfreeable.append(buffer)
        log.warning("could not unpin a staging buffer on %s (kept, not freed): %s", device, exc)


def _make_staging(h2d: HostToDevice, device: str, nbytes: int) -> _Staging:
    import torch

    buffers: list[torch.Tensor] = []
    try:
        for _ in range(2):
            buffers.append(h2d.pin(nbytes))
    except RuntimeError as exc:
        for buffer in buffers:
            _unpin_or_keep(h2d, buffer, device)
        # Some devices and drivers refuse to page-lock: copy from ordinary memory (slower, still right).
        log.warning("cannot page-lock staging buffers on %s (%s); copying unpinned", device, exc)
        return _Staging(h2d, device, nbytes, [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)], False)
    return _Staging(h2d, device, nbytes, buffers, True)


@dataclass(slots=True)
class _Window:
    """File bytes [begin, end) that go through one staging buffer at once, and the tensor pieces in
    them: (tensor, first byte, end) in file offsets."""

    begin: int
    end: int
    pieces: list[tuple[_Entry, int, int]]


def _plan_windows(entries: Sequence[_Entry], window_bytes: int) -> list[_Window]:
    """Cover every byte of the non-empty tensors, in file order, with windows of at most
    `window_bytes` (a larger tensor spans several). A gap between tensors smaller than the room left
    in a window is staged with it (safetensors' data is contiguous, so there are none in practice)."""
    windows: list[_Window] = []
    for e in (e for e in entries if e.nbytes):
        at = e.begin
        while at < e.end:
            last = windows[-1] if windows else None
            if last is not None and last.begin <= at < last.begin + window_bytes:
                end = min(e.end, last.begin + window_bytes)
                last.end = max(last.end, end)
                last.pieces.append((e, at, end))
            else:
                end = min(e.end, at + window_bytes)
                windows.append(_Window(at, end, [(e, at, end)]))
            at = end
    return windows


def _copy_to_device(
    mapping: mmap.mmap, entries: Sequence[_Entry], h2d: HostToDevice, staging: _Staging, window_bytes: int
) -> tuple[dict[str, torch.Tensor], float, float, int]:
    """The cuda path: (tensors, stage_s, copy_s, fills). Each window of the file is staged into one
    buffer while the transfers of the other's run; a buffer is filled again only once the transfers
    that read it have ended. Returns after every transfer has ended, also when one fails."""
    import torch

    with warnings.catch_warnings():  # a read-only buffer: only ever copied from, never written
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # byte views: no dtype alignment to respect
    tensors = {e.name: h2d.empty(e.shape, e.dtype) for e in entries}
    destinations = {name: t.reshape(-1).view(torch.uint8) for name, t in tensors.items() if t.numel()}
    windows = _plan_windows(entries, window_bytes)
    read_by: list[object | None] = [None, None]  # per buffer: the mark after the transfers reading it
    stage_s = copy_s = 0.0
    try:
        for i, window in enumerate(windows):
            buffer = staging.buffers[i % 2]
            started = time.perf_counter()
            if read_by[i % 2] is not None:
                h2d.wait(read_by[i % 2])
            filled = time.perf_counter()
            copy_s += filled - started
            buffer[: window.end - window.begin].copy_(whole[window.begin : window.end])
            stage_s += time.perf_counter() - filled
            for e, begin, end in window.pieces:
                h2d.copy(
                    destinations[e.name][begin - e.begin : end - e.begin],
                    buffer[begin - window.begin : end - window.begin],
                )
            read_by[i % 2] = h2d.mark()
        started = time.perf_counter()
        h2d.synchronize()
        copy_s += time.perf_counter() - started
    except BaseException:
        # Transfers in flight read the staging buffers: let them end before they are reused or freed.
        with contextlib.suppress(Exception):
            h2d.synchronize()
        raise
    # In file order, as safetensors returns them.
    return {e.name: tensors[e.name] for e in entries}, stage_s, copy_s, len(windows)
