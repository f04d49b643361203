"""`gpufaas sim`'s progress counts every call that ended: completed, timed out or refused."""

from __future__ import annotations

from typer.testing import CliRunner

from gpufaas.cli import app
from gpufaas.profiles import paper_table1
from simulator.engine import ClusterConfig, simulate
from simulator.report import shipped_trace
from simulator.workload import WorkloadConfig, build_workload, load_trace


def test_the_progress_ends_at_every_request_when_calls_time_out() -> None:
    """1 GPU, a 0.5 s deadline: most calls time out. The progress counted completed calls only, so
    a run ended short of its requests (e.g. 861/2700); it ends at every request now, counted
    once each (never backwards)."""
    workload = build_workload(
        load_trace(shipped_trace(), "azure2019"),
        WorkloadConfig(minutes=1, rpm=60, working_set=5, timeout_s=0.5),
        paper_table1(),
    )
    progress: list[int] = []
    result = simulate(workload, "lalb-o3", cluster=ClusterConfig(gpus=1), on_progress=progress.append)
    assert result.timed_out > 0 and result.completed < result.requests
    assert progress[-1] == result.requests == 60
    assert progress == sorted(progress)


def test_the_progress_line_of_gpufaas_sim_ends_at_every_request() -> None:
    run = ["sim", "--minutes", "1", "--rpm", "60", "--working-set", "5", "--gpus", "1", "--no-optimum", "--json"]
    result = CliRunner().invoke(app, [*run, "--timeout-s", "0.5", "--progress-every-s", "1000"])
    assert result.exit_code == 0, result.stderr
    assert "sim done: 60/60 requests" in result.stderr
