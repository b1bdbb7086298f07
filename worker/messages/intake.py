"""Intake: the one synchronous path by which a message enters orderly.

Validate, insert NEW (or POSTPONED behind its funnel; idempotent on correlation_id +
source_system), commit, then wake a worker that claims due messages in batches
(worker.messages.wake, worker.messages.batches); a POSTPONED message waits for its funnel to
release it; one scheduled for later waits for its due time (worker.messages.due). Bad input
raises InvalidMessage before anything is written. ``submit_many`` takes up to MAX_BATCH messages at
once: all validated first (one bad item refuses them all), stored in one transaction, those
without a parent in one statement (a funnel's stored NEW: the claim holds back, under its
lock, those that may not go yet). The HTTP API, the CLI and the Python API are thin faces over
:class:`Intake`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from sqlalchemy import Engine

from orderly.models import MessageState
from orderly.worker import nodes
from orderly.worker.core import owners, tracing
from orderly.worker.core.errors import (
    ConflictingMessage,
    InvalidMessage,
    OrderlyError,
    ServiceUnavailable,
    first_line,
)
from orderly.worker.core.group_commit import ALONE, Alone, GroupCommit
from orderly.worker.core.owners import Owns
from orderly.worker.db.prepared import PreparedConnection, prepared_connection
from orderly.worker.messages import store
from orderly.worker.messages.admission import (
    batchable,
    differs,
    groupable,
    new_message,
    parse_message,
    require_owned,
)
from orderly.worker.messages.handlers import HandlerRegistry
from orderly.worker.messages.inputs import MAX_BATCH, MessageIn
from orderly.worker.messages.store import Inserted

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubmitResult:
    msg_id: int
    state: MessageState
    created: bool
    # Stored to wait for its due time (``delay_ms``, ``not_before``): beat's ticker wakes a
    # worker for it then (worker.messages.due), not intake.
    scheduled: bool = False


def insert_many(
    conn: PreparedConnection, messages: Sequence[MessageIn], node_id: int
) -> dict[tuple[str, str], Inserted]:
    """Insert messages NEW in one statement, in order; each one inserted, by
    (correlation_id, source_system). The node must be in RUN (checked in the statement)."""
    rows = store.insert(
        conn, [new_message(m) for m in messages], node_id, require_run=True, hold=False
    )
    return {(r.correlation_id, r.source_system): r for r in rows}


# A message the broker refused is handed over again this long after (by beat's ticker,
# worker.messages.due), and again every tick while the broker refuses.
HAND_OVER_AGAIN_S = 1.0


def _not_handed(new: list[int], exc: Exception) -> ServiceUnavailable:
    stored = f"message {new[0]} is" if len(new) == 1 else f"messages {new} are"
    return ServiceUnavailable(
        "broker",
        f"{first_line(exc)}; {stored} stored and will be processed when the broker "
        "answers again (submitting again answers 200 with the same msg_id)",
    )


def hand_over_later(engine: Engine, msg_ids: list[int]) -> None:
    with prepared_connection(engine) as conn:
        store.hand_over_later(conn, msg_ids, HAND_OVER_AGAIN_S)


class Intake:
    """Accepts messages through one node. After commit, ``wake`` is called when new messages
    are due (a worker claims them in batches); without ``wake``, ``enqueue`` is called with the
    msg_id of each."""

    def __init__(
        self,
        engine: Engine,
        *,
        node_id: int,
        enqueue: Callable[[int], None],
        registry: HandlerRegistry,
        max_payload_bytes: int,
        wake: Callable[[], object] | None = None,
        group_max: int = 0,
    ) -> None:
        self._engine = engine
        self._node_id = node_id
        self._enqueue = enqueue
        self._wake = wake
        self._registry = registry
        self._max_payload_bytes = max_payload_bytes
        # Concurrent submits of plain messages share one INSERT and COMMIT (0: each its own).
        self._group: GroupCommit[tuple[MessageIn, str | None], SubmitResult] | None = (
            GroupCommit(self._write_group, group_max) if group_max > 0 else None
        )

    def _parse(self, data: Any) -> MessageIn:
        return parse_message(
            data, max_payload_bytes=self._max_payload_bytes, registry=self._registry
        )

    @property
    def grouped(self) -> bool:
        """Whether concurrent single submits share commits (``group_max`` above 0)."""
        return self._group is not None

    def validate(self, data: Any, owns: Owns | None = None) -> MessageIn:
        """The message ``data`` is, or InvalidMessage naming every bad field; a message of a
        source system ``owns`` does not hold is refused (404)."""
        message = self._parse(data)
        require_owned(owns, message)
        return message

    def submit(self, data: Any, owns: Owns | None = None) -> SubmitResult:
        """Store one message (idempotent on correlation_id and source_system). ``owns``: the
        caller's objects; a message of another source system is refused (404) before
        anything is stored."""
        return self.store(self.validate(data, owns), owns)

    def store(self, message: MessageIn, owns: Owns | None = None) -> SubmitResult:
        """Store one validated message (:meth:`validate`) on its own, as ``submit``."""
        with tracing.span("intake", attributes={"orderly.correlation_id": message.correlation_id}):
            return self._store_handed(message, owns)

    async def submit_together(self, data: Any, owns: Owns | None = None) -> SubmitResult:
        """``submit`` for a coroutine (the API's): a plain message (no parent, no funnel) is
        stored with those submitted at the same time in one INSERT (its own commit: group
        commit, ``group_max``; worker.core.group_commit), each answered after it; any other,
        or without a group, alone in a thread, as ``submit``. Validated on the caller's loop:
        for bodies of a few kilobytes."""
        if self._group is None:
            return await anyio.to_thread.run_sync(self.submit, data, owns)
        return await self.store_together(self.validate(data, owns), owns)

    async def store_together(
        self, message: MessageIn, owns: Owns | None = None, *, funnels: bool = False
    ) -> SubmitResult:
        """Store one validated message as ``submit_together`` does (the intake must be
        grouped). ``funnels``: a funnel's message joins the group too, stored NEW as in a batch
        (the claim holds it back while an earlier one of its funnel is in flight)."""
        if self._group is None:
            raise RuntimeError("store_together needs an intake with group commit (group_max)")
        with tracing.span("intake", attributes={"orderly.correlation_id": message.correlation_id}):
            # alone: as without a group (its own connection, its own error)
            return await self._group.run_or_alone(
                (message, tracing.current_parent()),
                functools.partial(self._store_handed, message, owns),
                grouped=groupable(message) or (funnels and batchable(message)),
            )

    def _store_handed(
        self, message: MessageIn, owns: Owns | None, traces: Sequence[str | None] | None = None
    ) -> SubmitResult:
        result = self._store(message, owns, traces)
        self._hand_over([result])
        return result

    def _write_group(
        self, items: Sequence[tuple[MessageIn, str | None]]
    ) -> list[SubmitResult | Alone | BaseException]:
        """Submits that came together (worker.core.group_commit): one INSERT for all, in
        autocommit (in key order: two groups never wait for each other's rows in turn), then one
        hand-over; each its own result, or its own refusal (another message under its ids, a
        node refusing input, a broker that did not take it). A group of one is stored as
        without a group (one INSERT, autocommit) while the others queue; every one of a group
        whose statement failed is stored by its own caller instead (ALONE): its own
        connection, its own error, in parallel threads."""
        if len(items) == 1:  # one INSERT, under its own trace parent (not the writer's)
            try:
                return [self._store_handed(items[0][0], None, [items[0][1]])]
            except Exception as exc:
                return [exc]
        order = sorted(items, key=lambda i: (i[0].source_system, i[0].correlation_id))
        inserted: dict[tuple[str, str], Inserted] | None = None
        found: list[SubmitResult | Alone | BaseException] = []
        try:
            with prepared_connection(self._engine) as conn:
                # One statement in autocommit: atomic and durable on its own, without a BEGIN
                # and a COMMIT on the group's way.
                rows = store.insert(
                    conn,
                    [new_message(m) for m, _ in order],
                    self._node_id,
                    require_run=True,
                    hold=False,
                    traces=[t for _, t in order],
                )
                inserted = {(r.correlation_id, r.source_system): r for r in rows}
                # A row is its first submit's: a second one under the same ids is the same
                # message again (200) or a conflict (409), as if it came after.
                unclaimed = dict(inserted)
                for m, _ in items:
                    row = unclaimed.pop((m.correlation_id, m.source_system), None)
                    found.append(self._inserted(row) if row else self._existing_or(conn, m))
        except Exception as exc:
            log.warning(
                "a group of %d submits failed (%s): each alone", len(items), first_line(exc)
            )
            if inserted is None:  # nothing stored
                return [ALONE] * len(items)
            # Stored: the inserted are told so; the others look again on their own.
            unclaimed = dict(inserted)
            found = [
                self._inserted(row) if row else ALONE
                for row in (
                    unclaimed.pop((m.correlation_id, m.source_system), None) for m, _ in items
                )
            ]
        new, failed = self._wake_new([r for r in found if isinstance(r, SubmitResult)])
        if failed is None:
            return found
        return [
            _not_handed([r.msg_id], failed)
            if isinstance(r, SubmitResult) and r.msg_id in new
            else r
            for r in found
        ]

    @staticmethod
    def _inserted(row: Inserted) -> SubmitResult:
        return SubmitResult(row.msg_id, MessageState(row.state), True, row.scheduled)

    def _existing_or(
        self, conn: PreparedConnection, message: MessageIn
    ) -> SubmitResult | Exception:
        try:
            return self._existing(conn, message)
        except OrderlyError as exc:
            return exc

    def submit_many(self, items: Any, owns: Owns | None = None) -> list[SubmitResult]:
        """Store up to MAX_BATCH messages at once, each idempotent as with ``submit``; the
        result of each, in order. Every item is validated before anything is stored: one bad
        item refuses them all, its problems named ``messages[i].field``."""
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
            got = f"{len(items)}" if isinstance(items, list) else type(items).__name__
            problem = f"must be a list of 1 to {MAX_BATCH} messages, got {got}"
            raise InvalidMessage("messages", problem)
        messages: list[MessageIn] = []
        problems: list[tuple[str, str]] = []
        for i, item in enumerate(items):
            try:
                messages.append(self._parse(item))
            except InvalidMessage as exc:
                problems += [(f"messages[{i}].{name}", problem) for name, problem in exc.problems]
        if problems:
            raise InvalidMessage(*problems[0], *problems[1:])
        for i, message in enumerate(messages):
            try:
                require_owned(owns, message)
            except InvalidMessage as exc:
                raise InvalidMessage(f"messages[{i}].{exc.field}", exc.problem) from None
        with tracing.span("intake", attributes={"orderly.messages": len(messages)}):
            results = self._store_many(messages, owns)
            self._hand_over(results)
        return results

    def _hand_over(self, results: Sequence[SubmitResult]) -> None:
        """Wake a worker for the new messages (or, without ``wake``, send each its task). What
        could not be handed over waits POSTPONED: beat's ticker hands it to the broker again
        once it answers (or, should even that fail, repair takes up the NEW message).
        The producer is told; submitting again answers 200."""
        new, failed = self._wake_new(results)
        if failed is not None:
            raise _not_handed(new, failed) from failed

    def _wake_new(self, results: Sequence[SubmitResult]) -> tuple[list[int], Exception | None]:
        """The new messages due now among ``results``, and why they could not be handed over
        (None: they were, or there were none)."""
        new = [
            r.msg_id
            for r in results
            if r.created and r.state is MessageState.NEW and not r.scheduled
        ]
        if not new:
            return new, None
        try:
            if self._wake is not None:
                self._wake()
            else:
                for msg_id in new:
                    self._enqueue(msg_id)
        except Exception as exc:
            # All of them: one a task reached meanwhile has moved on and is left alone.
            log.warning("messages %s stored but not handed to the broker: %s", new, exc)
            try:
                hand_over_later(self._engine, new)
            except Exception:
                log.exception("messages %s: left NEW for repair", new)
            return new, exc
        return new, None

    def _store(
        self, message: MessageIn, owns: Owns | None, traces: Sequence[str | None] | None = None
    ) -> SubmitResult:
        """One message on a connection of its own; ``traces``: its trace parent when it is not
        this thread's (a group's writer stores a group of one)."""
        with prepared_connection(self._engine) as conn:
            return self._store_one(conn, message, owns, traces)

    def _store_one(
        self,
        conn: PreparedConnection,
        message: MessageIn,
        owns: Owns | None,
        traces: Sequence[str | None] | None = None,
    ) -> SubmitResult:
        unknown_parent = InvalidMessage(
            "parent_msg_id", f"no message {message.parent_msg_id} exists"
        )
        if owns is not None and message.parent_msg_id is not None:
            # Another tenant's message is no parent of the caller's: as if it did not exist.
            owned = owners.source_systems(owns)
            if not store.parent_owned(conn, message.parent_msg_id, owned):
                raise unknown_parent
        try:
            inserted = store.insert(
                conn,
                [new_message(message)],
                self._node_id,
                require_run=True,
                hold=True,
                traces=traces,
            )
        except self._engine.dialect.loaded_dbapi.IntegrityError as exc:
            if "parent_msg_id" in str(exc):
                raise unknown_parent from None
            raise
        if inserted:
            return SubmitResult(
                inserted[0].msg_id,
                MessageState(inserted[0].state),
                created=True,
                scheduled=inserted[0].scheduled,
            )
        return self._existing(conn, message)

    def _existing(self, conn: PreparedConnection, message: MessageIn) -> SubmitResult:
        """The message stored before under the same ids; or why the node refused it."""
        found = store.find(conn, message.correlation_id, message.source_system)
        if found is None:
            raise nodes.refusal(conn, self._node_id)
        changed = differs(message, found.service_name, found.operation_name, found.payload)
        if changed:
            raise ConflictingMessage(
                found.msg_id, message.correlation_id, message.source_system, changed
            )
        return SubmitResult(found.msg_id, MessageState(found.state), created=False)

    def _store_many(self, messages: list[MessageIn], owns: Owns | None) -> list[SubmitResult]:
        """One transaction: the messages without a parent in one statement, the others one by
        one in their order (a parent's check), under their funnels' locks taken first, in key
        order (two batches naming the same funnels in another order cannot deadlock)."""
        results: list[SubmitResult | None] = [None] * len(messages)
        plain = [i for i, m in enumerate(messages) if batchable(m)]
        held = [
            (m.funnel_value, m.funnel_component_id)
            for m in messages
            if not batchable(m) and m.funnel_value is not None
        ]
        with prepared_connection(self._engine) as conn:
            conn.execute("BEGIN")
            try:
                store.lock_funnels(conn, held)
                if plain:
                    inserted = insert_many(conn, [messages[i] for i in plain], self._node_id)
                    for i in plain:
                        m = messages[i]
                        row = inserted.pop((m.correlation_id, m.source_system), None)
                        if row is not None:
                            results[i] = SubmitResult(
                                row.msg_id,
                                MessageState(row.state),
                                created=True,
                                scheduled=row.scheduled,
                            )
                for i, m in enumerate(messages):
                    if results[i] is None and not batchable(m):
                        try:
                            results[i] = self._store_one(conn, m, owns)
                        except InvalidMessage as exc:
                            field = f"messages[{i}].{exc.field}"
                            raise InvalidMessage(field, exc.problem) from None
                for i, m in enumerate(messages):
                    if results[i] is None:
                        # Stored before, or an earlier item of this batch with the same ids.
                        try:
                            results[i] = self._existing(conn, m)
                        except ConflictingMessage as exc:
                            raise exc.at(f"messages[{i}].correlation_id") from None
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return [r for r in results if r is not None]
