"""`gpufaas top`: the frame rendered from /system/overview, and the command against a real HTTP gateway stand-in."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gpufaas.cli import app
from gpufaas.cli.top import age_text, natural_key, render, short_model_names
from tests.unit.test_overview_parts import NO_CALLS

NOW_S = 1_763_870_000.0
RESNET = "resnet@ab12cd34ef56"
BERT = "bert@0011223344aa"


def make_gpu(gpu: str = "node-0/0", **fields: Any) -> dict[str, Any]:
    node = gpu.split("/", 1)[0]
    return {
        "gpu": gpu,
        "node": node,
        "gpu_type": "cpu",
        "status": "idle",
        "memory_used_mb": 0,
        "memory_capacity_mb": 8000,
        "lru": [],
        "local_queue": 0,
        "slots": 1,
        "running": [],
        "host_tier": [],
        **fields,
    }


def make_function(name: str = "resnet", **fields: Any) -> dict[str, Any]:
    return {"name": name, "model": f"{name}@ab12cd34ef56", "replicas": 1, **NO_CALLS, **fields}


def make_overview(**fields: Any) -> dict[str, Any]:
    return {
        "time_unix_s": NOW_S,
        "policy": "lalb-o3",
        "gpus": [make_gpu()],
        "queue": {"length": 0, "capacity": 10000, "calls": []},
        "functions": [make_function()],
        "evictions": [],
        **fields,
    }


def shown(overview: dict[str, Any], *, now_unix_s: float = NOW_S, problem: str | None = None) -> str:
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(render(overview, gateway_url="http://gw:8080", now_unix_s=now_unix_s, problem=problem))
    return console.export_text()


def row(text: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell` (cells are 2+ spaces apart)."""
    for line in text.splitlines():
        if line.startswith(first_cell + " "):
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row starts with {first_cell!r} in:\n{text}")


def test_header_names_gateway_policy_time_and_totals() -> None:
    functions = [
        make_function("resnet", calls=120, hits=110, misses=10),
        make_function("bert", calls=80, hits=30, misses=50),
    ]
    gpus = [make_gpu("node-0/0", status="busy"), make_gpu("node-0/1"), make_gpu("node-1/0", status="busy")]
    text = shown(make_overview(functions=functions, gpus=gpus, queue={"length": 3, "capacity": 10000}))
    header = text.splitlines()[:2]
    assert "http://gw:8080" in header[0] and "policy lalb-o3" in header[0]
    assert "2025-11-23 03:53:20 UTC" in header[0]
    # 140 hits of 200 placed calls: the ratio over all calls (70%), not the mean of the functions' (65%).
    assert header[1] == "GPUs 3 (2 busy)  functions 2  calls 200  hit ratio 70.0%  queue 3/10000"


def test_gpu_row_shows_memory_bar_and_figures_running_queue_lru_and_host_tier() -> None:
    gpu = make_gpu(
        "node-0/0",
        status="busy",
        memory_used_mb=1200,
        memory_capacity_mb=8000,
        lru=[RESNET, BERT],
        slots=4,
        running=[RESNET, RESNET, BERT],
        local_queue=2,
        host_tier=["gpt@ffeeddccbbaa"],
    )
    cells = row(shown(make_overview(gpus=[gpu])), "node-0/0")
    # 1200 of 8000 MB is 15%: 2 of 12 cells.
    assert cells == [
        "node-0/0",
        "cpu",
        "busy",
        "██░░░░░░░░░░ 1200/8000 MB",
        "3/4 resnet x2, bert",
        "2",
        "resnet, bert",
        "gpt",
    ]


def test_full_and_overfull_memory_fill_the_bar_without_overflowing_it() -> None:
    gpus = [
        make_gpu("node-0/0", memory_used_mb=8000, memory_capacity_mb=8000),
        make_gpu("node-0/1", memory_used_mb=9000, memory_capacity_mb=8000),
        make_gpu("node-0/2", memory_used_mb=0, memory_capacity_mb=0),
    ]
    text = shown(make_overview(gpus=gpus))
    assert row(text, "node-0/0")[3] == "████████████ 8000/8000 MB"
    assert row(text, "node-0/1")[3] == "████████████ 9000/8000 MB"
    assert row(text, "node-0/2")[3] == "░░░░░░░░░░░░ 0/0 MB"


