"""gpufaas.weights: pooled safetensors files load as safetensors would, zero-copy on the cpu and
through registered, chunked copies (a recording fake for the CUDA calls) on a cuda device."""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gpufaas import weights  # noqa: E402  (after the importorskips: the module's tests need torch)
from gpufaas.weights import _Entry, _parse_header, _plan_chunks, _target_device  # noqa: E402

PAGE = mmap.PAGESIZE


@pytest.fixture(autouse=True)
def reset_weights() -> Iterator[None]:
    weights.configure(".", {})
    weights.set_host_to_device_factory(None)
    yield
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


# --- cuda: registered, chunked, pipelined copies (through a recording fake) ---


class RecordingHostToDevice:
    """A HostToDevice whose "device" tensors live on the cpu; it logs every call in order and checks
    that each copy reads registered memory."""

    def __init__(self, device: str, fail_on_copy: int | None = None) -> None:
        self.device = device
        self.fail_on_copy = fail_on_copy
        self.events: list[tuple[str, int, int, int]] = []  # (call, address, nbytes, destination's storage)
        self.live: dict[int, int] = {}  # address -> nbytes of live registrations

    def register(self, address: int, nbytes: int) -> None:
        assert all(address >= a + n or address + nbytes <= a for a, n in self.live.items()), "overlap"
        self.live[address] = nbytes
        self.events.append(("register", address, nbytes, 0))

    def unregister(self, address: int) -> None:
        del self.live[address]
        self.events.append(("unregister", address, 0, 0))

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.fail_on_copy is not None and sum(e[0] == "copy" for e in self.events) == self.fail_on_copy:
            raise RuntimeError("copy failed")
        assert dst.dtype == src.dtype == torch.uint8 and dst.numel() == src.numel()
        start, end = src.data_ptr(), src.data_ptr() + src.numel()
        assert any(a <= start and end <= a + n for a, n in self.live.items()), "not within one registration"
        dst.copy_(src)
        self.events.append(("copy", start, end - start, dst.untyped_storage().data_ptr()))

    def synchronize(self) -> None:
        self.events.append(("synchronize", 0, 0, 0))


def big_tensors() -> dict[str, torch.Tensor]:
    """Tensors of several sizes, a few sharing pages, one larger than the chunks of the tests."""
    tensors = {f"layer{i}.weight": torch.full((1000 + 300 * i,), float(i)) for i in range(6)}
    tensors |= {f"layer{i}.bias": torch.arange(i + 1, dtype=torch.float16) for i in range(6)}
    tensors |= {"embedding": torch.randn(9000), "mask": torch.tensor([True, False]), "none": torch.empty(0)}
    return tensors


def install_fake(**options: int) -> list[RecordingHostToDevice]:
    """Make the cuda path use recording fakes; the list fills with those it builds."""
    fakes: list[RecordingHostToDevice] = []

    def make_fake(device: str) -> RecordingHostToDevice:
        fakes.append(RecordingHostToDevice(device, **options))
        return fakes[-1]

    weights.set_host_to_device_factory(make_fake)
    return fakes


