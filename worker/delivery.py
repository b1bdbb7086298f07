"""The sends: one HTTP POST of a conversation response to its channel, classified for the
gate, or of an event to a PUSH subscription; both through the one outbound client."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from orderly.worker.channels import ACK_TOKEN_HEADER, Channel, ack_token
from orderly.worker.conversations import MAX_ASYNC_ID, Delivery, Head, SendResult
from orderly.worker.core.clock import utcnow
from orderly.worker.core.http import OutboundHttp, SignedAs
from orderly.worker.core.retry import retry_headers
from orderly.worker.pubsub import Attempt, Claimed

# Worth trying again: the client may accept the same response later.
RECOVERABLE_STATUS = frozenset({408, 425, 429})

# A late response (its request expired, MESSAGE_TTL, before it came, so it went after later
# requests' responses) carries these: "true", and the milliseconds it came after its
# request's timestamp + MESSAGE_TTL. A response in order carries neither.
LATE_HEADER = "X-Orderly-Late"
LATE_BY_HEADER = "X-Orderly-Late-By-Ms"


def response_headers(channel: Channel, head: Head) -> dict[str, str]:
    """The headers of a conversation response's POST: its ACK token among them."""
    headers = {
        "Idempotency-Key": head.response_id,
        ACK_TOKEN_HEADER: ack_token(channel.ack_secret, head.conversation_id, head.response_id),
        **retry_headers(channel.policy, head.attempt + 1),
    }
    if head.late_ms is not None:
        headers[LATE_HEADER] = "true"
        headers[LATE_BY_HEADER] = str(head.late_ms)
    return headers


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


class HttpSender:
    """POSTs ``{conversation_id, request_id, response_id, payload}`` to a channel (with its
    ACK token, and ``X-Orderly-Late`` when late), and events to PUSH subscriptions, each with an
    Idempotency-Key (a resend is safe)."""

    def __init__(self, http: OutboundHttp) -> None:
        self.http = http

    def __call__(self, channel: Channel, head: Head) -> SendResult:
        body = {
            "conversation_id": head.conversation_id,
            "request_id": head.request_id,
            "response_id": head.response_id,
            "payload": head.payload,
        }
        reply = self.http.post_json(
            channel.url,
            body,
            timeout_ms=channel.timeout_ms,
            headers=response_headers(channel, head),
            signed_as=SignedAs("channel", channel.origin, f"res_{head.msg_id}"),
        )
        if reply.status is None:
            return SendResult(Delivery.RECOVERABLE, reason=reply.error)
        result = classify(reply.status, reply.content)
        wait = reply.retry_after_ms(utcnow())
        return result if wait is None else replace(result, retry_after_ms=wait)

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
        reply = self.http.post_json(
            str(claimed.push_url),
            body,
            timeout_ms=claimed.timeout_ms,
            headers={
                "Idempotency-Key": f"{claimed.correlation_id}:{claimed.subscription_id}",
                **retry_headers(claimed.policy, claimed.attempt + 1),
            },
            signed_as=SignedAs(
                "subscription", str(claimed.subscription_id), f"dlv_{claimed.delivery_id}"
            ),
        )
        if reply.ok:
            return Attempt(True)
        return Attempt(
            False, reply.describe(), retry_after_ms=reply.retry_after_ms(utcnow()), stop=reply.stop
        )
