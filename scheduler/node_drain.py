"""The leader's side of a node's graceful stop (gpu_manager.drain): a node whose record says
`draining` gets no new call. Its GPUs are taken out of the scheduler as if it had left
(`CallBook.gpus_removed`): calls parked behind them go back to the global queue and run elsewhere,
leases on them end, and the calls placed there are STRANDED, forgotten at their Done (their
gateways present their grants to the node, which still runs them) or placed again where their
gateway is refused. Its link stays, for those Dones. Then one Revoke marked `drained` lists every
grant placed there: the node revokes those never presented and, once none runs, stops."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from gpufaas.cluster import NodeRecord
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import ConnectionLost, MessageType, RemoteError
from scheduler.reconciler import NODE_TIMEOUT_S

if TYPE_CHECKING:
    from scheduler.node_links import NodeLink, NodeLinks

log = logging.getLogger("gpufaas.scheduler")


def same_manager(known: NodeRecord, record: NodeRecord) -> bool:
    """Whether `record` is `known`'s GPU manager still running its calls: the same record but
    for its address (it moved) or its `draining` flag (it began to drain)."""
    return dataclasses.replace(known, address=record.address, draining=record.draining) == record


def none_to_attach(links: NodeLinks) -> bool:
    """Whether no registered node of `links` is still to add its GPUs: each is attached, or drains
    (it never adds them: a new term that waited for it held every call its whole attach wait)."""
    return all(node.gpu_ids or node.record.draining for node in links.nodes.values())


async def drain_node(links: NodeLinks, node: NodeLink) -> None:
    """`node` drains: take its GPUs out (see the module's docstring) and, where it is linked, tell
    it so with the grants placed there; a node not linked now is told when it attaches (its
    record still says `draining`: `NodeLinks._attach` comes here)."""
    name = node.record.node
    grants = links.book.placed_on(name)
    claim_by = links.book.claim_by(grants)
    links.detach(node)
    conn = node.conn
    if conn is None:
        return
    request = pb.Revoke(
        grants=[pb.GrantRef(call_id=c, attempt=a) for c, a in grants],
        claim_by_unix_s=claim_by + time.time() - links.clock() if claim_by else 0.0,
        drained=True,
    )
    try:
        reply = (await conn.request(MessageType.REVOKE, request, timeout_s=NODE_TIMEOUT_S)).message(pb.RevokeReply)
    except (ConnectionLost, TimeoutError, RemoteError) as exc:
        log.warning("node %s drains, but cannot be told so (%s): it stops at its drain timeout", name, exc)
        return
    log.info(
        "node %s drains: its GPUs are out; %d placed call(s) run there to their end, %d never presented "
        "are revoked there (placed again once their gateway is refused)",
        name,
        len(reply.seen),
        len(reply.unseen),
    )
