"""Benchmark: the cuda backend on a real GPU: a miss stage by stage, a hit against calling the same
model directly in torch, and the GPU memory the cache manager is told about.

Two models, from the function templates: `pytorch-image-classifier` (ResNet-18, torchvision's when
installed; one 224 x 224 PNG per call) and `pytorch-custom` (a tiny MLP). Three ways to call each:

- direct: the template's own `load("cuda:0")` and `predict` in this process (the floor: no
  process boundary, no control plane);
- pool: the GPU manager's WorkerPool in this process (zygote, a warm spare with its CUDA context,
  one worker per model, a socket to it): what the node adds;
- cluster: a LocalCluster (etcd, scheduler, gateway, one GPU manager on every GPU NVML finds)
  over HTTP: what the whole system adds, as a client sees it.

And the host model pool (docs/weights.md) on the device:

- pinned: the device's host-to-device bandwidth from pinned memory (the ceiling), and from
  pageable memory, 1 GiB copies;
- pool_copy: `gpufaas.weights.load_file` of a 1 GiB safetensors file in the pool (/dev/shm) onto
  cuda:0, staged through pinned buffers as a worker does it (the buffers made beforehand, as a
  spare makes them while it waits), as a fraction of the pinned bandwidth (goal >= 0.8);
- pool_miss: ResNet-18 through the WorkerPool with the node's host pool: a miss whose weights are
  in the pool (the worker evicted first), with the template's `warmup` (goal <= 100 ms);
- cluster first_call_after_deploy: `gpufaas deploy`'s upload, pre-staging, then the first call
  (goal <= 300 ms).

Needs a CUDA GPU (`python -m bench.cuda_bench` exits with a message without one); `--smoke-cpu`
runs the pool parts on the cpu backend with small sizes (checks the wiring, writes nothing).
Run: `python -m bench.cuda_bench [--out bench/results/cuda_bench.json] [--calls 200] [--pool-dir DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.machine import run_metadata
from gpu_manager.backends import Handler, import_handler
from gpu_manager.devices import Nvml, discover_nvml
from gpu_manager.host_pool import POOL_MIN_FILE_BYTES, huge_pages
from gpu_manager.pool import ModelRun, WorkerPool
from gpu_manager.staging import LocalPackages
from gpufaas.cli import uploads
from gpufaas.cli.client import GatewayClient
from gpufaas.credentials import read_secret
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.packages import DigestCache, build_package
from gpufaas.proto import gpufaas_pb2 as pb
from simulator.engine import percentile

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = {"resnet18": "pytorch-image-classifier", "tiny-mlp": "pytorch-custom"}
DECLARED_MB = {"resnet18": 1400, "tiny-mlp": 600}


def quantiles(values_s: list[float]) -> dict[str, float]:
    ordered = sorted(values_s)
    return {
        "p50_ms": round(percentile(ordered, 50) * 1e3, 3),
        "p90_ms": round(percentile(ordered, 90) * 1e3, 3),
        "calls": len(ordered),
    }


def prepare(name: str, work: Path) -> tuple[Path, bytes, bytes, str]:
    """The template as a function directory (weights written), its package, a request body and
    the body's content type."""
    directory = work / name
    shutil.copytree(REPO / "function_templates" / TEMPLATES[name], directory)
    subprocess.run([sys.executable, "make_weights.py"], cwd=directory, check=True, capture_output=True)
    package = build_package(directory)
    if name == "resnet18":
        from PIL import Image

        image = Image.frombytes("RGB", (224, 224), os.urandom(224 * 224 * 3))
        png = io.BytesIO()
        image.save(png, format="PNG")
        return directory, package, png.getvalue(), "image/png"
    return directory, package, json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}).encode(), "application/json"


def direct(directory: Path, body: bytes, calls: int) -> dict[str, Any]:
    """The template's handler in this process on cuda:0 (inputs decoded as a worker would)."""
    import torch

    from gpu_manager.worker import decode_inputs

    os.environ["GPUFAAS_PACKAGE_DIR"] = str(directory)
    handler = import_handler(str(directory))
    inputs = decode_inputs(body, "image/png" if body[:4] == b"\x89PNG" else "application/json")
    result = time_direct(handler, inputs, calls)
    torch.cuda.empty_cache()  # the model went with time_direct's frame
    return result


