"""A worker's control group (gpu_manager.cgroups), probed with a function that takes more than it
declared (fixture `rogue_function`) on a real cluster: its children's memory counts against its
limit, a spinner gets its CPU share and not the machine, and nothing it starts outlives its
function. Needs root and writable cgroups (CI has both)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_manager.cgroups import CGROUP_ROOT, Unavailable, open_cgroups
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.mounts import mounted_under
from tests.builders import package_user
from tests.integration.conftest import ClusterFactory, deploy


def cgroups_usable() -> bool:
    """Whether a node here can make worker groups (the probe's own directory removed again)."""
    if os.geteuid() != 0:
        return False
    found = open_cgroups(f"gpufaas-probe-{os.getpid()}", root=CGROUP_ROOT)
    if isinstance(found, Unavailable):
        return False
    found.remove_base()
    return True


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not cgroups_usable(), reason="worker cgroups need root and writable cgroups (CI has both)"),
]


def post(cluster: LocalCluster, name: str, timeout_s: float = 120, **inputs: Any) -> httpx.Response:
    return httpx.post(
        f"{cluster.gateway_url}/function/{name}", json=inputs, headers=cluster.invoke_headers, timeout=timeout_s
    )


def latencies_ms(
    cluster: LocalCluster, name: str, *, count: int = 0, until: threading.Event | None = None
) -> list[float]:
    """Sequential calls of `name`: `count` of them, or as many as fit until `until` is set."""
    figures: list[float] = []
    with httpx.Client(headers=cluster.invoke_headers, timeout=60) as client:
        while (until is None and len(figures) < count) or (until is not None and not until.is_set()):
            started = time.perf_counter()
            response = client.post(f"{cluster.gateway_url}/function/{name}", json={})
            assert response.status_code == 200, response.text
            figures.append((time.perf_counter() - started) * 1000)
    return figures


def available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def processes_of(uid: int) -> list[int]:
    """The processes of user `uid` now (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and "State:\tZ" not in (entry / "status").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_until_none(uid: int, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def digest_of(cluster: LocalCluster, name: str) -> str:
    specs = httpx.get(f"{cluster.gateway_url}/system/functions", auth=cluster.admin_auth, timeout=30).json()
    return str(next(f["package_digest"] for f in specs if f["name"] == name))


@dataclass
class Hogged:
    """What `victim_under_a_hog` saw."""

    response: httpx.Response  # the rogue's answer
    took_s: float  # how long the rogue took to answer
    taken_mb: int  # the most host memory taken meanwhile (how far MemAvailable fell)
    idle: list[float]  # the victim's latencies (ms) before
    during: list[float]  # and meanwhile

    @property
    def victim(self) -> str:
        idle_p50, during_p50 = statistics.median(self.idle), statistics.median(self.during)
        return f"victim p50 idle {idle_p50:.1f} ms, during {during_p50:.1f} ms ({len(self.during)} calls)"


def victim_under_a_hog(cluster: LocalCluster) -> Hogged:
    """With `rogue` loaded and `victim` deployed: call the victim 40 times, then call the rogue with
    3 children touching 1,500 MB each for 10 s while calling the victim back to back (each call
    must answer 200) and watching the host's available memory."""
    idle = latencies_ms(cluster, "victim", count=40)
    before_mb = available_mb()
    lowest_mb = [before_mb]
    done = threading.Event()
    answer: list[httpx.Response] = []
    hog_s: list[float] = []

    def watch_memory() -> None:
        while not done.is_set():
            lowest_mb.append(available_mb())
            time.sleep(0.02)

    def hog() -> None:
        started = time.perf_counter()
        try:
            answer.append(post(cluster, "rogue", children=3, mb=1500, hold_s=10))
        finally:
            hog_s.append(time.perf_counter() - started)
            done.set()

    threads = [threading.Thread(target=watch_memory), threading.Thread(target=hog)]
    for thread in threads:
        thread.start()
    during = latencies_ms(cluster, "victim", until=done)
    for thread in threads:
        thread.join()
    return Hogged(answer[0], hog_s[0], before_mb - min(lowest_mb), idle, during)


