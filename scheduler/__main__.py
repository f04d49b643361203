"""`python -m scheduler`: run the scheduler service against an etcd."""

from __future__ import annotations

import argparse
import sys

from cache_manager import EvictionPolicy
from gpufaas.credentials import wire_key
from gpufaas.keys import Keys
from gpufaas.metrics import MetricsServer
from gpufaas.service_main import (
    add_common_flags,
    add_metrics_flag,
    cluster_secret,
    configure_logging,
    etcd_credentials,
    open_store,
    run_daemon,
    run_until_signalled,
    start_metrics,
    warn_if_insecure,
)
from scheduler.policies import registered_policies
from scheduler.service import DEFAULT_PRESTAGE_NODES, MAX_CLAIM_S, SchedulerService, SlotConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description="gpufaas scheduler service")
    add_common_flags(parser)
    add_metrics_flag(parser)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="address to bind (default %(default)s)")
    parser.add_argument("--advertise", default=None, help="address gateways dial (default: the listen address)")
    parser.add_argument("--policy", default="lalb-o3", choices=registered_policies())
    parser.add_argument("--o3-limit", type=int, default=25, help="lalb-o3: max skips per request")
    parser.add_argument(
        "--eviction",
        default="lru",
        choices=sorted(EvictionPolicy.registry),
        help="which models a miss evicts from a GPU: lru (the paper's), heaviness (Torpor's) or tinylfu "
        "(the least used lately; docs/policies.md) (default %(default)s)",
    )
    parser.add_argument("--queue-capacity", type=int, default=10_000, help="calls waiting before 429")
    parser.add_argument(
        "--slots",
        default="4",
        help="concurrent calls per GPU: N, or N,GPU_TYPE=M,... per GPU type (default %(default)s)",
    )
    parser.add_argument(
        "--claim-s", type=float, default=5.0, help="a placement not used within this long is checked with its node"
    )
    parser.add_argument(
        "--gpu-idle-release-s",
        type=float,
        default=None,
        help="staged exit: a model unused on a GPU this long leaves it, for its node's host tier where "
        "the node keeps one (default: never)",
    )
    parser.add_argument(
        "--host-idle-release-s",
        type=float,
        default=None,
        help="staged exit: a model in a node's host tier unused this long leaves it too (default: never)",
    )
    parser.add_argument(
        "--prestage-nodes",
        type=int,
        default=DEFAULT_PRESTAGE_NODES,
        help="nodes that get a new function's package (and weights) before its first call; 0: none "
        "(default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.prestage_nodes < 0:
        parser.error("--prestage-nodes must be >= 0")
    for flag, value in (
        ("--gpu-idle-release-s", args.gpu_idle_release_s),
        ("--host-idle-release-s", args.host_idle_release_s),
    ):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be a number of seconds > 0 (leave it out to keep models until evicted)")
    if args.o3_limit < 0 or args.queue_capacity <= 0 or not 0 < args.claim_s <= MAX_CLAIM_S:
        parser.error(f"--o3-limit must be >= 0, --queue-capacity > 0 and --claim-s in (0, {MAX_CLAIM_S:g}]")
    try:
        slots = SlotConfig.parse(args.slots)
    except ValueError as exc:
        parser.error(str(exc))
    secret = cluster_secret(parser, args)
    etcd_creds = etcd_credentials(parser, args)
    configure_logging(args.log_level)
    warn_if_insecure(args, "the scheduler")

    async def run() -> None:
        store = await open_store(args.etcd, etcd_creds)
        service = SchedulerService(
            store,
            keys=Keys(args.root),
            policy=args.policy,
            max_num_skips=args.o3_limit,
            eviction=args.eviction,
            queue_capacity=args.queue_capacity,
            slots=slots,
            claim_s=args.claim_s,
            gpu_idle_release_s=args.gpu_idle_release_s,
            host_idle_release_s=args.host_idle_release_s,
            prestage_nodes=args.prestage_nodes,
            wire_key=wire_key(secret) if secret is not None else None,
        )

        metrics: list[MetricsServer] = []

        async def start() -> None:
            await service.start(args.listen, advertise=args.advertise)
            server = await start_metrics(service.metrics.registry, args.metrics_listen, secret)
            metrics.extend([server] if server is not None else [])
            print(f"scheduler listening on {service.address}", flush=True)

        async def stop() -> None:
            for server in metrics:
                await server.close()
            await service.stop()
            await store.close()

        await run_until_signalled(start, stop)

    return run_daemon(run, args.etcd)


if __name__ == "__main__":
    sys.exit(main())
