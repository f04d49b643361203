"""The schedulers' election: the pure `Leadership` (facts in, decisions out, on a manual clock),
and its etcd edge (`Election`) with two candidates on a MemoryStore driven by a ManualClock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpufaas.keys import Keys
from gpufaas.store import StoreError
from scheduler.election import Election, LeadershipCollector
from scheduler.leadership import PATIENCE_TTLS, Holder, Leadership, Role
from tests.fakes import ManualClock, MemoryStore
from tests.scrape import sample

TTL_S = 1.0
KEY = Keys("/t").scheduler_leader


def leader(epoch: int = 10, lease: int = 7, *, at: float = 0.0, ttl_s: float = TTL_S) -> Leadership:
    """A leadership that won its campaign as `epoch`, its lease asked for at `at`, patient for a TTL."""
    leadership = Leadership("me:1", ttl_s, patience_s=ttl_s)
    leadership.observed(None, 5)
    leadership.won(epoch, lease, sent_at=at)
    return leadership


# --- the pure object ------------------------------------------------------------------------------


def test_a_standby_campaigns_only_once_it_has_read_the_key_and_found_it_absent() -> None:
    leadership = Leadership("me:1", TTL_S)
    assert leadership.role is Role.STANDBY and not leadership.campaign_due()  # not read yet
    leadership.observed(Holder("other:1", 4, 99), 4)
    assert not leadership.campaign_due() and leadership.highest_epoch == 4
    leadership.observed(None, 6)  # the leader's lease expired: its key went
    assert leadership.campaign_due()
    assert not leadership.leading(0.0) and not leadership.unsure(0.0)


def test_a_leader_is_sure_until_a_ttl_after_the_last_answered_keep_alive_was_sent() -> None:
    leadership = leader(epoch=10, at=100.0)
    assert leadership.leading(100.0) and leadership.leading(100.99)
    assert leadership.epoch == 10 and leadership.highest_epoch == 10
    leadership.renewed(sent_at=100.5)  # answered: valid a TTL past its sending, not its answer
    assert leadership.leading(101.49) and not leadership.leading(101.5)
    assert leadership.unsure(101.5)
    assert leadership.step_down_reason(101.5) is None  # unsure, not yet deposed


def test_an_unsure_leader_whose_keep_alive_is_answered_again_is_sure_again() -> None:
    leadership = leader(at=0.0)
    assert leadership.unsure(1.5)
    leadership.renewed(sent_at=1.4)  # the lease never expired, so no one else can have led
    assert leadership.leading(1.5) and leadership.leading(2.39) and not leadership.leading(2.4)


def test_a_leader_unsure_past_its_patience_steps_down() -> None:
    assert Leadership("me:1", 2.0).patience_s == PATIENCE_TTLS * 2.0  # an etcd restart is ridden out
    leadership = leader(at=0.0)
    assert leadership.step_down_reason(1.99) is None
    reason = leadership.step_down_reason(2.0)
    assert reason is not None and "no keep-alive answered" in reason
    leadership.stepped_down()
    assert leadership.role is Role.STANDBY and leadership.epoch == 0 and leadership.lease == 0
    assert leadership.step_down_reason(2.0) is None and not leadership.leading(2.0)


def test_a_term_left_for_want_of_answers_is_kept_to_resume_and_one_deposed_is_not() -> None:
    silent = leader(epoch=10, lease=7, at=0.0)
    assert silent.step_down_reason(2.0) is not None
    silent.stepped_down()
    assert silent.resume_due() and silent.kept == Holder("me:1", 10, 7)
    silent.forget_kept()  # its lease turned out gone
    assert not silent.resume_due()
    deposed = leader(epoch=10, lease=7, at=0.0)
    deposed.lease_lost()
    deposed.stepped_down()
    assert not deposed.resume_due() and deposed.kept is None


def test_a_lost_lease_means_stepping_down_at_once() -> None:
    leadership = leader(at=0.0)
    leadership.lease_lost()
    assert not leadership.leading(0.1)  # however recent its last keep-alive
    assert leadership.step_down_reason(0.1) == "the leadership lease expired"


@pytest.mark.parametrize(
    ("holder", "says"),
    [(None, "the leader key is gone"), (Holder("other:1", 20, 8), "other:1's now (epoch 20)")],
)
def test_a_leader_whose_key_is_gone_or_anothers_steps_down(holder: Holder | None, says: str) -> None:
    leadership = leader(epoch=10, lease=7)
    leadership.observed(holder, 20)
    reason = leadership.step_down_reason(0.1)
    assert reason is not None and says in reason
    assert not leadership.leading(0.1)


def test_a_leader_takes_its_own_key_and_older_news_calmly() -> None:
    leadership = leader(epoch=10, lease=7)
    leadership.observed(None, 9)  # the previous leader's key going, seen late
    leadership.observed(Holder("me:1", 10, 7), 10)  # our own campaign's put, seen by the watch
    assert leadership.leading(0.1) and leadership.step_down_reason(0.1) is None


def test_a_node_that_has_seen_a_newer_epoch_deposes_a_leader_but_not_a_standby() -> None:
    leadership = leader()
    leadership.fenced()
    assert leadership.step_down_reason(0.0) == "a node has seen a newer leader's epoch"
    standby = Leadership("me:1", TTL_S)
    standby.fenced()
    assert standby.role is Role.STANDBY and standby.step_down_reason(0.0) is None


def test_the_newest_epoch_seen_only_grows() -> None:
    leadership = Leadership("me:1", TTL_S)
    leadership.observed(Holder("a:1", 12, 1), 12)
    leadership.observed(Holder("b:1", 30, 2), 30)
    leadership.observed(Holder("a:1", 12, 1), 13)  # a stale read
    assert leadership.highest_epoch == 30
    leadership.won(41, 3, sent_at=0.0)
    assert leadership.highest_epoch == 41


def test_the_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="TTL"):
        Leadership("me:1", 0)


def test_the_metrics_say_the_role_and_the_newest_epoch() -> None:
    leadership = leader(epoch=12, at=0.0)
    now = [0.5]
    registry = CollectorRegistry()
    registry.register(LeadershipCollector(leadership, lambda: now[0]))

    def scraped() -> tuple[float, dict[str, float], float]:
        text = generate_latest(registry).decode()
        roles = {role: sample(text, "gpufaas_scheduler_role", role=role) for role in ("leader", "unsure", "standby")}
        return sample(text, "gpufaas_scheduler_leader"), roles, sample(text, "gpufaas_scheduler_epoch")

    assert scraped() == (1, {"leader": 1, "unsure": 0, "standby": 0}, 12)
    now[0] = 1.5
    assert scraped() == (0, {"leader": 0, "unsure": 1, "standby": 0}, 12)
    leadership.stepped_down()
    assert scraped() == (0, {"leader": 0, "unsure": 0, "standby": 1}, 12)


# --- the etcd edge, on a MemoryStore --------------------------------------------------------------


class FakeOffice:
    """Records what the election tells the service."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    async def take_office(self, epoch: int) -> None:
        self.events.append(("take", epoch))

    def confirmed(self) -> None:
        self.events.append(("confirmed", None))

    async def leave_office(self, reason: str) -> None:
        self.events.append(("leave", reason))


