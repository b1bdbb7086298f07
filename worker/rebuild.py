"""Rebuild from PostgreSQL: what Redis held, made again from the rows after Redis lost it.

PostgreSQL is the durable truth; Redis holds the conversations' order and waits, the broker's
tasks, tracking and due sets. A marker in every shard of the conversation keys
(``<prefix>:{bq:<count>:<n>}:epoch``: a generation, a state and the ``run_id`` of the server
holding it) says whether Redis still holds what orderly put there: missing (a FLUSHALL, a
restart without persistence, a key layout with another shard count, or the layout of an
orderly before shards), not "ready" (a rebuild that did not finish), or written under another
server run (a restart: with RDB the last changes may be gone), Redis is rebuilt. One marker per
shard, so that on a Redis Cluster the loss of one node is seen by the shards it held, and the
gate (advance.lua) reads its shard's marker in its own slot. :func:`check` costs two round
trips (the markers, then one INFO per server); beat's agents run it every tick.

:func:`rebuild` holds a PostgreSQL advisory lock (one rebuilder across beats and operators),
checks again under it, marks every shard "rebuilding" under a new generation, removes the keys
under the prefix that belong to another key layout (an older orderly's, another shard
count's: what they held is rebuilt from the rows in this one), then:

1. conversations (``orderly.worker.conversations.rebuild``): requests waiting, responses not yet
   delivered, their order, attempts, AWAITED and ACK waits (a delivered response is OK in its
   row: final, never rebuilt, never sent again); while the marker says "rebuilding" no drain
   claims a response, and once it says "ready" a drain is started for every conversation
   with something to deliver;
2. the store's queued messages (NEW, IN_QUEUE): the wake-up of a worker went with the broker;
   one is woken again, and its claims take them in line (priority, then place in line: funnels
   take turns), as any due message (worker.messages.batches). A task per message would run
   them in msg_id order instead, one funnel's backlog before the next one's;
3. push deliveries the broker had (due, leased): due again now;

and marks each shard "ready" if its marker still holds the generation. Left to what already
recovers them: tracking of messages in flight (Redis-only figures; a worker that dies is
released by beat's orphan job through its backend pid, a hung one after
repairRepeatTimeSec), service keys
(each worker restores its own on its next renewal), confirmations (due again when their 60 s
lease ends: taking one back early could POST a try twice), and timed-out messages waiting
for a retry (their due time is on their rows: beat's due ticker makes them claimable).

A send in flight at the moment of the loss may be sent once more (with the same
Idempotency-Key): its row is recorded after the POST, and the rebuild may read the row first.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Engine

from orderly.models.keys import SHARD_TAG
from orderly.worker import lua
from orderly.worker.conversations import Conversations
from orderly.worker.conversations import rebuild as conversations_rebuild
from orderly.worker.conversations.drains import wake
from orderly.worker.core.clients import run_ids
from orderly.worker.core.lease import new_token
from orderly.worker.core.scripts import as_text
from orderly.worker.db.queries import sql
from orderly.worker.totals import REDIS_REBUILDS, TALLY

log = logging.getLogger(__name__)

PAGE = 1000
# The one marker of the layout before shards: removed with that layout's keys.
UNSHARDED_EPOCH_KEY = "orderly:epoch"
# What follows the prefix in a conversation key of any layout: a shard's tag, a request's,
# response's or ACK's key, a conversation's own (its id has no ':') or a shared set of the
# layout before shards. Nothing else under the prefix is touched.
_CONVERSATION_KEY = re.compile(
    rf"^(\{{{SHARD_TAG}:\d+:\d+\}}:.*|(req|res|asyncRequest):.+"
    r"|[A-Za-z0-9._~@+=-]+(:(req|seq|lease|leased))?)$"
)


@dataclass
class RebuildReport:
    reason: str = ""  # why Redis counted as lost ('' = it did not)
    done: bool = False  # False: not needed, or another rebuilder holds the lock
    busy: bool = False  # another rebuilder holds the lock
    generation: str = ""
    conversations: int = 0
    keys_created: int = 0
    other_layout_keys_removed: int = 0
    drains_started: list[str] = field(default_factory=list)
    messages_queued: int = 0
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
            f"{self.other_layout_keys_removed} keys of another layout removed, "
            f"{self.messages_queued} queued messages (a worker woken), "
            f"{self.deliveries_due} push deliveries due again"
        )


def server_run_id(conversations: Conversations) -> str:
    """The run_id of the server holding the first shard's marker."""
    return run_ids(conversations.ctx.redis, [conversations.keys.every_shard[0].epoch])[0]


