"""gateway.http.answer_whole over a real uvicorn server and socket: the same bytes as uvicorn's own
`send` (but the Date), one answer after another on a kept connection, pipelined requests answered
in order, and the connection closed where HTTP/1.0 or the client's Connection: close asks."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.http import HttpLimits, answer_whole
from tests.unit.test_gateway_http import serving

HEAD = b"content-type: text/plain\r\ncontent-length: 5\r\nx-call-id: abc\r\n"
BODY = b"hello"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/whole answers with answer_whole (failing loudly if it declines), /asgi with the same
    headers through uvicorn's own send."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/whole":
        assert answer_whole(send, 200, HEAD, BODY), "uvicorn's httptools cycle: it must answer"
        return
    headers = [tuple(line.split(b": ", 1)) for line in HEAD.split(b"\r\n") if line]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with serving(app, HttpLimits()) as free:
        yield free


def request(path: str, *, version: bytes = b"1.1", headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/" + version + b"\r\nHost: x\r\n" + headers + b"\r\n"


def read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """`count` whole answers (each a head and its 5-byte body) as they come on `sock`."""
    received = b""
    answers: list[bytes] = []
    while len(answers) < count:
        end = received.find(b"\r\n\r\n")
        if end >= 0 and len(received) >= end + 4 + len(BODY):
            answers.append(received[: end + 4 + len(BODY)])
            received = received[end + 4 + len(BODY) :]
            continue
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {len(answers)} answers"
        received += chunk
    assert not received, "nothing past the answers asked for"
    return answers


def without_date(answer: bytes) -> bytes:
    return b"\r\n".join(line for line in answer.split(b"\r\n") if not line.startswith(b"date: "))


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    return sock.recv(65536) == b""


def test_a_whole_answer_is_the_bytes_uvicorns_send_writes(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/whole"))
        (whole,) = read_answers(sock, 1)
        sock.sendall(request("/asgi"))
        (asgi,) = read_answers(sock, 1)
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\n" + BODY)
    assert b"\r\ndate: " in whole, "the server's default headers are written too"
    assert without_date(whole) == without_date(asgi)


def test_pipelined_requests_are_answered_in_order_on_a_kept_connection(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/whole") + request("/asgi") + request("/whole"))
        answers = read_answers(sock, 3)
        sock.sendall(request("/whole"))  # still open: the cycle was completed as uvicorn's send does
        answers += read_answers(sock, 1)
    assert all(b"connection: close" not in answer for answer in answers)
    assert len({without_date(answer) for answer in answers}) == 1


@pytest.mark.parametrize(
    ("version", "headers"), [(b"1.0", b""), (b"1.1", b"Connection: close\r\n")], ids=["http-1.0", "connection-close"]
)
def test_a_connection_not_to_be_kept_is_told_so_and_closed(port: int, version: bytes, headers: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request("/whole", version=version, headers=headers))
        (answer,) = read_answers(sock, 1)
        assert b"\r\nconnection: close\r\n" in answer
        assert closed_by_server(sock)


@pytest.mark.anyio
async def test_a_send_that_is_not_uvicorns_is_left_to_the_caller() -> None:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    assert answer_whole(send, 200, HEAD, BODY) is False
    assert sent == []
