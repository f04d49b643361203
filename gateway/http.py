"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol held to a head size and to
deadlines, so that a client cannot hold the gateway's memory or its connections for free.

- A request's head (request line and headers) may hold `max_head_bytes`; a longer one is answered
  431 and the connection closed, before the rest of it is read (httptools sets no limit: 20 MB of
  headers were buffered whole, then answered 500).
- Once a request's first byte arrives, its whole head must within `head_timeout_s`, else 408 and
  the connection is closed (a slowloris client, sending a header byte a second, held its
  connection as long as it liked).
- Once its head is in, a request's body must arrive within `head_timeout_s` plus a second for
  each `min_body_rate_bytes_s` bytes it declares (the largest body, where it declares none),
  else 408 and the connection is closed (a client sending a body byte a second held its
  connection, and the body it had sent, as long as it liked). No body is given longer than
  `largest_body_bytes` (the largest any route accepts) would take.
- A request answered before its body was read (a 401, a 413) has the rest of its body discarded
  as it comes, while it comes at `min_body_rate_bytes_s` (checked each `head_timeout_s`), else
  the connection is closed (a client that declared a petabyte and sent a byte every few seconds
  held its connection for ever).
- A connection with no request under way is closed after `keep_alive_timeout_s`, a new one that
  sends nothing included (uvicorn arms that timer only after a first response).
- A client that goes away before its answer cancels the task serving its request, while that
  task asks to be (`cancel_on_disconnect`: the invoke path while its call waits, whose router then
  withdraws the call from the scheduler, so that it takes no GPU slot for nobody).

