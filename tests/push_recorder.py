"""A push endpoint for the tests: a real HTTP server recording each POST, failing on demand."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Recorder(ThreadingHTTPServer):
    """A push endpoint: records each POST (time, subscription key, body); fails on demand."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.arrivals: list[dict[str, Any]] = []
        # path, or (path, routing key) -> how many more of those POSTs answer 503
        self.fail: dict[str | tuple[str, str], int] = {}
        # path -> the answers its next POSTs get (status, headers), before any failure above
        self.answers: dict[str, list[tuple[int, dict[str, str]]]] = {}
        # path -> every POST answers this (status) while set
        self.down: dict[str, int] = {}
        # path -> seconds each POST takes to answer; the most POSTs of a path at once
        self.slow: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def times(self, path: str, routing_key: str = "a") -> list[float]:
        with self.lock:
            return [
                a["t"]
                for a in self.arrivals
                if a["path"] == path and a["body"]["routing_key"] == routing_key
            ]


class _Handler(BaseHTTPRequestHandler):
    server: Recorder

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            now = server.in_flight[self.path] = server.in_flight.get(self.path, 0) + 1
            server.most_at_once[self.path] = max(server.most_at_once.get(self.path, 0), now)
        time.sleep(server.slow.get(self.path, 0.0))
        with server.lock:
            server.in_flight[self.path] -= 1
            self.server.arrivals.append(
                {
                    "t": time.monotonic(),
                    "path": self.path,
                    "body": body,
                    "key": self.headers["Idempotency-Key"],
                    "attempt": self.headers.get("X-Orderly-Attempt"),
                }
            )
            scripted = self.server.answers.get(self.path)
            status, headers = scripted.pop(0) if scripted else (200, {})
            if status == 200:
                key: str | tuple[str, str] = (self.path, str(body.get("routing_key")))
                if key not in self.server.fail:
                    key = self.path
                left = self.server.fail.get(key, 0)
                if left:
                    self.server.fail[key] = left - 1
                    status = 503
                status = self.server.down.get(self.path, status)
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass
