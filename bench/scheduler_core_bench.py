"""The placement benchmark's decision core alone, in one process: the `Scheduler` (lalb-o3, D = 4)
over 50 nodes x 20 GPUs of 8,192 MB with placement_bench's Azure mix, 64 calls kept outstanding;
no wire, no service, no etcd. Prints the process CPU time per placement of submit + schedule +
on_complete + schedule, the part of `scheduler_cpu_per_placement` that the policy and its state
cost (`python -m bench.scheduler_core_bench [--calls N] [--no-fast-path]`; `--no-fast-path` places
every call through the policy's full fill, `Scheduler(fast_path=False)`)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from collections import deque
from collections.abc import Sequence

from bench.placement_bench import trace_mix
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import PolicyConfig, Scheduler, make_policy

NODES, GPUS_PER_NODE, GPU_MEMORY_MB, SLOTS, OUTSTANDING = 50, 20, 8192, 4, 64
STEP_S = 0.001  # virtual time between completions: calls finish in the order they started


def build(seed: int, *, fast_path: bool = True) -> tuple[Scheduler, list[str], list[float], random.Random]:
    """The scheduler over the cluster and the mix, the mix's names and cumulative weights, the rng."""
    mix = trace_mix(200)
    scheduler = Scheduler(make_policy("lalb-o3", PolicyConfig()), fast_path=fast_path)
    for node in range(NODES):
        for gpu in range(GPUS_PER_NODE):
            scheduler.add_gpu(GpuSpec(f"n{node}/{gpu}", GPU_MEMORY_MB, gpu_type="cpu", slots=SLOTS, node=f"n{node}"))
    for spec in mix.functions:
        scheduler.register_model(ModelSpec(spec.name, spec.memory_mb))
    # Cumulative weights: `choices` draws the same as with the weights, without summing 200 per call.
    cumulative = list(itertools.accumulate(mix.weights))
    return scheduler, [spec.name for spec in mix.functions], cumulative, random.Random(seed)


def run(calls: int, seed: int = 1, *, fast_path: bool = True) -> dict[str, float]:
    """Warm up with `calls` completions, then time `calls` more; CPU microseconds per placement."""
    scheduler, names, cumulative, rng = build(seed, fast_path=fast_path)
    running: deque[str] = deque()
    ids = iter(range(10**12))
    now = 0.0

    def submit() -> None:
        model = rng.choices(names, cum_weights=cumulative)[0]
        scheduler.submit(Request(f"r{next(ids)}", function=model, model=model, arrival_s=now))

    def loop(count: int) -> int:
        nonlocal now
        placed = 0
        for _ in range(count):
            for decision in scheduler.schedule(now):
                running.append(decision.request.request_id)
                placed += 1
            now += STEP_S
            scheduler.on_complete(running.popleft(), now, inference_time_s=0.01)
            scheduler.schedule(now)
            submit()
        return placed

    for _ in range(OUTSTANDING):
        submit()
    loop(calls)
    started_s = time.process_time()
    placed = loop(calls)
    cpu_s = time.process_time() - started_s
    return {"placements": placed, "core_cpu_us_per_placement": round(cpu_s / placed * 1e6, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=30000, help="completions timed (after as many to warm up)")
    parser.add_argument("--no-fast-path", action="store_true", help="every call through the full fill")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.calls, fast_path=not args.no_fast_path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
