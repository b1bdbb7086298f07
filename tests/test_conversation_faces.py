"""The HTTP API and the CLI of conversations, against the real store and the real broker."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker.celery import DELIVER_QUEUE
from tests.helpers import OrderlyCli, queued

CHANNEL = {"url": "http://127.0.0.1:9/deliver", "delivery_delay_ms": 10, "attempts": 2}


@pytest.fixture
def client(client: TestClient) -> TestClient:
    assert client.put("/channels/chat", json=CHANNEL).status_code == 200
    return client


def rows(db: Engine) -> int:
    with db.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM message")).scalar_one())


def test_request_response_and_repeats(client: TestClient, redis_client: redis.Redis) -> None:
    first = client.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    assert first.status_code == 201 and first.json()["state"] == "WAITING_FOR_RES"
    again = client.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    assert again.status_code == 200 and again.json()["msg_id"] == first.json()["msg_id"]
    body = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}, "last": True}
    created = client.post("/conversations/c1/responses", json=body)
    assert created.status_code == 201 and created.json()["state"] == "IN_QUEUE"
    assert client.post("/conversations/c1/responses", json=body).status_code == 200
    assert queued(DELIVER_QUEUE) == 1  # one drain for the conversation, not two
    view = client.get("/conversations/c1").json()
    assert [r["responseId"] for r in view["responses"]] == ["s1"]
    assert view["requests"][0]["requestId"] == "r1" and view["draining"] is True
    shown = client.get(f"/messages/{created.json()['msg_id']}").json()
    assert shown["parent_msg_id"] == first.json()["msg_id"]
    assert shown["parent_binding_type"] == "HARD"


@pytest.mark.parametrize(
    ("path", "raw", "status", "field", "needle"),
    [
        ("requests", b"{broken", 400, "body", "malformed JSON"),
        ("requests", b"[]", 422, "body", "JSON object"),
        ("requests", b'{"origin": "chat"}', 422, "request_id", "missing"),
        ("requests", b'{"request_id": "r", "origin": "fax"}', 422, "origin", "no channel"),
        ("requests", b'{"request_id": "r", "origin": "chat", "x": 1}', 422, "x", "unknown"),
        (
            "requests",
            b'{"request_id": "r", "origin": "chat", "timestamp": "noon"}',
            422,
            "timestamp",
            "ISO 8601",
        ),
        (
            "responses",
            b'{"request_id": "r9", "response_id": "s", "payload": 1}',
            404,
            "request_id",
            "'r9'",
        ),
        ("responses", b'{"request_id": "r1", "response_id": "s"}', 422, "payload", "missing"),
        (
            "responses",
            b'{"request_id": "r1", "response_id": "s", "payload": 1, "last": "y"}',
            422,
            "last",
            "boolean",
        ),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    client: TestClient,
    db: Engine,
    redis_client: redis.Redis,
    path: str,
    raw: bytes,
    status: int,
    field: str,
    needle: str,
) -> None:
    client.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    before_rows, before_keys = rows(db), sorted(redis_client.keys("bridge:queue:*"))
    answer = client.post(
        f"/conversations/c1/{path}", content=raw, headers={"content-type": "application/json"}
    )
    assert answer.status_code == status, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == field and needle in error["problem"], error
    assert rows(db) == before_rows
    assert sorted(redis_client.keys("bridge:queue:*")) == before_keys
    assert queued(DELIVER_QUEUE) == 0


@pytest.mark.parametrize(
    ("path", "body", "field", "needle"),
    [
        (
            "/conversations/c1:lease/requests",
            {"request_id": "r", "origin": "chat"},
            "conversation_id",
            "A-Z",
        ),
        (
            "/conversations/pendingMessages/requests",
            {"request_id": "r", "origin": "chat"},
            "conversation_id",
            "reserved",
        ),
        (
            "/conversations/c1/requests",
            {"request_id": "r:1", "origin": "chat"},
            "request_id",
            "pattern",
        ),
        (
            "/conversations/c1/responses",
            {"request_id": "r1", "response_id": "ответ", "payload": 1},
            "response_id",
            "pattern",
        ),
        (
            "/conversations/c2/requests",
            {"request_id": "r1", "origin": "chat"},
            "request_id",
            "conversation 'c1'",
        ),
        (
            "/conversations/c1/requests",
            {"request_id": "r", "origin": "chat", "timestamp": "0001-01-01T00:00:00+14:00"},
            "timestamp",
            "out of range",
        ),
    ],
)
def test_ids_that_could_reach_other_keys_are_refused(
    client: TestClient,
    db: Engine,
    redis_client: redis.Redis,
    path: str,
    body: dict[str, Any],
    field: str,
    needle: str,
) -> None:
    client.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    before_rows, before_keys = rows(db), sorted(redis_client.keys("bridge:queue:*"))
    answer = client.post(path, json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == field and needle in error["problem"], error
    assert rows(db) == before_rows
    assert sorted(redis_client.keys("bridge:queue:*")) == before_keys


def test_nan_payload_is_refused(client: TestClient, db: Engine) -> None:
    client.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    raw = b'{"request_id": "r1", "response_id": "s1", "payload": NaN}'
    answer = client.post(
        "/conversations/c1/responses", content=raw, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "payload"
    assert rows(db) == 1


def test_unknown_ack_is_404(client: TestClient) -> None:
    answer = client.post("/acks/nobody-knows", headers={"X-Orderly-Ack-Token": "A" * 43})
    assert answer.status_code == 404
    assert "nobody-knows" in answer.json()["errors"][0]["problem"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://x"}, "url"),
        ({"url": "http://[::1"}, "url"),
        ({"url": "http://127.0.0.1:99999/"}, "url"),
        ({}, "url"),
        ({"url": "http://x", "multiplier": 0.5}, "multiplier"),
        ({"url": "http://x", "attempts": -1}, "attempts"),
        ({"url": "http://x", "timeout_ms": 10**9}, "timeout_ms"),
        ({"url": "http://x", "colour": "red"}, "colour"),
    ],
)
def test_bad_channels_are_refused(client: TestClient, body: dict[str, Any], field: str) -> None:
    answer = client.put("/channels/other", json=body)
    assert answer.status_code == 422
    assert field in [e["field"] for e in answer.json()["errors"]]
    assert "other" not in [c["origin"] for c in client.get("/channels").json()]


def test_channel_put_and_list(client: TestClient) -> None:
    answer = client.put("/channels/sms", json={"url": "https://sms.example/in", "attempts": 0})
    assert answer.status_code == 200
    listed = {c["origin"]: c for c in client.get("/channels").json()}
    assert listed["sms"]["attempts"] == 0 and listed["sms"]["url"] == "https://sms.example/in"


def test_cli_conversation_commands(cli: OrderlyCli, db: Engine, redis_client: redis.Redis) -> None:
    done = cli("channel", "set", "chat", "--url", "http://127.0.0.1:9/x", "--attempts", "1")
    assert done.returncode == 0, done.stderr
    done = cli("conversation", "request", "c1", "--request-id", "r1", "--origin", "chat")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "WAITING_FOR_RES"
    done = cli(
        "conversation",
        "respond",
        "c1",
        "--request-id",
        "r1",
        "--response-id",
        "s1",
        "--payload",
        '{"text": "hi"}',
        "--last",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == "accepted"
    shown = json.loads(cli("conversation", "show", "c1").stdout)
    assert shown["responses"][0]["responseId"] == "s1"
    refused = cli(
        "conversation",
        "respond",
        "c1",
        "--request-id",
        "nope",
        "--response-id",
        "s2",
        "--payload",
        "x",
    )
    assert refused.returncode == 2 and "'nope'" in refused.stderr
    refused = cli("conversation", "ack", "unknown-ack")
    assert refused.returncode == 2 and "unknown-ack" in refused.stderr
    refused = cli("channel", "set", "bad", "--url", "gopher://x")
    assert refused.returncode == 2 and "url" in refused.stderr
