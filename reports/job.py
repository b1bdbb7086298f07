"""The report job: read the store over JDBC, compute every aggregate in Spark, write Parquet,
CSV and one HTML file per run (and, if asked, the aggregates back to PostgreSQL).

Run by ``orderly report`` and by ``spark-submit reports/job.py`` (same options). By default a
run is incremental: it reads only rows after the stored watermark and moves it forward when it
succeeds; ``--since``/``--until`` name a window and ``--full`` reads the whole store instead.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from orderly.reports.aggregates import AGGREGATES, TABLES, Aggregate, Frames
from orderly.reports.data import AggregateRows, Reads, ReportData
from orderly.reports.source import (
    NO_SPAN,
    Jdbc,
    ReportError,
    Table,
    guarded,
    read,
    read_grouped,
    spans,
    spark_session,
)
from orderly.reports.tables import Grouped
from orderly.worker.core import tracing
from orderly.worker.settings import Settings, get_settings

# Spark jobs submitted at once from the driver (reads, aggregates, writes).
PARALLEL_JOBS = 4


@dataclass(frozen=True)
class ReportOptions:
    since: datetime | None = None
    until: datetime | None = None
    incremental: bool = False
    watermark_name: str = "default"
    lag: timedelta = timedelta(0)
    output_dir: Path | None = None
    to_postgres: bool = False
    master: str | None = None


@dataclass(frozen=True)
class ReportResult:
    data: ReportData
    folder: Path
    html: Path
    total_s: float


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat()


def _plain(value: Any) -> Any:
    """Spark's values as the report keeps them (Decimal → float, datetime → ISO text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _sort_key(row: dict[str, Any], columns: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple((row[c] is not None, row[c]) for c in columns)


def compute(
    spark: Any,
    jdbc: Jdbc,
    since: datetime | None,
    until: datetime | None,
    parquet: Path | None = None,
    done: Callable[[AggregateRows], None] | None = None,
) -> tuple[list[AggregateRows], Reads]:
    """Every aggregate's rows (sorted), and what was read.

    The jobs: one for the key spans of every partitioned read, one that reads into memory
    what several passes take (reports.tables.CACHED: rows Spark needs, partial aggregates
    PostgreSQL computes, range by range as parallel tasks), then the aggregates,
    ``PARALLEL_JOBS`` at a time (a small job is mostly scheduling latency, which overlaps),
    each reading its single-use reads itself (reports.tables.SINGLE_USE).
    With ``parquet``, each aggregate is written there from its computed (cached) frame; each
    aggregate's rows go to ``done`` as soon as they are there (the charts start early).
    """
    lo, hi = _iso(since), _iso(until)
    spans_of = spans(spark, jdbc, list(TABLES), lo, hi)

    def load(source: Table | Grouped) -> Any:
        if isinstance(source, Grouped):
            t = source.table
            span = spans_of.get(t.name, NO_SPAN)
            return read_grouped(
                spark, jdbc, t, source.select, source.group_by, lo, hi, span, source.rows
            )
        return read(spark, jdbc, source, lo, hi, spans_of.get(source.name, NO_SPAN))

    frames = Frames(load)
    try:
        started = time.monotonic()
        reads = Reads(frames.materialize(), time.monotonic() - started)
        with ThreadPoolExecutor(max_workers=PARALLEL_JOBS) as pool:
            results = list(pool.map(lambda a: _rows_of(a, frames, parquet, done), AGGREGATES))
    finally:
        frames.release()
    return results, reads


def _rows_of(
    aggregate: Aggregate,
    frames: Frames,
    parquet: Path | None,
    done: Callable[[AggregateRows], None] | None,
) -> AggregateRows:
    frame = aggregate.spark(frames).select(*aggregate.columns)
    types = {f.name: _kind(f.dataType.simpleString()) for f in frame.schema.fields}
    if parquet is not None:
        # Typed as the CSV and the report tables are; computed once, written and collected.
        from pyspark.sql import functions as F

        frame = frame.select(*(F.col(c).cast(_SPARK_TYPES[types[c]]).alias(c) for c in types))
        frame = frame.cache()
    try:
        rows = [{c: _plain(v) for c, v in r.asDict().items()} for r in guarded(frame.collect)]
        if parquet is not None:
            target = str(parquet / aggregate.name)
            guarded(frame.coalesce(1).write.mode("overwrite").parquet, target)
    finally:
        if parquet is not None:
            frame.unpersist(blocking=True)
    columns = aggregate.columns
    rows.sort(key=lambda r: _sort_key(r, columns))
    result = AggregateRows(aggregate.name, aggregate.title, columns, rows, types)
    if done is not None:
        done(result)
    return result


_SPARK_TYPES = {"long": "bigint", "double": "double", "string": "string"}


def _kind(spark_type: str) -> str:
    if spark_type in ("bigint", "int", "smallint", "tinyint"):
        return "long"
    if spark_type in ("double", "float") or spark_type.startswith("decimal"):
        return "double"
    return "string"  # text, and timestamps as ISO text


