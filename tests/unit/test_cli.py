"""`gpufaas sim`: outputs, modes, and clear errors (never a traceback) for bad input."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufaas.cli import app
from simulator.report import AGGREGATED_METRICS

runner = CliRunner()
# A run's policy and counts, and every metric the report aggregates over runs (the paper's among them).
REQUIRED_KEYS = {"policy", "requests", "completed", *AGGREGATED_METRICS}


def sim(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["sim", *args])
    # Usage errors come in a box that wraps lines: compare words, not layout.
    stderr = " ".join(result.stderr.replace("│", " ").split())
    return result.exit_code, result.stdout, stderr


def test_json_output_has_the_paper_metrics() -> None:
    code, out, _ = sim("--json", "--policy", "lalb", "--working-set", "15", "--minutes", "2")
    assert code == 0
    data = json.loads(out)
    assert data.keys() >= REQUIRED_KEYS
    assert data["policy"] == "lalb"
    assert data["requests"] == data["completed"] == 650
    assert 0.0 <= data["miss_ratio"] <= 1.0
    # The floor beside it: the offline optimum of the same requests in the pooled GPU memory.
    assert data["optimal_exact"] is True and 0.0 < data["optimal_miss_ratio"] <= data["miss_ratio"]
    # And the latency floor: the mean time the calls' own batches ran (no policy averages less).
    assert 0.0 < data["floor_latency_s"] < data["avg_latency_s"]


def test_compare_runs_every_policy_on_the_same_workload() -> None:
    code, out, _ = sim("--json", "--compare", "--working-set", "15,25", "--minutes", "1")
    assert code == 0
    results = json.loads(out)["results"]
    assert [(r["working_set"], r["policy"]) for r in results] == [
        (15, "lb"),
        (15, "lalb"),
        (15, "lalb-o3"),
        (15, "mqfq-sticky"),
        (15, "torpor"),
        (25, "lb"),
        (25, "lalb"),
        (25, "lalb-o3"),
        (25, "mqfq-sticky"),
        (25, "torpor"),
    ]
    assert len({r["requests"] for r in results}) == 1


def test_sweep_o3_refuses_a_limit_listed_twice() -> None:
    """As --mappings does: the same limit twice ran the same simulation twice, two equal rows."""
    code, _, err = sim("--json", "--sweep-o3", "0,5,5", "--minutes", "1")
    assert code == 2
    assert "5 is listed twice" in " ".join(err.replace("│", " ").split())


def test_sweep_o3_runs_each_limit() -> None:
    code, out, _ = sim("--json", "--sweep-o3", "0,5", "--minutes", "1")
    assert code == 0
    assert [(r["policy"], r["max_num_skips"]) for r in json.loads(out)["results"]] == [("lalb-o3", 0), ("lalb-o3", 5)]


def test_slots_and_batching_are_simulated_and_reported() -> None:
    args = ("--json", "--policy", "lalb", "--working-set", "15", "--minutes", "1", "--slots", "4")
    code, out, _ = sim(*args, "--max-batch-size", "4", "--max-batch-wait-ms", "5", "--batch-exponent", "0.6")
    assert code == 0
    data = json.loads(out)
    assert (data["slots"], data["max_batch_size"], data["max_batch_wait_ms"], data["batch_exponent"]) == (
        4,
        4,
        5.0,
        0.6,
    )
    assert data["completed"] == 325 and data["avg_batch_calls"] > 1.0
    code, out, _ = sim(*args)
    assert json.loads(out)["avg_batch_calls"] == 1.0


def test_misses_placement_flags() -> None:
    base = ("--json", "--policy", "lalb", "--working-set", "35", "--minutes", "1")
    for flags, expected in (
        ((), (True, True)),
        (("--no-coldest-victim-misses",), (True, False)),
        (("--no-room-aware-misses",), (False, True)),
    ):
        code, out, _ = sim(*base, *flags)
        assert code == 0
        data = json.loads(out)
        assert (data["room_aware_misses"], data["coldest_victim_misses"]) == expected


def test_a_policy_knob_reaches_the_simulated_policy() -> None:
    base = ("--json", "--policy", "lalb-o3", "--working-set", "35", "--minutes", "2")
    runs = {}
    for limit in ("0", "25"):
        code, out, _ = sim(*base, "--o3-limit", limit)
        assert code == 0
        runs[limit] = json.loads(out)
    assert (runs["0"]["max_num_skips"], runs["25"]["max_num_skips"]) == (0, 25)
    # Limit 0 is strict arrival order (lalb): other requests go first, so other latencies.
    assert runs["0"]["avg_latency_s"] != runs["25"]["avg_latency_s"]
    code, out, _ = sim(*base)
    assert json.loads(out) == runs["25"]  # the scheduler's default limit, as the simulator's


def test_a_refused_policy_knob_is_the_schedulers_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from scheduler.settings import DESCRIPTION, PROG, SchedulerSettings

    with pytest.raises(SystemExit) as exited:
        SchedulerSettings.from_args(["--o3-limit", "-1"], PROG, DESCRIPTION)
    assert exited.value.code == 2
    schedulers = capsys.readouterr().err.splitlines()[-1].removeprefix(f"{PROG}: error: ")
    assert schedulers == "--o3-limit must be >= 0"
    result = runner.invoke(app, ["sim", "--minutes", "1", "--o3-limit", "-1"])
    assert result.exit_code == 2
    assert any(schedulers in line for line in result.stderr.splitlines())
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--eviction", "fifo"), "--eviction: unknown eviction policy 'fifo'; valid: heaviness, lru, tinylfu"),
        (("--torpor-alpha", "2"), "--torpor-alpha must be <= 1"),
        (("--torpor-alpha-period-s", "0"), "--torpor-alpha-period-s must be > 0"),
        (("--mqfq-ttl-alpha", "x"), "argument --mqfq-ttl-alpha: invalid float value: 'x'"),
        (("--literal-misses",), "unrecognized arguments: --literal-misses"),  # the old spelling is gone
        (("--listen", "0.0.0.0:1"), "--listen is a setting of the scheduler service, not of its policy"),
    ],
)
def test_policy_flags_are_checked_as_the_scheduler_checks_them(flags: tuple[str, ...], says: str) -> None:
    code, _, err = sim("--minutes", "1", *flags)
    assert code == 2 and says in err and "Traceback" not in err


def test_help_lists_the_schedulers_policy_flags() -> None:
    result = runner.invoke(app, ["sim", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--o3-limit", "--no-room-aware-misses", "--mqfq-ttl-alpha", "--torpor-alpha-period-s", "--eviction"):
        assert flag in result.stdout
    assert "how often a request may be passed over (default 25)" in result.stdout


def test_the_schedulers_environment_does_not_change_a_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ("--json", "--policy", "lalb-o3", "--working-set", "15", "--minutes", "1")
    _, plain, _ = sim(*base)
    monkeypatch.setenv("GPUFAAS_SCHEDULER_POLICY_CONFIG__MAX_NUM_SKIPS", "0")
    monkeypatch.setenv("GPUFAAS_SCHEDULER_EVICTION", "tinylfu")
    _, under_env, _ = sim(*base)
    assert json.loads(under_env) == json.loads(plain)


def test_table_output_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "figs.png"
    code, out, _ = sim("--compare", "--minutes", "1", "--working-set", "15", "--plot", str(png))
    assert code == 0
    assert "lalb-o3" in out and "miss ratio" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_azure2021_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    rows = [f"app{i % 3},f{i % 3},{5.0 + i * 1.7:.1f},0.5" for i in range(100)]
    trace.write_text("app,func,end_timestamp,duration\n" + "\n".join(rows) + "\n")
    code, out, _ = sim("--json", "--trace", str(trace), "--trace-format", "azure2021", "--minutes", "2", "--rpm", "60")
    assert code == 0
    assert json.loads(out)["requests"] == 120


def test_unknown_policy_lists_valid_ones() -> None:
    code, _, err = sim("--policy", "nonsense")
    assert code == 2
    assert "valid policies: lalb, lalb-o3, lb, mqfq-sticky, torpor" in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--gpus", "-1"),
        ("--minutes", "0"),
        ("--rpm", "0"),
        ("--working-set", "0"),
        ("--o3-limit", "-3"),
        ("--slots", "0"),
        ("--max-batch-size", "0"),
        ("--max-batch-wait-ms", "-1"),
        ("--batch-exponent", "0"),
        ("--slo-factor", "0"),  # its help said x>=0.0; 0 ended in exit 1 after loading the trace
        ("--slo-factor", "inf"),  # ran, and --json printed "slo_factor": Infinity (not JSON)
    ],
)
def test_nonsense_flags_are_usage_errors(flag: str, value: str) -> None:
    code, _, err = sim(flag, value)
    assert code == 2
    assert flag in err


def test_malformed_trace_names_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,f,http,3,4\no,a,g,http,x,1\n")
    code, _, err = sim("--trace", str(trace))
    assert code == 1
    assert "bad.csv:3" in err
    assert "Traceback" not in err


def test_window_outside_the_trace_is_explained() -> None:
    code, _, err = sim("--start-minute", "5000")
    assert code == 1
    assert "5000" in err


def test_real_console_script_prints_no_traceback(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "gpufaas.cli", "sim", "--trace", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "nope.csv" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_several_mappings_give_mean_and_spread_per_policy() -> None:
    args = ("--compare", "--working-set", "15", "--minutes", "1", "--mappings", "ends,1,2", "--timing-spread", "0.2")
    code, out, _ = sim("--json", *args)
    assert code == 0
    data = json.loads(out)
    assert data["mappings"] == ["ends", "seed 1", "seed 2"] and data["timing_spread"] == 0.2
    assert len(data["results"]) == 5 * 3  # policies x mappings
    by_policy = {group["policy"]: group for group in data["aggregates"]}
    assert set(by_policy) == {"lb", "lalb", "lalb-o3", "mqfq-sticky", "torpor"}
    lalb = [r["avg_latency_s"] for r in data["results"] if r["policy"] == "lalb"]
    assert by_policy["lalb"]["avg_latency_s_mean"] == pytest.approx(statistics.fmean(lalb))
    assert by_policy["lalb"]["avg_latency_s_stdev"] == pytest.approx(statistics.stdev(lalb))
    assert by_policy["lalb"]["mappings"] == ["ends", "seed 1", "seed 2"]
    code, out, _ = sim(*args)
    assert code == 0 and "mean ± sd over mappings" in out and "±" in out


def test_the_table_over_mappings_shows_slo_and_timeouts_as_the_single_run_table_does() -> None:
    """README: with --slo-factor the table adds the calls and functions within SLO, and where calls
    timed out a column and a caption; over several mappings too (docs/policies.md's command)."""
    args = ("--working-set", "15", "--minutes", "1", "--mappings", "ends,1", "--slo-factor", "4")
    code, out, _ = sim(*args)
    out = " ".join(out.split())  # (a title or caption wraps where the trace's path, in it, is long)
    assert code == 0 and "mean ± sd over mappings" in out
    assert "SLO met" in out and "fns in SLO" in out and "timeout rate" not in out
    code, out, _ = sim(*args, "--timeout-s", "2", "--rpm", "2000")
    out = " ".join(out.split())
    assert code == 0 and "timeout rate" in out and "the latencies cover the completed calls only" in out


def test_working_sets_that_keep_the_same_functions_run_once(tmp_path: Path) -> None:
    """The window invokes two functions: working sets 2 and 3 keep both. Each ran, and the
    aggregate merged them into one group of four runs, each mapping twice."""
    trace = tmp_path / "trace.csv"
    trace.write_text("HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,fa,http,5,1\no,a,fb,http,1,3\no,a,fc,http,0,0\n")
    args = ("--trace", str(trace), "--minutes", "2", "--working-set", "2,3", "--mappings", "ends,1", "--rpm", "6")
    code, out, err = sim("--json", "--no-optimum", *args)
    assert code == 0, err
    data = json.loads(out)
    assert [(r["working_set"], r["mapping"]) for r in data["results"]] == [(2, "ends"), (2, "seed 1")]
    assert [group["mappings"] for group in data["aggregates"]] == [["ends", "seed 1"]]
    assert "note: --working-set 3 keeps the same 2 functions as 2: run once" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--mappings", "ends,x"), "expected 'ends' or a non-negative seed"),
        (("--mappings", "1,1"), "listed twice"),
        (("--mappings", "ends,1", "--plot", "f.png"), "--plot draws one mapping"),
        (("--timing-spread", "-1"), "--timing-spread"),
    ],
)
def test_bad_mappings_and_spread_are_clear_errors(flags: tuple[str, ...], message: str) -> None:
    code, _, err = sim("--minutes", "1", *flags)
    assert code == 2 and message in err and "Traceback" not in err


