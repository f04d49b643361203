"""Gateway authentication: which credential may use which route, over the real app in process."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway import auth
from gateway.auth import (
    INSECURE_CROSS_SITE_MESSAGE,
    AmbiguousCredentials,
    Credentials,
    Role,
    addressed_by_own_name,
    caller_role,
    insecure_refusal,
    roles_for,
)
from gpufaas.credentials import CredentialError, basic_authorization
from gpufaas.functions import FunctionSpec
from tests.unit.test_gateway_app import ADMIN_PASSWORD, CREDENTIALS, INVOKE_TOKEN, NODE_TOKEN, Env, assert_error, run

ADMIN = {"authorization": f"Bearer {ADMIN_PASSWORD}"}
INVOKER = {"authorization": f"Bearer {INVOKE_TOKEN}"}
NODE = {"authorization": f"Bearer {NODE_TOKEN}"}
NOBODY: dict[str, str] = {}
WRONG = {"authorization": basic_authorization("admin", "guess")}
PUBLIC_URL = "http://gateway:8080"  # the test client's base URL names the host `gateway`


@pytest.mark.parametrize(
    ("header", "role"),
    [
        (basic_authorization("admin", ADMIN_PASSWORD), Role.ADMIN),
        (f"Bearer {ADMIN_PASSWORD}", Role.ADMIN),
        (f"bearer {ADMIN_PASSWORD}", Role.ADMIN),  # the scheme's case does not matter
        (f"BASIC {basic_authorization('admin', ADMIN_PASSWORD).split()[1]}", Role.ADMIN),
        (f"Bearer {INVOKE_TOKEN}", Role.INVOKE),
        (f"Bearer {NODE_TOKEN}", Role.NODE),
        (basic_authorization("root", ADMIN_PASSWORD), None),  # the user is admin, no other
        (basic_authorization("admin", INVOKE_TOKEN), None),  # a token is not the password
        (f"Bearer {ADMIN_PASSWORD}x", None),
        (f"Basic {ADMIN_PASSWORD}", None),
        ("", None),
        ("Bearer", None),
    ],
)
def test_a_header_proves_exactly_the_role_of_the_secret_it_carries(header: str, role: Role | None) -> None:
    assert CREDENTIALS.role_of(header.encode()) == role


def test_a_request_proves_a_role_with_exactly_one_authorization_header() -> None:
    admin = f"Bearer {ADMIN_PASSWORD}".encode()
    assert caller_role(CREDENTIALS, [(b"host", b"x"), (b"authorization", admin)]) == Role.ADMIN
    assert caller_role(CREDENTIALS, [(b"host", b"x")]) is None
    for pair in ([admin, b"Bearer wrong"], [b"Bearer wrong", admin]):
        with pytest.raises(AmbiguousCredentials, match="send one Authorization header; this request has 2"):
            caller_role(CREDENTIALS, [(b"authorization", value) for value in pair])


def test_without_tokens_only_the_admin_has_a_role() -> None:
    credentials = Credentials(admin_password="pw")
    assert credentials.role_of(b"Bearer pw") == Role.ADMIN
    assert credentials.role_of(b"Bearer ") is None
    assert "pw" not in repr(credentials)  # secrets stay out of logs


def test_an_invoke_token_that_is_the_admin_password_is_refused() -> None:
    # Before, it was taken: an application given the invoke token could log in as admin with it
    # (Basic admin:TOKEN), and the admin's `Bearer PASSWORD` proved only the invoke role.
    with pytest.raises(CredentialError, match="the invoke token is the admin password"):
        Credentials(admin_password=ADMIN_PASSWORD, invoke_token=ADMIN_PASSWORD)


def test_routes_admit_admin_everywhere_nodes_only_to_read_packages_and_anyone_to_health_and_docs() -> None:
    assert roles_for("GET", "/healthz") is None
    assert roles_for("GET", "/openapi.json") is None
    assert roles_for("GET", "/system/packages/sha256:" + "0" * 64) == {Role.ADMIN, Role.NODE}
    assert roles_for("POST", "/system/packages") == {Role.ADMIN}
    assert roles_for("DELETE", "/system/packages/x") == {Role.ADMIN}
    for path in ("/system/functions", "/system/gpus", "/metrics", "/system/info", "/nowhere"):
        assert roles_for("GET", path) == {Role.ADMIN}


async def status(env: Env, method: str, path: str, headers: dict[str, str], **kwargs: object) -> httpx.Response:
    # The fixture's client sends the admin's basic auth; `auth=None`-like override: an explicit header wins.
    request = env.client.build_request(method, path, headers=headers, **kwargs)  # type: ignore[arg-type]
    return await env.client.send(request, auth=_NoAuth())


class _NoAuth(httpx.Auth):
    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        yield request


def test_system_routes_need_the_admin_credentials(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        for headers, expected in ((NOBODY, 401), (WRONG, 401), (INVOKER, 403), (NODE, 403)):
            for method, path, kwargs in (
                ("GET", "/system/functions", {}),
                ("POST", "/system/functions", {"json": spec}),
                ("PUT", "/system/functions", {"json": spec}),
                ("DELETE", "/system/functions", {"json": {"functionName": "f"}}),
                ("POST", "/system/packages", {"content": b"anything"}),
                ("GET", "/system/gpus", {}),
                ("GET", "/system/info", {}),
                ("GET", "/metrics", {}),
            ):
                response = await status(env, method, path, headers, **kwargs)
                message = assert_error(response, expected)
                if expected == 401:
                    assert response.headers["www-authenticate"].startswith('Basic realm="gpufaas"')
                    assert "gpufaas login" in message
        assert await env.stored_spec("f") is None  # nothing got through
        deployed = await status(env, "POST", "/system/functions", ADMIN, json=spec)
        assert deployed.status_code == 202, deployed.text
        assert (await status(env, "GET", "/healthz", NOBODY)).status_code == 503  # open, and says no scheduler
        assert (await status(env, "GET", "/livez", NOBODY)).status_code == 200
        assert (await status(env, "GET", "/openapi.json", NOBODY)).status_code == 200
        # No interactive pages: FastAPI's load floating versions of third-party scripts from a CDN,
        # which would run on the origin where a browser holds the admin's credentials (the dashboard's).
        for page in ("/docs", "/redoc"):
            assert (await status(env, "GET", page, ADMIN)).status_code == 404

    run(tmp_path, body)


def test_nodes_may_download_packages_and_nothing_else(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        downloaded = await status(env, "GET", f"/system/packages/{digest}", NODE)
        assert downloaded.status_code == 200 and downloaded.content
        assert_error(await status(env, "GET", f"/system/packages/{digest}", NOBODY), 401)
        assert_error(await status(env, "GET", f"/system/packages/{digest}", INVOKER), 403)

    run(tmp_path, body)


def test_a_call_needs_a_caller_credential_unless_the_function_is_public(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        digest = await env.upload()
        for name, public in (("private", False), ("open", True)):
            spec = {"name": name, "package_digest": digest, "memory_mb": 100, "public": public}
            assert (await env.client.post("/system/functions", json=spec)).status_code == 202
        assert FunctionSpec.from_json((await env.store.get(env.keys.function("open"))).value).public  # type: ignore[union-attr]

        refused = await status(env, "POST", "/function/private", NOBODY, json={})
        assert_error(refused, 401, "call function 'private' needs credentials")
        assert refused.headers["x-call-id"]
        assert_error(await status(env, "POST", "/function/private", WRONG, json={}), 401)
        assert_error(await status(env, "POST", "/function/private", NODE, json={}), 403)
        # Past authentication, these calls meet the missing scheduler (503), not a refusal.
        for headers in (INVOKER, ADMIN):
            assert_error(await status(env, "POST", "/function/private", headers, json={}), 503)
        assert_error(await status(env, "POST", "/function/open", NOBODY, json={}), 503)
        # An unknown function is not revealed to a caller without credentials.
        assert_error(await status(env, "POST", "/function/ghost", NOBODY, json={}), 401)
        assert_error(await status(env, "POST", "/function/ghost", INVOKER, json={}), 404, "not deployed")

    run(tmp_path, body, scheduler_wait_s=0.1)


def test_a_call_without_credentials_for_a_name_the_gateway_does_not_know_costs_etcd_no_read(
    tmp_path: Path,
) -> None:
    """A name the gateway's mirror lacks is read from etcd once (a deploy through another gateway
    its watch has not brought yet), but only for a caller with a right to call: anyone else's
    flood of made-up names is refused 401 without a read."""

    async def body(env: Env) -> None:
        reads: list[str] = []
        read = env.store.get

        async def counted(key: str) -> object:
            reads.append(key)
            return await read(key)

        env.store.get = counted  # type: ignore[method-assign]
        for _ in range(3):
            assert_error(await status(env, "POST", "/function/ghost", NOBODY, json={}), 401)
            assert_error(await status(env, "POST", "/function/ghost", WRONG, json={}), 401)
        assert reads == []
        assert_error(await status(env, "POST", "/function/ghost", INVOKER, json={}), 404, "not deployed")
        assert reads == [env.keys.function("ghost")]

    run(tmp_path, body, scheduler_wait_s=0.1)


def test_an_insecure_gateway_admits_anyone(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        assert (await status(env, "GET", "/system/functions", NOBODY)).status_code == 200
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        assert (await status(env, "POST", "/system/functions", NOBODY, json=spec)).status_code == 202
        assert_error(await status(env, "POST", "/function/f", NOBODY, json={}), 503)

    run(tmp_path, body, credentials=None, scheduler_wait_s=0.1, public_url=PUBLIC_URL)


def test_another_site_cannot_write_to_an_insecure_gateway_through_a_browser_that_reaches_it(tmp_path: Path) -> None:
    """--insecure asks nobody for anything, so reaching the port is all it takes: a page on any
    site could otherwise register a package and deploy it through the browser of someone whose
    host or network reaches the gateway (a form or a no-cors fetch needs no preflight). Such
    writes are refused; reads, the same origin and clients that are not browsers are not."""

    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        for headers in ({"sec-fetch-site": "cross-site"}, {"origin": "https://evil.example"}, {"origin": "null"}):
            refused = await status(env, "POST", "/system/packages", headers, content=b"x")
            assert_error(refused, 403, "cross-site", "--insecure")
            assert_error(await status(env, "POST", "/system/functions", headers, json=spec), 403, "cross-site")
            assert (await status(env, "GET", "/system/functions", headers)).status_code == 200
        assert await env.stored_spec("f") is None
        same_origin = {"origin": "http://gateway", "sec-fetch-site": "same-origin"}
        assert (await status(env, "POST", "/system/functions", same_origin, json=spec)).status_code == 202

    run(tmp_path, body, credentials=None, scheduler_wait_s=0.1, public_url=PUBLIC_URL)


BROWSER_ADMIN = {"authorization": basic_authorization("admin", ADMIN_PASSWORD)}


def test_another_site_cannot_write_with_the_admins_browser_credentials(tmp_path: Path) -> None:
    """Once the dashboard asked for them, a browser sends the admin's Basic credentials with any
    request to the gateway, even one another site's page makes (CSRF): writes that a browser marks
    as cross-site are refused; reads, same-origin writes and bearer tokens are not."""

    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        cross_site = (
            {**BROWSER_ADMIN, "sec-fetch-site": "cross-site"},
            {**BROWSER_ADMIN, "origin": "https://evil.example"},
            {**BROWSER_ADMIN, "origin": "null"},
        )
        for headers in cross_site:
            assert_error(await status(env, "POST", "/system/functions", headers, json=spec), 403, "cross-site")
            assert_error(await status(env, "POST", "/system/packages", headers, content=b"x"), 403, "cross-site")
            refused = await status(env, "POST", "/function/f", headers, content=b"{}")
            assert_error(refused, 403, "cross-site")
            assert (await status(env, "GET", "/system/functions", headers)).status_code == 200  # reads are fine
        assert await env.stored_spec("f") is None
        same_origin = {**BROWSER_ADMIN, "origin": "http://gateway", "sec-fetch-site": "same-origin"}
        assert (await status(env, "POST", "/system/functions", same_origin, json=spec)).status_code == 202
        bearer = {**ADMIN, "sec-fetch-site": "cross-site"}  # a token is never the browser's own doing
        assert_error(await status(env, "POST", "/function/f", bearer, json={}), 503)  # past auth: no scheduler

    run(tmp_path, body, scheduler_wait_s=0.1)


def test_a_path_no_route_serves_is_a_404_whatever_the_credential(tmp_path: Path) -> None:
    """A typo (/functon/x) or OpenFaaS's /async-function/x was refused the invoke token with
    "use the admin credentials", which sent the caller after a credential that would not help: a
    path no route serves is a 404 for anyone (the routes are public: /openapi.json), and a known
    route still asks for its credential."""

    async def body(env: Env) -> None:
        for headers in (NOBODY, WRONG, INVOKER, NODE):
            for method, path in (("POST", "/functon/x"), ("GET", "/system/nothing"), ("POST", "/function")):
                missing = await status(env, method, path, headers)
                assert_error(missing, 404, f"no route {method} {path}", "POST /function/NAME")
            refused = await status(env, "POST", "/async-function/x", headers, json={})
            assert_error(refused, 404, "no asynchronous invocations", "POST /function/NAME")
        assert_error(await status(env, "POST", "/async-function/x", ADMIN, json={}), 404, "no asynchronous")
        assert_error(await status(env, "GET", "/system/functions", INVOKER), 403)  # a route: its credential
        assert_error(await status(env, "GET", "/system/functions/", NOBODY), 401)  # (redirected, with the slash)

    run(tmp_path, body)


def test_a_refusal_names_the_credentials_the_route_takes(tmp_path: Path) -> None:
    """A node's token calling a function was told to use the admin credentials, when the invoke
    token would do: each 403 names what its route takes."""

    async def body(env: Env) -> None:
        await env.deploy("f", memory_mb=100)
        message = assert_error(await status(env, "POST", "/function/f", NODE, json={}), 403)
        assert message.endswith("use the invoke token or the admin credentials"), message
        digest = await env.upload()
        message = assert_error(await status(env, "GET", f"/system/packages/{digest}", INVOKER), 403)
        assert message.endswith("use a node's package-download token or the admin credentials"), message
        message = assert_error(await status(env, "GET", "/system/gpus", NODE), 403)
        assert message.endswith("use the admin credentials"), message

    run(tmp_path, body)


@pytest.mark.parametrize(
    ("host", "own"),
    [
        (b"127.0.0.1:8080", True),
        (b"localhost:8080", True),
        (b"LOCALHOST.", True),
        (b"dev.localhost:5173", True),
        (b"[::1]:8080", True),
        (b"::1", True),
        (b"10.1.2.3", True),  # an address: no other site's DNS can point it elsewhere
        (b"gateway:8080", True),  # the public URL's host
        (b"evil.example:8080", False),
        (b"localhost.evil.example", False),
        (b"127.0.0.1.nip.io", False),
        (b"", False),
    ],
)
def test_an_insecure_gateway_is_addressed_only_by_names_no_other_site_can_point_at_it(host: bytes, own: bool) -> None:
    assert addressed_by_own_name(host, "gateway") is own


def test_an_insecure_gateway_parses_a_hosts_name_once_not_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The invoke path asks per call: parsing the address of the same Host on every call cost some
    # us of a call's ~130 us. Its verdict is remembered, for a bounded number of Hosts.
    parsed: list[str] = []
    real = auth.ipaddress.ip_address
    monkeypatch.setattr(auth.ipaddress, "ip_address", lambda name: parsed.append(name) or real(name))
    for _ in range(3):
        assert addressed_by_own_name(b"192.0.2.77:8080", "gateway")
    assert parsed == ["192.0.2.77"]
    assert addressed_by_own_name.cache_info().maxsize == auth.OWN_NAMES_KEPT


def test_an_insecure_gateway_refuses_a_browsers_cross_site_call_to_a_function() -> None:
    """A web page on another origin could POST to http://127.0.0.1:PORT/function/NAME (a simple
    request needs no preflight) and run a function on an --insecure gateway; `insecure_refusal` is
    what the invoke path asks, as AuthMiddleware does for the other routes."""

    def scope(method: str, headers: dict[bytes, bytes]) -> dict[str, object]:
        return {
            "method": method,
            "path": "/function/f",
            "headers": list({b"host": b"127.0.0.1:8080", **headers}.items()),
        }

    for browser in ({b"origin": b"https://evil.example"}, {b"sec-fetch-site": b"cross-site"}, {b"origin": b"null"}):
        assert insecure_refusal(scope("POST", browser), "127.0.0.1") == (403, INSECURE_CROSS_SITE_MESSAGE)
    rebound = scope("POST", {b"host": b"evil.example:8080", b"origin": b"http://evil.example:8080"})
    refused = insecure_refusal(rebound, "127.0.0.1")
    assert refused is not None and refused[0] == 403 and "DNS rebinding" in refused[1]
    assert insecure_refusal(scope("POST", {}), "127.0.0.1") is None  # curl, httpx, the CLI: no Origin
    same_origin = {b"origin": b"http://127.0.0.1:8080", b"sec-fetch-site": b"same-origin"}
    assert insecure_refusal(scope("POST", same_origin), "127.0.0.1") is None


def test_an_insecure_gateway_answers_no_page_that_dns_rebinding_pointed_at_it(tmp_path: Path) -> None:
    """A page on evil.example whose DNS then answers 127.0.0.1 is same-origin with the gateway in
    the browser's eyes (Origin and Host both evil.example): it could read /system/* and deploy.
    --insecure answers only Host names no other site can point at it; the rest are refused."""

    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        rebound = {"host": "evil.example:8080", "origin": "http://evil.example:8080"}
        # (from another host, 127.0.0.1 is not it: the name is taken once it is the public URL's)
        refused = await status(env, "GET", "/system/functions", rebound)
        assert_error(refused, 403, "DNS rebinding", "127.0.0.1", "an IP address", "--public-url")
        assert_error(await status(env, "POST", "/system/functions", rebound, json=spec), 403, "DNS rebinding")
        assert await env.stored_spec("f") is None
        for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "gateway:8080"):
            assert (await status(env, "GET", "/system/functions", {"host": host})).status_code == 200, host
        assert (await status(env, "GET", "/livez", rebound)).status_code == 200  # open routes stay open

    run(tmp_path, body, credentials=None, scheduler_wait_s=0.1, public_url=PUBLIC_URL)


def test_an_insecure_gateway_refuses_another_sites_function_calls_on_the_invoke_path(tmp_path: Path) -> None:
    """The invoke path (gateway.invoke, which answers POST /function/NAME before AuthMiddleware)
    ran another site's calls on an --insecure gateway and answered a rebinding page; it asks
    `insecure_refusal` now. A client that is not a browser still calls (503: no scheduler here)."""

    async def body(env: Env) -> None:
        digest = await env.upload()
        spec = {"name": "f", "package_digest": digest, "memory_mb": 100}
        assert (await status(env, "POST", "/system/functions", NOBODY, json=spec)).status_code == 202
        for headers in ({"sec-fetch-site": "cross-site"}, {"origin": "https://evil.example"}):
            assert_error(await status(env, "POST", "/function/f", headers, json={}), 403, "cross-site")
        rebound = {"host": "evil.example:8080", "origin": "http://evil.example:8080"}
        assert_error(await status(env, "POST", "/function/f", rebound, json={}), 403, "DNS rebinding")
        assert_error(await status(env, "POST", "/function/f", NOBODY, json={}), 503)

    run(tmp_path, body, credentials=None, scheduler_wait_s=0.1, public_url=PUBLIC_URL)