class Candidate:
    def __init__(self, address: str, store: MemoryStore, clock: ManualClock, *, patience_s: float = TTL_S) -> None:
        self.leadership = Leadership(address, TTL_S, patience_s=patience_s)
        self.office = FakeOffice()
        self.election = Election(store, KEY, self.leadership, self.office, clock=clock, sleep=clock.sleep)
        self.task: asyncio.Task[None] | None = None

    def run(self) -> None:
        self.task = asyncio.ensure_future(self.election.run())

    async def freeze(self) -> None:
        """As SIGKILL or SIGSTOP would: no keep-alive, no revoke (its leadership object stays)."""
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


def on_store(scenario: Callable[[MemoryStore, ManualClock], Awaitable[None]]) -> None:
    async def main() -> None:
        clock = ManualClock()
        store = MemoryStore(clock=clock)
        await asyncio.wait_for(scenario(store, clock), 10)

    asyncio.run(main())


async def started(store: MemoryStore, clock: ManualClock, address: str, *, patience_s: float = TTL_S) -> Candidate:
    """A candidate running for the leadership (it leads if the key was free)."""
    candidate = Candidate(address, store, clock, patience_s=patience_s)
    candidate.run()
    await clock.advance(0.01)
    return candidate


async def leader_cut_off(store: MemoryStore, clock: ManualClock) -> tuple[Candidate, int]:
    """Candidate a:1 started (leading: the key was free), then etcd made unreachable: the candidate
    and the epoch of its term."""
    a = await started(store, clock, "a:1")
    epoch = a.leadership.epoch
    store.set_reachable(False)
    return a, epoch


async def lapse(store: MemoryStore, clock: ManualClock, seconds: float) -> None:
    """Let `seconds` pass, the leases past their TTL expiring (their keys' deletions watched)."""
    await clock.advance(seconds)
    store.expire_leases()
    await clock.advance(0.01)


def test_one_of_two_candidates_leads_with_the_keys_create_revision_as_its_epoch() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b = await started(store, clock, "a:1"), await started(store, clock, "b:1")
        kv = await store.get(KEY)
        assert kv is not None and kv.value == b"a:1"
        assert a.leadership.role is Role.LEADER and a.leadership.epoch == kv.create_revision
        assert a.office.events == [("take", kv.create_revision)]
        assert b.leadership.role is Role.STANDBY and b.office.events == []
        assert b.leadership.holder == Holder("a:1", kv.create_revision, kv.lease)
        await lapse(store, clock, 5 * TTL_S)  # a's keep-alives hold the key
        assert a.leadership.leading(clock()) and b.leadership.role is Role.STANDBY
        for candidate in (a, b):
            await candidate.freeze()

    on_store(scenario)


def test_a_frozen_leader_is_replaced_under_a_newer_epoch_and_steps_down_when_it_thaws() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b = await started(store, clock, "a:1"), await started(store, clock, "b:1")
        first = a.leadership.epoch
        await a.freeze()  # SIGSTOP: its lease lapses in etcd, its key goes
        assert a.leadership.leading(clock())  # it would think so, were it to run now...
        await lapse(store, clock, TTL_S)
        assert not a.leadership.leading(clock())  # ...but not a TTL later: it places nothing
        assert b.leadership.role is Role.LEADER and b.leadership.epoch > first
        assert b.office.events == [("take", b.leadership.epoch)]
        a.run()  # SIGCONT: its keep-alive finds the lease gone, its watch finds b's key
        await clock.advance(0.5)
        assert a.leadership.role is Role.STANDBY
        assert [event for event, _ in a.office.events] == ["take", "leave"]
        assert a.leadership.holder is not None and a.leadership.holder.address == "b:1"
        assert (await store.get(KEY)).value == b"b:1"  # type: ignore[union-attr]
        await lapse(store, clock, 3 * TTL_S)
        assert a.leadership.role is Role.STANDBY and b.leadership.leading(clock())  # never two leaders
        for candidate in (a, b):
            await candidate.freeze()

    on_store(scenario)


def test_a_leader_cut_off_from_etcd_holds_then_steps_down_and_a_standby_takes_over() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, first = await leader_cut_off(store, clock)  # a partition (here, of everyone: the store's)
        await clock.advance(TTL_S)
        assert a.leadership.unsure(clock()) and a.leadership.role is Role.LEADER
        await clock.advance(1.4 * TTL_S)  # past its patience (a TTL more; looked at every third of one)
        assert a.leadership.role is Role.STANDBY
        assert a.office.events[-1][0] == "leave" and "no keep-alive" in str(a.office.events[-1][1])
        store.set_reachable(True)  # healed: the old lease is expired by now, the key gone
        await lapse(store, clock, TTL_S)
        await clock.advance(1.0)  # the watch's retry, then a campaign
        assert a.leadership.role is Role.LEADER and a.leadership.epoch > first
        await a.freeze()

    on_store(scenario)


def test_a_resigning_leader_hands_over_at_once() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b = await started(store, clock, "a:1"), await started(store, clock, "b:1")
        await a.freeze()
        await a.election.resign()  # a stop: the lease is revoked, the key goes with it
        await clock.advance(0.01)
        assert b.leadership.role is Role.LEADER  # no TTL waited
        await b.freeze()

    on_store(scenario)


def test_a_leader_silenced_by_an_etcd_restart_resumes_its_term_once_its_lease_answers() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, epoch = await leader_cut_off(store, clock)  # etcd restarting
        await clock.advance(2.4 * TTL_S)
        assert a.leadership.role is Role.STANDBY and a.leadership.kept is not None
        # A restarted etcd renews every lease it kept (its new raft leader does), so the key lives.
        for lease in store._leases.values():
            lease.expires_at = clock() + lease.ttl_s
        store.set_reachable(True)
        await clock.advance(0.5)
        assert a.leadership.role is Role.LEADER and a.leadership.epoch == epoch  # no one else led meanwhile
        assert [event for event, _ in a.office.events] == ["take", "leave", "take"]
        await a.freeze()

    on_store(scenario)


def test_a_leader_rides_out_a_short_etcd_restart_unsure_and_then_carries_on() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a = await started(store, clock, "a:1", patience_s=PATIENCE_TTLS * TTL_S)
        store.set_reachable(False)
        await clock.advance(2.5 * TTL_S)
        assert a.leadership.unsure(clock()) and a.leadership.role is Role.LEADER  # holding, not placing
        for lease in store._leases.values():  # etcd is back, and renews the leases it kept
            lease.expires_at = clock() + lease.ttl_s
        store.set_reachable(True)
        await clock.advance(0.5)
        assert a.leadership.leading(clock())
        assert [event for event, _ in a.office.events] == ["take", "confirmed"]  # what it held goes out
        await a.freeze()

    on_store(scenario)


