"""The figures of GET /metrics and `orderly status`, against the real PostgreSQL and Redis:
worker.observe on a seeded state with exact counts, the exposition, the command, and a
scrape of a real API process while real workers deliver."""

from __future__ import annotations

import functools
import json
import re
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, text

from orderly.api.metrics import FiguresCollector, make_registry
from orderly.models import MessageState, NodeState
from orderly.models.keys import BridgeKeys, TrackKeys
from orderly.models.pubsub import DeliveryState
from orderly.worker import nodes, pubsub
from orderly.worker.celery import AGENTS_QUEUE, DELIVER_QUEUE, PROCESS_QUEUE
from orderly.worker.celery import broker as celery_broker
from orderly.worker.channels import Channel, put_channel
from orderly.worker.conversations import Delivery, Head, SendResult
from orderly.worker.core.clock import now_ms
from orderly.worker.messages.intake import Intake
from orderly.worker.observe import (
    BROKER_PRIORITY_SEP,
    BlockReason,
    ConversationFigures,
    Figures,
    Source,
    broker_figures,
    conversation_figures,
    gather,
    store_figures,
)
from orderly.worker.tracking import Services, Tracker, TrackingPolicy, snapshot
from tests.conftest import TEST_BROKER
from tests.helpers import OrderlyCli, message, wait_until
from tests.stack import Stack
from tooling.processes import wait_for_log
from tooling.sink import Sink

from .push_recorder import Recorder as PushRecorder
from .test_conversations import Harness, Recorder, make

