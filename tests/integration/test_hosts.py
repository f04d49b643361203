"""Hosts that are really apart: the netns harness alone, then a whole cluster with a daemon per host."""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gpufaas import netns, wire
from gpufaas.dev.host_cluster import HostCluster, host_names
from gpufaas.netns import OWNERS_DIR, PREFIX, Hosts, NetnsUnavailable
from gpufaas.processes import pid_alive
from gpufaas.proto import gpufaas_pb2 as pb
from tests.integration.conftest import deploy

pytestmark = pytest.mark.integration

HostsFactory = Callable[[list[str]], Hosts]


@pytest.fixture
def make_hosts() -> Iterator[HostsFactory]:
    """Harnesses closed at the end and checked gone; where namespaces cannot be made the test
    skips saying why, but under CI=true it fails."""
    made: list[Hosts] = []

    def factory(names: list[str]) -> Hosts:
        try:
            hosts = Hosts(names)
        except NetnsUnavailable as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true and the hosts harness cannot run: {exc}")
            pytest.skip(f"no network namespaces here: {exc}")
        made.append(hosts)
        return hosts

    try:
        yield factory
    finally:
        for hosts in made:
            hosts.close()
            assert not leftovers(hosts.layout.suffix), leftovers(hosts.layout.suffix)


def leftovers(suffix: str) -> list[str]:
    """This harness's namespaces and links that still exist."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    names += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout.split()
    return [name for name in names if name.startswith(PREFIX + suffix)]


def test_without_root_the_harness_says_why(make_hosts: HostsFactory) -> None:
    """What a test sees where namespaces cannot be made: NetnsUnavailable, saying to run as root."""
    make_hosts(["probe"])  # skips (or fails under CI) where even root cannot make them
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv (util-linux) to drop to another user")
    script = (
        "from gpufaas.netns import Hosts, NetnsUnavailable\n"
        "try:\n    Hosts(['a'])\nexcept NetnsUnavailable as exc:\n    print(exc)\n"
    )
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", script]
    repository = Path(__file__).parents[2]
    done = subprocess.run(as_nobody, check=False, capture_output=True, text=True, timeout=60, cwd=repository)
    assert done.stdout.strip() == "network namespaces need root: run as root or skip", done.stderr


def test_a_harness_failing_after_its_hosts_were_made_removes_them(
    make_hosts: HostsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its constructor fails past `_create` (its netem probe: `tc` timing out, a Ctrl-C): no
    caller holds it to close, and its owner (this process) lives on, so nothing else would remove
    its namespaces, veths and bridge."""
    make_hosts(["probe"])  # skips (or fails under CI) where namespaces cannot be made
    probed: list[str] = []

    def netem_fails(namespace: str, device: str) -> bool:
        probed.append(namespace)
        raise netns.NetnsError("tc qdisc add dev eth0 root netem delay 1ms did not finish in 20 s")

    monkeypatch.setattr(netns, "netem_available", netem_fails)
    with pytest.raises(netns.NetnsError, match="did not finish"):
        Hosts(["a", "b"])
    suffix = probed[0][len(PREFIX) : len(PREFIX) + netns.SUFFIX_LEN]
    try:
        assert leftovers(suffix) == [] and not (OWNERS_DIR / suffix).exists()
    finally:
        netns._remove(suffix, [f"{PREFIX}{suffix}-a", f"{PREFIX}{suffix}-b"])  # what the failure left, if any


def test_a_harness_whose_process_died_is_removed_by_the_next(make_hosts: HostsFactory) -> None:
    make_hosts(["probe"])  # skips (or fails under CI) where namespaces cannot be made
    script = (
        "import sys, time\nfrom gpufaas.netns import Hosts\n"
        "hosts = Hosts(['x', 'y'])\nhosts.run('x', ['sleep', '300'])\n"
        "print(hosts.layout.suffix, flush=True)\ntime.sleep(300)\n"
    )
    crashing = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2]
    )
    assert crashing.stdout is not None
    suffix = crashing.stdout.readline().strip()
    try:
        assert len(leftovers(suffix)) >= 4, leftovers(suffix)  # 2 namespaces, 2 veths, the bridge
        sleeper = int(subprocess.run(["ip", "netns", "pids", f"{PREFIX}{suffix}-x"], capture_output=True, text=True,
                                     check=True).stdout.split()[0])  # fmt: skip
    finally:
        crashing.kill()  # SIGKILL: no close()
        crashing.wait()
    assert leftovers(suffix) and pid_alive(sleeper)
    make_hosts(["next"])
    assert leftovers(suffix) == []
    assert not pid_alive(sleeper)  # what ran in its hosts was stopped too
    assert not (OWNERS_DIR / suffix).exists()


