"""Scheduling, priority and the resubmission conflict through every face: the HTTP API (its
contract too), the command line, the Python client and the console. What is checked is what
intake stores and what each face says; when a worker takes a scheduled message up is tested
with the worker."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.client import AsyncClient, Conflict, ConflictingMessage, Invalid
from orderly.client.answers import MessageDetail
from orderly.client.errors import error_for
from orderly.worker.celery import PROCESS_QUEUE
from orderly.worker.messages.inputs import MAX_DELAY_MS
from tests.helpers import OrderlyCli, count_messages, message, queued

DAY_MS = 86_400_000


def stored(db: Engine) -> list[dict[str, Any]]:
    """Every message row's ids, content, due time and priority, by msg_id."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT msg_id, correlation_id, service_name, operation_name, payload, state,"
                " due_at, priority, receive_timestamp FROM message ORDER BY msg_id"
            )
        )
        return [dict(r._mapping) for r in rows]


# --- HTTP: what is stored -------------------------------------------------------------------


def test_delay_ms_sets_the_due_time_and_priority_is_stored(client: TestClient, db: Engine) -> None:
    before = datetime.now(UTC)
    created = client.post("/messages", json=message(1, delay_ms=60_000, priority=7))
    after = datetime.now(UTC)
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "NEW"
    (found,) = stored(db)
    # Due so many ms after intake, to the millisecond: both are the statement's now().
    assert found["due_at"] - found["receive_timestamp"] == timedelta(milliseconds=60_000)
    assert before + timedelta(seconds=60) <= found["due_at"] <= after + timedelta(seconds=60)
    assert found["priority"] == 7
    # Its detail and the list show both.
    shown = client.get(f"/messages/{found['msg_id']}").json()
    assert shown["priority"] == 7
    assert datetime.fromisoformat(shown["due_at"]) == found["due_at"]
    (listed,) = client.get("/messages").json()
    assert listed["priority"] == 7 and listed["due_at"] == shown["due_at"]


def test_not_before_sets_the_due_time_and_a_past_one_is_due_now(
    client: TestClient, db: Engine
) -> None:
    at = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    later = client.post("/messages", json=message(1, not_before=at.isoformat(), priority=-100))
    past = client.post("/messages", json=message(2, not_before="2026-01-01T00:00:00Z"))
    plain = client.post("/messages", json=message(3))
    assert [a.status_code for a in (later, past, plain)] == [201, 201, 201]
    first, second, third = stored(db)
    # Due no earlier than asked, and no later than the time intake took.
    assert at <= first["due_at"] < at + timedelta(seconds=5)
    assert first["priority"] == -100
    assert (second["due_at"], second["priority"]) == (None, 0)
    assert (third["due_at"], third["priority"]) == (None, 0)
    assert client.get(f"/messages/{third['msg_id']}").json()["due_at"] is None


@pytest.mark.parametrize(
    ("extra", "field", "needle"),
    [
        ({"delay_ms": 1000, "not_before": "2030-01-01T00:00:00Z"}, "not_before", "not both"),
        ({"priority": 101}, "priority", "100"),
        ({"priority": -101}, "priority", "-100"),
        ({"priority": "high"}, "priority", "integer"),
        ({"priority": True}, "priority", "integer"),
        ({"delay_ms": -1}, "delay_ms", "0"),
        ({"delay_ms": MAX_DELAY_MS + 1}, "delay_ms", str(MAX_DELAY_MS)),
        ({"delay_ms": 1.5}, "delay_ms", "integer"),
        ({"not_before": "tomorrow"}, "not_before", "ISO 8601"),
        ({"not_before": "2030-02-30T00:00:00Z"}, "not_before", ""),
    ],
)
def test_bad_scheduling_and_priority_are_refused_naming_the_field(
    client: TestClient,
    db: Engine,
    redis_client: redis.Redis,
    extra: dict[str, Any],
    field: str,
    needle: str,
) -> None:
    answer = client.post("/messages", json=message(1, **extra))
    assert answer.status_code == 422, answer.text
    errors = answer.json()["errors"]
    assert [e["field"] for e in errors] == [field]
    assert needle in errors[0]["problem"]
    assert count_messages(db) == 0 and queued(PROCESS_QUEUE) == 0


def test_the_longest_delay_is_taken(client: TestClient, db: Engine) -> None:
    """Delays beyond 2^31 ms (24.8 days) too, alone and in a batch, and a far not_before."""
    far = (datetime.now(UTC) + timedelta(days=300)).replace(microsecond=0)
    longest = client.post("/messages", json=message(1, delay_ms=MAX_DELAY_MS))
    assert longest.status_code == 201, longest.text
    batch = [message(2, delay_ms=2**31), message(3, not_before=far.isoformat())]
    assert client.post("/messages:batch", json={"messages": batch}).status_code == 201
    first, second, third = stored(db)
    assert first["due_at"] - first["receive_timestamp"] == timedelta(days=366)
    assert second["due_at"] - second["receive_timestamp"] == timedelta(milliseconds=2**31)
    assert far <= third["due_at"] < far + timedelta(seconds=5)


# --- HTTP: submitted again ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changed", "differs"),
    [
        ({"payload": '{"n": 2}'}, "another payload"),
        ({"payload": {"n": 1, "extra": True}}, "another payload"),
        ({"operation": "say"}, "another operation"),
        ({"service": "bench", "operation": "noop"}, "another service and operation"),
    ],
)
def test_another_message_under_stored_ids_is_409_and_writes_nothing(
    client: TestClient,
    db: Engine,
    redis_client: redis.Redis,
    changed: dict[str, Any],
    differs: str,
) -> None:
    first = client.post("/messages", json=message(1, payload={"n": 1}))
    assert first.status_code == 201
    msg_id = first.json()["msg_id"]
    rows, tasks = stored(db), queued(PROCESS_QUEUE)
    # Another timestamp and priority are not compared, and change nothing of the row.
    refused = client.post(
        "/messages", json=message(1, msg_timestamp="2027-01-01T00:00:00Z", priority=5, **changed)
    )
    assert refused.status_code == 409, refused.text
    (error,) = refused.json()["errors"]
    assert error["field"] == "correlation_id"
    assert f"message {msg_id} " in error["problem"] and differs in error["problem"]
    assert "'corr-1'" in error["problem"] and "'crm'" in error["problem"]
    assert stored(db) == rows and queued(PROCESS_QUEUE) == tasks
    assert rows[0]["payload"] == '{"n":1}'


def test_the_same_message_again_is_200_whatever_the_order_of_its_keys(
    client: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    payload = {"a": 1, "b": {"c": [1, 2], "d": None}}
    first = client.post("/messages", json=message(1, payload=payload))
    assert first.status_code == 201
    rows, tasks = stored(db), queued(PROCESS_QUEUE)
    for again in (
        payload,
        {"b": {"d": None, "c": [1, 2]}, "a": 1},  # another order of keys
        '{ "b": {"c": [1, 2], "d": null}, "a": 1 }',  # the same value as JSON text
    ):
        answer = client.post("/messages", json=message(1, payload=again, priority=9))
        assert answer.status_code == 200, answer.text
        assert answer.json() == first.json()
    assert stored(db) == rows and queued(PROCESS_QUEUE) == tasks
    # A list's order is its value: another order is another payload.
    assert client.post("/messages", json=message(2, payload=[1, 2])).status_code == 201
    assert client.post("/messages", json=message(2, payload=[2, 1])).status_code == 409


def test_a_batch_with_a_conflicting_message_stores_nothing(
    client: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    assert client.post("/messages", json=message(1, payload="one")).status_code == 201
    rows, tasks = stored(db), queued(PROCESS_QUEUE)
    conflicting = [
        message(2, delay_ms=1000),
        message(1, payload="another"),
        message(3, priority=3),
    ]
    refused = client.post("/messages:batch", json={"messages": conflicting})
    assert refused.status_code == 409, refused.text
    assert [e["field"] for e in refused.json()["errors"]] == ["messages[1].correlation_id"]
    assert f"message {rows[0]['msg_id']} " in refused.json()["errors"][0]["problem"]
    # Two messages of the batch itself under the same ids, with other payloads.
    twice = [message(4), message(5, payload="five"), message(5, payload="V")]
    again = client.post("/messages:batch", json={"messages": twice})
    assert again.status_code == 409, again.text
    assert stored(db) == rows and queued(PROCESS_QUEUE) == tasks
    # The same message again in a batch is its stored result; the new ones are stored.
    fine = [message(1, payload="one"), message(2, delay_ms=1000), message(3, priority=3)]
    taken = client.post("/messages:batch", json={"messages": fine})
    assert taken.status_code == 201, taken.text
    results = taken.json()["results"]
    assert [r["created"] for r in results] == [False, True, True]
    assert results[0]["msg_id"] == rows[0]["msg_id"]
    by_cid = {r["correlation_id"]: r for r in stored(db)}
    assert by_cid["corr-2"]["due_at"] - by_cid["corr-2"]["receive_timestamp"] == timedelta(
        seconds=1
    )
    assert (by_cid["corr-3"]["priority"], by_cid["corr-3"]["due_at"]) == (3, None)


# --- HTTP: the contract ---------------------------------------------------------------------


def test_the_contract_documents_the_fields_and_the_409(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    fields = document["components"]["schemas"]["MessageIn"]["properties"]
    delay = next(f for f in fields["delay_ms"]["anyOf"] if f.get("type") == "integer")
    assert (delay["minimum"], delay["maximum"]) == (0, MAX_DELAY_MS)
    assert {"format": "date-time", "type": "string"} in fields["not_before"]["anyOf"]
    assert (fields["priority"]["minimum"], fields["priority"]["maximum"]) == (-100, 100)
    assert fields["priority"]["default"] == 0
    errors = {"$ref": "#/components/schemas/Errors"}
    for path in ("/messages", "/messages:batch"):
        conflict = document["paths"][path]["post"]["responses"]["409"]
        assert conflict["content"]["application/json"]["schema"] == errors
        assert "correlation_id" in conflict["description"], path
    assert (
        "whole batch"
        in document["paths"]["/messages:batch"]["post"]["responses"]["409"]["description"]
    )
    # Other routes keep the generic 409.
    cancel = document["paths"]["/messages/{msg_id}/cancel"]["post"]["responses"]["409"]
    assert "state" in cancel["description"]
    row = document["components"]["schemas"]["MessageRow"]["properties"]
    assert {"priority", "due_at"} <= set(row)


# --- the Python client ----------------------------------------------------------------------


def test_the_client_sends_the_fields_and_raises_conflicting_message(
    client: TestClient, db: Engine
) -> None:
    token = client.headers["Authorization"].removeprefix("Bearer ")
    at = datetime.now(UTC) + timedelta(hours=2)

    async def run() -> tuple[int, ConflictingMessage, ConflictingMessage, MessageDetail]:
        transport = httpx.ASGITransport(app=client.app)
        async with AsyncClient("http://testserver", token, transport=transport) as orderly:
            # A datetime in a dict is sent as ISO 8601.
            sent = await orderly.submit(message(1, not_before=at, priority=4))
            assert sent.created
            again = await orderly.submit(message(1, not_before=at, priority=4))
            assert (again.msg_id, again.created) == (sent.msg_id, False)
            with pytest.raises(ConflictingMessage) as one:
                await orderly.submit(message(1, payload="changed"))
            with pytest.raises(ConflictingMessage) as many:
                await orderly.submit_many([message(2), message(1, operation="say")])
            with pytest.raises(Invalid) as invalid:
                await orderly.submit(message(3, delay_ms=5, not_before=at))
            assert invalid.value.fields == ["not_before"]
            return sent.msg_id, one.value, many.value, await orderly.message(sent.msg_id)

    msg_id, one, many, shown = asyncio.run(run())
    for refused, field in ((one, "correlation_id"), (many, "messages[1].correlation_id")):
        assert isinstance(refused, Conflict) and refused.status == 409
        assert refused.msg_id == msg_id and refused.fields == [field]
    assert shown["priority"] == 4
    assert shown.due_at is not None and at <= shown.due_at < at + timedelta(seconds=5)
    assert [r["correlation_id"] for r in stored(db)] == ["corr-1"]


def test_a_409_of_a_state_is_a_conflict_without_a_msg_id() -> None:
    state = error_for(409, {"errors": [{"field": "msg_id", "problem": "message 5: is OK"}]})
    assert type(state) is Conflict
    ids = error_for(
        409, {"errors": [{"field": "correlation_id", "problem": "message 12 holds ..."}]}
    )
    assert isinstance(ids, ConflictingMessage) and ids.msg_id == 12
    unnamed = error_for(409, {"errors": [{"field": "correlation_id", "problem": "taken"}]})
    assert isinstance(unnamed, ConflictingMessage) and unnamed.msg_id is None


# --- the console ----------------------------------------------------------------------------


def _cells(html: str, msg_id: int) -> str:
    found = re.search(rf'<tr data-msg-id="{msg_id}">(.*?)</tr>', html, re.S)
    assert found, html
    return found.group(1)


def test_the_console_shows_scheduled_messages_and_the_priority(
    client: TestClient, db: Engine
) -> None:
    later = client.post("/messages", json=message(1, delay_ms=DAY_MS, priority=12)).json()
    now = client.post("/messages", json=message(2)).json()
    listed = client.get("/console/messages")
    assert listed.status_code == 200, listed.text
    (due,) = [r["due_at"] for r in stored(db) if r["msg_id"] == later["msg_id"]]
    shown = due.astimezone(UTC).isoformat(sep=" ", timespec="milliseconds")
    assert f"scheduled {shown.removesuffix('+00:00')}" in _cells(listed.text, later["msg_id"])
    cells = _cells(listed.text, now["msg_id"])
    assert ">NEW<" in cells and "scheduled" not in cells
    page = client.get(f"/console/messages/{later['msg_id']}").text
    assert re.search(r'<dd id="priority">12</dd>', page)
    assert f'<dd id="due">{shown.removesuffix("+00:00")}</dd>' in page
    page = client.get(f"/console/messages/{now['msg_id']}").text
    assert '<dd id="priority">0</dd>' in page and '<dd id="due">none</dd>' in page


# --- the command line -----------------------------------------------------------------------


def _submit(cli: OrderlyCli, *args: str) -> Any:
    return cli(
        "submit",
        "--service",
        "test",
        "--operation",
        "script",
        "--correlation-id",
        "cli-1",
        "--source-system",
        "shell",
        *args,
    )


def test_cli_submit_schedules_with_a_priority_and_shows_them(cli: OrderlyCli, db: Engine) -> None:
    done = _submit(cli, "--payload", '{"n": 1}', "--delay-ms", "90000", "--priority", "-3")
    assert done.returncode == 0, done.stderr
    msg_id = json.loads(done.stdout)["msg_id"]
    (found,) = stored(db)
    assert found["due_at"] - found["receive_timestamp"] == timedelta(milliseconds=90_000)
    assert found["priority"] == -3
    shown = json.loads(cli("message", "show", str(msg_id)).stdout)
    assert shown["priority"] == -3 and shown["due_at"]
    at = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    other = cli(
        "submit",
        "--service",
        "test",
        "--operation",
        "script",
        "--correlation-id",
        "cli-2",
        "--source-system",
        "shell",
        "--payload",
        "x",
        "--not-before",
        at.isoformat(),
    )
    assert other.returncode == 0, other.stderr
    assert at <= stored(db)[1]["due_at"] < at + timedelta(seconds=10)


def test_cli_submit_refusals_and_the_conflict_exit_code(cli: OrderlyCli, db: Engine) -> None:
    assert _submit(cli, "--payload", "first").returncode == 0
    rows = stored(db)
    again = _submit(cli, "--payload", "first")
    assert again.returncode == 0 and json.loads(again.stdout)["result"] == "already known"
    conflict = _submit(cli, "--payload", "second")
    assert conflict.returncode == 3, conflict.stderr
    lines = conflict.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: message ")
    assert f"message {rows[0]['msg_id']} holds correlation_id 'cli-1'" in lines[0]
    assert "another payload" in lines[0]
    for refused, needle in (
        (_submit(cli, "--payload", "p", "--delay-ms", "5", "--not-before", "2030-01-01"), "both"),
        (_submit(cli, "--payload", "p", "--priority", "500"), "priority"),
        (_submit(cli, "--payload", "p", "--not-before", "soon"), "not_before"),
        (cli("submit", "--json", json.dumps(message(9)), "--priority", "1"), "--priority"),
    ):
        assert refused.returncode == 2, refused.stderr
        assert needle in refused.stderr, refused.stderr
    assert stored(db) == rows
