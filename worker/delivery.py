"""The send: one HTTP POST of a response to its origin's channel, classified for the gate."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from worker.channels import Channel
from worker.conversations import Delivery, Head, SendResult

# Worth trying again: the client may accept the same response later.
RECOVERABLE_STATUS = frozenset({408, 425, 429})


def classify(status: int, body: bytes) -> SendResult:
    if status == 202:
        async_id = _async_id(body)
        if async_id:
            return SendResult(Delivery.ASYNC, status, async_id)
        # A 202 without an id promises no ACK: the response is delivered.
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
        if isinstance(value, str) and value.strip():
            return value
    return None


class HttpSender:
    """POSTs ``{conversation_id, request_id, response_id, payload}`` with an Idempotency-Key.

    One keep-alive client per process (created lazily, so a forked worker builds its own).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(headers={"content-type": "application/json"})
            self._local.client = client
        return client

    def __call__(self, channel: Channel, head: Head) -> SendResult:
        body = json.dumps(
            {
                "conversation_id": head.conversation_id,
                "request_id": head.request_id,
                "response_id": head.response_id,
                "payload": head.payload,
            },
            separators=(",", ":"),
        )
        try:
            reply = self._client().post(
                channel.url,
                content=body,
                headers={"Idempotency-Key": head.response_id},
                timeout=channel.timeout_ms / 1000,
            )
        except httpx.TimeoutException:
            return SendResult(Delivery.RECOVERABLE, reason=f"timeout after {channel.timeout_ms} ms")
        except httpx.TransportError as exc:
            return SendResult(Delivery.RECOVERABLE, reason=f"{type(exc).__name__}: {exc}")
        return classify(reply.status_code, reply.content)
