"""A workload whose models do not all fit the simulated GPUs: the calls of a model larger than
every GPU are refused at once and counted as rejected (as the service answers them 503 at
submit), the rest run; a workload none of whose models fits is refused before any run, naming
the memory a GPU needs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import simulator.report
from gpufaas.cli import app
from gpufaas.errors import ModelTooLarge
from gpufaas.profiles import ModelProfile
from gpufaas.types import DEFAULT_BATCH_SIZE, Request
from scheduler import registered_policies
from simulator.engine import ClusterConfig, simulate
from simulator.workload import Workload

TWO_GPUS = ClusterConfig(gpus=2, slots=1, gpu_memory_mb=4096)
runner = CliRunner()


def _workload(sizes_mb: dict[str, int]) -> Workload:
    """Function fn-M of model M (`sizes_mb[M]` MB, load 0.5 s, 0.1 s a call) for each M, called
    every second, the models taking turns: 4 calls each."""
    models = list(sizes_mb)
    profiles = [ModelProfile(m, "rtx2080", mb, 0.5, 0.1, DEFAULT_BATCH_SIZE) for m, mb in sizes_mb.items()]
    calls = [models[i % len(models)] for i in range(4 * len(models))]
    return Workload(
        requests=[Request(f"r{i:06d}", f"fn-{m}", m, float(i), DEFAULT_BATCH_SIZE) for i, m in enumerate(calls)],
        profiles=profiles,
        function_models={f"fn-{m}": m for m in models},
        top_function=f"fn-{models[0]}",
        start_minute=0,
        minutes=1,
    )


@pytest.mark.parametrize("policy", registered_policies())
def test_calls_of_a_model_larger_than_every_gpu_are_rejected_and_the_rest_run(policy: str) -> None:
    result = simulate(_workload({"A": 1000, "HUGE": 9000, "B": 2000}), policy, cluster=TWO_GPUS)
    assert (result.requests, result.completed, result.rejected, result.timed_out) == (12, 8, 4, 0)
    assert result.rejection_rate == pytest.approx(4 / 12)
    assert result.to_json()["rejected"] == 4
    assert result.hits + result.misses == 8  # the rejected calls never reached a GPU


def test_a_workload_no_model_of_which_fits_is_refused_before_the_run_naming_the_memory_needed() -> None:
    with pytest.raises(ModelTooLarge, match=r"at least 5000 MB .*, 9000 MB to run every model"):
        simulate(_workload({"BIG": 5000, "HUGE": 9000}), "lalb", cluster=TWO_GPUS)


def test_valid_workloads_reject_nothing() -> None:
    result = simulate(_workload({"A": 1000, "B": 4096}), "lalb-o3", cluster=TWO_GPUS)
    assert (result.completed, result.rejected, result.rejection_rate) == (8, 0, 0.0)


def test_cli_refuses_gpus_smaller_than_every_model_before_simulating(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*_: object, **__: object) -> None:
        raise AssertionError("the simulation started")

    monkeypatch.setattr(simulator.report, "execute", no_run)
    result = runner.invoke(app, ["sim", "--gpu-memory-mb", "1000", "--gpus", "2", "--minutes", "1", "--rpm", "30"])
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    # The shipped trace's smallest model is 1269 MB, its largest 3947 MB.
    assert said.startswith("error: no model of the workload fits a GPU of 1000 MB"), said
    assert "give the GPUs at least 1269 MB (gpufaas sim --gpu-memory-mb), 3947 MB to run every model" in said
    assert "Traceback" not in result.output


def test_cli_counts_the_calls_of_models_too_large_as_rejected() -> None:
    argv = ["sim", "--gpu-memory-mb", "3000", "--gpus", "2", "--minutes", "1", "--rpm", "60", "--no-optimum"]
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 0 < data["rejected"] < data["requests"]
    assert data["rejection_rate"] == pytest.approx(data["rejected"] / data["requests"])
    table = runner.invoke(app, argv, env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert "rejection rate" in table.stdout and "rejected: calls whose model is larger" in table.stdout


def test_the_floor_leaves_out_the_calls_the_run_rejects() -> None:
    # HUGE (7000 MB) fits the pool of 2 x 4096 MB but no GPU: its calls are rejected, so the floor
    # covers A's and B's 8 calls, 2 cold misses (both fit one GPU), not 12 calls with HUGE's misses.
    workload = _workload({"A": 1000, "HUGE": 7000, "B": 1000})
    optimum = simulator.report.workload_optimum(workload, TWO_GPUS)
    assert (optimum.requests, optimum.misses) == (8, 2)
    result = simulate(workload, "lalb", cluster=TWO_GPUS)
    assert optimum.miss_ratio <= result.miss_ratio