def test_literal_visits_is_passed_to_the_policy_and_reported() -> None:
    base = ("--json", "--policy", "lalb", "--working-set", "35", "--minutes", "2")
    code, out, _ = sim(*base, "--literal-visits")
    assert code == 0
    literal = json.loads(out)
    assert literal["literal_visits"] is True
    code, out, _ = sim(*base)
    default = json.loads(out)
    assert default["literal_visits"] is False
    # Limit 0 read literally lets each request be passed once: no longer strict arrival order.
    assert literal["avg_latency_s"] != default["avg_latency_s"]


def test_host_tier_flags_reach_the_simulated_cluster() -> None:
    base = ("--json", "--policy", "lb", "--working-set", "35", "--minutes", "2")
    code, out, _ = sim(*base, "--host-memory-mb", "8192", "--gpus-per-node", "2", "--host-to-gpu-mb-s", "5000")
    assert code == 0
    tiered = json.loads(out)
    assert tiered["host_memory_mb"] == 8192 and tiered["swap_ins"] > 0
    code, out, _ = sim(*base)
    assert json.loads(out)["swap_ins"] == 0


def test_the_shipped_azure_2021_extract_runs_every_policy() -> None:
    trace = Path(__file__).resolve().parents[2] / "simulator/traces/azure2021-head/Azure2021_200.csv"
    code, out, _ = sim("--json", "--compare", "--trace", str(trace), "--trace-format", "azure2021", "--minutes", "1")
    assert code == 0
    data = json.loads(out)
    assert data["trace_format"] == "azure2021"
    results = {r["policy"]: r for r in data["results"]}
    assert set(results) == {"lb", "lalb", "lalb-o3", "mqfq-sticky", "torpor"}
    assert {r["working_set"] for r in results.values()} == {27}  # the extract's functions
    assert all(r["completed"] == r["requests"] == 325 for r in results.values())
    assert results["lalb"]["miss_ratio"] < results["lb"]["miss_ratio"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--runtime", "docker", "--spares", "2"], "keeps no warm spares"),
        (["--runtime", "podman"], "expected process or docker"),
        (["--docker-image", "x"], "goes with --runtime docker"),
        (["--eviction", "fifo"], "heaviness, lru, tinylfu"),
        (["--scheduler-args", "--mqfq-ttl-alpha -1"], "--mqfq-ttl-alpha must be >= 0"),
        (["--scheduler-args", "--torpor-alpha-period-s"], "expected one argument"),
        (["--scheduler-args", "--mqfq-ttl-alpha '3"], "cannot split"),
        (["--o3-limit", "-1"], "--o3-limit must be >= 0"),  # a scheduler flag given to `up` itself
        (["--torpor-alpha", "2"], "--torpor-alpha must be <= 1"),
        (["--nodez", "3"], "unrecognized arguments: --nodez 3"),
        (["--slots", "x"], "--slots: slots: expected N"),
    ],
)
def test_up_refuses_what_cannot_run_before_it_starts_anything(tmp_path: Path, flags: list[str], says: str) -> None:
    result = runner.invoke(app, ["up", "--state-dir", str(tmp_path / "state"), "--backend", "cpu", *flags])
    assert result.exit_code == 2
    assert says in " ".join(result.stderr.replace("│", " ").split())
    assert not (tmp_path / "state").exists()  # nothing was started or written


