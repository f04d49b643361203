"""How a node's worker processes are started, connected to and stopped: one `Runtime` per way of
running them, chosen once when the worker pool is built (`make_runtime`).

- `ProcessRuntime` (`--runtime process`, gpu_manager.runtimes.process): workers forked from the
  node's zygote (gpu_manager.zygote), which imported the backend's runtime (torch) once; they start
  as warm spares before any model is known, and confine themselves when they take one
  (gpu_manager.sandbox).
- `DockerRuntime` (`--runtime docker`, gpu_manager.runtimes.docker): one container per worker, made
  for a model (its package and weights mounted read-only), so it keeps no spares
  (gpu_manager.containers).

A runtime's `run(worker, model)` starts the process, connects `worker` to it, and returns once it
has exited (`worker.exited` resolved); the worker pool does everything else, and never asks which
runtime it has.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from gpu_manager.containers import DockerLauncher
from gpu_manager.runtimes.base import (
    KILL_WAIT_S,
    SPARE_RETRY_S,
    SPARE_START_TIMEOUT_S,
    STOP_GRACE_S,
    Prepare,
    Runtime,
)
from gpu_manager.runtimes.docker import ContainerEngine, DockerRuntime
from gpu_manager.runtimes.process import ProcessRuntime
from gpu_manager.sandbox import Isolation

__all__ = [
    "KILL_WAIT_S",
    "ContainerEngine",
    "Prepare",
    "RUNTIMES",
    "SPARE_RETRY_S",
    "SPARE_START_TIMEOUT_S",
    "STOP_GRACE_S",
    "DockerRuntime",
    "ProcessRuntime",
    "Runtime",
    "make_runtime",
]

RUNTIMES = (ProcessRuntime.name, DockerRuntime.name)  # forked from the zygote, or in containers


def make_runtime(
    name: str,
    *,
    backend: str,
    gpus: dict[str, int],
    isolation: Isolation,
    max_body_bytes: int,
    closing: Callable[[], bool],
    prepare: Prepare,
    track: Callable[[asyncio.Task[Any]], None],
    python: str = sys.executable,
    launcher: ContainerEngine | None = None,
    node: str = "node",
    spares_per_gpu: int = 0,
) -> Runtime:
    """The runtime called `name` (one of RUNTIMES; ValueError naming them otherwise). What every
    runtime takes: `gpus` (node-local GPU id -> device index), `isolation`, `max_body_bytes` and
    `closing()` (whether the node is shutting down). The process runtime's own: `python`, the
    interpreter its zygote runs. The docker runtime's: `launcher`, its container engine (default:
    the local Docker engine, with the default image), `node` (its containers' label), `prepare(run)` (a container's
    package, user and weights) and `track(task)` (keeps a background signal). `spares_per_gpu`:
    what the pool keeps, which a runtime that makes a worker for a model refuses (ValueError)."""
    common: dict[str, Any] = {
        "backend": backend,
        "gpus": gpus,
        "isolation": isolation,
        "max_body_bytes": max_body_bytes,
        "closing": closing,
    }
    chosen: Runtime
    if name == ProcessRuntime.name:
        chosen = ProcessRuntime(python=python, **common)
    elif name == DockerRuntime.name:
        chosen = DockerRuntime(launcher=launcher or DockerLauncher(), node=node, prepare=prepare, track=track, **common)
    else:
        raise ValueError(f"unknown worker runtime {name!r}; use one of {', '.join(RUNTIMES)}")
    if spares_per_gpu and not chosen.keeps_spares:
        raise ValueError(f"the {name} runtime keeps no spares (a worker is made for a model): use 0 spares")
    return chosen
