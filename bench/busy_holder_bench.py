"""Benchmark: what one placement costs the scheduler when every holder of the called model has its
worker busy, on GPUs whose memory is full (a busy cluster's steady state).

With D > 1 a GPU with a free slot may still run calls of the model, which its worker serves one at
a time: LALB weighs a new replica on another GPU against that wait (`_place_with_holders`). The
search for a GPU with room for one walks every idle GPU when none has room. It is made only where
the wait is longer than the least a load of the model could take (`ClusterState.least_load_time_s`):
a wait of a call or two against a load of seconds needs no search, and the fast path
(`lone_target`) places the call.

The cluster: `--gpus` GPUs of 8192 MB with D = 4, their memory full (two models of 3000 MB each),
the hot model A on `--holders` of them, one call of A running on each holder (A's worker busy for
its estimated inference), so that each new call of A is a lone hit whose best idle holder's worker
is busy. Each round submits one call of A, times `schedule()` (`time.perf_counter_ns`) and completes
the call, so the state is the same every round. Reported per GPU count: p50 and p90 of a decision
in microseconds, and how the call was placed (a hit on a holder).

Run: `python -m bench.busy_holder_bench [--gpus 100 1000 4000] [--rounds 4000] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.machine import print_results, run_metadata
from gpufaas.profiles import ModelProfile
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Dispatch, Estimator, PolicyConfig, Scheduler, make_policy
from simulator.engine import percentile

GPU_MEMORY_MB = 8192
MODEL_MB = 3000
LOAD_S = 2.0
INFERENCE_S = 0.05


def busy_holders_cluster(gpus: int, holders: int, policy: str) -> Scheduler:
    """`gpus` GPUs of D = 4, each full with two models; A on the first `holders`, one call of A
    running on each."""
    models = ("A", "B", "C")
    estimator = Estimator(ModelProfile(m, "rtx2080", MODEL_MB, LOAD_S, INFERENCE_S, 1) for m in models)
    scheduler = Scheduler(make_policy(policy, PolicyConfig()), estimator=estimator)
    for index in range(gpus):
        scheduler.add_gpu(GpuSpec(f"g{index}", GPU_MEMORY_MB, slots=4))
    for model in models:
        scheduler.register_model(ModelSpec(model, MODEL_MB))
    for index in range(gpus):
        for model in ("A", "B") if index < holders else ("B", "C"):
            scheduler.cache.admit(f"g{index}", model, MODEL_MB)
    for index in range(holders):
        request = Request(f"running-{index}", "fn-A", "A", 0.0)
        scheduler.submit(request)
        scheduler.dispatch(request, f"g{index}", 0.0)
    return scheduler


def measure(gpus: int, holders: int, rounds: int, policy: str) -> dict[str, Any]:
    scheduler = busy_holders_cluster(gpus, holders, policy)
    times_ns: list[int] = []
    hits = 0
    gc.collect()
    gc.disable()  # a collection would be charged to whichever round triggers it
    try:
        for index in range(rounds):
            request = Request(f"call-{index}", "fn-A", "A", 0.0)
            scheduler.submit(request)
            started = time.perf_counter_ns()
            (decision,) = scheduler.schedule(0.0)
            times_ns.append(time.perf_counter_ns() - started)
            assert isinstance(decision, Dispatch), decision
            hits += decision.hit
            scheduler.on_complete(request.request_id, 0.0)
    finally:
        gc.enable()
    micros = sorted(t / 1000 for t in times_ns)
    return {
        "policy": policy,
        "gpus": gpus,
        "holders": holders,
        "rounds": rounds,
        "p50_us": round(percentile(micros, 50), 2),
        "p90_us": round(percentile(micros, 90), 2),
        "hits": hits,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpus", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--holders", type=int, default=3, help="GPUs holding the hot model")
    parser.add_argument("--rounds", type=int, default=4000)
    parser.add_argument("--policy", default="lalb-o3")
    parser.add_argument("--out", type=Path, help="write the JSON there too")
    args = parser.parse_args(argv)
    results = [measure(gpus, args.holders, args.rounds, args.policy) for gpus in args.gpus]
    print_results(run_metadata(benchmark="busy_holder_bench", results=results), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