def test_up_over_what_outlived_a_killed_supervisor_says_what_to_do(tmp_path: Path) -> None:
    """A cluster whose supervisor was killed, its etcd left running (recorded here as this test's own
    process: alive, and nothing `up` may stop): `up` said "already running" and exited 0, with no
    gateway answering."""
    import os

    state = tmp_path / "state"
    state.mkdir()
    (state / "pids.json").write_text(json.dumps({"etcd": os.getpid(), "supervisor": 2**22 + 1}))
    result = runner.invoke(app, ["up", "--state-dir", str(state), "--backend", "cpu"], terminal_width=400)
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert f"etcd (pid {os.getpid()}) still run" in said and "`gpufaas down` stops them" in said
    assert "already running" not in result.output


@pytest.mark.parametrize(
    ("flags", "code", "says"),
    [
        ([], 0, "already running"),  # none given: unchanged
        (["--port", "18780", "--backend", "cpu", "--nodes", "1"], 0, "already running"),  # the same
        (["--port", "18790", "--no-tls"], 1, "--port 18790 (it runs with 18780); --tls off (it runs with on)"),
        (["--policy", "lb", "--o3-limit", "3"], 1, "--scheduler-args '--o3-limit 3' (it runs with '')"),
    ],
)
def test_up_on_a_running_cluster_says_which_options_it_does_not_run_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: list[str], code: int, says: str
) -> None:
    """`up` with another --port on a running cluster said "already running" and exited 0: a script
    could not tell it had not got the port it asked for. The options are the supervisor's record."""
    from gpufaas.dev import local_cluster

    state = tmp_path / "state"
    state.mkdir()
    options = {"policy": "lalb-o3", "nodes": 1, "backend": "cpu", "gateway_port": 18780, "scheduler_flags": []}
    (state / "supervisor.json").write_text(json.dumps({"status": "up", "options": {**options, "tls": True}}))
    (state / "cluster.json").write_text(json.dumps({"gateway_url": "http://127.0.0.1:18780"}))
    monkeypatch.setattr(local_cluster, "supervised", lambda state_dir: True)
    result = runner.invoke(app, ["up", "--state-dir", str(state), *flags], terminal_width=400)
    assert result.exit_code == code, result.output
    said = " ".join(result.output.split())
    assert says in said and "http://127.0.0.1:18780" in said
    assert code == 0 or "`gpufaas down` stops it" in said


