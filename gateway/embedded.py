"""`python -m gateway --with-scheduler --with-node`: a scheduler and a node run in the gateway's
process, which the gateway reaches in memory (gpufaas.wire_local): the scheduler while it leads,
the node always; the embedded scheduler reaches the embedded node in memory too.

What it saves: a placement's Place and Placement, and a call's Execute, its answer and its Done,
cross no socket, no TLS record and no second process's event loop; the scheduler and the node are
the same services with the same election, fencing and grants, and the rest of the cluster (other
gateways, nodes, schedulers) reaches them over the wire as it reaches any. What it costs: the
gateway process also holds the scheduler's grant key and the node's worker control (docs/security.md),
and a gateway that dies takes them with it: a standby scheduler, if any, takes over; the node's
workers exit with it, so its models load again when it comes back.

The gateway package depends on the scheduler and the node here only, and only at run time: they
are imported inside these functions (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpufaas.service_main import (
    cluster_secret,
    etcd_credentials,
    link_tls,
    open_store,
    state_dir_held,
    wire_daemon_running,
)
from gpufaas.settings import DaemonSettings, SettingsError

_ROLE_FLAGS = {"scheduler": "--with-scheduler", "node": "--with-node"}

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings
    from gpu_manager.__main__ import Hardware
    from gpu_manager.settings import NodeSettings
    from gpufaas.store import EtcdCredentials
    from gpufaas.tls import LinkTls
    from scheduler.settings import SchedulerSettings


@dataclass(frozen=True)
class EmbeddedScheduler:
    """The scheduler's settings and credentials, checked at start; `run()` serves it."""

    settings: SchedulerSettings
    secret: str | None
    etcd_credentials: EtcdCredentials | None
    tls: LinkTls | bool  # the scheduler role's links, False: plain (this process's are the gateway's)

    @classmethod
    def from_flags(
        cls, parser: argparse.ArgumentParser, gateway: GatewaySettings, flags: list[str]
    ) -> EmbeddedScheduler:
        """The scheduler `flags` describe, with the gateway's etcd, credentials, TLS and logging
        flags where they say nothing of those; a usage error (through `parser`) where the
        scheduler would refuse them."""
        from scheduler.settings import SchedulerSettings

        try:
            settings = SchedulerSettings(**_shared(gateway)).with_flags(flags)
        except (SettingsError, ValueError) as exc:
            parser.error(f"the scheduler's flags (after `-- scheduler`): {exc}")
        tls = link_tls(parser, settings, "scheduler")
        return cls(settings, cluster_secret(parser, settings), etcd_credentials(parser, settings), tls or False)

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """The scheduler started (its own etcd handle, listener and metrics, offered in memory to
        this process's dialers) for the body; stopped after it."""
        from scheduler.__main__ import make_service

        store = await open_store(self.settings.etcd, self.etcd_credentials)
        try:
            service = make_service(self.settings, self.secret, store, tls=self.tls, in_process=True)
            async with wire_daemon_running(service, self.settings, self.secret, "scheduler"):
                yield
        finally:
            await store.close()


