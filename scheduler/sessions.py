"""The scheduler's wire sessions: a gateway's connection (Place, Abandon, Cluster) and a node's
(Done, Holdings), each frame turned into a call on the service or its book."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from gpufaas.metrics import outcome_label
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import Connection, Frame, MessageType
from scheduler.node_links import NodeLink

if TYPE_CHECKING:
    from scheduler.service import SchedulerService


class GatewaySession:
    """One gateway's connection: its calls are owned by the connection itself. A scheduler that
    does not lead closes it at its first frame."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        service = self.service
        if not service.serves_gateways():
            conn.close()  # a standby: the gateway finds the leader in etcd
            return
        if frame.type == MessageType.PLACE:
            service.place(conn, frame.message(pb.Place))
        elif frame.type == MessageType.ABANDON:
            abandon = frame.message(pb.Abandon)
            if abandon.reason == pb.Abandon.CANCELLED:
                service.term.cancel(conn, abandon.call_id)
            service.apply(service.book.abandon(conn, abandon.call_id, abandon.attempt, abandon.reason, service.clock()))
        elif frame.type == MessageType.CLUSTER:
            conn.reply(frame, MessageType.CLUSTER_REPLY, cluster_reply(service, frame.message(pb.ClusterRequest)))
        elif frame.is_request:
            conn.reply_error(frame, pb.INVALID, f"the scheduler does not answer message type {frame.type}")

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        service = self.service
        service.apply(service.book.owner_lost(conn, service.clock()))


class NodeSession:
    """The scheduler's connection to one node: Done messages arrive on it."""

    def __init__(self, service: SchedulerService, node: NodeLink) -> None:
        self.service = service
        self.node = node

    def on_frame(self, conn: Connection, frame: Frame) -> None:
        if frame.type == MessageType.HOLDINGS:
            self.service.holdings_reported(self.node, frame.message(pb.Holdings))
            return
        if frame.type != MessageType.DONE:
            return
        done = frame.message(pb.Done)
        service = self.service
        placed = service.book.placement(done.call_id, done.attempt)
        if placed is not None and done.worker_lost and done.peak_memory_mb > 0:
            # The node stopped a worker it measured over its declared size, with no room for that on
            # its GPU (gpu_manager.pool): later admissions book what it measured, so that the next
            # call makes room for the model instead of loading it to be stopped again. (Otherwise
            # the book's `done` takes the size in, which it does not for a worker lost.) Queued calls
            # that no GPU could hold at that size are answered.
            service.apply(service.book.observe_memory(placed[0], placed[1], int(done.peak_memory_mb), service.clock()))
        if placed is not None:
            self._measured(done, *placed)
        service.apply(
            service.book.done(
                done.call_id,
                done.attempt,
                done.outcome,
                service.clock(),
                loaded=done.loaded,
                load_time_s=done.load_time_s,
                inference_time_s=done.inference_time_s,
                peak_memory_mb=int(done.peak_memory_mb),
                batch_calls=done.batch_calls,
                worker_lost=done.worker_lost,
                lease_ended=done.lease_ended,
                lease_call_id=done.lease_call_id,
            )
        )

    def _measured(self, done: pb.Done, model: str, gpu_id: str) -> None:
        """What the node measured, into the metrics."""
        service = self.service
        try:
            gpu_type = service.scheduler.gpu(gpu_id).spec.gpu_type
        except KeyError:  # its node left meanwhile
            gpu_type = ""
        ok = done.outcome == pb.OK
        service.metrics.done(
            model,
            gpu_type,
            ok=ok,
            outcome="" if ok else outcome_label(done.outcome),  # a label of failures only
            loaded=done.loaded,
            load_time_s=done.load_time_s,
            inference_time_s=done.inference_time_s,
            retired=not service.book.runs(model),  # (a call of a function deleted while it ran)
        )

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        pass  # NodeLinks' keep-attached loop sees `conn.closed` resolve


def cluster_reply(service: SchedulerService, request: pb.ClusterRequest | None = None) -> pb.ClusterReply:
    """The cluster as this scheduler sees it: what a gateway's CLUSTER request is answered with
    (a `summary` one: without the GPUs, the queue and the evictions; one with a `queue_limit`:
    only that many of the queue's oldest calls, with the queue's length)."""
    if request is not None and request.summary:
        return pb.ClusterReply(
            policy=service.policy_name,
            queue_capacity=service.book.queue_capacity,
            scheduler=service.name,
            epoch=service.leadership.epoch,
        )
    now = service.clock()
    gpus = []
    for node in service.links.nodes.values():
        for address in node.gpu_ids:
            state = service.scheduler.gpu(address)
            cache = service.scheduler.cache.gpu(address)
            gpus.append(
                pb.GpuInfo(
                    gpu=address,
                    node=node.record.node,
                    status="idle" if state.idle else "busy",
                    memory_used_mb=cache.used_mb,
                    memory_capacity_mb=cache.capacity_mb,
                    lru=cache.lru_list(),
                    local_queue=len(state.local_queue),
                    running=list(state.running),
                    running_models=[r.model for r in state.running.values()],
                    gpu_type=state.spec.gpu_type,
                    slots=state.spec.slots,
                    host_tier=host.lru_list() if (host := service.scheduler.cache.host_of(address)) else [],
                )
            )
    queue_limit = request.queue_limit if request is not None and request.queue_limit else None
    queue = [
        pb.QueuedCall(call_id=r.request_id, function=r.function, model=r.model, waited_s=now - r.arrival_s)
        for r in itertools.islice(service.scheduler.queue, queue_limit)
    ]
    evictions = [
        pb.EvictionRecord(gpu=e.gpu, model=e.model, reason=e.reason, age_s=now - e.at_s)
        for e in service.evictions.recent()
    ]
    return pb.ClusterReply(
        gpus=gpus,
        queue=queue,
        queue_length=len(service.scheduler.queue),
        policy=service.policy_name,
        queue_capacity=service.book.queue_capacity,
        evictions=evictions,
        scheduler=service.name,
        epoch=service.leadership.epoch,
    )
