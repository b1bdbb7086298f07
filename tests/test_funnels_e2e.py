"""End to end with two worker processes, beat and the API: funnels, guaranteed order,
external calls, parent/child, responses, confirmations, cancel and re-drive."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from tests.helpers import BASE_TS, message, set_config, wait_until
from tests.push_recorder import Recorder
from tests.stack import Stack


@pytest.fixture
def cluster(stack: Stack, db: Engine) -> Stack:
    set_config(
        db,
        asynch__partlyFailedIntervalSec="0",
        asynch__partlyFailedRepeatTimeSec="1",
        asynch__postponedIntervalSec="1",
        asynch__repairRepeatTimeSec="5",
    )
    stack.start_api()
    return stack


def start(stack: Stack, beat: bool = True) -> None:
    """Two worker processes (one child each) and beat. Each holds only the task it runs: the
    tests watch what a second message does while the first runs, which a task prefetched by
    the busy worker (and waiting there) would never show."""
    stack.workers({"w1": "node-1", "w2": "node-2"}, concurrency=1, prefetch=1)
    if beat:
        stack.beat()


def ts(n: float) -> str:
    return (BASE_TS + timedelta(seconds=n)).isoformat()


def order_log(redis_client: redis.Redis) -> list[str]:
    return [
        v.decode() if isinstance(v, bytes) else v
        for v in redis_client.lrange("orderly:test:order", 0, -1)
    ]


def test_a_funnel_postpones_a_concurrent_message_with_the_same_value(
    cluster: Stack, redis_client: redis.Redis
) -> None:
    # The pool would take b up only after a minute: b can only start at once by its release.
    set_config(cluster.db, asynch__postponedIntervalSec="60")
    start(cluster)
    slow = json.dumps({"sleep": 1.5})
    a = cluster.submit(message(1, operation="ordered", funnel_value="cust-7", payload=slow))
    wait_until(lambda: cluster.get(a)["state"] == "PROCESSING", 30, "a running")
    b = cluster.submit(message(2, operation="ordered", funnel_value="cust-7", payload=slow))
    other = cluster.submit(message(3, operation="ordered", funnel_value="cust-8", payload=slow))
    cluster.wait_state(b, "POSTPONED", timeout=5)
    # another funnel is not held: it runs beside a
    wait_until(lambda: cluster.get(other)["state"] == "PROCESSING", 5, "other funnel running")
    assert cluster.get(a)["state"] == "PROCESSING"
    cluster.wait_state(a, "OK")
    cluster.wait_state(b, "PROCESSING", timeout=1)  # released when a ended, not after a poll
    cluster.wait_state(b, "OK")
    assert order_log(redis_client).index("cust-7:corr-1") < order_log(redis_client).index(
        "cust-7:corr-2"
    )


def test_guaranteed_order_processes_200_shuffled_messages_in_timestamp_order(
    cluster: Stack, redis_client: redis.Redis
) -> None:
    rng = random.Random(5)

    def bodies(funnel: str, count: int, sleep: float, shuffle: bool) -> list[dict[str, Any]]:
        found = [
            message(
                n,
                operation="ordered",
                correlation_id=f"{funnel}-{n:03d}",
                funnel_value=funnel,
                guaranteed_order=True,
                payload=json.dumps({"sleep": sleep}),
            )
            for n in range(count)
        ]
        if shuffle:
            rng.shuffle(found)
        return found

    # All 200 are stored, shuffled, before any worker runs.
    for body in bodies("g", 200, 0.01, shuffle=True):
        cluster.submit(body)
    start(cluster, beat=False)
    wait_until(lambda: len(order_log(redis_client)) > 0, 30, "the funnel started")
    # Other funnels arrive while g is being processed (in order: one that arrives after a
    # newer one of its funnel already ran cannot go before it).
    others = [bodies(f"o{f}", 20, 0.0, shuffle=False) for f in range(3)]
    for n in range(20):
        for funnel in others:
            cluster.submit(funnel[n])
    wait_until(lambda: len(order_log(redis_client)) == 260, 120, "every message processed")
    log = order_log(redis_client)
    g = [entry.split(":", 1)[1] for entry in log if entry.startswith("g:")]
    assert len(g) == 200 and g == sorted(g)  # exactly msg_timestamp order
    for f in range(3):
        mine = [e for e in log if e.startswith(f"o{f}:")]
        assert len(mine) == 20 and mine == sorted(mine)
    first, last = log.index(f"g:{g[0]}"), log.index(f"g:{g[-1]}")
    assert any(not e.startswith("g:") for e in log[first:last]), "other funnels ran meanwhile"

    def open_messages() -> int:
        # The handler logs before its message is finished: the last one may still be PROCESSING.
        with cluster.db.connect() as conn:
            return int(
                conn.execute(text("SELECT count(*) FROM message WHERE state <> 'OK'")).scalar_one()
            )

    wait_until(lambda: open_messages() == 0, 30, "every message OK")


def test_exclude_failed_state_both_ways(cluster: Stack, db: Engine) -> None:
    set_config(
        db, asynch__countPartlyFailsBeforeFailed="0", asynch__postponedIntervalWhenFailedSec="3"
    )
    failing = json.dumps({"fail": True, "sleep": 0.5})
    held = [
        cluster.submit(
            message(
                1, operation="ordered", funnel_value="held", guaranteed_order=True, payload=failing
            )
        ),
        cluster.submit(message(2, operation="ordered", funnel_value="held", guaranteed_order=True)),
    ]
    free = [
        cluster.submit(
            message(
                3,
                operation="ordered",
                funnel_value="free",
                guaranteed_order=True,
                exclude_failed_state=True,
                payload=failing,
            )
        ),
        cluster.submit(
            message(
                4,
                operation="ordered",
                funnel_value="free",
                guaranteed_order=True,
                exclude_failed_state=True,
            )
        ),
    ]
    start(cluster)
    failed = cluster.wait_state(held[0], "FAILED")
    # It stays held for postponedIntervalWhenFailedSec after that failure: POSTPONED when
    # looked at (on a busy machine the look may come later than that; then it moved on
    # no earlier than the interval after the failure).
    second = cluster.get(held[1])
    if second["state"] != "POSTPONED":
        waited = datetime.fromisoformat(second["last_process_timestamp"]) - datetime.fromisoformat(
            failed["last_process_timestamp"]
        )
        assert second["state"] == "FAILED" and waited >= timedelta(seconds=3), second
    cluster.wait_state(free[0], "FAILED")
    cluster.wait_state(free[1], "OK")  # a FAILED message does not hold it
    late = cluster.wait_state(held[1], "FAILED", timeout=20)  # ...until it waited too long
    assert late["failed_error_code"] == "E_POSTPONED_TOO_LONG"


def test_external_calls_skip_older_and_duplicates_and_wait_for_a_busy_key(
    cluster: Stack, redis_client: redis.Redis
) -> None:
    start(cluster)

    def call(n: float, sleep: float = 0.0, cid: str | None = None) -> int:
        payload = json.dumps({"key": "cust-1", "sleep": sleep})
        return cluster.submit(
            message(
                0,
                operation="extcall",
                payload=payload,
                msg_timestamp=ts(n),
                correlation_id=cid or f"call-{n}",
            )
        )

    first = call(1, sleep=1.5)
    wait_until(lambda: cluster.get(first)["state"] == "PROCESSING", 30, "first call running")
    newer = call(2)
    cluster.wait_state(newer, "POSTPONED", timeout=5)  # the key is busy: try later
    assert cluster.wait_state(first, "OK")["custom_data"] == "CALLED"
    assert cluster.wait_state(newer, "OK", timeout=15)["custom_data"] == "CALLED"
    assert cluster.wait_state(call(0.5), "OK")["custom_data"] == "OBSOLETE"
    assert cluster.wait_state(call(2, cid="again"), "OK")["custom_data"] == "DUPLICATE"
    calls = [
        v.decode() if isinstance(v, bytes) else v
        for v in redis_client.lrange("orderly:test:calls", 0, -1)
    ]
    assert calls == ["call-1", "call-2"]


def test_parent_and_children_hard_and_soft_two_levels(cluster: Stack, db: Engine) -> None:
    set_config(db, asynch__countPartlyFailsBeforeFailed="0")
    ok = {"operation": "script", "payload": {}}
    bad = {"operation": "script", "payload": {"fail_times": 9, "code": "E_DEEP"}}
    soft_bad = {**bad, "soft": True}
    tree_ok = {
        "children": [{"operation": "split", "payload": {"children": [ok, ok, soft_bad]}}, ok]
    }
    tree_bad = {"children": [{"operation": "split", "payload": {"children": [ok, bad]}}, ok]}
    good = cluster.submit(message(1, operation="split", payload=json.dumps(tree_ok)))
    failing = cluster.submit(message(2, operation="split", payload=json.dumps(tree_bad)))
    start(cluster)
    done = cluster.wait_state(good, "OK")
    assert len(done["children"]) == 2 and all(c["state"] == "OK" for c in done["children"])
    failed = cluster.wait_state(failing, "FAILED")
    assert failed["failed_error_code"] == "E_DEEP"
    middle = next(c for c in failed["children"] if c["operation_name"] == "split")
    assert middle["state"] == "FAILED"
    with db.connect() as conn:
        soft = conn.execute(
            text("SELECT state FROM message WHERE parent_binding_type = 'SOFT'")
        ).scalar()
    assert soft == "FAILED"  # and its parent still ended OK


def test_a_response_resumes_a_waiting_message_and_a_missing_one_times_out(
    cluster: Stack,
) -> None:
    start(cluster)
    waits = cluster.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "ext-1"}))
    )
    times_out = cluster.submit(
        message(
            2, operation="wait", payload=json.dumps({"correlation_id": "ext-2", "timeout_s": 1})
        )
    )
    cluster.wait_state(waits, "WAITING_FOR_RES")
    bad = cluster.http.post("/messages/responses", json={"payload": {}})
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "correlation_id"
    unknown = {"correlation_id": "x", "payload": "y"}
    assert cluster.http.post("/messages/responses", json=unknown).status_code == 404
    answer = cluster.http.post(
        "/messages/responses", json={"correlation_id": "ext-1", "payload": {"id": 42}}
    )
    assert answer.status_code == 201, answer.text
    assert cluster.wait_state(waits, "OK")["custom_data"] == '{"id":42}'
    expired = cluster.wait_state(times_out, "FAILED", timeout=20)
    assert expired["failed_error_code"] == "E_RESPONSE_TIMEOUT"


def test_confirmations_are_retried_up_to_failed_end(
    cluster: Stack, db: Engine, recorder: Recorder
) -> None:
    set_config(db, asynch__confirmation__failedLimit="3", asynch__confirmation__intervalSec="1")
    put = cluster.http.put("/source-systems/crm", json={"confirmation_url": "mailto:x"})
    assert put.status_code == 422
    put = cluster.http.put(
        "/source-systems/crm", json={"confirmation_url": recorder.base + "/confirm"}
    )
    assert put.status_code == 200, put.text
    recorder.fail["/confirm"] = 100
    msg_id = cluster.submit(message(1))
    start(cluster)  # beat's ticker sends the due confirmations
    cluster.wait_state(msg_id, "OK")

    def confirmation() -> tuple[str, int]:
        with db.connect() as conn:
            found = conn.execute(
                text("SELECT state, failed_count FROM external_call WHERE msg_id = :i"),
                {"i": msg_id},
            ).one()
        return str(found.state), int(found.failed_count)

    wait_until(lambda: confirmation()[0] == "FAILED_END", 30, "FAILED_END")
    assert confirmation() == ("FAILED_END", 3)
    assert len(recorder.arrivals) == 3
    assert all(
        a["body"]["msg_id"] == msg_id and a["body"]["state"] == "OK" for a in recorder.arrivals
    )
    exchanges = cluster.get(msg_id)["exchanges"]
    assert len(exchanges) == 3 and all(e["failed"] for e in exchanges)


def test_cancel_and_redrive_through_the_api_with_audit_notes(cluster: Stack) -> None:
    start(cluster)
    msg_id = cluster.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "ext-9"}))
    )
    cluster.wait_state(msg_id, "WAITING_FOR_RES")
    refused = cluster.http.post(f"/messages/{msg_id}/cancel", json={})
    assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == "note"
    assert cluster.get(msg_id)["state"] == "WAITING_FOR_RES"  # nothing half-done
    done = cluster.http.post(
        f"/messages/{msg_id}/cancel", json={"note": "wrong order", "by": "ann"}
    )
    assert done.status_code == 200 and done.json()["state"] == "CANCEL"
    again = cluster.http.post(f"/messages/{msg_id}/cancel", json={"note": "twice"})
    assert again.status_code == 409
    listed = cluster.http.get("/messages", params={"state": "CANCEL"}).json()
    assert [m["msg_id"] for m in listed] == [msg_id]
    back = cluster.http.post(f"/messages/{msg_id}/redrive", json={"note": "it was right"})
    assert back.status_code == 200, back.text
    cluster.wait_state(msg_id, "WAITING_FOR_RES")
    cluster.http.post("/messages/responses", json={"correlation_id": "ext-9", "payload": "ok"})
    final = cluster.wait_state(msg_id, "OK")
    assert [(a["action"], a["note"]) for a in final["audit"]] == [
        ("CANCEL", "wrong order"),
        ("REDRIVE", "it was right"),
    ]
