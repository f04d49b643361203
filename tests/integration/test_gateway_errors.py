"""Every error the gateway promises, over a real cluster (etcd, scheduler, gateway, one GPU manager
with one 1000 MB CPU "GPU" running one call at a time, a global queue of 2, a 0.01 MB payload
limit), each with its JSON body."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.http import HEAD_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S
from gpufaas.credentials import ADMIN_USER, basic_authorization, read_secret
from gpufaas.dev.etcd_server import EtcdServer
from gpufaas.dev.local_cluster import LocalCluster
from tests.fixtures.make_packages import build_package
from tests.integration.conftest import deploy, stop_clusters
from tests.scrape import sample
from tests.unit.test_gateway_app import assert_error
from tests.unit.test_gateway_http import read_until_closed, send_head_until_refused

pytestmark = pytest.mark.integration

MAX_PAYLOAD_BYTES = int(0.01 * 1024 * 1024)
FIXTURES = ("sleepy_function", "failing_function", "echo_function")


@dataclass
class Env:
    cluster: LocalCluster
    url: str
    tmp: Path
    models: dict[str, str]  # function name -> model
    digests: dict[str, str]  # fixture -> package digest

    def invoke(self, name: str, body: Any = None, *, timeout: float = 30, **kwargs: Any) -> httpx.Response:
        if body is not None:
            kwargs["json"] = body
        # Calls carry the invoke token (what an application holds), the rest the admin's password.
        kwargs["headers"] = {**self.cluster.invoke_headers, **kwargs.get("headers", {})}
        return httpx.post(f"{self.url}/function/{name}", timeout=timeout, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10, auth=self.cluster.admin_auth)

    def counted(self, name: str, code: int) -> int:
        """The gateway's invocation counter for (function, HTTP status), from /metrics."""
        text = self.get("/metrics").text
        return int(sample(text, "gateway_function_invocation_total", function_name=name, code=str(code)))

    def cached(self) -> set[str]:
        """Every model cached on some GPU, per the scheduler."""
        return {model for gpu in self.get("/system/gpus").json() for model in gpu["lru"]}

    def wait_idle(self, timeout_s: float = 15.0) -> None:
        wait_for(
            lambda: (
                self.get("/system/queue").json()["length"] == 0
                and all(g["status"] == "idle" for g in self.get("/system/gpus").json())
            ),
            timeout_s,
        )


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout_s:g} s")


