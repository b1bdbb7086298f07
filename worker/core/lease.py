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

    def give_up(self, token: str) -> bool:
        """Release the lease if ``token`` holds it."""
        return lua.lease_give_up(self.scripts, lease=self.key, token=token)
