"""A conversation's Redis structures rebuilt from its rows (rebuild_conversation.lua).

PostgreSQL knows every request and response, their states and ages; Redis knew the order and
the waits. The rows give them back:

- a request WAITING_FOR_RES whose MESSAGE_TTL has not run out (counted from its latest
  response) is in the request list again: WAITING without responses, PENDING with;
- a response IN_QUEUE is PENDING with its attempt and retry time (``conv_retry`` records them
  on the row, for the awaited round it belongs to); PARTLY_FAILED is AWAITED until the wait
  its round gave it; WAITING_FOR_RES is SENT, waiting for the ACK under its asyncResponseId
  for what is left of SENT_MESSAGE_TTL (a delivered response is OK: final, never rebuilt);
- the order: requests by msg_id, a request that had completed and took responses again (a
  callback) at its first open response; responses by msg_id within their request.

Times in Redis are the injected clock's: each is rebuilt as ``now - age``, the age measured
by PostgreSQL. Whether a key should still be there (``groups``' ``offset``) may be judged by
the injected clock instead: the rows carry PostgreSQL's clock too.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine

from orderly.models import MessageState
from orderly.models.keys import min_message_info
from orderly.worker import lua
from orderly.worker.conversations.context import Context
from orderly.worker.db.queries import sql

_RETRY = re.compile(r"^retry=(\d+);at=(\d+);round=(\d+)$")
# An AWAITED date an operator set (worker.conversations.operations), for its round.
_AWAITED = re.compile(r"^awaited=(\d+);round=(\d+)$")
_ASYNC = "asyncResponseId="


@dataclass
class _Group:
    request_id: str
    order: int
    request: dict[str, Any] | None = None
    ttl: int = 0
    responses: list[dict[str, Any]] = field(default_factory=list)


def expiry(at_ms: int) -> dict[str, int]:
    """A hash's expiry as the seed writes it (expiresAtTS, Unix seconds) and in the gate's
    milliseconds (expiresAt)."""
    return {"expiresAt": at_ms, "expiresAtTS": at_ms // 1000}


def _int(value: Any) -> int:
    return int(float(value)) if value is not None else 0


def read_rows(
    source: Engine | Connection,
    *,
    after: str = "",
    page: int | None = None,
    only: str | None = None,
    without: Collection[int] = (),
) -> list[Any]:
    """The rows a rebuild reads (``rebuild_conversation_rows``), ordered by conversation,
    then msg_id: every conversation's, a ``page`` of those after ``after``, or ``only`` one's;
    the rows of ``without`` left out (as if not there yet: not counted in their request's
    responses nor its latest one's age). ``source``: a connection whose transaction it reads
    in, or an engine."""
    params = {"after": after, "conversations": page, "only": only, "without": list(without)}
    if isinstance(source, Connection):
        return list(source.execute(sql("rebuild_conversation_rows"), params).all())
    with source.connect() as conn:
        return read_rows(conn, after=after, page=page, only=only, without=without)


def offset_ms(ctx: Context, rows: Sequence[Any]) -> int:
    """How far the injected clock is ahead of PostgreSQL's, which measured the rows' ages
    (a few ms in production; what a test moved its clock by)."""
    return ctx.now_ms() - _int(rows[0].now_ms) if rows else 0


def _response(ctx: Context, row: Any, now: int, offset: int = 0) -> dict[str, Any] | None:
    s = ctx.settings
    age, idle = _int(row.age_ms) + offset, _int(row.idle_ms)
    ttl = s.awaited_message_ttl - age
    if ttl <= 0:
        return None  # its life in Redis was over: the awaited agent's sweep ends the row
    expires = now - age + s.awaited_message_ttl
    member = min_message_info(row.request_id, row.correlation_id, row.process_id)
    fields: dict[str, Any] = {
        "conversationId": row.process_id,
        "origin": row.entity_type,
        "requestId": row.request_id,
        "responseId": row.correlation_id,
        "requestTimestamp": _int(row.request_timestamp_ms),
        "responseTimestamp": _int(row.timestamp_ms),
        "status": "PENDING",
        **expiry(expires),
        "awaitedToDate": 0,
        "awaitedToDateTS": 0,
        "awaitedRetries": row.failed_count,
        "taskItem": row.payload,
        "msgId": row.msg_id,
        "requestMsgId": row.request_msg_id,
        "last": "1" if row.response_last else "0",
        "reqSeq": 0,
        "attempt": 0,
        "notBefore": 0,
        "member": member,
        "lastAccess": now - idle,
        "receivedAt": now - age,
    }
    if row.corr is not None:
        fields["corr"] = row.corr
    if row.trace_parent:
        fields["tp"] = row.trace_parent
    out: dict[str, Any] = {"responseId": row.correlation_id, "member": member, "ttl": ttl}
    if row.remove_at_ms is not None:
        # A removal an operator scheduled (removeAllReferencesAtTime): due again then.
        fields["removeAt"] = int(row.remove_at_ms)
        out["removeAt"] = int(row.remove_at_ms)
    custom = row.custom_data or ""
    if row.state == MessageState.WAITING_FOR_RES:
        sent_at = now - idle
        fields.update(status="SENT", sentAt=sent_at)
        out["pendingAt"] = min(sent_at + s.sent_message_ttl + ctx.inflight_ms, expires)
        if custom.startswith(_ASYNC):
            out["asyncId"] = custom[len(_ASYNC) :]
            out["asyncTtl"] = s.sent_message_ttl - idle
    elif row.state == MessageState.PARTLY_FAILED:
        # AWAITED by its round (advance.lua's wait): the first after the retries' end, then
        # a step per earlier round.
        earlier = max(0, row.failed_count - 1)
        wait = earlier * ctx.awaited_step_ms if earlier else s.awaited_time_when_retries_end
        at = min(int(now - idle + wait), expires)
        by_hand = _AWAITED.match(custom)
        if by_hand and int(by_hand.group(2)) == row.failed_count:
            at = min(int(by_hand.group(1)), expires)
        fields.update(status="AWAITED", awaitedToDate=at, awaitedToDateTS=at // 1000, notBefore=at)
        out["pendingAt"] = at
    else:
        retry = _RETRY.match(custom)
        if retry and int(retry.group(3)) == row.failed_count:
            at = int(retry.group(2))
            fields.update(attempt=int(retry.group(1)), notBefore=at)
            out["pendingAt"] = min(at + ctx.inflight_ms, expires)
        else:
            out["pendingAt"] = min(now + ctx.blocked_ms, expires)
    out["fields"] = fields
    return out


def groups(ctx: Context, rows: Sequence[Any], now: int, offset: int = 0) -> list[_Group]:
    """A conversation's rows as the groups a rebuild makes (``request`` None: the request's
    life in Redis is over), in conversation order. ``offset``: added to every age (ms), to
    judge the lives by another clock than PostgreSQL's (:func:`offset_ms`)."""
    s = ctx.settings
    by_request: dict[str, _Group] = {}
    for row in rows:
        if row.operation_name == "request":
            group = by_request.setdefault(
                row.correlation_id, _Group(row.correlation_id, row.msg_id)
            )
            group.order = row.msg_id
            latest = row.latest_response_age_ms
            age = offset + min(
                _int(row.age_ms), _int(latest) if latest is not None else _int(row.age_ms)
            )
            ttl = s.message_ttl - age
            if ttl > 0:
                group.ttl = ttl
                group.request = {
                    "conversationId": row.process_id,
                    "origin": row.entity_type,
                    "requestId": row.correlation_id,
                    "requestTimestamp": _int(row.timestamp_ms),
                    "status": "PENDING" if row.responses else "WAITING",
                    "responseIdCounter": 0,
                    **expiry(now + ttl),
                    "msgId": row.msg_id,
                    "seq": 0,
                    "lastAccess": now - _int(row.idle_ms),
                    **({"corr": row.corr} if row.corr is not None else {}),
                }
            continue
        response = _response(ctx, row, now, offset)
        if response is None:
            continue
        group = by_request.setdefault(row.request_id, _Group(row.request_id, row.msg_id))
        group.responses.append(response)
        if row.request_state != MessageState.WAITING_FOR_RES and group.request is None:
            # A callback: the request had completed; it took its turn again at the end.
            group.order = min(group.order, row.msg_id)
            age = _int(row.age_ms) + offset
            group.ttl = max(1, s.message_ttl - age)
            group.request = {
                "conversationId": row.process_id,
                "origin": row.entity_type,
                "requestId": row.request_id,
                "requestTimestamp": _int(row.request_timestamp_ms),
                "status": "PENDING",
                "responseIdCounter": 0,
                **expiry(now + group.ttl),
                "msgId": row.request_msg_id,
                "seq": 0,
                "callback": 1,
            }
    return sorted(by_request.values(), key=lambda g: g.order)


