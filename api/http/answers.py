"""The documented answers of the API's routes (their OpenAPI response schemas).

The routes build their answers from the mechanisms' rows and views; the models of what those
answers hold live with the clients (orderly.client.answers), which read answers into them,
and the fuzz test checks every answer it gets against them. :func:`answers` is a route's
``responses``.
"""

from __future__ import annotations

from typing import Any

from orderly.client.answers import (
    Accepted,
    Acked,
    AwaitedDate,
    BatchAccepted,
    BatchItem,
    Cancelled,
    Channel,
    Conversation,
    ConversationAwaited,
    ConversationDeleted,
    ConversationMessage,
    DeadLetter,
    EventTypeAdded,
    EventTypeVersion,
    ExceptionDetail,
    ExceptionListed,
    Health,
    Key,
    KeyMade,
    KeyOwns,
    MessageDetail,
    MessageRow,
    Published,
    PublishedRow,
    PublisherAdded,
    Pulled,
    PulledAcked,
    PulledVisibility,
    QueueLogRow,
    Ready,
    Redriven,
    RedrivenDeadLetters,
    RemovalScheduled,
    Replayed,
    ResponseAccepted,
    Room,
    RoomListed,
    SigningSecret,
    SourceSystem,
    Subscription,
    SubscriptionChanged,
    SubscriptionCreated,
    SubscriptionListed,
    TrackedDone,
)

__all__ = [
    "Accepted",
    "Acked",
    "AwaitedDate",
    "BatchAccepted",
    "BatchItem",
    "Cancelled",
    "Channel",
    "Conversation",
    "ConversationAwaited",
    "ConversationDeleted",
    "ConversationMessage",
    "DeadLetter",
    "EventTypeAdded",
    "EventTypeVersion",
    "ExceptionDetail",
    "ExceptionListed",
    "Health",
    "Key",
    "KeyMade",
    "KeyOwns",
    "MessageDetail",
    "MessageRow",
    "Published",
    "PublishedRow",
    "PublisherAdded",
    "Pulled",
    "PulledAcked",
    "PulledVisibility",
    "QueueLogRow",
    "Ready",
    "Redriven",
    "RedrivenDeadLetters",
    "RemovalScheduled",
    "Replayed",
    "ResponseAccepted",
    "Room",
    "RoomListed",
    "SigningSecret",
    "SourceSystem",
    "Subscription",
    "SubscriptionChanged",
    "SubscriptionCreated",
    "SubscriptionListed",
    "TrackedDone",
    "answers",
]


def answers(model: Any, *, created: bool = False, repeat: bool = False) -> dict[int | str, Any]:
    """A route's documented successes: 200 (or 201 when it ``created``, and 200 too when a
    ``repeat`` answers what was stored before) with ``model``."""
    if not created:
        return {200: {"model": model, "description": "done"}}
    found: dict[int | str, Any] = {201: {"model": model, "description": "created"}}
    if repeat:
        found[200] = {"model": model, "description": "stored before: the same answer again"}
    return found
