"""The election's etcd edge: campaign for the leader key, keep its lease alive, watch the key, and
tell the pure `Leadership` (scheduler.leadership) what happened; the service is told when it
takes office, when it is sure again after an unsure spell, and when it must leave office.

A campaign is one create-if-absent of the leader key (its value: the candidate's address) under a
fresh lease, then a read of the key: if it holds our lease we lead, with the key's create_revision
as the epoch. A term's lease is kept alive `KEEP_ALIVES_PER_TTL` times per TTL; leaving office
revokes it (best effort), so that a standby need not wait for it to expire, unless the term was
left for want of answers: then a keep-alive of it answered later resumes the term (no one else can
have led while its lease lived), and one refused lets it go. A candidate that wins the key but
cannot take office (the service's reads fail) leaves as one deposed: it revokes the lease, so that
a standby campaigns, and campaigns again itself only after a holdoff (`OFFICE_HOLDOFF_TTLS`,
doubled per failure in a row), so that a lone scheduler still leads once its reads go through.

A standby with a way to dial the leader (`dial`) also holds a link to it, the *tether*, which
carries nothing. A SIGKILLed leader's host closes it at once (a lease would take a TTL and etcd's
expiry sweep, up to half a second more, to say the same); when the leader then answers no dial
(`TETHER_PROBES` tries), the standby revokes the leader's lease: its key goes, and the standby
campaigns at once. A tether lost to silence (the keep-alive probes of a partitioned link) is no
evidence, nor is a leader that answers again (it closed the link, or restarted): then the lease
decides, as without a tether. Revoking a live leader's lease by mistake costs a needless new term,
never two leaders placing at once: the deposed leader sees its key go, and nodes that the new
leader attached refuse its older epoch (`Leadership`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufaas.store import KeyValue, LeaseLost, Store, StoreError, WatchEvent, list_and_watch
from scheduler.leadership import Holder, Leadership, Role

log = logging.getLogger("gpufaas.scheduler")

KEEP_ALIVES_PER_TTL = 3
TETHER_PROBES = 3  # dials after the tether closed, each within TETHER_DIAL_S: none answered = dead
TETHER_DIAL_S = 0.3
TETHER_IDLE_S = 0.1  # how often a standby with nothing to tether to (or a held tether) looks again
# After failing to take office, a candidate waits this many TTLs (doubled per failure in a row, up to
# OFFICE_HOLDOFF_MAX_TTLS) before it campaigns again: a standby that can take office goes first,
# and a lone scheduler does not read a whole etcd prefix that fails every third of a TTL.
OFFICE_HOLDOFF_TTLS = 1
OFFICE_HOLDOFF_MAX_TTLS = 4  # a lone scheduler leads again within 4 TTLs of its reads going through


class Link(Protocol):
    """A standby's open link to the leader (a wire connection)."""

    @property
    def closed(self) -> asyncio.Future[BaseException | None]:
        """Resolves, with the reason (None: the peer closed it), when the link is gone."""

    def close(self) -> None:
        """Close it from this end."""


class TetherRefused(Exception):
    """The leader's address answered a dial but refused the link (its credentials, or ours):
    someone is there."""


# Opens a link to the scheduler at an address within a timeout; raises ConnectionError when
# nothing answers there in time, TetherRefused when it answers and refuses.
Dial = Callable[[str, float], Awaitable[Link]]


class Office(Protocol):
    """What the election tells the service."""

    async def take_office(self, epoch: int) -> None:
        """We lead from now on, as `epoch`: do what a restarted scheduler does (StoreError: we
        cannot, and leave office again)."""

    def confirmed(self) -> None:
        """We lead and are sure of it again after an unsure spell: carry out what was held."""

    async def leave_office(self, reason: str) -> None:
        """We lead no more (the leadership says standby already): stop placing, close sessions."""


def holder_of(kv: KeyValue | None) -> Holder | None:
    return None if kv is None else Holder(kv.value.decode(errors="replace"), kv.create_revision, kv.lease)


