"""Model weights at the speed of the hardware: what a 1 GB model costs to deploy, to call first and
to take back from a node's host pool, and what a blob fetch between two nodes sustains, beside the
machine's own copy, hash and loopback speeds measured in the same run.

    python -m bench.weights_bench [--size-mb 1024] [--out bench/results/weights_bench.json]
    python -m bench.weights_bench --baseline d295323   # also the same scenario on an older commit

The scenario (cpu backend, one node with two logical GPUs, a real cluster on loopback): two
functions, each one handler and one safetensors file of `--size-mb` made here (random floats, so
nothing compresses), deployed together with `gpufaas deploy -f stack.yml` as a user would (a fresh
digest cache); then one redeployed with a changed handler; the first call of each once the node
staged them; then misses that take the model back from the node's host pool (the scheduler lets an
idle model leave its GPU after a second, so the next call is a miss). `--baseline COMMIT` runs the
deploy and the first call on that commit too (a git worktree), for the figures side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.machine import REPO, run_metadata
from gpufaas.blobnet import BlobServer, fetch_blob, measure_copy_gb_s
from gpufaas.blobs import BlobStore
from gpufaas.credentials import read_secret
from gpufaas.dev.local_cluster import LocalCluster

GB = 1e9
HANDLER = '''"""An embedding table of {size_mb} MB: a call looks up a few rows (it reads little of the table)."""

VERSION = {version!r}

try:
    from gpufaas.weights import load_file
except ImportError:
    from safetensors.torch import load_file


def load(device):
    return load_file("weights.safetensors", device=device)["table"]


def predict(table, inputs):
    ids = inputs.get("ids", [0, 1, 2]) if isinstance(inputs, dict) else [0, 1, 2]
    return {{"version": VERSION, "sums": table[ids].sum(dim=1).tolist()}}
'''
ROW_FLOATS = 1024
IDLE_RELEASE_S = 1.0  # the scheduler's staged exit: an idle model leaves its GPU after this long


# --- the machine ------------------------------------------------------------------------------------


def prefault(nbytes: int) -> float:
    """Touch `nbytes` of memory the guest may not have had backed, then free it; its speed (GB/s).

    This machine is a virtual machine whose hypervisor backs guest memory on first use, and takes
    back what the guest leaves free for a few seconds: a first write to such memory costs about
    2 s per GB, whatever does it (measured here as `fresh_memory_gb_s`). Touching memory just
    before a step lets that step run at the speed of the software and of backed memory, as on a
    dedicated server."""
    import mmap

    started = time.perf_counter()
    with mmap.mmap(-1, nbytes) as mapped:
        for offset in range(0, nbytes, mmap.PAGESIZE):
            mapped[offset] = 1
    return nbytes / (time.perf_counter() - started) / GB


def machine_figures(size_bytes: int) -> dict[str, float]:
    """Copy, hash and loopback-socket speeds of this machine, each the best of three (GB/s), and
    how fast memory the hypervisor had not backed is touched (see `prefault`)."""
    time.sleep(15)  # long enough for the hypervisor to take back what the guest left free
    fresh = prefault(size_bytes)
    data = bytearray(os.urandom(1 << 20)) * (size_bytes >> 20)
    hashed = []
    for _ in range(3):
        started = time.perf_counter()
        hashlib.sha256(data).digest()
        hashed.append(len(data) / (time.perf_counter() - started) / GB)
    return {
        "fresh_memory_gb_s": round(fresh, 3),
        "copy_gb_s": round(measure_copy_gb_s(size_bytes), 3),
        "sha256_gb_s": round(max(hashed), 3),
        "loopback_gb_s": round(max(_loopback_gb_s(data) for _ in range(3)), 3),
    }


def _loopback_gb_s(data: bytearray) -> float:
    """Bytes through a TCP connection on loopback, sendall -> recv_into, nothing else done with them."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(data)

    thread = threading.Thread(target=send)
    thread.start()
    buffer = memoryview(bytearray(4 << 20))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started = time.perf_counter()
        got = 0
        while got < len(data):
            got += conn.recv_into(buffer)
        seconds = time.perf_counter() - started
    thread.join()
    listener.close()
    return len(data) / seconds / GB


