"""Who may use which gateway route: credentials from the Authorization header, a role per
credential, the roles each route admits (docs/security.md has the whole model).

- admin (HTTP basic `admin:PASSWORD`, or `Bearer PASSWORD`): every route.
- invoke (`Bearer INVOKE_TOKEN`): calls to functions (POST /function/{name}).
- node (`Bearer NODE_TOKEN`, derived from the cluster secret): reading packages and blobs by digest.
- nobody: /healthz, /livez and the API's own documentation (`OPEN_PATHS`); calls to functions deployed
  `public`.

A request without a valid credential gets 401 with a `WWW-Authenticate` challenge; a valid
credential whose role the route does not admit gets 403, naming the credentials it takes; one with
several Authorization headers gets 400 (`caller_role` reads them, for every route). A path no route
serves gets 404 whatever the credential (the routes are public: /openapi.json lists them).
"""

from __future__ import annotations

import enum
import functools
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import Match

from gpufaas.credentials import ADMIN_USER, CredentialError, basic_authorization
from gpufaas.errors import shown

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Role(enum.Enum):
    ADMIN = "admin"
    INVOKE = "invoke"
    NODE = "node"


ANY_CALLER = frozenset({Role.ADMIN, Role.INVOKE})
OPEN_PATHS = frozenset({"/healthz", "/livez", "/openapi.json"})
PACKAGE_PREFIX = "/system/packages/"
BLOB_PREFIX = "/system/blobs/"
CHALLENGE = b'Basic realm="gpufaas", charset="UTF-8"'
# The Host values whose verdict (`addressed_by_own_name`) is remembered: a few per gateway are its
# own; bounded, whatever Hosts clients send.
OWN_NAMES_KEPT = 64
# OpenFaaS's asynchronous invocations, which gpufaas does not have: a client written for OpenFaaS
# is told what to call instead of being refused the admin's credentials.
ASYNC_PREFIX = "/async-function/"
ASYNC_MESSAGE = "gpufaas has no asynchronous invocations (/async-function/NAME); call POST /function/NAME"
# How a refusal names each credential, in the order a message lists them.
CREDENTIAL_NAMES = {
    Role.INVOKE: "the invoke token",
    Role.NODE: "a node's package-download token",
    Role.ADMIN: "the admin credentials",
}


