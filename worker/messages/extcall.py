"""External calls and exchanges: the ``external_call``, ``request`` and ``response`` tables.

An external call is keyed by (operation, key); the key names what the call changes: the
message itself (source system + correlation id), an entity (entity type + object id) or a
custom value. Before calling, the message's ``msg_timestamp`` is compared with the key's last
call, in one statement that also takes the key:

- no call yet, or the last one is older: call (the row becomes PROCESSING for this message);
- the last one failed for the same timestamp (this message tried before): call again;
- the last one is newer: skip, this message's data is obsolete;
- the last one succeeded with the same timestamp: skip, a duplicate;
- another message's call on the key is PROCESSING: :class:`CallInProgress` (try later).

Every exchange over HTTP is logged: one ``request`` row (uri, res_join_id, envelope, time) and
one ``response`` row (envelope or failure reason, time).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from orderly.worker.core.errors import CallInProgress, ExchangeFailed
from orderly.worker.core.http import OutboundHttp, SignedAs
from orderly.worker.db.prepared import PreparedConnection

T = TypeVar("T")


@dataclass(frozen=True)
class CallKey:
    """What an external call changes; ``entity_id`` is the stored form (kind-prefixed)."""

    kind: str
    value: str

    @classmethod
    def message(cls, source_system: str, correlation_id: str) -> CallKey:
        return cls("msg", f"{source_system}:{correlation_id}")

    @classmethod
    def entity(cls, entity_type: str, object_id: str) -> CallKey:
        return cls("entity", f"{entity_type}:{object_id}")

    @classmethod
    def custom(cls, value: str) -> CallKey:
        if not value:
            raise ValueError("a custom call key must not be empty")
        return cls("custom", value)

    @property
    def entity_id(self) -> str:
        return f"{self.kind}:{self.value}"[:255]


class Skip(enum.StrEnum):
    OBSOLETE = "OBSOLETE"  # the key's last call came from a newer message
    DUPLICATE = "DUPLICATE"  # the key's last successful call had this very timestamp


@dataclass(frozen=True)
class CallResult(Generic[T]):
    called: bool
    value: T | None = None
    skipped: Skip | None = None
    call_id: int | None = None


@dataclass(frozen=True)
class CallTaken:
    call_id: int


@dataclass(frozen=True)
class CallRow:
    """The key's call: the message that holds or last made it, its state, that message's
    timestamp."""

    msg_id: int
    state: str
    msg_timestamp: datetime


@dataclass(frozen=True)
class RequestLogged:
    req_id: int


@dataclass(frozen=True)
class ResponseLogged:
    res_id: int


def take_call(
    conn: PreparedConnection, msg_id: int, msg_timestamp: datetime, operation: str, key: CallKey
) -> int | Skip:
    """Take the key for a call (its call_id), or say why not to call (raises CallInProgress)."""
    taken = conn.one(
        CallTaken, "orderly_call_take", msg_id, msg_timestamp, operation, key.entity_id
    )
    if taken is not None:
        return taken.call_id
    row = conn.one(CallRow, "orderly_call_row", operation, key.entity_id)
    if row is None:  # deleted in between: nothing to compare with, so try again later
        raise CallInProgress(operation, key.entity_id, msg_id)
    owner, state, last_ts = row.msg_id, row.state, row.msg_timestamp
    if last_ts > msg_timestamp:
        return Skip.OBSOLETE
    if state == "OK" and last_ts == msg_timestamp:
        return Skip.DUPLICATE
    # PROCESSING for another message (or it changed since): the key is busy.
    raise CallInProgress(operation, key.entity_id, owner)


def finish_call(conn: PreparedConnection, call_id: int, msg_id: int, ok: bool) -> None:
    conn.run("orderly_call_done", call_id, msg_id, ok)


def external_call(
    conn: PreparedConnection,
    msg_id: int,
    msg_timestamp: datetime,
    operation: str,
    key: CallKey,
    call: Callable[[], T],
) -> CallResult[T]:
    """Apply the rules above around ``call``; an exception from it marks the call FAILED."""
    taken = take_call(conn, msg_id, msg_timestamp, operation, key)
    if isinstance(taken, Skip):
        return CallResult(called=False, skipped=taken)
    try:
        value = call()
    except BaseException:
        finish_call(conn, taken, msg_id, ok=False)
        raise
    finish_call(conn, taken, msg_id, ok=True)
    return CallResult(called=True, value=value, call_id=taken)


def log_request(
    conn: PreparedConnection, msg_id: int | None, uri: str, res_join_id: str | None, envelope: str
) -> int:
    row = conn.one(RequestLogged, "orderly_log_request", msg_id, res_join_id, uri, envelope)
    assert row is not None  # an insert (or its upsert) returns its row
    return row.req_id


def log_response(
    conn: PreparedConnection,
    req_id: int | None,
    msg_id: int | None,
    envelope: str | None,
    *,
    failed: bool = False,
    reason: str | None = None,
) -> int:
    if failed and not reason:
        reason = "failed, no reason given"  # the seed: a failed response names its reason
    row = conn.one(ResponseLogged, "orderly_log_response", req_id, msg_id, envelope, failed, reason)
    assert row is not None  # an insert returns its row
    return row.res_id


def post_logged(
    conn: PreparedConnection,
    http: OutboundHttp,
    msg_id: int | None,
    uri: str,
    body: Any,
    *,
    res_join_id: str | None = None,
    timeout_ms: int = 10_000,
    headers: dict[str, str] | None = None,
    signed_as: SignedAs | None = None,
) -> tuple[int, str]:
    """POST JSON to ``uri``, logging the request and the response; (status, body) of a 2xx.

    Anything else (no answer, a non-2xx status) is logged as a failed response and raised as
    :class:`~worker.core.errors.ExchangeFailed`.
    """
    envelope = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str)
    req_id = log_request(conn, msg_id, uri, res_join_id, envelope)
    reply = http.post(
        uri, envelope.encode(), timeout_ms=timeout_ms, headers=headers, signed_as=signed_as
    )
    if reply.status is None:
        log_response(conn, req_id, msg_id, None, failed=True, reason=reply.error)
        raise ExchangeFailed(uri, reply.error)
    text = reply.text
    if not reply.ok:
        reason = f"HTTP {reply.status}: {text[:500]}"
        log_response(conn, req_id, msg_id, text, failed=True, reason=reason)
        raise ExchangeFailed(uri, reason, reply.status)
    log_response(conn, req_id, msg_id, text)
    return reply.status, text
