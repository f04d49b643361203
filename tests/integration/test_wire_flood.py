"""A node's wire port against peers that never authenticate, on a real cluster: what they cost the
node's memory before the handshake, and that a proper client still gets in (gpufaas.wire;
docs/security.md)."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from pathlib import Path

import httpx
import pytest

from gpufaas import wire
from gpufaas.dev.local_cluster import LocalCluster
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.wire import MessageType, connect
from tests.integration.conftest import ClusterFactory, deploy
from tests.integration.test_security import node_addresses

pytestmark = pytest.mark.integration

PEERS = 30
ANNOUNCED_BYTES = 16 * 1024 * 1024  # under the node's frame limit (16 MiB payloads + 1 MiB)
RSS_GROWTH_LIMIT_KB = 4 * 1024
SETTLE_S = 1.0
CLOSE_WAIT_S = 3.0


def rss_kb(pid: int) -> int:
    """The process's resident set (VmRSS, KiB) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_raw(address: str, count: int, first: bytes = b"") -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=5)
        if first:
            sock.sendall(first)
        sockets.append(sock)
    return sockets


def closed_by_peer(sock: socket.socket, wait_s: float) -> tuple[bool, bytes]:
    """(whether the node closed `sock` within `wait_s`, what it sent before: its Hello or nothing)."""
    received = b""
    sock.settimeout(0.1)
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, received
        if not chunk:
            return True, received
        received += chunk
    return False, received


def call_ok(cluster: LocalCluster) -> None:
    response = httpx.post(
        f"{cluster.gateway_url}/function/echo", json={"x": 1}, headers=cluster.invoke_headers, timeout=60
    )
    assert response.status_code == 200, response.text


async def proper_client(address: str, key: bytes | None) -> None:
    """A client holding the cluster's key gets in, and the node answers its request (a call
    without a valid grant: the node's ledger refuses it, which is an answer)."""
    conn = await connect(address, key=key, timeout_s=5)
    answer = await conn.request(MessageType.EXECUTE, pb.Execute(token=b"not a grant"), b"{}", timeout_s=5)
    assert answer.message(pb.ExecuteReply).outcome == pb.REFUSED
    await conn.aclose()


def test_peers_that_never_authenticate_cost_the_node_almost_nothing_and_are_capped(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    # Plain links: what a peer costs before the key handshake, and the Hello that tells a peer
    # under the cap from one over it (under TLS a peer's first bytes go to the TLS handshake).
    cluster = make_cluster(nodes=1, gpus_per_node=1, backend="cpu", gpu_memory_mb=1000, tls=False)
    deploy(cluster, "echo", "echo_function", tmp_path, memory_mb=100)
    call_ok(cluster)
    (address,) = node_addresses(cluster)
    node_pid = cluster.pids()["node0"]
    time.sleep(SETTLE_S)
    before_kb = rss_kb(node_pid)

    announcing = open_raw(address, PEERS, struct.pack("!I", ANNOUNCED_BYTES))
    silent = open_raw(address, PEERS)
    time.sleep(SETTLE_S)
    after_kb = rss_kb(node_pid)
    print(f"node VmRSS {before_kb} KiB -> {after_kb} KiB with {PEERS} announcing and {PEERS} silent peers")
    assert after_kb - before_kb < RSS_GROWTH_LIMIT_KB, (before_kb, after_kb)

    # A frame announced before the handshake is over its cap: each such peer is cut off at once.
    assert all(closed_by_peer(sock, CLOSE_WAIT_S)[0] for sock in announcing)
    # The silent ones wait in the handshake (under the cap), and a proper client still gets in.
    asyncio.run(proper_client(address, cluster.wire_key))
    call_ok(cluster)

    # Past the cap on peers in the handshake, more are closed unread (no Hello); the first are not.
    extra = open_raw(address, wire.MAX_UNAUTHENTICATED - PEERS + 10)
    outcomes = [closed_by_peer(sock, 0.5) for sock in extra]
    refused = [closed and not hello for closed, hello in outcomes]
    assert refused[-10:] == [True] * 10 and not any(refused[: -10 - 1]), refused
    for sock in [*announcing, *silent, *extra]:
        sock.close()
    call_ok(cluster)  # the scheduler's and gateway's connections were authenticated: unaffected
    asyncio.run(proper_client(address, cluster.wire_key))
