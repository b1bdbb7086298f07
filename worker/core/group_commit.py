"""Group commit: calls that arrive together are written in one transaction, each answered only
after that transaction committed.

Coroutines of one event loop (an API process's requests) await :meth:`GroupCommit.run` with
one item each. The first to find nobody writing starts the writer: a task that takes every
item queued so far (up to ``max_batch``), writes them with one ``write`` call in a thread (one
statement, one commit), answers each caller, and goes on with whatever queued meanwhile until
nothing is left. No timer: a lone call is written at once, as before; under load each commit
carries what arrived while the previous one was written, so commits per second stay bounded
while items per second grow. A waiting caller costs a future, not a thread: one thread hop a
group, not one a request.

``write`` returns one outcome per item, in order: a result, the exception that item's
caller raises, or :data:`ALONE`: the caller stores it on its own instead (:meth:`run_or_alone`;
what a group's one statement does not settle: a repeat, an unknown reference, a failed
group). When ``write`` itself raises, every caller of that group raises it. A caller
cancelled while its item is still queued takes it out (nothing of it is written); once its
group is being written, the write goes on and its outcome is dropped. Should the writer task
itself be cancelled (its loop closing) during a write, its callers are told so while the
write may still complete in its thread: a caller submitting again is answered with what was
stored.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

import anyio.to_thread

Item = TypeVar("Item")
Out = TypeVar("Out")


class Alone:
    """An item of a group its caller stores on its own (:meth:`GroupCommit.run_or_alone`)."""


ALONE = Alone()


class GroupCommit(Generic[Item, Out]):
    def __init__(
        self,
        write: Callable[[Sequence[Item]], Sequence[Out | Alone | BaseException]],
        max_batch: int = 500,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._write = write
        self._max_batch = max_batch
        self._queue: list[tuple[Item, asyncio.Future[Out | Alone]]] = []
        self._writer: asyncio.Task[None] | None = None
        # The writes' own thread (started at the first): one write at a time, never waiting
        # for a thread shared with other work (anyio's also looks through every task of the
        # loop at each call, thousands while a pipeline has them in flight).
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="orderly-group-commit")

    async def run(self, item: Item) -> Out | Alone:
        """``item`` written with whatever else is queued; its own outcome (raised, if an
        exception)."""
        loop = asyncio.get_running_loop()
        if self._writer is not None and self._writer.get_loop() is not loop:
            # Its queue and writer belong to one loop at a time (an API process's, a pipeline's).
            raise RuntimeError("a group commit serves one event loop at a time")
        answer: asyncio.Future[Out | Alone] = loop.create_future()
        self._queue.append((item, answer))
        if self._writer is None:
            # In a context of its own: not this caller's (its trace, its log fields).
            self._writer = loop.create_task(self._write_all(), context=contextvars.Context())
        try:
            return await answer
        except asyncio.CancelledError:
            # Not taken yet: never written.
            self._queue = [(i, a) for i, a in self._queue if a is not answer]
            raise

    async def run_or_alone(
        self, item: Item, alone: Callable[[], Out], *, grouped: bool = True
    ) -> Out:
        """``item`` written with the others (``grouped``), or on its own by ``alone`` in a
        worker thread when it is not (``grouped`` False) or its group answered ALONE."""
        if grouped:
            found = await self.run(item)
            if not isinstance(found, Alone):
                return found
        return await anyio.to_thread.run_sync(alone)

    async def _write_all(self) -> None:
        """Write group after group until nothing is queued."""
        group: list[tuple[Item, asyncio.Future[Out | Alone]]] = []
        try:
            while self._queue:
                group = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                items = [item for item, _ in group]
                try:
                    loop = asyncio.get_running_loop()
                    outcomes = await loop.run_in_executor(self._thread, self._write, items)
                    if len(outcomes) != len(group):
                        raise RuntimeError(f"{len(outcomes)} outcomes for a group of {len(group)}")
                except Exception as exc:  # every caller of the group learns it
                    outcomes = [exc] * len(group)
                for (_, answer), outcome in zip(group, outcomes, strict=True):
                    if answer.done():  # its caller was cancelled meanwhile
                        continue
                    if isinstance(outcome, BaseException):
                        answer.set_exception(outcome)
                    else:
                        answer.set_result(outcome)
        finally:
            self._writer = None
            # The writer itself cancelled (its loop closing): nobody waits for ever.
            for _, answer in group + self._queue:
                if not answer.done():
                    answer.set_exception(RuntimeError("the group's writer was stopped"))
            self._queue.clear()
