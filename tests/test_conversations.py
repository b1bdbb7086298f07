"""The conversation mechanism against the real Redis and PostgreSQL, driven step by step.

Drains run in the test process with a recording sender, so each rule of the ordering gate
(the seed's validation cases, TTLs, ACKs, retries, AWAITED, cancel) is checked alone.

The mechanism reads a clock the test moves (``h.clock``): backoffs, ACK deadlines and AWAITED
waits pass without sleeping, and the times they produce are exact. The lifetimes of Redis
keys (PEXPIRE) are Redis's own: a test checks a key's PTTL, then ends its life by deleting it.
Those lifetimes are long enough that a slow machine never sees one run out by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from orderly.models.keys import BridgeKeys
from orderly.worker import nodes
from orderly.worker.channels import (
    ACK_TOKEN_HEADER,
    Channel,
    ChannelDirectory,
    ack_token,
    put_channel,
)
from orderly.worker.conversations import Conversations, Delivery, Head, Sender, SendResult, gate
from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.due import drain
from orderly.worker.core.errors import (
    InvalidMessage,
    Unauthenticated,
    UnknownAck,
    UnknownChannel,
    UnknownRequest,
)
from orderly.worker.delivery import response_headers
from orderly.worker.settings import Settings

from .conftest import TEST_DB_URL, TEST_REDIS_URL
from .helpers import ManualClock, wait_until

SINK = "http://127.0.0.1:9/never-called"


@dataclass
class Recorder:
    """A sender whose answers the test scripts; records every send in order."""

    sent: list[str] = field(default_factory=list)
    answers: dict[str, list[SendResult]] = field(default_factory=dict)

    def __call__(self, channel: Channel, head: Head) -> SendResult:
        self.sent.append(head.response_id)
        queue = self.answers.get(head.response_id)
        if queue:
            return queue.pop(0)
        return SendResult(Delivery.DELIVERED, 200)


@dataclass
class Harness:
    conv: Conversations
    engine: Engine
    redis: OrderingRedis  # the plain Redis, or a Redis Cluster (tests/test_redis_cluster.py)
    clock: ManualClock
    started: list[tuple[str, str]] = field(default_factory=list)

    def enqueue(self, conversation_id: str, token: str) -> None:
        self.started.append((conversation_id, token))

    def request(self, cid: str, rid: str, **extra: Any) -> None:
        self.conv.register_request(cid, {"request_id": rid, "origin": "chat", **extra})

    def response(self, cid: str, rid: str, sid: str, last: bool = False) -> None:
        self.conv.add_response(
            cid,
            {"request_id": rid, "response_id": sid, "payload": {"text": sid}, "last": last},
            self.enqueue,
        )

    def wake_due(self) -> list[str]:
        """The ticker's turn over the conversations' wake-ups: those it woke."""
        before = len(self.started)
        drain(self.conv.wakes(self.enqueue), 500)
        return [cid for cid, _ in self.started[before:]]

    def run(self, sender: Sender) -> list[str]:
        """Run every drain started so far (and those they start), like workers would."""
        ends = []
        while self.started:
            cid, token = self.started.pop(0)
            report = self.conv.drain(cid, token, sender)
            if report.end == "YIELD":
                self.started.append((cid, token))
            ends.append(report.end)
        return ends

    def state(self, correlation_id: str) -> str:
        with self.engine.connect() as conn:
            return str(
                conn.execute(
                    text("SELECT state FROM message WHERE correlation_id = :c"),
                    {"c": correlation_id},
                ).scalar_one()
            )

    @property
    def k(self) -> BridgeKeys:
        return self.conv.keys

    def bridge_keys(self) -> list[str]:
        """Every conversation key (every node's, on a cluster)."""
        return sorted(
            k.decode() if isinstance(k, bytes) else k
            for k in self.redis.scan_iter(match="bridge:queue:*")
        )


def make(db: Engine, redis_client: OrderingRedis, **overrides: Any) -> Harness:
    values: dict[str, Any] = {
        "database_url": TEST_DB_URL,
        "redis_url": TEST_REDIS_URL,
        "message_ttl": 10_000,
        "awaited_message_ttl": 60_000,
        "sent_message_ttl": 5_000,
        "max_pending_ttl": 30_000,
        "max_pending_ttl_margin": 5_000,
        "awaited_time_when_retries_end": 5_000,
    }
    values.update(overrides)
    settings = Settings(**values)
    node_id = nodes.register_node(db, "conversations-test")
    channels = ChannelDirectory(db, settings)
    put_channel(db, Channel("chat", SINK, 10, 2.0, 2, 1000))
    clock = ManualClock()
    conv = Conversations(
        db, redis_client, settings, node_id=node_id, channels=channels, clock=clock
    )
    return Harness(conv, db, redis_client, clock)


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    yield make(db, redis_client)


# --- intake -------------------------------------------------------------------------------


def test_request_is_registered_once(h: Harness) -> None:
    first = h.conv.register_request("c1", {"request_id": "r1", "origin": "chat"})
    again = h.conv.register_request("c1", {"request_id": "r1", "origin": "chat"})
    assert first.created and not again.created and first.msg_id == again.msg_id
    assert h.state("r1") == "WAITING_FOR_RES"
    assert h.redis.lrange(h.k.request_list("c1"), 0, -1) == [h.k.request("c1", "r1").encode()]
    fields = h.redis.hgetall(h.k.request("c1", "r1"))
    assert fields[b"status"] == b"WAITING" and fields[b"responseIdCounter"] == b"0"
    assert 0 < h.redis.pttl(h.k.request("c1", "r1")) <= 10_000


def test_response_is_stored_with_the_seed_structures(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    res = h.redis.hgetall(h.k.response("c1", "s1"))
    assert res[b"status"] == b"PENDING" and res[b"requestId"] == b"r1"
    assert h.redis.hget(h.k.request("c1", "r1"), "responseIdCounter") == b"1"
    assert h.redis.hget(h.k.request("c1", "r1"), "status") == b"PENDING"
    member = b'{"rqId":"r1","rsId":"s1","cnId":"c1"}'
    assert h.redis.zrange(h.k.response_list("c1"), 0, -1) == [member]
    assert h.redis.zscore(h.k.shard("c1").pending_messages, member) is not None
    assert 50_000 < h.redis.pttl(h.k.response("c1", "s1")) <= 60_000
    assert h.state("s1") == "IN_QUEUE"
    assert len(h.started) == 1  # the first response starts a drain


@pytest.mark.parametrize(
    ("body", "field_name"),
    [
        ({"origin": "chat"}, "request_id"),
        ({"request_id": "r", "origin": "chat", "colour": 1}, "colour"),
        ({"request_id": 5, "origin": "chat"}, "request_id"),
        ({"request_id": "r", "origin": "chat", "timestamp": "yesterday"}, "timestamp"),
        ({"request_id": "", "origin": "chat"}, "request_id"),
    ],
)
def test_bad_requests_write_nothing(h: Harness, body: dict[str, Any], field_name: str) -> None:
    with pytest.raises(InvalidMessage) as caught:
        h.conv.register_request("c1", body)
    assert caught.value.field == field_name
    assert h.bridge_keys() == []
    with h.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM message")).scalar_one() == 0


def test_unknown_origin_and_unknown_request_are_refused(h: Harness) -> None:
    with pytest.raises(UnknownChannel, match="nowhere"):
        h.conv.register_request("c1", {"request_id": "r1", "origin": "nowhere"})
    with pytest.raises(UnknownRequest, match="'r9'"):
        h.response("c1", "r9", "s1")
    h.request("c1", "r1")
    with pytest.raises(UnknownRequest, match="conversation 'c2'"):
        h.response("c2", "r1", "s1")
    assert h.bridge_keys() == [
        h.k.request_list("c1"),
        h.k.request_seq("c1"),
        h.k.request("c1", "r1"),
    ]


def test_duplicate_response_changes_nothing(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s1")
    assert h.redis.hget(h.k.request("c1", "r1"), "responseIdCounter") == b"1"
    assert len(h.started) == 1


# --- the seed's validation cases ----------------------------------------------------------


def test_earlier_request_without_response_holds_later_ones(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2")
    assert h.conv.can_send("c1", "s2").status == "WAIT_REQUEST"
    rec = Recorder()
    assert h.run(rec) == ["WAIT_REQUEST"]
    assert rec.sent == []
    h.response("c1", "r1", "s1", last=True)
    h.run(rec)
    assert rec.sent == ["s1", "s2"]


def test_first_response_can_send_and_the_second_waits(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    assert h.conv.can_send("c1", "s1").status == "CAN_SEND"  # case 1
    gate = h.conv.can_send("c1", "s2")
    assert (gate.status, gate.first_response_id) == ("WAIT_RESPONSE", "s1")  # case 2


def test_vanished_first_response_is_removed_and_checked_again(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    h.clock.advance_ms(60_000)  # AWAITED_MESSAGE_TTL
    h.redis.delete(h.k.response("c1", "s1"))  # case 3: its hash expired
    assert h.conv.can_send("c1", "s2").status == "CAN_SEND"
    assert len(h.redis.zrange(h.k.response_list("c1"), 0, -1)) == 1


def test_a_first_response_evicted_is_rebuilt_not_skipped(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    h.redis.delete(h.k.response("c1", "s1"))  # its life not over: evicted, or deleted
    gate = h.conv.can_send("c1", "s2")
    assert (gate.status, gate.first_response_id) == ("WAIT_RESPONSE", "s1")
    assert h.redis.hget(h.k.response("c1", "s1"), "status") == b"PENDING"
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1", "s2"]


def test_vanished_head_request_is_removed_and_checked_again(h: Harness) -> None:
    h.request("c1", "r1")  # never answered: expires after MESSAGE_TTL
    h.request("c1", "r2")
    h.response("c1", "r2", "s2")
    assert h.conv.can_send("c1", "s2").status == "WAIT_REQUEST"
    assert 0 < h.redis.pttl(h.k.request("c1", "r1")) <= 10_000
    h.clock.advance_ms(10_000)
    h.redis.delete(h.k.request("c1", "r1"))  # MESSAGE_TTL ran out
    assert h.conv.can_send("c1", "s2").status == "CAN_SEND"
    assert h.k.request("c1", "r1").encode() not in h.redis.lrange(h.k.request_list("c1"), 0, -1)


def test_a_head_request_evicted_is_rebuilt_and_still_holds_its_successors(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.redis.delete(h.k.request("c1", "r1"))  # its life not over: evicted, or deleted
    rec = Recorder()
    assert h.run(rec) == ["WAIT_REQUEST"]  # not sent: r1 still waits for its answer
    assert rec.sent == []
    assert h.redis.hget(h.k.request("c1", "r1"), "status") == b"WAITING"
    h.response("c1", "r1", "s1", last=True)
    h.run(rec)
    assert rec.sent == ["s1", "s2"]


# --- order and completion -----------------------------------------------------------------


def test_responses_arriving_out_of_order_leave_in_conversation_order(h: Harness) -> None:
    for r in ("r1", "r2", "r3"):
        h.request("c1", r)
    h.response("c1", "r3", "s3a")
    h.response("c1", "r2", "s2a", last=True)
    h.response("c1", "r1", "s1a")
    h.response("c1", "r3", "s3b", last=True)
    h.response("c1", "r1", "s1b", last=True)
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1a", "s1b", "s2a", "s3a", "s3b"]
    assert {h.state(x) for x in ("r1", "r2", "r3", "s1a", "s3b")} == {"OK"}
    assert h.bridge_keys() == []  # everything delivered: nothing left behind


def test_two_responses_in_the_same_millisecond_keep_arrival_order(h: Harness) -> None:
    h.request("c1", "r1")
    for i in range(50):
        h.response("c1", "r1", f"s{i:02d}", last=i == 49)
    rec = Recorder()
    h.run(rec)
    assert rec.sent == [f"s{i:02d}" for i in range(50)]


def test_request_stays_at_the_head_until_its_final_response(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r1", "s1")
    h.response("c1", "r2", "s2")
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1"]  # r1 may still answer: r2 waits
    assert h.state("r1") == "WAITING_FOR_RES"
    h.response("c1", "r1", "s1b", last=True)
    h.run(rec)
    assert rec.sent == ["s1", "s1b", "s2"]
    assert h.state("r1") == "OK"


def test_callback_for_a_completed_request_is_delivered_after_the_current_turns(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    rec = Recorder()
    h.run(rec)
    h.request("c1", "r2")
    h.response("c1", "r1", "late")  # an asynchronous callback: r1 is known, completed
    h.response("c1", "r2", "s2", last=True)
    h.run(rec)
    # r1 takes its turn again behind r2, which was registered before the callback came.
    assert rec.sent == ["s1", "s2", "late"]


def test_drain_yields_after_its_batch(db: Engine, redis_client: redis.Redis) -> None:
    h = make(db, redis_client, drain_batch=3)
    h.request("c1", "r1")
    for i in range(7):
        h.response("c1", "r1", f"s{i}", last=i == 6)
    rec = Recorder()
    assert h.run(rec) == ["YIELD", "YIELD", "EMPTY"]
    assert rec.sent == [f"s{i}" for i in range(7)]


def test_a_second_drain_of_the_same_conversation_stands_aside(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    cid, _ = h.started[0]
    report = h.conv.drain(cid, "someone-else", Recorder())
    assert report.end == "LOST"


# --- asynchronous delivery and ACKs -------------------------------------------------------


def test_ack_releases_the_next_response(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    rec = Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, "ack-1")]})
    assert h.run(rec) == ["WAIT_ACK"]
    assert rec.sent == ["s1"]
    assert h.state("s1") == "WAITING_FOR_RES"
    assert h.redis.hget(h.k.response("c1", "s1"), "status") == b"SENT"
    assert 0 < h.redis.pttl(h.k.shard("c1").async_request("ack-1")) <= 5_000
    h.conv.ack("ack-1", h.enqueue)
    assert h.state("s1") == "OK"
    h.run(rec)
    assert rec.sent == ["s1", "s2"]
    with pytest.raises(UnknownAck):
        h.conv.ack("ack-1", h.enqueue)  # already used
    with pytest.raises(UnknownAck):
        h.conv.ack("never-given", h.enqueue)


def test_an_ack_must_bring_the_token_its_response_was_sent_with(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    tokens: dict[str, str] = {}

    def send(channel: Channel, head: Head) -> SendResult:
        tokens[head.response_id] = response_headers(channel, head)[ACK_TOKEN_HEADER]
        return SendResult(Delivery.ASYNC, 202, "1")  # an id anyone could guess

    assert h.run(send) == ["WAIT_ACK"]
    with h.engine.connect() as conn:
        secret = conn.execute(text("SELECT secret FROM channel_ack_secret")).scalar()
    assert secret and len(secret) == 64
    # Another conversation's token, a forged one, none: refused, and nothing released.
    other = ack_token(str(secret), "c2", "s1")
    real = tokens["s1"]
    forged = real[:-1] + ("A" if real[-1] != "A" else "E")
    # A well-formed wrong token is answered as an unknown id (no oracle of which ids exist);
    # one that is not a token at all is refused before any lookup.
    for wrong in (other, ack_token("x" * 64, "c1", "s1"), forged):
        with pytest.raises(UnknownAck, match="with this token"):
            h.conv.ack("1", h.enqueue, wrong)
    for wrong in ("é" * 43, "short"):
        with pytest.raises(Unauthenticated) as refused:
            h.conv.ack("1", h.enqueue, wrong)
        assert refused.value.field == ACK_TOKEN_HEADER
    with pytest.raises(Unauthenticated, match="missing"):
        h.conv.ack("1", h.enqueue, "")
    assert h.state("s1") == "WAITING_FOR_RES"
    assert h.redis.exists(h.k.shard("c1").async_request("1"))
    h.conv.ack("1", h.enqueue, tokens["s1"])
    assert h.state("s1") == "OK"


def test_no_ack_within_sent_ttl_counts_as_delivered(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    rec = Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, "ack-1")]})
    h.run(rec)
    # The wait is scheduled in Redis, not held in memory: SENT_MESSAGE_TTL after the send.
    assert h.redis.zscore(h.k.shard("c1").scheduled, "c1") == h.clock.ms() + 5_000
    h.clock.advance_ms(4_999)
    assert h.wake_due() == []  # not due yet
    h.clock.advance_ms(1)
    assert 0 < h.redis.pttl(h.k.shard("c1").async_request("ack-1")) <= 5_000
    h.redis.delete(h.k.shard("c1").async_request("ack-1"))  # the ACK key expired with the wait
    assert h.wake_due() == ["c1"]
    h.run(rec)
    assert rec.sent == ["s1", "s2"]
    assert h.state("s1") == "OK"
    with pytest.raises(UnknownAck):
        h.conv.ack("ack-1", h.enqueue)


# --- failures -----------------------------------------------------------------------------


def test_recoverable_failure_retries_with_backoff_and_keeps_the_order(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    fail = SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")
    rec = Recorder(answers={"s1": [fail, fail]})
    assert h.run(rec) == ["WAIT_RETRY"]
    not_before = int(h.redis.hget(h.k.response("c1", "s1"), "notBefore") or 0)
    assert not_before == h.clock.ms() + 10 * 2**1  # deliveryDelay * multiplier ^ 1
    h.clock.advance_ms(19)
    assert h.wake_due() == []
    h.clock.advance_ms(1)
    assert h.wake_due() == ["c1"]
    assert h.run(rec) == ["WAIT_RETRY"]  # second failure: waits 10 * 2^2 ms
    assert rec.sent == ["s1", "s1"]  # s2 never overtakes
    not_before = int(h.redis.hget(h.k.response("c1", "s1"), "notBefore") or 0)
    assert not_before == h.clock.ms() + 10 * 2**2
    h.clock.advance_ms(40)
    assert h.wake_due() == ["c1"]
    h.run(rec)
    assert rec.sent == ["s1", "s1", "s1", "s2"]
    assert h.state("s1") == "OK" and h.state("s2") == "OK"


def test_retries_spent_make_the_group_awaited(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    h.response("c1", "r2", "t1", last=True)
    fail = SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")
    rec = Recorder(answers={"s1": [fail, fail, fail]})  # the channel allows 2 retries
    for _ in range(2):
        h.run(rec)
        h.clock.advance_ms(40)  # past the retry's wait (10 * 2^attempt ms)
        assert h.wake_due() == ["c1"]
    h.run(rec)
    assert rec.sent == ["s1", "s1", "s1"]
    for sid in ("s1", "s2"):
        assert h.redis.hget(h.k.response("c1", sid), "status") == b"AWAITED"
        assert h.state(sid) == "PARTLY_FAILED"
    assert h.state("t1") == "IN_QUEUE"  # held behind the AWAITED group
    until = int(h.redis.hget(h.k.response("c1", "s1"), "awaitedToDate") or 0)
    assert until == h.clock.ms() + 5_000  # AWAITED_TIME_WHEN_RETRIES_END


def test_non_recoverable_failure_cancels_the_group_and_moves_on(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    h.response("c1", "r2", "t1", last=True)
    rec = Recorder(answers={"s1": [SendResult(Delivery.FATAL, 400, reason="HTTP 400")]})
    h.run(rec)
    assert rec.sent == ["s1", "t1"]
    assert (h.state("s1"), h.state("s2"), h.state("r1")) == ("CANCEL", "CANCEL", "CANCEL")
    assert h.state("t1") == "OK"
    h.response("c1", "r1", "s3", last=True)  # arrives after the cancel
    assert h.state("s3") == "CANCEL"
    h.run(rec)
    assert rec.sent == ["s1", "t1"]
    with h.engine.connect() as conn:
        reason = conn.execute(
            text("SELECT failed_desc FROM message WHERE correlation_id = 's2'")
        ).scalar_one()
    assert "HTTP 400" in reason


def test_a_response_accepted_while_its_group_is_cancelled_does_not_stay_open(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the drain has cancelled the group's rows, and a new response of the group is
    accepted (row and Redis entry) before the drain's next step drops the group from Redis."""
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    apply = gate._apply

    def apply_then_accept(*args: Any) -> Any:
        answer = apply(*args)
        if args[2].response_id == "s1":
            # s2's insert read its request before the cancel committed and committed after
            # the cancel's snapshot: its row is IN_QUEUE (written here as that race leaves it)
            with h.engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO message (msg_timestamp, receive_timestamp,"
                        " last_process_timestamp, service_name, operation_name, object_id,"
                        " entity_type, correlation_id, process_id, payload, envelope,"
                        " source_system, state, node_id, parent_msg_id, parent_binding_type,"
                        " response_last)"
                        " SELECT msg_timestamp, now(), now(), service_name, operation_name,"
                        " object_id, entity_type, 's2', process_id, payload, envelope,"
                        " source_system, 'IN_QUEUE', node_id, parent_msg_id,"
                        " parent_binding_type, true"
                        " FROM message WHERE correlation_id = 's1'"
                    )
                )
            # ... and its intake puts it into Redis before the drain's next step.
            h.response("c1", "r1", "s2", last=True)
            assert h.redis.exists(h.k.response("c1", "s2"))
        return answer

    monkeypatch.setattr(gate, "_apply", apply_then_accept)
    rec = Recorder(answers={"s1": [SendResult(Delivery.FATAL, 400, reason="HTTP 400")]})
    h.run(rec)
    assert rec.sent == ["s1"]
    # dropped with its group: out of the order, its hash kept as CANCEL for its lifetime
    assert h.redis.zcard(h.k.response_list("c1")) == 0
    assert h.redis.hget(h.k.response("c1", "s2"), "status") == b"CANCEL"
    assert (h.state("s1"), h.state("s2"), h.state("r1")) == ("CANCEL", "CANCEL", "CANCEL")


# --- the awaited agent --------------------------------------------------------------------


def test_awaited_agent_takes_a_due_message_once_across_two_agents(
    db: Engine, redis_client: redis.Redis
) -> None:
    first = make(db, redis_client, max_retries=1, interval=1)  # blocked after 1 ms
    ctx = first.conv.ctx
    second = Conversations(
        db, redis_client, ctx.settings, node_id=ctx.node_id, channels=ctx.channels, clock=ctx.clock
    )
    first.request("c1", "r1")
    first.request("c1", "r2")
    first.response("c1", "r2", "s2")  # blocked behind r1
    first.run(Recorder())
    first.clock.advance_ms(1)
    woken_a: list[tuple[str, str]] = []
    woken_b: list[tuple[str, str]] = []
    report_a = first.conv.awaited_turn(lambda c, t: woken_a.append((c, t)))
    report_b = second.awaited_turn(lambda c, t: woken_b.append((c, t)))
    assert (report_a.taken, report_b.taken) == (1, 0)  # claimed once, by the first
    assert len(woken_a) + len(woken_b) == 1
    assert report_a.woken == ["c1"] and report_b.woken == []
    assert redis_client.hget(first.k.response("c1", "s2"), "status") == b"AWAITED"
    assert redis_client.hget(first.k.response("c1", "s2"), "awaitedRetries") == b"1"


def test_awaited_agent_expires_messages_past_their_ttl(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)  # blocked behind r1 until it expires
    h.clock.advance_ms(60_000)  # AWAITED_MESSAGE_TTL, for the agent (Redis keeps the keys)
    report = h.conv.awaited_turn(h.enqueue)
    assert (report.expired, report.vanished, report.swept) == (1, 0, 0)
    assert h.state("s2") == "FAILED"
    assert h.redis.zcard(h.k.shard("c1").pending_messages) == 0


def test_worker_dying_mid_send_is_recovered_by_the_agent(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client, max_pending_ttl_margin=0)
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    cid, token = h.started.pop()

    def dies(channel: Channel, head: Head) -> SendResult:
        raise KeyboardInterrupt("killed mid-send")

    with pytest.raises(KeyboardInterrupt):
        h.conv.drain(cid, token, dies)
    h.clock.advance_ms(29_999)
    assert h.conv.awaited_turn(h.enqueue).woken == []  # still within MAX_PENDING_TTL
    h.clock.advance_ms(1)
    # The dead drain's lease (MAX_PENDING_TTL in Redis) has run out with it.
    assert 0 < h.redis.pttl(h.k.drain_lease("c1")) <= 30_000
    h.redis.delete(h.k.drain_lease("c1"))
    assert h.conv.awaited_turn(h.enqueue).woken == ["c1"]
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1"] and h.state("s1") == "OK"


def _dies(channel: Channel, head: Head) -> SendResult:
    raise KeyboardInterrupt("killed mid-send")


def test_a_live_drain_is_not_released(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    cid, token = h.started.pop()
    with pytest.raises(KeyboardInterrupt):
        h.conv.drain(cid, token, _dies)  # its connection goes back to the pool, alive
    h.clock.advance_ms(5_000)
    assert h.conv.release_dead_drains() == 0
    assert h.redis.get(h.k.drain_lease("c1")) is not None
    assert h.redis.hexists(h.k.shard("c1").drains, "c1")
    # Its lease ran out (the awaited agent then takes the head up): the entry is dropped.
    h.redis.delete(h.k.drain_lease("c1"))
    h.clock.advance_ms(30_000)
    assert h.conv.release_dead_drains() == 0
    assert not h.redis.hexists(h.k.shard("c1").drains, "c1")


def test_a_drain_whose_worker_died_is_released_at_once_and_its_head_quarantined_at_the_limit(
    db: Engine, redis_client: redis.Redis
) -> None:
    # Every drain's connection closes when the drain ends, as its process's would on a kill
    # (its own engine, on the database the ``db`` fixture created and emptied).
    engine = create_engine(TEST_DB_URL, poolclass=NullPool)
    h = make(engine, redis_client)
    limit = h.conv.ctx.settings.worker_lost_limit
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)  # its send kills the worker, every time
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    for _ in range(limit):
        cid, token = h.started.pop()
        with pytest.raises(KeyboardInterrupt):
            h.conv.drain(cid, token, _dies)
        h.clock.advance_ms(1_000)  # the grace
        wait_until(lambda: h.conv.release_dead_drains() == 1, 10, "the dead drain released")
        assert h.redis.get(h.k.drain_lease("c1")) is None
        assert h.redis.hget(h.k.shard("c1").drains, "c1") is None
        # woken at once: no MAX_PENDING_TTL (30 s) to wait out
        assert h.wake_due() == ["c1"]
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s2"]  # s1 is not tried again; the conversation moves on
    assert (h.state("s1"), h.state("r1"), h.state("s2")) == ("CANCEL", "CANCEL", "OK")
    with engine.connect() as conn:
        code, why = conn.execute(
            text("SELECT failed_error_code, failed_desc FROM message WHERE correlation_id = 's1'")
        ).one()
    assert code == "E_WORKER_LOST" and f"died {limit} times" in why
    assert h.redis.hlen(h.k.shard("c1").drains) == 0
    engine.dispose()


# --- every AURA_QUEUE_MANAGER_* timing has its effect ---------------------------------------


def _score(h: Harness, sid: str) -> float:
    member = f'{{"rqId":"r1","rsId":"{sid}","cnId":"c1"}}'
    score = h.redis.zscore(h.k.shard("c1").pending_messages, member)
    assert score is not None
    return score - h.clock.ms()


def test_blocked_limit_is_max_retries_times_interval(db: Engine, redis_client: redis.Redis) -> None:
    h = make(db, redis_client, max_retries=7, interval=100)
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    assert _score(h, "s1") == 700  # 7 validations * 100 ms, then AWAITED


def test_in_flight_limit_is_max_pending_ttl_plus_margin(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client, max_pending_ttl=4000, max_pending_ttl_margin=1500)
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    fail = SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")
    h.run(Recorder(answers={"s1": [fail]}))
    # After a failed send the response waits its retry (20 ms), then MAX_PENDING_TTL + margin.
    assert _score(h, "s1") == 20 + 4000 + 1500
    assert int(h.redis.pttl(h.k.drain_lease("c1"))) == -2  # released while waiting


def test_awaited_agent_backoff_uses_the_retries_factor(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(
        db, redis_client, max_retries=1, interval=1, max_pending_ttl=1000, awaited_retries_factor=3
    )
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2")
    h.clock.advance_ms(1)  # blocked for MAX_RETRIES * INTERVAL
    h.conv.awaited_turn(h.enqueue)
    member = '{"rqId":"r2","rsId":"s2","cnId":"c1"}'
    score = h.redis.zscore(h.k.shard("c1").pending_messages, member)
    assert score is not None
    # currentRetry (1) * MAX_PENDING_TTL (1000) * AWAITED_RETRIES_FACTOR (3)
    assert score - h.clock.ms() == 3000


def test_awaited_agent_takes_at_most_by_turn(db: Engine, redis_client: redis.Redis) -> None:
    h = make(db, redis_client, max_retries=1, interval=1, awaited_messages_by_turn=3)
    for c in range(5):
        h.request(f"c{c}", f"r{c}a")
        h.request(f"c{c}", f"r{c}b")
        h.response(f"c{c}", f"r{c}b", f"s{c}")  # blocked behind r{c}a
    h.run(Recorder())  # each drain finds its head request unanswered and lets go
    h.clock.advance_ms(1)  # blocked for MAX_RETRIES * INTERVAL
    assert len(h.conv.awaited_turn(h.enqueue).woken) == 3
    assert len(h.conv.awaited_turn(h.enqueue).woken) == 2


def test_awaited_interval_sets_the_agent_schedule(db: Engine) -> None:
    from orderly.beat.schedule import jobs
    from orderly.worker.configuration import ConfigReader
    from orderly.worker.runtime import get_runtime

    settings = Settings(database_url=TEST_DB_URL, awaited_messages_interval=7000)
    job = {j.name: j for j in jobs(ConfigReader(db), settings, get_runtime())}["awaited-agent"]
    assert job.run.__name__ == "awaited"
    assert job.every_s == 7.0
    # The first run comes at a random moment within the first interval (under a minute).
    assert 0 <= job.first_after_s <= 7.0


def test_partial_metrics_count_the_queue(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    assert h.conv.partial_metrics() == {"pending_messages": 2, "awaited_due": 0, "scheduled": 0}


def test_beat_logs_partial_metrics_only_when_asked_at_their_interval(
    h: Harness, db: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    from orderly.beat.schedule import jobs
    from orderly.worker.configuration import ConfigReader
    from orderly.worker.runtime import get_runtime

    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    values: dict[str, Any] = {"database_url": TEST_DB_URL, "metrics_partial_interval": 4500}
    off = jobs(ConfigReader(db), Settings(**values), get_runtime())
    assert "queue-metrics" not in {j.name for j in off}  # AURA_LOGGING_EXTRA_TIME_METRICS
    on = jobs(ConfigReader(db), Settings(**values, logging_extra_time_metrics=True), get_runtime())
    job = {j.name: j for j in on}["queue-metrics"]
    assert job.every_s == 4.5
    with caplog.at_level(logging.INFO):
        job.run()
    assert "queue metrics: {'pending_messages': 1, 'awaited_due': 0, 'scheduled': 0}" in (
        caplog.text
    )


# --- robustness ---------------------------------------------------------------------------


def test_a_repeat_puts_back_what_redis_never_got(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    # As if the process had died between the row and the script: Redis has nothing.
    h.redis.flushdb()
    h.started.clear()
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    assert h.redis.hget(h.k.response("c1", "s1"), "status") == b"PENDING"
    assert h.redis.lrange(h.k.request_list("c1"), 0, -1) == [h.k.request("c1", "r1").encode()]
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1"] and h.state("s1") == "OK"


def test_cancel_leaves_a_tombstone_even_for_an_expired_request(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client)
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    # The request hash expires (MESSAGE_TTL after its latest response), its responses do not.
    assert 0 < h.redis.pttl(h.k.request("c1", "r1")) <= 10_000
    assert h.redis.pttl(h.k.response("c1", "s2")) > 10_000
    h.clock.advance_ms(10_000)
    h.redis.delete(h.k.request("c1", "r1"))
    h.run(Recorder(answers={"s1": [SendResult(Delivery.FATAL, 400, reason="HTTP 400")]}))
    # A response of the group being accepted right now finds the tombstone, not a callback.
    assert h.redis.hget(h.k.request("c1", "r1"), "status") == b"CANCEL"
    assert 0 < h.redis.pttl(h.k.request("c1", "r1")) <= 10_000


def test_a_short_wait_never_shortens_the_schedule_of_a_long_one(
    db: Engine, redis_client: redis.Redis
) -> None:
    # One shard: both conversations' wake-ups share its scheduled set.
    h = make(db, redis_client, sent_message_ttl=5000, redis_shards=1)
    for c in ("a", "b"):
        h.request(c, f"r{c}")
        h.response(c, f"r{c}", f"s{c}", last=True)
    h.run(
        Recorder(
            answers={
                "sa": [SendResult(Delivery.ASYNC, 202, "ack-a")],  # waits up to 5 s
                "sb": [SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")],  # 20 ms
            }
        )
    )
    # The set lives MESSAGE_TTL (10 s) past its latest wake-up: 15 s, not 10.02 s.
    assert 10_020 < h.redis.pttl(h.k.shard("a").scheduled) <= 15_000


def test_an_ack_id_in_use_is_not_taken_over(h: Harness) -> None:
    for c in ("a", "b"):
        h.request(c, f"r{c}")
        h.response(c, f"r{c}", f"s{c}", last=True)
    same = SendResult(Delivery.ASYNC, 202, "same-id")
    h.run(Recorder(answers={"sa": [same], "sb": [same]}))
    h.conv.ack("same-id", h.enqueue)
    assert h.state("sa") == "OK"
    assert h.state("sb") == "WAITING_FOR_RES"  # waits out SENT_MESSAGE_TTL instead


def test_a_sender_that_raises_counts_as_a_recoverable_failure(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)

    def broken(channel: Channel, head: Head) -> SendResult:
        raise ValueError("bad header")

    assert h.run(broken) == ["WAIT_RETRY"]
    assert not h.redis.exists(h.k.drain_lease("c1"))
    assert h.redis.hget(h.k.response("c1", "s1"), "attempt") == b"1"


def test_agent_expires_a_response_still_in_redis(db: Engine, redis_client: redis.Redis) -> None:
    h = make(db, redis_client)
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)  # blocked behind r1
    h.response("c1", "r1", "s1")
    h.run(Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, "a1")]}))
    # Past AWAITED_MESSAGE_TTL for the agent while Redis still has the keys: the agent's own
    # expiry path, not Redis's.
    h.clock.advance_ms(60_000)
    for key in (
        h.k.response("c1", "s1"),
        h.k.response("c1", "s2"),
        h.k.shard("c1").pending_messages,
    ):
        assert 0 < h.redis.pttl(key) <= 60_000
    report = h.conv.awaited_turn(h.enqueue)
    assert report.expired == 2
    assert h.state("s1") == "OK"  # the client had it (202); only the ACK never came
    assert h.state("s2") == "FAILED" and h.state("r2") == "FAILED"
    assert not h.redis.exists(h.k.response("c1", "s2"))