@dataclass
class ConversationsRebuilt:
    conversations: int = 0
    keys_created: int = 0
    to_deliver: list[str] = field(default_factory=list)


def rebuild(ctx: Context, rows: Sequence[Any], offset: int = 0) -> ConversationsRebuilt:
    """Rebuild every conversation the rows name (rows ordered by conversation, then msg_id;
    ``offset``: as :func:`groups`')."""
    report = ConversationsRebuilt()
    by_conversation: dict[str, list[Any]] = {}
    for row in rows:
        by_conversation.setdefault(row.process_id, []).append(row)
    k = ctx.keys
    keep_ms = max(ctx.settings.message_ttl, ctx.settings.awaited_message_ttl)
    for cid, own in by_conversation.items():
        found = groups(ctx, own, ctx.now_ms(), offset)
        if not found:
            continue
        data = {
            "groups": [
                {
                    "requestId": g.request_id,
                    "inList": g.request is not None,
                    "ttl": g.ttl,
                    **({"request": g.request} if g.request is not None else {}),
                    "responses": g.responses,
                }
                for g in found
            ]
        }
        shard = k.shard(cid)
        rebuilt = lua.rebuild_conversation(
            ctx.scripts,
            request_list=k.request_list(cid),
            response_order=k.response_list(cid),
            pending_messages=shard.pending_messages,
            request_seq=k.request_seq(cid),
            scheduled=shard.scheduled,
            groups=data,
            request_prefix=shard.request_prefix,
            response_prefix=shard.response_prefix,
            async_prefix=shard.async_prefix,
            keep_ms=keep_ms,
        )
        report.conversations += 1
        report.keys_created += rebuilt.created
        if rebuilt.queued:
            report.to_deliver.append(cid)
    return report
