"""The handlers benchmarks/scheduling.py runs in its workers (ORDERLY_HANDLER_MODULES).

Each records what the benchmark measures in the bench Redis DB: when a try started and ended
(wall clock, ms), per message or per funnel.
"""

from __future__ import annotations

import json
import os
import time

import redis

from orderly.worker.handlers import MessageContext, Retry, registry

SERVICE = "bench_sched"
TRIES = "bench:sched:tries"  # list of JSON {"msg", "key", "start", "end", "try"}
ABORTED = "bench:sched:aborted"  # list of JSON {"msg", "end", "how"}

# The failing handler's retry policy: the benchmark compares the gaps with its formula.
RETRY = Retry(delay_s=0.5, multiplier=2.0, attempts=4, max_delay_s=30.0)
HOLD_S = 0.05

_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["ORDERLY_REDIS_URL"])
    return _client


def _now_ms() -> float:
    return time.time() * 1000


def _record(ctx: MessageContext, start: float) -> None:
    entry = {
        "msg": ctx.msg_id,
        "key": ctx.funnel_value,
        "start": start,
        "end": _now_ms(),
        "try": ctx.failed_count,
    }
    _redis().rpush(TRIES, json.dumps(entry))


@registry.register(SERVICE, "noop")
def noop(ctx: MessageContext) -> None:
    _record(ctx, _now_ms())


@registry.register(SERVICE, "hold")
def hold(ctx: MessageContext) -> None:
    start = _now_ms()
    time.sleep(HOLD_S)
    _record(ctx, start)


@registry.register(SERVICE, "fail", retry=RETRY)
def fail(ctx: MessageContext) -> None:
    _record(ctx, _now_ms())
    raise RuntimeError(f"try {ctx.failed_count} fails, as this handler always does")


@registry.register(SERVICE, "long", time_limit_s=60.0)
def long(ctx: MessageContext) -> None:
    """Runs until it is aborted: half of them look at ``ctx.aborted``, half ignore it."""
    cooperative = ctx.msg_id % 2 == 0
    _redis().rpush(f"bench:sched:started:{ctx.msg_id}", "1")
    how = "stopped"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if cooperative and ctx.aborted:
                how = "returned"
                return
            time.sleep(0.01)
    finally:
        _redis().rpush(ABORTED, json.dumps({"msg": ctx.msg_id, "end": _now_ms(), "how": how}))
