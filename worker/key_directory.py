"""Which API keys exist, held in memory by an API process: a bearer token whose SHA-256 is no
key's is refused with one set lookup, without a PostgreSQL round trip or a thread of its own,
and in the same time whether its prefix names a key or not (the whole token is hashed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sqlalchemy import Engine

from orderly.worker.db.queries import sql

# PostgreSQL loads the directory at most this often, however many unknown tokens come: the
# longest a key made a moment ago by another process waits (once) before it is known here.
LOAD_EVERY_S = 0.05


def key_digests(engine: Engine) -> frozenset[bytes]:
    """The SHA-256 of every key's token (worker.keys stores them as hex)."""
    with engine.connect() as conn:
        return frozenset(bytes.fromhex(h) for h in conn.execute(sql("api_key_digests")).scalars())


class KeyDirectory:
    """The digests of every key (revoked and expired ones too: worker.keys.authenticate says
    why those are refused), loaded whole.

    A digest it does not hold may be a key made since the last load, by another process:
    :meth:`knows` then waits for a load begun after it was asked. That load is shared by every
    caller waiting meanwhile, and loads begin one at a time, at most one every
    :data:`LOAD_EVERY_S`: a flood of unknown tokens costs PostgreSQL a few small queries a
    second and one thread, never a lookup each. Used from one event loop at a time.
    """

    def __init__(self, load: Callable[[], frozenset[bytes]], every_s: float = LOAD_EVERY_S) -> None:
        self._load = load
        self._every_s = every_s
        self._digests: frozenset[bytes] = frozenset()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future[None] | None = None
        # The number of the last load begun, and when (on the event loop's clock).
        self._begun = 0
        self._begun_at = float("-inf")

    async def knows(self, digest: bytes) -> bool:
        """Whether a key's token hashes to ``digest``, by a load begun after this call when
        the last one did not hold it. Raises what the load raised (PostgreSQL unreachable)."""
        if digest in self._digests:
            return True
        await self._loaded_after(self._begun)
        return digest in self._digests

    async def _loaded_after(self, seen: int) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A load of another (closed) loop would never end here.
            self._loop, self._task = loop, None
        while True:
            task = self._task
            if task is not None and self._begun > seen:
                await asyncio.shield(task)
                return
            if task is not None and not task.done():
                await asyncio.wait([task])  # begun before the call: its outcome is not ours
                continue
            wait = self._begun_at + self._every_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._begun += 1
            self._begun_at = loop.time()
            self._task = asyncio.ensure_future(self._reload())

    async def _reload(self) -> None:
        self._digests = await asyncio.to_thread(self._load)