@dataclass(frozen=True)
class Credentials:
    """The secrets a gateway accepts. `invoke_token` and `node_token` may be absent (then no
    caller has that role). CredentialError where the invoke token is the admin password."""

    admin_password: str = field(repr=False)
    invoke_token: str | None = field(default=None, repr=False)
    node_token: str | None = field(default=None, repr=False)
    _accepted: tuple[tuple[bytes, Role], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.invoke_token == self.admin_password:
            # Every application given the invoke token could log in as admin with it (Basic), and
            # the admin's `Bearer PASSWORD` would prove only the invoke role.
            raise CredentialError(
                "the invoke token is the admin password: applications holding it could administer the "
                "gateway; put another secret in the invoke token's file"
            )
        accepted = [
            (basic_authorization(ADMIN_USER, self.admin_password).encode(), Role.ADMIN),
            (f"Bearer {self.admin_password}".encode(), Role.ADMIN),
        ]
        if self.invoke_token:
            accepted.append((f"Bearer {self.invoke_token}".encode(), Role.INVOKE))
        if self.node_token:
            accepted.append((f"Bearer {self.node_token}".encode(), Role.NODE))
        object.__setattr__(self, "_accepted", tuple(accepted))

    def role_of(self, authorization: bytes | None) -> Role | None:
        """The role an Authorization header value proves, or None. Compared in constant time
        against every accepted value; the scheme's case does not matter (RFC 7235)."""
        if not authorization:
            return None
        scheme, _, rest = authorization.partition(b" ")
        value = scheme.capitalize() + b" " + rest.strip()
        role = None
        for candidate, candidate_role in self._accepted:
            if hmac.compare_digest(value, candidate):
                role = candidate_role
        return role


class AmbiguousCredentials(ValueError):
    """A request carried several Authorization headers (a proxy, or two routes, could each read
    a different one): it is refused with 400, whatever they hold."""


def caller_role(credentials: Credentials, headers: Iterable[tuple[bytes, bytes]]) -> Role | None:
    """The role the request's Authorization header proves (None: it has none, or an invalid one);
    AmbiguousCredentials if it has more than one. `headers`: ASGI's (lower-case names)."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) > 1:
        raise AmbiguousCredentials(f"send one Authorization header; this request has {len(values)}")
    return credentials.role_of(bytes(values[0]) if values else None)


def roles_for(method: str, path: str) -> frozenset[Role] | None:
    """The roles a (non-invocation) route admits; None: open to anyone."""
    if path in OPEN_PATHS:
        return None
    if method in ("GET", "HEAD") and path.startswith((PACKAGE_PREFIX, BLOB_PREFIX)):
        return frozenset({Role.ADMIN, Role.NODE})
    return frozenset({Role.ADMIN})


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CROSS_SITE_MESSAGE = (
    "a cross-site request may not use the admin's browser credentials to change anything; "
    "call the API directly (curl, gpufaas), or with a bearer token"
)


INSECURE_CROSS_SITE_MESSAGE = (
    "a cross-site request may not change anything on this gateway nor call its functions (it runs "
    "--insecure: a web page could otherwise deploy or run code through any browser that reaches it); "
    "call the API directly (curl, gpufaas)"
)


@functools.lru_cache(maxsize=OWN_NAMES_KEPT)
def addressed_by_own_name(host: bytes, public_host: str) -> bool:
    """Whether a Host header names this gateway by a name no other site can make resolve to it:
    a loopback name (`localhost`, `*.localhost`), an IP address, or `public_host` (its public URL's).
    Any other name may be another site's domain that its DNS pointed at this gateway (DNS
    rebinding), under which a web page reads the answers as its own origin's. Cached: the invoke
    path asks it per call, and parsing an address costs some us where a call's Host repeats."""
    name = host.decode("latin-1").lower()
    if name.startswith("["):  # an IPv6 address, with or without a port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if name in ("localhost", public_host.lower()) or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def insecure_refusal(
    scope: Scope, public_host: str, headers: dict[bytes, bytes] | None = None
) -> tuple[int, str] | None:
    """Why a gateway that asks no credential (--insecure) refuses this request, or None: it may go
    on. Reaching it is authority enough, so a browser must not be another site's way in: a Host
    that is not one of its own names (`addressed_by_own_name`; a rebinding page would read the
    answers) and a browser's cross-site write (`forged`, which a call to a function is) are refused
    with 403. A client that is not a browser (curl, httpx, the CLI) sends no Origin and its own Host.
    `headers`: the scope's as a dict, where the caller made one already (the invoke path)."""
    headers = dict(scope["headers"]) if headers is None else headers
    host = headers.get(b"host")
    if host is not None and not addressed_by_own_name(host, public_host):
        return 403, (
            f"this gateway runs --insecure and answers only requests addressed to it by a loopback name, "
            f"an IP address or its public URL's host, not {shown(repr(host.decode('latin-1')))} (another "
            "site's name pointed at it, DNS rebinding, would let a web page use it): call it by an IP address "
            "(127.0.0.1 on its own host), or start it with that name's URL in --public-url"
        )
    return (403, INSECURE_CROSS_SITE_MESSAGE) if forged(scope["method"], headers, ambient=True) else None


