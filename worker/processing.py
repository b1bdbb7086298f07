"""Processing: claim a message under a row lock, run its handler, record the outcome.

Every transition is one UPDATE whose WHERE holds the state check, so a transition from the
wrong state changes nothing and is reported, never silently applied. The claim records the
claiming connection's backend pid; the same connection records the outcome, and only if it
still holds the claim. A PROCESSING message whose backend pid is gone belongs to a dead
worker: a redelivered task may claim it again at once, and repair releases it.
"""

from __future__ import annotations

import enum
import logging
import traceback
from dataclasses import dataclass

from sqlalchemy import Engine

from worker.configuration import ConfigReader
from worker.errors import HandlerError
from worker.handlers import HandlerRegistry, MessageContext
from worker.prepared import Prepared, PreparedConnection, PreparedSet

log = logging.getLogger(__name__)

# A claimer whose backend no longer exists is dead (pg_stat_get_activity(pid) plans far
# cheaper than the pg_stat_activity view, and this runs on every claim).
ORPHANED = (
    "m.processing_pid IS NOT NULL"
    " AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(m.processing_pid))"
)

_CLAIM_COLUMNS = (
    "msg_id",
    "service_name",
    "operation_name",
    "correlation_id",
    "source_system",
    "msg_timestamp",
    "payload",
    "object_id",
    "entity_type",
    "process_id",
    "funnel_value",
    "failed_count",
    "custom_data",
)

# A claimer holds its claim through its backend pid; only that connection may finish it.
_HOLDS_CLAIM = "m.msg_id = $1 AND m.state = 'PROCESSING' AND m.processing_pid = pg_backend_pid()"

STATEMENTS = (
    Prepared(
        "orderly_claim",
        ("bigint", "bigint"),
        f"""
        UPDATE message m
           SET state = 'PROCESSING', node_id = $2, last_process_timestamp = now(),
               processing_pid = pg_backend_pid()
         WHERE m.msg_id = $1
           AND (m.state IN ('NEW', 'IN_QUEUE') OR (m.state = 'PROCESSING' AND {ORPHANED}))
           AND NOT EXISTS (SELECT 1 FROM node n WHERE n.node_id = $2 AND n.state = 'STOPPED')
        RETURNING {", ".join("m." + c for c in _CLAIM_COLUMNS)}
        """,
        # The claim's commit need not wait for the disk: if a server crash loses it, the
        # message is back in NEW/IN_QUEUE, the finish finds no claim, and repair brings the
        # message back. One simple query is one implicit transaction, so LOCAL applies.
        prefix="SET LOCAL synchronous_commit TO OFF; ",
    ),
    Prepared(
        "orderly_why_not_claimed",
        ("bigint", "bigint"),
        """
        SELECT (SELECT state FROM message WHERE msg_id = $1),
               (SELECT state FROM node WHERE node_id = $2)
        """,
    ),
    Prepared(
        "orderly_finish_ok",
        ("bigint", "text"),
        f"""
        UPDATE message m
           SET state = 'OK', last_process_timestamp = now(), custom_data = $2,
               processing_pid = NULL
         WHERE {_HOLDS_CLAIM}
        RETURNING m.state
        """,
    ),
    # failed_count on the right-hand side is the value before this failure.
    Prepared(
        "orderly_finish_failed",
        ("bigint", "boolean", "integer", "text", "text", "text"),
        f"""
        UPDATE message m
           SET state = CASE WHEN $2 OR m.failed_count >= $3
                            THEN 'FAILED' ELSE 'PARTLY_FAILED' END,
               failed_count = m.failed_count + 1,
               failed_error_code = $4, failed_desc = $5,
               last_process_timestamp = now(), custom_data = $6, processing_pid = NULL
         WHERE {_HOLDS_CLAIM}
        RETURNING m.state
        """,
    ),
)


