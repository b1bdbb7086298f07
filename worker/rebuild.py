"""Rebuild from PostgreSQL: what Redis held, made again from the rows after Redis lost it.

PostgreSQL is the durable truth; Redis holds the conversations' order and waits, the broker's
tasks, tracking and due sets. A marker in Redis (``orderly:epoch``: a generation, a state and
the server's ``run_id``) says whether Redis still holds what orderly put there: missing (a
FLUSHALL, a restart without persistence), not "ready" (a rebuild that did not finish), or
written under another server run (a restart: with RDB the last changes may be gone), Redis
is rebuilt. :func:`check` costs one round trip; beat's agents run it every tick.

:func:`rebuild` holds a PostgreSQL advisory lock (one rebuilder across beats and operators),
checks again under it, marks Redis "rebuilding" under a new generation, then:

1. conversations (``worker.conversations.rebuild``): requests waiting, responses not yet
   delivered, their order, attempts, AWAITED and ACK waits (a delivered response is OK in its
   row: final, never rebuilt, never sent again); while the marker says "rebuilding" no drain
   claims a response, and once it says "ready" a drain is started for every conversation
   with something to deliver;
2. the store's queued messages (NEW, IN_QUEUE): their tasks went with the broker; they are
   sent again at once (the claim takes a row only once, so a task that survived is harmless);
3. push deliveries the broker had (due, leased): due again now;

and marks Redis "ready" if the marker still holds its generation. Left to what already
recovers them: tracking of messages in flight (Redis-only figures; a worker that dies is
released by beat's orphan job through its backend pid, a hung one after
repairRepeatTimeSec), service keys
(each worker restores its own on its next renewal), confirmations (due again when their 60 s
lease ends: taking one back early could POST a try twice), and timed-out messages waiting
for a retry (IN_QUEUE: sent again at once with the queued messages).

A send in flight at the moment of the loss may be sent once more (with the same
Idempotency-Key): its row is recorded after the POST, and the rebuild may read the row first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine

from models.keys import EPOCH_KEY
from worker.conversations import Conversations
from worker.conversations import rebuild as conversations_rebuild
from worker.conversations.agent import wake
from worker.core.lease import new_token
from worker.core.scripts import as_text
from worker.store.queries import sql

log = logging.getLogger(__name__)

PAGE = 1000


@dataclass
class RebuildReport:
    reason: str = ""  # why Redis counted as lost ('' = it did not)
    done: bool = False  # False: not needed, or another rebuilder holds the lock
    busy: bool = False  # another rebuilder holds the lock
    generation: str = ""
    conversations: int = 0
    keys_created: int = 0
    drains_started: list[str] = field(default_factory=list)
    messages_requeued: int = 0
    deliveries_due: int = 0
    marked_ready: bool = False

    def summary(self) -> str:
        if self.busy:
            return "another rebuild is running"
        if not self.done:
            return "Redis holds its state: nothing to rebuild"
        return (
            f"rebuilt ({self.reason}): {self.conversations} conversations "
            f"({self.keys_created} keys), {len(self.drains_started)} drains started, "
            f"{self.messages_requeued} queued messages sent again, "
            f"{self.deliveries_due} push deliveries due again"
        )


def server_run_id(conversations: Conversations) -> str:
    return str(conversations.ctx.redis.info("server")["run_id"])


def check(conversations: Conversations) -> str:
    """Why Redis lost (some of) its state, or '' when it did not. One round trip."""
    pipe = conversations.ctx.redis.pipeline(transaction=False)
    pipe.hmget(EPOCH_KEY, "state", "run_id")
    pipe.info("server")
    (state, run_id), info = pipe.execute()
    if state is None:
        return "the marker is missing"
    if as_text(state) != "ready":
        return "a rebuild did not finish"
    current = str(info["run_id"])
    if run_id is None or as_text(run_id) != current:
        return f"the server restarted (run {as_text(run_id or b'')[:8]} -> {current[:8]})"
    return ""


def rebuild_if_lost(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    enqueue_processing_many: Callable[[list[int]], None],
) -> RebuildReport | None:
    """Beat's check every tick: one Redis round trip, a rebuild only when Redis lost state."""
    if not check(conversations):
        return None
    return rebuild(engine, conversations, enqueue_drain, enqueue_processing_many)


def rebuild(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    enqueue_processing_many: Callable[[list[int]], None],
    *,
    force: bool = False,
) -> RebuildReport:
    """Rebuild if Redis lost its state (or ``force``); one rebuilder at a time."""
    report = RebuildReport()
    with engine.connect() as lock:
        if not lock.execute(sql("rebuild_lock")).scalar_one():
            report.busy = True
            return report
        lock.commit()
        try:
            report.reason = check(conversations) or ("forced" if force else "")
            if not report.reason:
                return report
            _rebuild(engine, conversations, enqueue_drain, enqueue_processing_many, report)
        finally:
            lock.execute(sql("rebuild_unlock"))
            lock.commit()
    log.warning("Redis %s", report.summary())
    return report


def _rebuild(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    enqueue_processing_many: Callable[[list[int]], None],
    report: RebuildReport,
) -> None:
    ctx = conversations.ctx
    report.generation = new_token()
    run_id = server_run_id(conversations)
    ctx.redis.hset(
        EPOCH_KEY,
        mapping={"generation": report.generation, "state": "rebuilding", "run_id": run_id},
    )
    # 1. Conversations first: a response accepted meanwhile joins the order rebuilt.
    with engine.connect() as conn:
        rows = conn.execute(sql("rebuild_conversation_rows")).all()
    rebuilt = conversations_rebuild.rebuild(ctx, rows)
    report.conversations = rebuilt.conversations
    report.keys_created = rebuilt.keys_created
    # 2. The store's queued messages, page by page.
    after = 0
    while True:
        with engine.connect() as conn:
            ids = [
                int(r[0])
                for r in conn.execute(
                    sql("rebuild_queued_messages"), {"after": after, "limit": PAGE}
                )
            ]
        if not ids:
            break
        enqueue_processing_many(ids)
        report.messages_requeued += len(ids)
        after = ids[-1]
    # 3. Push deliveries that were on the broker.
    with engine.begin() as conn:
        report.deliveries_due = len(conn.execute(sql("rebuild_deliveries_due")).all())
    report.marked_ready = bool(
        ctx.scripts.run("epoch_ready", [EPOCH_KEY], [report.generation, run_id])
    )
    # Drains start once Redis is whole: until then a drain claims nothing (advance.lua:
    # REBUILDING), so a response accepted meanwhile cannot overtake older ones.
    for cid in rebuilt.to_deliver:
        if wake(ctx, cid, enqueue_drain):
            report.drains_started.append(cid)
    report.done = True
