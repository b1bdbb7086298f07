"""Group commit: calls that arrive together are written in one transaction, each answered only
after that transaction committed.

Many threads (an API process's request threads) call :meth:`GroupCommit.run` with one item
each. The first to find nobody writing becomes the leader: it takes every item queued so far
(up to ``max_batch``), writes them with one ``write`` call (one statement, one commit), hands
each caller its own outcome, and passes the lead to the first caller still queued, which does
the same with what queued up meanwhile. No thread of its own and no timer: a lone call is
written at once, as before; under load each commit carries what arrived while the previous
one was written, so commits per second stay bounded while items per second grow.

``write`` returns one outcome per item, in order: a result, or the exception that item's
caller raises. When ``write`` itself raises, every caller of that group raises it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Out = TypeVar("Out")


@dataclass
class _Waiting(Generic[Item, Out]):
    item: Item
    ready: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to write the next group, not with an outcome
    outcome: Out | BaseException | None = None


class GroupCommit(Generic[Item, Out]):
    def __init__(
        self, write: Callable[[Sequence[Item]], Sequence[Out | BaseException]], max_batch: int = 500
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._write = write
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Waiting[Item, Out]] = []
        self._writing = False

    def run(self, item: Item) -> Out:
        """``item`` written with whatever else is queued; its own outcome (raised, if an
        exception)."""
        me: _Waiting[Item, Out] = _Waiting(item)
        with self._lock:
            self._queue.append(me)
            leading = not self._writing
            self._writing = True
        if not leading:
            self._wait(me)
        if me.lead or leading:
            self._lead()
        found = me.outcome
        if isinstance(found, BaseException):
            raise found
        return found  # type: ignore[return-value]

    def _wait(self, me: _Waiting[Item, Out]) -> None:
        """Until this caller has its outcome or the lead. Interrupted (a BaseException in this
        thread), it leaves the queue, or, handed the lead already, writes its group first:
        nobody else would."""
        try:
            me.ready.wait()
        except BaseException:
            with self._lock:
                queued = me in self._queue and not me.lead
                if queued:
                    self._queue.remove(me)
            if not queued and me.lead:
                self._lead()
            raise

    def _lead(self) -> None:
        """Write one group (this caller's among it), answer it, pass the lead on."""
        with self._lock:
            group, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
        try:
            outcomes: Sequence[Out | BaseException] = self._write([w.item for w in group])
            if len(outcomes) != len(group):
                raise RuntimeError(f"{len(outcomes)} outcomes for a group of {len(group)}")
        except BaseException as exc:  # every caller of the group learns it
            outcomes = [exc] * len(group)
        finally:
            with self._lock:
                nxt = self._queue[0] if self._queue else None
                self._writing = nxt is not None
            if nxt is not None:
                nxt.lead = True
                nxt.ready.set()
        for waiting, outcome in zip(group, outcomes, strict=True):
            waiting.outcome = outcome
            waiting.lead = False
            waiting.ready.set()
