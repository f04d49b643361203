"""The datastore handle of gpufaas: one narrow async `Store`, over etcd (`EtcdStore`); tests use an
in-memory fake with the same semantics (`MemoryStore` in tests/fakes.py).

Errors (the only ones a `Store` raises, besides ValueError for a malformed key or prefix):

    StoreError              transient: the store is unreachable or timed out; retry with backoff
    ├── LeaseLost           the lease expired or was revoked: grant a new one and re-register
    └── RevisionCompacted   a watch asked for history the store no longer keeps: re-list, then watch

Both implementations keep etcd's semantics, so a test that passes on the fake means the same thing on
etcd: one global revision, bumped once per mutating call (a prefix delete or a lease expiry that
removes several keys is one revision); keys carry create/mod revisions and an optional lease; a
compare-and-put compares `mod_revision` (0: "the key does not exist"); deleting the keys of an
expired or revoked lease produces delete events. `LeaseKeeper` keeps one lease per daemon alive.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict, TypeVar, Unpack

import aetcd
import aetcd.exceptions

from gpufaas.settings import is_loopback

logger = logging.getLogger(__name__)

# The most operations one etcd transaction may hold (etcd's --max-txn-ops default): a
# `write_batch` is at most this many keys.
MAX_TXN_OPS = 128
# What a caller should keep a `write_batch`'s keys and values under: etcd refuses a request over
# its --max-request-bytes (1.5 MiB by default), whatever its count of keys.
MAX_TXN_BYTES = 1024 * 1024


# The most keys one range call of `EtcdStore.get_prefix` asks for. A page whose answer is still
# over ETCD_MAX_RECEIVE_BYTES (a value may be up to etcd's 1.5 MiB request limit) is asked again
# with half as many keys, down to one.
GET_PREFIX_PAGE_KEYS = 256
# Whole-prefix reads begun again from their first page when history was compacted under them.
GET_PREFIX_ATTEMPTS = 3


# --- values and errors ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored: `lease` is 0 when the key is not attached to a lease."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change seen by a watch; `mod_revision` is the revision of the change (of the deletion for
    "delete", whose `value` is b"")."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int


# gRPC keepalive on the etcd channel, and a short reconnect backoff. Without keepalive a channel
# whose packets are dropped (a partition: no reset) never learns its connection is gone, and calls
# wait behind TCP's retransmission backoff: after a 60 s partition a node's lease refresh first
# succeeded 53.6 s after the heal; with these, 0.1 s (docs/hosts.md). etcd refuses pings more often
# than every 5 s (--grpc-keepalive-min-time) and pings on a connection with no stream open, so:
# every 10 s, and only while a call or a watch is open (every daemon keeps a watch). gRPC takes
# answers of at most 4 MiB by default: a whole-prefix read past that failed for good (holders/ of
# ~130 nodes, models/ of hundreds of models on a thousand GPUs), so reads come in pages
# (`GET_PREFIX_PAGE_KEYS`) and the cap is ETCD_MAX_RECEIVE_BYTES, room for pages of large values
# and for a watch catching up on many revisions at once.
ETCD_MAX_RECEIVE_BYTES = 64 * 1024 * 1024
ETCD_CHANNEL_OPTIONS: dict[str, int] = {
    "grpc.max_receive_message_length": ETCD_MAX_RECEIVE_BYTES,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.min_reconnect_backoff_ms": 1_000,
    "grpc.max_reconnect_backoff_ms": 2_000,
}


# gRPC sends a channel through an http(s)_proxy the environment names; one set for a corporate
# network cannot reach this machine's loopback, where a local cluster's etcd listens (etcdctl, as
# every Go client, goes to loopback directly), so a channel to loopback goes directly too.
_NO_PROXY: dict[str, int] = {"grpc.enable_http_proxy": 0}


class StoreError(Exception):
    """Transient: the store is unreachable or did not answer in time. Retry with backoff."""


class LeaseLost(StoreError):
    """The lease expired or was revoked (refresh, or a put attached to it, found it gone)."""


class RevisionCompacted(StoreError):
    """A watch's start_revision is older than the history the store keeps: re-list, then watch."""


# --- the interface --------------------------------------------------------------------------


