"""`python -m scheduler`: run the scheduler service against an etcd."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from gpufaas.credentials import wire_key
from gpufaas.keys import Keys
from gpufaas.service_main import daemon_start, open_store, run_daemon, serve_wire_daemon, warn_if_insecure
from scheduler.service import SchedulerService
from scheduler.settings import DESCRIPTION, PROG, SchedulerSettings

if TYPE_CHECKING:
    from gpufaas.store import EtcdCredentials, Store
    from gpufaas.tls import LinkTls


def make_service(
    settings: SchedulerSettings,
    secret: str | None,
    store: Store,
    *,
    tls: LinkTls | bool = True,
    in_process: bool = False,
) -> SchedulerService:
    """The scheduler service `settings` describe, on `store` (`tls`, `in_process`: as
    SchedulerService takes them)."""
    return SchedulerService(
        store,
        keys=Keys(settings.root),
        policy=settings.policy,
        policy_config=settings.policy_config,
        eviction=settings.eviction,
        adaptive_slots=settings.adaptive_slots,
        utilization_threshold=settings.utilization_threshold,
        queue_capacity=settings.queue_capacity,
        slots=settings.slot_config,
        claim_s=settings.claim_s,
        hit_lease_s=settings.hit_lease_s,
        gpu_idle_release_s=settings.gpu_idle_release_s,
        host_idle_release_s=settings.host_idle_release_s,
        prestage_nodes=settings.prestage_nodes,
        wire_key=wire_key(secret) if secret is not None else None,
        name=settings.name,
        lease_ttl_s=settings.lease_ttl_s,
        tls=tls,
        in_process=in_process,
    )


async def serve(settings: SchedulerSettings, secret: str | None, etcd_creds: EtcdCredentials | None) -> None:
    """Run the scheduler with `settings` until SIGTERM or SIGINT."""
    store = await open_store(settings.etcd, etcd_creds)
    await serve_wire_daemon(make_service(settings, secret, store), store, settings, secret, "scheduler")


def main(argv: list[str] | None = None) -> int:
    _, settings, secret, etcd_creds = daemon_start(SchedulerSettings, PROG, DESCRIPTION, argv)
    warn_if_insecure(settings, "the scheduler")
    return run_daemon(lambda: serve(settings, secret, etcd_creds), settings.etcd)


if __name__ == "__main__":
    sys.exit(main())
