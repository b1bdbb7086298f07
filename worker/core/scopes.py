"""The scopes an API key may hold (worker.keys): what each lets its holder do over HTTP."""

from __future__ import annotations

PRODUCE = "produce"  # messages, conversation requests and responses, external responses
CONSUME = "consume"  # pull and acknowledge pulled events, report tracked work done
OPERATE = "operate"  # list, show, cancel, re-drive; conversations, dead letters
ADMIN = "admin"  # channels, rooms, event types, publishers, subscriptions, source systems, keys
METRICS = "metrics"  # GET /metrics
IMPERSONATE = "impersonate"  # publish in another user's name (the key is the impersonator)
PUBLISH_ANY = "publish:*"  # publish to every room; publish:<room> to one
SCOPES = (PRODUCE, PUBLISH_ANY, CONSUME, OPERATE, ADMIN, METRICS, IMPERSONATE)


def publish_scope(room: str) -> str:
    return f"publish:{room}"
