"""The blob server and its clients over real sockets on loopback: fetches and uploads that resume
where they broke off, wrong bytes refused, credentials checked, bad requests answered plainly."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufaas import blobnet, blobs
from gpufaas.blobnet import UPLOAD_OFFSET, BlobServer, TransferError, fetch_blob, upload_blob
from gpufaas.blobs import PUMP_BUFFER_BYTES, BlobStore, CorruptBlob
from gpufaas.packages import sha256_digest

TOKEN = "Bearer secret"


def only_token(method: str, authorization: str | None) -> tuple[int, str] | None:
    if authorization == TOKEN:
        return None
    return (401 if authorization is None else 403), "no"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[BlobServer, str]]:
    server = BlobServer(BlobStore(tmp_path / "holder"), only_token, accept_uploads=True, max_blob_bytes=64 << 20)
    address = server.start("127.0.0.1:0")
    yield server, f"http://{address}"
    server.stop()


def big(n: int = 3 * PUMP_BUFFER_BYTES + 17) -> bytes:
    return os.urandom(n)


def test_fetch_moves_a_blob_and_checks_it(tmp_path: Path, holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    data = big()
    digest = server.store.put(data)
    mine = BlobStore(tmp_path / "mine")
    path = fetch_blob(url, digest, len(data), mine, authorization=TOKEN)
    assert path.read_bytes() == data and server.bytes_sent == len(data)
    assert fetch_blob(url, digest, len(data), mine, authorization=TOKEN) == path  # here already: no transfer
    assert server.bytes_sent == len(data)


def test_fetch_resumes_from_what_a_broken_one_left(tmp_path: Path, holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    data = big()
    digest = server.store.put(data)
    mine = BlobStore(tmp_path / "mine")
    with mine.writer(digest, len(data)) as writer:
        writer.write(data[:1000])  # an earlier fetch broke off here
    fetch_blob(url, digest, len(data), mine, authorization=TOKEN)
    assert mine.path(digest).read_bytes() == data  # type: ignore[union-attr]
    assert server.bytes_sent == len(data) - 1000  # only the rest crossed


def serve_half(data: bytes) -> tuple[str, threading.Thread]:
    """A holder that promises the whole blob and breaks off half way."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data[: len(data) // 2])
        conn.close()
        listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


def test_a_fetch_that_breaks_off_keeps_what_arrived_and_the_next_resumes(
    tmp_path: Path, holder: tuple[BlobServer, str]
) -> None:
    server, url = holder
    data = big()
    digest = server.store.put(data)
    mine = BlobStore(tmp_path / "mine")
    broken, thread = serve_half(data)
    with pytest.raises(TransferError, match="broke off"):
        fetch_blob(broken, digest, len(data), mine)
    thread.join()
    assert mine.partial_size(digest) == len(data) // 2
    fetch_blob(url, digest, len(data), mine, authorization=TOKEN)
    assert mine.path(digest).read_bytes() == data  # type: ignore[union-attr]
    assert server.bytes_sent == len(data) - len(data) // 2


def test_a_holder_with_wrong_bytes_is_refused_and_nothing_is_kept(
    tmp_path: Path, holder: tuple[BlobServer, str]
) -> None:
    server, url = holder
    data = big()
    digest = sha256_digest(data)
    tampered = bytearray(data)
    tampered[12345] ^= 0xFF
    wrong = server.store.put(bytes(tampered))
    os.replace(server.store.path(wrong), server.store.root / "sha256" / digest[7:])  # type: ignore[arg-type]
    mine = BlobStore(tmp_path / "mine")
    with pytest.raises(CorruptBlob, match="hash to"):
        fetch_blob(url, digest, len(data), mine, authorization=TOKEN)
    assert not mine.has(digest) and mine.partial_size(digest) == 0


