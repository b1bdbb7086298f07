"""The sink's HTTP server: a small asyncio protocol that records deliveries and answers
them as the behaviour says, plus its control routes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qs

from tooling.sink.behaviour import Behaviour, BehaviourError
from tooling.sink.state import _AckSender, _Arrival, _Decision, _State

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024


@dataclass(slots=True)
class _Head:
    method: str
    target: str
    headers: dict[str, str]
    length: int
    keep_alive: bool


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    t_arrival: float


class _HttpError(Exception):
    def __init__(self, status: int, problem: str) -> None:
        super().__init__(problem)
        self.status = status
        self.problem = problem


_STATUS_LINES: dict[int, bytes] = {}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} {_phrase(status)}\r\n".encode("latin-1")
        _STATUS_LINES[status] = line
    return line


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _problem(field: str, problem: str) -> bytes:
    return _json({"errors": [{"field": field, "problem": problem}]})


class _Connection(asyncio.Protocol):
    """One client connection: requests are parsed from the buffer and answered in order."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: _Head | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None
        self._buf.clear()
        self._head = None

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._drain()

    def _drain(self) -> None:
        while self._transport is not None and not self._busy:
            try:
                request = self._next_request()
            except _HttpError as exc:
                self.respond(exc.status, _problem("request", exc.problem), keep_alive=False)
                return
            if request is None:
                return
            self._server.handle(self, request)

    def _next_request(self) -> _Request | None:
        head = self._head
        if head is None:
            if not self._buf:
                return None
            head = self._parse_head()
            if head is None:
                return None
            self._head = head
        if len(self._buf) < head.length:
            return None
        body = bytes(self._buf[: head.length])
        del self._buf[: head.length]
        self._head = None
        path, _, query = head.target.partition("?")
        return _Request(head.method, path, query, head.headers, body, head.keep_alive, time.time())

    def _parse_head(self) -> _Head | None:
        # Stray CRLFs between requests are allowed by RFC 9112.
        while self._buf[:2] == b"\r\n":
            del self._buf[:2]
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                raise _HttpError(431, "request head too large")
            return None
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _HttpError(400, f"bad request line {lines[0][:100]!r}")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, f"bad header line {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
        raw_length = headers.get("content-length")
        if raw_length is None:
            if "transfer-encoding" in headers or method in ("POST", "PUT", "PATCH"):
                raise _HttpError(411, "Content-Length is required")
            length = 0
        else:
            if not raw_length.isdigit():
                raise _HttpError(400, f"bad Content-Length {raw_length[:40]!r}")
            length = int(raw_length)
            if length > MAX_BODY:
                raise _HttpError(413, f"body over {MAX_BODY} bytes")
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.0":
            keep_alive = "keep-alive" in connection
        else:
            keep_alive = "close" not in connection
        if (
            headers.get("expect", "").lower() == "100-continue"
            and len(self._buf) < length
            and self._transport is not None
        ):
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return _Head(method, target, headers, length, keep_alive)

    def respond(self, status: int, body: bytes, *, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        head = _status_line(status) + (
            b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        )
        if not keep_alive:
            head += b"Connection: close\r\n"
        transport.write(head + b"\r\n" + body)
        if not keep_alive:
            transport.close()
            self._transport = None

    def respond_later(
        self, delay_s: float, answer: Callable[[], tuple[int, bytes]], *, keep_alive: bool
    ) -> None:
        """Answer after ``delay_s`` without holding up other connections; this one waits."""
        self._busy = True
        if self._transport is not None:
            self._transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._later(delay_s, answer, keep_alive))
        self._server.tasks.add(task)
        task.add_done_callback(self._server.tasks.discard)

    async def _later(
        self, delay_s: float, answer: Callable[[], tuple[int, bytes]], keep_alive: bool
    ) -> None:
        await asyncio.sleep(delay_s)
        status, body = answer()
        self.respond(status, body, keep_alive=keep_alive)
        self._busy = False
        if self._transport is not None:
            self._transport.resume_reading()
            self._drain()


