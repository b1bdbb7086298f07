"""Confirmations: a message's final state told to its source system over HTTP.

A source system with a ``confirmation_url`` (``source_system`` table) is confirmed every final
state of its messages. The trigger on ``message.state`` records the confirmation as an
external call (operation ``orderly.confirmation``, entity the msg_id) in the same transaction,
due at once; every worker's scheduler moves due confirmations to the broker (SKIP LOCKED, with
a lease), and a task POSTs ``{msg_id, correlation_id, source_system, state, failed_error_code,
failed_desc}`` with ``Idempotency-Key: confirmation:<msg_id>``, logging the exchange in
``request``/``response``. A 2xx makes it OK; a failure FAILED, tried again after
``asynch.confirmation.intervalSec``; the ``asynch.confirmation.failedLimit``-th failure
FAILED_END (no further tries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from sqlalchemy import Engine, text

from models import CONFIRMATION_OPERATION
from worker import extcall
from worker.configuration import ConfigReader
from worker.errors import InvalidMessage
from worker.extcall import ExchangeFailed
from worker.intake import invalid_from
from worker.prepared import PreparedSet

# A dispatched confirmation is due again after this, should its task be lost.
LEASE_S = 60
DISPATCH_BATCH = 100


class SourceSystemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    confirmation_url: str | None = None
    # Within the dispatch lease, so a confirmation in flight is not sent again meanwhile.
    timeout_ms: Annotated[StrictInt, Field(ge=1, le=30_000)] = 5000

    @field_validator("confirmation_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")) or len(value) > 500:
            raise ValueError("must be an http:// or https:// URL of at most 500 characters")
        return value


def set_source_system(engine: Engine, name: str, data: Any) -> dict[str, Any]:
    """Create or change a source system's confirmation target."""
    if not 1 <= len(name) <= 100:
        raise InvalidMessage("name", "must be 1 to 100 characters")
    if not isinstance(data, dict):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        spec = SourceSystemIn.model_validate(data)
    except ValidationError as exc:
        raise invalid_from(exc) from None
    with engine.begin() as conn:
        conn.execute(
            text(
                """
                INSERT INTO source_system (name, confirmation_url, timeout_ms, updated_at)
                VALUES (:name, :url, :timeout, now())
                ON CONFLICT (name) DO UPDATE
                   SET confirmation_url = EXCLUDED.confirmation_url,
                       timeout_ms = EXCLUDED.timeout_ms, updated_at = now()
                """
            ),
            {"name": name, "url": spec.confirmation_url, "timeout": spec.timeout_ms},
        )
    return {"name": name, "confirmation_url": spec.confirmation_url, "timeout_ms": spec.timeout_ms}


def list_source_systems(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT name, confirmation_url, timeout_ms FROM source_system ORDER BY name")
        )
        return [dict(r._mapping) for r in rows]


_DISPATCH = text(
    f"""
    UPDATE external_call
       SET state = 'PROCESSING', last_update_timestamp = now(),
           next_attempt_at = now() + make_interval(secs => {LEASE_S})
     WHERE call_id IN (
           SELECT call_id FROM external_call
            WHERE next_attempt_at <= now() AND operation_name = '{CONFIRMATION_OPERATION}'
              AND state IN ('PROCESSING', 'FAILED')
            ORDER BY next_attempt_at
            LIMIT :batch
            FOR UPDATE SKIP LOCKED)
    RETURNING call_id
    """
)


def dispatch_due(engine: Engine, enqueue: Callable[[int], None]) -> list[int]:
    """Move due confirmations to the broker (their lease starts now)."""
    with engine.begin() as conn:
        ids = [r.call_id for r in conn.execute(_DISPATCH, {"batch": DISPATCH_BATCH})]
    for call_id in ids:
        enqueue(call_id)
    return ids


_LOAD = text(
    """
    SELECT c.msg_id, c.failed_count, c.last_update_timestamp, m.correlation_id,
           m.source_system, m.state, m.failed_error_code, m.failed_desc,
           s.confirmation_url, s.timeout_ms
      FROM external_call c
      JOIN message m ON m.msg_id = c.msg_id
      LEFT JOIN source_system s ON s.name = m.source_system
     WHERE c.call_id = :id AND c.state = 'PROCESSING'
    """
)

_SETTLE = text(
    """
    UPDATE external_call
       SET state = CASE WHEN :ok THEN 'OK'
                        WHEN failed_count + 1 >= :limit THEN 'FAILED_END'
                        ELSE 'FAILED' END,
           failed_count = failed_count + CASE WHEN :ok THEN 0 ELSE 1 END,
           next_attempt_at = CASE WHEN :ok OR failed_count + 1 >= :limit THEN NULL
                                  ELSE now() + make_interval(secs => :interval_s) END,
           last_update_timestamp = now()
     -- the try this settles: a final state confirmed anew meanwhile is not settled by it
     WHERE call_id = :id AND state = 'PROCESSING' AND last_update_timestamp = :dispatched
    RETURNING state
    """
)


def confirm(engine: Engine, call_id: int, config: ConfigReader) -> str:
    """One try of a confirmation; its new state (or NOT_DUE if it is not PROCESSING)."""
    with engine.connect() as conn:
        row = conn.execute(_LOAD, {"id": call_id}).first()
    if row is None:
        return "NOT_DUE"
    ok = False
    if row.confirmation_url is not None:
        body = {
            "msg_id": row.msg_id,
            "correlation_id": row.correlation_id,
            "source_system": row.source_system,
            "state": row.state,
            "failed_error_code": row.failed_error_code,
            "failed_desc": row.failed_desc,
        }
        with PreparedSet(engine, extcall.STATEMENTS).connection() as prepared:
            try:
                extcall.post_logged(
                    prepared,
                    row.msg_id,
                    row.confirmation_url,
                    body,
                    res_join_id=f"confirmation:{row.msg_id}:{row.failed_count + 1}",
                    timeout_s=row.timeout_ms / 1000,
                    headers={"Idempotency-Key": f"confirmation:{row.msg_id}"},
                )
                ok = True
            except ExchangeFailed:
                ok = False
    params = {
        "id": call_id,
        "dispatched": row.last_update_timestamp,
        "ok": ok,
        "limit": config.get_int("asynch.confirmation.failedLimit"),
        "interval_s": config.get_int("asynch.confirmation.intervalSec"),
    }
    with engine.begin() as conn:
        state = conn.execute(_SETTLE, params).scalar()
    return str(state or "NOT_DUE")
