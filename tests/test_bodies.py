"""Request bodies bounded before they are read (api/http/bodies.py), over real sockets to a real
API process: a Content-Length over a route's limit answered 413 before the body is sent, a
chunked body cut at the limit, a body of exactly the limit taken, nothing stored on refusal."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Engine

from orderly.api.http.bodies import BODILESS_BYTES, BodyLimits
from orderly.api.http.common import ENVELOPE_BYTES
from orderly.worker.settings import Settings
from tests.helpers import count_messages, message
from tests.stack import Stack

PAYLOAD_BYTES = 1_000
BATCH_BYTES = 131_072
MESSAGE_LIMIT = PAYLOAD_BYTES + ENVELOPE_BYTES
FORM_LIMIT = 65_536  # the console's MAX_FORM_BYTES
# A bound on a failing test, never a wait: every answer below comes at once when it passes.
ANSWER_S = 20.0


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after the answer

    def problems(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = json.loads(self.body)["errors"]
        return found


class Reader:
    """An HTTP/1.1 answer read off a socket: its head, then as many body bytes as it says."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> bool:
        chunk = self.sock.recv(65_536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            if not self._more():
                raise AssertionError(f"the connection closed before an answer: {self.buffer!r}")
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length and self._more():
            pass
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), headers, body

    def closed(self) -> bool:
        """Whether the server closed the connection: another request on it finds it gone (EOF
        or a reset) rather than answered."""
        if self.buffer:
            return False
        try:
            self.sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            if not self._more():
                return True
        except (BrokenPipeError, ConnectionResetError):
            return True
        status = self.answer()[0]
        assert status == 200, f"GET /health on a kept connection answered {status}"
        return False


