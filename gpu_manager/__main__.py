"""`python -m gpu_manager`: run one node's GPU manager (cuda, cpu or emulated backend)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import sys
from pathlib import Path

from gpu_manager.cgroups import group_prefix
from gpu_manager.containers import DEFAULT_IMAGE
from gpu_manager.daemon import DEFAULT_HOST_CACHE_MB, GpuManagerDaemon
from gpu_manager.devices import discover_nvml, logical_devices
from gpu_manager.sandbox import DEFAULT_HOME_MB, Isolation
from gpu_manager.spares import DEFAULT_MAX_EXTRA
from gpufaas.credentials import node_token, wire_key
from gpufaas.keys import Keys
from gpufaas.metrics import MetricsServer
from gpufaas.service_main import (
    add_common_flags,
    add_metrics_flag,
    cluster_secret,
    configure_logging,
    etcd_credentials,
    open_store,
    run_daemon,
    run_until_signalled,
    start_metrics,
    warn_if_insecure,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_manager", description="gpufaas GPU manager (one per node)")
    add_common_flags(parser)
    add_metrics_flag(parser)
    parser.add_argument("--node", default=socket.gethostname(), help="node name (default: host name)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="address to bind (port 0 = any free)")
    parser.add_argument(
        "--advertise", default=None, help="address gateways and the scheduler dial (default: the listen address)"
    )
    parser.add_argument(
        "--backend",
        choices=["cuda", "cpu", "emulated"],
        default=None,
        help="default: cuda if NVML finds GPUs, else cpu",
    )
    parser.add_argument("--gpus", type=int, default=2, help="logical GPUs for the cpu/emulated backends")
    parser.add_argument("--gpu-memory-mb", type=int, default=8192, help="cache capacity per logical GPU")
    parser.add_argument(
        "--gpus-per-link",
        type=int,
        default=0,
        help="logical GPUs behind each shared host link (PCIe switch), for the scheduler's interference-aware "
        "placement (default 0: a link per GPU; on cuda NVML's topology decides)",
    )
    parser.add_argument(
        "--gpu-type", default=None, help="GPU type reported for logical GPUs (default: the backend name)"
    )
    parser.add_argument(
        "--reserve-mb", type=int, default=1024, help="cuda: memory kept free per GPU (contexts, fragmentation)"
    )
    parser.add_argument("--state-dir", type=Path, required=True, help="the disk cache of packages (and homes)")
    parser.add_argument(
        "--disk-cache-mb",
        type=int,
        default=None,
        help="disk the staged packages' blobs may use, least recently used out first (default: half the free space)",
    )
    parser.add_argument(
        "--pool-mb",
        type=int,
        default=None,
        help="the host model pool: weights kept in shared memory for any GPU of the node to map "
        "(default: half of --pool-dir's free memory; 0: no pool)",
    )
    parser.add_argument(
        "--pool-dir",
        type=Path,
        default=None,
        help="a directory on a memory filesystem where the pool makes its own (default: /dev/shm)",
    )
    parser.add_argument(
        "--blob-listen", default=None, help="where peers fetch this node's blobs (default: the --listen host, any port)"
    )
    parser.add_argument(
        "--blob-advertise", default=None, help="the blob URL peers are told (default: http://the bound address)"
    )
    parser.add_argument(
        "--spares", type=int, default=1, help="warm spare workers per GPU (a miss takes one; 0: start a process)"
    )
    parser.add_argument(
        "--extra-spares",
        type=int,
        default=DEFAULT_MAX_EXTRA,
        help="spares beyond --spares a GPU may keep while misses come faster than spares are made, when the "
        "CPUs are not all busy (not on cuda, where a spare holds GPU memory) (default %(default)s)",
    )
    parser.add_argument(
        "--max-payload-mb", type=float, default=16.0, help="largest payload or result a call may carry (MiB)"
    )
    parser.add_argument(
        "--host-cache-mb",
        type=int,
        default=None,
        help="cpu backend: models evicted from a GPU kept in host memory up to this much, taken back on a "
        f"miss instead of loaded (default {DEFAULT_HOST_CACHE_MB} on cpu; 0: off; other backends: 0)",
    )
    parser.add_argument(
        "--runtime",
        choices=["process", "docker"],
        default="process",
        help="how workers run: processes forked here (confined: docs/security.md) or a Docker container each",
    )
    parser.add_argument(
        "--docker-image", default=DEFAULT_IMAGE, help="the docker runtime's worker image (scripts/worker-image.sh)"
    )
    parser.add_argument(
        "--home-mb",
        type=int,
        default=DEFAULT_HOME_MB,
        help="what a package's workers on this node may write in all (HOME, /tmp, /var/tmp, /dev/shm: one tmpfs "
        "per package, removed when its last worker stops; as root) (default %(default)s)",
    )
    parser.add_argument(
        "--worker-cpus",
        type=float,
        default=0.0,
        help="CPUs' worth of time each worker's cgroup may use, all its threads and children together "
        "(default %(default)s; 0: no quota, only an equal CPU weight per worker)",
    )
    parser.add_argument(
        "--unconfined-workers",
        action="store_true",
        help="workers keep the node's user and network (development only; see docs/security.md)",
    )
    args = parser.parse_args(argv)
    secret = cluster_secret(parser, args)
    etcd_creds = etcd_credentials(parser, args)
    configure_logging(args.log_level)
    warn_if_insecure(args, f"GPU manager {args.node}")

    found = discover_nvml()
    backend = args.backend or ("cuda" if found else "cpu")
    if backend == "cuda":
        if not found:
            parser.error("--backend cuda: NVML finds no GPU on this machine; use --backend cpu or emulated")
        devices = [dataclasses.replace(d, memory_mb=max(1, d.memory_mb - args.reserve_mb)) for d in found]
    else:
        if args.gpus <= 0 or args.gpu_memory_mb <= 0:
            parser.error("--gpus and --gpu-memory-mb must be positive")
        if args.gpus_per_link < 0:
            parser.error("--gpus-per-link must be >= 0")
        devices = logical_devices(
            args.gpus, args.gpu_memory_mb, args.gpu_type or backend, gpus_per_link=args.gpus_per_link
        )
    if (args.disk_cache_mb is not None and args.disk_cache_mb < 1) or (args.pool_mb is not None and args.pool_mb < 0):
        parser.error("--disk-cache-mb must be >= 1 and --pool-mb >= 0")
    if args.spares < 0 or args.extra_spares < 0 or args.max_payload_mb <= 0:
        parser.error("--spares and --extra-spares must be >= 0 and --max-payload-mb positive")
    if not args.spares:
        args.extra_spares = 0  # no spares asked for (the docker runtime): none made ahead either
    if args.runtime == "docker" and args.spares:
        parser.error("--runtime docker keeps no warm spares (a container is made for its model): pass --spares 0")
    host_cache_mb = (
        args.host_cache_mb if args.host_cache_mb is not None else (DEFAULT_HOST_CACHE_MB if backend == "cpu" else 0)
    )
    if host_cache_mb < 0 or (host_cache_mb and backend != "cpu"):
        parser.error(
            f"--host-cache-mb: the host tier is built for the cpu backend only; pass 0 with --backend {backend}"
        )

    # Workers (other users) pass through the state directory to their own package, and list nothing.
    for directory in (args.state_dir, args.state_dir / "packages"):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o711)
    if args.worker_cpus < 0 or args.home_mb < 1:
        parser.error("--worker-cpus must be >= 0 and --home-mb >= 1")
    isolation = (
        Isolation(network=False, users=False)
        if args.unconfined_workers
        else Isolation(
            homes_dir=args.state_dir / "homes",
            home_mb=args.home_mb,
            cgroup_prefix=group_prefix(args.node, args.state_dir),
            worker_cpus=args.worker_cpus or None,
        )
    )

    async def run() -> None:
        store = await open_store(args.etcd, etcd_creds)
        daemon = GpuManagerDaemon(
            store,
            node=args.node,
            backend=backend,
            devices=devices,
            state_dir=args.state_dir,
            disk_cache_mb=args.disk_cache_mb,
            pool_mb=args.pool_mb,
            pool_dir=args.pool_dir,
            blob_listen=args.blob_listen or f"{args.listen.rpartition(':')[0] or '127.0.0.1'}:0",
            blob_advertise=args.blob_advertise,
            keys=Keys(args.root),
            spares_per_gpu=args.spares,
            extra_spares=args.extra_spares,
            max_body_bytes=int(args.max_payload_mb * 1024 * 1024),
            host_cache_mb=host_cache_mb,
            wire_key=wire_key(secret) if secret is not None else None,
            package_token=node_token(secret) if secret is not None else None,
            isolation=isolation,
            runtime=args.runtime,
            docker_image=args.docker_image,
        )

        metrics: list[MetricsServer] = []

        async def start() -> None:
            await daemon.start(args.listen, advertise=args.advertise)
            server = await start_metrics(daemon.metrics.registry, args.metrics_listen, secret)
            metrics.extend([server] if server is not None else [])
            print(f"gpu manager {args.node} listening on {daemon.address}", flush=True)

        async def stop() -> None:
            for server in metrics:
                await server.close()
            await daemon.stop()
            await store.close()

        await run_until_signalled(start, stop)

    return run_daemon(run, args.etcd)


if __name__ == "__main__":
    sys.exit(main())
