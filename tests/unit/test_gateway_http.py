"""The gateway's HTTP connections (gateway.http) over a real socket, with short limits: a head past
its size is a 431 before the rest is read, a head or a body that trickles in is cut at its
deadline (408), idle connections are closed, a request under way is never cut for taking long,
and the invoke path neither runs a body cut short nor keeps a call whose client left."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import unquote

import pytest
import uvicorn

from gateway.http import HttpLimits, server_config
from gateway.invoke import InvokeMiddleware, _answer_head
from gateway.router import CallFailed, CallResult
from gateway.stats import FunctionStats
from gpufaas.functions import FunctionSpec
from gpufaas.proto import gpufaas_pb2 as pb

LIMITS = HttpLimits(max_head_bytes=4096, head_timeout_s=1.0, keep_alive_timeout_s=1.0, min_body_rate_bytes_s=1000)
MARGIN_S = 1.0  # a busy 2-core machine's scheduling delay


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 200 "ok" once the body is in; /slow after 1.5 s (longer than the head deadline)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body", False):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(1.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def serving(asgi_app: Any, limits: HttpLimits) -> Iterator[int]:
    """`asgi_app` served by uvicorn as the gateway serves (gateway.http), in a thread, on a free
    port of 127.0.0.1 (yielded)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    server = uvicorn.Server(server_config(asgi_app, host="127.0.0.1", port=free, limits=limits, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield free
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving(app, LIMITS) as free:
        yield free


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def request(path: str = "/", headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"


def test_a_head_within_the_limit_is_served_and_one_past_it_is_a_431(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request(headers=b"X-Fill: " + b"a" * 3000 + b"\r\n"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    with connect(port) as sock:  # in one read: counted as parsed
        sock.sendall(request(headers=b"X-Fill: " + b"a" * 5000 + b"\r\n"))
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431") and b"larger than the limit of 4096 bytes" in answer


def send_head_until_refused(sock: socket.socket, start: bytes, filler: bytes) -> tuple[int, bytes]:
    """Send `start`, then `filler` until 20 MB went or the server hung up; (bytes of filler sent,
    the server's answer)."""
    sent = 0
    sock.sendall(start)
    try:
        while sent < 20 * 1024 * 1024:
            sent += sock.send(filler)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent, read_until_closed(sock)


def test_20_mb_of_headers_are_refused_before_they_are_read(port: int) -> None:
    with connect(port) as sock:  # one header that never ends: httptools would buffer it whole
        sent, answer = send_head_until_refused(sock, b"GET / HTTP/1.1\r\nHost: x\r\nX-Fill: ", b"a" * 65536)
    assert sent < 20 * 1024 * 1024, "the server read 20 MB of headers"
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def trickled(sock: socket.socket, count: int) -> tuple[bytes, float]:
    """Send `count` bytes, one each 0.2 s, until the server closes; what it answered, and when it
    closed (seconds after the first byte)."""
    started = time.monotonic()
    for _ in range(count):
        try:
            sock.sendall(b"x")
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.2)
    return read_until_closed(sock), time.monotonic() - started


def test_a_head_that_trickles_in_is_cut_at_its_deadline(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n")
        answer, closed_after_s = trickled(sock, 10)  # one header byte each 0.2 s: never done in 2 s
    assert answer.startswith(b"HTTP/1.1 408") and b"within 1 s" in answer
    assert closed_after_s < LIMITS.head_timeout_s + MARGIN_S + 1.0


def test_a_body_that_trickles_in_is_cut_at_its_deadline_and_one_in_time_is_served(port: int) -> None:
    # 2,000 bytes declared: 1 s for the head's deadline plus 2 s at 1,000 bytes a second.
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(head + b"x" * 1000)
        answer, closed_after_s = trickled(sock, 40)  # a byte each 0.2 s: 1,000 more take 200 s
    assert answer.startswith(b"HTTP/1.1 408") and b"body" in answer, answer[:200]
    assert 3.0 - MARGIN_S < closed_after_s < 3.0 + MARGIN_S + 1.0
    with connect(port) as sock:  # the same body in 1.5 s: within its deadline
        sock.sendall(head)
        for size in (666, 667, 667):
            time.sleep(0.5)
            sock.sendall(b"x" * size)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 401 at once, reading no body (as the gateway answers a request without credentials)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"no"})


def test_a_refused_request_with_a_huge_declared_body_cannot_hold_its_connection() -> None:
    with serving(refuse, LIMITS) as port, connect(port) as sock:
        sock.sendall(b"POST /system/functions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000000\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        started = time.monotonic()
        closed = False
        while not closed and time.monotonic() - started < 8.0:  # a body byte each 0.5 s
            try:
                sock.sendall(b"x")
                sock.settimeout(0.5)
                closed = sock.recv(1) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            except TimeoutError:
                pass
        held_s = time.monotonic() - started
    assert closed and held_s < LIMITS.head_timeout_s + LIMITS.keep_alive_timeout_s + MARGIN_S + 1, held_s


def test_a_refused_upload_that_keeps_coming_at_the_least_rate_is_read_to_its_end() -> None:
    # Most clients send the whole body before they read the answer. Cut off a flat head timeout
    # after an early 401 or 413, an honest upload longer than that got a reset, never its answer.
    with serving(refuse, LIMITS) as port, connect(port) as sock:
        chunks, chunk = 30, b"x" * 300  # 3,000 bytes a second, three times the least rate
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (chunks * len(chunk)))
        for _ in range(chunks):  # for 3 s: three head timeouts
            sock.sendall(chunk)
            time.sleep(0.1)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")  # the connection is kept
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")


def test_a_refused_request_whose_body_then_comes_in_time_keeps_its_connection() -> None:
    with serving(refuse, LIMITS) as port, connect(port) as sock:
        for _ in range(2):  # the second on the same connection
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 401")
            sock.sendall(b"x" * 500)


def test_the_body_deadline_is_at_most_the_largest_body_s() -> None:
    limits = HttpLimits(head_timeout_s=1.0, min_body_rate_bytes_s=1000, largest_body_bytes=10_000)
    assert limits.body_timeout_s(5000) == 6.0
    assert limits.body_timeout_s(10**17) == limits.body_timeout_s(10_000) == 11.0


def test_idle_connections_are_closed_after_the_keep_alive_timeout(port: int) -> None:
    fresh = [connect(port) for _ in range(50)]
    used = connect(port)
    used.sendall(request())
    assert used.recv(65536).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    for sock in [*fresh, used]:
        assert read_until_closed(sock) == b""
        sock.close()
    assert time.monotonic() - started < LIMITS.keep_alive_timeout_s + MARGIN_S


def test_a_request_under_way_is_not_cut_for_taking_longer_than_the_deadlines(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request("/slow") + request())  # the second pipelined behind it
        answer = b""
        while answer.count(b"HTTP/1.1 200") < 2:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk


# --- the invoke path's body and its client ------------------------------------------------------------
class StandInRouter:
    """Stands in for the gateway's router on the invoke path: `Router.invoke`'s signature, its
    answer `answer`'s (a result, or CallFailed raised)."""

    async def invoke(
        self,
        spec: FunctionSpec,
        call_id: str,
        payload: bytes,
        content_type: str,
        *,
        clock: Any,
        given_call_id: bool = False,
    ) -> Any:
        return await self.answer(payload)

    async def answer(self, payload: bytes) -> Any:
        raise NotImplementedError


class RecordingRouter(StandInRouter):
    """Stands in for the gateway's router: keeps each payload it is asked to run, holds the call
    for 3 s, and counts the calls cancelled meanwhile (the real router withdraws those)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.cancelled = 0

    async def answer(self, payload: bytes) -> Any:
        self.payloads.append(payload)
        try:
            await asyncio.sleep(3)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("the call was held to the end: its client was not seen leaving")


def invoke_app(
    router: StandInRouter, recorded: list[tuple[Any, ...]] | None = None, stats: FunctionStats | None = None
) -> InvokeMiddleware:
    """The invoke path over `router`; what it records of each call (function, status) goes to
    `recorded`, or to `stats` where given."""
    spec = FunctionSpec(name="f", package_digest="sha256:" + "0" * 64, memory_mb=100)
    records = recorded if recorded is not None else []
    gateway = SimpleNamespace(
        config=SimpleNamespace(max_payload_bytes=1 << 20, credentials=None, public_url="http://127.0.0.1:8080"),
        functions={"f": spec},
        router=router,
        stats=stats or SimpleNamespace(record=lambda name, status, *args, **kwargs: records.append((name, status))),
    )

    async def not_invoked(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError(f"passed on: {scope['path']}")

    return InvokeMiddleware(not_invoked, cast(Any, gateway))


def test_a_body_cut_short_by_its_client_leaving_is_never_run() -> None:
    router = RecordingRouter()
    with serving(invoke_app(router), LIMITS) as free, connect(free) as sock:
        sock.sendall(b"POST /function/f HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n" + b'{"amount": 1')
        time.sleep(0.3)
        sock.close()
        time.sleep(0.5)
    assert router.payloads == [], "the function was run on a body cut short"


def test_a_client_that_leaves_while_its_call_waits_withdraws_it() -> None:
    router = RecordingRouter()
    with serving(invoke_app(router), LIMITS) as free:
        with connect(free) as sock:
            sock.sendall(b"POST /function/f HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
            time.sleep(0.3)
        deadline = time.monotonic() + 2
        while not router.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
    assert router.payloads == [b"{}"] and router.cancelled == 1, "the call was kept for a client that left"


def test_a_call_whose_client_left_is_counted_once_as_a_499_in_the_metrics_and_the_overview() -> None:
    # Withdrawn and answered nothing, it was recorded nowhere: calls whose clients time out
    # before a slow function ends vanished from gateway_function_invocation_total and the overview.
    router, stats = RecordingRouter(), FunctionStats()
    with serving(invoke_app(router, stats=stats), LIMITS) as free:
        with connect(free) as sock:
            sock.sendall(b"POST /function/f HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
            time.sleep(0.3)
        deadline = time.monotonic() + 2
        while not stats.count("f") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert router.cancelled == 1
    samples = [s for metric in stats.collect() for s in metric.samples]
    assert [(s.labels["code"], s.value) for s in samples if s.name == "gateway_function_invocation_total"] == [
        ("499", 1)
    ], "counted under no status, or under another as well"
    assert [s.value for s in samples if s.name == "gateway_functions_seconds_count"] == [1]
    assert stats.summary("f")["calls"] == stats.summary("f")["errors"] == 1


class FailingRouter(StandInRouter):
    """Stands in for the gateway's router: answers each call with an error whose message is the
    next of `sizes` bytes long."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = list(sizes)

    async def answer(self, payload: bytes) -> Any:
        raise CallFailed(502, "x" * self.sizes.pop(0))


def test_a_client_that_leaves_while_its_answer_waits_to_be_written_is_no_error() -> None:
    # The first answer (8 MB, never read) fills the connection: the second waits to be written.
    # Its client leaving then cancelled the task writing it, and uvicorn logged the cancellation
    # as an "Exception in ASGI application": a call once answered has nothing to withdraw.
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    call = b"POST /function/f HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}"
    with serving(invoke_app(cast(Any, FailingRouter(8 << 20, 10))), LIMITS) as free:
        logging.getLogger("uvicorn.error").addHandler(handler)  # (after uvicorn's logging set-up)
        try:
            with connect(free) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(call)
                time.sleep(0.3)
                sock.sendall(call)
                time.sleep(0.3)
            time.sleep(0.5)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
    assert [record.getMessage() for record in errors] == []


class ForgingRouter(StandInRouter):
    """Stands in for the gateway's router: answers every call with a result of `content_type`,
    as a function's code that rewrote its worker's encoder (or wrote its own frames) would."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type

    async def answer(self, payload: bytes) -> Any:
        reply = SimpleNamespace(content_type=self.content_type, loaded=False)
        return SimpleNamespace(reply=reply, output=b"<script>fetch('/system/functions')</script>")


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain\r\nSet-Cookie: a=b",  # would split the answer's head
        "text/html",  # would run on the gateway's origin, the dashboard's, with an admin's credentials
    ],
)
def test_a_content_type_workers_do_not_make_is_a_502_and_counted_as_one(content_type: str) -> None:
    recorded: list[tuple[Any, ...]] = []
    with serving(invoke_app(cast(Any, ForgingRouter(content_type)), recorded), LIMITS) as free, connect(free) as sock:
        head = b"POST /function/f HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        sock.sendall(head + b"{}")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 502") and b"Set-Cookie" not in answer and b"<script>" not in answer
    assert recorded == [("f", 502)], "a 502 counted as a 200 hit"


def test_x_gpu_holds_only_ascii_a_node_name_outside_it_percent_encoded() -> None:
    # Any printable Unicode is a node name: it was written into X-Gpu as raw UTF-8 bytes, which
    # some HTTP clients reject or mangle (a header value is ASCII, latin-1 at most).
    reply = pb.ExecuteReply(outcome=pb.OK)

    def x_gpu(node: str, gpu: str = "gpu0") -> bytes:
        placement = pb.Placement(call_id="c1", attempt=1, node=node, gpu=gpu)
        head = _answer_head(CallResult(b"out", placement, reply), "text/plain; charset=utf-8", "c1", 0.0)
        assert head.isascii()
        [line] = [line for line in head.split(b"\r\n") if line.startswith(b"x-gpu: ")]
        return line.removeprefix(b"x-gpu: ")

    assert x_gpu("node0", "gpu1") == b"node0/gpu1"  # ASCII names as they are
    assert x_gpu("gpu-höst") == b"gpu-h%C3%B6st/gpu0"
    assert unquote(x_gpu("节点 %1")) == "节点 %1/gpu0"  # "%" encoded too where the name is: decodable
