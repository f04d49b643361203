"""simulator.workload.DrawnRequests: a trace window's requests drawn as they are read."""

from __future__ import annotations

import random
from pathlib import Path

from gpufaas.profiles import paper_table1
from simulator.workload import TraceCounts, WorkloadConfig, build_workload

SECONDS_PER_MINUTE = 60


def _trace() -> TraceCounts:
    minutes = [10, 11, 12, 13]
    counts = {
        "hot": {10: 50, 11: 40, 13: 70},
        "warm": {10: 5, 12: 9, 13: 1},
        "cold": {11: 1, 13: 2},
    }
    return TraceCounts(path=Path("made-up.csv"), minutes=minutes, counts=counts)


def _whole_window_sorted(trace: TraceCounts, config: WorkloadConfig, functions: list[str]) -> list[tuple[float, str]]:
    """What building every arrival first and sorting them all at once gives (the definition)."""
    rng, drawn = random.Random(config.seed), []
    start = config.start_minute or trace.minutes[0]
    for minute in range(start, start + config.minutes):
        counts = [trace.counts[f].get(minute, 0) for f in functions]
        if not sum(counts):
            continue
        weight = sum(counts)
        shares = [c * config.rpm // weight for c in counts]
        leftover = config.rpm - sum(shares)
        for i in sorted(range(len(counts)), key=lambda i: (-(counts[i] * config.rpm % weight), i))[:leftover]:
            shares[i] += 1
        offset_s = (minute - start) * SECONDS_PER_MINUTE
        for rank, share in enumerate(shares):
            drawn += [(offset_s + rng.uniform(0, SECONDS_PER_MINUTE), rank) for _ in range(share)]
    return [(arrival_s, functions[rank]) for arrival_s, rank in sorted(drawn)]


def test_the_stream_is_the_whole_window_sorted_at_once_and_the_same_on_every_read() -> None:
    config = WorkloadConfig(minutes=4, working_set=3, rpm=37, seed=3)
    workload = build_workload(_trace(), config, paper_table1())
    functions = ["hot", "warm", "cold"]

    first = list(workload.requests)
    assert [(r.arrival_s, r.function) for r in first] == _whole_window_sorted(_trace(), config, functions)
    assert [r.request_id for r in first] == [f"r{i:06d}" for i in range(len(first))]
    assert len(workload.requests) == len(first) == 37 * 4
    assert list(workload.requests) == first  # drawn again, the same
    assert workload.requests[5] == first[5] and workload.requests[-3:] == first[-3:]
    assert workload.requests == first and workload.requests != first[:-1]


def test_a_minute_without_invocations_yields_no_requests_and_draws_nothing() -> None:
    trace = _trace()
    trace.counts["hot"].pop(11)
    trace.counts["cold"].pop(11)
    config = WorkloadConfig(start_minute=10, minutes=3, working_set=2, rpm=10, seed=1)
    workload = build_workload(trace, config, paper_table1())
    minutes = sorted({int(r.arrival_s // SECONDS_PER_MINUTE) for r in workload.requests})
    assert minutes == [0, 2]
    assert len(workload.requests) == 20
    expected = _whole_window_sorted(trace, config, ["hot", "warm"])
    assert [(r.arrival_s, r.function) for r in workload.requests] == expected