class _Server:
    """The listening socket, its connections and the request routing, on one event loop."""

    def __init__(self, state: _State, acks: _AckSender) -> None:
        self.state = state
        self.acks = acks
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int) -> int:
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def handle(self, conn: _Connection, req: _Request) -> None:
        if req.path.startswith("/_sink/"):
            status, body = self._control(req)
            conn.respond(status, body, keep_alive=req.keep_alive)
        elif req.method == "POST":
            self._deliver(conn, req)
        else:
            conn.respond(405, _problem("method", "deliveries are POSTs"), keep_alive=req.keep_alive)

    def _deliver(self, conn: _Connection, req: _Request) -> None:
        try:
            data = json.loads(req.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            conn.respond(400, _problem("body", f"malformed JSON: {exc}"), keep_alive=req.keep_alive)
            return
        if not isinstance(data, dict):
            conn.respond(400, _problem("body", "must be a JSON object"), keep_alive=req.keep_alive)
            return
        if "conversation_id" not in data and "correlation_id" in data:
            # A room's event pushed to a subscription: logged under its room and routing key,
            # keyed by the Idempotency-Key (one per event and subscription).
            key = req.headers.get("idempotency-key") or str(data["correlation_id"])
            data = {
                "conversation_id": str(data.get("room", "")),
                "request_id": str(data.get("routing_key", "")),
                "response_id": key,
            }
        ids: list[str] = []
        for name in ("conversation_id", "request_id", "response_id"):
            value = data.get(name)
            if not isinstance(value, str):
                conn.respond(400, _problem(name, "must be a string"), keep_alive=req.keep_alive)
                return
            ids.append(value)
        conversation_id, request_id, response_id = ids
        key = req.headers.get("idempotency-key") or response_id
        arrival, decision = self.state.arrive(
            conversation_id,
            request_id,
            response_id,
            key,
            req.t_arrival,
            req.headers,
            data.get("payload"),
        )

        def answer() -> tuple[int, bytes]:
            if decision.status == 200:
                body = b"{}"
            elif decision.status == 202:
                body = _json({"async_response_id": arrival.async_response_id})
            else:
                body = _json({"error": _phrase(decision.status)})
            arrival.t_responded = time.time()
            # Called right before the write, on the loop thread: the timer cannot fire before
            # the 202 is out, and the ACK clock starts when it goes out, as a client's would.
            self._schedule_ack(arrival, decision)
            return decision.status, body

        if decision.delay_s > 0:
            conn.respond_later(decision.delay_s, answer, keep_alive=req.keep_alive)
            return
        status, body = answer()
        conn.respond(status, body, keep_alive=req.keep_alive)

    def _schedule_ack(self, arrival: _Arrival, decision: _Decision) -> None:
        if decision.ack_delay_s is None or decision.ack_url is None or self._loop is None:
            return
        self._loop.call_later(decision.ack_delay_s, self.acks.submit, arrival, decision.ack_url)

    def _control(self, req: _Request) -> tuple[int, bytes]:
        route = req.path.rstrip("/")
        methods: dict[str, dict[str, Callable[[_Request], tuple[int, bytes]]]] = {
            "/_sink/health": {"GET": lambda _: (200, b'{"ok":true}')},
            "/_sink/behaviour": {"GET": self._get_behaviour, "PUT": self._put_behaviour},
            "/_sink/log": {"GET": self._get_log, "DELETE": self._delete_log},
            "/_sink/deliveries": {"GET": self._get_deliveries},
        }
        handlers = methods.get(route)
        if handlers is None:
            return 404, _problem("path", f"no control endpoint {req.path}")
        handler = handlers.get(req.method)
        if handler is None:
            return 405, _problem("method", f"{req.path} takes {', '.join(handlers)}")
        return handler(req)

    def _get_behaviour(self, _: _Request) -> tuple[int, bytes]:
        return 200, _json(self.state.behaviour.as_dict())

    def _put_behaviour(self, req: _Request) -> tuple[int, bytes]:
        try:
            data = json.loads(req.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return 400, _problem("body", f"malformed JSON: {exc}")
        try:
            behaviour = Behaviour.parse(data)
        except BehaviourError as exc:
            return 422, _problem(exc.field, exc.problem)
        self.state.configure(behaviour)
        return 200, _json(behaviour.as_dict())

    def _get_log(self, req: _Request) -> tuple[int, bytes]:
        since = 0
        values = parse_qs(req.query).get("since")
        if values:
            try:
                since = int(values[-1])
            except ValueError:
                return 422, _problem("since", f"must be an integer, got {values[-1]!r}")
        return 200, _json({"arrivals": self.state.arrivals(since)})

    def _delete_log(self, _: _Request) -> tuple[int, bytes]:
        self.state.reset()
        return 200, b"{}"

    def _get_deliveries(self, _: _Request) -> tuple[int, bytes]:
        return 200, _json({"conversations": self.state.deliveries()})


def _base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
