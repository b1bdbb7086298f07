"""The report on a real Spark standalone cluster: a master and two workers started from
pyspark's own distribution on this machine, the report's driver here with master
``spark://127.0.0.1:PORT``. Its aggregates are those of local[*] and of the SQL twins, its
JDBC reads ran as tasks on both executors (the tasks' own metrics, from Spark's event log),
the JDBC jar reached the executors through ``spark.jars``, and ``orderly report --master``
runs on it too.

Skipped only where a component cannot exist here (no Java, no pyspark, no JDBC jar); a
cluster that does not come up where Java is fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from orderly.reports.aggregates import AGGREGATES
from orderly.reports.job import ReportOptions, compute, run_report
from orderly.reports.source import Jdbc, spark_session
from orderly.worker.settings import Settings
from tests.conftest import _unavailable
from tests.test_report import (
    JAR,
    START,
    _database,
    _is_pct,
    _same,
    assert_same_rows,
)
from tooling.generate import generate
from tooling.processes import BIN
from tooling.spark_cluster import ClusterUnavailable, StandaloneCluster

pytestmark = pytest.mark.e2e

EXECUTOR_CONF = {
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.cores.max": "2",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[StandaloneCluster]:
    try:
        made = StandaloneCluster(workers=2, cores=1, memory="1g")
    except ClusterUnavailable as exc:
        pytest.skip(f"no Spark standalone cluster can run here: {exc}")
    if not JAR.is_file():
        _unavailable("the PostgreSQL JDBC driver", FileNotFoundError(str(JAR)))
    with made:  # torn down (every process group) however the tests end
        yield made


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, Engine]]:
    for url, engine in _database():
        generate(engine, 3_000, seed=17, start=START, days=2)
        yield url, engine


def _task_reads(event_log: Path) -> dict[str, int]:
    """Rows read by the JDBC scan tasks per executor, from the tasks' input metrics."""
    jdbc_stages: set[int] = set()
    ends: list[dict[str, Any]] = []
    for line in event_log.read_text().splitlines():
        event = json.loads(line)
        kind = event.get("Event")
        if kind == "SparkListenerStageSubmitted":
            info = event["Stage Info"]
            if any("JDBCRDD" in str(rdd.get("Name", "")) for rdd in info.get("RDD Info", [])):
                jdbc_stages.add(info["Stage ID"])
        elif kind == "SparkListenerTaskEnd":
            ends.append(event)
    rows: dict[str, int] = defaultdict(int)
    for event in ends:
        if event["Stage ID"] in jdbc_stages:
            read = event["Task Metrics"]["Input Metrics"]["Records Read"]
            rows[event["Task Info"]["Executor ID"]] += read
    return dict(rows)


def test_the_report_runs_on_the_cluster_as_on_local(
    cluster: StandaloneCluster, store: tuple[str, Engine], tmp_path: Path
) -> None:
    url, engine = store
    settings = Settings(database_url=url, report_partitions=4)
    jdbc = Jdbc.from_settings(settings)
    events = tmp_path / "events"
    events.mkdir()
    conf = {
        **EXECUTOR_CONF,
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": str(events),
        "spark.eventLog.rolling.enabled": "false",  # one plain JSON-lines file
        "spark.eventLog.compress": "false",
    }
    spark = spark_session(jdbc, cluster.url, "1g", app="orderly-report-cluster", conf=conf)
    try:
        assert spark.sparkContext.master == cluster.url
        app_id = spark.sparkContext.applicationId
        result = run_report(ReportOptions(output_dir=tmp_path / "out"), settings, spark=spark)
    finally:
        spark.stop()

    # The master ran the application, with an executor on each worker.
    apps = cluster.state().get("completedapps", []) + cluster.state().get("activeapps", [])
    assert app_id in {a.get("id") for a in apps}
    # Both executors read JDBC ranges (the driver cannot: on a cluster it runs no tasks), and
    # together they read every row: the jar reached them, the reads were split.
    reads = _task_reads(events / app_id)
    assert len([e for e, n in reads.items() if n > 0]) >= 2, reads
    assert "driver" not in reads
    assert sum(reads.values()) >= sum(result.data.rows_read.values()), reads

    # The cluster's aggregates are the SQL twins' ...
    for twin in AGGREGATES:
        assert_same_rows(result.data.get(twin.name), engine, twin, (None, None))
        assert (result.folder / "parquet" / twin.name).is_dir()
    assert result.html.read_text().startswith("<!DOCTYPE html>")

    # ... and local[*]'s, value for value (percentiles too: the same sketch of the same rows).
    local = spark_session(jdbc, "local[*]", "1g", app="orderly-report-local")
    try:
        on_local, read_local = compute(local, jdbc, None, None)
    finally:
        local.stop()
    assert read_local.rows == result.data.rows_read
    for mine in on_local:
        theirs = result.data.get(mine.name)
        assert len(mine.rows) == len(theirs.rows), mine.name
        for a, b in zip(mine.rows, theirs.rows, strict=True):
            for column in mine.columns:
                if _is_pct(column):
                    assert a[column] == b[column], (mine.name, column, a, b)
                else:
                    assert _same(column, a[column], b[column]), (mine.name, column, a, b)


def test_orderly_report_runs_on_the_cluster(
    cluster: StandaloneCluster, store: tuple[str, Engine], tmp_path: Path
) -> None:
    env = dict(os.environ)
    env.update(
        {
            "ORDERLY_DATABASE_URL": store[0],
            "ORDERLY_REPORT_OUTPUT_DIR": str(tmp_path),
            "ORDERLY_REPORT_DRIVER_MEMORY": "1g",
            "ORDERLY_REPORT_EXECUTOR_MEMORY": "512m",
        }
    )
    done = subprocess.run(
        [str(BIN / "orderly"), "report", "--master", cluster.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("report "), done.stdout
    # The cached tables are released before the session stops: no executor left mid-request.
    noise = [line for line in done.stderr.splitlines() if "ERROR" in line or "Exception" in line]
    assert not noise, done.stderr
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run / "report.html").is_file()
    assert sorted(p.name for p in (run / "parquet").iterdir()) == sorted(a.name for a in AGGREGATES)
    apps = cluster.state().get("completedapps", [])
    assert any(a.get("name") == "orderly-report" for a in apps), apps
