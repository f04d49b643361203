"""The load balancer in front of a local cluster's gateways: HAProxy's configuration, written from
the gateways' addresses, and the command that runs it in the foreground (stopped by PID)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufaas.errors import GpufaasError

# Answered by HAProxy itself (its liveness, for the cluster's watchdog), never by a gateway.
BALANCER_HEALTH_PATH = "/balancer/livez"
# What the balancer asks each gateway: alive and serving (its event loop answers), not the
# gateway's readiness (/healthz), which also needs the scheduler: during a leader change every
# gateway loses the scheduler at once, and a check on it would take them all out together, so
# HAProxy itself would answer 503; a live gateway instead holds its calls while it relinks
# (gateway.router's SCHEDULER_WAIT_S) and answers each one itself.
GATEWAY_CHECK_PATH = "/livez"
HAPROXY_PATHS = ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")


class BalancerUnavailable(GpufaasError):
    """HAProxy is not installed; the message says how to install it."""


@dataclass(frozen=True, slots=True)
class BalancerConfig:
    """Round robin over `gateways` (name -> HOST:PORT), each checked with GET /livez
    (`GATEWAY_CHECK_PATH`: the gateway process serves) every `check_interval_ms`: out after
    `fall` failed checks, back after `rise` good ones. A call whose
    connection to a gateway cannot be made (the gateway is gone) is sent to another (`retries`,
    redispatch); a call a gateway already took is never sent twice (an invocation is not
    idempotent), so a killed gateway fails at most the calls it was serving. Each call, and each
    upload, gets a new connection to its gateway (server-close): none is sent on an idle one a dead
    gateway left.

    Uploads (/system/blobs..., /system/packages) go by the client's address to one gateway, the
    same while it is up: a deploy asks which blobs a gateway lacks, sends them, then registers
    the package with them, and each step must find the blobs of the one before."""

    listen: str  # HOST:PORT the balancer binds
    gateways: Mapping[str, str]
    check_interval_ms: int = 500
    fall: int = 2
    rise: int = 1
    retries: int = 3
    # Also the pause before a retry (HAProxy waits min(this, 1 s)): a call that found its gateway
    # gone waits this long for another; a gateway on this host accepts in well under it.
    connect_timeout_ms: int = 250
    # A call may wait long for a model to load; the gateway's own deadlines end it first.
    call_timeout_s: int = 900
    # A DNS server (HOST:PORT) that names the gateways, asked again while the balancer runs: a
    # gateway container restarted with another address is followed (compose's: 127.0.0.11:53).
    # None: the names are resolved once, at start (addresses on this host).
    resolver: str | None = None

    def render(self) -> str:
        """haproxy.cfg's text."""
        gateways = sorted(self.gateways.items())
        dns = "" if self.resolver is None else " resolvers dns init-addr last,libc,none"
        checked = "\n".join(f"    server {name} {address} check{dns}" for name, address in gateways)
        # The same gateways, up or down as the checks above say (not checked twice).
        tracking = "\n".join(f"    server {name} {address} track gateways/{name}{dns}" for name, address in gateways)
        resolvers = ""
        if self.resolver is not None:
            resolvers = f"\nresolvers dns\n    nameserver dns {self.resolver}\n    hold valid 1s\n"
        return f"""\
# Written by gpufaas.dev.balancer (BalancerConfig.render): the gateways behind one address.
global
    log stdout format raw local0
    maxconn 4096  # two descriptors a call: within a default 20000-descriptor limit

defaults
    mode http
    log global
    option httplog
    option dontlog-normal  # only the calls that failed or were retried
    option forwardfor
    timeout connect {self.connect_timeout_ms}ms
    timeout client {self.call_timeout_s}s
    timeout server {self.call_timeout_s}s
    timeout http-keep-alive 60s
    retries {self.retries}
    retry-on conn-failure  # only where the gateway never got the call
    option redispatch 1
{resolvers}
frontend gateways
    bind {self.listen}
    monitor-uri {BALANCER_HEALTH_PATH}
    acl upload path_beg /system/blobs /system/packages
    use_backend uploads if upload
    default_backend gateways

backend gateways
    balance roundrobin
    # A connection to a gateway per call, closed after its answer: a call is never sent on an idle
    # connection that a gateway closed as it died (HAProxy would answer it 502 itself, and could not
    # retry it: it was sent); a dead gateway's refused connect is retried on another (retry-on).
    option http-server-close
    option httpchk GET {GATEWAY_CHECK_PATH}
    http-check expect status 200
    default-server inter {self.check_interval_ms}ms fall {self.fall} rise {self.rise}
{checked}

backend uploads
    balance source  # one client's upload steps reach one gateway
    hash-type consistent  # and stay there when another gateway leaves or comes back
    option http-server-close  # as the gateways backend: no upload sent on a dead gateway's idle connection
{tracking}
"""


def haproxy_binary() -> str:
    """The haproxy executable (BalancerUnavailable saying how to install it if there is none)."""
    found = shutil.which("haproxy") or next((path for path in HAPROXY_PATHS if Path(path).is_file()), None)
    if found is None:
        raise BalancerUnavailable(
            "several gateways need HAProxy in front of them: install it (apt-get install haproxy) "
            "or start one gateway (--gateways 1)"
        )
    return found


def balancer_argv(config_path: Path) -> list[str]:
    """HAProxy in the foreground (-db: no daemon, so its PID is the one to stop) on `config_path`."""
    return [haproxy_binary(), "-db", "-f", str(config_path)]
