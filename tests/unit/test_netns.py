"""The hosts harness's pure parts: names, addresses, the /24 it picks, faults as nft rules, relay messages."""

from __future__ import annotations

import ipaddress
import random
import struct

import pytest

from gpufaas.netns import (
    NFT_TABLE,
    Faults,
    NetnsError,
    host_ruleset,
    make_layout,
    networks_in,
    packet_ids,
    pick_network,
    queue_message,
    suffixes_in,
    verdict_message,
)

NET = ipaddress.IPv4Network("10.231.7.0/24")


def test_layout_gives_each_host_its_namespace_veth_and_address_and_the_bridge_dot_one() -> None:
    layout = make_layout("0a1b2c", NET, ["etcd", "node0", "node1"])
    assert layout.bridge == "gfns0a1b2c"
    assert layout.bridge_address == "10.231.7.1"
    assert [h.address for h in layout.hosts.values()] == ["10.231.7.2", "10.231.7.3", "10.231.7.4"]
    node1 = layout.host("node1")
    assert (node1.namespace, node1.veth, node1.peer) == ("gfns0a1b2c-node1", "gfns0a1b2cv2", "gfns0a1b2cp2")
    # Interface names fit IFNAMSIZ (15 bytes) even for the 200th host.
    last = make_layout("0a1b2c", NET, [f"h{i}" for i in range(200)]).host("h199")
    assert len(last.veth) <= 15 and last.address == "10.231.7.201"


@pytest.mark.parametrize(
    ("suffix", "names", "message"),
    [
        ("0a1b2c", ["a", "a"], "repeat"),
        ("0a1b2c", [], "between 1 and 200"),
        ("0a1b2c", ["Bad Name"], "lower-case"),
        ("xyz", ["a"], "hex digits"),
    ],
)
def test_layout_refuses_bad_names(suffix: str, names: list[str], message: str) -> None:
    with pytest.raises(NetnsError, match=message):
        make_layout(suffix, NET, names)


def test_an_unknown_host_is_named_with_the_known_ones() -> None:
    with pytest.raises(NetnsError, match="no host 'nope'; the hosts are a, b"):
        make_layout("0a1b2c", NET, ["a", "b"]).host("nope")


def test_the_picked_network_overlaps_nothing_in_use() -> None:
    ip_output = (
        "2: eth0    inet 10.231.0.5/16 brd 10.231.255.255 scope global eth0\n"  # covers 10.231.0-255... all of it
        "default via 172.17.0.1 dev eth0\n"
    )
    in_use = networks_in(ip_output)
    assert ipaddress.IPv4Network("10.231.0.0/16") in in_use
    with pytest.raises(NetnsError, match="in use"):
        pick_network(in_use, random.Random(1))
    taken = [ipaddress.IPv4Network(f"10.231.{x}.0/24") for x in range(256) if x != 42]
    assert pick_network(taken, random.Random(1)) == ipaddress.IPv4Network("10.231.42.0/24")
    # Different seeds spread parallel harnesses over the space.
    assert len({pick_network([], random.Random(seed)) for seed in range(20)}) > 10


def test_networks_in_reads_addresses_and_routes() -> None:
    text = "1: lo    inet 127.0.0.1/8 scope host lo\n10.231.9.0/24 dev gfns0a1b2c proto kernel src 10.231.9.1\n"
    assert set(networks_in(text)) >= {
        ipaddress.IPv4Network("127.0.0.0/8"),
        ipaddress.IPv4Network("10.231.9.0/24"),
        ipaddress.IPv4Network("10.231.9.1/32"),
    }


def test_suffixes_are_found_in_the_harness_names_only() -> None:
    names = [
        "lo",
        "eth0",
        "gfns0a1b2c",
        "gfns0a1b2cv3",
        "gfns0a1b2cp0@if5",
        "gfnsffeedd-node0",
        "gfnsnothex",
        "docker0",
    ]
    assert suffixes_in(names) == {"0a1b2c", "ffeedd"}


def test_cuts_heal_by_pair_by_host_or_all() -> None:
    faults = Faults().cut("a", "b").cut("c", "a", one_way=True).isolate("c").degrade("b", 50, 5)
    assert faults.cuts == {("a", "b"), ("b", "a"), ("c", "a")}
    assert faults.heal("b", "a").cuts == {("c", "a")}
    by_host = faults.heal("c")
    assert by_host.cuts == {("a", "b"), ("b", "a")} and not by_host.isolated and by_host.delay_ms == {"b": 50}
    assert faults.heal() == Faults()
    assert faults.degrade("b", 0, 0).delay_ms == {} and faults.degrade("b", 0, 0).loss_pct == {}
    with pytest.raises(NetnsError, match="itself"):
        Faults().cut("a", "a")
    with pytest.raises(NetnsError, match=r"within 0\.\.100"):
        Faults().degrade("a", 10, 150)


def test_a_hosts_rules_drop_what_its_faults_say_and_keep_loopback() -> None:
    layout = make_layout("0a1b2c", NET, ["a", "b", "c"])
    clean = host_ruleset("a", Faults(), layout)
    assert clean.startswith(f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n")
    assert "drop" not in clean
    faults = Faults().cut("a", "b").cut("a", "c", one_way=True)
    rules_a = host_ruleset("a", faults, layout)
    assert "ip daddr { 10.231.7.3, 10.231.7.4 } drop" in rules_a
    # The one-way cut a -> c leaves c's rules alone; the two-way a <-> b puts one in b's.
    assert "drop" not in host_ruleset("c", faults, layout)
    assert "ip daddr { 10.231.7.2 } drop" in host_ruleset("b", faults, layout)
    isolated = host_ruleset("b", Faults().isolate("b"), layout)
    assert isolated.index('oifname "lo" accept') < isolated.index("    drop")
    assert isolated.count("    drop") == 2  # output and input
    assert "numgen random mod 10000 < 250 drop" in host_ruleset("c", Faults().degrade("c", 0, 2.5), layout)


def test_relay_messages_round_trip() -> None:
    verdict = verdict_message(7, 1234)
    length, kind, flags = struct.unpack_from("=IHH", verdict)
    assert length == len(verdict) == 16 + 4 + 12 and kind == (3 << 8) | 1 and flags == 1
    assert struct.unpack_from("!H", verdict, 18)[0] == 7  # the queue, big-endian
    assert struct.unpack_from("!II", verdict, 24) == (1, 1234)  # NF_ACCEPT, the packet id
    # Two packet messages and an unrelated one in a datagram: both ids, in order.
    header = struct.pack("!IHB", 99, 0x0800, 3) + b"\0"  # id, protocol, hook, padding

    def packet(packet_id: int) -> bytes:
        return queue_message(0, 7, struct.pack("=HH", 4 + 7, 1) + struct.pack("!IHB", packet_id, 0x0800, 3) + b"\0")

    datagram = packet(5) + queue_message(2, 7, struct.pack("=HH", 4 + 7, 1) + header) + packet(6)
    assert packet_ids(datagram) == [5, 6]
    assert packet_ids(b"") == [] and packet_ids(b"\0" * 16) == []
