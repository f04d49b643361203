"""The docker runtime (`--runtime docker`): a container per worker, made for its model (its package
and weights mounted read-only), so it keeps no spares (gpu_manager.containers makes them)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from gpu_manager.containers import (
    LAYER_MOUNT,
    PACKAGE_MOUNT,
    POOL_MOUNT,
    SOCKET_NAME,
    ContainerSpec,
    container_environment,
    container_spec,
)
from gpu_manager.runtimes.base import KILL_WAIT_S, SPARE_START_TIMEOUT_S, Prepare, Runtime, log
from gpu_manager.workers import ModelRun, WeightsPlan, Worker
from gpufaas.errors import GpufaasError
from gpufaas.wire import Connection, ConnectionLost


class ContainerEngine(Protocol):
    """What the docker runtime asks of the container engine: gpu_manager.containers'
    DockerLauncher (the Docker engine), or a fake that keeps the same contract."""

    image: str  # the worker image its containers run
    instance: str  # the node instance its containers are labelled with (containers.node_instance)

    async def check(self) -> None:
        """Raise (DockerUnavailable) unless the engine answers and has the image."""

    async def remove_node_containers(self, node: str) -> int:
        """Remove every container a previous run of `node` (of this instance) left behind; how many."""

    async def start(self, spec: ContainerSpec) -> str:
        """Create and start the container `spec` says; its id."""

    async def exited(self, container_id: str) -> str:
        """Wait until the container exits; what it said last (its status and log's tail)."""

    async def kill(self, container_id: str, signum: int) -> None:
        """Send the container's process `signum` (nothing if it is gone)."""

    async def wait_and_remove(self, container_id: str, timeout_s: float) -> int | None:
        """Wait for the container to exit (SIGKILL past `timeout_s`), remove it; its exit status."""

    def over_memory(self, container_id: str) -> bool:
        """Whether the container met its memory limit (and was killed whole)."""

    def close(self) -> None:
        """Stop watching the engine (the node is stopping)."""


class DockerRuntime(Runtime):
    """A container per worker, made for its model by `launcher` (gpu_manager.containers): its
    package, pooled weights and requirements layer mounted read-only, a Unix socket of its own to
    talk on. `prepare(run)` brings the package and says its directory, its user and its weights;
    `track(task)` keeps a background task (a signal sent through the engine)."""

    name = "docker"
    keeps_spares = False

    def __init__(
        self,
        *,
        launcher: ContainerEngine,
        node: str,
        prepare: Prepare,
        track: Callable[[asyncio.Task[Any]], None],
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.launcher = launcher
        self.node = node
        self._prepare = prepare
        self._track = track
        self._sockets: Path | None = None

    async def check(self) -> None:
        """The engine answers and has the image (DockerUnavailable if not), and the containers a
        previous run of this node left are removed."""
        await self.launcher.check()
        removed = await self.launcher.remove_node_containers(self.node)
        if removed:
            log.info("removed %d worker container(s) a previous run of node %s left", removed, self.node)

    def package_dir(self, directory: Path) -> str:
        return PACKAGE_MOUNT

    def worker_view(self, weights: WeightsPlan) -> WeightsPlan:
        return dataclasses.replace(
            weights,
            pooled={path: _pool_mount(host) for path, host in weights.pooled.items()},
            layer_dir=LAYER_MOUNT if weights.layer_dir else "",
        )

    async def confinement(self, worker: Worker, run: ModelRun) -> dict[str, Any]:
        return {"max_file_mb": self.isolation.max_file_mb}  # the container is the rest: user, limits, tmpfs

    def over_memory(self, worker: Worker) -> bool:
        # The engine's oom events, watched by the launcher: a container whose memory limit was met
        # is killed whole (the kernel ends only one of its processes).
        if worker.exit_cause != "over_memory" and worker.container and self.launcher.over_memory(worker.container):
            worker.exit_cause = "over_memory"
        return worker.exit_cause == "over_memory"

    async def shutdown(self) -> None:
        self.launcher.close()
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)

    async def run(self, worker: Worker, model: ModelRun | None) -> None:
        """A container for `model` on `worker.gpu_id`, connected to, and `exited` resolved once it
        is gone and removed, whichever way this ends: a worker whose exit never resolved would
        count as live for good, and the node's shutdown would wait on it."""
        assert model is not None, "the docker runtime starts a worker for a model"
        socket_dir = self._socket_root() / uuid.uuid4().hex[:12]
        try:
            conn = await self._start(worker, model, socket_dir)
            if conn is None:
                return
            worker.conn = conn
            if worker.is_gone:  # let go of while it connected (its signal was sent)
                conn.close()
            await asyncio.shield(conn.closed)
            worker.gone(ConnectionLost(f"worker container {worker.container[:12]} exited"))
        except Exception as exc:  # a bug: said once, with its traceback; the worker ends all the same
            log.exception("the worker container of %s on %s failed", model.model, worker.gpu_id)
            worker.exit_cause = worker.exit_cause or "died"
            worker.gone(ConnectionLost(f"the worker container of {model.model} failed: {exc}"))
            if worker.container:
                await self.launcher.kill(worker.container, signal.SIGKILL)
        finally:
            await self._remove_container(worker, socket_dir)

    async def _start(self, worker: Worker, model: ModelRun, socket_dir: Path) -> Connection | None:
        """`worker`'s container started and connected to; None if it could not be (`worker` then
        gone, a failure said unless it was let go of meanwhile)."""
        listener: socket.socket | None = None
        # A worker killed or stopped (a call's timeout) before its container started reaches no
        # signal: each step after an await looks whether it was let go of meanwhile.
        try:
            try:
                directory, uid, weights = await self._prepare(model)
            except GpufaasError as exc:
                # The package cannot be had (InvalidPackage: deleted; NoRoom: no room on disk): the
                # worker ends with that error, which its load answers (LOAD_FAILED, as on the process
                # runtime), not with a death, which the scheduler would place again.
                worker.exit_cause = worker.exit_cause or "load_failed"
                worker.gone(exc)
                return None
            if worker.is_gone:
                raise RuntimeError("let go of before its container started")
            listener = _listen(socket_dir, uid)
            spec = self._spec(worker, model, socket_dir=socket_dir, directory=directory, uid=uid, weights=weights)
            worker.cgroup_limit_mb = spec.memory_limit_mb  # what an over-memory answer names
            worker.container = await self.launcher.start(spec)
            if worker.is_gone:
                await self.launcher.kill(worker.container, signal.SIGKILL)
                raise RuntimeError("let go of while its container started")
            launcher = self.launcher
            worker.on_signal = lambda signum: self._track(
                asyncio.ensure_future(launcher.kill(worker.container, signum))
            )
            accepted = await self._accept(listener, worker.container)
            max_frame_bytes = self.max_frame_bytes
            _, conn = await asyncio.get_running_loop().create_unix_connection(
                lambda: Connection(worker, max_frame_bytes=max_frame_bytes), sock=accepted
            )
            return conn
        except (OSError, RuntimeError, TimeoutError, GpufaasError, asyncio.CancelledError) as exc:
            if not worker.is_gone:  # else it was let go of: no failure
                self._start_failed(worker, exc, f"a container for {model.model} on {worker.gpu_id}")
            return None
        finally:
            if listener is not None:
                listener.close()  # one worker per socket: nobody else may connect

    def _spec(
        self, worker: Worker, run: ModelRun, *, socket_dir: Path, directory: Path, uid: int, weights: WeightsPlan
    ) -> ContainerSpec:
        """The container of `worker` for `run`: its package, its socket's directory, and its pool
        files and layer at paths of its own (`worker_view`), read-only. Identical files of a package
        are one pool file: mounted once (the engine refuses two mounts at one path)."""
        mounts = [(host, _pool_mount(host)) for host in dict.fromkeys(weights.pooled.values())]
        if weights.layer_dir:
            mounts.append((weights.layer_dir, LAYER_MOUNT))
        return container_spec(
            image=self.launcher.image,
            node=self.node,
            instance=self.launcher.instance,
            worker_id=socket_dir.name,
            backend=self.backend,
            gpu_id=worker.gpu_id,
            gpu_index=self.gpus[worker.gpu_id],
            memory_mb=run.memory_mb,
            uid=uid,
            package_dir=directory,
            socket_dir=socket_dir,
            max_processes=self.isolation.max_processes,
            cpus=self.isolation.worker_cpus,
            environment=container_environment(os.environ),
            read_only_mounts=mounts,
        )

    async def _accept(self, listener: socket.socket, container: str) -> socket.socket:
        """The container's connection on `listener`; RuntimeError if it exits first or does not
        connect within SPARE_START_TIMEOUT_S."""
        accepting = asyncio.ensure_future(asyncio.get_running_loop().sock_accept(listener))
        exiting = asyncio.ensure_future(self.launcher.exited(container))
        try:
            done, _ = await asyncio.wait(
                {accepting, exiting}, timeout=SPARE_START_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            exiting.cancel()
            if not accepting.done():
                accepting.cancel()
        if accepting not in done:
            why = exiting.result() if exiting in done and exiting.exception() is None else "no answer"
            raise RuntimeError(f"the worker container did not connect ({why})")
        accepted, _ = accepting.result()
        return accepted

    async def _remove_container(self, worker: Worker, socket_dir: Path) -> None:
        """`worker`'s container removed (where it got one) and its socket's directory, and its
        `exited` resolved even where the engine would not answer."""
        try:
            if worker.container:
                status = await self.launcher.wait_and_remove(worker.container, KILL_WAIT_S)
                if status not in (None, 0, -signal.SIGKILL, 128 + signal.SIGKILL, 128 + signal.SIGTERM):
                    container = worker.container[:12]
                    log.info("worker container %s (%s) exited with status %s", container, worker.model, status)
        except Exception as exc:  # the engine gone (restarting): the node's next start removes what is left
            log.warning("cannot remove worker container %s: %s", worker.container[:12], exc)
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
            if not worker.exited.done():
                worker.exited.set_result(None)

    def _socket_root(self) -> Path:
        """Where the containers' sockets go: a short path of this pool's own (a Unix socket's path
        may not pass 107 bytes, which a state directory's easily would)."""
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="gpufaas-sockets-"))
            self._sockets.chmod(0o711)
        return self._sockets


def _listen(socket_dir: Path, uid: int) -> socket.socket:
    """A listening Unix socket for one worker in `socket_dir` (made here), owned by `uid` where the
    node is root: the container runs as that user."""
    socket_dir.mkdir(parents=True, mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(socket_dir / SOCKET_NAME))
        listener.listen(1)
        listener.setblocking(False)
        if os.geteuid() == 0:
            os.chown(socket_dir, uid, uid)
            os.chown(socket_dir / SOCKET_NAME, uid, uid)
    except OSError:
        listener.close()
        raise
    return listener


def _pool_mount(host_path: str) -> str:
    """Where a container sees one of the host pool's files (one bind mount each)."""
    return f"{POOL_MOUNT}/{Path(host_path).name}"
