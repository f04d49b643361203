"""The HTTP gateway (FastAPI): the app that mounts the route modules (gateway.routes) over the
gateway's state (gateway.state), its authentication and the invoke path (gateway.invoke)."""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import gpufaas
from gateway.auth import OPEN_PATHS, AuthMiddleware
from gateway.invoke import InvokeMiddleware, Receive, Scope, Send
from gateway.routes import cluster, dashboard, functions, health, packages
from gateway.state import ApiError, Gateway, GatewayConfig
from gpufaas.errors import InvalidInput, shown
from gpufaas.functions import FunctionSpec, explain
from gpufaas.store import Store, StoreError

__all__ = ["ApiError", "Gateway", "GatewayConfig", "create_app"]

# What a parameter takes, for its error messages (the function spec's fields: gpufaas.functions).
PARAMETERS = {"digest": "expected 'sha256:' and 64 hex digits"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


def _invalid_request(request: Request, exc: RequestValidationError) -> str:
    """One line for a request FastAPI's validation refused: which part, what it takes, what it got."""
    errors = list(exc.errors())
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ())]
    if loc[:1] == ["body"]:
        if isinstance(first.get("input"), bytes):  # a body FastAPI did not read as JSON: its content type
            return (
                f"the body was sent as {request.headers.get('content-type', 'no content type')!r}; "
                "send JSON with Content-Type: application/json"
            )
        if request.url.path == "/system/blobs/missing":
            where = shown(".".join(loc[1:]) or "body")
            return f'{where}: the body must be JSON like {{"blobs": {{"sha256:<64 hex digits>": SIZE_IN_BYTES}}}}'
        if first.get("type") == "json_invalid" or (loc == ["body"] and first.get("type") == "missing"):
            if request.url.path == "/system/functions" and request.method == "DELETE":
                return 'the body must be JSON like {"functionName": "NAME"}'
            return "the body must be a JSON function spec (see /openapi.json)"
        body_errors = [{**e, "loc": tuple(e["loc"][1:])} for e in errors if tuple(e["loc"][:1]) == ("body",)]
        if request.url.path == "/system/functions" and request.method != "DELETE":
            return explain(body_errors, FunctionSpec)  # type: ignore[arg-type]
        value = first.get("input")
        if loc[1:] == ["functionName"] and isinstance(value, str):
            return f"{shown(repr(value))} is not a valid function name"
        return 'the body must be JSON like {"functionName": "NAME"}'
    name = loc[-1] if loc else "request"
    expected = PARAMETERS.get(name, first.get("msg", "malformed"))
    return f"{name}: {expected}, got {shown(repr(first.get('input')))}"


class GatewayApp(FastAPI):
    """FastAPI with the invoke path in front of its whole middleware stack: POST /function/{name}
    goes straight to `invoke` (gateway.invoke), everything else through FastAPI as before.

    Why not `add_middleware`: FastAPI puts its own layers outside every added middleware
    (ServerErrorMiddleware, which wraps each `send`, its telemetry check, which reads the
    environment per request, its body limit, Starlette's app), and they took 8 % of the gateway's
    CPU per call (cProfile at concurrency 8, tiny calls). The invoke path catches its own errors;
    an unexpected exception is answered 500 "Internal Server Error" by uvicorn, as
    ServerErrorMiddleware answered it, and the connection is closed either way."""

    invoke: InvokeMiddleware  # set by create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.invoke(scope, receive, send)


def create_app(store: Store, config: GatewayConfig) -> GatewayApp:
    """The ASGI app. The store is opened and closed by the caller; the app owns the rest."""
    gateway = Gateway(store, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # (a start that fails partway is stopped too: uvicorn runs no shutdown after it)
            await gateway.start()
            yield
        finally:
            await gateway.stop()

    # No /docs nor /redoc: FastAPI's pages load floating versions of third-party scripts from a CDN
    # (no integrity hashes), which would run on this origin, where a browser holds the admin's
    # credentials for the dashboard. The API's document is /openapi.json, for any viewer.
    app = GatewayApp(
        title="gpufaas gateway", version=gpufaas.__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.gateway = gateway
    # Every route but invocations (checked per function by InvokeMiddleware); without credentials
    # (--insecure) it refuses only what a browser sent by another site would ask (gateway.auth.insecure_refusal).
    public_host = urllib.parse.urlsplit(config.public_url).hostname or ""
    app.add_middleware(AuthMiddleware, credentials=config.credentials, public_host=public_host)
    # Outermost: POST /function/{name} is answered before FastAPI's stack; the rest goes on to it.
    app.invoke = InvokeMiddleware(functools.partial(FastAPI.__call__, app), gateway)
    _add_error_handlers(app)
    for module in (health, packages, functions, cluster, dashboard):
        app.include_router(module.router)
    app.openapi = _secured_openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error as {"error": ..., "status": N}: the API's own, invalid input (400), an
    unreachable etcd (503), and FastAPI's (an unparsable body, an unknown route or method)."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(InvalidInput)
    async def on_invalid(request: Request, exc: InvalidInput) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(StoreError)
    async def on_store(request: Request, exc: StoreError) -> JSONResponse:
        return _error(503, f"the datastore (etcd) is unreachable: {exc}; check that etcd runs")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers (a body it cannot parse, an unknown route or method) in the same form.
        return _error(exc.status_code, str(exc.detail), dict(exc.headers) if exc.headers else None)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _invalid_request(request, exc))


def _secured_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` for `app`: FastAPI's document, with the credentials every route but the
    open ones asks for (built once, on the first call)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "admin": {"type": "http", "scheme": "basic", "description": "user admin, the admin password"},
                "token": {"type": "http", "scheme": "bearer", "description": "the admin password"},
            }
            schema["security"] = [{"admin": []}, {"token": []}]
            for path, operations in schema["paths"].items():
                if path in OPEN_PATHS:
                    for operation in operations.values():
                        operation["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
