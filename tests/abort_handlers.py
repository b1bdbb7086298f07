"""Handlers for the abort tests: one that stops when it sees ``ctx.aborted``, and ones that
never look (a sleep, a busy loop without a time limit). Each records ``<event>:<pid>:<time>``
in a Redis list (``{"key": k}``, default :data:`EVENTS`), the time being ``time.time()``."""

from __future__ import annotations

import json
import os
import time

import redis

from orderly.worker.core.limits import Aborted
from orderly.worker.handlers import MessageContext, registry
from orderly.worker.settings import get_settings

EVENTS = "orderly:test:abort"
# The longest any of them runs when nothing stops it.
RUN_S = 30.0


def record(ctx: MessageContext, event: str) -> None:
    key = str(json.loads(ctx.payload or "{}").get("key", EVENTS))
    client = redis.Redis.from_url(get_settings().redis_url)
    try:
        client.rpush(key, f"{event}:{os.getpid()}:{time.time():.6f}")
    finally:
        client.close()


@registry.register("abort", "cooperative", time_limit_s=60)
def cooperative(ctx: MessageContext) -> None:
    """Loops until it sees its abort, then returns: ``noticed``."""
    record(ctx, "start")
    deadline = time.monotonic() + RUN_S
    while not ctx.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    record(ctx, "noticed" if ctx.aborted else "end")


@registry.register("abort", "sleeping", time_limit_s=60)
def sleeping(ctx: MessageContext) -> None:
    """Sleeps and never looks: stopped, it records ``stopped`` and lets the stop go on."""
    record(ctx, "start")
    try:
        time.sleep(RUN_S)
    except Aborted:
        record(ctx, "stopped")
        raise
    record(ctx, "end")


@registry.register("abort", "spinning")
def spinning(ctx: MessageContext) -> None:
    """A busy loop under no time limit of its own (the default's, unless that is 0)."""
    record(ctx, "start")
    deadline = time.monotonic() + RUN_S
    try:
        while time.monotonic() < deadline:
            pass
    except Aborted:
        record(ctx, "stopped")
        raise
    record(ctx, "end")


@registry.register("abort", "quick", time_limit_s=60)
def quick(ctx: MessageContext) -> None:
    record(ctx, "done")
