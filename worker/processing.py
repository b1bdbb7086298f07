"""Processing: claim a message under a row lock, run its handler, record the outcome.

Every transition is one statement whose WHERE holds the state check, so a transition from the
wrong state changes nothing and is reported, never silently applied. The claim records the
claiming connection's backend pid; the same connection records the outcome, and only if it
still holds the claim. A PROCESSING message whose backend pid is gone belongs to a dead
worker: a redelivered task may claim it again at once (the death counted in lost_count), and
beat's orphan job releases it within a second; one that has killed its worker
``worker_lost_limit`` times is quarantined there (worker.pool.release_orphans).

Funnels: the claim of a funnel message runs under its funnel's advisory lock and makes it
POSTPONED instead of PROCESSING when the funnel holds it back (``orderly_funnel_blocked``).
The outcome (``orderly_finish``) takes the same lock; the trigger on ``message.state`` then
releases the funnel's next POSTPONED message in the same transaction, and this worker goes
on with it at once on the same connection (up to CHAIN_LIMIT in a row), with no broker trip
and no poll in between.

Batches: due messages are claimed several at a time, tracked as one claim, and their OK
outcomes written together (worker.batches, on ``run_claimed``).
"""

from __future__ import annotations

import enum
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from orderly.models import BindingType, MessageState
from orderly.worker.backend import HandlerBackend
from orderly.worker.configuration import ConfigReader
from orderly.worker.core import logs
from orderly.worker.core.errors import CallInProgress, HandlerError, InvalidMessage
from orderly.worker.core.http import OutboundHttp
from orderly.worker.core.limits import TimeLimitExceeded, TimeLimits
from orderly.worker.handlers import ExternalResponse, Handler, HandlerRegistry, MessageContext
from orderly.worker.intake import insert_message, insert_values, parse_message
from orderly.worker.store.prepared import PreparedConnection, prepared_connection
from orderly.worker.tracking import Tracker, claim_of

log = logging.getLogger(__name__)

# Released funnel messages one worker goes on with in a row before handing the next to the
# broker (fair to the messages waiting there).
CHAIN_LIMIT = 100

CLAIM_COLUMNS = (
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
    "wait_res_id",
    # the claim's identity, for the timeout monitor
    "processing_pid",
    "last_process_timestamp",
)


class Outcome(enum.StrEnum):
    OK = "OK"
    PARTLY_FAILED = "PARTLY_FAILED"
    FAILED = "FAILED"
    OBSOLETE = "OBSOLETE"  # skipped: a newer message of the same object was processed (OK)
    POSTPONED = "POSTPONED"  # held back by its funnel, or an external call in progress
    WAITING = "WAITING"  # a parent waiting for its HARD children
    WAITING_FOR_RES = "WAITING_FOR_RES"  # parked until an external response comes
    IN_QUEUE = "IN_QUEUE"  # parked, but its response had come already: taken up again
    NOT_CLAIMABLE = "NOT_CLAIMABLE"  # wrong state (already done, or running elsewhere)
    NODE_STOPPED = "NODE_STOPPED"  # this node processes nothing; the task goes back
    LOST_CLAIM = "LOST_CLAIM"  # someone took the message over while the handler ran
    MISSING = "MISSING"  # no such message


ERROR_NO_HANDLER = "E_NO_HANDLER"
ERROR_HANDLER = "E_HANDLER"
ERROR_INVALID_CHILD = "E_INVALID_CHILD"
ERROR_TIME_LIMIT = "E_TIME_LIMIT"

# Added to a time-limited message's tracking deadline beyond its limit and the kill grace:
# the claim and outcome statements around the handler, and the orphan job's turn (every
# second, after a one-second grace) that releases the message of a killed worker first.
LIMIT_TRACKING_MARGIN_MS = 2_000


@dataclass(frozen=True)
class ProcessResult:
    msg_id: int
    outcome: Outcome
    detail: str = ""
    # Messages this outcome made ready: funnel messages it released, itself when its
    # response had already come. The worker goes on with them at once.
    ready: tuple[int, ...] = ()
    # NEW children it stored: they go to the broker (processed in parallel).
    spawned: tuple[int, ...] = ()


def parse_ids(text: str | None) -> list[int]:
    """The comma-separated ids a transaction collected in 'orderly.released'."""
    return [int(part) for part in (text or "").split(",") if part]