def write_csv(data: ReportData, folder: Path) -> None:
    """CSV per aggregate, with a header also when empty."""
    for aggregate in data.aggregates:
        csv_path = folder / "csv" / f"{aggregate.name}.csv"
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(aggregate.columns))
            writer.writeheader()
            writer.writerows(aggregate.rows)


_SQL_TYPES = {"long": "bigint", "double": "double precision", "string": "text"}
_TAGS = {"run_id": "text", "window_since": "timestamp with time zone",
         "window_until": "timestamp with time zone"}  # fmt: skip


def _ensure_table(conn: Connection, aggregate: AggregateRows) -> str:
    """``report_<name>``, created on first use; a table whose columns differ is refused."""
    table = f"report_{aggregate.name}"
    wanted = {c: _SQL_TYPES[aggregate.types.get(c, "string")] for c in aggregate.columns}
    wanted.update(_TAGS)
    columns = ", ".join(f"{c} {t}" for c, t in wanted.items())
    conn.execute(text(f"CREATE TABLE IF NOT EXISTS {table} ({columns})"))
    have: dict[str, str] = dict(
        conn.execute(
            text(
                "SELECT column_name, data_type FROM information_schema.columns"
                " WHERE table_schema = current_schema() AND table_name = :t"
            ),
            {"t": table},
        ).all()
    )
    if have != wanted:
        raise ReportError(
            f"{table} has other columns than this report writes ({sorted(have)} instead of "
            f"{sorted(wanted)}): rename or drop it to start a new series"
        )
    return table


def write_to_postgres(conn: Connection, data: ReportData) -> None:
    """Append every aggregate to ``report_<name>`` with the run and its window (in the
    caller's transaction: with the watermark's move, or not at all)."""
    tags = {"run_id": data.run_id, "window_since": data.since, "window_until": data.until}
    for aggregate in data.aggregates:
        table = _ensure_table(conn, aggregate)
        if not aggregate.rows:
            continue
        names = [*aggregate.columns, *_TAGS]
        statement = text(
            f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(':' + n for n in names)})"
        )
        conn.execute(statement, [{**row, **tags} for row in aggregate.rows])


# --- the watermark --------------------------------------------------------------------------


def read_watermark(engine: Engine, name: str) -> datetime | None:
    with engine.connect() as conn:
        value = conn.execute(
            text("SELECT read_until FROM report_watermark WHERE name = :n"), {"n": name}
        ).scalar()
    return value if isinstance(value, datetime) else None


def move_watermark(
    conn: Connection, name: str, expected: datetime | None, until: datetime, run_id: str
) -> None:
    """Compare and set, in the caller's transaction: only from the value this run started
    from, so two runs never both report the same rows as new."""
    if expected is None:
        moved = conn.execute(
            text(
                "INSERT INTO report_watermark (name, read_until, run_id)"
                " VALUES (:n, :u, :r) ON CONFLICT (name) DO NOTHING RETURNING name"
            ),
            {"n": name, "u": until, "r": run_id},
        ).first()
    else:
        moved = conn.execute(
            text(
                "UPDATE report_watermark SET read_until = :u, run_id = :r, updated_at = now()"
                " WHERE name = :n AND read_until = :e RETURNING name"
            ),
            {"n": name, "u": until, "r": run_id, "e": expected},
        ).first()
    if moved is None:
        raise ReportError(
            f"the watermark {name!r} moved while this report ran (another incremental run?): "
            "its files are written; the watermark and the report tables are left to the other run"
        )


def _store_clock(engine: Engine) -> datetime:
    """The store's now: the time its rows are stamped with, whatever this host's clock says."""
    with engine.connect() as conn:
        value = conn.execute(text("SELECT now()")).scalar_one()
    assert isinstance(value, datetime)
    return value


# --- the run --------------------------------------------------------------------------------


def run_report(
    options: ReportOptions,
    settings: Settings | None = None,
    engine: Engine | None = None,
    spark: Any = None,
) -> ReportResult:
    """Run one report. A ``spark`` session given is used and left running (tests, the
    benchmark); otherwise one is started and stopped."""

    attributes = {"orderly.incremental": options.incremental, "spark.master": options.master}
    with tracing.span("report", attributes=attributes):  # a refused report's too, with why
        return _report(options, settings, engine, spark)


def _report(
    options: ReportOptions, settings: Settings | None, engine: Engine | None, spark: Any
) -> ReportResult:
    started = time.monotonic()
    # Bad options are named before what the environment lacks (the jar, the server).
    if options.lag < timedelta(0):
        raise ReportError("the lag must not be negative: rows not yet written would be skipped")
    settings = settings or get_settings()
    jdbc = Jdbc.from_settings(settings)
    jdbc.check()
    own_engine = engine is None and (options.incremental or options.to_postgres)
    if engine is None and (options.incremental or options.to_postgres):
        from orderly.worker.db.db import engine_for

        engine = engine_for(settings.database_url)
    try:
        return _run(options, settings, jdbc, engine, spark, started)
    finally:
        if own_engine and engine is not None:
            engine.dispose()


