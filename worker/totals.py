"""Running totals: the counters and histograms of ``GET /metrics`` that only grow.

Every process (API, workers, beat) counts what it does in memory (:class:`Tally`: a dict
increment under a lock, no I/O) and adds its increments to table ``metric_total`` at most once
per ``ORDERLY_METRICS_FLUSH_S`` in one statement, from a thread of its own that sleeps while
nothing is counted. The API's collector reads the table at scrape time, so a figure is the sum
over every process of the cluster, and it never goes down: a purge does not touch the table and
a restarted process adds to what its predecessors left. What a process counted in its last
interval before it was killed (SIGKILL) is lost; a process that stops (SIGTERM) flushes first.

A histogram is stored as its buckets' own counts (``<name>_bucket`` with an ``le`` label, not
cumulative), ``<name>_sum`` and ``<name>_count``; :func:`read` puts them back together.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy import Engine

from orderly.worker.db.queries import sql

log = logging.getLogger(__name__)

# Handler runs and HTTP requests: a millisecond to a minute.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A conversation response's wait for its turn: from its arrival to its release, up to hours.
RELEASE_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   300.0, 900.0, 3600.0)  # fmt: skip


@dataclass(frozen=True)
class Counter:
    name: str  # ends in _total
    doc: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Histogram:
    name: str  # the base name: <name>_bucket, _sum, _count are exposed
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = SECONDS  # upper bounds; +Inf is implied


MESSAGES_PROCESSED = Counter(
    "orderly_messages_processed_total",
    "Handler runs by outcome: OK, PARTLY_FAILED (tried again), FAILED, OBSOLETE, POSTPONED,"
    " WAITING, WAITING_FOR_RES, ABORTED, LOST_CLAIM, ...",
    ("service", "operation", "outcome"),
)
HANDLER_SECONDS = Histogram(
    "orderly_handler_duration_seconds",
    "Time a handler ran (raised or not, stopped by its time limit too)",
    ("service", "operation"),
)
DELIVERIES = Counter(
    "orderly_deliveries_sent_total",
    "Publish/subscribe sends by subscription (the endpoint) and outcome: DELIVERED, PENDING"
    " (failed, sent again), DEAD, EXPIRED",
    ("subscription", "outcome"),
)
CONVERSATION_SENDS = Counter(
    "orderly_conversation_sends_total",
    "Conversation response sends by channel and outcome: delivered, sent (202, waits for its"
    " ACK), retry, awaited (retries spent), cancel",
    ("channel", "outcome"),
)
CONVERSATION_RELEASE = Histogram(
    "orderly_conversation_release_seconds",
    "From a response's arrival to its delivery to the client (2xx or 202), by channel",
    ("channel",),
    RELEASE_SECONDS,
)
LATE_RESPONSES = Counter(
    "orderly_late_responses_total",
    "Conversation responses delivered after their request expired (MESSAGE_TTL): they went"
    " after later requests' responses, marked (message.late_ms)",
)
HTTP_REQUESTS = Counter(
    "orderly_http_requests_total",
    "HTTP requests answered, by method, route (its template) and status",
    ("method", "route", "status"),
)
HTTP_SECONDS = Histogram(
    "orderly_http_request_duration_seconds",
    "Time from a request's arrival to the end of its answer, by method and route",
    ("method", "route"),
)
REDIS_REBUILDS = Counter(
    "orderly_redis_rebuilds_total",
    "Rebuilds of the conversation structures after Redis lost them, by reason",
    ("reason",),
)

CATALOGUE: tuple[Counter | Histogram, ...] = (
    MESSAGES_PROCESSED,
    HANDLER_SECONDS,
    DELIVERIES,
    CONVERSATION_SENDS,
    CONVERSATION_RELEASE,
    LATE_RESPONSES,
    HTTP_REQUESTS,
    HTTP_SECONDS,
    REDIS_REBUILDS,
)

Series = tuple[str, str]  # (stored name, labels as canonical JSON)
Sink = Callable[[Mapping[Series, float]], None]


@lru_cache(maxsize=4096)
def _labels(names: tuple[str, ...], values: tuple[str, ...], le: str | None = None) -> str:
    """A series' labels as canonical JSON (cached: the same few series are counted again and
    again)."""
    if len(values) != len(names):
        raise ValueError(f"labels {list(names)} take {len(names)} values, not {len(values)}")
    pairs = dict(zip(names, (str(v) for v in values), strict=True))
    if le is not None:
        pairs["le"] = le
    return json.dumps(pairs, sort_keys=True, separators=(",", ":"))


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class Tally:
    """A process's increments since its last flush; :meth:`attach` a sink to flush them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Series, float] = {}
        self._sink: Sink | None = None
        self._interval_s = 1.0
        self._wake = threading.Event()
        self._pid = 0  # the process whose thread flushes
        self._running = False  # its flush thread is started
        self._flushing = threading.Lock()  # held while increments are on their way
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a forked child: the parent's pending increments are the parent's to flush, its
        thread did not come along, and its locks may have been held by that thread."""
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._wake = threading.Event()
        self._pending = {}
        self._pid, self._running = os.getpid(), False

    def attach(self, sink: Sink, interval_s: float) -> None:
        with self._lock:
            self._sink, self._interval_s = sink, interval_s

    def detach(self) -> None:
        """Stop flushing, dropping what is pending; returns once no flush is under way."""
        with self._flushing, self._lock:
            self._sink = None
            self._pending.clear()

    def add(self, counter: Counter, *labels: str, amount: float = 1.0) -> None:
        self._record({(counter.name, _labels(counter.labels, labels)): amount})

    def observe(self, histogram: Histogram, *labels: str, seconds: float) -> None:
        bounds = histogram.buckets
        i = bisect_left(bounds, seconds)
        le = _le(bounds[i]) if i < len(bounds) else "+Inf"
        plain = _labels(histogram.labels, labels)
        name = histogram.name
        self._record(
            {
                (f"{name}_bucket", _labels(histogram.labels, labels, le)): 1.0,
                (f"{name}_sum", plain): seconds,
                (f"{name}_count", plain): 1.0,
            }
        )

    def _record(self, increments: Mapping[Series, float]) -> None:
        with self._lock:
            for series, amount in increments.items():
                self._pending[series] = self._pending.get(series, 0.0) + amount
            if self._sink is None:
                return
            if not self._running:
                self._running = True
                self._wake, self._pid = threading.Event(), os.getpid()
                threading.Thread(target=self._run, name="orderly-totals", daemon=True).start()
        self._wake.set()

    def _run(self) -> None:
        wake, pid = self._wake, self._pid
        while pid == os.getpid():
            wake.wait()  # asleep while nothing is counted
            time.sleep(self._interval_s)  # gather an interval's increments into one write
            wake.clear()
            self.flush()

    def flush(self) -> None:
        """Add the pending increments to the totals (given back to be tried again when the
        sink fails)."""
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, {}
                sink = self._sink
            if not pending or sink is None:
                return
            try:
                sink(pending)
                return
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                log.warning(
                    "adding %d metric increments failed (kept for the next try): %s: %s",
                    len(pending),
                    type(exc).__name__,
                    first,
                )
        self._record(pending)


TALLY = Tally()
atexit.register(TALLY.flush)


@dataclass(frozen=True)
class Total:
    """One stored series: its name, labels and running total."""

    name: str
    labels: Mapping[str, str]
    value: float


class Totals:
    """The gateway of table ``metric_total``."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def add(self, increments: Mapping[Series, float]) -> None:
        names, labels, values = [], [], []
        for (name, label), value in sorted(increments.items()):
            names.append(name)
            labels.append(label)
            values.append(value)
        with self._engine.begin() as conn:
            conn.execute(sql("metric_add"), {"names": names, "labels": labels, "values": values})

    def read(self) -> list[Total]:
        with self._engine.connect() as conn:
            rows = conn.execute(sql("metric_totals")).all()
        return [Total(name, json.loads(labels), float(value)) for name, labels, value in rows]


