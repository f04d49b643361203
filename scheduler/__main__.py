"""`python -m scheduler`: run the scheduler service against an etcd."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

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
from scheduler.adaptive_slots import DEFAULT_THRESHOLD
from scheduler.policies import PolicyConfig, registered_policies
from scheduler.service import DEFAULT_PRESTAGE_NODES, MAX_CLAIM_S, SchedulerService, SlotConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description="gpufaas scheduler service")
    add_common_flags(parser)
    add_metrics_flag(parser)
    parser.add_argument("--listen", default="127.0.0.1:50051", help="address to bind (default %(default)s)")
    parser.add_argument("--advertise", default=None, help="address gateways dial (default: the listen address)")
    parser.add_argument("--policy", default="lalb-o3", choices=registered_policies())
    defaults = PolicyConfig()
    parser.add_argument(
        "--o3-limit",
        type=int,
        default=defaults.max_num_skips,
        help="lalb-o3 and mqfq-sticky: how often a request may be passed over (%(default)s)",
    )
    parser.add_argument(
        "--mqfq-overrun-s",
        type=float,
        default=defaults.mqfq_overrun_s,
        help="mqfq-sticky: T, seconds of service a flow may run ahead before it is throttled (%(default)s)",
    )
    parser.add_argument(
        "--mqfq-ttl-alpha",
        type=float,
        default=defaults.mqfq_ttl_alpha,
        help="mqfq-sticky: a flow's keep-alive, in mean inter-arrival times (%(default)s)",
    )
    parser.add_argument(
        "--mqfq-swap-out",
        action="store_true",
        help="mqfq-sticky: move a flow's model to its node's host tier once the flow is past its keep-alive",
    )
    parser.add_argument(
        "--torpor-alpha",
        type=float,
        default=defaults.torpor_alpha,
        help="torpor: the share of the required request count the high-priority group starts with (%(default)s)",
    )
    parser.add_argument(
        "--torpor-alpha-period-s",
        type=float,
        default=None,
        help="torpor: retune alpha this often by Torpor's Algorithm 2 (default: alpha fixed)",
    )
    parser.add_argument(
        "--no-interference-aware-loads",
        dest="interference_aware_loads",
        action="store_false",
        help="misses no longer prefer a GPU whose shared host link (PCIe switch) carries no other load "
        "(Torpor's interference-aware placement; in effect where nodes report shared links)",
    )
    parser.add_argument(
        "--adaptive-slots",
        type=int,
        default=None,
        metavar="MAX",
        help="adaptive D (MQFQ-Sticky's): each GPU's concurrent calls move between 1 and MAX from its "
        "utilization every 200 ms, starting at --slots (default: D fixed)",
    )
    parser.add_argument(
        "--utilization-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="adaptive D: above this share of time busy a GPU's D steps down, below it up (%(default)s)",
    )
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
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, SlotConfig]:
    """The flags, checked: anything wrong is `parser.error`."""
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
    if args.mqfq_overrun_s < 0 or args.mqfq_ttl_alpha < 0 or not 0 <= args.torpor_alpha <= 1:
        parser.error("--mqfq-overrun-s and --mqfq-ttl-alpha must be >= 0 and --torpor-alpha in [0, 1]")
    if args.adaptive_slots is not None and args.adaptive_slots < 1:
        parser.error("--adaptive-slots must be >= 1 (leave it out to keep D fixed)")
    if not 0 < args.utilization_threshold <= 1:
        parser.error("--utilization-threshold must be in (0, 1]")
    if args.torpor_alpha_period_s is not None and not args.torpor_alpha_period_s > 0:
        parser.error("--torpor-alpha-period-s must be > 0 seconds (leave it out to keep alpha fixed)")
    try:
        slots = SlotConfig.parse(args.slots)
    except ValueError as exc:
        parser.error(str(exc))
    return args, slots


class _FlagError(Exception):
    pass


def check_flags(flags: list[str]) -> str | None:
    """What is wrong with scheduler flags `flags` (as `python -m scheduler` would say it), or
    None: for launchers that pass them on (`gpufaas up --scheduler-args`)."""
    parser = _parser()

    def error(message: str) -> NoReturn:
        raise _FlagError(message)

    parser.error = error  # type: ignore[method-assign]  # report, do not exit
    try:
        _parse(parser, flags)
    except _FlagError as exc:
        return str(exc)
    except SystemExit:
        return "--help and --version are not scheduler settings"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, slots = _parse(parser, argv)
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
            policy_config=PolicyConfig(
                max_num_skips=args.o3_limit,
                mqfq_overrun_s=args.mqfq_overrun_s,
                mqfq_ttl_alpha=args.mqfq_ttl_alpha,
                mqfq_swap_out=args.mqfq_swap_out,
                torpor_alpha=args.torpor_alpha,
                torpor_alpha_period_s=args.torpor_alpha_period_s,
                interference_aware_loads=args.interference_aware_loads,
            ),
            eviction=args.eviction,
            adaptive_slots=args.adaptive_slots,
            utilization_threshold=args.utilization_threshold,
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
