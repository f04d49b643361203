"""A node's graceful stop (drain): on its first SIGTERM/SIGINT a node runs the calls placed on it
to their end, takes no new ones, and stops once none is left (or at `--drain-timeout-s`).

How the schedulers learn it: the node puts its record again, under its lease, with `draining`
set (gpufaas.cluster.NodeRecord). etcd rather than a wire message, because every scheduler
watches the node records: the leader sees it at once, a standby knows it when it takes over (a
new leader reads the records at its term's start, and attaches such a node without adding its
GPUs), and the flag lasts exactly as long as the node's lease, with nothing to resend after a
lost link. The leader then takes the node's GPUs out (calls parked or queued behind them go back
to the global queue and run elsewhere, hit leases on them end) and sends the node one Revoke
marked `drained`, listing every grant it had placed there: those never presented are revoked
(their gateways, refused, have them placed again), the rest run to their Done.

When the node stops (`NodeDrain.verdict`): once no call runs on it and the scheduler whose grants
it admits has sent that Revoke (so no grant it admitted or could still be presented is
outstanding), or no call runs and no scheduler is attached (none is there to tell it, and a grant
of a scheduler that lost it is placed again when the node is gone: stopping, `gpufaas down` and
`docker compose down` stop the schedulers too), or once the drain timeout passes, whichever comes
first. Pure but for `drain`,
which takes the clock as an argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import LeaseLost, StoreError

if TYPE_CHECKING:
    from gpu_manager.daemon import GpuManagerDaemon

log = logging.getLogger("gpufaas.gpu_manager")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.05  # how often a draining node looks whether it may stop
RECORD_RETRY_S = 1.0  # how often a draining node tries again to put its record, while etcd refuses it


class NodeDrain:
    """A node's calls in flight, and its drain once begun (`start`). `running`: Executes taken
    and not yet answered with their Done sent; `acked_by`: the scheduler that said (a Revoke
    marked `drained`) that it places nothing more here; `attached`: whether a scheduler is
    attached (kept by the node's sessions)."""

    def __init__(self) -> None:
        self.running = 0
        self.ran = 0  # calls ended since the drain began
        self.started_s: float | None = None
        self.timeout_s = 0.0
        self.acked_by: str | None = None
        self.attached = False

    @property
    def draining(self) -> bool:
        return self.started_s is not None

    def start(self, now_s: float, timeout_s: float) -> None:
        """The drain begins at `now_s` (monotonic seconds) and lasts at most `timeout_s`."""
        self.started_s, self.timeout_s = now_s, timeout_s

    def revoked(self, request: pb.Revoke, scheduler_id: str) -> None:
        """The attached scheduler (`scheduler_id`) sent `request`: a `drained` one says it places
        nothing more here and has revoked every grant of its that was never presented."""
        if request.drained:
            self.acked_by = scheduler_id

    def tracked(self, execute: Awaitable[None]) -> Coroutine[Any, Any, None]:
        """One Execute's handling, counted in `running` from now (as its frame is taken, not once
        its task first runs: a drain that looked in between stopped the node under a call it had
        taken) until its Done is sent (the Done goes out on a callback the handling schedules: the
        count drops on the one after it). To be run as a task: one cancelled before it began is
        not counted off, which only the node's stop does."""
        self.running += 1
        return self._counted(execute)

    async def _counted(self, execute: Awaitable[None]) -> None:
        try:
            await execute
        finally:
            asyncio.get_running_loop().call_soon(self._ended)

    def _ended(self) -> None:
        self.running -= 1
        self.ran += self.draining

    def verdict(self, now_s: float, scheduler_id: str) -> str | None:
        """Why the draining node may stop now: "drained" (no call runs, and the scheduler whose
        grants it admits, `scheduler_id`, has acknowledged the drain), "no scheduler attached"
        (no call runs, and none is there to acknowledge it), "timed out" (the drain timeout
        passed); None while it must wait."""
        if self.started_s is None:
            return None
        if self.running == 0 and not self.attached:
            return "no scheduler attached"
        if self.running == 0 and self.acked_by is not None and self.acked_by == scheduler_id:
            return "drained"
        if now_s >= self.started_s + self.timeout_s:
            return "timed out"
        return None


async def drain(node: GpuManagerDaemon, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
    """Drain `node` (see the module's docstring); returns when it may stop. `timeout_s` 0: at once.
    Cancelled (a second signal): the node stops at once all the same."""
    if timeout_s <= 0:
        return
    state = node.drain
    state.start(clock(), timeout_s)
    log.info(
        "node %s draining: %d call(s) running; stopping once they end and the scheduler places nothing more "
        "here, within %g s",
        node.node,
        state.running,
        timeout_s,
    )
    node.ledger.end_leases()  # a gateway's next call under a lease is placed (elsewhere)
    # Beside the wait, not before it: a put to an etcd that hangs must not hold the drain past its
    # timeout, nor one that failed leave the schedulers placing calls here until then.
    recording = asyncio.ensure_future(_record_draining(node))
    verdict: str | None = None
    try:
        await asyncio.sleep(0)  # (its put begins, even where the node may stop at once)
        while (verdict := state.verdict(clock(), node.ledger.scheduler_id)) is None:
            await asyncio.sleep(DRAIN_POLL_S)
    finally:
        recording.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recording
        started_s = state.started_s or 0.0
        log.info(
            "node %s drain ended (%s) after %.1f s: %d call(s) ran to their end during it, %d still running",
            node.node,
            verdict or "cut short",
            clock() - started_s,
            state.ran,
            state.running,
        )


async def _record_draining(node: GpuManagerDaemon) -> None:
    """Put `node`'s record saying that it drains, again every RECORD_RETRY_S until etcd takes it:
    the schedulers learn a drain from that record only (one put that failed, with the lease still
    alive, would never be followed by another: the leader would go on placing calls here, and the
    node would wait for its word until the drain timeout cut the calls it had placed)."""
    level = logging.WARNING  # (once: then each second of an etcd down would say it again)
    while True:
        try:
            await node.register_now()
            return
        except (StoreError, LeaseLost) as exc:
            log.log(level, "node %s: cannot record its drain in etcd (%s); trying again", node.node, exc)
            level = logging.DEBUG
        await asyncio.sleep(RECORD_RETRY_S)
