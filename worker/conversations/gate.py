"""The ordering gate and the sends: one drain at a time delivers a conversation's heads in order.

Each step is one call of advance.lua: it settles the previous send's outcome and validates
(and, holding the drain's lease, claims) the next head, so a successor leaves the moment its
predecessor is delivered or ACKed, without polling. PostgreSQL records each outcome.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from orderly.models.keys import ShardKeys
from orderly.worker import lua
from orderly.worker.channels import ACK_TOKEN_FORM, ACK_TOKEN_HEADER, Channel, ack_token_matches
from orderly.worker.conversations import reconcile
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.model import (
    ERROR_CANCELLED,
    ERROR_RETRIES_SPENT,
    ERROR_WORKER_LOST,
    MAX_ASYNC_ID,
    Delivery,
    DrainReport,
    Enqueue,
    Gate,
    Head,
    Sender,
    SendResult,
)
from orderly.worker.core import logs, tracing
from orderly.worker.core.errors import Unauthenticated, UnknownAck, UnknownChannel
from orderly.worker.core.lease import new_token
from orderly.worker.core.scripts import as_text
from orderly.worker.db.prepared import PreparedConnection
from orderly.worker.totals import CONVERSATION_RELEASE, CONVERSATION_SENDS, LATE_RESPONSES, TALLY

log = logging.getLogger(__name__)

# How long an ACK for an id not (yet) known, bringing the token of a response being sent,
# waits for that response's 202 to be recorded: ~130 ms.
ACK_GRACE_S = (0.001, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)


def _advance(
    ctx: Context,
    mode: str,
    conversation_id: str,
    token: str,
    outcome: tuple[str, str, str],
    check_response: str = "",
    holder_pid: int | None = None,
    gone: tuple[str, ...] = (),
) -> lua.Advanced:
    k = ctx.keys
    shard = k.shard(conversation_id)
    return lua.advance(
        ctx.scripts,
        request_list=k.request_list(conversation_id),
        response_order=k.response_list(conversation_id),
        pending_messages=shard.pending_messages,
        drain_lease=k.drain_lease(conversation_id),
        scheduled=shard.scheduled,
        request_seq=k.request_seq(conversation_id),
        drains=shard.drains,
        epoch=shard.epoch,
        mode=mode,
        lease_token=token,
        now_ms=ctx.now_ms(),
        lease_ms=ctx.lease_ms,
        inflight_ms=ctx.inflight_ms,
        sent_message_ttl_ms=ctx.settings.sent_message_ttl,
        request_prefix=shard.request_prefix,
        response_prefix=shard.response_prefix,
        async_prefix=shard.async_prefix,
        check_response_id=check_response,
        outcome=outcome[0],
        outcome_response_id=outcome[1],
        outcome_detail=outcome[2],
        message_ttl_ms=ctx.settings.message_ttl,
        awaited_time_when_retries_end_ms=ctx.settings.awaited_time_when_retries_end,
        awaited_step_ms=ctx.awaited_step_ms,
        conversation_id=conversation_id,
        holder_pid=holder_pid,
        gone=gone,
    )


def _looked_up(ctx: Context, conversation_id: str, step: lua.Advanced) -> tuple[str, ...]:
    """A head's key found MISSING: PostgreSQL decides whether it was evicted (the conversation
    rebuilt, the key back) or its life ran out (reconcile.repair); the next step takes it as
    run out if it is still missing."""
    missing = step.missing or ""
    reconcile.repair(ctx, conversation_id, [missing])
    return (missing,)


def can_send(ctx: Context, conversation_id: str, response_id: str) -> Gate:
    """canSendConversationMessage: may this response go out now, by the order alone?"""
    gone: tuple[str, ...] = ()
    while True:
        result = _advance(ctx, "check", conversation_id, "", ("", "", ""), response_id, None, gone)
        if result.code is not lua.AdvanceCode.MISSING:
            return Gate(result.code, result.first)
        gone = _looked_up(ctx, conversation_id, result)


def drain(ctx: Context, conversation_id: str, token: str, send: Sender) -> DrainReport:
    """Deliver the conversation's sendable heads, one after another, while holding its lease.

    Returns with ``end`` YIELD after ``ORDERLY_DRAIN_BATCH`` deliveries: the caller starts
    a new drain with the same token (the lease stays held).
    """
    report = DrainReport(conversation_id)
    # One connection for the whole drain: its outcomes go one after another.
    with ctx.pg() as conn:
        outcome: tuple[str, str, str] = ("", "", "")
        after: Callable[[], None] | None = None
        sends = 0
        gone: tuple[str, ...] = ()
        while True:
            mode = "yield" if sends >= ctx.settings.drain_batch else "claim"
            pid = conn.backend_pid
            step = _advance(ctx, mode, conversation_id, token, outcome, "", pid, gone)
            gone = ()
            if after is not None:
                after()
                after = None
            if step.ack_clash:
                log.warning(
                    "ACK id %r is already in use: the response waits out SENT_MESSAGE_TTL",
                    step.ack_clash,
                )
            _settled_by_timeout(conn, step, report)
            if step.code is lua.AdvanceCode.MISSING:
                # the previous outcome is settled; the lease is still held
                outcome, gone = ("", "", ""), _looked_up(ctx, conversation_id, step)
                continue
            if step.code is not lua.AdvanceCode.SEND:
                report.end = step.code
                return report
            h = step.head
            assert h is not None  # SEND always brings its head
            head = Head(
                conversation_id=h["conversationId"],
                origin=h["origin"],
                request_id=h["requestId"],
                response_id=h["responseId"],
                payload=json.loads(h["taskItem"]),
                msg_id=int(h["msgId"]),
                request_msg_id=int(h["requestMsgId"]),
                last=h["last"] == "1",
                attempt=int(h["attempt"]),
                awaited_retries=int(h["awaitedRetries"]),
                late_ms=int(h["lateMs"]) if h.get("lateMs") not in (None, "") else None,
                lost=int(h.get("lost", 0)),
                received_ms=int(h["receivedAt"]) if h.get("receivedAt") else None,
                trace_parent=h.get("tp") or None,
            )
            if head.awaited_retries:
                conn.run("conv_back_in_queue", head.msg_id)
            channel = ctx.channels.get(head.origin)
            with tracing.span(
                "deliver response",
                parent=head.trace_parent,
                attributes={
                    "orderly.conversation_id": conversation_id,
                    "orderly.msg_id": head.msg_id,
                },
            ):
                result = _send_or_quarantine(ctx, send, channel, head)
            sends += 1
            outcome, after = _apply(conn, channel, head, result, report, ctx.now_ms())


def _send_or_quarantine(ctx: Context, send: Sender, channel: Channel, head: Head) -> SendResult:
    """Send the head, unless its sends keep killing their worker: at ORDERLY_WORKER_LOST_LIMIT
    lost claims it is not tried again, its group is cancelled with E_WORKER_LOST and the
    conversation moves on, as after any fatal answer."""
    limit = ctx.settings.worker_lost_limit
    if head.lost >= limit:
        log.error("response %s: its worker died %d times sending it", head.response_id, head.lost)
        return SendResult(
            Delivery.FATAL,
            reason=f"quarantined: its worker died {head.lost} times while sending it",
            error_code=ERROR_WORKER_LOST,
        )
    try:
        return send(channel, head)
    except Exception as exc:  # a sender's bug must not leave the head in flight
        log.exception("sending response %s failed", head.response_id)
        return SendResult(Delivery.RECOVERABLE, reason=f"{type(exc).__name__}: {exc}")


def _apply(
    conn: PreparedConnection,
    channel: Channel,
    head: Head,
    result: SendResult,
    report: DrainReport,
    now_ms: int,
) -> tuple[tuple[str, str, str], Callable[[], None] | None]:
    """What PostgreSQL records now, and the outcome the next gate step settles in Redis.

    PostgreSQL goes first where the send is final (a crash in between resends, with the
    same Idempotency-Key, rather than losing); a 202 is recorded after Redis knows its
    ACK id, so that an ACK arriving at once finds it.
    """
    with logs.bound(
        conversation_id=head.conversation_id,
        request_id=head.request_id,
        response_id=head.response_id,
        status=result.status,
    ):
        recorded = _record(conn, channel, head, result, report, now_ms)
    outcome = recorded[0][0]
    TALLY.add(CONVERSATION_SENDS, head.origin, outcome)
    if outcome in ("delivered", "sent"):
        if head.received_ms is not None:
            waited_s = max(0, now_ms - head.received_ms) / 1000
            TALLY.observe(CONVERSATION_RELEASE, head.origin, seconds=waited_s)
        if head.late_ms is not None:
            TALLY.add(LATE_RESPONSES)
    return recorded


def _record(
    conn: PreparedConnection,
    channel: Channel,
    head: Head,
    result: SendResult,
    report: DrainReport,
    now_ms: int,
) -> tuple[tuple[str, str, str], Callable[[], None] | None]:
    rid = head.response_id
    # A late response's mark goes in the same transaction as its delivery's record.
    late = None if head.late_ms is None else ("conv_mark_late", (head.msg_id, head.late_ms))
    # A final outcome is recorded under the conversation's lock (Context.locked), settled in
    # Redis after: a repair reads the row before both, or after the record.
    lock = ("conv_lock_all", ([head.conversation_id],))
    if result.kind is Delivery.DELIVERED:
        ids = [head.msg_id, head.request_msg_id] if head.last else [head.msg_id]
        conn.run("conv_ok", ids, None, before=[lock, late] if late else lock)
        report.delivered += 1
        report.late += head.late_ms is not None
        return ("delivered", rid, ""), None
    if result.kind is Delivery.ASYNC:
        async_id = str(result.async_response_id)
        report.sent_async += 1
        report.late += head.late_ms is not None

        def record_sent() -> None:  # after Redis recorded the ACK id
            conn.run("conv_sent", head.msg_id, async_id, before=late)

        return ("sent", rid, async_id), record_sent
    if result.kind is Delivery.RECOVERABLE:
        attempt = head.attempt + 1
        policy = channel.policy
        if policy.allows(attempt):
            report.retried += 1
            wait = policy.delay(attempt) if result.retry_after_ms is None else result.retry_after_ms
            with logs.bound(attempt=attempt):
                log.warning(
                    "response %s: send %d failed: %s; sent again in %d ms",
                    rid,
                    attempt,
                    result.reason,
                    wait,
                )
            conn.run("conv_retry", head.msg_id, attempt, now_ms + wait)
            return ("retry", rid, str(wait)), None
        conn.run(
            "conv_group_awaited",
            head.request_msg_id,
            ERROR_RETRIES_SPENT,
            f"{result.reason} ({channel.attempts} retries spent)",
        )
        report.awaited += 1
        log.error("response %s: retries spent (%s); its group is AWAITED", rid, result.reason)
        return ("awaited", rid, ""), None
    why = f"response {rid}: {result.reason}"
    code = result.error_code or ERROR_CANCELLED

    def cancel_group() -> None:
        conn.run("conv_group_cancel", head.request_msg_id, code, why, before=lock)

    cancel_group()
    report.cancelled += 1
    log.error("response %s: %s; its group is cancelled", rid, result.reason)
    # Once more after Redis dropped the group: a response of the group accepted meanwhile
    # (its row written after the first cancel, its Redis entry before the drop) is dropped
    # from Redis by the next step and must not stay open in PostgreSQL. A response accepted
    # after the drop finds the tombstone and is cancelled by its intake.
    return ("cancel", rid, ""), cancel_group


def _settled_by_timeout(conn: PreparedConnection, step: lua.Advanced, report: DrainReport) -> None:
    settled = step.settled
    if not settled:
        return
    ids = [i for done in settled for i in done.msg_ids]
    conn.run("conv_ok", ids, "delivered: no ACK within SENT_MESSAGE_TTL")
    report.ack_timeouts += len(settled)


def _check_ack_token(ctx: Context, info: dict[str, Any], token: str) -> None:
    """The ACK must bring the token its response was sent with (worker.channels.ack_token)."""
    if not token:
        raise Unauthenticated(
            "missing: bring back the X-Orderly-Ack-Token the response was sent with",
            ACK_TOKEN_HEADER,
        )
    if not ACK_TOKEN_FORM.fullmatch(token):
        raise Unauthenticated("not an ACK token of orderly's", ACK_TOKEN_HEADER)
    origin = ctx.redis.hget(ctx.keys.response(info["cnId"], info["rsId"]), "origin")
    try:
        secret = ctx.channels.get(as_text(origin)).ack_secret if origin else ""
    except UnknownChannel:
        secret = ""
    if not secret or not ack_token_matches(secret, info["cnId"], info["rsId"], token):
        raise Unauthenticated("not the token this response was sent with", ACK_TOKEN_HEADER)


def ack(ctx: Context, async_response_id: str, enqueue: Enqueue, token: str | None = None) -> int:
    """The client's ACK: the response is delivered and its successor released at once.
    ``token`` (None: a caller orderly trusts) must be the response's ACK token."""
    if token is not None and not ACK_TOKEN_FORM.fullmatch(token):
        _check_ack_token(ctx, {}, token)  # refused before any lookup
    if not 0 < len(async_response_id) <= MAX_ASYNC_ID:
        raise UnknownAck(async_response_id[:MAX_ASYNC_ID])
    found = find_ack(ctx, async_response_id) or _early_ack(ctx, async_response_id, token)
    shard, member = found
    info = json.loads(member)
    if token is not None:
        try:
            _check_ack_token(ctx, info, token)
        except Unauthenticated:
            # The same answer as an unknown id: a guess learns nothing of which ids exist.
            raise UnknownAck(async_response_id) from None
    cid = info["cnId"]
    k = ctx.keys
    token = new_token()
    # The member read above names the conversation, so its shard; the script checks again,
    # atomically in that shard's slot, that the ACK key still holds it.
    with ctx.locked(cid) as conn:
        acked = lua.ack(
            ctx.scripts,
            async_request=shard.async_request(async_response_id),
            response=shard.response(info["rsId"]),
            response_order=k.response_list(cid),
            pending_messages=shard.pending_messages,
            request_list=k.request_list(cid),
            request_seq=k.request_seq(cid),
            drain_lease=k.drain_lease(cid),
            member=member,
            request_prefix=shard.request_prefix,
            async_prefix=shard.async_prefix,
            lease_token=token,
            lease_ms=ctx.lease_ms,
            async_response_id=async_response_id,
        )
        conn.run("conv_ok", acked.msg_ids, f"ACK {async_response_id}")
    if acked.lease_taken:
        enqueue(cid, token)
    return acked.msg_id