class Election:
    """Runs one scheduler's part in the election until cancelled (see the module's doc)."""

    def __init__(
        self,
        store: Store,
        key: str,
        leadership: Leadership,
        office: Office,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        dial: Dial | None = None,
    ) -> None:
        """`dial`: how a standby reaches the leader for its tether (None: no tether; a dead
        leader's lease alone says it is gone)."""
        self.store, self.key, self.leadership, self.office = store, key, leadership, office
        self.clock, self.sleep, self.dial = clock, sleep, dial
        self._changed = asyncio.Event()
        self._warned_unsure = False
        self._office_failures = 0  # take_office failures in a row
        self._campaign_after = -math.inf  # the clock's time before which we do not campaign

    def wake(self) -> None:
        """Something the leadership decides on changed (a node fenced us): look now."""
        self._changed.set()

    async def run(self) -> None:
        helpers = [
            asyncio.ensure_future(
                list_and_watch(self.store, self.key, on_list=self._listed, on_event=self._changed_key, sleep=self.sleep)
            )
        ]
        if self.dial is not None:
            helpers.append(asyncio.ensure_future(self._tether(self.dial)))
        try:
            await self._loop()
        finally:
            for helper in helpers:
                helper.cancel()
                with contextlib.suppress(BaseException):
                    await helper

    async def resign(self) -> None:
        """At a stop: give the key up at once (revoke the term's lease), so a standby takes over."""
        kept = self.leadership.kept
        lease = self.leadership.lease or (kept.lease if kept is not None else 0)
        self.leadership.stepped_down()
        self.leadership.forget_kept()
        if lease:
            await self._revoke(lease)

    # --- the loop ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        period_s = self.leadership.ttl_s / KEEP_ALIVES_PER_TTL
        while True:
            try:
                await self._step(period_s)
            except Exception:  # the election must go on: a leader that does not know leaves office
                log.exception("the scheduler election failed a step; going on")
                self.leadership.must_leave("the election failed a step")
                await self.sleep(period_s)

    async def _step(self, period_s: float) -> None:
        """One turn: leave office, keep the lease alive, resume, campaign, or wait for news."""
        leadership = self.leadership
        reason = leadership.step_down_reason(self.clock())
        if reason is not None:
            await self._leave(reason)
        elif leadership.role is Role.LEADER:
            began = self.clock()
            await self._keep_alive(leadership.ttl_s)
            await self._wait(max(0.0, began + period_s - self.clock()))
        elif leadership.resume_due():
            if not await self._resume():
                await self._wait(period_s)
        elif leadership.campaign_due():
            holdoff_s = self._campaign_after - self.clock()
            if holdoff_s > 0:
                await self._wait(holdoff_s)  # we could not take office lately: let a standby lead
            elif not await self._campaign():
                await self._wait(period_s)
        else:
            await self._wait(leadership.ttl_s)  # the key's watch wakes us when it goes

    async def _wait(self, timeout_s: float) -> None:
        waiter = asyncio.ensure_future(self._changed.wait())
        sleeper = asyncio.ensure_future(self.sleep(timeout_s))
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            sleeper.cancel()
        self._changed.clear()

    async def _campaign(self) -> bool:
        """Try to take the key; whether we did (a StoreError is a lost try)."""
        leadership = self.leadership
        sent_at = self.clock()
        lease = 0
        try:
            lease = await self.store.grant_lease(math.ceil(leadership.ttl_s))
            await self.store.compare_and_put(self.key, leadership.address.encode(), mod_revision=0, lease=lease)
            kv = await self.store.get(self.key)
        except StoreError as exc:
            log.warning("campaign for the scheduler leadership failed: %s", exc)
            if lease:
                await self._revoke(lease)
            return False
        if kv is None or kv.lease != lease:
            await self._revoke(lease)
            holder = holder_of(kv)
            leadership.observed(holder, kv.mod_revision if kv is not None else 0)
            if holder is not None:
                log.info("standing by: the scheduler at %s leads (epoch %d)", holder.address, holder.epoch)
                self._office_failures = 0  # another took office: failures of ours before are not "in a row"
            return False
        leadership.won(kv.create_revision, lease, sent_at)
        log.info("leading the schedulers as epoch %d (lease %x)", kv.create_revision, lease)
        return await self._take_office(kv.create_revision)

    async def _resume(self) -> bool:
        """Resume the term left for want of answers if its lease lives and its key is ours still;
        whether it did (a StoreError: not yet, try again)."""
        leadership = self.leadership
        kept = leadership.kept
        assert kept is not None
        sent_at = self.clock()
        try:
            await self.store.refresh_lease(kept.lease)
            kv = await self.store.get(self.key)
        except LeaseLost:
            leadership.forget_kept()
            return False
        except StoreError:
            return False
        if kv is None or kv.lease != kept.lease or kv.create_revision != kept.epoch:
            leadership.forget_kept()
            await self._revoke(kept.lease)
            return False
        leadership.won(kept.epoch, kept.lease, sent_at)
        log.info("the leadership lease outlived etcd's silence: leading again as epoch %d", kept.epoch)
        return await self._take_office(kept.epoch)

    async def _take_office(self, epoch: int) -> bool:
        """Take office as `epoch`; whether we did. One we cannot take we leave as one deposed (the
        lease revoked, not kept: resuming it would fail alike, and keep a standby out for good),
        and we campaign again only after a holdoff."""
        try:
            await self.office.take_office(epoch)
        except StoreError as exc:
            self._office_failures += 1
            holdoff_ttls = min(OFFICE_HOLDOFF_TTLS * 2 ** (self._office_failures - 1), OFFICE_HOLDOFF_MAX_TTLS)
            self._campaign_after = self.clock() + holdoff_ttls * self.leadership.ttl_s
            reason = f"could not take office: {exc}"
            self.leadership.must_leave(reason)
            await self._leave(reason)
            return False
        self._office_failures = 0
        return True

    async def _keep_alive(self, timeout_s: float) -> None:
        leadership = self.leadership
        sent_at = self.clock()
        was_sure = leadership.leading(sent_at)
        try:
            async with asyncio.timeout(timeout_s):
                await self.store.refresh_lease(leadership.lease)
        except LeaseLost:
            leadership.lease_lost()
            return
        except (StoreError, TimeoutError) as exc:
            if not leadership.leading(self.clock()) and not self._warned_unsure:
                self._warned_unsure = True
                log.warning(
                    "unsure of the leadership (keep-alive: %s): placing nothing until etcd answers",
                    exc or type(exc).__name__,
                )
            return
        leadership.renewed(sent_at)
        if not was_sure and leadership.leading(self.clock()):
            if self._warned_unsure:
                log.info("sure of the leadership again (epoch %d)", leadership.epoch)
            self._warned_unsure = False
            self.office.confirmed()

    async def _leave(self, reason: str) -> None:
        lease, epoch = self.leadership.lease, self.leadership.epoch
        log.warning("stepping down as the scheduler leader (epoch %d): %s", epoch, reason)
        self.leadership.stepped_down()
        self._warned_unsure = False
        await self.office.leave_office(reason)
        if lease and self.leadership.kept is None:
            await self._revoke(lease)

    async def _revoke(self, lease: int) -> None:
        """Best effort, bounded: a lease not revoked expires by itself."""
        with contextlib.suppress(StoreError, TimeoutError):
            async with asyncio.timeout(self.leadership.ttl_s):
                await self.store.revoke_lease(lease)

    # --- the tether (a standby's link to the leader) -----------------------------------------
    def _tether_target(self) -> Holder | None:
        """The leader a standby tethers to: the key's holder, when it is someone else."""
        holder = self.leadership.holder
        if self.leadership.role is not Role.STANDBY or holder is None or not holder.address:
            return None
        return None if holder.address == self.leadership.address else holder

    async def _tether(self, dial: Dial) -> None:
        """While a standby: hold a link to the leader, and end its term when it is dead (see the
        module's doc)."""
        refused_logged = False
        while True:
            holder = self._tether_target()
            if holder is None:
                await self.sleep(TETHER_IDLE_S)
                continue
            try:
                link = await dial(holder.address, TETHER_DIAL_S)
            except (ConnectionError, TimeoutError, TetherRefused) as exc:
                if isinstance(exc, TetherRefused) and not refused_logged:
                    refused_logged = True
                    log.warning(
                        "cannot hold a link to the leader at %s (%s): its lease alone says when it is gone",
                        holder.address,
                        exc,
                    )
                await self.sleep(self.leadership.ttl_s)  # out of reach: its lease decides
                continue
            cause = await self._hold(link, holder)
            if cause is None or isinstance(cause, TimeoutError):
                continue  # the leader changed (or the link went silent: a partition, no evidence)
            if await self._answers(dial, holder.address):
                await self.sleep(TETHER_IDLE_S)  # it closed the link itself (left office), or restarted
                continue
            if self._tether_target() == holder:
                log.warning(
                    "the leader at %s (epoch %d) is gone: it closed our link and answers no dial; "
                    "revoking its lease rather than waiting it out",
                    holder.address,
                    holder.epoch,
                )
                await self._revoke(holder.lease)

    async def _hold(self, link: Link, holder: Holder) -> BaseException | None:
        """Wait until the link closes (its reason; a peer's close is a `ConnectionError`) or the
        tether's target is `holder` no more (None: we closed it)."""
        try:
            while not link.closed.done():
                if self._tether_target() != holder:
                    return None
                sleeper = asyncio.ensure_future(self.sleep(TETHER_IDLE_S))
                try:
                    waiters: set[asyncio.Future[Any]] = {link.closed, sleeper}
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    sleeper.cancel()
            reason = link.closed.result()
            return reason if reason is not None else ConnectionResetError("closed by the leader")
        finally:
            link.close()

    async def _answers(self, dial: Dial, address: str) -> bool:
        """Whether anything answers a dial at `address` within TETHER_PROBES tries."""
        for _ in range(TETHER_PROBES):
            try:
                (await dial(address, TETHER_DIAL_S)).close()
            except TetherRefused:
                return True
            except (ConnectionError, TimeoutError):
                continue
            return True
        return False

    # --- the key's watch --------------------------------------------------------------------
    def _listed(self, kvs: list[KeyValue], revision: int) -> None:
        # A prefix watch: keys that merely start with the leader key's name are not it.
        self.leadership.observed(holder_of(next((kv for kv in kvs if kv.key == self.key), None)), revision)
        self._changed.set()

    async def _changed_key(self, event: WatchEvent) -> None:
        if event.key != self.key:
            return
        holder: Holder | None = None
        revision = event.mod_revision
        if event.kind == "put":
            # The event lacks the key's create_revision (the epoch) and lease: read them.
            try:
                kv = await self.store.get(self.key)
            except StoreError:
                return  # the next event, or the next listing, says
            holder = holder_of(kv)
            revision = kv.mod_revision if kv is not None else revision
        self.leadership.observed(holder, revision)
        self._changed.set()


class LeadershipCollector(Collector):
    """The election as Prometheus sees it, read when scraped."""

    def __init__(self, leadership: Leadership, clock: Callable[[], float]) -> None:
        self._leadership = leadership
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        leadership = self._leadership
        yield GaugeMetricFamily(
            "gpufaas_scheduler_leader",
            "1 while this scheduler leads and is sure of it (its lease confirmed), else 0 (a standby, or unsure).",
            value=1 if leadership.leading(self._clock()) else 0,
        )
        now = self._clock()
        role = "leader" if leadership.leading(now) else "unsure" if leadership.unsure(now) else "standby"
        roles = GaugeMetricFamily(
            "gpufaas_scheduler_role",
            "1 for this scheduler's role in the election: leader (sure of its lease), unsure (leading, its lease "
            "unconfirmed: it places nothing) or standby.",
            labels=["role"],
        )
        for name in ("leader", "unsure", "standby"):
            roles.add_metric([name], 1 if name == role else 0)
        yield roles
        yield GaugeMetricFamily(
            "gpufaas_scheduler_epoch",
            "The newest leader's epoch this scheduler has seen (its own while it leads).",
            value=leadership.highest_epoch,
        )
