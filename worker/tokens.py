"""Signed message tokens: who produced a message (and who impersonated), valid until when.

``<payload>.<signature>``: the payload is URL-safe base64 of compact JSON, the signature the
hex HMAC-SHA256 of the payload under ``ORDERLY_TOKEN_SECRET``. A consumer verifies it before
it processes the message.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass

from orderly.worker.core.errors import Unauthorized


@dataclass(frozen=True)
class Claims:
    user: str | None
    impersonator: str | None
    correlation_id: str
    expires_ms: int


def sign(secret: str, claims: Claims) -> str:
    if not secret:
        raise Unauthorized("no ORDERLY_TOKEN_SECRET is configured: tokens cannot be signed")
    body = json.dumps(
        {
            "u": claims.user,
            "i": claims.impersonator,
            "c": claims.correlation_id,
            "exp": claims.expires_ms,
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    payload = base64.urlsafe_b64encode(body).decode().rstrip("=")
    return f"{payload}.{_mac(secret, payload)}"


def verify(secret: str, token: str | None, *, now_ms: int) -> Claims:
    """The token's claims, or Unauthorized saying why not."""
    if not secret:
        raise Unauthorized("no ORDERLY_TOKEN_SECRET is configured: tokens cannot be verified")
    if not token:
        raise Unauthorized("the message carries no token")
    payload, _, signature = token.partition(".")
    try:
        matches = hmac.compare_digest(_mac(secret, payload), signature)
    except (TypeError, ValueError):  # not ASCII: no signature of ours
        matches = False
    if not matches:
        raise Unauthorized("the token's signature does not match (forged or damaged)")
    try:
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        claims = Claims(data["u"], data["i"], str(data["c"]), int(data["exp"]))
    except (ValueError, KeyError, TypeError):
        raise Unauthorized("the token cannot be read") from None
    if claims.expires_ms <= now_ms:
        raise Unauthorized(f"the token expired at {claims.expires_ms} (now {now_ms})")
    return claims


def _mac(secret: str, payload: str) -> str:
    return hmac.new(secret.encode(), payload.encode(), hashlib.sha256).hexdigest()
