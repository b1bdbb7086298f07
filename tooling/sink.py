"""Client sink: a real HTTP server standing in for a chat client's channel (or a PUSH
subscriber). It records every delivery orderly makes to it and answers with configurable,
reproducible behaviour."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qs

import httpx

log = logging.getLogger("orderly.sink")

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
ACK_ATTEMPTS = 3
ACK_TIMEOUT_S = 5.0

_PROBABILITIES = ("p_recoverable", "p_timeout", "p_non_recoverable", "p_async")
_BEHAVIOUR_FIELDS = frozenset(
    {
        "seed",
        *_PROBABILITIES,
        "p_never_ack",
        "ack_delay_ms",
        "timeout_sleep_ms",
        "orderly_url",
        "rules",
    }
)
_RULE_FIELDS = frozenset({"match", "status", "times", "never_ack", "delay_ms"})
_MATCH_FIELDS = frozenset({"conversation_id", "response_id"})


class BehaviourError(ValueError):
    """A behaviour setting that cannot be applied; ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def _number(value: Any, field: str, *, low: float = 0.0, high: float = math.inf) -> float:
    # bool is an int subclass; True as a probability is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BehaviourError(field, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise BehaviourError(field, f"must be between {low:g} and {high:g}, got {value!r}")
    return number


