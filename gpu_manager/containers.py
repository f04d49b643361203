"""The `docker` worker runtime: one container per (model, GPU) worker, made through the Docker SDK.

What a worker's container is (`container_spec`, pure) and the few calls that make, signal and
remove one (`DockerLauncher`, I/O; blocking SDK calls run in threads). A container:
- runs the image's Python as the package's own user (never root: without package users, a
  root node's containers run as UNCONFINED_UID), every capability dropped, no new privileges;
- has no network at all (`network_mode=none`): it speaks to its node over a Unix socket in a
  directory of its own, mounted in;
- sees a read-only root filesystem, its package and its socket's directory read-only, and two
  tmpfs mounts of bounded size, /tmp (its HOME) and /dev/shm: all it can write;
- is held to a memory limit from the function's declared memory, a task limit, an equal CPU
  weight (and a CPU quota where the node sets one), and capped logs;
- on `cuda`, gets exactly its GPU by device request.

A container whose memory limit was met is killed whole (`DockerLauncher` watches the engine's
`oom` events): the kernel kills one process at the limit, perhaps a child the worker waits on, and
what is left must not live on as if nothing happened. Containers are labelled with their node and
its instance (`node_instance`: its name, key root and state directory), so that what a crashed node
left behind is removed when it starts again, and nothing of another cluster's node of the same name
on the same engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufaas.errors import GpufaasError

log = logging.getLogger("gpufaas.gpu_manager.containers")

DEFAULT_IMAGE = "gpufaas/worker:latest"  # scripts/worker-image.sh builds it
PACKAGE_MOUNT = "/package"
SOCKET_MOUNT = "/run/gpufaas"
POOL_MOUNT = "/gpufaas/pool"  # the worker's files of the node's host model pool, one mount each
LAYER_MOUNT = "/gpufaas/layer"  # its requirements layer
SOCKET_NAME = "worker.sock"
RUNTIME_MB = 1024  # what the image's Python and torch hold before a model (measured ~250 MiB on cpu)
HOST_HEADROOM_MB = 512
TMPFS_MB = 256
SHM_MB = 64  # /dev/shm: the engine's tmpfs of each container (the engine's default size, said here)
CPU_SHARES = 1024  # every worker container the same CPU weight (cgroup v1 cpu.shares; v2 weight 100)
LOG_MAX_BYTES = "10m"  # docker's json-file log, one file: what a worker may print is capped there
UNCONFINED_UID = 65534  # nobody: a root node's containers without package users (--unconfined-workers)
NODE_LABEL = "gpufaas.node"
INSTANCE_LABEL = "gpufaas.instance"  # which node of which cluster (`node_instance`): what its cleanup removes
OOM_RETRY_S = 1.0  # the engine's event stream broke (a restart, say): wait this long, then watch again
OOM_REMEMBERED = 1024  # the latest containers killed for their memory, kept for `over_memory`


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """Everything `docker run` is told for one worker."""

    image: str
    name: str
    command: list[str]
    user: str
    environment: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # (host path, container path, read only)
    memory_limit_mb: int
    pids_limit: int
    labels: dict[str, str]
    gpu_index: int | None = None  # cuda: the host's device index to hand in
    cpus: float | None = None  # a CPU quota (CPUs' worth of time), or none: the weight alone
    tmpfs_mb: int = TMPFS_MB
    shm_mb: int = SHM_MB
    extra: dict[str, Any] = field(default_factory=dict)

    def run_kwargs(self) -> dict[str, Any]:
        """The Docker SDK's `containers.run` arguments."""
        from docker.types import DeviceRequest, LogConfig, Mount

        kwargs: dict[str, Any] = {
            "image": self.image,
            "name": self.name,
            "command": self.command,
            "user": self.user,
            "environment": self.environment,
            "mounts": [
                Mount(target=target, source=source, type="bind", read_only=read_only)
                for source, target, read_only in self.mounts
            ],
            "network_mode": "none",
            "read_only": True,
            "tmpfs": {"/tmp": f"rw,size={self.tmpfs_mb}m,mode=1777"},
            "shm_size": f"{self.shm_mb}m",
            "mem_limit": f"{self.memory_limit_mb}m",
            "memswap_limit": f"{self.memory_limit_mb}m",  # no swap beyond the limit
            "pids_limit": self.pids_limit,
            "cpu_shares": CPU_SHARES,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "log_config": LogConfig(type="json-file", config={"max-size": LOG_MAX_BYTES, "max-file": "1"}),
            "labels": self.labels,
            "detach": True,
            **self.extra,
        }
        if self.cpus is not None:
            kwargs["nano_cpus"] = int(self.cpus * 1e9)
        if self.gpu_index is not None:
            kwargs["device_requests"] = [DeviceRequest(device_ids=[str(self.gpu_index)], capabilities=[["gpu"]])]
        return kwargs


