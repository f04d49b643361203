"""`python -m gateway`: run the HTTP gateway (uvicorn) against an etcd and a scheduler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.auth import Credentials
from gateway.http import HEAD_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_HEAD_BYTES, HttpLimits, server_config
from gpufaas.credentials import CredentialError, node_token, read_secret, wire_key
from gpufaas.keys import Keys
from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB
from gpufaas.service_main import (
    add_common_flags,
    cluster_secret,
    configure_logging,
    etcd_credentials,
    open_store,
    run_daemon,
    warn_if_insecure,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="gpufaas HTTP gateway")
    add_common_flags(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--state-dir", type=Path, required=True, help="where uploaded packages are kept")
    parser.add_argument(
        "--public-url", default=None, help="URL other hosts reach this gateway at (default: http://HOST:PORT)"
    )
    parser.add_argument("--scheduler", default=None, help="scheduler address host:port (default: look it up in etcd)")
    parser.add_argument(
        "--blob-listen",
        default=None,
        help="where the blob server listens: uploads from `gpufaas deploy`, fetches by nodes (default: HOST, any port)",
    )
    parser.add_argument(
        "--blob-advertise",
        default=None,
        help="the blob server's URL for nodes and the CLI (default: http://the --public-url host:the bound port)",
    )
    parser.add_argument("--max-payload-mb", type=float, default=16.0, help="invocation body limit (413 above)")
    parser.add_argument(
        "--max-unpacked-mb",
        type=int,
        default=DEFAULT_MAX_UNPACKED_MB,
        help="largest size a package may unpack to (413 at upload above)",
    )
    parser.add_argument(
        "--admin-password-file",
        type=Path,
        default=None,
        help="the password of user `admin`, for /system/* and /metrics (mode 0600; required unless --insecure)",
    )
    parser.add_argument(
        "--invoke-token-file",
        type=Path,
        default=None,
        help="a bearer token that may call any function (mode 0600; default: only admin may call non-public ones)",
    )
    parser.add_argument(
        "--max-header-kb",
        type=int,
        default=MAX_HEAD_BYTES // 1024,
        help="largest request line and headers, in KiB (431 above)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="a request's headers must arrive within this after its first byte (408 and closed past it)",
    )
    parser.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=KEEP_ALIVE_TIMEOUT_S,
        help="a connection with no request under way is closed after this",
    )
    args = parser.parse_args(argv)
    try:
        limits = HttpLimits(args.max_header_kb * 1024, args.header_timeout_s, args.keep_alive_timeout_s)
    except ValueError as exc:
        parser.error(str(exc))
    secret = cluster_secret(parser, args)
    etcd_creds = etcd_credentials(parser, args)
    credentials = None
    if secret is not None:
        if args.admin_password_file is None:
            parser.error("--admin-password-file is required (`gpufaas up` makes STATE/secrets/admin-password)")
        try:
            credentials = Credentials(
                admin_password=read_secret(args.admin_password_file),
                invoke_token=read_secret(args.invoke_token_file) if args.invoke_token_file else None,
                node_token=node_token(secret),
            )
        except CredentialError as exc:
            parser.error(str(exc))
    configure_logging(args.log_level)
    warn_if_insecure(args, "the gateway")
    config = GatewayConfig(
        state_dir=args.state_dir,
        public_url=args.public_url or f"http://{args.host}:{args.port}",
        scheduler_address=args.scheduler,
        blob_listen=args.blob_listen or f"{args.host}:0",
        blob_advertise=args.blob_advertise,
        max_payload_bytes=int(args.max_payload_mb * 1024 * 1024),
        max_unpacked_bytes=args.max_unpacked_mb * 1024 * 1024,
        keys=Keys(args.root),
        credentials=credentials,
        wire_key=wire_key(secret) if secret is not None else None,
    )

    async def run() -> None:
        store = await open_store(args.etcd, etcd_creds)
        try:
            server = uvicorn.Server(
                server_config(
                    create_app(store, config), host=args.host, port=args.port, limits=limits, log_level="warning"
                )
            )
            await server.serve()
        finally:
            await store.close()

    return run_daemon(run, args.etcd)


if __name__ == "__main__":
    sys.exit(main())