class Store(Protocol):
    """One narrow handle on the datastore. Keys are str (UTF-8 in etcd: reads and watches skip,
    with a warning, a key that is not), values bytes.

    Every method may raise StoreError; methods taking a lease raise LeaseLost if it is gone.
    """

    async def get(self, key: str) -> KeyValue | None:
        """The key, or None if it does not exist."""
        ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with `prefix` (non-empty), sorted by key: one consistent snapshot,
        however many keys and bytes (on etcd it is read in pages, all at one revision)."""
        ...

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write unconditionally; returns the new revision. A put without a lease detaches the key
        from any lease it had (etcd semantics)."""
        ...

    async def delete(self, key: str) -> bool:
        """True if the key existed (and is now deleted)."""
        ...

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with `prefix` (non-empty) in one revision; returns how many."""
        ...

    async def compare_and_put(self, key: str, value: bytes, *, mod_revision: int, lease: int = 0) -> bool:
        """Write only if the key's mod_revision equals `mod_revision`, or, with `mod_revision=0`, only
        if the key does not exist (create_revision == 0). False, and nothing written, otherwise.
        The lease is checked only when the comparison holds (then LeaseLost if it is gone)."""
        ...

    async def compare_and_delete(self, key: str, *, mod_revision: int) -> bool:
        """Delete only if the key exists with this mod_revision (> 0); True if it was deleted."""
        ...

    async def put_fenced(self, key: str, value: bytes | None, *, guard_key: str, guard_create_revision: int) -> bool:
        """Write `value` to `key` (None: delete it) only while `guard_key` exists with this
        create_revision (an elected leader's epoch): a leader deposed while it paused writes
        nothing over its successor's, whatever it believed. False, and nothing written, otherwise."""
        ...

    async def write_batch(
        self, writes: Mapping[str, bytes | None], *, guard_key: str | None = None, guard_create_revision: int = 0
    ) -> bool:
        """Put each value (None: delete the key) in one transaction, at one revision: at most
        MAX_TXN_OPS keys (etcd's default limit on one transaction's operations; ValueError past it).
        With `guard_key`, only while it exists with `guard_create_revision` (> 0), as `put_fenced`:
        False, and nothing written, otherwise."""
        ...

    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease id (never 0). etcd may grant a longer TTL than asked (its minimum is ~2 s)."""
        ...

    async def refresh_lease(self, lease: int) -> None:
        """Restart the lease's TTL; LeaseLost if it no longer exists."""
        ...

    async def revoke_lease(self, lease: int) -> None:
        """Revoke the lease and delete its keys; revoking a lease that is already gone is a no-op."""
        ...

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncGenerator[WatchEvent, None]:
        """An async generator of the changes under `prefix`, in revision order.

        The watch is created when iteration starts (the first `__anext__`), not when this is
        called: to see every change after a snapshot, pass `start_revision` (events from that
        revision on, inclusive, are replayed first). Get-then-watch without gaps:
        `rev = await store.revision()`, then `get_prefix(...)`, then
        `watch_prefix(..., start_revision=rev + 1)`, ignoring events not newer than the mirror.
        Stop it with `aclose()` or by cancelling the consuming task. It raises StoreError when the
        connection is lost (RevisionCompacted if `start_revision` is too old), and ends when the
        store is closed.
        """
        ...

    async def revision(self) -> int:
        """The store's current revision (that of the last change)."""
        ...

    async def close(self) -> None:
        """Release the connection; running watches end. The store is not usable afterwards."""
        ...


def check_key(key: str) -> bytes:
    if not key:
        raise ValueError("a store key must be non-empty")
    return key.encode()


def check_batch(count: int, guard_key: str | None, guard_create_revision: int) -> None:
    """What `Store.write_batch` refuses (ValueError) before it asks the datastore."""
    if count > MAX_TXN_OPS:
        raise ValueError(f"write_batch takes at most {MAX_TXN_OPS} keys (etcd's --max-txn-ops), got {count}")
    if guard_key is not None and guard_create_revision <= 0:
        raise ValueError(f"write_batch needs the guard's create_revision (> 0), got {guard_create_revision}")


def check_prefix(prefix: str) -> bytes:
    # An empty prefix would mean "every key in the cluster": always a bug here.
    if not prefix:
        raise ValueError("a store prefix must be non-empty")
    return prefix.encode()


# --- etcd -----------------------------------------------------------------------------------


# etcd's errors in this process by (operation, kind: compacted, lease_lost, refused, token_expired,
# unavailable), counted where they are translated. A process is one daemon, whose metrics read this
# when scraped (gpufaas.metrics.ProcessErrors); a plain Counter, so an error costs a dict increment.
etcd_error_counts: collections.Counter[tuple[str, str]] = collections.Counter()


@contextlib.contextmanager
def _etcd_errors(what: str) -> Iterator[None]:
    """The one place where aetcd/gRPC errors become StoreError (or LeaseLost, RevisionCompacted)."""
    try:
        yield
    except aetcd.RevisionCompactedError as exc:
        etcd_error_counts[(what, "compacted")] += 1
        raise RevisionCompacted(f"etcd {what}: {exc}") from exc
    except aetcd.ClientError as exc:
        # aetcd maps gRPC NOT_FOUND to a bare ClientError caused by the AioRpcError. On the KV and
        # lease APIs NOT_FOUND only ever means "etcdserver: requested lease not found".
        cause = exc.__cause__
        if isinstance(cause, aetcd.rpc.AioRpcError) and cause.code() == aetcd.rpc.StatusCode.NOT_FOUND:
            etcd_error_counts[(what, "lease_lost")] += 1
            raise LeaseLost(f"etcd {what}: {exc}") from exc
        # A read pinned to a revision etcd compacted away (a page of `get_prefix`): OUT_OF_RANGE.
        if isinstance(cause, aetcd.rpc.AioRpcError) and cause.code() == aetcd.rpc.StatusCode.OUT_OF_RANGE:
            etcd_error_counts[(what, "compacted")] += 1
            raise RevisionCompacted(f"etcd {what}: {exc}") from exc
        etcd_error_counts[(what, _client_error_kind(exc))] += 1
        raise StoreError(f"etcd {what}: {exc}") from exc
    except (aetcd.rpc.RpcError, aetcd.rpc.BaseError, TimeoutError, OSError) as exc:
        etcd_error_counts[(what, "unavailable")] += 1
        raise StoreError(f"etcd {what}: {exc!r}") from exc


def _key_of(raw: bytes) -> str | None:
    """An etcd key as a `Store` key; None, with a warning naming it (its bytes escaped), for one
    that is not UTF-8 (put by hand: no daemon writes one). Every read and watch skips it: decoded
    strictly, its UnicodeDecodeError (no StoreError) ended the watch of its prefix, and under the
    scheduler's gpus/ failed every take of office."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        logger.warning("ignoring etcd key %r: it is not UTF-8", raw)
        return None


def _from_etcd(kv: Any) -> KeyValue | None:  # an etcd mvccpb.KeyValue (protobuf, untyped)
    """The key as stored; None for a key that is not UTF-8 (`_key_of`)."""
    key = _key_of(bytes(kv.key))
    if key is None:
        return None
    return KeyValue(
        key=key,
        value=bytes(kv.value),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        lease=int(kv.lease),
    )


@dataclass(frozen=True)
class EtcdCredentials:
    """etcd's own authentication: a user and its password (etcd's `root` for the daemons).

    Kept out of repr so that a logged store or flag set does not print the password."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """TLS to etcd: the cluster CA (PEM) etcd's certificate must be signed by, and the client
    certificate and key this process shows (etcd runs with --client-cert-auth). etcd's certificate
    is checked for the name `etcd` (gpufaas.tls.ETCD_NAME) whatever address is dialled."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)