# A TCP echo server on (HOST, PORT), and a client that prints "ok MS" (connect, one byte there and
# back) or "fail ERROR" within its timeout: run inside the hosts.
ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
def echo(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""
ECHO_CLIENT = """
import socket, sys, time
start = time.monotonic()
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
    print("ok", (time.monotonic() - start) * 1000)
except OSError as exc:
    print("fail", type(exc).__name__, exc)
"""
PORT = 7000
LOOPBACK_PORT = 7001


def probe(hosts: Hosts, source: str | None, target: str, *, port: int = PORT, timeout_s: float = 1.0) -> str:
    """ "ok MS" or "fail ERROR" for a connection from `source` (None: the root namespace) to `target`,
    an address or a host's name."""
    address = target if target[0].isdigit() else hosts.address(target)
    argv = [sys.executable, "-c", ECHO_CLIENT, address, str(port), str(timeout_s)]
    if source is None:
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    return hosts.check_output(source, argv, timeout_s=30).strip()


def rtt_ms(hosts: Hosts, source: str | None, target: str, count: int = 5) -> float:
    """The median of `count` connect-and-echo times (two round trips each)."""
    times = []
    for _ in range(count):
        answer = probe(hosts, source, target)
        assert answer.startswith("ok"), answer
        times.append(float(answer.split()[1]))
    return statistics.median(times)


def start_echo_servers(hosts: Hosts) -> None:
    """An echo server on every host's address, and one on the first host's 127.0.0.1."""
    for name in hosts.names:
        hosts.run(name, [sys.executable, "-c", ECHO_SERVER, "0.0.0.0", str(PORT)])
    hosts.run(hosts.names[0], [sys.executable, "-c", ECHO_SERVER, "127.0.0.1", str(LOOPBACK_PORT)])
    deadline = time.monotonic() + 20
    for name in hosts.names:
        while not probe(hosts, None, name).startswith("ok"):
            assert time.monotonic() < deadline, f"the echo server in {name} did not start"
            time.sleep(0.1)


def test_hosts_are_apart_and_their_links_fail_and_heal(make_hosts: HostsFactory) -> None:
    started = time.monotonic()
    hosts = make_hosts(["a", "b", "c"])
    made_s = time.monotonic() - started
    start_echo_servers(hosts)
    names = hosts.names
    addresses = {hosts.address(name) for name in names}
    assert len(addresses) == 3 and hosts.bridge_address not in addresses

    # Each host reaches every other by address; the root namespace reaches all.
    source: str | None  # a host's name, None for the root namespace
    for source in names:
        for target in names:
            assert probe(hosts, source, target).startswith("ok"), (source, target)
    # A service on a's 127.0.0.1 (only a has one) is a's alone: not at a's address, not at
    # 127.0.0.1 as the others see it.
    assert probe(hosts, "a", "127.0.0.1", port=LOOPBACK_PORT).startswith("ok")
    for source in ("b", "c", None):
        assert probe(hosts, source, "a", port=LOOPBACK_PORT).startswith("fail ConnectionRefused"), source
        assert probe(hosts, source, "127.0.0.1", port=LOOPBACK_PORT).startswith("fail ConnectionRefused"), source

    # 50 ms on what b sends: a connect-and-echo (two round trips) to b takes 100 ms more.
    before_ms = rtt_ms(hosts, "a", "b")
    hosts.delay("b", 50)
    delayed_ms = rtt_ms(hosts, "a", "b")
    other_ms = rtt_ms(hosts, "a", "c")
    hosts.delay("b", 0)
    after_ms = rtt_ms(hosts, "a", "b")
    print(f"\nhosts made in {made_s:.2f} s; a->b {before_ms:.2f} ms, with 50 ms on b {delayed_ms:.1f} ms, "
          f"a->c meanwhile {other_ms:.2f} ms, b undelayed {after_ms:.2f} ms")  # fmt: skip
    assert 95 <= delayed_ms - before_ms <= 160, (before_ms, delayed_ms)
    # The others are not slowed (a shared, busy machine gives some noise: less than the delay).
    assert other_ms < delayed_ms - 60 and after_ms < delayed_ms - 60, (other_ms, after_ms)

    # Cut a <-> b: only that link.
    hosts.cut("a", "b")
    assert probe(hosts, "a", "b").startswith("fail TimeoutError")
    assert probe(hosts, "b", "a").startswith("fail TimeoutError")
    assert probe(hosts, "a", "c").startswith("ok") and probe(hosts, "c", "b").startswith("ok")
    hosts.heal("a", "b")
    assert probe(hosts, "a", "b").startswith("ok") and probe(hosts, "b", "a").startswith("ok")

    # One way, a -> c: a's packets to c vanish, so no connection either way (c's SYN-ACK or
    # answers to a do not come back), but c still reaches everyone else.
    hosts.cut("a", "c", one_way=True)
    assert probe(hosts, "a", "c").startswith("fail TimeoutError")
    assert probe(hosts, "c", "b").startswith("ok")
    assert hosts.faults.cuts == {("a", "c")}
    hosts.heal()

    # Isolate c: nobody reaches it, it reaches nobody, it still reaches itself.
    hosts.isolate("c")
    for source in ("a", "b", None):
        assert probe(hosts, source, "c").startswith("fail TimeoutError"), source
    assert probe(hosts, "c", "a").startswith("fail TimeoutError")
    assert probe(hosts, "c", "c").startswith("ok")  # its own address: by its loopback
    assert probe(hosts, "a", "b").startswith("ok")
    hosts.heal("c")
    for source in ("a", "b", None):
        assert probe(hosts, source, "c").startswith("ok"), source

    suffix = hosts.layout.suffix
    assert leftovers(suffix)
    hosts.close()
    hosts.close()  # twice is fine
    assert leftovers(suffix) == []


# --- a wire connection to a host that vanishes ---------------------------------------------------

# A wire server on (HOST, PORT) that takes requests and never answers them: what a peer looks like
# from the other end once its host is cut off after the request was delivered.
SILENT_WIRE_SERVER = """
import asyncio, sys
from gpufaas import wire
class Silent:
    def on_frame(self, conn, frame): pass
    def on_close(self, conn, exc): pass
async def main():
    server = wire.Server(Silent)
    await server.start(f"{sys.argv[1]}:{sys.argv[2]}")
    print("listening", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def _wire_cases_after_isolation(
    hosts: Hosts, host: str, dead_after_s: float | None, timeout_s: float
) -> dict[str, float | None]:
    """For three connections to `host`'s silent wire server (an idle one, one whose request was
    delivered and waits for its answer, one whose request is sent after the cut), the seconds from
    isolating `host` until each is lost (None: still open after `timeout_s`)."""
    address = f"{hosts.address(host)}:{PORT}"
    idle, awaiting, sending = [await wire.connect(address, dead_after_s=dead_after_s) for _ in range(3)]
    delivered = asyncio.create_task(awaiting.request(wire.MessageType.CLUSTER, pb.ClusterRequest()))
    await asyncio.sleep(0.5)  # delivered and acknowledged: nothing left unacknowledged
    hosts.isolate(host)
    isolated_at = time.monotonic()
    sent = asyncio.create_task(sending.request(wire.MessageType.CLUSTER, pb.ClusterRequest()))
    lost: dict[str, float | None] = {}

    async def until_lost(name: str, conn: wire.Connection, request: asyncio.Task[wire.Frame] | None) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                if request is not None:
                    with pytest.raises(wire.ConnectionLost):
                        await request
                await asyncio.shield(conn.closed)
            lost[name] = time.monotonic() - isolated_at
        except TimeoutError:
            lost[name] = None

    await asyncio.gather(
        until_lost("idle", idle, None),
        until_lost("awaiting", awaiting, delivered),
        until_lost("sending", sending, sent),
    )
    for conn in (idle, awaiting, sending):
        conn.close()
    for task in (delivered, sent):
        task.cancel()
    return lost


def test_a_wire_connection_to_a_vanished_host_is_lost_within_dead_after_s(make_hosts: HostsFactory) -> None:
    """Packets to the host dropped, no reset: with the wire's keepalive options (DEAD_AFTER_S) an
    idle connection, one awaiting an answer and one sending are all lost within a few seconds;
    without them (the kernel's defaults: keepalive off, retransmissions for about 15 minutes) the
    same connections stay open."""
    hosts = make_hosts(["peer"])
    server = hosts.run("peer", [sys.executable, "-c", SILENT_WIRE_SERVER, "0.0.0.0", str(PORT)],
                       stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])  # fmt: skip
    assert server.stdout is not None and server.stdout.readline() == b"listening\n"

    async def both() -> tuple[dict[str, float | None], dict[str, float | None]]:
        without = asyncio.create_task(_wire_cases_after_isolation(hosts, "peer", None, wire.DEAD_AFTER_S + 5))
        await asyncio.sleep(0)  # the two sets of connections are made before the one isolation
        with_options = await _wire_cases_after_isolation(hosts, "peer", wire.DEAD_AFTER_S, wire.DEAD_AFTER_S + 5)
        return with_options, await without

    with_options, without = asyncio.run(both())
    print(
        f"\nisolated peer, lost after (s): with dead_after_s={wire.DEAD_AFTER_S:g}: {with_options}; without: {without}"
    )
    for case, lost_s in with_options.items():
        assert lost_s is not None and lost_s < wire.DEAD_AFTER_S + 2, (case, with_options)
    assert without == {"idle": None, "awaiting": None, "sending": None}, without


# --- a whole cluster, a daemon per host ------------------------------------------------------------

IN_FLIGHT_ID = "in-flight"
IN_FLIGHT_SLEEP_S = 2.0
# The node's 3 s lease, then the gateway's and the scheduler's word on the call; slack for 2 busy cores.
IN_FLIGHT_ANSWERED_S = 8.0


def call_in_flight(cluster: HostCluster) -> tuple[str, str, float]:
    """Call sleepy-a for IN_FLIGHT_SLEEP_S as IN_FLIGHT_ID: its status (or "timeout" after the
    client's 60 s), the GPU that answered (or the error's text), and when (monotonic seconds)."""
    payload: dict[str, object] = {"sleep_s": IN_FLIGHT_SLEEP_S, "call_id": IN_FLIGHT_ID}  # it prints sleepy-ran ID
    with httpx.Client() as client:
        try:
            response = cluster.call("sleepy-a", client, timeout_s=60, payload=payload, call_id=IN_FLIGHT_ID)
        except httpx.TimeoutException:
            return "timeout", "", time.monotonic()
    what = response.headers.get("X-Gpu", "") if response.status_code == 200 else response.text
    return str(response.status_code), what, time.monotonic()


def test_a_cluster_with_a_daemon_per_host_serves_and_survives_an_isolated_node(
    make_hosts: HostsFactory, tmp_path: Path
) -> None:
    nodes = ["node0", "node1"]
    hosts = make_hosts(host_names(nodes))
    cluster = HostCluster(hosts, tmp_path, nodes)
    try:
        started = time.monotonic()
        cluster.start()
        print(f"\ncluster up on {hosts.layout.network} in {time.monotonic() - started:.1f} s")
        # Two functions, each filling a GPU (800 of its 1000 MB): one lands on each node. sleepy-a
        # sleeps as long as its payload's sleep_s says (none for {"x": 1}).
        functions = ["sleepy-a", "echo-b"]
        deploy(cluster, "sleepy-a", "sleepy_function", tmp_path)  # type: ignore[arg-type]
        deploy(cluster, "echo-b", "echo_function", tmp_path)  # type: ignore[arg-type]
        with httpx.Client() as client:
            served: dict[str, set[str]] = {}
            for _ in range(3):
                for function in functions:
                    response = cluster.call(function, client)
                    assert response.status_code == 200, response.text
                    served.setdefault(function, set()).add(response.headers["X-Gpu"].split("/")[0])
            on_nodes = set().union(*served.values())
            assert on_nodes == set(nodes), served

            # Isolate the node serving sleepy-a while a call runs there: the call runs on there, cut
            # off (the node is not dead), so it is not run again elsewhere (at most once): it is
            # answered 502 "outcome unknown" once the node's lease expires; calls to both functions
            # go on on the other node.
            victim = next(iter(served["sleepy-a"]))
            survivor = next(node for node in nodes if node != victim)
            watcher = ThreadPoolExecutor(2)  # the call in flight, and when the victim leaves the gateway's view
            in_flight = watcher.submit(call_in_flight, cluster)
            started = time.monotonic()
            # Started there: in the scheduler's view, or (a call under a hit lease, which the scheduler
            # learns of from its Done) by the handler's own line in the node's log.
            while IN_FLIGHT_ID not in cluster.running_on(
                victim
            ) and f"sleepy-ran {IN_FLIGHT_ID}" not in cluster.log_text(victim):
                assert time.monotonic() - started < 10 and not in_flight.done(), "the call did not start on the victim"
                time.sleep(0.05)
            hosts.isolate(victim)
            isolated_at = time.monotonic()
            gone = watcher.submit(cluster.wait_for_gpus, {survivor}, 90)
            rounds: list[str] = []  # what each round of calls got, for the figures
            while True:
                answers = []
                for function in functions:
                    sent_s = time.monotonic()
                    try:
                        answers.append(cluster.call(function, client, timeout_s=60))
                        got = str(answers[-1].status_code)
                    except httpx.TimeoutException:
                        got = "timeout"
                    rounds.append(
                        f"{function} at {sent_s - isolated_at:.1f} s: {got} in {time.monotonic() - sent_s:.1f} s"
                    )
                if len(answers) == len(functions) and all(answer.status_code == 200 for answer in answers):
                    break
                assert time.monotonic() - isolated_at < 120, rounds
            recovered_s = time.monotonic() - isolated_at
            assert {a.headers["X-Gpu"].split("/")[0] for a in answers} == {survivor}
            in_flight_got, in_flight_error, answered_at = in_flight.result()
            in_flight_s = answered_at - isolated_at
            # The gateway closed its connection to the node when its key went (Router.node_left)
            # and the scheduler, which lost the node too, could not ask it whether it started the
            # call (its ledger): 502, its outcome unknown, and never run on the survivor.
            assert in_flight_got == "502" and "is unknown" in in_flight_error, (in_flight_got, in_flight_error)
            assert in_flight_s < IN_FLIGHT_ANSWERED_S, in_flight_s
            assert f"sleepy-ran {IN_FLIGHT_ID}" not in cluster.log_text(survivor), "it ran again on the survivor"
            gone_s = gone.result()
            watcher.shutdown()
            for _ in range(5):
                for function in functions:
                    answer = cluster.call(function, client)
                    assert answer.status_code == 200 and answer.headers["X-Gpu"].startswith(survivor + "/")

            # Heal: the node comes back with its GPUs.
            hosts.heal(victim)
            back_s = cluster.wait_for_gpus(set(nodes), timeout_s=150)
            assert cluster.call("sleepy-a", client).status_code == 200
        print(
            f"{victim} isolated: the call running there ({IN_FLIGHT_SLEEP_S:g} s) answered 502 (outcome unknown, "
            f"not run again) after {in_flight_s:.1f} s; calls to both functions succeed again after "
            f"{recovered_s:.1f} s "
            f"({'; '.join(rounds)}); its GPUs gone from the gateway's view after {gone_s:.1f} s; "
            f"healed: back in {back_s:.1f} s"
        )
    finally:
        cluster.close()
