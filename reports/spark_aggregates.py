"""The report's aggregates for Spark (DataFrame API); their SQL twins are in
reports/aggregates.py, which holds both together (conventions there)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reports.tables import (
    DELIVERY,
    EXTERNAL_CALL,
    FINAL,
    MESSAGE,
    NODE,
    PCT_ACCURACY,
    PCTS,
    PUBLISHED,
    QUEUE_LOG,
    REQUEST,
    RESPONSE,
    ROOM,
    SUBSCRIPTION,
    Frames,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def _ms(later: str, earlier: str) -> Column:
    from pyspark.sql import functions as F

    return (F.unix_micros(F.col(later)) - F.unix_micros(F.col(earlier))) / F.lit(1000.0)


def _pcts(column: str) -> list[Column]:
    from pyspark.sql import functions as F

    return [F.percentile_approx(column, list(PCTS), PCT_ACCURACY).alias("_pcts")]


def _split_pcts(frame: DataFrame, names: tuple[str, ...]) -> DataFrame:
    from pyspark.sql import functions as F

    for i, name in enumerate(names):
        frame = frame.withColumn(name, F.col("_pcts")[i])
    return frame.drop("_pcts")


def throughput(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = f[MESSAGE]
    return m.groupBy(
        F.date_format("receive_timestamp", "yyyy-MM-dd HH:00").alias("hour"),
        "service_name",
        "operation_name",
        "state",
    ).agg(F.count("*").alias("messages"))


def latency(f: Frames) -> DataFrame:
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


def failures(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    m = f[MESSAGE].where(F.col("failed_error_code").isNotNull())
    return m.groupBy("failed_error_code", "source_system").agg(
        F.count("*").alias("messages"),
        F.sum(F.when(F.col("state") == "FAILED", 1).otherwise(0)).alias("final_failed"),
    )


def failed_counts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    return f[MESSAGE].groupBy("failed_count").agg(F.count("*").alias("messages"))


def funnels(f: Frames) -> DataFrame:
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


def external_calls(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    c = f[EXTERNAL_CALL].withColumn("ms", _ms("last_update_timestamp", "creation_timestamp"))
    return c.groupBy("operation_name", "state").agg(
        F.count("*").alias("calls"),
        F.sum("failed_count").cast("long").alias("failures"),
        F.avg("ms").alias("mean_ms"),
    )


def nodes(f: Frames) -> DataFrame:
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


def subs(f: Frames) -> DataFrame:
    return (
        f[SUBSCRIPTION]
        .join(f[ROOM], "room_id", "left")
        .select("subscription_id", "room", "subscription")
    )


def deliveries(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY].join(subs(f), "subscription_id", "left")

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


def delivery_attempts(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    d = f[DELIVERY].join(subs(f), "subscription_id", "left")
    return d.groupBy("room", "subscription", "attempt").agg(F.count("*").alias("deliveries"))


def publish_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    p = f[PUBLISHED].join(subs(f), "subscription_id", "left")
    return p.groupBy("room", "subscription", "outcome").agg(F.count("*").alias("attempts"))


def consumer_log(f: Frames) -> DataFrame:
    from pyspark.sql import functions as F

    q = f[QUEUE_LOG].withColumn(
        "ms", F.when(F.col("end_time").isNotNull(), _ms("end_time", "start_time"))
    )
    return q.groupBy("routing_key", "state").agg(
        F.count("*").alias("messages"), F.avg("ms").alias("mean_ms"), F.max("ms").alias("max_ms")
    )


def exchanges(f: Frames) -> DataFrame:
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
    release = _split_pcts(released.agg(*_pcts("ms")), RELEASE_PCTS)
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
        *(F.coalesce(F.col(c), F.lit(0)).cast("long").alias(c) for c in CONVERSATION_COUNTS),
        *RELEASE_PCTS,
    )
