"""Probe: where a cuda miss from the host pool spends its time, and what the alternatives would save.

Two questions, each answered on the device in one run (JSON out):

- copy: a 1 GiB file in /dev/shm (the host pool's tmpfs) onto cuda:0 three ways: pageable (no
  pinning), `gpufaas.weights.load_file` (page-lock the pool's pages chunk by chunk, as workers do
  today), and a bounce copy (`threads` readers `preadv` the file into pinned buffers allocated once,
  each buffer's transfer overlapping the next reads), beside the pinned ceiling.
- first call: ResNet-18 (the template) in fresh processes, stage by stage: CUDA context, the
  handler's import, `load` (the weights' copy, the model's assembly), `warmup`, the first `predict`
  of a real image; with and without priming the process first (cuDNN and cuBLAS handles, the
  kernels of common layers) as a warm spare could, before it knows which model it gets.

Run: `python -m bench.cuda_probe --out bench/results/cuda_probe.json` (needs a CUDA GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.cuda_bench import pinned_bandwidth, pool_copy, prepare
from bench.machine import run_metadata

REPO = Path(__file__).resolve().parent.parent


def bounce_copy(path: Path, threads: int, chunk_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """The file onto cuda:0 through 2 x `threads` pinned buffers of `chunk_bytes` (allocated once:
    `alloc_s`), read with preadv by `threads` threads; each run's GB/s."""
    import torch

    size = path.stat().st_size
    started = time.perf_counter()
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]
    views = [memoryview(b.numpy()) for b in buffers]  # type: ignore[arg-type]  # an ndarray is a buffer
    alloc_s = time.perf_counter() - started
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    runs = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(repeats):
            dst = torch.empty(size, dtype=torch.uint8, device="cuda:0")
            torch.cuda.synchronize()
            offsets = list(range(0, size, chunk_bytes))
            done: list[torch.cuda.Event | None] = [None] * len(buffers)
            started = time.perf_counter()

            def read(index: int, done: list[Any] = done, offsets: list[int] = offsets) -> int:
                slot = index % len(buffers)
                event = done[slot]
                if event is not None:
                    event.synchronize()  # the buffer's last transfer has ended: it may be refilled
                n = min(chunk_bytes, size - offsets[index])
                return os.preadv(fd, [views[slot][:n]], offsets[index])

            with ThreadPoolExecutor(threads) as pool:
                futures = {i: pool.submit(read, i) for i in range(min(len(buffers), len(offsets)))}
                for index, offset in enumerate(offsets):
                    n = futures.pop(index).result()
                    slot = index % len(buffers)
                    with torch.cuda.stream(stream):
                        dst[offset : offset + n].copy_(buffers[slot][:n], non_blocking=True)
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(stream)
                    done[slot] = event
                    if index + len(buffers) < len(offsets):
                        futures[index + len(buffers)] = pool.submit(read, index + len(buffers))
            stream.synchronize()
            seconds = time.perf_counter() - started
            runs.append({"seconds": round(seconds, 4), "gb_s": round(size / seconds / 1e9, 3)})
            del dst
    finally:
        os.close(fd)
    return {"threads": threads, "chunk_mb": chunk_bytes >> 20, "alloc_s": round(alloc_s, 4), "runs": runs}


def pageable_copy(path: Path, repeats: int = 3) -> list[float]:
    import mmap

    import torch

    runs = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        source = torch.frombuffer(mapping, dtype=torch.uint8)
        for _ in range(repeats):
            started = time.perf_counter()
            source.to("cuda:0")
            torch.cuda.synchronize()
            runs.append(round(mapping.size() / (time.perf_counter() - started) / 1e9, 3))
    return runs


