"""gpufaas.weights: pooled safetensors files load as safetensors would, zero-copy on the cpu and
through staged, pipelined copies (a recording fake for the CUDA calls) on a cuda device."""

from __future__ import annotations

import gc
import itertools
import json
import mmap
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gpufaas import weights  # noqa: E402  (after the importorskips: the module's tests need torch)
from gpufaas.weights import _Entry, _plan_windows, _target_device  # noqa: E402

PAGE = mmap.PAGESIZE


@pytest.fixture(autouse=True)
def reset_weights() -> Iterator[None]:
    weights.configure(".", {})
    weights.set_host_to_device_factory(None)
    yield
    weights.release_staging()  # a test that failed halfway leaves none for the next
    weights.configure(".", {})
    weights.set_host_to_device_factory(None)


@pytest.fixture
def open_fds() -> Iterator[list[int]]:
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    directory = tmp_path / "package"
    directory.mkdir()
    return directory


@pytest.fixture
def pool(tmp_path: Path, open_fds: list[int]) -> Callable[[Path], int]:
    """Copy a package file into the "pool" (a directory of tmp_path) and open the copy read-only."""
    (tmp_path / "pool").mkdir()

    def copy_into_pool(source: Path) -> int:
        copy = tmp_path / "pool" / f"{len(open_fds)}-{source.name}"
        shutil.copyfile(source, copy)
        fd = os.open(copy, os.O_RDONLY)
        open_fds.append(fd)
        return fd

    return copy_into_pool


