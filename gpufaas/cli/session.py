"""`gpufaas login` and `logout`: the admin password kept for a gateway."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpufaas.cli.base import GatewayOpt, StateDir, app, console, user_errors
from gpufaas.cli.client import (
    GatewayClient,
    credentials_to_change,
    gateway_url,
    keep_credentials,
    local_cluster_password,
    state_dir_default,
)
from gpufaas.credentials import ADMIN_USER
from gpufaas.errors import GpufaasError


@app.command()
def login(
    gateway: GatewayOpt = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Check the admin password with the gateway and keep it for later commands (mode 0600).

    Without --password-stdin: the local cluster's own password (its state directory), if the
    gateway is the local cluster's."""
    with user_errors():
        url = gateway_url(gateway, state_dir=state_dir)
        if password_stdin:
            if sys.stdin.isatty():
                raise GpufaasError("--password-stdin: pipe the password in, e.g. `cat FILE | gpufaas login ...`")
            password = sys.stdin.readline().strip()
            if not password:  # (not the advice below: to pass it with --password-stdin, as was done)
                raise GpufaasError(
                    "--password-stdin: stdin held no password; pipe it in, e.g. `cat FILE | gpufaas login ...`"
                )
        else:
            password = local_cluster_password(url, state_dir) or ""  # its own, never a password kept before
        if not password:
            raise GpufaasError(
                f"no password for {url}: pass it with --password-stdin (a local cluster keeps it in "
                f"{state_dir / 'secrets' / 'admin-password'})"
            )
        client = GatewayClient(url, password=password, state_dir=state_dir)
        response = client.request("GET", "/system/info")
        if response.status_code in (401, 403):
            raise GpufaasError(f"the gateway at {url} refused that password; check it and try again")
        client.ok(response)
        saved = credentials_to_change()
        saved[url] = password
        path = keep_credentials(saved)
    console.print(f"logged in to {url} as {ADMIN_USER} (kept in {path})", markup=False)  # (a path: text)


@app.command()
def logout(gateway: GatewayOpt = None, state_dir: StateDir = state_dir_default()) -> None:  # noqa: B008
    """Forget the password `gpufaas login` kept for a gateway."""
    with user_errors():
        url = gateway_url(gateway, state_dir=state_dir)
        saved = credentials_to_change()
        if saved.pop(url, None) is None:
            console.print(f"no password kept for {url}", markup=False)
            return
        keep_credentials(saved)
    console.print(f"forgot the password for {url}", markup=False)
