"""Benchmark: gpufaas beside Ray Serve and a bare FastAPI floor, same client, same workload, one run.

The workload a multi-model inference service sees: 8 tiny torch models (m0..m7) with a Zipf 1.1
popularity, on 2 "GPUs" (gpufaas: 2 logical cpu GPUs of 300 MB, each holding 3 models of 100 MB;
Ray: 2 replicas with `@serve.multiplexed(max_num_models_per_replica=3)`), closed-loop clients at
concurrency 1, 8 and 32 (bench/peer/load_client.py for every system). gpufaas runs as a user
runs it: `gpufaas up` (cpu backend, its defaults), eight functions from the pytorch-custom
template (`gpufaas new`, `gpufaas deploy`), invoked at /function/m{i}. Also measured: gpufaas with
its daemons' links in plain (`gpufaas up --no-tls`: what TLS costs), gpufaas with every model
resident (hits only), gpufaas with the scheduler and the node each in a process of its own
(`gpufaas up --scheduler-apart --node-apart`; with one gateway and one node both run in the
gateway's by default), Ray Serve's default proxy and its HAProxy mode, and a bare FastAPI echo
(one uvicorn worker): the floor of any Python HTTP service on this machine.

Reloads per request: gpufaas counts misses from its X-Cache header; Ray, model loads reported by
its replicas (GET /mux) before and after each point.

Ray runs in a virtualenv of its own (`--ray-env`, created when missing: `ray[serve]`,
`torch==2.13.0`, fastapi, uvicorn, aiohttp, uvloop from PyPI, about a minute).

Run: `python -m bench.peer_bench [--out bench/results/peer_bench.json] [--duration 10]
[--systems gpufaas,gpufaas-apart,gpufaas-plain,gpufaas-hits,ray-default,ray-haproxy,fastapi]`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.machine import run_metadata
from gpufaas.credentials import SecretFiles, read_secret
from gpufaas.dev.etcd_server import free_port
from gpufaas.processes import descendants

HERE = Path(__file__).resolve().parent
PEER = HERE / "peer"
REPO = HERE.parent
CONCURRENCY = (1, 8, 32)
NUM_MODELS = 8
ZIPF = 1.1
SYSTEMS = ("gpufaas", "gpufaas-apart", "gpufaas-plain", "gpufaas-hits", "ray-default", "ray-haproxy", "fastapi")
RAY_REQUIREMENTS = ("ray[serve]", "torch==2.13.0", "fastapi", "uvicorn", "aiohttp", "uvloop")
TARGETS = {
    "c32_rps_min": 1000.0,
    "c32_reload_ratio_max": 0.15,
    "hits_c1_p50_ms_max": 1.5,
    "goal_c32_rps": 2900.0,
    "goal_c1_p50_ms": 1.0,
}


def load(
    url: str,
    concurrency: int,
    args: argparse.Namespace,
    *extra: str,
    num_models: int = NUM_MODELS,
    zipf: float = ZIPF,
) -> dict[str, Any]:
    """One point of the closed-loop client (this Python, which has aiohttp and uvloop): models
    m0..m{num_models-1}, Zipf `zipf` popularity."""
    command = [
        sys.executable,
        str(PEER / "load_client.py"),
        url,
        "-c",
        str(concurrency),
        "-d",
        str(args.duration),
        "--warmup",
        str(args.warmup),
        "--num-models",
        str(num_models),
        "--zipf",
        str(zipf),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=args.duration * 4 + 120)
    print("  " + done.stderr.strip().splitlines()[-1], flush=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# --- gpufaas --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningCluster:
    url: str  # the gateway's
    invoke_token: str
    state_dir: Path  # `gpufaas up`'s: cluster.json, pids.json, logs, secrets


@contextmanager
def gpufaas_cluster(
    work: Path, *, gpu_memory_mb: int, functions: int = NUM_MODELS, model_memory_mb: int = 100, up: tuple[str, ...] = ()
) -> Iterator[RunningCluster]:
    """A local cluster as a user starts it (`gpufaas up`: 1 node, 2 cpu GPUs of `gpu_memory_mb`,
    its defaults, `up` added), with `functions` functions m0..m{functions-1} of the pytorch-custom
    template deployed at `model_memory_mb` each, each with weights of its own (the template's
    `make_weights`, seeded by its index: per-customer variants of one model); `gpufaas down` after."""
    gpufaas = [str(Path(sys.executable).parent / "gpufaas")]  # the CLI, as a user runs it
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = work / f"state-{gpu_memory_mb}-{functions}"
    directory = work / f"functions-{gpu_memory_mb}-{functions}"

    def cli(*argv: str) -> None:
        # GPUFAAS_STATE_DIR: the CLI finds this cluster's admin password there (as after `gpufaas up`).
        env = {**os.environ, "GPUFAAS_STATE_DIR": str(state)}
        subprocess.run([*gpufaas, *argv], check=True, capture_output=True, text=True, cwd=work, env=env)

    cli(
        "up",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--backend",
        "cpu",
        "--gpu-memory-mb",
        str(gpu_memory_mb),
        "--port",
        str(port),
        "--state-dir",
        str(state),
        *up,
    )
    try:
        cli("new", "m0", "--template", "pytorch-custom", "--dir", str(directory))
        stack = directory / "stack.yml"
        add_variants(directory, functions)
        stack.write_text(re.sub(r"(?m)^(\s*memory_mb:).*$", rf"\1 {model_memory_mb}", stack.read_text()))
        cli("deploy", "-f", str(stack), "--gateway", url)
        # Calls carry the invoke token, as an application's would (the functions are not public).
        yield RunningCluster(url, read_secret(SecretFiles(state / "secrets").invoke_token), state)
    finally:
        subprocess.run([*gpufaas, "down", "--state-dir", str(state)], check=False, capture_output=True)


def add_variants(directory: Path, functions: int) -> None:
    """m1..m{functions-1} beside `gpufaas new`'s m0 in `directory`: its handler, weights of their
    own (written as the template's make_weights.py writes them, seeded by index), entries in
    stack.yml alike m0's. (What `gpufaas new` does per function, without starting Python 200 times.)"""
    import yaml
    from safetensors.torch import save_file

    first = directory / "m0"
    sys.path.insert(0, str(first))
    try:
        make_weights = importlib.import_module("make_weights")  # the template's own
    finally:
        sys.path.remove(str(first))
    stack_path = directory / "stack.yml"
    stack = yaml.safe_load(stack_path.read_text())
    for index in range(1, functions):
        name = f"m{index}"
        shutil.copytree(first, directory / name, ignore=shutil.ignore_patterns("weights.safetensors", "__pycache__"))
        save_file(make_weights.random_state_dict(index), str(directory / name / "weights.safetensors"))
        stack["functions"][name] = {**stack["functions"]["m0"], "handler": f"./{name}"}
    stack_path.write_text(yaml.safe_dump(stack, sort_keys=False))


def count_misses(point: dict[str, Any]) -> dict[str, Any]:
    """The model loads of a gpufaas point, from its X-Cache counts."""
    misses = point.get("header_counts", {}).get("X-Cache", {}).get("miss", 0)
    point["model_loads"] = misses
    point["reload_ratio"] = round(misses / max(1, point["requests"]), 4)
    return point


def run_gpufaas(
    args: argparse.Namespace, work: Path, *, gpu_memory_mb: int, up: tuple[str, ...] = ()
) -> dict[str, Any]:
    body = work / "x.json"
    body.write_text(json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]}))
    results = {}
    # 100 MB each: 3 models fit on a 300 MB logical GPU.
    with gpufaas_cluster(work, gpu_memory_mb=gpu_memory_mb, up=up) as cluster:
        for concurrency in CONCURRENCY:
            point = gpufaas_load(cluster, concurrency, args, body, f"gpufaas ({gpu_memory_mb} MB GPUs)")
            results[f"c{concurrency}"] = count_misses(point)
    return results