def load_on_fake_cuda(
    package: Path, pool: Callable[[Path], int], device: str | int = "cuda:1"
) -> tuple[Path, list[RecordingHostToDevice], dict[str, torch.Tensor]]:
    source = write_package_file(package, "weights.safetensors", big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    fakes = install_fake()
    return source, fakes, weights.load_file(source, device, chunk_bytes=8192)


def test_cuda_load_copies_every_tensor_after_registering_its_pages(package: Path, pool: Callable[[Path], int]) -> None:
    source, fakes, loaded = load_on_fake_cuda(package, pool)

    assert_same(loaded, safetensors_torch.load_file(source))
    [fake] = fakes
    kinds = [kind for kind, *_ in fake.events]
    registers = [(a, n) for kind, a, n, _ in fake.events if kind == "register"]
    synchronized_at = kinds.index("synchronize")
    assert kinds.count("synchronize") == 1
    assert set(kinds[:synchronized_at]) == {"register", "copy"}  # every chunk enqueued before the one wait
    assert kinds[synchronized_at + 1 :] == ["unregister"] * len(registers)
    assert sorted(a for kind, a, *_ in fake.events if kind == "unregister") == sorted(a for a, _ in registers)
    assert fake.live == {}
    assert all(a % PAGE == 0 and n % PAGE == 0 and n > 0 for a, n in registers)
    stats = weights.last_load_stats()
    assert stats is not None
    assert (stats.pooled, stats.device, stats.tensors) == (True, "cuda:1", len(loaded))
    assert stats.chunks > 1 and stats.register_s >= 0 and stats.copy_s >= 0


def test_cuda_load_copies_straddling_tensors_one_registration_at_a_time(
    package: Path, pool: Callable[[Path], int]
) -> None:
    source, [fake], _ = load_on_fake_cuda(package, pool)

    # The fake checked each copy's source lies within one registration; tensors whose first page went
    # with the previous chunk came in two pieces.
    pieces_per_tensor = Counter(destination for kind, *_, destination in fake.events if kind == "copy")
    assert max(pieces_per_tensor.values()) == 2
    with source.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        planned = _plan_chunks(_parse_header(mapping, str(source)), 8192)
    stats = weights.last_load_stats()
    assert stats is not None and stats.chunks == len(planned)


def test_chunks_span_at_most_chunk_bytes_unless_one_tensor_is_larger(package: Path) -> None:
    source = write_package_file(package, "weights.safetensors", big_tensors())
    with source.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        entries = _parse_header(mapping, str(source))

    chunks = _plan_chunks(entries, 8192)

    assert [e.name for c in chunks for e in c.entries] == [e.name for e in entries if e.nbytes]
    spans = [(len(c.entries), max(e.end for e in c.entries) - c.entries[0].begin) for c in chunks]
    assert all(span <= 8192 or count == 1 for count, span in spans)
    assert any(span > 8192 for _, span in spans) and any(count > 1 for count, _ in spans)


def test_cuda_device_spellings_reach_the_factory(package: Path, pool: Callable[[Path], int]) -> None:
    for device, expected in (("cuda", "cuda"), ("cuda:1", "cuda:1"), (1, "cuda:1"), (0, "cuda:0")):
        _, [fake], _ = load_on_fake_cuda(package, pool, device)
        assert fake.device == expected


def test_a_failed_copy_still_unregisters_everything_and_reraises(package: Path, pool: Callable[[Path], int]) -> None:
    source = write_package_file(package, "weights.safetensors", big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    fakes = install_fake(fail_on_copy=5)

    with pytest.raises(RuntimeError, match="copy failed"):
        weights.load_file(source, "cuda", chunk_bytes=8192)

    [fake] = fakes
    kinds = [kind for kind, *_ in fake.events]
    assert kinds.count("register") >= 2 and kinds.count("copy") == 5
    assert kinds[kinds.index("synchronize") + 1 :] == ["unregister"] * kinds.count("register")
    assert fake.live == {}


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


def test_chunk_plan_tiles_pages_without_overlap_and_covers_every_tensor() -> None:
    entries = [entry(0, 0), entry(8, 100), entry(108, 3000), entry(3108, 5000), entry(8108, 20000), entry(28108, 10)]

    chunks = _plan_chunks(entries, chunk_bytes=4096, page_bytes=4096)

    assert [[e.begin for e in c.entries] for c in chunks] == [[8, 108], [3108], [8108], [28108]]
    previous_end = 0
    for chunk in chunks:
        assert chunk.register_begin % 4096 == 0 and chunk.register_end % 4096 == 0
        assert chunk.register_begin >= previous_end
        previous_end = max(previous_end, chunk.register_end)
        assert all(e.end <= previous_end for e in chunk.entries)  # registered by now, by this chunk or earlier
    assert chunks[-1].register_begin == chunks[-1].register_end  # its page was registered with the one before


# --- on a real GPU (skipped here) ---


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_load_matches_safetensors(package: Path, pool: Callable[[Path], int]) -> None:
    source = write_package_file(package, "weights.safetensors", make_tensors() | big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})

    loaded = weights.load_file(source, "cuda:0", chunk_bytes=8192)

    assert_same({k: v.cpu() for k, v in loaded.items()}, safetensors_torch.load_file(source))
    assert all(t.device == torch.device("cuda:0") for t in loaded.values())
    stats = weights.last_load_stats()
    assert stats is not None and stats.pooled and stats.chunks > 1


class UnpinnableHostToDevice(RecordingHostToDevice):
    """A device whose driver refuses read-only registration (the fallback must still load)."""

    def register(self, address: int, nbytes: int) -> None:
        raise RuntimeError("cudaHostRegister failed: operation not supported (cudaError 801)")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.events.append(("copy", src.data_ptr(), src.numel(), 0))


def test_a_device_that_cannot_pin_the_pool_still_gets_the_tensors(package: Path, pool: Callable[[Path], int]) -> None:
    source = write_package_file(package, "weights.safetensors", big_tensors())
    weights.configure(str(package), {"weights.safetensors": pool(source)})
    fakes: list[UnpinnableHostToDevice] = []
    weights.set_host_to_device_factory(lambda device: fakes.append(UnpinnableHostToDevice(device)) or fakes[-1])

    loaded = weights.load_file(source, "cuda:0", chunk_bytes=8192)

    assert_same(loaded, safetensors_torch.load_file(source))
    assert {kind for kind, *_ in fakes[0].events} == {"copy", "synchronize"}  # nothing left registered
