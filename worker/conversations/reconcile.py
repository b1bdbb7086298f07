"""Partial loss: conversations whose rows are open in PostgreSQL but whose keys Redis lost.

The markers (worker/rebuild.py) see a whole Redis lost: a FLUSHALL, a restart without its
data. They do not see single keys gone under a live marker: evicted by a Redis whose
``maxmemory-policy`` may evict keys with a TTL (every conversation key has one), deleted by
hand. Such a conversation stalls: nothing wakes it, nothing delivers its responses.

The sweep walks the conversations with open rows a page at a time (the rows the rebuild
reads) and asks Redis whether what those rows stand for is there: each request hash whose
MESSAGE_TTL has not run out, each response hash and its entry in its shard's pendingMessages
(what wakes it) and in the conversation's order, each live request in the conversation's
request list, its counter. A conversation missing
any is suspect; found so again at the next sweep with the same rows (a key that is only
between its row and its script, or a response delivered whose row is being written, is not:
the next sweep finds it whole, or its row closed), it is rebuilt from its rows exactly as
after a FLUSHALL (rebuild_conversation.lua creates what is missing, keeps what exists) and a
drain is started for it. A sweep costs one query a page and one pipelined round trip; with
no open conversation, one query and nothing in Redis.

A key gone is ambiguous where it is met, too: its life ran out, or it was evicted. A script
that would act on it (the gate skipping a head, intake taking a response for a callback or
numbering a request anew, the awaited agent failing a response) answers MISSING instead, and
:func:`repair` lets the conversation's rows decide before the script runs again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from orderly.worker.conversations import rebuild
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.drains import wake
from orderly.worker.conversations.model import Enqueue
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)

# Conversations a page of the sweep reads.
PAGE = 500
# A key this close to the end of its life in Redis may be gone by its TTL: not looked for.
MARGIN_MS = 5_000
# A repair takes a key this close to its end as run out (the process's and PostgreSQL's
# clocks may differ by this much).
REPAIR_MARGIN_MS = 1_000

# What is looked for in Redis: a key that exists, or a member of a sorted set.
Look = tuple[str, str, str]


@dataclass
class SweepReport:
    conversations: int = 0  # looked at
    suspect: list[str] = field(default_factory=list)  # keys missing, first seen
    repaired: list[str] = field(default_factory=list)  # rebuilt from their rows
    keys_created: int = 0
    drains_started: int = 0


def _fingerprint(rows: Sequence[Any]) -> tuple[tuple[Any, ...], ...]:
    """What a conversation's rows are: a suspect is repaired only if they have not changed."""
    return tuple((r.msg_id, r.state, r.failed_count, r.custom_data) for r in rows)


def _expected(
    ctx: Context,
    cid: str,
    rows: Sequence[Any],
    now: int,
    offset: int = 0,
    margin: int = MARGIN_MS,
) -> list[Look]:
    """What a conversation's open rows stand for in Redis (as a rebuild would make them), of
    more than ``margin`` ms of life: keys that exist, a live request in the conversation's
    request list, a response in its order and in its shard's pendingMessages (what wakes
    it). ``offset``: as :func:`rebuild.groups`'."""
    k = ctx.keys
    shard = k.shard(cid)
    found: list[Look] = []
    groups = rebuild.groups(ctx, rows, now, offset)
    requests = [g for g in groups if g.request is not None and g.ttl > margin]
    responses = [r for g in groups for r in g.responses if r["ttl"] > margin]
    if requests or responses:
        # the request counter outlives everything it numbered (register_request.lua)
        found.append(("exists", k.request_seq(cid), ""))
    if requests:
        found.append(("exists", k.request_list(cid), ""))
    for g in requests:
        key = shard.request_prefix + g.request_id
        found += [("exists", key, ""), ("lpos", k.request_list(cid), key)]
    if responses:
        found.append(("exists", k.response_list(cid), ""))
    for r in responses:
        found.append(("exists", shard.response_prefix + r["responseId"], ""))
        found.append(("zscore", shard.pending_messages, r["member"]))
        found.append(("zscore", k.response_list(cid), r["member"]))
    return found


