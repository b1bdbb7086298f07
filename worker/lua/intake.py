"""The calls of conversation intake's scripts: a request registered (register_request.lua), a
response added to its conversation's order (add_response.lua)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orderly.worker.core.scripts import Call, Scripts, as_text


class Registration(enum.IntEnum):  # register_request.lua's answer
    REGISTERED = 1
    ALREADY = 0  # registered before: nothing changed
    MISSING = -1  # its conversation's counter is gone: nothing written (joins.py)


def register_request(scripts: Scripts, call: Call) -> Registration:
    """The request registered (:func:`register_request_call`), or why not."""
    return Registration(int(scripts.run(call)))


def register_request_each(
    scripts: Scripts, calls: Sequence[Call]
) -> list[Registration | Exception]:
    """Requests registered (:func:`register_request_call`), in one round trip per server; one
    that failed answers its exception."""
    return [
        reply if isinstance(reply, Exception) else Registration(int(reply))
        for reply in scripts.run_each(calls, each_error=True)
    ]


def register_request_call(
    *,
    request: str,
    request_list: str,
    request_seq: str,
    response_order: str,
    conversation_id: str,
    origin: str,
    request_id: str,
    request_timestamp_ms: int,
    msg_id: int,
    now_ms: int,
    message_ttl_ms: int,
    awaited_message_ttl_ms: int,
    corr: str | None,
    check: bool = True,
    others_open: bool = False,
) -> Call:
    """register_request.lua's call (:class:`Registration`). ``check``: answer MISSING rather
    than go on when the conversation's counter is gone while its list or order is there, or
    its counter or list is gone and ``others_open`` (PostgreSQL has other open rows in it)."""
    return Call(
        "register_request",
        keys=(request, request_list, request_seq, response_order),
        args=(
            conversation_id,
            origin,
            request_id,
            request_timestamp_ms,
            msg_id,
            now_ms,
            message_ttl_ms,
            awaited_message_ttl_ms,
            corr or "",
            1 if check else 0,
            1 if others_open else 0,
        ),
    )


class AddCode(enum.StrEnum):
    ADDED = "ADDED"
    DUPLICATE = "DUPLICATE"
    CANCELLED = "CANCELLED"  # the request's group was cancelled
    MISSING = "MISSING"  # its request's key or the counter is gone: nothing written (joins.py)


@dataclass(frozen=True)
class ResponseAdded:
    code: AddCode
    lease_taken: bool  # the caller must start a drain with its lease token
    late_ms: int | None  # a late response: how long after its request's MESSAGE_TTL it came
    missing: str | None = None  # MISSING: the key found gone


def add_response(scripts: Scripts, call: Call) -> ResponseAdded:
    """One response added (:func:`add_response_call`)."""
    return _added(scripts.run(call))


def add_response_each(scripts: Scripts, calls: Sequence[Call]) -> list[ResponseAdded | Exception]:
    """Responses added (:func:`add_response_call`), in one round trip per server; one that
    failed answers its exception."""
    return [
        reply if isinstance(reply, Exception) else _added(reply)
        for reply in scripts.run_each(calls, each_error=True)
    ]


def _added(reply: Sequence[Any]) -> ResponseAdded:
    code, taken, late_ms = reply
    added, late = AddCode(as_text(code)), as_text(late_ms)
    if added is AddCode.MISSING:
        return ResponseAdded(added, False, None, missing=late)
    return ResponseAdded(added, bool(int(taken)), int(late) if late else None)


def add_response_call(
    *,
    request: str,
    response: str,
    response_order: str,
    pending_messages: str,
    request_list: str,
    request_seq: str,
    drain_lease: str,
    conversation_id: str,
    origin: str,
    request_id: str,
    response_id: str,
    member: str,
    response_timestamp_ms: int,
    task_item: str,
    msg_id: int,
    request_msg_id: int,
    last: bool,
    now_ms: int,
    message_ttl_ms: int,
    awaited_message_ttl_ms: int,
    blocked_limit_ms: int,
    request_timestamp_ms: int,
    lease_token: str,
    lease_ms: int,
    request_completed: bool,
    corr: str | None,
    trace_parent: str | None = None,
    check: bool = True,
    request_open: bool = False,
    others_open: bool = False,
) -> Call:
    """add_response.lua's call (:class:`ResponseAdded`). ``check``: answer MISSING rather
    than go on when the request's key is gone and ``request_open`` (PostgreSQL has it waiting
    for responses), a callback finds the counter gone, or the conversation's order is gone
    and ``others_open`` (PostgreSQL has other responses of it open)."""
    return Call(
        "add_response",
        keys=(
            request,
            response,
            response_order,
            pending_messages,
            request_list,
            request_seq,
            drain_lease,
        ),
        args=(
            conversation_id,
            origin,
            request_id,
            response_id,
            member,
            response_timestamp_ms,
            task_item,
            msg_id,
            request_msg_id,
            1 if last else 0,
            now_ms,
            message_ttl_ms,
            awaited_message_ttl_ms,
            blocked_limit_ms,
            request_timestamp_ms,
            lease_token,
            lease_ms,
            1 if request_completed else 0,
            corr or "",
            trace_parent or "",
            1 if check else 0,
            1 if request_open else 0,
            1 if others_open else 0,
        ),
    )