def forged(method: str, headers: dict[bytes, bytes], *, ambient: bool = False) -> bool:
    """Whether this is another site's write riding on the admin's Basic credentials, which a
    browser keeps after the dashboard asked for them and sends with any request to the gateway
    (CSRF): a method that changes something, Basic credentials, and a browser's sign that another
    origin sent it (Sec-Fetch-Site: cross-site, or an Origin that is not this host). Bearer tokens
    are never sent by a browser on its own, and a script cannot add one cross-site unasked.
    `ambient`: the gateway asks for no credential (--insecure), so that reaching it is authority
    enough, and any browser's write counts, whatever it carries (a page on the web can reach a
    gateway on the admin's own host or network through the browser)."""
    basic = headers.get(b"authorization", b"")[:6].lower() == b"basic "
    if method in SAFE_METHODS or not (basic or ambient):
        return False
    if headers.get(b"sec-fetch-site") == b"cross-site":
        return True
    origin = headers.get(b"origin")
    return origin is not None and origin.partition(b"://")[2] != headers.get(b"host")


def refusal(role: Role | None, what: str, admitted: frozenset[Role] = ANY_CALLER) -> tuple[int, str]:
    """The status and message for a caller whose `role` (None: no valid credential) may not `what`,
    which the roles `admitted` may (the default: a call to a function's, admin or invoke)."""
    if role is None:
        return 401, (
            f"{what} needs credentials: `gpufaas login` (or curl -u admin:PASSWORD, or "
            "-H 'Authorization: Bearer TOKEN'); `gpufaas up` writes them to its state directory"
        )
    takes = " or ".join(name for taker, name in CREDENTIAL_NAMES.items() if taker in admitted)
    return 403, f"the {role.value} credential may not {what}; use {takes}"


def no_route(scope: Scope) -> str | None:
    """Why no route of the app serving `scope` (Starlette's `scope["app"]`) answers its path, or
    None: one does (perhaps for another method, or after a redirect to the path with or without its
    trailing slash, as Starlette's router makes). Read only for requests refused already."""
    path: str = scope["path"]
    routes = scope["app"].router.routes
    alternate = path.rstrip("/") if path.endswith("/") else path + "/"
    for candidate in (path, alternate):
        probe = {**scope, "path": candidate}
        if any(route.matches(probe)[0] is not Match.NONE for route in routes):
            return None
    return (
        f"no route {scope['method']} {path}: functions are called with POST /function/NAME; "
        "/openapi.json lists the other routes"
    )


async def send_refusal(send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message, "status": status}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", CHALLENGE))
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """ASGI middleware: lets a request through to the app only if its credential's role is one
    the route admits (`roles_for`). Invocations are checked by gateway.invoke, per function.
    `credentials` None (--insecure): anyone is let through, but for what `insecure_refusal` refuses
    (`public_host`: the host of the gateway's public URL, a name it is addressed by)."""

    def __init__(self, app: ASGIApp, credentials: Credentials | None, public_host: str = "") -> None:
        self.app = app
        self.credentials = credentials
        self.public_host = public_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith(ASYNC_PREFIX):
            await send_refusal(send, 404, ASYNC_MESSAGE)
            return
        admitted = roles_for(scope["method"], scope["path"])
        refused = None if admitted is None else self._refusal(scope, admitted)
        if refused is not None:
            # (A path no route serves is a 404 for everyone, not "use the admin credentials" for a
            # typo: the routes are no secret, /openapi.json lists them.)
            missing = no_route(scope) if refused[0] in (401, 403) else None
            await send_refusal(send, *((404, missing) if missing is not None else refused))
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, admitted: frozenset[Role]) -> tuple[int, str] | None:
        """The status and message a request to a route that admits `admitted` is refused with;
        None: it may go on."""
        method, path, headers = scope["method"], scope["path"], scope["headers"]
        if self.credentials is None:  # (--insecure: anyone, but for a browser sent by another site)
            return insecure_refusal(scope, self.public_host)
        try:
            role = caller_role(self.credentials, headers)
        except AmbiguousCredentials as exc:
            return 400, str(exc)
        if role not in admitted:
            return refusal(role, f"{method} {path}", admitted)
        if forged(method, dict(headers)):
            return 403, CROSS_SITE_MESSAGE
        return None
