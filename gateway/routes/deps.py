"""What the route modules share: the gateway's state as a FastAPI dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.state import Gateway


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