def _early_ack(ctx: Context, async_response_id: str, token: str | None) -> tuple[ShardKeys, str]:
    """An ACK no ACK key holds: a client may ACK before the worker has recorded its 202, so it
    waits a moment (ACK_GRACE_S) for the id to show. Only an ACK whose token is that of a
    response being sent now waits: any other (an id guessed or long gone) is refused after
    one more look, without a sleep, in about the time a wrong token for a known id takes."""
    if token is not None:
        heads = lua.ack_inflight_each(
            ctx.scripts,
            [
                lua.ack_inflight_call(
                    async_request=shard.async_request(async_response_id),
                    drains=shard.drains,
                    conversation_prefix=shard.conversation_prefix,
                    response_prefix=shard.response_prefix,
                )
                for shard in ctx.keys.every_shard
            ],
        )
        if any(look.member for look in heads):  # recorded meanwhile
            found = find_ack(ctx, async_response_id)
            if found is not None:
                return found
        in_flight = [claimed for look in heads for claimed in look.claimed]
        if not any(_signed(ctx, cid, rid, origin, token) for cid, rid, origin in in_flight):
            raise UnknownAck(async_response_id)
    for pause in ACK_GRACE_S:
        time.sleep(pause)
        found = find_ack(ctx, async_response_id)
        if found is not None:
            return found
    raise UnknownAck(async_response_id)


