"""Leases and claims: who holds something, until when, proven by a fencing token.

Every claim orderly makes (a conversation's drain, a delivery batch, a pulled message, a
confirmation try, a due item handed to the broker) is identified the same way: a fresh
:func:`new_token` that the holder presents with every later change. A change whose token no
longer matches is refused (the claim was taken over), so a holder that was too slow cannot
overwrite its successor's work. In Redis a lease is a key holding the token with an expiry
(:class:`RedisLease`); in PostgreSQL a claim is a ``claim`` column checked in the WHERE of
every statement that settles it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from orderly.worker import lua
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.scripts import Scripts

# A claim records the backend pid of the connection its worker holds (a message, a delivery
# batch, a confirmation try, a drain): once PostgreSQL no longer shows that backend, the
# worker is dead. The grace only covers a claim committed in the very instant its worker's
# connection was replaced.
ORPHAN_GRACE_S = 1.0


def new_token() -> str:
    """A fencing token: unique, unguessable, 32 hex characters."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class RedisLease:
    """One lease key: taken if free, given up only by its holder (one script each). A holder
    that goes on renews it in the same script that checks it (e.g. advance.lua)."""

    scripts: Scripts
    key: str

    def take(self, token: str, ttl_ms: int) -> bool:
        """Hold the lease for ``ttl_ms`` if nobody does."""
        return lua.lease_take(self.scripts, lease=self.key, token=token, ttl_ms=ttl_ms)

    def hold(self, token: str, ttl_ms: int) -> bool:
        """Hold the lease for ``ttl_ms`` if nobody does, or renew it if ``token`` does."""
        return lua.lease_hold(self.scripts, lease=self.key, token=token, ttl_ms=ttl_ms)

    def give_up(self, token: str) -> bool:
        """Release the lease if ``token`` holds it."""
        return lua.lease_give_up(self.scripts, lease=self.key, token=token)


class Leadership:
    """One holder among processes that would each do the same (beats running the agents): a
    Redis lease (:class:`RedisLease`) taken by the first to ask and renewed by it while it
    asks; when it stops asking (stopped, killed, its node STOPPED) the lease runs out after
    ``hold_ms`` and the next to ask takes it. Asked often, the holder renews once half its
    lease is gone and the others ask once per ``hold_ms / 3`` (one script each), so a holder
    costs two round trips per ``hold_ms`` and takes over within ``4/3 hold_ms``. A holder
    that paused past its lease may act beside its successor for a moment: for work that is
    safe to run twice (it was run by every beat before), to save the others' polling."""

    def __init__(
        self, scripts: Scripts, key: str, *, hold_ms: int = 3_000, clock: Clock = SYSTEM
    ) -> None:
        self._lease = RedisLease(scripts, key)
        self._token = new_token()
        self._hold_ms = hold_ms
        self._clock = clock
        self._until = 0.0  # the monotonic time the lease is ours until (taken before asking)
        self._ask_at = 0.0  # not holding it: when to ask again

    def leads(self) -> bool:
        """Whether this one holds the lease (taken or renewed now, or recently enough)."""
        now = self._clock.monotonic()
        hold_s = self._hold_ms / 1000
        if self._until - now > hold_s / 2:
            return True
        if not self._until and now < self._ask_at:
            return False
        held = self._lease.hold(self._token, self._hold_ms)
        self._until = now + hold_s if held else 0.0
        self._ask_at = now + hold_s / 3
        return held

    def resign(self) -> None:
        """Let the next one lead at once (a process stopping)."""
        if self._until:
            self._lease.give_up(self._token)
            self._until = 0.0
