"""The running totals behind GET /metrics' counters and histograms (worker.totals), against the
real PostgreSQL: processes' increments add up, histograms come back whole, a purge and a
restart lower nothing, a forked child flushes only its own counts, a failed write is kept."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.exposition import generate_latest
from sqlalchemy import Engine

from orderly.api.metrics import make_registry
from orderly.worker.handlers import HandlerRegistry, MessageContext
from orderly.worker.messages.batches import process_batch
from orderly.worker.messages.intake import Intake
from orderly.worker.observe import Figures
from orderly.worker.purge import purge
from orderly.worker.totals import (
    HANDLER_SECONDS,
    HTTP_REQUESTS,
    LATE_RESPONSES,
    MESSAGES_PROCESSED,
    TALLY,
    Series,
    Tally,
    Totals,
)
from tests.helpers import ManualClock, message, wait_until
from tests.test_metrics import parse, value

from .test_batches import batch_processor


def scraped(db: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape shows of the stored totals, through prometheus_client's text format."""
    figures = Figures(None, None, None, None, None, totals=Totals(db).read())
    return parse(generate_latest(make_registry(lambda: figures)).decode())


def test_two_processes_add_up_and_a_histogram_comes_back_whole(db: Engine) -> None:
    totals = Totals(db)
    first, second = Tally(), Tally()
    for tally in (first, second):
        tally.attach(totals.add, 60.0)
    first.add(MESSAGES_PROCESSED, "billing", "charge", "OK", amount=3)
    second.add(MESSAGES_PROCESSED, "billing", "charge", "OK")
    second.add(MESSAGES_PROCESSED, "billing", "charge", "FAILED")
    for seconds in (0.0004, 0.003, 0.003, 7.0, 99.0):
        first.observe(HANDLER_SECONDS, "billing", "charge", seconds=seconds)
    first.flush()
    second.flush()

    samples = scraped(db)
    labels = {"service": "billing", "operation": "charge"}
    assert value(samples, "orderly_messages_processed_total", **labels, outcome="OK") == 4
    assert value(samples, "orderly_messages_processed_total", **labels, outcome="FAILED") == 1
    bucket = "orderly_handler_duration_seconds_bucket"
    assert value(samples, bucket, **labels, le="0.001") == 1  # cumulative, by upper bound
    assert value(samples, bucket, **labels, le="0.005") == 3
    assert value(samples, bucket, **labels, le="5.0") == 3
    assert value(samples, bucket, **labels, le="10.0") == 4
    assert value(samples, bucket, **labels, le="60.0") == 4
    assert value(samples, bucket, **labels, le="+Inf") == 5
    assert value(samples, "orderly_handler_duration_seconds_count", **labels) == 5
    assert value(samples, "orderly_handler_duration_seconds_sum", **labels) == pytest.approx(
        106.0064
    )
    # A counter without labels that nobody counted yet is there, at 0; one with labels is not.
    assert value(samples, "orderly_late_responses_total") == 0
    assert not [k for k in samples if k[0] == "orderly_http_requests_total"]


def test_wrong_labels_are_refused_before_anything_is_counted(db: Engine) -> None:
    tally = Tally()
    tally.attach(Totals(db).add, 60.0)
    with pytest.raises(ValueError, match="take 3 values, not 2"):
        tally.add(MESSAGES_PROCESSED, "billing", "charge")
    tally.flush()
    assert Totals(db).read() == []


