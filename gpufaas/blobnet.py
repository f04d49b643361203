"""Blobs over the network at the speed of the hardware: a small HTTP/1.1 blob server that every
holder (gateway, node) runs, and the blocking client functions that fetch and upload through it.

The protocol (plain HTTP, so curl speaks it too):

    GET  /blobs/sha256:<hex>         the blob (Range: bytes=N- resumes at N: 206)
    HEAD /blobs/sha256:<hex>         200 and its Content-Length if complete; 404 with
                                     Upload-Offset: N where N bytes of an upload are here; 409
                                     (no offset) while another transfer writes it
    PUT  /blobs/sha256:<hex>?size=N  upload (servers that take them): Upload-Offset: K says where
                                     this body starts (0 by default; 409 with the server's
                                     offset when it is not that, 409 without while another
                                     transfer writes it); 201 once the whole blob arrived and
                                     hashed to its name, 400 if it did not. With Expect:
                                     100-continue (this module's client sends it) every refusal
                                     comes before the body is sent, and 100 Continue once the
                                     body is wanted

Why not the gateway's ASGI server: uvicorn copies each body chunk several times and wakes the
event loop per 64 KiB; here one thread per connection sends with sendfile(2) (no copy in user
space) and receives into large buffers that another thread hashes (gpufaas.blobs' `pump`), so
a blob crosses loopback at a few GB/s. The same bytes may also go through the gateway's API
(`PUT /system/blobs/...`): slower, but it needs no second port.

Every request needs an Authorization header that the holder's `authorize` accepts. With TLS
(gpufaas.tls: the process's link TLS unless one is passed), the server takes only clients showing
a certificate of the cluster CA whose role belongs there (a node fetching), and the client checks
the holder's the same way; the sendfile path then becomes TLS writes (the bytes are encrypted in
user space). A server that takes uploads (the gateway's) also takes clients in plain HTTP, as the
gateway's public port does: users' CLIs, which hold no certificate; the nodes always come in TLS.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import logging
import os
import re
import socket
import socketserver
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpufaas.blobs import BlobBusy, BlobStore, BlobWriter, CorruptBlob
from gpufaas.packages import DIGEST_PATTERN, DISK_FULL_ERRNOS, InvalidPackage
from gpufaas.tls import LinkTls, PeerRefused, links_of

log = logging.getLogger("gpufaas.blobnet")

UPLOAD_OFFSET = "Upload-Offset"
SEND_CHUNK_BYTES = 16 << 20  # sendfile per call: progress is reported this often
HEADER_LIMIT_BYTES = 16 << 10
DEFAULT_TIMEOUT_S = 60.0
# A request's line and headers (and the wait for them on a kept-alive connection) within this in
# all: anyone may connect (users upload in plain HTTP), and a head trickled a byte at a time, each
# within DEFAULT_TIMEOUT_S, would hold a connection's slot for ever before any credential is read.
HEAD_TIMEOUT_S = DEFAULT_TIMEOUT_S
# The slowest a fetch may go on average: a holder that trickles bytes (each read within the
# timeout) is given up on once the whole blob at this rate, plus the timeout, has passed. Low, as
# many nodes may fetch from one gateway at once over a shared link; what arrived is kept and the
# next try resumes from it, so a deadline met by a slow but honest holder costs a reconnection.
MIN_RATE_BYTES_S = 1 << 20
EXPECT_WAIT_S = 5.0  # for 100 Continue; a holder silent that long gets the body anyway
TLS_SEND_BYTES = 1 << 20  # what one TLS send takes from the file
_TLS_HANDSHAKE = b"\x16"  # the first byte a TLS client sends (a handshake record)
HANDSHAKE_S = 10.0  # a TLS client that has not finished its handshake by then is cut off
# Connections one blob server serves at once (a thread each, idle ones kept for DEFAULT_TIMEOUT_S);
# one more is answered 503 and closed at once, before any thread is made for it.
DEFAULT_MAX_CONNECTIONS = 256
_BUSY_BODY = json.dumps({"error": "this blob holder serves too many connections; retry later", "status": 503})
_BUSY_REPLY = (
    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n{_BUSY_BODY}"
).encode()
_PATH = re.compile(r"/blobs/(" + DIGEST_PATTERN.pattern + r")")
_RANGE = re.compile(r"bytes=(\d{1,20})-$")  # (more digits: past any file, and past what int() takes)

# authorize(method, Authorization header or None) -> None to go on, or (status, message)
Authorizer = Callable[[str, str | None], tuple[int, str] | None]


class TransferError(InvalidPackage):
    """A blob could not be moved: the holder refused or broke off (`status` its HTTP status,
    0 when the connection failed). What arrived before a break is kept for a resume."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def send_range(sock: socket.socket, source: IO[bytes], offset: int, count: int) -> int:
    """Send `count` bytes of `source` from `offset`; the bytes sent (fewer where the file is shorter).
    sendfile(2) on a plain socket; under TLS the bytes are encrypted in user space, read in large
    pieces (socket.sendfile's fallback reads 8 KiB at a time: a third of the speed)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.sendfile(source, offset, count)
    buffer = bytearray(TLS_SEND_BYTES)
    sent = 0
    while sent < count:
        n = os.preadv(source.fileno(), [memoryview(buffer)[: min(TLS_SEND_BYTES, count - sent)]], offset + sent)
        if n == 0:
            break
        sock.sendall(memoryview(buffer)[:n])
        sent += n
    return sent


# --- the server ---------------------------------------------------------------------------------


class BlobServer:
    """Serves `store` on a port of its own (threads; see the module docstring). `accept_uploads`:
    take PUTs (the gateway), up to `max_blob_bytes` each; `on_stored(digest)` runs (in the
    connection's thread) after each blob an upload completed; `on_missing(digest)` (in the
    connection's thread, may block) is asked for the path of a blob a GET wants that is not
    here, e.g. once fetched from another holder (None: 404 as without it). `tls`: True, the
    process's link TLS (plain where none); False, plain; or the one given. At most
    `max_connections` connections are served at once (a thread each); more are answered 503
    and closed without a thread, so a peer opening many cannot exhaust threads or memory."""

    def __init__(
        self,
        store: BlobStore,
        authorize: Authorizer,
        *,
        accept_uploads: bool = False,
        max_blob_bytes: int = 1 << 40,
        on_stored: Callable[[str], None] | None = None,
        on_missing: Callable[[str], Path | None] | None = None,
        tls: LinkTls | bool = True,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.store, self.authorize, self.on_stored, self.on_missing = store, authorize, on_stored, on_missing
        self.accept_uploads = accept_uploads
        self.max_blob_bytes = max_blob_bytes
        self.tls = links_of(tls)
        # For metrics and tests; added to by the connections' threads, under `_counted`: `+=` on
        # an attribute is a read and a write, which Python does not promise to keep together.
        self.bytes_sent = 0
        self.bytes_received = 0
        self._counted = threading.Lock()
        self.max_connections = max_connections
        self.connections_refused = 0  # past `max_connections`, for metrics
        self._server: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None

    def count(self, *, sent: int = 0, received: int = 0) -> None:
        """Add to the bytes sent and received (from any connection's thread)."""
        with self._counted:
            self.bytes_sent += sent
            self.bytes_received += received

    def start(self, listen: str = "127.0.0.1:0") -> str:
        """Listen on HOST:PORT (port 0: any free one); returns the bound HOST:PORT."""
        host, _, port = listen.rpartition(":")
        server = _ThreadingServer((host.strip("[]") or "127.0.0.1", int(port)), _Handler)
        server.blob_server = self
        server.slots = threading.BoundedSemaphore(self.max_connections)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="blob server", daemon=True)
        self._thread.start()
        bound_host, bound_port = server.server_address[:2]
        return f"{bound_host!s}:{bound_port}"

    def stop(self) -> None:
        """Stop accepting; transfers under way end when their clients do (daemon threads)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128
    blob_server: BlobServer
    slots: threading.BoundedSemaphore  # one per connection served now (BlobServer.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection if a slot is free; else 503 (plain HTTP only: a TLS
        client sees the connection close) and close, in this, the accepting thread."""
        if not self.slots.acquire(blocking=False):
            self.blob_server.connections_refused += 1
            if self.blob_server.tls is None:
                with contextlib.suppress(OSError):
                    request.setblocking(False)  # never wait on a client that does not read
                    request.send(_BUSY_REPLY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread was started to release it
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """What escaped a connection's handler, logged (socketserver prints a traceback to
        stderr): a connection error (the client went, reset, timed out) in one line; anything
        else with its traceback, through logging."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("blob client %s broke off: %s", client_address[0], error)
        else:
            log.exception("blob request of %s failed", client_address[0])

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Under TLS: the handshake and the peer's role checked in the connection's own thread
        (a slow or hostile client holds up only itself), then the request."""
        blobs = self.blob_server
        if blobs.tls is not None:
            request.settimeout(HANDSHAKE_S)
            try:
                # A user's client in plain HTTP (uploads, as on the gateway's public port) goes on.
                user_in_plain = blobs.accept_uploads and request.recv(1, socket.MSG_PEEK) != _TLS_HANDSHAKE
                if not user_in_plain:
                    request = blobs.tls.server.wrap_socket(request, server_side=True)
                    blobs.tls.check(request.getpeercert(), "blob-server")
            except (OSError, PeerRefused) as exc:
                log.warning("blob client %s refused: %s", client_address[0], exc)
                request.close()
                return
            if isinstance(request, ssl.SSLSocket):
                # wrap_socket detached the accepted socket, which is all socketserver closes after.
                try:
                    super().finish_request(request, client_address)
                finally:
                    request.close()
                return
        super().finish_request(request, client_address)


class _HeadIO(socket.SocketIO):
    """A connection's reads (under the handler's buffered rfile), bounded while `deadline`
    (time.monotonic()) is set: past it TimeoutError, however steadily the client trickles."""

    deadline: float | None = None

    def readinto(self, b: Any) -> int | None:
        if self.deadline is not None:
            left_s = self.deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError("the request's head did not arrive in time")
            self._sock.settimeout(min(left_s, DEFAULT_TIMEOUT_S))  # type: ignore[attr-defined]
        return super().readinto(b)


class _ClientGone(Exception):
    """Reading an upload's body failed: the client broke off (its partial is kept for a resume)."""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ThreadingServer
    timeout = DEFAULT_TIMEOUT_S
    _expecting = False  # this request's client waits for 100 Continue before its body

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # (its socket stays open: only this reader goes)
        self._head = _HeadIO(self.connection, "rb")
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        self._head.deadline = time.monotonic() + HEAD_TIMEOUT_S  # (lifted once the head is read)
        super().handle_one_request()

    def _blob(self) -> tuple[BlobServer, str, dict[str, list[str]]] | None:
        """Check the credential and the path; answers and returns None if the request stops here."""
        blobs = self.server.blob_server
        refused = blobs.authorize(self.command, self.headers.get("Authorization"))
        if refused is not None:
            self._answer(*refused)
            return None
        url = urllib.parse.urlsplit(self.path)
        match = _PATH.fullmatch(url.path)
        if match is None:
            self._answer(404, f"no such path {url.path!r}; blobs are at /blobs/sha256:<hex>")
            return None
        return blobs, match.group(1), urllib.parse.parse_qs(url.query)

    def parse_request(self) -> bool:
        self._expecting = False  # (one handler serves every request of a kept-alive connection)
        parsed = super().parse_request()
        self._head.deadline = None  # the body: each read within the timeout, as long as it takes
        self.connection.settimeout(self.timeout)
        return parsed

    def handle_expect_100(self) -> bool:
        # The interim 100 Continue is sent by do_PUT once it wants the body (`_continue`): a
        # refusal (busy, a wrong offset, stored already) then costs the client none of it.
        self._expecting = True
        return True

    def _continue(self) -> None:
        if self._expecting:
            self._expecting = False
            self.send_response_only(100)
            self.end_headers()

    def do_HEAD(self) -> None:
        found = self._blob()
        if found is None:
            return
        blobs, digest, _ = found
        if blobs.store.busy(digest) and not blobs.store.has(digest):
            # Asked before an upload: wait and ask again, rather than PUT a body to be refused.
            self._answer(409, f"blob {digest} is being written by another transfer; retry when it ends")
            return
        self._get(head=True, found=found)

    def do_GET(self) -> None:
        self._get(head=False)

    def _get(self, *, head: bool, found: tuple[BlobServer, str, dict[str, list[str]]] | None = None) -> None:
        found = found or self._blob()
        if found is None:
            return
        blobs, digest, _ = found
        path = blobs.store.path(digest)
        if path is None and not head and blobs.on_missing is not None and not blobs.store.partial_size(digest):
            path = blobs.on_missing(digest)  # (not while an upload of it is under way here)
        if path is None:
            offset = blobs.store.partial_size(digest)
            self._answer(404, f"blob {digest} is not here", {UPLOAD_OFFSET: str(offset)}, head=head)
            return
        try:
            source = path.open("rb")
        except FileNotFoundError:  # removed since
            self._answer(404, f"blob {digest} is not here", head=head)
            return
        with source:
            size = os.fstat(source.fileno()).st_size
            start = 0
            wanted = self.headers.get("Range")
            if wanted is not None:
                match = _RANGE.fullmatch(wanted.strip())
                if match is None or int(match.group(1)) > size:
                    self._answer(416, f"range {wanted!r} is not bytes=N- within {size} bytes", head=head)
                    return
                start = int(match.group(1))
            self.send_response(206 if wanted is not None else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size - start))
            if wanted is not None:
                self.send_header("Content-Range", f"bytes {start}-{max(start, size - 1)}/{size}")
            self.end_headers()
            if head:
                return
            sent = send_range(self.connection, source, start, size - start)
            blobs.count(sent=sent)
            if sent != size - start:
                self.close_connection = True

    def do_PUT(self) -> None:
        found = self._blob()
        if found is None:
            return
        blobs, digest, query = found
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._answer(411, "send a blob with a Content-Length (no chunked encoding): its size is known")
            return
        if not blobs.accept_uploads:
            self._answer(405, "this holder does not take uploads; upload through the gateway")
            return
        try:
            size = int(query.get("size", [""])[0])
            offset = int(self.headers.get(UPLOAD_OFFSET, "0"))
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            size = offset = length = -1
        if min(size, offset, length) < 0:  # (a negative Content-Length: `_discard` would read to the end)
            self._answer(
                400, "an upload needs ?size=BYTES, a Content-Length and (to resume) Upload-Offset, none negative"
            )
            return
        if size > blobs.max_blob_bytes:
            self._answer(413, f"a blob may not be larger than {blobs.max_blob_bytes} bytes (the gateway's limit)")
            return
        writer = self._writer(blobs.store, digest, size, length)
        if writer is None or not self._receive(writer, blobs, size, offset, length):
            return
        if blobs.on_stored is not None:
            blobs.on_stored(digest)
        self._answer(201, "stored", {UPLOAD_OFFSET: str(size)})

    def _writer(self, store: BlobStore, digest: str, size: int, length: int) -> BlobWriter | None:
        """The writer an upload of `length` bytes goes to, or None once answered (its body
        discarded): 201 when the blob is stored already, 409 while another upload of it runs,
        400 when what is on disk of it is wrong, 507 (500) when its partial cannot be opened."""
        if store.has(digest):
            self._discard(length)
            self._answer(201, "stored", {UPLOAD_OFFSET: str(size)})
            return None
        try:
            return store.writer(digest, size)
        except BlobBusy as exc:
            status, message = 409, str(exc)
        except CorruptBlob as exc:
            status, message = 400, str(exc)
        except OSError as exc:  # (no inode left for its partial; the partial unreadable)
            status, message = 507 if exc.errno in DISK_FULL_ERRNOS else 500, f"storing blob {digest} failed: {exc}"
        self._discard(length)
        self._answer(status, message)
        return None

    def _receive(self, writer: BlobWriter, blobs: BlobServer, size: int, offset: int, length: int) -> bool:
        """Append the body (`length` bytes from `offset` of the blob's `size`) and commit the blob; True once it is
        stored. False once answered (409 when the upload does not start where the partial ends
        or does not end the blob, 400 when the bytes are wrong), or when the client broke off
        (the connection closes; the partial is kept for a resume)."""
        with writer:
            if offset != writer.offset or offset + length != size:
                current = writer.offset
                writer.close()
                self._discard(length)
                self._answer(
                    409,
                    f"this upload starts at byte {offset} and sends {length} of {size}; the gateway has {current}: "
                    f"send from Upload-Offset {current}",
                    {UPLOAD_OFFSET: str(current)},
                )
                return False
            self._continue()
            try:
                got = writer.pump(self._body_reader(), length)
            except _ClientGone:
                got = -1
            except OSError as exc:  # this holder's own write (its disk full): the client must hear it
                self._answer_storing_failed(writer.digest, exc)
                return False
            blobs.count(received=max(0, got))
            if got != length:
                self.close_connection = True  # the client broke off: keep the partial for a resume
                return False
            try:
                writer.commit()
            except CorruptBlob as exc:
                self._answer(400, str(exc))
                return False
            except OSError as exc:  # its flush or rename (the disk full as it flushed): as a write's
                self._answer_storing_failed(writer.digest, exc)
                return False
        return True

    def _answer_storing_failed(self, digest: str, exc: OSError) -> None:
        self._answer(507 if exc.errno in DISK_FULL_ERRNOS else 500, f"storing blob {digest} failed: {exc}")

    def _body_reader(self) -> Callable[[memoryview], int | None]:
        """readinto of the request's body whose failures (the client broke off, or went silent)
        are _ClientGone: told apart from a failure to write what it sent."""

        def read_into(view: memoryview) -> int | None:
            try:
                return self.rfile.readinto(view)
            except OSError as exc:
                raise _ClientGone(str(exc)) from exc

        return read_into

    def _discard(self, length: int) -> None:
        """Read and drop a body this server will not keep (so the connection can go on)."""
        if self._expecting:
            self.close_connection = True  # never asked for: the client sends none, or closes
            return
        if length > 1 << 20:
            self.close_connection = True  # cheaper to drop the connection than to read it
            return
        with contextlib.suppress(OSError):
            self.rfile.read(length)

    def _answer(self, status: int, message: str, headers: dict[str, str] | None = None, *, head: bool = False) -> None:
        head = head or self.command == "HEAD"  # never a body after HEAD: a kept-alive client would misread it
        if self.command == "PUT" and status >= 400:
            self.close_connection = True  # its body is left unread: the connection cannot go on
        body = json.dumps({"error" if status >= 400 else "message": message, "status": status}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="gpufaas"')
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)


# --- the client ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    headers: dict[str, str]
    leftover: bytes  # body bytes read along with the headers

    def number(self, name: str, default: int) -> int:
        """Header `name` as a whole number of bytes (`default` where absent or empty);
        TransferError if it is something else (the caller passes over this holder)."""
        value = self.headers.get(name.lower(), "")
        if not value:
            return default
        if not (value.isascii() and value.isdecimal()):
            raise TransferError(f"the blob holder's {name} header is {value[:40]!r}, not a number of bytes")
        return int(value)


class _Connection:
    """One HTTP/1.1 connection to a holder (blocking)."""

    def __init__(self, base_url: str, timeout_s: float, tls: LinkTls | bool = True) -> None:
        """Under TLS (the process's, unless `tls` says) the holder is reached over TLS whatever
        the URL's scheme says (holders advertise http:// URLs), and its role checked."""
        not_one = TransferError(f"{base_url!r} is not an http://HOST:PORT blob address")
        try:
            url = urllib.parse.urlsplit(base_url)
            hostname, port = url.hostname, url.port or 80
        except ValueError:  # (a bracket not closed, a port that is not one)
            raise not_one from None
        if url.scheme not in ("http", "https") or not hostname:
            raise not_one
        self.host = url.netloc
        self.prefix = url.path.rstrip("/")
        links = links_of(tls)
        try:
            sock = socket.create_connection((hostname, port), timeout=timeout_s)
        except (OSError, UnicodeError) as exc:  # (UnicodeError: a host name IDNA cannot encode)
            raise TransferError(f"cannot reach the blob holder at {base_url}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if links is not None:
                sock = links.client.wrap_socket(sock)
                links.check(sock.getpeercert(), "blob-client")
        except (OSError, PeerRefused) as exc:
            sock.close()
            raise TransferError(f"the blob holder at {base_url} is not one of this cluster's: {exc}") from None
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # time.monotonic() past which no read waits (`limit`)
        self._late = ""
        self._buffer = b""

    def close(self) -> None:
        self.sock.close()

    def limit(self, seconds: float) -> None:
        """Bound every read from now on to `seconds` from now in all: a read past them raises
        TimeoutError, however steadily a holder trickles bytes within the per-read timeout."""
        self.deadline = time.monotonic() + seconds
        self._late = f"the transfer's deadline of {seconds:.1f} s passed"

    def _recv_into(self, view: memoryview) -> int:
        """sock.recv_into, waiting no longer than the deadline (`limit`) leaves."""
        if self.deadline is None:
            return self.sock.recv_into(view)
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(self._late)
        if left_s < self.timeout_s:
            self.sock.settimeout(left_s)
        try:
            return self.sock.recv_into(view)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise TimeoutError(self._late) from None
            raise

    def _recv(self, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        return bytes(buffer[: self._recv_into(memoryview(buffer))])

    def send_head(self, method: str, path: str, headers: dict[str, str]) -> None:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def reply(self) -> _Reply:
        data = self._buffer
        while b"\r\n\r\n" not in data:
            if len(data) > HEADER_LIMIT_BYTES:
                raise TransferError("the blob holder's answer has oversized headers")
            chunk = self._recv(65536)
            if not chunk:
                raise TransferError("the blob holder closed the connection before answering")
            self._buffer = data = data + chunk  # (kept if a timeout interrupts: `interim`)
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            raise TransferError(f"the blob holder answered {status_line!r}, not HTTP") from None
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self._buffer = b""
        return _Reply(status, headers, rest)

    def interim(self, wait_s: float) -> _Reply | None:
        """After a head sent with Expect: 100-continue: None once the holder says to go on (100
        Continue), or has not answered within `wait_s` (a holder that ignores the header: send
        anyway); else its final answer, which refuses the body before any of it is sent."""
        self.sock.settimeout(wait_s)
        try:
            reply = self.reply()
        except TimeoutError:
            if not self._buffer:
                return None
            self.sock.settimeout(self.timeout_s)  # part of an answer came: wait for the rest
            reply = self.reply()
        finally:
            self.sock.settimeout(self.timeout_s)
        if reply.status != 100:
            return reply
        self._buffer = reply.leftover
        return None

    def final(self) -> _Reply:
        """The final answer to a request: a 100 Continue that came after `interim` stopped
        waiting for it (a holder slow to decide: it re-hashes a large partial first) is not it."""
        reply = self.reply()
        while reply.status == 100:
            self._buffer = reply.leftover
            reply = self.reply()
        return reply

    def body(self, reply: _Reply) -> bytes:
        """A small body (an error's JSON)."""
        length = reply.number("Content-Length", 0)
        data = reply.leftover
        while len(data) < length:
            chunk = self._recv(min(65536, length - len(data)))
            if not chunk:
                break
            data += chunk
        return data[:length]

    def reader(self, reply: _Reply) -> Callable[[memoryview], int]:
        """read_into for the body of `reply`: what came with the headers first, then the socket."""
        pending = memoryview(reply.leftover)

        def read_into(view: memoryview) -> int:
            nonlocal pending
            if pending:
                n = min(len(view), len(pending))
                view[:n] = pending[:n]
                pending = pending[n:]
                return n
            return self._recv_into(view)

        return read_into


def _message(conn: _Connection, reply: _Reply) -> str:
    with contextlib.suppress(Exception):
        document = json.loads(conn.body(reply))
        return str(document.get("error") or document.get("message") or "")
    return ""


def fetch_blob(
    base_url: str,
    digest: str,
    size: int,
    store: BlobStore,
    *,
    authorization: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tls: LinkTls | bool = True,
    min_rate_bytes_s: float = MIN_RATE_BYTES_S,
) -> Path:
    """Bring blob `digest` (of `size` bytes) from the holder at `base_url` into `store`, verified
    on the way; resumes a partial an earlier fetch left (over TLS as `_Connection` says, `tls`
    as for `BlobServer`). Returns the blob's path. TransferError
    when the holder refuses or breaks off (what arrived is kept), CorruptBlob when the bytes are
    not the blob's (nothing kept), BlobBusy when another fetch of it runs, OSError when `store`
    cannot write it (its disk full: no other holder would do better). `timeout_s` bounds each
    wait for the holder; the whole transfer, once connected, gets `timeout_s` plus the bytes
    missing at `min_rate_bytes_s`, after which it is TransferError too (a holder that trickles or
    stalls: the caller passes over it; what arrived is kept for the next to resume)."""
    existing = store.path(digest)
    if existing is not None:
        return existing
    with store.writer(digest, size) as writer:
        conn = _Connection(base_url, timeout_s, tls)
        try:
            conn.limit(timeout_s + (size - writer.offset) / min_rate_bytes_s)
            headers = {"Authorization": authorization} if authorization else {}
            if writer.offset:
                headers["Range"] = f"bytes={writer.offset}-"
            try:
                conn.send_head("GET", f"/blobs/{digest}", headers)
                reply = conn.reply()
            except OSError as exc:  # reset, timed out: this holder is no good now, another may be
                raise TransferError(f"{base_url} did not answer for blob {digest}: {exc}") from None
            if reply.status == 200 and writer.offset:
                writer.restart()  # the holder ignored the range: take it all
            elif reply.status not in (200, 206):
                message = _message(conn, reply) or f"HTTP {reply.status}"
                raise TransferError(f"{base_url} refused blob {digest}: {message}", reply.status)
            length = reply.number("Content-Length", -1)
            if length != size - writer.offset:
                raise TransferError(
                    f"{base_url} offers {length} bytes of blob {digest} from byte {writer.offset}; "
                    f"expected {size - writer.offset}"
                )
            # (an OSError out of pump is then this store's own: its disk full)
            got = writer.pump(_broken_off_as(conn.reader(reply), f"fetching blob {digest} from {base_url}"), length)
            if got != length:
                raise TransferError(f"{base_url} broke off blob {digest} at byte {writer.offset} of {size}")
            return writer.commit()
        finally:
            conn.close()


def _broken_off_as(read_into: Callable[[memoryview], int], doing: str) -> Callable[[memoryview], int]:
    """`read_into` whose failures (the holder reset, timed out) are TransferError saying what
    was `doing`: told apart from failures to write what it read."""

    def read(view: memoryview) -> int:
        try:
            return read_into(view)
        except OSError as exc:
            raise TransferError(f"{doing} broke off: {exc}") from None

    return read


def upload_blob(
    base_url: str,
    path: Path,
    digest: str,
    *,
    authorization: str | None = None,
    progress: Callable[[int], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tls: LinkTls | bool = True,
) -> int:
    """Send the file at `path` as blob `digest` to the holder at `base_url`, from wherever an
    earlier, broken upload of it stopped (the holder says where). `progress(n)` hears every
    n bytes sent or found there already; `tls` as for `fetch_blob` (False: plain HTTP, as a
    user's client, or a gateway copying to another gateway, speaks). Returns the bytes sent
    now. TransferError when the holder refuses (its message) or the connection breaks."""
    size = path.stat().st_size
    headers = {"Authorization": authorization} if authorization else {}
    for _ in range(2):  # a second try if the offset moved under us
        conn = _Connection(base_url, timeout_s, tls)
        try:
            conn.send_head("HEAD", f"/blobs/{digest}", headers)
            reply = conn.reply()
            if reply.status == 200:
                if progress is not None:
                    progress(size)
                return 0
            if reply.status == 409:  # (a HEAD's answer has no body to say so)
                raise TransferError(f"blob {digest} is being written by another transfer at {base_url}", 409)
            if reply.status != 404:
                message = _message(conn, reply) or f"HTTP {reply.status}"
                raise TransferError(f"{base_url} refused blob {digest}: {message}", reply.status)
            offset = min(reply.number(UPLOAD_OFFSET, 0), size)
            put_headers = {**headers, UPLOAD_OFFSET: str(offset), "Content-Length": str(size - offset)}
            put_headers["Content-Type"] = "application/octet-stream"
            put_headers["Expect"] = "100-continue"
            conn.send_head("PUT", f"/blobs/{digest}?size={size}", put_headers)
            sent = 0
            refused = conn.interim(EXPECT_WAIT_S)  # a refusal before the body: none of it sent
            if refused is not None:
                reply = refused
            else:
                if progress is not None and offset:
                    progress(offset)
                sent, reply = _send_body(conn, path, offset, size, progress)
            if reply.status == 201:
                if progress is not None and refused is not None:
                    progress(size)  # stored since the HEAD
                return sent
            message = _message(conn, reply) or f"HTTP {reply.status}"
            if reply.status == 409 and UPLOAD_OFFSET.lower() in reply.headers:
                continue
            raise TransferError(f"{base_url} refused blob {digest}: {message}", reply.status)
        except OSError as exc:
            raise TransferError(f"uploading blob {digest} to {base_url} broke off: {exc}") from None
        finally:
            conn.close()
    raise TransferError(f"{base_url} kept moving the offset of blob {digest}; try again")


def _send_body(
    conn: _Connection, path: Path, offset: int, size: int, progress: Callable[[int], None] | None
) -> tuple[int, _Reply]:
    """Send the body, then read the final answer: the bytes sent and that answer. A holder that
    stops reading half way and answers (its disk full) breaks the send: its answer is read then,
    where it came; OSError where none did."""
    try:
        sent = _send_file(conn, path, offset, size, progress)
    except OSError:
        try:
            return 0, conn.final()
        except (OSError, TransferError):
            pass
        raise
    return sent, conn.final()


def _send_file(conn: _Connection, path: Path, offset: int, size: int, progress: Callable[[int], None] | None) -> int:
    sent = 0
    with path.open("rb") as source:
        position = offset
        while position < size:
            count = min(SEND_CHUNK_BYTES, size - position)
            n = send_range(conn.sock, source, position, count)
            if n == 0:
                raise OSError("the connection closed")
            position += n
            sent += n
            if progress is not None:
                progress(n)
    return sent


def measure_copy_gb_s(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """This machine's in-memory copy speed (GB/s, best of `repeats`, destination faulted in
    first): the yardstick transfers are quoted against."""
    source = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    target = bytearray(len(source))
    target[:] = source
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target[:] = source
        best = min(best, time.perf_counter() - started)
    return len(source) / best / 1e9