def test_up_passes_the_policys_knobs_on_to_the_scheduler_settings() -> None:
    from gpufaas.cli.local import _checked_scheduler

    flags = ["--o3-limit", "0", "--mqfq-overrun-s", "5", "--no-room-aware-misses", "--eviction", "tinylfu"]
    settings = _checked_scheduler({"policy": "mqfq-sticky", "eviction": "lru"}, flags)
    assert (settings.policy, settings.eviction) == ("mqfq-sticky", "tinylfu")  # a flag wins, as it comes later
    config = settings.policy_config
    assert (config.max_num_skips, config.mqfq_overrun_s, config.room_aware_misses) == (0, 5.0, False)


def deployed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, package: dict[str, Any], answer: dict[str, Any]) -> str:
    """What `gpufaas deploy` prints (on one line) for a one-function stack whose upload's report
    adds `package` to its package's entry, and whose gateway answers the deploy with `answer`."""
    import httpx

    from gpufaas.cli import uploads
    from gpufaas.cli.client import GatewayClient

    (tmp_path / "fn").mkdir(exist_ok=True)
    (tmp_path / "fn" / "handler.py").write_text("def load(device):\n    return None\n")
    (tmp_path / "stack.yml").write_text("functions:\n  fn:\n    handler: ./fn\n    memory_mb: 100\n")

    def uploaded(client: object, scanned: list[uploads.Scanned], **_: object) -> uploads.UploadReport:
        digest = scanned[0].manifest.digest
        return uploads.UploadReport(packages={digest: {"digest": digest, **package}})

    monkeypatch.setattr(uploads, "upload", uploaded)
    monkeypatch.setattr(GatewayClient, "request", lambda self, *a, **k: httpx.Response(200, json=answer))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = runner.invoke(app, ["deploy", "-f", str(tmp_path / "stack.yml"), "--gateway", "http://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_deploy_says_when_no_second_gateway_holds_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A commit's `warning` (no other gateway took a copy: the package is not yet durable) is shown."""
    warning = "none of the 1 other gateway(s) took a copy of this package"
    output = deployed(monkeypatch, tmp_path, {"warning": warning}, {"model": "m"})
    assert f"warning: fn: {warning}" in output


def test_deploy_shows_what_the_gateway_says_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A warning, a model and requirements with square brackets (pip's extras) are text, not markup."""
    warning = "[/INST] no copy [red]"
    package = {"warning": warning, "requirements": ["transformers[torch]"]}
    output = deployed(monkeypatch, tmp_path, package, {"model": "m[bold]"})
    assert f"warning: fn: {warning}" in output
    assert "model m[bold]" in output and "requirements: transformers[torch]" in output


def test_every_option_up_hands_its_supervisor_is_one_the_supervisor_takes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`gpufaas up` passes its options as JSON to `python -m gpufaas.dev.local_cluster`, which
    refuses any it does not know: an option added to one and not the other breaks every `up`."""
    from gpufaas.cli import local
    from gpufaas.dev.local_cluster import SUPERVISED_OPTIONS

    handed: dict[str, object] = {}
    monkeypatch.setattr(local, "_start_supervised", lambda state_dir, options, policy: handed.update(options))
    argv = ["up", "--backend", "cpu", "--no-tls", "--gateways", "1", "--state-dir", str(tmp_path / "state")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert handed and set(handed) <= set(SUPERVISED_OPTIONS), set(handed) - set(SUPERVISED_OPTIONS)
    assert handed["tls"] is False
    assert handed["scheduler_in_gateway"] is True  # one gateway: the scheduler runs in its process
    assert handed["node_in_gateway"] is False  # two nodes (`up`'s default): each in a process of its own
    runner.invoke(app, [*argv, "--nodes", "1"])
    assert handed["node_in_gateway"] is True  # and one node: in the gateway's process too
    runner.invoke(app, [*argv, "--nodes", "1", "--node-apart"])
    assert handed["node_in_gateway"] is False


def test_logs_of_the_scheduler_in_the_gateways_process_are_the_gateways(tmp_path: Path) -> None:
    """`gpufaas up` runs the scheduler in the gateway's process by default: it has no log of its own."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "gateway.log").write_text("one\nscheduler leads (epoch 3)\n")
    (tmp_path / "logs" / "node0.log").write_text("node\n")
    result = runner.invoke(app, ["logs", "scheduler", "--state-dir", str(tmp_path), "-n", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "scheduler leads (epoch 3)\n"
    assert "in the gateway's process" in result.stderr
    (tmp_path / "logs" / "scheduler.log").write_text("apart\n")  # `gpufaas up --scheduler-apart`
    assert runner.invoke(app, ["logs", "scheduler", "--state-dir", str(tmp_path)]).stdout == "apart\n"
    (tmp_path / "logs" / "node0.log").unlink()  # `gpufaas up --nodes 1`: the node in the gateway's process too
    result = runner.invoke(app, ["logs", "node0", "--state-dir", str(tmp_path), "-n", "1"])
    assert result.exit_code == 0 and result.stdout == "scheduler leads (epoch 3)\n", result.output
    assert "the node runs in the gateway's process (`gpufaas up --node-apart`" in result.stderr


def test_status_says_what_runs_in_the_gateways_process(tmp_path: Path) -> None:
    """`gpufaas up --nodes 1` runs the scheduler and the node in the gateway's process: no rows of
    their own, so the gateway's says so."""
    (tmp_path / "pids.json").write_text(json.dumps({"etcd": 2**22 + 1, "gateway": 2**22 + 2}))
    nobody = "http://127.0.0.1:9"  # no gateway answers: status exits 1 after its table
    info = {"gateway_url": nobody, "gateways": {"gateway": nobody}, "in_gateway": ["scheduler", "node0"]}
    (tmp_path / "cluster.json").write_text(json.dumps(info))
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 1, result.output
    assert "gateway (with scheduler, node0 in its process)" in result.output
    assert "etcd (with" not in result.output


def test_status_counts_each_components_restarts(tmp_path: Path) -> None:
    """The supervisor restarts what exits: a component that crashes as it starts, again and again,
    is "running" at most reads of its PID; its count of restarts tells."""
    (tmp_path / "pids.json").write_text(json.dumps({"etcd": 2**22 + 1, "scheduler": 2**22 + 2}))
    nobody = "http://127.0.0.1:9"
    (tmp_path / "cluster.json").write_text(json.dumps({"gateway_url": nobody, "restarts": {"scheduler": 14}}))
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)], terminal_width=200)
    rows = {line.split()[1]: line for line in result.output.splitlines() if line.startswith("│")}
    assert "stopped (restarted 14x)" in rows["scheduler"] and "restarted" not in rows["etcd"], result.output


def test_odd_input_to_sim_is_one_clear_line_before_the_run(tmp_path: Path) -> None:
    """Each of these ended in a traceback: a plot into a folder that is not there (after the
    whole run, its results lost), a Unicode digit as a mapping seed, and a per-invocation trace
    with a timestamp far past any trace's span (its minutes are listed one by one)."""
    trace = tmp_path / "t.csv"
    trace.write_text("app,func,end_timestamp,duration\na,f,10,1\na,f,1e300,1\n")
    cases = {
        "is not a folder this user can write the plot into": ["--plot", str(tmp_path / "no" / "f.png")],
        "expected 'ends' or a non-negative seed, got '²'": ["--mappings", "ends,²"],
        "t.csv: its invocations span minutes 0 to": ["--trace", str(trace), "--trace-format", "azure2021"],
    }
    for message, argv in cases.items():
        result = runner.invoke(app, ["sim", "--minutes", "1", "--rpm", "5", "--no-optimum", *argv])
        assert isinstance(result.exception, SystemExit) and result.exit_code in (1, 2), repr(result.exception)
        assert message in " ".join(result.stderr.replace("│", " ").split()), result.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--hit-lease-s", "inf"], "--hit-lease-s: must be at most 30 s, as the scheduler's --hit-lease-s"),
        (["--hit-lease-s", "31"], "--hit-lease-s: must be at most 30 s"),
        (["--batch-exponent", "inf"], "--batch-exponent"),
        (["--max-batch-size", "2", "--max-batch-wait-ms", "inf"], "--max-batch-wait-ms: must be at most 10000 ms"),
        (["--max-batch-size", "2", "--slots", "2", "--max-batch-wait-ms", "1e308"], "--max-batch-wait-ms"),
    ],
)
def test_numbers_past_what_the_services_take_are_a_usage_error(flags: list[str], says: str) -> None:
    """Each ended in a traceback: a ValueError from the cluster's or the batching's own checks,
    or (a finite wait of 1e308 ms) an OverflowError summing the latencies after the run."""
    result = runner.invoke(app, ["sim", "--minutes", "1", "--rpm", "20", "--no-optimum", "--json", *flags])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, repr(result.exception)
    err = " ".join(result.stderr.replace("│", " ").split())
    assert says in err and "Traceback" not in err, err


