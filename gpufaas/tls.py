"""The cluster's TLS: a CA of its own, a certificate per daemon role, and the contexts and peer
checks the daemons' links (gpufaas.wire, gpufaas.blobnet) and etcd (gpufaas.store) use.

Every link is mutually authenticated: each side shows a certificate signed by the cluster CA and
checks the other's. The certificate says which daemon role it belongs to, as a SAN URI
`gpufaas://ROLE/NAME` (ROLE one of `ROLES`), and each side of each link accepts only the roles
that belong there (`PEERS`): a node's certificate cannot act as the scheduler, nor a gateway's as
a node. Host names are not checked on the wire and blob links (CA + role are; node addresses come
and go); etcd's certificate carries the DNS name `etcd`, which clients verify whatever address
they dial (docs/security.md).

A daemon configures its links once at start (`configure`, from gpufaas.service_main); the wire
and the blob client read that unless a caller passes its own `LinkTls`.
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import ssl
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpufaas.errors import GpufaasError

ROLES = ("gateway", "scheduler", "node", "etcd")
URI_SCHEME = "gpufaas://"
ETCD_NAME = "etcd"  # the DNS name in etcd's certificate that clients verify (grpc target name override)
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"  # only in the secrets directory: signing new certificates needs it
VALID_DAYS = 825
CA_VALID_DAYS = 3650

Link = Literal["wire-server", "wire-client", "blob-server", "blob-client"]

# Which peer roles each daemon role accepts on each side of its links; anything else is refused.
PEERS: Mapping[str, Mapping[Link, frozenset[str]]] = {
    # The gateway dials the scheduler and the nodes (a scheduler at --scheduler's address, pinned:
    # `LinkTls.pinned`; or named by the caller, `connect(peer_role=)`), serves blobs to the nodes
    # and the other gateways, and fetches blobs from (and pushes copies to) both.
    "gateway": {
        "wire-client": frozenset({"scheduler", "node"}),
        "blob-server": frozenset({"node", "gateway"}),
        "blob-client": frozenset({"gateway", "node"}),
    },
    # The scheduler serves the gateways and, as the leader, its standbys' tethers (links that carry
    # nothing: scheduler.election); a scheduler's certificate could place calls as a gateway does,
    # which gives nothing to the role that signs the grants.
    "scheduler": {"wire-server": frozenset({"gateway", "scheduler"}), "wire-client": frozenset({"node", "scheduler"})},
    "node": {
        "wire-server": frozenset({"scheduler", "gateway"}),
        "blob-server": frozenset({"node", "gateway"}),
        "blob-client": frozenset({"gateway", "node"}),
    },
}


class TlsError(GpufaasError):
    """TLS files missing or unsafe, or a peer whose certificate does not belong on a link."""


class PeerRefused(TlsError):
    """The peer's certificate is the cluster's but its role does not belong on this link."""


class InDirectory:
    """A class attribute naming one file of an object's `directory`: `ca = InDirectory("ca.pem")`
    reads as that object's `directory / "ca.pem"`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, files: Any, owner: type | None = None) -> Path:
        return Path(files.directory) / self.name


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The TLS files of one cluster in one directory (0700; keys 0600)."""

    directory: Path
    ca = InDirectory(CA_FILE)
    ca_key = InDirectory(CA_KEY_FILE)

    def cert(self, role: str) -> Path:
        return self.directory / f"{role}.pem"

    def key(self, role: str) -> Path:
        return self.directory / f"{role}-key.pem"


# --- making certificates --------------------------------------------------------------------------


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(now: datetime.datetime, *, valid_days: int = CA_VALID_DAYS) -> tuple[bytes, bytes]:
    """A new cluster CA: (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufaas cluster CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .sign(key, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def issue(
    ca_pem: bytes,
    ca_key_pem: bytes,
    role: str,
    now: datetime.datetime,
    *,
    name: str | None = None,
    hosts: Iterable[str] = (),
    valid_days: int = VALID_DAYS,
) -> tuple[bytes, bytes]:
    """A certificate for daemon `role` (named `name`, default the role) signed by the CA:
    (certificate PEM, key PEM). It carries `gpufaas://ROLE/NAME`, the DNS names ROLE and
    localhost, 127.0.0.1, ::1 and each of `hosts` (IP addresses or DNS names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    key = _new_key()
    sans: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(f"{URI_SCHEME}{role}/{name or role}"),
        x509.DNSName(role),
        x509.DNSName("localhost"),
    ]
    for host in ("127.0.0.1", "::1", *hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpufaas {role} {name or role}")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # an EC key, as make_ca makes
    )
    return _pem_cert(cert), _pem_key(key)


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to a new file `path` of `mode`, whole or not at all (FileExistsError where one
    is there): written beside it first, then linked at `path`, so that a write that failed (a full
    disk) or was interrupted leaves no empty or cut file, which later runs would keep as made."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.unlink(missing_ok=True)  # (one an earlier process of this pid left)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        try:
            os.link(partial, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links (vfat, some network shares)
            if path.exists():
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
            os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _expiry(path: Path) -> datetime.datetime | None:
    """When the certificate in `path` expires; None where the file is absent or does not read as a
    certificate (kept as it is: loading it says what is wrong)."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
    except (OSError, ValueError):
        return None


def _hosts_named(path: Path, role: str) -> list[str]:
    """The IP addresses and DNS names the certificate in `path` carries beyond those `issue` gives
    every one of `role` ([] where none reads): one issued again in its place (expired, or its CA
    made anew) keeps them, though this run was given no --tls-host (docker-compose's runs none)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    addresses = [str(address) for address in names.get_values_for_type(x509.IPAddress)]
    defaults = {role, "localhost", "127.0.0.1", "::1"}
    return [host for host in (*names.get_values_for_type(x509.DNSName), *addresses) if host not in defaults]


def _current(path: Path, now: datetime.datetime) -> bool:
    """Whether a certificate is in `path` that has not expired at `now` (one that does not read
    as a certificate counts as current: it is left for the operator)."""
    expiry = _expiry(path)
    return path.exists() and (expiry is None or expiry > now)


def ensure_tls(directory: Path, *, hosts: Iterable[str] = (), now: datetime.datetime | None = None) -> TlsFiles:
    """The cluster CA and a certificate per role in `directory`, each made if absent or expired at
    `now` (existing ones are kept: delete a file to have it made again, docs/security.md). Keys
    are mode 0600.

    The CA's certificate and key are one unit: where either is missing, or the certificate has
    expired, both are made anew, and then every role's certificate is issued again (the old ones
    name a CA that is gone; restart the daemons). A role whose certificate or key is missing, or
    whose certificate has expired (every peer refuses it), gets both anew. A certificate issued
    again in place of one carries `hosts` and the addresses and names the old one did."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    files = TlsFiles(directory)
    now = now or datetime.datetime.now(datetime.UTC)
    new_ca = not (files.ca_key.exists() and _current(files.ca, now))
    if new_ca:
        ca_pem, ca_key_pem = make_ca(now)
        for path in (files.ca, files.ca_key):
            path.unlink(missing_ok=True)
        write_new(files.ca_key, ca_key_pem, 0o600)
        write_new(files.ca, ca_pem, 0o644)
    ca_pem, ca_key_pem = files.ca.read_bytes(), files.ca_key.read_bytes()
    host_list = list(hosts)
    for role in ROLES:
        if not new_ca and _current(files.cert(role), now) and files.key(role).exists():
            continue
        kept = [host for host in _hosts_named(files.cert(role), role) if host not in host_list]
        cert_pem, key_pem = issue(ca_pem, ca_key_pem, role, now, hosts=[*host_list, *kept])
        for path in (files.cert(role), files.key(role)):
            path.unlink(missing_ok=True)
        write_new(files.key(role), key_pem, 0o600)
        write_new(files.cert(role), cert_pem, 0o644)
    return files


# --- using them ------------------------------------------------------------------------------------


def role_of(peercert: Mapping[str, Any] | None) -> str | None:
    """The role a verified peer certificate (`SSLSocket.getpeercert()`) names, None if none or
    several."""
    roles = {
        value.removeprefix(URI_SCHEME).partition("/")[0]
        for kind, value in (peercert or {}).get("subjectAltName", ())
        if kind == "URI" and value.startswith(URI_SCHEME)
    }
    return roles.pop() if len(roles) == 1 else None


def _check_key(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TlsError(
            f"the TLS key {path} does not exist; `python -m gpufaas.credentials SECRETS_DIR` makes the cluster's"
        ) from None
    if mode & stat.S_IRWXO:
        raise TlsError(f"the TLS key {path} is open to every user; run `chmod 600 {path}`")


def _check_expiry(files: TlsFiles, role: str, now: datetime.datetime) -> None:
    """TlsError, saying how to make a new one, where the CA's or `role`'s certificate has expired:
    a daemon started with it would serve and dial, and every peer refuse it, its own log silent."""
    remake = "`python -m gpufaas.credentials SECRETS_DIR` makes"
    fixes = {
        files.ca: f"{remake} a new CA and certificates; restart every daemon and etcd",
        files.cert(role): f"{remake} a new one; restart the {role}",
    }
    for path, fix in fixes.items():
        expiry = _expiry(path)
        if expiry is not None and expiry <= now:
            raise TlsError(f"the TLS certificate {path} expired on {expiry:%Y-%m-%d}; {fix} (docs/security.md)")


@dataclass(frozen=True)
class LinkTls:
    """One daemon's TLS for its links: its role, the contexts it serves and dials with, and the
    roles it expects at pinned addresses (the gateway's scheduler)."""

    role: str
    server: ssl.SSLContext
    client: ssl.SSLContext
    pinned: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        directory: Path,
        role: str,
        *,
        pinned: Mapping[str, str] | None = None,
        now: datetime.datetime | None = None,
    ) -> LinkTls:
        """The contexts of `role` from the TLS files in `directory` (TlsError, saying what to do,
        where a file is missing, a key open to others, or the certificate or the CA expired at
        `now`, default the present: every peer would refuse it)."""
        files = TlsFiles(directory)
        _check_key(files.key(role))
        _check_expiry(files, role, now or datetime.datetime.now(datetime.UTC))
        server, client = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.verify_mode = ssl.CERT_REQUIRED  # mutual: the server asks the client for its own
            try:
                context.load_verify_locations(files.ca)
                context.load_cert_chain(files.cert(role), files.key(role))
            except (OSError, ssl.SSLError) as exc:
                raise TlsError(f"cannot load the TLS files of role {role} in {directory}: {exc}") from None
        client.check_hostname = False  # CA and role are checked (`check`); addresses come and go
        return cls(role, server, client, dict(pinned or {}))

    def peers(self, link: Link, address: str | None = None, expected: str | None = None) -> frozenset[str]:
        """The roles accepted at the other end of `link`: those of `PEERS`, narrowed to the one
        pinned at `address` (a client's) or to `expected` (what the caller dials)."""
        allowed = PEERS.get(self.role, {}).get(link, frozenset())
        for narrowed in (self.pinned.get(address or ""), expected):
            if narrowed is not None:
                allowed &= {narrowed}
        return allowed

    def check(
        self, peercert: Mapping[str, Any] | None, link: Link, address: str | None = None, expected: str | None = None
    ) -> str:
        """The peer's role if it belongs on `link` (`peers`); PeerRefused otherwise."""
        role = role_of(peercert)
        allowed = self.peers(link, address, expected)
        if role not in allowed:
            where = f" at {address}" if address else ""
            raise PeerRefused(
                f"the peer{where} shows a certificate of role {role or 'none'}; this {self.role}'s {link} link "
                f"accepts {', '.join(sorted(allowed)) or 'no role'}"
            )
        return role


@dataclass
class _Process:
    links: LinkTls | None = None


_process = _Process()


def configure(links: LinkTls | None) -> None:
    """Set this process's link TLS (a daemon does so once at start; None: plain links)."""
    _process.links = links


def process_links() -> LinkTls | None:
    """This process's link TLS, as `configure` set it (None: plain links)."""
    return _process.links


def links_of(tls: LinkTls | bool) -> LinkTls | None:
    """What a link's `tls` argument means: True, the process's link TLS (`configure`); False,
    plain; a LinkTls, that one."""
    return process_links() if tls is True else (tls or None)


def etcd_client_files(directory: Path, role: str) -> tuple[bytes, bytes, bytes]:
    """(CA, certificate, key) PEMs a daemon of `role` presents to etcd with."""
    files = TlsFiles(directory)
    _check_key(files.key(role))
    try:
        return files.ca.read_bytes(), files.cert(role).read_bytes(), files.key(role).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the TLS files of role {role} in {directory}: {exc.strerror}") from None
