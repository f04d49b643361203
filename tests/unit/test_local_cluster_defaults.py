"""gpufaas.dev.local_cluster's defaults: the local cluster's own etcd asks for a password, and every
daemon's command line is its settings model's, read back by the daemon as the same settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from gpu_manager.settings import NodeSettings
from gpufaas.credentials import ensure_secrets
from gpufaas.dev.local_cluster import (
    STARTED_KEY,
    ClusterError,
    LocalCluster,
    _supervisor_lock,
    pool_dir,
    recorded_pids,
    stop_recorded,
    supervised,
)
from gpufaas.dev.local_cluster import main as local_cluster_main
from gpufaas.processes import started
from gpufaas.settings import DaemonSettings, SettingsError
from scheduler.policies import PolicyConfig
from scheduler.settings import SchedulerSettings


def argvs(cluster: LocalCluster) -> list[list[str]]:
    """The three daemons' flags as `start()` would pass them."""
    cluster.etcd_endpoint = cluster.etcd_endpoint or "127.0.0.1:2379"  # what start() sets once its etcd runs
    return [
        cluster.scheduler_settings().to_argv(),
        cluster.gateway_settings().to_argv(),
        cluster.node_settings("node0").to_argv(),
    ]


def test_a_cluster_that_runs_its_own_etcd_turns_etcds_authentication_on(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)  # as `gpufaas up` makes it (python -m gpufaas.dev.local_cluster)
    assert cluster.etcd_auth is True
    for argv in argvs(cluster):
        assert argv[argv.index("--etcd-password-file") + 1] == str(cluster.secrets.etcd_password)
        assert argv[argv.index("--secret-file") + 1] == str(cluster.secrets.cluster_secret)


def test_a_cluster_that_runs_its_own_etcd_reaches_it_over_tls_unless_its_links_are_plain(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path)
    assert cluster.etcd_tls is True and all("--etcd-tls" in argv for argv in argvs(cluster))
    ensure_secrets(cluster.secrets.directory)  # as start() makes them
    client = cluster.etcd_client_tls
    assert client is not None and client.ca_pem == cluster.secrets.tls.ca.read_bytes()
    for plain in (
        LocalCluster(tmp_path, tls=False),  # --no-tls: no TLS anywhere
        LocalCluster(tmp_path, secure=False),
        LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379"),  # the tests' shared etcd: its owner's
    ):
        assert not plain.etcd_tls and all("--etcd-tls" not in argv for argv in argvs(plain))
        assert plain.etcd_client_tls is None


def test_an_etcd_given_to_the_cluster_is_left_as_its_owner_runs_it(tmp_path: Path) -> None:
    shared = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379")  # the tests' shared etcd
    assert shared.etcd_auth is False and all("--etcd-password-file" not in argv for argv in argvs(shared))
    locked = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379", etcd_auth=True)
    assert all("--etcd-password-file" in argv for argv in argvs(locked))
    insecure = LocalCluster(tmp_path, secure=False)  # --insecure daemons: no credentials at all
    assert all("--insecure" in argv and "--etcd-password-file" not in argv for argv in argvs(insecure))
    assert insecure.etcd_credentials is None


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        (SchedulerSettings, LocalCluster.scheduler_settings),
        (GatewaySettings, LocalCluster.gateway_settings),
        (NodeSettings, lambda cluster: cluster.node_settings("node1")),
    ],
    ids=["scheduler", "gateway", "node"],
)
def test_each_daemon_reads_its_command_line_back_as_the_settings_it_came_from(
    tmp_path: Path, model: type[DaemonSettings], settings: object
) -> None:
    cluster = LocalCluster(
        tmp_path,
        policy="mqfq-sticky",
        eviction="heaviness",
        slots="2,cpu=3",
        gpu_idle_release_s=4.5,
        runtime="docker",
        spares=0,
        scheduler_flags=["--o3-limit", "0", "--no-interference-aware-loads", "--mqfq-overrun-s", "2.5"],
        node_flags=["--home-mb", "256", "--pool-dir", str(tmp_path / "pool")],
    )
    cluster.etcd_endpoint = "127.0.0.1:2379"
    assert callable(settings)
    expected = settings(cluster)
    assert isinstance(expected, model)
    assert model.from_args(expected.to_argv(), "test", "") == expected


