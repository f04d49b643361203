"""Views of the cluster as the scheduler sees it (GPUs, LRU lists, queues, recent evictions), and
the overview that the dashboard and `gpufaas top` show."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from gateway.router import CallFailed
from gateway.routes.deps import GatewayDep
from gateway.state import ApiError, Gateway
from gpufaas.proto import gpufaas_pb2 as pb

router = APIRouter()

OVERVIEW_QUEUE_CALLS = 20  # the oldest queued calls the overview lists
OVERVIEW_EVICTIONS = 20


async def _cluster(gateway: Gateway, *, queue_limit: int = 0) -> pb.ClusterReply:
    try:
        return await gateway.router.cluster(queue_limit=queue_limit)
    except CallFailed as exc:
        raise ApiError(exc.status, exc.message) from None


def _gpu(g: pb.GpuInfo, *, running: str = "call ids") -> dict[str, Any]:
    """A GPU's JSON form; `running` lists the running calls' ids, or their models ("models")."""
    return {
        "gpu": g.gpu,
        "node": g.node,
        "gpu_type": g.gpu_type,
        "status": g.status,
        "memory_used_mb": g.memory_used_mb,
        "memory_capacity_mb": g.memory_capacity_mb,
        "lru": list(g.lru),
        "local_queue": g.local_queue,
        "slots": g.slots,
        "running": list(g.running_models if running == "models" else g.running),
        "host_tier": list(g.host_tier),
    }


@router.get("/system/gpus")
async def gpus(gateway: GatewayDep) -> list[dict[str, Any]]:
    """Every GPU: memory, LRU list (most recent first), local queue, calls running, host tier."""
    return [_gpu(g) for g in (await _cluster(gateway)).gpus]


@router.get("/system/queue")
async def queue(gateway: GatewayDep) -> dict[str, Any]:
    """The global queue (oldest first)."""
    reply = await _cluster(gateway)
    return {
        "policy": reply.policy,
        "capacity": reply.queue_capacity,
        "length": len(reply.queue),
        "calls": [
            {"call_id": c.call_id, "function": c.function, "model": c.model, "waited_s": c.waited_s}
            for c in reply.queue
        ],
    }


@router.get("/system/overview")
async def overview(gateway: GatewayDep) -> dict[str, Any]:
    """The cluster at a glance (what the dashboard at /ui and `gpufaas top` show): GPUs, the global
    queue (length and its oldest calls), every function with its calls by cache result and its
    latency percentiles at this gateway (since it started; over its last 1,024 calls), and the
    recent evictions (most recent first), and the scheduler that leads (its name, address and
    epoch)."""
    # Only the calls it lists: it is polled every second, and the whole queue costs the
    # scheduler's loop O(calls queued) at each poll (10,000 at its default capacity).
    reply = await _cluster(gateway, queue_limit=OVERVIEW_QUEUE_CALLS)
    now_unix_s = time.time()
    replicas: dict[str, int] = {}
    for g in reply.gpus:
        for model in g.lru:
            replicas[model] = replicas.get(model, 0) + 1
    gateway.stats.forget(set(gateway.functions))
    functions = [
        {"name": spec.name, "model": spec.model, "replicas": replicas.get(spec.model, 0), **gateway.stats.summary(name)}
        for name, spec in sorted(gateway.functions.items())
    ]
    return {
        "time_unix_s": now_unix_s,
        "scheduler_leader": {
            "name": reply.scheduler,
            "address": gateway.router.scheduler_address,
            "epoch": reply.epoch,
        },
        "policy": reply.policy,
        "gpus": [_gpu(g, running="models") for g in reply.gpus],
        "queue": {
            # (a scheduler before `queue_length` sends every call, and no length)
            "length": max(reply.queue_length, len(reply.queue)),
            "capacity": reply.queue_capacity,
            "calls": [
                {"function": c.function, "model": c.model, "waited_s": c.waited_s}
                for c in reply.queue[:OVERVIEW_QUEUE_CALLS]
            ],
        },
        "functions": functions,
        "evictions": [
            {"time_unix_s": now_unix_s - e.age_s, "gpu": e.gpu, "model": e.model, "reason": e.reason}
            for e in reply.evictions[:OVERVIEW_EVICTIONS]
        ],
    }
