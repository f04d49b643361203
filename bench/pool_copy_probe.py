"""Benchmark: ways to move a pooled weight file (a tmpfs file) onto a cuda device, side by side.

Until 2026-11-28 `gpufaas.weights.load_file` page-locked the pool's copy chunk by chunk
(cudaHostRegister) and copied from it: on an H200 10-16 GB/s against the 55 GB/s the device copies
from pinned memory, nearly all of it the page-locking. This probe measured what else could carry
the same bytes (its first results, `bench/results/pool_copy_probe_h200_20261128*.json`, name that
path `register`), and `load_file` now stages through pinned buffers, as `bounce_copy` below does.
Each on the same 1 GiB file, best and median of `--repeats`:

- load_file: `gpufaas.weights.load_file` as a worker runs it (its staging buffers made for each
  load: a spare makes them beforehand), the file on /dev/shm (4 KiB pages);
- load_file_prepared: the same with the buffers made beforehand (`prepare_staging`);
- load_file_huge, load_file_huge_prepared: the same two with the file on a tmpfs mounted
  `huge=always` (`--huge-dir`, made by the caller; root may mount one): 2 MiB pages, 512 times
  fewer faults;
- bounce_copy: no registration. Two pinned staging buffers, allocated before the clock starts (a
  warm spare could hold them), filled from the file's mapping by torch's multithreaded copy, each
  sent on a side stream while the other fills;
- bounce_pread: the same, filled with `os.preadv` from the file by `--threads` threads (no mapping:
  no page faults in this process; the kernel copies from its page cache).

Also the one-off cost of allocating the staging buffers, and the pinned ceiling (torch pinned ->
device). Needs a CUDA GPU; `--smoke-cpu` runs the bounce paths' logic on the cpu (no pinning,
small), to check them where there is none.
Run: `python -m bench.pool_copy_probe [--out bench/results/pool_copy_probe.json] [--huge-dir DIR]`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import run_metadata

REPO = Path(__file__).resolve().parents[1]
STAGE_BYTES = 64 << 20
LAYERS = 24


def _write_file(directory: Path, nbytes: int) -> Path:
    import torch
    from safetensors.torch import save_file

    path = directory / f"gpufaas-probe-{os.getpid()}.safetensors"
    save_file({f"layer{i}": torch.randn(nbytes // 4 // LAYERS) for i in range(LAYERS)}, str(path))
    return path


def _timed(run: Callable[[], Any], repeats: int) -> dict[str, Any]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return {
        "best_s": round(min(seconds), 4),
        "median_s": round(statistics.median(seconds), 4),
        "runs_s": [round(s, 4) for s in seconds],
    }


def _with_rate(result: dict[str, Any], nbytes: int) -> dict[str, Any]:
    result["best_gb_s"] = round(nbytes / result["best_s"] / 1e9, 3)
    result["median_gb_s"] = round(nbytes / result["median_s"] / 1e9, 3)
    return result


def load_file_path(path: Path, device: str, repeats: int, *, prepared: bool = False) -> dict[str, Any]:
    """`gpufaas.weights.load_file` of a pooled file at `path` (its pin, stage and copy seconds too);
    `prepared`: with staging buffers made beforehand (`prepare_staging`), as a spare has them."""
    from gpufaas import weights

    fd = os.open(path, os.O_RDONLY)
    stats: list[Any] = []
    try:
        if prepared:
            weights.prepare_staging(device)
        weights.configure(str(path.parent), {path.name: fd})

        def run() -> None:
            tensors = weights.load_file(str(path), device=device)
            stats.append(weights.last_load_stats())
            del tensors

        result = _timed(run, repeats)
    finally:
        weights.configure(str(path.parent), {})
        weights.release_staging()
        os.close(fd)
    result["pin_s"] = [round(s.pin_s, 4) for s in stats]
    result["stage_s"] = [round(s.stage_s, 4) for s in stats]
    result["copy_s"] = [round(s.copy_s, 4) for s in stats]
    return result


class Bounce:
    """Two staging buffers (pinned on cuda) and a side stream: `copy(fill, dst, nbytes)` fills one
    buffer with `fill(buffer, offset, n)` while the other's transfer runs."""

    def __init__(self, device: str, stage_bytes: int = STAGE_BYTES) -> None:
        import torch

        self.device = device
        self.cuda = device.startswith("cuda")
        started = time.perf_counter()
        self.stages = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        for stage in self.stages:
            stage[::4096].fill_(0)  # touched: a spare would have them resident
        self.alloc_s = time.perf_counter() - started
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]

    def copy(self, fill: Callable[[Any, int, int], None], dst: Any, nbytes: int) -> None:
        import torch

        stage_bytes = self.stages[0].numel()
        done: list[Any] = [None, None]
        for i, offset in enumerate(range(0, nbytes, stage_bytes)):
            b, n = i % 2, min(stage_bytes, nbytes - offset)
            if done[b] is not None:
                done[b].synchronize()  # the transfer that read this buffer has ended
            fill(self.stages[b], offset, n)
            if self.stream is None:
                dst[offset : offset + n].copy_(self.stages[b][:n])
                continue
            with torch.cuda.stream(self.stream):
                dst[offset : offset + n].copy_(self.stages[b][:n], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
                done[b] = event
        if self.stream is not None:
            self.stream.synchronize()


def _same_bytes(path: Path, dst: Any) -> bool:
    """Whether the device's copy holds the file's bytes (checked once, outside the clock)."""
    import torch

    return bool(torch.equal(dst.cpu(), torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)))


