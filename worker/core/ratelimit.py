"""Token buckets in Redis (worker/lua/rate_take.lua): how much a client may ask of the API, one
atomic take per request, shared by every API process. The keys are built in models/keys.py.

:func:`take` and :class:`Buckets` run on a plain client (threads, tests); :class:`Limiter` is
the API's: on the event loop (``redis.asyncio``), on the clock it is given, and failing open.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
import redis.asyncio
from redis.commands.core import AsyncScript

from orderly.worker import lua
from orderly.worker.core.clients import async_redis_client
from orderly.worker.core.clock import Clock, now_ms
from orderly.worker.core.scripts import Call, source

log = logging.getLogger(__name__)

K = TypeVar("K")

# Redis unreachable: requests pass unlimited (fail open) and Redis is not asked again for this
# long, so that an outage adds no timeout to every request; a warning at most this often.
FAIL_OPEN_PAUSE_S = 1.0
FAIL_OPEN_WARN_EVERY_S = 30.0
# A limiter's Redis calls give up after this: a slow Redis must not hold every request.
REDIS_TIMEOUT_S = 0.5
# A limiter's lease (Limiter): a bucket's tokens for this long at its rate, at most this many,
# taken at once; the unused dropped after LEASE_HELD_S; leases held at most LEASES_HELD (an
# address flood costs their Redis takes, never memory).
LEASE_S = 0.02
LEASE_MAX = 64
LEASE_HELD_S = 1.0
LEASES_HELD = 10_000
# Connections of a limiter to Redis: takes beyond them wait for one (a take holds it for one
# round trip), so that a burst of requests queues instead of opening a connection each.
REDIS_CONNECTIONS = 32


@dataclass(frozen=True)
class Limit:
    """A bucket's shape: ``burst`` tokens at most, refilled at ``per_s`` a second. A rate of 0
    is no limit (the bucket is never asked)."""

    per_s: float
    burst: int

    @property
    def unlimited(self) -> bool:
        return self.per_s <= 0


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    # Until the refused cost would be there (0 when allowed).
    retry_after_s: float
    remaining: int

    @property
    def retry_after(self) -> int:
        """``Retry-After``: whole seconds, rounded up, at least 1."""
        return max(1, math.ceil(self.retry_after_s))


UNLIMITED = Verdict(True, 0.0, 0)
# A token of a lease this process holds (the bucket's count not asked).
LEASED = Verdict(True, 0.0, 0)


def _call(bucket_key: str, limit: Limit, cost: int, at_ms: int, most: int | None = None) -> Call:
    if not 1 <= cost <= limit.burst:
        raise ValueError(f"a cost of {cost} can never be taken from a bucket of {limit.burst}")
    return lua.rate_take_call(
        bucket=bucket_key,
        rate_per_s=limit.per_s,
        burst=limit.burst,
        cost=cost,
        now_ms=at_ms,
        most=most,
    )


def _verdict(taken: lua.RateTaken) -> Verdict:
    return Verdict(taken.allowed, taken.retry_after_ms / 1000, taken.remaining)


class Buckets:
    """The buckets of one plain Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._script = client.register_script(source(lua.RATE_TAKE))

    def take(self, bucket_key: str, limit: Limit, at_ms: int, cost: int = 1) -> Verdict:
        """Take ``cost`` tokens from the bucket at ``at_ms`` (the caller's clock), if it holds
        them."""
        if limit.unlimited:
            return UNLIMITED
        call = _call(bucket_key, limit, cost, at_ms)
        return _verdict(lua.rate_taken(self._script(keys=call.keys, args=call.args)))

    def take_each(self, takes: Sequence[tuple[str, Limit]], at_ms: int) -> list[Verdict]:
        """One token from each bucket (key, limit), in order, in one pipelined round trip; a
        bucket named twice gives two tokens, the first take first."""
        verdicts: list[Verdict | None] = [
            UNLIMITED if limit.unlimited else None for _, limit in takes
        ]
        pipe = self._client.pipeline(transaction=False)
        for (key, limit), verdict in zip(takes, verdicts, strict=True):
            if verdict is None:
                call = _call(key, limit, 1, at_ms)
                self._script(keys=call.keys, args=call.args, client=pipe)
        replies = iter(pipe.execute() if len(pipe) else [])
        return [v if v is not None else _verdict(lua.rate_taken(next(replies))) for v in verdicts]

    def refused(
        self, takes: Sequence[tuple[K, str, Limit]], at_ms: int, what: str
    ) -> dict[K, int] | None:
        """One token for each item (its id, its bucket, the bucket's limit), in one round trip:
        the ids that got none, with the milliseconds until their token is there. Redis not
        answering refuses nothing (fail open, logged with ``what``): a pace protects what is
        called, it must not stop the work; None says so."""
        if not takes:
            return {}
        try:
            verdicts = self.take_each([(key, limit) for _, key, limit in takes], at_ms)
        except redis.RedisError as exc:
            log.warning("%s not applied (Redis: %s)", what, exc)
            return None
        return {
            item: max(1, round(verdict.retry_after_s * 1000))
            for (item, _, _), verdict in zip(takes, verdicts, strict=True)
            if not verdict.allowed
        }


def take(client: redis.Redis, bucket_key: str, limit: Limit, at_ms: int, cost: int = 1) -> Verdict:
    """One take (:meth:`Buckets.take`) without keeping the registered script."""
    return Buckets(client).take(bucket_key, limit, at_ms, cost)


