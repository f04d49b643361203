"""bench/hop_cpu.py's measuring parts: a process's CPU from /proc, a call id's format, the
cProfile table it reports, and the cluster's processes by role."""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import time
import uuid
from pathlib import Path

from bench.hop_cpu import cluster_pids, cpu_s, top_functions
from gateway.invoke import new_call_id
from gpufaas.dev.local_cluster import node_pid, recorded_pids


def _spin(seconds: float) -> int:
    deadline = time.process_time() + seconds
    n = 0
    while time.process_time() < deadline:
        n += 1
    return n


def test_cpu_s_counts_this_process_user_and_system_time() -> None:
    before = cpu_s(os.getpid())
    _spin(0.3)
    spent = cpu_s(os.getpid()) - before
    assert 0.25 <= spent <= 1.0, f"0.3 s of CPU spent, /proc says {spent:.2f} s"


def test_cpu_s_of_a_process_gone_is_zero() -> None:
    assert cpu_s(2**22 + 12345) == 0.0  # above Linux's largest PID


def test_top_functions_reports_us_per_call_own_and_with_callees() -> None:
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    _spin(0.1)
    profile.disable()
    table = top_functions(pstats.Stats(profile), calls=100)
    own = {name.split(" ")[0]: us for name, us in table["own_us_per_call"].items()}
    cumulative = {name.split(" ")[0]: us for name, us in table["cumulative_us_per_call"].items()}
    # 0.1 s over 100 calls is about 1,000 us a call, all of it in _spin and the clock it reads.
    assert 500 <= cumulative["_spin"] <= 5000, table
    assert 0 < own["_spin"] < cumulative["_spin"] <= table["total_us_per_call"] * 1.01


def test_new_call_id_is_a_random_uuid4_in_hex() -> None:
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    for call_id in ids:
        parsed = uuid.UUID(hex=call_id)
        assert (parsed.version, parsed.variant, parsed.hex) == (4, uuid.RFC_4122, call_id)


def test_cluster_pids_name_the_gateway_as_the_node_where_the_node_runs_inside_it(tmp_path: Path) -> None:
    """`node_pid`: a node of its own, or the gateway's process that runs it (its workers are that
    process's descendants: none of these PIDs lives, so none is found)."""
    (tmp_path / "pids.json").write_text(json.dumps({"gateway": 2**22 + 1, "etcd": 2**22 + 2}))
    assert node_pid(recorded_pids(tmp_path)) == 2**22 + 1
    assert cluster_pids(tmp_path) == {
        "gateway": [2**22 + 1],
        "scheduler": [],
        "node": [],
        "workers": [],
        "etcd": [2**22 + 2],
    }
    (tmp_path / "pids.json").write_text(json.dumps({"gateway": 2**22 + 1, "node0": 2**22 + 3}))
    assert node_pid(recorded_pids(tmp_path)) == 2**22 + 3
    assert cluster_pids(tmp_path)["node"] == [2**22 + 3]
