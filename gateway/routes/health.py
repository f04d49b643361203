"""Health, version and metrics routes."""

from __future__ import annotations

import asyncio
import platform
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import gpufaas
from gateway.routes.deps import GatewayDep

router = APIRouter()


@router.get("/healthz")
async def healthz(gateway: GatewayDep) -> JSONResponse:
    """Ready: the scheduler answers (within a second: a connected scheduler whose loop is
    stalled, or that is SIGSTOPped, is not ready) and etcd does (a read within a second); asked
    at most twice a second however many probes come (gateway.readiness). 503 otherwise, naming
    what is missing: calls would fail or wait. Also this process's own event-loop lag
    (gpufaas.liveness)."""
    readiness = await gateway.readiness.check()
    return JSONResponse(
        {
            "status": "ok" if readiness.ready else "unavailable",
            "scheduler": readiness.scheduler,
            "etcd": readiness.etcd,
            **gateway.loop_lag.report(asyncio.get_running_loop().time()),
        },
        status_code=200 if readiness.ready else 503,
    )


@router.get("/livez")
async def livez() -> dict[str, str]:
    """Alive: the process answers (what a liveness probe restarts on; readiness is /healthz)."""
    return {"status": "ok"}


@router.get("/system/info")
async def info() -> dict[str, Any]:
    return {
        "provider": {"provider": "gpufaas", "orchestration": "gpufaas", "version": {"release": gpufaas.__version__}},
        "version": {"release": gpufaas.__version__},
        "arch": platform.machine(),
    }


@router.get("/metrics")
async def metrics(gateway: GatewayDep) -> Response:
    """Prometheus metrics (gateway.metrics)."""
    await gateway.metrics.count_replicas(gateway.store, gateway.keys, gateway.functions)
    gateway.stats.forget(set(gateway.functions))  # (a call answered after its function's deletion)
    return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)