`server_config` makes the uvicorn.Config that serves an app so; `answer_whole` writes a whole
answer the gateway made in one piece (the invoke path's).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB

MAX_HEAD_BYTES = 64 * 1024  # as nginx's large_client_header_buffers (4 x 8k) gives room for, and more
HEAD_TIMEOUT_S = 10.0
MIN_BODY_RATE_BYTES_S = 64 * 1024  # the slowest a body may arrive, beyond the head's deadline
MAX_BODY_BYTES = 16 * 1024 * 1024  # what a body that declares no length is given time for
LARGEST_BODY_BYTES = DEFAULT_MAX_UNPACKED_MB * 1024 * 1024  # a package upload's, the largest a route takes
KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's default


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client connection may take (see the module docstring)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    head_timeout_s: float = HEAD_TIMEOUT_S
    keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S
    min_body_rate_bytes_s: int = MIN_BODY_RATE_BYTES_S
    max_body_bytes: int = MAX_BODY_BYTES
    largest_body_bytes: int = LARGEST_BODY_BYTES

    def body_timeout_s(self, declared_bytes: int | None) -> float:
        """How long a body of `declared_bytes` (None: not declared) may take to arrive: no longer
        than one of `largest_body_bytes`, which no route would take anyway."""
        size = self.max_body_bytes if declared_bytes is None else min(declared_bytes, self.largest_body_bytes)
        return self.head_timeout_s + size / self.min_body_rate_bytes_s

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1024:
            raise ValueError(f"the header limit must be at least 1 KiB, got {self.max_head_bytes} bytes")
        timeouts = {"header timeout": self.head_timeout_s, "keep-alive timeout": self.keep_alive_timeout_s}
        for what, seconds in timeouts.items():
            if not seconds > 0:  # NaN too
                raise ValueError(f"the {what} must be above 0 s, got {seconds}")
        if self.min_body_rate_bytes_s < 1:
            raise ValueError(f"the body rate must be at least 1 byte/s, got {self.min_body_rate_bytes_s}")


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop reading a head past the limit."""


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limit and deadlines of `limits` (a subclass per
    HttpLimits: uvicorn makes its protocol from the class)."""

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # no request under way: the next bytes are a head
        self._head_bytes = 0  # of the head under way: as received, and as parsed
        self._parsed_head_bytes = 0
        self._head_deadline: asyncio.TimerHandle | None = None  # the head's, then the body's
        self._body_to_come = False  # a head is in and its body is not
        self._received_bytes = 0  # every byte read on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Idle from the start: the same deadline as between requests.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # (set above where its answer was not complete)
            task: asyncio.Task[Any] | None = getattr(cycle, _TASK, None)
            if task is not None:
                task.cancel()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._received_bytes += len(data)
        if self._awaiting_head:
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # the gateway speaks no WebSocket (ws="none")
        except httptools.HttpParserError:
            if self._parsed_head_bytes > self.limits.max_head_bytes:
                self._refuse_head_too_large()
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        # A head still incomplete is counted as it arrives: httptools would buffer a header whole.
        if self._awaiting_head and self._head_bytes > self.limits.max_head_bytes:
            self._refuse_head_too_large()
        elif self._body_to_come and self._head_deadline is None:  # a body still to come: its deadline
            timeout_s = self.limits.body_timeout_s(_declared_length(self.headers))
            self._head_deadline = self.loop.call_later(timeout_s, self._body_timed_out)

    # The parser's callbacks: the head as parsed (a whole head may arrive in one read).
    def on_message_begin(self) -> None:
        self._parsed_head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # `_count_parsed` inlined: this runs for every header of every request.
        self._parsed_head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._parsed_head_bytes > self.limits.max_head_bytes:
            raise _HeadTooLarge
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._disarm_head_deadline()
        super().on_headers_complete()
        self._body_to_come = True  # (a body that comes with its head is done before a timer is needed)

    def on_message_complete(self) -> None:
        self._body_to_come = False
        self._disarm_head_deadline()
        super().on_message_complete()
        self._awaiting_head = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if self._body_to_come and cycle is not None and cycle.response_complete and not self.transport.is_closing():
            # Answered without reading its body (a 401, a 413): the rest is discarded as it comes,
            # and a client that sends it (most send the whole body before reading) reads the answer
            # and keeps the connection; but only while the body comes at the least rate a body is
            # given. A client that declared a petabyte and sent a byte every few seconds held the
            # connection for ever; cut off after a flat `head_timeout_s`, an honest upload of more
            # than that never read its 413.
            self._disarm_head_deadline()
            self._still_coming(self._received_bytes, first=True)

    def _still_coming(self, received_bytes: int, *, first: bool = False) -> None:
        """A discarded body's check, each `head_timeout_s`: it came at `min_body_rate_bytes_s` since
        the last (`received_bytes` then), or the connection is closed."""
        self._head_deadline = None
        if not self._body_to_come or self.transport.is_closing():
            return
        period_s = self.limits.head_timeout_s
        if not first and self._received_bytes - received_bytes < self.limits.min_body_rate_bytes_s * period_s:
            self.transport.close()
            return
        self._head_deadline = self.loop.call_later(period_s, self._still_coming, self._received_bytes)

    def _count_parsed(self, size: int) -> None:
        self._parsed_head_bytes += size
        if self._parsed_head_bytes > self.limits.max_head_bytes:
            raise _HeadTooLarge

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head waits for the answer before it under way (a call may take long).
            self._head_deadline = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out)
            return
        self._refuse(408, f"the request's headers did not arrive within {self.limits.head_timeout_s:g} s")

    def _body_timed_out(self) -> None:
        self._head_deadline = None
        if self.cycle is not None and self.cycle.response_started:  # answered early (a 413, say)
            self.transport.close()
            return
        self._refuse(408, "the request's body did not arrive in time; send it faster, or less of it")

    def _refuse_head_too_large(self) -> None:
        self._refuse(
            431, f"the request line and headers are larger than the limit of {self.limits.max_head_bytes} bytes"
        )

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with the gateway's error body, and close the connection."""
        self._disarm_head_deadline()
        self._awaiting_head = False
        if self.transport.is_closing():
            return
        body = json.dumps({"error": message, "status": status}).encode()
        head = [STATUS_LINE[status]]
        head += _header_lines(self.server_state.default_headers)
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def protocol_for(limits: HttpLimits) -> type[LimitedHttpProtocol]:
    """The protocol class uvicorn is to use for `limits`."""

    class GatewayHttpProtocol(LimitedHttpProtocol):
        pass

    GatewayHttpProtocol.limits = limits
    return GatewayHttpProtocol