def test_gpus_are_listed_in_natural_order() -> None:
    gpus = [make_gpu("node-10/0"), make_gpu("node-2/1"), make_gpu("node-2/0")]
    lines = shown(make_overview(gpus=gpus)).splitlines()
    order = [line.split()[0] for line in lines if line.startswith("node-")]
    assert order == ["node-2/0", "node-2/1", "node-10/0"]
    assert sorted(["a10", "a9", "b1"], key=natural_key) == ["a9", "a10", "b1"]


def test_model_names_are_shortened_only_where_unambiguous() -> None:
    other_bert = "bert@99887766"
    assert short_model_names([RESNET, BERT, other_bert, RESNET]) == {
        RESNET: "resnet",
        BERT: BERT,
        other_bert: other_bert,
    }
    # Two versions of bert anywhere in the frame (here: one only in an eviction) keep both in full on the GPU.
    overview = make_overview(
        gpus=[make_gpu(lru=[RESNET, BERT])],
        evictions=[{"time_unix_s": NOW_S - 1, "gpu": "node-0/0", "model": other_bert, "reason": "lru"}],
    )
    assert row(shown(overview), "node-0/0")[6] == f"resnet, {BERT}"


def test_a_long_lru_list_shows_its_head_and_how_many_more() -> None:
    models = [f"m{i}@{i:012x}" for i in range(9)]
    cells = row(shown(make_overview(gpus=[make_gpu(lru=models)])), "node-0/0")
    assert cells[6] == "m0, m1, m2, m3, m4, m5 +3 more"


def test_function_row_shows_replicas_calls_hit_ratio_percentiles_and_errors() -> None:
    resnet = make_function(
        "resnet",
        replicas=2,
        calls=120,
        hits=110,
        misses=10,
        errors=4,
        hit_ratio=0.9167,
        latency_ms={"p50": 12.1, "p95": 40.2, "p99": 80.0},
    )
    assert row(shown(make_overview(functions=[resnet])), "resnet") == [
        "resnet",
        "2",
        "120",
        "91.7",
        "12.1",
        "40.2",
        "80.0",
        "4",
    ]


@pytest.mark.parametrize(
    "latency",
    [None, {}, {"p50": None, "p95": None, "p99": None}, "n/a"],
    ids=["null", "empty", "null-percentiles", "not-an-object"],
)
def test_missing_latency_and_hit_ratio_show_a_dash(latency: object) -> None:
    function = make_function("idle-fn", calls=0, hit_ratio=None, latency_ms=latency)
    assert row(shown(make_overview(functions=[function])), "idle-fn") == ["idle-fn", "1", "0", "-", "-", "-", "-", "0"]


def test_one_missing_percentile_shows_a_dash_beside_the_others() -> None:
    function = make_function("f", calls=3, hit_ratio=1.0, latency_ms={"p50": 5, "p95": 7.25})
    assert row(shown(make_overview(functions=[function])), "f")[3:7] == ["100.0", "5.0", "7.2", "-"]


def test_functions_are_listed_busiest_first() -> None:
    functions = [make_function("a", calls=1), make_function("b", calls=50), make_function("c", calls=7)]
    lines = shown(make_overview(functions=functions)).splitlines()
    assert [line.split()[0] for line in lines if line[:2] in ("a ", "b ", "c ")] == ["b", "c", "a"]


def test_queue_shows_length_capacity_and_the_oldest_calls_first() -> None:
    calls = [{"function": f"f{i}", "model": f"f{i}@{i:012x}", "waited_s": i / 10} for i in range(8)]
    text = shown(make_overview(queue={"length": 42, "capacity": 10000, "calls": calls}))
    assert "queue 42/10000" in text.splitlines()[1]
    assert "Global queue 42/10000, the 5 oldest shown" in text
    queued = [line.split() for line in text.splitlines() if re.match(r"f\d ", line)]
    assert queued == [[f"f{i}", f"f{i}", f"0.{i}0"] for i in (7, 6, 5, 4, 3)]


