"""The report's aggregates for Spark (DataFrame API); their SQL twins are in
reports/aggregates.py, which holds both together (conventions there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from orderly.reports.tables import (
    CALL_GROUPS,
    CONVERSATION_SUMMARY,
    DELIVERY_GROUPS,
    FINAL,
    FUNNEL_SUMMARY,
    LATENCY_SUMMARY,
    MESSAGE_GROUPS,
    NODE,
    PCTS,
    PUBLISHED_GROUPS,
    QUEUE_GROUPS,
    REQUEST_COUNT,
    RESPONSE_SUMMARY,
    ROOM,
    SUBSCRIPTION,
    SUMMARY_RANKS,
    Frames,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def _merged(
    summaries: DataFrame,
    keys: tuple[str, ...],
    totals: Callable[[Column], list[Column]],
    names: tuple[str, ...],
) -> DataFrame:
    """Per group of ``keys``, the percentiles PCTS (as ``names``) merged from the rank
    summaries of its ranges (reports.tables.SUMMARY_RANKS: a row a range, its ``n`` values
    summarised in ``pts``), beside ``totals(first)``: aggregates of the ranges' own columns,
    each taken once a range where ``first`` holds.

    The summary's k-th value (from 0) has rank ceil((k + 1) n / R) in its range and stands
    for the ranks after ceil(k n / R): its weight. Over every range's values in order, a
    percentile p is the first whose weights add up to p times the group's count; its rank is
    within the group's n / R of the exact one's, and exact where each range has at most R.
    A range with no values (``pts`` NULL) still counts in the totals; a group with none has
    NULL percentiles.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    k, n = F.col("k"), F.col("n")

    def rank(i: Column) -> Column:  # exact: i * n is an integer, R a power of two
        return F.ceil(i * n / F.lit(SUMMARY_RANKS))

    carried = [c for c in summaries.columns if c != "pts"]
    points = summaries.select(*carried, F.posexplode_outer("pts").alias("k", "v"))
    w = rank(k + 1) - rank(k)
    points = points.withColumn("w", w).where((F.col("w") > 0) | k.isNull())
    upto = Window.partitionBy(*keys).orderBy("v").rowsBetween(Window.unboundedPreceding, 0)
    points = points.withColumn("upto", F.sum("w").over(upto)).withColumn(
        "all", F.sum("w").over(Window.partitionBy(*keys))
    )
    pcts = [
        F.min(F.when(F.col("upto") >= F.col("all") * F.lit(p), F.col("v"))).alias(name)
        for p, name in zip(PCTS, names, strict=True)
    ]
    return points.groupBy(*keys).agg(*totals(F.coalesce(k, F.lit(0)) == 0), *pcts)


def _ratio(total: str, count: str) -> Column:
    """A mean from partial sums and counts (NULL where nothing was counted)."""
    from pyspark.sql import functions as F

    return F.when(F.sum(count) > 0, F.sum(total) / F.sum(count))


# The message table's counts by hour, error code, failed_count and node come from one pass
# over the counts PostgreSQL grouped by all their keys (MESSAGE_GROUPS): one aggregation over
# grouping sets; each aggregate takes its set's rows.
_COUNT_SETS = {
    "hour": ("h", "service_name", "operation_name", "state"),
    "failure": ("failed_error_code", "source_system"),
    "failed_count": ("failed_count",),
    "node": ("node_id",),
}


def _message_counts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    n = F.col("n")
    keys = list(dict.fromkeys(c for cols in _COUNT_SETS.values() for c in cols))
    return (
        f[MESSAGE_GROUPS]
        .groupingSets([list(cols) for cols in _COUNT_SETS.values()], *keys)
        .agg(
            F.sum(n).alias("messages"),
            F.sum(F.when(F.col("state") == "FAILED", n).otherwise(0)).alias("failed"),
            F.sum(F.when(F.col("state").isin(*FINAL), n).otherwise(0)).alias("final"),
            *(F.grouping(cols[0]).alias(f"g_{name}") for name, cols in _COUNT_SETS.items()),
        )
    )


def _counts_by(f: Frames, name: str) -> DataFrame:
    from pyspark.sql import functions as F

    counts = f.derived("message_counts", _message_counts)
    return counts.where(F.col(f"g_{name}") == 0)


