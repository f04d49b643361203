"""The CLI's side of a gateway: which one (flag, environment, stack file), the admin password to
use with it, and `GatewayClient`, its handle on it."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from gpufaas.credentials import ADMIN_USER, basic_authorization
from gpufaas.errors import GpufaasError
from gpufaas.settings import is_loopback

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
MAX_ERROR_CHARS = 300  # of a refusal's text: an error is one line, not a page


def state_dir_default() -> Path:
    """Where the local cluster keeps its state: $GPUFAAS_STATE_DIR, else ~/.local/state/gpufaas."""
    env = os.environ.get("GPUFAAS_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "gpufaas"


def gateway_url(flag: str | None, stack_gateway: str | None = None, *, state_dir: Path | None = None) -> str:
    """The gateway every command talks to, in one order: --gateway, else $GPUFAAS_URL, else the
    stack file's provider.gateway (`deploy`), else the local cluster's while it runs (its
    cluster.json in `state_dir`, by default `state_dir_default()`), else DEFAULT_GATEWAY."""
    if flag or os.environ.get("GPUFAAS_URL") or stack_gateway:
        return (flag or os.environ.get("GPUFAAS_URL") or stack_gateway or "").rstrip("/")
    return running_cluster_url(state_dir) or DEFAULT_GATEWAY


def running_cluster_url(state_dir: Path | None = None) -> str | None:
    """The gateway URL of the local cluster in `state_dir` (default `state_dir_default()`) if any
    of its processes runs; else None."""
    from gpufaas.dev.local_cluster import recorded_pids
    from gpufaas.processes import pid_alive

    state_dir = state_dir or state_dir_default()
    if not any(pid_alive(pid) for pid in recorded_pids(state_dir).values()):
        return None
    url = cluster_info(state_dir).get("gateway_url")
    return url.rstrip("/") if isinstance(url, str) and url else None


def credentials_path() -> Path:
    """Where `gpufaas login` keeps passwords, by gateway URL (mode 0600)."""
    env = os.environ.get("GPUFAAS_CONFIG_DIR")
    return (Path(env) if env else Path.home() / ".config" / "gpufaas") / "credentials.json"


def saved_credentials() -> dict[str, str]:
    """The passwords `gpufaas login` kept, by gateway URL (none: {})."""
    try:
        saved = json.loads(credentials_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in saved.items()} if isinstance(saved, dict) else {}


def credentials_to_change() -> dict[str, str]:
    """The passwords `gpufaas login` kept, to change and `keep_credentials` again: a file there
    that is not what login writes is refused (written over, it would lose every password it has)."""
    path = credentials_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise GpufaasError(f"cannot read {path}: {exc}") from None
    try:
        saved = json.loads(text)
    except ValueError:
        saved = None
    if not isinstance(saved, dict) or not all(isinstance(v, str) for v in saved.values()):
        raise GpufaasError(
            f"{path} is not a JSON object of passwords by gateway URL; fix it or remove it, then log in again"
        )
    return saved


def keep_credentials(saved: dict[str, str]) -> Path:
    """Write the passwords kept by gateway URL (0600), whole or not at all, where the file is (a
    link, as dotfile managers make, is written through). Returns the file's path."""
    path = credentials_path()
    target = path.resolve()
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            json.dump(saved, out, indent=2)
        os.replace(partial, target)
    except OSError as exc:
        raise GpufaasError(f"cannot write {path}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


def admin_password_for(url: str, state_dir: Path | None = None) -> str | None:
    """The admin password to use with the gateway at `url`: $GPUFAAS_PASSWORD, else the local
    cluster's own if `url` is its gateway (a cluster made again has a new one: a password
    `gpufaas login` kept for its URL may be stale), else what `gpufaas login` kept for it."""
    if os.environ.get("GPUFAAS_PASSWORD"):
        return os.environ["GPUFAAS_PASSWORD"]
    return local_cluster_password(url, state_dir) or saved_credentials().get(url) or None


def local_cluster_password(url: str, state_dir: Path | None = None) -> str | None:
    """The admin password of the local cluster in `state_dir` (default `state_dir_default()`), from
    its secrets, if `url` is that cluster's gateway and it runs (one stopped left its files; another
    gateway may answer at its URL now, whose password `gpufaas login` keeps); else None."""
    from gpufaas.credentials import CredentialError, SecretFiles, read_secret

    info = cluster_info(state_dir or state_dir_default())
    if running_cluster_url(state_dir) == url.rstrip("/") and info.get("secrets"):
        with contextlib.suppress(CredentialError):
            return read_secret(SecretFiles(Path(info["secrets"])).admin_password)
    return None


def what_to_start(url: str, state_dir: Path | None = None) -> str:
    """What to do when no gateway answers at `url`: where `url` is the local cluster's recorded
    gateway or the default one (a command given no --gateway) and that cluster in `state_dir`
    (default `state_dir_default()`) is stopped, name it and its port (a cluster made with
    `up --port P` and stopped left commands at port 8080, with no word of it); else start one."""
    state_dir = state_dir or state_dir_default()
    recorded = cluster_info(state_dir).get("gateway_url")
    anywhere = "or point --gateway / GPUFAAS_URL at a running one"
    if not isinstance(recorded, str) or not recorded or running_cluster_url(state_dir) is not None:
        return f"start a local cluster with `gpufaas up`, {anywhere}"
    recorded = recorded.rstrip("/")
    if url.rstrip("/") not in (recorded, DEFAULT_GATEWAY):
        return f"start a local cluster with `gpufaas up`, {anywhere}"
    try:
        port = urllib.parse.urlsplit(recorded).port
    except ValueError:  # (a cluster.json edited by hand)
        port = None
    again = "gpufaas up" + (
        f" --port {port}" if port not in (None, urllib.parse.urlsplit(DEFAULT_GATEWAY).port) else ""
    )
    return f"the local cluster in {state_dir} was at {recorded} and is stopped: `{again}` starts one again, {anywhere}"


class GatewayClient:
    """The CLI's handle on a gateway: every failure becomes a GpufaasError that says what to do.
    It authenticates as admin with `admin_password_for(url)` when there is one."""

    def __init__(
        self, url: str, *, timeout_s: float = 120.0, password: str | None = None, state_dir: Path | None = None
    ) -> None:
        self.url = url
        self.state_dir = state_dir  # the local cluster's (None: `state_dir_default()`)
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 (ValueError: not a port number)
        except ValueError:  # (an unclosed [IPv6 address, a port past 65535)
            raise not_a_gateway_url(url) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise not_a_gateway_url(url)
        password = password if password is not None else admin_password_for(url, state_dir)
        auth = httpx.BasicAuth(ADMIN_USER, password) if password else None
        # The same credential for the gateway's blob server (gpufaas.blobnet), which httpx does not reach.
        self.authorization = basic_authorization(ADMIN_USER, password) if password else None
        try:
            # A gateway on this machine is reached directly: with an http_proxy set for the outside
            # (and no no_proxy), every command to a local cluster failed "no gateway answers".
            # The CAs to trust are still the environment's (SSL_CERT_FILE: a private CA's) on loopback.
            verify = httpx.create_ssl_context() if parts.scheme == "https" else True
            self._client = httpx.Client(
                base_url=url, timeout=timeout_s, auth=auth, trust_env=not is_loopback(parts.hostname), verify=verify
            )
        except httpx.InvalidURL:  # (a bad port, an unclosed [IPv6 address)
            raise not_a_gateway_url(url) from None

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.InvalidURL as exc:  # (a function name no URL can carry)
            raise GpufaasError(f"cannot ask the gateway at {self.url} for {path!r}: {exc}") from None
        except httpx.ConnectError as exc:
            if _untrusted_certificate(exc):  # (not "no gateway answers": one answered, with TLS)
                raise GpufaasError(
                    f"the gateway at {self.url} has a certificate this machine does not trust ({exc}); "
                    "give the CA that signed it in SSL_CERT_FILE"
                ) from None
            raise GpufaasError(f"no gateway answers at {self.url}; {what_to_start(self.url, self.state_dir)}") from None
        except httpx.HTTPError as exc:
            raise GpufaasError(f"talking to the gateway at {self.url} failed: {exc}") from None

    def ok(self, response: httpx.Response, *, accept: tuple[int, ...] = (200, 201, 202)) -> Any:
        if response.status_code == 401:
            raise GpufaasError(
                f"the gateway at {self.url} needs credentials: `gpufaas login --gateway {self.url} --password-stdin` "
                "(the password of a local cluster is in its state directory, secrets/admin-password)"
            )
        if response.status_code not in accept:
            raise GpufaasError(f"{self._error_message(response)} (HTTP {response.status_code})")
        try:
            return response.json() if response.content else None
        except ValueError:  # a web page, a proxy's: whatever answers there, it is not a gateway
            raise self.not_a_gateway(response, "JSON") from None

    def _error_message(self, response: httpx.Response) -> str:
        """What a refusal says, on one line: the gateway's JSON `error`, else its body's text (a
        proxy's HTML page, printed whole, was dozens of lines of markup in place of one)."""
        try:
            message = response.json().get("error", response.text)
        except (ValueError, AttributeError):  # not JSON, or not an object
            message = response.text
        text = " ".join(str(message).split())
        if not text or text.startswith("<") or "html" in response.headers.get("content-type", ""):
            reason = f" ({response.reason_phrase})" if response.reason_phrase else ""
            return f"the gateway at {self.url} refused{reason} with a web page, not a gateway's error (a proxy's?)"
        return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"

    def not_a_gateway(self, response: httpx.Response, what: str) -> GpufaasError:
        """The error for an answer (of HTTP status `accept` takes) that is not `what` a gateway answers."""
        try:
            asked = f" {response.request.url.path}"
        except RuntimeError:  # (a response made without a request)
            asked = ""
        return GpufaasError(
            f"the gateway at {self.url} answered{asked} with something other than {what} "
            f"(HTTP {response.status_code}): is it a gpufaas gateway?"
        )

    def rows(
        self, response: httpx.Response, what: str, fields: Mapping[str, Callable[[Any], bool]]
    ) -> list[dict[str, Any]]:
        """The answer to a listing: a list of objects, each with every key of `fields` holding a
        value its check takes (what a table shows: a listing that is not one is a clear line,
        not a traceback in the formatting); else `not_a_gateway`."""
        answer = self.ok(response)
        if not isinstance(answer, list) or not all(
            isinstance(row, dict) and all(key in row and check(row[key]) for key, check in fields.items())
            for row in answer
        ):
            raise self.not_a_gateway(response, what)
        return answer


# The checks of a listing's fields (`GatewayClient.rows`). JSON's true is not a number here.
def is_text(value: object) -> bool:
    return isinstance(value, str)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_texts(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _untrusted_certificate(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it came from) is a TLS certificate that failed verification."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def not_a_gateway_url(url: str) -> GpufaasError:
    return GpufaasError(
        f"{url!r} is not a gateway URL: give one like http://127.0.0.1:8080 or https://gateway.example.com:8443"
    )


def cluster_info(state_dir: Path) -> dict[str, Any]:
    """What the local cluster in `state_dir` recorded of itself (its cluster.json; none: {})."""
    try:
        info: dict[str, Any] = json.loads((state_dir / "cluster.json").read_text())
        return info
    except (OSError, ValueError):
        return {}