def time_direct(handler: Handler, inputs: object, calls: int) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    model = handler.load("cuda:0")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - started

    def once() -> float:
        started = time.perf_counter()
        handler.predict(model, inputs)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    first_s = once()
    for _ in range(10):
        once()
    result: dict[str, Any] = {"load_ms": round(load_s * 1e3, 3), "first_inference_ms": round(first_s * 1e3, 3)}
    return result | quantiles([once() for _ in range(calls)])


async def through_pool(models: dict[str, tuple[Path, bytes, bytes, str]], work: Path, calls: int) -> dict[str, Any]:
    local = LocalPackages(work / "pool-packages")
    digests = {name: local.add_archive(package) for name, (_, package, _, _) in models.items()}
    pool = WorkerPool("cuda", gpus={"gpu0": 0}, fetch_package=local.fetch, spares_per_gpu=1)
    pool.start()
    out: dict[str, Any] = {}
    call_ids = iter(range(10**9))
    try:
        hellos = await pool.spares_ready()
        out["spare"] = {
            "zygote_import_s": round(hellos[0].import_s, 3) if hellos else None,
            "context_ms": round(hellos[0].context_s * 1e3, 3) if hellos else None,
            "context_mb": int(hellos[0].context_mb) if hellos else None,
        }
        for name, (_, _, body, content_type) in models.items():
            await asyncio.sleep(0.5)  # a warm spare again
            run = ModelRun(name, digests[name], DECLARED_MB[name])
            out[name] = await _time_in_pool(pool, run, body, content_type, calls=calls, call_ids=call_ids)
        nvml = Nvml.open()
        if nvml is not None:
            out["nvml_process_mb"] = {
                f"{model}@{gpu}": nvml.process_mb(0, pid) for model, gpu, pid, _ in pool.workers()
            }
            out["nvml_used_mb"] = nvml.used_mb(0)
            nvml.close()
    finally:
        await pool.shutdown()
    return out


async def _time_in_pool(
    pool: WorkerPool, run: ModelRun, body: bytes, content_type: str, *, calls: int, call_ids: Iterator[int]
) -> dict[str, Any]:
    """One model through the pool on gpu0: its miss, stage by stage, then `calls` timed hits
    (after 10 untimed), each call with `body`; call ids from `call_ids`."""

    async def call() -> Any:
        result = await pool.run(run, "gpu0", f"c{next(call_ids)}", body, content_type=content_type, timeout_s=120)
        if result.outcome != pb.OK:
            raise RuntimeError(f"{result.outcome}: {result.message}")
        return result

    started = time.perf_counter()
    miss = await call()
    miss_s = time.perf_counter() - started
    assert miss.loaded and miss.stages is not None
    stages = miss.stages
    hits = []
    for _ in range(10):
        await call()
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        hits.append(time.perf_counter() - started)
    return {
        "miss_ms": round(miss_s * 1e3, 3),
        "miss_stages_ms": {
            "fetch": round(stages.fetch_s * 1e3, 3),
            "prefetch": round(stages.prefetch_s * 1e3, 3),
            "start": round(stages.start_s * 1e3, 3),
            "context": round(stages.context_s * 1e3, 3),
            "load": round(stages.load_s * 1e3, 3),
            "first_inference": round(miss.inference_time_s * 1e3, 3),
            "spare_start": round(stages.spare_start_s * 1e3, 3),
            "spare_context": round(stages.spare_context_s * 1e3, 3),
        },
        "hit": quantiles(hits),
        "declared_memory_mb": DECLARED_MB[run.model],
        "measured_peak_memory_mb": miss.peak_memory_mb,
    }


