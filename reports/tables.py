"""What a report reads: each table's columns, key and time window, the partial aggregates
PostgreSQL computes for it, and the frames of one report (each read once, cached while the
report runs)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orderly.models.enums import FINAL_STATES
from orderly.reports.source import Table, guarded

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

FINAL = tuple(sorted(FINAL_STATES))
PCTS = (0.5, 0.95, 0.99)
# Spark's percentiles are percentile_approx at this accuracy: the value returned has a rank
# within n / PCT_ACCURACY of the exact one's (0.01 % of the rows) among the n values of a
# group; exact where the group is small enough for the sketch to keep every value.
PCT_ACCURACY = 10_000

MESSAGE = Table(
    "message",
    (
        "msg_id",
        "receive_timestamp",
        "last_process_timestamp",
        "service_name",
        "operation_name",
        "state::text AS state",
        "failed_count",
        "failed_error_code",
        "source_system",
        "funnel_value",
        "guaranteed_order",
        "node_id",
        "process_id",
    ),
    key="msg_id",
    window="receive_timestamp",
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


def sql_ms(later: str, earlier: str) -> str:
    """Milliseconds between two timestamps, in PostgreSQL."""
    return f"(EXTRACT(EPOCH FROM ({later} - {earlier})) * 1000)::float8"


# Responses of the requests in the window, however late they came (as the SQL twin joins),
# with their time since the request.
RESPONSE = Table(
    "response",
    ("res_id", "failed", f"{sql_ms('res_timestamp', 'req_timestamp')} AS ms"),
    key="res_id",
    window="req_timestamp",
    source="response JOIN request USING (req_id)",
)

TABLES = (
    MESSAGE,
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
GROUPED = (
    CALL_GROUPS,
    DELIVERY_GROUPS,
    PUBLISHED_GROUPS,
    QUEUE_GROUPS,
    REQUEST_COUNT,
)
# What a report reads: the tables whose rows Spark needs (percentiles, a window function, the
# names joined in), each cached as several aggregates take it, and the partial aggregates.
READS: tuple[Table | Grouped, ...] = (MESSAGE, NODE, ROOM, SUBSCRIPTION, RESPONSE, *GROUPED)


class Frames:
    """The reads of one report (``READS``), each read once and kept in memory while the
    report runs.

    Safe to share between the threads that submit jobs: a read is loaded once.
    """

    def __init__(self, load: Callable[[Table | Grouped], DataFrame]) -> None:
        self._load = load
        self._frames: dict[str, DataFrame] = {}
        self._locks = {r.name: threading.Lock() for r in READS}
        self._derived: dict[str, DataFrame] = {}
        self._derived_lock = threading.Lock()

    def __getitem__(self, read: Table | Grouped) -> DataFrame:
        # One lock per read: reads load side by side, each only once.
        with self._locks[read.name]:
            if read.name not in self._frames:
                self._frames[read.name] = self._load(read).cache()
            return self._frames[read.name]

    def derived(self, name: str, build: Callable[[Frames], DataFrame]) -> DataFrame:
        """A frame several aggregates take their rows from (one pass computing them all),
        built once and kept with the tables."""
        with self._derived_lock:
            if name not in self._derived:
                self._derived[name] = build(self).cache()
            return self._derived[name]

    def materialize(self) -> dict[str, int]:
        """Read everything into memory in one Spark job (its reads run as parallel tasks);
        the rows read per read (a grouped one's: its partial rows)."""
        from functools import reduce

        from pyspark.sql import functions as F

        counts = [
            self[t].agg(F.count(F.lit(1)).alias("n")).select(F.lit(t.name).alias("t"), "n")
            for t in READS
        ]
        union = reduce(lambda a, b: a.unionByName(b), counts)
        return {str(r["t"]): int(r["n"]) for r in guarded(union.collect)}

    def release(self) -> None:
        for frame in [*self._derived.values(), *self._frames.values()]:
            frame.unpersist(blocking=True)  # done before the session may stop
        self._derived.clear()
        self._frames.clear()
