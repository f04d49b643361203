"""The client side of a deploy's upload: scan the handler directories into manifests, ask the
gateway which blobs it lacks, send only those (large ones to its blob server in parallel, small
ones batched in one gzipped tar), then register each manifest. What a broken upload sent stays
on the gateway: the next deploy resumes it."""

from __future__ import annotations

import gzip
import io
import queue
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from gpufaas.blobnet import UPLOAD_OFFSET, TransferError, upload_blob
from gpufaas.errors import GpufaasError
from gpufaas.packages import MAX_BATCH_MEMBERS, DigestCache, InvalidPackage, Manifest, scan_directory

BATCH_MAX_BYTES = 1 << 20  # files up to this size go in the batch (code, configs, labels)
BATCH_LIMIT_BYTES = 64 << 20  # a batch request carries at most this much; more batches beyond
PARALLEL_UPLOADS = 4
API_CHUNK_BYTES = 1 << 20
# Another deploy uploading the same blob (two functions sharing weights, deployed at once):
# waited for, asked again this often, for up to this long (a multi-GB upload takes minutes).
BUSY_WAIT_S = 1.0
BUSY_GIVE_UP_S = 1800.0
_T = TypeVar("_T")


class Gateway(Protocol):
    """What the upload needs of the CLI's gateway client."""

    url: str
    authorization: str | None

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...
    def ok(self, response: httpx.Response, *, accept: tuple[int, ...] = ...) -> Any: ...


@dataclass
class Scanned:
    """One function's package, as found on disk."""

    name: str
    manifest: Manifest
    files: dict[str, Path]  # blob digest -> a file holding its bytes
    links: list[str] = field(default_factory=list)  # symbolic links left out (a package holds none)


@dataclass
class UploadReport:
    """What an upload moved: per package digest its answer; the blobs the gateway lacked, the
    bytes sent now (`bytes_sent`: not what a broken upload had sent before) and of those blobs in
    all (`bytes_total`)."""

    packages: dict[str, dict[str, Any]] = field(default_factory=dict)
    blobs_sent: int = 0
    bytes_sent: int = 0
    bytes_total: int = 0
    via_api: bool = False  # the blob server could not be reached (or not in TLS): bytes went through the API


def scan(functions: Sequence[tuple[str, Path]], cache: DigestCache) -> list[Scanned]:
    """Manifests of the functions' directories (hashing what the cache does not know)."""
    scanned = []
    for name, directory in functions:
        links: list[str] = []
        try:
            manifest, files = scan_directory(directory, cache=cache, links=links)
        except OSError as exc:  # a file unreadable, or gone while it was read
            raise GpufaasError(f"{name}: cannot read {directory}: {exc}") from None
        except InvalidPackage as exc:
            raise GpufaasError(f"{name}: {exc}") from None
        scanned.append(Scanned(name, manifest, files, links))
    cache.save()
    return scanned


