"""Hostile input through the real API (in process) on the real PostgreSQL and Redis: every bad
value answers 4xx naming where it is, writes nothing, and the connection stays usable."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker.pubsub import topic_matches
from tests.helpers import message, stored_keys

TABLES = ("message", "channel", "event", "delivery", "room", "event_type_version")


def rows(db: Engine) -> dict[str, int]:
    with db.connect() as conn:
        return {
            t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in TABLES
        }


def keys(r: redis.Redis) -> int:
    return stored_keys(r)


def _raw(client: TestClient, path: str, body: str, method: str = "POST") -> Any:
    return client.request(
        method, path, content=body.encode("utf-8"), headers={"Content-Type": "application/json"}
    )


BAD_BODIES = [
    # (a JSON text, the status, the field named)
    ('{"payload": "a\\u0000b"}', 422, "payload"),
    ('{"payload": {"x": ["\\ud800"]}}', 422, "payload.x[0]"),
    ('{"payload": {"k\\u0000": 1}}', 422, "payload.<key>"),
    ('{"payload": NaN}', 422, "payload"),
    ('{"payload": {"a": [-Infinity]}}', 422, "payload.a[0]"),
    ('{"payload": 1e999}', 422, "payload"),
    ('{"payload": ' + "9" * 5000 + "}", 422, "body"),
    ('{"payload": ' + "[" * 100 + "]" * 100 + "}", 422, "payload" + "[0]" * 64),
    ("[" * 200_000 + "]" * 200_000, 422, "body"),
    ('{"payload": "x"', 400, "body"),
]
# Not UTF-8: UTF-16 (which json.loads would take), and a surrogate encoded in UTF-8 bytes.
BAD_BYTES = [
    '{"correlation_id": "a\u0000b", "payload": "x"}'.encode("utf-16"),
    b'{"payload": {"s": "ab\xed\xa0\x80"}}',
]


@pytest.mark.parametrize(("body", "status", "field"), BAD_BODIES)
def test_bad_json_is_refused_naming_where_and_writes_nothing(
    client: TestClient, db: Engine, redis_client: redis.Redis, body: str, status: int, field: str
) -> None:
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    before, before_keys = rows(db), keys(redis_client)
    for path in ("/messages", "/rooms/r/events", "/conversations/c/requests"):
        answer = _raw(client, path, body)
        assert answer.status_code == status, (path, answer.text)
        assert answer.json()["errors"][0]["field"] == field, (path, answer.text)
    answer = _raw(client, "/channels/chat", body, "PUT")
    assert answer.status_code == status
    assert rows(db) == before and keys(redis_client) == before_keys
    # The same connection goes on.
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("raw", BAD_BYTES)
def test_a_body_that_is_not_utf8_is_400_and_writes_nothing(
    client: TestClient, db: Engine, raw: bytes
) -> None:
    before = rows(db)
    for path in ("/messages", "/rooms/r/events", "/conversations/c/responses"):
        answer = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert answer.json()["errors"][0]["field"] == "body"
    assert rows(db) == before


def test_a_body_over_the_limit_is_413(client: TestClient, db: Engine) -> None:
    before = rows(db)
    huge = '{"payload": "' + "x" * (1_048_576 + 70_000) + '"}'
    answer = _raw(client, "/messages", huge)
    assert answer.status_code == 413 and answer.json()["errors"][0]["field"] == "body"
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    over = {"routing_key": "a", "payload": "x" * 1_048_577}
    answer = client.post("/rooms/r/events", json=over)
    assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "payload"
    assert rows(db)["event"] == before["event"]


def test_nul_in_a_path_or_query_and_out_of_range_ids_are_refused(
    client: TestClient, db: Engine
) -> None:
    before = rows(db)
    assert client.get("/rooms/a%00b/subscriptions").status_code == 400
    answer = client.get("/messages?state=%00")
    assert answer.status_code == 400 and answer.json()["errors"][0]["field"] == "query"
    for path in ("/messages/99999999999999999999999", "/subscriptions/-1/messages"):
        answer = client.get(path)
        assert answer.status_code == 422, answer.text
        assert answer.json()["errors"][0]["field"] in ("msg_id", "subscription_id")
    answer = client.post("/messages/99999999999999999999999/cancel", json={"note": "n"})
    assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "msg_id"
    answer = client.get("/messages?limit=99999999999")
    assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "limit"
    answer = client.post("/messages", json=message(1, correlation_id="ok"))
    assert answer.status_code == 201  # the connection and the API go on
    assert rows(db)["message"] == before["message"] + 1


def test_an_infinite_multiplier_is_refused_and_the_channels_stay_listed(
    client: TestClient, db: Engine
) -> None:
    answer = _raw(
        client, "/channels/x", '{"url": "http://127.0.0.1:9/", "multiplier": 1e400}', "PUT"
    )
    assert answer.status_code == 422
    assert rows(db)["channel"] == 0
    assert client.get("/channels").status_code == 200


def test_a_catastrophic_pattern_runs_in_linear_time_and_a_backreference_is_refused(
    client: TestClient, db: Engine
) -> None:
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
    answer = client.post("/rooms/r/event-types", json={"name": "t", "version": 1, "schema": schema})
    assert answer.status_code == 201
    # With a backtracking engine this one publish would take longer than the test run.
    evil = {"event_type": "t", "payload": {"s": "a" * 5000 + "!"}}
    answer = client.post("/rooms/r/events", json=evil)
    assert answer.status_code == 422 and answer.json()["errors"][0]["field"] == "payload.s"
    fine = client.post("/rooms/r/events", json={"event_type": "t", "payload": {"s": "aaa"}})
    assert fine.status_code == 201
    backref = {"type": "string", "pattern": "(a)\\1"}
    answer = client.post(
        "/rooms/r/event-types", json={"name": "u", "version": 1, "schema": backref}
    )
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "schema.pattern"
    names = {"type": "object", "patternProperties": {"(?=x)": {}}}
    answer = client.post("/rooms/r/event-types", json={"name": "v", "version": 1, "schema": names})
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["field"] == "schema.patternProperties.(?=x)"


def test_topic_patterns_match_in_polynomial_time() -> None:
    # Without memoisation this pair explores about 10^9 ways to split the words.
    pattern = ".".join(["#"] * 12 + ["z"])
    key = ".".join(["a"] * 25)
    assert topic_matches(pattern, key) is False
    assert topic_matches(pattern, key + ".z") is True


def test_a_schema_registered_before_patterns_were_checked_refuses_publishes_clearly(
    client: TestClient, db: Engine
) -> None:
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    ok = {"type": "object", "properties": {"s": {"type": "string"}}}
    assert (
        client.post("/rooms/r/event-types", json={"name": "t", "version": 1, "schema": ok})
    ).status_code == 201
    with db.begin() as conn:  # as an older orderly stored it: a lookahead RE2 cannot run
        conn.execute(
            text("UPDATE event_type_version SET json_schema = CAST(:s AS jsonb)"),
            {"s": json.dumps({"type": "object", "properties": {"s": {"pattern": "(?=a)"}}})},
        )
    before = rows(db)["event"]
    answer = client.post("/rooms/r/events", json={"event_type": "t", "payload": {"s": "a"}})
    assert answer.status_code == 422, answer.text
    assert "new version" in answer.json()["errors"][0]["problem"]
    assert rows(db)["event"] == before
