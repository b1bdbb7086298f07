"""Waking a worker to claim due messages: one mark in Redis says whether one is looking.

Intake stores a message NEW and wakes a worker instead of sending a task per message; the
woken worker claims due messages from PostgreSQL in batches (worker.messages.batches). The mark
(``wake.lua``) is absent (nobody looks), ``woken`` (a task was sent and has not begun),
``looking:<token>`` (the woken worker, between claims, claims again soon) or
``busy:<token>`` (it claims or runs handlers now). :meth:`Wake.wake` sends a task only when
the mark is absent or its holder busy: a steady stream costs one script a message while a
worker polls for it, and a message that comes while the worker runs a slow handler wakes
another worker instead of waiting behind it.

The rule that loses nothing: whoever moves the mark away from ``looking`` (to ``busy``, or
away altogether) claims afterwards, so a message committed while it looked (whose wake-up
sent nothing) is seen by that claim; one committed while it is busy, or after it let go,
wakes a worker of its own. The holder moves the mark only while it is still its own
(``wake_swap.lua``, ``lease_give_up.lua``): a task woken while it was busy takes over.

After a claim that found nothing, the looking worker waits on a poke rather than a timer: a
submission that finds it looking pushes one (``wake.lua``, in the same step), and its wait (a
BLPOP) ends at once, so that a message is claimed as soon as it is committed and a worker
waiting for more costs nothing while none comes.

The mark expires: a wake-up whose task was lost is replaced by the next submission after
that. And beat wakes a worker whenever messages have waited NEW for longer than a second
(``orderly.beat.agents.wake_due``) past a looking or woken mark that has not moved for
``STALE_MS``: a mark whose holder died with its worker must not hold the store back until it
expires, while a live holder (it moves its mark at every claim) or a task just sent is left
alone, and a backlog gets no task a second. (A woken task queued behind a backlog while every
worker is busy looks stale too: beat then sends one more every ``STALE_MS`` while messages
wait; each claims in batches when a worker is free.)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import redis

from orderly.models.keys import PROCESS_WAKE_KEY
from orderly.worker import lua
from orderly.worker.core.lease import RedisLease, new_token
from orderly.worker.core.scripts import Scripts, as_text

log = logging.getLogger(__name__)

# Longer than a worker stays between two moves of its mark (every move renews it), short
# enough that a lost wake-up is replaced soon.
WAKE_TTL_MS = 10_000

# A looking or woken mark that has not moved for this long, while messages wait, is a dead
# holder's or a lost task's (beat's wake-up passes it).
STALE_MS = 3_000

WOKEN = "woken"
# The shortest wait for a poke (s).
MIN_WAIT_S = 0.001


class Wake:
    def __init__(
        self, client: redis.Redis, key: str = PROCESS_WAKE_KEY, ttl_ms: int = WAKE_TTL_MS
    ) -> None:
        self._client = client
        self._scripts = Scripts(client)
        self._key = key
        self._pokes = f"{key}:pokes"
        self._ttl_ms = ttl_ms

    def wake(self, send: Callable[[], object], stale_ms: int = 0) -> bool:
        """Send a task (``send``) unless a worker is looking or one was woken already; whether
        one was sent. With ``stale_ms``, a looking or woken mark set (or last moved) longer
        ago than that is passed: its holder was killed while it looked, or its task was lost
        with a worker (beat's wake-up of messages that waited). Raises what Redis or ``send``
        raised (a mark it set is taken back)."""
        if not lua.wake(
            self._scripts,
            mark=self._key,
            pokes=self._pokes,
            ttl_ms=self._ttl_ms,
            stale_ms=stale_ms,
        ):
            return False
        try:
            send()
        except BaseException:
            # No task went out: the mark must not hold back the next wake-up.
            with contextlib.suppress(redis.RedisError):
                RedisLease(self._scripts, self._key).give_up(WOKEN)
            raise
        return True

    def hold(self) -> Holder:
        """The woken worker takes the mark: it is looking."""
        return Holder(self, new_token())

    def value(self) -> str | None:
        """The mark as it stands (None: absent)."""
        found = self._client.get(self._key)
        return None if found is None else as_text(found)

    def _set(self, value: str) -> None:
        self._client.set(self._key, value, px=self._ttl_ms)

    def _swap(self, old: str, new: str) -> bool:
        return lua.wake_swap(
            self._scripts, mark=self._key, expected=old, new=new, ttl_ms=self._ttl_ms
        )

    def _wait_poke(self, seconds: float) -> bool:
        # At least a millisecond: a shorter timeout is 0, "for ever", to a Redis before 7.0.8.
        return self._client.blpop([self._pokes], timeout=max(seconds, MIN_WAIT_S)) is not None

    def _give_up(self, value: str) -> bool:
        return RedisLease(self._scripts, self._key).give_up(value)


class Holder:
    """The woken worker's side of the mark. ``held`` turns False for good once the mark is
    another's (a worker woken while this one was busy took over)."""

    def __init__(self, wake: Wake, token: str) -> None:
        self._wake = wake
        self._looking = f"looking:{token}"
        self._busy = f"busy:{token}"
        self._state = self._looking
        wake._set(self._looking)
        self.held = True

    def busy(self) -> bool:
        """About to claim and run handlers: what comes meanwhile wakes another worker."""
        return self._move(self._busy)

    def looking(self) -> bool:
        """Between claims: what comes meanwhile waits for this worker's next claim."""
        return self._move(self._looking)

    def _move(self, new: str) -> bool:
        if self.held and self._state != new:
            self.held = self._wake._swap(self._state, new)
            self._state = new
        return self.held

    def wait(self, seconds: float) -> bool:
        """Looking: wait up to ``seconds`` for a submission's poke; whether one came. Redis
        failing, it sleeps instead (and says none came): the next claim looks anyway."""
        try:
            return self._wake._wait_poke(seconds)
        except redis.RedisError:
            log.exception("waiting for a poke failed")
            time.sleep(seconds)
            return False

    def release(self) -> bool:
        """Let go of the mark (if still held): from now on every submission wakes a worker.
        The caller claims once more afterwards."""
        if not self.held:
            return False
        self.held = False
        return self._wake._give_up(self._state)
