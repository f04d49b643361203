"""The gateway app in process: MemoryStore, httpx's ASGI transport, no scheduler listening."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway import artifacts
from gateway.app import GatewayConfig, create_app
from gateway.auth import Credentials
from gpufaas import packages
from gpufaas.cluster import GpuRecord, NodeRecord
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.packages import EMPTY_DIGEST, build_package
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import KeyValue, StoreError, WatchEvent
from gpufaas.types import DEFAULT_BATCH_SIZE
from tests.fakes import MemoryStore
from tests.scrape import sample


def make_package(version: str = "1") -> bytes:
    """A small real package (a handler and a data file), built deterministically."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        handler = "def load(device):\n    return None\n\ndef predict(model, inputs):\n    return VERSION\n"
        (directory / "handler.py").write_text(f"VERSION = {version!r}\n\n{handler}")
        (directory / "data.bin").write_bytes(bytes(range(256)) * 8)
        return build_package(directory)


PACKAGE = make_package()
UNREACHABLE_SCHEDULER = "127.0.0.1:1"  # nothing listens there


def sha256(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class Env:
    client: httpx.AsyncClient
    store: MemoryStore
    app: FastAPI
    keys: Keys
    state_dir: Path

    async def upload(self, data: bytes = PACKAGE) -> str:
        response = await self.client.post("/system/packages", content=data)
        assert response.status_code == 201, response.text
        digest: str = response.json()["digest"]
        return digest

    async def deploy(self, name: str, **fields: Any) -> None:
        """Upload PACKAGE and deploy it as function `name` (with `fields`), which must be accepted."""
        spec = {"name": name, "package_digest": await self.upload(), **fields}
        response = await self.client.post("/system/functions", json=spec)
        assert response.status_code == 202, response.text

    async def stored_spec(self, name: str) -> dict[str, Any] | None:
        kv = await self.store.get(self.keys.function(name))
        return None if kv is None else json.loads(kv.value)


ADMIN_PASSWORD, INVOKE_TOKEN, NODE_TOKEN = "admin-pw", "invoke-tok", "node-tok"
CREDENTIALS = Credentials(admin_password=ADMIN_PASSWORD, invoke_token=INVOKE_TOKEN, node_token=NODE_TOKEN)


@asynccontextmanager
async def gateway(tmp_path: Path, **config: Any) -> AsyncIterator[Env]:
    """A gateway with credentials (CREDENTIALS unless `credentials=` says otherwise) and a client
    that sends the admin's."""
    store = config.pop("store", None) or MemoryStore()
    keys = Keys("/unit")
    config.setdefault("credentials", CREDENTIALS)
    app = create_app(
        store, GatewayConfig(state_dir=tmp_path, scheduler_address=UNREACHABLE_SCHEDULER, keys=keys, **config)
    )
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gateway", auth=("admin", ADMIN_PASSWORD)
            ) as client:
                yield Env(client, store, app, keys, tmp_path)
        assert store.num_watchers == 0, "the gateway left a watch open after shutdown"
    finally:
        await store.close()


def run(tmp_path: Path, body: Callable[[Env], Awaitable[None]], **config: Any) -> None:
    async def main() -> None:
        async with gateway(tmp_path, **config) as env:
            await body(env)

    asyncio.run(main())


