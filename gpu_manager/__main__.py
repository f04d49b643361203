"""`python -m gpu_manager`: run one node's GPU manager (cuda, cpu or emulated backend)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from gpu_manager.cgroups import group_prefix
from gpu_manager.daemon import DEFAULT_HOST_CACHE_MB, GpuManagerDaemon
from gpu_manager.devices import Device, discover_nvml, logical_devices
from gpu_manager.drain import drain
from gpu_manager.host_pool import DEFAULT_POOL_PARENT, huge_pages
from gpu_manager.sandbox import PACKAGE_USERS_FILE, Isolation, PackageUsers
from gpu_manager.settings import DESCRIPTION, PROG, NodeSettings
from gpu_manager.storage import StorageOptions
from gpufaas.credentials import node_token, wire_key
from gpufaas.errors import GpufaasError
from gpufaas.keys import Keys
from gpufaas.service_main import (
    daemon_start,
    open_store,
    own_state_dir,
    run_daemon,
    serve_wire_daemon,
    state_dir_held,
    warn_if_insecure,
)

if TYPE_CHECKING:
    from gpufaas.store import EtcdCredentials, EtcdStore
    from gpufaas.tls import LinkTls

log = logging.getLogger("gpu_manager")


class NodeSetupError(GpufaasError):
    """A node that cannot be made as its flags say (its host pool's directory refused, say)."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the node runs on, resolved from its settings and the machine: its backend, its GPUs,
    its host tier's size and how its workers are confined."""

    backend: str
    devices: list[Device]
    host_cache_mb: int
    isolation: Isolation


def hardware(parser: argparse.ArgumentParser, settings: NodeSettings) -> Hardware:
    """The node's backend (cuda if NVML finds GPUs, unless --backend says), its GPUs and its host
    tier; a usage error for a combination the backend cannot run."""
    found = discover_nvml()
    backend = settings.backend or ("cuda" if found else "cpu")
    if backend == "cuda":
        if not found:
            parser.error("--backend cuda: NVML finds no GPU on this machine; use --backend cpu or emulated")
        devices = [dataclasses.replace(d, memory_mb=max(1, d.memory_mb - settings.reserve_mb)) for d in found]
    else:
        devices = logical_devices(
            settings.gpus, settings.gpu_memory_mb, settings.gpu_type or backend, gpus_per_link=settings.gpus_per_link
        )
    host_cache_mb = settings.host_cache_mb
    if host_cache_mb is None:
        host_cache_mb = DEFAULT_HOST_CACHE_MB if backend == "cpu" else 0
    if host_cache_mb and backend != "cpu":
        parser.error(
            f"--host-cache-mb: the host tier is built for the cpu backend only; pass 0 with --backend {backend}"
        )
    # The state directory made passable for workers (other users: they pass through it to their
    # own package, and list nothing).
    own_state_dir(parser, (settings.state_dir, settings.state_dir / "packages"), 0o711)
    return Hardware(backend, devices, host_cache_mb, isolation(settings))


def isolation(settings: NodeSettings) -> Isolation:
    """How workers are confined (the state directory made: `own_state_dir`)."""
    if settings.unconfined_workers:
        return Isolation(network=False, users=False)
    return Isolation(
        package_users=PackageUsers(settings.state_dir / PACKAGE_USERS_FILE),
        homes_dir=settings.state_dir / "homes",
        home_mb=settings.home_mb,
        cgroup_prefix=group_prefix(settings.node, settings.state_dir),
        worker_cpus=settings.worker_cpus or None,
    )


def daemon(
    store: EtcdStore,
    settings: NodeSettings,
    machine: Hardware,
    secret: str | None,
    *,
    tls: LinkTls | bool = True,
    in_process: bool = False,
) -> GpuManagerDaemon:
    """The node `settings` describe (`tls`, `in_process`: GpuManagerDaemon's)."""
    try:
        return GpuManagerDaemon(
            store,
            node=settings.node,
            backend=machine.backend,
            devices=machine.devices,
            state_dir=settings.state_dir,
            keys=Keys(settings.root),
            spares_per_gpu=settings.spares,
            # No spares asked for (the docker runtime): none made ahead either.
            extra_spares=settings.extra_spares if settings.spares else 0,
            max_body_bytes=int(settings.max_payload_mb * 1024 * 1024),
            host_cache_mb=machine.host_cache_mb,
            wire_key=wire_key(secret) if secret is not None else None,
            isolation=machine.isolation,
            runtime=settings.runtime,
            docker_image=settings.docker_image,
            storage=StorageOptions(
                package_token=node_token(secret) if secret is not None else None,
                disk_cache_mb=settings.disk_cache_mb,
                pool_mb=settings.pool_mb,
                pool_dir=settings.pool_dir,
                blob_listen=settings.blob_listen or f"{settings.listen.rpartition(':')[0] or '127.0.0.1'}:0",
                blob_advertise=settings.blob_advertise,
            ),
            tls=tls,
            in_process=in_process,
        )
    except OSError as exc:  # its host pool's directory (--pool-dir): the message says what to change
        raise NodeSetupError(f"node {settings.node} cannot set up its storage: {exc}") from None


async def serve(
    settings: NodeSettings, machine: Hardware, secret: str | None, etcd_creds: EtcdCredentials | None
) -> None:
    """Run the node until SIGTERM or SIGINT, then drain it (gpu_manager.drain) and stop it."""
    store = await open_store(settings.etcd, etcd_creds)
    with state_dir_held(settings.state_dir, "node", f"node {settings.node}"):
        node = daemon(store, settings, machine, secret)
        name = f"gpu manager {settings.node}"
        await serve_wire_daemon(
            node, store, settings, secret, name, drain=lambda: drain(node, settings.drain_timeout_s)
        )


def main(argv: list[str] | None = None) -> int:
    parser, settings, secret, etcd_creds = daemon_start(NodeSettings, PROG, DESCRIPTION, argv)
    warn_if_insecure(settings, f"GPU manager {settings.node}")
    machine = hardware(parser, settings)
    pool_dir = settings.pool_dir or DEFAULT_POOL_PARENT
    if machine.backend == "cuda" and settings.pool_mb != 0 and huge_pages(pool_dir) is False:
        log.info(
            "the host pool (%s) is on a tmpfs of 4 KiB pages: weights reached H200s 1.8-2.2x faster from "
            "one mounted huge=always (--pool-dir; see docs/weights.md, 'Huge pages')",
            pool_dir,
        )
    return run_daemon(lambda: serve(settings, machine, secret, etcd_creds), settings.etcd)


if __name__ == "__main__":
    sys.exit(main())
