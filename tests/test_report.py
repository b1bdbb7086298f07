"""The Spark report against the real PostgreSQL over JDBC: every aggregate equals its SQL twin
on a generated dataset (in a window and over everything), partitioned reads, empty tables,
the incremental watermark, the write-back, and the errors a person can fix."""

from __future__ import annotations

import math
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from orderly.reports.aggregates import AGGREGATES, PCT_SQL, Aggregate
from orderly.reports.data import AggregateRows, ReportData
from orderly.reports.job import (
    ReportOptions,
    ReportResult,
    compute,
    move_watermark,
    options_from,
    parser,
    run_report,
    write_to_postgres,
)
from orderly.reports.source import Jdbc, ReportError, read, spark_session
from orderly.reports.tables import CONVERSATION, FINISHED, PCT_ACCURACY, PCTS
from orderly.worker.db import schema
from orderly.worker.settings import Settings
from tests.conftest import PG_ADMIN_URL, _unavailable
from tooling.generate import generate
from tooling.processes import BIN, free_port
from tooling.servers import PostgresServer, ServerUnavailable

START = datetime(2026, 3, 2, tzinfo=UTC)
WINDOW = (START + timedelta(hours=7), START + timedelta(hours=31))
JAR = Path("/usr/share/java/postgresql.jar")


def _database() -> Iterator[tuple[str, Engine]]:
    name = f"orderly_report_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    schema.upgrade(url)
    engine = create_engine(url)
    try:
        yield url, engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, Engine]]:
    """A migrated database with a generated dataset of two days."""
    for url, engine in _database():
        generate(engine, 4_000, seed=11, start=START, days=2)
        yield url, engine


@pytest.fixture(scope="module")
def empty_store() -> Iterator[tuple[str, Engine]]:
    yield from _database()


def settings_for(url: str, **extra: Any) -> Settings:
    return Settings(database_url=url, report_partitions=3, **extra)


@pytest.fixture(scope="module")
def spark(store: tuple[str, Engine]) -> Iterator[Any]:
    if not JAR.is_file():
        _unavailable("the PostgreSQL JDBC driver", FileNotFoundError(str(JAR)))
    jdbc = Jdbc.from_settings(settings_for(store[0]))
    session = spark_session(jdbc, "local[2]", "1g", app="orderly-report-tests")
    yield session
    session.stop()


def _sql_rows(
    engine: Engine, aggregate: Aggregate, window: tuple[Any, Any]
) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.execute(text(aggregate.sql), {"since": window[0], "until": window[1]})
        return [dict(r._mapping) for r in result]


def _band_twin(aggregate: Aggregate, side: int) -> Aggregate:
    """The SQL twin with each exact percentile p replaced by the group's value at rank
    p - 1/PCT_ACCURACY (side -1) or p + 1/PCT_ACCURACY (side +1): Spark's approximate
    percentile must lie between the two."""
    eps = 1 / PCT_ACCURACY
    fractions = ", ".join(str(min(1.0, max(0.0, p + side * eps))) for p in PCTS)
    band = f"percentile_disc(ARRAY[{fractions}]) WITHIN GROUP (ORDER BY ms)"
    return replace(aggregate, sql=aggregate.sql.replace(PCT_SQL, band))


def _is_pct(column: str) -> bool:
    return column.removeprefix("release_") in ("p50_ms", "p95_ms", "p99_ms")


def _same(column: str, spark_value: Any, sql_value: Any) -> bool:
    if spark_value is None or sql_value is None:
        return spark_value is None and sql_value is None
    if isinstance(sql_value, str) or isinstance(spark_value, str):
        return str(spark_value) == str(sql_value)
    if column.startswith("mean_"):  # sums of doubles in another order: float rounding
        return math.isclose(float(spark_value), float(sql_value), rel_tol=1e-9, abs_tol=1e-9)
    # Counts, sums, maxima (and shares: one division of the same two integers): identical.
    return bool(float(spark_value) == float(sql_value))


