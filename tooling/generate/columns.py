"""Tables, their COPY columns, the time constants and the report of a run."""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

# Tables in the order of the report (and of writing).
TABLES = (
    "node",
    "message",
    "external_call",
    "request",
    "response",
    "room",
    "event_type",
    "event_type_version",
    "subscription",
    "event",
    "delivery",
    "published_messages",
    "queue_message",
)
# Tables whose keys are assigned here; the rest are a handful of rows inserted normally.
_KEYED = {
    "message": "msg_id",
    "external_call": "call_id",
    "request": "req_id",
    "response": "res_id",
    "event": "event_id",
    "delivery": "delivery_id",
    "published_messages": "id",
    "queue_message": "id",
}
# Bigger chunks cost memory; smaller ones more round trips through the feed queue.
CHUNK_ROWS = 20_000
NULL = "\\N"
SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR
# The configuration defaults the generated history follows (worker/configuration.py).
PARTLY_FAILED_INTERVAL = 60 * SECOND
FAILS_BEFORE_FAILED = 3
RESPONSE_TIMEOUT = HOUR
POSTPONED_WHEN_FAILED = 300 * SECOND
CONFIRMATION_INTERVAL = 60 * SECOND
CONFIRMATION_LIMIT = 3
# Messages received this close to the window's end (at least an hour, or this share of the
# window) may still be on their way; push endpoints have an outage then.
RECENT = HOUR
RECENT_SHARE = 0.02

MESSAGE_COLUMNS: tuple[str, ...] = (
    "msg_id",
    "msg_timestamp",
    "receive_timestamp",
    "service_name",
    "operation_name",
    "object_id",
    "entity_type",
    "correlation_id",
    "process_id",
    "payload",
    "envelope",
    "source_system",
    "state",
    "failed_count",
    "failed_error_code",
    "failed_desc",
    "last_process_timestamp",
    "start_in_queue_timestamp",
    "custom_data",
    "parent_msg_id",
    "parent_binding_type",
    "funnel_value",
    "funnel_component_id",
    "guaranteed_order",
    "exclude_failed_state",
    "node_id",
    "processing_pid",
    "audit",
    "wait_correlation_id",
    "response_deadline",
    "wait_res_id",
)
CALL_COLUMNS: tuple[str, ...] = (
    "call_id",
    "msg_id",
    "operation_name",
    "state",
    "entity_id",
    "msg_timestamp",
    "creation_timestamp",
    "last_update_timestamp",
    "failed_count",
    "next_attempt_at",
)
REQUEST_COLUMNS: tuple[str, ...] = (
    "req_id",
    "msg_id",
    "res_join_id",
    "uri",
    "req_envelope",
    "req_timestamp",
)
RESPONSE_COLUMNS: tuple[str, ...] = (
    "res_id",
    "req_id",
    "res_envelope",
    "failed_reason",
    "res_timestamp",
    "failed",
    "msg_id",
)
EVENT_COLUMNS: tuple[str, ...] = (
    "event_id",
    "correlation_id",
    "room_id",
    "event_type_id",
    "version",
    "routing_key",
    "payload",
    "user_id",
    "published_at",
    "deliver_at",
    "expires_at",
    "unroutable",
)
DELIVERY_COLUMNS: tuple[str, ...] = (
    "delivery_id",
    "event_id",
    "subscription_id",
    "state",
    "pull",
    "order_value",
    "attempt",
    "next_attempt_at",
    "scheduled_at",
    "claimed_at",
    "claim",
    "delivered_at",
    "last_error",
)
PUBLISHED_COLUMNS: tuple[str, ...] = (
    "id",
    "correlation_id",
    "delivery_id",
    "event_id",
    "subscription_id",
    "attempt",
    "published_at",
    "delivered_at",
    "outcome",
    "error",
)
QUEUE_COLUMNS: tuple[str, ...] = (
    "id",
    "delivery_id",
    "message",
    "routing_key",
    "scheduled_start_time",
    "start_time",
    "end_time",
    "state",
    # exception_id stays NULL: it names a log_exception row, which the generator writes none
    # of (the failed attempt's id is in the delivery's error text instead).
    "memory_used",
)
# External calls keyed by an entity may meet the key's row from an earlier run: like
# orderly, the newest message takes the row over (see _upsert_keyed_calls).
KEYED_CALLS = "orderly_generated_calls"
_COLUMNS = {
    KEYED_CALLS: CALL_COLUMNS,
    "message": MESSAGE_COLUMNS,
    "external_call": CALL_COLUMNS,
    "request": REQUEST_COLUMNS,
    "response": RESPONSE_COLUMNS,
    "event": EVENT_COLUMNS,
    "delivery": DELIVERY_COLUMNS,
    "published_messages": PUBLISHED_COLUMNS,
    "queue_message": QUEUE_COLUMNS,
}


@dataclass(frozen=True)
class GenerateReport:
    """What one run wrote: new rows per table (every table of ``TABLES``) and its duration."""

    rows: Mapping[str, int]
    seconds: float
    seed: int
    start: datetime
    end: datetime

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def rows_per_second(self) -> float:
        return self.total_rows / self.seconds if self.seconds > 0 else 0.0


def _copy(conn: Connection, table: str, data: bytes) -> None:
    sql = f"COPY {table} ({', '.join(_COLUMNS[table])}) FROM STDIN"
    source = io.BytesIO(data)
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.copy_expert(sql, source, size=1 << 20)
    finally:
        cursor.close()