class Processor:
    def __init__(
        self,
        engine: Engine,
        *,
        node_id: int,
        registry: HandlerRegistry,
        config: ConfigReader,
        max_payload_bytes: int = 1_048_576,
        tracker: Tracker | None = None,
        http: OutboundHttp | None = None,
        worker_lost_limit: int = 3,
        limits: TimeLimits | None = None,
        default_time_limit_s: float | None = None,
    ) -> None:
        self._tracker = tracker
        # Without ``limits`` handlers run unlimited; a handler declaring no time limit takes
        # ``default_time_limit_s`` (None: unlimited).
        self._limits = limits
        self._default_time_limit_s = default_time_limit_s
        self._worker_lost_limit = worker_lost_limit
        self._http = http or OutboundHttp()
        self._engine = engine
        self._integrity = engine.dialect.loaded_dbapi.IntegrityError
        self._node_id = node_id
        self._registry = registry
        self._config = config
        self._max_payload_bytes = max_payload_bytes

    def process(self, msg_id: int, enqueue: Callable[[int], None] | None = None) -> ProcessResult:
        """Process one message, then the funnel messages its outcome released (in a row, up to
        CHAIN_LIMIT); what is left, and children, go to ``enqueue``. Without ``enqueue`` the
        first result's ``ready`` lists them and nothing else runs."""
        # One connection for claim and outcome: the claim is tied to its backend pid.
        with prepared_connection(self._engine) as conn:
            first = self._process_one(conn, msg_id)
            if enqueue is None:
                return first
            chain, result, ready = 0, first, list(first.ready)
            try:
                while True:
                    for child in result.spawned:
                        enqueue(child)
                    if not ready:
                        return first
                    next_id = ready.pop(0)
                    if chain >= CHAIN_LIMIT:
                        enqueue(next_id)
                        continue
                    chain += 1
                    result = self._process_one(conn, next_id)
                    ready.extend(result.ready)
                    if result.outcome is Outcome.NODE_STOPPED:
                        enqueue(next_id)  # back to the broker for another node
            finally:
                # Released messages have no task of their own: never leave one behind.
                for left in ready:
                    enqueue(left)

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def tracker(self) -> Tracker | None:
        return self._tracker

    def all_limited(self) -> bool:
        """Whether every handler runs under a time limit in this process (worker.batches)."""
        if self._limits is None:
            return False
        return self._default_time_limit_s is not None or self._registry.all_limited()

    def limited_deadline_ms(self, claimed: Any) -> int | None:
        """The tracking deadline a claimed message's time-limited handler needs: its limit,
        the kill grace and the margin (None: it runs unlimited, messageTimeout applies)."""
        limit_s = self._time_limit_s(
            claimed[1 + CLAIM_COLUMNS.index("service_name")],
            claimed[1 + CLAIM_COLUMNS.index("operation_name")],
        )
        if limit_s is None or self._limits is None:
            return None
        return round((limit_s + self._limits.grace_s) * 1000) + LIMIT_TRACKING_MARGIN_MS

    def _process_one(self, conn: PreparedConnection, msg_id: int) -> ProcessResult:
        claimed = conn.run("orderly_claim_ids", [msg_id], self._node_id, self._worker_lost_limit)
        if claimed is None:
            return self._not_claimed(conn, msg_id)
        if claimed[0] == MessageState.POSTPONED:
            return ProcessResult(msg_id, Outcome.POSTPONED, "held back by its funnel")
        if self._tracker is None:
            return self.run_claimed(conn, claimed)
        # Tracked from the claim to the outcome: a worker that never gets there is a timeout.
        # Never before its handler's time limit and kill grace have passed: the limits stop a
        # hung handler; taking its message back while it may still run would run it twice.
        pid = claimed[1 + CLAIM_COLUMNS.index("processing_pid")]
        at = claimed[1 + CLAIM_COLUMNS.index("last_process_timestamp")]
        timeout_ms = self.limited_deadline_ms(claimed)
        with self._tracker.tracking(
            msg_id, "message", claim=claim_of(pid, at), timeout_ms=timeout_ms
        ):
            return self.run_claimed(conn, claimed)

    def _time_limit_s(self, service: str, operation: str) -> float | None:
        declared = self._registry.time_limit_s(service, operation)
        return self._default_time_limit_s if declared is None else declared

    def _call_handler(self, handler: Handler, ctx: MessageContext) -> None:
        """The handler under its time limit, if it has one (worker.core.limits)."""
        limit_s = self._time_limit_s(ctx.service, ctx.operation)
        if limit_s is None or self._limits is None:
            handler(ctx)
            return
        what = f"handler {ctx.service}.{ctx.operation} (message {ctx.msg_id})"
        self._limits.run(limit_s, what, lambda: handler(ctx))

    def run_claimed(
        self, conn: PreparedConnection, claimed: Any, held: list[tuple[int, Any]] | None = None
    ) -> ProcessResult:
        """Run a claimed message's handler and record its outcome (a plain OK goes to ``held``
        instead, when given: worker.batches writes a batch's OK outcomes together)."""
        row = dict(zip(CLAIM_COLUMNS, claimed[1:-1], strict=True))
        newer: int | None = claimed[-1]
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
            backend=HandlerBackend(conn, self._config, self._integrity, self._http),
        )
        with logs.bound(msg_id=ctx.msg_id, correlation_id=ctx.correlation_id):
            return self._handle(conn, ctx, row, newer, held)

    def _handle(
        self,
        conn: PreparedConnection,
        ctx: MessageContext,
        row: dict[str, Any],
        newer: int | None,
        held: list[tuple[int, Any]] | None = None,
    ) -> ProcessResult:
        """Run the handler and record the outcome; a plain OK goes to ``held`` instead, when
        given (a batch writes its OK outcomes together: worker.batches)."""
        if newer is not None:
            return self._finish(
                conn, ctx, "OK", obsolete_by=newer, detail=f"obsolete: message {newer} is newer"
            )
        if row["wait_res_id"] is not None:
            ctx.response = self._response(conn, row["wait_res_id"])
        handler = self._registry.get(ctx.service, ctx.operation)
        if handler is None:
            desc = f"no handler registered for {ctx.service}.{ctx.operation}"
            return self._finish(conn, ctx, "FAILED", code=ERROR_NO_HANDLER, desc=desc)
        try:
            self._call_handler(handler, ctx)
        except TimeLimitExceeded as exc:
            # Stopped, not left running: the message is failed like any handler error and
            # comes back through the pool (or ends FAILED) with no copy of it still running.
            desc = f"{exc}; stopped"
            return self._finish(conn, ctx, "FAIL", code=ERROR_TIME_LIMIT, desc=desc)
        except CallInProgress as exc:
            # Not a failure: the key is busy; the pool takes the message up again.
            return self._finish(conn, ctx, "POSTPONED", detail=str(exc))
        except HandlerError as exc:
            return self._finish(conn, ctx, "FAIL", code=exc.code, desc=exc.description)
        except Exception as exc:
            desc = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            return self._finish(conn, ctx, "FAIL", code=ERROR_HANDLER, desc=desc)
        if ctx.children and ctx.waits_for is not None:
            desc = "a handler may wait for a response or add children, not both"
            return self._finish(conn, ctx, "FAIL", code=ERROR_INVALID_CHILD, desc=desc)
        if ctx.children:
            return self._split(conn, ctx)
        if ctx.waits_for is not None:
            return self._finish(conn, ctx, "WAITING_FOR_RES", detail=f"waits for {ctx.waits_for}")
        if held is not None:
            held.append((ctx.msg_id, ctx.custom_data))
            return ProcessResult(ctx.msg_id, Outcome.OK)
        return self._finish(conn, ctx, "OK")

    def _finish(
        self,
        conn: PreparedConnection,
        ctx: MessageContext,
        kind: str,
        *,
        code: str | None = None,
        desc: str | None = None,
        obsolete_by: int | None = None,
        detail: str = "",
    ) -> ProcessResult:
        limit = self._config.get_int("asynch.countPartlyFailsBeforeFailed")
        done = conn.run(
            "orderly_finish",
            ctx.msg_id,
            kind,
            limit,
            None if code is None else code[:64],
            desc,
            ctx.custom_data,
            obsolete_by,
        )
        assert done is not None
        new_state, released = done
        if new_state is None:
            log.warning(
                "message %s was taken over while its handler ran; outcome dropped", ctx.msg_id
            )
            return ProcessResult(ctx.msg_id, Outcome.LOST_CLAIM)
        ready = tuple(parse_ids(released))
        if new_state == MessageState.IN_QUEUE:
            ready = (ctx.msg_id, *ready)  # parked, but the response is here: go on at once
        outcome = Outcome.OBSOLETE if obsolete_by is not None else Outcome(new_state)
        if code is not None and not detail:
            detail = f"{code}: {(desc or '').splitlines()[0] if desc else ''}"
        return ProcessResult(ctx.msg_id, outcome, detail, ready)

    def _split(self, conn: PreparedConnection, ctx: MessageContext) -> ProcessResult:
        """Store the children and the parent's outcome in one transaction."""
        try:
            children = [
                (
                    spec.binding,
                    parse_message(
                        {
                            "service": spec.service,
                            "operation": spec.operation,
                            "correlation_id": spec.correlation_id or _child_correlation(ctx, n),
                            "source_system": ctx.source_system,
                            "msg_timestamp": ctx.msg_timestamp,
                            "payload": spec.payload,
                            "object_id": spec.object_id,
                            "entity_type": spec.entity_type,
                            "process_id": ctx.process_id,
                            "funnel_value": spec.funnel_value,
                            "funnel_component_id": spec.funnel_component_id,
                            "guaranteed_order": spec.guaranteed_order,
                            "exclude_failed_state": spec.exclude_failed_state,
                            "parent_msg_id": ctx.msg_id,
                        },
                        max_payload_bytes=self._max_payload_bytes,
                        registry=self._registry,
                    ),
                )
                for n, spec in enumerate(ctx.children, start=1)
            ]
        except InvalidMessage as exc:
            return self._finish(conn, ctx, "FAIL", code=ERROR_INVALID_CHILD, desc=str(exc))
        if ctx.funnel_value is not None and any(
            child.funnel_value == ctx.funnel_value for _, child in children
        ):
            # The parent holds its funnel while WAITING: such a child could never start.
            desc = f"a child may not join its parent's funnel {ctx.funnel_value!r}"
            return self._finish(conn, ctx, "FAIL", code=ERROR_INVALID_CHILD, desc=desc)
        hard = any(binding is BindingType.HARD for binding, _ in children)
        conn.execute("BEGIN")
        try:
            new: list[int] = []
            for binding, child in children:
                stored = insert_message(
                    conn,
                    insert_values(child, self._node_id, binding.value),
                    require_run=False,
                )
                if stored is not None and stored[1] is MessageState.NEW:
                    new.append(stored[0])
            result = self._finish(
                conn, ctx, "WAITING" if hard else "OK", detail=f"{len(children)} children"
            )
            # A parent taken over meanwhile (cancelled, repaired) keeps no children.
            conn.execute("ROLLBACK" if result.outcome is Outcome.LOST_CLAIM else "COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if result.outcome is Outcome.LOST_CLAIM:
            return result
        return ProcessResult(result.msg_id, result.outcome, result.detail, result.ready, tuple(new))

    def _response(self, conn: PreparedConnection, res_id: int) -> ExternalResponse | None:
        found = conn.run("orderly_load_response", res_id)
        if found is None:
            return None
        return ExternalResponse(
            res_id=int(found[0]),
            envelope=found[1],
            failed=bool(found[2]),
            reason=found[3],
            received_at=found[4],
        )

    def _not_claimed(self, conn: PreparedConnection, msg_id: int) -> ProcessResult:
        why = conn.run("orderly_why_not_claimed", msg_id, self._node_id)
        msg_state, node_state = why if why is not None else (None, None)
        if msg_state is None:
            return ProcessResult(msg_id, Outcome.MISSING)
        if node_state == "STOPPED" and msg_state in ("NEW", "IN_QUEUE"):
            return ProcessResult(msg_id, Outcome.NODE_STOPPED)
        return ProcessResult(msg_id, Outcome.NOT_CLAIMABLE, f"message is {msg_state}")


def _child_correlation(ctx: MessageContext, n: int) -> str:
    """A child's default correlation id: stable across tries of the parent."""
    candidate = f"{ctx.correlation_id}/{n}"
    return candidate if len(candidate) <= 100 else f"msg-{ctx.msg_id}/{n}"
