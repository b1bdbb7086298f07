"""Signed requests as the Standard Webhooks specification defines them: what orderly's
outbound requests carry, and what a receiver checks.

Each request carries three headers: ``webhook-id`` (the same for every attempt of one
delivery: an idempotency key), ``webhook-timestamp`` (the attempt's Unix time in seconds) and
``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` under each
secret in use, space-separated (two while a secret is rotated: the receiver accepts either).
A secret is ``whsec_`` followed by the base64 of its key bytes.

A receiver verifies the raw body it was sent, before parsing it::

    from orderly.client.webhooks import verify, InvalidSignature

    try:
        verify(secret, request.headers, raw_body)
    except InvalidSignature as exc:
        return 401, str(exc)

This module needs only the standard library: the sender (orderly's workers) and the receiver
use the same code.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _random
import time
from collections.abc import Iterable, Mapping, Sequence

PREFIX = "whsec_"
VERSION = "v1"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
# How far a request's timestamp may be from the receiver's clock (replays, clock skew).
TOLERANCE_S = 300
# Key bytes of a new secret (the specification asks for 24 to 64).
SECRET_BYTES = 32


class InvalidSignature(ValueError):
    """The request is not one a holder of the secret sent: the reason says which check failed."""


def new_secret() -> str:
    """A new random secret, ``whsec_<base64>``."""
    return PREFIX + base64.b64encode(_random.token_bytes(SECRET_BYTES)).decode()


def key_of(secret: str) -> bytes:
    """The key bytes of a secret (with or without its ``whsec_`` prefix)."""
    encoded = secret[len(PREFIX) :] if secret.startswith(PREFIX) else secret
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a signing secret is whsec_ followed by base64") from None


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The signature of one request under one secret: ``v1,<base64>``."""
    if "." in msg_id:
        raise ValueError("a webhook-id must not contain '.'")
    signed = b"%s.%d.%s" % (msg_id.encode(), timestamp, body)
    digest = hmac.new(key_of(secret), signed, hashlib.sha256).digest()
    return f"{VERSION},{base64.b64encode(digest).decode()}"


def headers(
    secrets: Sequence[str], msg_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, str]:
    """The three headers of a request signed under each of ``secrets`` (the current one, and
    the previous one while a rotation lets both count)."""
    at = int(time.time()) if timestamp is None else timestamp
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(at),
        SIGNATURE_HEADER: " ".join(sign(s, msg_id, at, body) for s in secrets),
    }


def _header(sent: Mapping[str, str], name: str) -> str:
    for key, value in sent.items():
        if key.lower() == name:
            return value
    raise InvalidSignature(f"the {name} header is missing")


def verify(
    secrets: str | Iterable[str],
    sent_headers: Mapping[str, str],
    body: bytes | str,
    *,
    tolerance_s: int = TOLERANCE_S,
    now: float | None = None,
) -> None:
    """Check that a request was signed with one of ``secrets`` (a secret, or several while
    the receiver itself accepts an old and a new one) and sent within ``tolerance_s`` of
    ``now``; raises :class:`InvalidSignature` naming what failed. Signatures are compared in
    constant time. ``body`` is the raw body as received."""
    msg_id = _header(sent_headers, ID_HEADER)
    if "." in msg_id:
        raise InvalidSignature(f"{ID_HEADER} must not contain '.'")
    raw_ts = _header(sent_headers, TIMESTAMP_HEADER)
    offered = _header(sent_headers, SIGNATURE_HEADER).split()
    try:
        timestamp = int(raw_ts)
    except ValueError:
        raise InvalidSignature(f"{TIMESTAMP_HEADER} is not a Unix time: {raw_ts[:40]!r}") from None
    clock = time.time() if now is None else now
    if abs(clock - timestamp) > tolerance_s:
        raise InvalidSignature(
            f"{TIMESTAMP_HEADER} {timestamp} is more than {tolerance_s} s from now"
        )
    data = body.encode() if isinstance(body, str) else body
    keys = [secrets] if isinstance(secrets, str) else list(secrets)
    expected = [sign(s, msg_id, timestamp, data).encode() for s in keys]
    for candidate in offered:
        version, _, _ = candidate.partition(",")
        if version != VERSION:
            continue
        if any(hmac.compare_digest(candidate.encode(), e) for e in expected):
            return
    raise InvalidSignature("no signature matches (wrong secret, or a body changed on the way)")
