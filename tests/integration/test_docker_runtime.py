"""The docker worker runtime on a real Docker engine: a function's worker in a container of its
own, checked from inside (its user, no network, a read-only filesystem) and from the engine (the
container's limits), and its memory limit enforced; then each function-side attack of
docs/security.md's "Attacks probed", reproduced on containers through a real cluster. CI starts
dockerd and builds the image (scripts/worker-image.sh); elsewhere these tests say why they skip."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_manager.containers import (
    CPU_SHARES,
    DEFAULT_IMAGE,
    NODE_LABEL,
    PACKAGE_MOUNT,
    SHM_MB,
    SOCKET_MOUNT,
    TMPFS_MB,
    memory_limit_mb,
)
from gpu_manager.sandbox import DEFAULT_MAX_PROCESSES
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.processes import pid_alive
from tests.builders import package_user
from tests.integration import test_isolation as isolation
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_confinement import (
    digest_of,
    latencies_ms,
    post,
    processes_of,
    victim_under_a_hog,
    victim_under_a_spinner,
    wait_until_none,
    written_everywhere,
)
from tests.integration.test_isolation import O_PATH, SECRET, node_address
from tests.integration.test_isolation import call as call_ok
from tests.integration.test_memory_reports import GPU_MB, over_declared, settled, the_gpu


def engine() -> tuple[Any, str]:
    """(a Docker client, "") or (None, why not)."""
    try:
        import docker
        import docker.errors
    except ImportError:
        return None, "the docker package is not installed"
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(DEFAULT_IMAGE)
    except docker.errors.ImageNotFound:
        return None, f"the image {DEFAULT_IMAGE} is missing: bash scripts/worker-image.sh"
    except Exception as exc:
        return None, f"no Docker engine answers ({type(exc).__name__}); CI starts dockerd"
    return client, ""


CLIENT, WHY_NOT = engine()
REQUIRED = os.environ.get("GPUFAAS_REQUIRE_DOCKER") == "1"  # CI: a missing engine is a failure, not a skip
pytestmark = [pytest.mark.integration, pytest.mark.skipif(CLIENT is None and not REQUIRED, reason=WHY_NOT)]


def call(cluster: LocalCluster, **probes: Any) -> httpx.Response:
    return httpx.post(
        f"{cluster.gateway_url}/function/prowler", json=probes, headers=cluster.invoke_headers, timeout=180
    )


def containers(node: str) -> list[Any]:
    """The node's containers, each inspected. docker-py lists, then inspects each one: one removed
    in between (what the tests wait for) is left out, not a failure of the whole listing."""
    return list(CLIENT.containers.list(all=True, filters={"label": f"{NODE_LABEL}={node}"}, ignore_removed=True))


def test_a_function_runs_in_a_container_of_its_own_held_to_its_limits(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    assert CLIENT is not None, WHY_NOT
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, runtime="docker", spares=0)
    deploy(cluster, "prowler", "prowler_function", tmp_path, memory_mb=100)
    digest = httpx.get(f"{cluster.gateway_url}/system/function/prowler", auth=cluster.admin_auth, timeout=30).json()[
        "package_digest"
    ]
    assert cluster.etcd_endpoint is not None
    etcd_host, etcd_port = cluster.etcd_endpoint.rsplit(":", 1)
    response = call(
        cluster,
        connect=[
            [etcd_host, int(etcd_port)],
            ["127.0.0.1", cluster.scheduler_port],
            ["127.0.0.1", cluster.gateway_port],
            list(node_address(cluster)),
        ],
        read=["/package/handler.py"],
        write=["/package/handler.py", "/package/new.py", "/usr/local/x", "/tmp/scratch"],
        show=["/proc/self/cgroup"],
    )
    assert response.status_code == 200, response.text
    report = response.json()
    assert response.headers["X-Cache"] == "miss"

    # From inside: its own user, no network, its package read-only, a writable /tmp only.
    expected_uid = package_user(cluster.state_dir / "node0", digest) if os.geteuid() == 0 else os.getuid()
    assert report["uid"] == report["gid"] == expected_uid != 0
    assert all(outcome != "ok" for outcome in report["connect"].values()), report["connect"]
    assert report["read"] == {"/package/handler.py": "ok"}
    assert report["write"]["/tmp/scratch"] == "ok"
    refused = {"OSError", "PermissionError"}  # a read-only filesystem, or files not the worker's
    assert {p for p, o in report["write"].items() if o in refused} == {
        "/package/handler.py",
        "/package/new.py",
        "/usr/local/x",
    }, report["write"]
    assert not [name for name in report["environment"] if "SECRET" in name or "ETCD" in name]

    # From the engine: the container's settings.
    (container,) = containers("node0")
    host = container.attrs["HostConfig"]
    assert container.attrs["Config"]["User"] == f"{expected_uid}:{expected_uid}"
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["Memory"] == memory_limit_mb("cpu", 100) * 1024 * 1024
    assert host["PidsLimit"] == DEFAULT_MAX_PROCESSES
    assert host["CapDrop"] == ["ALL"] and "no-new-privileges" in host["SecurityOpt"]
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/package"]["RW"] is False

    # Its memory limit holds: 4 GiB on a 100 MB declaration ends the container, not the node.
    over = call(cluster, allocate_mb=4096)
    assert over.status_code >= 500, over.text
    again = call(cluster)
    assert again.status_code == 200 and again.headers["X-Cache"] == "miss"  # a new container

    cluster.stop()
    assert containers("node0") == []  # the node removes its containers when it stops


def test_a_container_maps_its_weights_from_the_host_pool(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    assert CLIENT is not None, WHY_NOT
    import torch
    from safetensors.torch import save_file

    from gpufaas.cli import uploads
    from gpufaas.cli.client import GatewayClient
    from gpufaas.credentials import read_secret
    from gpufaas.packages import DigestCache
    from tests.integration.test_packages import POOLED_HANDLER, invoke

    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=2000, runtime="docker", spares=0)
    directory = tmp_path / "fn"
    directory.mkdir()
    (directory / "handler.py").write_text(f"VERSION = 'docker'\n{POOLED_HANDLER}")
    weights = torch.randn(1 << 20)  # 4 MB: pooled
    save_file({"w": weights}, directory / "weights.safetensors")
    gateway = GatewayClient(cluster.gateway_url, password=read_secret(cluster.secrets.admin_password))
    report = uploads.upload(gateway, uploads.scan([("pooled", directory)], DigestCache(None)))
    (answer,) = report.packages.values()
    spec = {"name": "pooled", "package_digest": answer["digest"], "memory_mb": 300}
    assert gateway.request("POST", "/system/functions", json=spec).status_code == 202

    result = invoke(cluster, "pooled").json()
    assert result == {"sum": pytest.approx(float(weights.double().sum())), "pooled": True, "version": "docker"}
    (container,) = containers("node0")
    pool_mounts = [m for m in container.attrs["Mounts"] if m["Destination"].startswith("/gpufaas/pool/")]
    assert len(pool_mounts) == 1 and pool_mounts[0]["RW"] is False  # its own weights only, read-only


# --- The attacks of docs/security.md's "Attacks probed", on the docker runtime -----------------


def on_docker(make_cluster: ClusterFactory) -> ClusterFactory:
    """`make_cluster` for the docker runtime (which keeps no spares)."""

    def factory(**options: Any) -> LocalCluster:
        assert CLIENT is not None, WHY_NOT
        return make_cluster(**options, runtime="docker", spares=0)

    return factory


def container_starts(since_s: float) -> int:
    """How many containers of node0 the engine started since `since_s`."""
    filters = {"type": "container", "event": "start", "label": f"{NODE_LABEL}=node0"}
    return len(list(CLIENT.events(since=int(since_s), until=int(time.time()) + 1, filters=filters, decode=True)))


def docker_cluster(make_cluster: ClusterFactory, *, gpus: int = 1, gpu_memory_mb: int = 2000) -> LocalCluster:
    assert CLIENT is not None, WHY_NOT
    return make_cluster(
        nodes=1, gpus_per_node=gpus, backend="cpu", gpu_memory_mb=gpu_memory_mb, runtime="docker", spares=0
    )


def the_container(cluster: LocalCluster, name: str) -> Any:
    """The one container of function `name` on node0 (found by its package's mount)."""
    digest = digest_of(cluster, name).removeprefix("sha256:")
    found = [
        c
        for c in containers("node0")
        if any(m["Destination"] == PACKAGE_MOUNT and m["Source"].endswith(digest) for m in c.attrs["Mounts"])
    ]
    assert len(found) == 1, [c.name for c in found]
    return found[0]


def host_pid(uid: int, namespace_pid: int) -> int | None:
    """The host's pid of the process of user `uid` that is `namespace_pid` in its container."""
    for pid in processes_of(uid):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            ns_pids = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
            if int(ns_pids[-1]) == namespace_pid:
                return pid
    return None


def remove_function(cluster: LocalCluster, name: str) -> None:
    """What `gpufaas rm NAME` sends."""
    removed = httpx.request(
        "DELETE", f"{cluster.gateway_url}/system/functions", json={"functionName": name}, auth=cluster.admin_auth
    )
    assert removed.is_success, removed.text


def gone_within(check: Any, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(check())


def test_a_container_worker_holds_nothing_of_its_nodes(make_cluster: ClusterFactory, tmp_path: Path) -> None:
    """Inherited descriptors: a handler lists /proc/self/fd and tries each one (fixture
    `descriptor_function`). A container's process is the engine's, not the node's child: it holds
    its stdio (the engine's /dev/null and log pipes) and its socket to the node, nothing it can
    read, reopen or write, and another function's output (in the node's log) is nowhere."""
    cluster = docker_cluster(make_cluster)
    deploy(cluster, "victim", "prowler_function", tmp_path, memory_mb=100)
    deploy(cluster, "thief", "descriptor_function", tmp_path, memory_mb=100)
    victim = call_ok(cluster, "victim", say=SECRET)
    report = call_ok(cluster, "thief", look_for=SECRET)
    descriptors = {int(fd): entry for fd, entry in report["descriptors"].items()}
    print(f"descriptors: {descriptors}")
    assert report["found"] == [], descriptors
    sockets = [fd for fd, entry in descriptors.items() if entry["target"].startswith("socket:")]
    assert len(sockets) == 1, descriptors
    assert descriptors[0]["target"] == "/dev/null"
    assert descriptors[1]["target"].startswith("pipe:") and descriptors[2]["target"].startswith("pipe:"), descriptors
    assert victim["stdout"].startswith("pipe:") and victim["stdout"] != descriptors[1]["target"]
    others = {fd: entry for fd, entry in descriptors.items() if fd not in (0, 1, 2, *sockets)}
    assert {fd: entry for fd, entry in others.items() if not entry["flags"] & O_PATH} == {}, others
    assert not [entry for entry in others.values() if "ok" in (entry["read"], entry["reopen"], entry["write"])]
    assert "forged log line" not in (cluster.state_dir / "logs" / "node0.log").read_text(errors="replace")


def test_json_nested_100000_deep_is_a_400_and_the_warm_container_stays(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """The process runtime's test on containers: 20 calls with JSON nested 100,000 deep are each a
    400, a handler's sys.exit() its call's 500, and the next call a hit on the same worker; the
    engine started one container in all (a worker that died would have been replaced)."""
    started_s = time.time()
    isolation.test_a_caller_cannot_break_a_warm_worker(on_docker(make_cluster), tmp_path)
    assert container_starts(started_s) == 1


def test_a_container_worker_lying_about_its_memory_is_booked_at_its_declared_size(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """The memory liar (fixture `memory_liar_function`) in containers: one declared 1,800 MB
    reporting 1 MB and one declared 100 MB reporting 1,999 MB are booked 1,800 and 100 MB (a node
    believing them would book 1 + 1,999 MB), both resident on a 2,000 MB GPU, and the over-report
    is counted once."""
    cluster = docker_cluster(make_cluster, gpu_memory_mb=GPU_MB)
    under = deploy(cluster, "under", "memory_liar_function", tmp_path, memory_mb=1800, environment={"CLAIM_MB": "1"})
    over = deploy(cluster, "over", "memory_liar_function", tmp_path, memory_mb=100, environment={"CLAIM_MB": "1999"})
    for name, claimed_mb in (("under", 1), ("over", 1999), ("under", 1), ("over", 1999)):
        assert call_ok(cluster, name)["claimed_mb"] == claimed_mb  # twice each: a hit's Done carries a report too
    booked = {"memory_used_mb": 1900, "models": {under["model"], over["model"]}}

    def view() -> dict[str, Any]:
        gpu = the_gpu(cluster)
        return {"memory_used_mb": gpu["memory_used_mb"], "models": set(gpu["lru"])}

    assert (booked_now := settled(view, booked)) == booked, booked_now
    assert settled(lambda: over_declared(cluster), 1.0) == 1.0


def test_children_holding_3x1500_mb_on_a_600_mb_declaration_stop_at_the_containers_limit(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """3 children of a container's worker each touch 1.5 GB on a 600 MB declaration: the
    container's memory limit (1 GiB + 2 x 600 + 512 MiB) holds them all, the kernel kills one and
    the node the whole container, the call is an error, another function answers throughout, and
    the function answers again after (a new container)."""
    cluster = docker_cluster(make_cluster, gpus=2, gpu_memory_mb=4000)
    deploy(cluster, "victim", "echo_function", tmp_path, memory_mb=100)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=600)
    assert post(cluster, "rogue").status_code == 200
    first = the_container(cluster, "rogue").id
    hogged = victim_under_a_hog(cluster)
    response, taken_mb = hogged.response, hogged.taken_mb
    print(
        f"host memory taken at most {taken_mb} MiB (limit {memory_limit_mb('cpu', 600)} MiB); the call answered "
        f"{response.status_code} in {hogged.took_s:.2f} s: {response.text[:300]}; {hogged.victim}"
    )
    # The node names the limit met (the engine's oom event), and does not retry the call.
    assert response.status_code == 500 and "went over their" in response.text, response.text
    # 4,500 MiB and more without the limit; the margin is what others on the host take meanwhile.
    assert taken_mb < memory_limit_mb("cpu", 600) + 800, f"the container took {taken_mb} MiB of host memory"
    again = post(cluster, "rogue")
    assert again.status_code == 200, again.text
    assert the_container(cluster, "rogue").id != first  # the whole container went, a new one answers
    assert latencies_ms(cluster, "victim", count=5)


def test_a_16_thread_spinner_in_a_container_leaves_another_function_answering(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """16 threads spinning in one container (each hashing: the GIL released) while another
    function is called back to back: every call answers, its p50 within 5x of its idle p50 (each
    container has the same CPU weight: measured 1.5x to 2.8x on 2 busy CPUs, where a spinner
    weighted 256x the other container took it from 8 to 265 ms, 32x). The process runtime's worker
    groups hold it to 1.5x (test_confinement.py)."""
    cluster = docker_cluster(make_cluster, gpus=2, gpu_memory_mb=4000)
    answer, idle_p50, during_p50 = victim_under_a_spinner(cluster, tmp_path)
    cpu = {c.name: c.attrs["HostConfig"]["CpuShares"] for c in containers("node0")}
    assert answer.status_code == 200 and answer.json()["spun"] == 16, answer.text
    assert during_p50 <= 5 * idle_p50, f"p50 {idle_p50:.2f} -> {during_p50:.2f} ms"
    assert len(cpu) == 2 and set(cpu.values()) == {CPU_SHARES}, cpu


def test_a_containers_home_and_tmp_are_bounded_in_total_and_removed_with_it(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A handler writes 3 files of 100 MiB in HOME, /tmp, /var/tmp, /dev/shm and its socket's
    directory: only the container's tmpfs mounts take them (a read-only root elsewhere, the socket's
    directory read-only), bounded in all; nothing lands on the host; the container goes with
    `gpufaas rm`, its tmpfs with it."""
    cluster = docker_cluster(make_cluster)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    places = ["$HOME", "/tmp", "/var/tmp", "/dev/shm", SOCKET_MOUNT]
    report, total_mb = written_everywhere(cluster, places)
    wrote = report["wrote"]
    assert total_mb <= TMPFS_MB + SHM_MB, wrote
    assert {place["error"] for place in wrote.values()} == {"OSError"}, wrote  # ENOSPC or EROFS everywhere
    assert report["home"] == "/tmp" and report["no_new_privs"] == "1"
    for place in ("/tmp", "/var/tmp", "/dev/shm", "/tmp/gpufaas-sockets-*/*"):
        assert not list(Path("/").glob(f"{place[1:]}/rogue-*")), f"the function wrote in the host's {place}"
    container = the_container(cluster, "rogue")
    remove_function(cluster, "rogue")
    assert gone_within(lambda: container.id not in {c.id for c in containers("node0")}), "it outlived `gpufaas rm`"


def test_a_detached_child_ends_with_its_container_and_with_the_cluster(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A handler starts a process in a session of its own (setsid and a second fork): it lives in
    the container's PID namespace and dies with it, at `gpufaas rm` and at the cluster's stop."""
    cluster = docker_cluster(make_cluster)
    deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
    for ending in ("rm", "stop"):
        if ending == "stop":
            deploy(cluster, "rogue", "rogue_function", tmp_path, memory_mb=100)
        response = post(cluster, "rogue", detach=True)
        assert response.status_code == 200, response.text
        uid = package_user(cluster.state_dir / "node0", digest_of(cluster, "rogue"))
        detached = host_pid(uid, response.json()["detached"])
        assert detached is not None, "the detached child is not running"
        if ending == "rm":
            remove_function(cluster, "rogue")
        else:
            cluster.stop()
        assert gone_within(lambda: not pid_alive(detached)), f"the detached child outlived `{ending}`"  # noqa: B023
        assert wait_until_none(uid) == [], f"a process of the function's user outlived `{ending}`"
    assert containers("node0") == []


def test_a_container_worker_may_not_make_namespaces_mounts_keyrings_or_ptrace(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A handler tries unshare(CLONE_NEWUSER) and keyctl (the kernel allows any user both: a
    seccomp filter refuses them), unshare(CLONE_NEWNS) and a mount (no CAP_SYS_ADMIN), and
    ptrace on its worker and on a child of its own (same user: the kernel allows it) (fixture
    `docker_probe_function`). Each is refused: the engine's default seccomp profile and dropped
    capabilities, and inside them the worker's own filter (gpu_manager.seccomp, which alone
    refuses ptrace). The container's processes are all it can name (a PID namespace of its own, the
    worker its init), and its tmpfs mounts are nosuid, nodev, noexec."""
    cluster = docker_cluster(make_cluster)
    deploy(cluster, "probe", "docker_probe_function", tmp_path, memory_mb=100)
    report = call_ok(cluster, "probe")
    calls = report["calls"]
    print(f"system calls: {calls}; pids it sees: {report['visible_pids']}; mounts: {report['mounts']}")
    assert calls == dict.fromkeys(calls, "EPERM") and len(calls) == 6, calls
    assert report["pid"] == 1 and len(report["visible_pids"]) < 10, report["visible_pids"]
    for point in ("/tmp", "/dev/shm"):
        assert {"nosuid", "nodev", "noexec"} <= set(report["mounts"][point].split()[1].split(",")), report["mounts"]
    host = the_container(cluster, "probe").attrs["HostConfig"]
    assert host["PidMode"] in ("", "private") and not host["Privileged"]
    assert not [option for option in host["SecurityOpt"] if option.startswith("seccomp")]  # the engine's default
