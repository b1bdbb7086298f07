"""Each operation of the API as a :class:`Call`: its request and how its answer is read. The
sync and async clients send the same calls."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, TypeAdapter

from orderly.client import answers as a

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

ACK_TOKEN_HEADER = "X-Orderly-Ack-Token"


@dataclass(frozen=True)
class Submitted:
    """A message, conversation request or response the API took (``created`` False: it had
    it already, the same answer again)."""

    msg_id: int
    state: str
    created: bool


@dataclass(frozen=True)
class Published:
    correlation_id: str
    event_id: int
    deliveries: list[int]
    unroutable: bool
    created: bool


@dataclass(frozen=True)
class Acked:
    msg_id: int
    state: str


def _as_is(status: int, body: Any) -> Any:
    return body


def _one(model: type[M]) -> Callable[[int, Any], M]:
    """An answer read into its model (orderly.client.answers)."""
    return lambda status, body: model.model_validate(body)


def _many(model: type[M]) -> Callable[[int, Any], list[M]]:
    """A list answer read into its model, row by row."""
    adapter = TypeAdapter(list[model])  # type: ignore[valid-type]
    return lambda status, body: list(adapter.validate_python(body))


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    body: Any = None
    params: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    read: Callable[[int, Any], T] = _as_is
    # Sent again after a timeout or a lost connection: a read (GET), or a write the API stores
    # once whatever the number of times it comes (by its ids, or an Idempotency-Key).
    idempotent: bool | None = None
    # how long this call may take to answer, when longer than the client's timeout (seconds)
    wait_s: float = 0.0

    @property
    def retry_safe(self) -> bool:
        return self.idempotent if self.idempotent is not None else self.method == "GET"


def segment(value: object) -> str:
    """A path segment: every character that is not unreserved escaped (``/`` too)."""
    return quote(str(value), safe="")


def json_of(value: Any) -> Any:
    """A body: a pydantic model as it dumps for JSON (aliases, only the fields set); a dict
    with its datetime values in ISO 8601 (``msg_timestamp``, ``not_before``); else the value
    itself."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    if isinstance(value, Mapping):
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in value.items()}
    return value


def _submitted(status: int, body: Any) -> Submitted:
    return Submitted(int(body["msg_id"]), str(body["state"]), status == 201)


def _published(status: int, body: Any) -> Published:
    return Published(
        body["correlation_id"],
        int(body["event_id"]),
        [int(d) for d in body["deliveries"]],
        bool(body["unroutable"]),
        status == 201,
    )


def _acked(status: int, body: Any) -> Acked:
    return Acked(int(body["msg_id"]), str(body["state"]))


def submit(message: Any) -> Call[Submitted]:
    return Call("POST", "/messages", json_of(message), read=_submitted, idempotent=True)


def _submitted_many(status: int, body: Any) -> list[Submitted]:
    return [
        Submitted(int(item["msg_id"]), str(item["state"]), bool(item["created"]))
        for item in body["results"]
    ]


def submit_many(messages: Sequence[Any]) -> Call[list[Submitted]]:
    """Up to 1,000 messages in one request: all stored, or none (one invalid refuses all)."""
    body = {"messages": [json_of(message) for message in messages]}
    return Call("POST", "/messages:batch", body, read=_submitted_many, idempotent=True)


def respond(response: Any) -> Call[a.ResponseAccepted]:
    """An external system's response to a message waiting for it (WAITING_FOR_RES)."""
    return Call("POST", "/messages/responses", json_of(response), read=_one(a.ResponseAccepted))


@dataclass(frozen=True)
class MessageFilter:
    """Which messages ``messages()`` lists: every field given must match (None: any)."""

    state: str | None = None
    service: str | None = None
    operation: str | None = None
    source_system: str | None = None
    correlation_id: str | None = None
    funnel: str | None = None
    since: datetime | str | None = None  # msg_timestamp from
    until: datetime | str | None = None  # msg_timestamp before
    # how correlation_id matches: exact, prefix (its start) or contains
    correlation_match: str | None = None


def messages(found: MessageFilter, limit: int, offset: int) -> Call[list[a.MessageRow]]:
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    for name, value in asdict(found).items():
        if value is not None:
            params[name] = value.isoformat() if isinstance(value, datetime) else value
    return Call("GET", "/messages", params=params, read=_many(a.MessageRow))


def message(msg_id: int) -> Call[a.MessageDetail]:
    return Call("GET", f"/messages/{segment(msg_id)}", read=_one(a.MessageDetail))


def cancel(msg_id: int, note: str, by: str | None) -> Call[a.Cancelled]:
    return Call(
        "POST", f"/messages/{segment(msg_id)}/cancel", _note(note, by), read=_one(a.Cancelled)
    )


def redrive(msg_id: int, note: str, by: str | None) -> Call[a.Redriven]:
    path = f"/messages/{segment(msg_id)}/redrive"
    return Call("POST", path, _note(note, by), read=_one(a.Redriven))


