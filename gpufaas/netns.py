"""Hosts that are really apart: each one a Linux network namespace on a bridge, with link faults."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import os
import random
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from gpufaas.errors import GpufaasError
from gpufaas.processes import pid_alive

# Every name the harness makes starts with PREFIX and a harness's own suffix (6 hex digits):
# bridge "gfns1a2b3c", veth "gfns1a2b3cv0" (its peer inside the host is "eth0"), namespace
# "gfns1a2b3c-node0". Interface names have 15 bytes at most (IFNAMSIZ - 1).
PREFIX = "gfns"
SUFFIX_LEN = 6
MAX_HOSTS = 200  # addresses .2 to .201 of the /24; the bridge (the root namespace) has .1
SUBNET_BASE = "10.231"  # 10.231.X.0/24, X picked free; private space that is rarely in use
OWNERS_DIR = Path("/run/gpufaas-netns")  # one file per live harness: its suffix -> its owner's PID
NFT_TABLE = "gpufaas_netns"  # the fault table inside each host's namespace
DELAY_QUEUE = 7  # the NFQUEUE number a host's delay relay reads (each namespace has its own queues)
_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")


class NetnsError(GpufaasError):
    """A namespace, link or rule could not be made or changed; the message has the command and its stderr."""


class NetnsUnavailable(NetnsError):
    """This machine cannot make namespaces here (not root, no iproute2, a sandbox refusing it);
    tests skip with this message, under CI they fail."""


# --- the layout (pure) ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostLayout:
    name: str  # as the caller named it ("etcd", "node0")
    namespace: str  # the `ip netns` name
    veth: str  # the bridge's end, in the root namespace
    peer: str  # the host's end before it moves into the namespace (then renamed "eth0")
    address: str  # the host's IPv4 address on the bridge


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every name and address one harness uses, decided before anything is made."""

    suffix: str
    network: ipaddress.IPv4Network
    hosts: Mapping[str, HostLayout]

    @property
    def bridge(self) -> str:
        return PREFIX + self.suffix

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the bridge (the tests, the user's CLI)."""
        return str(self.network.network_address + 1)

    def host(self, name: str) -> HostLayout:
        try:
            return self.hosts[name]
        except KeyError:
            raise NetnsError(f"no host {name!r}; the hosts are {', '.join(self.hosts)}") from None


def make_layout(suffix: str, network: ipaddress.IPv4Network, names: Sequence[str]) -> Layout:
    """Names and addresses for hosts `names` (in order: .2, .3, ...) on `network`, a /24.
    Raises NetnsError on a bad, repeated or surplus host name."""
    if not re.fullmatch(rf"[0-9a-f]{{{SUFFIX_LEN}}}", suffix):
        raise NetnsError(f"suffix must be {SUFFIX_LEN} hex digits, not {suffix!r}")
    if network.prefixlen != 24:
        raise NetnsError(f"the hosts' network must be a /24, not {network}")
    if len(set(names)) != len(names):
        raise NetnsError(f"host names repeat: {list(names)}")
    if not 1 <= len(names) <= MAX_HOSTS:
        raise NetnsError(f"between 1 and {MAX_HOSTS} hosts, not {len(names)}")
    hosts: dict[str, HostLayout] = {}
    for index, name in enumerate(names):
        if not _HOST_NAME.match(name):
            raise NetnsError(f"host name {name!r}: lower-case letters, digits, '-' and '_', 31 at most")
        hosts[name] = HostLayout(
            name=name,
            namespace=f"{PREFIX}{suffix}-{name}",
            veth=f"{PREFIX}{suffix}v{index}",
            peer=f"{PREFIX}{suffix}p{index}",
            address=str(network.network_address + 2 + index),
        )
    return Layout(suffix, network, hosts)


def pick_network(in_use: Iterable[ipaddress.IPv4Network], rng: random.Random) -> ipaddress.IPv4Network:
    """A 10.231.X.0/24 that overlaps none of `in_use` (the machine's addresses and routes, other
    harnesses' bridges), X at random so parallel harnesses rarely try the same one first."""
    used = list(in_use)
    candidates = [ipaddress.IPv4Network(f"{SUBNET_BASE}.{x}.0/24") for x in range(256)]
    free = [net for net in candidates if not any(net.overlaps(other) for other in used)]
    if not free:
        raise NetnsError(f"every {SUBNET_BASE}.X.0/24 is in use on this machine")
    return rng.choice(free)


def networks_in(ip_output: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks named in `ip -4 -o addr show` or `ip -4 route show` output."""
    found = []
    for match in re.finditer(r"(?<![\d.])(\d+\.\d+\.\d+\.\d+)(/\d+)?(?![\d.])", ip_output):
        with contextlib.suppress(ValueError):
            found.append(ipaddress.IPv4Network(match.group(1) + (match.group(2) or "/32"), strict=False))
    return found


def suffixes_in(names: Iterable[str]) -> set[str]:
    """The harness suffixes among interface or namespace names (others' names ignored)."""
    pattern = re.compile(rf"^{PREFIX}([0-9a-f]{{{SUFFIX_LEN}}})(?:$|[vp]\d+(?:@|$)|-)")
    return {m.group(1) for name in names if (m := pattern.match(name))}


# --- faults (pure) ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Faults:
    """What is wrong with the network now. `cuts` holds (source, destination) pairs whose packets
    are dropped (a two-way cut is both pairs); an isolated host sends and receives nothing but on
    its loopback; `loss_pct` and `delay_ms` apply to what a host sends."""

    cuts: frozenset[tuple[str, str]] = frozenset()
    isolated: frozenset[str] = frozenset()
    loss_pct: Mapping[str, float] = dataclasses.field(default_factory=dict)
    delay_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def cut(self, a: str, b: str, *, one_way: bool = False) -> Faults:
        """Packets a -> b dropped, and b -> a too unless `one_way`."""
        if a == b:
            raise NetnsError(f"cannot cut {a!r} from itself")
        added = {(a, b)} if one_way else {(a, b), (b, a)}
        return dataclasses.replace(self, cuts=self.cuts | added)

    def isolate(self, host: str) -> Faults:
        return dataclasses.replace(self, isolated=self.isolated | {host})

    def degrade(self, host: str, delay_ms: float, loss_pct: float) -> Faults:
        if delay_ms < 0 or not 0 <= loss_pct <= 100:
            raise NetnsError(f"delay must be >= 0 ms and loss within 0..100 %, not {delay_ms} ms, {loss_pct} %")
        delays = {h: ms for h, ms in self.delay_ms.items() if h != host} | ({host: delay_ms} if delay_ms else {})
        losses = {h: pct for h, pct in self.loss_pct.items() if h != host} | ({host: loss_pct} if loss_pct else {})
        return dataclasses.replace(self, delay_ms=delays, loss_pct=losses)

    def heal(self, *hosts: str) -> Faults:
        """No host: every fault gone. One: its isolation, its delay and loss, every cut touching
        it. Two: the cut between them (both directions)."""
        if not hosts:
            return Faults()
        if len(hosts) == 1:
            (host,) = hosts
            return Faults(
                cuts=frozenset(pair for pair in self.cuts if host not in pair),
                isolated=self.isolated - {host},
                loss_pct={h: pct for h, pct in self.loss_pct.items() if h != host},
                delay_ms={h: ms for h, ms in self.delay_ms.items() if h != host},
            )
        if len(hosts) == 2:
            a, b = hosts
            return dataclasses.replace(self, cuts=self.cuts - {(a, b), (b, a)})
        raise NetnsError(f"heal() takes no host, one, or a pair, not {len(hosts)}")


def host_ruleset(host: str, faults: Faults, layout: Layout) -> str:
    """The nft script that makes `host`'s namespace drop what `faults` say it sends or receives;
    replaces the harness's table atomically (create, delete, create). Loopback always passes: a
    host keeps talking to itself."""
    output = ['oifname "lo" accept']
    input_ = ['iifname "lo" accept']
    if host in faults.isolated:
        output.append("drop")
        input_.append("drop")
    blocked = sorted(layout.host(dst).address for src, dst in faults.cuts if src == host)
    if blocked:
        output.append(f"ip daddr {{ {', '.join(blocked)} }} drop")
    loss = faults.loss_pct.get(host, 0.0)
    if loss > 0:
        # numgen draws 0..9999: loss in hundredths of a percent.
        output.append(f"numgen random mod 10000 < {round(loss * 100)} drop")
    lines = [f"table inet {NFT_TABLE}", f"delete table inet {NFT_TABLE}", f"table inet {NFT_TABLE} {{"]
    for chain, hook, rules in (("output", "output", output), ("input", "input", input_)):
        lines.append(f"  chain {chain} {{")
        lines.append(f"    type filter hook {hook} priority 0; policy accept;")
        lines.extend(f"    {rule}" for rule in rules)
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- commands ---------------------------------------------------------------------------------


def _check(argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = 20.0) -> str:
    """Run a command; its stdout, or NetnsError with the command and its stderr."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise NetnsUnavailable(f"{argv[0]} not found: install iproute2 and nftables (apt-get install ...)") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)} did not finish in {timeout_s:g} s") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed (status {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _in(namespace: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def check_available() -> None:
    """Raises NetnsUnavailable saying why this process cannot make hosts (None: it can)."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root: run as root or skip")
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"no `{tool}` on PATH: apt-get install {package}")


def netem_available(namespace: str, device: str) -> bool:
    """Whether the kernel has sch_netem (tried on `device` in `namespace`, then removed)."""
    try:
        _check(_in(namespace, ["tc", "qdisc", "add", "dev", device, "root", "netem", "delay", "1ms"]))
    except NetnsError:
        return False
    _check(_in(namespace, ["tc", "qdisc", "del", "dev", device, "root"]))
    return True


def _owner_alive(suffix: str) -> bool:
    try:
        pid = int((OWNERS_DIR / suffix).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    return pid_alive(pid)


def _kill_pids(pids: Iterable[int], timeout_s: float = 5.0) -> None:
    """SIGTERM each PID, then SIGKILL what is left after `timeout_s`."""
    pids = [pid for pid in pids if pid_alive(pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _namespace_pids(namespace: str) -> list[int]:
    try:
        return [int(pid) for pid in _check(["ip", "netns", "pids", namespace]).split()]
    except NetnsError:
        return []  # already gone


def _namespaces() -> list[str]:
    # `ip netns list` prints "NAME (id: N)" for a namespace with an id.
    return [line.split()[0] for line in _check(["ip", "netns", "list"]).splitlines() if line.strip()]


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0] for line in _check(["ip", "-o", "link", "show"]).splitlines()]


def remove_leftovers() -> list[str]:
    """Delete what harnesses that died left (namespaces, their processes, veths, bridges with
    PREFIX whose owner PID is gone); a live harness's are kept. Returns the suffixes removed."""
    names = _namespaces() + _links()
    dead = sorted(suffix for suffix in suffixes_in(names) if not _owner_alive(suffix))
    for suffix in dead:
        _remove(suffix, [name for name in _namespaces() if name.startswith(PREFIX + suffix + "-")])
    return dead


def _remove(suffix: str, namespaces: Iterable[str]) -> None:
    """Kill what runs in `namespaces` (by PID), delete them, then this suffix's veths and bridge."""
    for namespace in namespaces:
        _kill_pids(_namespace_pids(namespace))
        with contextlib.suppress(NetnsError):
            _check(["ip", "netns", "del", namespace])
    for link in _links():
        if link.startswith(PREFIX + suffix):
            with contextlib.suppress(NetnsError):  # a veth goes with its peer's namespace
                _check(["ip", "link", "del", link])
    with contextlib.suppress(FileNotFoundError):
        (OWNERS_DIR / suffix).unlink()


# --- the harness --------------------------------------------------------------------------------


class Hosts(contextlib.AbstractContextManager["Hosts"]):  # its __enter__ returns self
    """Named hosts, each a network namespace with its own address on a private bridge; the root
    namespace reaches every one at `address(host)` through the bridge's address.

        with Hosts(["etcd", "node0", "node1"]) as hosts:
            hosts.run("etcd", ["etcd", f"--listen-client-urls=http://{hosts.address('etcd')}:2379", ...])
            hosts.isolate("node0"); ...; hosts.heal()

    Processes started by `run` get their own session; `close()` signals them (and anything else
    still in a namespace) by PID, then deletes the namespaces, veths and bridge. Faults are nft
    rules inside the hosts' namespaces and go with them. Not thread-safe: one caller at a time.
    """

    def __init__(self, names: Sequence[str], *, rng: random.Random | None = None) -> None:
        check_available()
        OWNERS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        rng = rng or random.Random(secrets.randbits(64))
        self._processes: list[subprocess.Popen[Any]] = []
        self._relays: dict[str, subprocess.Popen[bytes]] = {}  # host -> its delay relay (no netem)
        self._faults = Faults()
        self._closed = False
        # The lock keeps two harnesses starting at once from picking the same /24 or removing
        # each other's half-made hosts.
        with open(OWNERS_DIR / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            remove_leftovers()
            in_use = networks_in(_check(["ip", "-4", "-o", "addr", "show"]) + _check(["ip", "-4", "route", "show"]))
            self.layout = make_layout(secrets.token_hex(SUFFIX_LEN // 2), pick_network(in_use, rng), names)
            (OWNERS_DIR / self.layout.suffix).write_text(f"{os.getpid()}\n")
            try:
                self._create()
            except BaseException:
                self.close()
                raise
        try:
            self._netem = netem_available(self.namespace(names[0]), "eth0")
        except BaseException:  # no caller holds these hosts to close, and their owner lives on
            self.close()
            raise

    def _create(self) -> None:
        layout = self.layout
        try:
            _check(["ip", "link", "add", "name", layout.bridge, "type", "bridge"])
        except NetnsError as exc:
            raise NetnsUnavailable(f"cannot make a bridge here: {exc}") from exc
        _check(["ip", "addr", "add", f"{layout.bridge_address}/24", "dev", layout.bridge])
        _check(["ip", "link", "set", layout.bridge, "up"])
        for host in layout.hosts.values():
            try:
                _check(["ip", "netns", "add", host.namespace])
            except NetnsError as exc:
                raise NetnsUnavailable(f"`ip netns add` is refused here: {exc}") from exc
            _check(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", host.peer])
            _check(["ip", "link", "set", host.veth, "master", layout.bridge, "up"])
            _check(["ip", "link", "set", host.peer, "netns", host.namespace])
            _check(["ip", "-n", host.namespace, "link", "set", host.peer, "name", "eth0"])
            _check(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0"])
            _check(["ip", "-n", host.namespace, "link", "set", "eth0", "up"])
            _check(["ip", "-n", host.namespace, "link", "set", "lo", "up"])

    # --- what callers use ---------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.layout.hosts)

    @property
    def bridge_address(self) -> str:
        return self.layout.bridge_address

    def address(self, host: str) -> str:
        return self.layout.host(host).address

    def namespace(self, host: str) -> str:
        return self.layout.host(host).namespace

    @property
    def faults(self) -> Faults:
        return self._faults

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` as run inside `host` (`ip netns exec`: it execs argv, so the PID is argv's)."""
        return _in(self.namespace(host), argv)

    def run(self, host: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`, in a session of its own (so `close()` can signal its
        process group); stopped by `close()` if still running."""
        self._check_open()
        popen_kwargs.setdefault("start_new_session", True)
        process: subprocess.Popen[Any] = subprocess.Popen(self.command(host, argv), **popen_kwargs)
        self._processes.append(process)
        return process

    def check_output(self, host: str, argv: Sequence[str], *, timeout_s: float = 20.0) -> str:
        """Run `argv` inside `host` to the end; its stdout (NetnsError if it fails)."""
        return _check(self.command(host, argv), timeout_s=timeout_s)

    def delay(self, host: str, ms: float, loss_pct: float = 0.0) -> None:
        """Delay everything `host` sends by `ms` and drop `loss_pct` percent of it (0, 0: off).
        Loss by nft; delay by netem on the host's eth0, or where the kernel has no sch_netem, by a
        relay process that holds each packet in an NFQUEUE for `ms`."""
        self._check_open()
        self._faults = self._faults.degrade(self.layout.host(host).name, ms, loss_pct)
        self._apply([host])
        namespace = self.namespace(host)
        if not self._netem:
            self._set_relay(host, ms)
        elif ms:
            _check(_in(namespace, ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"]))
        else:
            _delete_qdisc(namespace)

    def cut(self, a: str, b: str, *, one_way: bool = False) -> None:
        """Drop packets a -> b, and b -> a unless `one_way`; only that link, not either host's others."""
        self._check_open()
        self._faults = self._faults.cut(self.layout.host(a).name, self.layout.host(b).name, one_way=one_way)
        self._apply([a, b])

    def isolate(self, host: str) -> None:
        """`host` sends and receives nothing (but on its loopback): to other hosts and the root
        namespace it is gone, its connections time out."""
        self._check_open()
        self._faults = self._faults.isolate(self.layout.host(host).name)
        self._apply([host])

    def heal(self, *hosts: str) -> None:
        """No host: every fault gone. One: its isolation, delay, loss and cuts. Two: their cut."""
        self._check_open()
        for host in hosts:
            self.layout.host(host)
        before = self._faults
        self._faults = before.heal(*hosts)
        touched = set(hosts) if hosts else set(self.layout.hosts)
        touched |= {src for src, _ in before.cuts - self._faults.cuts}
        self._apply(sorted(touched))
        for host in sorted(touched):
            if before.delay_ms.get(host) and not self._faults.delay_ms.get(host):
                if self._netem:
                    _delete_qdisc(self.namespace(host))
                else:
                    self._set_relay(host, 0)

    def close(self) -> None:
        """Stop every process started here and whatever else runs in the hosts (by PID), delete
        the namespaces (their rules with them), veths and bridge. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        groups = [p.pid for p in [*self._processes, *self._relays.values()] if p.poll() is None]
        for pid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for process in [*self._processes, *self._relays.values()]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        _remove(self.layout.suffix, [host.namespace for host in self.layout.hosts.values()])

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # --- inside ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError("these hosts are closed")

    def _apply(self, hosts: Iterable[str]) -> None:
        for host in hosts:
            _check(_in(self.namespace(host), ["nft", "-f", "-"]), stdin=host_ruleset(host, self._faults, self.layout))

    def _set_relay(self, host: str, ms: float) -> None:
        """Without netem: (re)start `host`'s delay relay for `ms`, or stop it (0)."""
        namespace = self.namespace(host)
        old = self._relays.pop(host, None)
        if old is not None:
            with contextlib.suppress(NetnsError):
                _check(_in(namespace, _queue_rule("-D")))
            _stop(old)
        if not ms:
            return
        relay = subprocess.Popen(
            _in(namespace, [sys.executable, "-m", "gpufaas.netns", "delay-relay", str(DELAY_QUEUE), str(ms)]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._relays[host] = relay
        assert relay.stdout is not None
        ready = relay.stdout.readline()  # "bound" once it listens: no packet finds the queue unread
        if ready.strip() != b"bound":
            _stop(relay)
            del self._relays[host]
            raise NetnsError(f"the delay relay in {host} did not start (netem is missing; NFQUEUE too?)")
        _check(_in(namespace, _queue_rule("-A")))


def _queue_rule(action: str) -> list[str]:
    # --queue-bypass: if the relay is gone, packets pass instead of being dropped.
    return ["iptables", "-t", "mangle", action, "OUTPUT", "!", "-o", "lo", "-j", "NFQUEUE",
            "--queue-num", str(DELAY_QUEUE), "--queue-bypass"]  # fmt: skip


def _delete_qdisc(namespace: str) -> None:
    with contextlib.suppress(NetnsError):  # none there: nothing to delete
        _check(_in(namespace, ["tc", "qdisc", "del", "dev", "eth0", "root"]))


def _stop(process: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


# --- the delay relay (where the kernel has no sch_netem) ----------------------------------------
# nfnetlink_queue over a raw netlink socket: bind a queue, take each packet's id (metadata only:
# the packet stays in the kernel), and accept it `delay_s` after it arrived. A constant delay
# keeps the order, so a FIFO is the whole schedule.

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_VERDICT, _NFQNL_MSG_CONFIG = 0, 1, 2
_NFQA_CFG_CMD, _NFQA_CFG_PARAMS, _NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
_NFQNL_CFG_CMD_BIND = 1
_NFQNL_COPY_META = 1
_NFQA_PACKET_HDR, _NFQA_VERDICT_HDR = 1, 2
_NF_ACCEPT = 1
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_QUEUE_MAXLEN = 65536


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def queue_message(kind: int, queue: int, attributes: bytes, *, seq: int = 0, ack: bool = False) -> bytes:
    """One nfnetlink_queue message (`kind`: config or verdict) for queue `queue`."""
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attributes
    flags = _NLM_F_REQUEST | (_NLM_F_ACK if ack else 0)
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def verdict_message(queue: int, packet_id: int) -> bytes:
    return queue_message(
        _NFQNL_MSG_VERDICT, queue, _attribute(_NFQA_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, packet_id))
    )


def packet_ids(datagram: bytes) -> list[int]:
    """The packet ids in a datagram of netlink messages (errors and other messages skipped)."""
    ids = []
    offset = 0
    while offset + 16 <= len(datagram):
        length, kind = struct.unpack_from("=IH", datagram, offset)
        if length < 16:
            break
        if kind == (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET:
            at = offset + 20  # past nlmsghdr and nfgenmsg
            while at + 4 <= offset + length:
                attr_len, attr_kind = struct.unpack_from("=HH", datagram, at)
                if attr_len < 4:
                    break
                if attr_kind & 0x7FFF == _NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", datagram, at + 4)[0])
                at += attr_len + (-attr_len % 4)
        offset += length + (-length % 4)
    return ids


def _bind_queue(queue: int) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    config = [
        _attribute(_NFQA_CFG_CMD, struct.pack("!BBH", _NFQNL_CFG_CMD_BIND, 0, 0)),
        _attribute(_NFQA_CFG_PARAMS, struct.pack("!IB", 0, _NFQNL_COPY_META)),
        _attribute(_NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", _QUEUE_MAXLEN)),
    ]
    for seq, attribute in enumerate(config, 1):
        sock.send(queue_message(_NFQNL_MSG_CONFIG, queue, attribute, seq=seq, ack=True))
        answer = sock.recv(65536)
        if struct.unpack_from("=H", answer, 4)[0] == _NLMSG_ERROR:
            errno = -struct.unpack_from("=i", answer, 16)[0]
            if errno:
                raise OSError(errno, f"nfnetlink_queue config {seq} refused: {os.strerror(errno)}")
    return sock


def delay_relay(queue: int, delay_s: float) -> None:
    """Accept each packet of NFQUEUE `queue` `delay_s` after it arrived, until killed. Prints
    "bound" on stdout once the queue is bound."""
    sock = _bind_queue(queue)
    print("bound", flush=True)
    held: deque[tuple[float, int]] = deque()  # (when to accept, packet id), oldest first
    while True:
        timeout_s = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([sock], [], [], timeout_s)
        if readable:
            arrived = time.monotonic()
            for packet_id in packet_ids(sock.recv(1 << 20)):
                held.append((arrived + delay_s, packet_id))
        now = time.monotonic()
        while held and held[0][0] <= now:
            sock.send(verdict_message(queue, held.popleft()[1]))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gpufaas.netns delay-relay QUEUE MS` (what `Hosts.delay` runs inside a host)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "delay-relay":
        print("usage: python -m gpufaas.netns delay-relay QUEUE MS", file=sys.stderr)
        return 2
    delay_relay(int(args[1]), float(args[2]) / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
