"""PULL consumers that wait (``GET …/messages?wait_ms=``): a long poll that holds no
PostgreSQL connection while it waits.

A publish that gives a PULL subscription a delivery due now PUBLISHes the subscription's
Redis channel after its commit (:func:`announce`). Each API process listens to every such
channel with one pattern subscription (:class:`PullWaiters`) and wakes the pulls of that
subscription waiting in it, which then take from PostgreSQL again. A waiting pull is
registered before it first looks, so a publish between its look and its wait still wakes it;
it also looks again every ``recheck_s`` (a redelivery after a visibility timeout, a delayed
event coming due, or a notice lost with Redis, are seen that late at most).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis
import redis.asyncio

from orderly.models.keys import PullKeys
from orderly.worker.core.clients import async_redis_client

log = logging.getLogger(__name__)

# The longest a pull may wait (SQS's ReceiveMessage WaitTimeSeconds is at most 20 s too).
MAX_WAIT_MS = 20_000
RECHECK_S = 1.0


def announce(
    client: redis.Redis, subscription_ids: Iterable[int], keys: PullKeys | None = None
) -> None:
    """Tell the waiting pulls of these PULL subscriptions that a delivery is there (after the
    commit). Redis not answering only delays them until their next look (logged)."""
    keys = keys or PullKeys()
    ids = sorted(set(subscription_ids))
    if not ids:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for subscription_id in ids:
            pipe.publish(keys.channel(subscription_id), b"1")
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("waiting pulls of %s not told (Redis: %s)", ids, exc)


class PullWaiters:
    """The pulls waiting in this process, by subscription, and the one listener that wakes
    them (started with the first wait, on the running event loop)."""

    def __init__(
        self, url: str, keys: PullKeys | None = None, recheck_s: float = RECHECK_S
    ) -> None:
        self._url = url
        self._keys = keys or PullKeys()
        self.recheck_s = recheck_s
        self._waiting: dict[int, set[asyncio.Event]] = {}
        self._listener: asyncio.Task[None] | None = None

    def register(self, subscription_id: int) -> asyncio.Event:
        """A pull about to look: set when an event for it may be there."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())
        event = asyncio.Event()
        self._waiting.setdefault(subscription_id, set()).add(event)
        return event

    def unregister(self, subscription_id: int, event: asyncio.Event) -> None:
        waiting = self._waiting.get(subscription_id)
        if waiting is not None:
            waiting.discard(event)
            if not waiting:
                del self._waiting[subscription_id]

    async def wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Until ``event`` is set or ``timeout_s`` (at most ``recheck_s``) passed."""
        try:
            await asyncio.wait_for(event.wait(), min(timeout_s, self.recheck_s))
        except TimeoutError:
            return False
        return True

    async def _listen(self) -> None:
        while True:
            client = async_redis_client(self._url)
            try:
                async with client.pubsub() as channels:
                    await channels.psubscribe(self._keys.pattern)
                    async for message in channels.listen():
                        if message.get("type") != "pmessage":
                            continue
                        channel = message["channel"]
                        name = channel.decode() if isinstance(channel, bytes) else str(channel)
                        subscription_id = self._keys.subscription_of(name)
                        for event in self._waiting.get(subscription_id or 0, ()):
                            event.set()
            except (redis.RedisError, OSError) as exc:
                log.warning(
                    "waiting pulls not woken by Redis (%s): they look every %.1f s",
                    exc,
                    self.recheck_s,
                )
                await asyncio.sleep(self.recheck_s)
            finally:
                await client.aclose()
