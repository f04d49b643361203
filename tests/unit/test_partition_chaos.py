"""The partition chaos bench's pure parts: the fault schedule, the per-fault tally, the recovery time."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.partition_chaos import (
    BUSIEST,
    LEADER,
    CallRecord,
    Fault,
    Phase,
    busiest_node,
    fault_schedule,
    recovery_s,
    runs_in_log,
    settled,
    tally,
)

SLOW_S = 2.0


def call(call_id: str, sent_s: float, done_s: float, status: str = "200", node: str = "node0") -> CallRecord:
    return CallRecord(call_id, sent_s, done_s, status, node)


def steady(start_s: float, end_s: float, prefix: str, step_s: float = 0.5) -> list[CallRecord]:
    """Good calls every `step_s`, each answered in 0.05 s."""
    count = round((end_s - start_s) / step_s)
    return [call(f"{prefix}{i}", start_s + i * step_s, start_s + i * step_s + 0.05) for i in range(count)]


def test_the_schedule_names_each_fault_once_in_order_with_the_kill_last() -> None:
    faults = fault_schedule(["gateway0", "gateway1"], election=True)
    assert [(f.name, f.action, f.hosts) for f in faults] == [
        ("isolate-node", "isolate", (BUSIEST,)),
        ("isolate-scheduler", "isolate", (LEADER,)),
        ("cut-scheduler-etcd", "cut", (LEADER, "etcd")),
        ("cut-gateway-node-one-way", "cut-one-way", ("gateway0", BUSIEST)),
        ("delay-node", "delay", (BUSIEST,)),
        ("kill-node-host", "kill", (BUSIEST,)),
    ]
    assert faults[4].delay_ms == 50
    assert "leading scheduler" in faults[1].what


def test_without_election_the_scheduler_faults_say_it_is_the_only_one() -> None:
    faults = fault_schedule(["gateway"], election=False)
    assert "only scheduler" in faults[1].what and "no election" in faults[2].what


def test_the_leader_and_the_busiest_node_are_resolved_when_the_fault_is_applied() -> None:
    fault = Fault("cut-scheduler-etcd", "cut", (LEADER, "etcd"), "")
    assert fault.resolved("scheduler1", "node0").hosts == ("scheduler1", "etcd")
    assert Fault("x", "cut-one-way", ("gateway0", BUSIEST), "").resolved("", "node1").hosts == ("gateway0", "node1")


def test_the_busiest_node_served_the_most_calls_lately() -> None:
    records = [
        *(call(f"old{i}", 0.0, 0.1, node="node0") for i in range(10)),  # before the window
        *(call(f"a{i}", 5.0, 5.1, node="node1") for i in range(3)),
        call("b", 5.0, 5.1, node="node0"),
        call("failed", 5.0, 5.1, "503", node=""),
    ]
    assert busiest_node(records, 4.0, ["node0", "node1"]) == "node1"
    assert busiest_node(records, 9.0, ["node0", "node1"]) == "node0"  # none served: the first


def test_nothing_hurt_is_recovered_at_once() -> None:
    assert recovery_s(steady(0, 10, "c"), 5.0, 10.0, SLOW_S) == 0.0


def test_recovery_runs_until_the_first_good_call_after_the_last_hurt_one() -> None:
    records = [
        *steady(0, 5, "before"),
        call("failed", 5.2, 5.3, "503"),
        call("hung", 5.4, 10.4, "timeout"),  # the last hurt call is the last *sent*
        call("good-early", 5.5, 5.6),  # good, but sent before a hurt call: not recovered yet
        call("slow", 6.0, 9.0),  # 200, but 3 s: hurt
        call("first-after", 6.5, 7.1),
        call("later", 7.0, 7.2),
    ]
    assert recovery_s(records, 5.0, 12.0, SLOW_S) == pytest.approx(2.1)  # 7.1 - 5.0


def test_a_call_in_flight_at_the_event_counts_and_no_good_follower_is_not_recovered() -> None:
    records = [call("in-flight", 4.0, 6.0, "timeout"), call("good-before", 3.0, 3.1)]
    assert recovery_s(records, 5.0, 12.0, SLOW_S) is None
    assert recovery_s([*records, call("after", 6.1, 6.2)], 5.0, 12.0, SLOW_S) == pytest.approx(1.2)
    # Sent after the window: it does not count for this event.
    assert recovery_s([*records, call("late", 12.5, 12.6)], 5.0, 12.0, SLOW_S) is None


def test_the_tally_counts_the_calls_answered_in_the_phase_by_status_twice_and_lost() -> None:
    kill = Fault("kill-node-host", "kill", ("node1",), "killed")
    phase = Phase(kill, applied_s=10.0, healed_s=18.0, ended_s=30.0, killed_s=10.0)
    unknown = '{"error": "the outcome of call \'c\' is unknown: the gateway lost node node1 after sending it'
    records = [
        call("earlier", 8.0, 8.1),  # answered before the phase
        call("on-killed", 9.9, 15.0, "connection-error"),  # lost, in flight at the kill
        call("twice-elsewhere", 9.8, 10.5),  # in flight at the kill, but never ran on node1
        call("lost-later", 11.0, 16.0, "timeout"),  # lost, sent after the kill
        call("refused", 11.5, 11.6, "503"),
        CallRecord("unknown", 9.5, 11.7, "502", "", unknown),  # in flight on node1: not run again
        call("twice", 12.0, 12.4),
        *steady(12.5, 29.5, "ok"),
        call("next-phase", 29.9, 30.2),
    ]
    runs = Counter({"twice": 2, "ok0": 1, "earlier": 2, "on-killed": 2, "twice-elsewhere": 2, "unknown": 1})
    on_node1 = Counter({"on-killed": 1, "unknown": 1, "twice": 1})  # "twice" started there, but after the kill
    result = tally(records, phase, runs, SLOW_S, runs_on_killed=on_node1)
    assert (result.calls, result.ok) == (1 + 1 + 1 + 1 + 1 + 1 + len(steady(12.5, 29.5, "ok")), 2 + 34)
    assert result.failed_by_status == {"502": 1, "503": 1, "connection-error": 1, "timeout": 1}
    assert result.failed_outcome_unknown == 1
    assert result.run_twice == 3  # "earlier" ran twice but belongs to the phase before
    assert result.run_twice_in_flight_on_kill == 1  # "on-killed": in flight at the kill, and ran on node1
    assert (result.lost, result.lost_in_flight_on_kill) == (2, 1)
    assert result.recovery_after_fault_s == pytest.approx(12.4 - 10.0)  # "twice", sent after "lost-later"
    assert result.recovery_after_heal_s == 0.0
    assert result.held_s == 8.0
    # Without the killed host's executions nothing counts as in flight there.
    assert tally(records, phase, runs, SLOW_S).run_twice_in_flight_on_kill == 0


def test_executions_are_read_from_what_the_workers_printed_in_the_node_log() -> None:
    log = (
        "2026-11-26 11:00:00 INFO gpufaas.worker: chaos-a (pid 41): chaos-ran chaos-1-0-0\n"
        "2026-11-26 11:00:01 INFO gpufaas.worker: chaos-b (pid 42): chaos-ran chaos-1-0-1\n"
        "2026-11-26 11:00:02 INFO gpufaas: node node0 serving\n"
        "2026-11-26 11:00:03 INFO gpufaas.worker: chaos-a (pid 43): chaos-ran chaos-1-0-0\n"
    )
    assert runs_in_log(log) == Counter({"chaos-1-0-0": 2, "chaos-1-0-1": 1})


def test_settled_needs_the_minimum_time_and_the_last_calls_all_good() -> None:
    records = [call("bad", 10.0, 10.5, "503"), *steady(10.5, 14.0, "ok")]
    assert not settled(records, 10.0, 12.0, min_s=3.0, last=4, slow_s=SLOW_S)  # too soon
    assert settled(records, 10.0, 14.0, min_s=3.0, last=4, slow_s=SLOW_S)
    assert not settled(records, 10.0, 14.0, min_s=3.0, last=len(records), slow_s=SLOW_S)  # reaches the 503
    assert not settled(records[:2], 10.0, 14.0, min_s=3.0, last=4, slow_s=SLOW_S)  # too few calls


def test_probes_count_in_the_tally_but_not_for_recovery() -> None:
    probe = CallRecord("probe", 4.5, 9.0, "200", "node1", probe=True)  # slow by design
    records = [*steady(0, 12, "c"), probe]
    assert recovery_s(records, 5.0, 12.0, SLOW_S) == 0.0
    assert settled(records, 5.0, 12.0, min_s=3.0, last=4, slow_s=SLOW_S)
    phase = Phase(Fault("isolate-node", "isolate", ("node0",), ""), 5.0, 8.0, 12.0)
    assert tally(records, phase, Counter(), SLOW_S).slow == 1
