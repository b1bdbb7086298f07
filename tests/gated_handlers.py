"""A handler that holds until the test lets it go, for measuring what runs at once."""

from __future__ import annotations

import json

import redis

from orderly.worker.handlers import MessageContext, registry
from orderly.worker.settings import get_settings


@registry.register("gate", "hold", time_limit_s=120)
def hold(ctx: MessageContext) -> None:
    """``{"key": k}``: records ``start:<correlation_id>`` in the Redis list ``k``, waits for a
    token in ``k:go`` (at most 100 s), then records ``end:<correlation_id>``."""
    key = str(json.loads(ctx.payload or "{}")["key"])
    client = redis.Redis.from_url(get_settings().redis_url)
    try:
        client.rpush(key, f"start:{ctx.correlation_id}")
        client.blpop([f"{key}:go"], timeout=100)
        client.rpush(key, f"end:{ctx.correlation_id}")
    finally:
        client.close()
