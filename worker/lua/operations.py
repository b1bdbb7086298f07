"""The calls of operators' conversation scripts (conv_*.lua, worker.conversations.operations and
removal) and of the rebuild's end (epoch_ready.lua, worker.rebuild)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from orderly.worker.core.scripts import Call, Scripts, as_text
from orderly.worker.lua.conversation import _id, _list


@dataclass(frozen=True)
class ConvDeleted:
    excepted: bool  # the request's origin was the excepted one: nothing changed
    deleted: list[tuple[str, str]]  # (msgId or '', responseId) of each response deleted
    request: bool  # the request went too


def conv_delete(
    scripts: Scripts,
    *,
    request: str,
    response_order: str,
    pending_messages: str,
    request_list: str,
    request_seq: str,
    request_id: str,
    status: str | None,
    all_origin_except: str | None,
    origin: str,
    response_prefix: str,
    async_prefix: str,
    message_ttl_ms: int,
    now_ms: int,
) -> ConvDeleted:
    """Delete the request's responses (only those in ``status``; None: all, and the request);
    each keeps a CANCEL hash for its lifetime."""
    call = Call(
        "conv_delete",
        keys=(request, response_order, pending_messages, request_list, request_seq),
        args=(
            request_id,
            status or "",
            all_origin_except or "",
            origin,
            response_prefix,
            async_prefix,
            message_ttl_ms,
            now_ms,
        ),
    )
    found = json.loads(scripts.run(call))
    return ConvDeleted(
        excepted=bool(found["excepted"]),
        deleted=[(str(mid), str(rid)) for mid, rid in _list(found.get("deleted"))],
        request=bool(found["request"]),
    )


@dataclass(frozen=True)
class AwaitedRow:
    msg_id: int
    response_id: str
    awaited_to_date_ms: int
    awaited_retries: int


@dataclass(frozen=True)
class MadeAwaited:
    set: list[AwaitedRow]
    skipped: list[tuple[str, str]]  # (responseId, status) left as they were


def conv_set_awaited(
    scripts: Scripts,
    *,
    response_order: str,
    pending_messages: str,
    response_prefix: str,
    now_ms: int,
    awaited_time_when_retries_end_ms: int,
    awaited_step_ms: float,
    request_id: str | None,
    response_id: str | None,
) -> MadeAwaited:
    """Every response of ``request_id``, or the one ``response_id``, made AWAITED."""
    call = Call(
        "conv_set_awaited",
        keys=(response_order, pending_messages),
        args=(
            response_prefix,
            now_ms,
            awaited_time_when_retries_end_ms,
            awaited_step_ms,
            request_id or "",
            response_id or "",
        ),
    )
    found = json.loads(scripts.run(call))
    return MadeAwaited(
        set=[AwaitedRow(int(mid), rid, int(at), n) for mid, rid, at, n in _list(found.get("set"))],
        skipped=[(rid, status) for rid, status in _list(found.get("skipped"))],
    )


class AwaitedDateCode(enum.StrEnum):
    SET = "SET"
    UNKNOWN = "UNKNOWN"  # the response is no longer in its conversation's order
    NOT_AWAITED = "NOT_AWAITED"
    PAST_EXPIRY = "PAST_EXPIRY"  # its AWAITED_MESSAGE_TTL ends before the date


@dataclass(frozen=True)
class AwaitedDate:
    code: AwaitedDateCode
    detail: str = ""  # NOT_AWAITED: the status it has; PAST_EXPIRY: when it expires (ms)
    msg_id: int = 0  # SET: the response's msgId, its awaitedToDate and awaitedRetries
    date_ms: int = 0
    retries: int = 0


def conv_awaited_date(
    scripts: Scripts, *, response: str, pending_messages: str, date_ms: int, now_ms: int
) -> AwaitedDate:
    call = Call("conv_awaited_date", keys=(response, pending_messages), args=(date_ms, now_ms))
    code, *rest = scripts.run(call)
    found = AwaitedDateCode(as_text(code))
    if found is AwaitedDateCode.SET:
        msg_id, date, retries = (int(as_text(v)) for v in rest)
        return AwaitedDate(found, msg_id=msg_id, date_ms=date, retries=retries)
    return AwaitedDate(found, detail=as_text(rest[0]) if rest else "")


class RemoveAtCode(enum.StrEnum):
    SCHEDULED = "SCHEDULED"
    UNKNOWN = "UNKNOWN"  # the response is no longer in its conversation's order


def conv_remove_at(
    scripts: Scripts, *, response: str, scheduled: str, at_ms: int, now_ms: int, message_ttl_ms: int
) -> RemoveAtCode:
    call = Call("conv_remove_at", keys=(response, scheduled), args=(at_ms, now_ms, message_ttl_ms))
    code, *_ = scripts.run(call)
    return RemoveAtCode(as_text(code))


@dataclass(frozen=True)
class RemovedDue:
    msg_id: int
    completed_request_msg_id: int | None
    status: str  # the response's status when its references went

    @property
    def msg_ids(self) -> list[int]:
        done = self.completed_request_msg_id
        return [self.msg_id] if done is None else [self.msg_id, done]


def conv_remove_due(
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
    now_ms: int,
) -> RemovedDue | None:
    """The scheduled removal, if due; None when nothing was removed (GONE: nothing left;
    NOT_DUE: the removal was moved later, or the hash is another response's by now)."""
    call = Call(
        "conv_remove_due",
        keys=(response, response_order, pending_messages, request_list, request_seq),
        args=(member, request_prefix, async_prefix, now_ms),
    )
    done: list[Any] = scripts.run(call)
    if len(done) != 3:
        return None
    msg_id, completed, status = done
    return RemovedDue(int(as_text(msg_id)), _id(completed), as_text(status))


def epoch_ready(scripts: Scripts, *, marker: str, generation: str | int, run_id: str) -> bool:
    """Whether the marker says 'ready' now (False: it is gone, or another rebuild's)."""
    return bool(scripts.run(Call("epoch_ready", keys=(marker,), args=(generation, run_id))))