def written_everywhere(cluster: LocalCluster, places: list[str]) -> tuple[dict[str, Any], int]:
    """Have `rogue` write 3 files of 100 MiB in each of `places` (it must answer 200): its report,
    and the MiB it wrote in all."""
    response = post(cluster, "rogue", write_mb=100, files=3, where=places)
    assert response.status_code == 200, response.text
    report = response.json()
    wrote = report["wrote"]
    total_mb = sum(place["written_mb"] for place in wrote.values())
    print(f"written in all: {total_mb} MiB of {300 * len(places):,} tried; {wrote}")
    return report, total_mb


def test_children_holding_3x1500_mb_on_a_600_mb_declaration_are_stopped_at_the_limit(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """Row (1): 3 children of one worker each touch 1.5 GB (per-process limits let each through:
    RLIMIT_DATA is 2 x 600 + 512 MiB per process). Their group's limit (the worker's resident
    memory + 1,712 MiB) stops them: the kernel kills one, the node kills the rest of the group,
    the call is a 500 saying so, and another function keeps answering."""
    cluster = make_cluster(nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=4000)
    deploy(cluster, "victim", "echo_function", tmp_path, memory_mb=100)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=600)
    assert post(cluster, "rogue").status_code == 200  # loaded: its worker holds its group
    hogged = victim_under_a_hog(cluster)
    response, taken_mb = hogged.response, hogged.taken_mb
    print(f"host memory taken at most {taken_mb} MiB; the call answered in {hogged.took_s:.2f} s; {hogged.victim}")
    assert response.status_code == 500, response.text
    assert "went over their" in response.json()["error"] and "host memory" in response.json()["error"]
    assert taken_mb < 2600, f"the group took {taken_mb} MiB of host memory"  # 4,500 MiB without it
    # The node is healthy: the rogue loads afresh and answers, the victim never stopped.
    assert post(cluster, "rogue").status_code == 200
    assert latencies_ms(cluster, "victim", count=5)
    log = (cluster.state_dir / "logs" / "node0.log").read_text(errors="replace")
    assert "went over their" in log


