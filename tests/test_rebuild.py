"""Rebuild from PostgreSQL (worker/rebuild.py) against the real Redis and PostgreSQL: Redis is
flushed in the middle of conversations (some responses delivered, one waiting for its ACK,
one waiting for a retry, a group AWAITED, a request still waiting), rebuilt from the rows,
and everything accepted is then delivered in order, nothing twice."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models.keys import BridgeKeys
from orderly.worker import rebuild
from orderly.worker.conversations import Delivery, SendResult
from orderly.worker.messages.intake import Intake
from tests.test_conversations import Harness, Recorder, make

RETRY = SendResult(Delivery.RECOVERABLE, 500, reason="500")
K = BridgeKeys()  # the harness's layout (tests.test_conversations.make)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def snapshot(r: redis.Redis, cids: list[str]) -> dict[str, Any]:
    """The ordering state that must survive: per conversation its request list, its order of
    responses and each response's status, attempt, retry time and awaited round."""
    out: dict[str, Any] = {}
    for cid in cids:
        responses = []
        for m in r.zrange(K.response_list(cid), 0, -1):
            rid = _text(m).split('"rsId":"')[1].split('"')[0]
            f = {_text(k): _text(v) for k, v in r.hgetall(K.response(cid, rid)).items()}
            # An AWAITED wait is rebuilt from the row's age (PostgreSQL's clock, while the
            # test's clock stands still): compared apart, within the test's real time.
            not_before = "awaited" if f["status"] == "AWAITED" else f["notBefore"]
            responses.append(
                (rid, f["status"], f["attempt"], not_before, f["awaitedRetries"], f["last"])
            )
        out[cid] = {
            "requests": [_text(k) for k in r.lrange(K.request_list(cid), 0, -1)],
            "responses": responses,
        }
    return out


def _no_rebuild_sends() -> None:
    raise AssertionError("nothing to process, yet a worker was woken")


def test_flush_mid_drain_then_everything_in_order_nothing_twice(
    db: Engine, redis_client: redis.Redis
) -> None:
    h: Harness = make(db, redis_client)
    sender = Recorder()
    # c1: s1 delivered, s2 answered 202 (its ACK pending), t1 of a later request behind it.
    h.request("c1", "r1")
    h.request("c1", "r2")
    sender.answers["s2"] = [SendResult(Delivery.ASYNC, 202, async_response_id="ack-s2")]
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    h.response("c1", "r2", "t1", last=True)
    # c3: v1's retries are spent: its group is AWAITED.
    h.request("c3", "p1")
    sender.answers["v1"] = [RETRY, RETRY, RETRY]
    h.response("c3", "p1", "v1", last=True)
    # c4: w1 still waits for its first response and holds x1 of the next request.
    h.request("c4", "w1")
    h.request("c4", "w2")
    h.response("c4", "w2", "x1", last=True)
    h.run(sender)
    h.clock.advance_ms(20)  # u1's and v1's first retries are due
    h.wake_due()
    h.run(sender)
    h.clock.advance_ms(40)  # v1's second retry
    h.wake_due()
    h.run(sender)
    # c2: u1 failed once (waits for its retry), u2 behind it.
    h.request("c2", "q1")
    sender.answers["u1"] = [RETRY]
    h.response("c2", "q1", "u1")
    h.response("c2", "q1", "u2", last=True)
    h.run(sender)
    assert sender.sent == ["s1", "s2", "v1", "v1", "v1", "u1"]
    assert h.state("s1") == "OK" and h.state("s2") == "WAITING_FOR_RES"
    assert h.state("v1") == "PARTLY_FAILED" and h.state("u1") == "IN_QUEUE"
    cids = ["c1", "c2", "c3", "c4"]
    before = snapshot(redis_client, cids)
    assert before["c2"]["responses"][0][1:4] == ("PENDING", "1", str(h.clock.ms() + 20))
    assert before["c3"]["responses"][0][1] == "AWAITED"
    until_before = int(_text(redis_client.hget(K.response("c3", "v1"), "awaitedToDate")))

    redis_client.flushdb()
    assert rebuild.check(h.conv).startswith("the marker is missing")
    woken: list[bool] = []
    report = rebuild.rebuild(db, h.conv, h.enqueue, lambda: woken.append(True))
    # conversation rows are the drains': no store message waits, no worker is woken
    assert report.done and report.marked_ready and woken == []
    assert rebuild.check(h.conv) == ""
    assert snapshot(redis_client, cids) == before
    until = int(_text(redis_client.hget(K.response("c3", "v1"), "awaitedToDate")))
    # Rebuilt from the row's age (PostgreSQL's clock), within the test's real time.
    assert abs(until - until_before) < 30_000
    assert sorted(report.drains_started) == cids
    # A second rebuild finds Redis whole.
    assert not rebuild.rebuild(db, h.conv, h.enqueue, _no_rebuild_sends).done

    # Delivery goes on from where it was.
    h.run(sender)
    assert sender.sent[6:] == []  # s2 waits for its ACK, u1 for its retry, v1 AWAITED, w1
    h.conv.ack("ack-s2", h.enqueue)
    h.run(sender)
    h.clock.advance_ms(30)
    h.wake_due()
    h.run(sender)
    h.response("c4", "w1", "y1", last=True)
    h.run(sender)
    h.clock.advance_ms(6_000)  # AWAITED_TIME_WHEN_RETRIES_END
    h.conv.awaited_turn(h.enqueue)
    h.run(sender)
    after = sender.sent[6:]
    assert sorted(after) == ["t1", "u1", "u2", "v1", "x1", "y1"], after
    assert after.index("u1") < after.index("u2") and after.index("y1") < after.index("x1")
    with db.connect() as conn:
        states: dict[str, str] = dict(
            conn.execute(
                text(
                    "SELECT correlation_id, state FROM message WHERE service_name = 'conversation'"
                )
            ).all()
        )
    assert set(states.values()) == {"OK"}, states


