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

from sqlalchemy import Connection, Engine, text

from worker.configuration import ConfigReader
from worker.errors import HandlerError
from worker.handlers import HandlerRegistry, MessageContext

log = logging.getLogger(__name__)

# A backend pid that does not appear in pg_stat_activity is a dead claimer.
ORPHANED = "NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = m.processing_pid)"

_CLAIM = text(
    f"""
    UPDATE message m
       SET state = 'PROCESSING', node_id = :node_id, last_process_timestamp = now(),
           processing_pid = pg_backend_pid()
     WHERE m.msg_id = :msg_id
       AND (m.state IN ('NEW', 'IN_QUEUE') OR (m.state = 'PROCESSING' AND {ORPHANED}))
       AND NOT EXISTS (SELECT 1 FROM node n WHERE n.node_id = :node_id AND n.state = 'STOPPED')
    RETURNING m.msg_id, m.service_name, m.operation_name, m.correlation_id, m.source_system,
              m.msg_timestamp, m.payload, m.object_id, m.entity_type, m.process_id,
              m.funnel_value, m.failed_count, m.custom_data
    """
)

_WHY_NOT_CLAIMED = text(
    """
    SELECT (SELECT state FROM message WHERE msg_id = :msg_id) AS msg_state,
           (SELECT state FROM node WHERE node_id = :node_id) AS node_state
    """
)

_HOLDS_CLAIM = (
    "m.msg_id = :msg_id AND m.state = 'PROCESSING' AND m.processing_pid = pg_backend_pid()"
)

_FINISH_OK = text(
    f"""
    UPDATE message m
       SET state = 'OK', last_process_timestamp = now(), custom_data = :custom_data,
           processing_pid = NULL
     WHERE {_HOLDS_CLAIM}
    RETURNING m.state
    """
)

# failed_count on the right-hand side is the value before this failure.
_FINISH_FAILED = text(
    f"""
    UPDATE message m
       SET state = CASE WHEN :final OR m.failed_count >= :limit
                        THEN 'FAILED' ELSE 'PARTLY_FAILED' END,
           failed_count = m.failed_count + 1,
           failed_error_code = :code, failed_desc = :desc,
           last_process_timestamp = now(), custom_data = :custom_data, processing_pid = NULL
     WHERE {_HOLDS_CLAIM}
    RETURNING m.state
    """
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
        self._engine = engine
        self._node_id = node_id
        self._registry = registry
        self._config = config

    def process(self, msg_id: int) -> ProcessResult:
        # One connection for claim and outcome: the claim is tied to its backend pid.
        with self._engine.connect() as conn:
            row = conn.execute(_CLAIM, {"msg_id": msg_id, "node_id": self._node_id}).first()
            conn.commit()
            if row is None:
                return self._not_claimed(conn, msg_id)
            ctx = MessageContext(
                msg_id=row.msg_id,
                service=row.service_name,
                operation=row.operation_name,
                correlation_id=row.correlation_id,
                source_system=row.source_system,
                msg_timestamp=row.msg_timestamp,
                payload=row.payload,
                object_id=row.object_id,
                entity_type=row.entity_type,
                process_id=row.process_id,
                funnel_value=row.funnel_value,
                failed_count=row.failed_count,
                custom_data=row.custom_data,
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
            state = conn.execute(
                _FINISH_OK, {"msg_id": msg_id, "custom_data": ctx.custom_data}
            ).scalar_one_or_none()
            conn.commit()
            if state is None:
                return self._lost(msg_id)
            return ProcessResult(msg_id, Outcome.OK)

    def _fail(
        self, conn: Connection, ctx: MessageContext, code: str, desc: str, *, final: bool
    ) -> ProcessResult:
        limit = self._config.get_int("asynch.countPartlyFailsBeforeFailed")
        state = conn.execute(
            _FINISH_FAILED,
            {
                "msg_id": ctx.msg_id,
                "final": final,
                "limit": limit,
                "code": code[:64],
                "desc": desc,
                "custom_data": ctx.custom_data,
            },
        ).scalar_one_or_none()
        conn.commit()
        if state is None:
            return self._lost(ctx.msg_id)
        return ProcessResult(ctx.msg_id, Outcome(state), f"{code}: {desc.splitlines()[0]}")

    def _lost(self, msg_id: int) -> ProcessResult:
        log.warning("message %s was taken over while its handler ran; outcome dropped", msg_id)
        return ProcessResult(msg_id, Outcome.LOST_CLAIM)

    def _not_claimed(self, conn: Connection, msg_id: int) -> ProcessResult:
        why = conn.execute(_WHY_NOT_CLAIMED, {"msg_id": msg_id, "node_id": self._node_id}).one()
        conn.commit()
        if why.msg_state is None:
            return ProcessResult(msg_id, Outcome.MISSING)
        if why.node_state == "STOPPED" and why.msg_state in ("NEW", "IN_QUEUE"):
            return ProcessResult(msg_id, Outcome.NODE_STOPPED)
        return ProcessResult(msg_id, Outcome.NOT_CLAIMABLE, f"message is {why.msg_state}")
