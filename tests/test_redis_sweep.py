"""Partial Redis loss: keys gone under a live marker (evicted, deleted by hand) are noticed and
the conversations they belonged to rebuilt from PostgreSQL; a Redis that may evict orderly's
keys is refused at start-up and in /ready unless allowed. Against the real Redis and
PostgreSQL (a Redis of the test's own for eviction)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.worker import readiness
from orderly.worker.conversations import rebuild as conversations_rebuild
from orderly.worker.conversations import reconcile
from orderly.worker.conversations.model import Delivery, SendResult
from orderly.worker.conversations.reconcile import SweepReport
from orderly.worker.core.scripts import as_text
from orderly.worker.runtime import Runtime
from orderly.worker.settings import Settings
from tests.conftest import TEST_DB_URL
from tests.helpers import wait_until
from tests.stack import Stack
from tests.test_conversations import Harness, Recorder, make
from tooling.servers import RedisServer


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    yield make(db, redis_client)


def sweep(h: Harness) -> SweepReport:
    return h.conv.sweep(reconcile.page_reader(h.engine), h.enqueue)


def conversation(h: Harness, cid: str, responses: int) -> None:
    h.request(cid, f"{cid}-r1")
    h.request(cid, f"{cid}-r2")
    for i in range(responses):
        h.response(cid, f"{cid}-r{1 + i % 2}", f"{cid}-s{i}", last=i >= responses - 2)


def test_a_response_deleted_by_hand_is_rebuilt_once_seen_twice(h: Harness) -> None:
    conversation(h, "c1", 4)
    conversation(h, "c2", 4)
    assert sweep(h).suspect == []  # whole: nothing to do
    h.redis.delete(h.k.response("c1", "c1-s2"))
    first = sweep(h)
    assert first.suspect == ["c1"] and first.repaired == []  # not yet: it may be in flight
    assert not h.redis.exists(h.k.response("c1", "c1-s2"))
    second = sweep(h)
    assert second.repaired == ["c1"] and second.keys_created >= 1
    assert h.redis.hget(h.k.response("c1", "c1-s2"), "status") == b"PENDING"
    assert sweep(h).suspect == []  # whole again
    rec = Recorder()
    h.run(rec)
    # every response once, in conversation order (r1's, then r2's)
    assert [s for s in rec.sent if s.startswith("c1")] == ["c1-s0", "c1-s2", "c1-s1", "c1-s3"]
    assert len(rec.sent) == len(set(rec.sent)) == 8


def test_a_lost_wait_list_and_order_are_rebuilt(h: Harness) -> None:
    conversation(h, "c1", 2)
    shard = h.k.shard("c1")
    member = as_text(h.redis.zrange(h.k.response_list("c1"), 0, 0)[0])
    h.redis.zrem(shard.pending_messages, member)  # its wait gone: nothing would wake it
    h.redis.delete(h.k.request_list("c1"), h.k.response_list("c1"))
    sweep(h)
    assert sweep(h).repaired == ["c1"]
    assert h.redis.zscore(shard.pending_messages, member) is not None
    assert h.redis.llen(h.k.request_list("c1")) == 2
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["c1-s0", "c1-s1"]


def test_a_key_back_before_the_second_sweep_is_left_alone(h: Harness) -> None:
    conversation(h, "c1", 2)
    saved = h.redis.dump(h.k.response("c1", "c1-s1"))
    ttl = h.redis.pttl(h.k.response("c1", "c1-s1"))
    h.redis.delete(h.k.response("c1", "c1-s1"))
    assert sweep(h).suspect == ["c1"]
    # its script ran after all (the moment between the row and Redis)
    assert saved is not None
    h.redis.restore(h.k.response("c1", "c1-s1"), ttl, saved)
    report = sweep(h)
    assert report.suspect == [] and report.repaired == []


def test_rows_that_changed_between_sweeps_are_looked_at_again(h: Harness) -> None:
    conversation(h, "c1", 2)
    h.redis.delete(h.k.response("c1", "c1-s1"))
    assert sweep(h).suspect == ["c1"]
    h.response("c1", "c1-r2", "c1-s9", last=True)  # new rows: not the same conversation
    report = sweep(h)
    assert report.repaired == [] and report.suspect == ["c1"]
    assert sweep(h).repaired == ["c1"]


# --- noticed in-band: a script that finds a key gone asks PostgreSQL before it goes on ------


def test_a_response_whose_open_request_was_evicted_keeps_its_place(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.redis.delete(h.k.request("c1", "r1"))  # evicted: r1's life is not over
    h.response("c1", "r1", "s1", last=True)  # not a late callback taking a turn after r2
    assert h.redis.hget(h.k.response("c1", "s1"), "lateMs") == b""
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1", "s2"]


def test_a_response_after_its_request_expired_is_still_late(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.clock.advance_ms(11_000)  # past r1's MESSAGE_TTL (10 s): PostgreSQL agrees it is over
    h.redis.delete(h.k.request("c1", "r1"))
    h.response("c1", "r1", "s1", last=True)
    assert h.redis.hget(h.k.response("c1", "s1"), "lateMs") not in (None, b"")
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s2", "s1"]  # its turn again, after the conversation's later ones


@pytest.mark.parametrize(
    "lost", [("seq",), ("seq", "req", "res")], ids=["counter", "counter-list-and-order"]
)
def test_a_request_after_its_conversations_counter_was_evicted_goes_last(
    h: Harness, lost: tuple[str, ...]
) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    keys = {"seq": h.k.request_seq("c1"), "req": h.k.request_list("c1")}
    keys["res"] = h.k.response_list("c1")
    h.redis.delete(*[keys[name] for name in lost])
    h.request("c1", "r3")  # numbered after r1 and r2, not from 1 again
    h.response("c1", "r3", "s3", last=True)
    h.response("c1", "r1", "s1", last=True)
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1", "s2", "s3"]


def test_a_request_after_its_conversations_list_was_evicted_waits_behind_the_open_ones(
    h: Harness,
) -> None:
    h.request("c1", "r1")  # waits for its first response
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.redis.delete(h.k.request_list("c1"))
    h.request("c1", "r3")  # not a list of r3 alone: r1 and r2 before it
    listed = [as_text(x) for x in h.redis.lrange(h.k.request_list("c1"), 0, -1)]
    assert listed == [h.k.request("c1", r) for r in ("r1", "r2", "r3")]
    rec = Recorder()
    assert h.run(rec) == ["WAIT_REQUEST"] and rec.sent == []
    h.response("c1", "r1", "s1", last=True)
    h.run(rec)
    assert rec.sent == ["s1", "s2"]


def test_the_gate_does_not_send_past_an_evicted_request_list(h: Harness) -> None:
    h.request("c1", "r1")  # waits for its first response
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.redis.delete(h.k.request_list("c1"))  # r1 no longer holds s2 back, unless asked
    assert h.conv.can_send("c1", "s2").status == "WAIT_REQUEST"
    h.redis.delete(h.k.request_list("c1"))  # and once more, for the drain's own look
    rec = Recorder()
    assert h.run(rec) == ["WAIT_REQUEST"] and rec.sent == []


def test_a_response_after_its_conversations_order_was_evicted_goes_after_its_elders(
    h: Harness,
) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1")
    h.response("c1", "r1", "s2")
    h.started.clear()  # not sent yet
    h.redis.delete(h.k.drain_lease("c1"), h.k.response_list("c1"))
    h.response("c1", "r1", "s3", last=True)  # not an order of s3 alone
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1", "s2", "s3"]


def test_the_sweep_puts_back_a_request_or_response_missing_from_its_list_or_order(
    h: Harness,
) -> None:
    conversation(h, "c1", 4)
    h.redis.lrem(h.k.request_list("c1"), 0, h.k.request("c1", "c1-r1"))
    member = as_text(h.redis.zrange(h.k.response_list("c1"), 1, 1)[0])
    h.redis.zrem(h.k.response_list("c1"), member)
    assert sweep(h).suspect == ["c1"]
    assert sweep(h).repaired == ["c1"]
    assert sweep(h).suspect == []
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["c1-s0", "c1-s2", "c1-s1", "c1-s3"]


def test_a_repair_waits_for_a_response_settled_in_redis_to_be_recorded(h: Harness) -> None:
    """An ACK, a deletion, a scheduled removal settle a response in Redis before PostgreSQL
    records it, under the conversation's lock (Context.locked): a repair between the two would
    read the row still open and bring the response back, to be sent again."""
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r1", "s1")
    key = h.k.response("c1", "s1")
    ctx = h.conv.ctx
    with ctx.locked("c1") as conn:
        h.redis.delete(key)  # settled in Redis (as conv_delete.lua would)
        repaired: list[set[str]] = []
        worker = threading.Thread(
            target=lambda: repaired.append(reconcile.repair(ctx, "c1", [key]))
        )
        worker.start()
        wait_until(lambda: _waiting_for_a_lock(h.engine), timeout=30, what="the repair waiting")
        assert worker.is_alive() and repaired == []
        conn.execute("UPDATE message SET state = 'CANCEL' WHERE correlation_id = 's1'")
    worker.join(timeout=30)
    assert repaired == [set()]  # its row read after the record: not brought back
    assert not h.redis.exists(key)


def test_an_ack_settles_redis_and_records_postgresql_under_the_conversations_lock(
    h: Harness,
) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    h.run(Recorder(answers={"s1": [SendResult(Delivery.ASYNC, 202, "ack-1")]}))
    with h.conv.ctx.locked("c1"):  # a repair reading c1's rows
        acking = threading.Thread(target=lambda: h.conv.ack("ack-1", h.enqueue))
        acking.start()
        wait_until(lambda: _waiting_for_a_lock(h.engine), timeout=30, what="the ACK waiting")
        assert acking.is_alive()
        assert h.redis.hget(h.k.response("c1", "s1"), "status") == b"SENT"  # not yet settled
    acking.join(timeout=30)
    assert h.state("s1") == "OK" and not h.redis.exists(h.k.response("c1", "s1"))


def _waiting_for_a_lock(db: Engine) -> bool:
    """Some session of this test's database waits for an advisory lock."""
    with db.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
                " WHERE l.locktype = 'advisory' AND NOT l.granted"
                " AND d.datname = current_database()"
            )
        )
        return bool(found.scalar_one())