def test_an_empty_queue_says_so() -> None:
    assert "Global queue 0/10000: empty" in shown(make_overview())


def test_evictions_show_age_gpu_model_and_reason() -> None:
    evictions = [
        {"time_unix_s": NOW_S - 9.5, "gpu": "node-0/0", "model": BERT, "reason": "lru"},
        {"time_unix_s": NOW_S - 300, "gpu": "node-1/0", "model": RESNET, "reason": "gpu-lost"},
    ]
    text = shown(make_overview(evictions=evictions))
    assert row(text, "9.5 s ago") == ["9.5 s ago", "node-0/0", "bert", "lru"]
    assert row(text, "5 min ago") == ["5 min ago", "node-1/0", "resnet", "gpu-lost"]


def test_eviction_ages_use_the_gateway_clock_not_the_cli_clock() -> None:
    eviction = {"time_unix_s": NOW_S - 3.0, "gpu": "node-0/0", "model": BERT, "reason": "release"}
    # The CLI's machine is an hour ahead: the age is still the gateway's 3 s.
    assert "3.0 s ago" in shown(make_overview(evictions=[eviction]), now_unix_s=NOW_S + 3600)
    # An overview without its time falls back on the CLI's clock.
    undated = make_overview(evictions=[eviction])
    del undated["time_unix_s"]
    assert "13 s ago" in shown(undated, now_unix_s=NOW_S + 10)


def test_age_text_scales_its_unit() -> None:
    assert [age_text(s) for s in (-2.0, 0.25, 9.94, 42.4, 119.0, 600.0, 7200.0)] == [
        "0.0 s ago",
        "0.2 s ago",
        "9.9 s ago",
        "42 s ago",
        "119 s ago",
        "10 min ago",
        "2.0 h ago",
    ]


def test_empty_cluster_renders_a_helpful_line() -> None:
    text = shown(make_overview(gpus=[], functions=[]))
    assert "The cluster is empty" in text and "gpufaas up" in text and "gpufaas deploy" in text
    assert "GPUs 0 (0 busy)  functions 0  calls 0  hit ratio -  queue 0/10000" in text


def test_gpus_without_functions_and_functions_without_gpus_each_say_what_is_missing() -> None:
    assert "No functions deployed" in shown(make_overview(functions=[]))
    assert "No GPUs registered" in shown(make_overview(gpus=[]))


def test_a_refresh_problem_is_shown_above_the_last_overview() -> None:
    text = shown(make_overview(), problem="refresh failed: no gateway answers")
    lines = text.splitlines()
    assert lines[2] == "refresh failed: no gateway answers"
    assert row(text, "node-0/0")[0] == "node-0/0"


@pytest.mark.parametrize(
    "overview",
    [
        {},
        {"gpus": None, "functions": None, "queue": None, "evictions": None},
        {"gpus": [{}], "functions": [{}], "queue": {"calls": [{}]}, "evictions": [{}]},
        {"gpus": ["node-0/0", 3], "functions": "resnet", "queue": [], "evictions": {}},
        {"gpus": [make_gpu(memory_used_mb="1200", slots=True, lru="resnet", running=None)], "time_unix_s": "now"},
    ],
    ids=["nothing", "nulls", "empty-entries", "wrong-containers", "wrong-values"],
)
def test_missing_or_mistyped_keys_render_dashes_not_errors(overview: dict[str, Any]) -> None:
    text = shown(overview)
    assert text.startswith("gpufaas top  http://gw:8080  policy -")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_numbers_that_are_not_finite_render_dashes_not_errors(bad: float) -> None:
    # Python's json reads NaN and Infinity: a gateway's figures reach the frame as floats of any value.
    gpu = make_gpu(memory_used_mb=bad, memory_capacity_mb=bad, slots=bad, local_queue=bad)
    function = make_function(calls=bad, hits=bad, misses=bad, p50_ms=bad)
    queue = {"length": bad, "capacity": bad, "calls": [{"function": "f", "model": "q@3", "waited_s": bad}]}
    evictions = [{"time_unix_s": bad, "gpu": "node-0/0", "model": "e@4", "reason": "lru"}]
    text = shown(make_overview(time_unix_s=bad, gpus=[gpu], functions=[function], queue=queue, evictions=evictions))
    assert text.startswith("gpufaas top  http://gw:8080  policy lalb-o3  2025-")  # the CLI's clock instead
    assert row(text, "node-0/0")[:6] == ["node-0/0", "cpu", "idle", "-", "0/-", "-"]