def throughput(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    hour = F.date_format(F.timestamp_seconds(F.col("h") * 3600), "yyyy-MM-dd HH:00")
    return _counts_by(f, "hour").select(
        hour.alias("hour"), "service_name", "operation_name", "state", "messages"
    )


def latency(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    def totals(first: Column) -> list[Column]:
        messages = F.sum(F.when(first, F.col("n")))
        return [
            messages.alias("messages"),
            (F.sum(F.when(first, F.col("ms_sum"))) / messages).alias("mean_ms"),
            F.max("ms_max").alias("max_ms"),
        ]

    keys = ("service_name", "operation_name")
    return _merged(f[LATENCY_SUMMARY], keys, totals, ("p50_ms", "p95_ms", "p99_ms"))


def failures(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    rows = _counts_by(f, "failure").where(F.col("failed_error_code").isNotNull())
    return rows.select(
        "failed_error_code",
        "source_system",
        "messages",
        F.col("failed").cast("long").alias("final_failed"),
    )


def failed_counts(f: Frames) -> DataFrame:
    return _counts_by(f, "failed_count").select("failed_count", "messages")


def funnels(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    def totals(first: Column) -> list[Column]:
        counts = ("funnels", "messages", "postponed_now", "failed_postponed_too_long")
        return [F.sum(F.when(first, F.col(c))).alias(c) for c in counts]

    # The funnels are read at once: one summary per kind, no range's.
    return _merged(f[FUNNEL_SUMMARY], ("kind",), totals, ("p50_ms", "p95_ms", "p99_ms"))


def external_calls(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    return (
        f[CALL_GROUPS]
        .groupBy("operation_name", "state")
        .agg(
            F.sum("calls").alias("calls"),
            F.sum("failures").cast("long").alias("failures"),
            _ratio("ms_sum", "ms_n").alias("mean_ms"),
        )
    )


def nodes(f: Frames) -> DataFrame:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    per = _counts_by(f, "node").where(F.col("final") > 0)
    per = per.select("node_id", F.col("final").cast("long").alias("messages"))
    per = per.join(f[NODE], "node_id", "left")
    total = F.sum("messages").over(Window.partitionBy())
    return per.select(
        "node_id",
        F.coalesce(F.col("code"), F.lit("?")).alias("code"),
        "messages",
        (F.col("messages") / total).alias("share"),
    )


def subs(f: Frames) -> DataFrame:
    return (
        f[SUBSCRIPTION]
        .join(f[ROOM], "room_id", "left")
        .select("subscription_id", "room", "subscription")
    )


def deliveries(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY_GROUPS].join(subs(f), "subscription_id", "left")
    d = d.withColumn("tried", F.when(F.col("attempt").isNotNull(), F.col("n")))
    d = d.withColumn("attempts", F.col("attempt") * F.col("n"))

    def state(name: str) -> Column:
        return F.sum(F.when(F.col("state") == name, F.col("n")).otherwise(0)).alias(name.lower())

    return d.groupBy("room", "subscription").agg(
        F.sum("n").alias("deliveries"),
        state("DELIVERED"),
        state("DEAD"),
        state("EXPIRED"),
        state("PENDING"),
        _ratio("attempts", "tried").alias("mean_attempts"),
        F.max("attempt").alias("max_attempts"),
    )


def delivery_attempts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY_GROUPS].join(subs(f), "subscription_id", "left")
    return d.groupBy("room", "subscription", "attempt").agg(F.sum("n").alias("deliveries"))


def publish_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    p = f[PUBLISHED_GROUPS].join(subs(f), "subscription_id", "left")
    return p.groupBy("room", "subscription", "outcome").agg(F.sum("n").alias("attempts"))


def consumer_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    return (
        f[QUEUE_GROUPS]
        .groupBy("routing_key", "state")
        .agg(
            F.sum("n").alias("messages"),
            _ratio("ms_sum", "ms_n").alias("mean_ms"),
            F.max("ms_max").alias("max_ms"),
        )
    )


def exchanges(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    # The responses of the requests in the window, summarised with their ms since the request
    # (joined in PostgreSQL); the requests are counted there.
    def totals(first: Column) -> list[Column]:
        return [
            F.coalesce(F.sum(F.when(first, F.col(c))), F.lit(0)).alias(a)
            for c, a in (("n", "responses"), ("failed", "failed"))
        ]

    out = _merged(f[RESPONSE_SUMMARY], (), totals, ("p50_ms", "p95_ms", "p99_ms"))
    requests = f[REQUEST_COUNT].agg(F.coalesce(F.sum("n"), F.lit(0)).alias("requests"))
    return requests.crossJoin(out)


CONVERSATION_COUNTS = (
    "conversations",
    "requests",
    "responses",
    "delivered",
    "cancelled_groups",
    "awaited",
)
RELEASE_PCTS = ("release_p50_ms", "release_p95_ms", "release_p99_ms")


def conversations(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    # Counted and summarised range by range in PostgreSQL (reports.tables.CONVERSATION_SUMMARY:
    # each range holds whole conversations); one row, of zeros where there is nothing.
    def totals(first: Column) -> list[Column]:
        return [
            F.coalesce(F.sum(F.when(first, F.col(c))), F.lit(0)).cast("long").alias(c)
            for c in CONVERSATION_COUNTS
        ]

    return _merged(f[CONVERSATION_SUMMARY], (), totals, RELEASE_PCTS)
