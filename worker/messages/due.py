"""Messages that wait for a time, as due work of beat's ticker (worker.core.due).

One route back for every message that waits: a NEW message scheduled for later
(``delay_ms``, ``not_before``), a PARTLY_FAILED one until its retry (``delay *
multiplier^attempt``, the handler's :class:`~orderly.worker.messages.handlers.Retry` or the
configuration table's), a POSTPONED one until it is looked at again, a timed-out one until
its retry (worker.messages.timeouts). Each holds its due time on its row (``message.due_at``);
when it comes, the take makes the message claimable (IN_QUEUE or NEW without a due time) and the
hand-off wakes a worker, whose batch claim takes it up (worker.messages.batches). Nothing waits in
worker memory, in the broker or in Redis. A wake-up that fails makes them due again at once
(the ticker tries again); one that is lost afterwards is covered by beat's wake-up of
messages due for over a second.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Engine

from orderly.worker.core.due import PgDueIndex


def due_messages(engine: Engine, wake: Callable[[], object], postponed_s: int) -> PgDueIndex:
    """The waiting messages as a due source: each batch that became due wakes one worker. A
    POSTPONED message its funnel still holds back is looked at again after ``postponed_s``
    (the take's lease)."""

    def hand_off(msg_ids: list[int]) -> None:
        if msg_ids:
            wake()

    return PgDueIndex(
        "messages",
        engine,
        take_query="messages_due_take",
        release_query="messages_due_release",
        next_query="messages_due_next",
        hand_off=hand_off,
        batch=1000,
        lease_ms=max(1, postponed_s) * 1000,
    )
