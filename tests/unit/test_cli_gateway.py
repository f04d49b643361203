"""The CLI's side of a gateway (`gpufaas.cli.client`, `uploads`): which gateway and password a
command uses, what it sends where, and what it says when the other end is not a gateway."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpufaas.cli import uploads
from gpufaas.cli.client import GatewayClient
from gpufaas.packages import DigestCache


@pytest.fixture
def listener() -> Iterator[tuple[str, list[bytes]]]:
    """A raw TCP listener on loopback standing in for a blob server: its http:// URL, and what
    every connection to it sent (it answers nothing)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    heard: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    heard.append(conn.recv(65536))
                except OSError:
                    heard.append(b"")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", heard
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_a_deploy_to_an_https_gateway_sends_no_credential_to_its_plain_http_blob_server(
    tmp_path: Path, listener: tuple[str, list[bytes]]
) -> None:
    """The gateway advertises its blob server as http://; reached over https, the CLI uploads a
    large blob through the API instead, and the blob server hears nothing (no admin password)."""
    blob_url, heard = listener
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    (tmp_path / "fn" / "weights.bin").write_bytes(b"w" * (uploads.BATCH_MAX_BYTES + 1))
    scanned = uploads.scan([("fn", tmp_path / "fn")], DigestCache(None))
    blobs = scanned[0].manifest.blobs()
    through_api: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/system/blobs/missing":
            asked = list(json.loads(request.read())["blobs"])
            return httpx.Response(200, json={"missing": asked, "offsets": {}, "upload_url": blob_url})
        if request.method == "HEAD":
            return httpx.Response(404)
        if request.method == "PUT":
            request.read()
            through_api.append(path.rsplit("/", 1)[1])
            return httpx.Response(201, json={})
        if path == "/system/packages":
            return httpx.Response(201, json={"digest": scanned[0].manifest.digest})
        return httpx.Response(200, json={})

    client = GatewayClient("https://127.0.0.1:1", password="the-admin-password")
    client._client = httpx.Client(base_url=client.url, transport=httpx.MockTransport(gateway))
    report = uploads.upload(client, scanned)
    assert report.via_api
    assert len(through_api) == 1 and blobs[through_api[0]] > uploads.BATCH_MAX_BYTES
    assert heard == [], heard  # not a byte: no HEAD, no Authorization
