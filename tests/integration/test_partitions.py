"""Partitions and host loss under load, tested: the partition chaos bench on the netns harness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.partition_chaos import ChaosConfig, run_chaos, summary_lines
from gpufaas.dev.host_cluster import HostCluster, haproxy_available, host_names
from tests.integration.test_hosts import HostsFactory, make_hosts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

RECOVERY_TARGET_S = 5.0  # issue 21 item 5: calls succeed again within 5 s of a fault, and of its heal
# Faults that cut a node off from a gateway, or kill it: a call whose Execute may have reached the
# node is answered 502 "outcome unknown" rather than run again (at most once, docs/partitions.md).
NODE_FAULTS = {"isolate-node", "cut-gateway-node-one-way", "kill-node-host"}
# What the runs showed and why (docs/partitions.md, "What goes wrong"): each (fault, check) here is a
# known defect of the system, not of the test. The test fails on any other miss; where only these
# miss, it is an expected failure naming them with the figures measured. None is known now.
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}
RECOVERY_CEILING_S = 10.0  # a known recovery miss must still end within this


def violations(fault: dict[str, Any]) -> list[tuple[str, str]]:
    """(check, figure) for each check `fault`'s tally fails."""
    name, found = fault["fault"], []
    # After each heal exactly one scheduler leads: a deposed leader that is reachable again stands by.
    roles = fault.get("scheduler_roles_after_heal", {})
    if list(roles.values()).count("leader") != 1:
        found.append(("one leader", f"scheduler roles after the heal: {roles}"))
    # At most once: no call starts twice, not even one in flight on a killed host (its gateway
    # answers it 502 "outcome unknown": its first run may have had effects).
    if fault["run_twice"]:
        found.append(("run twice", f"{fault['run_twice']} calls ran twice"))
    if fault["lost"] != fault["lost_in_flight_on_kill"]:
        found.append(("lost", f"{fault['lost'] - fault['lost_in_flight_on_kill']} calls got no answer"))
    # Calls fail only where a node was cut off or killed under them, and then only with 502
    # "outcome unknown"; anything else (HAProxy's own 503 while the scheduler changes, a 503 from a
    # new leader attaching its nodes, a timeout) is a miss.
    allowed = fault.get("failed_outcome_unknown", 0) if name in NODE_FAULTS else 0
    failed = sum(fault["failed_by_status"].values()) - fault["lost"]
    if failed > allowed:
        found.append(("failed", f"{failed - allowed} calls failed: {fault['failed_by_status']}"))
    after = {"after the fault": fault["recovery_after_fault_s"], "after the heal": fault["recovery_after_heal_s"]}
    for when, seconds in after.items():
        if seconds is None or seconds > RECOVERY_TARGET_S:
            assert (name, "recovery") in KNOWN_DEFECTS and seconds is not None and seconds <= RECOVERY_CEILING_S, (
                name,
                when,
                seconds,
                fault["hurt"],
            )
            found.append(("recovery", f"recovered {seconds:.1f} s {when}"))
    return found


def test_each_fault_runs_no_call_twice_loses_none_and_recovers_within_the_target(
    make_hosts: HostsFactory,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    """Two nodes, two gateways (behind HAProxy where it is installed, else the clients spread their
    calls over them), two schedulers (one leads, by election), TLS on every link and
    etcd; 8 clients of short calls and 4 longer probes while each fault of bench.partition_chaos
    is applied, held 8 s and healed."""
    balancer = haproxy_available()
    nodes = ["node0", "node1"]
    hosts = make_hosts(host_names(nodes, 2, 2, balancer=balancer))
    cluster = HostCluster.of_shape(hosts, tmp_path, nodes, balancer=balancer)
    try:
        document = run_chaos(cluster, ChaosConfig(), election=True)
    finally:
        cluster.close()
    print("\n" + "\n".join(summary_lines(document)))
    assert document["baseline"]["ok"] == document["baseline"]["calls"] > 0, document["baseline"]
    assert all(fault["calls"] > 0 for fault in document["faults"]), document["faults"]
    found = [(fault["fault"], *v) for fault in document["faults"] for v in violations(fault)]
    unexplained = [v for v in found if v[:2] not in KNOWN_DEFECTS]
    assert not unexplained, (unexplained, document["faults"])
    if found:
        said = "; ".join(f"{name}: {figure} ({KNOWN_DEFECTS[name, check]})" for name, check, figure in found)
        pytest.xfail(f"known defects: {said}")
