"""Schemathesis against a real gateway's OpenAPI document, a bounded number of examples per
operation: no answer is a server error, no request that is valid by the schema is refused (4xx
other than not found, conflict and credentials), and every write operation describes its body.

(Invocations, POST /function/{name}, are served before the FastAPI app and are not in the document:
a function's own 500 is the function's, and the other answers are covered by the gateway's tests.)
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, positive_data_acceptance

from gpufaas.credentials import read_secret
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.functions import FunctionSpec
from tests.integration.conftest import deploy

pytestmark = pytest.mark.integration
EXAMPLES_PER_OPERATION = 30
WRITES = {("post", "/system/functions"), ("put", "/system/functions"), ("delete", "/system/functions")}
WRITES |= {("post", "/system/packages"), ("post", "/system/blobs/missing"), ("put", "/system/blobs/{digest}")}
WRITES |= {("post", "/system/blobs")}


def _package(handler: bytes, extra: list[tuple[str, bytes]]) -> bytes:
    """A gzipped tar with handler.py at its top (what the schema's application/gzip body is)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in [("handler.py", handler), *extra]:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


# A package is a gzipped tar, which JSON Schema cannot describe: Schemathesis draws its bodies here.
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12).map(lambda n: f"{n}.txt")
schemathesis.openapi.media_type(
    "application/gzip",
    st.builds(_package, st.binary(max_size=256), st.lists(st.tuples(_names, st.binary(max_size=64)), max_size=3)),
)


# A manifest names blobs: Schemathesis draws well-formed ones (a handler.py and a few files), which
# the gateway answers 409 (their blobs are not uploaded) or 201 (they are).
_entries = st.lists(
    st.tuples(_names, st.binary(max_size=64), st.sampled_from([0o644, 0o755])), max_size=3, unique_by=lambda e: e[0]
)


def _manifest(handler: bytes, extra: list[tuple[str, bytes, int]]) -> bytes:
    files = [
        {"path": name, "digest": f"sha256:{hashlib.sha256(data).hexdigest()}", "size": len(data), "mode": mode}
        for name, data, mode in [("handler.py", handler, 0o644), *extra]
    ]
    return json.dumps({"version": 1, "files": files}).encode()


schemathesis.openapi.media_type(
    "application/vnd.gpufaas.manifest+json", st.builds(_manifest, st.binary(max_size=64), _entries)
)


def _blob_batch(blobs: list[bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for data in blobs:
            info = tarfile.TarInfo(f"sha256:{hashlib.sha256(data).hexdigest()}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


schemathesis.openapi.media_type(
    "application/vnd.gpufaas.blobs+gzip", st.builds(_blob_batch, st.lists(st.binary(max_size=64), max_size=3))
)


def _digest_of_the_body(case: Any) -> Any:
    """The `digest` parameter promises the body's sha256, and a blob's `size` its length
    (relations JSON Schema cannot state)."""
    if case.query and "digest" in case.query and isinstance(case.body, bytes):
        case.query["digest"] = f"sha256:{hashlib.sha256(case.body).hexdigest()}"
    if case.method == "PUT" and case.path.startswith("/system/blobs/"):
        body = case.body if isinstance(case.body, bytes) else b""
        case.body = body
        case.path_parameters["digest"] = f"sha256:{hashlib.sha256(body).hexdigest()}"
        case.query = {**(case.query or {}), "size": len(body)}
        if case.headers:
            case.headers.pop("Upload-Offset", None)
    return case


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("fuzz")
    cluster = LocalCluster(tmp / "cluster", nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    cluster.start()
    try:
        deploy(cluster, "echo", "echo_function", tmp, memory_mb=100)  # something to list, describe, delete
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def api_schema(cluster: LocalCluster) -> Any:
    document = httpx.get(f"{cluster.gateway_url}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(document)


def operations() -> list[Any]:
    """(operation, generation mode) pairs: every operation with valid data; those that take input
    also with data that breaks the schema (one without input has no invalid request to make)."""
    cases = []
    for path, methods in _document_paths().items():
        for method, operation in methods.items():
            label = f"{method.upper()} {path}"
            cases.append(pytest.param(label, GenerationMode.POSITIVE, id=f"{label}-positive"))
            if operation.get("parameters") or operation.get("requestBody"):
                cases.append(pytest.param(label, GenerationMode.NEGATIVE, id=f"{label}-negative"))
    return cases


def _document_paths() -> dict[str, Any]:
    """The gateway's paths, from the app itself (no cluster needed to list them)."""
    from gateway.app import GatewayConfig, create_app
    from tests.fakes import MemoryStore

    app = create_app(MemoryStore(), GatewayConfig(state_dir=Path("/nonexistent")))
    paths: dict[str, Any] = app.openapi()["paths"]
    return paths


@pytest.mark.parametrize(("operation", "mode"), operations())
def test_no_operation_answers_a_server_error(
    operation: str, mode: GenerationMode, api_schema: Any, cluster: LocalCluster
) -> None:
    """Valid requests (positive) and requests that break the schema (negative) alike."""
    # Schemathesis' own pytest plugin does not run on this pytest; its strategies and checks do.
    method, path = operation.split(" ", 1)
    strategy = api_schema[path][method].as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:
        strategy = strategy.map(_digest_of_the_body)
    checks = [not_a_server_error, *([positive_data_acceptance] if mode == GenerationMode.POSITIVE else [])]
    password = read_secret(cluster.secrets.admin_password)

    @given(case=strategy)
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        response = case.call(base_url=cluster.gateway_url, auth=("admin", password), timeout=30)
        case.validate_response(response, checks=checks)

    fuzz()


def test_every_write_operation_describes_its_request_body(cluster: LocalCluster) -> None:
    document = httpx.get(f"{cluster.gateway_url}/openapi.json", timeout=10).json()
    for method, path in sorted(WRITES):
        operation = document["paths"][path][method]
        content = operation["requestBody"]["content"]
        assert operation["requestBody"]["required"] is True
        assert content and all(content[media_type]["schema"] for media_type in content), (method, path)
    body = document["paths"]["/system/functions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    spec_schema = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert set(spec_schema["required"]) == {"name", "package_digest", "memory_mb"}
    assert spec_schema["additionalProperties"] is False
    # One schema: what the routes document is the pydantic model stack.yml and etcd use too.
    assert set(spec_schema["properties"]) == set(FunctionSpec.model_fields)
    assert spec_schema["properties"]["memory_mb"] == FunctionSpec.model_json_schema()["properties"]["memory_mb"]
    assert document["components"]["securitySchemes"]["admin"]["scheme"] == "basic"
    assert document["paths"]["/healthz"]["get"]["security"] == []


def test_the_fuzzed_cluster_still_serves(cluster: LocalCluster, tmp_path: Path) -> None:
    response = httpx.post(
        f"{cluster.gateway_url}/function/echo", json={"after": "fuzz"}, headers=cluster.invoke_headers, timeout=60
    )
    # The fuzzer may have deleted or replaced "echo" (DELETE/PUT are fair game): gone is fine, broken is not.
    assert response.status_code in (200, 404, 400), response.text