# --- a blob between two nodes ---------------------------------------------------------------------


def blob_fetch(work: Path, size_bytes: int, runs: int = 3) -> dict[str, Any]:
    """A blob from one holder's blob server into another store on loopback, verified on the way
    (what a node does when it stages from a peer): once into memory the hypervisor has to back
    (cold), then `runs` times into prefaulted memory; and the same fetch resumed half way."""
    source = BlobStore(work / "holder")
    data = os.urandom(size_bytes)
    digest = source.put(data)
    del data
    server = BlobServer(source, lambda method, authorization: None)
    url = f"http://{server.start('127.0.0.1:0')}"
    speeds = []
    try:
        for run in range(runs + 1):
            if run == 0:
                time.sleep(15)
            else:
                prefault(2 * size_bytes)
            target = BlobStore(work / f"fetcher{run}")
            started = time.perf_counter()
            fetch_blob(url, digest, size_bytes, target)
            speeds.append(size_bytes / (time.perf_counter() - started) / GB)
            shutil.rmtree(work / f"fetcher{run}")
        resumed = BlobStore(work / "resumed")
        with resumed.writer(digest, size_bytes) as writer, (source.root / "sha256" / digest[7:]).open("rb") as f:
            writer.write(f.read(size_bytes // 2))
        sent_before = server.bytes_sent
        started = time.perf_counter()
        fetch_blob(url, digest, size_bytes, resumed)
        resume_s = time.perf_counter() - started
        resumed_bytes = server.bytes_sent - sent_before
    finally:
        server.stop()
    return {
        "bytes": size_bytes,
        "cold_gb_s": round(speeds[0], 3),
        "gb_s": [round(s, 3) for s in speeds[1:]],
        "median_gb_s": round(statistics.median(speeds[1:]), 3),
        "resumed_half_way": {"bytes_sent": resumed_bytes, "seconds": round(resume_s, 3)},
    }


# --- the cluster ------------------------------------------------------------------------------------


def make_function(directory: Path, size_bytes: int, seed: int) -> None:
    """handler.py and weights.safetensors: one float32 table of `size_bytes`, random (incompressible)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    rows = size_bytes // (4 * ROW_FLOATS)
    save_file({"table": torch.randn(rows, ROW_FLOATS, generator=generator)}, directory / "weights.safetensors")
    write_handler(directory, size_bytes, "1")


def write_handler(directory: Path, size_bytes: int, version: str) -> None:
    (directory / "handler.py").write_text(HANDLER.format(size_mb=size_bytes >> 20, version=version))


def stack(path: Path, url: str, names: list[str], memory_mb: int) -> None:
    import yaml

    functions = {name: {"handler": f"./{name}", "memory_mb": memory_mb, "timeout_s": 120} for name in names}
    document = {"version": 1.0, "provider": {"name": "gpufaas", "gateway": url}, "functions": functions}
    path.write_text(yaml.safe_dump(document))


def gpufaas(work: Path, *args: str, password: str) -> tuple[float, str]:
    """Run the CLI as a user would; its wall time and output."""
    environment = {**os.environ, "GPUFAAS_PASSWORD": password, "XDG_CACHE_HOME": str(work / "cache")}
    started = time.perf_counter()
    argv = [sys.executable, "-m", "gpufaas.cli", *args]
    done = subprocess.run(argv, check=False, cwd=work, env=environment, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"gpufaas {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return seconds, done.stdout + done.stderr


def sent_mb(output: str) -> float | None:
    match = re.search(r"sent ([\d.]+) MB", output)
    return float(match.group(1)) if match else None


def call(client: httpx.Client, name: str) -> dict[str, Any]:
    """One call, as an application makes it (a kept-alive connection): its latency and stages."""
    started = time.perf_counter()
    response = client.post(f"/function/{name}", json={"ids": [1, 2, 3]})
    seconds = time.perf_counter() - started
    response.raise_for_status()
    stages = {}
    for part in filter(None, response.headers.get("server-timing", "").split(", ")):
        stage, _, ms = part.partition(";dur=")
        stages[stage] = float(ms)
    return {
        "seconds": round(seconds, 4),
        "cache": response.headers.get("x-cache"),
        "gpu": response.headers.get("x-gpu"),
        "stages_ms": stages,
    }


def wait_staged(cluster: LocalCluster, names: list[str], password: str, timeout_s: float = 300.0) -> float:
    """Seconds until the node holds every one of `names` on disk and its weights in its pool."""
    started = time.perf_counter()
    with httpx.Client(base_url=cluster.gateway_url, auth=("admin", password), timeout=10) as client:
        while time.perf_counter() - started < timeout_s:
            if all(client.get(f"/system/function/{n}").json().get("pooled_on") for n in names):
                return time.perf_counter() - started
            time.sleep(0.02)
    raise RuntimeError(f"{names} not staged within {timeout_s:g} s")


@contextlib.contextmanager
def cluster_at(work: Path, *, baseline: bool = False) -> Iterator[LocalCluster]:
    flags = ["--host-cache-mb", "0"]
    cluster = LocalCluster(
        work / "cluster", nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=4000, slots="1",
        gpu_idle_release_s=IDLE_RELEASE_S, node_flags=[] if baseline else flags,
    )  # fmt: skip
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def code_of(tree: Path | None) -> Iterator[None]:
    """Daemons and CLI started meanwhile run the code in `tree` (another commit's), if given."""
    if tree is None:
        yield
        return
    # PYTHONSAFEPATH: `python -m` would otherwise put the working directory (this checkout) first.
    before = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYTHONSAFEPATH")}
    os.environ.update(PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def scenario(work: Path, size_bytes: int, misses: int, *, warm: bool, tree: Path | None = None) -> dict[str, Any]:
    """The cluster scenario of the module docstring; with `tree`, on that code (the deploy, the
    first calls and the redeploy only). `warm`: memory prefaulted just before the deploy (see
    `prefault`); else idle first, so the deploy and the staging write to memory the hypervisor
    has to back."""
    names = ["embed-a", "embed-b"]
    for seed, name in enumerate(names):
        make_function(work / name, size_bytes, seed)
    memory_mb = int(size_bytes / 1e6 * 1.3)
    baseline = tree is not None
    out: dict[str, Any] = {}
    with (
        code_of(tree),
        cluster_at(work, baseline=baseline) as cluster,
        httpx.Client(base_url=cluster.gateway_url, headers=cluster.invoke_headers, timeout=300) as client,
    ):
        password = read_secret(cluster.secrets.admin_password)
        stack(work / "stack.yml", cluster.gateway_url, names, memory_mb)
        time.sleep(3 if warm else 15)  # the node's spares warm up (CPU), and for cold: memory goes back
        if warm:
            out["prefault_gb_s"] = round(prefault(6 * size_bytes), 3)
        seconds, output = gpufaas(work, "deploy", "-f", "stack.yml", password=password)
        out["deploy_both_s"] = round(seconds, 3)
        out["deploy_both_sent_mb"] = sent_mb(output)
        if not baseline:
            out["staged_after_deploy_s"] = round(wait_staged(cluster, names, password), 3)
        out["first_calls"] = {name: call(client, name) for name in names}
        write_handler(work / names[0], size_bytes, "2")
        seconds, output = gpufaas(work, "deploy", "-f", "stack.yml", "--filter", names[0], password=password)
        out["redeploy_changed_handler_s"] = round(seconds, 3)
        out["redeploy_changed_handler_sent_mb"] = sent_mb(output)
        out["redeploy_handler_bytes"] = (work / names[0] / "handler.py").stat().st_size
        if baseline:
            return out
        wait_staged(cluster, names[:1], password)
        out["first_call_after_redeploy"] = call(client, names[0])
        calls = [call(client, names[1]) for _ in range(6)]
        hits = [c["seconds"] for c in calls if c["cache"] == "hit"]
        pool_misses = []
        for _ in range(misses):
            time.sleep(IDLE_RELEASE_S + 1.5)  # the model leaves its GPU (its worker stops): the next call misses
            result = call(client, names[1])
            if result["cache"] == "miss":
                pool_misses.append(result)
        out["hit_median_s"] = round(statistics.median(hits), 4) if hits else None
        out["pool_misses"] = pool_misses
        out["pool_miss_median_s"] = (
            round(statistics.median(m["seconds"] for m in pool_misses), 4) if pool_misses else None
        )
    return out


def baseline_tree(work: Path, commit: str) -> Path:
    tree = work / "baseline-tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True, capture_output=True)
    return tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weights_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="each function's weights (default %(default)s)")
    parser.add_argument("--misses", type=int, default=5, help="misses from the host pool to time")
    parser.add_argument("--baseline", default=None, help="a commit to run the same deploy and first call on")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "weights_bench.json")
    args = parser.parse_args(argv)
    size_bytes = args.size_mb << 20
    results: dict[str, Any] = {"meta": run_metadata(), "size_bytes_per_function": size_bytes}
    with tempfile.TemporaryDirectory(prefix="gpufaas-weights-bench-") as tmp:
        work = Path(tmp)
        print("machine ...", flush=True)
        results["machine"] = machine_figures(min(size_bytes, 1 << 30))
        print(results["machine"], flush=True)
        print("blob fetch between two holders ...", flush=True)
        results["blob_fetch"] = blob_fetch(work / "fetch", size_bytes)
        print(results["blob_fetch"], flush=True)
        print("cluster scenario, cold ...", flush=True)
        results["gpufaas_cold"] = scenario(work / "cold", size_bytes, args.misses, warm=False)
        print(json.dumps(results["gpufaas_cold"], indent=1), flush=True)
        print("cluster scenario, prefaulted ...", flush=True)
        results["gpufaas"] = scenario(work / "warm", size_bytes, args.misses, warm=True)
        print(json.dumps(results["gpufaas"], indent=1), flush=True)
        if args.baseline:
            print(f"baseline {args.baseline} ...", flush=True)
            tree = baseline_tree(work, args.baseline)
            try:
                then = scenario(work / "then", size_bytes, 0, warm=True, tree=tree)
                results["baseline"] = {"commit": args.baseline, **then}
            finally:
                remove = ["git", "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, check=False, cwd=REPO, capture_output=True)
            print(json.dumps(results["baseline"], indent=1), flush=True)
    gpufaas_figures = results["gpufaas"]
    copy_s = size_bytes / (results["machine"]["copy_gb_s"] * GB)
    results["checks"] = {
        "deploy_both_s<=4": gpufaas_figures["deploy_both_s"] <= 4.0,
        "redeploy_sends_only_the_handler": (gpufaas_figures["redeploy_changed_handler_sent_mb"] or 0) * 1e6
        <= gpufaas_figures["redeploy_handler_bytes"] + 1e4,
        "first_call_fetch_0": all(c["stages_ms"].get("fetch") == 0.0 for c in gpufaas_figures["first_calls"].values()),
        "first_call_s<=1": all(c["seconds"] <= 1.0 for c in gpufaas_figures["first_calls"].values()),
        "copy_once_s": round(copy_s, 4),
        "pool_miss_over_copy": round(gpufaas_figures["pool_miss_median_s"] / copy_s, 3)
        if gpufaas_figures["pool_miss_median_s"]
        else None,
        "pool_miss<=2x_copy": bool(gpufaas_figures["pool_miss_median_s"])
        and gpufaas_figures["pool_miss_median_s"] <= 2 * copy_s,
        "blob_fetch>=1GB/s": results["blob_fetch"]["median_gb_s"] >= 1.0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["checks"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
