"""Funnel components' start rates: how many messages of one funnel value may start a second
(``funnel_limit.rate_per_s``, a bucket of ``burst``). One token bucket per funnel value in
Redis, taken by the claim (worker.messages.batches) through the one limiter
(worker.core.ratelimit, the API's too; outbound endpoints use it the same way).

A claim takes a token for each funnel message it chose whose component has a rate (all in one
pipelined round trip); one that gets none is left due again when its token will be there (its
row's due time), never claimed before. The take is atomic in Redis and comes before the
claim: a claim that then takes nothing wastes the token, so a funnel may start fewer than its
rate, never more. Should Redis
not answer, claims go on unlimited (fail open, logged): a rate protects what the handlers
call, it must not stop the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import redis

from orderly.models.keys import RateKeys
from orderly.worker.core.clock import SYSTEM, Clock, now_ms
from orderly.worker.core.ratelimit import Buckets, Limit


class Startable(Protocol):
    """A message a claim chose or took, with its funnel's start rate (None: none)."""

    @property
    def msg_id(self) -> int: ...

    @property
    def funnel_key(self) -> int | None: ...

    @property
    def rate_per_s(self) -> float | None: ...

    @property
    def burst(self) -> int | None: ...


class StartRates:
    """The start buckets of the funnels, on one Redis client."""

    def __init__(
        self, client: redis.Redis, clock: Clock = SYSTEM, keys: RateKeys | None = None
    ) -> None:
        self._buckets = Buckets(client)
        self._clock = clock
        self._keys = keys or RateKeys()

    def refused(self, chosen: Sequence[Startable]) -> dict[int, int]:
        """Take a start token for each chosen message whose funnel has a rate: the ones that got
        none, with the ms until their token is there."""
        rated = [
            (c.msg_id, self._keys.funnel(c.funnel_key), Limit(c.rate_per_s, c.burst))
            for c in chosen
            if c.funnel_key is not None and c.rate_per_s is not None and c.burst is not None
        ]
        return self._buckets.refused(rated, now_ms(self._clock), "funnel start rates") or {}