def attach(engine: Engine, interval_s: float) -> None:
    """Flush this process's tally into ``engine``'s totals."""
    TALLY.attach(Totals(engine).add, interval_s)


@dataclass(frozen=True)
class HistogramTotal:
    labels: Mapping[str, str]
    buckets: tuple[tuple[str, float], ...]  # (le, cumulative count), +Inf last
    sum: float


def histogram_totals(histogram: Histogram, totals: Iterable[Total]) -> list[HistogramTotal]:
    """A stored histogram's series put back together, one per label set."""
    per: dict[str, dict[str, float]] = {}
    sums: dict[str, float] = {}
    key_labels: dict[str, dict[str, str]] = {}
    for t in totals:
        if t.name == f"{histogram.name}_bucket":
            plain = {k: v for k, v in t.labels.items() if k != "le"}
            key = json.dumps(plain, sort_keys=True)
            key_labels[key] = plain
            per.setdefault(key, {})[t.labels.get("le", "+Inf")] = t.value
        elif t.name == f"{histogram.name}_sum":
            key = json.dumps(dict(t.labels), sort_keys=True)
            sums[key] = t.value
    found = []
    for key, counts in sorted(per.items()):
        running, cumulative = 0.0, []
        for bound in (*histogram.buckets, float("inf")):
            running += counts.get(_le(bound), 0.0)
            cumulative.append((_le(bound), running))
        found.append(HistogramTotal(key_labels[key], tuple(cumulative), sums.get(key, 0.0)))
    return found