def upload(
    gateway: Gateway,
    packages: Sequence[Scanned],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> UploadReport:
    """Send what the gateway lacks of `packages`, then register each; GpufaasError on failure
    (what was sent stays there for the next try). `progress(sent, total)` hears the bytes."""
    wanted: dict[str, int] = {}
    files: dict[str, Path] = {}
    for package in packages:
        wanted |= package.manifest.blobs()
        files |= package.files
    answer = _missing(gateway, wanted)
    limit = answer.get("limit_bytes")
    for package in packages:  # said before anything is sent, not after
        if limit is not None and package.manifest.unpacked_bytes > limit:
            raise GpufaasError(
                f"{package.name}: its files hold {package.manifest.unpacked_bytes} bytes, more than the gateway "
                f"takes in one package ({limit}); leave data out of it or raise the gateway's --max-unpacked-mb"
            )
    missing: list[str] = answer["missing"]
    offsets: dict[str, int] = answer.get("offsets", {})
    report = UploadReport(bytes_total=sum(wanted[d] for d in missing))
    sent = _Progress(report.bytes_total, progress)
    small = [d for d in missing if wanted[d] <= BATCH_MAX_BYTES and not offsets.get(d)]
    large = [d for d in missing if d not in set(small)]
    for batch in _batches(small, wanted):
        _send_batch(gateway, batch, files)
        sent.add(sum(wanted[d] for d in batch))
    upload_url = answer.get("upload_url")
    if large:
        report.via_api = _send_large(gateway, upload_url, large, files, sent)
    report.blobs_sent = len(missing)
    report.bytes_sent = sent.sent - sent.resumed
    for package in packages:
        report.packages[package.manifest.digest] = _register(gateway, package)
    return report


def _missing(gateway: Gateway, wanted: dict[str, int]) -> dict[str, Any]:
    """The gateway's answer to which of the `wanted` blobs (digest: size) it lacks, checked."""
    response = gateway.request("POST", "/system/blobs/missing", json={"blobs": wanted})
    answer = gateway.ok(response)
    if not (
        isinstance(answer, dict)
        and isinstance(answer.get("missing"), list)
        and all(isinstance(d, str) and d in wanted for d in answer["missing"])  # (only those it was asked of)
        and isinstance(answer.get("offsets", {}), dict)
        and isinstance(answer.get("limit_bytes"), int | None)
        and isinstance(answer.get("upload_url"), str | None)
    ):
        raise GpufaasError(
            f"the gateway at {gateway.url} answered /system/blobs/missing with something other than the blobs it "
            f"lacks (HTTP {response.status_code}): is it a gpufaas gateway?"
        )
    return answer


def _register(gateway: Gateway, package: Scanned) -> dict[str, Any]:
    """Register `package` (its manifest) once its blobs are there: the gateway's answer, checked."""
    response = gateway.request(
        "POST",
        "/system/packages",
        content=package.manifest.to_json(),
        headers={"content-type": "application/vnd.gpufaas.manifest+json"},
    )
    try:
        registered = gateway.ok(response)
    except GpufaasError as exc:
        raise GpufaasError(f"{package.name}: {exc}") from None
    if not isinstance(registered, dict) or not isinstance(registered.get("digest"), str):
        raise GpufaasError(
            f"the gateway at {gateway.url} answered {package.name}'s package with no digest "
            f"(HTTP {response.status_code}): is it a gpufaas gateway?"
        )
    return registered


class _Progress:
    def __init__(self, total: int, callback: Callable[[int, int], None] | None) -> None:
        self.total = total
        self.sent = 0  # shown: what the gateway has of the blobs
        self.resumed = 0  # of which it had before this upload (resumed, and blobs found there)
        self._callback = callback
        self._lock = threading.Lock()

    def add(self, n: int, *, resumed: int = 0) -> None:
        """`n` more bytes are on the gateway, of which `resumed` were there before."""
        with self._lock:
            self.sent += n
            self.resumed += resumed
            if self._callback is not None:
                self._callback(self.sent, self.total)


def _batches(digests: list[str], sizes: dict[str, int]) -> list[list[str]]:
    batches: list[list[str]] = []
    current: list[str] = []
    size = 0
    for digest in digests:
        if current and (size + sizes[digest] > BATCH_LIMIT_BYTES or len(current) == MAX_BATCH_MEMBERS):
            batches.append(current)
            current, size = [], 0
        current.append(digest)
        size += sizes[digest]
    if current:
        batches.append(current)
    return batches


def _send_batch(gateway: Gateway, digests: list[str], files: dict[str, Path]) -> None:
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=6) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for digest in digests:
            data = files[digest].read_bytes()
            info = tarfile.TarInfo(digest)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    gateway.ok(
        gateway.request(
            "POST",
            "/system/blobs",
            content=buffer.getvalue(),
            headers={"content-type": "application/vnd.gpufaas.blobs+gzip"},
        )
    )


def _send_large(
    gateway: Gateway, upload_url: str | None, digests: list[str], files: dict[str, Path], sent: _Progress
) -> bool:
    """Upload through the blob server, in parallel; where it cannot be reached (or the gateway is
    reached over TLS, `_blob_urls`), through the API. Returns whether the API was used."""
    via_api = True
    for url in _blob_urls(upload_url, gateway.url):
        try:
            _parallel(
                lambda d, url=url: _upload_one(gateway, url, d, files[d], sent),  # type: ignore[misc]
                digests,
            )
        except TransferError as exc:
            if exc.status in (401, 403, 413, 400):
                raise GpufaasError(f"the gateway's blob server refused an upload: {exc}") from None
            continue  # not reachable from here (another network): the next way in
        via_api = False
        break
    if via_api:  # (asked again, and checked as the first answer was: {} here was a KeyError's traceback)
        remaining = _missing(gateway, {d: files[d].stat().st_size for d in digests})["missing"]
        _parallel(lambda d: _send_through_api(gateway, d, files[d], sent), remaining)
    return via_api


def _upload_one(gateway: Gateway, url: str, digest: str, path: Path, sent: _Progress) -> None:
    """One blob to the blob server; what it had already counts as resumed, not sent. Another
    transfer of the same blob under way (another deploy sharing these weights): waited for."""
    shown = 0

    def progress(n: int) -> None:
        nonlocal shown
        shown += n
        sent.add(n)

    def attempt() -> int:
        try:
            return upload_blob(url, path, digest, authorization=gateway.authorization, progress=progress)
        except TransferError as exc:
            if exc.status == 409:  # (an offset to resume from is upload_blob's own: this is a writer)
                raise _Busy(str(exc)) from None
            raise

    sent_now = _while_busy(attempt, digest)
    sent.add(0, resumed=shown - sent_now)


