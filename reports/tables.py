"""What a report reads: each table's columns, key and time window, and the frames of one
report (each table read once, cached while the report runs)."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
EXTERNAL_CALL = Table(
    "external_call",
    (
        "call_id",
        "operation_name",
        "state::text AS state",
        "failed_count",
        "creation_timestamp",
        "last_update_timestamp",
    ),
    key="call_id",
    window="creation_timestamp",
)
NODE = Table("node", ("node_id", "code"), key="node_id", partitioned=False)
ROOM = Table("room", ("room_id", "name AS room"), key="room_id", partitioned=False)
SUBSCRIPTION = Table(
    "subscription",
    ("subscription_id", "room_id", "name AS subscription"),
    key="subscription_id",
    partitioned=False,
)
DELIVERY = Table(
    "delivery",
    ("delivery_id", "subscription_id", "state::text AS state", "attempt", "scheduled_at"),
    key="delivery_id",
    window="scheduled_at",
)
PUBLISHED = Table(
    "published_messages",
    ("id", "subscription_id", "outcome::text AS outcome", "published_at"),
    key="id",
    window="published_at",
)
QUEUE_LOG = Table(
    "queue_message",
    ("id", "routing_key", "state::text AS state", "start_time", "end_time"),
    key="id",
    window="start_time",
)
REQUEST = Table("request", ("req_id", "req_timestamp"), key="req_id", window="req_timestamp")
# Responses of the requests in the window, however late they came (as the SQL twin joins).
RESPONSE = Table(
    "response",
    ("res_id", "req_id", "res_timestamp", "failed"),
    key="res_id",
    window="req_timestamp",
    window_via="req_id IN (SELECT req_id FROM request WHERE {cond})",
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


class Frames:
    """The tables of one report, read once each and kept in memory while the report runs.

    Safe to share between the threads that submit jobs: a table is loaded once.
    """

    def __init__(self, load: Callable[[Table], DataFrame]) -> None:
        self._load = load
        self._frames: dict[str, DataFrame] = {}
        self._locks = {t.name: threading.Lock() for t in TABLES}
        self._derived: dict[str, DataFrame] = {}
        self._derived_lock = threading.Lock()

    def __getitem__(self, table: Table) -> DataFrame:
        # One lock per table: tables load side by side, each only once.
        with self._locks[table.name]:
            if table.name not in self._frames:
                self._frames[table.name] = self._load(table).cache()
            return self._frames[table.name]

    def derived(self, name: str, build: Callable[[Frames], DataFrame]) -> DataFrame:
        """A frame several aggregates take their rows from (one pass computing them all),
        built once and kept with the tables."""
        with self._derived_lock:
            if name not in self._derived:
                self._derived[name] = build(self).cache()
            return self._derived[name]

    def materialize(self) -> dict[str, int]:
        """Read every table into memory in one Spark job (its reads run as parallel tasks);
        the rows read per table."""
        from functools import reduce

        from pyspark.sql import functions as F

        counts = [
            self[t].agg(F.count(F.lit(1)).alias("n")).select(F.lit(t.name).alias("t"), "n")
            for t in TABLES
        ]
        union = reduce(lambda a, b: a.unionByName(b), counts)
        return {str(r["t"]): int(r["n"]) for r in guarded(union.collect)}

    def release(self) -> None:
        for frame in [*self._derived.values(), *self._frames.values()]:
            frame.unpersist(blocking=True)  # done before the session may stop
        self._derived.clear()
        self._frames.clear()