def _note(note: str, by: str | None) -> dict[str, str]:
    return {"note": note} if by is None else {"note": note, "by": by}


def conversation_request(conversation_id: str, request: Any) -> Call[Submitted]:
    path = f"/conversations/{segment(conversation_id)}/requests"
    return Call("POST", path, json_of(request), read=_submitted, idempotent=True)


def conversation_response(conversation_id: str, response: Any) -> Call[Submitted]:
    path = f"/conversations/{segment(conversation_id)}/responses"
    return Call("POST", path, json_of(response), read=_submitted, idempotent=True)


def conversation(conversation_id: str) -> Call[a.Conversation]:
    return Call("GET", f"/conversations/{segment(conversation_id)}", read=_one(a.Conversation))


def conversation_message(
    response_id: str | None, async_response_id: str | None, fields: Sequence[str] | None
) -> Call[a.ConversationMessage]:
    """getConversationMessage: by response id or by ACK id; only ``fields`` if given."""
    params = {"response_id": response_id, "async_response_id": async_response_id}
    if fields is not None:
        params["fields"] = ",".join(fields)
    found = {k: v for k, v in params.items() if v is not None}
    return Call("GET", "/conversation-messages", params=found, read=_one(a.ConversationMessage))


def delete_conversation_request(
    conversation_id: str, request_id: str, filters: Mapping[str, Any]
) -> Call[a.ConversationDeleted]:
    """deleteConversationRegister: ``filters`` status, all_origin_except, note."""
    path = f"/conversations/{segment(conversation_id)}/requests/{segment(request_id)}"
    params = {k: v for k, v in filters.items() if v is not None}
    return Call("DELETE", path, params=params, read=_one(a.ConversationDeleted))


def _conversation_operation(
    conversation_id: str,
    kind: str,
    ident: str,
    action: str,
    body: Mapping[str, Any],
    model: type[M],
) -> Call[M]:
    path = f"/conversations/{segment(conversation_id)}/{kind}/{segment(ident)}/{action}"
    method = "PUT" if action == "awaited-date" else "POST"
    return Call(method, path, dict(body), read=_one(model))


def set_awaited(
    conversation_id: str, request_id: str | None, response_id: str | None, note: str | None
) -> Call[a.ConversationAwaited]:
    """setAwaitedByRequestId or setAwaitedByResponseId: exactly one of the two ids."""
    if (request_id is None) == (response_id is None):
        raise ValueError("set_awaited takes exactly one of request_id and response_id")
    kind, ident = ("requests", request_id) if request_id else ("responses", response_id)
    body = {} if note is None else {"note": note}
    return _conversation_operation(
        conversation_id, kind, str(ident), "awaited", body, a.ConversationAwaited
    )


def set_awaited_date(
    conversation_id: str, response_id: str, at: datetime | str
) -> Call[a.AwaitedDate]:
    """updateAwaitedExpires: an AWAITED response's new awaitedToDate."""
    body = {"awaited_to_date": at.isoformat() if isinstance(at, datetime) else at}
    return _conversation_operation(
        conversation_id, "responses", response_id, "awaited-date", body, a.AwaitedDate
    )


def remove_at(conversation_id: str, response_id: str, delay_s: int) -> Call[a.RemovalScheduled]:
    """removeAllReferencesAtTime: the response's references go after ``delay_s``."""
    body = {"delay_s": delay_s}
    return _conversation_operation(
        conversation_id, "responses", response_id, "removal", body, a.RemovalScheduled
    )


def ack(async_response_id: str, token: str) -> Call[Acked]:
    """A client's ACK: the ACK token its response came with, no API key needed."""
    return Call(
        "POST",
        f"/acks/{segment(async_response_id)}",
        headers={ACK_TOKEN_HEADER: token},
        read=_acked,
    )


def publish(room: str, event: Any, idempotency_key: str | None) -> Call[Published]:
    headers = {} if idempotency_key is None else {"Idempotency-Key": idempotency_key}
    path = f"/rooms/{segment(room)}/events"
    return Call(
        "POST",
        path,
        json_of(event),
        headers=headers,
        read=_published,
        idempotent=idempotency_key is not None,
    )


def pull(subscription_id: int, max_messages: int, wait_ms: int = 0) -> Call[list[a.Pulled]]:
    path = f"/subscriptions/{segment(subscription_id)}/messages"
    params = {"max": max_messages, **({"wait_ms": wait_ms} if wait_ms else {})}
    # not sent again: a pull that timed out may have taken messages (they come back later)
    return Call(
        "GET", path, params=params, read=_many(a.Pulled), idempotent=False, wait_s=wait_ms / 1000
    )


