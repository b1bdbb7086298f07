"""ORDERLY_LOG_FORMAT=json: the API, a worker and beat write one JSON object per line, and the
records of work carry its ids (message, correlation, conversation, task) and the node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import message, wait_until
from tests.stack import Stack
from tooling.sink import Sink


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def _records(text: str) -> list[dict[str, Any]]:
    """Every line that is a log record (Celery's own prints, such as "worker: Warm shutdown",
    are not records)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            record = json.loads(line)  # a line that starts as JSON must be JSON
            assert {"time", "level", "logger", "message"} <= set(record), line
            found.append(record)
    return found


def test_json_logs_carry_the_ids_of_the_work(stack: Stack, sink: Sink) -> None:
    stack.env(ORDERLY_LOG_FORMAT="json")
    stack.start_api()
    worker = stack.worker(node="json-worker")
    stack.beat()
    http = stack.http
    channel = {"url": sink.url, "delivery_delay_ms": 20, "attempts": 3, "timeout_ms": 1000}
    assert http.put("/channels/chat", json=channel).status_code == 200
    msg_id = stack.submit(message(1, service="test", operation="say", payload="hello"))
    stack.wait_state(msg_id, "OK")
    assert (
        http.post(
            "/conversations/conv-7/requests", json={"request_id": "r1", "origin": "chat"}
        ).status_code
        == 201
    )
    response = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}, "last": True}
    assert http.post("/conversations/conv-7/responses", json=response).status_code == 201
    wait_until(lambda: bool(sink.arrivals()), 30, "the response delivered")

    def worker_records() -> list[dict[str, Any]]:
        return _records(worker.log_path.read_text())

    def said() -> list[dict[str, Any]]:
        return [r for r in worker_records() if r["message"] == "saying hello"]

    wait_until(lambda: bool(said()), 30, "the handler's record in the worker's log")
    (record,) = said()
    assert record["msg_id"] == msg_id
    assert record["correlation_id"] == "corr-1"
    assert record["task"] == "orderly.process.message" and record["task_id"]
    assert record["node"] == "json-worker"
    assert record["level"] == "INFO" and record["logger"] == "tooling.handlers"

    def drained() -> list[dict[str, Any]]:
        return [r for r in worker_records() if r.get("conversation_id") == "conv-7"]

    wait_until(lambda: bool(drained()), 30, "a record of the conversation's drain")
    assert all(r["task"] == "orderly.deliver.conversation" for r in drained())
    # Every process wrote records, and beat's carry its node too.
    for proc in stack.procs.procs:
        if proc.name == "beat":
            records = _records(proc.log_path.read_text())
            assert records and all("node" in r for r in records)
