"""The simulator at scale: whole-trace runs from the CLI, its progress lines, the run's Meter, the
running totals that replaced per-instant sums over every GPU, and bench.sim_speed's helpers."""

from __future__ import annotations

import cProfile
import json
import pstats
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.sim_speed import area_shares, scaled_rpm
from gpufaas.cli import app
from gpufaas.profiles import paper_table1
from scheduler import PolicyConfig, make_policy
from simulator.engine import ClusterConfig, Meter, _make_scheduler, _Run, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_azure2019

runner = CliRunner()


def write_trace(path: Path) -> Path:
    """Three functions over minutes 10..13; fn c is never invoked, minute 12 has no invocation."""
    rows = [
        "HashOwner,HashApp,HashFunction,Trigger,10,11,12,13",
        "o,a,fa,http,5,1,0,2",
        "o,a,fb,http,1,3,0,0",
        "o,a,fc,http,0,0,0,0",
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_whole_trace_replays_every_minute_and_every_invoked_function(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    args = ["sim", "--trace", str(trace), "--whole-trace", "--working-set", "all", "--rpm", "20", "--gpus", "2"]
    result = runner.invoke(app, [*args, "--no-optimum", "--progress-every-s", "0.1", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["start_minute"], data["minutes"]) == (10, 4)
    assert data["working_set"] == 2  # fa and fb: fc is never invoked
    assert data["requests"] == data["completed"] == 3 * 20  # minute 12 has none
    assert data["optimal_miss_ratio"] is None
    done = [line for line in result.stderr.splitlines() if line.startswith("sim done:")]
    assert len(done) == 1 and done[0].startswith("sim done: 60/60 requests, ")
    assert "events/s" in done[0] and "requests/s" in done[0]


@pytest.mark.parametrize("extra", [["--minutes", "3"], ["--start-minute", "11"]])
def test_whole_trace_refuses_a_window_of_its_own(tmp_path: Path, extra: list[str]) -> None:
    trace = write_trace(tmp_path / "trace.csv")
    result = runner.invoke(app, ["sim", "--trace", str(trace), "--whole-trace", *extra])
    assert result.exit_code == 2
    assert "leave out --start-minute and --minutes" in " ".join(result.stderr.replace("│", " ").split())


def test_the_meter_counts_every_arrival_and_every_gpu_event() -> None:
    workload = build_workload(
        load_azure2019(shipped_trace()), WorkloadConfig(minutes=1, working_set=35), paper_table1()
    )
    meter = Meter()
    result = simulate(workload, "lalb-o3", meter=meter)
    # One call at a time, no batching: each call is an arrival and a batch end, each miss a load.
    assert result.batches == result.requests
    assert meter.events == 2 * result.requests + result.misses
    assert meter.submitted == meter.completed == result.requests
    assert meter.now_s == result.makespan_s
    assert 0 < meter.instants <= meter.events


def test_runs_in_turn_add_their_events_to_the_progress_line() -> None:
    """With --compare every run shares the progress line's meter: the last line counts the events
    of every run (it counted only the last run's)."""
    args = ["sim", "--minutes", "1", "--working-set", "15", "--rpm", "30", "--gpus", "4", "--compare"]
    result = runner.invoke(app, [*args, "--no-optimum", "--progress-every-s", "60", "--json"])
    assert result.exit_code == 0, result.stderr
    runs = json.loads(result.stdout)["results"]
    assert len(runs) > 1
    # One call at a time, no batching: each call is an arrival and a batch end, each miss a load.
    events = sum(2 * run["requests"] + run["misses"] for run in runs)
    done = [line for line in result.stderr.splitlines() if line.startswith("sim done:")]
    assert len(done) == 1 and f", {events:,} events in " in done[0], (events, done)


class _CheckedRun(_Run):
    """A run that also sums the GPUs' memory and D at every instant, as the simulator did before
    it kept running totals, and checks the totals against the sums."""

    checks = 0

    def _integrate(self, now: float) -> None:
        super()._integrate(now)
        scheduler = self.scheduler
        assert self.used_mb_total == sum(scheduler.cache.gpu(g.spec.gpu_id).used_mb for g in scheduler.gpus())
        assert self.slots_total == sum(g.spec.slots for g in scheduler.gpus())
        _CheckedRun.checks += 1


@pytest.mark.parametrize(
    ("policy", "cluster"),
    [
        ("lalb-o3", ClusterConfig(gpus=6)),
        ("lalb", ClusterConfig(gpus=6, host_memory_mb=8192, gpu_idle_release_s=5.0, host_idle_release_s=10.0)),
        ("mqfq-sticky", ClusterConfig(gpus=6, slots=2, host_memory_mb=16384, interference=0.5, adaptive_slots=4)),
        ("torpor", ClusterConfig(gpus=6, host_memory_mb=16384, gpus_per_link=2)),
    ],
)
def test_running_totals_equal_the_sums_over_every_gpu(policy: str, cluster: ClusterConfig) -> None:
    workload = build_workload(
        load_azure2019(shipped_trace()),
        WorkloadConfig(minutes=2, working_set=50, rpm=400, slo_factor=3.0),
        paper_table1(),
    )
    _CheckedRun.checks = 0
    run = _CheckedRun(workload, _make_scheduler(workload, make_policy(policy, PolicyConfig()), cluster), cluster, {})
    run.run(None, Meter())
    assert _CheckedRun.checks > 100
    result = run.result(policy, PolicyConfig())
    assert result.completed + result.timed_out == len(workload.requests)  # (overloaded: some wait past 60 s)


def test_scaled_rpm_is_the_papers_load_per_gpu() -> None:
    assert scaled_rpm(12) == 325
    assert scaled_rpm(100) == 2708
    assert scaled_rpm(1000) == 27083


def test_area_shares_split_a_profile_by_code_area() -> None:
    workload = build_workload(load_azure2019(shipped_trace()), WorkloadConfig(minutes=1), paper_table1())
    profiler = cProfile.Profile()
    profiler.enable()
    simulate(workload, "lalb-o3")
    profiler.disable()
    shares = area_shares(pstats.Stats(profiler))
    assert set(shares) == {"simulator/", "scheduler/", "cache_manager/", "gpufaas/", "other"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert shares["simulator/"] > 0 and shares["scheduler/"] > 0
