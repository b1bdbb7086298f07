"""The calls of conversation delivery's scripts (intake's: intake.py): the gate and the ACK
(advance.lua, ack.lua, ack_inflight.lua), the awaited agent (awaited.lua, expire.lua), dead
drains (drain_release.lua) and the rebuild (rebuild_conversation.lua)."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orderly.worker.core.scripts import Call, Scripts, as_text


def _id(value: Any) -> int | None:
    """A msgId a script read from a hash ('' when there was none)."""
    text = as_text(value)
    return int(text) if text else None


def _list(value: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}.
    return value if isinstance(value, list) else []


@dataclass(frozen=True)
class Settled:
    """A response settled (its references gone), and its request's msgId when the response
    was the request's final one (the request completed)."""

    msg_id: int | None
    completed_request_msg_id: int | None

    @property
    def msg_ids(self) -> list[int]:
        return [i for i in (self.msg_id, self.completed_request_msg_id) if i is not None]

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> Settled:
        return cls(_id(reply[0]), _id(reply[1]))


# --- the gate ---------------------------------------------------------------------------------


class AdvanceCode(enum.StrEnum):
    SEND = "SEND"
    CAN_SEND = "CAN_SEND"
    EMPTY = "EMPTY"
    WAIT_REQUEST = "WAIT_REQUEST"
    WAIT_RESPONSE = "WAIT_RESPONSE"
    WAIT_ACK = "WAIT_ACK"
    WAIT_RETRY = "WAIT_RETRY"
    WAIT_AWAITED = "WAIT_AWAITED"
    UNKNOWN = "UNKNOWN"  # check mode: no such response
    LOST = "LOST"  # the lease is another's
    YIELD = "YIELD"
    REBUILDING = "REBUILDING"  # Redis is being rebuilt from PostgreSQL: nothing is claimed
    MISSING = "MISSING"  # a head's key is gone: PostgreSQL decides (reconcile.repair)


@dataclass(frozen=True)
class Advanced:
    code: AdvanceCode
    head: Mapping[str, Any] | None  # SEND: the response's fields
    first: str | None  # the first response id of the conversation's order
    due: int | None  # a wait's end (ms)
    settled: list[Settled]  # responses delivered by their ACK wait's end
    ack_clash: str | None  # a 'sent' outcome's ACK id another response waits under
    missing: str | None = None  # MISSING: the key found gone


def advance(
    scripts: Scripts,
    *,
    request_list: str,
    response_order: str,
    pending_messages: str,
    drain_lease: str,
    scheduled: str,
    request_seq: str,
    drains: str,
    epoch: str,
    mode: str,
    lease_token: str,
    now_ms: int,
    lease_ms: int,
    inflight_ms: int,
    sent_message_ttl_ms: int,
    request_prefix: str,
    response_prefix: str,
    async_prefix: str,
    check_response_id: str,
    outcome: str,
    outcome_response_id: str,
    outcome_detail: str,
    message_ttl_ms: int,
    awaited_time_when_retries_end_ms: int,
    awaited_step_ms: float,
    conversation_id: str,
    holder_pid: int | None,
    gone: Sequence[str] = (),
) -> Advanced:
    """One gate step. ``mode``: 'claim', 'yield' or 'check'; ``outcome``: the previous send's
    ('' | 'delivered' | 'sent' | 'retry' | 'awaited' | 'cancel'), ``outcome_detail`` its async
    response id ('sent') or delay in ms ('retry'); ``gone``: keys to take as run out when
    missing (a MISSING answer's, after PostgreSQL was asked)."""
    call = Call(
        "advance",
        keys=(
            request_list,
            response_order,
            pending_messages,
            drain_lease,
            scheduled,
            request_seq,
            drains,
            epoch,
        ),
        args=(
            mode,
            lease_token,
            now_ms,
            lease_ms,
            inflight_ms,
            sent_message_ttl_ms,
            request_prefix,
            response_prefix,
            async_prefix,
            check_response_id,
            outcome,
            outcome_response_id,
            outcome_detail,
            message_ttl_ms,
            awaited_time_when_retries_end_ms,
            awaited_step_ms,
            conversation_id,
            "" if holder_pid is None else holder_pid,
            json.dumps(list(gone)) if gone else "",
        ),
    )
    found: dict[str, Any] = json.loads(scripts.run(call))
    return Advanced(
        code=AdvanceCode(found["code"]),
        head=found.get("head"),
        first=found.get("first"),
        due=found.get("due"),
        settled=[Settled.from_reply(pair) for pair in _list(found.get("settled"))],
        ack_clash=found.get("ack_clash"),
        missing=found.get("missing"),
    )


@dataclass(frozen=True)
class Acked:
    msg_id: int
    completed_request_msg_id: int | None
    lease_taken: bool  # the caller must start a drain with its lease token

    @property
    def msg_ids(self) -> list[int]:
        done = self.completed_request_msg_id
        return [self.msg_id] if done is None else [self.msg_id, done]