@pytest.fixture(scope="module")
def env(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One cluster for the whole module; stopped by PID at the end, and checked that none survives."""
    tmp = tmp_path_factory.mktemp("gateway-errors")
    cluster = LocalCluster(
        state_dir=tmp / "cluster",
        nodes=1,
        gpus_per_node=1,
        backend="cpu",
        gpu_memory_mb=1000,
        queue_capacity=2,
        max_payload_mb=0.01,
        slots="1",
        etcd_endpoint=etcd_server.endpoint,
        root=f"/t-{uuid.uuid4().hex[:12]}",
    )
    watched: list[int] = []
    try:
        cluster.start()
        watched.extend(cluster.pids().values())
        for fixture in FIXTURES:
            build_package(fixture, tmp)
        functions: dict[str, tuple[str, dict[str, Any]]] = {
            "sleepy": ("sleepy_function", {}),
            "sleepy-short": ("sleepy_function", {"timeout_s": 1}),
            "failing": ("failing_function", {}),
            "echo": ("echo_function", {}),
            "echo-untouched": ("echo_function", {}),
        }
        # 100 MB each, so every function's model fits beside the others on the 1000 MB GPU.
        models = {
            name: str(deploy(cluster, name, fixture, tmp, **{"memory_mb": 100, **spec})["model"])
            for name, (fixture, spec) in functions.items()
        }
        uploaded = {
            fixture: httpx.post(
                f"{cluster.gateway_url}/system/packages",
                content=(tmp / f"{fixture}.tar.gz").read_bytes(),
                timeout=30,
                auth=cluster.admin_auth,
            ).json()["digest"]
            for fixture in FIXTURES
        }
        yield Env(cluster, cluster.gateway_url, tmp, models, uploaded)
    finally:
        stop_clusters([cluster], watched)


# --- the happy endpoints --------------------------------------------------------------------


def test_health_info_and_metrics(env: Env) -> None:
    health = env.get("/healthz").json()
    assert {k: health.pop(k) for k in ("status", "scheduler", "etcd")} == {
        "status": "ok",
        "scheduler": True,
        "etcd": True,
    }
    assert set(health) == {"loop_lag_s", "loop_lag_max_s"} and all(v >= 0 for v in health.values())
    assert env.get("/system/info").json()["provider"]["provider"] == "gpufaas"
    response = env.invoke("echo", {"hello": 1})
    assert response.status_code == 200, response.text
    metrics = env.get("/metrics")
    assert metrics.status_code == 200
    assert "gateway_function_invocation_total" in metrics.text
    assert env.counted("echo", 200) >= 1


# --- 404 ------------------------------------------------------------------------------------


def test_404s_name_what_is_missing(env: Env) -> None:
    assert_error(env.invoke("nope", {}), 404, "'nope'", "deploy")
    assert_error(env.get("/system/function/nope"), 404, "'nope'", "GET /system/functions")
    response = httpx.request(
        "DELETE", f"{env.url}/system/functions", json={"functionName": "nope"}, timeout=10, auth=env.cluster.admin_auth
    )
    assert_error(response, 404, "'nope'")
    response = httpx.put(
        f"{env.url}/system/functions",
        json={"name": "nope", "package_digest": env.digests["echo_function"], "memory_mb": 10},
        timeout=10,
        auth=env.cluster.admin_auth,
    )
    assert_error(response, 404, "'nope'", "POST /system/functions")
    assert_error(env.get(f"/system/packages/sha256:{'1' * 64}"), 404, "POST /system/packages")


# --- 400 and 409 ----------------------------------------------------------------------------


def test_400s_on_deploy_and_upload(env: Env) -> None:
    digest = env.digests["echo_function"]
    post = lambda **kw: httpx.post(f"{env.url}/system/functions", timeout=10, auth=env.cluster.admin_auth, **kw)  # noqa: E731

    response = post(json={"name": "Not_Valid", "package_digest": digest, "memory_mb": 10})
    assert_error(response, 400, "name:", "'Not_Valid'", "lower-case")

    never = f"sha256:{'a' * 64}"
    response = post(json={"name": "ghost", "package_digest": never, "memory_mb": 10})
    assert_error(response, 409, never, "not uploaded", "POST it to /system/packages")

    response = post(content=b'{"name": "x",', headers={"content-type": "application/json"})
    assert_error(response, 400, "JSON function spec")

    package = (env.tmp / "echo_function.tar.gz").read_bytes()
    wrong = f"sha256:{'b' * 64}"
    response = httpx.post(
        f"{env.url}/system/packages", params={"digest": wrong}, content=package, timeout=10, auth=env.cluster.admin_auth
    )
    archive_digest = f"sha256:{hashlib.sha256(package).hexdigest()}"  # what ?digest= checks: the bytes sent
    assert_error(response, 400, wrong, archive_digest, "corrupted", "retry")

    response = post(json={"name": "echo", "package_digest": digest, "memory_mb": 100})
    assert_error(response, 409, "'echo'", "PUT /system/functions")

    # None of those left a function behind.
    names = {f["name"] for f in env.get("/system/functions").json()}
    assert names == set(env.models)


def test_invalid_json_payload_is_a_400_and_the_worker_stays(env: Env) -> None:
    # Only the worker parses payloads (once); the gateway and the scheduler pass them on as bytes.
    response = env.invoke("echo-untouched", content=b"{oops", headers={"content-type": "application/json"})
    assert_error(response, 400, "application/json", "not valid JSON")
    assert env.counted("echo-untouched", 400) == 1
    response = env.invoke("echo-untouched", {"fine": True})
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "hit"
    # The same bytes as an opaque payload are fine: the function gets them as they are.
    response = env.invoke("echo", content=b"{oops", headers={"content-type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    assert response.content == b"{oops"


# --- 413 ------------------------------------------------------------------------------------


def test_413_above_the_payload_limit(env: Env) -> None:
    too_big = b"x" * (MAX_PAYLOAD_BYTES + 1)
    response = env.invoke("echo", content=too_big, headers={"content-type": "application/octet-stream"})
    assert_error(response, 413, f"{MAX_PAYLOAD_BYTES} bytes")
    just_fits = b"x" * MAX_PAYLOAD_BYTES
    response = env.invoke("echo", content=just_fits, headers={"content-type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    assert response.content == just_fits


# --- 429 ------------------------------------------------------------------------------------


def test_429_with_retry_after_when_the_global_queue_is_full(env: Env) -> None:
    warm = env.invoke("sleepy", {"sleep_s": 0})
    assert warm.status_code == 200, warm.text
    env.wait_idle()

    with ThreadPoolExecutor(3) as pool:
        # One runs on the only GPU and two wait: the global queue (capacity 2) is full.
        slow = [pool.submit(env.invoke, "sleepy", {"sleep_s": 2}) for _ in range(3)]
        wait_for(lambda: env.get("/system/queue").json()["length"] == 2)
        queue = env.get("/system/queue").json()
        assert queue["capacity"] == 2
        assert [c["function"] for c in queue["calls"]] == ["sleepy", "sleepy"]

        response = env.invoke("echo", {"one": "more"})
        assert_error(response, 429, "queue is full", "2 calls", "retry")
        assert response.headers["Retry-After"] == "1"
        assert response.headers["X-Call-Id"]

        answers = [future.result() for future in slow]
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert all(r.json()["slept_s"] == 2 for r in answers)
    env.wait_idle()
    assert env.counted("echo", 429) >= 1


# --- 504 ------------------------------------------------------------------------------------


def test_504_past_the_function_timeout_then_the_gpu_serves_again(env: Env) -> None:
    warm = env.invoke("sleepy-short", {"sleep_s": 0})
    assert warm.status_code == 200, warm.text
    assert env.models["sleepy-short"] in env.cached()

    before = env.counted("sleepy-short", 504)
    started = time.monotonic()
    response = env.invoke("sleepy-short", {"sleep_s": 3})
    elapsed = time.monotonic() - started
    assert_error(response, 504, "'sleepy-short'", "timeout of 1 s")
    assert 0.8 <= elapsed <= 2.5, f"the 504 came after {elapsed:.2f} s; the function's timeout is 1 s"
    assert env.counted("sleepy-short", 504) == before + 1

    # The stuck worker was killed, so its model is no longer cached, and the GPU works again.
    wait_for(lambda: env.models["sleepy-short"] not in env.cached())
    response = env.invoke("echo", {"after": "timeout"})
    assert response.status_code == 200, response.text
    assert response.json()["echo"] == {"after": "timeout"}
    response = env.invoke("sleepy-short", {"sleep_s": 0})
    assert response.status_code == 200, response.text
    assert response.headers["X-Cache"] == "miss"
    env.wait_idle()


# --- 409 (well formed, but not for this cluster) --------------------------------------------


def test_a_function_no_gpu_can_hold_is_refused_at_deploy(env: Env) -> None:
    spec = {"name": "huge", "package_digest": env.digests["echo_function"], "memory_mb": 5000}
    response = httpx.post(f"{env.url}/system/functions", json=spec, timeout=30, auth=env.cluster.admin_auth)
    assert_error(response, 409, "memory_mb 5000", "1000 MB")
    assert env.get("/system/function/huge").status_code == 404


# --- 500 ------------------------------------------------------------------------------------


def test_500_carries_the_function_error_and_the_worker_stays(env: Env) -> None:
    before = env.counted("failing", 500)
    response = env.invoke("failing", {"fail": True})
    assert_error(response, 500, "bad input")
    assert env.counted("failing", 500) == before + 1
    assert env.models["failing"] in env.cached()
    response = env.invoke("failing", {"fail": False})
    assert response.status_code == 200, response.text
    assert response.text == "ok"  # a str result comes back as plain text
    assert response.headers["X-Cache"] == "hit"
    env.wait_idle()


# --- the connection itself (gateway.auth, gateway.http) ---------------------------------------


def test_two_authorization_headers_are_a_400_on_every_route(env: Env) -> None:
    # /function read the last, the other routes the first: a proxy that checks one of them could
    # be told one caller and the gateway another. Either order, either route: refused.
    valid = env.cluster.invoke_headers["authorization"]
    admin = basic_authorization(ADMIN_USER, read_secret(env.cluster.secrets.admin_password))
    for pair in ([valid, "Bearer wrong"], ["Bearer wrong", valid], [valid, valid]):
        headers = [("authorization", value) for value in pair]
        response = httpx.post(f"{env.url}/function/echo", json={}, headers=headers, timeout=10)
        assert_error(response, 400, "one Authorization header", "has 2")
        assert response.headers["x-call-id"]
    for pair in ([admin, "Bearer wrong"], ["Bearer wrong", admin]):
        response = httpx.get(f"{env.url}/system/functions", headers=[("authorization", v) for v in pair], timeout=10)
        assert_error(response, 400, "one Authorization header", "has 2")
    assert env.invoke("echo", {}).status_code == 200  # one is fine


def gateway_socket(env: Env) -> socket.socket:
    host, port = env.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def test_20_mb_of_headers_are_a_431_not_a_500(env: Env) -> None:
    with gateway_socket(env) as sock:
        start = b"POST /function/echo HTTP/1.1\r\nHost: gateway\r\n"
        sent, answer = send_head_until_refused(sock, start, b"X-Filler: " + b"a" * 1000 + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"larger than the limit of 65536 bytes" in answer
    assert sent < 20 * 1024 * 1024, "the gateway read all 20 MB"
    assert env.invoke("echo", {}).status_code == 200


def test_a_slowloris_connection_is_closed_at_the_header_deadline(env: Env) -> None:
    with gateway_socket(env) as sock:
        sock.sendall(b"POST /function/echo HTTP/1.1\r\n")
        started = time.monotonic()
        closed = threading.Event()

        def trickle() -> None:  # one header byte a second, until the gateway hangs up
            while not closed.wait(1.0):
                try:
                    sock.send(b"X")
                except OSError:
                    return

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            answer = read_until_closed(sock)
        finally:
            closed.set()
            sender.join()
        closed_after_s = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408") and b"within 10 s" in answer, answer
    assert HEAD_TIMEOUT_S <= closed_after_s < HEAD_TIMEOUT_S + 3, closed_after_s


def test_idle_connections_are_closed_after_the_keep_alive_timeout(env: Env) -> None:
    idle = [gateway_socket(env) for _ in range(200)]
    started = time.monotonic()
    try:
        for sock in idle:
            assert read_until_closed(sock) == b""
    finally:
        for sock in idle:
            sock.close()
    closed_after_s = time.monotonic() - started
    assert closed_after_s < KEEP_ALIVE_TIMEOUT_S + 3, closed_after_s
