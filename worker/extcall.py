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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

import httpx

from worker.errors import OrderlyError
from worker.prepared import Prepared, PreparedConnection

T = TypeVar("T")


class CallInProgress(OrderlyError):
    """Another message's call on the same key is running; the message is taken up later."""

    def __init__(self, operation: str, entity_id: str, msg_id: int) -> None:
        self.operation = operation
        self.entity_id = entity_id
        super().__init__(
            f"external call {operation} on {entity_id!r} is in progress for message {msg_id}"
        )


class ExchangeFailed(OrderlyError):
    """An HTTP exchange got no answer or a non-2xx answer (logged as a failed response)."""

    def __init__(self, uri: str, reason: str, status: int | None = None) -> None:
        self.uri = uri
        self.reason = reason
        self.status = status
        super().__init__(f"{uri}: {reason}")


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


STATEMENTS = (
    Prepared(
        "orderly_call_take",
        ("bigint", "timestamptz", "text", "text"),
        """
        INSERT INTO external_call AS e (msg_id, operation_name, entity_id, state, msg_timestamp,
                                        creation_timestamp, last_update_timestamp, failed_count)
        VALUES ($1, $3, $4, 'PROCESSING', $2, now(), now(), 0)
        ON CONFLICT (operation_name, entity_id) DO UPDATE
           SET state = 'PROCESSING', msg_id = EXCLUDED.msg_id,
               msg_timestamp = EXCLUDED.msg_timestamp, last_update_timestamp = now(),
               failed_count = CASE WHEN e.msg_id = EXCLUDED.msg_id THEN e.failed_count ELSE 0 END
         WHERE (e.state <> 'PROCESSING' OR e.msg_id = EXCLUDED.msg_id)
           AND (EXCLUDED.msg_timestamp > e.msg_timestamp
                OR (EXCLUDED.msg_timestamp = e.msg_timestamp AND e.state <> 'OK'))
        RETURNING call_id
        """,
    ),
    Prepared(
        "orderly_call_row",
        ("text", "text"),
        """
        SELECT msg_id, state, msg_timestamp FROM external_call
         WHERE operation_name = $1 AND entity_id = $2
        """,
    ),
    Prepared(
        "orderly_call_done",
        ("bigint", "bigint", "boolean"),
        """
        UPDATE external_call
           SET state = CASE WHEN $3 THEN 'OK' ELSE 'FAILED' END,
               failed_count = failed_count + CASE WHEN $3 THEN 0 ELSE 1 END,
               last_update_timestamp = now()
         WHERE call_id = $1 AND msg_id = $2 AND state = 'PROCESSING'
        RETURNING state
        """,
    ),
    Prepared(
        "orderly_log_request",
        ("bigint", "text", "text", "text"),
        """
        INSERT INTO request (msg_id, res_join_id, uri, req_envelope, req_timestamp)
        VALUES ($1, $2, $3, $4, now())
        ON CONFLICT (uri, res_join_id) DO UPDATE
           SET msg_id = EXCLUDED.msg_id, req_envelope = EXCLUDED.req_envelope,
               req_timestamp = now()
        RETURNING req_id
        """,
    ),
    Prepared(
        "orderly_log_response",
        ("bigint", "bigint", "text", "boolean", "text"),
        """
        INSERT INTO response (req_id, msg_id, res_envelope, failed, failed_reason, res_timestamp)
        VALUES ($1, $2, $3, $4, $5, now())
        RETURNING res_id
        """,
    ),
)


def take_call(
    conn: PreparedConnection, msg_id: int, msg_timestamp: datetime, operation: str, key: CallKey
) -> int | Skip:
    """Take the key for a call (its call_id), or say why not to call (raises CallInProgress)."""
    taken = conn.run("orderly_call_take", msg_id, msg_timestamp, operation, key.entity_id)
    if taken is not None:
        return int(taken[0])
    row = conn.run("orderly_call_row", operation, key.entity_id)
    if row is None:  # deleted in between: nothing to compare with, so try again later
        raise CallInProgress(operation, key.entity_id, msg_id)
    owner, state, last_ts = int(row[0]), str(row[1]), row[2]
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
    row = conn.run("orderly_log_request", msg_id, res_join_id, uri, envelope)
    assert row is not None
    return int(row[0])


def log_response(
    conn: PreparedConnection,
    req_id: int | None,
    msg_id: int | None,
    envelope: str | None,
    *,
    failed: bool = False,
    reason: str | None = None,
) -> int:
    row = conn.run("orderly_log_response", req_id, msg_id, envelope, failed, reason)
    assert row is not None
    return int(row[0])


_clients = threading.local()


def _client() -> httpx.Client:
    client: httpx.Client | None = getattr(_clients, "client", None)
    if client is None:
        client = _clients.client = httpx.Client()
    return client


def post_logged(
    conn: PreparedConnection,
    msg_id: int | None,
    uri: str,
    body: Any,
    *,
    res_join_id: str | None = None,
    timeout_s: float = 10.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    """POST JSON to ``uri``, logging the request and the response; (status, body) of a 2xx.

    Anything else (no answer, a non-2xx status) is logged as a failed response and raised as
    :class:`ExchangeFailed`.
    """
    envelope = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str)
    req_id = log_request(conn, msg_id, uri, res_join_id, envelope)
    try:
        answer = _client().post(
            uri,
            content=envelope.encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log_response(conn, req_id, msg_id, None, failed=True, reason=reason)
        raise ExchangeFailed(uri, reason) from None
    text = answer.text
    if not 200 <= answer.status_code < 300:
        reason = f"HTTP {answer.status_code}: {text[:500]}"
        log_response(conn, req_id, msg_id, text, failed=True, reason=reason)
        raise ExchangeFailed(uri, reason, answer.status_code)
    log_response(conn, req_id, msg_id, text)
    return answer.status_code, text