def test_credentials_and_missing_blobs(tmp_path: Path, holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    digest = server.store.put(b"x")
    mine = BlobStore(tmp_path / "mine")
    with pytest.raises(TransferError) as refused:
        fetch_blob(url, digest, 1, mine)
    assert refused.value.status == 401
    with pytest.raises(TransferError) as wrong:
        fetch_blob(url, digest, 1, mine, authorization="Bearer nope")
    assert wrong.value.status == 403
    with pytest.raises(TransferError) as missing:
        fetch_blob(url, sha256_digest(b"y"), 1, mine, authorization=TOKEN)
    assert missing.value.status == 404 and "is not here" in str(missing.value)
    with pytest.raises(TransferError, match="offers 1 bytes"):
        fetch_blob(url, digest, 2, mine, authorization=TOKEN)  # the size the caller expects is not the blob's
    with pytest.raises(TransferError, match="cannot reach"):
        fetch_blob("http://127.0.0.1:1", digest, 1, mine)


def raw(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_bad_requests_are_answered_plainly(holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    digest = server.store.put(b"abc")
    status, _, body = raw(url, f"GET /nope HTTP/1.1\r\nAuthorization: {TOKEN}\r\n\r\n".encode())
    assert status == 404 and "blobs are at" in json.loads(body)["error"]
    status, _, _ = raw(
        url, f"GET /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\nRange: bytes=9-\r\n\r\n".encode()
    )
    assert status == 416
    status, _, _ = raw(  # (more digits than int() takes from a string)
        url, f"GET /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\nRange: bytes={'9' * 5000}-\r\n\r\n".encode()
    )
    assert status == 416
    status, headers, body = raw(
        url, f"GET /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\nRange: bytes=1-\r\n\r\n".encode()
    )
    assert status == 206 and body == b"bc" and headers["content-range"] == "bytes 1-2/3"
    status, _, _ = raw(
        url, f"PUT /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\nContent-Length: 0\r\n\r\n".encode()
    )
    assert status == 400  # no ?size=


def test_upload_sends_only_what_is_missing_and_resumes(tmp_path: Path, holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    source = tmp_path / "weights.bin"
    data = big()
    source.write_bytes(data)
    digest = sha256_digest(data)
    # An earlier upload broke off after 5 MB: its partial is on the holder.
    with server.store.writer(digest, len(data)) as writer:
        writer.write(data[: 5 << 20])
    seen: list[int] = []
    sent = upload_blob(url, source, digest, authorization=TOKEN, progress=seen.append)
    assert sent == len(data) - (5 << 20) and sum(seen) == len(data)
    assert server.store.path(digest).read_bytes() == data  # type: ignore[union-attr]
    assert upload_blob(url, source, digest, authorization=TOKEN) == 0  # there already
    with pytest.raises(TransferError) as refused:
        upload_blob(url, source, sha256_digest(b"not these bytes"), authorization=TOKEN)
    assert refused.value.status == 400 and "hash to" in str(refused.value)
    assert server.store.partial_size(sha256_digest(b"not these bytes")) == 0


def test_an_upload_that_does_not_start_where_the_holder_is_gets_its_offset(holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    data = b"0123456789"
    digest = sha256_digest(data)
    with server.store.writer(digest, len(data)) as writer:
        writer.write(data[:4])
    status, headers, body = raw(
        url,
        f"PUT /blobs/{digest}?size=10 HTTP/1.1\r\nAuthorization: {TOKEN}\r\n{UPLOAD_OFFSET}: 0\r\n"
        f"Content-Length: 10\r\n\r\n".encode()
        + data,
    )
    assert status == 409 and headers[UPLOAD_OFFSET.lower()] == "4" and "Upload-Offset 4" in json.loads(body)["error"]
    status, _, _ = raw(
        url,
        f"PUT /blobs/{digest}?size=10 HTTP/1.1\r\nAuthorization: {TOKEN}\r\n{UPLOAD_OFFSET}: 4\r\n"
        f"Content-Length: 6\r\n\r\n".encode()
        + data[4:],
    )
    assert status == 201 and server.store.path(digest).read_bytes() == data  # type: ignore[union-attr]


def test_a_blob_another_transfer_writes_is_refused_before_any_of_its_body_is_sent(
    tmp_path: Path, holder: tuple[BlobServer, str]
) -> None:
    """Two deploys sharing weights at once: while one writes the blob, the other's upload is told
    409 (busy, no offset), whether it asks first (HEAD) or its PUT finds the writer since; never
    a reset (which the CLI took for an unreachable server) and never a byte of its body."""
    server, url = holder
    source = tmp_path / "weights.bin"
    data = big()
    source.write_bytes(data)
    digest = sha256_digest(data)
    seen: list[int] = []
    with server.store.writer(digest, len(data)):
        with pytest.raises(TransferError) as busy:
            upload_blob(url, source, digest, authorization=TOKEN, progress=seen.append)
        assert busy.value.status == 409 and "another transfer" in str(busy.value)
        # A PUT whose HEAD found no writer (one came between): refused before its body.
        status, headers, body = raw(
            url,
            f"PUT /blobs/{digest}?size={len(data)} HTTP/1.1\r\nAuthorization: {TOKEN}\r\n"
            f"Content-Length: {len(data)}\r\nExpect: 100-continue\r\n\r\n".encode(),
        )
        assert status == 409 and UPLOAD_OFFSET.lower() not in headers
        assert "another transfer" in json.loads(body)["error"]
    assert server.bytes_received == 0 and seen == []
    # Once the writer is gone: 100 Continue, then the body, then 201.
    sent = upload_blob(url, source, digest, authorization=TOKEN, progress=seen.append)
    assert sent == len(data) == sum(seen) == server.bytes_received


def test_a_put_with_expect_hears_100_continue_before_its_body(holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    data = b"0123456789"
    digest = sha256_digest(data)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            f"PUT /blobs/{digest}?size=10 HTTP/1.1\r\nAuthorization: {TOKEN}\r\nContent-Length: 10\r\n"
            "Expect: 100-continue\r\n\r\n".encode()
        )
        assert conn.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        conn.sendall(data)
        stored = b""
        while not stored.endswith(b"}"):  # (the head and the JSON body may come apart)
            stored += conn.recv(65536)
        assert stored.startswith(b"HTTP/1.1 201 ")
        # The same connection's next request expects nothing: answered without an interim.
        conn.sendall(f"HEAD /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\n\r\n".encode())
        assert conn.recv(65536).startswith(b"HTTP/1.1 200 ")
    assert server.store.path(digest).read_bytes() == data  # type: ignore[union-attr]


def test_a_100_continue_later_than_the_client_waits_is_not_taken_for_the_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that restarted re-hashes a broken upload's partial before it asks for the rest
    (seconds for GBs): the client sends the body after EXPECT_WAIT_S anyway, and the late 100
    Continue ahead of the 201 is not a refusal."""
    data = big()
    digest = sha256_digest(data)
    store = BlobStore(tmp_path / "holder")
    with store.writer(digest, len(data)) as writer:
        writer.write(data[: 5 << 20])
    store = BlobStore(tmp_path / "holder")  # (a new process: no hash state kept for the partial)
    server = BlobServer(store, only_token, accept_uploads=True, max_blob_bytes=64 << 20)
    url = f"http://{server.start('127.0.0.1:0')}"
    source = tmp_path / "weights.bin"
    source.write_bytes(data)
    monkeypatch.setattr(blobnet, "EXPECT_WAIT_S", 0.1)
    rehash = blobs._hash_prefix
    monkeypatch.setattr(blobs, "_hash_prefix", lambda path, n: (time.sleep(0.4), rehash(path, n))[1])
    seen: list[int] = []
    try:
        assert upload_blob(url, source, digest, authorization=TOKEN, progress=seen.append) == len(data) - (5 << 20)
        assert store.path(digest).read_bytes() == data and sum(seen) == len(data)  # type: ignore[union-attr]
    finally:
        server.stop()


def test_a_partial_holding_every_byte_is_counted_once(tmp_path: Path, holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    data = b"all of it, not committed"
    digest = sha256_digest(data)
    with server.store.writer(digest, len(data)) as writer:
        writer.write(data)  # (and the holder stopped before its commit)
    source = tmp_path / "weights.bin"
    source.write_bytes(data)
    seen: list[int] = []
    assert upload_blob(url, source, digest, authorization=TOKEN, progress=seen.append) == 0
    assert server.store.has(digest) and seen == [len(data)]


def test_a_holder_that_takes_no_uploads_and_the_size_limit(tmp_path: Path) -> None:
    reader = BlobServer(BlobStore(tmp_path / "node"), only_token)
    url = f"http://{reader.start('127.0.0.1:0')}"
    limited = BlobServer(BlobStore(tmp_path / "gw"), only_token, accept_uploads=True, max_blob_bytes=10)
    limited_url = f"http://{limited.start('127.0.0.1:0')}"
    try:
        source = tmp_path / "f"
        source.write_bytes(b"x" * 11)
        with pytest.raises(TransferError) as refused:
            upload_blob(url, source, sha256_digest(b"x" * 11), authorization=TOKEN)
        assert refused.value.status == 405
        with pytest.raises(TransferError) as large:
            upload_blob(limited_url, source, sha256_digest(b"x" * 11), authorization=TOKEN)
        assert large.value.status == 413
    finally:
        reader.stop()
        limited.stop()


def test_refusals_of_head_carry_no_body_and_chunked_uploads_are_refused(holder: tuple[BlobServer, str]) -> None:
    server, url = holder
    digest = sha256_digest(b"abc")
    status, headers, body = raw(url, f"HEAD /blobs/{digest} HTTP/1.1\r\n\r\n".encode())
    assert status == 401 and body == b"" and int(headers["content-length"]) > 0
    status, _, _ = raw(
        url,
        f"PUT /blobs/{digest}?size=3 HTTP/1.1\r\nAuthorization: {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n"
        "3\r\nabc\r\n0\r\n\r\n".encode(),
    )
    assert status == 411 and not server.store.has(digest)


def test_connections_past_the_limit_are_refused_without_a_thread(tmp_path: Path) -> None:
    """Each connection holds a thread (idle ones for the handler's timeout): a peer opening many,
    credentials or not, must not make one thread each; those past the limit hear 503 at once."""
    server = BlobServer(BlobStore(tmp_path / "holder"), only_token, tls=False)
    host, port = server.start("127.0.0.1:0").split(":")
    digest = server.store.put(b"abc")
    limit = getattr(blobnet, "DEFAULT_MAX_CONNECTIONS", 256)
    threads_before = threading.active_count()
    idle = [socket.create_connection((host, int(port))) for _ in range(limit)]
    try:
        deadline = time.monotonic() + 10.0
        while threading.active_count() < threads_before + limit and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(5):
            with socket.create_connection((host, int(port)), timeout=2.0) as extra:
                assert extra.recv(65536).startswith(b"HTTP/1.1 503 ")  # at once, not after a timeout
        assert threading.active_count() <= threads_before + limit
    finally:
        for conn in idle:
            conn.close()
    deadline = time.monotonic() + 10.0
    while True:  # the slots come back once the idle connections close
        try:
            fetch_blob(f"http://{host}:{port}", digest, 3, BlobStore(tmp_path / "mine"), authorization=TOKEN, tls=False)
            break
        except TransferError as exc:
            assert exc.status == 503 and time.monotonic() < deadline
            time.sleep(0.05)
    server.stop()


def test_a_negative_content_length_is_refused_not_read_to_the_end(holder: tuple[BlobServer, str]) -> None:
    """A refused upload's body is read and dropped (`_discard`); read(-1) would read to the end
    of the connection, every byte held in memory, however much the client sends."""
    server, url = holder
    digest = server.store.put(b"stored")
    host, port = url.removeprefix("http://").split(":")
    for query in (f"{digest}?size=6", f"{sha256_digest(b'other')}?size=5"):  # stored already; a wrong offset
        with socket.create_connection((host, int(port)), timeout=2.0) as conn:
            head = f"PUT /blobs/{query} HTTP/1.1\r\nAuthorization: {TOKEN}\r\nContent-Length: -1\r\n\r\n"
            conn.sendall(head.encode() + b"x" * 65536)  # and it goes on sending: the server must not wait
            status_line = conn.recv(65536).split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 400 "), status_line


def serve_once(answer: bytes) -> str:
    """A holder that answers every request of one connection with `answer`, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2.0)
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    conn.sendall(answer)
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_holder_with_malformed_numbers_is_a_transfer_error_not_a_crash(tmp_path: Path) -> None:
    """Callers pass over a holder on TransferError (staging tries the next one); a ValueError out of
    int() of its headers ended the whole staging (and a CLI upload) with a traceback instead."""
    digest = sha256_digest(b"abc")
    mine = BlobStore(tmp_path / "mine")
    bad_length = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: three\r\n\r\nabc")
    with pytest.raises(TransferError, match="Content-Length"):
        fetch_blob(bad_length, digest, 3, mine, tls=False)
    source = tmp_path / "blob"
    source.write_bytes(b"abc")
    bad_offset = serve_once(f"HTTP/1.1 404 Not Found\r\n{UPLOAD_OFFSET}: soon\r\nContent-Length: 0\r\n\r\n".encode())
    with pytest.raises(TransferError, match=UPLOAD_OFFSET):
        upload_blob(bad_offset, source, digest, tls=False)


@pytest.mark.parametrize(
    ("nbytes", "failing"),
    [(1000, "write"), (1000, "open"), (3 * PUMP_BUFFER_BYTES + 17, "write"), (1000, "fsync")],
)
def test_a_holder_whose_disk_is_full_says_so(
    tmp_path: Path, holder: tuple[BlobServer, str], monkeypatch: pytest.MonkeyPatch, nbytes: int, failing: str
) -> None:
    """The holder's own write failing (ENOSPC) is answered 507 naming it, not taken for the client
    breaking off (the connection closed without an answer: the CLI said the upload broke off, and
    resumed into the same full disk)."""
    _, url = holder

    def full(*args: object) -> int:
        raise OSError(28, "No space left on device")

    if failing == "fsync":  # every byte written, the flush before the commit fails (thin storage, NFS)
        monkeypatch.setattr(blobs.os, "fsync", full)
    else:
        monkeypatch.setattr(blobs.os, "pwrite", full)
        monkeypatch.setattr(blobs.BlobWriter, "write", lambda self, data: full(0, data))
    if failing == "open":  # no inode left for its partial
        monkeypatch.setattr(blobs.BlobStore, "writer", lambda self, digest, size: full(0, digest))
    source = tmp_path / "weights.bin"
    data = big(nbytes)
    source.write_bytes(data)
    with pytest.raises(TransferError) as refused:
        upload_blob(url, source, sha256_digest(data), authorization=TOKEN)
    assert refused.value.status == 507 and "No space left" in str(refused.value)


def test_a_client_that_goes_mid_blob_is_logged_in_a_line_not_a_traceback(
    holder: tuple[BlobServer, str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch given up half way (a staging cancelled, a client timed out) is routine: socketserver's
    handle_error printed its traceback to stderr, past the logging configuration, every time."""
    server, url = holder
    digest = server.store.put(big(32 << 20))
    host, port = url.removeprefix("http://").split(":")
    with caplog.at_level("DEBUG", logger="gpufaas.blobnet"):
        conn = socket.create_connection((host, int(port)))
        conn.sendall(f"GET /blobs/{digest} HTTP/1.1\r\nAuthorization: {TOKEN}\r\n\r\n".encode())
        conn.recv(1000)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + (0).to_bytes(4, "little"))
        conn.close()  # a reset, while the holder sends
        deadline = time.monotonic() + 5.0
        while "broke off" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "Traceback" not in capsys.readouterr().err
    assert "broke off" in caplog.text and "Traceback" not in caplog.text


def serve_trickle(data: bytes, stop: threading.Event) -> str:
    """A holder that announces `data` whole, then sends it a byte at a time, each well within any
    per-read timeout, until `stop` (or the client goes)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode())
            for byte in data:
                if stop.wait(0.05):
                    break
                conn.sendall(bytes([byte]))
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_holder_that_trickles_is_given_up_on_at_the_transfer_deadline(tmp_path: Path) -> None:
    """Each byte came within the per-read timeout, so a holder trickling (or stalled a read short of
    it, again and again) held the fetch, and the call waiting on it, for ever. The whole transfer
    now has a deadline (the timeout plus the size at a floor rate): TransferError, the blob free
    for the next holder."""
    data = os.urandom(2000)
    digest = sha256_digest(data)
    mine = BlobStore(tmp_path / "mine")
    stop = threading.Event()
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            fetch_blob(serve_trickle(data, stop), digest, len(data), mine, timeout_s=0.5, min_rate_bytes_s=4000)
            outcome.append(None)
        except BaseException as exc:  # (handed to the test's thread)
            outcome.append(exc)

    fetching = threading.Thread(target=fetch, daemon=True)
    fetching.start()
    fetching.join(30.0)  # (a guard against hanging the suite, not a measure of speed)
    stop.set()
    fetching.join()
    assert len(outcome) == 1 and isinstance(outcome[0], TransferError), outcome
    assert "deadline" in str(outcome[0])
    assert not mine.has(digest) and not mine.busy(digest)


@pytest.mark.parametrize("nbytes", [1000, 2 * PUMP_BUFFER_BYTES + 4096 + 17])
def test_a_fetch_that_times_out_keeps_every_byte_that_arrived(tmp_path: Path, nbytes: int) -> None:
    """A holder gone silent half way (the read timed out: an exception, not the end of the body)
    lost what had arrived in the buffer being filled, all of a blob of up to PUMP_BUFFER_BYTES:
    the next holder sent it again. What arrived is kept for the resume, as when a holder closes."""
    data = os.urandom(nbytes)
    digest = sha256_digest(data)
    half = nbytes // 2
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {nbytes}\r\n\r\n".encode() + data[:half])
            stop.wait(30.0)
        listener.close()

    serving = threading.Thread(target=run, daemon=True)
    serving.start()
    mine = BlobStore(tmp_path / "mine")
    try:
        with pytest.raises(TransferError, match="broke off"):
            fetch_blob(f"http://127.0.0.1:{listener.getsockname()[1]}", digest, nbytes, mine, timeout_s=0.5)
    finally:
        stop.set()
        serving.join()
    assert mine.partial_size(digest) == half
    with mine.writer(digest, nbytes) as writer:  # resumed where it stopped, and the hash with it
        assert writer.offset == half
        writer.write(data[half:])
        writer.commit()
    assert mine.path(digest).read_bytes() == data  # type: ignore[union-attr]


@pytest.mark.parametrize("host", ["bad..host", "a" * 64 + ".example"])
def test_a_holder_with_a_host_name_no_resolver_takes_is_passed_over(tmp_path: Path, host: str) -> None:
    """A holder advertised under a host name IDNA cannot encode (an empty label, one over 63
    characters: a typo in --blob-advertise) raised UnicodeError out of the connect, which no
    caller passes over: one such holder failed every staging that reached it. A TransferError."""
    source = tmp_path / "blob"
    source.write_bytes(b"abc")
    digest = sha256_digest(b"abc")
    with pytest.raises(TransferError, match="cannot reach the blob holder"):
        fetch_blob(f"http://{host}:9000", digest, 3, BlobStore(tmp_path / "mine"), tls=False)
    with pytest.raises(TransferError, match="cannot reach the blob holder"):
        upload_blob(f"http://{host}:9000", source, digest, tls=False)


def test_a_client_that_trickles_its_request_head_is_cut_off(
    holder: tuple[BlobServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anyone may connect to a gateway's blob server (users upload in plain HTTP); before any
    credential is read, a request head sent a byte at a time (each within the read timeout) held
    its connection, and max_connections of them refused everyone. The head now has a deadline."""
    monkeypatch.setattr(blobnet, "HEAD_TIMEOUT_S", 0.5)
    _, url = holder
    host, port = url.removeprefix("http://").rsplit(":", 1)
    closed = False
    with socket.create_connection((host, int(port)), timeout=5.0) as conn:
        for byte in b"GET /blobs/sha256:" + b"0" * 64 + b" HTTP/1.1\r\nX-Slow: " + b"a" * 400:
            readable, _, _ = select.select([conn], [], [], 0.05)  # (400 bytes: 20 s, a guard)
            if readable:
                closed = not conn.recv(65536)
                break
            try:
                conn.send(bytes([byte]))
            except OSError:
                closed = True
                break
    assert closed
