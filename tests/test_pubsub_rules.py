"""Tokens, pull subscriptions and ordered subscriptions, driven in process on the real store.

Retry waits and visibility timeouts fall due by PostgreSQL's clock (the claims compare with
its now()): a test waits until PostgreSQL says so, not for a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine, text

from orderly.models import DeliveryState
from orderly.worker import pubsub, tokens
from orderly.worker.core.errors import InvalidMessage, NotFound, Unauthorized
from orderly.worker.db.queries import sql
from orderly.worker.pubsub import Attempt, Claimed
from tests.helpers import ManualClock, wait_until

SECRET = "test-secret-of-enough-length"
LOST_LIMIT = 3


def test_token_round_trip_and_refusals() -> None:
    now = int(time.time() * 1000)
    claims = tokens.Claims("alice", "bob", "corr-1", now + 60_000)
    token = tokens.sign(SECRET, claims)
    assert tokens.verify(SECRET, token, now_ms=now) == claims
    with pytest.raises(Unauthorized, match="no token"):
        tokens.verify(SECRET, None, now_ms=now)
    payload, _, signature = token.partition(".")
    forged = tokens.sign("another-secret", tokens.Claims("mallory", None, "corr-1", now + 1))
    with pytest.raises(Unauthorized, match="signature"):
        tokens.verify(SECRET, forged, now_ms=now)
    with pytest.raises(Unauthorized, match="signature"):
        tokens.verify(SECRET, payload[:-2] + "xx." + signature, now_ms=now)
    with pytest.raises(Unauthorized, match="expired"):
        tokens.verify(SECRET, token, now_ms=now + 60_000)
    with pytest.raises(Unauthorized, match="SECRET"):
        tokens.verify("", token, now_ms=now)


@pytest.fixture
def room(db: Engine, redis_client: redis.Redis) -> Iterator[Engine]:
    pubsub.create_room(
        db,
        {
            "name": "r",
            "delivery_delay_ms": 50,
            "delivery_delay_multiplier": 2.0,
            "delivery_attempts": 3,
        },
    )
    yield db


def publish(engine: Engine, payload: Any, **extra: Any) -> list[int]:
    result, _ = pubsub.publish(
        engine, "r", {"routing_key": "k", "payload": payload, **extra}, secret=SECRET
    )
    return result.deliveries


def state(engine: Engine, delivery_id: int) -> tuple[str, int]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT state, attempt FROM delivery WHERE delivery_id = :d"), {"d": delivery_id}
        ).one()
        return str(row.state), int(row.attempt)


def retry_due(engine: Engine, delivery_id: int) -> bool:
    """The delivery's wait is over by PostgreSQL's clock."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT next_attempt_at <= now() FROM delivery WHERE delivery_id = :d"),
                {"d": delivery_id},
            ).scalar_one()
        )


