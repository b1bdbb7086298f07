"""ORDERLY_LOG_FORMAT=json: the API, a worker and beat, started by orderly's runners, write
nothing but JSON objects, one per line, and the records of work carry its ids (message,
correlation, conversation, task) and the node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from tests.helpers import api_key, message, wait_until
from tooling.processes import BIN, ProcessGroup, free_port, wait_http
from tooling.sink import Sink


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def _records(text: str) -> list[dict[str, Any]]:
    """Every line, as the log record it must be."""
    found = []
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            assert {"time", "level", "logger", "message"} <= set(record), line
            found.append(record)
    return found


def test_json_logs_carry_the_ids_of_the_work(procs: ProcessGroup, db: Engine, sink: Sink) -> None:
    port = free_port()
    env = {"ORDERLY_LOG_FORMAT": "json", "ORDERLY_API_PORT": str(port)}
    orderly = str(BIN / "orderly")
    api = procs.start("api", [orderly, "api"], {**env, "ORDERLY_NODE_CODE": "json-api"})
    wait_http(f"http://127.0.0.1:{port}/health", api)
    worker = procs.start(
        "worker",
        [orderly, "worker", "--concurrency", "1"],
        {**env, "ORDERLY_NODE_CODE": "json-worker"},
    )
    beat = procs.start("beat", [orderly, "beat"], {**env, "ORDERLY_NODE_CODE": "json-beat"})
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        timeout=10,
        headers={"Authorization": f"Bearer {api_key(db)}"},
    )
    channel = {"url": sink.url, "delivery_delay_ms": 20, "attempts": 3, "timeout_ms": 1000}
    assert http.put("/channels/chat", json=channel).status_code == 200
    body = message(1, service="test", operation="say", payload="hello")
    assert http.post("/messages", json=body).status_code == 201
    request = {"request_id": "r1", "origin": "chat"}
    assert http.post("/conversations/conv-7/requests", json=request).status_code == 201
    response = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}, "last": True}
    assert http.post("/conversations/conv-7/responses", json=response).status_code == 201
    wait_until(lambda: bool(sink.arrivals()), 60, "the response delivered")

    def worker_records() -> list[dict[str, Any]]:
        return _records(worker.log_path.read_text())

    def said() -> list[dict[str, Any]]:
        return [r for r in worker_records() if r["message"] == "saying hello"]

    wait_until(lambda: bool(said()), 60, "the handler's record in the worker's log")
    (record,) = said()
    assert record["msg_id"] >= 1 and record["correlation_id"] == "corr-1"
    # Processed in a batch by the worker its intake woke (worker/messages/wake.py).
    assert record["task"] == "orderly.process.due" and record["task_id"]
    assert record["node"] == "json-worker"
    assert record["level"] == "INFO" and record["logger"] == "tooling.handlers"

    def drained() -> list[dict[str, Any]]:
        return [r for r in worker_records() if r.get("conversation_id") == "conv-7"]

    wait_until(lambda: bool(drained()), 60, "a record of the conversation's drain")
    assert all(r["task"] == "orderly.deliver.conversation" for r in drained())
    # Nothing but records from the API and beat too, each with its node.
    wait_until(lambda: bool(_records(beat.log_path.read_text())), 30, "beat's records")
    assert all(r["node"] == "json-beat" for r in _records(beat.log_path.read_text()))
    assert all(r["node"] == "json-api" for r in _records(api.log_path.read_text()))


def test_bound_ids_in_both_formats_and_only_inside() -> None:
    import io
    import logging

    from orderly.worker.core import logs

    stream = io.StringIO()
    logger = logging.getLogger("orderly.test.logs")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logs.set_node("n1")
        logs.adopt(logger, "text")  # another library's formatter keeps its line, gains the ids
        with logs.bound(msg_id=7, correlation_id=None):
            logger.info("inside")
        logger.info("outside")
        logs.adopt(logger, "json")
        token = logs.push(conversation_id="c1")
        logger.info("json")
        logs.pop(token)
        logger.info("after")
    finally:
        logger.removeHandler(handler)
        logs.set_node("")
        logging.captureWarnings(False)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "inside [msg_id=7]" and lines[1] == "outside"
    assert json.loads(lines[2])["conversation_id"] == "c1" and json.loads(lines[2])["node"] == "n1"
    assert "conversation_id" not in json.loads(lines[3])


def test_every_failed_try_is_one_line_with_its_ids(procs: ProcessGroup, db: Engine) -> None:
    from orderly.worker import configuration

    # a retry 1 s after the first failure, and FAILED at the second
    for code, value in (
        ("asynch.partlyFailedIntervalSec", "1"),
        ("asynch.partlyFailedMultiplier", "1.0"),
        ("asynch.countPartlyFailsBeforeFailed", "1"),
    ):
        configuration.set_value(db, code, value)
    port = free_port()
    env = {"ORDERLY_LOG_FORMAT": "json", "ORDERLY_API_PORT": str(port)}
    orderly = str(BIN / "orderly")
    api = procs.start("api", [orderly, "api"], env)
    wait_http(f"http://127.0.0.1:{port}/health", api)
    worker = procs.start("worker", [orderly, "worker", "--concurrency", "1"], env)
    procs.start("beat", [orderly, "beat"], env)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        timeout=10,
        headers={"Authorization": f"Bearer {api_key(db)}"},
    )
    body = message(5, payload=json.dumps({"fail_times": 9, "code": "E_BOOM"}))
    made = http.post("/messages", json=body)
    assert made.status_code == 201, made.text
    msg_id = made.json()["msg_id"]

    def failures() -> list[dict[str, Any]]:
        return [
            r
            for r in _records(worker.log_path.read_text())
            if r.get("error_code") == "E_BOOM" and r.get("msg_id") == msg_id
        ]

    wait_until(lambda: len(failures()) >= 2, 60, "both tries' lines in the worker's log")
    first, last = failures()
    assert first["level"] == "WARNING" and last["level"] == "ERROR"
    for record in (first, last):
        assert record["correlation_id"] == "corr-5" and record["source_system"] == "crm"
        assert (record["service"], record["operation"]) == ("test", "script")
    assert first["attempt"] == 1 and first["next_due_at"] and "exception" not in first
    assert last["attempt"] == 2 and "scripted failure 1" in last["exception"]
    assert len(failures()) == 2  # one line per try