def _canon(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> list[tuple[Any, ...]]:
    def key(row: dict[str, Any]) -> tuple[Any, ...]:
        return tuple((row[c] is not None, str(row[c])) for c in columns if not _is_pct(c))

    return [tuple(r[c] for c in columns) for r in sorted(rows, key=key)]


def assert_same_rows(
    got: AggregateRows,
    engine: Engine,
    aggregate: Aggregate,
    window: tuple[Any, Any],
) -> None:
    """Spark's rows are the SQL twin's: exact but for means (float rounding) and
    percentiles (within the approximation's stated rank error of the exact ones)."""
    expected = _sql_rows(engine, aggregate, window)
    assert got.columns == aggregate.columns
    assert len(got.rows) == len(expected), f"{aggregate.name}: row counts differ"
    columns = aggregate.columns
    low, high = (
        _canon(_sql_rows(engine, _band_twin(aggregate, side), window), columns) for side in (-1, 1)
    )
    mine, theirs = _canon(got.rows, columns), _canon(expected, columns)
    for n, (a_row, b_row) in enumerate(zip(mine, theirs, strict=True)):
        for i, column in enumerate(columns):
            a, b = a_row[i], b_row[i]
            if _is_pct(column):
                lo, hi = low[n][i], high[n][i]
                if a is None or lo is None:
                    assert a is None and lo is None, f"{aggregate.name}.{column}: {a!r} {lo!r}"
                else:
                    assert lo <= a <= hi, (
                        f"{aggregate.name}.{column}: spark {a!r} outside [{lo!r}, {hi!r}]"
                        f" (exact {b!r})"
                    )
            else:
                assert _same(column, a, b), f"{aggregate.name}.{column}: spark {a!r} != sql {b!r}"


@pytest.fixture(scope="module")
def computed(spark: Any, store: tuple[str, Engine]) -> dict[str, dict[str, AggregateRows]]:
    jdbc = Jdbc.from_settings(settings_for(store[0]))
    out = {}
    for label, window in (("window", WINDOW), ("all", (None, None))):
        aggregates, _ = compute(spark, jdbc, *window)
        out[label] = {a.name: a for a in aggregates}
    return out


@pytest.mark.parametrize("label", ["window", "all"])
@pytest.mark.parametrize("aggregate", AGGREGATES, ids=[a.name for a in AGGREGATES])
def test_every_aggregate_equals_its_sql(
    aggregate: Aggregate,
    label: str,
    computed: dict[str, dict[str, AggregateRows]],
    store: tuple[str, Engine],
) -> None:
    window = WINDOW if label == "window" else (None, None)
    assert_same_rows(computed[label][aggregate.name], store[1], aggregate, window)


def test_the_dataset_exercises_every_aggregate(
    computed: dict[str, dict[str, AggregateRows]],
) -> None:
    # An aggregate compared on no rows proves nothing: the generated data must reach each.
    for name, aggregate in computed["all"].items():
        assert aggregate.rows, f"{name} has no rows"
    conversations = computed["all"]["conversations"].rows[0]
    assert conversations["conversations"] > 0 and conversations["release_p95_ms"] is not None
    assert computed["window"]["throughput_hourly"].rows != computed["all"]["throughput_hourly"].rows


# (later, earlier): sub-millisecond, zero, negative and over a day, before 1970, after 2038,
# and a gap of over a century.
_INSTANTS = (
    ("2026-11-23T10:00:00.000001", "2026-11-23T09:59:59.999999"),
    ("2026-11-23T10:00:00", "2026-11-23T10:00:00"),
    ("2026-11-23T10:00:00", "2026-11-24T11:00:00.123457"),
    ("1969-12-31T23:59:59.999999", "1969-12-31T22:00:00.000003"),
    ("2041-06-30T23:59:59.999999", "2041-06-30T23:00:00.000001"),
    ("2126-01-01T00:00:00.000001", "1970-01-01T00:00:00"),
)


def test_milliseconds_are_exact_and_hours_the_same_in_postgresql_and_spark(
    spark: Any, store: tuple[str, Engine]
) -> None:
    from pyspark.sql import functions as F

    from orderly.reports.tables import SQL_HOUR, sql_ms

    values = ", ".join(
        f"(TIMESTAMPTZ '{a}Z', TIMESTAMPTZ '{b}Z', {n})" for n, (a, b) in enumerate(_INSTANTS)
    )
    rows = f"(VALUES {values}) v(receive_timestamp, earlier, n)"
    twin_hour = f"to_char(to_timestamp({SQL_HOUR} * 3600) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:00')"
    with store[1].connect() as conn:
        sql = conn.execute(
            text(
                f"SELECT {sql_ms('receive_timestamp', 'earlier')} AS ms, {twin_hour} AS twin,"
                " to_char(receive_timestamp AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:00') AS hour"
                f" FROM {rows} ORDER BY n"
            )
        ).all()
    # Spark's side as a report reads it: the hour as PostgreSQL numbers it, over JDBC.
    jdbc = Jdbc.from_settings(settings_for(store[0]))
    query = f"(SELECT n, receive_timestamp, earlier, {SQL_HOUR} AS h FROM {rows}) t"
    frame = spark.read.format("jdbc").options(**jdbc.options()).option("dbtable", query).load()
    hour = F.date_format(F.timestamp_seconds(F.col("h") * 3600), "yyyy-MM-dd HH:00")
    got = frame.orderBy("n").select(hour.alias("hour"))
    assert [(r.hour, r.hour) for r in sql] == [
        (g["hour"], r.twin) for g, r in zip(got.collect(), sql, strict=True)
    ]
    # Every millisecond of the report and of its twins is this expression, in PostgreSQL:
    # the whole microseconds over 1000, as the same float (percentiles and maxima are
    # compared as equal).
    exact = [
        (datetime.fromisoformat(a) - datetime.fromisoformat(b)) // timedelta(microseconds=1) / 1000
        for a, b in _INSTANTS
    ]
    assert [float(r.ms) for r in sql] == exact
    assert exact[:3] == [0.002, 0.0, -90_000_123.457]


# Three ranges of very different sizes and spreads (two above SUMMARY_RANKS values, one of
# five), with ties: each value's weight in the merge is what its range's summary says.
_RANGES = """
    SELECT 0 AS r, (hashint4(g) % 1000 + 1000) / 4.0::float8 AS v
      FROM generate_series(1, 90000) g
    UNION ALL SELECT 1, (hashint4(g) % 100000) / 7.0::float8 FROM generate_series(1, 30000) g
    UNION ALL SELECT 2, g * 1000.0::float8 FROM generate_series(1, 5) g"""


def test_percentiles_merged_from_range_summaries_are_within_the_stated_rank_error(
    spark: Any, store: tuple[str, Engine]
) -> None:
    from pyspark.sql import functions as F

    from orderly.reports.spark_aggregates import _merged
    from orderly.reports.tables import SUMMARY_RANKS, sql_summary

    jdbc = Jdbc.from_settings(settings_for(store[0]))
    query = f"(SELECT r, count(*) AS n, {sql_summary('v')} AS pts FROM ({_RANGES}) x GROUP BY r) t"
    summaries = spark.read.format("jdbc").options(**jdbc.options()).option("dbtable", query).load()
    names = tuple(f"p{i}" for i in range(len(PCTS)))

    def totals(first: Any) -> list[Any]:
        return [F.sum(F.when(first, F.col("n"))).alias("n")]

    got = _merged(summaries, (), totals, names).first()
    assert got is not None and got["n"] == 120_005
    n = 120_005
    band = n // SUMMARY_RANKS  # the merge's rank error: under n / SUMMARY_RANKS
    with store[1].connect() as conn:
        for p, name in zip(PCTS, names, strict=True):
            # The values at the ranks ceil(p n) and ceil(p n) + band, as percentile_disc ranks.
            lo, hi = (
                conn.execute(
                    text(
                        "SELECT percentile_disc(CAST(:f AS float8)) WITHIN GROUP (ORDER BY v)"
                        f" FROM ({_RANGES}) x"
                    ),
                    {"f": (math.ceil(p * n) + extra) / n},
                ).scalar_one()
                for extra in (0, band)
            )
            assert lo <= got[name] <= hi, f"{name}: {got[name]} outside [{lo}, {hi}]"
            # Narrow beside the values' spread (-14,285 to 14,285): a wrong weight lands outside.
            assert hi - lo < 10, f"{name}: the band [{lo}, {hi}] tells nothing"


def _in_window(engine: Engine, select: str, where: str) -> tuple[Any, ...]:
    """``select`` over the messages in WINDOW that ``where`` picks, in PostgreSQL."""
    with engine.connect() as conn:
        return tuple(
            conn.execute(
                text(
                    f"SELECT {select} FROM message WHERE {where}"
                    " AND receive_timestamp >= :s AND receive_timestamp < :u"
                ),
                {"s": WINDOW[0], "u": WINDOW[1]},
            ).one()
        )


def test_a_read_is_partitioned_and_filtered_in_postgres(
    spark: Any, store: tuple[str, Engine]
) -> None:
    jdbc = Jdbc.from_settings(settings_for(store[0]))
    since, until = (w.isoformat() for w in WINDOW)
    frame = read(spark, jdbc, FINISHED, since, until)
    assert frame.rdd.getNumPartitions() == 3
    assert frame.columns == [c.split(" AS ")[-1] for c in FINISHED.columns]
    finished = "state IN ('OK', 'FAILED', 'CANCEL') AND last_process_timestamp IS NOT NULL"
    expected = _in_window(store[1], "count(*)", finished)[0]
    assert 0 < frame.count() == expected
    # The window and the filter are in the statement PostgreSQL runs, not applied after
    # reading; so is each range of the key.
    plan = frame._jdf.queryExecution().executedPlan().toString()
    assert "receive_timestamp >=" in plan and "last_process_timestamp IS NOT NULL" in plan
    assert "msg_id >=" in plan


def test_a_text_key_is_cut_at_its_quantiles_and_each_range_holds_its_keys_whole(
    spark: Any, store: tuple[str, Engine]
) -> None:
    from pyspark.sql import functions as F

    jdbc = Jdbc.from_settings(settings_for(store[0]))
    since, until = (w.isoformat() for w in WINDOW)
    conversation = replace(CONVERSATION, columns=("process_id", "msg_id"))
    frame = read(spark, jdbc, conversation, since, until)
    assert frame.rdd.getNumPartitions() == 3
    expected = _in_window(
        store[1], "count(*), count(DISTINCT process_id)", "service_name = 'conversation'"
    )
    tagged = frame.withColumn("part", F.spark_partition_id())
    assert (
        tagged.count() == expected[0] and tagged.select("msg_id").distinct().count() == expected[0]
    )
    # A conversation's messages are in one range only, and each range has some.
    per_key = tagged.groupBy("process_id").agg(F.countDistinct("part").alias("parts"))
    assert per_key.count() == expected[1] > 3
    assert per_key.agg(F.max("parts").alias("most")).collect()[0]["most"] == 1
    assert tagged.select("part").distinct().count() == 3
    # Keys that need quoting, and rows without a key, are read once each.
    values = ["a", "b'c", "it''s", "m\\", None, "z", "z", "\u00e9t\u00e9", "q"]
    rows = ", ".join("(NULL)" if v is None else "('" + v.replace("'", "''") + "')" for v in values)
    odd = replace(
        conversation,
        name="odd",
        columns=("k",),
        key="k",
        window=None,
        source=f"(VALUES {rows}) AS v(k)",
        where="",
    )
    got = read(spark, jdbc, odd, None, None)
    assert got.rdd.getNumPartitions() == 3

    def ordered(keys: list[Any]) -> list[Any]:
        return sorted(keys, key=lambda k: (k is not None, k))

    assert ordered([r.k for r in got.collect()]) == ordered(values)
    # Cut where PostgreSQL orders the keys (here an ICU collation: "D" after "b", unlike in
    # code-point order), and keys of backslashes and quotes as cuts.
    for column, keys in (
        ('k COLLATE "en-US-x-icu"', ["a", "b", "c", "D", "e", "f"]),  # cuts "b" and "D"
        ("k", ["a\\'", "b\\\\", "c''\\", "d\\n", "e'\\'", "f\\"]),
    ):
        literals = ", ".join(
            "(E'" + k.replace("\\", "\\\\").replace("'", "''") + "')" for k in keys
        )
        source = f"(SELECT {column} AS k FROM (VALUES {literals}) AS v(k)) AS c"
        read_keys = read(spark, jdbc, replace(odd, source=source), None, None).collect()
        assert ordered([r.k for r in read_keys]) == ordered(keys), column


def test_an_empty_store_gives_an_empty_but_valid_report(
    spark: Any, empty_store: tuple[str, Engine], tmp_path: Path
) -> None:
    result = run_report(
        ReportOptions(output_dir=tmp_path), settings_for(empty_store[0]), spark=spark
    )
    for aggregate in result.data.aggregates:
        if aggregate.name in ("conversations", "exchanges"):  # one row of zeros and no data
            assert len(aggregate.rows) == 1
        else:
            assert aggregate.rows == [], aggregate.name
        header = (result.folder / "csv" / f"{aggregate.name}.csv").read_text().splitlines()
        assert header[0].split(",") == list(aggregate.columns)
        assert (result.folder / "parquet" / aggregate.name).is_dir()
    html = result.html.read_text()
    assert html.startswith("<!DOCTYPE html>") and "</html>" in html
    assert "no data" in html
    # Empty, and still what the SQL says (a sum over no rows is NULL in both, a count 0).
    for twin in AGGREGATES:
        assert_same_rows(result.data.get(twin.name), empty_store[1], twin, (None, None))


def counted(result: ReportResult) -> int:
    """The messages a report counted (each once, by failed_count)."""
    return sum(int(r["messages"]) for r in result.data.get("failed_counts").rows)


@pytest.fixture
def fresh_store() -> Iterator[tuple[str, Engine]]:
    yield from _database()


def test_incremental_runs_read_only_new_rows_and_write_back(
    spark: Any, fresh_store: tuple[str, Engine], tmp_path: Path
) -> None:
    url, engine = fresh_store
    settings = settings_for(url)
    first_batch = generate(engine, 300, seed=3, start=START, days=1)
    options = ReportOptions(incremental=True, output_dir=tmp_path, to_postgres=True)
    # The first run leaves out the last two hours (its lag): rows received then are new to
    # the second run, older ones are not read again.
    first = run_report(
        replace(options, lag=timedelta(hours=2)), settings, engine=engine, spark=spark
    )
    assert first.data.since is None and first.data.until is not None
    assert counted(first) == first_batch.rows["message"]
    second_batch = generate(engine, 120, seed=4, start=first.data.until, days=1 / 24)
    second = run_report(options, settings, engine=engine, spark=spark)
    assert second.data.since == first.data.until
    assert counted(second) == second_batch.rows["message"]
    with engine.connect() as conn:
        mark = conn.execute(text("SELECT read_until, run_id FROM report_watermark")).one()
        assert (mark.read_until, mark.run_id) == (second.data.until, second.data.run_id)
        runs = conn.execute(
            text("SELECT run_id, sum(messages) FROM report_failed_counts GROUP BY 1")
        ).all()
    # Each run's aggregates are in PostgreSQL, tagged with the run.
    assert dict(runs) == {
        first.data.run_id: first_batch.rows["message"],
        second.data.run_id: second_batch.rows["message"],
    }


def test_the_watermark_and_the_report_tables_move_together(
    fresh_store: tuple[str, Engine],
) -> None:
    _, engine = fresh_store
    now = datetime.now(UTC)
    rows = AggregateRows("failed_counts", "t", ("failed_count", "messages"),
                         [{"failed_count": 0, "messages": 5}],
                         {"failed_count": "long", "messages": "long"})  # fmt: skip
    data = ReportData("run-1", now, None, now, [rows])
    with engine.begin() as conn:
        move_watermark(conn, "nightly", None, now, "run-1")
        write_to_postgres(conn, data)
    # A second run that started from the same (absent) watermark loses, and writes nothing.
    with pytest.raises(ReportError, match="moved while this report ran"), engine.begin() as conn:
        write_to_postgres(conn, replace(data, run_id="run-2"))
        move_watermark(conn, "nightly", None, now + timedelta(hours=1), "run-2")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT run_id FROM report_failed_counts")).scalars().all() == [
            "run-1"
        ]
        assert conn.execute(text("SELECT run_id FROM report_watermark")).scalar_one() == "run-1"
    # A report table whose columns changed is refused, not appended to.
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE report_failed_counts ADD COLUMN extra int"))
    with pytest.raises(ReportError, match="has other columns"), engine.begin() as conn:
        write_to_postgres(conn, data)


