"""Publish/subscribe: rooms (exchanges), subscriptions (bindings), publish and delivery.

One routing model speaks both seeds: a room has subscriptions that select events by event
type and/or routing-key pattern (topic rules: ``*`` one word, ``#`` zero or more), and each
names a destination: a PUSH url, a PULL queue of its own, or a consumer handler chosen by
name. PostgreSQL holds every event and delivery; the partial index on
``delivery.scheduled_at`` of PENDING rows is the due-time index the ticker moves to the
broker when due (worker.core.due), so a ``$delay`` or a retry wait is never held in worker
memory nor in the broker.

``admin`` defines rooms, event types, publishers and subscriptions; ``publish`` stores
events; ``delivery`` sends them and records every attempt (``due``: when; ``endpoints``: each
endpoint's pace and health); ``replay`` sends a window of them again; ``pull`` serves PULL
subscribers and dead letters, and ``waiting`` wakes the pulls that wait; ``routing`` matches
routing keys; ``logs`` reads the queue log, its exceptions and the published_messages rows.
"""

from orderly.worker.pubsub.admin import (
    EventTypeIn,
    RoomIn,
    SubscriptionIn,
    add_event_type,
    add_publisher,
    create_room,
    create_subscription,
    list_event_types,
    list_rooms,
    list_subscriptions,
    room_view,
    set_subscription_status,
    subscription_deliveries,
    update_room,
    update_subscription,
)
from orderly.worker.pubsub.claims import Attempt, Claimed, Push
from orderly.worker.pubsub.consumers import Consumers, consumers
from orderly.worker.pubsub.delivery import deliver, deliver_batch
from orderly.worker.pubsub.due import due_deliveries, upkeep
from orderly.worker.pubsub.event_rows import QUEUED_LEASE_S
from orderly.worker.pubsub.logs import exception_get, exception_list, published_log, queue_log
from orderly.worker.pubsub.publish import (
    BATCH,
    Published,
    PublishIn,
    hand_off,
    publish,
    publish_many,
    publish_message,
)
from orderly.worker.pubsub.pull import (
    ack_pulled,
    dead_letter_counts,
    dead_letters,
    extend_pulled,
    pull,
    redrive,
)
from orderly.worker.pubsub.routing import order_value, topic_matches

__all__ = [
    "BATCH",
    "QUEUED_LEASE_S",
    "Attempt",
    "Claimed",
    "Consumers",
    "EventTypeIn",
    "PublishIn",
    "Published",
    "Push",
    "RoomIn",
    "SubscriptionIn",
    "ack_pulled",
    "add_event_type",
    "add_publisher",
    "consumers",
    "create_room",
    "create_subscription",
    "dead_letter_counts",
    "dead_letters",
    "deliver",
    "deliver_batch",
    "due_deliveries",
    "exception_get",
    "exception_list",
    "extend_pulled",
    "hand_off",
    "list_event_types",
    "list_rooms",
    "list_subscriptions",
    "order_value",
    "publish",
    "publish_many",
    "publish_message",
    "published_log",
    "pull",
    "queue_log",
    "redrive",
    "room_view",
    "set_subscription_status",
    "subscription_deliveries",
    "topic_matches",
    "update_room",
    "update_subscription",
    "upkeep",
]