QUEUES = (PROCESS_QUEUE, AGENTS_QUEUE, DELIVER_QUEUE)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(exposition: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def found(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value, 0 when the scrape has no such series (yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def exposition(figures: Figures) -> Samples:
    """What a scrape of these figures shows, through prometheus_client's own text format."""
    return parse(generate_latest(make_registry(lambda: figures)).decode())


def pg_counts(engine: Engine, sql: str) -> dict[str, int]:
    with engine.connect() as conn:
        return {str(k): int(v) for k, v in conn.execute(text(sql)).all()}


# --- PostgreSQL ---------------------------------------------------------------------------


def _submit(intake: Intake, n: int) -> list[int]:
    return [intake.submit(message(i)).msg_id for i in range(n)]


def _set_state(engine: Engine, ids: list[int], state: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE message SET state = :s WHERE msg_id = ANY(:ids)"), {"s": state, "ids": ids}
        )


ROOM = {
    "name": "orders",
    "delivery_delay_ms": 100,
    "delivery_delay_multiplier": 2.0,
    "delivery_attempts": 3,
}


def test_store_figures_count_every_state_and_the_delayed_and_dead_deliveries(
    db: Engine, intake: Intake
) -> None:
    ids = _submit(intake, 8)
    _set_state(db, ids[0:3], "OK")
    _set_state(db, ids[3:5], "FAILED")
    _set_state(db, ids[5:6], "PARTLY_FAILED")
    _set_state(db, ids[6:7], "POSTPONED")  # ids[7] stays NEW
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET receive_timestamp = now() - make_interval(secs => :s)"
                " WHERE msg_id = :id"
            ),
            [{"s": 120, "id": ids[1]}, {"s": 30, "id": ids[2]}],
        )
        # Waiting for their due time: a NEW one scheduled for later and a PARTLY_FAILED one
        # 40 s overdue. An OK row's leftover due time and a POSTPONED one without one are not.
        conn.execute(
            text(
                "UPDATE message SET due_at = now() + make_interval(secs => :s) WHERE msg_id = :id"
            ),
            [{"s": 600, "id": ids[7]}, {"s": -40, "id": ids[5]}, {"s": -90, "id": ids[0]}],
        )

    pubsub.create_room(db, ROOM)
    pubsub.create_subscription(db, "orders", {"name": "s", "kind": "PUSH", "push_url": "http://x/"})
    deliveries = []
    for delay in (600_000, 600_000, 0, 0, 0):
        published, _ = pubsub.publish(
            db, "orders", {"routing_key": "k", "payload": {}, "$delay": delay}
        )
        deliveries += published.deliveries
    with db.begin() as conn:
        conn.execute(
            text("UPDATE delivery SET state = 'DEAD' WHERE delivery_id = :d"), {"d": deliveries[2]}
        )
        conn.execute(
            text("UPDATE delivery SET state = 'DELIVERED' WHERE delivery_id = :d"),
            {"d": deliveries[3]},
        )

    figures = store_figures(db, [ids[1], ids[2], ids[4]])
    assert dict(figures.messages) == {
        **dict.fromkeys(MessageState, 0),
        MessageState.OK: 3,
        MessageState.FAILED: 2,
        MessageState.PARTLY_FAILED: 1,
        MessageState.POSTPONED: 1,
        MessageState.NEW: 1,
    }
    assert dict(figures.deliveries) == {
        **dict.fromkeys(DeliveryState, 0),
        DeliveryState.PENDING: 3,
        DeliveryState.DEAD: 1,
        DeliveryState.DELIVERED: 1,
    }
    assert figures.deliveries_delayed == 2  # the PENDING one due now is not delayed
    assert 120 <= figures.oldest_blocked_head_age_s < 125
    assert store_figures(db).oldest_blocked_head_age_s == 0
    assert dict(figures.due_waiting) == {
        MessageState.NEW: 1,
        MessageState.PARTLY_FAILED: 1,
        MessageState.POSTPONED: 0,
        MessageState.IN_QUEUE: 0,
    }
    assert 40 <= figures.due_lag_s < 45

    samples = exposition(gather(db, _down(), BridgeKeys(), _down(), TrackKeys(), None))
    assert value(samples, "orderly_messages", state="OK") == 3
    assert value(samples, "orderly_messages", state="WAITING") == 0
    assert value(samples, "orderly_deliveries_delayed") == 2
    assert value(samples, "orderly_deliveries_dead_lettered") == 1
    assert value(samples, "orderly_messages_due_waiting", state="PARTLY_FAILED") == 1
    assert value(samples, "orderly_messages_due_waiting", state="IN_QUEUE") == 0
    assert 40 <= value(samples, "orderly_messages_due_lag_seconds") < 45
    assert value(samples, "orderly_source_up", source="postgresql") == 1
    assert value(samples, "orderly_source_up", source="redis") == 0
    assert value(samples, "orderly_source_up", source="tracking") == 0
    # Parts whose source failed are left out, not shown as zeros.
    assert not any(name.startswith("orderly_conversation") for name, _ in samples)
    assert not any(name.startswith("orderly_tracked") for name, _ in samples)
    with db.begin() as conn:  # none overdue any more: no lag, and never a negative one
        conn.execute(
            text("UPDATE message SET due_at = now() + interval '1 minute' WHERE msg_id = :id"),
            {"id": ids[5]},
        )
    assert store_figures(db).due_lag_s == 0


def _down() -> redis.Redis:
    # Refused at once: redis-py's own retries (seconds of backoff) are not what is tested.
    return redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )


# --- conversations ------------------------------------------------------------------------


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    # Waits long enough that nothing a test set up falls due while it looks.
    harness = make(
        db,
        redis_client,
        message_ttl=600_000,
        awaited_message_ttl=900_000,
        sent_message_ttl=600_000,
        awaited_time_when_retries_end=600_000,
    )
    put_channel(db, Channel("slow", "http://127.0.0.1:9/", 300_000, 2.0, 3, 1000))
    put_channel(db, Channel("spent", "http://127.0.0.1:9/", 10, 2.0, 0, 1000))
    yield harness


def _msg_id(engine: Engine, correlation_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT msg_id FROM message WHERE correlation_id = :c"), {"c": correlation_id}
            ).scalar_one()
        )