def _integer(value: Any, field: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BehaviourError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise BehaviourError(field, f"must be at least {low}, got {value!r}")
    return value


def _unknown(data: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    for name in data:
        if name not in allowed:
            raise BehaviourError(f"{prefix}{name}", f"unknown field (allowed: {sorted(allowed)})")


@dataclass(frozen=True, slots=True)
class Rule:
    """A deterministic override: the arrivals it matches get ``status``, ``times`` times."""

    conversation_id: str | None = None
    response_id: str | None = None
    status: int = 200
    times: int | None = None
    never_ack: bool = False
    delay_ms: float = 0.0

    def matches(self, conversation_id: str, response_id: str) -> bool:
        return (self.conversation_id is None or self.conversation_id == conversation_id) and (
            self.response_id is None or self.response_id == response_id
        )

    @classmethod
    def parse(cls, data: Any, field: str) -> Rule:
        if not isinstance(data, dict):
            raise BehaviourError(field, "must be an object")
        _unknown(data, _RULE_FIELDS, f"{field}.")
        match = data.get("match", {})
        if not isinstance(match, dict):
            raise BehaviourError(f"{field}.match", "must be an object")
        _unknown(match, _MATCH_FIELDS, f"{field}.match.")
        for name, value in match.items():
            if not isinstance(value, str):
                raise BehaviourError(f"{field}.match.{name}", "must be a string")
        if "status" not in data:
            raise BehaviourError(f"{field}.status", "is required")
        status = _integer(data["status"], f"{field}.status", low=0)
        if status not in (200, 202) and not 400 <= status <= 599:
            raise BehaviourError(f"{field}.status", f"must be 200, 202 or 4xx/5xx, got {status}")
        times = data.get("times")
        if times is not None:
            times = _integer(times, f"{field}.times", low=0)
        never_ack = data.get("never_ack", False)
        if not isinstance(never_ack, bool):
            raise BehaviourError(f"{field}.never_ack", "must be a boolean")
        delay_ms = _number(data.get("delay_ms", 0), f"{field}.delay_ms", high=600_000)
        return cls(
            conversation_id=match.get("conversation_id"),
            response_id=match.get("response_id"),
            status=status,
            times=times,
            never_ack=never_ack,
            delay_ms=delay_ms,
        )

    def as_dict(self) -> dict[str, Any]:
        match = {
            name: value
            for name, value in (
                ("conversation_id", self.conversation_id),
                ("response_id", self.response_id),
            )
            if value is not None
        }
        return {
            "match": match,
            "status": self.status,
            "times": self.times,
            "never_ack": self.never_ack,
            "delay_ms": self.delay_ms,
        }


@dataclass(frozen=True, slots=True)
class Behaviour:
    """How the sink answers; replaced as a whole by every configure / PUT."""

    seed: int = 0
    p_recoverable: float = 0.0
    p_timeout: float = 0.0
    p_non_recoverable: float = 0.0
    p_async: float = 0.0
    p_never_ack: float = 0.0
    ack_delay_ms: tuple[float, float] = (20.0, 100.0)
    timeout_sleep_ms: float = 2000.0
    orderly_url: str | None = None
    rules: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, data: Any) -> Behaviour:
        if not isinstance(data, dict):
            raise BehaviourError("body", "must be a JSON object")
        _unknown(data, _BEHAVIOUR_FIELDS, "")
        seed = _integer(data.get("seed", 0), "seed", low=-(2**63))
        probs = {name: _number(data.get(name, 0.0), name, high=1.0) for name in _PROBABILITIES}
        total = 0.0
        for name in _PROBABILITIES:
            total += probs[name]
            if total > 1.0 + 1e-9:
                raise BehaviourError(
                    name, f"p_recoverable+p_timeout+p_non_recoverable+p_async is {total:g} > 1"
                )
        p_never_ack = _number(data.get("p_never_ack", 0.0), "p_never_ack", high=1.0)
        delays = data.get("ack_delay_ms", [20, 100])
        if not isinstance(delays, list | tuple) or len(delays) != 2:
            raise BehaviourError("ack_delay_ms", "must be [low, high] in milliseconds")
        low = _number(delays[0], "ack_delay_ms", high=600_000)
        high = _number(delays[1], "ack_delay_ms", high=600_000)
        if low > high:
            raise BehaviourError("ack_delay_ms", f"low {low:g} is above high {high:g}")
        timeout_sleep_ms = _number(
            data.get("timeout_sleep_ms", 2000), "timeout_sleep_ms", high=600_000
        )
        orderly_url = data.get("orderly_url")
        if orderly_url is not None and (
            not isinstance(orderly_url, str) or not orderly_url.startswith(("http://", "https://"))
        ):
            raise BehaviourError("orderly_url", "must be an http(s) URL or null")
        raw_rules = data.get("rules", [])
        if not isinstance(raw_rules, list):
            raise BehaviourError("rules", "must be a list")
        rules = tuple(Rule.parse(rule, f"rules[{i}]") for i, rule in enumerate(raw_rules))
        if orderly_url is None:
            if probs["p_async"] > 0 and p_never_ack < 1:
                raise BehaviourError("orderly_url", "is required when p_async > 0")
            for i, rule in enumerate(rules):
                if rule.status == 202 and not rule.never_ack:
                    raise BehaviourError(
                        "orderly_url", f"is required by rules[{i}] (202 with an ACK)"
                    )
        return cls(
            seed=seed,
            p_never_ack=p_never_ack,
            ack_delay_ms=(low, high),
            timeout_sleep_ms=timeout_sleep_ms,
            orderly_url=orderly_url.rstrip("/") if orderly_url else None,
            rules=rules,
            **probs,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "p_recoverable": self.p_recoverable,
            "p_timeout": self.p_timeout,
            "p_non_recoverable": self.p_non_recoverable,
            "p_async": self.p_async,
            "p_never_ack": self.p_never_ack,
            "ack_delay_ms": list(self.ack_delay_ms),
            "timeout_sleep_ms": self.timeout_sleep_ms,
            "orderly_url": self.orderly_url,
            "rules": [rule.as_dict() for rule in self.rules],
        }


@dataclass(slots=True)
class _Arrival:
    seq: int
    t_arrival: float
    conversation_id: str
    request_id: str
    response_id: str
    key: str
    attempt: int
    status: int
    duplicate: bool
    # How long the answer was held back on purpose (a timeout, a rule's delay_ms).
    delay_ms: float = 0.0
    async_response_id: str | None = None
    t_responded: float | None = None
    ack_status: int | None = None
    t_ack: float | None = None
    # orderly's X-Orderly-Late and X-Orderly-Late-By-Ms headers, as received (None: absent).
    late: str | None = None
    late_by_ms: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "t_arrival": self.t_arrival,
            "t_responded": self.t_responded,
            "conversation_id": self.conversation_id,
            "request_id": self.request_id,
            "response_id": self.response_id,
            "key": self.key,
            "attempt": self.attempt,
            "status": self.status,
            "async_response_id": self.async_response_id,
            "ack_status": self.ack_status,
            "t_ack": self.t_ack,
            "duplicate": self.duplicate,
            "delay_ms": self.delay_ms,
            "late": self.late,
            "late_by_ms": self.late_by_ms,
        }


@dataclass(frozen=True, slots=True)
class _Decision:
    status: int
    delay_s: float = 0.0
    # Seconds after the 202 is written; None: no ACK will be sent.
    ack_delay_s: float | None = None
    ack_url: str | None = None


_ANSWER_200 = _Decision(200)