@pytest.mark.unit
def test_jdbc_settings_follow_the_database_url() -> None:
    jdbc = Jdbc.from_settings(
        Settings(
            database_url="postgresql+psycopg2://rep:p%2541ss@db.example:6543/store?sslmode=require"
        )
    )
    assert jdbc.url == "jdbc:postgresql://db.example:6543/store?sslmode=require"
    assert (jdbc.user, jdbc.password) == ("rep", "p%41ss")  # decoded once, not twice
    v6 = Jdbc.from_settings(Settings(database_url="postgresql://u@[::1]:5432/orderly"))
    assert v6.url == "jdbc:postgresql://[::1]:5432/orderly"
    with pytest.raises(ReportError, match="unix socket"):
        Jdbc.from_settings(Settings(database_url="postgresql://u@/orderly?host=/run/postgresql"))


@pytest.mark.unit
def test_a_run_is_incremental_unless_a_window_or_full_is_asked_for() -> None:
    def options(*argv: str) -> ReportOptions:
        return options_from(parser().parse_args(list(argv)))

    assert options().incremental and options("--incremental").incremental
    assert options("--lag-minutes", "60").lag == timedelta(hours=1)
    windowed = options("--since", "2026-11-01", "--until", "2026-11-02T00:00:00Z")
    assert not windowed.incremental and windowed.until == datetime(2026, 11, 2, tzinfo=UTC)
    assert not options("--until", "2026-11-02").incremental
    whole = options("--full")
    assert not whole.incremental and (whole.since, whole.until) == (None, None)
    for argv, named in (
        (("--incremental", "--since", "2026-11-01"), "--incremental takes its window"),
        (("--incremental", "--full"), "--incremental takes its window"),
        (("--full", "--until", "2026-11-02"), "--full reads the whole store"),
    ):
        with pytest.raises(ReportError, match=named):
            options(*argv)