def test_a_purge_and_a_restart_lower_no_total(
    db: Engine, intake: Intake, redis_client: redis.Redis
) -> None:
    TALLY.attach(Totals(db).add, 60.0)  # the db fixture detaches it after the test
    own = HandlerRegistry()
    own.add("test", "script", lambda ctx: None)
    for n in range(4):
        intake.submit(message(n))
    done, _ = process_batch(batch_processor(db, redis_client, own), 10, lambda _: None)
    assert len(done) == 4
    TALLY.flush()
    ok = {"service": "test", "operation": "script", "outcome": "OK"}
    assert value(scraped(db), "orderly_messages_processed_total", **ok) == 4

    later = ManualClock(time.time() + 60)
    report = purge(db, datetime.now(UTC) + timedelta(seconds=30), batch_size=100, clock=later)
    assert report.rows["message"] == 4  # every processed message is gone ...
    assert value(scraped(db), "orderly_messages_processed_total", **ok) == 4  # ... not its count

    restarted = Tally()  # a new process adds to what the one before left
    restarted.attach(Totals(db).add, 60.0)
    restarted.add(MESSAGES_PROCESSED, "test", "script", "OK")
    restarted.flush()
    assert value(scraped(db), "orderly_messages_processed_total", **ok) == 5


def test_the_flush_thread_writes_within_its_interval_and_only_when_something_was_counted(
    db: Engine,
) -> None:
    writes: list[int] = []
    totals = Totals(db)

    def sink(increments: Mapping[Series, float]) -> None:
        totals.add(increments)
        writes.append(len(increments))  # once written

    tally = Tally()
    tally.attach(sink, 0.05)
    tally.add(HTTP_REQUESTS, "GET", "/metrics", "200")
    tally.add(HTTP_REQUESTS, "GET", "/metrics", "200")
    wait_until(lambda: writes == [1], timeout=10, what="the increments written")
    assert value(scraped(db), "orderly_http_requests_total", method="GET", route="/metrics",
                 status="200") == 2  # fmt: skip
    tally.add(LATE_RESPONSES)
    wait_until(lambda: writes == [1, 1], timeout=10, what="the next interval's write")
    threads = [t for t in threading.enumerate() if t.name == "orderly-totals"]
    assert threads and all(t.is_alive() for t in threads)  # waiting, not polling: see Tally._run
    assert value(scraped(db), "orderly_late_responses_total") == 1


def test_a_failed_write_keeps_its_increments_for_the_next(db: Engine) -> None:
    totals = Totals(db)
    fail = [True]

    def sink(increments: Mapping[Series, float]) -> None:
        if fail.pop():
            raise ConnectionError("PostgreSQL is away")
        totals.add(increments)

    tally = Tally()
    tally.attach(sink, 60.0)
    tally.add(LATE_RESPONSES, amount=2)
    tally.flush()
    assert totals.read() == []
    fail.append(False)
    tally.flush()
    assert value(scraped(db), "orderly_late_responses_total") == 2


def _child(url: str) -> None:
    from sqlalchemy import create_engine

    TALLY.attach(Totals(create_engine(url)).add, 60.0)
    TALLY.add(LATE_RESPONSES)  # a new process: its own thread, not the parent's pending
    TALLY.flush()
    os._exit(0)


