"""`python -m gateway --with-scheduler`: a scheduler run in the gateway's process, which the gateway
reaches in memory (gpufaas.wire_local) while it leads.

What it saves: a placement's Place and Placement cross no socket, no TLS record and no second
process's event loop; the scheduler is the same service with the same election, and the nodes and
any other gateway reach it over the wire as they reach any scheduler. What it costs: the gateway
process also holds the scheduler's grant key and signs grants (docs/security.md), and a gateway
that dies takes its scheduler with it (a standby, if any, takes over as after any leader's death).

The gateway package depends on the scheduler here only, and only at run time: `scheduler` is
imported inside these functions (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpufaas.service_main import cluster_secret, etcd_credentials, link_tls, open_store, wire_daemon_running
from gpufaas.settings import DaemonSettings, SettingsError

if TYPE_CHECKING:
    from gateway.router import LocalScheduler
    from gateway.settings import GatewaySettings
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

        shared = {
            name: getattr(gateway, name) for name in DaemonSettings.model_fields if name in gateway.model_fields_set
        }
        try:
            settings = SchedulerSettings(**shared).with_flags(flags)
        except (SettingsError, ValueError) as exc:
            parser.error(f"the scheduler's flags (after `--`): {exc}")
        tls = link_tls(parser, settings, "scheduler")
        return cls(settings, cluster_secret(parser, settings), etcd_credentials(parser, settings), tls or False)

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[LocalScheduler]:
        """The scheduler started (its own etcd handle, listener and metrics) for the body; stopped
        after it."""
        from scheduler.__main__ import make_service

        store = await open_store(self.settings.etcd, self.etcd_credentials)
        try:
            service = make_service(self.settings, self.secret, store, tls=self.tls)
            async with wire_daemon_running(service, self.settings, self.secret, "scheduler"):
                yield service
        finally:
            await store.close()
