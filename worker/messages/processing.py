"""Processing: run a claimed message's handler and record its outcome.

Claims come from worker.messages.batches (a single message is a batch of one). Every
transition is one statement whose WHERE holds the state check, so a transition from the wrong
state changes nothing and is reported, never silently applied. The claim records the claiming
connection's backend pid; the same connection records the outcome, and only if it still holds
the claim. A PROCESSING message whose backend pid is gone belongs to a dead worker: a
redelivered task may claim it again at once (the death counted in lost_count when its claim
held it alone; a claim of several is isolated instead), and beat's orphan job releases it
within a second; one that has killed its worker ``worker_lost_limit`` times in claims of its
own is quarantined there (worker.messages.watchdogs.release_orphans).

Funnels: the outcome (``orderly_finish``) takes the funnel's advisory lock; the trigger on
``message.state`` then releases the funnel's next POSTPONED message in the same transaction,
and the worker goes on with it in its next round on the same connection, with no broker trip
and no poll in between.

Outcomes: a failed try is retried after ``delay * multiplier^attempt`` (the handler's
:class:`~orderly.worker.messages.handlers.Retry`, or the configuration table's), waiting on
its row for its due time (worker.messages.due); a cancel aborts a running handler
(worker.messages.abort).
"""

from __future__ import annotations

import enum
import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from orderly.models import BindingType, MessageState
from orderly.worker.configuration import ConfigReader
from orderly.worker.core import logs, tracing
from orderly.worker.core.errors import CallInProgress, HandlerError, InvalidMessage
from orderly.worker.core.http import OutboundHttp
from orderly.worker.core.limits import Aborted, TimeLimitExceeded, TimeLimits
from orderly.worker.core.retry import MAX_ATTEMPTS, RetryPolicy
from orderly.worker.db.prepared import PreparedConnection
from orderly.worker.messages import store
from orderly.worker.messages.abort import AbortWatch
from orderly.worker.messages.admission import new_message, parse_message
from orderly.worker.messages.backend import HandlerBackend
from orderly.worker.messages.failure_log import log_failure
from orderly.worker.messages.handlers import (
    ExternalResponse,
    Handler,
    HandlerRegistry,
    MessageContext,
    Retry,
)
from orderly.worker.messages.rates import StartRates
from orderly.worker.messages.store import Claimed, parse_ids
from orderly.worker.totals import HANDLER_SECONDS, MESSAGES_PROCESSED, TALLY
from orderly.worker.tracking import Tracker

