"""What a node passes on of a worker's own figures for a call (its inference time, its batch):
held to what the node saw (gpu_manager.workers' `held_to_what_the_node_saw`), so that a handler
that rewrites them cannot make its function look slower than a load and be given GPUs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpu_manager.workers import held_to_what_the_node_saw
from gpufaas.proto import gpufaas_pb2 as pb
from tests.unit.test_gpu_manager_pool import Node, Shelf, ok, on_cpu, on_own_pool, open_pool


@pytest.mark.parametrize(
    ("reported_s", "batch_calls", "expected_s", "expected_batch"),
    [
        (0.4, 3, 0.4, 3),  # within what the node saw: as reported
        (0.0, 0, 0.0, 1),  # nothing timed (an error before predict); no batch: one call
        (5000.0, 9, 0.5, 4),  # more time than the call spent at the worker; more calls than were there
        (-1.0, 1, 0.5, 1),
        (math.nan, 1, 0.5, 1),
    ],
)
def test_a_workers_figures_are_held_to_the_calls_time_at_it_and_the_calls_it_had(
    reported_s: float, batch_calls: int, expected_s: float, expected_batch: int
) -> None:
    result = pb.CallResult(call_id="c#1", inference_s=reported_s, batch_calls=batch_calls)
    held_to_what_the_node_saw(result, elapsed_s=0.5, most_calls=4)
    assert result.inference_s == pytest.approx(expected_s) and result.batch_calls == expected_batch


@pytest.mark.parametrize("outcome", [pb.WORKER_DIED, pb.REFUSED, pb.LOAD_FAILED, 9999])
def test_an_outcome_that_is_not_a_workers_is_its_handlers_error(outcome: int) -> None:
    # A handler can rewrite the protocol's constants in its process (or write any frame to its
    # socket): WORKER_DIED would drop its model while resident, REFUSED have its call placed again,
    # an outcome the protocol does not name fail the node's Done (its slot held till the deadline).
    result = pb.CallResult(call_id="c#1", outcome=outcome, message="from the handler")  # type: ignore[arg-type]
    held_to_what_the_node_saw(result, elapsed_s=0.5, most_calls=1)
    assert result.outcome == pb.HANDLER_ERROR
    assert result.message == f"its worker answered outcome {outcome}, which is not a worker's: from the handler"


def test_a_handler_that_rewrites_its_workers_clock_reports_no_more_than_the_call_took(tmp_path: Path) -> None:
    # The fixture's load() swaps the clock its worker times predict by for one 10,000 times as fast:
    # a call of 0.3 s would be reported at 3,000 s, and the scheduler would give it replicas.
    async def scenario(node: Node) -> None:
        liar = on_cpu("liar", node.shelf.digest("time_liar_function"), environment={"LIE_FACTOR": "1e4"})
        ok(await node.call(liar, {"sleep_s": 0}))  # the miss: loaded
        hit = await node.call(liar, {"sleep_s": 0.3})
        assert ok(hit) == {"factor": 1e4}
        assert 0.3 <= hit.inference_time_s < 2.0, hit.inference_time_s
        assert hit.batch_calls == 1

    on_own_pool(tmp_path, "cpu", scenario)


def test_a_fast_calls_inference_time_survives_the_daemons_millisecond_loop_clock(tmp_path: Path) -> None:
    # The daemons run on uvloop, whose loop.time() is the libuv clock: cached per turn of the loop,
    # in whole milliseconds. Timed by it, a call answered within the millisecond it was written in
    # took 0 s at the node, its worker's honest figure was held down to 0, and the scheduler's
    # inference series and estimates saw fast functions take no time at all.
    uvloop = pytest.importorskip("uvloop")
    shelf = Shelf(tmp_path)

    async def main() -> None:
        async with open_pool("cpu", shelf) as node:
            echo = on_cpu("echo", shelf.digest("echo_function"))
            ok(await node.call(echo, {"n": 0}))  # the miss: loaded
            hits = [await node.call(echo, {"n": i}) for i in range(20)]
            times_s = [hit.inference_time_s for hit in hits]
            assert all(0 < t < 1.0 for t in times_s), times_s

    uvloop.run(main())