class FailingOffice(FakeOffice):
    """An office that cannot be taken (its reads fail: too large, or a slow link) its first
    `failures` times."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def take_office(self, epoch: int) -> None:
        await super().take_office(epoch)
        if self.failures > 0:
            self.failures -= 1
            raise StoreError("etcd get_prefix: Received message larger than max (5417130 vs. 4194304)")


def test_a_scheduler_that_cannot_take_office_lets_another_lead() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a = Candidate("a:1", store, clock)
        a.office = a.election.office = FailingOffice(failures=1_000)
        a.run()
        await clock.advance(0.01)
        b = await started(store, clock, "b:1")
        for _ in range(10):
            await lapse(store, clock, TTL_S)
        kv = await store.get(KEY)
        takes = sum(event == "take" for event, _ in a.office.events)
        assert b.leadership.role is Role.LEADER, f"the key is {kv!r}; a tried to take office {takes} times"
        assert kv is not None and kv.value == b"b:1" and a.leadership.kept is None
        assert takes == 1 and b.office.events == [("take", b.leadership.epoch)]
        for candidate in (a, b):
            await candidate.freeze()

    on_store(scenario)


def test_a_lone_scheduler_that_could_not_take_office_tries_again_and_leads() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a = Candidate("a:1", store, clock)
        a.office = a.election.office = FailingOffice(failures=3)
        a.run()
        await clock.advance(0.01)
        assert a.leadership.role is Role.STANDBY and await store.get(KEY) is None  # its lease revoked
        for _ in range(20):
            await lapse(store, clock, TTL_S)
        assert a.leadership.leading(clock())
        assert [event for event, _ in a.office.events] == ["take", "leave"] * 3 + ["take"]
        await a.freeze()

    on_store(scenario)


# --- the tether: a standby's link to the leader -----------------------------------------------------


class FakeLink:
    def __init__(self) -> None:
        self.closed: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def close(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class LeaderHost:
    """Where the standby dials the leader: links that a death (or the leader) closes, and dials
    that a dead host refuses."""

    def __init__(self) -> None:
        self.links: list[FakeLink] = []
        self.answering = True
        self.dials = 0

    async def dial(self, address: str, timeout_s: float) -> FakeLink:
        self.dials += 1
        if not self.answering:
            raise ConnectionRefusedError(f"{address} refuses")
        link = FakeLink()
        self.links.append(link)
        return link

    def close_links(self, reason: BaseException | None = None) -> None:
        for link in self.links:
            if not link.closed.done():
                link.closed.set_result(reason)


async def tethered(store: MemoryStore, clock: ManualClock) -> tuple[Candidate, Candidate, LeaderHost]:
    """a leads; b stands by with a tether to a (a's host: the LeaderHost)."""
    host = LeaderHost()
    a = await started(store, clock, "a:1")
    b = Candidate("b:1", store, clock)
    b.election.dial = host.dial
    b.run()
    await clock.advance(0.5)
    assert b.leadership.role is Role.STANDBY and any(not link.closed.done() for link in host.links)
    return a, b, host


def test_a_standby_whose_tether_closes_and_whose_dials_go_unanswered_takes_over_before_the_lease_lapses() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b, host = await tethered(store, clock)
        first = a.leadership.epoch
        await a.freeze()  # SIGKILL: no keep-alive, no revoke; its host closes its links, refuses dials
        host.answering = False
        host.close_links()
        await clock.advance(0.1 * TTL_S)  # well inside the lease: only the tether can have told b
        assert b.leadership.role is Role.LEADER and b.leadership.epoch > first
        assert b.office.events == [("take", b.leadership.epoch)]
        assert (await store.get(KEY)).value == b"b:1"  # type: ignore[union-attr]
        await b.freeze()

    on_store(scenario)


@pytest.mark.parametrize("still_answering", [True, False])
def test_a_tether_closed_by_a_live_leader_or_lost_to_silence_deposes_no_one(still_answering: bool) -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b, host = await tethered(store, clock)
        dials = host.dials
        if still_answering:
            host.close_links()  # the leader closed it (e.g. it restarted its server): it answers dials
        else:
            host.answering = False  # a partition: the link's keep-alive probes time out, dials too
            host.close_links(TimeoutError(110, "Connection timed out"))
        await clock.advance(0.5 * TTL_S)
        assert a.leadership.leading(clock()) and b.leadership.role is Role.STANDBY
        assert (await store.get(KEY)).value == b"a:1"  # type: ignore[union-attr]
        if still_answering:  # it probed, found the leader there, and tethered again
            assert host.dials > dials and not host.links[-1].closed.done()
        for candidate in (a, b):
            await candidate.freeze()

    on_store(scenario)


def test_a_leader_holds_no_tether_and_a_new_leader_is_tethered_to_instead() -> None:
    async def scenario(store: MemoryStore, clock: ManualClock) -> None:
        a, b, host = await tethered(store, clock)
        await a.election.resign()  # a hands over: b leads, and tethers to no one
        await a.freeze()
        await clock.advance(0.5)
        assert b.leadership.role is Role.LEADER
        assert all(link.closed.done() for link in host.links)
        await b.freeze()

    on_store(scenario)
