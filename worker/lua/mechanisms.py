"""The calls of the shared mechanisms' scripts: due sets (due_*.lua), leases (lease_*.lua), the
wake-up mark of the message workers (wake*.lua) and the API's token buckets (rate_take.lua)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orderly.worker.core.scripts import Call, Scripts, as_text

# --- due sets (worker.core.due.RedisDueSet) ---------------------------------------------------


def due_take(
    scripts: Scripts, *, due_set: str, leased_set: str, now_ms: int, limit: int, lease_end_ms: int
) -> list[str]:
    """The due members taken (earliest due first), leased until ``lease_end_ms``: the take's
    fencing token."""
    taken = scripts.run(
        Call("due_take", keys=(due_set, leased_set), args=(now_ms, limit, lease_end_ms))
    )
    return [as_text(m) for m in taken]


def due_settle(
    scripts: Scripts, *, due_set: str, leased_set: str, lease_end_ms: int, members: list[str]
) -> int:
    """Forget ``members`` still leased by the take ``lease_end_ms``; how many were."""
    return int(
        scripts.run(Call("due_settle", keys=(due_set, leased_set), args=(lease_end_ms, *members)))
    )


def due_release(
    scripts: Scripts,
    *,
    due_set: str,
    leased_set: str,
    now_ms: int,
    lease_end_ms: int,
    members: list[str],
) -> int:
    """Make ``members`` still leased by the take ``lease_end_ms`` due at once; how many were."""
    return int(
        scripts.run(
            Call(
                "due_release",
                keys=(due_set, leased_set),
                args=(now_ms, lease_end_ms, *members),
            )
        )
    )


# --- leases (worker.core.lease.RedisLease) and the wake-up mark (worker.messages.wake) --------


def lease_take(scripts: Scripts, *, lease: str, token: str, ttl_ms: int) -> bool:
    """Whether ``token`` now holds the lease (nobody held it)."""
    return bool(scripts.run(Call("lease_take", keys=(lease,), args=(token, ttl_ms))))


def lease_hold(scripts: Scripts, *, lease: str, token: str, ttl_ms: int) -> bool:
    """Whether ``token`` holds the lease now: taken (nobody held it) or renewed (it did)."""
    return bool(scripts.run(Call("lease_hold", keys=(lease,), args=(token, ttl_ms))))


def lease_give_up(scripts: Scripts, *, lease: str, token: str) -> bool:
    """Whether the lease was released (``token`` held it)."""
    return bool(scripts.run(Call("lease_give_up", keys=(lease,), args=(token,))))


def wake(scripts: Scripts, *, mark: str, pokes: str, ttl_ms: int, stale_ms: int = 0) -> bool:
    """Whether the caller must send a task: the mark was absent, its holder busy, or (with
    ``stale_ms``) set longer ago than that, and is now 'woken' (a looking holder is poked
    instead)."""
    args = (ttl_ms, stale_ms) if stale_ms else (ttl_ms,)
    return bool(int(scripts.run(Call("wake", keys=(mark, pokes), args=args))))


def wake_swap(scripts: Scripts, *, mark: str, expected: str, new: str, ttl_ms: int) -> bool:
    """Whether the mark moved from ``expected`` to ``new`` (False: it is another's, or gone)."""
    return bool(int(scripts.run(Call("wake_swap", keys=(mark,), args=(expected, new, ttl_ms)))))


# --- the API's token buckets (worker.core.ratelimit) -------------------------------------------

# The buckets' script, registered on the rate limiter's own clients (an asyncio one included).
RATE_TAKE = "rate_take"


@dataclass(frozen=True)
class RateTaken:
    allowed: bool
    retry_after_ms: int  # 0 when allowed, else until the cost would be there again
    remaining: int  # tokens left, rounded down
    taken: int  # tokens taken: the cost, or up to ``most`` (0 when refused)


def rate_take_call(
    *, bucket: str, rate_per_s: float, burst: int, cost: int, now_ms: int, most: int | None = None
) -> Call:
    """One take from a bucket, for the caller's client to run (the API's is an asyncio one):
    ``cost`` tokens, or as many as are there up to ``most`` once the cost is."""
    args: tuple[str | int, ...] = (repr(float(rate_per_s)), burst, cost, now_ms)
    return Call("rate_take", keys=(bucket,), args=args if most is None else (*args, most))


def rate_taken(reply: Any) -> RateTaken:
    """rate_take.lua's reply: {allowed, retry after (ms), tokens left, tokens taken}."""
    allowed, retry_ms, remaining, taken = (int(v) for v in reply)
    return RateTaken(allowed == 1, retry_ms, remaining, taken)
