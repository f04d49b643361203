"""Function packages: uploaded once (streamed, checked, stored by digest), fetched by the nodes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse

from gateway.routes.deps import GatewayDep
from gateway.state import ApiError
from gpufaas.functions import DIGEST_PATTERN
from gpufaas.packages import InvalidPackage, PackageTooLarge, check_archive

router = APIRouter()

Digest = Annotated[str, Path(pattern=DIGEST_PATTERN.pattern, description="'sha256:' and 64 hex digits")]

# The body is streamed to disk as it arrives (a package may be GBs), so it is read from the request
# and described to OpenAPI here rather than declared as a parameter.
PACKAGE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the function's package: a gzipped tar with handler.py at its top (gpufaas.packages)",
        "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("/system/packages", status_code=201, openapi_extra=PACKAGE_BODY)
async def upload_package(
    request: Request,
    gateway: GatewayDep,
    digest: Annotated[
        str | None,
        Query(
            pattern=DIGEST_PATTERN.pattern,
            description="the package's sha256, checked against what arrives (also taken as X-Package-Digest)",
        ),
    ] = None,
) -> dict[str, Any]:
    """Store a package; answers its digest (what a function spec names). Refused: larger than the
    limits, not a gzipped tar with handler.py, or not matching the digest given."""
    config = gateway.config
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_package_bytes:
        raise ApiError(413, f"the package is larger than the gateway's limit of {config.max_package_bytes} bytes")
    expected = digest or request.headers.get("x-package-digest")
    if expected is not None:
        gateway.package_path(expected)  # validates the form
    hasher = hashlib.sha256()
    size = 0
    with tempfile.NamedTemporaryFile(dir=gateway.packages_dir, delete=False, suffix=".part") as part:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_package_bytes:
                    raise ApiError(413, f"the package is larger than the limit of {config.max_package_bytes} bytes")
                hasher.update(chunk)
                part.write(chunk)
        except BaseException:
            part.close()
            os.unlink(part.name)
            raise
    actual = f"sha256:{hasher.hexdigest()}"
    if size == 0:
        os.unlink(part.name)
        raise ApiError(400, "the package is empty; send the function's .tar.gz as the request body")
    if expected is not None and expected != actual:
        os.unlink(part.name)
        raise ApiError(400, f"the package's digest is {actual}, not {expected}: the upload was corrupted; retry it")
    try:  # refused at the door, not at its first call
        await asyncio.to_thread(check_archive, part.name, max_unpacked_bytes=config.max_unpacked_bytes)
    except InvalidPackage as exc:
        os.unlink(part.name)
        raise ApiError(413 if isinstance(exc, PackageTooLarge) else 400, str(exc)) from None
    os.replace(part.name, gateway.package_path(actual))
    return {"digest": actual, "size_bytes": size}


@router.get("/system/packages/{digest}", response_class=FileResponse)
async def download_package(digest: Digest, gateway: GatewayDep) -> FileResponse:
    path = gateway.package_path(digest)
    if not path.exists():
        raise ApiError(404, f"package {digest} is not stored here; upload it with POST /system/packages")
    return FileResponse(path, media_type="application/gzip")