def test_requests_and_responses_accepted_after_the_loss_go_behind_the_rebuilt_ones(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client)
    sender = Recorder()
    h.request("c1", "r1")
    sender.answers["s1"] = [RETRY]
    h.response("c1", "r1", "s1")
    h.run(sender)
    redis_client.flushdb()
    h.started.clear()
    # Accepted before beat noticed: the intake finds c1's counter gone while PostgreSQL has
    # c1 open, and has c1 rebuilt from its rows before it registers r2 after them.
    h.request("c1", "r2")
    assert redis_client.exists(K.request("c1", "r1"), K.response("c1", "s1")) == 2
    h.response("c1", "r2", "t1", last=True)
    h.response("c1", "r1", "s2", last=True)
    report = rebuild.rebuild(db, h.conv, h.enqueue, lambda: None)
    assert report.done and report.keys_created == 0  # nothing left to rebuild
    order = [
        _text(m).split('"rsId":"')[1].split('"')[0]
        for m in redis_client.zrange(K.response_list("c1"), 0, -1)
    ]
    assert order == ["s1", "s2", "t1"]
    # The drain the intake started after the loss runs after the rebuild (beat's tick came
    # first): it finds s1 waiting for its retry.
    assert h.run(sender) == ["WAIT_RETRY"]
    h.clock.advance_ms(1_000)
    assert h.wake_due() == ["c1"]
    h.run(sender)
    assert sender.sent == ["s1", "s1", "s2", "t1"]


def test_no_drain_claims_while_redis_is_being_rebuilt(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client)
    sender = Recorder()
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.run(sender)
    assert sender.sent == ["s1"]
    redis_client.flushdb()
    h.started.clear()
    # A rebuild is under way (the marker says so) and a response comes in meanwhile: its
    # request is not rebuilt yet, so sending it now could overtake older responses.
    redis_client.hset(K.shard("c1").epoch, mapping={"state": "rebuilding", "generation": "g"})
    h.response("c1", "r1", "s2", last=True)
    assert h.run(sender) == ["REBUILDING"]
    assert sender.sent == ["s1"]
    assert redis_client.get(K.drain_lease("c1")) is None  # the drain gave up its lease
    redis_client.delete(K.shard("c1").epoch)
    report = rebuild.rebuild(db, h.conv, h.enqueue, lambda: None)
    assert report.marked_ready and report.drains_started == ["c1"]
    h.run(sender)
    assert sender.sent == ["s1", "s2"]


def test_queued_store_messages_wake_a_worker_and_one_rebuilder_at_a_time(
    db: Engine, redis_client: redis.Redis, intake: Intake, queue: list[int]
) -> None:
    h = make(db, redis_client)
    for n in range(3):
        intake.submit(
            {
                "service": "customer",
                "operation": "createCustomer",
                "correlation_id": f"m-{n}",
                "source_system": "crm",
                "msg_timestamp": "2026-11-22T10:00:00Z",
                "payload": "x",
            }
        )
    assert len(queue) == 3
    with db.connect() as holder:
        assert holder.execute(
            text("SELECT pg_try_advisory_lock(hashtext('orderly.rebuild'))")
        ).scalar_one()
        busy = rebuild.rebuild(db, h.conv, h.enqueue, lambda: None)
        assert busy.busy and not busy.done
        holder.execute(text("SELECT pg_advisory_unlock(hashtext('orderly.rebuild'))"))
        holder.commit()
    woken: list[bool] = []
    report = rebuild.rebuild(db, h.conv, h.enqueue, lambda: woken.append(True))
    # one wake-up, not a task per message: the woken claims take them in line (priority,
    # funnels taking turns), as any due message
    assert report.done and report.messages_queued == 3 and woken == [True]
    # The marker is written under this server's run: a changed run_id counts as a restart.
    redis_client.hset(K.every_shard[3].epoch, "run_id", "another-run")  # one shard's
    assert rebuild.check(h.conv).startswith("the server restarted")
    assert rebuild.rebuild(db, h.conv, h.enqueue, lambda: woken.append(True)).done
    assert woken == [True, True]


