"""What a report reads: each table's columns, key, time window and filter, the partial
aggregates PostgreSQL computes for it, and the frames of one report (those taken more than
once read once and cached while the report runs; single-use ones read where used)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orderly.models.enums import FINAL_STATES
from orderly.reports.source import Table, guarded

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

FINAL = tuple(sorted(FINAL_STATES))
PCTS = (0.5, 0.95, 0.99)
# The report's percentiles are within this accuracy: the value returned has a rank within
# n / PCT_ACCURACY of the exact one's (0.01 % of the rows) among the n values of a group.
# Each is merged from the rank summaries PostgreSQL makes of each range (SUMMARY_RANKS: finer).
PCT_ACCURACY = 10_000
# A rank summary: a range's values of a group at ranks ceil(k * n / SUMMARY_RANKS), k = 1 ..
# SUMMARY_RANKS (``percentile_disc`` at those fractions); each stands for the ranks down to the
# one before it, so merged summaries place a value within n / SUMMARY_RANKS ranks of the exact
# one (and exactly where a range has at most SUMMARY_RANKS values). A power of two: k /
# SUMMARY_RANKS is exact in float8, and so are the ranks PostgreSQL and Spark compute from it.
SUMMARY_RANKS = 1 << 14
_FRACTIONS = (
    f"(SELECT array_agg(k::float8 / {SUMMARY_RANKS}) FROM generate_series(1, {SUMMARY_RANKS}) k)"
)


def sql_summary(value: str) -> str:
    """The rank summary of ``value`` in PostgreSQL (an array of SUMMARY_RANKS values)."""
    return f"percentile_disc({_FRACTIONS}) WITHIN GROUP (ORDER BY {value})"


def sql_ms(later: str, earlier: str) -> str:
    """Milliseconds between two timestamps, in PostgreSQL: the whole microseconds between
    them over 1000 (every millisecond of the report and of its twins is this one). In float8
    throughout (EXTRACT's numeric costs PostgreSQL more than the scan); the rounding takes
    off the float error of seconds times a million, leaving the exact microseconds."""
    return f"(round(date_part('epoch', {later} - {earlier}) * 1000000) / 1000)"


# The hour of a timestamp as a number (hours since the epoch, UTC): grouped on, then named.
SQL_HOUR = "floor(date_part('epoch', receive_timestamp) / 3600)::bigint"


# The message table is read four ways, each with only what its aggregates take: its counts
# grouped in PostgreSQL (MESSAGE_GROUPS below), the latency of every finished message, the
# funnels' messages and the conversations' (each summarised in PostgreSQL below).
MESSAGE = Table("message", (), key="msg_id", window="receive_timestamp")
_FINAL_SQL = ", ".join(f"'{s.value}'" for s in FINAL)
_FINISHED = f"state IN ({_FINAL_SQL}) AND last_process_timestamp IS NOT NULL"
_LATENCY = sql_ms("last_process_timestamp", "receive_timestamp")


def _of_message(
    name: str, columns: tuple[str, ...], where: str, key: str = "msg_id", **more: Any
) -> Table:
    """A read of the message rows in the window that ``where`` picks (by default in MESSAGE's
    key span)."""
    return Table(
        name, columns, key=key, window="receive_timestamp", source="message", where=where, **more
    )


FINISHED = _of_message(
    "finished", ("service_name", "operation_name", f"{_LATENCY} AS ms"), _FINISHED
)
# Read at once, not in ranges: a funnel's messages lie in any range of msg_id, and distinct
# funnels are counted over all of them (as the twin does; a statement beside the ranges of
# the other reads).
FUNNEL = _of_message("funnel", (), "funnel_value IS NOT NULL", partitioned=False)
# A conversation's messages, in ranges of its id: each range holds whole conversations (by
# their partial index), so each can order its conversations' deliveries itself.
CONVERSATION = _of_message(
    "conversation", (), "service_name = 'conversation'", key="process_id", text_key=True
)
NODE = Table("node", ("node_id", "code"), key="node_id", partitioned=False)
ROOM = Table("room", ("room_id", "name AS room"), key="room_id", partitioned=False)
SUBSCRIPTION = Table(
    "subscription",
    ("subscription_id", "room_id", "name AS subscription"),
    key="subscription_id",
    partitioned=False,
)
# Tables whose aggregates PostgreSQL computes (``Grouped`` below): no columns are read out.
EXTERNAL_CALL = Table("external_call", (), key="call_id", window="creation_timestamp")
DELIVERY = Table("delivery", (), key="delivery_id", window="scheduled_at")
PUBLISHED = Table("published_messages", (), key="id", window="published_at")
QUEUE_LOG = Table("queue_message", (), key="id", window="start_time")
REQUEST = Table("request", (), key="req_id", window="req_timestamp")


# Responses of the requests in the window, however late they came (as the SQL twin joins).
# Split on the request's key, which bounds both sides of the join: each range joins only its
# own requests and responses (by their indexes), not every response with every range.
RESPONSE = Table(
    "response",
    (),
    key="req_id",
    window="req_timestamp",
    source="response JOIN request USING (req_id)",
    range_columns=("request.req_id", "response.req_id"),
    spans_from="request",
)
_RESPONSE_MS = sql_ms("res_timestamp", "req_timestamp")

TABLES = (
    MESSAGE,
    FINISHED,
    FUNNEL,
    CONVERSATION,
    EXTERNAL_CALL,
    NODE,
    ROOM,
    SUBSCRIPTION,
    DELIVERY,
    PUBLISHED,
    QUEUE_LOG,
    REQUEST,
    RESPONSE,
)


@dataclass(frozen=True)
class Grouped:
    """Partial aggregates that PostgreSQL computes over a table's window, range by range of
    its key (in parallel), for aggregates that need counts, sums and maxima by a few columns:
    the database does those in its scan, and Spark adds up a few rows a range instead of
    reading every row out (reports.source.read_grouped)."""

    name: str
    table: Table
    select: str
    group_by: str
    # Values of each row that ``select`` aggregates, when not the table's own columns (e.g. a
    # window function over the range's rows)
    rows: str = ""


# The message counts by every key a count aggregate groups by (about a tenth of the rows at
# scale); Spark adds them up by grouping sets (reports.spark_aggregates).
MESSAGE_GROUPS = Grouped(
    "message_groups",
    MESSAGE,
    f"{SQL_HOUR} AS h, service_name, operation_name,"
    " state::text AS state, failed_error_code, source_system, failed_count, node_id,"
    " count(*) AS n",
    "1, 2, 3, 4, 5, 6, 7, 8",
)
CALL_GROUPS = Grouped(
    "external_call_groups",
    EXTERNAL_CALL,
    "operation_name, state::text AS state, count(*) AS calls, sum(failed_count) AS failures,"
    f" sum({sql_ms('last_update_timestamp', 'creation_timestamp')}) AS ms_sum,"
    f" count({sql_ms('last_update_timestamp', 'creation_timestamp')}) AS ms_n",
    "1, 2",
)
DELIVERY_GROUPS = Grouped(
    "delivery_groups",
    DELIVERY,
    "subscription_id, state::text AS state, attempt, count(*) AS n",
    "1, 2, 3",
)
PUBLISHED_GROUPS = Grouped(
    "published_groups",
    PUBLISHED,
    "subscription_id, outcome::text AS outcome, count(*) AS n",
    "1, 2",
)
_QUEUE_MS = sql_ms("end_time", "start_time")  # NULL while a message has no end_time
QUEUE_GROUPS = Grouped(
    "queue_message_groups",
    QUEUE_LOG,
    f"routing_key, state::text AS state, count(*) AS n, sum({_QUEUE_MS}) AS ms_sum,"
    f" count({_QUEUE_MS}) AS ms_n, max({_QUEUE_MS}) AS ms_max",
    "1, 2",
)
REQUEST_COUNT = Grouped("request_count", REQUEST, "count(*) AS n", "()")  # a row a range
# The percentiles of the two largest reads (every finished message's latency, every response's
# time) come from rank summaries of each range, with the counts, sums and maxima beside them:
# PostgreSQL sorts each range's values as its twin sorts them all, and no row of them is
# carried to Spark. ``n`` is the count the ranks are of; ``pts`` the summary (NULL if none).
LATENCY_SUMMARY = Grouped(
    "latency_summary",
    FINISHED,
    f"service_name, operation_name, count(*) AS n, sum({_LATENCY}) AS ms_sum,"
    f" max({_LATENCY}) AS ms_max, {sql_summary(_LATENCY)} AS pts",
    "1, 2",
)
RESPONSE_SUMMARY = Grouped(
    "response_summary",
    RESPONSE,
    f"count(*) AS n, count(*) FILTER (WHERE failed) AS failed, {sql_summary(_RESPONSE_MS)} AS pts",
    "()",
)
_FUNNEL_KIND = "CASE WHEN guaranteed_order THEN 'guaranteed order' ELSE 'funnel' END"
_FUNNEL_MS = f"CASE WHEN {_FINISHED} THEN {_LATENCY} END"  # NULL until it is finished
FUNNEL_SUMMARY = Grouped(
    "funnel_summary",
    FUNNEL,
    f"{_FUNNEL_KIND} AS kind, count(DISTINCT funnel_value) AS funnels, count(*) AS messages,"
    " count(*) FILTER (WHERE state = 'POSTPONED') AS postponed_now,"
    " count(*) FILTER (WHERE failed_error_code = 'E_POSTPONED_TOO_LONG')"
    " AS failed_postponed_too_long,"
    f" count({_FUNNEL_MS}) AS n, {sql_summary(_FUNNEL_MS)} AS pts",
    "1",
)
# Each range holds whole conversations, so its delivered responses are ordered there (the
# one before each: ``prev``) and counted exactly: distinct conversations add up over ranges.
_DELIVERED = "operation_name = 'response' AND state = 'OK' AND last_process_timestamp IS NOT NULL"
_RELEASE_MS = sql_ms("last_process_timestamp", "greatest(prev, receive_timestamp)")
_RELEASED = f"CASE WHEN prev IS NOT NULL THEN {_RELEASE_MS} END"
CONVERSATION_SUMMARY = Grouped(
    "conversation_summary",
    CONVERSATION,
    "count(DISTINCT process_id) AS conversations,"
    " count(*) FILTER (WHERE operation_name = 'request') AS requests,"
    " count(*) FILTER (WHERE operation_name = 'response') AS responses,"
    " count(*) FILTER (WHERE operation_name = 'response' AND state = 'OK') AS delivered,"
    " count(*) FILTER (WHERE operation_name = 'request' AND state = 'CANCEL')"
    " AS cancelled_groups,"
    " count(*) FILTER (WHERE operation_name = 'response' AND failed_count > 0) AS awaited,"
    f" count({_RELEASED}) AS n, {sql_summary(_RELEASED)} AS pts",
    "()",
    rows="process_id, operation_name, state, failed_count, receive_timestamp,"
    f" last_process_timestamp, CASE WHEN {_DELIVERED} THEN lag(last_process_timestamp) OVER"
    f" (PARTITION BY process_id, ({_DELIVERED}) ORDER BY last_process_timestamp, msg_id) END"
    " AS prev",
)
GROUPED = (
    MESSAGE_GROUPS,
    CALL_GROUPS,
    DELIVERY_GROUPS,
    PUBLISHED_GROUPS,
    QUEUE_GROUPS,
    REQUEST_COUNT,
    LATENCY_SUMMARY,
    RESPONSE_SUMMARY,
    FUNNEL_SUMMARY,
    CONVERSATION_SUMMARY,
)
# What a report reads: the tables whose rows Spark needs (percentiles, a window function, the
# names joined in) and the partial aggregates.
READS: tuple[Table | Grouped, ...] = (
    NODE,
    ROOM,
    SUBSCRIPTION,
    *GROUPED,
)
# Reads one aggregate takes in one pass: read by that aggregate's own job (beside the others),
# not held in memory. The rest are read together first and cached, as several passes take them
# (a summary is few rows, and merged in two passes).
SINGLE_USE: tuple[Table | Grouped, ...] = (MESSAGE_GROUPS,)
CACHED = tuple(r for r in READS if r not in SINGLE_USE)


class Frames:
    """The reads of one report (``READS``): those taken more than once are read once and
    kept in memory while the report runs (``CACHED``); a single-use one is read where used.

    Safe to share between the threads that submit jobs: a read is loaded once.
    """

    def __init__(self, load: Callable[[Table | Grouped], DataFrame]) -> None:
        self._load = load
        self._frames: dict[str, DataFrame] = {}
        self._locks = {r.name: threading.Lock() for r in CACHED}
        self._derived: dict[str, DataFrame] = {}
        self._derived_lock = threading.Lock()

    def __getitem__(self, read: Table | Grouped) -> DataFrame:
        if read in SINGLE_USE:
            return self._load(read)
        # One lock per read: reads load side by side, each only once.
        with self._locks[read.name]:
            if read.name not in self._frames:
                self._frames[read.name] = self._load(read).cache()
            return self._frames[read.name]

    def derived(self, name: str, build: Callable[[Frames], DataFrame]) -> DataFrame:
        """A frame several aggregates take their rows from (one pass computing them all),
        built once and kept with the tables. Jobs that ask for it side by side share the
        stage that computes it (one shuffle of its reads, as the event log shows), so none
        waits for a job of its own first."""
        with self._derived_lock:
            if name not in self._derived:
                self._derived[name] = build(self).cache()
            return self._derived[name]

    def materialize(self) -> dict[str, int]:
        """Read the cached reads into memory in one Spark job (its reads run as parallel
        tasks); the rows read per read (a grouped one's: its partial rows). The frames are
        made side by side: each range's statement is a round trip to PostgreSQL (its schema)."""
        from concurrent.futures import ThreadPoolExecutor
        from functools import reduce

        from pyspark.sql import functions as F

        with ThreadPoolExecutor(max_workers=len(CACHED)) as pool:
            frames = list(pool.map(self.__getitem__, CACHED))
        counts = [
            frame.agg(F.count(F.lit(1)).alias("n")).select(F.lit(t.name).alias("t"), "n")
            for t, frame in zip(CACHED, frames, strict=True)
        ]
        union = reduce(lambda a, b: a.unionByName(b), counts)
        return {str(r["t"]): int(r["n"]) for r in guarded(union.collect)}

    def release(self) -> None:
        for frame in [*self._derived.values(), *self._frames.values()]:
            frame.unpersist(blocking=True)  # done before the session may stop
        self._derived.clear()
        self._frames.clear()
