"""Due work: items that become due at a time, taken atomically and handed to the broker.

A :class:`DueSource` keeps items under a due time: a PostgreSQL table's partial index on its
due-time column (:class:`PgDueIndex`), or a Redis sorted set scored by the due time in ms
(:class:`RedisDueSet`). Taking is one atomic step that returns the due items and moves their
due time forward by a lease, so no other scheduler takes them meanwhile. The :class:`Ticker`
then hands them to the broker in batches (after the taking committed) and settles each batch
the broker accepted; a batch the broker refused is released (due again at once), and items
of a scheduler that died in between come back when their lease runs out. Nothing is lost
between "taken" and "on the broker", and nothing waits in worker memory or in the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Engine

from orderly.worker import lua
from orderly.worker.core.clock import SYSTEM, Clock, now_ms
from orderly.worker.core.lease import new_token
from orderly.worker.core.scripts import Scripts
from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)

# How long a taken item stays out of every scheduler's sight: a hand-off lost with its
# scheduler, or a task lost with its worker, is due again after this.
DEFAULT_LEASE_MS = 60_000


class DueSource(Protocol):
    name: str
    batch: int  # items per hand-off

    def take(self, limit: int) -> list[Any]:
        """The due items, leased to the caller (one atomic step)."""
        ...

    def hand_off(self, items: list[Any]) -> None:
        """Give one batch to the broker (raises when it did not take it)."""
        ...

    def settle(self, items: list[Any]) -> None:
        """The broker has these: forget what the lease no longer needs."""
        ...

    def release(self, items: list[Any]) -> None:
        """The broker did not take these: due again at once."""
        ...

    def due_in_ms(self) -> float | None:
        """Milliseconds until the earliest item is due (0 or less: due now, a lease that ran
        out included); None when nothing waits."""
        ...


@dataclass
class PgDueIndex:
    """Rows due by a time column. ``take_query`` leases up to ``:limit`` due rows
    (``FOR UPDATE SKIP LOCKED``, the lease as ``:lease_s``, the take's fencing token as
    ``:token`` for a query that records one) and returns their ids, or ids with more columns
    (then the items are tuples, the id first); ``release_query`` makes ``:ids`` due at once
    (a query that recorded the token releases only under ``:token``). The commit of the take
    comes before the hand-off; the claim that follows checks the row is still due (the lease
    is no claim). ``next_query`` answers :meth:`due_in_ms` from the same rows (NULL when
    none waits)."""

    name: str
    engine: Engine
    take_query: str
    release_query: str
    next_query: str
    hand_off: Callable[[list[Any]], None]
    batch: int = 50
    lease_ms: int = DEFAULT_LEASE_MS
    _token: str = field(default="", repr=False)

    def take(self, limit: int) -> list[Any]:
        self._token = new_token()
        with self.engine.begin() as conn:
            params = {"limit": limit, "lease_s": self.lease_ms / 1000, "token": self._token}
            rows = conn.execute(sql(self.take_query), params).all()
        return [r[0] if len(r) == 1 else tuple(r) for r in rows]

    def settle(self, items: list[Any]) -> None:
        """Nothing to do: the row's claim or its lease's end decides what happens next."""

    def release(self, items: list[Any]) -> None:
        ids = [i[0] if isinstance(i, tuple) else i for i in items]
        with self.engine.begin() as conn:
            conn.execute(sql(self.release_query), {"ids": ids, "token": self._token})

    def due_in_ms(self) -> float | None:
        with self.engine.connect() as conn:
            found = conn.execute(sql(self.next_query)).scalar()
        return None if found is None else float(found)


@dataclass
class RedisDueSet:
    """Members of a sorted set scored by their due time (ms). Taking moves them to a leased
    set scored by when the lease ends (``leased_key``); settling removes them from it;
    releasing, or a lease that ended unsettled, makes them due again. Settling and releasing
    touch only what this take still holds: the lease end is the take's fencing token."""

    name: str
    scripts: Scripts
    key: str
    leased_key: str
    hand_off: Callable[[list[Any]], None]
    batch: int = 100
    lease_ms: int = DEFAULT_LEASE_MS
    clock: Clock = SYSTEM
    _until: int = field(default=0, repr=False)

    def take(self, limit: int) -> list[Any]:
        now = now_ms(self.clock)
        # The lease end is this take's fencing token: unique, as a take that ends at the same
        # millisecond as an earlier one of this set moves it on by one.
        self._until = max(now + self.lease_ms, self._until + 1)
        return lua.due_take(
            self.scripts,
            due_set=self.key,
            leased_set=self.leased_key,
            now_ms=now,
            limit=limit,
            lease_end_ms=self._until,
        )

    def settle(self, items: list[Any]) -> None:
        if items:
            lua.due_settle(
                self.scripts,
                due_set=self.key,
                leased_set=self.leased_key,
                lease_end_ms=self._until,
                members=items,
            )

    def release(self, items: list[Any]) -> None:
        if items:
            lua.due_release(
                self.scripts,
                due_set=self.key,
                leased_set=self.leased_key,
                now_ms=now_ms(self.clock),
                lease_end_ms=self._until,
                members=items,
            )

    def due_in_ms(self) -> float | None:
        """The earlier of the set's first due time and its leased set's first lease end."""
        pipe = self.scripts.client.pipeline(transaction=False)
        pipe.zrange(self.key, 0, 0, withscores=True)
        pipe.zrange(self.leased_key, 0, 0, withscores=True)
        firsts = [float(found[0][1]) for found in pipe.execute() if found]
        return min(firsts) - now_ms(self.clock) if firsts else None


