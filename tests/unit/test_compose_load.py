"""deploy/compose_load.py, the load and verdict of compose-e2e.sh's kills: its figures from known
calls, the leader's service from the overview, and a real load against a real socket."""

from __future__ import annotations

import http.server
import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "compose_load.py"


@pytest.fixture(scope="module")
def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compose_load"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_recovery_counts_from_the_kill_and_only_calls_sent_after_the_death(load: ModuleType) -> None:
    calls = [
        load.Call(sent_s=9.9, done_s=10.2, status=200),  # sent before the death: not a recovery
        load.Call(sent_s=10.1, done_s=11.0, status=503, error="b'no scheduler'"),
        load.Call(sent_s=10.2, done_s=11.4, status=200),
        load.Call(sent_s=10.3, done_s=11.3, status=200),
    ]
    assert load.recovery_s(calls, killed_s=10.0, dead_s=10.05) == pytest.approx(1.3)
    assert load.recovery_s(calls[:2], killed_s=10.0, dead_s=10.05) is None
    assert load.longest_gap_s(calls, killed_s=10.0) == pytest.approx(1.1)  # 10.2 -> 11.3
    assert [c.outcome for c in calls[:2]] == ["200", "503"]
    assert load.Call(1.0, 2.0, None, "ConnectionResetError(104, 'reset')").outcome == "ConnectionResetError"


def test_the_leader_is_mapped_to_its_service_by_its_registered_address(load: ModuleType) -> None:
    containers = {"scheduler-0": "c0", "scheduler-1": "c1"}
    leader = {"name": "scheduler-1:50051", "address": "scheduler-1:50051", "epoch": 12}
    assert load.service_of(leader, containers) == "scheduler-1"
    with pytest.raises(SystemExit, match="none of the services"):
        load.service_of({"name": "10.0.0.7:50051", "address": "10.0.0.7:50051", "epoch": 3}, containers)


class Gateway(http.server.BaseHTTPRequestHandler):
    """Answers calls 200, or 503 while `failing`, and the overview with `leader`."""

    failing = False
    leader: ClassVar[dict[str, Any]] = {"name": "scheduler-0:50051", "address": "scheduler-0:50051", "epoch": 5}

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self._answer(503 if self.failing else 200, b"{}")

    def do_GET(self) -> None:
        ok = self.path == "/system/overview" and self.headers["authorization"].startswith("Basic ")
        self._answer(200 if ok else 401, json.dumps({"scheduler_leader": self.leader}).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        Gateway.failing = False


def test_a_load_records_every_call_and_its_answer(load: ModuleType, gateway_url: str) -> None:
    with load.Load(gateway_url, "token") as running:
        time.sleep(0.3)
        Gateway.failing = True
        time.sleep(0.3)
    outcomes = {c.outcome for c in running.calls}
    assert outcomes == {"200", "503"}
    assert all(c.sent_s <= c.done_s for c in running.calls)
    assert load.overview_leader(gateway_url, "password")["epoch"] == 5


def test_the_gateway_verdict_fails_when_calls_sent_after_the_death_fail(
    load: ModuleType, gateway_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(load, "STEADY_S", 0.3)
    (tmp_path / "token").write_text("token\n")
    for failing, passed in ((False, True), (True, False)):
        Gateway.failing = failing
        victim = subprocess.Popen(["sleep", "60"])
        reaper = threading.Thread(target=victim.wait)  # reaped as its container's shim would
        reaper.start()
        assert load.main(["gateway", gateway_url, str(tmp_path / "token"), str(victim.pid)]) == (0 if passed else 1)
        reaper.join()
        assert victim.returncode == -9