def container_environment(node_environment: Mapping[str, str]) -> dict[str, str]:
    """What a container takes from its node's environment: the runtime's thread and device
    settings, not the node's paths (the image has its own)."""
    from gpu_manager.sandbox import worker_environment

    host_paths = {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH"}
    return {k: v for k, v in worker_environment(node_environment).items() if k not in host_paths}


def memory_limit_mb(backend: str, memory_mb: int) -> int:
    """The container's memory limit: the runtime's own, plus, on `cpu` (where the model lives in
    host memory), twice the declared memory (a load may hold the file and the tensors), plus a
    margin; on `cuda` the weights pass through host memory once on their way to the GPU."""
    return RUNTIME_MB + 2 * memory_mb + HOST_HEADROOM_MB


def node_instance(node: str, *, root: str, state_dir: Path) -> str:
    """A short name of one node of one cluster on its host, the same each time it starts: its
    name, its etcd key root and its state directory's real path (two nodes never share one). Not
    its etcd endpoint: a local cluster's own etcd takes a free port at each start, and a node
    restarted with it must still find what its previous run left."""
    identity = "\0".join((node, root, str(state_dir.resolve())))
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def container_spec(
    *,
    image: str,
    node: str,
    instance: str,
    worker_id: str,
    backend: str,
    gpu_id: str,
    gpu_index: int,
    memory_mb: int,
    uid: int,
    package_dir: Path,
    socket_dir: Path,
    max_processes: int,
    environment: Mapping[str, str] | None = None,
    read_only_mounts: Sequence[tuple[str, str]] = (),
    cpus: float | None = None,
) -> ContainerSpec:
    """The container of one worker of `node` (see the module's doc), labelled with its `instance`
    (`node_instance`). `environment`: the runtime's settings (threads); the function's own arrives
    with its model, as in the process runtime.
    `read_only_mounts`: (host path, container path) of what else it reads (its weights in the
    host model pool, its requirements layer). `cpus`: a CPU quota (the node's --worker-cpus), or
    None for the equal weight alone. The socket's directory is mounted read-only: connecting to a
    Unix socket needs no writable mount, and a writable one would let the function fill the
    host's disk there. `uid` 0 is refused (ValueError): a worker's container is never root."""
    if uid == 0:
        raise ValueError("a worker container never runs as root (uid 0)")
    return ContainerSpec(
        image=image,
        # The engine takes only [a-zA-Z0-9_.-] in a name (its label keeps the node's as given).
        name=f"gpufaas-{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}-{worker_id}",
        command=[
            "python",
            "-m",
            "gpu_manager.worker",
            "--connect",
            f"{SOCKET_MOUNT}/{SOCKET_NAME}",
            "--backend",
            backend,
            "--gpu-id",
            gpu_id,
            "--device-index",
            "0",  # the one device the container sees
            "--network-isolated",
        ],
        user=f"{uid}:{uid}",
        environment={"HOME": "/tmp", "PYTHONUNBUFFERED": "1", **(environment or {})},
        mounts=[
            (str(package_dir), PACKAGE_MOUNT, True),
            (str(socket_dir), SOCKET_MOUNT, True),
            *((host, inside, True) for host, inside in read_only_mounts),
        ],
        memory_limit_mb=memory_limit_mb(backend, memory_mb),
        pids_limit=max_processes,
        labels={NODE_LABEL: node, INSTANCE_LABEL: instance, "gpufaas.gpu": gpu_id},
        gpu_index=gpu_index if backend == "cuda" else None,
        cpus=cpus,
    )


class DockerUnavailable(GpufaasError):
    """The Docker engine cannot be reached; the message says what to start or install."""


class DockerLauncher:
    """Makes, signals and removes worker containers through the Docker engine (DOCKER_HOST, or
    the local socket), for the node `instance` names (`node_instance`)."""

    def __init__(self, image: str = DEFAULT_IMAGE, instance: str = "") -> None:
        self.image = image
        self.instance = instance
        self._client: Any = None
        # Containers killed for meeting their memory limit (ids, oldest first, at most
        # OOM_REMEMBERED): written by the watcher threads, read by `over_memory`; kept past their
        # removal, since the node may ask after it.
        self._over_memory: dict[str, None] = {}
        self._watched: set[str] = set()  # one `oom` watcher thread per node instance, for good
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._streams: dict[str, Any] = {}  # each watcher's open event stream (by instance), closed by `close`

    def _docker(self) -> Any:
        if self._client is None:
            try:
                import docker

                self._client = docker.from_env()
                self._client.ping()
            except Exception as exc:
                self._client = None
                raise DockerUnavailable(
                    f"the docker runtime needs a Docker engine, and none answers ({exc}); start dockerd, or run "
                    "the GPU manager with --runtime process"
                ) from None
        return self._client

    async def check(self) -> None:
        """Raise DockerUnavailable unless the engine answers and has the image."""

        def check() -> None:
            import docker.errors

            try:
                self._docker().images.get(self.image)
            except docker.errors.ImageNotFound:
                raise DockerUnavailable(
                    f"the worker image {self.image} is not in the Docker engine; build it with "
                    "`bash scripts/worker-image.sh` (or pass --docker-image)"
                ) from None

        await asyncio.to_thread(check)

    def over_memory(self, container_id: str) -> bool:
        """Whether the container met its memory limit (the kernel killed one of its processes),
        and so was killed whole."""
        return container_id in self._over_memory

    def close(self) -> None:
        """Stop watching the engine's events."""
        self._closed.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.close()

    def _watch_memory(self, node: str, instance: str) -> None:
        """Start, once per node instance, the thread that kills whole each container of `node`'s
        `instance` meeting its memory limit (the engine's `oom` event: any process of the container
        killed at its limit)."""
        with self._lock:
            if instance in self._watched:
                return
            self._watched.add(instance)
        args = (node, instance)
        threading.Thread(target=self._watch_events, args=args, name=f"oom-watch-{node}", daemon=True).start()

    def _watch_events(self, node: str, instance: str) -> None:
        since_s = int(time.time()) - 1  # events of a second ago are read again: killing is idempotent
        labels = [f"{NODE_LABEL}={node}", f"{INSTANCE_LABEL}={instance}"]  # both: the engine ANDs them
        filters = {"type": "container", "event": "oom", "label": labels}
        while not self._closed.is_set():
            try:
                stream = self._docker().events(decode=True, since=since_s, filters=filters)
                with self._lock:
                    self._streams[instance] = stream
                if self._closed.is_set():  # closed while it opened
                    break
                for event in stream:
                    since_s = int(event.get("time", since_s))
                    self._kill_over_memory(str(event["id"]))
            except Exception as exc:
                if not self._closed.is_set():
                    log.warning(
                        "watching the engine's oom events for node %s: %s; again in %.0f s", node, exc, OOM_RETRY_S
                    )
            self._closed.wait(OOM_RETRY_S)
        with self._lock, contextlib.suppress(Exception):
            self._streams.pop(instance).close()

    def _kill_over_memory(self, container_id: str) -> None:
        """The container met its memory limit: noted first (the node asks why its worker went as
        soon as the container is killed), then killed."""
        with self._lock:
            if container_id in self._over_memory:
                return  # the engine says `oom` once per process killed
            self._over_memory[container_id] = None
            while len(self._over_memory) > OOM_REMEMBERED:
                del self._over_memory[next(iter(self._over_memory))]
        log.error(
            "worker container %s: its processes went over their memory limit (the kernel killed one); killed whole",
            container_id[:12],
        )
        with contextlib.suppress(Exception):  # gone already
            self._docker().containers.get(container_id).kill()

    async def start(self, spec: ContainerSpec) -> str:
        """Create and start the container; its id. One that was created but would not start is
        removed before the error is raised. From its node's first container on, its node's
        containers that meet their memory limit are killed whole."""

        def start() -> str:
            client = self._docker()
            self._watch_memory(spec.labels[NODE_LABEL], spec.labels[INSTANCE_LABEL])
            try:
                return str(client.containers.run(**spec.run_kwargs()).id)
            except Exception:
                with contextlib.suppress(Exception):
                    client.containers.get(spec.name).remove(force=True)
                raise

        return await asyncio.to_thread(start)

    async def exited(self, container_id: str, poll_s: float = 0.2) -> str:
        """Wait until the container exits (polled: no thread is held while it runs, and the wait
        may be cancelled); what it said last (its status and log's tail)."""

        def state() -> str | None:
            container = self._docker().containers.get(container_id)
            if container.status not in ("exited", "dead"):
                return None
            status = container.attrs["State"]["ExitCode"]
            tail = container.logs(tail=10).decode(errors="replace").strip()
            return f"status {status}" + (f"; its log ends: {tail}" if tail else "; it printed nothing")

        while (said := await asyncio.to_thread(state)) is None:
            await asyncio.sleep(poll_s)
        return said

    async def kill(self, container_id: str, signum: int) -> None:
        def kill() -> None:
            with contextlib.suppress(Exception):  # gone already
                self._docker().containers.get(container_id).kill(signal=signum)

        await asyncio.to_thread(kill)

    async def wait_and_remove(self, container_id: str, timeout_s: float) -> int | None:
        """Wait for the container to exit (SIGKILL past `timeout_s`), remove it; its exit status."""

        def wait() -> int | None:
            import docker.errors

            try:
                container = self._docker().containers.get(container_id)
            except docker.errors.NotFound:
                return None
            status: int | None = None
            try:
                status = int(container.wait(timeout=timeout_s)["StatusCode"])
            except Exception:
                with contextlib.suppress(Exception):
                    container.kill()
            with contextlib.suppress(Exception):
                container.remove(force=True)
            return status

        return await asyncio.to_thread(wait)

    async def remove_node_containers(self, node: str) -> int:
        """Remove every container a previous run of `node` (this launcher's instance of it) left
        behind, and those of `node` made before containers named their instance (an upgrade);
        how many. Another cluster's node of the same name keeps its own."""

        def remove() -> int:
            removed = 0
            # sparse: the listing's own fields, not an inspection of each container (one removed
            # meanwhile would fail the whole listing); its labels are then in attrs["Labels"].
            listed = self._docker().containers.list(all=True, sparse=True, filters={"label": [f"{NODE_LABEL}={node}"]})
            for container in listed:
                if (container.attrs.get("Labels") or {}).get(INSTANCE_LABEL, self.instance) != self.instance:
                    continue  # another cluster's node of this name
                with contextlib.suppress(Exception):
                    container.remove(force=True)
                    removed += 1
            return removed

        return await asyncio.to_thread(remove)
