"""The cluster views on a real cluster: GET /system/overview, and the dashboard at /ui in a real
headless Chromium (Playwright), which must show the live cluster and follow a call. The test run
writes a screenshot of the dashboard (test-artifacts/dashboard.png)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufaas.credentials import ADMIN_USER, read_secret
from gpufaas.dev.local_cluster import LocalCluster
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_control_plane import invoke

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "test-artifacts" / "dashboard.png"


def call(cluster: LocalCluster, name: str) -> httpx.Response:
    """One call, answered 200, and then done in the scheduler's view too: the node tells the
    gateway and the scheduler at once, so a next call made at the answer could find the model
    still busy and be placed as a new replica on another GPU (the counts below would vary)."""
    response = invoke(cluster, name)
    assert response.status_code == 200, response.text

    def gpus() -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = httpx.get(
            f"{cluster.gateway_url}/system/gpus", auth=cluster.admin_auth, timeout=10
        ).json()
        return listed

    eventually(gpus, lambda listed: all(not gpu["running"] for gpu in listed))
    return response


def overview(cluster: LocalCluster) -> dict[str, Any]:
    response = httpx.get(f"{cluster.gateway_url}/system/overview", auth=cluster.admin_auth, timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def eventually(read: Any, check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_the_overview_shows_gpus_functions_hits_and_evictions(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    # One GPU that holds one 800 MB model: each change of model evicts the one before.
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000)
    for name in ("lin-a", "lin-b"):
        deploy(cluster, name, "linear_function", tmp_path)
    caches = [call(cluster, name).headers["X-Cache"] for name in ("lin-a", "lin-a", "lin-a", "lin-b")]
    assert caches == ["miss", "hit", "hit", "miss"]

    view = eventually(lambda: overview(cluster), lambda v: v["evictions"])
    (gpu,) = view["gpus"]
    assert gpu["memory_capacity_mb"] == 1000 and gpu["memory_used_mb"] > 0
    functions = {f["name"]: f for f in view["functions"]}
    a, b = functions["lin-a"], functions["lin-b"]
    assert (a["calls"], a["hits"], a["misses"], a["errors"]) == (3, 2, 1, 0)
    assert a["hit_ratio"] == pytest.approx(2 / 3)
    assert a["latency_ms"]["p50"] <= a["latency_ms"]["p95"] <= a["latency_ms"]["p99"]
    assert (b["calls"], b["misses"], b["replicas"]) == (1, 1, 1)
    assert gpu["lru"] == [b["model"]] and a["replicas"] == 0
    (eviction,) = view["evictions"]
    assert (eviction["model"], eviction["gpu"], eviction["reason"]) == (a["model"], gpu["gpu"], "lru")
    assert view["queue"] == {"length": 0, "capacity": view["queue"]["capacity"], "calls": []}
    assert view["policy"] == "lalb-o3"
    # Credentials are asked for, as everywhere else.
    assert httpx.get(f"{cluster.gateway_url}/system/overview", timeout=10).status_code == 401

    # `gpufaas top` shows the same numbers (one frame, as a script would take it).
    env = {**os.environ, "GPUFAAS_PASSWORD": read_secret(cluster.secrets.admin_password), "COLUMNS": "160"}
    shown = subprocess.run(
        [sys.executable, "-m", "gpufaas.cli", "top", "--once", "--gateway", cluster.gateway_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert "\x1b[" not in shown.stdout  # no terminal: plain text
    frame = shown.stdout
    for fragment in ("lalb-o3", gpu["gpu"], "1000 MB", "lin-a", "lin-b", "66.7", "lru"):
        assert fragment in frame, (fragment, frame)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def test_the_dashboard_shows_the_live_cluster_in_a_real_browser(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (in the dev extra)")
    browser_path = _chromium()
    if browser_path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the dashboard test: apt-get install chromium (scripts/test.sh does)")
        pytest.skip("no Chromium here: apt-get install chromium")
    cluster = make_cluster(nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "lin-a", "linear_function", tmp_path)
    deploy(cluster, "lin-b", "linear_function", tmp_path)
    call(cluster, "lin-a")
    password = read_secret(cluster.secrets.admin_password)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            context = browser.new_context(
                http_credentials={"username": ADMIN_USER, "password": password}, viewport={"width": 1400, "height": 900}
            )
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{cluster.gateway_url}/ui")
            expect = sync_api.expect
            # The page shows both GPUs with their memory, and the deployed functions.
            expect(page.locator("article.gpu")).to_have_count(2, timeout=15_000)
            expect(page.locator("#gpu-count")).to_have_text("2")
            expect(page.locator("article.gpu .memory").first).to_contain_text("/ 2000 MB")
            row = page.locator('tr[data-function="lin-a"]')
            expect(row).to_have_attribute("data-calls", "1")
            expect(page.locator('tr[data-function="lin-b"]')).to_have_attribute("data-calls", "0")
            expect(page.locator("#policy")).to_have_text("lalb-o3")
            # It follows the cluster: a call made now shows up without reloading the page.
            call(cluster, "lin-b")
            call(cluster, "lin-b")
            expect(page.locator('tr[data-function="lin-b"]')).to_have_attribute("data-calls", "2", timeout=10_000)
            expect(page.locator("#call-count")).to_have_text("3")
            expect(page.locator(".chip.cached", has_text="lin-b")).to_have_count(1)
            assert page.locator("#problem").is_hidden()
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            assert errors == [], errors
            # Without credentials the page is refused with a challenge (a browser asks for them).
            refused = browser.new_context().request.get(f"{cluster.gateway_url}/ui")
            assert refused.status == 401 and refused.headers["www-authenticate"].startswith("Basic")
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