def pinned_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Host-to-device GB/s from pinned and from pageable memory (best of `repeats`, CUDA events)."""
    import torch

    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for kind, source in (
        ("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(nbytes, dtype=torch.uint8)),
    ):
        source.fill_(1)
        best = float("inf")
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        result[f"{kind}_gb_s"] = round(nbytes / best / 1e9, 3)
        del source
    del target
    torch.cuda.empty_cache()
    return result


def pool_copy(
    device: str, work: Path, nbytes: int = 1 << 30, repeats: int = 3, pool_dir: Path = Path("/dev/shm")
) -> dict[str, Any]:
    """gpufaas.weights.load_file of a safetensors file of about `nbytes` held in the host pool
    (a file in `pool_dir`, as the node keeps it) onto `device`: what a miss from the pool copies."""
    import torch
    from safetensors.torch import save_file

    from gpufaas import weights

    package = work / "pool-copy"
    package.mkdir(parents=True, exist_ok=True)
    layers = 24  # a model's worth of tensors: the copy goes chunk by chunk
    save_file({f"layer{i}": torch.randn(nbytes // 4 // layers) for i in range(layers)}, package / "w.safetensors")
    shm = pool_dir / f"gpufaas-bench-{os.getpid()}.safetensors"
    shutil.copyfile(package / "w.safetensors", shm)
    fd = os.open(shm, os.O_RDONLY)
    runs = []
    try:
        os.chdir(package)
        if device.startswith("cuda"):
            weights.prepare_staging(device)  # as a spare makes them while it waits
        weights.configure(str(package), {"w.safetensors": fd})
        for _ in range(repeats):
            tensors = weights.load_file("w.safetensors", device=device)
            stats = weights.last_load_stats()
            assert stats is not None and stats.pooled
            runs.append(
                {
                    "seconds": round(stats.seconds, 4),
                    "gb_s": round(stats.bytes / stats.seconds / 1e9, 3),
                    "pin_s": round(stats.pin_s, 4),
                    "stage_s": round(stats.stage_s, 4),
                    "copy_s": round(stats.copy_s, 4),
                    "chunks": stats.chunks,
                }
            )
            del tensors
    finally:
        weights.configure(str(package), {})
        weights.release_staging()
        os.close(fd)
        shm.unlink()
        os.chdir(REPO)
    return {"bytes": (package / "w.safetensors").stat().st_size, "runs": runs}


async def pool_miss(
    models: dict[str, tuple[Path, bytes, bytes, str]],
    work: Path,
    backend: str,
    name: str = "resnet18",
    pool_dir: Path = Path("/dev/shm"),
) -> dict[str, Any]:
    """`name` through a WorkerPool wired to a host model pool as a node wires it: the first miss
    copies its weights into the pool, the next misses (the worker evicted between) map them."""
    from gpu_manager.host_pool import HostModelPool
    from gpu_manager.pool import WeightsPlan

    local = LocalPackages(work / f"pool-miss-{backend}")
    digest = local.add_archive(models[name][1])
    host_pool = HostModelPool(pool_dir, 4 << 30, name=f"gpufaas-bench-pool-{os.getpid()}")

    async def prepare_weights(package: str, directory: Path) -> WeightsPlan:
        manifest = local.manifests[package]
        was = host_pool.holds(manifest)
        started = time.perf_counter()
        pooled = await host_pool.admit(manifest, local.blobs) or {}
        return WeightsPlan(pooled, "", 0.0 if was else time.perf_counter() - started, was)

    pool = WorkerPool(
        backend, gpus={"gpu0": 0}, fetch_package=local.fetch, spares_per_gpu=1, prepare_weights=prepare_weights
    )
    pool.start()
    _, _, body, content_type = models[name]
    misses = []
    try:
        await pool.spares_ready()
        run = ModelRun(name, digest, DECLARED_MB[name])
        for index in range(4):
            await asyncio.sleep(1.0)  # a warm spare again
            started = time.perf_counter()
            result = await pool.run(run, "gpu0", f"m{index}", body, content_type=content_type, timeout_s=120)
            seconds = time.perf_counter() - started
            if result.outcome != pb.OK or result.stages is None:
                raise RuntimeError(f"{result.outcome}: {result.message}")
            misses.append(
                {
                    "miss_ms": round(seconds * 1e3, 3),
                    "from_pool": result.stages.from_pool,
                    "pool_ms": round(result.stages.pool_s * 1e3, 3),
                    "load_ms": round(result.stages.load_s * 1e3, 3),
                    "inference_ms": round(result.inference_time_s * 1e3, 3),
                }
            )
            await pool.evict(name, "gpu0")
    finally:
        await pool.shutdown()
        host_pool.close()
    from_pool = [m["miss_ms"] for m in misses if m["from_pool"]]
    return {"misses": misses, "from_pool_median_ms": statistics.median(from_pool) if from_pool else None}


async def timed_hits(
    url: str, name: str, body: bytes, content_type: str, calls: int, *, headers: dict[str, str]
) -> tuple[list[float], list[float]]:
    """`calls` calls one at a time with aiohttp (bench/peer's client library): client latency and
    the gateway's own duration (X-Duration-Seconds) of each."""
    import aiohttp

    hits: list[float] = []
    inside: list[float] = []
    async with aiohttp.ClientSession(url, headers=headers) as session:
        for index in range(calls + 10):
            started = time.perf_counter()
            async with session.post(f"/function/{name}", data=body, headers={"content-type": content_type}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}")
                if index >= 10:  # the first ten warm the connection
                    hits.append(time.perf_counter() - started)
                    inside.append(float(r.headers["x-duration-seconds"]))
    return hits, inside


def through_cluster(models: dict[str, tuple[Path, bytes, bytes, str]], work: Path, calls: int) -> dict[str, Any]:
    gpus = len(discover_nvml())
    cluster = LocalCluster(work / "cluster", nodes=1, gpus_per_node=gpus, backend="cuda", slots="2")
    cluster.start(timeout_s=180)
    out: dict[str, Any] = {}
    try:
        url = cluster.gateway_url
        out["gpus"] = httpx.get(f"{url}/system/gpus", timeout=30, auth=cluster.admin_auth).json()
        gateway = GatewayClient(url, password=read_secret(cluster.secrets.admin_password))
        with httpx.Client(base_url=url, timeout=120, auth=cluster.admin_auth) as client:
            for name, (directory, _, body, content_type) in models.items():
                # As `gpufaas deploy` does it: the blobs the gateway lacks, the manifest, the spec;
                # then the scheduler pre-stages it (disk, host pool) before the first call.
                deployed = time.perf_counter()
                report = uploads.upload(gateway, uploads.scan([(name, directory)], DigestCache(None)))
                (registered,) = report.packages.values()
                spec = {"name": name, "package_digest": registered["digest"], "memory_mb": DECLARED_MB[name]}
                client.post("/system/functions", json=spec).raise_for_status()
                deploy_s = time.perf_counter() - deployed
                # Staged: on the node's disk, and its weights in the host pool where it has any
                # (files under POOL_MIN_FILE_BYTES, the tiny MLP's, are read from disk).
                poolable = any(f.stat().st_size >= POOL_MIN_FILE_BYTES for f in directory.rglob("*") if f.is_file())
                where = "pooled_on" if poolable else "staged_on"
                while not client.get(f"/system/function/{name}").json().get(where):
                    if time.perf_counter() - deployed > 120:
                        raise RuntimeError(f"{name} was not staged within 120 s")
                    time.sleep(0.02)
                staged_s = time.perf_counter() - deployed

                def call(name: str = name, body: bytes = body, content_type: str = content_type) -> httpx.Response:
                    response = client.post(f"/function/{name}", content=body, headers={"content-type": content_type})
                    response.raise_for_status()
                    return response

                started = time.perf_counter()
                miss = call()
                miss_s = time.perf_counter() - started
                hits, inside = asyncio.run(
                    timed_hits(url, name, body, content_type, calls, headers=cluster.invoke_headers)
                )
                out[name] = {
                    "deploy_s": round(deploy_s, 3),
                    "staged_after_s": round(staged_s, 3),
                    "first_call_after_deploy_ms": round(miss_s * 1e3, 3),
                    "miss_ms": round(miss_s * 1e3, 3),
                    "miss_cache": miss.headers["x-cache"],
                    "miss_server_timing": miss.headers.get("server-timing"),
                    "hit": quantiles(hits),
                    "hit_inside_gateway": quantiles(inside),
                }
        out["gpus_after"] = httpx.get(f"{url}/system/gpus", timeout=30, auth=cluster.admin_auth).json()
    finally:
        cluster.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cuda_bench.json")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--smoke-cpu", action="store_true", help="the pool parts on the cpu backend, small")
    parser.add_argument(
        "--pool-dir",
        type=Path,
        default=Path("/dev/shm"),
        help="the memory filesystem the pool parts keep weights on (a tmpfs mounted huge=always, say)",
    )
    args = parser.parse_args(argv)
    if args.smoke_cpu:
        return smoke_cpu()
    devices = discover_nvml()
    if not devices:
        print("no NVIDIA GPU found (NVML): this benchmark needs one", file=sys.stderr)
        return 1
    import torch

    report: dict[str, Any] = {
        "metadata": run_metadata(
            gpu=[f"{d.gpu_id}: {d.gpu_type}, {d.memory_mb} MiB" for d in devices],
            torch=torch.__version__,
            calls=args.calls,
            pool_dir=str(args.pool_dir),
            pool_huge_pages=huge_pages(args.pool_dir),
        )
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _run_parts(report, args.out, args.calls, args.pool_dir)
    summary = _summary(report)
    report["summary"] = summary
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


def _run_parts(report: dict[str, Any], out: Path, calls: int, pool_dir: Path) -> None:
    """Every part of the benchmark in turn, each's figures into `report`, written to `out` as the
    next part starts."""

    def step(what: str) -> None:
        # Each part's figures are kept as soon as they exist: a later part that fails loses none.
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"== {what}", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpufaas-cuda-bench-") as tmp:
        work = Path(tmp)
        models = {name: prepare(name, work) for name in TEMPLATES}
        step("direct")
        report["direct"] = {name: direct(directory, body, calls) for name, (directory, _, body, _) in models.items()}
        step("pinned bandwidth")
        report["pinned"] = pinned_bandwidth("cuda:0")
        step("pool copy")
        report["pool_copy"] = pool_copy("cuda:0", work, pool_dir=pool_dir)
        step("pool miss")
        report["pool_miss"] = asyncio.run(pool_miss(models, work, "cuda", pool_dir=pool_dir))
        step("pool")
        report["pool"] = asyncio.run(through_pool(models, work, calls))
        step("cluster")
        report["cluster"] = through_cluster(models, work, calls)


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a full report: per model, hits and misses on each path; the host
    pool's against their goals."""
    summary = {}
    for name in TEMPLATES:
        direct_p50 = report["direct"][name]["p50_ms"]
        summary[name] = {
            "direct_hit_p50_ms": direct_p50,
            "pool_hit_p50_ms": report["pool"][name]["hit"]["p50_ms"],
            "cluster_hit_p50_ms": report["cluster"][name]["hit"]["p50_ms"],
            "cluster_overhead_p50_ms": round(report["cluster"][name]["hit"]["p50_ms"] - direct_p50, 3),
            "pool_miss_ms": report["pool"][name]["miss_ms"],
            "cluster_miss_ms": report["cluster"][name]["miss_ms"],
        }
    best_copy = max(run["gb_s"] for run in report["pool_copy"]["runs"])
    summary["host_pool"] = {
        "pinned_gb_s": report["pinned"]["pinned_gb_s"],
        "pool_copy_gb_s": best_copy,
        "pool_copy_fraction_of_pinned": round(best_copy / report["pinned"]["pinned_gb_s"], 3),  # goal >= 0.8
        "resnet18_miss_from_pool_ms": report["pool_miss"]["from_pool_median_ms"],  # goal <= 100
        "first_call_after_deploy_ms": {n: report["cluster"][n]["first_call_after_deploy_ms"] for n in TEMPLATES},
    }  # first call goal <= 300 ms
    return summary


def smoke_cpu() -> int:
    """The host-pool parts on the cpu backend (no GPU): the same wiring, small sizes."""
    with tempfile.TemporaryDirectory(prefix="gpufaas-cuda-bench-smoke-") as tmp:
        work = Path(tmp)
        models = {"resnet18": prepare("resnet18", work)}
        print(json.dumps(pool_copy("cpu", work, nbytes=64 << 20, repeats=1)))
        print(json.dumps(asyncio.run(pool_miss(models, work, "cpu"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
