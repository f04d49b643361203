"""Packages and their blobs: which blobs are missing, blob uploads (resumable) and downloads, a
batch of small blobs in one tar, package registration from a manifest (or a whole `.tar.gz`),
and a package's manifest by digest (gateway.artifacts does the work)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from gateway.artifacts import (
    BODY_IDLE_TIMEOUT_S,
    MAX_BATCH_BYTES,
    MissingBlobs,
    OffsetMismatch,
    PeerAccess,
    UploadStalled,
    spool,
)
from gateway.routes.deps import GatewayDep
from gateway.state import ApiError
from gpufaas.blobnet import UPLOAD_OFFSET
from gpufaas.blobs import BlobBusy, CorruptBlob
from gpufaas.functions import DIGEST_PATTERN, WHOLE
from gpufaas.holders import PackageRecord
from gpufaas.packages import DISK_FULL_ERRNOS, InvalidPackage, Manifest, PackageTooLarge
from gpufaas.requirements import RequirementsError

router = APIRouter()

Digest = Annotated[str, Path(pattern=DIGEST_PATTERN.pattern, description="'sha256:' and 64 hex digits")]

# Bodies that are streamed to disk as they arrive (a package or a blob may be GBs) are read from the
# request and described to OpenAPI here rather than declared as parameters.
MANIFEST_MEDIA_TYPE = "application/vnd.gpufaas.manifest+json"  # (plain application/json is taken too)
_MANIFEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["version", "files"],
    "properties": {
        "version": {"const": 1},
        "files": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["path", "digest", "size", "mode"],
                "properties": {
                    "path": {"type": "string", "description": "relative POSIX path; handler.py at the top"},
                    "digest": {"type": "string", "pattern": DIGEST_PATTERN.pattern},
                    "size": {"type": "integer", "minimum": 0},
                    "mode": {"enum": [0o644, 0o755]},
                },
            },
        },
    },
}
PACKAGE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "a manifest (gpufaas.packages) whose blobs are uploaded already, or the whole package as a gzipped tar "
            "with handler.py at its top (application/gzip)"
        ),
        "content": {
            MANIFEST_MEDIA_TYPE: {"schema": _MANIFEST_SCHEMA},
            "application/gzip": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}
BLOB_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the blob's bytes from Upload-Offset (default 0) to its end",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
HOLDERS_HEADER = "X-Package-Holders"  # the gateways that hold a committed package's blobs
BATCH_MEDIA_TYPE = "application/vnd.gpufaas.blobs+gzip"  # (application/x-tar: the same, not compressed)
BATCH_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "a gzipped tar whose members are small blobs, each named by its digest",
        "content": {BATCH_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    }
}


class WantedBlobs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    blobs: dict[Annotated[str, Field(pattern=DIGEST_PATTERN.pattern)], Annotated[int, Field(ge=0), WHOLE]] = Field(
        description="digest -> size in bytes of every blob a package needs",
        json_schema_extra={"additionalProperties": False},  # keys other than digests are refused
    )


class MissingAnswer(BaseModel):
    missing: list[str] = Field(description="the blobs this gateway lacks: upload these")
    offsets: dict[str, int] = Field(description="bytes of a missing blob already here (an upload resumes there)")
    upload_url: str | None = Field(
        description="this gateway's blob server (gpufaas.blobnet), the fast way in, in plain HTTP; null where the "
        "gateway's public URL is https: upload through PUT /system/blobs/DIGEST"
    )
    limit_bytes: int = Field(description="the most a package may hold, in all (larger ones are refused)")


def _package_answer(record: PackageRecord, size_bytes: int | None = None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "digest": record.digest,
        "files": len(record.manifest.files),
        "unpacked_bytes": record.manifest.unpacked_bytes,
        "requirements": list(record.requirements.pins) if record.requirements is not None else [],
    }
    if size_bytes is not None:
        answer["size_bytes"] = size_bytes
    return answer


def _refused(exc: InvalidPackage | RequirementsError) -> ApiError:
    if isinstance(exc, PackageTooLarge):
        return ApiError(413, str(exc))
    if isinstance(exc, MissingBlobs):
        return ApiError(409, str(exc))
    return ApiError(400, str(exc))


@contextlib.contextmanager
def _disk_full_is_507() -> Iterator[None]:
    """Within it, this gateway's disk filling as an upload is written is 507 saying so (as its
    blob server answers), not a 500 with a traceback: the uploader can do nothing but wait."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS:
            raise
        raise ApiError(
            507, f"the gateway's disk is full ({exc.strerror}); free space on it, then upload again"
        ) from None


