"""What the API answers, as typed models: the OpenAPI document's response schemas are made
from these (api/http/answers.py uses them), and the clients read their answers into them.

Rows that may gain columns (``_Open``) keep the fields they do not know, as pydantic's extra
fields.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class MessageState(enum.StrEnum):
    """A message's state: the store's own (orderly.models re-exports it)."""

    NEW = "NEW"  # accepted and stored; a processing task has been (or is being) enqueued
    IN_QUEUE = "IN_QUEUE"  # handed (again) to the broker by the pool, repair or an operator
    PROCESSING = "PROCESSING"  # claimed by a worker under a row lock
    OK = "OK"  # processed successfully
    PARTLY_FAILED = "PARTLY_FAILED"  # last try failed; the pool tries again
    FAILED = "FAILED"  # finally failed, no further processing
    WAITING = "WAITING"  # a parent waiting for its children
    WAITING_FOR_RES = "WAITING_FOR_RES"  # waiting for a response from an external system
    CANCEL = "CANCEL"  # cancelled by an operator or an external system
    POSTPONED = "POSTPONED"  # held back by a funnel / guaranteed order


class Answer(BaseModel):
    """An answer's fields as attributes, and read by name as a mapping's are as well
    (``row["state"]``, ``row.get("state")``, ``"state" in row``, ``dict(row)``): code written
    for the plain dicts the client returned before keeps working."""

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> list[str]:
        """The fields' names: the model's, then any extra ones the answer brought."""
        return [*type(self).model_fields, *(self.model_extra or {})]

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self.keys() else default

    def items(self) -> list[tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in self.keys()]

    def values(self) -> list[Any]:
        return [getattr(self, name) for name in self.keys()]

    def __contains__(self, name: object) -> bool:
        return name in self.keys()


class _Open(Answer):
    # A row may gain columns: clients read the fields they know, and the others by name.
    model_config = ConfigDict(extra="allow")


class Accepted(Answer):
    msg_id: int
    state: MessageState


class BatchItem(Accepted):
    created: bool


class BatchAccepted(Answer):
    """One result per message, in the order sent."""

    results: list[BatchItem]


class ResponseAccepted(Accepted):
    res_id: int


class Redriven(Accepted):
    reopened: list[int]


class Cancelled(Accepted):
    cancelled: list[int]  # its HARD descendants, cancelled with it


class Acked(Answer):
    msg_id: int
    state: Literal["OK"]


class MessageRow(_Open):
    msg_id: int
    state: MessageState
    service_name: str
    operation_name: str
    correlation_id: str
    source_system: str
    msg_timestamp: datetime
    funnel_value: str | None
    guaranteed_order: bool
    parent_msg_id: int | None
    failed_count: int
    failed_error_code: str | None
    last_process_timestamp: datetime | None
    # Claims take higher priority first (-100 to 100).
    priority: int
    # When the message is due (scheduled with delay_ms or not_before, or a retry's wait);
    # None: it waits for no time.
    due_at: datetime | None


class MessageDetail(MessageRow):
    receive_timestamp: datetime
    start_in_queue_timestamp: datetime | None
    object_id: str | None
    entity_type: str | None
    process_id: str | None
    funnel_component_id: str | None
    exclude_failed_state: bool
    parent_binding_type: str | None
    failed_desc: str | None
    custom_data: str | None
    node_id: int | None
    obsolete_by: int | None
    wait_correlation_id: str | None
    response_deadline: datetime | None
    wait_res_id: int | None
    audit: list[dict[str, Any]] | None
    payload: str | None
    children: list[dict[str, Any]]
    external_calls: list[dict[str, Any]]
    exchanges: list[dict[str, Any]]


class Conversation(Answer):
    conversation_id: str
    # What Redis holds of each request and response, field by field (text values).
    requests: list[dict[str, str]]
    responses: list[dict[str, str]]
    draining: bool


class ConversationMessage(_Open):
    """getConversationMessage: the response's fields as Redis holds them (text values; the
    payload as ``taskItem``), its row's ``state`` and ``inRedis``; only the fields asked for
    when a projection is given."""


class ConversationDeleted(Answer):
    conversation_id: str
    request_id: str
    excepted: bool
    request_cancelled: bool
    deleted: list[str]
    msg_ids: list[int]


class ConversationAwaited(Answer):
    conversation_id: str
    awaited: list[dict[str, Any]]
    skipped: list[dict[str, str]]


class AwaitedDate(Answer):
    response_id: str
    msg_id: int
    awaited_to_date_ms: int


class RemovalScheduled(Answer):
    response_id: str
    msg_id: int
    remove_at_ms: int


class Channel(Answer):
    origin: str
    url: str
    delivery_delay_ms: int
    multiplier: float
    attempts: int
    timeout_ms: int


class Room(Answer):
    name: str
    message_expiration_ms: int | None
    delivery_delay_ms: int
    delivery_delay_multiplier: float
    delivery_attempts: int
    status: Literal["ACTIVE", "PAUSED"]


class RoomListed(Room):
    # Events of the room that matched no subscription.
    unroutable: int


class EventTypeAdded(Answer):
    room: str
    name: str
    version: int


class EventTypeVersion(Answer):
    name: str
    version: int
    json_schema: dict[str, Any] = Field(alias="schema")


class PublisherAdded(Answer):
    room: str
    name: str


class Subscription(_Open):
    subscription_id: int
    name: str
    kind: Literal["PUSH", "PULL", "HANDLER"]
    push_url: str | None
    handler: str | None
    event_type: str | None
    # the event type's versions it selects (None: that end open)
    min_version: int | None
    max_version: int | None
    routing_key_pattern: str | None
    delivery_delay_ms: int | None
    delivery_delay_multiplier: float | None
    delivery_attempts: int | None
    # the endpoint's pace
    rate_per_s: float | None
    burst: int | None
    max_in_flight: int | None


class SubscriptionCreated(Subscription):
    # deliveries made for the room's events published since backfill_since
    backfilled: int


class SubscriptionListed(Subscription):
    status: Literal["ACTIVE", "PAUSED"]
    # the endpoint's health: failed sends in a row since failing_since; OPEN: only a probe
    # goes, at probe_at; DISABLED: nothing goes until an operator enables it
    failures: int
    failing_since: str | None
    probe_at: str | None
    disabled_at: str | None
    disabled_reason: str | None
    circuit: Literal["CLOSED", "OPEN", "DISABLED"]


class SubscriptionChanged(_Open):
    subscription_id: int
    status: Literal["ACTIVE", "PAUSED"]


class Published(Answer):
    correlation_id: str
    event_id: int
    deliveries: list[int]
    unroutable: bool


class Pulled(Answer):
    delivery_id: int
    attempt: int
    correlation_id: str
    routing_key: str
    payload: Any
    user: str | None
    impersonator: str | None
    receipt: str


class SigningSecret(Answer):
    kind: Literal["channel", "subscription", "source_system"]
    name: str
    secret: str
    previous: str | None  # still signed with until previous_until
    previous_until: str | None


class Replayed(Answer):
    replayed: int  # deliveries sent again
    backfilled: int  # deliveries made for events the subscription never had


class PulledVisibility(Answer):
    delivery_id: int
    state: Literal["IN_PROCESS"]


class PulledAcked(Answer):
    delivery_id: int
    state: Literal["DELIVERED"]


class TrackedDone(Answer):
    """Tracked work reported done by its xid (POST /tracking/done)."""

    xid: str
    track_id: int
    # DONE: reported now; ALREADY: reported done before; GONE: its tracking had expired
    outcome: Literal["DONE", "ALREADY", "GONE"]


class DeadLetter(Answer):
    delivery_id: int
    subscription_id: int
    attempt: int
    # The receiver's answer: its status and at most 200 bytes of its body, escaped.
    last_error: str | None
    correlation_id: str
    routing_key: str
    room: str


class RedrivenDeadLetters(Answer):
    redriven: list[int]


class QueueLogRow(_Open):
    """One state a delivery entered (the broker seed's queue message log)."""

    id: int
    delivery_id: int
    attempt: int | None
    state: Literal["Pending", "In process", "Completed", "Error"]
    routing_key: str
    message: str
    scheduled_start_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    # the log_exception row of an Error (GET /exceptions/{id})
    exception_id: int | None
    # bytes the attempt allocated at its peak; None where orderly did not run it (PULL)
    memory_used: int | None
    correlation_id: str
    subscription_id: int


class ExceptionListed(_Open):
    id: int
    time: datetime
    type: str
    message: str
    delivery_id: int
    attempt: int
    correlation_id: str
    subscription_id: int
    routing_key: str
    has_traceback: bool


class ExceptionDetail(_Open):
    id: int
    time: datetime
    type: str
    message: str
    # the Python traceback when it was thrown; None for a failure nothing threw
    traceback: str | None
    delivery_id: int
    attempt: int
    correlation_id: str
    subscription_id: int
    routing_key: str


class PublishedRow(_Open):
    """One attempt of an event for a subscription (published_messages)."""

    id: int
    delivery_id: int | None
    correlation_id: str
    event_id: int
    subscription_id: int | None
    attempt: int
    outcome: Literal["PENDING", "DELIVERED", "FAILED", "DEAD", "EXPIRED"]
    published_at: datetime
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    error: str | None
    next_delay_ms: int | None


class SourceSystem(Answer):
    name: str
    confirmation_url: str | None
    timeout_ms: int


class KeyOwns(Answer):
    source_systems: list[str]
    origins: list[str]
    subscriptions: list[int]


class Key(Answer):
    name: str
    prefix: str
    scopes: list[str]
    # What the key may act on; null: every object.
    owns: KeyOwns | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


class KeyMade(Key):
    # Shown in this answer only: orderly keeps its SHA-256, never the token.
    token: str


class Health(Answer):
    status: Literal["ok"]


class Ready(Answer):
    status: Literal["ready"]
    checked: list[str]