def test_conversation_figures_tell_each_blocked_head_apart(
    h: Harness, db: Engine, redis_client: redis.Redis
) -> None:
    h.request("c-retry", "r1", origin="slow")
    h.response("c-retry", "r1", "s1a")
    h.response("c-retry", "r1", "s1b")
    h.request("c-awaited", "r2", origin="spent")
    h.response("c-awaited", "r2", "s2a")
    h.response("c-awaited", "r2", "s2b")
    h.request("c-ack", "r3")
    h.response("c-ack", "r3", "s3")
    h.request("c-request", "r4a")  # still waits for its first response
    h.request("c-request", "r4b")
    h.response("c-request", "r4b", "s4")
    h.request("c-done", "r5")
    h.response("c-done", "r5", "s5", last=True)
    sender = Recorder(
        answers={
            "s1a": [SendResult(Delivery.RECOVERABLE, 503, reason="503")],
            "s2a": [SendResult(Delivery.RECOVERABLE, 503, reason="503")],
            "s3": [SendResult(Delivery.ASYNC, 202, async_response_id="ack-3")],
        }
    )
    h.run(sender)
    assert sorted(sender.sent) == ["s1a", "s2a", "s3", "s5"]
    h.request("c-ready", "r6")
    h.response("c-ready", "r6", "s6")  # its drain is started, not run

    figures = conversation_figures(redis_client, BridgeKeys())
    assert figures.blocked == {
        BlockReason.REQUEST: 1,
        BlockReason.RETRY: 1,
        BlockReason.ACK: 1,
        BlockReason.AWAITED: 1,
    }
    assert figures.blocked_total == 4
    assert (figures.open, figures.ready, figures.in_flight) == (5, 1, 0)
    assert figures.awaited == 2  # the whole group of s2a
    assert figures.responses_undelivered == 7  # s5 was delivered
    assert figures.scheduled == 4  # every blocked conversation has its wake-up time
    heads = {_msg_id(db, rid) for rid in ("s1a", "s2a", "s3", "s4")}
    assert set(figures.blocked_head_msg_ids) == heads
    assert figures.oldest_blocked_head_age_s is None  # only PostgreSQL knows the arrival

    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET receive_timestamp = now() - interval '42 seconds'"
                " WHERE correlation_id = 's3' AND source_system = 'bridge.response'"
            )
        )
    gathered = gather(db, redis_client, BridgeKeys(), redis_client, TrackKeys(), None)
    assert gathered.conversations is not None and not gathered.errors
    assert 42 <= (gathered.conversations.oldest_blocked_head_age_s or 0) < 45

    # The same moment seen later: the retry wait and the others are over, nothing is blocked
    # any more by time; the request gate and the ACK still hold their conversations.
    later = conversation_figures(redis_client, BridgeKeys(), now_ms=now_ms() + 3_600_000)
    assert later.blocked == {
        BlockReason.REQUEST: 1,
        BlockReason.RETRY: 0,
        BlockReason.ACK: 1,
        BlockReason.AWAITED: 0,
    }
    assert later.ready == 3


def test_a_head_being_sent_is_in_flight_not_blocked(h: Harness, redis_client: redis.Redis) -> None:
    seen: list[ConversationFigures] = []

    def send(channel: Channel, head: Head) -> SendResult:
        seen.append(conversation_figures(redis_client, BridgeKeys()))
        return SendResult(Delivery.DELIVERED, 200)

    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)
    h.run(send)
    (during,) = seen
    assert (during.open, during.in_flight, during.ready, during.blocked_total) == (1, 1, 0, 0)
    after = conversation_figures(redis_client, BridgeKeys())
    assert (after.open, after.responses_undelivered, after.in_flight) == (0, 0, 0)


# --- tracking, workers, broker ------------------------------------------------------------