@router.post("/system/blobs/missing")
async def missing_blobs(wanted: Annotated[WantedBlobs, Body()], gateway: GatewayDep) -> MissingAnswer:
    """Which of a package's blobs this gateway lacks (upload only those), and how much of each a
    broken upload left here."""
    artifacts = gateway.artifacts
    limit = artifacts.max_unpacked_bytes
    too_large = next((d for d, size in wanted.blobs.items() if size > limit), None)
    if too_large is not None:  # well formed, but more than this gateway takes: a conflict with it
        raise ApiError(409, f"blob {too_large} is larger than this gateway's limit of {limit} bytes per package")
    missing, offsets = await artifacts.missing(wanted.blobs)
    # Clients speak plain HTTP to the blob server: beside a gateway they reach over TLS (an https://
    # public URL: its own certificate or a proxy's) it is not offered, or their admin password and
    # weights would cross in the clear; they upload through the API, in TLS, instead.
    upload_url = artifacts.url if gateway.config.public_url.startswith("http:") else None
    return MissingAnswer(missing=missing, offsets=offsets, upload_url=upload_url or None, limit_bytes=limit)


@router.put("/system/blobs/{digest}", status_code=201, openapi_extra=BLOB_BODY)
async def upload_blob(
    request: Request,
    digest: Digest,
    gateway: GatewayDep,
    size: Annotated[int, Query(ge=0, description="the whole blob's size in bytes")],
) -> Response:
    """Upload one blob, verified as it streams (the blob server does the same faster). A broken
    upload resumes: send the rest with Upload-Offset: the bytes already here (HEAD says)."""
    offset_header = request.headers.get(UPLOAD_OFFSET.lower(), "0")
    # (At most 20 digits, as the blob server's Range: more is past any blob, and past what int() takes.)
    if not offset_header.isdecimal() or len(offset_header) > 20:
        raise ApiError(400, f"{UPLOAD_OFFSET} must be a whole number of bytes, got {offset_header[:40]!r}")
    offset = int(offset_header)
    try:
        with _disk_full_is_507():
            reached = await gateway.artifacts.receive(digest, size, offset, request.stream())
    except OffsetMismatch as exc:
        raise ApiError(409, str(exc), headers={UPLOAD_OFFSET: str(exc.offset)}) from None
    except UploadStalled as exc:  # (its client is likely gone; one merely slow hears where to go on)
        raise ApiError(408, str(exc), headers={UPLOAD_OFFSET: str(exc.offset)}) from None
    except BlobBusy as exc:
        raise ApiError(409, str(exc)) from None
    except (CorruptBlob, PackageTooLarge) as exc:
        raise _refused(exc) from None
    except ClientDisconnect:
        return Response(status_code=400)  # nobody hears it; the partial stays for a resume
    if reached < size:
        raise ApiError(
            400,
            f"{reached} of the blob's {size} bytes are here; send the rest with {UPLOAD_OFFSET}: {reached}",
            headers={UPLOAD_OFFSET: str(reached)},
        )
    return Response(status_code=201, headers={UPLOAD_OFFSET: str(size)})


@router.head("/system/blobs/{digest}", response_class=FileResponse)
async def blob_status(digest: Digest, gateway: GatewayDep) -> Response:
    """200 and its size if the blob is here; 404 with Upload-Offset: what a broken upload left;
    409 while another transfer writes it (ask again rather than PUT a body to be refused)."""
    blobs = gateway.artifacts.blobs
    if blobs.busy(digest) and not blobs.has(digest):
        raise ApiError(409, f"blob {digest} is being written by another transfer; retry when it ends")
    return await download_blob(digest, gateway)


@router.get("/system/blobs/{digest}", response_class=FileResponse)
async def download_blob(digest: Digest, gateway: GatewayDep) -> Response:
    """A blob's bytes (Range: bytes=N- for the rest from N), fetched from another holder first
    if a registered package names it and this gateway lacks it. 404 with Upload-Offset: what a
    broken upload of it left."""
    path = gateway.artifacts.blobs.path(digest)
    if path is None and gateway.artifacts.blobs.partial_size(digest) == 0:  # (not an upload under way)
        path = await gateway.artifacts.ensure_blob(digest, PeerAccess.of(gateway.config.credentials))
    if path is None:
        offset = gateway.artifacts.blobs.partial_size(digest)
        raise ApiError(404, f"blob {digest} is not stored here", headers={UPLOAD_OFFSET: str(offset)})
    return FileResponse(path, media_type="application/octet-stream")


@router.post("/system/blobs", status_code=201, openapi_extra=BATCH_BODY)
async def upload_blob_batch(request: Request, gateway: GatewayDep) -> dict[str, Any]:
    """Many small blobs in one request: a tar whose members are named by their digests."""
    compressed = request.headers.get("content-type", "").split(";", 1)[0].strip().lower() != "application/x-tar"
    spooled, _, _ = await _spool(request, gateway, MAX_BATCH_BYTES)
    try:
        with _disk_full_is_507():
            stored = await gateway.artifacts.receive_batch(spooled, compressed=compressed)
    except BlobBusy as exc:  # (written by another transfer for longer than the batch waits)
        raise ApiError(409, str(exc)) from None
    except InvalidPackage as exc:
        raise _refused(exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spooled)
    return {"stored": stored}