def bounce_copy(path: Path, device: str, repeats: int, bounce: Bounce, *, populate: bool = False) -> dict[str, Any]:
    """Staging buffers filled from the file's mapping by torch's copy (`populate`: the mapping made
    with MAP_POPULATE, its page tables filled in one pass instead of a fault per page)."""
    import torch

    nbytes = path.stat().st_size
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def run() -> None:
        with open(path, "rb") as f:
            if populate:
                flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
                mapping = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            else:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(mapping, dtype=torch.uint8)

            def fill(stage: Any, offset: int, n: int) -> None:
                stage[:n].copy_(whole[offset : offset + n])

            bounce.copy(fill, dst, nbytes)
        finally:
            mapping.close()

    result = _timed(run, repeats)
    result["same_bytes"] = _same_bytes(path, dst)
    return result


def bounce_pread(path: Path, device: str, repeats: int, bounce: Bounce, threads: int) -> dict[str, Any]:
    """Staging buffers filled by `threads` threads of `os.preadv` straight from the file."""
    import torch

    nbytes = path.stat().st_size
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    views = [memoryview(stage.numpy()) for stage in bounce.stages]  # type: ignore[arg-type]

    def run() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:

            def fill(stage: Any, offset: int, n: int) -> None:
                view = views[0] if stage.data_ptr() == bounce.stages[0].data_ptr() else views[1]
                piece = -(-n // threads)
                parts = [(s, min(piece, n - s)) for s in range(0, n, piece)]

                def read(part: tuple[int, int]) -> None:
                    start, length = part
                    got = 0
                    while got < length:
                        r = os.preadv(fd, [view[start + got : start + length]], offset + start + got)
                        if r <= 0:
                            raise OSError(f"short read at {offset + start + got}")
                        got += r

                list(pool.map(read, parts))

            bounce.copy(fill, dst, nbytes)
        finally:
            os.close(fd)

    try:
        result = _timed(run, repeats)
    finally:
        pool.shutdown()
    result["same_bytes"] = _same_bytes(path, dst)
    return result


def pinned_ceiling(device: str, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return round(nbytes / best / 1e9, 3)


def probe(
    device: str, *, nbytes: int, repeats: int, threads: int, huge_dir: Path | None, stage_bytes: int = STAGE_BYTES
) -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {
        "bytes": nbytes,
        "torch_threads": torch.get_num_threads(),
        "pread_threads": threads,
        "stage_bytes": stage_bytes,
    }
    cuda = device.startswith("cuda")
    if cuda:
        report["pinned_gb_s"] = pinned_ceiling(device, nbytes)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = _write_file(shm, nbytes)
    try:
        size = path.stat().st_size
        if cuda:
            report["load_file"] = _with_rate(load_file_path(path, device, repeats), size)
            report["load_file_prepared"] = _with_rate(load_file_path(path, device, repeats, prepared=True), size)
        bounce = Bounce(device, stage_bytes)
        report["staging_alloc_s"] = round(bounce.alloc_s, 4)
        report["bounce_copy"] = _with_rate(bounce_copy(path, device, repeats, bounce), size)
        report["bounce_copy_populate"] = _with_rate(bounce_copy(path, device, repeats, bounce, populate=True), size)
        report["bounce_pread"] = _with_rate(bounce_pread(path, device, repeats, bounce, threads), size)
    finally:
        path.unlink()
    if huge_dir is not None and cuda:
        huge = _write_file(huge_dir, nbytes)
        try:
            report["load_file_huge"] = _with_rate(load_file_path(huge, device, repeats), size)
            report["load_file_huge_prepared"] = _with_rate(load_file_path(huge, device, repeats, prepared=True), size)
            report["bounce_copy_huge"] = _with_rate(bounce_copy(huge, device, repeats, bounce), size)
            report["bounce_pread_huge"] = _with_rate(bounce_pread(huge, device, repeats, bounce, threads), size)
        finally:
            huge.unlink()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/pool_copy_probe.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8, help="preadv threads filling a staging buffer")
    parser.add_argument("--stage-mb", type=int, default=STAGE_BYTES >> 20, help="each staging buffer's size")
    parser.add_argument("--huge-dir", type=Path, help="a directory on a tmpfs mounted huge=always")
    parser.add_argument("--smoke-cpu", action="store_true", help="the bounce paths on the cpu, 64 MiB, nothing written")
    args = parser.parse_args(argv)
    if args.smoke_cpu:
        print(
            json.dumps(
                probe(
                    "cpu",
                    nbytes=64 << 20,
                    repeats=2,
                    threads=args.threads,
                    huge_dir=None,
                    stage_bytes=args.stage_mb << 20,
                ),
                indent=2,
            )
        )
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this probe needs one (try --smoke-cpu)", file=sys.stderr)
        return 1
    report = {
        "metadata": run_metadata(gpu=[torch.cuda.get_device_name(0)], torch=torch.__version__),
        "probe": probe(
            "cuda:0",
            nbytes=1 << 30,
            repeats=args.repeats,
            threads=args.threads,
            huge_dir=args.huge_dir,
            stage_bytes=args.stage_mb << 20,
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["probe"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