def test_a_response_added_while_a_repair_read_joins_its_rebuilt_request(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r1", "s1a")
    h.response("c1", "r2", "s2", last=True)
    rows = conversations_rebuild.read_rows(h.engine, only="c1")  # a repair's read
    h.response("c1", "r1", "s1b", last=True)  # taken in meanwhile (no lock for a response)
    h.redis.delete(h.k.request_seq("c1"))  # what the repair came for
    assert conversations_rebuild.rebuild(h.conv.ctx, rows).keys_created > 0
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1a", "s1b", "s2"]  # in r1's turn, not behind r2's


def test_a_drain_whose_lease_was_evicted_leaves_a_head_another_drain_is_sending(
    h: Harness,
) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    cid, token = h.started.pop(0)
    sent: list[str] = []
    second: list[str] = []

    def send(channel: Any, head: Any) -> SendResult:
        sent.append(head.response_id)
        if not second:
            h.redis.delete(h.k.drain_lease("c1"))  # evicted while s1 is being sent
            second.append(h.conv.drain("c1", "another-drain", send).end)
        return SendResult(Delivery.DELIVERED, 200)

    h.conv.drain(cid, token, send)
    assert second == ["LOST"] and sent == ["s1"]  # not sent twice
    assert h.redis.hget(h.k.response("c1", "s1"), "lost") is None


def test_grouped_intake_after_an_eviction_keeps_the_order(db: Engine, redis_client: Any) -> None:
    h = make(db, redis_client, intake_group_max=64)
    h.request("c1", "r1")
    h.request("c1", "r2")
    h.response("c1", "r2", "s2", last=True)
    h.redis.delete(h.k.request_seq("c1"), h.k.request("c1", "r1"))

    async def arrive() -> None:
        await h.conv.register_request_together("c1", {"request_id": "r3", "origin": "chat"})
        body = {"request_id": "r3", "response_id": "s3", "payload": {}, "last": True}
        await h.conv.add_response_together("c1", body, h.enqueue)
        body = {"request_id": "r1", "response_id": "s1", "payload": {}, "last": True}
        await h.conv.add_response_together("c1", body, h.enqueue)

    asyncio.run(arrive())
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1", "s2", "s3"]


def test_the_awaited_agent_rebuilds_an_evicted_response_rather_than_fail_it(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    h.started.clear()  # no drain ran (its lease ran out): s1 waits in pendingMessages
    h.redis.delete(h.k.drain_lease("c1"))
    h.redis.delete(h.k.response("c1", "s1"))  # evicted: its life is not over
    h.clock.advance_ms(h.conv.blocked_ms + 1)  # its entry is due for the agent
    report = h.conv.awaited_turn(h.enqueue)
    assert report.vanished == 0
    assert h.state("s1") == "IN_QUEUE"
    assert h.redis.hget(h.k.response("c1", "s1"), "status") == b"PENDING"
    rec = Recorder()
    h.run(rec)
    assert rec.sent == ["s1"]


def test_the_awaited_agent_fails_a_response_whose_life_ran_out(h: Harness) -> None:
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    h.started.clear()
    h.clock.advance_ms(60_000)  # AWAITED_MESSAGE_TTL: PostgreSQL agrees its life is over
    h.redis.delete(h.k.response("c1", "s1"))  # its key expired
    assert h.conv.awaited_turn(h.enqueue).vanished == 1
    assert h.state("s1") == "FAILED"


@pytest.fixture
def evicting(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


def _fill_until_evicted(client: redis.Redis, gone: list[str]) -> None:
    """Volatile filler under a small maxmemory until some of ``gone``'s keys are evicted."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 256 * 1024))
    client.config_set("maxmemory-policy", "volatile-lru")
    blob = "x" * 1024
    for i in range(4000):
        client.set(f"filler:{i}", blob, ex=3600)
        if i % 100 == 99 and client.exists(*gone) < len(gone):
            break
    assert int(client.info("stats")["evicted_keys"]) > 0
    assert client.exists(*gone) < len(gone), "nothing of orderly's was evicted"


def test_keys_evicted_under_volatile_lru_are_rebuilt(db: Engine, evicting: redis.Redis) -> None:
    h = make(db, evicting)
    for c in range(20):
        conversation(h, f"c{c}", 4)
    keys = [as_text(k) for k in evicting.keys("bridge:*")]
    _fill_until_evicted(evicting, keys)
    evicting.config_set("maxmemory", "0")  # the pressure is over
    evicting.delete(*[f"filler:{i}" for i in range(4000)])
    first = sweep(h)
    assert first.suspect, "the sweep did not notice the evicted keys"
    second = sweep(h)
    assert sorted(second.repaired) == sorted(first.suspect)
    assert sweep(h).suspect == []
    rec = Recorder()
    h.run(rec)
    for c in range(20):
        sent = [s for s in rec.sent if s.startswith(f"c{c}-")]
        assert sent == [f"c{c}-s0", f"c{c}-s2", f"c{c}-s1", f"c{c}-s3"], (c, sent)
    assert len(rec.sent) == len(set(rec.sent)) == 80


def test_a_redis_that_may_evict_is_named_and_refused_unless_allowed(
    evicting: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    assert readiness.evicting(evicting) == []  # no maxmemory: nothing is evicted
    evicting.config_set("maxmemory", str(512 * 1024 * 1024))
    assert readiness.evicting(evicting) == []  # noeviction: writes fail instead
    evicting.config_set("maxmemory-policy", "volatile-lru")
    found = readiness.evicting(evicting)
    assert len(found) == 1 and "maxmemory-policy volatile-lru" in found[0]
    with pytest.raises(readiness.RedisMayEvict, match="ORDERLY_REDIS_EVICTION_ALLOWED"):
        readiness.keeps_keys([evicting], allowed=False)
    readiness.keeps_keys([evicting], allowed=True)
    assert "may evict" in caplog.text


def test_startup_refuses_a_redis_that_may_evict(redis_server: RedisServer, db: Engine) -> None:
    client = redis_server.client()
    client.config_set("maxmemory", str(512 * 1024 * 1024))
    client.config_set("maxmemory-policy", "allkeys-lru")
    values: dict[str, Any] = {"database_url": TEST_DB_URL, "redis_url": redis_server.url}
    with pytest.raises(readiness.RedisMayEvict, match="allkeys-lru"):
        Runtime(Settings(**values)).startup_check()
    Runtime(Settings(**values)).startup_check(redis=False)  # migrations: no Redis
    Runtime(Settings(**values, redis_eviction_allowed=True)).startup_check()


@pytest.mark.e2e
def test_the_api_refuses_to_start_and_ready_names_eviction(
    stack: Stack, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    client.config_set("maxmemory", str(512 * 1024 * 1024))
    client.config_set("maxmemory-policy", "volatile-lru")
    stack.env(ORDERLY_REDIS_URL=redis_server.url, ORDERLY_READY_CACHE_MS="0")
    with pytest.raises(RuntimeError, match="exited"):
        stack.start_api()
    client.config_set("maxmemory-policy", "noeviction")
    stack.start_api()
    assert stack.http.get("/ready").status_code == 200
    client.config_set("maxmemory-policy", "volatile-lru")  # changed under a running API
    ready = stack.http.get("/ready")
    assert ready.status_code == 503 and "redis-eviction" in ready.text
    assert "volatile-lru" in ready.text
    stack.env(ORDERLY_REDIS_EVICTION_ALLOWED="true")
    stack.start_api()
    wait_until(lambda: stack.http.get("/ready").status_code == 200, 30, "/ready with it allowed")
