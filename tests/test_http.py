"""The HTTP face of intake, in process, against the real store and the real broker."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from orderly.worker.celery import PROCESS_QUEUE
from tests.helpers import count_messages, message, queued


def test_post_answers_201_then_get_shows_the_row(
    client: TestClient, redis_client: redis.Redis
) -> None:
    created = client.post("/messages", json=message(1, object_id="o-1"))
    assert created.status_code == 201
    body = created.json()
    assert body["state"] == "NEW"
    assert queued(PROCESS_QUEUE) == 1
    shown = client.get(f"/messages/{body['msg_id']}").json()
    assert shown["correlation_id"] == "corr-1" and shown["object_id"] == "o-1"
    assert shown["service_name"] == "test" and shown["failed_count"] == 0
    assert shown["receive_timestamp"]


def test_duplicate_answers_200_with_the_existing_message_and_enqueues_nothing(
    client: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    first = client.post("/messages", json=message(1)).json()
    again = client.post("/messages", json=message(1))
    assert again.status_code == 200 and again.json()["msg_id"] == first["msg_id"]
    assert count_messages(db) == 1
    assert queued(PROCESS_QUEUE) == 1


def test_unknown_message_is_404(client: TestClient) -> None:
    answer = client.get("/messages/12345")
    assert answer.status_code == 404
    assert "12345" in answer.json()["errors"][0]["problem"]


@pytest.mark.parametrize(
    ("raw", "status", "field", "needle"),
    [
        (b"{not json", 400, "body", "malformed JSON"),
        (b"", 400, "body", "malformed JSON"),
        (b'"a string"', 422, "body", "JSON object"),
        (None, 422, "msg_timestamp", "ISO 8601"),
    ],
)
def test_bad_bodies_are_refused_and_nothing_is_written(
    client: TestClient,
    db: Engine,
    redis_client: redis.Redis,
    raw: bytes | None,
    status: int,
    field: str,
    needle: str,
) -> None:
    content = (
        raw
        if raw is not None
        else (
            b'{"service":"test","operation":"script","correlation_id":"c","source_system":"s",'
            b'"msg_timestamp":"31/12/2026","payload":"x"}'
        )
    )
    answer = client.post("/messages", content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status
    error = answer.json()["errors"][0]
    assert error["field"] == field and needle in error["problem"]
    assert count_messages(db) == 0
    assert queued(PROCESS_QUEUE) == 0


def test_every_bad_field_is_listed(client: TestClient, db: Engine) -> None:
    data: dict[str, Any] = message(1, guaranteed_order="maybe")
    del data["source_system"]
    answer = client.post("/messages", json=data)
    assert answer.status_code == 422
    fields = {e["field"] for e in answer.json()["errors"]}
    assert fields == {"source_system", "guaranteed_order"}
    assert count_messages(db) == 0


def test_a_client_gone_before_its_body_is_read_is_no_failure(
    client: TestClient, db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The body never comes (the client disconnected): nothing stored, no 500 sent, and no
    error logged as if the API had failed."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/messages", "raw_path": b"/messages", "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
        "headers": [
            (b"authorization", client.headers["Authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"120"),
        ],
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level("DEBUG", logger="orderly.api"):
        client.portal.call(client.app, scope, receive, send)  # type: ignore[union-attr, arg-type, call-arg]
    assert sent == [] and count_messages(db) == 0
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []
    assert any("disconnected" in r.getMessage() for r in caplog.records)