class _Busy(Exception):
    """Another transfer writes the blob now."""


def _while_busy(attempt: Callable[[], _T], digest: str) -> _T:
    """`attempt()`, again every BUSY_WAIT_S while it finds the blob being written by another
    transfer, for up to BUSY_GIVE_UP_S; then the last refusal, said so."""
    deadline = time.monotonic() + BUSY_GIVE_UP_S
    while True:
        try:
            return attempt()
        except _Busy as exc:
            if time.monotonic() > deadline:
                raise GpufaasError(
                    f"blob {digest} has been written by another transfer for {BUSY_GIVE_UP_S:g} s: {exc}; "
                    "deploy again once that one ends"
                ) from None
            time.sleep(BUSY_WAIT_S)


def _blob_urls(advertised: str | None, gateway_url: str) -> list[str]:
    """Where to reach the gateway's blob server: the URL it advertises, then the same port on the
    host this CLI reaches the gateway at (a published port, when the advertised name is one of
    the cluster's network: compose, a pod). None when the gateway is reached over TLS: the CLI
    speaks only plain HTTP to a blob server, and would send the admin password and the weights
    in the clear beside an https:// gateway (its blobs go through the API, in TLS)."""
    if advertised is None or urllib.parse.urlsplit(gateway_url).scheme != "http":
        return []
    urls = [advertised]
    advertised_parts, gateway_parts = urllib.parse.urlsplit(advertised), urllib.parse.urlsplit(gateway_url)
    if advertised_parts.hostname != gateway_parts.hostname and gateway_parts.hostname and advertised_parts.port:
        urls.append(f"http://{gateway_parts.hostname}:{advertised_parts.port}")
    return urls


def _send_through_api(gateway: Gateway, digest: str, path: Path, sent: _Progress) -> None:
    _while_busy(lambda: _put_through_api(gateway, digest, path, sent), digest)


def _put_through_api(gateway: Gateway, digest: str, path: Path, sent: _Progress) -> None:
    size = path.stat().st_size
    head = gateway.request("HEAD", f"/system/blobs/{digest}")
    if head.status_code == 409:
        raise _Busy(f"blob {digest} is being written by another transfer")  # (HEAD has no body)
    if head.status_code == 200:
        sent.add(size, resumed=size)
        return
    try:
        offset = int(head.headers.get(UPLOAD_OFFSET, "0") or 0)
    except ValueError:  # (a traceback, before)
        raise GpufaasError(
            f"the gateway at {gateway.url} answered blob {digest}'s HEAD with {UPLOAD_OFFSET} "
            f"{head.headers[UPLOAD_OFFSET]!r}, not a byte offset: is it a gpufaas gateway?"
        ) from None
    sent.add(offset, resumed=offset)

    def body() -> Any:
        with path.open("rb") as source:
            source.seek(offset)
            while chunk := source.read(API_CHUNK_BYTES):
                sent.add(len(chunk))
                yield chunk

    response = gateway.request(
        "PUT",
        f"/system/blobs/{digest}",
        params={"size": size},
        content=body(),
        headers={UPLOAD_OFFSET: str(offset), "content-length": str(size - offset)},
    )
    if response.status_code == 409 and UPLOAD_OFFSET.lower() not in response.headers:
        raise _Busy(response.text)  # (with an offset: another resumed it since the HEAD; refused below)
    gateway.ok(response, accept=(201,))


def _parallel(work: Callable[[str], object], digests: list[str]) -> None:
    """`work(digest)` for every digest, PARALLEL_UPLOADS at a time; the first failure is raised
    once the uploads under way end (no new one starts after it). The threads are daemons: a
    Ctrl-C ends the deploy at once, what was sent staying on the gateway for the next deploy to
    resume (a pool's threads are joined at exit: every queued upload ran to its end first)."""
    if not digests:
        return
    pending = queue.SimpleQueue[str]()
    for digest in digests:
        pending.put(digest)
    failures: list[BaseException] = []

    def uploader() -> None:
        while not failures:
            try:
                digest = pending.get_nowait()
            except queue.Empty:
                return
            try:
                work(digest)
            except BaseException as exc:  # (raised in the caller's thread, below)
                failures.append(exc)

    threads = [threading.Thread(target=uploader, daemon=True) for _ in range(min(PARALLEL_UPLOADS, len(digests)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.1)  # (polled: a Ctrl-C whose signal reached another thread is heard at once)
    if failures:
        raise failures[0]