@dataclass(frozen=True)
class EmbeddedNode:
    """A node's settings, hardware and credentials, checked at start; `run()` serves it.

    What stays the process's: logging (the gateway's `--log-level`) and every TLS link but the
    node's wire server (its blob server and client and its etcd client show the gateway's
    certificate, which every blob link takes: gpufaas.tls.PEERS); the node's TLS flags say which
    certificate its wire server shows."""

    settings: NodeSettings
    machine: Hardware
    secret: str | None
    etcd_credentials: EtcdCredentials | None
    tls: LinkTls | bool  # the node role's wire server, False: plain (this process's are the gateway's)

    @classmethod
    def from_flags(cls, parser: argparse.ArgumentParser, gateway: GatewaySettings, flags: list[str]) -> EmbeddedNode:
        """The node `flags` describe (`python -m gpu_manager`'s), with the gateway's etcd,
        credentials, TLS and logging flags where they say nothing of those; a usage error (through
        `parser`) where the node would refuse them."""
        from gpu_manager.__main__ import hardware
        from gpu_manager.settings import NodeSettings

        try:
            # (constructed unchecked: the node's required flags come with `flags`, checked there)
            settings = NodeSettings.model_construct(**_shared(gateway)).with_flags(flags)
        except (SettingsError, ValueError) as exc:
            parser.error(f"the node's flags (after `-- node`): {exc}")
        if settings.state_dir.resolve() == gateway.state_dir.resolve():
            # Both keep blobs in its blobs/: the node's cache collects every blob its own packages
            # do not use, and the packages uploaded to the gateway would go with them.
            parser.error(
                f"the node's --state-dir {settings.state_dir} is the gateway's: give the node a directory of its own"
            )
        tls = link_tls(parser, settings, "node")
        secret = cluster_secret(parser, settings)
        return cls(settings, hardware(parser, settings), secret, etcd_credentials(parser, settings), tls or False)

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """The node started (its own etcd handle, wire server, blob server and metrics, offered
        in memory to this process's dialers) for the body; stopped, its workers with it, after."""
        from gpu_manager.__main__ import daemon

        store = await open_store(self.settings.etcd, self.etcd_credentials)
        try:
            with state_dir_held(self.settings.state_dir, "node", f"node {self.settings.node}"):
                node = daemon(store, self.settings, self.machine, self.secret, tls=self.tls, in_process=True)
                async with wire_daemon_running(node, self.settings, self.secret, f"gpu manager {self.settings.node}"):
                    yield
        finally:
            await store.close()


def _shared(gateway: GatewaySettings) -> dict[str, Any]:
    """The gateway's daemon flags that were given (etcd, credentials, TLS, logging): an embedded
    service's defaults."""
    return {name: getattr(gateway, name) for name in DaemonSettings.model_fields if name in gateway.model_fields_set}


def split_argv(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(the gateway's flags, each embedded service's by role): every `--` opens a section named by
    its first word, `scheduler` or `node` (`-- scheduler --slots 2 -- node --gpus 2`); a first
    section that opens with a flag is the scheduler's (`--with-scheduler -- --slots 2`), and an
    empty one is none. ValueError for a section named twice or by another word."""
    if "--" not in argv:
        return argv, {}
    at = argv.index("--")
    chunks: list[list[str]] = [[]]
    for word in argv[at + 1 :]:
        if word == "--":
            chunks.append([])
        else:
            chunks[-1].append(word)
    sections: dict[str, list[str]] = {}
    for index, chunk in enumerate(chunks):
        if not chunk:
            continue  # a `--` with nothing after it (a trailing one) says nothing
        if chunk[0] in _ROLE_FLAGS:
            role, flags = chunk[0], chunk[1:]
        elif index == 0 and chunk[0].startswith("-"):
            role, flags = "scheduler", chunk
        else:
            raise ValueError(
                f"`-- {' '.join(chunk[:1])}`: each `--` opens the flags of `scheduler` or `node` "
                "(`-- scheduler --slots 2 -- node --gpus 2`)"
            )
        if role in sections:
            raise ValueError(f"the {role}'s flags are given twice: one `-- {role}` section each")
        sections[role] = flags
    return argv[:at], sections


def embedded_flags_error(sections: dict[str, list[str]], with_flags: dict[str, bool]) -> str | None:
    """What is wrong with giving a section for a service not asked to run here (None: nothing)."""
    for role in sections:
        if not with_flags[role]:
            also = ", or put a node's after `-- node`" if role == "scheduler" else ""
            return (
                f"the flags after `-- {role}` (or a first `--`) are a {role}'s: pass {_ROLE_FLAGS[role]} to run "
                f"one in this process{also}"
            )
    return None