def test_a_time_past_what_a_date_can_hold_is_replaced_by_the_clis_clock() -> None:
    text = shown(make_overview(time_unix_s=1e300))
    assert text.startswith("gpufaas top  http://gw:8080  policy lalb-o3  2025-")


def test_a_gpu_with_missing_fields_shows_dashes() -> None:
    text = shown(make_overview(gpus=[{"gpu": "node-0/0"}]))
    assert row(text, "node-0/0") == ["node-0/0", "-", "-", "-", "0/-", "-", "-", "-"]


def test_the_gateways_words_are_shown_as_text_not_rich_markup() -> None:
    # A node is named by its operator (default: the host name), unchecked: brackets in it, or in
    # anything else the gateway reports, are text. As markup, '[/b]' failed the whole frame
    # (MarkupError) and '[bold]' vanished.
    gpu = make_gpu("gpu[/b]/0", gpu_type="[bold]t", lru=["[red]m@1"], running=["[red]m@1"], host_tier=["[i]h@2"])
    queue = {"length": 1, "capacity": 10, "calls": [{"function": "[/q]", "model": "[u]q@3", "waited_s": 1.0}]}
    evictions = [{"time_unix_s": NOW_S - 1, "gpu": "gpu[/b]/0", "model": "[s]e@4", "reason": "[/r]"}]
    text = shown(make_overview(gpus=[gpu], queue=queue, evictions=evictions, functions=[make_function("[/f]")]))
    assert row(text, "gpu[/b]/0")[:2] == ["gpu[/b]/0", "[bold]t"]
    for fragment in ("1/1 [red]m", "[i]h", "[/q]", "[u]q", "[s]e", "[/r]", "[/f]"):
        assert fragment in text, (fragment, text)


def test_gpu_names_with_digits_other_than_decimal_sort_without_error() -> None:
    # '²' is a digit to str.isdigit() but not to int() nor to the regex's \d.
    assert sorted(["n1²", "n10", "n2"], key=natural_key) == ["n1²", "n2", "n10"]
    assert row(shown(make_overview(gpus=[make_gpu("n²/0"), make_gpu("n1²/0")])), "n1²/0")[0] == "n1²/0"


# --- the command, against a real HTTP server on loopback ---------------------------------------------------


@dataclass
class FakeGateway:
    """Answers GET /system/overview with `status` and `body`; records each request's path and credentials."""

    url: str = ""
    status: int = 200
    body: bytes = b""
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def answer(self, status: int, document: object) -> None:
        self.status, self.body = status, json.dumps(document).encode()