def _signed(ctx: Context, conversation_id: str, response_id: str, origin: str, token: str) -> bool:
    """Whether ``token`` is the ACK token of that response (sent to ``origin``)."""
    try:
        secret = ctx.channels.get(origin).ack_secret
    except UnknownChannel:
        return False
    return bool(secret) and ack_token_matches(secret, conversation_id, response_id, token)


def find_ack(ctx: Context, async_response_id: str) -> tuple[ShardKeys, str] | None:
    """The shard whose ACK key holds ``async_response_id``, and the MinMessageInfo it holds.

    The id is the client's own (its 202's asyncResponseId): it names no conversation, so every
    shard's key is read, in one pipelined round trip (one per node of a cluster). Two shards
    hold it only when a client gave two responses the same id; the one waiting longest (the
    least of its SENT_MESSAGE_TTL left) takes the ACK, as on one shard the first keeps it.
    """
    shards = ctx.keys.every_shard
    pipe = ctx.redis.pipeline(transaction=False)
    for shard in shards:
        pipe.get(shard.async_request(async_response_id))
        pipe.pttl(shard.async_request(async_response_id))
    raw = pipe.execute()
    found = [
        (int(raw[2 * n + 1]), n, as_text(raw[2 * n]))
        for n in range(len(shards))
        if raw[2 * n] is not None
    ]
    if not found:
        return None
    if len(found) > 1:
        log.warning(
            "ACK id %r is held in %d shards: the oldest takes it", async_response_id, len(found)
        )
    _, n, member = min(found)
    return shards[n], member