def make_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "f64": torch.randn(3, 5, generator=generator, dtype=torch.float64),
        "f32": torch.randn(4, 6, generator=generator),
        "f16": torch.randn(7, generator=generator).half(),
        "bf16": torch.randn(2, 3, 4, generator=generator).bfloat16(),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "i16": torch.arange(-3, 4, dtype=torch.int16),
        "i8": torch.arange(-8, 8, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "u32": torch.tensor([0, 1, 3_000_000_000, 4_294_967_295], dtype=torch.uint32),
        "c64": torch.randn(3, generator=generator, dtype=torch.complex64),
        "bool": torch.tensor([True, False, True, True, False]),
        "f8_e4m3": torch.randn(5, generator=generator).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(6, generator=generator).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def write_package_file(package: Path, rel_path: str, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path = package / rel_path
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(make_tensors() if tensors is None else tensors, path, metadata={"format": "pt"})
    return path


def write_raw_file(path: Path, header: object, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """A safetensors file built by hand (header padded to 8 bytes, as safetensors pads it)."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded) if header_len is None else header_len) + encoded + data)
    return path


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(expected)  # file order, as safetensors gives it
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert loaded[name].shape == tensor.shape, name
        assert raw_bytes(loaded[name]) == raw_bytes(tensor), name  # bytes: float8 has no equality kernel


def mappings_of(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of `path`, from /proc/self/maps."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1]))
    return found


def in_pooled_package(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch, rel_path: str, *, named: str = ""
) -> tuple[Path, int]:
    """Write `rel_path` (make_tensors') into the package, pool a copy, configure the pool with it
    (under `named`, `rel_path` unless given) and work in the package directory: the file and the
    pool copy's fd."""
    source = write_package_file(package, rel_path)
    fd = pool(source)
    weights.configure(str(package), {named or rel_path: fd})
    monkeypatch.chdir(package)
    return source, fd


def pool_path(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


# --- cpu: zero-copy over a private mapping ---


def test_cpu_load_matches_safetensors_for_every_dtype(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_package_file(package, "weights.safetensors")
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    monkeypatch.chdir(package)

    loaded = weights.load_file("weights.safetensors")

    assert_same(loaded, safetensors_torch.load_file(source))
    stats = weights.last_load_stats()
    assert stats is not None
    assert (stats.file, stats.pooled, stats.device, stats.chunks) == (str(source.resolve()), True, "cpu", 0)
    assert stats.tensors == len(loaded)
    assert stats.bytes == sum(t.nbytes for t in loaded.values())
    assert stats.seconds >= 0


def test_cpu_load_reads_the_pool_copy_not_the_package_file(
    package: Path, tmp_path: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_package_file(package, "weights.safetensors", {"w": torch.zeros(4)})
    other = tmp_path / "other.safetensors"
    safetensors_torch.save_file({"w": torch.ones(4)}, other)
    weights.configure(str(package), {"weights.safetensors": pool(other)})
    monkeypatch.chdir(package)

    assert torch.equal(weights.load_file(source)["w"], torch.ones(4))


def test_cpu_tensors_lie_in_a_private_mapping_of_the_pool_copy_and_writes_stay_private(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, fd = in_pooled_package(package, pool, monkeypatch, "weights.safetensors")
    pooled_bytes = pool_path(fd).read_bytes()

    loaded = weights.load_file("weights.safetensors")

    regions = mappings_of(pool_path(fd))
    for name in ("f64", "f32", "bf16", "bool", "i8"):
        pointer = loaded[name].data_ptr()
        assert any(start <= pointer < end and perms.endswith("p") for start, end, perms in regions), name
    loaded["f32"].fill_(123.0)
    loaded["bool"].logical_not_()
    assert pool_path(fd).read_bytes() == pooled_bytes
    assert_same(weights.load_file("weights.safetensors"), safetensors_torch.load_file(source))


def test_cpu_tensors_keep_the_mapping_alive_and_release_it_when_gone(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, fd = in_pooled_package(package, pool, monkeypatch, "weights.safetensors")
    expected = safetensors_torch.load_file(source)["f32"][1:3].clone()

    view = weights.load_file("weights.safetensors")["f32"][1:3]  # the dict and the base tensor are gone
    gc.collect()

    assert len(mappings_of(pool_path(fd))) == 1
    assert torch.equal(view, expected)
    del view
    gc.collect()
    assert mappings_of(pool_path(fd)) == []


def test_misaligned_tensors_load_as_aligned_copies(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    header = {
        "__metadata__": {"note": "odd offsets"},
        "byte": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "f32": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
        "f64": {"dtype": "F64", "shape": [1], "data_offsets": [9, 17]},
        "i8": {"dtype": "I8", "shape": [2], "data_offsets": [17, 19]},
    }
    data = bytes([7]) + struct.pack("<2fd", 1.5, -2.0, 3.25) + bytes([255, 1])
    source = write_raw_file(package / "odd.safetensors", header, data)
    weights.configure(str(package), {"odd.safetensors": pool(source)})
    monkeypatch.chdir(package)

    loaded = weights.load_file("odd.safetensors")

    assert_same(loaded, safetensors_torch.load_file(source))
    assert loaded["f32"].tolist() == [1.5, -2.0]
    assert loaded["f64"].tolist() == [3.25]
    assert loaded["f32"].data_ptr() % 4 == 0
    assert loaded["f64"].data_ptr() % 8 == 0


# --- which files are pooled ---


def test_pooled_files_in_subdirectories_match_however_the_path_is_spelled(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source, fd = in_pooled_package(package, pool, monkeypatch, "sub/w.safetensors", named="./sub/w.safetensors")

    assert weights.pooled_files() == {"sub/w.safetensors": fd}
    for spelling in ("sub/w.safetensors", "./sub/../sub/w.safetensors", source, str(source)):
        weights.load_file(spelling)
        stats = weights.last_load_stats()
        assert stats is not None and stats.pooled, spelling


def test_files_not_pooled_and_files_outside_the_package_fall_back_to_safetensors(
    package: Path, tmp_path: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled = write_package_file(package, "w.safetensors")
    write_package_file(package, "other.safetensors")
    outside = write_package_file(tmp_path / "elsewhere", "w.safetensors")
    (package / "link.safetensors").symlink_to(outside)
    weights.configure(str(package), {"w.safetensors": pool(pooled), "link.safetensors": pool(pooled)})
    monkeypatch.chdir(package)

    for name in ("other.safetensors", "../elsewhere/w.safetensors", str(outside), "link.safetensors"):
        loaded = weights.load_file(name)
        stats = weights.last_load_stats()
        assert stats is not None and not stats.pooled, name
        assert_same(loaded, safetensors_torch.load_file(name))


def test_package_dir_given_as_an_o_path_handle(
    package: Path, pool: Callable[[Path], int], open_fds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_package_file(package, "weights.safetensors")
    handle = os.open(package, os.O_PATH | os.O_DIRECTORY)
    open_fds.append(handle)
    weights.configure(f"/proc/self/fd/{handle}", {"weights.safetensors": pool(source)})
    monkeypatch.chdir(package)

    assert_same(weights.load_file("weights.safetensors"), safetensors_torch.load_file(source))
    stats = weights.last_load_stats()
    assert stats is not None and stats.pooled


def test_configure_refuses_paths_leaving_the_package(package: Path) -> None:
    for rel_path in ("/etc/w.safetensors", "../w.safetensors", "sub/../../w.safetensors"):
        with pytest.raises(ValueError, match="not inside the package"):
            weights.configure(str(package), {rel_path: 0})


def test_configure_with_nothing_clears_the_pool(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_package_file(package, "weights.safetensors")
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    weights.configure(str(package), {})
    monkeypatch.chdir(package)

    weights.load_file("weights.safetensors")
    stats = weights.last_load_stats()
    assert weights.pooled_files() == {}
    assert stats is not None and not stats.pooled


# --- corrupt headers ---

F32_PAIR = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("header", "data", "header_len", "message"),
    [
        (b"", b"", 1 << 40, "runs past the end"),
        (b"{not json", b"", None, "not JSON"),
        (b"\xff\xfe", b"", None, "not JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, b"", None, "not JSON"),  # nested too deep to decode
        ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "malformed entry"),
        ({"w": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "'X9'"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None, "malformed shape"),
        ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4), None, "malformed shape"),
        (F32_PAIR, bytes(4), None, "outside the file"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}}, bytes(8), None, "outside the file"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), None, "spans 8 bytes, not 12"),
    ],
)
def test_corrupt_headers_raise_value_error_naming_the_file(
    package: Path,
    pool: Callable[[Path], int],
    monkeypatch: pytest.MonkeyPatch,
    *,
    header: object,
    data: bytes,
    header_len: int | None,
    message: str,
) -> None:
    source = write_raw_file(package / "bad.safetensors", header, data, header_len=header_len)
    weights.configure(str(package), {"bad.safetensors": pool(source)})
    monkeypatch.chdir(package)

    with pytest.raises(ValueError, match=message) as raised:
        weights.load_file("bad.safetensors")
    assert str(source) in str(raised.value)


def test_a_file_too_short_for_a_header_raises_value_error(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = package / "short.safetensors"
    source.write_bytes(b"\x01\x02\x03")
    weights.configure(str(package), {"short.safetensors": pool(source)})
    monkeypatch.chdir(package)

    with pytest.raises(ValueError, match="too short"):
        weights.load_file("short.safetensors")


# --- cuda: staged, pipelined copies (through a recording fake) ---


class RecordingHostToDevice:
    """A HostToDevice whose "device" tensors live on the cpu and whose transfers run late: a copy is
    carried out, reading its source, only when a `wait` or `synchronize` covers it, so a staging
    buffer filled again before its transfers ended shows as wrong bytes. Logs every call in order."""

    def __init__(
        self,
        device: str,
        pinned: dict[int, int],
        fail_on_copy: int | None = None,
        refuse_pin: bool = False,
    ) -> None:
        self.device = device
        self.fail_on_copy = fail_on_copy
        self.refuse_pin = refuse_pin
        self.events: list[str] = []
        # data_ptr -> nbytes of the buffers pinned and not unpinned, in this "process" (every fake's)
        self.pinned = pinned
        self.pin_sizes: list[int] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (sequence, dst, src), not yet run
        self.enqueued = 0

    def pin(self, nbytes: int) -> torch.Tensor:
        if self.refuse_pin:
            raise RuntimeError("cudaHostRegister failed: operation not supported (cudaError 801)")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned[buffer.data_ptr()] = nbytes
        self.pin_sizes.append(nbytes)
        self.events.append("pin")
        return buffer

    def unpin(self, buffer: torch.Tensor) -> None:
        assert not self.pending, "unpinned while a transfer still reads it"
        del self.pinned[buffer.data_ptr()]
        self.events.append("unpin")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.fail_on_copy is not None and self.events.count("copy") == self.fail_on_copy:
            raise RuntimeError("copy failed")
        assert dst.dtype == src.dtype == torch.uint8 and dst.numel() == src.numel()
        start, end = src.data_ptr(), src.data_ptr() + src.numel()
        if not self.refuse_pin:
            assert any(a <= start and end <= a + n for a, n in self.pinned.items()), "not from a pinned buffer"
        self.pending.append((self.enqueued, dst, src))
        self.enqueued += 1
        self.events.append("copy")

    def mark(self) -> object:
        self.events.append("mark")
        return self.enqueued

    def wait(self, mark: object) -> None:
        assert isinstance(mark, int)
        self._run(lambda sequence: sequence < mark)
        self.events.append("wait")

    def synchronize(self) -> None:
        self._run(lambda sequence: True)
        self.events.append("synchronize")

    def _run(self, due: Callable[[int], bool]) -> None:
        for _, dst, src in [p for p in self.pending if due(p[0])]:
            dst.copy_(src)
        self.pending = [p for p in self.pending if not due(p[0])]


def big_tensors() -> dict[str, torch.Tensor]:
    """Tensors of several sizes, a few small ones together, one larger than the windows of the tests."""
    tensors = {f"layer{i}.weight": torch.full((1000 + 300 * i,), float(i)) for i in range(6)}
    tensors |= {f"layer{i}.bias": torch.arange(i + 1, dtype=torch.float16) for i in range(6)}
    tensors |= {"embedding": torch.randn(9000), "mask": torch.tensor([True, False]), "none": torch.empty(0)}
    return tensors


def pooled_big_file(package: Path, pool: Callable[[Path], int]) -> Path:
    """`big_tensors()` written into the package as weights.safetensors, pooled and configured."""
    source = write_package_file(package, "weights.safetensors", big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    return source


def install_fake(**options: object) -> list[RecordingHostToDevice]:
    """Make the cuda path use recording fakes; the list fills with those it builds."""
    fakes: list[RecordingHostToDevice] = []
    pinned: dict[int, int] = {}

    def make_fake(device: str) -> RecordingHostToDevice:
        fakes.append(RecordingHostToDevice(device, pinned, **options))  # type: ignore[arg-type]
        return fakes[-1]

    weights.set_host_to_device_factory(make_fake)
    return fakes


def load_on_fake_cuda(
    package: Path, pool: Callable[[Path], int], device: str | int = "cuda:1", **options: object
) -> tuple[Path, list[RecordingHostToDevice], dict[str, torch.Tensor]]:
    source = pooled_big_file(package, pool)
    fakes = install_fake(**options)
    return source, fakes, weights.load_file(source, device, chunk_bytes=8192)


def test_cuda_load_stages_every_tensor_through_two_buffers_and_frees_them(
    package: Path, pool: Callable[[Path], int]
) -> None:
    source, fakes, loaded = load_on_fake_cuda(package, pool)

    # The fake ran each transfer late, when waited for: right bytes mean no buffer was filled again
    # before the transfers reading it had ended.
    assert_same(loaded, safetensors_torch.load_file(source))
    [fake] = fakes
    assert fake.events[:2] == ["pin", "pin"] and fake.events[-3:] == ["synchronize", "unpin", "unpin"]
    assert fake.events.count("synchronize") == 1 and fake.events.count("pin") == 2
    assert fake.pinned == {} and fake.pending == []
    stats = weights.last_load_stats()
    assert stats is not None
    assert (stats.pooled, stats.device, stats.tensors) == (True, "cuda:1", len(loaded))
    assert stats.chunks == fake.events.count("mark") > 2  # more windows than buffers: they were reused
    assert fake.events.count("wait") == stats.chunks - 2


def test_a_small_file_gets_staging_buffers_of_its_own_size(package: Path, pool: Callable[[Path], int]) -> None:
    source = write_package_file(package, "weights.safetensors", {"w": torch.arange(10, dtype=torch.float32)})
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    fakes = install_fake()

    loaded = weights.load_file(source, "cuda:0")

    assert_same(loaded, safetensors_torch.load_file(source))
    assert fakes[0].pin_sizes == [PAGE, PAGE]  # 40 bytes of data: a page each, not CHUNK_BYTES


def test_cuda_device_spellings_reach_the_factory(package: Path, pool: Callable[[Path], int]) -> None:
    for device, expected in (("cuda", "cuda"), ("cuda:1", "cuda:1"), (1, "cuda:1"), (0, "cuda:0")):
        _, [fake], _ = load_on_fake_cuda(package, pool, device)
        assert fake.device == expected


def test_a_failed_copy_ends_every_transfer_frees_the_staging_and_reraises(
    package: Path, pool: Callable[[Path], int]
) -> None:
    with pytest.raises(RuntimeError, match="copy failed"):
        load_on_fake_cuda(package, pool, "cuda", fail_on_copy=5)

    [fake] = weights_fakes_made()
    assert fake.events.count("copy") == 5
    assert fake.events[-3:] == ["synchronize", "unpin", "unpin"]
    assert fake.pinned == {} and fake.pending == []


def weights_fakes_made() -> list[RecordingHostToDevice]:
    """The fakes the factory installed by `install_fake` has made so far."""
    factory = weights._state.h2d_factory
    assert factory is not None and factory.__closure__ is not None
    fakes = factory.__closure__[0].cell_contents
    assert isinstance(fakes, list)
    return fakes


def test_a_device_that_cannot_pin_still_gets_the_tensors(package: Path, pool: Callable[[Path], int]) -> None:
    source, [fake], loaded = load_on_fake_cuda(package, pool, "cuda:0", refuse_pin=True)

    assert_same(loaded, safetensors_torch.load_file(source))
    assert "pin" not in fake.events and "unpin" not in fake.events
    assert fake.events.count("copy") >= len([t for t in loaded.values() if t.numel()])


def test_prepared_staging_is_used_by_loads_on_its_device_and_kept_until_released(
    package: Path, pool: Callable[[Path], int]
) -> None:
    source = pooled_big_file(package, pool)
    fakes = install_fake()
    weights.prepare_staging("cuda:1", 8192)
    weights.prepare_staging("cuda:1", 4096)  # already there, and large enough: nothing new
    [preparer] = fakes
    assert preparer.events == ["pin", "pin"]

    first = weights.load_file(source, "cuda:1", chunk_bytes=1 << 20)  # windows of the prepared 8192
    first_stats = weights.last_load_stats()
    second = weights.load_file(source, "cuda:1", chunk_bytes=8192)

    expected = safetensors_torch.load_file(source)
    assert_same(first, expected)
    assert_same(second, expected)
    assert first_stats is not None and first_stats.pin_s == 0 and first_stats.chunks > 2
    assert [f.events.count("pin") for f in fakes] == [2, 0, 0]  # the loads made no buffers of their own
    assert preparer.events == ["pin", "pin"] and len(preparer.pinned) == 2  # kept between loads

    other = weights.load_file(source, "cuda:0", chunk_bytes=8192)  # another device: buffers of its own
    assert_same(other, expected)
    assert fakes[-1].events[:2] == ["pin", "pin"] and fakes[-1].events[-2:] == ["unpin", "unpin"]
    assert len(preparer.pinned) == 2  # the prepared ones only

    weights.release_staging()
    assert preparer.events[-2:] == ["unpin", "unpin"] and preparer.pinned == {}
    weights.release_staging()  # nothing left: a no-op


def test_a_load_running_inside_another_makes_buffers_of_its_own(package: Path, pool: Callable[[Path], int]) -> None:
    """Two loads at once (a handler loading shards from threads) must not fill the same buffers:
    the prepared ones are one load's at a time. Here the second runs from inside the first's copy."""
    source = write_package_file(package, "weights.safetensors", big_tensors())
    other = write_package_file(package, "other.safetensors", {k: v + 1 for k, v in big_tensors().items()})
    weights.configure(str(package), {"weights.safetensors": pool(source), "other.safetensors": pool(other)})
    fakes = install_fake()
    weights.prepare_staging("cuda:1", 8192)
    inner: list[dict[str, torch.Tensor]] = []
    started: list[bool] = []
    copy = RecordingHostToDevice.copy

    def copy_and_load_the_other(self: RecordingHostToDevice, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy(self, dst, src)
        if not started:
            started.append(True)
            inner.append(weights.load_file(other, "cuda:1", chunk_bytes=8192))

    RecordingHostToDevice.copy = copy_and_load_the_other  # type: ignore[method-assign]
    try:
        outer = weights.load_file(source, "cuda:1", chunk_bytes=8192)
    finally:
        RecordingHostToDevice.copy = copy  # type: ignore[method-assign]

    assert_same(outer, safetensors_torch.load_file(source))
    assert_same(inner[0], safetensors_torch.load_file(other))
    assert [f.events.count("pin") for f in fakes] == [2, 0, 2]  # the inner load pinned its own
    assert weights.staging_bytes() == 2 * 8192  # the prepared ones are back for the next load


def test_staging_released_during_a_load_is_freed_when_the_load_ends(package: Path, pool: Callable[[Path], int]) -> None:
    source = pooled_big_file(package, pool)
    fakes = install_fake()
    weights.prepare_staging("cuda:1", 8192)
    released: list[bool] = []
    copy = RecordingHostToDevice.copy

    def copy_and_release(self: RecordingHostToDevice, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy(self, dst, src)
        if not released:
            weights.release_staging()  # the buffers are the load's now: nothing to free yet
            released.append(True)
            assert "unpin" not in fakes[0].events

    RecordingHostToDevice.copy = copy_and_release  # type: ignore[method-assign]
    try:
        loaded = weights.load_file(source, "cuda:1", chunk_bytes=8192)
    finally:
        RecordingHostToDevice.copy = copy  # type: ignore[method-assign]

    assert_same(loaded, safetensors_torch.load_file(source))
    assert fakes[0].events[-2:] == ["unpin", "unpin"] and fakes[0].pinned == {}
    assert weights.staging_bytes() == 0


def test_staging_prepared_for_the_current_device_serves_a_load_on_plain_cuda(
    package: Path, pool: Callable[[Path], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = pooled_big_file(package, pool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    fakes = install_fake()
    weights.prepare_staging("cuda:1", 8192)

    weights.load_file(source, "cuda", chunk_bytes=8192)
    assert [f.events.count("pin") for f in fakes] == [2, 0]

    weights.release_staging()
    weights.prepare_staging("cuda", 8192)  # pinned for device 1, the current one: named so
    assert fakes[-1].device == "cuda:1"
    weights.load_file(source, "cuda:1", chunk_bytes=8192)
    assert [f.events.count("pin") for f in fakes] == [2, 0, 2, 0]


def test_a_file_of_empty_tensors_pins_nothing(package: Path, pool: Callable[[Path], int]) -> None:
    source = write_package_file(package, "weights.safetensors", {"a": torch.empty(0), "b": torch.empty(0, 3)})
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    fakes = install_fake()

    loaded = weights.load_file(source, "cuda:0")

    # (Tensors that share an offset have no file order: safetensors' own varies from run to run.)
    assert_same(dict(sorted(loaded.items())), dict(sorted(safetensors_torch.load_file(source).items())))
    assert fakes[0].events == []


def test_a_chunk_size_below_one_byte_is_refused(package: Path, pool: Callable[[Path], int]) -> None:
    source = pooled_big_file(package, pool)
    install_fake()
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        weights.load_file(source, "cuda:0", chunk_bytes=0)


class UnpinnableBuffers(RecordingHostToDevice):
    def unpin(self, buffer: torch.Tensor) -> None:
        raise RuntimeError("cudaHostUnregister failed")


class SecondPinFails(UnpinnableBuffers):
    """Pins once, then refuses: the buffers it ends up copying from are ordinary memory."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.pending.append((self.enqueued, dst, src))
        self.enqueued += 1
        self.events.append("copy")

    def pin(self, nbytes: int) -> torch.Tensor:
        if self.pin_sizes:
            raise RuntimeError("cudaHostRegister failed: out of memory")
        return super().pin(nbytes)


def test_a_buffer_pinned_before_a_failed_pin_is_kept_if_it_cannot_be_unpinned(
    package: Path, pool: Callable[[Path], int]
) -> None:
    source = pooled_big_file(package, pool)
    pinned: dict[int, int] = {}
    weights.set_host_to_device_factory(lambda device: SecondPinFails(device, pinned))
    kept = len(weights._unfreeable)

    loaded = weights.load_file(source, "cuda:0", chunk_bytes=8192)  # copied unpinned, still right

    assert_same(loaded, safetensors_torch.load_file(source))
    assert len(weights._unfreeable) == kept + 1


def test_buffers_that_cannot_be_unpinned_are_kept_and_the_load_still_succeeds(
    package: Path, pool: Callable[[Path], int]
) -> None:
    source = pooled_big_file(package, pool)
    pinned: dict[int, int] = {}
    weights.set_host_to_device_factory(lambda device: UnpinnableBuffers(device, pinned))
    kept = len(weights._unfreeable)

    loaded = weights.load_file(source, "cuda:0", chunk_bytes=8192)

    assert_same(loaded, safetensors_torch.load_file(source))
    assert len(weights._unfreeable) == kept + 2  # never handed back to the allocator while locked


def test_staging_is_refused_for_a_device_other_than_cuda() -> None:
    with pytest.raises(ValueError, match="cuda device"):
        weights.prepare_staging("cpu")


@pytest.mark.parametrize(
    ("device", "target"),
    [
        ("cpu", "cpu"),
        ("cuda", "cuda"),
        ("cuda:3", "cuda:3"),
        (2, "cuda:2"),
        ("meta", None),
        ("cuda:x", None),
        (-1, None),
    ],
)
def test_target_devices(device: str | int, target: str | None) -> None:
    assert _target_device(device) == target


def entry(begin: int, nbytes: int) -> _Entry:
    return _Entry(f"t{begin}", torch.uint8, (nbytes,), begin, begin + nbytes)


def test_windows_cover_every_tensor_byte_once_in_file_order_and_none_is_too_wide() -> None:
    entries = [entry(0, 0), entry(8, 100), entry(108, 3000), entry(3108, 5000), entry(8108, 20000), entry(28108, 10)]

    windows = _plan_windows(entries, window_bytes=4096)

    assert all(0 < w.end - w.begin <= 4096 for w in windows)
    assert all(a.end <= b.begin for a, b in itertools.pairwise(windows))  # in file order, never overlapping
    pieces = [(e.name, begin, end) for w in windows for e, begin, end in w.pieces]
    assert all(w.begin <= begin < end <= w.end for w in windows for _, begin, end in w.pieces)
    covered: dict[str, list[tuple[int, int]]] = {}
    for name, begin, end in pieces:
        covered.setdefault(name, []).append((begin, end))
    for e in entries[1:]:  # the empty tensor has no bytes to copy
        spans = covered[e.name]
        assert spans[0][0] == e.begin and spans[-1][1] == e.end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous: every byte once
    assert len(covered["t8108"]) == 6  # 20,000 bytes over windows of 4,096 (its first shares one)
    assert [e.begin for e, *_ in windows[0].pieces] == [8, 108, 3108]  # small tensors share a window


# --- on a real GPU (skipped here) ---


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prepared", [False, True])
def test_real_cuda_load_matches_safetensors(package: Path, pool: Callable[[Path], int], prepared: bool) -> None:
    source = write_package_file(package, "weights.safetensors", make_tensors() | big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    if prepared:
        weights.prepare_staging("cuda:0", 8192)
    try:
        loaded = weights.load_file(source, "cuda:0", chunk_bytes=8192)
    finally:
        weights.release_staging()

    assert_same({k: v.cpu() for k, v in loaded.items()}, safetensors_torch.load_file(source))
    assert all(t.device == torch.device("cuda:0") for t in loaded.values())
    stats = weights.last_load_stats()
    assert stats is not None and stats.pooled and stats.chunks > 2
    assert (stats.pin_s == 0) == prepared
