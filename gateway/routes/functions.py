"""The function registry: deploy, update, list, describe and delete (specs kept in etcd)."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field

from gateway.routes.deps import GatewayDep
from gateway.state import ApiError, Gateway
from gpufaas.errors import InvalidInput
from gpufaas.functions import NAME_PATTERN, FunctionSpec
from gpufaas.holders import HolderRecord, read_holders
from gpufaas.store import StoreError

# A body without a Content-Type is read as JSON (as before the routes were typed); one sent as a
# form or as text is not (what a browser can send cross-site without asking).
log = logging.getLogger(__name__)
router = APIRouter(strict_content_type=False)


class DeleteRequest(BaseModel):
    """OpenFaaS's delete request."""

    # Other keys are ignored: OpenFaaS clients may send more (a namespace), as the old route allowed.
    model_config = ConfigDict(extra="ignore", strict=True)

    functionName: Annotated[str, Field(pattern=NAME_PATTERN.pattern, max_length=63)]  # noqa: N815 (OpenFaaS's name)


class Deployed(BaseModel):
    name: str
    model: str = Field(description="the cache item: the function at its package (NAME@DIGEST12)")


async def _check_fits(gateway: Gateway, spec: FunctionSpec) -> None:
    """What the schema cannot say: the package must be registered, and the model must fit a GPU
    of the cluster as it is now. 409: the spec is well formed but conflicts with the cluster's state.
    The package is held for the write that follows (young again for the collection: `Artifacts.hold`)."""
    if await gateway.artifacts.hold(spec.package_digest) is None:
        raise ApiError(409, f"package {spec.package_digest} is not uploaded; POST it to /system/packages first")
    largest = gateway.largest_gpu_mb(spec.required_gpu_type)
    if largest is not None and spec.memory_mb > largest:
        kind = f"{spec.gpu} GPU" if spec.required_gpu_type else "GPU"
        raise ApiError(
            409,
            f"memory_mb {spec.memory_mb} is more than any {kind} of the cluster holds (the largest: {largest} MB); "
            "declare the model's real peak memory, or add a larger GPU",
        )


@router.post("/system/functions", status_code=202)
async def deploy(spec: Annotated[FunctionSpec, Body()], gateway: GatewayDep) -> Deployed:
    """Deploy a new function (409 if the name is taken: update it with PUT)."""
    await _check_fits(gateway, spec)
    before = await gateway.store.revision()  # the watch's older events of the name are up to this
    created = await gateway.store.compare_and_put(gateway.keys.function(spec.name), spec.to_json(), mod_revision=0)
    if not created:
        raise ApiError(409, f"function {spec.name!r} already exists; update it with PUT /system/functions")
    gateway.function_written(spec, over_revision=before)
    return Deployed(name=spec.name, model=spec.model)


@router.put("/system/functions", status_code=202)
async def update(spec: Annotated[FunctionSpec, Body()], gateway: GatewayDep) -> Deployed:
    """Replace a deployed function's whole spec (404 if it is not deployed)."""
    await _check_fits(gateway, spec)
    key = gateway.keys.function(spec.name)
    for _ in range(5):
        current = await gateway.store.get(key)
        if current is None:
            raise ApiError(404, f"function {spec.name!r} does not exist; deploy it with POST /system/functions")
        if await gateway.store.compare_and_put(key, spec.to_json(), mod_revision=current.mod_revision):
            gateway.function_written(spec, over_revision=current.mod_revision)
            await _unnamed(gateway, current.value, spec.package_digest)
            return Deployed(name=spec.name, model=spec.model)
    raise ApiError(409, f"function {spec.name!r} is being changed concurrently; retry")


async def _unnamed(gateway: Gateway, old_spec: bytes, package_digest: str | None) -> None:
    """The old spec's package, where the change left it (`package_digest`: the new spec's, None
    for a delete): its grace before the collection starts now, for the calls that still run it.
    After the change took: etcd failing here loses only that (the grace runs from the package's
    making, as before), never the change's answer."""
    with contextlib.suppress(InvalidInput):
        old = FunctionSpec.from_json(old_spec).package_digest
        if old != package_digest:
            try:
                await gateway.artifacts.unnamed(old)
            except StoreError as exc:
                log.warning("package %s: its grace could not start now (%s); it runs from its making", old, exc)


def _replicas(value: bytes | None) -> list[Any]:
    """A model's replicas key's GPUs ("node/gpu"); [] where there is none (or not a list)."""
    with contextlib.suppress(ValueError):
        replicas = json.loads(value) if value is not None else []
        return replicas if isinstance(replicas, list) else []
    return []


def _describe(gateway: Gateway, spec: FunctionSpec, holders: list[HolderRecord], replicas: list[Any]) -> dict[str, Any]:
    return {
        **spec.model_dump(mode="json"),
        "model": spec.model,
        "invocationCount": gateway.stats.count(spec.name),
        "replicas": len(replicas),
        "gpus": replicas,
        # Nodes whose disk holds its package: a call there fetches nothing (pre-staging puts it
        # there); and those whose host model pool holds its weights: a miss there maps them.
        "staged_on": sorted(
            h.name.removeprefix("node-") for h in holders if h.kind == "node" and spec.package_digest in h.packages
        ),
        "pooled_on": sorted(
            h.name.removeprefix("node-") for h in holders if h.kind == "node" and spec.package_digest in h.pooled
        ),
    }


@router.get("/system/functions")
async def list_functions(gateway: GatewayDep) -> list[dict[str, Any]]:
    """Every deployed function, described: one range read of the models' replicas for all (not a
    read per function, each a round trip to etcd)."""
    holders = await read_holders(gateway.store, gateway.keys)
    values = {kv.key: kv.value for kv in await gateway.store.get_prefix(gateway.keys.models)}
    return [
        _describe(gateway, spec, holders, _replicas(values.get(gateway.keys.replicas(spec.model))))
        for spec in sorted(gateway.functions.values(), key=lambda s: s.name)
    ]


@router.get("/system/function/{name}")
async def get_function(name: str, gateway: GatewayDep) -> dict[str, Any]:
    spec = gateway.functions.get(name)
    if spec is None:
        raise ApiError(404, f"function {name!r} is not deployed; list functions with GET /system/functions")
    replicas_kv = await gateway.store.get(gateway.keys.replicas(spec.model))
    replicas = _replicas(replicas_kv.value if replicas_kv is not None else None)
    return _describe(gateway, spec, await read_holders(gateway.store, gateway.keys), replicas)


@router.delete("/system/functions", status_code=202)
async def delete(request: Annotated[DeleteRequest, Body()], gateway: GatewayDep) -> dict[str, Any]:
    name = request.functionName
    key = gateway.keys.function(name)
    for _ in range(5):
        current = await gateway.store.get(key)
        if current is None:
            raise ApiError(404, f"function {name!r} is not deployed")
        if await gateway.store.compare_and_delete(key, mod_revision=current.mod_revision):
            break
    else:
        raise ApiError(409, f"function {name!r} is being changed concurrently; retry")
    gateway.function_deleted(name, over_revision=current.mod_revision)
    await _unnamed(gateway, current.value, None)
    return {"name": name, "deleted": True}
