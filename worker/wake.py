"""Waking a worker to claim due messages: one wake-up pending at a time.

Intake stores a message NEW and wakes a worker instead of sending a task per message; the
woken worker claims due messages from PostgreSQL in batches (worker.batches).
:meth:`Wake.wake` sends a task only when no wake-up is pending (``SET NX``), so a burst of
submissions costs one task, not one per message. The woken worker clears the mark before it
claims: a message committed before the clear is seen by its claim, and one committed after it
finds no mark and wakes a worker of its own. No message can fall between the two.

The mark expires (``ttl_ms``): a wake-up whose task was lost is replaced by the next
submission after that, and beat wakes a worker whenever messages have waited NEW for longer
than a second (``beat.agents.wake_due``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import redis

from models.keys import PROCESS_WAKE_KEY

# Long enough that a busy queue does not collect a second wake-up per burst; short enough that
# a lost one is replaced soon.
WAKE_TTL_MS = 10_000


class Wake:
    def __init__(
        self, client: redis.Redis, key: str = PROCESS_WAKE_KEY, ttl_ms: int = WAKE_TTL_MS
    ) -> None:
        self._client = client
        self._key = key
        self._ttl_ms = ttl_ms

    def wake(self, send: Callable[[], object]) -> bool:
        """Mark a wake-up pending and ``send`` its task, unless one is pending already.
        Whether a task was sent. Raises what Redis or ``send`` raised (no mark is left)."""
        if not self._client.set(self._key, b"1", nx=True, px=self._ttl_ms):
            return False
        try:
            send()
        except BaseException:
            # No task went out: the mark must not hold back the next wake-up.
            with contextlib.suppress(redis.RedisError):
                self._client.delete(self._key)
            raise
        return True

    def clear(self) -> None:
        """The woken worker is about to claim: what comes from now on wakes a worker anew."""
        self._client.delete(self._key)

    def pending(self) -> bool:
        return bool(self._client.exists(self._key))
