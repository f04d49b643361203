"""The reconciler (a term's loop, scheduler.node_links): now and then it asks every attached node
which models it runs and reconciles the GPUs' LRU lists, and the node's host tier, with that
(phantoms dropped, orphans adopted or evicted): the cache follows what really runs, whatever was
missed (a worker that died between calls, a lost Done, a model the node pushed out of its host
tier)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gpufaas.keys import gpu_address
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import AnswerTooLarge, Connection, ConnectionLost, MessageType, RemoteError
from scheduler.calls import Effect

if TYPE_CHECKING:
    from scheduler.node_links import NodeLink, NodeLinks

log = logging.getLogger("gpufaas.scheduler")

RECONCILE_S = 5.0  # how often the GPUs' LRU lists are checked against the workers nodes run
RECONCILE_CONCURRENCY = 16  # nodes asked at once
# A node that does not answer an Attach, Revoke or probe within this is out (scheduler.node_links);
# one that does not answer a WORKERS request within it is passed over this round.
NODE_TIMEOUT_S = 2.0


async def reconcile_nodes(links: NodeLinks) -> None:
    """Every RECONCILE_S, reconcile each attached node of `links`, RECONCILE_CONCURRENCY of them at
    a time: a node that does not answer holds up no other (one after another, 5 silent nodes of 50
    held the rest 10 s a round). It runs for the term: what goes wrong with one node (its answer
    malformed, say) is logged and the loop goes on."""
    while True:
        await asyncio.sleep(RECONCILE_S)
        asking = asyncio.Semaphore(RECONCILE_CONCURRENCY)
        nodes = [(node, node.conn) for node in links.nodes.values() if node.conn is not None and node.gpu_ids]
        await asyncio.gather(*(_reconcile_logged(links, node, conn, asking) for node, conn in nodes))


async def _reconcile_logged(links: NodeLinks, node: NodeLink, conn: Connection, asking: asyncio.Semaphore) -> None:
    async with asking:
        try:
            await reconcile_node(links, node, conn)
        except Exception:  # (ending the loop would leave every node unreconciled for the term)
            log.exception("node %s: cannot reconcile its workers", node.record.node)


async def reconcile_node(links: NodeLinks, node: NodeLink, conn: Connection) -> None:
    """Ask one node, on `conn`, which models it runs and reconcile its GPUs and host tier."""
    frames = node.holdings_frames
    try:
        frame = await conn.request(MessageType.WORKERS, pb.WorkersRequest(), timeout_s=NODE_TIMEOUT_S)
    except AnswerTooLarge as exc:  # (the link stays: nothing would say why it is never reconciled)
        log.warning("node %s: its list of workers is not reconciled: %s", node.record.node, exc)
        return
    except (ConnectionLost, TimeoutError, RemoteError):
        return  # the node's keep-attached loop deals with a node that is gone
    if not node.gpu_ids:  # detached meanwhile
        return
    reply = frame.message(pb.AttachReply)
    resident = resident_of(node.record.node, reply)
    effects: list[Effect] = []
    for address in node.gpu_ids:
        effects += links.book.reconcile(address, resident.get(address, {}), links.clock())
    effects += links.book.reconcile_host(node.record.node, reply.host_memory_mb, parked_of(reply))
    links.holdings_answered(node, reply.holdings, frames)
    links.apply(effects + links.book.schedule(links.clock()))


def resident_of(node: str, reply: pb.AttachReply) -> dict[str, dict[str, int]]:
    """ "node/gpu" -> {model: MiB} of what a node reports it runs."""
    resident: dict[str, dict[str, int]] = {}
    for worker in reply.workers:
        resident.setdefault(gpu_address(node, worker.gpu), {})[worker.model] = int(worker.memory_mb)
    return resident


def parked_of(reply: pb.AttachReply) -> dict[str, int]:
    """{model: MiB} of a node's host tier, least recently parked first."""
    return {worker.model: int(worker.memory_mb) for worker in reply.parked}