class Sweeper:
    """The sweep of one beat: what it found suspect last time, and where its walk is."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._suspects: dict[str, tuple[tuple[Any, ...], ...]] = {}

    def sweep(self, read: Callable[[str, int], Sequence[Any]], enqueue: Enqueue) -> SweepReport:
        """Every conversation with open rows, ``read(after, page)`` giving a page of their rows
        (the rebuild's, ordered by conversation, then msg_id)."""
        report = SweepReport()
        suspects: dict[str, tuple[tuple[Any, ...], ...]] = {}
        after = ""
        while True:
            rows = read(after, PAGE)
            if not rows:
                break
            by_conversation: dict[str, list[Any]] = {}
            for row in rows:
                by_conversation.setdefault(row.process_id, []).append(row)
            report.conversations += len(by_conversation)
            for cid in self._missing(by_conversation):
                own = by_conversation[cid]
                if self._suspects.get(cid) == _fingerprint(own):
                    self._repair(cid, own, enqueue, report)
                else:
                    suspects[cid] = _fingerprint(own)
                    report.suspect.append(cid)
            if len(by_conversation) < PAGE:
                break
            after = max(by_conversation)
        self._suspects = suspects
        return report

    def _missing(self, by_conversation: dict[str, list[Any]]) -> list[str]:
        """The conversations some of whose keys are gone (one pipelined round trip)."""
        ctx = self._ctx
        now = ctx.now_ms()
        expected = {cid: _expected(ctx, cid, own, now) for cid, own in by_conversation.items()}
        pipe = ctx.redis.pipeline(transaction=False)
        for looks in expected.values():
            for how, key, member in looks:
                if how == "exists":
                    pipe.exists(key)
                elif how == "lpos":
                    pipe.lpos(key, member)
                else:
                    pipe.zscore(key, member)
        found = iter(pipe.execute())
        missing = []
        for cid, looks in expected.items():
            # every answer taken (the iterator goes on to the next conversation's)
            answers = [next(found) for _ in looks]
            # EXISTS answers a count; LPOS and ZSCORE None when absent (LPOS 0: the head)
            there = (
                a != 0 if how == "exists" else a is not None
                for (how, _, _), a in zip(looks, answers, strict=True)
            )
            if not all(there):
                missing.append(cid)
        return missing

    def _repair(self, cid: str, rows: Sequence[Any], enqueue: Enqueue, report: SweepReport) -> None:
        # Read again under the conversation's lock, rebuilt in its transaction: rows an ACK, a
        # deletion or a delivery closed since the page was read are not brought back.
        with self._ctx.engine.begin() as conn:
            conn.execute(sql("rebuild_conversation_lock"), {"conversation": cid})
            rows = rebuild.read_rows(conn, only=cid)
            if _fingerprint(rows) != self._suspects.get(cid):
                return  # changed: looked at again by the next sweep
            rebuilt = rebuild.rebuild(self._ctx, rows)
        report.repaired.append(cid)
        report.keys_created += rebuilt.keys_created
        log.warning(
            "conversation %s: %d of its keys were gone from Redis under a live marker "
            "(evicted, or deleted): rebuilt from PostgreSQL",
            cid,
            rebuilt.keys_created,
        )
        if rebuilt.to_deliver and wake(self._ctx, cid, enqueue):
            report.drains_started += 1


def repair(
    ctx: Context,
    cid: str,
    missing: Collection[str],
    without: Collection[int] = (),
    enqueue: Enqueue | None = None,
) -> set[str]:
    """A script of intake or of the gate found keys of conversation ``cid`` missing that it
    may not take as run out (its answer MISSING, nothing written): evicted, deleted by hand,
    or their lives over after all. PostgreSQL decides, under the conversation's lock: if its
    rows say any of ``missing`` should be in Redis now (by the injected clock, more than
    REPAIR_MARGIN_MS before its end), the conversation is rebuilt from them
    (rebuild_conversation.lua: what is missing is created, what exists is kept). The
    caller's script then runs again, told to take what is still missing as run out.
    ``without``: rows whose own script runs again after (a request or response being taken
    in), left out of the rebuild; ``enqueue``: a drain is started for what the rebuild made
    deliverable (None: the caller's drain holds the conversation). Returns those of
    ``missing`` PostgreSQL says should be there (rebuilt; none: the rest ran out)."""
    with ctx.engine.begin() as conn:
        # Under the conversation's lock: a Redis step that settles a response before its
        # record (Context.locked) is not between the two while the rows are read.
        conn.execute(sql("rebuild_conversation_lock"), {"conversation": cid})
        found = rebuild.read_rows(conn, only=cid, without=without)
        offset = rebuild.offset_ms(ctx, found)
        expected = _expected(ctx, cid, found, ctx.now_ms(), offset, REPAIR_MARGIN_MS)
        live = {key for how, key, _ in expected if how == "exists"} & set(missing)
        if not live:
            return live
        rebuilt = rebuild.rebuild(ctx, found, offset)
    log.warning(
        "conversation %s: %s gone from Redis while PostgreSQL has it open (evicted, or "
        "deleted): %d keys rebuilt from PostgreSQL",
        cid,
        ", ".join(sorted(missing)),
        rebuilt.keys_created,
    )
    if enqueue is not None and rebuilt.to_deliver:
        wake(ctx, cid, enqueue)
    return live


def page_reader(engine: Engine) -> Callable[[str, int], Sequence[Any]]:
    """``read`` for :meth:`Sweeper.sweep`: a page of the rebuild's rows from ``engine``."""

    def read(after: str, page: int) -> Sequence[Any]:
        return rebuild.read_rows(engine, after=after, page=page)

    return read