def test_tracking_histograms_workers_and_queues_are_exposed_exactly(
    db: Engine, redis_client: redis.Redis
) -> None:
    keys = TrackKeys("metrics-test")
    tracker = Tracker(
        redis_client, keys, TrackingPolicy(timeout_ms=1000, expire_ms=60_000, capacity=3)
    )
    t0 = now_ms()
    first, second, third = (tracker.register(f"m-{i}", now=t0) for i in range(3))
    assert tracker.register("m-over", now=t0) == 0  # over capacity: counted only
    tracker.done(first, now=t0 + 7)  # le 10 ms
    tracker.done(second, now=t0 + 300)  # le 500 ms
    turn = tracker.monitor_turn(now=t0 + 2000)  # the third has timed out after 2 s
    assert turn.done == 2 and [t.track_id for t in turn.timed_out] == [third]
    tracker.count("retry")
    tracker.count("gaveup")

    services = Services(redis_client, keys)
    for node in ("n1", "n1", "n2"):
        services.register({"node_code": node, "pid": 1}, expire_ms=60_000)
    gone = services.register({"node_code": "n3"}, expire_ms=60_000)
    services.stop(gone)

    redis_client.rpush(PROCESS_QUEUE, "a", "b")
    redis_client.rpush(f"{PROCESS_QUEUE}{BROKER_PRIORITY_SEP}6", "c")
    redis_client.rpush(DELIVER_QUEUE, "d")
    redis_client.hset("unacked", mapping={"t1": "x", "t2": "y"})

    figures = gather(
        db,
        redis_client,
        BridgeKeys(),
        redis_client,
        keys,
        functools.partial(broker_figures, redis_client, QUEUES),
    )
    assert not figures.errors
    assert figures.tracking is not None
    assert (figures.tracking.done.count, figures.tracking.done.sum_ms) == (2, 307)
    assert (figures.tracking.timeout.count, figures.tracking.overflow) == (1, 1)
    assert dict(figures.workers_alive or {}) == {"n1": 2, "n2": 1}
    assert figures.broker is not None and figures.broker.unacked == 2
    assert dict(figures.broker.queues) == {PROCESS_QUEUE: 3, AGENTS_QUEUE: 0, DELIVER_QUEUE: 1}

    samples = exposition(figures)
    done = "orderly_tracked_done_duration_seconds"
    assert value(samples, f"{done}_bucket", le="0.005") == 0
    assert value(samples, f"{done}_bucket", le="0.01") == 1
    assert value(samples, f"{done}_bucket", le="0.25") == 1
    assert value(samples, f"{done}_bucket", le="0.5") == 2
    assert value(samples, f"{done}_bucket", le="+Inf") == 2
    assert value(samples, f"{done}_count") == 2
    assert value(samples, f"{done}_sum") == pytest.approx(0.307)
    timeout = "orderly_tracked_timeout_duration_seconds"
    assert value(samples, f"{timeout}_bucket", le="1.0") == 0
    assert value(samples, f"{timeout}_bucket", le="2.5") == 1
    assert value(samples, f"{timeout}_sum") == pytest.approx(2.0)
    assert value(samples, "orderly_tracked_timeouts_total") == 1
    assert value(samples, "orderly_tracked_overflow_total") == 1
    assert value(samples, "orderly_tracked_expired_total") == 0
    assert value(samples, "orderly_timeout_retries_total") == 1
    assert value(samples, "orderly_timeout_failed_total") == 1
    assert value(samples, "orderly_workers_alive", node="n1") == 2
    assert ("orderly_workers_alive", (("node", "n3"),)) not in samples
    assert value(samples, "orderly_queue_depth", queue=PROCESS_QUEUE) == 3
    assert value(samples, "orderly_queue_depth", queue=AGENTS_QUEUE) == 0
    assert value(samples, "orderly_broker_unacked") == 2
    # A collector gathers on every collect: nothing is cached between scrapes.
    calls = Counter[str]()

    def counted() -> Figures:
        calls["gather"] += 1
        return figures

    collector = FiguresCollector(counted)
    assert list(collector.describe()) == [] and calls["gather"] == 0
    list(collector.collect())
    list(collector.collect())
    assert calls["gather"] == 2


# --- orderly status -----------------------------------------------------------------------