def _cluster(settings: Settings, master: str) -> dict[str, str]:
    """A cluster's executors: their memory and cores (local[*] runs in the driver)."""
    if master.startswith("local"):
        return {}
    return {
        "spark.executor.memory": settings.report_executor_memory,
        "spark.executor.cores": str(settings.report_executor_cores),
    }


def _run(
    options: ReportOptions,
    settings: Settings,
    jdbc: Jdbc,
    engine: Engine | None,
    spark: Any,
    started: float,
) -> ReportResult:
    from orderly.reports.render import chart_html, write_html

    since, until = options.since, options.until
    expected = None
    if options.incremental:
        assert engine is not None
        expected = read_watermark(engine, options.watermark_name)
        since = expected
        until = _store_clock(engine) - options.lag
    if since is not None and until is not None and since >= until:
        raise ReportError(f"the window is empty: since {_iso(since)} is not before {_iso(until)}")
    master = options.master or settings.report_master
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    folder = Path(options.output_dir or settings.report_output_dir) / run_id
    folder.mkdir(parents=True, exist_ok=True)
    own = spark is None
    # Charts are drawn beside the Spark work, each as soon as its aggregate's rows are there.
    charts: dict[str, Future[str]] = {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="report-charts") as drawing:

        def draw(aggregate: AggregateRows) -> None:
            charts[aggregate.name] = drawing.submit(chart_html, aggregate)

        if own:
            spark = spark_session(
                jdbc,
                master,
                settings.report_driver_memory,
                conf=_cluster(settings, master),
                quick_jit=settings.report_quick_jit,
            )
        spark_started = time.monotonic()
        try:
            aggregates, reads = compute(spark, jdbc, since, until, folder / "parquet", draw)
            data = ReportData(
                run_id=run_id,
                generated_at=datetime.now(UTC),
                since=since,
                until=until,
                aggregates=aggregates,
                rows_read=reads.rows,
                seconds=time.monotonic() - spark_started,
                read_s=reads.seconds,
                master=spark.sparkContext.master,
            )
        finally:
            if own:
                spark.stop()
        write_csv(data, folder)
        html = write_html(data, folder / "report.html", {n: f.result() for n, f in charts.items()})
    if engine is not None and (options.incremental or options.to_postgres):
        # The report tables and the watermark move together, or neither does.
        with engine.begin() as conn:
            if options.incremental and until is not None:
                move_watermark(conn, options.watermark_name, expected, until, run_id)
            if options.to_postgres:
                write_to_postgres(conn, data)
    return ReportResult(data, folder, html, time.monotonic() - started)


def _timestamp(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an ISO timestamp") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orderly report", description=__doc__.split("\n\n")[0])
    p.add_argument("--since", type=_timestamp, help="window start (ISO, UTC if no offset)")
    p.add_argument("--until", type=_timestamp, help="window end, exclusive")
    p.add_argument(
        "--incremental",
        action="store_true",
        help="from the stored watermark (the default without --since, --until or --full)",
    )
    p.add_argument("--full", action="store_true", help="the whole store; the watermark stays")
    p.add_argument("--watermark", default="default", help="the watermark's name")
    p.add_argument(
        "--lag-minutes",
        type=float,
        default=1.0,
        help="incremental: leave out the last minutes (rows stamped but not yet committed)",
    )
    p.add_argument("--output-dir", type=Path, help="default: ORDERLY_REPORT_OUTPUT_DIR")
    p.add_argument("--to-postgres", action="store_true", help="also append to report_* tables")
    p.add_argument("--master", help="Spark master (default: ORDERLY_REPORT_MASTER)")
    return p


def options_from(args: argparse.Namespace) -> ReportOptions:
    windowed = args.since is not None or args.until is not None
    if args.incremental and (windowed or args.full):
        raise ReportError(
            "--incremental takes its window from the watermark: drop --since/--until/--full"
        )
    if args.full and windowed:
        raise ReportError("--full reads the whole store: drop --since/--until")
    return ReportOptions(
        since=args.since,
        until=args.until,
        incremental=not (windowed or args.full),
        watermark_name=args.watermark,
        lag=timedelta(minutes=args.lag_minutes),
        output_dir=args.output_dir,
        to_postgres=args.to_postgres,
        master=args.master,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tracing.configure("orderly-report")
    try:
        result = run_report(options_from(args))
    except ReportError as exc:
        print(f"orderly report: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"orderly report: the store could not be read or written: {first}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"orderly report: the output could not be written: {exc}", file=sys.stderr)
        return 2
    print(f"report {result.data.run_id}: {result.html} ({result.total_s:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
