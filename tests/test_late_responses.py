"""Late responses: a response whose request expired (MESSAGE_TTL) before it came goes after
later requests' responses (the seed's rule) and is made visible: ``lateMs`` on its Redis hash
(decided by add_response.lua with that order), ``message.late_ms`` on its row when its delivery
is recorded, the ``X-Orderly-Late`` headers on its POST, and the count in ``GET /metrics`` and
``orderly status``.

The mechanism tests move the injected clock past MESSAGE_TTL and end the request's Redis life
by deleting its key (as tests/test_conversations.py does); the end-to-end test does the same
with a TTL far longer than the test, so no other request ever runs out by itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models.keys import BridgeKeys
from orderly.worker.channels import Channel
from orderly.worker.conversations import Delivery, Head, SendResult
from orderly.worker.delivery import HttpSender
from orderly.worker.observe import store_figures
from tests.helpers import OrderlyCli, bridge_ready, local_http, received_earlier, wait_until
from tests.stack import Stack
from tests.test_conversation_e2e import CHANNEL, TIMINGS
from tests.test_conversations import Harness, make
from tests.test_metrics import _row, parse, value
from tooling.sink import Sink

MESSAGE_TTL_MS = 10_000  # the harness's (tests/test_conversations.make)


@dataclass
class Heads:
    """A sender that records every head it is given; answers 200 unless scripted."""

    seen: list[Head] = field(default_factory=list)
    answers: dict[str, list[SendResult]] = field(default_factory=dict)

    def __call__(self, channel: Channel, head: Head) -> SendResult:
        self.seen.append(head)
        queue = self.answers.get(head.response_id)
        if queue:
            return queue.pop(0)
        return SendResult(Delivery.DELIVERED, 200)

    @property
    def sent(self) -> list[str]:
        return [h.response_id for h in self.seen]

    def late(self) -> dict[str, int | None]:
        return {h.response_id: h.late_ms for h in self.seen}


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    yield make(db, redis_client)


def late_marks(db: Engine) -> dict[str, int | None]:
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT correlation_id, late_ms FROM message WHERE service_name = 'conversation'")
        )
        return {r.correlation_id: r.late_ms for r in rows}


def expire_request(h: Harness, request_id: str) -> None:
    """The request's MESSAGE_TTL runs out: its key had that life; it ends now."""
    key = h.k.request("c1", request_id)
    assert 0 < h.redis.pttl(key) <= MESSAGE_TTL_MS
    h.redis.delete(key)


def late_count(figures_source: Engine) -> float:
    return store_figures(figures_source).late_responses


