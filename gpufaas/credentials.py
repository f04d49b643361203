"""The cluster's credentials: the secret its daemons share, the admin password, the invoke token;
made once (mode 0600), read back, and the keys derived from the shared secret.

Who holds what (docs/security.md):
- the cluster secret: every daemon (gateway, scheduler, GPU managers), never a worker. The wire's
  handshake key and the token nodes fetch packages with are derived from it, one per purpose.
- the admin password (user `admin`): operators; every `/system/*` route and `/metrics`.
- the invoke token: applications; calls to functions that are not public.
- the metrics token (derived from the cluster secret, written as `metrics-token`): a Prometheus
  server; /metrics of the scheduler and the nodes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from gpufaas.errors import GpufaasError
from gpufaas.tls import InDirectory, TlsFiles, ensure_tls, write_new

ADMIN_USER = "admin"
CLUSTER_SECRET_FILE = "cluster-secret"
ADMIN_PASSWORD_FILE = "admin-password"
INVOKE_TOKEN_FILE = "invoke-token"
ETCD_PASSWORD_FILE = "etcd-password"  # etcd's root user: the daemons authenticate to etcd with it
TLS_DIR = "tls"  # the cluster CA and a certificate per daemon role (gpufaas.tls)
METRICS_TOKEN_FILE = "metrics-token"  # derived (metrics_token): what a Prometheus server scrapes with
_SECRET_BYTES = 32
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"(\*\.)?({_LABEL}\.)*{_LABEL}\.?", re.IGNORECASE)  # a wildcard's first label too


class CredentialError(GpufaasError):
    """A credential file is missing, empty or readable by others; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class SecretFiles:
    """The credential files of one cluster, in one directory (mode 0700, files 0600)."""

    directory: Path
    cluster_secret = InDirectory(CLUSTER_SECRET_FILE)
    admin_password = InDirectory(ADMIN_PASSWORD_FILE)
    invoke_token = InDirectory(INVOKE_TOKEN_FILE)
    etcd_password = InDirectory(ETCD_PASSWORD_FILE)

    @property
    def tls(self) -> TlsFiles:
        """The cluster CA and the daemons' certificates (gpufaas.tls), in `tls/`."""
        return TlsFiles(self.directory / TLS_DIR)


def ensure_secrets(directory: Path, *, tls_hosts: tuple[str, ...] = ()) -> SecretFiles:
    """The credential files in `directory`, each made (random, mode 0600) if absent, and the
    cluster's TLS files in its `tls/` (`tls_hosts`: addresses the certificates carry beside
    loopback); existing ones are kept, so a restarted cluster keeps its credentials."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    files = SecretFiles(directory)
    for path in (files.cluster_secret, files.admin_password, files.invoke_token, files.etcd_password):
        with contextlib.suppress(FileExistsError):
            write_new(path, (secrets.token_urlsafe(_SECRET_BYTES) + "\n").encode(), 0o600)
    ensure_tls(files.tls.directory, hosts=tls_hosts)
    return files


def read_secret(path: Path) -> str:
    """The secret in `path`, UTF-8 (surrounding whitespace stripped). Refuses a file that is
    missing, empty, not UTF-8 text, or open to others (any user of the host): a secret anyone can
    read is none. Group access is allowed: Kubernetes hands secrets to a pod's fsGroup that way.
    Read as UTF-8 whatever the locale: every daemon derives the same keys from the same file."""
    try:
        mode = path.stat().st_mode
        value = path.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        raise CredentialError(f"the secret file {path} does not exist; `gpufaas up` makes one") from None
    except OSError as exc:
        raise CredentialError(f"cannot read the secret file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CredentialError(
            f"the secret file {path} is not UTF-8 text; put a long random string in it (such as "
            "`openssl rand -base64 32`)"
        ) from None
    if mode & stat.S_IRWXO:
        raise CredentialError(f"the secret file {path} is open to every user; run `chmod 600 {path}`")
    if not value:
        raise CredentialError(f"the secret file {path} is empty; put a long random string in it")
    return value


def derive(secret: str, purpose: str) -> bytes:
    """A key for one purpose, from the cluster secret: knowing one derived key tells nothing of
    the secret or of the others."""
    return hmac.new(secret.encode(), b"gpufaas/" + purpose.encode(), hashlib.sha256).digest()


def wire_key(secret: str) -> bytes:
    """The key the daemons' wire handshake proves (gpufaas.wire)."""
    return derive(secret, "wire/v1")