FIRST_CALL = r"""
import json, os, sys, time
stages = {}
t = time.perf_counter()
import torch
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
stages["import_torch_and_context"] = time.perf_counter() - t
prime = sys.argv[2]
t = time.perf_counter()
if prime in ("handles", "layers"):
    with torch.inference_mode():
        x = torch.randn(1, 3, 32, 32, device="cuda:0")
        torch.nn.functional.conv2d(x, torch.randn(8, 3, 3, 3, device="cuda:0"), padding=1)
        a = torch.randn(64, 64, device="cuda:0"); (a @ a).sum().item()
if prime == "layers":
    with torch.inference_mode():
        x = torch.randn(1, 3, 224, 224, device="cuda:0")
        c = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False).cuda().eval()
        b = torch.nn.BatchNorm2d(64).cuda().eval()
        y = torch.nn.functional.max_pool2d(torch.relu(b(c(x))), 3, 2, 1)
        y = torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        torch.softmax(torch.nn.functional.linear(y, torch.randn(10, 64, device="cuda:0")), 1).topk(2)
        torch.nn.functional.interpolate(x, size=(112, 112), mode="bilinear", antialias=True)
torch.cuda.synchronize()
stages["prime"] = time.perf_counter() - t
os.chdir(sys.argv[1]); sys.path.insert(0, sys.argv[1])
t = time.perf_counter()
import handler
stages["import_handler"] = time.perf_counter() - t
from safetensors.torch import load_file
t = time.perf_counter()
state = load_file("weights.safetensors", device="cuda:0"); torch.cuda.synchronize()
stages["weights_to_gpu"] = time.perf_counter() - t
del state
t = time.perf_counter()
model = handler.load("cuda:0"); torch.cuda.synchronize()
stages["load"] = time.perf_counter() - t
t = time.perf_counter()
handler.warmup(model)
stages["warmup"] = time.perf_counter() - t
body = open(sys.argv[3], "rb").read()
t = time.perf_counter()
handler.predict(model, body); torch.cuda.synchronize()
stages["first_predict"] = time.perf_counter() - t
t = time.perf_counter()
handler.predict(model, body); torch.cuda.synchronize()
stages["second_predict"] = time.perf_counter() - t
print(json.dumps({k: round(v * 1e3, 2) for k, v in stages.items()}))
"""


def first_calls(directory: Path, body_file: Path, prime: str, repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", FIRST_CALL, str(directory), prime, str(body_file)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "prime": prime,
        "median_ms": {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cuda_probe.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this probe needs one", file=sys.stderr)
        return 1
    report: dict[str, Any] = {"metadata": run_metadata(gpu=torch.cuda.get_device_name(0), torch=torch.__version__)}
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    report["metadata"]["shmem_thp"] = thp.read_text().strip() if thp.exists() else None
    with tempfile.TemporaryDirectory(prefix="gpufaas-cuda-probe-") as tmp:
        work = Path(tmp)
        directory, _, body, _ = prepare("resnet18", work)
        body_file = work / "body.png"
        body_file.write_bytes(body)
        for prime in ("none", "handles", "layers"):
            report.setdefault("first_call", []).append(first_calls(directory, body_file, prime, args.repeats))
            print(json.dumps(report["first_call"][-1]["median_ms"]), prime, flush=True)
        report["pinned"] = pinned_bandwidth("cuda:0")
        report["load_file_register"] = pool_copy("cuda:0", work)
        shm = Path("/dev/shm") / f"gpufaas-probe-{os.getpid()}.bin"
        with open(shm, "wb") as f:
            for _ in range(16):
                f.write(os.urandom(64 << 20))
        try:
            report["pageable_gb_s"] = pageable_copy(shm)
            report["bounce"] = [
                bounce_copy(shm, threads, chunk << 20) for threads in (1, 2, 4, 8) for chunk in (16, 64)
            ]
        finally:
            shm.unlink()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("pinned", "pageable_gb_s")}))
    print("register:", [r["gb_s"] for r in report["load_file_register"]["runs"]])
    for b in report["bounce"]:
        print("bounce", b["threads"], b["chunk_mb"], b["alloc_s"], [r["gb_s"] for r in b["runs"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
