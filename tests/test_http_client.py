"""The one outbound HTTP client against a real local server: answers, keep-alive, timeouts,
a total deadline, a bounded answer, refused connections."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.helpers import local_http


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _Server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append((self.path, body, dict(self.headers), self.client_address[1]))
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/drip-headers":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for n in range(100):  # a header line every 50 ms: 5 s in all
                self.wfile.write(f"X-Slow-{n}: x\r\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"Content-Length: 0\r\n\r\n")
            return
        if self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):  # a byte every 50 ms: each read is quick, the whole is not
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
            return
        payload = b"y" * 5000 if self.path == "/big" else b'{"async_response_id": "a1"}'
        self.send_response(503 if self.path == "/down" else 202)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, bytes, dict[str, str], int]] = []

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_posts_json_and_reuses_the_connection(server: _Server) -> None:
    http = local_http()
    for _ in range(3):
        reply = http.post_json(
            f"{server.base}/in", {"a": 1}, timeout_ms=5000, headers={"Idempotency-Key": "k"}
        )
        assert (reply.status, reply.content, reply.ok) == (
            202,
            b'{"async_response_id": "a1"}',
            True,
        )
    assert [s[1] for s in server.seen] == [b'{"a":1}'] * 3
    assert server.seen[0][2]["Idempotency-Key"] == "k"
    assert server.seen[0][2]["Content-Type"] == "application/json"
    assert len({s[3] for s in server.seen}) == 1  # one kept-alive connection


def test_a_non_2xx_answer_is_an_answer(server: _Server) -> None:
    reply = local_http().post_json(f"{server.base}/down", {}, timeout_ms=5000)
    assert reply.status == 503 and not reply.ok
    assert reply.describe().startswith("HTTP 503")


def test_a_slow_answer_times_out(server: _Server) -> None:
    reply = local_http().post_json(f"{server.base}/slow", {}, timeout_ms=300)
    assert reply.status is None and reply.error == "timeout after 300 ms"


@pytest.mark.parametrize("path", ["/drip", "/drip-headers"])
def test_the_total_deadline_holds_against_an_answer_that_trickles_in(
    server: _Server, path: str
) -> None:
    """Each read comes quickly, the whole does not: the request ends at its deadline (5 s of
    trickle against 300 ms), not one read timeout after another."""
    started = time.monotonic()
    reply = local_http().post_json(f"{server.base}{path}", {}, timeout_ms=300)
    assert reply.status is None and reply.error == "timeout after 300 ms"
    assert time.monotonic() - started < 4.5  # well before the trickle would have ended


def test_an_answer_is_read_up_to_the_limit(server: _Server) -> None:
    http = local_http(max_response_bytes=1024)
    reply = http.post_json(f"{server.base}/big", {}, timeout_ms=5000)
    assert reply.status == 202 and reply.content == b"y" * 1024


def test_a_refused_connection_and_a_bad_url_are_reasons_not_exceptions() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    refused = local_http().post_json(f"http://127.0.0.1:{port}/", {}, timeout_ms=1000)
    assert refused.status is None and "ConnectError" in refused.error
    bad = local_http().post_json("ftp://x/", {}, timeout_ms=1000)
    assert bad.status is None and bad.error


def test_a_new_process_makes_its_own_connections(server: _Server, monkeypatch: Any) -> None:
    http = local_http()
    http.post_json(f"{server.base}/in", {}, timeout_ms=5000)
    first = http._connections()
    monkeypatch.setattr("os.getpid", lambda: -1)  # as after a fork
    assert http._connections() is not first


def test_a_url_is_read_as_httpx_reads_it() -> None:
    from orderly.worker.core.http import _target

    target = _target("http://bücher.example:8080/a b/ü?x=ä")
    assert target.host == b"xn--bcher-kva.example"
    assert target.port == 8080
    assert target.target == b"/a%20b/%C3%BC?x=%C3%A4"