class Outcome(enum.StrEnum):
    OK = "OK"
    PARTLY_FAILED = "PARTLY_FAILED"
    FAILED = "FAILED"
    NOT_CLAIMABLE = "NOT_CLAIMABLE"  # wrong state (already done, or running elsewhere)
    NODE_STOPPED = "NODE_STOPPED"  # this node processes nothing; the task goes back
    LOST_CLAIM = "LOST_CLAIM"  # someone took the message over while the handler ran
    MISSING = "MISSING"  # no such message


ERROR_NO_HANDLER = "E_NO_HANDLER"
ERROR_HANDLER = "E_HANDLER"


@dataclass(frozen=True)
class ProcessResult:
    msg_id: int
    outcome: Outcome
    detail: str = ""


class Processor:
    def __init__(
        self, engine: Engine, *, node_id: int, registry: HandlerRegistry, config: ConfigReader
    ) -> None:
        self._statements = PreparedSet(engine, STATEMENTS)
        self._node_id = node_id
        self._registry = registry
        self._config = config

    def process(self, msg_id: int) -> ProcessResult:
        # One connection for claim and outcome: the claim is tied to its backend pid.
        with self._statements.connection() as conn:
            claimed = conn.run("orderly_claim", msg_id, self._node_id)
            if claimed is None:
                return self._not_claimed(conn, msg_id)
            row = dict(zip(_CLAIM_COLUMNS, claimed, strict=True))
            ctx = MessageContext(
                msg_id=row["msg_id"],
                service=row["service_name"],
                operation=row["operation_name"],
                correlation_id=row["correlation_id"],
                source_system=row["source_system"],
                msg_timestamp=row["msg_timestamp"],
                payload=row["payload"],
                object_id=row["object_id"],
                entity_type=row["entity_type"],
                process_id=row["process_id"],
                funnel_value=row["funnel_value"],
                failed_count=row["failed_count"],
                custom_data=row["custom_data"],
            )
            handler = self._registry.get(ctx.service, ctx.operation)
            if handler is None:
                return self._fail(
                    conn,
                    ctx,
                    ERROR_NO_HANDLER,
                    f"no handler registered for {ctx.service}.{ctx.operation}",
                    final=True,
                )
            try:
                handler(ctx)
            except HandlerError as exc:
                return self._fail(conn, ctx, exc.code, exc.description, final=False)
            except Exception as exc:
                desc = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
                return self._fail(conn, ctx, ERROR_HANDLER, desc, final=False)
            if conn.run("orderly_finish_ok", msg_id, ctx.custom_data) is None:
                return self._lost(msg_id)
            return ProcessResult(msg_id, Outcome.OK)

    def _fail(
        self,
        conn: PreparedConnection,
        ctx: MessageContext,
        code: str,
        desc: str,
        *,
        final: bool,
    ) -> ProcessResult:
        limit = self._config.get_int("asynch.countPartlyFailsBeforeFailed")
        done = conn.run(
            "orderly_finish_failed", ctx.msg_id, final, limit, code[:64], desc, ctx.custom_data
        )
        if done is None:
            return self._lost(ctx.msg_id)
        return ProcessResult(ctx.msg_id, Outcome(done[0]), f"{code}: {desc.splitlines()[0]}")

    def _lost(self, msg_id: int) -> ProcessResult:
        log.warning("message %s was taken over while its handler ran; outcome dropped", msg_id)
        return ProcessResult(msg_id, Outcome.LOST_CLAIM)

    def _not_claimed(self, conn: PreparedConnection, msg_id: int) -> ProcessResult:
        why = conn.run("orderly_why_not_claimed", msg_id, self._node_id)
        msg_state, node_state = why if why is not None else (None, None)
        if msg_state is None:
            return ProcessResult(msg_id, Outcome.MISSING)
        if node_state == "STOPPED" and msg_state in ("NEW", "IN_QUEUE"):
            return ProcessResult(msg_id, Outcome.NODE_STOPPED)
        return ProcessResult(msg_id, Outcome.NOT_CLAIMABLE, f"message is {msg_state}")
