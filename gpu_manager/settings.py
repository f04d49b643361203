"""A node's settings, declared once: `python -m gpu_manager`'s flags and environment
(GPUFAAS_NODE_*), and what the local cluster passes it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from gpu_manager.containers import DEFAULT_IMAGE
from gpu_manager.drain import DEFAULT_DRAIN_TIMEOUT_S
from gpu_manager.sandbox import DEFAULT_HOME_MB
from gpu_manager.spares import DEFAULT_MAX_EXTRA
from gpufaas.settings import MetricsSettings, host_and_port

PROG = "python -m gpu_manager"
DESCRIPTION = "gpufaas GPU manager (one per node)"


class NodeSettings(MetricsSettings):
    """Everything `python -m gpu_manager` takes."""

    model_config = SettingsConfigDict(env_prefix="GPUFAAS_NODE_")

    node: str = Field(default_factory=socket.gethostname, description="node name (default: host name)")
    listen: str = Field(default="127.0.0.1:0", description="address to bind (port 0 = any free)")
    advertise: str | None = Field(
        default=None, description="address gateways and the scheduler dial (default: the listen address)"
    )
    backend: Literal["cuda", "cpu", "emulated"] | None = Field(
        default=None, description="default: cuda if NVML finds GPUs, else cpu"
    )
    gpus: int = Field(default=2, gt=0, description="logical GPUs for the cpu/emulated backends")
    gpu_memory_mb: int = Field(default=8192, gt=0, description="cache capacity per logical GPU")
    gpus_per_link: int = Field(
        default=0,
        ge=0,
        description="logical GPUs behind each shared host link (PCIe switch), for the scheduler's "
        "interference-aware placement (0: a link per GPU; on cuda NVML's topology decides)",
    )
    gpu_type: str | None = Field(
        default=None, description="GPU type reported for logical GPUs (default: the backend name)"
    )
    reserve_mb: int = Field(default=1024, ge=0, description="cuda: memory kept free per GPU (contexts, fragmentation)")
    state_dir: Path = Field(description="the disk cache of packages (and homes)")
    disk_cache_mb: int | None = Field(
        default=None,
        ge=1,
        description="disk the staged packages' blobs may use, least recently used out first "
        "(default: half the free space)",
    )
    pool_mb: int | None = Field(
        default=None,
        ge=0,
        description="the host model pool: weights kept in shared memory for any GPU of the node to map "
        "(default: half of --pool-dir's free memory; 0: no pool)",
    )
    pool_dir: Path | None = Field(
        default=None, description="a directory on a memory filesystem where the pool makes its own (default: /dev/shm)"
    )
    blob_listen: str | None = Field(
        default=None, description="where peers fetch this node's blobs (default: the --listen host, any port)"
    )
    blob_advertise: str | None = Field(
        default=None, description="the blob URL peers are told (default: http://the bound address)"
    )
    spares: int = Field(
        default=1, ge=0, description="warm spare workers per GPU (a miss takes one; 0: start a process)"
    )
    extra_spares: int = Field(
        default=DEFAULT_MAX_EXTRA,
        ge=0,
        description="spares beyond --spares a GPU may keep while misses come faster than spares are made, when "
        "the CPUs are not all busy (not on cuda, where a spare holds GPU memory)",
    )
    max_payload_mb: float = Field(
        default=16.0, gt=0, allow_inf_nan=False, description="largest payload or result a call may carry (MiB)"
    )
    host_cache_mb: int | None = Field(
        default=None,
        ge=0,
        description="cpu backend: models evicted from a GPU kept in host memory up to this much, taken back on "
        "a miss instead of loaded (default: the node's own on cpu; 0: off; other backends: 0)",
    )
    runtime: Literal["process", "docker"] = Field(
        default="process",
        description="how workers run: processes forked here (confined: docs/security.md) or a Docker container each",
    )
    docker_image: str = Field(
        default=DEFAULT_IMAGE, description="the docker runtime's worker image (scripts/worker-image.sh)"
    )
    home_mb: int = Field(
        default=DEFAULT_HOME_MB,
        ge=1,
        description="what a package's workers on this node may write in all (HOME, /tmp, /var/tmp, /dev/shm: one "
        "tmpfs per package, removed when its last worker stops; as root)",
    )
    worker_cpus: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="CPUs' worth of time each worker's cgroup may use, all its threads and children together "
        "(0: no quota, only an equal CPU weight per worker)",
    )
    drain_timeout_s: float = Field(
        default=DEFAULT_DRAIN_TIMEOUT_S,
        ge=0,
        allow_inf_nan=False,
        description="on SIGTERM/SIGINT, how long the node may drain: it takes no new calls and stops once those "
        "placed on it have ended, or when this passes (0: stop at once; a second signal stops at once too). "
        "Keep it below Kubernetes' terminationGracePeriodSeconds",
    )
    unconfined_workers: bool = Field(
        default=False, description="workers keep the node's user and network (development only; see docs/security.md)"
    )

    @field_validator("node")
    @classmethod
    def _node_is_a_key_segment(cls, node: str) -> str:
        # The node's etcd keys are named after it (gpufaas.keys): refused here, not at registration.
        if not node or "/" in node or not node.isprintable():
            raise ValueError(f"a node name must be non-empty, printable and without '/', got {node!r}")
        return node

    @field_validator("listen", "blob_listen", "advertise")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        return host_and_port(address)

    @model_validator(mode="after")
    def _docker_keeps_no_spares(self) -> NodeSettings:
        if self.runtime == "docker" and self.spares:
            raise ValueError(
                "--runtime docker keeps no warm spares (a container is made for its model): pass --spares 0"
            )
        return self