def test_a_plot_that_cannot_be_written_after_the_run_keeps_the_results(tmp_path: Path) -> None:
    """Checked before the run (a folder where the file goes), and a failure after it (here the
    plot's folder removed meanwhile, as a full disk would) leaves the results printed."""
    taken = tmp_path / "figs.png"
    taken.mkdir()
    code, _, err = sim("--minutes", "1", "--working-set", "15", "--no-optimum", "--plot", str(taken))
    assert code == 2 and "is a folder, or a file this user cannot write" in err, err
    import simulator.report

    def no_room(results: object, path: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulator.report, "plot_policies", no_room)
        argv = ("--json", "--minutes", "1", "--working-set", "15", "--no-optimum", "--plot", str(tmp_path / "f.png"))
        code, out, err = sim(*argv)
    assert code == 1 and "No space left on device; the results are above" in err, err
    document = json.loads(out)
    assert document.get("results") or document.get("policy"), document


def test_a_per_invocation_trace_stamped_in_unix_seconds_loads(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    rows = [f"app{i % 3},f{i % 3},{1_611_700_000.0 + i * 6.0:.1f},0.5" for i in range(100)]
    trace.write_text("app,func,end_timestamp,duration\n" + "\n".join(rows) + "\n")
    argv = ("--json", "--trace", str(trace), "--trace-format", "azure2021", "--whole-trace", "--working-set", "all")
    code, out, err = sim(*argv, "--no-optimum", "--rpm", "60")
    assert code == 0 and json.loads(out)["requests"] > 0, err


def test_a_plot_write_that_fails_midway_leaves_the_earlier_plot_whole(tmp_path: Path) -> None:
    """Written in place, a write that failed partway (a full disk, an interrupt) left a truncated
    PNG where the earlier plot of that name had been; now the earlier file stays and no part is left."""
    from matplotlib.figure import Figure

    png = tmp_path / "f.png"
    png.write_bytes(b"the earlier plot")

    def fails_midway(self: Figure, fname: Path, **kwargs: object) -> None:
        Path(fname).write_bytes(b"\x89PNG part")
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", fails_midway)
        code, _, err = sim("--json", "--minutes", "1", "--working-set", "15", "--no-optimum", "--plot", str(png))
    assert code == 1 and "No space left on device; the results are above" in err, err
    assert png.read_bytes() == b"the earlier plot"
    assert [path.name for path in tmp_path.iterdir()] == ["f.png"]


def test_a_plot_through_a_symbolic_link_replaces_the_file_it_points_to(tmp_path: Path) -> None:
    target = tmp_path / "figures" / "f.png"
    target.parent.mkdir()
    target.write_bytes(b"the earlier plot")
    link = tmp_path / "latest.png"
    link.symlink_to(target)
    code, _, err = sim(
        "--json", "--minutes", "1", "--working-set", "5", "--rpm", "20", "--no-optimum", "--plot", str(link)
    )
    assert code == 0, err
    assert link.is_symlink() and target.read_bytes().startswith(b"\x89PNG")
    assert sorted(path.name for path in target.parent.iterdir()) == ["f.png"]


def test_a_plot_without_matplotlib_is_refused_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was found only after the whole run (a sweep can take hours), then exit 1."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, out, err = sim(
        "--json", "--minutes", "1", "--working-set", "5", "--no-optimum", "--plot", str(tmp_path / "f.png")
    )
    assert code == 2 and "--plot: the plot needs matplotlib: pip install 'gpufaas[plot]'" in err, err
    assert out == ""


def test_deploy_says_which_symbolic_links_it_left_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A package holds no links: a weights file linked into the handler directory was left out
    with no word (the deploy "succeeded", the function failed at load). Its target is not read."""
    (tmp_path / "elsewhere").write_text("the user's private file")
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "model.pt").symlink_to(tmp_path / "elsewhere")
    output = deployed(monkeypatch, tmp_path, {}, {"model": "m"})
    assert "warning: fn: left out symbolic link(s) model.pt" in output
    from gpufaas.packages import scan_directory

    links: list[str] = []
    manifest, _ = scan_directory(tmp_path / "fn", links=links)
    assert manifest.file("model.pt") is None and links == ["model.pt"]


def test_a_plot_path_with_brackets_is_said_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'wrote PATH' read the path as markup: a traceback (exit 1) after the plot was written."""
    import simulator.report

    monkeypatch.setattr(simulator.report, "plot_policies", lambda results, path: path.write_bytes(b"png"))
    plot = tmp_path / "[/run]" / "policies.png"
    plot.parent.mkdir(parents=True)
    code, out, err = sim("--minutes", "1", "--working-set", "15", "--no-optimum", "--plot", str(plot))
    assert code == 0, err
    assert f"wrote {plot}" in " ".join(out.split()), out
