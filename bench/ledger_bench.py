"""Benchmark: what the node's ledger of grants costs a busy node: per admission, and per sweep.

A node admits every placed call's grant once (`GrantLedger.admit`: the signature checked, the
grant remembered `keep_s` past its claim time), and its daemon sweeps the ledger every
`PRUNE_INTERVAL_S` (`GrantLedger.prune`). The sweep runs on the node's event loop: while it runs,
no call on that node is admitted or answered. This drives one ledger on a virtual clock at `--rate`
grants a second for `--seconds`, each grant claimable `--claim-s` ahead and kept 60 s past that
(the node's default), sweeping every `PRUNE_INTERVAL_S`, and times each admission and each sweep
(`time.perf_counter_ns`; tokens are signed beforehand, outside the timing). Reported: p50 / p99 of
an admission in microseconds, the longest sweep and the median sweep after the first minute in
milliseconds (the loop's stall), and how many grants the ledger holds at the end.

Run: `python -m bench.ledger_bench [--rate 3000] [--seconds 120] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.machine import print_results, run_metadata
from gpu_manager.daemon import PRUNE_INTERVAL_S
from gpu_manager.ledger import GrantLedger
from gpufaas.grants import new_key, sign
from gpufaas.proto import gpufaas_pb2 as pb
from simulator.engine import percentile

START_UNIX_S = 1_700_000_000.0
SCHEDULER = "bench-scheduler"


def tokens(count: int, rate: float, claim_s: float, key: bytes) -> list[tuple[float, bytes]]:
    """(when presented, token) for `count` grants at `rate` a second, each claimable `claim_s` on."""
    out = []
    for index in range(count):
        now = START_UNIX_S + index / rate
        grant = pb.Grant(
            scheduler_id=SCHEDULER,
            call_id=f"{index:032x}",
            attempt=1,
            node="n1",
            gpu=str(index % 8),
            claim_by_unix_s=now + claim_s,
            expires_unix_s=now + claim_s + 30.0,
        )
        out.append((now, sign(grant, key, function_part=b"")))
    return out


def run(rate: float, seconds: float, claim_s: float) -> dict[str, Any]:
    key = new_key()
    ledger = GrantLedger("n1", frozenset(str(gpu) for gpu in range(8)))
    ledger.attach(SCHEDULER, key)
    presented = tokens(int(rate * seconds), rate, claim_s, key)
    admit_ns: list[int] = []
    sweeps_ns: list[tuple[float, int]] = []
    next_sweep = START_UNIX_S + PRUNE_INTERVAL_S
    gc.collect()
    gc.disable()  # (the collector's own pauses are not the ledger's)
    try:
        for now, token in presented:
            if now >= next_sweep:
                started = time.perf_counter_ns()
                ledger.prune(now)
                sweeps_ns.append((now - START_UNIX_S, time.perf_counter_ns() - started))
                next_sweep += PRUNE_INTERVAL_S
            started = time.perf_counter_ns()
            ledger.admit(token, now)
            admit_ns.append(time.perf_counter_ns() - started)
    finally:
        gc.enable()
    steady = [ns for at_s, ns in sweeps_ns if at_s > 60.0] or [ns for _, ns in sweeps_ns]
    admit_us = sorted(ns / 1e3 for ns in admit_ns)
    return {
        "rate_per_s": rate,
        "seconds": seconds,
        "admitted": ledger.admitted,
        "admit_p50_us": round(percentile(admit_us, 50), 2),
        "admit_p99_us": round(percentile(admit_us, 99), 2),
        "sweeps": len(sweeps_ns),
        "sweep_max_ms": round(max(ns for _, ns in sweeps_ns) / 1e6, 3) if sweeps_ns else None,
        "sweep_median_ms_after_60s": round(statistics.median(steady) / 1e6, 3) if steady else None,
        "grants_held_at_end": len(ledger),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rate", type=float, nargs="+", default=[3000.0], help="grants admitted a second")
    parser.add_argument("--seconds", type=float, default=120.0, help="virtual seconds of admissions")
    parser.add_argument("--claim-s", type=float, default=5.0, help="the scheduler's --claim-s")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = [run(rate, args.seconds, args.claim_s) for rate in args.rate]
    print_results(run_metadata(benchmark="ledger_bench", results=results), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
