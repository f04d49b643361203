"""POST /function/{name}: the invocation route, as plain ASGI in front of the FastAPI app.

Invocations are the gateway's hot path and need nothing FastAPI offers (no body is parsed, no
dependency is injected): served here they cost half the time (measured at concurrency 1 on this
project's machines: 132 us against 285 us for an echo, uvicorn + httptools both). Every other
request goes on to the FastAPI app unchanged.

Answers: the function's output with its content type and the X-* headers (X-Call-Id,
X-Duration-Seconds, X-Gpu (a node or GPU name outside ASCII percent-encoded), X-Cache,
X-Queue-Seconds, X-Load-Seconds, X-Inference-Seconds, X-Batch-Calls, X-Attempts after a retry,
and Server-Timing with a miss's stages), or an error
as {"error": "...", "status": N} with the status the router chose (gateway.router). A call whose
client went away while it waited or ran is withdrawn and answered nothing, but counted (the
gateway's metrics and overview) under CLIENT_GONE, 499.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from gateway.auth import (
    ANY_CALLER,
    CROSS_SITE_MESSAGE,
    AmbiguousCredentials,
    caller_role,
    forged,
    insecure_refusal,
    refusal,
    send_refusal,
)
from gateway.http import answer_whole, cancel_on_disconnect, client_gone
from gateway.router import CallFailed, CallResult
from gpufaas.errors import GpufaasError
from gpufaas.functions import FunctionSpec, not_deployed
from gpufaas.proto import gpufaas_pb2 as pb
from gpufaas.store import StoreError

if TYPE_CHECKING:
    from gateway.state import Gateway

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFIX = "/function/"
# The status a call whose client went away before its answer is counted under (never answered):
# nginx's "client closed request", as Prometheus users know it.
CLIENT_GONE = 499


class InvokeMiddleware:
    """ASGI middleware: answers POST /function/{name}[/...] itself (another method there: 405),
    passes the rest on."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway
        # A name the gateway is addressed by, besides loopback names and IP addresses (--insecure).
        self.public_host = urlsplit(gateway.config.public_url).hostname or ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
        elif scope["method"] == "POST":
            await self._invoke(scope, receive, send)
        else:
            # Passed on, a GET (curl without -d) was refused the invoke token (403 "use the admin
            # credentials"), then answered 404 "Not Found" with the admin's. Whatever the name: the
            # answer tells no caller which functions exist.
            name = scope["path"][len(PREFIX) :].split("/", 1)[0]
            message = f"call a function with POST /function/{name}; GET /system/function/{name} describes it"
            await send_refusal(send, 405, message, [(b"allow", b"POST")])

    async def _invoke(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        gateway = self.gateway
        limit = gateway.config.max_payload_bytes
        name = scope["path"][len(PREFIX) :].split("/", 1)[0]
        headers = dict(scope["headers"])  # ASGI header names are lower-case bytes
        given_call_id = headers.get(b"x-call-id", b"")
        refused = _call_id_refused(given_call_id)
        if refused is not None:
            await _error(send, 400, refused, new_call_id())
            return
        call_id = given_call_id.decode("ascii") or new_call_id()
        spec = gateway.functions.get(name)
        if await self._refused(send, scope, headers, name=name, spec=spec, call_id=call_id):
            return
        # (After the credential: a caller without one costs etcd no read. A public function the
        # mirror lacks yet is refused it then, as any unknown name is, for those milliseconds.)
        spec = spec or await self._deployed_meanwhile(name)
        if spec is None:
            await _error(send, 404, not_deployed(name), call_id)
            return
        declared = headers.get(b"content-length", b"")
        try:  # (a declared length over the limit is answered unread; bytes: ASCII digits only)
            payload = None if declared.isdigit() and int(declared) > limit else await _read_body(receive, limit)
        except _ClientGone:
            return  # before its body was whole: nothing to run, nobody to answer
        if payload is None:
            await _error(send, 413, f"the payload is larger than the limit of {limit} bytes", call_id)
            return
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        cancel_on_disconnect(send)  # a client gone while its call waits: the router withdraws it
        try:
            result = await gateway.router.invoke(
                spec, call_id, payload, content_type, clock=time.monotonic, given_call_id=bool(given_call_id)
            )
        except CallFailed as exc:
            cancel_on_disconnect(send, False)  # answered: nothing to withdraw (as below)
            gateway.stats.record(name, exc.status, time.perf_counter() - started)
            await _error(send, exc.status, exc.message, call_id, retry_after=exc.status == 429)
            return
        except asyncio.CancelledError:
            if not self._client_left(send, name, started):
                raise
            return  # (not an error to log: the client left)
        # Answered: a client gone now leaves its answer unwritten, and a cancel landing in the
        # write (one that waits for room) would be an error for uvicorn to log.
        cancel_on_disconnect(send, False)
        content_type = result.reply.content_type or "application/octet-stream"
        if content_type not in _CONTENT_TYPES:
            # Made by the function's worker, which runs the user's code: served as it says, a
            # text/html would run on this gateway's origin (its dashboard's, with an admin's
            # credentials in the browser). A worker makes only these; another is its code's forgery.
            gateway.stats.record(name, 502, time.perf_counter() - started)
            await _error(send, 502, "the function's worker answered a content type that workers do not make", call_id)
            return
        gateway.stats.record(name, 200, time.perf_counter() - started, hit=not result.reply.loaded)
        await _respond(send, 200, _answer_head(result, content_type, call_id, started), result.output)

    def _client_left(self, send: Send, name: str, started: float) -> bool:
        """Whether the cancel being handled is the client's leaving (gateway.http.cancel_on_disconnect,
        the call withdrawn by the router); if so, the cancel is taken back and the call to `name`
        counted under CLIENT_GONE, timed from `started` (perf_counter) to now, its client's leaving."""
        if not client_gone(send):
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        # Counted, or an operator whose clients time out before a slow function ends sees their
        # calls vanish from gateway_function_invocation_total and the overview.
        self.gateway.stats.record(name, CLIENT_GONE, time.perf_counter() - started)
        return True

    async def _deployed_meanwhile(self, name: str) -> FunctionSpec | None:
        """The function's spec read from etcd once, for a name the mirror does not know: a
        deploy through another gateway reaches this one's watch some milliseconds after it was
        answered, and a call sent at once must not get 404 in between. None: not deployed (or
        etcd is unreachable now: the mirror's answer stands)."""
        gateway = self.gateway
        try:
            kv = await gateway.store.get(gateway.keys.function(name))
            return None if kv is None else FunctionSpec.from_json(kv.value)
        except (StoreError, GpufaasError, ValueError):  # (ValueError: a name no key can hold)
            return None

    async def _refused(
        self,
        send: Send,
        scope: Scope,
        headers: dict[bytes, bytes],
        *,
        name: str,
        spec: FunctionSpec | None,
        call_id: str,
    ) -> bool:
        """Refuse the call unless its caller may make it (400 for ambiguous credentials, 401/403
        for a caller without the right, 403 for a cross-site POST); True once refused. A public
        function needs no credential; an unknown one does, so that a 401 comes before the 404 and
        no caller without a right learns which functions exist. A gateway that asks none
        (--insecure) refuses what `insecure_refusal` does: another site's page calling through a
        browser, or reading the answer by DNS rebinding."""
        credentials = self.gateway.config.credentials
        call_header = [(b"x-call-id", call_id.encode("latin-1"))]
        if credentials is None:
            insecure = insecure_refusal(scope, self.public_host, headers)
            if insecure is not None:
                await send_refusal(send, *insecure, call_header)
            return insecure is not None
        if spec is not None and spec.public:
            return False
        try:
            role = caller_role(credentials, scope["headers"])
        except AmbiguousCredentials as exc:
            await send_refusal(send, 400, str(exc), call_header)
            return True
        if role not in ANY_CALLER:
            status, message = refusal(role, f"call function {name!r}")
        elif forged("POST", headers):
            status, message = 403, CROSS_SITE_MESSAGE
        else:
            return False
        await send_refusal(send, status, message, call_header)
        return True


# What a worker answers (gpu_manager.worker.encode_result): the only types a function's answer is served as.
_CONTENT_TYPES = frozenset({"application/octet-stream", "text/plain; charset=utf-8", "application/json"})
# A header value must not hold a control character (but tab) or leave ASCII: CR/LF would split it.
_NOT_VISIBLE = re.compile(rb"[^\t\x20-\x7e]")
# What X-Gpu keeps as it is of a name it percent-encodes: printable ASCII but "%".
_HEADER_SAFE = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")
# The longest X-Call-Id taken (a UUID has 36; a W3C trace id 32): the scheduler keeps a named call's
# id for minutes after it ends, its node too, and the id rides in its grant.
MAX_CALL_ID_CHARS = 256


def _call_id_refused(given: bytes) -> str | None:
    """Why the X-Call-Id `given` (b"": none) is refused, or None: it is echoed in the answer's
    headers, and the scheduler keeps a named call's id for minutes after it ends."""
    if _NOT_VISIBLE.search(given):
        return "X-Call-Id may hold only visible ASCII characters"
    if len(given) > MAX_CALL_ID_CHARS:
        return f"X-Call-Id may hold at most {MAX_CALL_ID_CHARS} characters"
    return None


def _header_safe(name: str) -> bytes:
    """A node or GPU name outside ASCII (any printable Unicode is a valid node name), for X-Gpu:
    percent-encoded UTF-8, as in a URL, so that the header holds only visible ASCII (raw UTF-8 in
    a header value is rejected or mangled by some clients); "%" in such a name is encoded too."""
    return quote(name, safe=_HEADER_SAFE).encode("ascii")


def _answer_head(result: CallResult, content_type: str, call_id: str, started: float) -> bytes:
    """The header lines of a call's answer: its output's type and length, and the X-* headers
    (X-Duration-Seconds up to now, from `started` on the perf_counter clock)."""
    placement, reply = result.placement, result.reply
    head = (
        b"content-type: %s\r\nx-content-type-options: nosniff\r\ncontent-length: %d\r\nx-call-id: %s\r\n"
        b"x-duration-seconds: %.6f\r\n"
        b"x-gpu: %s/%s\r\nx-cache: %s\r\nx-queue-seconds: %.6f\r\nx-load-seconds: %.6f\r\n"
        b"x-inference-seconds: %.6f\r\nx-batch-calls: %d\r\n"
    ) % (
        content_type.encode("ascii"),
        len(result.output),
        call_id.encode("ascii"),
        time.perf_counter() - started,
        placement.node.encode() if placement.node.isascii() else _header_safe(placement.node),
        placement.gpu.encode() if placement.gpu.isascii() else _header_safe(placement.gpu),
        b"miss" if reply.loaded else b"hit",
        placement.queue_s,
        reply.load_time_s,
        reply.inference_time_s,
        reply.batch_calls,
    )
    if result.placements > 1:
        head += b"x-attempts: %d\r\n" % result.placements
    if result.leased:
        head += b"x-lease: 1\r\n"  # it ran under a lease: no placement of its own
    if reply.loaded:
        head += b"server-timing: " + miss_timing(reply).encode() + b"\r\n"
    return head


async def _respond(send: Send, status: int, head: bytes, body: bytes) -> None:
    """Answer `status` with the header lines `head` and `body`: in one write where the server is
    uvicorn's (gateway.http.answer_whole), else as the two ASGI messages."""
    if answer_whole(send, status, head, body):
        return
    headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n") if line]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def new_call_id() -> str:
    """A fresh call id: a random UUID (version 4) in 32 hex digits, as `uuid.uuid4().hex` writes it,
    made without the UUID object (which cost 2 % of the gateway's CPU per call)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    return raw.hex()


class _ClientGone(Exception):
    """The client went away before its request's body was whole."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None once it exceeds `limit` bytes (the rest is not read). Raises
    _ClientGone where the client goes away first: a body cut short is never run as a whole one."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _error(send: Send, status: int, message: str, call_id: str, *, retry_after: bool = False) -> None:
    body = json.dumps({"error": message, "status": status}).encode()
    head = b"content-type: application/json\r\ncontent-length: %d\r\nx-call-id: %s\r\n" % (
        len(body),
        call_id.encode("ascii"),
    )
    await _respond(send, status, head + b"retry-after: 1\r\n" if retry_after else head, body)


def miss_timing(reply: pb.ExecuteReply) -> str:
    """A miss's stages as a Server-Timing header (durations in milliseconds, W3C Server Timing);
    `host` only when the model came back from the node's host tier instead of being loaded;
    `pool` (its weights copied into the node's host model pool on this call's path) and
    `from-pool` (they were there: mapped, not read from disk) where the node has a pool."""
    stages = reply.stages
    parts = [
        ("fetch", stages.fetch_s),
        *([("pool", stages.pool_s)] if stages.pool_s else []),
        *([("from-pool", 0.0)] if stages.from_pool else []),
        ("prefetch", stages.prefetch_s),
        ("start", stages.start_s),
        ("context", stages.context_s),
        ("load", stages.load_s),
        *([("host", stages.host_s)] if stages.from_host else []),
        ("inference", reply.inference_time_s),
        ("spare-start", stages.spare_start_s),
        ("spare-context", stages.spare_context_s),
    ]
    return ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in parts)
