"""PUSH endpoints as a receiver meets them: sends counted as the seed words them, the
receiver's Retry-After and stop answer honoured, a circuit per endpoint, disabling with an
operational event, and a pace (concurrency, rate) per endpoint. Real PostgreSQL, Redis and
HTTP; the due index and the claim are the product's own."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy import Engine, text

from orderly.api.metrics import families
from orderly.api.status import print_status
from orderly.worker import pubsub
from orderly.worker.core.errors import InvalidMessage, NotFound
from orderly.worker.core.http import HttpOptions, OutboundHttp
from orderly.worker.core.ratelimit import Buckets
from orderly.worker.delivery import HttpSender
from orderly.worker.observe import Figures, store_figures
from orderly.worker.pubsub.endpoints import (
    DISABLED_EVENT,
    SYSTEM_ROOM,
    EndpointPolicy,
    Endpoints,
    enable,
    publish_system_event,
)
from orderly.worker.totals import TALLY
from tests.helpers import LOOPBACK, wait_until
from tests.push_recorder import Recorder

SEND = HttpSender(OutboundHttp(HttpOptions(policy=LOOPBACK)))


def _room(db: Engine, name: str = "r", **policy: Any) -> None:
    body = {"delivery_delay_ms": 100, "delivery_delay_multiplier": 2.0, "delivery_attempts": 10}
    pubsub.create_room(db, {"name": name, **body, **policy})


def _subscribe(db: Engine, recorder: Recorder, path: str, room: str = "r", **extra: Any) -> int:
    body = {"name": path, "kind": "PUSH", "push_url": f"{recorder.base}/{path}", **extra}
    return int(pubsub.create_subscription(db, room, body, policy=LOOPBACK)["subscription_id"])


def _publish(db: Engine, n: int = 1, room: str = "r") -> list[int]:
    """Events published; their deliveries due now left to the due index (as when a hand-off
    to the broker failed), for _drive to take."""
    ids = []
    for i in range(n):
        result, due = pubsub.publish(db, room, {"routing_key": "a", "payload": {"n": i}})
        pubsub.due_deliveries(db, lambda _: None).release(due)
        ids += result.deliveries
    return ids


def _drive(db: Engine, endpoints: Endpoints) -> list[str]:
    """One turn of what beat and a worker do: take the due deliveries (the due index), and
    deliver each handed-off batch."""
    batches: list[list[int]] = []
    due = pubsub.due_deliveries(db, batches.append)
    items = due.take(500)
    if items:
        due.hand_off(items)
    return [
        state
        for batch in batches
        for state in pubsub.deliver_batch(db, batch, SEND.push, "", endpoints=endpoints)
    ]


def _row(db: Engine, table: str, key: str, value: int) -> Any:
    with db.connect() as conn:
        return conn.execute(text(f"SELECT * FROM {table} WHERE {key} = :v"), {"v": value}).one()


def _paths(recorder: Recorder, path: str) -> list[dict[str, Any]]:
    with recorder.lock:
        return [a for a in recorder.arrivals if a["path"] == f"/{path}"]


def test_delivery_attempts_counts_sends(
    db: Engine, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    _room(db, delivery_attempts=2)
    _subscribe(db, recorder, "twice", delivery_delay_ms=1, delivery_delay_multiplier=1.01)
    _subscribe(db, recorder, "once", delivery_attempts=0)
    recorder.down.update({"/twice": 503, "/once": 503})
    twice, once = _publish(db)
    endpoints = Endpoints()

    def settled() -> bool:
        _drive(db, endpoints)
        return bool(_row(db, "delivery", "delivery_id", twice).state == "DEAD")

    wait_until(settled, timeout=20, what="the attempts spent")
    assert [a["attempt"] for a in _paths(recorder, "twice")] == ["1", "2"]  # two sends
    # one line per failed send: a warning while it is sent again, an error when it is dead
    said = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "orderly.worker.pubsub.delivery" and f"delivery {twice} " in r.getMessage()
    ]
    assert [level for level, _ in said] == ["WARNING", "ERROR"], said
    assert "failed, send 1: HTTP 503" in said[0][1] and "is DEAD after send 2" in said[1][1]
    assert "attempts spent: 2 sends" in _row(db, "delivery", "delivery_id", twice).last_error
    assert _row(db, "delivery", "delivery_id", once).state == "DEAD"
    assert len(_paths(recorder, "once")) == 1  # 0: no redelivery


def test_retry_after_sets_the_next_attempt_and_only_on_429_and_503(
    db: Engine, recorder: Recorder
) -> None:
    _room(db)
    for path in ("seconds", "date", "ignored"):
        _subscribe(db, recorder, path)
    at = format_datetime(datetime.now(UTC) + timedelta(seconds=20), usegmt=True)
    recorder.answers.update(
        {
            "/seconds": [(429, {"Retry-After": "30"})],
            "/date": [(503, {"Retry-After": at})],
            "/ignored": [(500, {"Retry-After": "30"})],  # not a 429 or 503: the policy's wait
        }
    )
    by_path = dict(zip(("seconds", "date", "ignored"), _publish(db), strict=True))
    assert _drive(db, Endpoints()) == ["PENDING"] * 3
    waits = {}
    for path, delivery_id in by_path.items():
        with db.connect() as conn:
            waits[path] = conn.execute(
                text(
                    "SELECT next_delay_ms FROM published_messages"
                    " WHERE delivery_id = :d AND attempt = 0"
                ),
                {"d": delivery_id},
            ).scalar_one()
    assert waits["seconds"] == 30_000
    assert 18_000 <= waits["date"] <= 20_000
    assert waits["ignored"] == 200  # 100 ms * 2 ^ 1
    row = _row(db, "delivery", "delivery_id", by_path["seconds"])
    assert row.next_attempt_at - datetime.now(UTC) > timedelta(seconds=25)


def test_a_receiver_stops_the_retries_of_one_delivery(db: Engine, recorder: Recorder) -> None:
    _room(db)
    sub = _subscribe(db, recorder, "stop")
    recorder.answers["/stop"] = [(422, {"X-Orderly-Retry": "stop"})]
    (delivery_id,) = _publish(db)
    assert _drive(db, Endpoints()) == ["DEAD"]
    row = _row(db, "delivery", "delivery_id", delivery_id)
    assert row.last_error.startswith("the receiver stopped its retries: HTTP 422")
    # an answer, not a failing endpoint
    assert _row(db, "subscription", "subscription_id", sub).failures == 0
    _publish(db)
    assert _drive(db, Endpoints()) == ["DELIVERED"]
    assert len(_paths(recorder, "stop")) == 2


def test_a_down_endpoint_gets_one_probe_per_interval_and_drains_in_order_when_back(
    db: Engine, recorder: Recorder
) -> None:
    _room(db, delivery_delay_ms=300, delivery_attempts=100)
    sub = _subscribe(db, recorder, "down")
    healthy = _subscribe(db, recorder, "healthy")
    recorder.down["/down"] = 503
    endpoints = Endpoints(EndpointPolicy(circuit_failures=2, probe_max_ms=60_000))
    ids = _publish(db, 6)
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        _drive(db, endpoints)
        time.sleep(0.02)
    sent = _paths(recorder, "down")
    # two failures in a row open the circuit; then one probe at 300 * 2 ^ n ms: 600 ms, then
    # 1.2 s (with the machine's slowness, never more than these)
    assert 3 <= len(sent) <= 4, [a["t"] - started for a in sent]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(sent[1:])]
    assert all(gap >= 0.6 for gap in gaps), gaps
    assert _row(db, "subscription", "subscription_id", sub).probe_at is not None
    # the healthy endpoint of the same room went on at full speed
    assert len(_paths(recorder, "healthy")) == 6
    assert {pubsub.list_subscriptions(db, "r")[0]["circuit"]} == {"OPEN"}
    del recorder.down["/down"]

    def drained() -> bool:
        _drive(db, endpoints)
        with db.connect() as conn:
            done = conn.execute(
                text(
                    "SELECT count(*) FROM delivery"
                    " WHERE subscription_id = :s AND state = 'DELIVERED'"
                ),
                {"s": sub},
            ).scalar_one()
        return int(done) == 6

    wait_until(drained, timeout=30, what="the backlog drained")
    delivered = [a["body"]["payload"]["n"] for a in _paths(recorder, "down")][len(sent) :]
    assert delivered[1:] == sorted(delivered[1:])  # after the probe, in publish order
    row = _row(db, "subscription", "subscription_id", sub)
    assert (row.failures, row.probe_at, row.failing_since) == (0, None, None)
    assert healthy and ids


def test_an_endpoint_failing_too_long_is_disabled_announced_and_enabled(
    db: Engine, recorder: Recorder
) -> None:
    _room(db, delivery_delay_ms=50, delivery_attempts=100)
    pubsub.create_room(db, {"name": SYSTEM_ROOM})
    ops = pubsub.create_subscription(db, SYSTEM_ROOM, {"name": "ops", "kind": "PULL"})
    sub = _subscribe(db, recorder, "gone")
    recorder.down["/gone"] = 502
    handed: list[int] = []
    endpoints = Endpoints(
        EndpointPolicy(circuit_failures=1, probe_max_ms=100, disable_after_s=0.5),
        announce=lambda _room, key, payload: publish_system_event(db, key, payload, handed.extend),
    )
    (first,) = _publish(db)

    def disabled() -> bool:
        _drive(db, endpoints)
        return _row(db, "subscription", "subscription_id", sub).disabled_at is not None

    wait_until(disabled, timeout=20, what="the endpoint disabled")
    row = _row(db, "subscription", "subscription_id", sub)
    assert "failing since" in row.disabled_reason and "HTTP 502" in row.disabled_reason
    [event] = pubsub.pull(db, ops["subscription_id"], 10)
    assert event["routing_key"] == DISABLED_EVENT
    assert event["payload"]["subscription_id"] == sub and event["payload"]["room"] == "r"
    listed = {s["name"]: s for s in pubsub.list_subscriptions(db, "r")}
    assert listed["gone"]["circuit"] == "DISABLED"
    # its deliveries wait a day (or until it is enabled), and beat can still tell when the
    # next due one is
    assert pubsub.due_deliveries(db, handed.extend).due_in_ms() is not None
    # what /metrics and `orderly status` show
    figures = Figures(store_figures(db), None, None, None, None)
    assert figures.store is not None
    assert figures.store.endpoints == {"FAILING": 0, "OPEN": 0, "DISABLED": 1}
    [unwell] = [m for m in families(figures) if m.name == "orderly_endpoints_unwell"]
    assert {s.labels["circuit"]: s.value for s in unwell.samples}["DISABLED"] == 1
    shown = Console(record=True, width=200)
    print_status(figures, shown)
    assert "PUSH endpoints DISABLED │ 1" in shown.export_text()
    # nothing goes to a disabled endpoint, even when it is back
    del recorder.down["/gone"]
    seen = len(_paths(recorder, "gone"))
    (second,) = _publish(db)
    for _ in range(3):
        _drive(db, endpoints)
    assert len(_paths(recorder, "gone")) == seen
    with pytest.raises(NotFound):
        enable(db, sub, owned=[sub + 1000])  # another's subscription: not found
    enable(db, sub)

    def delivered() -> bool:
        _drive(db, endpoints)
        states = {_row(db, "delivery", "delivery_id", d).state for d in (first, second)}
        return states == {"DELIVERED"}

    wait_until(delivered, timeout=20, what="delivered after enabling")
    assert pubsub.list_subscriptions(db, "r")[0]["circuit"] == "CLOSED"


def test_max_in_flight_holds_an_endpoints_concurrent_sends(db: Engine, recorder: Recorder) -> None:
    _room(db)
    _subscribe(db, recorder, "one", max_in_flight=1)
    _subscribe(db, recorder, "many")
    recorder.slow.update({"/one": 1.0, "/many": 1.0})
    ids = _publish(db, 2)  # each to both
    endpoints = Endpoints()
    # four workers at once, one delivery each
    threads = [
        threading.Thread(
            target=pubsub.deliver_batch,
            args=(db, [delivery_id], SEND.push, ""),
            kwargs={"endpoints": endpoints},
        )
        for delivery_id in ids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert recorder.most_at_once["/one"] == 1
    assert recorder.most_at_once["/many"] == 2

    def all_delivered() -> bool:
        _drive(db, endpoints)
        return {_row(db, "delivery", "delivery_id", d).state for d in ids} == {"DELIVERED"}

    wait_until(all_delivered, timeout=20, what="the held-back send")


def test_an_endpoint_rate_paces_its_sends_through_the_one_limiter(
    db: Engine, recorder: Recorder, redis_client: redis.Redis
) -> None:
    _room(db)
    _subscribe(db, recorder, "paced", rate_per_s=5.0, burst=1)
    _subscribe(db, recorder, "free")
    ids = _publish(db, 10)
    endpoints = Endpoints(buckets=Buckets(redis_client))

    def delivered() -> bool:
        _drive(db, endpoints)
        return {_row(db, "delivery", "delivery_id", d).state for d in ids} == {"DELIVERED"}

    wait_until(delivered, timeout=30, what="every delivery")
    paced = [a["t"] for a in _paths(recorder, "paced")]
    free = [a["t"] for a in _paths(recorder, "free")]
    assert len(paced) == len(free) == 10
    # 5 a second with a bucket of 1: the i-th send no sooner than i / 5 s after the first
    assert all(t - paced[0] >= i / 5 - 0.02 for i, t in enumerate(paced)), paced
    assert free[-1] - free[0] < paced[-1] - paced[0]


def test_a_pace_is_checked_when_defined(db: Engine, recorder: Recorder) -> None:
    _room(db)
    url = f"{recorder.base}/x"
    for body, field in (
        ({"burst": 3}, "burst"),
        ({"rate_per_s": 0}, "rate_per_s"),
        ({"max_in_flight": 0}, "max_in_flight"),
    ):
        with pytest.raises(InvalidMessage) as refused:
            pubsub.create_subscription(
                db, "r", {"name": "p", "kind": "PUSH", "push_url": url, **body}, policy=LOOPBACK
            )
        assert refused.value.problems[0][0] == field
    with pytest.raises(InvalidMessage, match="own pace"):
        pubsub.create_subscription(db, "r", {"name": "q", "kind": "PULL", "rate_per_s": 2.0})
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM subscription")).scalar_one() == 0
    sub = _subscribe(db, recorder, "p", rate_per_s=2.5)
    assert _row(db, "subscription", "subscription_id", sub).burst == 3  # the rate, rounded up
    changed = pubsub.update_subscription(db, sub, {"rate_per_s": None}, policy=LOOPBACK)
    assert (changed["rate_per_s"], changed["burst"]) == (None, None)


def test_a_pull_waits_for_a_publish_and_holds_no_database_connection(
    db: Engine, client: TestClient
) -> None:
    assert client.post("/rooms", json={"name": "w"}).status_code == 201
    made = client.post("/rooms/w/subscriptions", json={"name": "q", "kind": "PULL"})
    sub = made.json()["subscription_id"]
    # only a Redis notice can wake it: its own looks come every 30 s here
    client.app.state.runtime.pull_waiters.recheck_s = 30.0  # type: ignore[attr-defined]
    TALLY.detach()  # no metrics write in flight when the backends are counted
    empty = time.monotonic()
    assert client.get(f"/subscriptions/{sub}/messages", params={"wait_ms": 300}).json() == []
    assert time.monotonic() - empty >= 0.3
    backends: list[int] = []

    def publish_later() -> None:
        time.sleep(0.5)
        with db.connect() as conn:  # the waiting pull's connections: none in a query
            backends.append(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND state = 'active' AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
            )
        client.post("/rooms/w/events", json={"routing_key": "a", "payload": {"n": 1}})

    later = threading.Thread(target=publish_later)
    asked = time.monotonic()
    later.start()
    got = client.get(f"/subscriptions/{sub}/messages", params={"wait_ms": 20_000}).json()
    took = time.monotonic() - asked
    later.join()
    assert [m["payload"] for m in got] == [{"n": 1}]
    assert 0.5 <= took < 15, took  # woken by the publish, not by its 30 s look
    assert backends == [0]
    too_long = client.get(f"/subscriptions/{sub}/messages", params={"wait_ms": 20_001})
    assert too_long.status_code == 422 and "wait_ms" in too_long.text


def test_a_pulled_messages_visibility_is_extended_with_its_receipt(
    db: Engine, client: TestClient
) -> None:
    assert client.post("/rooms", json={"name": "v"}).status_code == 201
    body = {"name": "q", "kind": "PULL", "visibility_timeout_ms": 200}
    sub = client.post("/rooms/v/subscriptions", json=body).json()["subscription_id"]
    client.post("/rooms/v/events", json={"routing_key": "a", "payload": {}})
    [taken] = client.get(f"/subscriptions/{sub}/messages").json()
    path = f"/subscriptions/{sub}/messages/{taken['delivery_id']}/visibility"
    wrong = client.post(path, json={"receipt": "other", "visibility_timeout_ms": 60_000})
    assert wrong.status_code == 404
    moved = client.post(path, json={"receipt": taken["receipt"], "visibility_timeout_ms": 60_000})
    assert moved.status_code == 200, moved.text
    time.sleep(0.4)  # past the subscription's 200 ms
    pubsub.upkeep(db, 3)
    assert _row(db, "delivery", "delivery_id", taken["delivery_id"]).state == "IN_PROCESS"
    assert client.get(f"/subscriptions/{sub}/messages").json() == []  # still invisible
    # 0: back at once
    back = {"receipt": taken["receipt"], "visibility_timeout_ms": 0}
    assert client.post(path, json=back).status_code == 200
    pubsub.upkeep(db, 3)
    [again] = client.get(f"/subscriptions/{sub}/messages").json()
    assert again["delivery_id"] == taken["delivery_id"] and again["attempt"] == 1
    bad = client.post(path, json={"receipt": again["receipt"], "visibility_timeout_ms": -1})
    assert bad.status_code == 422 and "visibility_timeout_ms" in bad.text


@pytest.fixture
def pulls_never_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDERLY_PULL_MAX_WAIT_MS", "0")


def test_the_longest_wait_is_a_setting(pulls_never_wait: None, client: TestClient) -> None:
    assert client.post("/rooms", json={"name": "w"}).status_code == 201
    sub = client.post("/rooms/w/subscriptions", json={"name": "q", "kind": "PULL"}).json()
    asked = time.monotonic()
    answer = client.get(
        f"/subscriptions/{sub['subscription_id']}/messages", params={"wait_ms": 10_000}
    )
    assert answer.json() == [] and time.monotonic() - asked < 5  # not the 10 s asked for


def test_a_probe_spends_no_messages_last_chance(db: Engine, recorder: Recorder) -> None:
    _room(db, delivery_delay_ms=200, delivery_attempts=1)  # one send each, no retry
    sub = _subscribe(db, recorder, "down")
    recorder.down["/down"] = 503
    endpoints = Endpoints(EndpointPolicy(circuit_failures=2, probe_max_ms=60_000))
    ids = _publish(db, 4)

    def probed() -> bool:
        _drive(db, endpoints)
        return len(_paths(recorder, "down")) >= 4  # the two that opened it, two probes

    wait_until(probed, timeout=30, what="two probes")
    states = [_row(db, "delivery", "delivery_id", d).state for d in ids]
    # the two sends before the circuit opened were their messages' only ones; the probes were
    # the endpoint's and left their messages waiting
    assert states[:2] == ["DEAD", "DEAD"] and set(states[2:]) == {"PENDING"}, states
    del recorder.down["/down"]

    def delivered() -> bool:
        _drive(db, endpoints)
        return {_row(db, "delivery", "delivery_id", d).state for d in ids[2:]} == {"DELIVERED"}

    wait_until(delivered, timeout=30, what="the waiting ones delivered")
    assert _row(db, "subscription", "subscription_id", sub).failures == 0
