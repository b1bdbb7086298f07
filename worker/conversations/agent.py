"""Waking conversations and the awaited agent (the seed's Awaited Messages Agent).

A drain that must wait (a retry's backoff, an ACK deadline, an expiring head request) leaves
a wake-up time in its shard's ``scheduled`` due set (where an operator's scheduled removal of a
response waits too: removal.py); :func:`wakes` is every shard's set as one
source of due work, handed to the ticker. The awaited agent takes up responses whose attempts
ran out (AWAITED), or whose sender died, from each shard's ``pendingMessages``, and expires
those past AWAITED_MESSAGE_TTL.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from orderly.models.keys import ShardKeys
from orderly.worker import lua
from orderly.worker.conversations import reconcile, removal
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.drains import wake
from orderly.worker.conversations.model import ERROR_EXPIRED, AgentReport, Enqueue
from orderly.worker.core.clients import any_exist
from orderly.worker.core.due import RedisDueSet, ShardedDueSets
from orderly.worker.core.errors import NotFound
from orderly.worker.core.lease import ORPHAN_GRACE_S
from orderly.worker.core.owners import Owns
from orderly.worker.core.scripts import as_text
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)


def wakes(ctx: Context, enqueue: Enqueue) -> ShardedDueSets:
    """The conversations whose wait has run out, as due work: each one is woken. One due set
    per shard (its ``scheduled`` and ``scheduled:leased``), walked as one source."""

    def hand_off(members: list[str]) -> None:
        for member in members:
            # A removal an operator scheduled (removal.py) runs here, then its conversation
            # is woken too: its next response may go now.
            if removal.is_removal(member) and not removal.remove_due(ctx, member):
                continue
            wake(ctx, removal.conversation_of(member), enqueue)

    sets = [
        RedisDueSet(
            f"conversation-wakes:{shard.number}",
            ctx.scripts,
            shard.scheduled,
            shard.scheduled_leased,
            hand_off,
            clock=ctx.clock,
        )
        for shard in ctx.keys.every_shard
    ]

    def shard_of(member: str) -> int:
        return ctx.keys.shard(removal.conversation_of(member)).number

    every_key = [
        k for shard in ctx.keys.every_shard for k in (shard.scheduled, shard.scheduled_leased)
    ]
    return ShardedDueSets(
        "conversation-wakes",
        sets,
        shard_of,
        hand_off,
        batch=100,
        occupied=lambda: any_exist(ctx.redis, every_key),
    )


def release_dead_drains(ctx: Context) -> int:
    """Drains whose worker died, found by the PostgreSQL connection each holds: their leases
    are freed and their conversations woken at once (the head in flight is claimed again and
    its death counted). Entries of drains that ended by raising are dropped once their lease
    has run out. Every shard's running drains are looked at (one pipelined read). Returns how
    many drains were released."""
    k = ctx.keys
    if any_exist(ctx.redis, [shard.drains for shard in k.every_shard]) is False:
        return 0  # no drain runs: one command, not one a shard
    pipe = ctx.redis.pipeline(transaction=False)
    for shard in k.every_shard:
        pipe.hgetall(shard.drains)
    running = {as_text(c): as_text(v) for found in pipe.execute() for c, v in found.items()}
    if not running:
        return 0
    holders: dict[str, tuple[int, int]] = {}
    for cid, entry in running.items():
        fields = entry.split("|")
        holders[cid] = (int(fields[0]), int(fields[2]))
    with ctx.engine.connect() as conn:
        gone = {
            row.pid: row.server_started_ms
            for row in conn.execute(
                sql("drain_holders_gone"), {"pids": sorted({p for p, _ in holders.values()})}
            )
        }
    now = ctx.now_ms()
    released = 0
    for cid, (pid, claimed_ms) in holders.items():
        if pid in gone and claimed_ms <= now - ORPHAN_GRACE_S * 1000:
            died = "1" if claimed_ms >= gone[pid] else "0"
        elif pid not in gone and claimed_ms <= now - ctx.inflight_ms:
            died = "forget"  # a drain that ended by raising, its lease run out since
        else:
            continue
        shard = k.shard(cid)
        released += lua.drain_release(
            ctx.scripts,
            drains=shard.drains,
            drain_lease=k.drain_lease(cid),
            scheduled=shard.scheduled,
            response_order=k.response_list(cid),
            conversation_id=cid,
            entry=running[cid],
            now_ms=now,
            died=died,
            response_prefix=shard.response_prefix,
            message_ttl_ms=ctx.settings.message_ttl,
        )
    return released


def describe(ctx: Context, conversation_id: str, owns: Owns | None = None) -> dict[str, Any]:
    """What Redis holds for a conversation now: its requests and responses in order.
    ``owns``: the caller's objects; a conversation whose requests are of another origin (or
    that holds none) is not found."""
    k = ctx.keys
    requests = []
    for key in ctx.redis.lrange(k.request_list(conversation_id), 0, -1):
        fields = ctx.redis.hgetall(key)
        requests.append(
            {as_text(f): as_text(v) for f, v in fields.items()} or {"key": as_text(key)}
        )
    if owns is not None and not (
        requests and all(r.get("origin") in owns.origins for r in requests)
    ):
        raise NotFound("conversation", conversation_id)
    responses = []
    for member in ctx.redis.zrange(k.response_list(conversation_id), 0, -1):
        info = json.loads(as_text(member))
        fields = ctx.redis.hgetall(k.response(conversation_id, info["rsId"]))
        view = {as_text(f): as_text(v) for f, v in fields.items() if f != b"taskItem"}
        responses.append(view or {"responseId": info["rsId"], "status": "GONE"})
    return {
        "conversation_id": conversation_id,
        "requests": requests,
        "responses": responses,
        "draining": bool(ctx.redis.exists(k.drain_lease(conversation_id))),
    }


def partial_metrics(ctx: Context) -> dict[str, int]:
    """The queue's figures now, summed over the shards (AURA_LOGGING_EXTRA_TIME_METRICS logs
    them periodically)."""
    pipe = ctx.redis.pipeline(transaction=False)
    now = ctx.now_ms()
    for shard in ctx.keys.every_shard:
        pipe.zcard(shard.pending_messages)
        pipe.zcount(shard.pending_messages, "-inf", now)
        pipe.zcard(shard.scheduled)
    found = [int(n) for n in pipe.execute()]
    return {
        "pending_messages": sum(found[0::3]),
        "awaited_due": sum(found[1::3]),
        "scheduled": sum(found[2::3]),
    }


def awaited_turn(ctx: Context, enqueue: Enqueue) -> AgentReport:
    """The awaited agent's turn: re-queue due AWAITED and stuck messages, expire old ones.

    The turn walks every shard's pendingMessages with one budget (AWAITED_MESSAGES_BY_TURN),
    starting one shard further each turn."""
    report = AgentReport()
    shards = ctx.keys.every_shard
    start, ctx.awaited_from = ctx.awaited_from, (ctx.awaited_from + 1) % len(shards)
    budget = ctx.settings.awaited_messages_by_turn
    if any_exist(ctx.redis, [shard.pending_messages for shard in shards]) is False:
        budget = 0  # nothing waits in any shard: one command, not one a shard
    for n in range(len(shards)):
        if report.taken >= budget:
            break
        shard = shards[(start + n) % len(shards)]
        _awaited_shard(ctx, shard, budget - report.taken, enqueue, report)
    ttl_s = ctx.settings.awaited_message_ttl / 1000
    with ctx.pg() as conn:
        conn.run("conv_expire_responses", ttl_s)
        report.swept = conn.rowcount()
        conn.run("conv_close_requests", ttl_s)
    return report


def _ran_out(
    ctx: Context, shard: ShardKeys, vanished: list[tuple[str, str]], enqueue: Enqueue
) -> list[str]:
    """Of the responses whose hash was gone, those whose life ran out: PostgreSQL is asked
    (reconcile.repair); an evicted one has its conversation rebuilt and woken instead."""
    by_conversation: dict[str, list[str]] = {}
    for rid, cid in vanished:
        by_conversation.setdefault(cid, []).append(shard.response(rid))
    out = []
    for cid, keys in by_conversation.items():
        live = reconcile.repair(ctx, cid, keys, enqueue=enqueue)
        out += [key[len(shard.response_prefix) :] for key in keys if key not in live]
    return out


def _awaited_shard(
    ctx: Context, shard: ShardKeys, budget: int, enqueue: Enqueue, report: AgentReport
) -> None:
    """One shard's part of the awaited agent's turn (awaited.lua on its pendingMessages)."""
    k = ctx.keys
    taken = lua.awaited(
        ctx.scripts,
        pending_messages=shard.pending_messages,
        now_ms=ctx.now_ms(),
        limit=budget,
        response_prefix=shard.response_prefix,
        awaited_step_ms=ctx.awaited_step_ms,
    )
    report.taken += taken.taken
    vanished = _ran_out(ctx, shard, taken.vanished, enqueue)
    expired = taken.expired
    if vanished:
        with ctx.pg() as conn:
            conn.run(
                "conv_failed_by_response",
                vanished,
                ERROR_EXPIRED,
                "AWAITED_MESSAGE_TTL spent before delivery",
            )
        report.vanished += len(vanished)
    for member, cid, status in expired:
        rid = json.loads(member)["rsId"]
        done = lua.expire(
            ctx.scripts,
            response=shard.response(rid),
            response_order=k.response_list(cid),
            pending_messages=shard.pending_messages,
            request_list=k.request_list(cid),
            request_seq=k.request_seq(cid),
            member=member,
            request_prefix=shard.request_prefix,
            async_prefix=shard.async_prefix,
        )
        ids = done.msg_ids if done is not None else []
        if ids and status == "SENT":
            # The client took it (202); only its ACK never came.
            with ctx.pg() as conn:
                conn.run("conv_ok", ids, "delivered: no ACK within AWAITED_MESSAGE_TTL")
        elif ids:
            with ctx.pg() as conn:
                conn.run(
                    "conv_failed", ids, ERROR_EXPIRED, "AWAITED_MESSAGE_TTL spent before delivery"
                )
        report.expired += 1
    for cid in taken.wake:
        if wake(ctx, cid, enqueue):
            report.woken.append(cid)