class StoreOptions(TypedDict, total=False):
    """How `EtcdStore` reaches etcd (see its docstring)."""

    timeout_s: float
    credentials: EtcdCredentials | None
    enable_auth: bool
    tls: EtcdTls | None


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd's client on a TLS channel: aetcd 1.0 opens only plaintext ones, so the channel is
    made here and the rest of aetcd's connect (login, stubs, watcher) is done as it does it."""

    def __init__(self, tls: EtcdTls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import grpc

        self._tls_credentials = grpc.ssl_channel_credentials(tls.ca_pem, tls.key_pem, tls.cert_pem)

    @aetcd.client._handle_errors  # type: ignore[untyped-decorator]
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        import grpc.aio

        from gpufaas.tls import ETCD_NAME

        rpc: Any = aetcd.rpc
        options = [*self._options.items(), ("grpc.ssl_target_name_override", ETCD_NAME)]
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._tls_credentials, options=options)
        if self._username is not None and self._password is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            self.metadata = (("token", (await self.auth_stub.Authenticate(request, timeout=self._timeout)).token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.client.watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()


# etcd answers these when a token is no longer valid (a simple token expires after --auth-token-ttl
# of disuse, 300 s by default, and on every etcd restart); aetcd authenticates once per channel and
# never again, so EtcdStore re-authenticates and retries once.
_STALE_TOKEN = ("invalid auth token", "user name is empty", "auth: revision in header is old")
_AUTH_NOT_ENABLED = "authentication is not enabled"


def _stale_token(exc: BaseException) -> bool:
    return isinstance(exc, aetcd.exceptions.UnauthenticatedError) or any(text in str(exc) for text in _STALE_TOKEN)


def _client_error_kind(exc: aetcd.ClientError) -> str:
    """How `etcd_error_counts` files an error etcd's client raised: it did not reach etcd
    (unavailable), its token had expired (token_expired: renewed and retried), or etcd refused."""
    if isinstance(exc, aetcd.exceptions.ConnectionFailedError | aetcd.exceptions.ConnectionTimeoutError):
        return "unavailable"
    return "token_expired" if _stale_token(exc) else "refused"


T = TypeVar("T")


async def _range(client: aetcd.Client, start: bytes, end: bytes, timeout_s: float, *, limit: int, revision: int) -> Any:
    """One range call, [start, end) sorted by key, at most `limit` keys, at `revision` (0: the
    newest): aetcd's get_prefix takes neither a limit nor a revision. Its errors as aetcd's."""
    await client.connect()
    request = aetcd.Client._build_get_range_request(start, range_end=end, sort_order="ascend", sort_target="key")
    request.limit, request.revision = limit, revision
    try:
        return await client.kvstub.Range(request, timeout=timeout_s, metadata=client.metadata)
    except aetcd.rpc.AioRpcError as exc:
        aetcd.exceptions._handle_exception(exc)


def _too_large(exc: StoreError) -> bool:
    """Whether the call failed because its answer was over ETCD_MAX_RECEIVE_BYTES."""
    cause = exc.__cause__
    error = cause.__cause__ if isinstance(cause, aetcd.ClientError) else cause
    return (
        isinstance(error, aetcd.rpc.AioRpcError)
        and error.code() == aetcd.rpc.StatusCode.RESOURCE_EXHAUSTED
        and "larger than max" in str(error.details())
    )


class EtcdStore:
    """`Store` over etcd v3, through aetcd (asyncio gRPC).

    `timeout_s` bounds every unary call (a deadline); a stopped etcd answers at once with
    StoreError, a hung one after `timeout_s`. gRPC reconnects by itself once etcd is back.
    Use `await EtcdStore.open(endpoint)`, or construct and `await connect()`.

    With `credentials`, every call carries an etcd token for that user; an expired token is
    renewed (and the call retried once). With `enable_auth=True` as well, an etcd that has no
    authentication yet is given it on connect (user `root` is made with the password, then auth is
    enabled): the first daemon of a fresh cluster locks etcd to the holders of the password. A
    wrong password, or auth refused, is StoreError naming it.
    """

    def __init__(
        self,
        endpoint: str = "127.0.0.1:2379",
        *,
        timeout_s: float = 5.0,
        credentials: EtcdCredentials | None = None,
        enable_auth: bool = False,
        tls: EtcdTls | None = None,
    ) -> None:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdecimal():
            raise ValueError(f"an etcd endpoint is 'host:port', got {endpoint!r}")
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._enable_auth = enable_auth and credentials is not None
        self._tls = tls
        self._client = self._new_client()
        self._closed = False
        self._renewing: asyncio.Lock | None = None
        # The clients of running watches that have one of their own (with credentials): close()
        # closes them too, so that those watches end with the store as the others do.
        self._watch_clients: set[aetcd.Client] = set()

    def _new_client(self, *, login: bool = True) -> aetcd.Client:
        """A client of this store's etcd (over TLS where the store has it); `login`: with the
        store's credentials."""
        host, _, port = self.endpoint.rpartition(":")
        creds = self._credentials if login else None
        options: dict[str, Any] = {
            "host": host,
            "port": int(port),
            "timeout": self._timeout_s,
            "username": creds.user if creds else None,
            "password": creds.password if creds else None,
            "options": ETCD_CHANNEL_OPTIONS if not is_loopback(host) else ETCD_CHANNEL_OPTIONS | _NO_PROXY,
        }
        return aetcd.Client(**options) if self._tls is None else _TlsClient(self._tls, **options)

    @classmethod
    async def open(cls, endpoint: str = "127.0.0.1:2379", **options: Unpack[StoreOptions]) -> EtcdStore:
        """A connected store; StoreError if etcd does not answer (or refuses the credentials or
        the certificate)."""
        store = cls(endpoint, **options)
        try:
            await store.connect()
        except BaseException:
            await store.close()
            raise
        return store

    async def connect(self) -> None:
        """Open the channel and check that etcd answers (aetcd itself connects lazily)."""
        self._check_open()
        try:
            with _etcd_errors("connect"):
                await self._client.connect()
        except StoreError as exc:
            if not (self._enable_auth and _AUTH_NOT_ENABLED in str(exc)):
                raise
            await self._turn_auth_on()
            with contextlib.suppress(Exception):
                await self._client.close()  # the channel of the refused attempt
            with _etcd_errors("connect"):
                await self._client.connect()
        await self.revision()

    async def _turn_auth_on(self) -> None:
        """Make the user (root role) and enable etcd's authentication; idempotent, so daemons
        starting together may all try. etcd enables auth only once a `root` user exists, so the
        user that bootstraps must be `root`."""
        assert self._credentials is not None
        creds = self._credentials
        if creds.user != "root":
            raise StoreError(f"etcd at {self.endpoint} has no authentication; only user 'root' can enable it")
        bare = self._new_client(login=False)
        rpc: Any = aetcd.rpc  # generated protobuf and stubs, untyped
        try:
            with _etcd_errors("enable auth"):
                await bare.connect()
                auth = rpc.AuthStub(bare.channel)
                steps = (
                    ("add user root", auth.UserAdd, rpc.AuthUserAddRequest(name="root", password=creds.password)),
                    ("add role root", auth.RoleAdd, rpc.AuthRoleAddRequest(name="root")),
                    ("grant root", auth.UserGrantRole, rpc.AuthUserGrantRoleRequest(user="root", role="root")),
                    ("enable auth", auth.AuthEnable, rpc.AuthEnableRequest()),
                )
                for what, method, request in steps:
                    # Each may find its work done ("already exists") or, when another daemon
                    # enabled auth meanwhile, be refused: the connect that follows tells.
                    try:
                        await method(request, timeout=self._timeout_s)
                    except rpc.AioRpcError as exc:
                        logger.debug("etcd auth bootstrap: %s: %s", what, exc.details())
            logger.info("etcd authentication enabled (user root)")
        finally:
            with contextlib.suppress(Exception):
                await bare.close()

    async def _renew_token(self, stale: object) -> None:
        """A fresh token for the credentials, on the channel in use (so running watches stay),
        unless another call renewed it since `stale` (the metadata the failed call carried):
        a burst of calls that find the token expired logs in once, not once each."""
        assert self._credentials is not None
        if self._renewing is None:
            self._renewing = asyncio.Lock()
        async with self._renewing:
            client = self._client
            if client.metadata is not stale:
                return
            with _etcd_errors("authenticate"):
                reply = await aetcd.rpc.AuthStub(client.channel).Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._credentials.user, password=self._credentials.password),
                    timeout=self._timeout_s,
                )
            client.metadata = (("token", reply.token),)
            # aetcd's watcher keeps the metadata it was made with: new watches need the new token.
            watcher = getattr(client, "_watcher", None)
            if watcher is not None:
                watcher._metadata = client.metadata

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one etcd call with the error mapping; with credentials, renew a stale token and retry once."""
        self._check_open()
        token_used = self._client.metadata
        try:
            with _etcd_errors(what):
                return await call()
        except StoreError as exc:
            if self._credentials is None or not _stale_token(exc.__cause__ or exc):
                raise
        await self._renew_token(token_used)
        with _etcd_errors(what):
            return await call()

    def _check_open(self) -> None:
        # aetcd would silently open a new channel after close(): that is a leak, and a bug here.
        if self._closed:
            raise RuntimeError("EtcdStore used after close()")

    async def get(self, key: str) -> KeyValue | None:
        raw = check_key(key)
        kv = await self._call("get", lambda: self._client.get(raw))
        return None if kv is None else _from_etcd(kv)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        raw = check_prefix(prefix)
        for _ in range(GET_PREFIX_ATTEMPTS - 1):
            try:
                return await self._read_pages(raw)
            except RevisionCompacted as exc:
                logger.info("etcd compacted under a read of %s (%s); reading it again", prefix, exc)
        return await self._read_pages(raw)

    async def _read_pages(self, raw: bytes) -> list[KeyValue]:
        """The keys under `raw` in pages of at most GET_PREFIX_PAGE_KEYS keys (fewer where an
        answer is too large to take), each from the last key read on, every page at the first
        one's revision: one snapshot, as one range call would read. RevisionCompacted when that
        revision was compacted between two pages."""
        end = aetcd.utils.prefix_range_end(raw)
        kvs: list[KeyValue] = []
        start, limit, revision = raw, GET_PREFIX_PAGE_KEYS, 0  # revision 0: the newest
        while True:
            page = functools.partial(_range, self._client, start, end, self._timeout_s, limit=limit, revision=revision)
            try:
                reply = await self._call("get_prefix", page)
            except StoreError as exc:
                if limit == 1 or not _too_large(exc):
                    raise
                limit //= 2
                continue
            kvs.extend(kv for kv in map(_from_etcd, reply.kvs) if kv is not None)
            revision = revision or int(reply.header.revision)
            if not reply.more or not reply.kvs:
                return kvs
            start = bytes(reply.kvs[-1].key) + b"\0"  # the next key after the last one read

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        raw = check_key(key)
        result = await self._call("put", lambda: self._client.put(raw, value, lease=lease))
        return int(result.header.revision)

    async def delete(self, key: str) -> bool:
        raw = check_key(key)
        result = await self._call("delete", lambda: self._client.delete(raw))
        return result is not None

    async def delete_prefix(self, prefix: str) -> int:
        raw = check_prefix(prefix)
        result = await self._call("delete_prefix", lambda: self._client.delete_prefix(raw))
        return int(result.deleted)

    async def compare_and_put(self, key: str, value: bytes, *, mod_revision: int, lease: int = 0) -> bool:
        raw = check_key(key)
        self._check_open()
        txn = self._client.transactions
        compare = txn.create(raw) == 0 if mod_revision == 0 else txn.mod(raw) == mod_revision
        succeeded, _ = await self._call(
            "compare_and_put",
            lambda: self._client.transaction(compare=[compare], success=[txn.put(raw, value, lease=lease)], failure=[]),
        )
        return bool(succeeded)

    async def compare_and_delete(self, key: str, *, mod_revision: int) -> bool:
        raw = check_key(key)
        if mod_revision <= 0:
            raise ValueError(f"compare_and_delete needs the key's mod_revision (> 0), got {mod_revision}")
        self._check_open()
        txn = self._client.transactions
        succeeded, _ = await self._call(
            "compare_and_delete",
            lambda: self._client.transaction(
                compare=[txn.mod(raw) == mod_revision], success=[txn.delete(raw)], failure=[]
            ),
        )
        return bool(succeeded)

    async def put_fenced(self, key: str, value: bytes | None, *, guard_key: str, guard_create_revision: int) -> bool:
        raw, guard = check_key(key), check_key(guard_key)
        if guard_create_revision <= 0:
            raise ValueError(f"put_fenced needs the guard's create_revision (> 0), got {guard_create_revision}")
        self._check_open()
        txn = self._client.transactions
        write = txn.delete(raw) if value is None else txn.put(raw, value)
        succeeded, _ = await self._call(
            "put_fenced",
            lambda: self._client.transaction(
                compare=[txn.create(guard) == guard_create_revision], success=[write], failure=[]
            ),
        )
        return bool(succeeded)

    async def write_batch(
        self, writes: Mapping[str, bytes | None], *, guard_key: str | None = None, guard_create_revision: int = 0
    ) -> bool:
        raw = {check_key(key): value for key, value in writes.items()}
        check_batch(len(raw), guard_key, guard_create_revision)
        self._check_open()
        if not raw:
            return True  # nothing to write: etcd is not asked (nor the guard checked)
        txn = self._client.transactions
        ops = [txn.delete(key) if value is None else txn.put(key, value) for key, value in raw.items()]
        compare = [] if guard_key is None else [txn.create(check_key(guard_key)) == guard_create_revision]
        succeeded, _ = await self._call(
            "write_batch", lambda: self._client.transaction(compare=compare, success=ops, failure=[])
        )
        return bool(succeeded)

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._call("grant_lease", lambda: self._client.lease(ttl_s))
        return int(lease.id)

    async def refresh_lease(self, lease: int) -> None:
        reply = await self._call("refresh_lease", lambda: self._client.refresh_lease(lease))
        # etcd answers a keep-alive for an unknown lease with TTL 0, not with an error.
        if reply is None or int(reply.TTL) <= 0:
            etcd_error_counts[("refresh_lease", "lease_lost")] += 1
            raise LeaseLost(f"etcd lease {lease:x} expired or was revoked")

    async def revoke_lease(self, lease: int) -> None:
        with contextlib.suppress(LeaseLost):
            await self._call("revoke_lease", lambda: self._client.revoke_lease(lease))

    async def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> AsyncGenerator[WatchEvent, None]:
        raw = check_prefix(prefix)
        self._check_open()
        # etcd checks a new watch against the token its stream was opened with, and aetcd keeps one
        # stream per client for good: once that token expires, new watches on it are silently
        # refused. With credentials, each watch gets a client (a stream, a token) of its own; an
        # open stream keeps delivering after its token expires.
        client = self._new_client() if self._credentials is not None else self._client
        if client is not self._client:
            self._watch_clients.add(client)
        try:
            with _etcd_errors("watch_prefix"):
                watch = await client.watch_prefix(raw, start_revision=start_revision or None)
            try:
                with _etcd_errors("watch_prefix"):
                    async for event in watch:
                        kv = event.kv
                        key = _key_of(bytes(kv.key))
                        if key is None:
                            continue
                        if event.kind == "DELETE":
                            yield WatchEvent("delete", key, b"", int(kv.mod_revision))
                        else:
                            yield WatchEvent("put", key, bytes(kv.value), int(kv.mod_revision))
            finally:
                # Tell etcd to drop the watch; bounded, and best effort (the stream may be gone).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.cancel(), self._timeout_s)
        finally:
            if client is not self._client:
                self._watch_clients.discard(client)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), self._timeout_s)

    async def revision(self) -> int:
        # aetcd's get() drops the response header when the key is missing; a range read does
        # not. "\0" prefixes no key of ours, so this reads nothing but the header.
        result = await self._call("revision", lambda: self._client.get_prefix(b"\0", keys_only=True))
        return int(result.header.revision)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in [self._client, *self._watch_clients]:
            with contextlib.suppress(Exception):
                await client.close()


# --- lease keeping --------------------------------------------------------------------------


class LeaseKeeper:
    """One lease per daemon, kept alive by one asyncio task.

    The task refreshes the lease every `refresh_interval_s` (default ttl_s / 3). When the store
    says the lease is gone (LeaseLost: it was revoked, or an outage outlasted the TTL, which shows
    up on the first refresh that reaches the store), it grants a new lease and awaits
    `on_regrant(new_lease)`, which must (idempotently) re-put the daemon's liveness keys under it;
    `lease` is the new id by then. Transient errors are retried with capped exponential backoff;
    the task never dies of an exception (unexpected ones are logged and retried too).
    `sleep` is injectable so tests can drive it with a fake clock.
    """

    def __init__(
        self,
        store: Store,
        ttl_s: int,
        *,
        on_regrant: Callable[[int], Awaitable[None]],
        refresh_interval_s: float | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a lease TTL must be positive, got {ttl_s}")
        self._store = store
        self._ttl_s = ttl_s
        self._on_regrant = on_regrant
        self._interval_s = refresh_interval_s if refresh_interval_s is not None else ttl_s / 3
        self._sleep = sleep
        # Lifecycle: 0 before start(); replaced by each regrant; kept after stop() for logging.
        self._lease = 0
        self._task: asyncio.Task[None] | None = None
        self.num_regrants = 0

    @property
    def lease(self) -> int:
        """The current lease id (0 before start())."""
        return self._lease

    @property
    def running(self) -> bool:
        """True between start() and stop() (the task never ends by itself)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> int:
        """Grant the first lease (StoreError if the store is unreachable) and start refreshing it."""
        if self._task is not None:
            raise RuntimeError("LeaseKeeper already started")
        self._lease = await self._store.grant_lease(self._ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease-keeper-{self._lease:x}")
        return self._lease

    async def stop(self, revoke: bool = True) -> None:
        """Stop refreshing; with `revoke`, revoke the lease so its keys go at once (best effort)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if revoke and self._lease:
            try:
                await self._store.revoke_lease(self._lease)
            except StoreError as exc:
                logger.warning("could not revoke lease %x (it will expire by itself): %s", self._lease, exc)

    def _backoff_s(self, failures: int) -> float:
        return float(min(self._interval_s, min(0.1, self._interval_s) * 2 ** min(failures, 16)))

    async def _run(self) -> None:
        failures = 0
        delay_s = self._interval_s
        while True:
            await self._sleep(delay_s)
            try:
                await self._store.refresh_lease(self._lease)
            except LeaseLost:
                logger.warning("lease %x lost; granting a new one", self._lease)
                await self._regrant()
            except StoreError as exc:
                logger.warning("refreshing lease %x failed (retrying): %s", self._lease, exc)
                delay_s = self._backoff_s(failures)
                failures += 1
                continue
            except Exception:
                logger.exception("unexpected error refreshing lease %x (retrying)", self._lease)
                delay_s = self._backoff_s(failures)
                failures += 1
                continue
            failures = 0
            delay_s = self._interval_s

    async def _regrant(self) -> None:
        """Grant a lease and run on_regrant under it, until both succeed."""
        lease = 0
        failures = 0
        while True:
            try:
                if not lease:
                    lease = await self._store.grant_lease(self._ttl_s)
                    self._lease = lease
                    self.num_regrants += 1
                await self._on_regrant(lease)
                return
            except LeaseLost:
                lease = 0  # the new lease expired too (a long outage): grant another
            except StoreError as exc:
                logger.warning("re-granting lease failed (retrying): %s", exc)
            except Exception:
                logger.exception("on_regrant(%x) failed (retrying)", lease)
            await self._sleep(self._backoff_s(failures))
            failures += 1


# --- list, then watch -----------------------------------------------------------------------

ListHandler = Callable[[list[KeyValue], int], Awaitable[None] | None]
EventHandler = Callable[[WatchEvent], Awaitable[None] | None]


async def list_and_watch(
    store: Store,
    prefix: str,
    *,
    on_list: ListHandler,
    on_event: EventHandler,
    listed_at: int | None = None,
    retry_s: float = 0.5,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Keep a mirror of `prefix` (Kubernetes' reflector): list it (`on_list(kvs, revision)`: the
    whole state, to replace the mirror with), then watch from that revision (`on_event`), for
    ever. A watch that breaks is resumed after the last event handled (a handler's StoreError
    breaks it before its event; the other events of that event's revision, one etcd transaction's,
    are not skipped); one whose revision was compacted away, or that finds the store's revision
    gone back (etcd lost its data), lists again. Any other
    error of a handler is logged, and the watch goes on. `listed_at`: the caller listed already,
    at this revision (so that a daemon starts with its mirror filled, or fails to start). Runs
    until cancelled or the store is closed; store errors are retried every `retry_s`. Handlers
    may be coroutines."""
    revision = listed_at  # None: list first
    # The revision a resumed watch starts at, and the keys of it handled already: a transaction's
    # events share one revision, and a break among them must give the rest again, not skip them.
    resume_at, handled = 0, set[str]()
    broke = False  # the watch broke: check that the store has the history it resumes from
    while True:
        try:
            if broke and revision is not None and await store.revision() < resume_at - 1:
                # etcd came back without the history seen (its data lost: a new cluster): a watch
                # from a revision it has not reached would wait, silently, for it. List again.
                logger.warning("watch on %s: the store's revision went back; listing again", prefix)
                revision, resume_at = None, 0
            broke = False
            if revision is None:
                # Taken as listed only once the list is in: a read or handler that fails between
                # the two must list again, not watch on from a revision the mirror never had.
                listing_at = await store.revision()
                kvs = await store.get_prefix(prefix)
                await _take_in(functools.partial(on_list, kvs, listing_at), f"watch on {prefix}: its list")
                revision = listing_at
            if resume_at <= revision:
                resume_at, handled = revision + 1, set()
            async for event in store.watch_prefix(prefix, start_revision=resume_at):
                if event.mod_revision == resume_at and event.key in handled:
                    continue  # taken in before the watch broke
                await _take_in(functools.partial(on_event, event), f"watch on {prefix}: the change to {event.key}")
                if event.mod_revision != resume_at:
                    resume_at, handled = event.mod_revision, set()
                handled.add(event.key)
            return  # the watch ended: the store was closed
        except asyncio.CancelledError:
            raise
        except RevisionCompacted as exc:
            logger.warning("watch on %s: %s; listing again", prefix, exc)
            revision = None
        except StoreError as exc:
            logger.warning("watch on %s failed (%s); retrying", prefix, exc)
            await sleep(retry_s)
            broke = True


async def _take_in(handle: Callable[[], Awaitable[None] | None], what: str) -> None:
    """Run a list_and_watch handler. Its StoreError goes on up (its own write failed: retried,
    with what it was given); any other error is logged: one value a handler cannot take (a newer
    daemon's record, during a rolling upgrade) must not end the mirror for good."""
    try:
        await _maybe_await(handle())
    except StoreError:
        raise
    except Exception:
        logger.exception("%s could not be taken in", what)


async def _maybe_await(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result