def server_config(app: Any, *, host: str, port: int, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn.Config serving `app` on httptools held to `limits` (`options`: uvicorn's others).

    Without uvicorn's X-Forwarded-* rewriting (`proxy_headers`): nothing in the gateway reads the
    client's address or scheme, and the middleware ran for every request."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(limits),
        ws="none",
        proxy_headers=False,
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]  # a float works (call_later)
        **options,
    )


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body length a request's head declares (uvicorn's header list: lower-case names), None
    where it declares none (chunked)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


_TASK = "gpufaas_task"  # the attribute of a RequestResponseCycle that names its task to cancel


def cancel_on_disconnect(send: Callable[[MutableMapping[str, Any]], Awaitable[None]], cancel: bool = True) -> None:
    """Have the current task (an ASGI app's, serving one request) cancelled if the client goes
    away before its answer, where `send` is a uvicorn httptools cycle's served by
    LimitedHttpProtocol; nothing otherwise. One attribute set: no task or timer of its own.
    `cancel=False` ends that once there is nothing left to withdraw (the call answered): a
    cancel landing in the answer's writing would end the task with an error for uvicorn to log."""
    cycle = _cycle_of(send)
    if cycle is not None:
        setattr(cycle, _TASK, asyncio.current_task() if cancel else None)


def client_gone(send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> bool:
    """Whether the client of the request `send` answers went away before its answer (a uvicorn
    httptools cycle's `send`; False for any other)."""
    cycle = _cycle_of(send)
    return cycle is not None and cycle.disconnected


def _cycle_of(send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> RequestResponseCycle | None:
    """The uvicorn httptools cycle whose bound method `send` is, or None for any other `send`."""
    cycle = getattr(send, "__self__", None)
    return cycle if type(cycle) is RequestResponseCycle else None


def answer_whole(
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]], status: int, head: bytes, body: bytes
) -> bool:
    """Write a whole answer in one write: the status line, the server's default headers (Date,
    Server), `head` (header lines, each ending in CRLF, Content-Length among them, values the
    caller checked: they are written as they are), a Connection: close where the connection will
    not be kept, the blank line, `body`. True once answered (or the client has gone, as uvicorn's
    own `send` does then); False where `send` is not a uvicorn httptools cycle's with nothing
    sent yet and room to write, for the caller to send the answer as ASGI messages instead.

    Why: uvicorn's `send` writes the head and the body apart (two syscalls, two TCP segments and
    two reads for the client per answer) and checks every header against two regular
    expressions. Measured with bench.hop_cpu, alternated: 3.5 % of the gateway's CPU per call
    (cProfile had put that `send` at 17 %). The cycle's state is left as its `send` leaves it
    after a whole answer."""
    cycle = _cycle_of(send)
    if cycle is None or cycle.response_started or cycle.flow.write_paused:
        return False
    if cycle.disconnected:
        return True
    cycle.response_started = cycle.response_complete = True
    cycle.waiting_for_100_continue = False  # as uvicorn's send: no 100 Continue after an answer
    lines = [STATUS_LINE[status]]
    lines += _header_lines(cycle.default_headers)
    lines += [head, b"\r\n" if cycle.keep_alive else b"connection: close\r\n\r\n", body]
    cycle.transport.write(b"".join(lines))
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


def _header_lines(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """`headers` (the server's defaults: Date, Server) as lines of a head, each ending in CRLF."""
    return [name + b": " + value + b"\r\n" for name, value in headers]