@pytest.fixture
def fake_gateway() -> Iterator[FakeGateway]:
    gateway = FakeGateway()
    gateway.answer(200, make_overview())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            gateway.seen.append((self.path, self.headers.get("Authorization")))
            status, body = (gateway.status, gateway.body) if self.path == "/system/overview" else (404, b"{}")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    gateway.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield gateway
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """No saved login and no local cluster: only $GPUFAAS_PASSWORD authenticates."""
    env = {
        "GPUFAAS_CONFIG_DIR": str(tmp_path / "config"),
        "GPUFAAS_STATE_DIR": str(tmp_path / "state"),
        "GPUFAAS_PASSWORD": "s3cret",
    }
    monkeypatch.delenv("GPUFAAS_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def top(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["top", *args])
    return result.exit_code, result.stdout, " ".join(result.stderr.split())


def test_once_prints_one_plain_frame_with_admin_credentials(fake_gateway: FakeGateway, cli_env: dict[str, str]) -> None:
    gpu = make_gpu("node-0/0", memory_used_mb=1200, lru=[RESNET])
    resnet = make_function("resnet", calls=120, hits=110, misses=10, hit_ratio=0.9167, latency_ms={"p50": 12.1})
    fake_gateway.answer(200, make_overview(gpus=[gpu], functions=[resnet], queue={"length": 3, "capacity": 10000}))
    code, out, err = top("--once", "--gateway", fake_gateway.url)
    assert (code, err) == (0, "")
    assert f"gpufaas top  {fake_gateway.url}  policy lalb-o3" in out
    assert "hit ratio 91.7%  queue 3/10000" in out
    assert "1200/8000 MB" in out and "12.1" in out
    assert "\x1b[" not in out  # not a terminal: no colour codes in a script's output
    expected_auth = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    assert fake_gateway.seen == [("/system/overview", expected_auth)]


def test_an_older_gateway_without_the_overview_is_one_clear_line(
    fake_gateway: FakeGateway, cli_env: dict[str, str]
) -> None:
    fake_gateway.answer(404, {"detail": "Not Found"})
    code, out, err = top("--once", "--gateway", fake_gateway.url)
    assert code == 1 and out == ""
    assert err.startswith("error: the gateway at") and "has no /system/overview: it is older than this CLI" in err
    assert "Traceback" not in err


def test_refused_credentials_say_to_log_in(fake_gateway: FakeGateway, cli_env: dict[str, str]) -> None:
    fake_gateway.answer(401, {"error": "unauthorized"})
    code, _, err = top("--once", "--gateway", fake_gateway.url)
    assert code == 1
    assert f"needs credentials: `gpufaas login --gateway {fake_gateway.url} --password-stdin`" in err


@pytest.mark.parametrize("body", [b"<html>proxy</html>", b"[1, 2]"], ids=["not-json", "not-an-object"])
def test_an_answer_that_is_not_an_overview_is_a_clear_error(
    fake_gateway: FakeGateway, cli_env: dict[str, str], body: bytes
) -> None:
    fake_gateway.status, fake_gateway.body = 200, body
    code, _, err = top("--once", "--gateway", fake_gateway.url)
    what = "JSON" if body.startswith(b"<") else "an overview"
    assert code == 1 and f"answered /system/overview with something other than {what}" in err
    assert "Traceback" not in err


def test_no_gateway_is_a_clear_error(cli_env: dict[str, str]) -> None:
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = top("--once", "--gateway", f"http://127.0.0.1:{port}")
    assert code == 1 and "no gateway answers at" in err


def test_live_view_refreshes_survives_a_failed_refresh_and_ends_quietly_on_ctrl_c(
    fake_gateway: FakeGateway, cli_env: dict[str, str]
) -> None:
    fake_gateway.answer(200, make_overview(queue={"length": 7, "capacity": 10000}))
    # Started as a terminal starts it, with Ctrl-C's default: a test run started in the background
    # by a non-interactive shell has SIGINT ignored, which a child inherits (and Python then never
    # raises KeyboardInterrupt); a handler, unlike an ignore, is reset to the default at exec.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpufaas.cli", "top", "--gateway", fake_gateway.url, "--interval", "0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **cli_env},
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        _wait_for(lambda: len(fake_gateway.seen) >= 2)
        fake_gateway.answer(503, {"error": "the scheduler is restarting"})
        seen = len(fake_gateway.seen)
        _wait_for(lambda: len(fake_gateway.seen) >= seen + 2)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)  # generous: a loaded CI machine
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert err == ""
    assert out.count("queue 7/10000") >= 3  # piped: a frame per refresh
    assert "refresh failed, showing the last overview: the scheduler is restarting (HTTP 503)" in out


def _wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)