def ack(
    scripts: Scripts,
    *,
    async_request: str,
    response: str,
    response_order: str,
    pending_messages: str,
    request_list: str,
    request_seq: str,
    drain_lease: str,
    member: str,
    request_prefix: str,
    async_prefix: str,
    lease_token: str,
    lease_ms: int,
    async_response_id: str,
) -> Acked:
    """The client's ACK; refused (UnknownAck) when the ACK key no longer holds ``member``."""
    call = Call(
        "ack",
        keys=(
            async_request,
            response,
            response_order,
            pending_messages,
            request_list,
            request_seq,
            drain_lease,
        ),
        args=(member, request_prefix, async_prefix, lease_token, lease_ms, async_response_id),
    )
    _, msg_id, completed, taken = scripts.run(call)
    return Acked(int(msg_id), _id(completed), bool(int(taken)))


@dataclass(frozen=True)
class AckInFlight:
    """One shard's look: the member its ACK key holds now ('' none), else the claimed heads
    of its running drains as (conversationId, responseId, origin)."""

    member: str
    claimed: list[tuple[str, str, str]]


def ack_inflight_call(
    *, async_request: str, drains: str, conversation_prefix: str, response_prefix: str
) -> Call:
    return Call(
        "ack_inflight",
        keys=(async_request, drains),
        args=(conversation_prefix, response_prefix),
    )


def ack_inflight_each(scripts: Scripts, calls: Sequence[Call]) -> list[AckInFlight]:
    """Every shard's look (:func:`ack_inflight_call`), in one round trip per server."""
    found = []
    for reply in scripts.run_each(calls):
        sent = [as_text(v) for v in reply[1:]]
        claimed = list(zip(sent[0::3], sent[1::3], sent[2::3], strict=True))
        found.append(AckInFlight(as_text(reply[0]), claimed))
    return found


# --- the awaited agent and dead drains --------------------------------------------------------


@dataclass(frozen=True)
class AwaitedTurn:
    wake: list[str]  # conversation ids to wake
    expired: list[tuple[str, str, str]]  # (member, conversationId, status) past their TTL
    vanished: list[tuple[str, str]]  # (response id, conversationId) whose hash is gone
    taken: int  # members this turn claimed


def awaited(
    scripts: Scripts,
    *,
    pending_messages: str,
    now_ms: int,
    limit: int,
    response_prefix: str,
    awaited_step_ms: float,
) -> AwaitedTurn:
    call = Call(
        "awaited",
        keys=(pending_messages,),
        args=(now_ms, limit, response_prefix, awaited_step_ms),
    )
    found = json.loads(scripts.run(call))
    return AwaitedTurn(
        wake=_list(found.get("wake")),
        expired=[(m, cid, status) for m, cid, status in _list(found.get("expired"))],
        vanished=[(rid, cid) for rid, cid in _list(found.get("vanished"))],
        taken=int(found.get("taken", 0)),
    )


def expire(
    scripts: Scripts,
    *,
    response: str,
    response_order: str,
    pending_messages: str,
    request_list: str,
    request_seq: str,
    member: str,
    request_prefix: str,
    async_prefix: str,
) -> Settled | None:
    """The response's references removed (None: it was gone already)."""
    call = Call(
        "expire",
        keys=(response, response_order, pending_messages, request_list, request_seq),
        args=(member, request_prefix, async_prefix),
    )
    done = scripts.run(call)
    return Settled.from_reply(done) if done else None


def drain_release(
    scripts: Scripts,
    *,
    drains: str,
    drain_lease: str,
    scheduled: str,
    response_order: str,
    conversation_id: str,
    entry: str,
    now_ms: int,
    died: str,
    response_prefix: str,
    message_ttl_ms: int,
) -> bool:
    """Whether the drain found dead (``entry``) was released. ``died``: '1' its worker died,
    '0' PostgreSQL restarted under it, 'forget' an old entry of a live worker."""
    call = Call(
        "drain_release",
        keys=(drains, drain_lease, scheduled, response_order),
        args=(conversation_id, entry, now_ms, died, response_prefix, message_ttl_ms),
    )
    return bool(int(scripts.run(call)))


# --- the rebuild ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rebuilt:
    created: int  # keys created
    queued: int  # responses in the conversation's order now


def rebuild_conversation(
    scripts: Scripts,
    *,
    request_list: str,
    response_order: str,
    pending_messages: str,
    request_seq: str,
    scheduled: str,
    groups: Mapping[str, Any],
    request_prefix: str,
    response_prefix: str,
    async_prefix: str,
    keep_ms: int,
) -> Rebuilt:
    """``groups``: {groups: [...]} as rebuild_conversation.lua's header describes it."""
    call = Call(
        "rebuild_conversation",
        keys=(request_list, response_order, pending_messages, request_seq, scheduled),
        args=(json.dumps(groups), request_prefix, response_prefix, async_prefix, keep_ms),
    )
    created, queued = scripts.run(call)
    return Rebuilt(int(created), int(queued))