@dataclass
class ShardedDueSets:
    """One due source over several :class:`RedisDueSet` (one per shard of a Redis Cluster
    key layout, each set and its leased set under one hash tag): taking walks the sets,
    starting one further each time so that a limit reached early favours no set; an item
    is settled or released in the set ``shard_of`` names for it. ``occupied``, when it can
    say (one command on a plain Redis), whether any set holds anything: while none does,
    the sets are not walked (an idle ticker sends one command a turn, not one a set)."""

    name: str
    sets: Sequence[RedisDueSet]
    shard_of: Callable[[Any], int]
    hand_off: Callable[[list[Any]], None]
    batch: int = 100
    occupied: Callable[[], bool | None] | None = None
    _start: int = field(default=0, repr=False)

    def _empty(self) -> bool:
        return self.occupied is not None and self.occupied() is False

    def take(self, limit: int) -> list[Any]:
        if self._empty():
            return []
        taken: list[Any] = []
        count = len(self.sets)
        start, self._start = self._start, (self._start + 1) % count
        for n in range(count):
            if len(taken) >= limit:
                break
            taken += self.sets[(start + n) % count].take(limit - len(taken))
        return taken

    def _by_set(self, items: list[Any]) -> dict[int, list[Any]]:
        parts: dict[int, list[Any]] = {}
        for item in items:
            parts.setdefault(self.shard_of(item), []).append(item)
        return parts

    def settle(self, items: list[Any]) -> None:
        for shard, part in self._by_set(items).items():
            self.sets[shard].settle(part)

    def release(self, items: list[Any]) -> None:
        for shard, part in self._by_set(items).items():
            self.sets[shard].release(part)

    def due_in_ms(self) -> float | None:
        if self._empty():
            return None
        found = [due for due in (s.due_in_ms() for s in self.sets) if due is not None]
        return min(found) if found else None


@dataclass(frozen=True)
class Job:
    """Periodic work that is not a due set (an agent's turn): run every ``every_s``, the first
    time ``first_after_s`` after the ticker starts."""

    name: str
    every_s: float
    run: Callable[[], Any]
    first_after_s: float = 0.0


# While something keeps failing (PostgreSQL or Redis down), its traceback is logged once and
# then one line at most this often, instead of at every tick.
REPEAT_LOG_S = 30.0


class Ticker:
    """The one loop over every due source and periodic job; ``tick`` runs what is due now.

    One failing source or job is logged and does not stop the others.
    """

    def __init__(
        self,
        sources: Sequence[DueSource],
        jobs: Sequence[Job] = (),
        *,
        limit: int = 1000,
        clock: Clock = SYSTEM,
    ) -> None:
        self.sources = list(sources)
        self.jobs = list(jobs)
        self.limit = limit
        self.clock = clock
        started = clock.monotonic()
        self._next: dict[str, float] = {j.name: started + j.first_after_s for j in self.jobs}
        self._failing: dict[str, float] = {}  # name -> when its failure was last logged

    def tick(self) -> dict[str, int]:
        """Hand every due item to the broker; run the jobs whose time has come."""
        moved: dict[str, int] = {}
        for source in self.sources:
            try:
                moved[source.name] = drain(source, self.limit)
            except Exception as exc:
                self._failed(f"due work {source.name}", exc, "its items stay due")
            else:
                self._recovered(f"due work {source.name}")
        now = self.clock.monotonic()
        for job in self.jobs:
            if now < self._next[job.name]:
                continue
            self._next[job.name] = now + job.every_s
            try:
                job.run()
            except Exception as exc:
                self._failed(f"periodic job {job.name}", exc, "tried again at its next turn")
            else:
                self._recovered(f"periodic job {job.name}")
        return moved

    def due_in_s(self) -> float | None:
        """Seconds until the earliest item of any source is due; None when nothing waits.
        A source that cannot answer counts as due now (it is tried again soon)."""
        soonest: float | None = None
        for source in self.sources:
            try:
                due = source.due_in_ms()
            except Exception as exc:
                self._failed(f"due work {source.name}", exc, "its items stay due")
                return 0.0
            if due is not None and (soonest is None or due < soonest):
                soonest = due
        return None if soonest is None else soonest / 1000

    def _failed(self, what: str, exc: Exception, then: str) -> None:
        now = self.clock.monotonic()
        last = self._failing.get(what)
        if last is None:
            log.exception("%s failed (%s)", what, then)
        elif now - last >= REPEAT_LOG_S:
            log.error("%s still failing: %s: %s", what, type(exc).__name__, exc)
        else:
            return
        self._failing[what] = now

    def _recovered(self, what: str) -> None:
        if self._failing.pop(what, None) is not None:
            log.warning("%s works again", what)


def drain(source: DueSource, limit: int) -> int:
    """Take what is due and hand it off in batches; what the broker refuses is released."""
    items = source.take(limit)
    for start in range(0, len(items), source.batch):
        batch = items[start : start + source.batch]
        try:
            source.hand_off(batch)
        except BaseException:
            source.release(items[start:])
            raise
        source.settle(batch)
    return len(items)