def extend_pulled(
    subscription_id: int, delivery_id: int, receipt: str, visibility_timeout_ms: int
) -> Call[a.PulledVisibility]:
    path = f"/subscriptions/{segment(subscription_id)}/messages/{segment(delivery_id)}/visibility"
    body = {"receipt": receipt, "visibility_timeout_ms": visibility_timeout_ms}
    return Call("POST", path, body, read=_one(a.PulledVisibility), idempotent=True)


def replay(subscription_id: int, since: Any, until: Any = None) -> Call[a.Replayed]:
    body = json_of({"since": since, **({} if until is None else {"until": until})})
    path = f"/subscriptions/{segment(subscription_id)}/replay"
    return Call("POST", path, body, read=_one(a.Replayed))


def enable_subscription(subscription_id: int, note: str = "") -> Call[a.SubscriptionChanged]:
    path = f"/subscriptions/{segment(subscription_id)}/enable"
    return Call("POST", path, {"note": note}, read=_one(a.SubscriptionChanged), idempotent=True)


def ack_pulled(subscription_id: int, delivery_id: int, receipt: str) -> Call[a.PulledAcked]:
    path = f"/subscriptions/{segment(subscription_id)}/messages/{segment(delivery_id)}/ack"
    return Call("POST", path, {"receipt": receipt}, read=_one(a.PulledAcked))


def tracked_done(xid: str) -> Call[a.TrackedDone]:
    return Call("POST", "/tracking/done", {"xid": xid}, read=_one(a.TrackedDone))


def subscribe(room: str, subscription: Any) -> Call[a.SubscriptionCreated]:
    """A subscription of ``room``: ``{name, kind, push_url?, handler?, event_type?,
    event_version? | min_version?/max_version?, routing_key_pattern?, ...}``."""
    path = f"/rooms/{segment(room)}/subscriptions"
    return Call("POST", path, json_of(subscription), read=_one(a.SubscriptionCreated))


def _log(table: str, filters: Mapping[str, Any], model: type[M]) -> Call[list[M]]:
    """Rows of ``table`` (queue-messages, exceptions, published-messages), newest first."""
    params = {k: v for k, v in filters.items() if v is not None}
    return Call("GET", f"/{table}", params=params, read=_many(model))


def queue_log(filters: Mapping[str, Any]) -> Call[list[a.QueueLogRow]]:
    return _log("queue-messages", filters, a.QueueLogRow)


def exceptions(filters: Mapping[str, Any]) -> Call[list[a.ExceptionListed]]:
    return _log("exceptions", filters, a.ExceptionListed)


def published(filters: Mapping[str, Any]) -> Call[list[a.PublishedRow]]:
    return _log("published-messages", filters, a.PublishedRow)


def exception(exception_id: int) -> Call[a.ExceptionDetail]:
    return Call("GET", f"/exceptions/{segment(exception_id)}", read=_one(a.ExceptionDetail))


def create_schedule(schedule: Any) -> Call[dict[str, Any]]:
    """A periodic schedule: ``{name, cron, time_zone?, service, operation, source_system,
    payload, ...}``; one message per due instant."""
    return Call("POST", "/schedules", json_of(schedule))


def schedules(limit: int, offset: int) -> Call[list[dict[str, Any]]]:
    return Call("GET", "/schedules", params={"limit": limit, "offset": offset})


def schedule(name: str) -> Call[dict[str, Any]]:
    return Call("GET", f"/schedules/{segment(name)}")


def update_schedule(name: str, changes: Any) -> Call[dict[str, Any]]:
    """Fields to change (``enabled``, ``cron``, ``time_zone``, the template's)."""
    return Call("PATCH", f"/schedules/{segment(name)}", json_of(changes))


def delete_schedule(name: str) -> Call[dict[str, Any]]:
    return Call("DELETE", f"/schedules/{segment(name)}")


def _limit_path(component_id: str) -> str:
    """A funnel limit's path: ``""`` (funnels without a component) is ``-``, and a component
    of dashes only gets one more (``-`` is ``--``)."""
    word = f"-{component_id}" if component_id.strip("-") == "" else component_id
    return f"/funnel-limits/{segment(word)}"


def _limit_set(status: int, body: Any) -> dict[str, Any]:
    return {**body, "created": status == 201}


def funnel_limits() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/funnel-limits")


def funnel_limit(component_id: str) -> Call[dict[str, Any]]:
    return Call("GET", _limit_path(component_id))


def set_funnel_limit(
    component_id: str,
    max_in_flight: int,
    rate_per_s: float | None = None,
    burst: int | None = None,
) -> Call[dict[str, Any]]:
    """The limit made or replaced; ``created`` tells which (201 or 200)."""
    body: dict[str, Any] = {"max_in_flight": max_in_flight}
    if rate_per_s is not None:
        body["rate_per_s"] = rate_per_s
    if burst is not None:
        body["burst"] = burst
    return Call("PUT", _limit_path(component_id), body, read=_limit_set)


def delete_funnel_limit(component_id: str) -> Call[dict[str, Any]]:
    return Call("DELETE", _limit_path(component_id))