def test_a_16_thread_spinner_leaves_another_function_its_latency(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """Row (1), CPU: a handler spinning 16 threads (each hashing: the GIL released) gets its
    group's share; another function's p50 stays within 2.5x of its idle p50."""
    # Measured on 2 cores: 1.2-1.55x with the group's equal weight (the high end with CI's other
    # jobs on the machine), 4.3x without cgroups (5.60 -> 23.90 ms). 2.5x is between the two, so
    # noise does not fail it and losing the weight does.
    cluster = make_cluster(nodes=1, gpus_per_node=2, backend="cpu", gpu_memory_mb=4000)
    answer, idle_p50, during_p50 = victim_under_a_spinner(cluster, tmp_path)
    assert answer.status_code == 200, answer.text
    assert during_p50 <= 2.5 * idle_p50, f"p50 {idle_p50:.2f} -> {during_p50:.2f} ms"


def victim_under_a_spinner(cluster: LocalCluster, tmp_path: Path) -> tuple[httpx.Response, float, float]:
    """Deploy `victim` (echo) and `rogue`; call the victim back to back, idle and then while the
    rogue spins 16 threads for 8 s (each call must answer 200): the rogue's answer, and the
    victim's p50 idle and during, in ms."""
    deploy(cluster, "victim", "echo_function", tmp_path, memory_mb=100)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    assert post(cluster, "rogue").status_code == 200
    latencies_ms(cluster, "victim", count=10)  # warm
    idle = latencies_ms(cluster, "victim", count=60)
    done = threading.Event()
    answer: list[httpx.Response] = []

    def spin() -> None:
        try:
            answer.append(post(cluster, "rogue", spin_threads=16, spin_s=8))
        finally:
            done.set()

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(1.0)  # its threads running
    during = latencies_ms(cluster, "victim", until=done)
    spinner.join()
    idle_p50, during_p50 = statistics.median(idle), statistics.median(during)
    print(f"victim p50 idle {idle_p50:.2f} ms, under a 16-thread spinner {during_p50:.2f} ms ({len(during)} calls)")
    return answer[0], idle_p50, during_p50


def test_a_detached_child_ends_with_its_function_and_with_the_cluster(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """Row (3): a handler starts a process in a session of its own (setsid and a second fork: not
    the worker's child, not in any process group of the node's). `gpufaas rm` (DELETE
    /system/functions {functionName}) ends it with its worker; and so does the cluster's stop."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    response = post(cluster, "rogue", detach=True)
    assert response.status_code == 200, response.text
    uid = package_user(cluster.state_dir / "node0", digest_of(cluster, "rogue"))
    detached = response.json()["detached"]
    assert detached in processes_of(uid)
    removed = httpx.request(  # what `gpufaas rm rogue` sends
        "DELETE",
        f"{cluster.gateway_url}/system/functions",
        json={"functionName": "rogue"},
        auth=cluster.admin_auth,
        timeout=30,
    )
    assert removed.is_success, removed.text
    assert wait_until_none(uid) == [], "a process of the function's user outlived `gpufaas rm`"

    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    response = post(cluster, "rogue", detach=True)
    assert response.status_code == 200, response.text
    assert response.json()["detached"] in processes_of(uid)
    cluster.stop()
    assert wait_until_none(uid, timeout_s=5) == [], "a process of the function's user outlived the cluster"


def test_a_packages_home_and_tmp_are_bounded_in_total_and_removed_with_it(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """Row (2): a handler writes 3 files of 100 MiB in HOME, /tmp, /var/tmp and /dev/shm (RLIMIT_FSIZE
    caps each file only). They are all one tmpfs of --home-mb (256 MiB here), its own: nothing
    lands in the host's /tmp, and its home is gone once the function is removed. Its worker runs
    with no_new_privs."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, node_flags=["--home-mb", "256"])
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    places = ["$HOME", "/tmp", "/var/tmp", "/dev/shm"]
    # The host's other world-writable places (a file left in /run/lock outlived the function).
    places += [p for p in ("/run/lock", "/var/crash") if Path(p).is_dir() and Path(p).stat().st_mode & 0o002]
    report, total_mb = written_everywhere(cluster, places)
    uid = package_user(cluster.state_dir / "node0", digest_of(cluster, "rogue"))
    wrote = report["wrote"]
    assert total_mb <= 256, wrote
    assert {place["error"] for place in wrote.values()} == {"OSError"}, wrote  # ENOSPC everywhere
    assert report["home"] == "/tmp" and report["no_new_privs"] == "1"
    for place in places[1:]:
        assert not list(Path(place).glob("rogue-*")), f"the function wrote in the host's {place}"
    home = cluster.state_dir / "node0" / "homes" / str(uid)
    assert home.is_dir()
    removed = httpx.request(
        "DELETE", f"{cluster.gateway_url}/system/functions", json={"functionName": "rogue"}, auth=cluster.admin_auth
    )
    assert removed.is_success, removed.text
    deadline = time.monotonic() + 15
    while home.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not home.exists(), "the function's home outlived `gpufaas rm`"
    assert str(home) not in Path("/proc/self/mountinfo").read_text()


def test_the_system_v_shared_memory_a_function_makes_is_its_workers_own(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A segment a handler makes and never removes is in its worker's IPC namespace: not in the
    host's (where it held host memory past the worker's cgroup, its function and the node: 2,000
    MiB after 5 workers of 400 MiB each, until a reboot), and gone with the worker."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    host_before = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    response = post(cluster, "rogue", shm_mb=64)
    assert response.status_code == 200, response.text
    uid = response.json()["uid"]
    host_after = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    made = [line for line in host_after if line not in host_before and int(line.split()[7]) == uid]
    assert made == [], f"the function's segment is in the host's IPC namespace: {made}"


@pytest.mark.parametrize("node_killed", [False, True])
def test_no_package_home_outlives_its_cluster(make_cluster: ClusterFactory, tmp_path: Path, node_killed: bool) -> None:
    """A package's home is a tmpfs in its node's state directory: after the cluster stops none is
    left mounted, whether the node unmounted them itself or was killed first (then the launcher
    does; left mounted, they held memory and kept the directory from being removed)."""
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    assert post(cluster, "rogue").status_code == 200
    assert mounted_under(cluster.state_dir), "the package's home is not a mount: nothing to check"
    if node_killed:
        cluster.components["node0"].stop(kill=True)
    cluster.stop()
    assert mounted_under(cluster.state_dir) == []