def visibility_over(engine: Engine, delivery_id: int) -> bool:
    """The pulled delivery's visibility timeout has run out by PostgreSQL's clock."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT d.claimed_at < now() - make_interval("
                    "secs => s.visibility_timeout_ms / 1000.0)"
                    " FROM delivery d JOIN subscription s USING (subscription_id)"
                    " WHERE d.delivery_id = :d"
                ),
                {"d": delivery_id},
            ).scalar_one()
        )


def test_pull_ack_and_visibility_timeout(room: Engine) -> None:
    sub = pubsub.create_subscription(
        room, "r", {"name": "puller", "kind": "PULL", "visibility_timeout_ms": 200}
    )["subscription_id"]
    ids = publish(room, {"n": 1})
    taken = pubsub.pull(room, sub, 10)
    assert [m["delivery_id"] for m in taken] == ids and taken[0]["payload"] == {"n": 1}
    assert pubsub.pull(room, sub, 10) == []  # invisible while pulled
    wait_until(lambda: visibility_over(room, ids[0]), timeout=10, what="visibility timeout")
    pubsub.upkeep(room, LOST_LIMIT)  # the upkeep job returns it
    again = pubsub.pull(room, sub, 10)
    assert [m["delivery_id"] for m in again] == ids and again[0]["attempt"] == 1
    with pytest.raises(NotFound):
        pubsub.ack_pulled(room, sub, ids[0], taken[0]["receipt"])  # the stale receipt
    pubsub.ack_pulled(room, sub, ids[0], again[0]["receipt"])
    assert state(room, ids[0]) == ("DELIVERED", 1)
    with room.connect() as conn:
        outcomes = conn.execute(
            text("SELECT attempt, outcome FROM published_messages ORDER BY id")
        ).all()
    assert [(o.attempt, o.outcome) for o in outcomes] == [(0, "FAILED"), (1, "DELIVERED")]


def test_pulled_and_never_acked_is_dead_lettered_when_attempts_run_out(room: Engine) -> None:
    sub = pubsub.create_subscription(
        room,
        "r",
        {"name": "p", "kind": "PULL", "visibility_timeout_ms": 100, "delivery_attempts": 2},
    )["subscription_id"]
    ids = publish(room, {})
    for _ in range(2):
        assert pubsub.pull(room, sub, 1)
        wait_until(lambda: visibility_over(room, ids[0]), timeout=10, what="visibility timeout")
        pubsub.upkeep(room, LOST_LIMIT)
    assert state(room, ids[0]) == ("DEAD", 2)
    # What the console shows: counts per subscription and state, dead letters per room.
    counts = pubsub.subscription_deliveries(room, "r")
    assert counts[sub].by_state[DeliveryState.DEAD] == 1 and counts[sub].due == 0
    assert sum(counts[sub].by_state.values()) == 1
    assert pubsub.dead_letter_counts(room) == {"r": 1}
    # A re-drive restricted to another room moves nothing; to its own room, it goes again.
    pubsub.create_room(room, {"name": "elsewhere"})
    assert pubsub.redrive(room, ids, room="elsewhere") == []
    assert state(room, ids[0]) == ("DEAD", 2)
    assert pubsub.redrive(room, ids, room="r") == ids
    assert state(room, ids[0]) == ("PENDING", 0)
    assert pubsub.subscription_deliveries(room, "r")[sub].due == 1
    assert pubsub.dead_letter_counts(room) == {}


def _push(results: dict[str, list[bool]], seen: list[str]) -> Any:
    def push(c: Claimed) -> Attempt:
        seen.append(f"{c.payload['key']}{c.payload['n']}")
        queue = results.get(seen[-1], [])
        return Attempt(queue.pop(0) if queue else True, "HTTP 503")

    return push


def test_ordered_subscription_holds_the_key_behind_a_retry(room: Engine) -> None:
    pubsub.create_subscription(
        room,
        "r",
        {"name": "o", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in", "order_key": "key"},
    )
    a1 = publish(room, {"key": "a", "n": 1})[0]
    a2 = publish(room, {"key": "a", "n": 2})[0]
    b1 = publish(room, {"key": "b", "n": 1})[0]
    seen: list[str] = []
    push = _push({"a1": [False]}, seen)
    assert pubsub.deliver(room, a1, push) == "PENDING"  # a retry waits at the head of "a"
    assert pubsub.deliver(room, a2, push) == "NOT_CLAIMABLE"  # held behind it
    assert pubsub.deliver(room, b1, push) == "DELIVERED"  # another key goes on
    wait_until(lambda: retry_due(room, a1), timeout=10, what="the retry's wait: 50 ms x 2^1")
    assert pubsub.deliver(room, a1, push) == "DELIVERED"
    with room.connect() as conn:  # the successor was made due at once
        due = conn.execute(
            text("SELECT next_attempt_at <= now() FROM delivery WHERE delivery_id = :d"),
            {"d": a2},
        ).scalar_one()
    assert due is True
    assert pubsub.deliver(room, a2, push) == "DELIVERED"
    assert seen == ["a1", "b1", "a1", "a2"]


def test_consumer_refuses_missing_forged_and_expired_tokens(
    room: Engine, redis_client: redis.Redis
) -> None:
    pubsub.create_subscription(
        room, "r", {"name": "h", "kind": "HANDLER", "handler": "test.record"}, token_secret=SECRET
    )
    import tooling.handlers  # noqa: F401 - registers the consumers

    now = int(time.time() * 1000)
    other = tokens.sign("wrong-secret", tokens.Claims("u", None, "x", now + 60_000))
    cases = {
        "valid": publish(room, {}, user="alice"),
        "forged": publish(room, {}, user="alice"),
        "expired": [],
        "missing": publish(room, {}, user="alice"),
    }
    with room.begin() as conn:
        conn.execute(
            text(
                "UPDATE event SET token = NULL WHERE event_id = ("
                " SELECT event_id FROM delivery WHERE delivery_id = :d)"
            ),
            {"d": cases["missing"][0]},
        )
        conn.execute(  # a token made with another secret, as if tampered with in transit
            text(
                "UPDATE event SET token = :t WHERE event_id = ("
                " SELECT event_id FROM delivery WHERE delivery_id = :d)"
            ),
            {"t": other, "d": cases["forged"][0]},
        )
    # Published a second ago with a token good for 1 ms: expired when it is delivered.
    expired, _ = pubsub.publish(
        room,
        "r",
        {"routing_key": "k", "payload": {}, "user": "alice"},
        secret=SECRET,
        token_ttl_ms=1,
        clock=ManualClock(time.time() - 1),
    )
    cases["expired"] = expired.deliveries
    results = {
        name: pubsub.deliver(room, ids[0], lambda c: Attempt(True), SECRET)
        for name, ids in cases.items()
    }
    assert results == {"valid": "DELIVERED", "forged": "DEAD", "expired": "DEAD", "missing": "DEAD"}
    processed = [p.decode() for p in redis_client.lrange("orderly:test:processed", 0, -1)]  # type: ignore[union-attr]
    assert processed == [_corr(room, cases["valid"][0])]  # the refused ones never ran
    with room.connect() as conn:
        reasons: dict[int, str] = dict(
            conn.execute(
                text("SELECT delivery_id, last_error FROM delivery WHERE state = 'DEAD'")
            ).all()
        )
        errors = conn.execute(
            text(
                "SELECT x.type FROM queue_message q JOIN log_exception x ON x.id = q.exception_id"
                " WHERE q.state = 'Error'"
            )
        ).scalars()
        logged = conn.execute(
            text(
                "SELECT routing_key, start_time <= end_time AS ordered, memory_used"
                " FROM queue_message WHERE state = 'Completed'"
            )
        ).one()
    assert "signature" in reasons[cases["forged"][0]]
    assert "expired" in reasons[cases["expired"][0]]
    assert "no token" in reasons[cases["missing"][0]]
    assert list(errors) == ["orderly.worker.core.errors.Unauthorized"] * 3
    # what the consumer itself allocated (tracemalloc's peak), not the process's size
    assert logged.routing_key == "k" and logged.ordered
    assert 0 < logged.memory_used < 10_000_000


def _corr(engine: Engine, delivery_id: int) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text(
                    "SELECT e.correlation_id FROM delivery d JOIN event e USING (event_id)"
                    " WHERE d.delivery_id = :d"
                ),
                {"d": delivery_id},
            ).scalar_one()
        )


def test_a_duplicate_task_does_not_send_before_the_wait(room: Engine) -> None:
    pubsub.create_subscription(
        room, "r", {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
    )
    d = publish(room, {"key": "a", "n": 1})[0]
    seen: list[str] = []
    push = _push({"a1": [False]}, seen)
    assert pubsub.deliver(room, d, push) == "PENDING"  # waits 50 ms x 2^1
    assert pubsub.deliver(room, d, push) == "NOT_CLAIMABLE"  # a second copy of the task
    assert state(room, d) == ("PENDING", 1) and seen == ["a1"]
    wait_until(lambda: retry_due(room, d), timeout=10, what="the retry's wait")
    assert pubsub.deliver(room, d, push) == "DELIVERED"


def test_an_outcome_after_the_claim_was_taken_over_is_dropped(room: Engine) -> None:
    pubsub.create_subscription(
        room, "r", {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
    )
    d = publish(room, {"key": "a", "n": 1})[0]

    def slow_then_fails(c: Claimed) -> Attempt:
        # Meanwhile its claim was released as stuck and another worker delivered it.
        with room.begin() as conn:
            conn.execute(
                text(
                    "UPDATE delivery SET state = 'PENDING', claim = NULL, claimed_at = NULL"
                    " WHERE delivery_id = :d"
                ),
                {"d": d},
            )
        assert pubsub.deliver(room, d, lambda c: Attempt(True)) == "DELIVERED"
        return Attempt(False, "HTTP 503")

    assert pubsub.deliver(room, d, slow_then_fails) == "LOST_CLAIM"
    assert state(room, d) == ("DELIVERED", 0)


def test_a_paused_subscription_receives_nothing_until_resumed(room: Engine) -> None:
    sub = pubsub.create_subscription(
        room, "r", {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
    )["subscription_id"]
    d = publish(room, {"key": "a", "n": 1})[0]
    pubsub.set_subscription_status(room, sub, "PAUSED")
    assert pubsub.deliver(room, d, lambda c: Attempt(True)) == "NOT_CLAIMABLE"
    pubsub.set_subscription_status(room, sub, "ACTIVE")
    assert pubsub.deliver(room, d, lambda c: Attempt(True)) == "DELIVERED"


def test_tokens_for_another_message_or_malformed_are_refused() -> None:
    now = int(time.time() * 1000)
    token = tokens.sign(SECRET, tokens.Claims("alice", None, "corr-1", now + 60_000))
    claims = tokens.verify(SECRET, token, now_ms=now)
    assert claims.correlation_id == "corr-1"  # the consumer compares it with its message
    for bad in ("é.é", "no-dot", token + "x", "." + token.partition(".")[2]):
        with pytest.raises(Unauthorized):
            tokens.verify(SECRET, bad, now_ms=now)


def _claim(conn: Connection, delivery_id: int, age_s: float) -> None:
    """Claim a delivery on this connection, as a worker's batch does, ``age_s`` ago."""
    conn.execute(
        text(
            "UPDATE delivery SET state = 'IN_PROCESS', claim = 'c', claim_pid = pg_backend_pid(),"
            " claimed_at = now() - make_interval(secs => :age) WHERE delivery_id = :d"
        ),
        {"d": delivery_id, "age": age_s},
    )
    conn.commit()