class _State:
    """Log, per-key state and behaviour; shared by the event loop and the ACK threads."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.lock = threading.Lock()
        self.behaviour = behaviour
        self._rule_left: list[int | None] = [rule.times for rule in behaviour.rules]
        self.log: list[_Arrival] = []
        self._attempts: dict[str, int] = {}
        self._delivered: set[str] = set()
        self._deliveries: dict[str, list[str]] = {}

    def configure(self, behaviour: Behaviour) -> None:
        with self.lock:
            self.behaviour = behaviour
            self._rule_left = [rule.times for rule in behaviour.rules]

    def reset(self) -> None:
        with self.lock:
            self.log = []
            self._attempts.clear()
            self._delivered.clear()
            self._deliveries.clear()
            # The rules' counts are about arrivals being forgotten here: they start over too.
            self._rule_left = [rule.times for rule in self.behaviour.rules]

    def arrive(
        self,
        conversation_id: str,
        request_id: str,
        response_id: str,
        key: str,
        t: float,
        headers: dict[str, str] | None = None,
    ) -> tuple[_Arrival, _Decision]:
        with self.lock:
            attempt = self._attempts.get(key, 0) + 1
            self._attempts[key] = attempt
            decision = self._decide(conversation_id, response_id, key, attempt)
            duplicate = key in self._delivered
            arrival = _Arrival(
                seq=len(self.log) + 1,
                t_arrival=t,
                conversation_id=conversation_id,
                request_id=request_id,
                response_id=response_id,
                key=key,
                attempt=attempt,
                status=decision.status,
                duplicate=duplicate,
                delay_ms=decision.delay_s * 1000,
                late=(headers or {}).get("x-orderly-late"),
                late_by_ms=(headers or {}).get("x-orderly-late-by-ms"),
            )
            if decision.status == 202:
                arrival.async_response_id = uuid.uuid4().hex
            if decision.status in (200, 202) and not duplicate:
                self._delivered.add(key)
                self._deliveries.setdefault(conversation_id, []).append(response_id)
            self.log.append(arrival)
            return arrival, decision

    def _decide(self, conversation_id: str, response_id: str, key: str, attempt: int) -> _Decision:
        b = self.behaviour
        for i, rule in enumerate(b.rules):
            if not rule.matches(conversation_id, response_id):
                continue
            left = self._rule_left[i]
            if left is not None:
                if left <= 0:
                    continue
                self._rule_left[i] = left - 1
            ack_delay = None
            if rule.status == 202 and not rule.never_ack:
                ack_delay = self._ack_delay(b, random.Random(f"{b.seed}:{key}:{attempt}"))
            return _Decision(rule.status, rule.delay_ms / 1000, ack_delay, b.orderly_url)
        if not (b.p_recoverable or b.p_timeout or b.p_non_recoverable or b.p_async):
            return _ANSWER_200
        # One generator per (seed, key, attempt): the decision does not depend on which other
        # arrivals happened first, so concurrent runs reproduce it.
        rng = random.Random(f"{b.seed}:{key}:{attempt}")
        u = rng.random()
        edge = b.p_recoverable
        if u < edge:
            return _Decision(503)
        edge += b.p_timeout
        if u < edge:
            return _Decision(503, b.timeout_sleep_ms / 1000)
        edge += b.p_non_recoverable
        if u < edge:
            return _Decision(400)
        edge += b.p_async
        if u < edge:
            never = rng.random() < b.p_never_ack
            delay = self._ack_delay(b, rng)
            return _Decision(202, 0.0, None if never else delay, b.orderly_url)
        return _ANSWER_200

    @staticmethod
    def _ack_delay(b: Behaviour, rng: random.Random) -> float:
        low, high = b.ack_delay_ms
        return rng.uniform(low, high) / 1000

    def record_ack(self, arrival: _Arrival, status: int, t_sent: float) -> None:
        with self.lock:
            arrival.ack_status = status
            arrival.t_ack = t_sent

    def arrivals(self, since: int = 0) -> list[dict[str, Any]]:
        with self.lock:
            # seq is the 1-based position in the log, so the tail after ``since`` is a slice.
            return [a.as_dict() for a in self.log[max(since, 0) :]]

    def deliveries(self) -> dict[str, list[str]]:
        with self.lock:
            return {cid: list(ids) for cid, ids in self._deliveries.items()}


class _AckSender:
    """Sends the delayed ACKs from a few threads, so slow ACKs never stall the event loop."""

    def __init__(self, state: _State, workers: int) -> None:
        self._state = state
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sink-ack")
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()

    def submit(self, arrival: _Arrival, base_url: str) -> None:
        with contextlib.suppress(RuntimeError):  # shut down: the pending ACK is dropped
            self._pool.submit(self._send, arrival, base_url)

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(timeout=ACK_TIMEOUT_S)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _send(self, arrival: _Arrival, base_url: str) -> None:
        url = f"{base_url}/acks/{arrival.async_response_id}"
        status = 0
        t_sent = time.time()
        for attempt in range(1, ACK_ATTEMPTS + 1):
            t_sent = time.time()
            try:
                status = self._client().post(url).status_code
                break
            except httpx.HTTPError as exc:
                # Only a missing answer is retried: an HTTP status is orderly's verdict.
                log.warning("ACK %s attempt %d failed: %s", url, attempt, exc)
                if attempt < ACK_ATTEMPTS:
                    time.sleep(0.1 * attempt)
        self._state.record_ack(arrival, status, t_sent)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._clients_lock:
            for client in self._clients:
                client.close()
            self._clients.clear()


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
            conversation_id, request_id, response_id, key, req.t_arrival, req.headers
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


class Sink:
    """The sink served from a background thread; ``url`` is the channel URL to give orderly."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        behaviour: Mapping[str, Any] | None = None,
        path: str = "/deliver",
        ack_workers: int = 4,
    ) -> None:
        if not path.startswith("/") or path.startswith("/_sink/"):
            raise ValueError(f"delivery path must start with / and not /_sink/: {path!r}")
        self._host = host
        self._port = port
        self._path = path
        self._state = _State(Behaviour.parse(dict(behaviour or {})))
        self._ack_workers = ack_workers
        self._acks: _AckSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> Sink:
        if self._thread is not None:
            raise RuntimeError("sink already started")
        self._acks = _AckSender(self._state, self._ack_workers)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="sink", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            self._acks.close()
            raise self._error
        return self

    def _run(self) -> None:
        assert self._acks is not None
        loop = asyncio.new_event_loop()
        server = _Server(self._state, self._acks)
        try:
            self._port = loop.run_until_complete(server.start(self._host, self._port))
        except BaseException as exc:
            self._error = exc
            loop.close()
            self._ready.set()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(server.close())
            loop.close()

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None
        self._loop = None
        if self._acks is not None:
            self._acks.close()
            self._acks = None

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        """Where the control endpoints live (``/_sink/...``)."""
        return _base_url(self._host, self._port)

    @property
    def url(self) -> str:
        """The channel URL for orderly; any path but ``/_sink/...`` is a delivery."""
        return self.base_url + self._path

    @property
    def behaviour(self) -> dict[str, Any]:
        return self._state.behaviour.as_dict()

    def configure(self, **behaviour: Any) -> None:
        """Replace the behaviour (unset fields take their defaults); BehaviourError if invalid."""
        self._state.configure(Behaviour.parse(behaviour))

    def reset(self) -> None:
        """Forget every arrival, attempt count and delivery; rule counts start over."""
        self._state.reset()

    def arrivals(self, since: int = 0) -> list[dict[str, Any]]:
        return self._state.arrivals(since)

    def deliveries(self) -> dict[str, list[str]]:
        return self._state.deliveries()


async def _serve_until_signalled(
    host: str, port: int, behaviour: Behaviour, ack_workers: int
) -> None:
    state = _State(behaviour)
    acks = _AckSender(state, ack_workers)
    server = _Server(state, acks)
    try:
        bound = await server.start(host, port)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        print(f"sink listening on {_base_url(host, bound)}", flush=True)
        await stopping.wait()
    finally:
        await server.close()
        acks.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tooling.sink", description="Run the client sink in the foreground."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--behaviour", default=None, help="initial behaviour, a JSON object")
    parser.add_argument("--ack-workers", type=int, default=4, help="threads sending ACKs")
    args = parser.parse_args(argv)
    try:
        behaviour = Behaviour.parse(json.loads(args.behaviour) if args.behaviour else {})
    except json.JSONDecodeError as exc:
        parser.error(f"--behaviour is not JSON: {exc}")
    except BehaviourError as exc:
        parser.error(f"--behaviour: {exc}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_serve_until_signalled(args.host, args.port, behaviour, args.ack_workers))
    except OSError as exc:
        print(f"sink: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
