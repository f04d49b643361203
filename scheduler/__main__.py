"""`python -m scheduler`: run the scheduler service against an etcd."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from gpufaas.credentials import wire_key
from gpufaas.keys import Keys
from gpufaas.metrics import MetricsServer
from gpufaas.service_main import (
    cluster_secret,
    configure_logging,
    etcd_credentials,
    open_store,
    run_daemon,
    run_until_signalled,
    start_metrics,
    warn_if_insecure,
)
from scheduler.service import SchedulerService
from scheduler.settings import DESCRIPTION, PROG, SchedulerSettings

if TYPE_CHECKING:
    from gpufaas.store import EtcdCredentials


async def serve(settings: SchedulerSettings, secret: str | None, etcd_creds: EtcdCredentials | None) -> None:
    """Run the scheduler with `settings` until SIGTERM or SIGINT."""
    store = await open_store(settings.etcd, etcd_creds)
    service = SchedulerService(
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
        gpu_idle_release_s=settings.gpu_idle_release_s,
        host_idle_release_s=settings.host_idle_release_s,
        prestage_nodes=settings.prestage_nodes,
        wire_key=wire_key(secret) if secret is not None else None,
    )
    metrics: list[MetricsServer] = []

    async def start() -> None:
        await service.start(settings.listen, advertise=settings.advertise)
        server = await start_metrics(service.metrics.registry, settings.metrics_listen, secret)
        metrics.extend([server] if server is not None else [])
        print(f"scheduler listening on {service.address}", flush=True)

    async def stop() -> None:
        for server in metrics:
            await server.close()
        await service.stop()
        await store.close()

    await run_until_signalled(start, stop)


def main(argv: list[str] | None = None) -> int:
    parser = SchedulerSettings.parser(PROG, DESCRIPTION)
    settings = SchedulerSettings.from_namespace(parser, parser.parse_args(argv))
    secret = cluster_secret(parser, settings)
    etcd_creds = etcd_credentials(parser, settings)
    configure_logging(settings.log_level)
    warn_if_insecure(settings, "the scheduler")
    return run_daemon(lambda: serve(settings, secret, etcd_creds), settings.etcd)


if __name__ == "__main__":
    sys.exit(main())