def _died(engine: Engine, delivery_id: int) -> None:
    """A worker claims the delivery and dies: its connection is gone."""
    conn = engine.connect()
    _claim(conn, delivery_id, 2.0)
    conn.invalidate()  # the socket closes, as when the process is killed
    conn.close()


def _lost(engine: Engine, delivery_id: int) -> tuple[str, int, int, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT state, attempt, lost_count, last_error, claim_pid FROM delivery"
                " WHERE delivery_id = :d"
            ),
            {"d": delivery_id},
        ).one()
    assert row.claim_pid is None or row.state == "IN_PROCESS"
    return str(row.state), int(row.attempt), int(row.lost_count), row.last_error


def _unreachable_push(room: Engine) -> None:
    """A push subscription of room r allowing 9 attempts, to an address nothing serves."""
    pubsub.create_subscription(
        room,
        "r",
        {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in", "delivery_attempts": 9},
    )


def test_a_delivery_whose_worker_died_is_released_at_once_and_quarantined_at_the_limit(
    room: Engine,
) -> None:
    _unreachable_push(room)
    (delivery_id,) = publish(room, {})

    def released() -> bool:
        pubsub.upkeep(room, LOST_LIMIT)
        return _lost(room, delivery_id)[0] != "IN_PROCESS"

    for death in range(1, LOST_LIMIT):
        _died(room, delivery_id)
        wait_until(released, timeout=10, what="the dead worker's claim released")
        got = _lost(room, delivery_id)
        assert got[:3] == ("PENDING", death, death)
        assert got[3] is not None and got[3].startswith("E_WORKER_LOST")
    _died(room, delivery_id)
    wait_until(released, timeout=10, what="the last death")
    state_, attempt, lost, error = _lost(room, delivery_id)
    assert (state_, attempt, lost) == ("DEAD", LOST_LIMIT, LOST_LIMIT)
    assert error is not None and error.startswith("E_WORKER_LOST: quarantined")


def _claim_batch(conn: Connection, delivery_ids: list[int]) -> list[int]:
    """Claim deliveries for one batch as a worker does (deliveries_claim, in the caller's
    transaction); the ids claimed."""
    rows = conn.execute(sql("deliveries_claim"), {"ids": delivery_ids, "claim": "batch"})
    return sorted(int(r.delivery_id) for r in rows)


def _died_in_batch(engine: Engine, delivery_ids: list[int]) -> list[int]:
    """A worker claims a batch and dies holding it; what its batch had claimed."""
    conn = engine.connect()
    claimed = _claim_batch(conn, delivery_ids)
    conn.commit()
    conn.execute(
        text("UPDATE delivery SET claimed_at = now() - interval '2 s' WHERE claim = 'batch'")
    )
    conn.commit()
    conn.invalidate()  # the socket closes, as when the process is killed
    conn.close()
    return claimed


def test_a_death_in_a_batch_of_several_counts_against_none_and_isolates_them(
    room: Engine,
) -> None:
    _unreachable_push(room)
    ids = [publish(room, {"n": n})[0] for n in range(3)]

    def released(delivery_ids: list[int]) -> bool:
        pubsub.upkeep(room, LOST_LIMIT)
        return all(_lost(room, d)[0] != "IN_PROCESS" for d in delivery_ids)

    # Deaths in batches of several, more than the limit: none of them is quarantined.
    for death in range(1, LOST_LIMIT + 2):
        if death > 1:  # isolated since the first death: back into one batch for the test
            with room.begin() as conn:
                conn.execute(text("UPDATE delivery SET isolate = false"))
        assert _died_in_batch(room, ids) == ids
        wait_until(lambda: released(ids), timeout=10, what="the dead batch released")
        for delivery_id in ids:
            got = _lost(room, delivery_id)
            assert got[:3] == ("PENDING", death, 0), got
            assert got[3] is not None and "batch of several" in got[3]
    # Each is claimed alone from then on: a batch takes the first, the rest stay due at once.
    with room.connect() as conn:
        assert _claim_batch(conn, ids) == ids[:1]
        left = conn.execute(
            text(
                "SELECT count(*) FROM delivery WHERE delivery_id = ANY(:ids)"
                " AND state = 'PENDING' AND isolate AND scheduled_at <= now()"
            ),
            {"ids": ids[1:]},
        ).scalar_one()
        assert left == 2
        conn.rollback()  # nothing claimed after all
    # Alone, a death counts.
    assert _died_in_batch(room, ids) == ids[:1]
    wait_until(lambda: released(ids[:1]), timeout=10, what="the lone claim released")
    assert _lost(room, ids[0])[:3] == ("PENDING", LOST_LIMIT + 2, 1)


def test_a_live_workers_claim_stays_and_a_stale_one_goes(room: Engine) -> None:
    pubsub.create_subscription(
        room, "r", {"name": "p", "kind": "PUSH", "push_url": "http://127.0.0.1:9/in"}
    )
    (delivery_id,) = publish(room, {})
    with room.connect() as alive:
        _claim(alive, delivery_id, 5.0)  # older than the grace, its worker alive
        pubsub.upkeep(room, LOST_LIMIT)
        assert _lost(room, delivery_id)[:3] == ("IN_PROCESS", 0, 0)
        # Held far past what its batch can take (a hung worker, a reused pid): released, and
        # the try counted (3 sends allowed by the room: the third loss is DEAD).
        for attempt in (1, 2, 3):
            _claim(alive, delivery_id, 3600.0)
            pubsub.upkeep(room, 99)
            assert _lost(room, delivery_id)[:2] == ("DEAD" if attempt == 3 else "PENDING", attempt)


def test_a_handler_subscription_without_a_token_secret_is_refused(room: Engine) -> None:
    body = {"name": "h", "kind": "HANDLER", "handler": "test.record"}
    with pytest.raises(InvalidMessage, match="ORDERLY_TOKEN_SECRET") as caught:
        pubsub.create_subscription(room, "r", body, token_secret="")
    assert caught.value.field == "kind"
    with room.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 0
    assert pubsub.create_subscription(room, "r", body, token_secret=SECRET)["name"] == "h"


def test_a_publish_names_its_destinations_and_routing_chooses_the_rest(room: Engine) -> None:
    def sub(name: str, pattern: str) -> int:
        body = {"name": name, "kind": "PULL", "routing_key_pattern": pattern}
        return int(pubsub.create_subscription(room, "r", body)["subscription_id"])

    matching, named, other = sub("matching", "k"), sub("named", "x.#"), sub("other", "y.#")
    ids = publish(room, {"n": 1}, destinations=["named"])
    with room.connect() as conn:
        got = conn.execute(
            text("SELECT subscription_id FROM delivery WHERE delivery_id = ANY(:ids)"),
            {"ids": ids},
        ).scalars()
        assert sorted(got) == sorted([matching, named])  # not "other": neither named nor chosen
    assert other not in (matching, named)
    # a name that is no active subscription of the room: refused, nothing stored
    pubsub.set_subscription_status(room, other, "PAUSED")
    for wrong in (["nobody"], ["other"]):
        with pytest.raises(InvalidMessage) as refused:
            publish(room, {"n": 2}, destinations=wrong)
        assert refused.value.problems[0][0] == "destinations"
        assert wrong[0] in refused.value.problems[0][1]
    with pytest.raises(InvalidMessage, match="destinations"):
        publish(room, {"n": 3}, destinations=[])
    with room.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event")).scalar_one() == 1