def gpufaas_load(
    cluster: RunningCluster, concurrency: int, args: argparse.Namespace, body: Path, label: str, **workload: Any
) -> dict[str, Any]:
    """One point of `load` against the cluster's gateway: each call posts `body` to its model's
    function with the invoke token, and the X-Cache answers (hit or miss) are counted."""
    return load(
        f"{cluster.url}/function/{{model}}",
        concurrency,
        args,
        "--body-file",
        str(body),
        "--count-header",
        "X-Cache",
        "-H",
        f"Authorization: Bearer {cluster.invoke_token}",
        "--label",
        label,
        **workload,
    )


# --- Ray Serve and the bare floor -----------------------------------------------------------


def ray_python(args: argparse.Namespace) -> Path:
    python: Path = args.ray_env / "bin" / "python"
    if not python.exists():
        print(f"creating {args.ray_env} ({', '.join(RAY_REQUIREMENTS)})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(args.ray_env)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *RAY_REQUIREMENTS], check=True)
    return python


def signal_pids(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


@contextmanager
def server(command: list[str], env: dict[str, str], ready_url: str, log: Path, **ready: Any) -> Iterator[int]:
    """Start a server, wait until `ready_url` answers 2xx, stop it and everything it started (by
    PID) after. A server that does not come up is an error quoting the end of its log."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=PEER, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{' '.join(command[1:3])} did not come up (status {process.poll()}):\n{tail}")
            try:
                if httpx.post(ready_url, timeout=5, **ready).is_success:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield process.pid
    finally:
        family = descendants(process.pid)
        signal_pids([process.pid], signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            signal_pids([process.pid], signal.SIGKILL)
            process.wait()
        family += [pid for pid in descendants(os.getpid()) if pid not in family]
        signal_pids(family, signal.SIGTERM)
        time.sleep(2)
        signal_pids(family, signal.SIGKILL)


def replica_loads(url: str) -> dict[int, int]:
    """Model loads per Ray replica, asking GET /mux until both replicas have answered."""
    loads: dict[int, int] = {}
    for _ in range(32):
        stats = httpx.get(url, timeout=10).json()
        loads[int(stats["replica_pid"])] = int(stats["model_loads"])
    return loads


@contextmanager
def ray_serve(args: argparse.Namespace, work: Path, variant: str, *, models_per_replica: int = 3) -> Iterator[str]:
    """Ray Serve's app (bench/peer/ray_serve_app.py) in `variant` ("default" or "haproxy"), its
    2 mux replicas keeping `models_per_replica` models each; yields the URL of /mux."""
    python = ray_python(args)
    port = free_port()
    env = {
        **os.environ,
        "RAY_AUTH_TOKEN_PATH": str(work / "ray_auth_token"),
        "MUX_MODELS_PER_REPLICA": str(models_per_replica),
    }
    (work / "ray_auth_token").write_text(os.urandom(32).hex())
    if variant == "haproxy":
        env |= {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    url = f"http://127.0.0.1:{port}/mux"
    command = [str(python), "ray_serve_app.py", "--port", str(port)]
    ready = {"content": ray_body(work).read_bytes(), "headers": {"serve_multiplexed_model_id": "m0"}}
    with server(command, env, url, work / f"ray-{variant}.log", **ready):
        yield url


def ray_body(work: Path) -> Path:
    body = work / "x16.json"
    body.write_text(json.dumps({"x": [0.1 * i for i in range(16)]}))
    return body


def ray_point(
    url: str, concurrency: int, args: argparse.Namespace, work: Path, label: str, **workload: Any
) -> dict[str, Any]:
    """One point against Ray's /mux, with the model loads its replicas report over its measured
    phase: the warm-up runs apart, before the replicas' counts are read (one load-client run would
    count the warm-up's loads against the measured requests; gpufaas's X-Cache counts are the
    measured requests' only)."""
    extra = ("--body-file", str(ray_body(work)), "--label", label)
    if args.warmup > 0:
        load(url, concurrency, argparse.Namespace(duration=args.warmup, warmup=0.0), *extra, **workload)
    before = replica_loads(url)
    point = load(url, concurrency, argparse.Namespace(duration=args.duration, warmup=0.0), *extra, **workload)
    point["warmup_s"] = args.warmup
    after = replica_loads(url)
    point["model_loads"] = sum(n - before.get(pid, 0) for pid, n in after.items())
    point["reload_ratio"] = round(point["model_loads"] / max(1, point["requests"]), 4)
    point["replicas_seen"] = len(after)
    return point


def run_ray(args: argparse.Namespace, work: Path, variant: str) -> dict[str, Any]:
    with ray_serve(args, work, variant) as url:
        return {f"c{c}": ray_point(url, c, args, work, f"ray-{variant}") for c in CONCURRENCY}


def run_fastapi(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    python = ray_python(args)
    port = free_port()
    command = [
        str(python),
        "-m",
        "uvicorn",
        "fastapi_echo:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--no-access-log",
    ]
    url = f"http://127.0.0.1:{port}/echo"
    with server(command, dict(os.environ), url, work / "fastapi.log", content=b"{}"):
        return {f"c{c}": load(url, c, args, "--body", "{}", "--label", "bare fastapi") for c in CONCURRENCY}


# --- the report -----------------------------------------------------------------------------


def throughput_ratio(ours: dict[str, Any], theirs: dict[str, Any], digits: int = 2) -> float | None:
    """Our point's throughput over theirs (rounded to `digits`), or None where theirs answered no
    call (0 or no throughput): a peer that failed every call has no ratio, and must not cost the
    report."""
    mine, peer = ours["throughput_rps"], theirs["throughput_rps"]
    return round(mine / peer, digits) if mine is not None and peer else None


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked against this run. A point with no successful call (no
    throughput, no p50) fails its target instead of raising: the verdict is computed once every
    system ran, and an exception here lost the whole run's results."""
    out: dict[str, Any] = {"targets": TARGETS}
    ours = results.get("gpufaas")
    if ours:
        c32 = ours["c32"]
        out["c32_at_least_1000_rps_no_errors_reload_le_0_15"] = (
            (c32["throughput_rps"] or 0.0) >= TARGETS["c32_rps_min"]
            and c32["errors"] == 0
            and c32["reload_ratio"] <= TARGETS["c32_reload_ratio_max"]
        )
        ray = results.get("ray-default")
        if ray:
            out["ahead_of_ray_default_at_every_concurrency"] = all(
                (ours[c]["throughput_rps"] or 0.0) > (ray[c]["throughput_rps"] or 0.0) for c in ours
            )
            out["ratio_to_ray_default"] = {c: throughput_ratio(ours[c], ray[c]) for c in ours}
    haproxy = results.get("ray-haproxy")
    for system, key in (("gpufaas", "ratio_to_ray_haproxy"), ("gpufaas-apart", "apart_ratio_to_ray_haproxy")):
        runs = results.get(system)
        if runs and haproxy:
            out[key] = {c: throughput_ratio(runs[c], haproxy[c]) for c in runs}
    hits = results.get("gpufaas-hits")
    if hits:
        p50_ms = hits["c1"]["p50_ms"]
        out["hits_c1_p50_le_1_5_ms"] = p50_ms is not None and p50_ms <= TARGETS["hits_c1_p50_ms_max"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, out_name="peer_bench.json", duration_s=10.0, systems=SYSTEMS)
    args, systems = parse_systems(parser, argv, SYSTEMS)

    def run_system(system: str, work: Path) -> dict[str, Any]:
        if system == "gpufaas":
            return run_gpufaas(args, work, gpu_memory_mb=300)
        if system == "gpufaas-plain":  # what TLS on the daemons' links costs: the same, links in plain
            (work / "plain").mkdir(exist_ok=True)  # a cluster and functions of its own beside gpufaas's
            return run_gpufaas(args, work / "plain", gpu_memory_mb=300, up=("--no-tls",))
        if system == "gpufaas-apart":  # the scheduler and the node each in a process of its own
            (work / "apart").mkdir(exist_ok=True)
            return run_gpufaas(args, work / "apart", gpu_memory_mb=300, up=("--scheduler-apart", "--node-apart"))
        if system == "gpufaas-hits":
            return run_gpufaas(args, work, gpu_memory_mb=1000)
        if system.startswith("ray-"):
            return run_ray(args, work, system.removeprefix("ray-"))
        return run_fastapi(args, work)

    return run_and_report(
        args,
        systems,
        run_system,
        prefix="gpufaas-peer-bench-",
        point_label="c",
        verdict=verdict,
        workload=f"{NUM_MODELS} models, Zipf {ZIPF}, 2 GPUs x 3 models, concurrency {list(CONCURRENCY)}",
    )


# --- shared with bench/density_bench.py ---------------------------------------------------


def bench_parser(
    doc: str | None, *, out_name: str, duration_s: float, systems: Sequence[str], default_systems: str | None = None
) -> argparse.ArgumentParser:
    """The options of a benchmark against its peers: --out (bench/results/`out_name`),
    --duration and --warmup of each point, --systems (a comma list of `systems`, all of them by
    default) and Ray's --ray-env; the caller adds its own before `parse_systems`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results" / out_name)
    parser.add_argument("--duration", type=float, default=duration_s, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="unrecorded seconds before each point")
    parser.add_argument(
        "--systems",
        default=",".join(systems) if default_systems is None else default_systems,
        help=f"a comma list of {', '.join(systems)}",
    )
    parser.add_argument(
        "--ray-env", type=Path, default=Path.home() / ".cache/gpufaas-peer-bench/rayenv", help="Ray's virtualenv"
    )
    return parser


def parse_systems(
    parser: argparse.ArgumentParser, argv: list[str] | None, systems: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """The parsed arguments and the systems --systems names; a usage error for an unknown one."""
    args = parser.parse_args(argv)
    chosen = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(chosen) - set(systems))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(systems)}")
    return args, chosen


def run_and_report(
    args: argparse.Namespace,
    systems: list[str],
    run: Callable[[str, Path], dict[str, Any]],
    *,
    prefix: str,
    point_label: str,
    verdict: Callable[[dict[str, Any]], dict[str, Any]],
    **metadata: Any,
) -> int:
    """`run_systems`, then the report (`metadata` beside the run's own) written by `write_report`.
    Returns the exit status: 1 (the failures said on stderr too) where a system failed, else 0."""
    started = time.monotonic()
    results, failures = run_systems(systems, run, prefix=prefix)
    report = {
        "metadata": run_metadata(
            duration_s=args.duration,
            warmup_s=args.warmup,
            wall_s=round(time.monotonic() - started, 1),
            **metadata,
            client="bench/peer/load_client.py (closed loop, aiohttp + uvloop), same host",
        ),
        "results": results,
        "failures": failures,
        "verdict": verdict(results),
    }
    write_report(args.out, report, point_label=point_label)
    if failures:  # recorded in the report, and said where a script running the benchmark sees it
        for system, error in failures.items():
            print(f"{system} failed: {error}", file=sys.stderr)
        print(f"{len(failures)} of {len(systems)} systems failed (the report: {args.out})", file=sys.stderr)
        return 1
    return 0


def run_systems(
    systems: list[str], run: Callable[[str, Path], dict[str, Any]], *, prefix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """`run(system, work)` for each system in turn, in one temporary directory: (results by system,
    failures by system); a system that fails is reported and the next one runs."""
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for system in systems:
            print(f"== {system}", flush=True)
            try:
                results[system] = run(system, Path(tmp))
            except (RuntimeError, subprocess.SubprocessError, httpx.HTTPError, OSError) as exc:
                print(f"  {system} failed: {exc}", flush=True)
                failures[system] = str(exc)
    return results, failures


def write_report(out: Path, report: dict[str, Any], *, point_label: str) -> None:
    """Write `report` (metadata, results by system and point, failures, verdict) as JSON to `out`
    and print its table (`point_label` heads the column of point names, "c" or "N") and verdict. A
    point with no successful call has None for its throughput and latencies: printed as such."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    header = f"{'system':<14} {point_label:>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>9} {'errors':>6} {'loads/req':>9}"
    print(f"\n{header}")
    for system, points in report["results"].items():
        for name, point in points.items():
            print(
                f"{system:<14} {name[1:]:>4} {point['throughput_rps']!s:>9} {point['p50_ms']!s:>8} "
                f"{point['p99_ms']!s:>9} {point['errors']:>6} {point.get('reload_ratio', '-')!s:>9}"
            )
    print(json.dumps(report["verdict"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