@router.post("/system/packages", status_code=201, openapi_extra=PACKAGE_BODY)
async def register_package(
    request: Request,
    response: Response,
    gateway: GatewayDep,
    digest: Annotated[
        str | None,
        Query(
            pattern=DIGEST_PATTERN.pattern,
            description="with a .tar.gz body: its sha256, checked against what arrives (or X-Package-Digest)",
        ),
    ] = None,
) -> dict[str, Any]:
    """Register a package; answers its digest (what a function spec names) once its blobs are
    held by this gateway and one other gateway (X-Package-Holders names them; a `warning` says
    when no other gateway took a copy). A manifest names blobs uploaded already, to this gateway or another holder (409
    naming one that none holds); a .tar.gz carries them. Refused: over the limits (413), a
    package that breaks a rule, or a requirements.txt that cannot be resolved (400 naming the
    requirement)."""
    artifacts = gateway.artifacts
    access = PeerAccess.of(gateway.config.credentials)
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    try:
        if media in (MANIFEST_MEDIA_TYPE, "application/json"):
            body = await _manifest_body(request)
            manifest = Manifest.from_json(body, max_unpacked_bytes=artifacts.max_unpacked_bytes)
            return await _committed(gateway, response, await artifacts.register(manifest, access), access)
        expected = digest or request.headers.get("x-package-digest")
        if expected is not None and not DIGEST_PATTERN.fullmatch(expected):
            raise ApiError(400, f"{expected!r} is not a package digest; expected 'sha256:' and 64 hex digits")
        spooled, size, actual = await _spool(request, gateway, gateway.config.max_package_bytes)
        try:
            if size == 0:
                raise ApiError(400, "the package is empty; send the function's .tar.gz as the request body")
            if expected is not None and expected != actual:
                raise ApiError(
                    400, f"the archive's sha256 is {actual}, not {expected}: the upload was corrupted; retry it"
                )
            with _disk_full_is_507():
                manifest = await artifacts.receive_archive(spooled)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spooled)
        return await _committed(gateway, response, await artifacts.register(manifest, access), access, size)
    except (InvalidPackage, RequirementsError) as exc:
        raise _refused(exc) from None


MAX_MANIFEST_BYTES = 4 << 20


async def _manifest_body(request: Request) -> bytes:
    """A manifest's body, at most MAX_MANIFEST_BYTES (PackageTooLarge as soon as it is past that,
    or declared so: a package sent with a manifest's content type is not read into memory)."""
    too_large = PackageTooLarge(f"a manifest may not be larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > MAX_MANIFEST_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size_bytes = 0
    async for chunk in request.stream():
        size_bytes += len(chunk)
        if size_bytes > MAX_MANIFEST_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _committed(
    gateway: GatewayDep, response: Response, record: PackageRecord, access: PeerAccess, size_bytes: int | None = None
) -> dict[str, Any]:
    """The answer to a commit, once a second gateway holds the package's blobs (or none would):
    X-Package-Holders names the gateways that hold them; a `warning` says when other gateways
    were registered but none took a copy."""
    artifacts = gateway.artifacts
    copy, others = await artifacts.replicate(record.manifest, access)
    response.headers[HOLDERS_HEADER] = ", ".join([artifacts.name, *([copy] if copy else [])])
    answer = _package_answer(record, size_bytes)
    if copy is None and others:
        answer["warning"] = (
            f"none of the {others} other gateway(s) took a copy of this package: it is held by this gateway only "
            "until a node stages it"
        )
    return answer


@router.get("/system/packages/{digest}")
async def get_package(digest: Digest, gateway: GatewayDep) -> dict[str, Any]:
    """A registered package: its manifest, and the Python distributions its requirements.txt
    resolved to."""
    record = await gateway.artifacts.record(digest)
    if record is None:
        raise ApiError(404, f"package {digest} is not registered; register it with POST /system/packages")
    return {
        "digest": record.digest,
        "manifest": json.loads(record.manifest.to_json()),
        "requirements": list(record.requirements.pins) if record.requirements is not None else [],
        "gateway": record.gateway,
    }


async def _spool(request: Request, gateway: GatewayDep, limit_bytes: int) -> tuple[Any, int, str]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdecimal() and int(declared) > limit_bytes:
        raise ApiError(413, f"the request is larger than the gateway's limit of {limit_bytes} bytes")
    try:
        with _disk_full_is_507():
            return await spool(request.stream(), gateway.spool_dir, limit_bytes)
    except PackageTooLarge as exc:
        raise ApiError(413, str(exc)) from None
    except TimeoutError:  # (its client is likely gone; one merely slow hears why)
        raise ApiError(408, f"no bytes of the request came for {BODY_IDLE_TIMEOUT_S:g} s; send it again") from None
