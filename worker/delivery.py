"""The sends: one HTTP POST of a conversation response to its channel, classified for the
gate, or of an event to a PUSH subscription."""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from worker.channels import Channel
from worker.conversations import MAX_ASYNC_ID, Delivery, Head, SendResult
from worker.pubsub import Attempt, Claimed

# Worth trying again: the client may accept the same response later.
RECOVERABLE_STATUS = frozenset({408, 425, 429})


def classify(status: int, body: bytes) -> SendResult:
    if status == 202:
        async_id = _async_id(body)
        if async_id:
            return SendResult(Delivery.ASYNC, status, async_id)
        # A 202 without a usable id (none, or over MAX_ASYNC_ID characters) promises no ACK
        # orderly could match: the response is delivered.
        return SendResult(Delivery.DELIVERED, status)
    if 200 <= status < 300:
        return SendResult(Delivery.DELIVERED, status)
    if status >= 500 or status in RECOVERABLE_STATUS:
        return SendResult(Delivery.RECOVERABLE, status, reason=f"HTTP {status}")
    return SendResult(Delivery.FATAL, status, reason=f"HTTP {status}: {body[:200]!r}")


def _async_id(body: bytes) -> str | None:
    try:
        data: Any = json.loads(body or b"null")
    except ValueError:
        return None
    if isinstance(data, dict):
        value = data.get("async_response_id", data.get("asyncResponseId"))
        if isinstance(value, str) and value.strip() and len(value) <= MAX_ASYNC_ID:
            return value
    return None


@dataclass(frozen=True)
class Reply:
    status: int | None  # None: no answer (timeout, connection error)
    content: bytes
    error: str = ""


class HttpSender:
    """POSTs ``{conversation_id, request_id, response_id, payload}`` with an Idempotency-Key.

    One keep-alive connection per channel host and thread, on the standard library's
    http.client: a delivery is on the hot path, and a full-featured client costs several
    times more CPU per request here. A connection the channel closed while idle is opened
    again and the POST sent once more (the Idempotency-Key makes that safe).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _connection(self, url: SplitResult, timeout: float) -> http.client.HTTPConnection:
        pool: dict[tuple[str, str], http.client.HTTPConnection] | None = getattr(
            self._local, "pool", None
        )
        if pool is None:
            pool = self._local.pool = {}
        key = (url.scheme, url.netloc)
        conn = pool.get(key)
        if conn is None:
            cls = (
                http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            )
            conn = pool[key] = cls(url.netloc, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop(self, url: SplitResult) -> None:
        conn = self._local.pool.pop((url.scheme, url.netloc), None)
        if conn is not None:
            conn.close()

    def __call__(self, channel: Channel, head: Head) -> SendResult:
        body = {
            "conversation_id": head.conversation_id,
            "request_id": head.request_id,
            "response_id": head.response_id,
            "payload": head.payload,
        }
        reply = self.post(channel.url, body, head.response_id, channel.timeout_ms)
        if reply.status is None:
            return SendResult(Delivery.RECOVERABLE, reason=reply.error)
        return classify(reply.status, reply.content)

    def post(self, url_text: str, body: Any, idempotency_key: str, timeout_ms: int) -> Reply:
        """POST JSON on a kept-alive connection; the status and body, or why there is none."""
        data = json.dumps(body, separators=(",", ":")).encode()
        url = urlsplit(url_text)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": idempotency_key,
            "Content-Length": str(len(data)),
        }
        timeout = timeout_ms / 1000
        for fresh in (False, True):
            conn = self._connection(url, timeout)
            reused = conn.sock is not None
            try:
                conn.request("POST", path, body=data, headers=headers)
                answer = conn.getresponse()
                content = answer.read()
            except TimeoutError:
                self._drop(url)
                return Reply(None, b"", f"timeout after {timeout_ms} ms")
            except (OSError, http.client.HTTPException) as exc:
                self._drop(url)
                if reused and not fresh:
                    continue  # the other side closed the idle connection: once more, anew
                return Reply(None, b"", f"{type(exc).__name__}: {exc}")
            if answer.will_close:
                self._drop(url)
            return Reply(answer.status, content)
        raise AssertionError("unreachable")

    def push(self, claimed: Claimed) -> Attempt:
        """A PUSH subscription's delivery: any 2xx is success."""
        body = {
            "correlation_id": claimed.correlation_id,
            "room": claimed.room,
            "routing_key": claimed.routing_key,
            "version": claimed.version,
            "attempt": claimed.attempt,
            "user": claimed.user,
            "impersonator": claimed.impersonator,
            "payload": claimed.payload,
        }
        key = f"{claimed.correlation_id}:{claimed.subscription_id}"
        reply = self.post(str(claimed.push_url), body, key, claimed.timeout_ms)
        if reply.status is None:
            return Attempt(False, reply.error)
        if 200 <= reply.status < 300:
            return Attempt(True)
        return Attempt(False, f"HTTP {reply.status}: {reply.content[:200]!r}")