class Limiter:
    """The buckets of an API process, taken from on its event loop.

    A bucket whose rate is high leases: one take from Redis gets up to :func:`lease_size`
    tokens (what the bucket gives in :data:`LEASE_S`, at most :data:`LEASE_MAX`), which this
    process hands out one a request, so that a busy client costs one Redis call per lease
    instead of one per request. The bucket stays shared: leased tokens are spent in Redis
    when taken, and those still unused after :data:`LEASE_HELD_S` are dropped, so every
    process together never uses more than the bucket gave; since a lease may be used up to
    that long after it was taken, a burst can pass the bucket's by one lease per process, and
    near the limit a process may hold a few tokens while another is refused. While one
    request of a bucket asks Redis, the others of that bucket wait for its answer (a refusal
    answers them all). A bucket too slow for a lease of two is taken from one token a
    request, as it always was.

    When Redis cannot be reached or refuses, every take is allowed (fail open: the API goes
    on serving, unlimited, rather than refusing everyone) and logged; Redis is then left alone
    for :data:`FAIL_OPEN_PAUSE_S`."""

    def __init__(self, url: str, clock: Clock, timeout_s: float = REDIS_TIMEOUT_S) -> None:
        self._url = url
        self._clock = clock
        self._timeout_s = timeout_s
        # One client per event loop: an asyncio connection belongs to the loop it was made in.
        self._bound: tuple[asyncio.AbstractEventLoop, AsyncScript] | None = None
        self._paused_until = float("-inf")
        self._warned_at = float("-inf")
        # bucket -> (tokens of its lease left, until when on the monotonic clock)
        self._leases: dict[str, tuple[int, float]] = {}
        # bucket -> the answer its asker will have (None: ask again): while one asks Redis
        self._asking: dict[str, asyncio.Future[Verdict | None]] = {}

    def _script_on_this_loop(self) -> AsyncScript:
        loop = asyncio.get_running_loop()
        if self._bound is None or self._bound[0] is not loop:
            client = async_redis_client(
                self._url,
                max_connections=REDIS_CONNECTIONS,
                wait_s=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                socket_timeout=self._timeout_s,
            )
            self._bound = (loop, client.register_script(source(lua.RATE_TAKE)))
        return self._bound[1]

    async def take(self, bucket_key: str, limit: Limit) -> Verdict:
        """One token of ``bucket_key``: from this process's lease when it holds one, else from
        Redis."""
        if limit.unlimited:
            return UNLIMITED
        most = lease_size(limit)
        if most == 1:
            return (await self._ask(bucket_key, limit, None))[0]
        while True:
            if self._from_lease(bucket_key):
                return LEASED
            asking = self._asking.get(bucket_key)
            if asking is None:
                break
            theirs = await asyncio.shield(asking)
            if theirs is not None and not theirs.allowed:
                return theirs
        answered: asyncio.Future[Verdict | None] = asyncio.get_running_loop().create_future()
        self._asking[bucket_key] = answered
        answer: Verdict | None = None  # cancelled before an answer: the others ask again
        try:
            verdict, taken = await self._ask(bucket_key, limit, most)
            if taken > 1:
                self._lease(bucket_key, taken - 1)
            answer = verdict
        finally:
            del self._asking[bucket_key]
            answered.set_result(answer)
        return verdict

    def _from_lease(self, bucket_key: str) -> bool:
        held = self._leases.get(bucket_key)
        if held is None:
            return False
        left, until = held
        if self._clock.monotonic() >= until:
            del self._leases[bucket_key]  # dropped: spent in Redis, never handed out
            return False
        if left <= 1:
            del self._leases[bucket_key]
        else:
            self._leases[bucket_key] = (left - 1, until)
        return True

    def _lease(self, bucket_key: str, tokens: int) -> None:
        if len(self._leases) >= LEASES_HELD:
            self._leases.pop(next(iter(self._leases)))  # the oldest: its tokens dropped
        self._leases[bucket_key] = (tokens, self._clock.monotonic() + LEASE_HELD_S)

    async def _ask(self, bucket_key: str, limit: Limit, most: int | None) -> tuple[Verdict, int]:
        """Redis's verdict on one token (up to ``most``) and how many it gave."""
        if self._clock.monotonic() < self._paused_until:
            return UNLIMITED, 1
        call = _call(bucket_key, limit, 1, now_ms(self._clock), most)
        try:
            reply = await self._script_on_this_loop()(keys=call.keys, args=call.args)
        except (redis.RedisError, OSError) as exc:
            self._fail_open(exc)
            return UNLIMITED, 1
        taken = lua.rate_taken(reply)
        return _verdict(taken), taken.taken

    def _fail_open(self, exc: Exception) -> None:
        now = self._clock.monotonic()
        self._paused_until = now + FAIL_OPEN_PAUSE_S
        if now - self._warned_at >= FAIL_OPEN_WARN_EVERY_S:
            self._warned_at = now
            log.warning("rate limits not applied (Redis: %s): requests pass unlimited", exc)


def lease_size(limit: Limit) -> int:
    """Tokens an API process takes from ``limit``'s bucket at once: what it gives in
    :data:`LEASE_S`, at most :data:`LEASE_MAX` and a quarter of its burst; 1 for a slow one."""
    return max(1, min(LEASE_MAX, int(limit.per_s * LEASE_S), limit.burst // 4))