def metrics_token(secret: str) -> str:
    """The bearer token the scheduler's and the nodes' metrics endpoints ask for (gpufaas.metrics):
    a Prometheus server scrapes every daemon with it."""
    return derive(secret, "metrics/v1").hex()


def write_metrics_token(files: SecretFiles) -> Path:
    """Write the metrics token (derived from the cluster secret) beside the other credentials,
    mode 0600: the file a Prometheus server's `credentials_file` names (deploy/monitoring). Derived,
    so writing it again writes the same token."""
    path = files.directory / METRICS_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # one there already (copied, made by hand) keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as out:
        out.write(metrics_token(read_secret(files.cluster_secret)) + "\n")
    return path


def node_token(secret: str) -> str:
    """The bearer token GPU managers fetch packages from the gateway with."""
    return derive(secret, "package-fetch/v1").hex()


def basic_authorization(user: str, password: str) -> str:
    """The `Authorization` header value for HTTP basic auth."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _tls_host(value: str) -> str:
    """A --tls-host as a certificate carries it: an IP address (IPv6 with or without brackets), or
    a DNS name (one with non-ASCII letters as its IDNA A-label); a usage error otherwise."""
    bare = value.strip()
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(bare.removeprefix("[").removesuffix("]")))
    try:
        name = bare.encode("idna").decode("ascii")
    except UnicodeError:
        name = ""
    if not _DNS_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{value!r} is neither an IP address nor a DNS name")
    return name


def main(argv: list[str] | None = None) -> int:
    """`python -m gpufaas.credentials DIR`: make a cluster's credential files in DIR (kept if
    there), the cluster's TLS files in DIR/tls (`--tls-host` for addresses they carry), and the
    metrics token derived from them: what containers share through a volume
    (docker-compose.yml; Prometheus reads DIR/metrics-token). `--metrics-token DIR`
    prints the bearer token the daemons' metrics endpoints ask for (for a Prometheus server's
    `credentials_file`)."""
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m gpufaas.credentials",
        description="Make a cluster's credential files in DIR (those there are kept), or print the metrics token.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="where the credential files go (made 0700)")
    parser.add_argument(
        "--metrics-token", action="store_true", help="print the metrics token of the credentials in DIR instead"
    )
    parser.add_argument(
        "--tls-host",
        action="append",
        default=[],
        type=_tls_host,
        metavar="HOST",
        help="an address or name the daemons' certificates carry beside loopback (repeatable; made once: "
        "delete DIR/tls/ROLE.pem to make one again)",
    )
    args = parser.parse_args(argv)  # `--help` prints this and exits: it is never taken for a DIR
    try:
        if args.metrics_token:
            print(metrics_token(read_secret(SecretFiles(args.directory).cluster_secret)))
            return 0
        # (a secret there made by hand, open to others or empty, is refused by write_metrics_token)
        files = ensure_secrets(args.directory, tls_hosts=tuple(args.tls_host))
        write_metrics_token(files)
    except GpufaasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # DIR a file, or a directory this user may not write to
        print(f"error: cannot make the credentials in {args.directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    names = (
        CLUSTER_SECRET_FILE,
        ADMIN_PASSWORD_FILE,
        INVOKE_TOKEN_FILE,
        ETCD_PASSWORD_FILE,
        METRICS_TOKEN_FILE,
        TLS_DIR,
    )
    print(f"credentials in {files.directory}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
