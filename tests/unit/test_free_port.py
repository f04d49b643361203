"""free_port: ports for daemons to listen on, outside the range outgoing connections draw from."""

from __future__ import annotations

import socket

import pytest

from gpufaas.dev import etcd_server
from gpufaas.dev.etcd_server import _ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _ = _ephemeral_range()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        for taken in range(low - 1, low - 500, -1):  # a port of the candidates that nobody holds yet
            try:
                held.bind(("127.0.0.1", taken))
                break
            except OSError:
                continue
        held.listen()

        def taken_first(ports: list[int]) -> None:  # the held port is the first candidate tried
            ports.sort(key=lambda port: port != taken)

        monkeypatch.setattr(etcd_server.random, "shuffle", taken_first)
        assert free_port() != taken