@pytest.mark.integration  # refused before Spark starts
def test_a_negative_lag_is_refused(store: tuple[str, Engine]) -> None:
    options = ReportOptions(incremental=True, lag=timedelta(minutes=-5))
    with pytest.raises(ReportError, match="lag must not be negative"):
        run_report(options, settings_for(store[0]))
    # Bad options are named before what the environment lacks: also without the jar.
    no_jar = settings_for(store[0], report_jdbc_jar="/nowhere/postgresql.jar")
    with pytest.raises(ReportError, match="lag must not be negative"):
        run_report(options, no_jar)


# --- errors a person can fix ------------------------------------------------------------------


@pytest.mark.integration
def test_a_missing_jar_is_named_before_spark_starts(store: tuple[str, Engine]) -> None:
    jdbc = Jdbc.from_settings(settings_for(store[0], report_jdbc_jar="/nowhere/postgresql.jar"))
    with pytest.raises(ReportError, match=r"/nowhere/postgresql.jar does not exist.*libpostgresql"):
        spark_session(jdbc, "local[1]", "512m")


@pytest.mark.unit
def test_a_bad_jdbc_url_is_refused_by_the_settings() -> None:
    with pytest.raises(ValueError, match="ORDERLY_REPORT_JDBC_URL must be a jdbc:postgresql"):
        Settings(report_jdbc_url="jdbc:mysql://127.0.0.1/orderly")


