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
        with self.server.lock:
            self.server.arrivals.append(
                {
                    "t": time.monotonic(),
                    "path": self.path,
                    "body": body,
                    "key": self.headers["Idempotency-Key"],
                }
            )
            key: str | tuple[str, str] = (self.path, str(body.get("routing_key")))
            if key not in self.server.fail:
                key = self.path
            left = self.server.fail.get(key, 0)
            if left:
                self.server.fail[key] = left - 1
        self.send_response(503 if left else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass
