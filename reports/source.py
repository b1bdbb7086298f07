"""Where the report reads: the JDBC connection, the Spark session, partitioned reads, and Java
errors turned into messages a person can act on."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from functools import reduce
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy.engine import URL, make_url

from orderly.worker.core.errors import OrderlyError
from orderly.worker.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

LOG4J = Path(__file__).resolve().parent / "log4j2.properties"


class ReportError(OrderlyError):
    """The report cannot run: the message says why and what to change."""


@dataclass(frozen=True)
class Jdbc:
    url: str
    user: str
    password: str
    jar: str
    partitions: int
    fetchsize: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Jdbc:
        db = make_url(settings.database_url)
        url = settings.report_jdbc_url or _jdbc_url(db)
        user = settings.report_jdbc_user or db.username or "postgres"
        if settings.report_jdbc_password is not None:
            password = settings.report_jdbc_password.get_secret_value()
        else:
            password = db.password if isinstance(db.password, str) else ""  # already decoded
        return cls(
            url=url,
            user=user,
            password=password,
            jar=settings.report_jdbc_jar,
            partitions=settings.report_partitions,
            fetchsize=settings.report_fetchsize,
        )

    def check(self) -> None:
        """What can be known without Java: the jar is there, the URL is PostgreSQL's."""
        if not self.url.startswith("jdbc:postgresql://"):
            raise ReportError(
                f"the JDBC URL must start with jdbc:postgresql://, got {self.url.split('?')[0]!r}"
            )
        if not Path(self.jar).is_file():
            raise ReportError(
                f"the PostgreSQL JDBC driver {self.jar} does not exist: install Debian's "
                "libpostgresql-jdbc-java, or set ORDERLY_REPORT_JDBC_JAR to the jar's path"
            )

    def options(self) -> dict[str, str]:
        return {
            "url": self.url,
            "user": self.user,
            "password": self.password,
            "driver": "org.postgresql.Driver",
            "fetchsize": str(self.fetchsize),
            # Rows in PostgreSQL's binary format from the first execution (each read runs
            # once): no timestamps or numbers printed as text by the server and parsed back.
            "prepareThreshold": "-1",
        }


# libpq parameters of the database URL that mean the same to the JDBC driver.
_CARRIED = ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name", "connect_timeout")


def _jdbc_url(db: URL) -> str:
    """``ORDERLY_DATABASE_URL`` as a JDBC URL (host, port, database and the SSL settings)."""
    query = {k: (v if isinstance(v, str) else v[-1]) for k, v in db.query.items()}
    if "host" in query or (db.host or "").startswith("/"):
        raise ReportError(
            "ORDERLY_DATABASE_URL connects through a unix socket, which JDBC cannot: set "
            "ORDERLY_REPORT_JDBC_URL to a jdbc:postgresql://host:port/database URL"
        )
    host = db.host or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    carried = "&".join(f"{k}={quote(query[k], safe='/')}" for k in _CARRIED if k in query)
    return f"jdbc:postgresql://{host}:{db.port or 5432}/{db.database or ''}" + (
        f"?{carried}" if carried else ""
    )


def spark_session(
    jdbc: Jdbc,
    master: str,
    driver_memory: str,
    app: str = "orderly-report",
    conf: dict[str, str] | None = None,
    quick_jit: bool = True,
) -> Any:
    """A Spark session that can read PostgreSQL; local runs bind to 127.0.0.1 only.

    Trimmed for a report's few, short jobs: no web UI, no console progress, shuffles in as
    many partitions as the reads, no adaptive re-planning (each of a report's aggregations
    is one small job: re-planning it stage by stage costs more than it finds), the JDBC jar
    handed to the executors (``spark.jars``: on a cluster they fetch it from the driver).
    With ``quick_jit`` the JVMs compile with the client compiler only (C1): a report of a
    few million rows ends before the optimising compiler's work would pay off. A cluster's
    driver, which runs no tasks, compiles with C1 only either way. ``conf`` adds or
    overrides settings (e.g. executor memory and cores on a cluster, an event log).
    """
    jdbc.check()
    from pyspark.sql import SparkSession

    # Py4J logs every gateway connection at INFO; a report's output is its own lines.
    logging.getLogger("py4j").setLevel(logging.WARNING)

    if "PYSPARK_GATEWAY_PORT" in os.environ:
        # Under spark-submit the JVM runs already, configured by spark-submit's own options
        # (--master, --jars, --driver-memory): only the session's settings apply here.
        try:
            session = (
                SparkSession.builder.appName(app)
                .config("spark.sql.session.timeZone", "UTC")
                .getOrCreate()
            )
        except Exception as exc:
            raise ReportError(f"Spark did not start: {_first_line(exc)}") from None
        session.sparkContext.setLogLevel("ERROR")
        return session
    local = master.startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # A report is a batch job: the throughput collector spends less CPU than G1's concurrent
    # threads on a few short-lived JVMs.
    executor = f"-Dlog4j2.configurationFile=file:{LOG4J} -XX:+UseParallelGC"
    # The optimising compiler pays off only for the rows' loops: not below a few million
    # rows, nor in a cluster's driver, which plans and schedules but runs no tasks.
    c1 = " -XX:TieredStopAtLevel=1"
    driver = executor + (c1 if quick_jit or not local else "")
    executor += c1 if quick_jit else ""
    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.jars", jdbc.jar)
        .config("spark.driver.extraClassPath", jdbc.jar)
        .config("spark.driver.memory", driver_memory)
        .config("spark.driver.extraJavaOptions", driver)
        .config("spark.executor.extraJavaOptions", executor)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(max(2, jdbc.partitions)))
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        # Aggregates are small: their results are broadcast, not shuffled, when joined.
        .config("spark.sql.autoBroadcastJoinThreshold", str(32 * 1024 * 1024))
        # The tables are cached for one run: compressing them costs more than it saves.
        .config("spark.sql.inMemoryColumnarStorage.compressed", "false")
        # Parquet outputs: no _SUCCESS marker, no summary files; a Spark-less reader sees
        # only the data.
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.sql.parquet.compression.codec", "snappy")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    if local:
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
    try:
        session = builder.getOrCreate()
    except Exception as exc:
        raise ReportError(f"Spark did not start: {_first_line(exc)}") from None
    session.sparkContext.setLogLevel("ERROR")
    return session


@dataclass(frozen=True)
class Table:
    """What one read takes: only these columns, only rows in the window, split on ``key``."""

    name: str
    columns: tuple[str, ...]
    key: str
    window: str | None = None  # column compared with [since, until)
    partitioned: bool = True
    # What the read selects from, when not the table alone (e.g. a join for a column of
    # another, or the same table read another way)
    source: str = ""
    where: str = ""  # which rows of the window, when not all
    # The columns a range of ``key`` bounds, when not ``key`` alone (e.g. both sides of a join)
    range_columns: tuple[str, ...] = ()
    # The table the key's span is looked up in, when not the whole source (e.g. a join's side
    # that holds the key and the window)
    spans_from: str = ""
    # A text key (e.g. a conversation's id, whose rows a read must hold together): its ranges
    # are cut at the key's quantiles among the read's rows, not evenly between its smallest
    # and largest value
    text_key: bool = False

    @property
    def from_(self) -> str:
        return self.source or self.name

    @property
    def relation(self) -> tuple[str, str, str | None, str | None]:
        """What its key span depends on: reads of one relation share it, filtered or not (a
        text key's cuts are of the filtered rows: its filter, or "true")."""
        cut_among = (self.where or "true") if self.text_key else None
        return (self.spans_from or self.from_, self.key, self.window, cut_among)


@dataclass(frozen=True)
class Span:
    """Where a read's ranges lie: an integer key's smallest and largest value in the window
    (cut evenly between them), or a text key's cuts (its quantiles among the read's rows)."""

    lo: int | None = None
    hi: int | None = None
    cuts: tuple[str, ...] = ()


NO_SPAN = Span()


def read(
    spark: SparkSession,
    jdbc: Jdbc,
    table: Table,
    since: str | None,
    until: str | None,
    span: Span | None = None,
) -> DataFrame:
    """Read ``table`` with its columns, window and filter pushed down to PostgreSQL; large
    reads in ranges of ``key`` within ``span`` (looked up when not given), one statement and
    one Spark task per range."""
    if span is None:
        span = spans(spark, jdbc, [table], since, until).get(table.name, NO_SPAN)
    return _ranged(spark, jdbc, table, ", ".join(table.columns), "", since, until, span)


def read_grouped(
    spark: SparkSession,
    jdbc: Jdbc,
    table: Table,
    select: str,
    group_by: str,
    since: str | None,
    until: str | None,
    span: Span,
    rows: str = "",
) -> DataFrame:
    """Aggregate ``table`` in PostgreSQL (``SELECT {select} ... GROUP BY {group_by}``) range by
    range of its key within ``span``: the rows are partial aggregates (counts, sums, maxima,
    rank summaries) of each range, which the caller adds up. What leaves the database is a few
    rows a range, not every row of the window. With ``rows``, ``select`` aggregates those
    values of the range's rows (e.g. a window function over them) instead of the table's."""
    return _ranged(spark, jdbc, table, select, f" GROUP BY {group_by}", since, until, span, rows)


def _ranged(
    spark: SparkSession,
    jdbc: Jdbc,
    table: Table,
    select: str,
    tail: str,
    since: str | None,
    until: str | None,
    span: Span,
    rows: str = "",
) -> DataFrame:
    """``SELECT {select} FROM`` the table's rows in the window (and its filter) ``{tail}``, as
    the union of one statement per range of its key within ``span`` (each read by a Spark
    task, in parallel): the range is inside the statement, so a grouped one groups by range
    and a read need not select its key. With ``rows``, the select is over those values of the
    rows (``SELECT {select} FROM (SELECT {rows} FROM ... WHERE ...) AS r {tail}``)."""
    window = _conditions(table.window, since, until) if table.window else "true"
    conds = [c for c in (window, f"({table.where})" if table.where else "") if c and c != "true"]
    ranges = _ranges(table, span, jdbc.partitions) if table.partitioned else [""]

    def load(r: str) -> DataFrame:
        where = " AND ".join([*conds, r] if r else conds) or "true"
        statement = f"SELECT {rows or select} FROM {table.from_} WHERE {where}"
        if rows:
            statement = f"SELECT {select} FROM ({statement}) AS r"
        frame: DataFrame = guarded(
            spark.read.format("jdbc")
            .options(**jdbc.options())
            .option("dbtable", f"({statement}{tail}) AS t")
            .load
        )
        return frame

    # One after another: each load is a connection of the driver's for the statement's
    # columns, and the cached reads are loaded side by side already (Frames.materialize).
    frames = [load(r) for r in ranges]
    union: DataFrame = reduce(lambda a, b: a.unionByName(b), frames)
    return union


def _ranges(table: Table, span: Span, partitions: int) -> list[str]:
    """Each range's condition on the key (on each of ``range_columns``); [""] for one range.
    An integer key's span is cut evenly; a text key at its cuts, the first range taking the
    rows without a key too."""
    columns = table.range_columns or (table.key,)
    if table.text_key:
        # In PostgreSQL's order (the column's collation), as percentile_disc gave them: a
        # sort here could disagree with the comparisons below and read some keys twice.
        cuts = [_literal(c) for c in dict.fromkeys(span.cuts)]
        if not cuts:
            return [""]
        first = [f"({c} < {cuts[0]} OR {c} IS NULL)" for c in columns]
        middle = [[f"{c} >= {a} AND {c} < {b}" for c in columns] for a, b in pairwise(cuts)]
        last = [f"{c} >= {cuts[-1]}" for c in columns]
        return [" AND ".join(r) for r in (first, *middle, last)]
    if span.lo is None or span.hi is None:
        return [""]
    lo, hi = span.lo, span.hi
    n = max(1, min(partitions, hi - lo + 1))
    edges = [lo + (hi + 1 - lo) * i // n for i in range(n + 1)]
    return [" AND ".join(f"{c} >= {a} AND {c} < {b}" for c in columns) for a, b in pairwise(edges)]


def _literal(value: str) -> str:
    """A text value as an escape-string literal: the same value whatever the server's
    ``standard_conforming_strings`` (a key is client-supplied text)."""
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def spans(
    spark: SparkSession,
    jdbc: Jdbc,
    tables: list[Table],
    since: str | None,
    until: str | None,
) -> dict[str, Span]:
    """The key spans of several tables' reads in one statement, run by the driver (no Spark
    job: the executors may still be starting); reads of one relation share one span (a
    filtered read's rows lie within it). A text key's
    cuts are its quantiles among the read's rows, ``jdbc.partitions`` ranges of about as many
    rows. Tables read whole (not partitioned, or in one range) have none."""
    if jdbc.partitions <= 1:
        return {}
    tables = [t for t in tables if t.partitioned]
    relations = list(dict.fromkeys(t.relation for t in tables))
    if not relations:
        return {}
    fractions = ", ".join(f"{i / jdbc.partitions!r}" for i in range(1, jdbc.partitions))
    parts = []
    for n, (from_, key, window, cut_among) in enumerate(relations):
        in_window = _conditions(window, since, until) if window else "true"
        conds = [c for c in (in_window, cut_among) if c and c != "true"]
        rows = f"{from_}{' WHERE ' + ' AND '.join(f'({c})' for c in conds) if conds else ''}"
        if cut_among is not None:
            parts.append(
                f"(SELECT percentile_disc(ARRAY[{fractions}]) WITHIN GROUP (ORDER BY {key})"
                f" AS cuts{n} FROM {rows}) s{n}"
            )
        else:
            parts.append(f"(SELECT min({key}) AS lo{n}, max({key}) AS hi{n} FROM {rows}) s{n}")
    row = guarded(_driver_row, spark, jdbc, f"SELECT * FROM {' CROSS JOIN '.join(parts)}")

    def span(n: int) -> Span:
        if f"cuts{n}" in row:
            return Span(cuts=tuple(c for c in row[f"cuts{n}"] or () if c is not None))
        return Span(row[f"lo{n}"], row[f"hi{n}"])

    n_of = {r: n for n, r in enumerate(relations)}
    return {t.name: span(n_of[t.relation]) for t in tables}


def _driver_row(spark: SparkSession, jdbc: Jdbc, statement: str) -> dict[str, Any]:
    """The one row of a small statement, read by the driver's JVM over JDBC (the report's
    URL, user and password); text arrays as tuples."""
    from py4j.java_gateway import JavaClass

    jvm: Any = spark.sparkContext._jvm
    driver = jvm.org.postgresql.Driver
    if not isinstance(driver, JavaClass):  # a package: the class is not on the driver's path
        raise ReportError(
            "Spark's driver has no PostgreSQL JDBC driver: check ORDERLY_REPORT_JDBC_JAR "
            "(libpostgresql-jdbc-java; under spark-submit, --driver-class-path)"
        )
    properties = jvm.java.util.Properties()
    properties.setProperty("user", jdbc.user)
    properties.setProperty("password", jdbc.password)
    connection = driver().connect(jdbc.url, properties)
    try:
        query = connection.createStatement()
        result = query.executeQuery(statement)
        meta = result.getMetaData()
        result.next()
        row = {}
        for i in range(1, meta.getColumnCount() + 1):
            value = result.getObject(i)
            if meta.getColumnType(i) == jvm.java.sql.Types.ARRAY and value is not None:
                value = tuple(value.getArray())
            row[meta.getColumnLabel(i)] = value
        query.close()  # and its result
        return row
    finally:
        connection.close()


_TS = re.compile(r"\A\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?([+-]\d{2}:?\d{2}|Z)?\Z")


def _conditions(column: str | None, since: str | None, until: str | None) -> str:
    """``column`` within ``[since, until)`` as SQL (``true`` without either)."""
    parts = []
    for value, op in ((since, ">="), (until, "<")):
        if value is None:
            continue
        if not _TS.match(value):
            raise ReportError(f"{value!r} is not an ISO timestamp (e.g. 2026-11-23T00:00:00Z)")
        parts.append(f"{column} {op} '{value}'::timestamptz")
    return " AND ".join(parts) or "true"


def guarded(call: Any, *args: Any) -> Any:
    """Run a Spark call; a Java failure becomes a ReportError naming its cause."""
    try:
        return call(*args)
    except ReportError:
        raise
    except Exception as exc:
        raise ReportError(explain(exc)) from None


# SQLSTATEs of the PostgreSQL driver that a person can fix, and what to say.
_SQLSTATE = {
    "28P01": "PostgreSQL refused the password of the report's user "
    "(ORDERLY_REPORT_JDBC_USER / ORDERLY_REPORT_JDBC_PASSWORD)",
    "28000": "PostgreSQL refused the report's user (no pg_hba.conf entry or no such role)",
    "3D000": "the database named in the JDBC URL does not exist",
    "08001": "PostgreSQL cannot be reached at the JDBC URL's host and port",
    "08004": "PostgreSQL refused the connection",
    "42P01": "a table the report reads does not exist (run `orderly migrate`)",
    "42703": "a column the report reads does not exist (run `orderly migrate`)",
    "53300": "PostgreSQL has no connection left for the report (max_connections): lower "
    "ORDERLY_REPORT_PARTITIONS or raise max_connections",
}


def explain(exc: BaseException) -> str:
    """One line for a failure that came through Py4J from the JVM (or any other)."""
    text = str(exc)
    # Py4J errors carry the Java exception as java_exception, Spark's captured ones as _origin.
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    sqlstate = None
    if java is not None:
        try:
            cause = java
            while cause is not None:
                if cause.getClass().getName() == "org.postgresql.util.PSQLException":
                    sqlstate = cause.getSQLState()
                    text = cause.getMessage()
                    break
                text = cause.toString()
                cause = cause.getCause()
        except Exception:
            pass
    if sqlstate is None:
        match = re.search(r"SQLState: ([0-9A-Z]{5})", text)
        sqlstate = match.group(1) if match else None
    first = _first_line(text)
    if sqlstate in _SQLSTATE:
        return f"{_SQLSTATE[sqlstate]}: {first}"
    if "No suitable driver" in text or "ClassNotFoundException: org.postgresql" in text:
        return (
            "Spark has no PostgreSQL JDBC driver: check ORDERLY_REPORT_JDBC_JAR "
            f"(libpostgresql-jdbc-java): {first}"
        )
    return f"the report failed: {first}"


def _first_line(value: object) -> str:
    text = str(value).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("at ", "Caused by", "---", "Traceback")):
            return line[:500]
    return text[:500]