def test_an_unreachable_server_is_named(spark: Any, store: tuple[str, Engine]) -> None:
    url = f"jdbc:postgresql://127.0.0.1:{free_port()}/orderly"
    jdbc = Jdbc.from_settings(settings_for(store[0], report_jdbc_url=url))
    with pytest.raises(ReportError) as caught:
        read(spark, jdbc, CONVERSATION, None, None)
    message = str(caught.value)
    assert message.startswith("PostgreSQL cannot be reached"), message
    assert "\n" not in message and "at org." not in message


@pytest.fixture(scope="module")
def password_server() -> Iterator[int]:
    """A throwaway PostgreSQL cluster that asks for a password (the machine's trusts all)."""
    try:
        server = PostgresServer(password="right-password")
    except ServerUnavailable as exc:
        _unavailable("initdb", exc)
    with server:
        yield server.port


def test_a_wrong_password_is_named(
    spark: Any, store: tuple[str, Engine], password_server: int
) -> None:
    url = f"jdbc:postgresql://127.0.0.1:{password_server}/postgres"
    right = Jdbc.from_settings(
        settings_for(store[0], report_jdbc_url=url, report_jdbc_password="right-password")
    )
    assert (
        spark.read.format("jdbc")
        .options(**right.options())
        .option("dbtable", "(SELECT 1 AS one) t")
        .load()
        .first()["one"]
        == 1
    )
    wrong = Jdbc.from_settings(
        settings_for(store[0], report_jdbc_url=url, report_jdbc_password="wrong")
    )
    with pytest.raises(ReportError) as caught:
        read(spark, wrong, CONVERSATION, None, None)
    message = str(caught.value)
    assert message.startswith("PostgreSQL refused the password"), message
    assert "ORDERLY_REPORT_JDBC_PASSWORD" in message and "at org." not in message


def test_the_command_prints_one_line_not_a_stack_trace(
    store: tuple[str, Engine], password_server: int, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env.update(
        {
            "ORDERLY_DATABASE_URL": store[0],
            "ORDERLY_REPORT_JDBC_URL": f"jdbc:postgresql://127.0.0.1:{password_server}/postgres",
            "ORDERLY_REPORT_JDBC_PASSWORD": "wrong",
            "ORDERLY_REPORT_OUTPUT_DIR": str(tmp_path),
        }
    )
    done = subprocess.run(
        [str(BIN / "orderly"), "report"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "orderly report: PostgreSQL refused the password" in done.stderr
    assert "Traceback" not in done.stderr and "\tat org." not in done.stderr
    assert "Py4JJavaError" not in done.stderr
