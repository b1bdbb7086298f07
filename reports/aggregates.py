"""The report's aggregates, each written twice: for Spark (DataFrame API) and as PostgreSQL
SQL. The SQL twin is the definition the tests hold Spark to, and the benchmark's baseline.

Conventions, the same on both sides:
- The window is ``[since, until)`` on each table's time column (message: receive_timestamp;
  external_call: creation_timestamp; delivery: scheduled_at; published_messages:
  published_at; queue_message: start_time; request: req_timestamp). Hours are UTC.
- Durations are milliseconds, from microsecond timestamps.
- Percentiles are continuous: linear interpolation between the two nearest ranks, position
  ``(n - 1) * p`` (PostgreSQL ``percentile_cont``, Spark ``percentile``). Means are
  arithmetic means; shares are fractions of the total in the window.
- Final states are OK, FAILED and CANCEL; latency is receive → last_process_timestamp of a
  message in a final state.
- Conversation release latency: for the OK responses of a conversation in delivery order
  (last_process_timestamp, msg_id), each one after the first waited
  ``delivered(n) - max(delivered(n-1), received(n))``: from the moment both its predecessor
  was delivered and it was there itself, to its own delivery.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reports.source import Table

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

FINAL = ("OK", "FAILED", "CANCEL")
PCTS = (0.5, 0.95, 0.99)

# --- what is read ---------------------------------------------------------------------------

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

    def __getitem__(self, table: Table) -> DataFrame:
        # One lock per table: tables load side by side, each only once.
        with self._locks[table.name]:
            if table.name not in self._frames:
                self._frames[table.name] = self._load(table).cache()
            return self._frames[table.name]

    def release(self) -> None:
        for frame in self._frames.values():
            frame.unpersist()
        self._frames.clear()


# --- helpers --------------------------------------------------------------------------------


def _ms(later: str, earlier: str) -> Column:
    from pyspark.sql import functions as F

    return (F.unix_micros(F.col(later)) - F.unix_micros(F.col(earlier))) / F.lit(1000.0)


def _pcts(column: str) -> list[Column]:
    from pyspark.sql import functions as F

    exprs = F.expr(f"percentile({column}, array({', '.join(str(p) for p in PCTS)}))")
    return [exprs.alias("_pcts")]


def _split_pcts(frame: DataFrame, names: tuple[str, ...]) -> DataFrame:
    from pyspark.sql import functions as F

    for i, name in enumerate(names):
        frame = frame.withColumn(name, F.col("_pcts")[i])
    return frame.drop("_pcts")


def _sql_ms(later: str, earlier: str) -> str:
    return f"(EXTRACT(EPOCH FROM ({later} - {earlier})) * 1000)::float8"


def _sql_window(column: str) -> str:
    return (
        f"(CAST(:since AS timestamptz) IS NULL OR {column} >= CAST(:since AS timestamptz))"
        f" AND (CAST(:until AS timestamptz) IS NULL OR {column} < CAST(:until AS timestamptz))"
    )


# --- the aggregates -------------------------------------------------------------------------


@dataclass(frozen=True)
class Aggregate:
    name: str
    title: str
    columns: tuple[str, ...]  # the output's columns, in order (also the sort order)
    spark: Callable[[Frames], DataFrame]
    sql: str


def _throughput(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = f[MESSAGE]
    return m.groupBy(
        F.date_format("receive_timestamp", "yyyy-MM-dd HH:00").alias("hour"),
        "service_name",
        "operation_name",
        "state",
    ).agg(F.count("*").alias("messages"))


def _latency(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = (
        f[MESSAGE]
        .where(F.col("state").isin(*FINAL) & F.col("last_process_timestamp").isNotNull())
        .withColumn("ms", _ms("last_process_timestamp", "receive_timestamp"))
    )
    out = m.groupBy("service_name", "operation_name").agg(
        F.count("*").alias("messages"),
        F.avg("ms").alias("mean_ms"),
        *_pcts("ms"),
        F.max("ms").alias("max_ms"),
    )
    return _split_pcts(out, ("p50_ms", "p95_ms", "p99_ms"))


def _failures(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = f[MESSAGE].where(F.col("failed_error_code").isNotNull())
    return m.groupBy("failed_error_code", "source_system").agg(
        F.count("*").alias("messages"),
        F.sum(F.when(F.col("state") == "FAILED", 1).otherwise(0)).alias("final_failed"),
    )


def _failed_counts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    return f[MESSAGE].groupBy("failed_count").agg(F.count("*").alias("messages"))


def _funnels(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = f[MESSAGE].where(F.col("funnel_value").isNotNull())
    m = m.withColumn(
        "kind", F.when(F.col("guaranteed_order"), "guaranteed order").otherwise("funnel")
    ).withColumn(
        "ms",
        F.when(
            F.col("state").isin(*FINAL) & F.col("last_process_timestamp").isNotNull(),
            _ms("last_process_timestamp", "receive_timestamp"),
        ),
    )
    out = m.groupBy("kind").agg(
        F.countDistinct("funnel_value").alias("funnels"),
        F.count("*").alias("messages"),
        F.sum(F.when(F.col("state") == "POSTPONED", 1).otherwise(0)).alias("postponed_now"),
        F.sum(F.when(F.col("failed_error_code") == "E_POSTPONED_TOO_LONG", 1).otherwise(0)).alias(
            "failed_postponed_too_long"
        ),
        *_pcts("ms"),
    )
    return _split_pcts(out, ("p50_ms", "p95_ms", "p99_ms"))


def _external_calls(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    c = f[EXTERNAL_CALL].withColumn("ms", _ms("last_update_timestamp", "creation_timestamp"))
    return c.groupBy("operation_name", "state").agg(
        F.count("*").alias("calls"),
        F.sum("failed_count").cast("long").alias("failures"),
        F.avg("ms").alias("mean_ms"),
    )


def _nodes(f: Frames) -> DataFrame:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    m = f[MESSAGE].where(F.col("state").isin(*FINAL))
    per = m.groupBy("node_id").agg(F.count("*").alias("messages"))
    per = per.join(f[NODE], "node_id", "left")
    total = F.sum("messages").over(Window.partitionBy())
    return per.select(
        "node_id",
        F.coalesce(F.col("code"), F.lit("?")).alias("code"),
        "messages",
        (F.col("messages") / total).alias("share"),
    )


def _subs(f: Frames) -> DataFrame:
    return (
        f[SUBSCRIPTION]
        .join(f[ROOM], "room_id", "left")
        .select("subscription_id", "room", "subscription")
    )


def _deliveries(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY].join(_subs(f), "subscription_id", "left")

    def state(name: str) -> Column:
        return F.sum(F.when(F.col("state") == name, 1).otherwise(0)).alias(name.lower())

    return d.groupBy("room", "subscription").agg(
        F.count("*").alias("deliveries"),
        state("DELIVERED"),
        state("DEAD"),
        state("EXPIRED"),
        state("PENDING"),
        F.avg("attempt").alias("mean_attempts"),
        F.max("attempt").alias("max_attempts"),
    )


def _delivery_attempts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY].join(_subs(f), "subscription_id", "left")
    return d.groupBy("room", "subscription", "attempt").agg(F.count("*").alias("deliveries"))


def _publish_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    p = f[PUBLISHED].join(_subs(f), "subscription_id", "left")
    return p.groupBy("room", "subscription", "outcome").agg(F.count("*").alias("attempts"))


def _consumer_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    q = f[QUEUE_LOG].withColumn(
        "ms", F.when(F.col("end_time").isNotNull(), _ms("end_time", "start_time"))
    )
    return q.groupBy("routing_key", "state").agg(
        F.count("*").alias("messages"), F.avg("ms").alias("mean_ms"), F.max("ms").alias("max_ms")
    )


def _exchanges(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    r = f[REQUEST].join(f[RESPONSE], "req_id", "left")
    r = r.withColumn(
        "ms", F.when(F.col("res_id").isNotNull(), _ms("res_timestamp", "req_timestamp"))
    )
    out = r.agg(
        F.countDistinct("req_id").alias("requests"),
        F.count("res_id").alias("responses"),
        F.count(F.when(F.col("failed"), 1)).alias("failed"),
        *_pcts("ms"),
    )
    return _split_pcts(out, ("p50_ms", "p95_ms", "p99_ms"))


_CONVERSATION_COUNTS = (
    "conversations",
    "requests",
    "responses",
    "delivered",
    "cancelled_groups",
    "awaited",
)
_RELEASE_PCTS = ("release_p50_ms", "release_p95_ms", "release_p99_ms")


def _conversations(f: Frames) -> DataFrame:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    m = f[MESSAGE].where(F.col("service_name") == "conversation")
    requests = m.where(F.col("operation_name") == "request")
    responses = m.where(F.col("operation_name") == "response")
    delivered = responses.where(
        (F.col("state") == "OK") & F.col("last_process_timestamp").isNotNull()
    )
    order = Window.partitionBy("process_id").orderBy("last_process_timestamp", "msg_id")
    prev = F.lag("last_process_timestamp").over(order)
    released = delivered.withColumn("prev", prev).where(F.col("prev").isNotNull())
    released = released.withColumn(
        "ready", F.greatest(F.col("prev"), F.col("receive_timestamp"))
    ).withColumn("ms", _ms("last_process_timestamp", "ready"))
    counts = m.agg(
        F.countDistinct("process_id").alias("conversations"),
        F.sum(F.when(F.col("operation_name") == "request", 1).otherwise(0)).alias("requests"),
        F.sum(F.when(F.col("operation_name") == "response", 1).otherwise(0)).alias("responses"),
    )
    cancelled = F.sum(F.when(F.col("state") == "CANCEL", 1).otherwise(0))
    release = _split_pcts(released.agg(*_pcts("ms")), _RELEASE_PCTS)
    other = (
        responses.agg(
            F.sum(F.when(F.col("state") == "OK", 1).otherwise(0)).alias("delivered"),
            F.sum(F.when(F.col("failed_count") > 0, 1).otherwise(0)).alias("awaited"),
        )
        .crossJoin(requests.agg(cancelled.alias("cancelled_groups")))
        .crossJoin(release)
    )
    out = counts.crossJoin(other)
    return out.select(
        *(F.coalesce(F.col(c), F.lit(0)).cast("long").alias(c) for c in _CONVERSATION_COUNTS),
        *_RELEASE_PCTS,
    )


_PCT_SQL = "percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms)"
_M = f"SELECT * FROM message WHERE {_sql_window('receive_timestamp')}"

AGGREGATES: tuple[Aggregate, ...] = (
    Aggregate(
        "throughput_hourly",
        "Messages per hour by service, operation and state",
        ("hour", "service_name", "operation_name", "state", "messages"),
        _throughput,
        f"""
        SELECT to_char(receive_timestamp AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:00') AS hour,
               service_name, operation_name, state::text AS state, count(*) AS messages
          FROM ({_M}) m
         GROUP BY 1, 2, 3, 4
        """,
    ),
    Aggregate(
        "latency",
        "Processing latency, receive to final state (ms)",
        (
            "service_name",
            "operation_name",
            "messages",
            "mean_ms",
            "p50_ms",
            "p95_ms",
            "p99_ms",
            "max_ms",
        ),
        _latency,
        f"""
        SELECT service_name, operation_name, messages, mean_ms,
               p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms, max_ms
          FROM (SELECT service_name, operation_name, count(*) AS messages, avg(ms) AS mean_ms,
                       {_PCT_SQL} AS p, max(ms) AS max_ms
                  FROM (SELECT service_name, operation_name,
                               {_sql_ms("last_process_timestamp", "receive_timestamp")} AS ms
                          FROM ({_M}) m
                         WHERE state IN ('OK', 'FAILED', 'CANCEL')
                           AND last_process_timestamp IS NOT NULL) x
                 GROUP BY service_name, operation_name) g
        """,
    ),
    Aggregate(
        "failures",
        "Failures by error code and source system",
        ("failed_error_code", "source_system", "messages", "final_failed"),
        _failures,
        f"""
        SELECT failed_error_code, source_system, count(*) AS messages,
               count(*) FILTER (WHERE state = 'FAILED') AS final_failed
          FROM ({_M}) m
         WHERE failed_error_code IS NOT NULL
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "failed_counts",
        "Messages by failed_count",
        ("failed_count", "messages"),
        _failed_counts,
        f"SELECT failed_count, count(*) AS messages FROM ({_M}) m GROUP BY 1",
    ),
    Aggregate(
        "funnels",
        "Funnels and guaranteed order: postponements and end-to-end waits (ms)",
        (
            "kind",
            "funnels",
            "messages",
            "postponed_now",
            "failed_postponed_too_long",
            "p50_ms",
            "p95_ms",
            "p99_ms",
        ),
        _funnels,
        f"""
        SELECT kind, funnels, messages, postponed_now, failed_postponed_too_long,
               p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms
          FROM (SELECT CASE WHEN guaranteed_order THEN 'guaranteed order' ELSE 'funnel' END
                         AS kind,
                       count(DISTINCT funnel_value) AS funnels, count(*) AS messages,
                       count(*) FILTER (WHERE state = 'POSTPONED') AS postponed_now,
                       count(*) FILTER (WHERE failed_error_code = 'E_POSTPONED_TOO_LONG')
                         AS failed_postponed_too_long,
                       {_PCT_SQL} AS p
                  FROM (SELECT *, CASE WHEN state IN ('OK', 'FAILED', 'CANCEL')
                                        AND last_process_timestamp IS NOT NULL
                                       THEN {_sql_ms("last_process_timestamp", "receive_timestamp")}
                                  END AS ms
                          FROM ({_M}) m WHERE funnel_value IS NOT NULL) x
                 GROUP BY 1) g
        """,
    ),
    Aggregate(
        "external_calls",
        "External calls by operation and outcome",
        ("operation_name", "state", "calls", "failures", "mean_ms"),
        _external_calls,
        f"""
        SELECT operation_name, state::text AS state, count(*) AS calls,
               sum(failed_count) AS failures,
               avg({_sql_ms("last_update_timestamp", "creation_timestamp")}) AS mean_ms
          FROM external_call WHERE {_sql_window("creation_timestamp")}
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "nodes",
        "Messages finished per node, and its share",
        ("node_id", "code", "messages", "share"),
        _nodes,
        f"""
        SELECT m.node_id, coalesce(n.code, '?') AS code, m.messages,
               m.messages::float8 / sum(m.messages) OVER () AS share
          FROM (SELECT node_id, count(*) AS messages FROM ({_M}) x
                 WHERE state IN ('OK', 'FAILED', 'CANCEL') GROUP BY 1) m
          LEFT JOIN node n ON n.node_id = m.node_id
        """,
    ),
    Aggregate(
        "deliveries",
        "Deliveries per room and subscription",
        (
            "room",
            "subscription",
            "deliveries",
            "delivered",
            "dead",
            "expired",
            "pending",
            "mean_attempts",
            "max_attempts",
        ),
        _deliveries,
        f"""
        SELECT r.name AS room, s.name AS subscription, count(*) AS deliveries,
               count(*) FILTER (WHERE d.state = 'DELIVERED') AS delivered,
               count(*) FILTER (WHERE d.state = 'DEAD') AS dead,
               count(*) FILTER (WHERE d.state = 'EXPIRED') AS expired,
               count(*) FILTER (WHERE d.state = 'PENDING') AS pending,
               avg(d.attempt)::float8 AS mean_attempts, max(d.attempt) AS max_attempts
          FROM delivery d
          LEFT JOIN subscription s ON s.subscription_id = d.subscription_id
          LEFT JOIN room r ON r.room_id = s.room_id
         WHERE {_sql_window("d.scheduled_at")}
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "delivery_attempts",
        "Attempts distribution per subscription",
        ("room", "subscription", "attempt", "deliveries"),
        _delivery_attempts,
        f"""
        SELECT r.name AS room, s.name AS subscription, d.attempt, count(*) AS deliveries
          FROM delivery d
          LEFT JOIN subscription s ON s.subscription_id = d.subscription_id
          LEFT JOIN room r ON r.room_id = s.room_id
         WHERE {_sql_window("d.scheduled_at")}
         GROUP BY 1, 2, 3
        """,
    ),
    Aggregate(
        "publish_log",
        "Publish attempts by outcome (published_messages)",
        ("room", "subscription", "outcome", "attempts"),
        _publish_log,
        f"""
        SELECT r.name AS room, s.name AS subscription, p.outcome::text AS outcome,
               count(*) AS attempts
          FROM published_messages p
          LEFT JOIN subscription s ON s.subscription_id = p.subscription_id
          LEFT JOIN room r ON r.room_id = s.room_id
         WHERE {_sql_window("p.published_at")}
         GROUP BY 1, 2, 3
        """,
    ),
    Aggregate(
        "consumer_log",
        "Consumers by routing key (queue message log)",
        ("routing_key", "state", "messages", "mean_ms", "max_ms"),
        _consumer_log,
        f"""
        SELECT routing_key, state::text AS state, count(*) AS messages,
               avg(ms) AS mean_ms, max(ms) AS max_ms
          FROM (SELECT routing_key, state, CASE WHEN end_time IS NOT NULL
                       THEN {_sql_ms("end_time", "start_time")} END AS ms
                  FROM queue_message WHERE {_sql_window("start_time")}) q
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "exchanges",
        "Requests and responses of external exchanges (ms)",
        ("requests", "responses", "failed", "p50_ms", "p95_ms", "p99_ms"),
        _exchanges,
        f"""
        SELECT requests, responses, failed, p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms
          FROM (SELECT count(DISTINCT q.req_id) AS requests, count(s.res_id) AS responses,
                       coalesce(sum(CASE WHEN s.failed THEN 1 ELSE 0 END), 0) AS failed,
                       {_PCT_SQL} AS p
                  FROM request q LEFT JOIN response s ON s.req_id = q.req_id
                 CROSS JOIN LATERAL (SELECT CASE WHEN s.res_id IS NOT NULL
                          THEN {_sql_ms("s.res_timestamp", "q.req_timestamp")} END AS ms) x
                 WHERE {_sql_window("q.req_timestamp")}) g
        """,
    ),
    Aggregate(
        "conversations",
        "Conversations: delivery, cancelled groups, AWAITED, release latency (ms)",
        (*_CONVERSATION_COUNTS, *_RELEASE_PCTS),
        _conversations,
        f"""
        WITH m AS (SELECT * FROM ({_M}) x WHERE service_name = 'conversation'),
        d AS (SELECT process_id, msg_id, receive_timestamp, last_process_timestamp,
                     lag(last_process_timestamp) OVER (
                         PARTITION BY process_id ORDER BY last_process_timestamp, msg_id) AS prev
                FROM m WHERE operation_name = 'response' AND state = 'OK'
                 AND last_process_timestamp IS NOT NULL),
        r AS (SELECT {_sql_ms("last_process_timestamp", "greatest(prev, receive_timestamp)")}
                     AS ms FROM d WHERE prev IS NOT NULL)
        SELECT (SELECT count(DISTINCT process_id) FROM m) AS conversations,
               (SELECT count(*) FROM m WHERE operation_name = 'request') AS requests,
               (SELECT count(*) FROM m WHERE operation_name = 'response') AS responses,
               (SELECT count(*) FROM m WHERE operation_name = 'response' AND state = 'OK')
                 AS delivered,
               (SELECT count(*) FROM m WHERE operation_name = 'request' AND state = 'CANCEL')
                 AS cancelled_groups,
               (SELECT count(*) FROM m WHERE operation_name = 'response' AND failed_count > 0)
                 AS awaited,
               p[1] AS release_p50_ms, p[2] AS release_p95_ms, p[3] AS release_p99_ms
          FROM (SELECT {_PCT_SQL} AS p FROM r) pp
        """,
    ),
)

BY_NAME = {a.name: a for a in AGGREGATES}


def rows_key(row: dict[str, Any], columns: tuple[str, ...]) -> tuple[Any, ...]:
    """A sort key that puts None first and compares like types (for stable outputs)."""
    return tuple((row[c] is not None, row[c]) for c in columns)