def assert_error(response: httpx.Response, status: int, *fragments: str) -> str:
    """The response is the gateway's error form with `status`, and its message has every fragment."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "status"}, body
    assert body["status"] == status
    message: str = body["error"]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def part_files(state_dir: Path) -> list[Path]:
    """Request bodies left behind (they must never be: each is removed once read)."""
    return sorted((state_dir / "spool").glob("*.part"))


def package_records(env: Env) -> Awaitable[list[Any]]:
    return env.store.get_prefix(env.keys.packages)


# --- lifecycle ------------------------------------------------------------------------------


def test_registers_itself_while_running_and_unregisters_on_shutdown(tmp_path: Path) -> None:
    async def main() -> None:
        store = MemoryStore()
        keys = Keys("/unit")
        config = GatewayConfig(
            state_dir=tmp_path, public_url="http://gw:9", scheduler_address=UNREACHABLE_SCHEDULER, keys=keys
        )
        app = create_app(store, config)
        async with app.router.lifespan_context(app):
            kv = await store.get(keys.service("gateway"))
            assert kv is not None and kv.value == b"http://gw:9"
            assert kv.lease != 0, "the registration must be under a lease, so it goes when the gateway dies"
        assert await store.get(keys.service("gateway")) is None
        assert store.num_watchers == 0
        await store.close()

    asyncio.run(main())


def test_a_start_that_fails_partway_is_stopped(tmp_path: Path) -> None:
    # Before, a start that failed after its lease (etcd failing as the gateway registered) left
    # the lease and its keys in etcd until it ran out, and its watches, blob server and scheduler
    # link running: uvicorn runs no shutdown for an app whose startup failed.
    class FailingRegistration(MemoryStore):
        async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
            if key.startswith(keys.holders):
                raise StoreError("etcd went away")
            return await super().put(key, value, lease=lease)

    keys = Keys("/unit")

    async def main() -> None:
        store = FailingRegistration()
        config = GatewayConfig(state_dir=tmp_path, scheduler_address=UNREACHABLE_SCHEDULER, keys=keys)
        app = create_app(store, config)
        with pytest.raises(StoreError):
            async with app.router.lifespan_context(app):
                pass
        assert await store.get(keys.service("gateway")) is None  # its lease revoked
        assert store.num_watchers == 0
        await store.close()

    asyncio.run(main())


def test_health_info_and_metrics(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        # No scheduler listens: not ready (calls would wait, then fail), though alive.
        health = await env.client.get("/healthz")
        assert health.status_code == 503
        report = health.json()
        assert {k: report.pop(k) for k in ("status", "scheduler", "etcd")} == {
            "status": "unavailable",
            "scheduler": False,
            "etcd": True,
        }
        assert set(report) == {"loop_lag_s", "loop_lag_max_s"}  # this process's own event loop
        assert (await env.client.get("/livez")).json() == {"status": "ok"}
        info = (await env.client.get("/system/info")).json()
        assert info["provider"]["provider"] == "gpufaas"
        metrics = await env.client.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.headers["content-type"].startswith("text/plain")
        assert sample(metrics.text, "gateway_functions_deployed") == 0
        assert sample(metrics.text, "gpufaas_event_loop_lag_seconds") >= 0

    run(tmp_path, body)


def test_the_dashboard_may_not_be_framed_sniffed_or_run_anything_but_its_own_files(tmp_path: Path) -> None:
    """The page runs where the browser holds the admin's credentials: another site may not frame
    it (clickjacking), and its CSP admits only its own script and style, which must then set no
    inline style or markup (a CSP would refuse them, or they would be an injection's way in)."""

    async def body(env: Env) -> None:
        for path in ("/ui", "/ui/dashboard.js", "/ui/dashboard.css"):
            response = await env.client.get(path)
            assert response.status_code == 200, path
            assert response.headers["x-content-type-options"] == "nosniff", path
            assert response.headers["x-frame-options"] == "DENY", path
            policy = dict(d.strip().split(" ", 1) for d in response.headers["content-security-policy"].split(";"))
            assert policy["frame-ancestors"] == "'none'", path
            assert policy["default-src"] == "'none'" and policy["script-src"] == policy["style-src"] == "'self'"
        page = (await env.client.get("/ui")).text
        assert "style=" not in page and "<script>" not in page and "<style" not in page
        script = (await env.client.get("/ui/dashboard.js")).text
        assert "innerHTML" not in script and "style:" not in script and 'setAttribute("style' not in script

    run(tmp_path, body)


# --- packages -------------------------------------------------------------------------------


def manifest_of(data: bytes) -> dict[str, Any]:
    """The manifest (as JSON) of a .tar.gz package's files."""
    files = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for info in tar:
            content = tar.extractfile(info)
            assert content is not None
            blob = content.read()
            files.append({"path": info.name, "digest": sha256(blob), "size": len(blob), "mode": info.mode & 0o777})
    return {"version": 1, "files": sorted(files, key=lambda f: f["path"])}


def test_package_upload_download_round_trip(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        uploaded = await env.client.post("/system/packages", content=PACKAGE)
        assert uploaded.status_code == 201, uploaded.text
        manifest = manifest_of(PACKAGE)
        digest = sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
        assert uploaded.json() == {
            "digest": digest,
            "files": 2,
            "unpacked_bytes": sum(f["size"] for f in manifest["files"]),
            "requirements": [],
            "size_bytes": len(PACKAGE),
        }
        described = (await env.client.get(f"/system/packages/{digest}")).json()
        assert described["manifest"] == manifest and described["requirements"] == []
        with tarfile.open(fileobj=io.BytesIO(PACKAGE), mode="r:gz") as tar:
            for info in tar:
                blob = await env.client.get(f"/system/blobs/{sha256(tar.extractfile(info).read())}")  # type: ignore[union-attr]
                assert blob.status_code == 200
                assert blob.content == tar.extractfile(info).read()  # type: ignore[union-attr]

        # The same bytes again, with the right digest (query or header): idempotent.
        again = await env.client.post("/system/packages", params={"digest": sha256(PACKAGE)}, content=PACKAGE)
        assert again.status_code == 201 and again.json()["digest"] == digest
        header = await env.client.post(
            "/system/packages", headers={"X-Package-Digest": sha256(PACKAGE)}, content=PACKAGE
        )
        assert header.status_code == 201, header.text
        # Streamed in chunks, without a Content-Length.
        chunks = [PACKAGE[:100], PACKAGE[100:]]

        async def stream() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        streamed = await env.client.post("/system/packages", content=stream())
        assert streamed.status_code == 201 and streamed.json()["size_bytes"] == len(PACKAGE)
        assert part_files(env.state_dir) == []

    run(tmp_path, body)


def test_package_digest_check(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        wrong = sha256(b"other bytes")
        response = await env.client.post("/system/packages", params={"digest": wrong}, content=PACKAGE)
        assert_error(response, 400, sha256(PACKAGE), wrong, "retry")
        response = await env.client.post("/system/packages", headers={"X-Package-Digest": wrong}, content=PACKAGE)
        assert_error(response, 400, wrong)
        # Nothing was kept: neither under the real digest nor as a partial file.
        assert (await env.client.get(f"/system/packages/{sha256(PACKAGE)}")).status_code == 404
        assert part_files(env.state_dir) == []

        response = await env.client.post("/system/packages", params={"digest": "md5:abc"}, content=PACKAGE)
        assert_error(response, 400, "'md5:abc'", "sha256:", "64 hex digits")
        response = await env.client.post("/system/packages", content=b"")
        assert_error(response, 400, "empty", ".tar.gz")

        response = await env.client.get(f"/system/packages/{wrong}")
        assert_error(response, 404, wrong, "POST /system/packages")
        response = await env.client.get("/system/packages/sha256:XYZ")
        assert_error(response, 400, "'sha256:XYZ'", "64 hex digits")
        assert part_files(env.state_dir) == []

    run(tmp_path, body)


def test_package_size_limit(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        response = await env.client.post("/system/packages", content=b"x" * 101)
        assert_error(response, 413, "100 bytes")

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * 60

        response = await env.client.post("/system/packages", content=stream())
        assert_error(response, 413, "100 bytes")
        assert part_files(env.state_dir) == []
        assert await package_records(env) == []

    run(tmp_path, body, max_package_bytes=100)


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


HANDLER = (member("handler.py"), b"def load(d):\n    return None\n\ndef predict(m, i):\n    return i\n")


def test_archives_that_could_escape_or_have_no_handler_are_refused_at_upload(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        bad = {
            "climbs out of the package": [HANDLER, (member("../evil.py"), b"x")],
            "absolute path": [HANDLER, (member("/etc/evil.py"), b"x")],
            "link or device": [HANDLER, (member("passwd", tarfile.SYMTYPE, "/etc/passwd"), b"")],
            "no handler.py": [(member("model.py"), b"x")],
        }
        for fragment, members in bad.items():
            response = await env.client.post("/system/packages", content=tar_gz(members))
            assert_error(response, 400, fragment)
        assert_error(await env.client.post("/system/packages", content=b"\x1f\x8b but not gzip"), 400, "not a valid")
        # A package that unpacks to more than the limit (4 KiB here): 413, however small it is.
        bomb = tar_gz([HANDLER, (member("zeros.bin"), bytes(8192))])
        assert len(bomb) < 1024
        assert_error(await env.client.post("/system/packages", content=bomb), 413, "unpacks to more than 4096 bytes")
        assert part_files(env.state_dir) == [] and await package_records(env) == []
        assert (await env.client.post("/system/packages", content=tar_gz([HANDLER]))).status_code == 201

    run(tmp_path, body, max_unpacked_bytes=4096)


def test_an_upload_offset_that_is_not_a_number_is_a_400(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = "sha256:" + "0" * 64
        # ('²': a digit to str.isdigit, not to int; 5,000 digits: past what int() converts, a 500 once)
        for offset in (b"x", b"-1", b"\xb2", b"9" * 5000):
            response = await env.client.put(
                f"/system/blobs/{digest}?size=1", content=b"x", headers={"Upload-Offset": offset}
            )
            assert_error(response, 400, "Upload-Offset must be a whole number of bytes")

    run(tmp_path, body)


def test_uploads_onto_a_full_disk_are_answered_507_not_500(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's own disk filling during an upload through the API (a blob, a batch, an
    archive) escaped as an OSError: a 500 with a traceback in the log, the uploader told nothing.
    Now 507 saying the gateway's disk is full, as its blob server answers."""
    data = b"weights" * 100
    digest = sha256(data)
    batch = io.BytesIO()
    with tarfile.open(fileobj=batch, mode="w") as tar:
        info = tarfile.TarInfo(digest)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body(env: Env) -> None:
        # writev failing: the spool of a request body and a blob's chunks; write failing: the
        # blobs of a batch and the files of an archive (which their readers took for a bad tar).
        # (The blob last: once its PUT succeeds, the batch holding it has nothing to write.)
        for failing, requests in (("writev", ("blob", "batch", "archive")), ("write", ("batch", "archive"))):
            monkeypatch.setattr(os, failing, full)
            answers = {
                "batch": await env.client.post(
                    "/system/blobs", content=batch.getvalue(), headers={"Content-Type": "application/x-tar"}
                ),
                "archive": await env.client.post("/system/packages", content=PACKAGE),
                "blob": await env.client.put(f"/system/blobs/{digest}?size={len(data)}", content=data),
            }
            monkeypatch.undo()
            for request in requests:
                assert_error(answers[request], 507, "disk", "full")

    run(tmp_path, body)


def test_a_blob_another_transfer_writes_is_said_busy_to_a_head(tmp_path: Path) -> None:
    """An uploader asks (HEAD) before it PUTs: while another transfer writes the blob, 409, so it
    waits without sending a body that would be refused; before and after, 404 and 200."""
    data = b"weights"
    digest = sha256(data)

    async def body(env: Env) -> None:
        blobs = env.app.state.gateway.artifacts.blobs
        assert (await env.client.head(f"/system/blobs/{digest}")).status_code == 404
        with blobs.writer(digest, len(data)) as writer:
            assert (await env.client.head(f"/system/blobs/{digest}")).status_code == 409
            writer.write(data)
            writer.commit()
        assert (await env.client.head(f"/system/blobs/{digest}")).status_code == 200

    run(tmp_path, body)


def test_the_same_directory_packs_to_the_same_digest(tmp_path: Path) -> None:
    first, second = make_package(), make_package()
    assert first == second  # fresh temporary directories, new mtimes: the same bytes
    assert make_package("2") != first


def test_a_model_larger_than_every_gpu_is_refused_at_deploy(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "huge", "package_digest": digest, "memory_mb": 5000}
        # No node registered yet: nothing to compare with, so it is accepted.
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        record = NodeRecord("node0", "127.0.0.1:1", "cpu", "i1", [GpuRecord("gpu0", 1000, "cpu")])
        await env.store.put(env.keys.node("node0"), record.to_json())
        await eventually(lambda: bool(env.app.state.gateway.nodes))
        response = await env.client.post("/system/functions", json={**spec, "name": "huger"})
        assert_error(response, 409, "memory_mb 5000", "the largest: 1000 MB")
        response = await env.client.put("/system/functions", json=spec)
        assert_error(response, 409, "memory_mb 5000")
        typed = {**spec, "name": "typed", "memory_mb": 500, "gpu": "nvidia-h100"}
        assert (await env.client.post("/system/functions", json=typed)).status_code == 202  # no such GPU known
        assert (
            await env.client.post("/system/functions", json={**spec, "name": "fits", "memory_mb": 1000})
        ).status_code == 202

    run(tmp_path, body)


def test_packages_no_function_uses_are_collected_after_their_grace(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        used, unused = await env.upload(make_package("used")), await env.upload(make_package("unused"))
        spec = {"name": "user", "package_digest": used, "memory_mb": 100}
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        gateway = env.app.state.gateway
        blobs = gateway.artifacts.blobs
        held = set(blobs.digests())
        now = time.time()
        assert await gateway.collect_packages(now) == ([], [])  # both are younger than the grace
        packages, gone = await gateway.collect_packages(now + 120)
        assert packages == [unused]
        # Only the blob of its own handler.py goes: data.bin is the used package's too.
        used_blobs = {f["digest"] for f in manifest_of(make_package("used"))["files"]}
        own = {f["digest"] for f in manifest_of(make_package("unused"))["files"]} - used_blobs
        assert set(gone) == own and set(blobs.digests()) == held - own
        assert (await env.client.get(f"/system/packages/{unused}")).status_code == 404
        assert (await env.client.get(f"/system/packages/{used}")).status_code == 200
        # Once its function is deleted, the other goes too, and every blob but the empty one.
        await env.client.request("DELETE", "/system/functions", json={"functionName": "user"})
        assert (await gateway.collect_packages(now + 120))[0] == [used]
        assert set(blobs.digests()) == {EMPTY_DIGEST}

    run(tmp_path, body, package_grace_s=60.0)


def test_the_collection_keeps_a_package_a_function_in_etcd_names_that_the_mirror_lacks(tmp_path: Path) -> None:
    """Another gateway's function, which this gateway's mirror does not hold (its watch lagging
    past the grace): its package is in use all the same."""

    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        used = await env.upload(make_package("used"))
        await age(env, used, time.time() - 1000)
        spec = {"name": "theirs", "package_digest": used, "memory_mb": 100}
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        gateway.functions.pop("theirs")  # the mirror lags
        assert (await gateway.collect_packages(time.time() + 120))[0] == []
        assert (await env.client.get(f"/system/packages/{used}")).status_code == 200

    run(tmp_path, body, package_grace_s=60.0)


def test_a_package_its_function_left_keeps_its_grace_from_the_change(tmp_path: Path) -> None:
    """An update to another package (or a delete) starts the old package's grace anew: calls that
    arrived before the change may still run it, and a node fetch it, however old the package is."""

    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        first, second = await env.upload(make_package("first")), await env.upload(make_package("second"))
        await age(env, first, time.time() - 1000)  # uploaded long ago
        spec = {"name": "fn", "package_digest": first, "memory_mb": 100}
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        now = time.time()
        assert (await env.client.put("/system/functions", json={**spec, "package_digest": second})).status_code == 202
        assert (await gateway.collect_packages(now + 30))[0] == []  # within the grace since the update
        assert (await gateway.collect_packages(now + 120))[0] == [first]
        # A delete: the same for the package it named.
        await age(env, second, 0.0)
        now = time.time()
        await env.client.request("DELETE", "/system/functions", json={"functionName": "fn"})
        assert (await gateway.collect_packages(now + 30))[0] == []
        assert (await gateway.collect_packages(now + 120))[0] == [second]

    run(tmp_path, body, package_grace_s=60.0)


def test_a_deploy_makes_the_package_it_names_young_again_for_the_collection(tmp_path: Path) -> None:
    """A package registered long ago and named by no function yet: a deploy (or an update) that
    names it must keep it from a collection that runs meanwhile with a mirror that does not hold
    the function yet (another gateway's, or this one's read before the deploy), or the function
    is deployed with its package deleted: listed, and never runnable."""

    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        old, older = await env.upload(make_package("old")), await env.upload(make_package("older"))
        await age(env, old, time.time() - 1000)
        await age(env, older, time.time() - 1000)
        spec = {"name": "fn", "package_digest": old, "memory_mb": 100}
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        # The collection of a gateway whose mirror lags: it sees no function naming either package.
        assert (await gateway.artifacts.collect(set(), time.time()))[0] == [older]
        assert (await env.client.get(f"/system/packages/{old}")).status_code == 200
        older = await env.upload(make_package("older"))
        await age(env, older, time.time() - 1000)
        assert (await env.client.put("/system/functions", json={**spec, "package_digest": older})).status_code == 202
        assert (await gateway.artifacts.collect(set(), time.time()))[0] == []
        assert (await env.client.get(f"/system/packages/{older}")).status_code == 200

    run(tmp_path, body, package_grace_s=60.0)


async def age(env: Env, digest: str, created_unix_s: float) -> None:
    """Make the package's record say it was registered at `created_unix_s`."""
    key = env.keys.package(digest)
    kv = await env.store.get(key)
    assert kv is not None
    await env.store.put(key, json.dumps({**json.loads(kv.value), "created_unix_s": created_unix_s}).encode())


async def eventually(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.01)


# --- function CRUD ------------------------------------------------------------------------


def test_deploy_list_describe_update_delete_through_the_store(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {
            "name": "resnet",
            "package_digest": digest,
            "memory_mb": 700,
            "timeout_s": 30,
            "labels": {"team": "vision"},
        }
        deployed = await env.client.post("/system/functions", json=spec)
        assert deployed.status_code == 202, deployed.text
        model = FunctionSpec.from_dict(spec).model
        assert deployed.json() == {"name": "resnet", "model": model}
        assert model == f"resnet@{digest.removeprefix('sha256:')[:12]}"

        # What lands in the store: the full spec, defaults filled in, under functions/NAME only.
        assert await env.stored_spec("resnet") == {
            "name": "resnet",
            "package_digest": digest,
            "memory_mb": 700,
            "gpu": "any",
            "batch_size": DEFAULT_BATCH_SIZE,
            "timeout_s": 30.0,
            "labels": {"team": "vision"},
            "environment": {},
            "max_batch_size": 1,
            "max_batch_wait_ms": 0.0,
            "public": False,
            "slo_ms": None,
            "warmup": True,
        }
        assert [kv.key for kv in await env.store.get_prefix(env.keys.functions)] == [env.keys.function("resnet")]

        listed = (await env.client.get("/system/functions")).json()
        assert [f["name"] for f in listed] == ["resnet"]
        described = (await env.client.get("/system/function/resnet")).json()
        assert described == listed[0]
        assert described["model"] == model
        assert described["memory_mb"] == 700 and described["timeout_s"] == 30.0
        assert described["labels"] == {"team": "vision"}
        assert described["invocationCount"] == 0
        assert described["replicas"] == 0 and described["gpus"] == []

        # Replicas come from the store (the scheduler writes them).
        await env.store.put(env.keys.replicas(model), json.dumps(["node0/gpu0"]).encode())
        described = (await env.client.get("/system/function/resnet")).json()
        assert described["replicas"] == 1 and described["gpus"] == ["node0/gpu0"]

        # A second deploy under the same name is refused and leaves the stored spec alone.
        before = await env.store.get(env.keys.function("resnet"))
        conflict = await env.client.post("/system/functions", json={**spec, "memory_mb": 1})
        assert_error(conflict, 409, "'resnet'", "PUT /system/functions")
        assert await env.store.get(env.keys.function("resnet")) == before

        # PUT replaces the whole spec.
        new_digest = await env.upload(make_package("2"))
        updated = await env.client.put(
            "/system/functions", json={"name": "resnet", "package_digest": new_digest, "memory_mb": 900}
        )
        assert updated.status_code == 202, updated.text
        new_model = f"resnet@{new_digest.removeprefix('sha256:')[:12]}"
        assert updated.json() == {"name": "resnet", "model": new_model}
        stored = await env.stored_spec("resnet")
        assert stored is not None
        assert stored["package_digest"] == new_digest and stored["memory_mb"] == 900
        assert stored["labels"] == {} and stored["timeout_s"] == 60.0
        described = (await env.client.get("/system/function/resnet")).json()
        assert described["model"] == new_model and described["memory_mb"] == 900

        missing = await env.client.put("/system/functions", json={**spec, "name": "ghost"})
        assert_error(missing, 404, "'ghost'", "POST /system/functions")
        assert await env.stored_spec("ghost") is None

        deleted = await env.client.request("DELETE", "/system/functions", json={"functionName": "resnet"})
        assert deleted.status_code == 202 and deleted.json() == {"name": "resnet", "deleted": True}
        assert await env.store.get_prefix(env.keys.functions) == []
        assert (await env.client.get("/system/functions")).json() == []
        assert_error(await env.client.get("/system/function/resnet"), 404, "'resnet'", "GET /system/functions")
        again = await env.client.request("DELETE", "/system/functions", json={"functionName": "resnet"})
        assert_error(again, 404, "'resnet'")

    run(tmp_path, body)


def test_functions_written_by_others_show_up_through_the_watch(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = FunctionSpec(name="from-cli", package_digest=digest, memory_mb=10)
        await env.store.put(env.keys.function("from-cli"), spec.to_json())
        await env.store.put(env.keys.function("garbage"), b"{not json")  # ignored, not fatal
        for _ in range(100):
            if (await env.client.get("/system/function/from-cli")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert [f["name"] for f in (await env.client.get("/system/functions")).json()] == ["from-cli"]
        await env.store.delete(env.keys.function("from-cli"))
        for _ in range(100):
            if (await env.client.get("/system/function/from-cli")).status_code == 404:
                break
            await asyncio.sleep(0.01)
        assert (await env.client.get("/system/functions")).json() == []

    run(tmp_path, body)


def test_the_overview_of_a_function_updated_through_this_gateway_to_a_new_package_starts_afresh(
    tmp_path: Path,
) -> None:
    # The PUT's own gateway mirrored the new spec before its watch event came, which then saw no
    # change: the old package's hits, misses and latency went on mixing into the new one's.
    async def body(env: Env) -> None:
        await env.deploy("f", memory_mb=10)
        gateway = env.app.state.gateway
        gateway.stats.record("f", 200, 0.5, hit=False)
        new_digest = await env.upload(make_package("2"))
        answer = await env.client.put(
            "/system/functions", json={"name": "f", "package_digest": new_digest, "memory_mb": 10}
        )
        assert answer.status_code == 202, answer.text
        await eventually(lambda: gateway.functions["f"].package_digest == new_digest)
        assert gateway.stats.summary("f")["calls"] == 0
        gateway.stats.record("f", 200, 0.5, hit=True)
        same = await env.client.put(
            "/system/functions", json={"name": "f", "package_digest": new_digest, "memory_mb": 20}
        )
        assert same.status_code == 202, same.text
        assert gateway.stats.summary("f")["calls"] == 1  # the same package: its figures go on

    run(tmp_path, body)


class LaggingWatches(MemoryStore):
    """A MemoryStore whose watches deliver the functions' events one at a time, each once let
    through (`let_through`): etcd's watch lagging behind the answers to the writes."""

    def __init__(self, functions_prefix: str) -> None:
        super().__init__()
        self.functions_prefix = functions_prefix
        self.gate = asyncio.Semaphore(0)
        self.handled = 0  # functions' events the watcher took in

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Any:
        async for event in super().watch_prefix(prefix, start_revision=start_revision):
            if not event.key.startswith(self.functions_prefix):
                yield event
                continue
            await self.gate.acquire()
            yield event
            self.handled += 1  # (the watcher asked for the next: this one is handled)

    async def let_through(self, events: int) -> None:
        target = self.handled + events
        for _ in range(events):
            self.gate.release()
        await eventually(lambda: self.handled >= target)


async def deployed_with_a_second_package(env: Env) -> tuple[dict[str, Any], str, str]:
    """Function "fn" deployed on package "first", and package "second" uploaded: (its spec, the
    two packages' digests)."""
    first, second = await env.upload(make_package("first")), await env.upload(make_package("second"))
    spec = {"name": "fn", "package_digest": first, "memory_mb": 100}
    assert (await env.client.post("/system/functions", json=spec)).status_code == 202
    return spec, first, second


def test_a_lagging_watch_does_not_take_the_mirror_back_to_a_version_older_than_a_write(tmp_path: Path) -> None:
    """A function deployed, then updated to another package through this gateway: once the update
    is answered, calls run the new package, even while the watch still brings the deploy's event;
    once a delete is answered, the update's event does not bring the function back."""
    store = LaggingWatches(Keys("/unit").functions)

    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        spec, first, second = await deployed_with_a_second_package(env)
        assert (await env.client.put("/system/functions", json={**spec, "package_digest": second})).status_code == 202
        await store.let_through(1)  # the deploy's event
        assert gateway.functions["fn"].package_digest == second
        assert (await env.client.get("/system/function/fn")).json()["package_digest"] == second
        await env.client.request("DELETE", "/system/functions", json={"functionName": "fn"})
        await store.let_through(1)  # the update's event
        assert "fn" not in gateway.functions
        assert (await env.client.get("/system/function/fn")).status_code == 404
        # Deployed again, while the watch has not brought the delete yet.
        assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        await store.let_through(1)  # the delete's event
        assert gateway.functions["fn"].package_digest == first
        await store.let_through(1)  # the new deploy's own
        assert gateway.functions["fn"].package_digest == first

    run(tmp_path, body, store=store)


def test_a_relist_older_than_a_write_keeps_the_write(tmp_path: Path) -> None:
    """A re-list (after a compaction) whose snapshot predates an update answered through this
    gateway keeps the update; one taken after it is the mirror's."""
    store = LaggingWatches(Keys("/unit").functions)

    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        spec, _, second = await deployed_with_a_second_package(env)
        await store.let_through(1)
        snapshot, revision = await store.get_prefix(env.keys.functions), await store.revision()
        assert (await env.client.put("/system/functions", json={**spec, "package_digest": second})).status_code == 202
        gateway._functions_listed(snapshot, revision)  # the list_and_watch's, from before the update
        assert gateway.functions["fn"].package_digest == second
        await env.client.request("DELETE", "/system/functions", json={"functionName": "fn"})
        gateway._functions_listed(snapshot, revision)
        assert "fn" not in gateway.functions
        later = await store.get_prefix(env.keys.functions), await store.revision()
        gateway._functions_listed(*later)  # after both writes: the list is the registry
        assert "fn" not in gateway.functions and gateway._function_floors == {}

    run(tmp_path, body, store=store)


def test_a_function_spec_under_another_functions_key_is_not_mirrored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # fn-b's spec put (by hand) at fn-a's key was mirrored as fn-b: deleting the key took out fn-a
    # (nobody), and fn-b was answered until a re-list.
    other = FunctionSpec(name="fn-b", package_digest="sha256:" + "b" * 64, memory_mb=1000)

    async def body(env: Env) -> None:
        gateway, key = env.app.state.gateway, env.keys.function("fn-a")
        gateway._functions_listed([KeyValue(key, other.to_json(), 3, 3, 0)], 3)
        assert gateway.functions == {}
        gateway._function_changed(WatchEvent("put", key, other.to_json(), 4))
        assert gateway.functions == {}
        assert_error(await env.client.get("/system/function/fn-b"), 404)
        assert caplog.text.count(f"ignoring invalid function spec at {key}: it names function 'fn-b'") == 2

    run(tmp_path, body)


def test_a_function_whose_spec_is_overwritten_with_an_invalid_one_is_taken_out(tmp_path: Path) -> None:
    # The invalid value was ignored and the old spec answered until a re-list (which finds no
    # function there); the watch now does as the re-list does.
    spec = FunctionSpec(name="fn-a", package_digest="sha256:" + "a" * 64, memory_mb=1000)

    async def body(env: Env) -> None:
        gateway, key = env.app.state.gateway, env.keys.function("fn-a")
        gateway._function_changed(WatchEvent("put", key, spec.to_json(), 3))
        assert list(gateway.functions) == ["fn-a"]
        gateway._function_changed(WatchEvent("put", key, b"{not json", 4))
        assert gateway.functions == {}
        assert_error(await env.client.get("/system/function/fn-a"), 404)

    run(tmp_path, body)


class CountedGets(MemoryStore):
    """A MemoryStore that counts its single-key reads (each a round trip to etcd)."""

    gets = 0

    async def get(self, key: str) -> Any:
        self.gets += 1
        return await super().get(key)


def test_listing_functions_reads_the_replicas_of_all_in_one_range_read(tmp_path: Path) -> None:
    """GET /system/functions answers with a number of etcd round trips that does not grow with
    the functions deployed (it read each function's replicas key in turn, on every listing)."""
    store = CountedGets()

    async def body(env: Env) -> None:
        digest = await env.upload()
        for i in range(8):
            spec = {"name": f"fn{i}", "package_digest": digest, "memory_mb": 100}
            assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        model = env.app.state.gateway.functions["fn3"].model
        await env.store.put(env.keys.replicas(model), json.dumps(["node0/gpu0", "node1/gpu0"]).encode())
        await env.store.put(env.keys.replicas(env.app.state.gateway.functions["fn4"].model), b"not json")
        store.gets = 0
        listed = (await env.client.get("/system/functions")).json()
        assert store.gets <= 1
        assert [f["replicas"] for f in listed] == [0, 0, 0, 2, 0, 0, 0, 0]
        assert listed[3]["gpus"] == ["node0/gpu0", "node1/gpu0"]
        described = (await env.client.get("/system/function/fn3")).json()
        assert described["replicas"] == 2 and described["gpus"] == ["node0/gpu0", "node1/gpu0"]

    run(tmp_path, body, store=store)


def test_functions_in_the_store_at_start_are_served(tmp_path: Path) -> None:
    async def main() -> None:
        store = MemoryStore()
        keys = Keys()
        spec = FunctionSpec(name="early", package_digest=sha256(b"p"), memory_mb=10)
        await store.put(keys.function("early"), spec.to_json())
        app = create_app(store, GatewayConfig(state_dir=tmp_path, scheduler_address=UNREACHABLE_SCHEDULER))
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c,
        ):
            response = await c.get("/system/function/early")
            assert response.status_code == 200 and response.json()["model"] == spec.model
            assert sample((await c.get("/metrics")).text, "gateway_functions_deployed") == 1
        await store.close()

    asyncio.run(main())


def test_openfaas_field_aliases(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        response = await env.client.post(
            "/system/functions",
            json={"service": "faas-style", "package_digest": digest, "memory_mb": 64, "envVars": {"MODE": "fast"}},
        )
        assert response.status_code == 202, response.text
        stored = await env.stored_spec("faas-style")
        assert stored is not None
        assert stored["name"] == "faas-style" and stored["environment"] == {"MODE": "fast"}
        assert "service" not in stored and "envVars" not in stored
        described = (await env.client.get("/system/function/faas-style")).json()
        assert described["environment"] == {"MODE": "fast"}

        # PUT takes the aliases too.
        response = await env.client.put(
            "/system/functions",
            json={"service": "faas-style", "package_digest": digest, "memory_mb": 64, "envVars": {"MODE": "slow"}},
        )
        assert response.status_code == 202, response.text
        stored = await env.stored_spec("faas-style")
        assert stored is not None and stored["environment"] == {"MODE": "slow"}

        # The gpufaas name wins when both are given; the alias is then an unknown field.
        both = await env.client.post(
            "/system/functions", json={"name": "a", "service": "b", "package_digest": digest, "memory_mb": 1}
        )
        assert_error(both, 400, "service", "unknown field")

    run(tmp_path, body)


def test_spec_validation_errors_name_the_field(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        good = {"name": "ok", "package_digest": digest, "memory_mb": 10}
        cases: list[tuple[Any, tuple[str, ...]]] = [
            ({**good, "name": "Bad_Name"}, ("name:", "'Bad_Name'", "lower-case")),
            ({**good, "name": "-x"}, ("name:", "'-x'")),
            ({**good, "name": "a" * 64}, ("name:", "63 characters")),
            ({k: v for k, v in good.items() if k != "name"}, ("name: required",)),
            ({**good, "package_digest": "latest"}, ("package_digest:", "'latest'", "64 hex digits")),
            ({k: v for k, v in good.items() if k != "memory_mb"}, ("memory_mb: required",)),
            ({**good, "memory_mb": 0}, ("memory_mb:", "positive whole number", "0")),
            ({**good, "memory_mb": "10"}, ("memory_mb:", "'10'")),
            ({**good, "memory_mb": True}, ("memory_mb:", "True")),
            ({**good, "batch_size": -2}, ("batch_size:", "-2")),
            ({**good, "timeout_s": 0}, ("timeout_s:", "(0, 3600]")),
            ({**good, "timeout_s": 3601}, ("timeout_s:", "3601")),
            ({**good, "labels": {"a": 1}}, ("labels:", "map of strings")),
            ({**good, "environment": ["A=1"]}, ("environment:", "map of variable names")),
            ({**good, "replicas": 3}, ("replicas:", "unknown field", "memory_mb")),
            (["not", "an", "object"], ("function spec: expected an object",)),
        ]
        for spec, fragments in cases:
            for method in ("POST", "PUT"):
                response = await env.client.request(method, "/system/functions", json=spec)
                assert_error(response, 400, *fragments)
        assert await env.store.get_prefix(env.keys.functions) == []
        # A lone surrogate (valid JSON, no UTF-8 for it) would be stored as U+FFFD, not as sent:
        # another model than the one answered, and an environment other than the one asked for.
        not_utf8: list[tuple[dict[str, Any], str]] = [
            ({**good, "labels": {"\ud800": "x"}}, "labels:"),
            ({**good, "labels": {"x": "\udce9"}}, "labels:"),
            ({**good, "environment": {"\ud800": "x"}}, "environment:"),
            ({**good, "environment": {"X": "\udfff"}}, "environment:"),
        ]
        for spec, fragment in not_utf8:
            raw = json.dumps(spec).encode()  # (ensure_ascii: the surrogate travels as its escape)
            for method in ("POST", "PUT"):
                response = await env.client.request(
                    method, "/system/functions", content=raw, headers={"content-type": "application/json"}
                )
                assert_error(response, 400, fragment, "UTF-8")
        assert await env.store.get_prefix(env.keys.functions) == []

        # A well-formed spec whose package was never uploaded.
        never = "sha256:" + "0" * 64
        response = await env.client.post("/system/functions", json={**good, "package_digest": never})
        assert_error(response, 409, never, "not uploaded", "POST it to /system/packages")
        # Bodies that are not JSON.
        for raw in (b"{not json", b"", b"\xff\xfe"):
            response = await env.client.post(
                "/system/functions", content=raw, headers={"content-type": "application/json"}
            )
            assert_error(response, 400, "JSON function spec")
        assert await env.store.get_prefix(env.keys.functions) == []
        # A form or text body is not read as JSON (a browser sends those cross-site unasked): the
        # answer says what to send instead.
        for content_type in ("application/x-www-form-urlencoded", "text/plain"):
            response = await env.client.post(
                "/system/functions", content=json.dumps(good).encode(), headers={"content-type": content_type}
            )
            assert_error(response, 400, content_type, "Content-Type: application/json")
        # FastAPI's own refusals come in the same form as the gateway's.
        assert_error(await env.client.get("/system/nowhere"), 404)
        assert_error(await env.client.patch("/system/functions", json=good), 405)

        # DELETE bodies.
        for raw_body in (b"nope", b'"x"', b"{}", b'{"functionName": 3}'):
            response = await env.client.request("DELETE", "/system/functions", content=raw_body)
            assert_error(response, 400, '{"functionName": "NAME"}')
        response = await env.client.request("DELETE", "/system/functions", json={"functionName": "a/b"})
        assert_error(response, 400, "'a/b'", "not a valid function name")
        response = await env.client.request("DELETE", "/system/functions", json={"functionName": "nope"})
        assert_error(response, 404, "'nope'")
        # OpenFaaS clients may say more (a namespace); a body without a content type is read as JSON.
        extra = await env.client.request("DELETE", "/system/functions", json={"functionName": "nope", "namespace": "x"})
        assert_error(extra, 404, "'nope'")
        bare = await env.client.request("DELETE", "/system/functions", content=b'{"functionName": "nope"}')
        assert_error(bare, 404, "'nope'")

    run(tmp_path, body)


def test_an_error_quotes_a_refused_value_cut_short_not_whole(tmp_path: Path) -> None:
    """A value of 100,000 characters (10,000 in a URL) is refused in one short line, not echoed whole."""

    async def body(env: Env) -> None:
        huge = "x" * 100_000
        refused = (
            (await env.client.request("DELETE", "/system/functions", json={"functionName": huge}), "not a valid"),
            (await env.client.post("/system/blobs/missing", json={"blobs": {huge: 1}}), "the body must be"),
            (await env.client.put(f"/system/blobs/sha256:{'0' * 64}?size={huge[:10_000]}", content=b"x"), "size:"),
        )
        for response, fragment in refused:
            message = assert_error(response, 400, fragment, "xxx...")
            assert len(message) < 300, message[:300]

    run(tmp_path, body)


def test_datastore_outage_is_a_503_naming_etcd(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        env.store.set_reachable(False)
        try:
            response = await env.client.post(
                "/system/functions", json={"name": "x", "package_digest": digest, "memory_mb": 1}
            )
            assert_error(response, 503, "etcd", "unreachable")
        finally:
            env.store.set_reachable(True)
        response = await env.client.post(
            "/system/functions", json={"name": "x", "package_digest": digest, "memory_mb": 1}
        )
        assert response.status_code == 202, response.text

    run(tmp_path, body)


# --- invocation without a scheduler ---------------------------------------------------------


def test_invoke_while_the_scheduler_is_unreachable(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        await env.deploy("lonely", memory_mb=1, timeout_s=2)

        started = asyncio.get_running_loop().time()
        response = await env.client.post("/function/lonely", json={"x": 1}, headers={"X-Call-Id": "call-1"})
        elapsed = asyncio.get_running_loop().time() - started
        assert_error(response, 503, "scheduler is unreachable")
        assert response.headers["x-call-id"] == "call-1"
        assert "retry-after" not in response.headers
        # It waited for a scheduler to (re)connect for scheduler_wait_s, not for the call's timeout.
        assert 0.3 <= elapsed < 1.5, f"took {elapsed:.2f} s; scheduler_wait_s is 0.3 s"

        assert_error(await env.client.get("/system/gpus"), 503, "scheduler is unreachable")
        assert_error(await env.client.get("/system/queue"), 503, "scheduler is unreachable")

        metrics = (await env.client.get("/metrics")).text
        assert sample(metrics, "gateway_function_invocation_total", function_name="lonely", code="503") == 1
        assert sample(metrics, "gateway_functions_seconds_count", function_name="lonely", code="503") == 1
        assert sample(metrics, "gateway_functions_deployed") == 1
        described = (await env.client.get("/system/function/lonely")).json()
        assert described["invocationCount"] == 1

    run(tmp_path, body, scheduler_wait_s=0.3)


def test_a_deleted_functions_series_leave_the_metrics(tmp_path: Path) -> None:
    # A cluster that deploys short-lived functions (one per CI run, per notebook...) grew the
    # gateway's /metrics by a counter and a histogram per function and status it ever ran, for
    # as long as the gateway ran: 10,000 such functions a month made a scrape of 400,000 lines.
    async def body(env: Env) -> None:
        gateway = env.app.state.gateway
        for name in ("short", "kept"):
            await env.deploy(name, memory_mb=1)
            gateway.stats.record(name, 200, 0.01, hit=True)
            gateway.stats.record(name, 503, 0.3)
        deleted = await env.client.request("DELETE", "/system/functions", json={"functionName": "short"})
        assert deleted.status_code == 202, deleted.text
        gateway.stats.record("short", 200, 0.02, hit=False)  # a call that was under way, answered since
        metrics = (await env.client.get("/metrics")).text
        assert 'function_name="short"' not in metrics
        assert sample(metrics, "gateway_function_invocation_total", function_name="kept") == 2
        assert sample(metrics, "gateway_functions_seconds_count", function_name="kept", code="503") == 1
        # Deployed again under the name: its calls count from nought, as a new function's do.
        await env.deploy("short", memory_mb=1)
        gateway.stats.record("short", 200, 0.01, hit=True)
        metrics = (await env.client.get("/metrics")).text
        assert sample(metrics, "gateway_function_invocation_total", function_name="short") == 1
        assert (await env.client.get("/system/function/short")).json()["invocationCount"] == 1

    run(tmp_path, body)


def test_invoke_errors_answered_by_the_gateway_itself(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        await env.deploy("small", memory_mb=1, timeout_s=2)

        assert_error(await env.client.post("/function/nope", json={}), 404, "'nope'", "deploy")
        # Over the payload limit: declared, and streamed without a Content-Length.
        assert_error(await env.client.post("/function/small", content=b"x" * 1025), 413, "1024 bytes")

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * 500

        assert_error(await env.client.post("/function/small", content=stream()), 413, "1024 bytes")
        # None of these reached the scheduler (which would have answered 503). (Declared JSON that
        # does not parse is the worker's to say, the only one that parses payloads: see the
        # integration tests.)
        assert sample((await env.client.get("/metrics")).text, "gateway_function_invocation_total") == 0

    run(tmp_path, body, max_payload_bytes=1024)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "HEAD"])
def test_a_function_called_with_another_method_than_post_is_a_405_saying_post(tmp_path: Path, method: str) -> None:
    # A GET (curl without -d, OpenFaaS's GET invocations) was answered 403 "use the admin
    # credentials" with the invoke token, then 404 "Not Found" with the admin's: a function that is
    # deployed, and a caller who holds the right to call it, told neither.
    async def body(env: Env) -> None:
        await env.deploy("small", memory_mb=1, timeout_s=2)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=env.app), base_url="http://gateway") as client:
            invoker = {"Authorization": f"Bearer {INVOKE_TOKEN}"}
            for response in [
                await client.request(method, "/function/small", headers=invoker),
                await client.request(method, "/function/small"),  # no credential: no function is told of
                await env.client.request(method, "/function/small"),  # the admin's
            ]:
                assert response.status_code == 405, response.text
                assert response.headers["allow"] == "POST"
                if method != "HEAD":  # (a HEAD's answer has no body)
                    assert_error(response, 405, "POST /function/small")
        assert sample((await env.client.get("/metrics")).text, "gateway_function_invocation_total") == 0

    run(tmp_path, body)


def test_a_blob_batch_is_bounded_by_what_it_unpacks_to_not_by_what_it_weighs(tmp_path: Path) -> None:
    """A batch of blobs that gzip shrinks to almost nothing (zeros) is refused once its members'
    sizes pass the limit, read from their headers: 413, the rest not unpacked."""

    async def body(env: Env) -> None:
        env.app.state.gateway.artifacts.max_batch_bytes = 100_000
        blobs = [bytes(40_000) + bytes([i]) for i in range(3)]  # 3 x 40 KB: over 100 KB together
        batch = tar_gz([(member(sha256(blob)), blob) for blob in blobs])
        assert len(batch) < 2_000
        headers = {"content-type": "application/vnd.gpufaas.blobs+gzip"}
        response = await env.client.post("/system/blobs", content=batch, headers=headers)
        assert_error(response, 413, "unpacks to more than 100000 bytes")
        fits = await env.client.post(
            "/system/blobs", content=tar_gz([(member(sha256(b)), b) for b in blobs[:2]]), headers=headers
        )
        assert fits.status_code == 201 and len(fits.json()["stored"]) == 2

    run(tmp_path, body)


def test_members_that_carry_no_bytes_are_counted_in_a_package_and_in_a_blob_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories in a package, empty blobs in a batch: each counts against the members limit (413)."""
    monkeypatch.setattr(packages, "MAX_MEMBERS", 50)
    monkeypatch.setattr(artifacts, "MAX_BATCH_MEMBERS", 50)

    async def body(env: Env) -> None:
        dirs = [(member(f"d{i}", tarfile.DIRTYPE), b"") for i in range(60)]
        response = await env.client.post("/system/packages", content=tar_gz([HANDLER, *dirs]))
        assert_error(response, 413, "more than 50 members")
        headers = {"content-type": "application/vnd.gpufaas.blobs+gzip"}
        batch = tar_gz([(member(sha256(b"")), b"") for _ in range(60)])
        assert_error(await env.client.post("/system/blobs", content=batch, headers=headers), 413, "more than 50")
        assert (await env.client.post("/system/packages", content=tar_gz([HANDLER, *dirs[:40]]))).status_code == 201

    run(tmp_path, body)


def test_a_manifest_nested_too_deep_is_a_400(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        headers = {"content-type": "application/json"}
        response = await env.client.post("/system/packages", content=b"[" * 100_000, headers=headers)
        assert_error(response, 400, "not valid JSON")

    run(tmp_path, body)


def test_a_manifest_path_that_is_not_utf8_is_a_400(tmp_path: Path) -> None:
    """A lone surrogate (valid JSON, no UTF-8 for it) in a manifest's path is refused as the path
    it is, not answered 500 by the UnicodeEncodeError of measuring it."""

    async def body(env: Env) -> None:
        entry = {"path": "\ud800.py", "digest": EMPTY_DIGEST, "size": 0, "mode": 0o644}
        manifest = json.dumps({"version": 1, "files": [entry]}).encode()  # (ensure_ascii: "\\ud800")
        headers = {"content-type": "application/json"}
        response = await env.client.post("/system/packages", content=manifest, headers=headers)
        assert_error(response, 400, "not UTF-8")
        # An archive whose member is named in Latin-1 (Python reads its byte 0xe9 as "\udce9").
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
            for info, data in (HANDLER, (member("caf\xe9.bin"), b"abc")):
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        assert_error(await env.client.post("/system/packages", content=buffer.getvalue()), 400, "not UTF-8")

    run(tmp_path, body)


def test_a_manifest_body_larger_than_its_limit_is_refused_as_it_arrives(tmp_path: Path) -> None:
    """A body sent as a manifest (application/json: a .tar.gz sent with the wrong content type, say)
    is refused once past the manifest's 4 MiB, not read whole into memory first (GBs for a model)."""

    async def body(env: Env) -> None:
        sent = 0

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal sent
            for _ in range(64):  # 64 MiB, with no Content-Length (chunked)
                sent += 1 << 20
                yield b" " * (1 << 20)

        headers = {"content-type": "application/json"}
        response = await env.client.post("/system/packages", content=chunks(), headers=headers)
        assert_error(response, 413, "4 MiB")
        assert sent <= 8 << 20
        declared = {**headers, "content-length": str(1 << 30)}
        response = await env.client.post("/system/packages", content=b"{}", headers=declared)
        assert_error(response, 413, "4 MiB")

    run(tmp_path, body)


def test_a_gateway_reached_over_tls_offers_no_plain_http_blob_server_for_uploads(tmp_path: Path) -> None:
    """Clients speak plain HTTP to the blob server, with the admin password: a gateway whose public
    URL is https (its own certificate, or a proxy's) does not offer it, and they upload through the API."""
    wanted = {"blobs": {sha256(b"x"): 1}}

    async def body(env: Env) -> None:
        answer = (await env.client.post("/system/blobs/missing", json=wanted)).json()
        https = env.app.state.gateway.config.public_url.startswith("https:")
        assert (answer["upload_url"] is None) == https, answer
        assert answer["missing"] == [sha256(b"x")]

    run(tmp_path / "http", body)
    run(tmp_path / "https", body, public_url="https://gw.example:8443")


def test_a_delete_that_took_is_answered_so_when_the_packages_grace_cannot_be_started(tmp_path: Path) -> None:
    # After the delete is committed, the package's grace is started again (a read and a put of its
    # record); etcd failing there answered 503 for a delete that took (a retry then got 404).
    async def body(env: Env) -> None:
        await env.deploy("fn", memory_mb=100)
        real_get = env.store.get

        async def get(key: str) -> Any:
            if key.startswith(env.keys.packages):
                raise StoreError("etcd unavailable")
            return await real_get(key)

        env.store.get = get  # type: ignore[method-assign]
        response = await env.client.request("DELETE", "/system/functions", json={"functionName": "fn"})
        env.store.get = real_get  # type: ignore[method-assign]
        assert response.status_code == 202, response.text
        assert await env.stored_spec("fn") is None

    run(tmp_path, body)


def test_a_blob_batch_waits_out_another_transfer_of_one_of_its_blobs(tmp_path: Path) -> None:
    """Two deploys at once sharing a small file (the same handler): the second batch finds the
    blob being written by the first, and waits for it rather than be refused; one whose other
    transfer breaks off writes the blob itself."""
    shared, other = b"def load(d):\n    return 1\n", b"labels\n"
    headers = {"content-type": "application/vnd.gpufaas.blobs+gzip"}

    async def body(env: Env) -> None:
        blobs = env.app.state.gateway.artifacts.blobs
        for finish in (True, False):
            data = shared + bytes([finish])
            writer = blobs.writer(sha256(data), len(data))  # the other deploy's batch, under way

            async def other_transfer_ends(writer: Any = writer, data: bytes = data, finish: bool = finish) -> None:
                await asyncio.sleep(0.2)
                if finish:
                    writer.write(data)
                    writer.commit()
                writer.close()

            ending = asyncio.create_task(other_transfer_ends())
            batch = tar_gz([(member(sha256(data)), data), (member(sha256(other)), other)])
            response = await env.client.post("/system/blobs", content=batch, headers=headers)
            await ending
            assert response.status_code == 201, response.text
            assert response.json()["stored"] == {sha256(data): len(data), sha256(other): len(other)}
            assert blobs.has(sha256(data))

    run(tmp_path, body)


def test_spool_writes_every_byte_it_hashed_though_a_write_falls_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """writev may write fewer bytes than asked (a disk filling up); spool dropped the rest, and
    returned the size and digest of the bytes it hashed for a file that held fewer."""
    import os

    real_writev = os.writev

    def short(fd: int, buffers: list[bytes]) -> int:
        data = b"".join(buffers)
        return real_writev(fd, [data[: max(1, len(data) // 3)]])

    monkeypatch.setattr(artifacts.os, "writev", short)
    data = [bytes([n]) * 1000 for n in range(10)]

    async def chunks() -> AsyncIterator[bytes]:
        for chunk in data:
            yield chunk

    path, size, digest = asyncio.run(artifacts.spool(chunks(), tmp_path, 1 << 20))
    monkeypatch.undo()
    body = path.read_bytes()
    assert size == len(body) == 10_000 and digest == "sha256:" + hashlib.sha256(body).hexdigest()


def test_the_overview_asks_the_scheduler_for_the_queued_calls_it_shows_and_says_how_many_wait(
    tmp_path: Path,
) -> None:
    # Polled every second by each dashboard and `gpufaas top`: the whole queue (up to its capacity,
    # 10,000 by default) cost the scheduler's loop O(calls queued) at every poll, to show 20.
    asked: list[int] = []
    queued = [pb.QueuedCall(call_id=f"c{n}", function="f", model="m", waited_s=1.0) for n in range(30)]

    async def body(env: Env) -> None:
        async def cluster(timeout_s: float = 5.0, *, summary: bool = False, queue_limit: int = 0) -> pb.ClusterReply:
            asked.append(queue_limit)
            if len(asked) == 1:  # this gateway's scheduler: the calls asked for, and the length
                return pb.ClusterReply(queue=queued[:queue_limit], queue_length=5000, queue_capacity=10000)
            return pb.ClusterReply(queue=queued, queue_capacity=10000)  # one without `queue_length`

        env.app.state.gateway.router.cluster = cluster
        for length in (5000, 30):
            answer = await env.client.get("/system/overview")
            assert answer.status_code == 200, answer.text
            queue = answer.json()["queue"]
            assert (queue["length"], len(queue["calls"])) == (length, 20)
        assert asked == [20, 20]

    run(tmp_path, body)


def test_an_upload_whose_client_goes_silent_lets_go_of_the_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone without closing (its network dropped: a half-open connection) sends no more
    of its body and no end of it; the server has no read timeout on a body, so the upload held the
    blob's writer for hours and every retry heard 409 "being written by another transfer". Now
    the upload ends once no bytes came for BODY_IDLE_TIMEOUT_S, keeping what arrived."""
    monkeypatch.setattr(artifacts, "BODY_IDLE_TIMEOUT_S", 0.2)
    data = b"weights" * 1000
    digest = sha256(data)

    async def body(env: Env) -> None:
        gateway_artifacts = env.app.state.gateway.artifacts
        never = asyncio.Event()

        async def half_then_silent() -> AsyncIterator[bytes]:
            yield data[:3000]
            await never.wait()

        receiving = asyncio.ensure_future(gateway_artifacts.receive(digest, len(data), 0, half_then_silent()))
        done, _ = await asyncio.wait([receiving], timeout=20.0)  # (a guard against hanging, not a measure)
        never.set()
        assert receiving in done
        with pytest.raises(artifacts.UploadStalled, match="Upload-Offset: 3000"):
            receiving.result()
        blobs = gateway_artifacts.blobs
        assert not blobs.busy(digest) and blobs.partial_size(digest) == 3000

    run(tmp_path, body)


def test_a_request_body_that_stops_coming_is_not_spooled_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package or batch upload whose client went without closing held its request and its
    spool file (up to the package limit on disk) until TCP noticed, hours on. Now it ends once
    no bytes came for BODY_IDLE_TIMEOUT_S, its spool file removed."""
    monkeypatch.setattr(artifacts, "BODY_IDLE_TIMEOUT_S", 0.2)

    async def main() -> None:
        never = asyncio.Event()

        async def one_then_silent() -> AsyncIterator[bytes]:
            yield b"x" * 1000
            await never.wait()

        spooling = asyncio.ensure_future(artifacts.spool(one_then_silent(), tmp_path, 1 << 20))
        done, _ = await asyncio.wait([spooling], timeout=20.0)  # (a guard against hanging, not a measure)
        never.set()
        assert spooling in done
        with pytest.raises(TimeoutError):
            spooling.result()

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []
