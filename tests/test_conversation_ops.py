"""Operators' conversation operations against the real Redis and PostgreSQL: get a message,
delete a request's messages, set AWAITED by hand, move an awaited date, remove a message's
references at a time; the corr and lastAccess fields. Each test checks Redis and the rows,
and, where an operation leaves state behind, that a rebuild from the rows gives it again.

The harness is tests/test_conversations.py's (a clock the test moves, drains run here).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker import rebuild
from orderly.worker.conversations import Delivery, SendResult
from orderly.worker.core.errors import InvalidMessage, NotFound, OperationRefused
from orderly.worker.core.scripts import as_text

from .helpers import OrderlyCli
from .test_conversations import Harness, Recorder, make

RETRY = SendResult(Delivery.RECOVERABLE, 503, reason="busy")


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    yield make(db, redis_client)


def _row(h: Harness, correlation_id: str) -> dict[str, Any]:
    with h.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT state, failed_count, failed_error_code, custom_data, envelope, audit"
                " FROM message WHERE correlation_id = :c"
            ),
            {"c": correlation_id},
        ).one()
    return dict(row._mapping)


def _hash(h: Harness, cid: str, rid: str) -> dict[str, str]:
    raw = h.redis.hgetall(h.k.response(cid, rid))
    return {as_text(k): as_text(v) for k, v in raw.items()}


def _snapshot(h: Harness) -> dict[str, Any]:
    """Every conversation key and its value (to show that nothing changed)."""
    found: dict[str, Any] = {}
    for key in h.bridge_keys():
        kind = as_text(h.redis.type(key))
        if kind == "hash":
            found[key] = h.redis.hgetall(key)
        elif kind == "zset":
            found[key] = h.redis.zrange(key, 0, -1, withscores=True)
        elif kind == "list":
            found[key] = h.redis.lrange(key, 0, -1)
        else:
            found[key] = h.redis.get(key)
    return found


def _rows(h: Harness) -> list[Any]:
    with h.engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT msg_id, state, failed_count, custom_data, audit FROM message ORDER BY 1"
                )
            )
        )


def _refused(h: Harness, call: Callable[[], Any], error: type[Exception], what: str) -> None:
    """``call`` raises ``error`` naming ``what`` (the field, or the unknown id), and neither
    Redis nor PostgreSQL changed."""
    before, rows = _snapshot(h), _rows(h)
    with pytest.raises(error) as caught:
        call()
    if isinstance(caught.value, InvalidMessage):
        assert caught.value.field == what
    else:
        assert what in str(caught.value)
    assert _snapshot(h) == before and _rows(h) == rows


def _two_requests(h: Harness, cid: str = "c1") -> None:
    h.request(cid, "r1")
    h.response(cid, "r1", "s1")
    h.response(cid, "r1", "s2", last=True)
    h.request(cid, "r2")
    h.response(cid, "r2", "t1", last=True)


def _rebuilt(h: Harness) -> None:
    h.redis.flushdb()
    report = rebuild.rebuild(h.engine, h.conv, h.enqueue, lambda: None)
    assert report.done and report.marked_ready


# --- corr and lastAccess --------------------------------------------------------------------


def test_corr_and_last_access_are_kept_shown_and_rebuilt(h: Harness) -> None:
    h.conv.register_request("c1", {"request_id": "r1", "origin": "chat", "corr": "corr-r1"})
    h.clock.advance(2)
    h.conv.add_response(
        "c1",
        {"request_id": "r1", "response_id": "s1", "payload": 1, "corr": "corr s1"},
        h.enqueue,
    )
    assert h.redis.hget(h.k.request("c1", "r1"), "corr") == b"corr-r1"
    s1 = _hash(h, "c1", "s1")
    assert s1["corr"] == "corr s1" and int(s1["lastAccess"]) == int(h.clock.now * 1000)
    last_access = h.redis.hget(h.k.request("c1", "r1"), "lastAccess")
    assert int(as_text(last_access)) == int(h.clock.now * 1000)
    assert json.loads(_row(h, "s1")["envelope"])["corr"] == "corr s1"
    assert json.loads(_row(h, "r1")["envelope"])["corr"] == "corr-r1"
    # The gate reads and writes it: lastAccess moves (a claim that failed, a retry).
    h.clock.advance(3)
    h.run(Recorder(answers={"s1": [RETRY]}))
    assert int(_hash(h, "c1", "s1")["lastAccess"]) == int(h.clock.now * 1000)
    h.clock.advance(1)
    h.conv.can_send("c1", "s1")
    shown = h.conv.get_message(response_id="s1", fields="corr,lastAccess,state")
    assert shown == {
        "corr": "corr s1",
        "lastAccess": str(int(h.clock.now * 1000)),
        "state": "IN_QUEUE",
    }
    _rebuilt(h)
    assert _hash(h, "c1", "s1")["corr"] == "corr s1"
    assert "lastAccess" in _hash(h, "c1", "s1")
    assert h.redis.hget(h.k.request("c1", "r1"), "corr") == b"corr-r1"


@pytest.mark.parametrize("corr", ["", "a\nb", "x" * 256, 5])
def test_a_bad_corr_is_refused_and_nothing_is_written(h: Harness, corr: Any) -> None:
    with pytest.raises(InvalidMessage) as caught:
        h.conv.register_request("c1", {"request_id": "r1", "origin": "chat", "corr": corr})
    assert caught.value.field == "corr"
    assert h.bridge_keys() == [] and _rows(h) == []


# --- getConversationMessage -----------------------------------------------------------------


def test_get_by_response_id_and_by_async_response_id_with_a_projection(h: Harness) -> None:
    _two_requests(h)
    h.run(Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, async_response_id="A-1")]}))
    by_async = h.conv.get_message(async_response_id="A-1")
    assert by_async["responseId"] == "s1" and by_async["status"] == "SENT"
    assert by_async["asyncResponseId"] == "A-1" and by_async["taskItem"] == {"text": "s1"}
    assert by_async["state"] == "WAITING_FOR_RES" and by_async["inRedis"] is True
    assert h.conv.get_message(response_id="s2", fields=["status", "requestId"]) == {
        "status": "PENDING",
        "requestId": "r1",
    }
    h.conv.ack("A-1", h.enqueue)
    h.run(Recorder())
    # Delivered: gone from Redis, its row still tells.
    gone = h.conv.get_message(response_id="s1")
    assert gone["inRedis"] is False and gone["state"] == "OK" and gone["conversationId"] == "c1"


@pytest.mark.parametrize(
    ("options", "field_name"),
    [
        ({}, "response_id"),
        ({"response_id": "s1", "async_response_id": "A"}, "response_id"),
        ({"response_id": "s:1"}, "response_id"),
        ({"response_id": "s1", "fields": "status,colour"}, "fields"),
        ({"response_id": "s1", "fields": 7}, "fields"),
        ({"async_response_id": ""}, "async_response_id"),
    ],
)
def test_get_refuses_bad_options(h: Harness, options: dict[str, Any], field_name: str) -> None:
    _two_requests(h)
    with pytest.raises(InvalidMessage) as caught:
        h.conv.get_message(**options)
    assert caught.value.field == field_name


def test_get_of_an_unknown_id_is_not_found(h: Harness) -> None:
    _two_requests(h)
    with pytest.raises(NotFound, match="s9"):
        h.conv.get_message(response_id="s9")
    with pytest.raises(NotFound, match="A-9"):
        h.conv.get_message(async_response_id="A-9")


# --- deleteConversationRegister -------------------------------------------------------------


def test_delete_a_request_cancels_its_group_and_the_next_request_goes(h: Harness) -> None:
    _two_requests(h)
    rec = Recorder(answers={"s1": [RETRY]})
    h.run(rec)  # s1 waits for its retry: the conversation's drain ended
    assert rec.sent == ["s1"] and h.started == []
    done = h.conv.delete_register("c1", "r1", {"note": "wrong answers"}, h.enqueue, key="ops")
    assert not done.excepted and done.request_cancelled and sorted(done.deleted) == ["s1", "s2"]
    assert {h.state(x) for x in ("r1", "s1", "s2")} == {"CANCEL"}
    audit = _row(h, "s1")["audit"]
    assert audit[-1]["action"] == "DELETE" and audit[-1]["by"] == "key:ops"
    assert audit[-1]["note"] == "wrong answers" and audit[-1]["from"] == "IN_QUEUE"
    # out of the order; each hash kept for its lifetime as the seed's CANCEL
    for rs in ("s1", "s2"):
        assert h.redis.hget(h.k.response("c1", rs), "status") == b"CANCEL"
        assert h.redis.pttl(h.k.response("c1", rs)) > 0
    assert h.redis.hget(h.k.request("c1", "r1"), "status") == b"CANCEL"
    assert h.k.request("c1", "r1").encode() not in h.redis.lrange(h.k.request_list("c1"), 0, -1)
    # a kept CANCEL hash is no live response to the gate or the operators' removal
    assert h.conv.can_send("c1", "s1").status == "UNKNOWN"
    with pytest.raises(OperationRefused, match="no longer in its conversation's order"):
        h.conv.remove_at("c1", "s1", {"delay_s": 1})
    assert len(h.started) == 1  # the conversation was woken: r2's response goes at once
    h.run(rec)
    assert rec.sent == ["s1", "t1"] and h.state("t1") == "OK"
    # A response of the deleted request still coming is cancelled by its intake.
    h.response("c1", "r1", "s3")
    assert h.state("s3") == "CANCEL"
    _rebuilt(h)
    assert h.bridge_keys() == [k for k in h.bridge_keys() if ":res:" not in k]


def test_delete_by_status_deletes_only_those_and_the_request_stays(h: Harness) -> None:
    _two_requests(h)
    h.conv.set_awaited("c1", {}, response_id="s1")
    done = h.conv.delete_register("c1", "r1", {"status": "AWAITED"}, h.enqueue)
    assert done.deleted == ["s1"] and not done.request_cancelled
    assert h.state("s1") == "CANCEL" and h.state("s2") == "IN_QUEUE"
    assert h.state("r1") == "WAITING_FOR_RES"
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s2", "t1"]
    assert {h.state(x) for x in ("r1", "s2", "r2", "t1")} == {"OK"}


def test_all_origin_except_keeps_the_excepted_origin(h: Harness) -> None:
    _two_requests(h)
    before = _snapshot(h)
    kept = h.conv.delete_register("c1", "r1", {"all_origin_except": "chat"}, h.enqueue)
    assert kept.excepted and kept.deleted == [] and _snapshot(h) == before
    assert h.state("s1") == "IN_QUEUE"
    gone = h.conv.delete_register("c1", "r1", {"all_origin_except": "mail"}, h.enqueue)
    assert sorted(gone.deleted) == ["s1", "s2"] and h.state("s1") == "CANCEL"


@pytest.mark.parametrize(
    ("cid", "rid", "body", "error", "what"),
    [
        ("c1", "r1", {"status": "LOST"}, InvalidMessage, "status"),
        ("c1", "r1", {"all_origin_except": "a:b"}, InvalidMessage, "all_origin_except"),
        ("c1", "r1", {"colour": 1}, InvalidMessage, "colour"),
        ("c1", "r1", [], InvalidMessage, "body"),
        ("c1", "r:1", {}, InvalidMessage, "request_id"),
        ("c1", "r9", {}, NotFound, "r9"),
        ("c2", "r1", {}, NotFound, "r1"),
    ],
)
def test_delete_refuses_bad_input_and_changes_nothing(
    h: Harness, cid: str, rid: str, body: Any, error: type[Exception], what: str
) -> None:
    _two_requests(h)
    _refused(h, lambda: h.conv.delete_register(cid, rid, body, h.enqueue), error, what)


# --- setAwaitedByRequestId / setAwaitedByResponseId -----------------------------------------


def test_set_awaited_by_response_as_the_gate_does_and_it_is_rebuilt(h: Harness) -> None:
    _two_requests(h)
    h.started.clear()
    now = int(h.clock.now * 1000)
    done = h.conv.set_awaited("c1", {"note": "client down"}, response_id="s1", key="ops")
    assert done.awaited == [
        {
            "response_id": "s1",
            "msg_id": done.awaited[0]["msg_id"],
            "awaited_to_date_ms": now + 5_000,
            "awaited_retries": 1,
        }
    ]
    s1 = _hash(h, "c1", "s1")
    assert s1["status"] == "AWAITED" and s1["awaitedRetries"] == "1"
    assert s1["awaitedToDate"] == s1["notBefore"] == str(now + 5_000)
    assert s1["awaitedToDateTS"] == str((now + 5_000) // 1000)  # the seed's Unix seconds
    member = s1["member"]
    assert h.redis.zscore(h.k.shard("c1").pending_messages, member) == now + 5_000
    row = _row(h, "s1")
    assert row["state"] == "PARTLY_FAILED" and row["failed_count"] == 1
    assert row["failed_error_code"] == "E_AWAITED_BY_HAND"
    assert row["custom_data"] == f"awaited={now + 5_000};round=1"
    assert row["audit"][-1]["action"] == "AWAITED" and row["audit"][-1]["by"] == "key:ops"
    # Again: it is AWAITED already, left as it is.
    again = h.conv.set_awaited("c1", {}, response_id="s1")
    assert again.awaited == [] and again.skipped == [{"response_id": "s1", "status": "AWAITED"}]
    _rebuilt(h)
    rebuilt = _hash(h, "c1", "s1")
    assert rebuilt["status"] == "AWAITED" and rebuilt["awaitedToDate"] == str(now + 5_000)
    assert h.redis.zscore(h.k.shard("c1").pending_messages, member) == now + 5_000
    # The awaited agent takes it up at its date; the order holds meanwhile.
    rec = Recorder()
    h.run(rec)
    assert rec.sent == []
    h.clock.advance(5)
    h.conv.awaited_turn(h.enqueue)
    h.run(rec)
    assert rec.sent == ["s1", "s2", "t1"]


def test_set_awaited_by_request_sets_its_group_and_skips_a_sent_one(h: Harness) -> None:
    _two_requests(h)
    h.run(Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, async_response_id="A-1")]}))
    done = h.conv.set_awaited("c1", {}, request_id="r1")
    assert [a["response_id"] for a in done.awaited] == ["s2"]
    assert done.skipped == [{"response_id": "s1", "status": "SENT"}]
    assert h.state("s2") == "PARTLY_FAILED" and h.state("s1") == "WAITING_FOR_RES"
    assert h.state("t1") == "IN_QUEUE"


@pytest.mark.parametrize(
    ("options", "body", "error", "what"),
    [
        ({}, {}, InvalidMessage, "request_id"),
        ({"request_id": "r1", "response_id": "s1"}, {}, InvalidMessage, "request_id"),
        ({"response_id": "s1"}, {"note": 5}, InvalidMessage, "note"),
        ({"response_id": "s9"}, {}, NotFound, "s9"),
        ({"request_id": "r9"}, {}, NotFound, "r9"),
    ],
)
def test_set_awaited_refuses_bad_input_and_changes_nothing(
    h: Harness, options: dict[str, Any], body: Any, error: type[Exception], what: str
) -> None:
    _two_requests(h)
    _refused(h, lambda: h.conv.set_awaited("c1", body, **options), error, what)


# --- updateAwaitedExpires -------------------------------------------------------------------


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat()


def test_a_new_awaited_date_is_when_the_agent_takes_it_up(h: Harness) -> None:
    _two_requests(h)
    h.started.clear()
    h.conv.set_awaited("c1", {}, response_id="s1")
    at = int(h.clock.now * 1000) + 20_000
    done = h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(at)})
    assert done["awaited_to_date_ms"] == at
    s1 = _hash(h, "c1", "s1")
    assert s1["awaitedToDate"] == s1["notBefore"] == str(at)
    assert h.redis.zscore(h.k.shard("c1").pending_messages, s1["member"]) == at
    row = _row(h, "s1")
    assert row["custom_data"] == f"awaited={at};round=1" and row["failed_count"] == 1
    assert row["audit"][-1]["action"] == "AWAITED_DATE"
    _rebuilt(h)
    assert _hash(h, "c1", "s1")["awaitedToDate"] == str(at)
    rec = Recorder()
    h.clock.advance(10)  # past the first date (5 s), before the new one
    h.conv.awaited_turn(h.enqueue)
    h.run(rec)
    assert rec.sent == []
    h.clock.advance(10)
    h.conv.awaited_turn(h.enqueue)
    h.run(rec)
    assert rec.sent == ["s1", "s2", "t1"]


def test_a_new_awaited_date_is_refused_when_it_cannot_be(h: Harness) -> None:
    _two_requests(h)
    before, rows = _snapshot(h), _rows(h)
    now = int(h.clock.now * 1000)
    with pytest.raises(OperationRefused, match="PENDING, not AWAITED"):
        h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(now + 1000)})
    h.conv.set_awaited("c1", {}, response_id="s1")
    before, rows = _snapshot(h), _rows(h)
    with pytest.raises(InvalidMessage) as caught:
        h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(now + 3_600_000)})
    assert caught.value.field == "awaited_to_date" and "AWAITED_MESSAGE_TTL" in str(caught.value)
    with pytest.raises(InvalidMessage) as caught:
        h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": "soon"})
    assert caught.value.field == "awaited_to_date"
    with pytest.raises(NotFound):
        h.conv.set_awaited_date("c1", "s9", {"awaited_to_date": _iso(now)})
    assert _snapshot(h) == before and _rows(h) == rows


def test_the_ts_fields_are_unix_seconds_and_a_hash_of_before_is_read_in_ms(h: Harness) -> None:
    _two_requests(h)
    now = int(h.clock.now * 1000)
    for key in (h.k.shard("c1").request("r1"), h.k.response("c1", "s1")):
        fields = {as_text(k): as_text(v) for k, v in h.redis.hgetall(key).items()}
        assert int(fields["expiresAtTS"]) == int(fields["expiresAt"]) // 1000
        assert abs(int(fields["expiresAtTS"]) - now // 1000) < 7 * 24 * 3600  # seconds, not ms
    h.conv.set_awaited("c1", {}, response_id="s1")
    s1 = _hash(h, "c1", "s1")
    assert int(s1["awaitedToDateTS"]) == int(s1["awaitedToDate"]) // 1000
    # a hash written before expiresAt held milliseconds in expiresAtTS: still read as such
    key = h.k.response("c1", "s1")
    expires = int(s1["expiresAt"])
    h.redis.hdel(key, "expiresAt")
    h.redis.hset(key, "expiresAtTS", expires)
    with pytest.raises(InvalidMessage, match=f"at {expires} ms"):
        h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(expires + 1000)})
    done = h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(expires - 1000)})
    assert done["awaited_to_date_ms"] == expires - 1000


# --- removeAllReferencesAtTime --------------------------------------------------------------


def test_references_go_when_the_removal_is_due_and_the_next_goes(h: Harness) -> None:
    _two_requests(h)
    h.started.clear()
    h.conv.set_awaited("c1", {}, response_id="s1")  # held: the conversation waits on it
    now = int(h.clock.now * 1000)
    h.conv.set_awaited_date("c1", "s1", {"awaited_to_date": _iso(now + 50_000)})
    done = h.conv.remove_at("c1", "s2", {"delay_s": 30}, key="ops")
    assert done["remove_at_ms"] == now + 30_000
    member = _hash(h, "c1", "s2")["member"]
    assert h.redis.zscore(h.k.shard("c1").scheduled, member) == now + 30_000
    assert _row(h, "s2")["audit"][-1]["remove_at_ms"] == now + 30_000
    _rebuilt(h)  # the removal is rebuilt from the row's audit
    assert h.redis.zscore(h.k.shard("c1").scheduled, member) == now + 30_000
    rec = Recorder()
    h.run(rec)  # the drain the rebuild started: s1 is AWAITED, nothing goes
    assert rec.sent == []
    h.clock.advance(29)
    h.wake_due()
    h.run(rec)
    assert h.redis.exists(h.k.response("c1", "s2"))
    h.clock.advance(2)
    assert h.wake_due() == ["c1"]
    h.run(rec)
    assert rec.sent == []
    assert not h.redis.exists(h.k.response("c1", "s2"))
    assert member.encode() not in h.redis.zrange(h.k.response_list("c1"), 0, -1)
    assert h.state("s2") == "CANCEL" and _row(h, "s2")["audit"][-1]["action"] == "REMOVE"
    # s2 was r1's final response: r1 is complete, and r2's turn comes after s1.
    assert h.state("r1") == "OK"
    h.clock.advance(20)
    h.conv.awaited_turn(h.enqueue)
    h.run(rec)
    assert rec.sent == ["s1", "t1"]


def test_a_sent_response_removed_counts_as_delivered(h: Harness) -> None:
    _two_requests(h)
    h.run(Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, async_response_id="A-1")]}))
    h.conv.remove_at("c1", "s1", {"delay_s": 0})
    h.wake_due()
    assert h.state("s1") == "OK" and not h.redis.exists(h.k.shard("c1").async_request("A-1"))
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s2", "t1"]


@pytest.mark.parametrize(
    ("rid", "body", "error", "what"),
    [
        ("s1", {"delay_s": -1}, InvalidMessage, "delay_s"),
        ("s1", {"delay_s": "10"}, InvalidMessage, "delay_s"),
        ("s1", {"delay_s": 10**9}, InvalidMessage, "delay_s"),
        ("s1", {}, InvalidMessage, "delay_s"),
        ("s9", {"delay_s": 1}, NotFound, "s9"),
    ],
)
def test_a_removal_refuses_bad_input_and_changes_nothing(
    h: Harness, rid: str, body: Any, error: type[Exception], what: str
) -> None:
    _two_requests(h)
    _refused(h, lambda: h.conv.remove_at("c1", rid, body), error, what)


# --- the faces: HTTP and CLI ----------------------------------------------------------------


def _http_conversation(client: TestClient) -> None:
    channel = {"url": "http://127.0.0.1:9/deliver", "delivery_delay_ms": 10, "attempts": 2}
    assert client.put("/channels/chat", json=channel).status_code == 200
    request = {"request_id": "r1", "origin": "chat", "corr": "k-1"}
    assert client.post("/conversations/c1/requests", json=request).status_code == 201
    for sid in ("s1", "s2"):
        body = {"request_id": "r1", "response_id": sid, "payload": sid, "corr": f"k-{sid}"}
        assert client.post("/conversations/c1/responses", json=body).status_code == 201


def _problem(answer: Any, status: int) -> dict[str, str]:
    assert answer.status_code == status, answer.text
    found: dict[str, str] = answer.json()["errors"][0]
    return found


def test_the_operations_over_http(client: TestClient, db: Engine) -> None:
    _http_conversation(client)
    got = client.get(
        "/conversation-messages", params={"response_id": "s1", "fields": "corr,status"}
    )
    assert got.status_code == 200 and got.json() == {"corr": "k-s1", "status": "PENDING"}
    bad = client.get("/conversation-messages", params={"response_id": "s1", "fields": "x"})
    assert _problem(bad, 422)["field"] == "fields"
    assert "s9" in _problem(client.get("/conversation-messages?response_id=s9"), 404)["problem"]
    with db.connect() as conn:
        before = conn.execute(text("SELECT msg_id, state, audit FROM message ORDER BY 1")).all()
    refused = client.delete("/conversations/c1/requests/r1", params={"status": "GONE"})
    assert _problem(refused, 422)["field"] == "status"
    refused = client.put(
        "/conversations/c1/responses/s1/awaited-date",
        json={"awaited_to_date": "2030-01-01T00:00:00Z"},
    )
    assert _problem(refused, 409)["problem"].endswith("PENDING, not AWAITED")
    refused = client.post("/conversations/c1/responses/s1/removal", json={"delay_s": -1})
    assert _problem(refused, 422)["field"] == "delay_s"
    with db.connect() as conn:
        after = conn.execute(text("SELECT msg_id, state, audit FROM message ORDER BY 1")).all()
    assert after == before
    awaited = client.post("/conversations/c1/responses/s1/awaited", json={"note": "down"})
    assert awaited.status_code == 200 and awaited.json()["awaited"][0]["response_id"] == "s1"
    at = awaited.json()["awaited"][0]["awaited_to_date_ms"] + 1_000
    moved = client.put(
        "/conversations/c1/responses/s1/awaited-date", json={"awaited_to_date": _iso(at)}
    )
    assert moved.status_code == 200 and moved.json()["awaited_to_date_ms"] == at
    group = client.post("/conversations/c1/requests/r1/awaited", json={})
    assert [a["response_id"] for a in group.json()["awaited"]] == ["s2"]
    removal = client.post("/conversations/c1/responses/s2/removal", json={"delay_s": 60})
    assert removal.status_code == 200 and removal.json()["remove_at_ms"] > at
    assert _problem(client.delete("/conversations/c1/requests/r9"), 404)["field"]
    deleted = client.delete("/conversations/c1/requests/r1", params={"note": "by hand"})
    assert deleted.status_code == 200
    assert sorted(deleted.json()["deleted"]) == ["s1", "s2"] and deleted.json()["request_cancelled"]
    with db.connect() as conn:
        states = conn.execute(text("SELECT DISTINCT state FROM message")).scalars().all()
    assert states == ["CANCEL"]


def test_the_operations_in_the_cli(cli: OrderlyCli, db: Engine, redis_client: redis.Redis) -> None:
    done = cli("channel", "set", "chat", "--url", "http://127.0.0.1:9/x", "--attempts", "1")
    assert done.returncode == 0, done.stderr
    done = cli("conversation", "request", "c1", "--request-id", "r1", "--origin", "chat")
    assert done.returncode == 0, done.stderr
    args = ["--request-id", "r1", "--payload", "x", "--corr", "k-s1"]
    done = cli("conversation", "respond", "c1", "--response-id", "s1", *args)
    assert done.returncode == 0, done.stderr
    shown = cli("conversation", "get", "--response-id", "s1", "--fields", "corr,responseId")
    assert json.loads(shown.stdout) == {"corr": "k-s1", "responseId": "s1"}, shown.stderr
    done = cli("conversation", "awaited", "c1", "--response-id", "s1", "--note", "down")
    assert json.loads(done.stdout)["awaited"][0]["response_id"] == "s1", done.stdout
    done = cli("conversation", "awaited-date", "c1", "--response-id", "s1", "--at", "soon")
    assert done.returncode == 2 and "awaited_to_date" in done.stderr
    done = cli("conversation", "remove-at", "c1", "--response-id", "s1", "--delay", "5")
    assert json.loads(done.stdout)["response_id"] == "s1", done.stderr
    refused = cli("conversation", "delete", "c1", "--request-id", "r9")
    assert refused.returncode == 2 and "r9" in refused.stderr
    done = cli("conversation", "delete", "c1", "--request-id", "r1", "--status", "AWAITED")
    assert json.loads(done.stdout)["deleted"] == ["s1"], done.stderr