def exchange(port: int, head: str, chunks: Iterable[bytes] = (), body: bytes = b"") -> Answer:
    """Send ``head`` (the request line and headers) and ``body`` in one write, then ``chunks``
    while the server has not answered; then read its answer. Sending stops at the first byte
    of an answer, and a connection the server closed on the sender is not an error: both are
    ways to refuse."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        for chunk in chunks:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        reader = Reader(sock)
        status, headers, body = reader.answer()
        return Answer(status, headers, body, reader.closed())


def request_head(method: str, path: str, token: str | None, *headers: str) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return "\r\n".join([*lines, *headers]) + "\r\n"


def chunked(total: int, size: int = 16_384) -> Iterator[bytes]:
    """``total`` bytes of a body in chunked transfer coding, then its last chunk."""
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield f"{n:x}\r\n".encode() + b" " * n + b"\r\n"
        sent += n
    yield b"0\r\n\r\n"


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON of exactly ``size`` bytes (spaces after it: still the same JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


@pytest.fixture
def api(stack: Stack) -> Stack:
    stack.env(
        ORDERLY_MAX_PAYLOAD_BYTES=str(PAYLOAD_BYTES), ORDERLY_MAX_BATCH_BYTES=str(BATCH_BYTES)
    )
    stack.start_api()
    return stack


def assert_refused(answer: Answer, limit: int) -> None:
    assert answer.status == 413, answer
    assert answer.headers["content-type"] == "application/json"
    (problem,) = answer.problems()
    assert problem["field"] == "body" and f"over the limit of {limit} bytes" in problem["problem"]
    assert answer.headers.get("connection") == "close"
    assert answer.closed, "the server kept the refused connection open"


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(
    api: Stack, db: Engine
) -> None:
    before = count_messages(db)
    cases = [
        ("POST", "/messages", api.token, MESSAGE_LIMIT),
        ("POST", "/messages", None, MESSAGE_LIMIT),  # nobody: the size first, before the key
        ("POST", "/messages:batch", api.token, BATCH_BYTES),
        ("POST", "/console/login", None, FORM_LIMIT),
        ("POST", "/acks/some-id", None, BODILESS_BYTES),
        ("GET", "/health", None, BODILESS_BYTES),
    ]
    for method, path, token, limit in cases:
        # Only the headers go: the answer comes without the server waiting for a body.
        head = request_head(method, path, token, "Content-Length: 300000000")
        answer = exchange(api.port, head)
        assert_refused(answer, limit)
        assert "300000000 bytes" in answer.problems()[0]["problem"], answer
    # With Expect: 100-continue the answer is the refusal, never "100 Continue".
    head = request_head("POST", "/messages", api.token, f"Content-Length: {MESSAGE_LIMIT + 1}")
    answer = exchange(api.port, head + "Expect: 100-continue\r\n")
    assert_refused(answer, MESSAGE_LIMIT)
    assert count_messages(db) == before


def test_a_chunked_body_over_the_limit_is_cut_there_with_413(api: Stack, db: Engine) -> None:
    before = count_messages(db)
    for path, limit in (("/messages", MESSAGE_LIMIT), ("/messages:batch", BATCH_BYTES)):
        head = request_head(
            "POST",
            path,
            api.token,
            "Content-Type: application/json",
            "Transfer-Encoding: chunked",
        )
        # Far more than the limit is offered; the server answers after reading the limit.
        answer = exchange(api.port, head, chunked(300 * limit))
        assert_refused(answer, limit)
        assert f"more than {limit} bytes" in answer.problems()[0]["problem"]
    form = request_head(
        "POST",
        "/console/login",
        None,
        "Content-Type: application/x-www-form-urlencoded",
        "Transfer-Encoding: chunked",
    )
    assert_refused(exchange(api.port, form, chunked(100 * FORM_LIMIT)), FORM_LIMIT)
    assert count_messages(db) == before


def test_a_body_of_exactly_the_limit_is_taken_and_one_byte_more_is_not(
    api: Stack, db: Engine
) -> None:
    before = count_messages(db)
    for n, framing in enumerate(("length", "chunked")):
        body = padded(message(n), MESSAGE_LIMIT)
        kind = "Content-Type: application/json"
        if framing == "length":
            head = request_head(
                "POST", "/messages", api.token, kind, f"Content-Length: {len(body)}"
            )
            answer = exchange(api.port, head, body=body)
        else:
            head = request_head("POST", "/messages", api.token, kind, "Transfer-Encoding: chunked")
            answer = exchange(
                api.port, head, [f"{len(body):x}\r\n".encode() + body + b"\r\n", b"0\r\n\r\n"]
            )
        assert answer.status == 201, answer
        assert not answer.closed, "an accepted request's connection was closed"
    assert count_messages(db) == before + 2
    over = padded(message(9), MESSAGE_LIMIT + 1)
    head = request_head(
        "POST",
        "/messages",
        api.token,
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
    )
    answer = exchange(
        api.port, head, [f"{len(over):x}\r\n".encode() + over + b"\r\n", b"0\r\n\r\n"]
    )
    assert_refused(answer, MESSAGE_LIMIT)
    # A form of exactly the console's limit reaches the sign-in (an unknown key: 401).
    form = b"key=" + b"x" * (FORM_LIMIT - 4)
    head = request_head(
        "POST",
        "/console/login",
        None,
        "Content-Type: application/x-www-form-urlencoded",
        f"Content-Length: {len(form)}",
    )
    assert exchange(api.port, head, body=form).status == 401
    # A stray body of a GET within the small limit is no reason to refuse.
    head = request_head("GET", "/health", None, f"Content-Length: {BODILESS_BYTES}")
    assert exchange(api.port, head, body=b" " * BODILESS_BYTES).status == 200
    assert count_messages(db) == before + 2


def test_an_answer_before_the_body_is_read_closes_the_connection(api: Stack, db: Engine) -> None:
    before = count_messages(db)
    # No key: 401 before the body is read; the rest of the stream is not read either.
    head = request_head(
        "POST", "/messages", None, "Content-Type: application/json", "Transfer-Encoding: chunked"
    )
    answer = exchange(api.port, head, chunked(300 * MESSAGE_LIMIT))
    assert answer.status == 401, answer
    assert answer.headers.get("connection") == "close" and answer.closed
    # A refusal of a request without a body, or with a small one, keeps the connection.
    bad_key = "orderly_000000000000_" + "x" * 43
    answer = exchange(api.port, request_head("GET", "/messages", bad_key))
    assert answer.status == 401 and not answer.closed, answer
    small = json.dumps(message(1)).encode()
    head = request_head("POST", "/messages", bad_key, f"Content-Length: {len(small)}")
    # In one write with its head: the body is on the wire before the refusal can come.
    answer = exchange(api.port, head, body=small)
    assert answer.status == 401 and not answer.closed, answer
    assert count_messages(db) == before


def test_every_route_limit_is_within_the_ceiling() -> None:
    limits = BodyLimits.of(
        Settings(ORDERLY_MAX_PAYLOAD_BYTES=PAYLOAD_BYTES, ORDERLY_MAX_BATCH_BYTES=BATCH_BYTES),
        FORM_LIMIT,
    )
    routes = [
        ("POST", "/messages", MESSAGE_LIMIT),
        ("POST", "/messages:batch", BATCH_BYTES),
        ("PUT", "/channels/chat", MESSAGE_LIMIT),
        ("POST", "/console/login", FORM_LIMIT),
        ("POST", "/acks/a-1", BODILESS_BYTES),
        ("GET", "/messages", BODILESS_BYTES),
        ("DELETE", "/keys/k", BODILESS_BYTES),
    ]
    for method, path, expected in routes:
        assert limits.limit(method, path) == expected, (method, path)
    assert limits.ceiling == BATCH_BYTES == max(e for _, _, e in routes)