def test_policy_knobs_reach_the_scheduler_as_one_policy_config(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379", scheduler_flags=["--o3-limit", "0"])
    cluster.scheduler_flags += ["--mqfq-ttl-alpha", "3", "--torpor-alpha-period-s", "10", "--mqfq-swap-out"]
    config = cluster.scheduler_settings().policy_config
    assert config == PolicyConfig(max_num_skips=0, mqfq_ttl_alpha=3, torpor_alpha_period_s=10, mqfq_swap_out=True)


def test_node_flags_override_the_cluster_and_are_checked(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, etcd_endpoint="127.0.0.1:2379", node_flags=["--gpus", "5"])
    assert cluster.node_settings("node0").gpus == 5  # later flags win, as on a command line
    cluster.node_flags = ["--spares", "-1"]
    with pytest.raises(SettingsError, match="--spares must be >= 0"):
        cluster.node_settings("node0")


def test_a_recorded_pid_now_naming_another_process_is_not_stopped(tmp_path: Path) -> None:
    # A failed start's supervisor (or a reboot) leaves its PID recorded; once reused by another
    # process (a shell, a session leader), `gpufaas down` signalled that process's whole group.
    unrelated = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        mine = started(os.getpid())
        assert mine is not None
        record = {"supervisor": unrelated.pid, "gateway": os.getpid(), STARTED_KEY: {"supervisor": 1, "gateway": mine}}
        (tmp_path / "pids.json").write_text(json.dumps(record))
        assert recorded_pids(tmp_path) == {"gateway": os.getpid()}  # the supervisor's PID is another's now
        (tmp_path / "pids.json").write_text(json.dumps({"supervisor": unrelated.pid, STARTED_KEY: {"supervisor": 1}}))
        assert stop_recorded(tmp_path) == [] and unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


def test_down_removes_the_host_pools_of_nodes_that_could_not(tmp_path: Path) -> None:
    # A supervisor killed past down's wait, its nodes killed after it: the pools (weights in
    # /dev/shm) stayed, a model's worth of memory each, until the next `up` of that directory.
    (tmp_path / "cluster.json").write_text(json.dumps({"nodes": 2}))
    pools = [pool_dir(tmp_path, f"node{index}") for index in range(2)]
    try:
        for pool in pools:
            (pool / "blobs").mkdir(parents=True)
            (pool / "blobs" / "weights").write_bytes(b"w" * 1000)
        assert stop_recorded(tmp_path) == []
        assert not any(pool.exists() for pool in pools)
    finally:
        for pool in pools:
            shutil.rmtree(pool, ignore_errors=True)


def test_one_supervisor_per_state_directory_and_a_start_gives_up_when_stopped(tmp_path: Path) -> None:
    # Two `gpufaas up` at once on one directory ran two supervisors sharing etcd's data, and a
    # `gpufaas down` while one started found nothing recorded and left it running.
    held = _supervisor_lock(tmp_path)
    assert held is not None and supervised(tmp_path)
    try:
        assert local_cluster_main(["--state-dir", str(tmp_path)]) == 2
        assert not (tmp_path / "pids.json").exists()  # the running one's record is left alone
    finally:
        held.close()
    assert not supervised(tmp_path)
    cluster = LocalCluster(tmp_path, nodes=0)
    cluster._stopping.set()  # as the supervisor's SIGTERM handler does
    with pytest.raises(ClusterError, match="stopped while it started"):
        cluster.wait_healthy(timeout_s=5.0)