log = logging.getLogger(__name__)


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
    ABORTED = "ABORTED"  # cancelled while its handler ran: the cancel is its outcome
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
        aborts: AbortWatch | None = None,
        rates: StartRates | None = None,
    ) -> None:
        self._rates = rates
        # Handlers stopped when their message is cancelled meanwhile (needs ``limits``).
        self._aborts = aborts
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

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def node_id(self) -> int:
        return self._node_id

    @property
    def tracker(self) -> Tracker | None:
        return self._tracker

    @property
    def rates(self) -> StartRates | None:
        """The funnels' start rates its claims take tokens from (None: not applied)."""
        return self._rates

    @property
    def worker_lost_limit(self) -> int:
        """Deaths of its workers after which a message is quarantined."""
        return self._worker_lost_limit

    def all_limited(self) -> bool:
        """Whether every handler runs under a time limit in this process
        (worker.messages.batches)."""
        if self._limits is None:
            return False
        return self._default_time_limit_s is not None or self._registry.all_limited()

    def limited_deadline_ms(self, claimed: Claimed) -> int | None:
        """The tracking deadline a claimed message's time-limited handler needs: its limit,
        the kill grace and the margin (None: it runs unlimited, messageTimeout applies)."""
        limit_s = self._time_limit_s(claimed.service_name, claimed.operation_name)
        if limit_s is None or self._limits is None:
            return None
        return round((limit_s + self._limits.grace_s) * 1000) + LIMIT_TRACKING_MARGIN_MS

    def _time_limit_s(self, service: str, operation: str) -> float | None:
        declared = self._registry.time_limit_s(service, operation)
        return self._default_time_limit_s if declared is None else declared

    def _call_handler(self, handler: Handler, ctx: MessageContext) -> None:
        """The handler under its time limit, if it has one (worker.core.limits), ended with
        Aborted if its message is cancelled meanwhile (worker.messages.abort); timed."""
        started = time.perf_counter()
        try:
            self._run_handler(handler, ctx)
        finally:
            ran_s = time.perf_counter() - started
            TALLY.observe(HANDLER_SECONDS, ctx.service, ctx.operation, seconds=ran_s)

    def _run_handler(self, handler: Handler, ctx: MessageContext) -> None:
        limit_s = self._time_limit_s(ctx.service, ctx.operation)
        if self._limits is None:
            handler(ctx)
            return
        what = f"handler {ctx.service}.{ctx.operation} (message {ctx.msg_id})"
        if self._aborts is None:
            self._limits.run(limit_s, what, lambda: handler(ctx))
            return
        with self._aborts.running(ctx.msg_id) as abort:
            ctx.abort_flag = abort.is_set
            self._limits.run(limit_s, what, lambda: handler(ctx), abort)

    def run_claimed(
        self,
        conn: PreparedConnection,
        claimed: Claimed,
        held: list[tuple[int, Any]] | None = None,
    ) -> ProcessResult:
        """Run a claimed message's handler and record its outcome (a plain OK goes to ``held``
        instead, when given: worker.messages.batches writes a batch's OK outcomes together)."""
        ctx = MessageContext(
            msg_id=claimed.msg_id,
            service=claimed.service_name,
            operation=claimed.operation_name,
            correlation_id=claimed.correlation_id,
            source_system=claimed.source_system,
            msg_timestamp=claimed.msg_timestamp,
            payload=claimed.payload,
            object_id=claimed.object_id,
            entity_type=claimed.entity_type,
            process_id=claimed.process_id,
            funnel_value=claimed.funnel_value,
            failed_count=claimed.failed_count,
            custom_data=claimed.custom_data,
            backend=HandlerBackend(conn, self._config, self._integrity, self._http),
        )
        with (
            logs.bound(
                msg_id=ctx.msg_id,
                correlation_id=ctx.correlation_id,
                source_system=ctx.source_system,
                service=ctx.service,
                operation=ctx.operation,
            ),
            tracing.span(
                f"handle {ctx.service}.{ctx.operation}",
                parent=claimed.trace_parent,
                attributes={
                    "orderly.msg_id": ctx.msg_id,
                    "orderly.correlation_id": ctx.correlation_id,
                },
            ) as span,
        ):
            result = self._handle(conn, ctx, claimed, held)
            if span is not None:
                span.set_attribute("orderly.outcome", result.outcome.value)
        if held is None or not held or held[-1][0] != ctx.msg_id:
            self.count([(claimed, result.outcome)])  # written: a held OK is counted once it is
        return result

    def count(self, outcomes: Sequence[tuple[Claimed, Outcome]]) -> None:
        """Handler runs whose outcome is written, by service, operation and outcome; the
        operation's FAILED series is there from its first run (at 0), so that an alert on its
        increase sees the first failure."""
        for claimed, outcome in outcomes:
            labels = (claimed.service_name, claimed.operation_name)
            TALLY.add(MESSAGES_PROCESSED, *labels, outcome.value)
            TALLY.add(MESSAGES_PROCESSED, *labels, Outcome.FAILED.value, amount=0)

    def _handle(
        self,
        conn: PreparedConnection,
        ctx: MessageContext,
        claimed: Claimed,
        held: list[tuple[int, Any]] | None = None,
    ) -> ProcessResult:
        """Run the handler and record the outcome; a plain OK goes to ``held`` instead, when
        given (a batch writes its OK outcomes together: worker.messages.batches)."""
        newer = claimed.newer
        if newer is not None:
            return self._finish(
                conn, ctx, "OK", obsolete_by=newer, detail=f"obsolete: message {newer} is newer"
            )
        if claimed.wait_res_id is not None:
            ctx.response = self._response(conn, claimed.wait_res_id)
        handler = self._registry.get(ctx.service, ctx.operation)
        if handler is None:
            desc = f"no handler registered for {ctx.service}.{ctx.operation}"
            result = self._finish(conn, ctx, "FAILED", code=ERROR_NO_HANDLER, desc=desc)
            log_failure(ctx, result.outcome, ERROR_NO_HANDLER, desc, ctx.failed_count + 1, 0, None)
            return result
        try:
            self._call_handler(handler, ctx)
        except Aborted as exc:
            # The cancel is the outcome, written with its audit entry by the operator's
            # command: nothing to write here, nothing to retry.
            log.info("message %s aborted by cancel", ctx.msg_id)
            return ProcessResult(ctx.msg_id, Outcome.ABORTED, str(exc))
        except TimeLimitExceeded as exc:
            # Stopped, not left running: the message is failed like any handler error and
            # comes back through the pool (or ends FAILED) with no copy of it still running.
            desc = f"{exc}; stopped"
            return self._fail(conn, ctx, ERROR_TIME_LIMIT, desc)
        except CallInProgress as exc:
            # Not a failure: the key is busy; the message is due again after
            # postponedIntervalSec.
            return self._finish(
                conn, ctx, "POSTPONED", detail=str(exc), due_ms=self.postponed_s() * 1000
            )
        except HandlerError as exc:
            return self._fail(conn, ctx, exc.code, exc.description, exc)
        except Exception as exc:
            desc = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            return self._fail(conn, ctx, ERROR_HANDLER, desc, exc)
        if ctx.children and ctx.waits_for is not None:
            desc = "a handler may wait for a response or add children, not both"
            return self._fail(conn, ctx, ERROR_INVALID_CHILD, desc)
        if ctx.children:
            return self._split(conn, ctx)
        if ctx.waits_for is not None:
            return self._finish(conn, ctx, "WAITING_FOR_RES", detail=f"waits for {ctx.waits_for}")
        if held is not None:
            held.append((ctx.msg_id, ctx.custom_data))
            return ProcessResult(ctx.msg_id, Outcome.OK)
        return self._finish(conn, ctx, "OK")

    def retry_policy(self, service: str, operation: str) -> tuple[Retry, RetryPolicy]:
        """A handler's retry policy, its unset parts taken from the configuration table."""
        declared = self._registry.retry(service, operation)
        config = self._config
        default = RetryPolicy(
            delay_ms=config.get_int("asynch.partlyFailedIntervalSec") * 1000,
            multiplier=config.get_float("asynch.partlyFailedMultiplier"),
            # The policy's own bound; the table allows more, which would mean "for ever".
            attempts=min(config.get_int("asynch.countPartlyFailsBeforeFailed"), MAX_ATTEMPTS),
            max_delay_ms=config.get_int("asynch.partlyFailedMaxIntervalSec") * 1000,
        )
        return declared, declared.policy(default)

    def postponed_s(self) -> int:
        """How long a message held back waits before it is looked at again."""
        return self._config.get_int("asynch.postponedIntervalSec")

    def _fail(
        self,
        conn: PreparedConnection,
        ctx: MessageContext,
        code: str,
        desc: str,
        error: BaseException | None = None,
    ) -> ProcessResult:
        """A failed try: retried after ``delay * multiplier^attempt`` while the policy allows
        (and the error is of a kind it retries), else FAILED."""
        declared, policy = self.retry_policy(ctx.service, ctx.operation)
        attempt = ctx.failed_count + 1
        retried = error is None or declared.retries(error)
        due_ms = policy.delay(attempt) if policy.allows(attempt) else 0
        result = self._finish(
            conn,
            ctx,
            "FAIL" if retried else "FAILED",
            code=code,
            desc=desc,
            limit=policy.attempts,
            due_ms=due_ms,
        )
        log_failure(ctx, result.outcome, code, desc, attempt, due_ms, error)
        return result

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
        limit: int = 0,
        due_ms: int = 0,
    ) -> ProcessResult:
        ending = store.Ending(
            ctx.msg_id,
            kind,
            fail_limit=limit,
            code=None if code is None else code[:64],
            desc=desc,
            custom_data=ctx.custom_data,
            obsolete_by=obsolete_by,
            due_ms=due_ms,
        )
        (done,) = store.finish(conn, [ending])
        new_state, released = done.new_state, done.released
        if new_state is None:
            return ProcessResult(ctx.msg_id, self.lost(conn, ctx.msg_id))
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
            return self._fail(conn, ctx, ERROR_INVALID_CHILD, str(exc))
        if ctx.funnel_value is not None and any(
            child.funnel_value == ctx.funnel_value for _, child in children
        ):
            # The parent holds its funnel while WAITING: such a child could never start.
            desc = f"a child may not join its parent's funnel {ctx.funnel_value!r}"
            return self._fail(conn, ctx, ERROR_INVALID_CHILD, desc)
        hard = any(binding is BindingType.HARD for binding, _ in children)
        conn.execute("BEGIN")
        try:
            # one statement for them all (a child's funnel: the claim decides, as in a batch)
            stored = store.insert(
                conn,
                [new_message(child, binding.value) for binding, child in children],
                self._node_id,
                require_run=False,
                hold=False,
            )
            new = [r.msg_id for r in stored if r.state == MessageState.NEW and not r.scheduled]
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
        found = store.load_response(conn, res_id)
        if found is None:
            return None
        return ExternalResponse(
            res_id=found.res_id,
            envelope=found.res_envelope,
            failed=bool(found.failed),
            reason=found.failed_reason,
            received_at=found.res_timestamp,
        )

    def lost(self, conn: PreparedConnection, msg_id: int) -> Outcome:
        """A message whose outcome this worker could not record: cancelled meanwhile (the
        cancel is its outcome), or taken over (by repair, the timeout monitor, an operator)."""
        why = store.why_not_claimed(conn, msg_id, self._node_id)
        if why.msg_state == MessageState.CANCEL:
            log.info("message %s aborted by cancel", msg_id)
            return Outcome.ABORTED
        log.warning("message %s was taken over while its handler ran; outcome dropped", msg_id)
        return Outcome.LOST_CLAIM

    def not_claimed(self, conn: PreparedConnection, msg_id: int) -> ProcessResult:
        """Why a message's claim took nothing: missing, its node STOPPED, or its state."""
        why = store.why_not_claimed(conn, msg_id, self._node_id)
        msg_state, node_state = why.msg_state, why.node_state
        if msg_state is None:
            return ProcessResult(msg_id, Outcome.MISSING)
        if node_state == "STOPPED" and msg_state in ("NEW", "IN_QUEUE"):
            return ProcessResult(msg_id, Outcome.NODE_STOPPED)
        return ProcessResult(msg_id, Outcome.NOT_CLAIMABLE, f"message is {msg_state}")


def _child_correlation(ctx: MessageContext, n: int) -> str:
    """A child's default correlation id: stable across tries of the parent."""
    candidate = f"{ctx.correlation_id}/{n}"
    return candidate if len(candidate) <= 100 else f"msg-{ctx.msg_id}/{n}"
