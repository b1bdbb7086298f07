"""Due work: the Redis due set and the PostgreSQL due index behind one interface, the ticker,
and leases with fencing tokens; on the real Redis and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.worker import pubsub
from orderly.worker.core.due import Job, RedisDueSet, Ticker, drain
from orderly.worker.core.lease import RedisLease, new_token
from orderly.worker.core.scripts import Scripts
from orderly.worker.messages import confirmations
from tests.helpers import ManualClock

SET, LEASED = "t:due", "t:due:leased"


def due_set(client: redis.Redis, clock: ManualClock, sink: list[Any]) -> RedisDueSet:
    return RedisDueSet("test", Scripts(client), SET, LEASED, sink.extend, batch=2, clock=clock)


def test_a_due_set_hands_off_what_is_due_in_batches_and_forgets_it(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock(1_000.0)
    handed: list[str] = []
    source = due_set(redis_client, clock, handed)
    redis_client.zadd(SET, {"a": 999_000, "b": 1_000_000, "c": 1_000_500})
    assert drain(source, 10) == 2  # a and b are due, c is not yet
    assert handed == ["a", "b"]
    assert redis_client.zrange(SET, 0, -1) == [b"c"]
    assert redis_client.zcard(LEASED) == 0  # on the broker: forgotten
    clock.advance(0.5)
    assert drain(source, 10) == 1 and handed == ["a", "b", "c"]


def test_a_refused_hand_off_is_due_again_at_once(redis_client: redis.Redis) -> None:
    clock = ManualClock(1_000.0)

    def broker_down(items: list[str]) -> None:
        raise ConnectionError("broker down")

    source = RedisDueSet("test", Scripts(redis_client), SET, LEASED, broker_down, clock=clock)
    redis_client.zadd(SET, {"a": 1, "b": 2})
    with pytest.raises(ConnectionError):
        drain(source, 10)
    assert redis_client.zrange(SET, 0, -1, withscores=True) == [
        (b"a", 1_000_000.0),
        (b"b", 1_000_000.0),
    ]
    assert redis_client.zcard(LEASED) == 0


def test_items_of_a_taker_that_died_come_back_when_the_lease_ends(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock(1_000.0)
    handed: list[str] = []
    source = due_set(redis_client, clock, handed)
    redis_client.zadd(SET, {"a": 1})
    assert source.take(10) == ["a"]  # taken, then the taker dies before the hand-off
    assert drain(source, 10) == 0  # leased: nobody else takes it meanwhile
    clock.advance(source.lease_ms / 1000 - 0.001)
    assert drain(source, 10) == 0
    clock.advance(0.001)
    assert drain(source, 10) == 1 and handed == ["a"]


def test_two_takers_never_take_the_same_item(redis_client: redis.Redis) -> None:
    clock = ManualClock(1_000.0)
    redis_client.zadd(SET, {f"m{i}": i for i in range(50)})
    first = due_set(redis_client, clock, [])
    second = due_set(redis_client, clock, [])
    taken = first.take(30) + second.take(30)
    assert sorted(taken) == sorted(f"m{i}" for i in range(50))


def test_a_due_index_leases_and_releases_deliveries(db: Engine, redis_client: redis.Redis) -> None:
    pubsub.create_room(db, {"name": "r", "delivery_delay_ms": 10})
    pubsub.create_subscription(db, "r", {"name": "s", "kind": "PUSH", "push_url": "http://x/i"})
    pubsub.publish(db, "r", {"routing_key": "k", "payload": {}, "$delay": 0})
    with db.begin() as conn:
        conn.execute(text("UPDATE delivery SET scheduled_at = now() - interval '1 second'"))
    handed: list[list[int]] = []
    source = pubsub.due_deliveries(db, handed.append)
    assert drain(source, 10) == 1 and len(handed) == 1
    assert drain(source, 10) == 0  # leased for a minute: not handed twice
    source.release(handed[0])  # as when the broker refuses it
    assert drain(source, 10) == 1


def test_a_delivery_whose_worker_died_is_handed_off_alone(db: Engine) -> None:
    pubsub.create_room(db, {"name": "r", "delivery_delay_ms": 10})
    pubsub.create_subscription(db, "r", {"name": "s", "kind": "PUSH", "push_url": "http://x/i"})
    ids = [
        pubsub.publish(db, "r", {"routing_key": "k", "payload": {}})[0].deliveries[0]
        for _ in range(3)
    ]
    with db.begin() as conn:
        conn.execute(text("UPDATE delivery SET scheduled_at = now() - interval '1 second'"))
        conn.execute(
            text("UPDATE delivery SET lost_count = 1 WHERE delivery_id = :d"), {"d": ids[1]}
        )
    handed: list[list[int]] = []
    assert drain(pubsub.due_deliveries(db, handed.append), 10) == 3
    assert handed == [[ids[0], ids[2]], [ids[1]]]
    # Isolated by a death in a batch of several (nothing counted): alone too, each in a task.
    with db.begin() as conn:
        conn.execute(text("UPDATE delivery SET scheduled_at = now() - interval '1 second'"))
        conn.execute(
            text("UPDATE delivery SET isolate = true WHERE delivery_id = ANY(:d)"),
            {"d": ids[:2]},
        )
    handed.clear()
    assert drain(pubsub.due_deliveries(db, handed.append), 10) == 3
    assert handed == [[ids[2]], [ids[0]], [ids[1]]]


def test_the_ticker_runs_every_source_and_each_job_at_its_period() -> None:
    clock = ManualClock(1_000.0)
    runs: list[str] = []

    class Source:
        name, batch = "s", 10

        def take(self, limit: int) -> list[Any]:
            runs.append("take")
            return []

        def hand_off(self, items: list[Any]) -> None: ...

        def settle(self, items: list[Any]) -> None: ...

        def release(self, items: list[Any]) -> None: ...

        def due_in_ms(self) -> float | None:
            return None

    def broken() -> None:
        raise RuntimeError("one failing job")

    ticker = Ticker(
        [Source()],
        [
            Job("every-2s", 2.0, lambda: runs.append("job")),
            Job("late", 1.0, lambda: runs.append("late"), first_after_s=5.0),
            Job("broken", 1.0, broken),
        ],
        clock=clock,
    )
    ticker.tick()
    assert runs == ["take", "job"]  # a failing job does not stop the others
    clock.advance(1)
    ticker.tick()
    assert runs == ["take", "job", "take"]
    clock.advance(4)
    ticker.tick()
    assert runs == ["take", "job", "take", "take", "job", "late"]


def test_a_lease_is_given_up_only_by_its_holder(redis_client: redis.Redis) -> None:
    lease = RedisLease(Scripts(redis_client), "t:lease")
    mine, theirs = new_token(), new_token()
    assert len(mine) == 32 and mine != theirs
    assert lease.take(mine, 10_000)
    assert not lease.take(theirs, 10_000)
    assert not lease.give_up(theirs)  # a stale holder cannot free it
    assert 0 < redis_client.pttl("t:lease") <= 10_000
    assert lease.give_up(mine)
    assert lease.take(theirs, 10_000)


def test_a_failing_source_is_logged_once_then_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(1_000.0)
    down = True

    class Source:
        name, batch = "flaky", 10

        def take(self, limit: int) -> list[Any]:
            if down:
                raise ConnectionError("database down")
            return []

        def hand_off(self, items: list[Any]) -> None: ...

        def settle(self, items: list[Any]) -> None: ...

        def release(self, items: list[Any]) -> None: ...

        def due_in_ms(self) -> float | None:
            if down:
                raise ConnectionError("database down")
            return None

    ticker = Ticker([Source()], clock=clock)
    for _ in range(50):  # ten seconds of ticks
        ticker.tick()
        clock.advance(0.2)
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert caplog.records[0].exc_info is not None  # the first one with its traceback
    clock.advance(30)
    ticker.tick()
    assert "still failing" in caplog.records[-1].message
    assert ticker.due_in_s() == 0.0  # no answer: due now, so beat looks again soon
    down = False
    ticker.tick()
    assert caplog.records[-1].message == "due work flaky works again"


def test_a_take_settles_and_releases_only_what_it_still_holds(redis_client: redis.Redis) -> None:
    clock = ManualClock(1_000.0)
    first = due_set(redis_client, clock, [])
    second = due_set(redis_client, clock, [])
    redis_client.zadd(SET, {"x": 1})
    assert first.take(10) == ["x"]
    redis_client.zadd(SET, {"x": 2})  # scheduled anew while the first take holds it
    clock.advance(0.001)
    assert second.take(10) == ["x"]  # now the second take's
    first.settle(["x"])  # the first take's settle must not drop the second's lease
    assert redis_client.zscore(LEASED, "x") is not None
    first.release(["x"])  # nor release it
    assert redis_client.zcard(SET) == 0
    second.release(["x"])  # the holder's release makes it due again
    assert redis_client.zrange(SET, 0, -1) == [b"x"] and redis_client.zcard(LEASED) == 0


def test_a_due_set_says_when_its_earliest_item_is_due(redis_client: redis.Redis) -> None:
    """What beat waits for (beat.scheduler.until_due): the first due time, or the
    first lease end of what a taker holds, whichever is earlier."""
    clock = ManualClock(1_000.0)
    source = due_set(redis_client, clock, [])
    assert source.due_in_ms() is None
    redis_client.zadd(SET, {"later": 1_000_750, "soon": 1_000_300})
    assert source.due_in_ms() == 300
    redis_client.zadd(LEASED, {"held": 1_000_100})  # a taker's lease ends first
    assert source.due_in_ms() == 100
    clock.advance(0.5)
    assert source.due_in_ms() == -400  # overdue: due now


def test_a_due_index_says_when_its_earliest_delivery_is_due(db: Engine) -> None:
    source = pubsub.due_deliveries(db, lambda ids: None)
    assert source.due_in_ms() is None
    pubsub.create_room(db, {"name": "r", "delivery_delay_ms": 10})
    pubsub.create_subscription(db, "r", {"name": "s", "kind": "PUSH", "push_url": "http://x/i"})
    pubsub.publish(db, "r", {"routing_key": "k", "payload": {}, "$delay": 3_600_000})
    due = source.due_in_ms()
    assert due is not None and 3_500_000 < due <= 3_600_000  # an hour's delay waits
    with db.begin() as conn:
        conn.execute(text("UPDATE delivery SET scheduled_at = now() - interval '2 seconds'"))
    due = source.due_in_ms()
    assert due is not None and due <= -2_000


def test_a_due_index_says_when_its_earliest_confirmation_is_due(db: Engine) -> None:
    source = confirmations.due_confirmations(db, lambda items: None)
    assert source.due_in_ms() is None
    with db.begin() as conn:
        node = conn.execute(
            text("INSERT INTO node (code, name, state) VALUES ('n', 'n', 'RUN') RETURNING node_id")
        ).scalar_one()
        msg_id = conn.execute(
            text(
                "INSERT INTO message (msg_timestamp, receive_timestamp, service_name, "
                "operation_name, correlation_id, source_system, payload, envelope, state, "
                "node_id) VALUES (now(), now(), 'test', 'script', 'c-1', 'crm', '{}', '{}', "
                "'OK', :n) "
                "RETURNING msg_id"
            ),
            {"n": node},
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO external_call (msg_id, operation_name, entity_id, state, "
                "msg_timestamp, creation_timestamp, last_update_timestamp, failed_count, "
                "next_attempt_at) VALUES (:m, 'orderly.confirmation', :m, 'FAILED', now(), "
                "now(), now(), 1, now() + interval '90 seconds')"
            ),
            {"m": msg_id},
        )
    due = source.due_in_ms()
    assert due is not None and 80_000 < due <= 90_000