def test_a_response_after_its_request_expired_is_late_marked_and_counted(
    h: Harness, db: Engine
) -> None:
    h.request("c1", "r1")  # its bot thinks too long
    h.clock.advance_ms(12_000)
    expire_request(h, "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.response("c1", "r1", "s1", last=True)
    # Decided with the order: s1 took r1's turn again, behind r2.
    assert h.redis.hget(h.k.response("c1", "s1"), "lateMs") == b"2000"
    assert h.redis.hget(h.k.response("c1", "s2"), "lateMs") == b""
    heads = Heads()
    h.run(heads)
    assert heads.sent == ["s2", "s1"]  # the order is the seed's: late goes after
    assert heads.late() == {"s2": None, "s1": 12_000 - MESSAGE_TTL_MS}
    assert late_marks(db) == {"r1": None, "r2": None, "s1": 2000, "s2": None}
    assert h.state("s1") == h.state("r1") == "OK"
    assert late_count(db) == 1


def test_every_response_of_a_late_turn_is_late_and_an_earlier_one_is_not(
    h: Harness, db: Engine
) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    heads = Heads()
    h.run(heads)
    # MESSAGE_TTL after its latest response the request runs out; the next one is late.
    h.clock.advance_ms(15_000)
    expire_request(h, "r1")
    h.response("c1", "r1", "s1b")
    h.clock.advance_ms(100)
    h.response("c1", "r1", "s1c", last=True)  # joins the late turn
    h.run(heads)
    assert heads.sent == ["s1", "s1b", "s1c"]
    assert heads.late() == {"s1": None, "s1b": 5000, "s1c": 5100}
    assert late_marks(db) == {"r1": None, "s1": None, "s1b": 5000, "s1c": 5100}
    assert late_count(db) == 2


def test_a_callback_for_a_completed_request_is_not_late(h: Harness, db: Engine) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    heads = Heads()
    h.run(heads)
    h.clock.advance_ms(12_000)  # the lateness would be positive, were it late
    h.request("c1", "r2")
    h.response("c1", "r1", "cb")  # r1 completed: an asynchronous callback, not a late one
    h.response("c1", "r2", "s2", last=True)
    h.run(heads)
    assert heads.sent == ["s1", "s2", "cb"]
    assert set(heads.late().values()) == {None}
    assert set(late_marks(db).values()) == {None}
    assert late_count(db) == 0


def test_a_request_closed_without_its_final_response_makes_the_next_one_late(
    h: Harness, db: Engine
) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.run(Heads())
    h.clock.advance_ms(11_000)
    expire_request(h, "r1")
    with h.conv.ctx.pg() as conn:  # the awaited agent's sweep, its time come
        conn.run("conv_close_requests", 0.0)
    assert h.state("r1") == "OK"
    h.response("c1", "r1", "s1b", last=True)
    heads = Heads()
    h.run(heads)
    assert heads.late() == {"s1b": 1000}
    assert late_marks(db)["s1b"] == 1000


def test_a_late_202_is_marked_when_sent_and_keeps_the_mark_when_acked(
    h: Harness, db: Engine
) -> None:
    h.request("c1", "r1")
    h.clock.advance_ms(10_001)
    expire_request(h, "r1")
    h.response("c1", "r1", "s1", last=True)
    h.run(Heads(answers={"s1": [SendResult(Delivery.ASYNC, 202, "a1")]}))
    assert h.state("s1") == "WAITING_FOR_RES"
    assert late_marks(db)["s1"] == 1
    h.conv.ack("a1", h.enqueue)
    assert h.state("s1") == "OK"
    assert late_marks(db)["s1"] == 1
    assert late_count(db) == 1


def test_a_late_response_retried_carries_the_mark_each_time_and_is_marked_once(
    h: Harness, db: Engine
) -> None:
    h.request("c1", "r1")
    h.clock.advance_ms(13_000)
    expire_request(h, "r1")
    h.response("c1", "r1", "s1", last=True)
    heads = Heads(answers={"s1": [SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")]})
    h.run(heads)
    assert late_marks(db)["s1"] is None  # not handed over yet
    h.clock.advance_ms(1000)
    assert h.wake_due() == ["c1"]
    h.run(heads)
    assert [(hd.response_id, hd.late_ms) for hd in heads.seen] == [("s1", 3000), ("s1", 3000)]
    assert late_marks(db)["s1"] == 3000
    assert late_count(db) == 1


def test_a_late_response_cancelled_is_not_marked(h: Harness, db: Engine) -> None:
    h.request("c1", "r1")
    h.clock.advance_ms(12_000)
    expire_request(h, "r1")
    h.response("c1", "r1", "s1", last=True)
    h.run(Heads(answers={"s1": [SendResult(Delivery.FATAL, 400, reason="HTTP 400")]}))
    assert h.state("s1") == "CANCEL"
    assert late_marks(db)["s1"] is None  # never reached the client
    assert late_count(db) == 0


def _head(response_id: str, late_ms: int | None) -> Head:
    return Head(
        conversation_id="c1",
        origin="chat",
        request_id="r1",
        response_id=response_id,
        payload={"text": response_id},
        msg_id=1,
        request_msg_id=2,
        last=False,
        attempt=0,
        awaited_retries=0,
        late_ms=late_ms,
    )


def test_the_post_of_a_late_response_carries_the_late_headers_and_others_none() -> None:
    with Sink() as sink:
        send = HttpSender(local_http())
        channel = Channel("chat", sink.url, 10, 2.0, 2, 5000, ack_secret="s" * 64)
        assert send(channel, _head("late", 2500)).kind is Delivery.DELIVERED
        assert send(channel, _head("in-order", None)).kind is Delivery.DELIVERED
        got = {a["response_id"]: (a["late"], a["late_by_ms"]) for a in sink.arrivals()}
    assert got == {"late": ("true", "2500"), "in-order": (None, None)}


# --- end to end ---------------------------------------------------------------------------


def test_late_response_end_to_end_header_row_metrics_and_status(
    stack: Stack, db: Engine, redis_client: redis.Redis, cli: OrderlyCli
) -> None:
    with Sink() as sink:
        stack.env(**TIMINGS)  # MESSAGE_TTL far longer than the test
        stack.start_api()
        http = stack.http
        answer = http.put("/channels/chat", json={"url": sink.url, **CHANNEL})
        assert answer.status_code == 200, answer.text
        stack.workers({"w1": "worker-1"}, concurrency=1)
        stack.beat()
        # Beat's first look finds this fresh Redis without its marker and rebuilds it from
        # PostgreSQL: wait for that, or it could bring back the request this test expires.
        wait_until(
            lambda: bridge_ready(redis_client),
            timeout=60,
            what="beat's first rebuild",
        )
        ttl_ms = int(TIMINGS["AURA_QUEUE_MANAGER_MESSAGE_TTL"])

        # r1's timestamp is long past: counted from it, its response comes 5 s past the TTL.
        old = datetime.now(UTC) - timedelta(milliseconds=ttl_ms + 5000)
        # c1: r1 expires (its key's life ends now), r2 comes after it and is answered first.
        assert (
            http.post(
                "/conversations/c1/requests",
                json={"request_id": "r1", "origin": "chat", "timestamp": old.isoformat()},
            ).status_code
            == 201
        )
        assert 0 < redis_client.pttl(BridgeKeys().request("c1", "r1")) <= ttl_ms
        # Its life over on both sides: received as long ago as its timestamp says (PostgreSQL,
        # which the intake asks when a request's key is gone), its key expired (Redis).
        received_earlier(db, "r1", ttl_ms + 5000)
        redis_client.delete(BridgeKeys().request("c1", "r1"))
        assert (
            http.post(
                "/conversations/c1/requests", json={"request_id": "r2", "origin": "chat"}
            ).status_code
            == 201
        )
        for rid, sid in (("r2", "s2"), ("r1", "s1")):
            answer = http.post(
                "/conversations/c1/responses",
                json={"request_id": rid, "response_id": sid, "payload": {}, "last": True},
            )
            assert answer.status_code == 201, answer.text

        wait_until(
            lambda: {a["response_id"] for a in sink.arrivals()} >= {"s1", "s2"},
            timeout=60,
            what="both responses delivered",
        )
        arrivals = {a["response_id"]: a for a in sink.arrivals()}
        assert sink.deliveries()["c1"] == ["s2", "s1"]
        assert (arrivals["s1"]["late"], arrivals["s2"]["late"]) == ("true", None)
        assert arrivals["s2"]["late_by_ms"] is None
        late_by = int(arrivals["s1"]["late_by_ms"])
        assert 5000 <= late_by < 5000 + 60_000  # the test's own time at most on top

        marks = late_marks(db)
        assert marks == {"r1": None, "r2": None, "s2": None, "s1": late_by}

        # The worker adds its count to the running totals within ORDERLY_METRICS_FLUSH_S.
        wait_until(
            lambda: value(parse(http.get("/metrics").text), "orderly_late_responses_total") == 1,
            timeout=30,
            what="the late response counted",
        )
        done = cli("status")
        assert done.returncode == 0, done.stderr
        assert _row(done.stdout, "delivered late (request expired)") == ["1"]
