"""End to end with real worker processes and beat: a handler that never finishes in time is
timed out by the monitor, retried, then FAILED; the tracking metrics count it; a worker stops
when its service key is deleted or its node is stopped with --exit."""

from __future__ import annotations

import json

import redis
from sqlalchemy import Engine

from orderly.models.keys import TrackKeys
from orderly.worker.tracking import Services, snapshot
from tests.helpers import OrderlyCli, message, row, set_config, wait_until
from tests.stack import Stack

KEYS = TrackKeys("orderly:track")
FAST_TRACKING = {
    "ORDERLY_TRACK_MESSAGE_TIMEOUT_MS": "1000",
    "ORDERLY_TRACK_MESSAGE_EXPIRE_MS": "20000",
    "ORDERLY_TRACK_RETRY_ATTEMPTS": "1",
    "ORDERLY_TRACK_RETRY_DELAY_MS": "200",
    "ORDERLY_TRACK_MONITOR_INTERVAL_MS": "300",
    # No handler time limits: the monitor alone takes a hung message back (a limit would
    # stop the handler first, and its deadline would cover the limit).
    "ORDERLY_HANDLER_TIME_LIMIT_MS": "0",
}


def test_a_hung_handler_is_timed_out_retried_then_failed(
    stack: Stack, db: Engine, redis_client: redis.Redis
) -> None:
    # Repair must not be the one that takes the hung message back.
    set_config(db, asynch__repairRepeatTimeSec="600")
    stack.env(**FAST_TRACKING)
    stack.start_api(node=None)
    worker = stack.worker("w1", concurrency=3, node=None)
    stack.beat(node=None)
    quick = [stack.submit(message(n)) for n in range(1, 4)]
    hung = stack.submit(message(9, payload=json.dumps({"sleep": 2.5})))
    wait_until(lambda: all(row(db, m).state == "OK" for m in quick), 30, "quick ones OK")
    wait_until(lambda: row(db, hung).state == "FAILED", 40, "hung message FAILED")

    got = row(db, hung)
    assert got.failed_error_code == "E_TIMEOUT"
    assert got.failed_count == 2  # the first timeout retried it, the second failed it
    assert "no retries left" in (got.failed_desc or "")
    snap = snapshot(redis_client, KEYS)
    assert snap.timeout.count == 2
    assert snap.timeout.max_ms is not None and snap.timeout.max_ms >= 1000
    assert (snap.retried, snap.gave_up) == (1, 1)
    # The three quick messages were done in time (each is one tracked processing).
    wait_until(lambda: snapshot(redis_client, KEYS).done.count >= 3, 10, "done counted")
    # Each try's worker came back to a message taken from it: its outcome was dropped.
    log = worker.log_path.read_text(errors="replace")
    assert log.count(f"message {hung} was taken over while its handler ran") >= 1


def _services_of(client: redis.Redis, node_code: str) -> list[int]:
    return [
        s.service_id
        for s in Services(client, KEYS).live()
        if s.fields.get("node_code") == node_code
    ]


def test_deleting_a_worker_key_stops_the_worker(
    stack: Stack, cli: OrderlyCli, db: Engine, redis_client: redis.Redis
) -> None:
    w1, w2, w3 = stack.workers({"w1": "node-a", "w2": "node-b", "w3": "node-c"}, concurrency=1)
    wait_until(lambda: len(Services(redis_client, KEYS).live()) == 3, 10, "three service keys")
    [a] = _services_of(redis_client, "node-a")
    fields = {s.service_id: s.fields for s in Services(redis_client, KEYS).live()}
    assert fields[a]["pid"] == str(w1.proc.pid)
    assert fields[a]["node_id"].isdigit()

    done = cli("node", "list")
    assert done.returncode == 0, done.stderr
    listing = done.stdout
    assert "node-a" in listing and "node-b" in listing
    assert f"{a} (" in listing  # the node's live worker is shown beside it

    # An operator deletes one worker's key: that worker (only) shuts down cleanly.
    redis_client.delete(KEYS.service(a))
    w1.proc.wait(timeout=30)
    assert w1.proc.returncode == 0
    log = w1.log_path.read_text(errors="replace")
    assert "is gone: stopping this worker" in log
    assert w2.alive() and w3.alive()

    # `orderly node stop CODE --exit`: STOPPED in the node table and the worker exits.
    done = cli("node", "stop", "node-b", "--exit")
    assert done.returncode == 0, done.stderr
    stopped = done.stdout
    assert "node node-b is STOPPED" in stopped
    w2.proc.wait(timeout=30)
    assert w2.proc.returncode == 0
    assert w3.alive()
    # Both left the set of live services; the third is still there and still renewed.
    wait_until(
        lambda: [s.fields["node_code"] for s in Services(redis_client, KEYS).live()] == ["node-c"],
        10,
        "only node-c alive",
    )
