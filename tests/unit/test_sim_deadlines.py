"""Call deadlines in the simulator: the real path's rule (scheduler.calls.CallBook.tick) that a call
still waiting (in the global queue, or parked behind a GPU) at its deadline is answered 504 and
never runs. (A dispatched one is cut at its deadline: tests/unit/test_sim_cuts.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from gpufaas.cli import app
from gpufaas.errors import InvalidInput
from gpufaas.functions import DEFAULT_TIMEOUT_S
from gpufaas.profiles import ModelProfile, paper_table1
from gpufaas.types import DEFAULT_BATCH_SIZE, Request
from simulator.engine import ClusterConfig, simulate
from simulator.report import aggregate, shipped_trace
from simulator.workload import Workload, WorkloadConfig, build_workload, load_trace, zipf_workload

ONE_GPU = ClusterConfig(gpus=1, slots=1, gpu_memory_mb=4096)


def _overloaded(calls: int = 50, timeout_s: float = 2.0) -> Workload:
    """1 GPU, one call at a time, calls of 1 s (after a 0.5 s load) every 0.1 s: ten times its capacity."""
    return zipf_workload(
        calls=calls,
        models=1,
        zipf_exponent=1.0,
        memory_mb=1000,
        gap_s=0.1,
        seed=0,
        load_time_s=0.5,
        inference_time_s=1.0,
        timeout_s=timeout_s,
    )


def test_calls_past_their_deadline_time_out_out_of_the_latency_figures() -> None:
    result = simulate(_overloaded(), "lalb", cluster=ONE_GPU)
    # One call runs at a time, each for 1 s: at each end the oldest call whose deadline (arrival
    # + 2 s) has not passed goes next. The first completes; every later one waited over 1 s, so
    # its deadline comes while it runs: it is cut there, its worker killed, and the next is a
    # miss that cannot load and run in time either (tests/unit/test_sim_cuts.py).
    assert result.completed == 1
    assert result.timed_out == 49
    assert result.completed + result.timed_out == result.requests
    assert result.timeout_rate == pytest.approx(49 / 50)
    # The percentiles cover completed calls only: none of them waited past its deadline.
    assert result.max_wait_s < 2.0
    assert result.p99_latency_s == pytest.approx(1.5)
    # Oldest first, each in turn was dispatched with less than its run left to its deadline.
    assert (result.hits, result.misses) == (1, 49)


def test_a_call_dispatched_before_its_deadline_is_cut_at_it() -> None:
    # The first call's load and run (1.5 s) outlast a deadline of 1.2 s: the node cuts it there.
    result = simulate(_overloaded(calls=1, timeout_s=1.2), "lalb", cluster=ONE_GPU)
    assert (result.completed, result.timed_out, result.makespan_s) == (0, 1, 1.2)
    assert simulate(_overloaded(calls=1, timeout_s=1.5), "lalb", cluster=ONE_GPU).avg_latency_s == pytest.approx(1.5)


def _parking(timeout_s: float) -> Workload:
    """A's calls on 2 GPUs: the first loads A on g0 (2 s) and runs (1 s); at 2.5 s and 2.6 s the
    next two park behind g0 (waiting for it beats loading A on idle g1); the second would start
    at 4 s. The last is fn-B's (A too), whose timeout is `timeout_s`; fn-A's is 60 s."""
    model = ModelProfile("A", "rtx2080", 1000, 2.0, 1.0, DEFAULT_BATCH_SIZE)
    return Workload(
        requests=[
            Request(f"r{i:06d}", function, "A", at_s, DEFAULT_BATCH_SIZE)
            for i, (function, at_s) in enumerate((("fn-A", 0.0), ("fn-A", 2.5), ("fn-B", 2.6)))
        ],
        profiles=[model],
        function_models={"fn-A": "A", "fn-B": "A"},
        top_function="fn-A",
        start_minute=0,
        minutes=1,
        timeouts_s={"fn-A": 60.0, "fn-B": timeout_s},
    )


def test_a_call_parked_behind_a_gpu_times_out_there_too() -> None:
    cluster = ClusterConfig(gpus=2, slots=1, gpu_memory_mb=4096)
    result = simulate(_parking(timeout_s=1.0), "lalb", cluster=cluster)
    assert result.parks == 2
    assert (result.completed, result.timed_out) == (2, 1)  # the one at 2.6 s: its deadline 3.6 s came first
    assert simulate(_parking(timeout_s=60.0), "lalb", cluster=cluster).completed == 3


def test_with_no_deadline_reached_the_figures_are_those_without_deadlines() -> None:
    short = simulate(_overloaded(timeout_s=3600.0), "lalb", cluster=ONE_GPU)
    assert (short.completed, short.timed_out, short.timeout_rate) == (50, 0, 0.0)
    assert short.p99_latency_s > 40.0  # every call ran, the last after waiting ~45 s


def test_a_workload_carries_each_functions_timeout_defaulting_to_the_functions_default() -> None:
    assert _overloaded(timeout_s=2.0).timeout_s("fn-m0") == 2.0
    assert (
        zipf_workload(calls=1, models=1, zipf_exponent=1.0, memory_mb=1, gap_s=1.0, seed=0).timeout_s("fn-m0")
        == DEFAULT_TIMEOUT_S
    )
    trace = load_trace(shipped_trace(), "azure2019")
    workload = build_workload(trace, WorkloadConfig(minutes=1, working_set=3, timeout_s=7.0), paper_table1())
    assert {workload.timeout_s(f) for f in workload.function_models} == {7.0}
    assert (
        build_workload(trace, WorkloadConfig(minutes=1, working_set=3), paper_table1()).timeout_s(
            next(iter(workload.function_models))
        )
        == DEFAULT_TIMEOUT_S
    )


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf"), 3601.0])
def test_a_timeout_out_of_range_is_refused(timeout_s: float) -> None:
    with pytest.raises(InvalidInput, match="timeout_s"):
        zipf_workload(calls=1, models=1, zipf_exponent=1.0, memory_mb=1, gap_s=1.0, seed=0, timeout_s=timeout_s)


def _sim(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        app, ["sim", "--minutes", "1", "--rpm", "60", "--working-set", "5", "--no-optimum", *args]
    )
    return result.exit_code, result.stdout, " ".join(result.stderr.replace("│", " ").split())


def test_sim_takes_every_functions_timeout_and_reports_the_calls_that_timed_out() -> None:
    code, out, err = _sim("--json", "--gpus", "1", "--timeout-s", "0.5")
    assert code == 0, err
    data = json.loads(out)
    assert data["timeout_s"] == 0.5
    assert data["timed_out"] > 0 and data["completed"] + data["timed_out"] == data["requests"] == 60
    assert data["timeout_rate"] == pytest.approx(data["timed_out"] / 60)
    code, out, _ = _sim("--json", "--gpus", "1")
    assert (json.loads(out)["timeout_s"], json.loads(out)["timed_out"]) == (DEFAULT_TIMEOUT_S, 0)


def test_sims_table_says_which_calls_its_latencies_cover_when_some_timed_out() -> None:
    code, out, _ = _sim("--gpus", "1", "--timeout-s", "0.5")
    assert code == 0
    words = " ".join(out.split())
    assert "timed out" in words and "timeout 0.5 s" in words
    assert "latencies cover the completed calls only" in words
    code, out, _ = _sim()
    assert "timed out" not in " ".join(out.split())  # none did: the table is as it was


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "3601"])
def test_sim_refuses_a_timeout_a_function_could_not_have(value: str) -> None:
    code, _, err = _sim("--timeout-s", value)
    assert code == 2
    assert "'--timeout-s': must be in (0, 3600] s, as a function's timeout_s" in err and "Traceback" not in err, err


def test_runs_over_several_mappings_aggregate_their_timeout_rate() -> None:
    results = [
        dataclasses.replace(simulate(_overloaded(), "lalb", cluster=ONE_GPU), mapping=mapping)
        for mapping in ("ends", "seed 1")
    ]
    (group,) = aggregate(results)
    assert group.metrics["timeout_rate"].mean == pytest.approx(49 / 50)