def _row(output: str, name: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if cells and cells[0] == name:
            return cells[1:]
    raise AssertionError(f"no row {name!r} in:\n{output}")


def test_status_without_a_live_worker_is_degraded(
    cli: OrderlyCli, db: Engine, redis_client: redis.Redis
) -> None:
    done = cli("status")
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[0] == "degraded: no live worker"
    found = json.loads(cli("status", "--json").stdout)
    assert (found["healthy"], found["problems"]) == (False, ["no live worker"])


def test_status_shows_the_figures_and_names_an_unreachable_source(
    cli: OrderlyCli, db: Engine, redis_client: redis.Redis, intake: Intake
) -> None:
    ids = _submit(intake, 5)
    _set_state(db, ids[:2], "OK")
    _set_state(db, ids[2:3], "FAILED")
    for msg_id in ids[:4]:  # tasks no worker takes: the broker's queue holds them
        celery_broker.enqueue_processing(msg_id)
    Services(redis_client, TrackKeys()).register({"node_code": "status-node"}, expire_ms=60_000)

    done = cli("status")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "healthy"
    assert _row(done.stdout, "OK") == ["2"]
    assert _row(done.stdout, "FAILED") == ["1"]
    assert _row(done.stdout, "NEW") == ["2"]
    assert _row(done.stdout, "CANCEL") == ["0"]
    assert _row(done.stdout, "DEAD") == ["0"]
    assert _row(done.stdout, "blocked") == ["0"]
    assert _row(done.stdout, PROCESS_QUEUE) == ["4"]
    assert _row(done.stdout, "status-node") == ["1"]

    as_json = json.loads(cli("status", "--json").stdout)
    assert as_json["healthy"] is True and as_json["store"]["messages"]["FAILED"] == 1
    assert as_json["workers_alive"] == {"status-node": 1}

    down = cli("status", env={"ORDERLY_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert down.returncode == 2
    assert down.stdout.splitlines()[0].startswith("degraded: redis could not be read")
    assert "redis could not be read" in down.stderr and "Connection refused" in down.stderr
    assert "Traceback" not in down.stderr + down.stdout
    assert _row(down.stdout, "OK") == ["2"]  # PostgreSQL is still shown


# --- a real API process, real workers -----------------------------------------------------

# Waits far longer than the test, so that what it set up stays where it is while it looks.
TIMINGS = {
    "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": "600000",
    "AURA_QUEUE_MANAGER_AWAITED_TIME_WHEN_RETRIES_END": "600000",
    "AURA_QUEUE_MANAGER_MESSAGE_TTL": "600000",
    "AURA_QUEUE_MANAGER_INTERVAL": "50",
}


def _res(client: redis.Redis, response_id: str) -> dict[str, str]:
    # Its hash is in its conversation's shard: found by its id alone.
    found = list(client.scan_iter(match=f"bridge:queue:*:res:{response_id}"))
    raw = client.hgetall(found[0]) if found else {}
    return {_str(k): _str(v) for k, v in raw.items()}


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_scraped_metrics_match_postgresql_and_redis_during_a_workload(
    stack: Stack, db: Engine, redis_client: redis.Redis, recorder: PushRecorder
) -> None:
    stack.env(**TIMINGS)
    stack.start_api()
    worker = stack.worker("w1", concurrency=1)
    http = stack.http

    with Sink() as sink:
        sink.configure(
            rules=[
                {"match": {"conversation_id": "c-retry"}, "status": 503},
                {"match": {"conversation_id": "c-awaited"}, "status": 503},
                {"match": {"conversation_id": "c-ack"}, "status": 202, "never_ack": True},
            ]
        )
        for origin, policy in (
            ("slow", {"delivery_delay_ms": 300_000, "attempts": 3}),
            ("spent", {"delivery_delay_ms": 10, "attempts": 0}),
            ("chat", {}),
        ):
            answer = http.put(f"/channels/{origin}", json={"url": sink.url, **policy})
            assert answer.status_code == 200, answer.text

        def request(cid: str, rid: str, origin: str = "chat") -> None:
            answer = http.post(
                f"/conversations/{cid}/requests", json={"request_id": rid, "origin": origin}
            )
            assert answer.status_code == 201, answer.text

        def respond(cid: str, rid: str, sid: str, last: bool = False) -> None:
            body = {"request_id": rid, "response_id": sid, "payload": {"t": sid}, "last": last}
            answer = http.post(f"/conversations/{cid}/responses", json=body)
            assert answer.status_code == 201, answer.text

        request("c-retry", "r1", "slow")
        respond("c-retry", "r1", "s1a")
        respond("c-retry", "r1", "s1b")
        request("c-awaited", "r2", "spent")
        respond("c-awaited", "r2", "s2a")
        respond("c-awaited", "r2", "s2b")
        request("c-ack", "r3")
        respond("c-ack", "r3", "s3")
        request("c-request", "r4a")
        request("c-request", "r4b")
        respond("c-request", "r4b", "s4")
        request("c-ok", "r5")
        respond("c-ok", "r5", "s5", last=True)

        # Messages: some processed OK, some failing (no beat: they stay PARTLY_FAILED).
        for n in range(5):
            assert http.post("/messages", json=message(n)).status_code == 201
        for n in range(5, 7):
            body = message(n, payload='{"fail_times": 99}')
            assert http.post("/messages", json=body).status_code == 201

        # Publish/subscribe: one delivery delayed far ahead, one dead-lettered.
        assert http.post("/rooms", json=ROOM).status_code == 201
        for name, pattern, extra in (
            ("later", "later", {}),
            ("never", "bad", {"delivery_attempts": 0}),
            ("now", "now", {}),
        ):
            sub = {"name": name, "kind": "PUSH", "push_url": f"{recorder.base}/{name}"}
            answer = http.post(
                "/rooms/orders/subscriptions", json={**sub, "routing_key_pattern": pattern, **extra}
            )
            assert answer.status_code == 201, answer.text
            if name == "never":
                never = str(answer.json()["subscription_id"])
            if name == "now":
                now_sub = str(answer.json()["subscription_id"])
        recorder.fail["/never"] = 1
        for key, delay in (("later", 600_000), ("bad", 0), ("now", 0)):
            body = {"routing_key": key, "payload": {}, "$delay": delay}
            assert http.post("/rooms/orders/events", json=body).status_code == 201

        def settled() -> bool:
            s1a, s2a, s2b, s3 = (_res(redis_client, r) for r in ("s1a", "s2a", "s2b", "s3"))
            with db.connect() as conn:
                busy = conn.execute(
                    text(
                        "SELECT count(*) FROM message WHERE service_name = 'test'"
                        " AND state IN ('NEW', 'IN_QUEUE', 'PROCESSING')"
                    )
                ).scalar_one()
                s5 = conn.execute(
                    text("SELECT state FROM message WHERE correlation_id = 's5'")
                ).scalar_one()
                dead = conn.execute(
                    text("SELECT count(*) FROM delivery WHERE state = 'DEAD'")
                ).scalar_one()
            return (
                s1a.get("attempt") == "1"
                and s2a.get("status") == s2b.get("status") == "AWAITED"
                and s3.get("status") == "SENT"
                and busy == 0
                and s5 == "OK"
                and dead == 1
            )

        wait_until(settled, timeout=60, what="the workload settled")

        # Counted where it happened (the worker, the API: worker.totals) and summed in
        # PostgreSQL within ORDERLY_METRICS_FLUSH_S.
        script = {"service": "test", "operation": "script"}

        sent = "orderly_deliveries_sent_total"

        def counted() -> bool:
            now = parse(http.get("/metrics").text)
            runs = ("orderly_messages_processed_total", "orderly_handler_duration_seconds_count")
            return (
                found(now, runs[0], **script, outcome="OK") == 5
                and found(now, runs[0], **script, outcome="PARTLY_FAILED") == 2
                and found(now, runs[1], **script) == 7
                and found(now, "orderly_deliveries_sent_total", subscription=never, outcome="DEAD")
                == 1
                and found(now, "orderly_conversation_sends_total", channel="chat", outcome="sent")
                == 1
                and found(now, sent, subscription=now_sub, outcome="DELIVERED") == 1
            )

        wait_until(counted, timeout=30, what="the runs, sends and requests counted")
        totals = parse(http.get("/metrics").text)
        assert found(
            totals, "orderly_conversation_sends_total", channel="chat", outcome="delivered"
        )
        assert found(totals, "orderly_conversation_sends_total", channel="slow", outcome="retry")
        # s5 delivered and s3 sent (202): each released once, a while after it came
        release = found(totals, "orderly_conversation_release_seconds_count", channel="chat")
        assert release == 2
        posts = found(totals, "orderly_http_requests_total", method="POST", route="/messages",
                      status="201")  # fmt: skip
        assert posts == 7
        failed = found(totals, "orderly_messages_processed_total", **script, outcome="FAILED")
        assert failed == 0  # retried later (no beat here), not failed for good

        # The worker's node stops: what is submitted now waits, and so does its wake-up task.
        nodes.set_state(db, "worker-node", NodeState.STOPPED)
        wait_for_log(worker, "no longer consuming", timeout=20)
        for n in range(10, 14):
            assert http.post("/messages", json=message(n)).status_code == 201
        Services(redis_client, TrackKeys()).register({"node_code": "metrics-node"}, 60_000)
        tracker = Tracker(redis_client, TrackKeys(), TrackingPolicy())
        t0 = now_ms()
        tracked = [tracker.register(f"e2e-{i}", now=t0) for i in range(3)]
        tracker.done(tracked[0], now=t0 + 40)
        tracker.done(tracked[1], now=t0 + 4000)
        tracker.monitor_turn(now=t0 + 11_000)  # the third timed out

        answer = http.get("/metrics")
        scraped_at = time.time()
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = parse(answer.text)

    # What PostgreSQL and Redis say, read directly.
    states = pg_counts(db, "SELECT state, count(*) FROM message GROUP BY state")
    for state in MessageState:
        assert value(samples, "orderly_messages", state=state.value) == states.get(state.value, 0)
    submitted = pg_counts(
        db, "SELECT state, count(*) FROM message WHERE service_name = 'test' GROUP BY state"
    )
    assert submitted == {"OK": 5, "PARTLY_FAILED": 2, "NEW": 4}
    delayed = pg_counts(
        db, "SELECT 'x', count(*) FROM delivery WHERE state = 'PENDING' AND next_attempt_at > now()"
    )["x"]
    assert value(samples, "orderly_deliveries_delayed") == delayed == 1
    assert value(samples, "orderly_deliveries_dead_lettered") == 1

    assert value(samples, "orderly_conversations_blocked") == 4
    for reason in BlockReason:
        assert value(samples, "orderly_conversations_blocked_by_reason", reason=reason.value) == 1
    awaited = [
        r
        for r in ("s1a", "s1b", "s2a", "s2b", "s3", "s4")
        if _res(redis_client, r).get("status") == "AWAITED"
    ]
    assert value(samples, "orderly_conversation_responses_awaited") == len(awaited) == 2
    pending = sum(redis_client.zcard(shard.pending_messages) for shard in BridgeKeys().every_shard)
    assert value(samples, "orderly_conversation_responses_undelivered") == pending == 6
    with db.connect() as conn:
        arrived = conn.execute(
            text(
                "SELECT extract(epoch FROM min(receive_timestamp)) FROM message"
                " WHERE correlation_id IN ('s1a', 's2a', 's3', 's4')"
                " AND source_system = 'bridge.response'"
            )
        ).scalar_one()
    age = value(samples, "orderly_conversation_oldest_blocked_head_age_seconds")
    assert abs(age - (scraped_at - float(arrived))) < 2.0

    tracking = snapshot(redis_client, TrackKeys())
    done = "orderly_tracked_done_duration_seconds"
    for bound, count in tracking.done.buckets:
        le = "+Inf" if bound == float("inf") else repr(bound / 1000)
        assert value(samples, f"{done}_bucket", le=le) == count
    # The workers track the messages they process too: the test's own are among them.
    assert value(samples, f"{done}_count") == tracking.done.count >= 2
    assert value(samples, f"{done}_sum") == pytest.approx(tracking.done.sum_ms / 1000)
    assert value(samples, "orderly_tracked_timeouts_total") == tracking.timeout.count >= 1
    assert value(samples, "orderly_tracked_overflow_total") == tracking.overflow

    live = Counter(
        s.fields.get("node_code", "") for s in Services(redis_client, TrackKeys()).live()
    )
    for node, count in live.items():
        assert value(samples, "orderly_workers_alive", node=node) == count
    assert live["metrics-node"] == 1

    # The Redis broker's own lists, every priority. (On RabbitMQ, tests/test_broker.py holds
    # the figures to RabbitMQ's own listing; the expectation below holds on both.)
    for queue in QUEUES if TEST_BROKER == "redis" else ():
        depth = sum(
            int(redis_client.llen(f"{queue}{BROKER_PRIORITY_SEP}{p}" if p else queue))
            for p in (0, 3, 6, 9)
        )
        assert value(samples, "orderly_queue_depth", queue=queue) == depth
    # The four submitted while the node was stopped woke one worker: one task waits for them
    # (worker/messages/wake.py), however many messages.
    assert value(samples, "orderly_queue_depth", queue=PROCESS_QUEUE) == 1
    for source in Source:
        assert value(samples, "orderly_source_up", source=source.value) == 1