@pytest.mark.parametrize("state", ["rebuilding"])
def test_an_unfinished_rebuild_counts_as_lost(
    db: Engine, redis_client: redis.Redis, state: str
) -> None:
    h = make(db, redis_client)
    for shard in K.every_shard:
        redis_client.hset(
            shard.epoch, mapping={"state": "ready", "run_id": rebuild.server_run_id(h.conv)}
        )
    assert rebuild.check(h.conv) == ""
    redis_client.hset(K.every_shard[-1].epoch, "state", state)  # one shard is enough
    assert rebuild.check(h.conv) == "a rebuild did not finish"


def _keys(r: redis.Redis) -> list[str]:
    return sorted(_text(k) for k in r.scan_iter(match="bridge:queue:*"))


def test_the_layout_before_shards_is_rebuilt_into_shards_and_removed(
    db: Engine, redis_client: redis.Redis
) -> None:
    h = make(db, redis_client)
    sender = Recorder(answers={"s1": [RETRY]})
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2", last=True)
    assert h.run(sender) == ["WAIT_RETRY"]
    # The keys as an orderly before shards named them (bridge:queue:req:r1,
    # bridge:queue:pendingMessages, bridge:queue:scheduled, ...) and its one marker.
    for key in _keys(redis_client):
        redis_client.rename(key, re.sub(r"\{bq:\d+:\d+\}:", "", key))
    redis_client.hset("orderly:epoch", mapping={"state": "ready", "generation": "g"})
    old = _keys(redis_client)
    assert {"bridge:queue:pendingMessages", "bridge:queue:req:r1", "bridge:queue:c1"} <= set(old)
    redis_client.set("bridge:queue:notes:kept:here", "1")  # not a conversation key
    redis_client.set("orderly:track:message:id", "7")  # another namespace
    assert rebuild.check(h.conv) == "the marker is missing"
    report = rebuild.rebuild(db, h.conv, h.enqueue, lambda: None)
    assert report.done and report.marked_ready and rebuild.check(h.conv) == ""
    assert report.other_layout_keys_removed == len(old) + 1  # and orderly:epoch
    left = _keys(redis_client)
    assert "bridge:queue:notes:kept:here" in left
    assert all(k.startswith(K.layout) for k in left if k != "bridge:queue:notes:kept:here")
    assert redis_client.get("orderly:track:message:id") == b"7"
    assert not redis_client.exists("orderly:epoch")
    # Delivery goes on in the new layout, in order: s1 still waits for its retry.
    assert report.drains_started == ["c1"]
    assert h.run(sender) == ["WAIT_RETRY"]
    h.clock.advance_ms(1_000)
    assert h.wake_due() == ["c1"]
    h.run(sender)
    assert sender.sent == ["s1", "s1", "s2"]
    assert (h.state("s1"), h.state("s2"), h.state("r1")) == ("OK", "OK", "OK")


def test_another_shard_count_is_a_rebuild_into_its_layout(
    db: Engine, redis_client: redis.Redis
) -> None:
    four = make(db, redis_client, redis_shards=4)
    cids = [f"c{n}" for n in range(8)]
    for cid in cids:  # nothing delivered yet: their drains are not run
        four.request(cid, f"{cid}-r1")
        four.response(cid, f"{cid}-r1", f"{cid}-s1")
        four.response(cid, f"{cid}-r1", f"{cid}-s2", last=True)
    assert rebuild.rebuild(db, four.conv, four.enqueue, lambda: None).done
    assert rebuild.check(four.conv) == ""
    before = _keys(redis_client)
    eight = make(db, redis_client, redis_shards=8)
    assert rebuild.check(eight.conv) == "the marker is missing"
    report = rebuild.rebuild(db, eight.conv, eight.enqueue, lambda: None)
    assert report.done and report.marked_ready
    assert report.other_layout_keys_removed == len(before)
    assert all(k.startswith(eight.k.layout) for k in _keys(redis_client))
    assert sorted(report.drains_started) == cids
    sender = Recorder()
    eight.run(sender)
    for cid in cids:
        assert [s for s in sender.sent if s.startswith(f"{cid}-")] == [f"{cid}-s1", f"{cid}-s2"]