def test_a_forked_child_flushes_its_own_counts_not_its_parents(db: Engine) -> None:
    TALLY.attach(Totals(db).add, 60.0)
    TALLY.add(LATE_RESPONSES, amount=5)  # pending in the parent when it forks
    child = multiprocessing.get_context("fork").Process(
        target=_child, args=(db.url.render_as_string(hide_password=False),)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert value(scraped(db), "orderly_late_responses_total") == 1
    TALLY.flush()
    assert value(scraped(db), "orderly_late_responses_total") == 6


def test_a_handler_run_is_counted_by_outcome_and_timed(
    db: Engine, intake: Intake, redis_client: redis.Redis
) -> None:
    TALLY.attach(Totals(db).add, 60.0)

    def script(ctx: MessageContext) -> None:
        if ctx.correlation_id == "corr-1":
            raise RuntimeError("the ledger is closed")

    own = HandlerRegistry()
    own.add("test", "script", script)
    for n in range(3):
        intake.submit(message(n))
    process_batch(batch_processor(db, redis_client, own), 10, lambda _: None)
    TALLY.flush()
    samples = scraped(db)
    labels = {"service": "test", "operation": "script"}
    assert value(samples, "orderly_messages_processed_total", **labels, outcome="OK") == 2
    failed = value(samples, "orderly_messages_processed_total", **labels, outcome="PARTLY_FAILED")
    assert failed == 1
    assert value(samples, "orderly_handler_duration_seconds_count", **labels) == 3


def test_requests_are_counted_by_their_route_template_and_status(
    client: TestClient, db: Engine
) -> None:
    assert client.get("/messages/987654").status_code == 404
    assert client.get("/messages/987653").status_code == 404
    assert client.get("/console/login").status_code == 200
    assert client.get("/no/such/thing").status_code == 404
    TALLY.flush()
    samples = scraped(db)
    counted = {
        (dict(labels)["route"], dict(labels)["status"]): v
        for (name, labels), v in samples.items()
        if name == "orderly_http_requests_total"
    }
    assert counted[("/messages/{msg_id}", "404")] == 2  # the template, not the ids
    assert counted[("/console/login", "200")] == 1
    assert counted[("unmatched", "404")] == 1  # whatever path a client makes up
    timed = "orderly_http_request_duration_seconds_count"
    assert value(samples, timed, method="GET", route="/messages/{msg_id}") == 2


def test_an_operation_and_an_endpoint_have_their_failure_series_from_their_first_count(
    db: Engine,
) -> None:
    """At 0 before the first failure, so that an alert on the increase sees that one."""
    from orderly.worker.messages.processing import Outcome
    from orderly.worker.pubsub.delivery import _counted

    TALLY.attach(Totals(db).add, 60.0)
    proc = batch_processor_for(db)
    proc.count([(_claimed("billing", "charge"), Outcome.OK)])
    assert _counted({7: "DELIVERED", 8: "LOST_CLAIM"}, {7: 3, 8: 3}, [7, 8]) == [
        "DELIVERED",
        "LOST_CLAIM",
    ]
    TALLY.flush()
    samples = scraped(db)
    runs = "orderly_messages_processed_total"
    assert value(samples, runs, service="billing", operation="charge", outcome="OK") == 1
    assert value(samples, runs, service="billing", operation="charge", outcome="FAILED") == 0
    sends = "orderly_deliveries_sent_total"
    assert value(samples, sends, subscription="3", outcome="DELIVERED") == 1
    assert value(samples, sends, subscription="3", outcome="DEAD") == 0
    assert not [k for k in samples if k[0] == sends and dict(k[1])["outcome"] == "LOST_CLAIM"]


def _claimed(service: str, operation: str) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(service_name=service, operation_name=operation)


def batch_processor_for(db: Engine) -> Any:
    from tests.helpers import processor

    return processor(db)


def _flush_in_child() -> None:
    TALLY.add(LATE_RESPONSES)
    TALLY.flush()  # its own lock: not the one the parent's thread held at the fork
    os._exit(0)


def test_a_fork_while_a_flush_is_under_way_does_not_hang_the_child(db: Engine) -> None:
    TALLY.attach(Totals(db).add, 60.0)
    holding = threading.Event()
    release = threading.Event()

    def slow_flush() -> None:
        with TALLY._flushing:  # as a flush writing to PostgreSQL holds it
            holding.set()
            release.wait(30)

    flusher = threading.Thread(target=slow_flush)
    flusher.start()
    holding.wait(10)
    try:
        child = multiprocessing.get_context("fork").Process(target=_flush_in_child)
        child.start()
        child.join(20)
        assert child.exitcode == 0, "the child hung on its parent's lock"
    finally:
        release.set()
        flusher.join()
    assert value(scraped(db), "orderly_late_responses_total") == 1


def test_a_made_up_method_is_counted_as_other(client: TestClient, db: Engine) -> None:
    for method in ("PWN1", "PWN2", "GET"):
        client.request(method, "/health")
    TALLY.flush()
    methods = {
        dict(labels)["method"]
        for (name, labels), _ in scraped(db).items()
        if name == "orderly_http_requests_total"
    }
    assert methods == {"OTHER", "GET"}
