"""What every kind of generated row shares: batches for COPY, keys counted on, the
random distributions."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from tooling.generate.catalogue import (
    _NORMAL,
    _OPS,
    _ORIGINS,
    _clock,
    _table,
)
from tooling.generate.columns import (
    CHUNK_ROWS,
    MINUTE,
    RECENT,
    RECENT_SHARE,
    SECOND,
)
from tooling.generate.setup import _Room

# A table, its rows as COPY text (encoded) and how many there are.
Batch = tuple[str, bytes, int]


def _batch(table: str, rows: list[str]) -> Batch:
    batch = (table, "".join(rows).encode(), len(rows))
    rows.clear()
    return batch


def _drain(tables: Sequence[tuple[str, list[str]]]) -> Iterator[Batch]:
    for table, rows in tables:
        if rows:
            yield _batch(table, rows)


def _chunked(
    table: str, units: Iterator[list[str]], side: Sequence[tuple[str, list[str]]]
) -> Iterator[Batch]:
    """``table``'s rows in chunks of about CHUNK_ROWS (a unit is never split), each chunk
    followed by the rows made meanwhile in ``side`` that reference it."""
    buf: list[str] = []
    for unit in units:
        buf.extend(unit)
        if len(buf) >= CHUNK_ROWS:
            yield _batch(table, buf)
            yield from _drain(side)
    yield _batch(table, buf)
    yield from _drain(side)


@dataclass(slots=True)
class _Outcome:
    """How a business message's processing went."""

    state: str
    failed: int = 0
    code: str | None = None
    desc: str | None = None
    done: int = 0  # last_process_timestamp (ms)
    queued: int | None = None  # start_in_queue_timestamp
    custom: str | None = None
    pid: int | None = None
    audit: str = "[]"
    wait_id: str | None = None
    deadline: int | None = None
    wait_res: int | None = None
    tries: int = 0  # handler runs that reached an external call
    in_flight: bool = False  # a call still running (PROCESSING)


class _Rows:
    """The state every kind of row shares: one stream of randomness, keys counted on from
    ``ids`` (the last used), the distributions drawn from."""

    def __init__(
        self,
        rng: random.Random,
        *,
        seed: int,
        messages: int,
        start: int,
        end: int,
        ids: Mapping[str, int],
        nodes: Sequence[tuple[int, float]],
        rooms: Sequence[_Room],
    ) -> None:
        self.rng = rng
        self.seed = seed
        self.n = messages
        self.start = start
        self.end = end
        self.recent = end - max(RECENT, int((end - start) * RECENT_SHARE))
        self.ids = dict(ids)  # the last key used per table
        self.ts = _clock()
        self._spreads: dict[tuple[float, float, int], list[int]] = {}
        # the durations drawn for every message, as lookup tables (see lognormal)
        self.sent_lag = self.spread(400, 1.2, 30 * SECOND)
        self.queue_wait = self.spread(40, 1.5, 5 * MINUTE)
        self.run_time = self.spread(180, 1.3, 10 * MINUTE)
        self.node = _table([(str(i), w) for i, w in nodes])
        self.rooms = rooms
        # rows of the tables that reference the ones being made, copied after them
        self.calls: list[str] = []
        self.requests: list[str] = []
        self.responses: list[str] = []
        self.deliveries: list[str] = []
        self.published: list[str] = []
        self.queued: list[str] = []
        # entity-keyed calls: one row per (operation, entity), the newest message's
        self.keyed_calls: dict[tuple[str, str], str] = {}
        # guaranteed-order funnels with a FAILED message, which holds the later ones
        self.blocked_funnels: dict[str, int] = {}
        pool = max(200, messages // 6)
        self.pools = {"C": pool, "O": pool, "INV": pool, "SH": pool // 2, "SKU-": 5000}
        self.op = _table([(op, op.weight) for op in _OPS])
        self.origin = _table(list(_ORIGINS))

    def next_id(self, table: str) -> int:
        self.ids[table] += 1
        return self.ids[table]

    def spread(self, median_ms: float, sigma: float, cap_ms: int) -> list[int]:
        """A log-normal distribution of durations (ms) as 4096 quantiles, at most ``cap_ms``:
        ``table[rng.getrandbits(12)]`` is a draw."""
        key = (median_ms, sigma, cap_ms)
        table = self._spreads.get(key)
        if table is None:
            table = [min(int(median_ms * math.exp(sigma * z)) + 1, cap_ms) for z in _NORMAL]
            self._spreads[key] = table
        return table

    def lognormal(self, median_ms: float, sigma: float, cap_ms: int) -> int:
        """A skewed duration (ms): median, spread, at most ``cap_ms``."""
        return self.spread(median_ms, sigma, cap_ms)[self.rng.getrandbits(12)]

    def obj(self, prefix: str) -> str:
        # squared uniform: a few hot objects get many messages (funnels fill up)
        return f"{prefix}{int(self.pools[prefix] * self.rng.random() ** 2):06d}"
