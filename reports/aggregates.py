"""The report's aggregates, each written twice: for Spark (DataFrame API) and as PostgreSQL
SQL. The SQL twin is the definition the tests hold Spark to, and the benchmark's baseline.

Conventions, the same on both sides:
- The window is ``[since, until)`` on each table's time column (message: receive_timestamp;
  external_call: creation_timestamp; delivery: scheduled_at; published_messages:
  published_at; queue_message: start_time; request: req_timestamp). Hours are UTC.
- Durations are milliseconds, from microsecond timestamps.
- Percentiles: the SQL twin's are exact and continuous (``percentile_cont``: linear
  interpolation between the two nearest ranks, position ``(n - 1) * p``). Spark's are one
  of the group's values, whose rank is within ``n / PCT_ACCURACY`` (10,000; reports/tables.py)
  of ``p * n`` (a relative rank error of 0.01 %), so it lies between the exact values at
  ranks ``p -/+ 0.0001``: a merge of the rank summaries PostgreSQL makes of each range
  (``SUMMARY_RANKS`` ranks a range, a finer rank error), so that no value crosses JDBC.
  Counts, sums, minima and maxima are exact on both sides. Means are arithmetic means;
  shares are fractions of the total in the window.
- Final states are OK, FAILED and CANCEL; latency is receive → last_process_timestamp of a
  message in a final state.
- Conversation release latency: for the OK responses of a conversation in delivery order
  (last_process_timestamp, msg_id), each one after the first waited
  ``delivered(n) - max(delivered(n-1), received(n))``: from the moment both its predecessor
  was delivered and it was there itself, to its own delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orderly.reports import spark_aggregates as spark
from orderly.reports.tables import SQL_HOUR, TABLES, Frames, sql_ms

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = [
    "AGGREGATES",
    "BY_NAME",
    "PCT_SQL",
    "TABLES",
    "Aggregate",
    "Frames",
    "rows_key",
]


def _sql_window(column: str) -> str:
    return (
        f"(CAST(:since AS timestamptz) IS NULL OR {column} >= CAST(:since AS timestamptz))"
        f" AND (CAST(:until AS timestamptz) IS NULL OR {column} < CAST(:until AS timestamptz))"
    )


@dataclass(frozen=True)
class Aggregate:
    name: str
    title: str
    columns: tuple[str, ...]  # the output's columns, in order (also the sort order)
    spark: Callable[[Frames], DataFrame]
    sql: str


PCT_SQL = "percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms)"
_M = f"SELECT * FROM message WHERE {_sql_window('receive_timestamp')}"

AGGREGATES: tuple[Aggregate, ...] = (
    Aggregate(
        "throughput_hourly",
        "Messages per hour by service, operation and state",
        ("hour", "service_name", "operation_name", "state", "messages"),
        spark.throughput,
        f"""
        SELECT to_char(to_timestamp(h * 3600) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:00') AS hour,
               service_name, operation_name, state, messages
          FROM (SELECT {SQL_HOUR} AS h, service_name, operation_name, state::text AS state,
                       count(*) AS messages
                  FROM ({_M}) m
                 GROUP BY 1, 2, 3, 4) g
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
        spark.latency,
        f"""
        SELECT service_name, operation_name, messages, mean_ms,
               p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms, max_ms
          FROM (SELECT service_name, operation_name, count(*) AS messages, avg(ms) AS mean_ms,
                       {PCT_SQL} AS p, max(ms) AS max_ms
                  FROM (SELECT service_name, operation_name,
                               {sql_ms("last_process_timestamp", "receive_timestamp")} AS ms
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
        spark.failures,
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
        spark.failed_counts,
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
        spark.funnels,
        f"""
        SELECT kind, funnels, messages, postponed_now, failed_postponed_too_long,
               p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms
          FROM (SELECT CASE WHEN guaranteed_order THEN 'guaranteed order' ELSE 'funnel' END
                         AS kind,
                       count(DISTINCT funnel_value) AS funnels, count(*) AS messages,
                       count(*) FILTER (WHERE state = 'POSTPONED') AS postponed_now,
                       count(*) FILTER (WHERE failed_error_code = 'E_POSTPONED_TOO_LONG')
                         AS failed_postponed_too_long,
                       {PCT_SQL} AS p
                  FROM (SELECT *, CASE WHEN state IN ('OK', 'FAILED', 'CANCEL')
                                        AND last_process_timestamp IS NOT NULL
                                       THEN {sql_ms("last_process_timestamp", "receive_timestamp")}
                                  END AS ms
                          FROM ({_M}) m WHERE funnel_value IS NOT NULL) x
                 GROUP BY 1) g
        """,
    ),
    Aggregate(
        "external_calls",
        "External calls by operation and outcome",
        ("operation_name", "state", "calls", "failures", "mean_ms"),
        spark.external_calls,
        f"""
        SELECT operation_name, state::text AS state, count(*) AS calls,
               sum(failed_count) AS failures,
               avg({sql_ms("last_update_timestamp", "creation_timestamp")}) AS mean_ms
          FROM external_call WHERE {_sql_window("creation_timestamp")}
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "nodes",
        "Messages finished per node, and its share",
        ("node_id", "code", "messages", "share"),
        spark.nodes,
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
        spark.deliveries,
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
        spark.delivery_attempts,
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
        spark.publish_log,
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
        spark.consumer_log,
        f"""
        SELECT routing_key, state::text AS state, count(*) AS messages,
               avg(ms) AS mean_ms, max(ms) AS max_ms
          FROM (SELECT routing_key, state, CASE WHEN end_time IS NOT NULL
                       THEN {sql_ms("end_time", "start_time")} END AS ms
                  FROM queue_message WHERE {_sql_window("start_time")}) q
         GROUP BY 1, 2
        """,
    ),
    Aggregate(
        "exchanges",
        "Requests and responses of external exchanges (ms)",
        ("requests", "responses", "failed", "p50_ms", "p95_ms", "p99_ms"),
        spark.exchanges,
        f"""
        SELECT requests, responses, failed, p[1] AS p50_ms, p[2] AS p95_ms, p[3] AS p99_ms
          FROM (SELECT count(DISTINCT q.req_id) AS requests, count(s.res_id) AS responses,
                       coalesce(sum(CASE WHEN s.failed THEN 1 ELSE 0 END), 0) AS failed,
                       {PCT_SQL} AS p
                  FROM request q LEFT JOIN response s ON s.req_id = q.req_id
                 CROSS JOIN LATERAL (SELECT CASE WHEN s.res_id IS NOT NULL
                          THEN {sql_ms("s.res_timestamp", "q.req_timestamp")} END AS ms) x
                 WHERE {_sql_window("q.req_timestamp")}) g
        """,
    ),
    Aggregate(
        "conversations",
        "Conversations: delivery, cancelled groups, AWAITED, release latency (ms)",
        (*spark.CONVERSATION_COUNTS, *spark.RELEASE_PCTS),
        spark.conversations,
        f"""
        WITH m AS (SELECT * FROM ({_M}) x WHERE service_name = 'conversation'),
        d AS (SELECT process_id, msg_id, receive_timestamp, last_process_timestamp,
                     lag(last_process_timestamp) OVER (
                         PARTITION BY process_id ORDER BY last_process_timestamp, msg_id) AS prev
                FROM m WHERE operation_name = 'response' AND state = 'OK'
                 AND last_process_timestamp IS NOT NULL),
        r AS (SELECT {sql_ms("last_process_timestamp", "greatest(prev, receive_timestamp)")}
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
          FROM (SELECT {PCT_SQL} AS p FROM r) pp
        """,
    ),
)

BY_NAME = {a.name: a for a in AGGREGATES}


def rows_key(row: dict[str, Any], columns: tuple[str, ...]) -> tuple[Any, ...]:
    """A sort key that puts None first and compares like types (for stable outputs)."""
    return tuple((row[c] is not None, row[c]) for c in columns)