def check(conversations: Conversations) -> str:
    """Why Redis lost (some of) its state, or '' when it did not: every shard's marker."""
    client = conversations.ctx.redis
    markers = [shard.epoch for shard in conversations.keys.every_shard]
    pipe = client.pipeline(transaction=False)
    for key in markers:
        pipe.hmget(key, "state", "run_id")
    found = pipe.execute()
    for state, _ in found:
        if state is None:
            return "the marker is missing"
    for state, _ in found:
        if as_text(state) != "ready":
            return "a rebuild did not finish"
    for (_, run_id), current in zip(found, run_ids(client, markers), strict=True):
        if run_id is None or as_text(run_id) != current:
            return f"the server restarted (run {as_text(run_id or b'')[:8]} -> {current[:8]})"
    return ""


def rebuild_if_lost(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    wake_processing: Callable[[], object],
) -> RebuildReport | None:
    """Beat's check every tick: one Redis round trip, a rebuild only when Redis lost state."""
    if not check(conversations):
        return None
    return rebuild(engine, conversations, enqueue_drain, wake_processing)


def rebuild(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    wake_processing: Callable[[], object],
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
            _rebuild(engine, conversations, enqueue_drain, wake_processing, report)
        finally:
            lock.execute(sql("rebuild_unlock"))
            lock.commit()
    log.warning("Redis %s", report.summary())
    if report.done:
        TALLY.add(REDIS_REBUILDS, report.reason.split(" (")[0])
    return report


# Why a rebuild ran (check's reasons, without their details; or forced by an operator; or
# conversations whose keys were gone under a live marker, rebuilt by beat's sweep).
KEYS_MISSING = "keys missing"
REASONS = (
    "the marker is missing",
    "a rebuild did not finish",
    "the server restarted",
    "forced",
    KEYS_MISSING,
)


def count_repair() -> None:
    """A sweep rebuilt conversations whose keys were gone (worker.conversations.reconcile)."""
    TALLY.add(REDIS_REBUILDS, KEYS_MISSING)


def count_from_zero() -> None:
    """Every reason's rebuild series, at 0 until the first: an alert on its increase sees the
    first rebuild of each (but one in the very first flush, as a fresh Redis's)."""
    for reason in REASONS:
        TALLY.add(REDIS_REBUILDS, reason, amount=0)


def _rebuild(
    engine: Engine,
    conversations: Conversations,
    enqueue_drain: Callable[[str, str], None],
    wake_processing: Callable[[], object],
    report: RebuildReport,
) -> None:
    ctx = conversations.ctx
    report.generation = new_token()
    markers = [shard.epoch for shard in ctx.keys.every_shard]
    runs = run_ids(ctx.redis, markers)
    pipe = ctx.redis.pipeline(transaction=False)
    for key, run_id in zip(markers, runs, strict=True):
        pipe.hset(
            key, mapping={"generation": report.generation, "state": "rebuilding", "run_id": run_id}
        )
    pipe.execute()
    report.other_layout_keys_removed = remove_other_layouts(conversations)
    # 1. Conversations first: a response accepted meanwhile joins the order rebuilt.
    rebuilt = conversations_rebuild.rebuild(ctx, conversations_rebuild.read_rows(engine))
    report.conversations = rebuilt.conversations
    report.keys_created = rebuilt.keys_created
    # 2. The store's queued messages: a worker's claims take them in line.
    with engine.connect() as conn:
        report.messages_queued = int(conn.execute(sql("rebuild_queued_messages")).scalar_one())
    if report.messages_queued:
        wake_processing()
    # 3. Push deliveries that were on the broker.
    with engine.begin() as conn:
        report.deliveries_due = len(conn.execute(sql("rebuild_deliveries_due")).all())
    report.marked_ready = all(
        [
            lua.epoch_ready(ctx.scripts, marker=key, generation=report.generation, run_id=run_id)
            for key, run_id in zip(markers, runs, strict=True)
        ]
    )
    # Drains start once Redis is whole: until then a drain claims nothing (advance.lua:
    # REBUILDING), so a response accepted meanwhile cannot overtake older ones.
    for cid in rebuilt.to_deliver:
        if wake(ctx, cid, enqueue_drain):
            report.drains_started.append(cid)
    report.done = True


def remove_other_layouts(conversations: Conversations) -> int:
    """Remove the keys under the conversation prefix that are not of this key layout (an
    orderly before shards, another shard count), and the unsharded marker. Their content is
    rebuilt from PostgreSQL in this layout; left alone, their waits would still wake and
    expire conversations. Returns how many keys went."""
    client = conversations.ctx.redis
    keys = conversations.keys
    removed = 0
    batch: list[str] = []
    start = len(keys.prefix) + 1
    for raw in client.scan_iter(match=f"{keys.prefix}:*", count=1000):
        key = as_text(raw)
        if not key.startswith(keys.layout) and _CONVERSATION_KEY.match(key[start:]):
            batch.append(key)
        if len(batch) >= PAGE:
            removed += int(client.delete(*batch))
            batch = []
    if batch:
        removed += int(client.delete(*batch))
    return removed + int(client.delete(UNSHARDED_EPOCH_KEY))
