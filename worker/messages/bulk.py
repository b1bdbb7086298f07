"""Operator commands on every message a filter selects: re-drive the FAILED or CANCEL ones,
cancel the ones not yet final.

The filter must name a state the command applies to, and the operator confirms what it
selects first (:func:`matching`): :func:`run` refuses when other messages match by then, so
that a change nobody saw is not applied. Each message then goes through the one-message command
(worker.messages.operations: its own transaction, funnel locks, HARD family, audit entry
with the note), so a bulk command is exactly that many single ones; a message whose state
changed in between is named as refused, the others go on.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from orderly.models import FINAL_STATES, MessageState
from orderly.worker.core.errors import InvalidMessage, MessageNotFound, OperationRefused
from orderly.worker.core.owners import Owns
from orderly.worker.messages import operations
from orderly.worker.messages.operations import MessageFilter

# At most this many messages in one command: a wider filter is refused (narrow it, or page).
BULK_MAX = 500
CONVERSATION = "conversation"  # settled by ordered delivery, never by hand


class Action(enum.StrEnum):
    REDRIVE = "redrive"
    CANCEL = "cancel"

    @property
    def states(self) -> frozenset[MessageState]:
        """The states a message must be in for the command to apply."""
        if self is Action.REDRIVE:
            return frozenset({MessageState.FAILED, MessageState.CANCEL})
        return frozenset(s for s in MessageState if s not in FINAL_STATES)


def actions_for(found: MessageFilter) -> list[Action]:
    """The commands a filter's state allows (none without a state)."""
    return [a for a in Action if found.state is not None and found.state in a.states]


def matching(engine: Engine, found: MessageFilter, action: Action, owns: Owns | None) -> list[int]:
    """The ids a command on ``found`` would take now, oldest first; InvalidMessage when the
    filter names no state the command applies to, or selects more than BULK_MAX."""
    if found.state is None or found.state not in action.states:
        allowed = ", ".join(sorted(s.value for s in action.states))
        raise InvalidMessage("state", f"{action.value} takes a filter on a state: {allowed}")
    rows = operations.list_messages(engine, found, limit=BULK_MAX + 1, owns=owns)
    ids = [int(r["msg_id"]) for r in rows if r["service_name"] != CONVERSATION]
    if len(rows) > BULK_MAX:
        raise InvalidMessage(
            "filter", f"more than {BULK_MAX} messages match: narrow it (a time window, a service)"
        )
    return ids


@dataclass
class BulkResult:
    action: Action
    done: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)  # msg_id -> why, in id order


def run(
    engine: Engine,
    found: MessageFilter,
    action: Action,
    expected: Sequence[int],
    data: Any,
    enqueue: Callable[[int], None],
    *,
    key: str | None = None,
    owns: Owns | None = None,
    announce: Callable[[Sequence[int]], object] | None = None,
) -> BulkResult:
    """Apply ``action`` to each message ``found`` selects, once they are still ``expected``
    (the ids the operator confirmed, oldest first); ``data`` holds the note every audit entry
    gets."""
    ids = matching(engine, found, action, owns)
    if ids != list(expected):
        raise InvalidMessage(
            "expected",
            f"{len(ids)} messages match now, not the {len(expected)} confirmed"
            + (" (others)" if len(ids) == len(expected) else "")
            + ": look at them again",
        )
    operations.check_command(data, key)  # a missing note refuses it before the first one
    result = BulkResult(action)
    for msg_id in ids:
        try:
            if action is Action.REDRIVE:
                operations.redrive(engine, msg_id, data, enqueue, key=key, owns=owns)
            else:
                operations.cancel(
                    engine, msg_id, data, enqueue, key=key, owns=owns, announce=announce
                )
        except (OperationRefused, MessageNotFound) as exc:
            result.refused[msg_id] = str(exc)
            continue
        result.done.append(msg_id)
    return result
