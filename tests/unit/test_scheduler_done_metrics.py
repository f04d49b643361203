"""The scheduler's metrics from a node's Done: a failed attempt is counted by its outcome, an OK
one by its cache result (scheduler.sessions.NodeSession, scheduler.metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.types import ModelSpec
from gpufaas.wire import Frame, MessageType
from scheduler.service import SchedulerService
from scheduler.sessions import NodeSession
from tests.fakes import MemoryStore, PlacedBook

COUNTERS = ("gpufaas_scheduler_call_failures_total", "gpufaas_scheduler_calls_total")
OUTCOMES = [pb.OK, pb.HANDLER_ERROR, pb.TIMEOUT, pb.OUTPUT_TOO_LARGE]


def counted_after(outcome: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Deliver one Done of `outcome` for a placed call of model `m`: the failures counter by
    outcome label, and the calls counter by cache label (only the non-zero samples)."""
    counted: dict[str, float] = {}

    async def scenario() -> None:
        service = SchedulerService(MemoryStore())
        monkeypatch.setattr(service, "book", PlacedBook(service.book, "m", "g0"))
        assert not list(service.scheduler.gpus())  # so its gpu("g0") raises KeyError: the GPU is gone
        done = pb.Done(call_id="c", attempt=1, outcome=outcome, inference_time_s=0.01)  # type: ignore[arg-type]
        conn: Any = None
        NodeSession(service, None).on_frame(  # type: ignore[arg-type]  # the node is not looked at
            conn, Frame(MessageType.DONE, 0, 0, done.SerializeToString(), b"")
        )
        for family in service.metrics.registry.collect():
            for sample in family.samples:
                if sample.value and sample.name in COUNTERS:
                    counted[f"{sample.name}:{','.join(sample.labels.values())}"] = sample.value

    asyncio.run(scenario())
    return counted


@pytest.mark.parametrize("outcome", OUTCOMES, ids=[pb.Outcome.Name(o) for o in OUTCOMES])
def test_a_done_is_counted_once_under_its_outcome(outcome: int, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = counted_after(outcome, monkeypatch)
    if outcome == pb.OK:
        assert counted == {"gpufaas_scheduler_calls_total:hit": 1.0}
    else:
        label = pb.Outcome.Name(outcome).lower()
        assert counted == {f"gpufaas_scheduler_call_failures_total:{label}": 1.0}


def test_an_outcome_this_scheduler_does_not_know_is_counted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    # A node of a newer gpufaas (a rolling upgrade) may answer an Outcome this scheduler's
    # protobuf has no name for: naming it for the failures' label raised ValueError before the
    # book took the Done in, so the call's attempt stayed open (its slot held) until it was lost.
    assert counted_after(99, monkeypatch) == {"gpufaas_scheduler_call_failures_total:unknown": 1.0}


def test_a_retired_models_late_done_leaves_no_series_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # A function deleted (or updated to a new package) while calls of its model ran: their Dones,
    # which come after the model's series were dropped (SchedulerMetrics.forget_model), made
    # them again, and nothing dropped them a second time: a gpufaas_load_seconds and a
    # gpufaas_inference_seconds series per deleted function that had calls under way, for good.
    async def scenario() -> list[str]:
        service = SchedulerService(MemoryStore())
        service.scheduler.register_model(ModelSpec("m", 10))
        service.scheduler.register_model(ModelSpec("kept", 10))
        conn: Any = None
        models: list[str] = []
        for model in ("m", "kept"):
            monkeypatch.setattr(service, "book", PlacedBook(service.book, model, "g0"))
            if model == "m":  # its function deleted while the call ran (the catalog's `_retire`)
                service.catalog.retired(model)
                service.book.retire(model)
            done = pb.Done(call_id="c", attempt=1, outcome=pb.OK, loaded=True, load_time_s=2.0, inference_time_s=0.01)
            NodeSession(service, None).on_frame(  # type: ignore[arg-type]
                conn, Frame(MessageType.DONE, 0, 0, done.SerializeToString(), b"")
            )
        for family in service.metrics.registry.collect():
            if family.name in ("gpufaas_load_seconds", "gpufaas_inference_seconds"):
                models += [s.labels["model"] for s in family.samples if s.name.endswith("_count")]
        return models

    assert asyncio.run(scenario()) == ["kept", "kept"]
