"""Cancelling a PROCESSING message end to end, with the API and a real worker process: its
handler stops within a second of the cancel, whether it looks at ``ctx.aborted`` (it
returns), sleeps (Aborted raised inside it after the grace) or spins without a time limit;
the cancel is the message's one outcome, and the same worker process goes on with the next
message."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from sqlalchemy import Engine

from tests.abort_handlers import EVENTS
from tests.helpers import message, row, wait_until
from tests.stack import Stack

WAIT_S = 60.0
WITHIN_S = 1.0

# Kinds of handler, and the event each records when it ends on its cancel.
RUNS = (("cooperative", "noticed"), ("sleeping", "stopped"), ("spinning", "stopped"))


def _events(client: redis.Redis) -> list[tuple[str, str, float]]:
    """(event, pid, time) as the handlers recorded them."""
    raw: Any = client.lrange(EVENTS, 0, -1)
    found = []
    for entry in raw:
        kind, pid, at = entry.decode().split(":")
        found.append((kind, pid, float(at)))
    return found


def test_a_cancelled_handler_stops_within_a_second_and_the_worker_goes_on(
    stack: Stack, db: Engine, redis_client: redis.Redis
) -> None:
    # abort.spinning declares no time limit, and no default applies: it runs unlimited.
    stack.env(
        ORDERLY_HANDLER_MODULES="tooling.handlers,tests.abort_handlers",
        ORDERLY_HANDLER_TIME_LIMIT_MS="0",
        ORDERLY_ABORT_GRACE_MS="300",
    )
    stack.start_api(node=None)
    worker = stack.worker("w1", concurrency=1, node=None)
    cancelled = []
    for n, (operation, end) in enumerate(RUNS, start=1):
        redis_client.delete(EVENTS)
        msg_id = stack.submit(message(n, service="abort", operation=operation))
        wait_until(lambda: redis_client.llen(EVENTS) >= 1, WAIT_S, f"{operation} started")
        at = time.time()
        answer = stack.http.post(f"/messages/{msg_id}/cancel", json={"note": "withdrawn"})
        assert answer.status_code == 200, answer.text
        wait_until(lambda: redis_client.llen(EVENTS) >= 2, WAIT_S, f"{operation} ended")
        (start, stopped) = _events(redis_client)
        assert (start[0], stopped[0]) == ("start", end)
        print(f"{operation}: ended {stopped[2] - at:.3f} s after the cancel was sent")
        assert stopped[2] - at < WITHIN_S, f"{operation} ran {stopped[2] - at:.3f} s on"
        cancelled.append((msg_id, start[1]))

    redis_client.delete(EVENTS)
    following = stack.submit(message(9, service="abort", operation="quick", payload=json.dumps({})))
    stack.wait_state(following, "OK", WAIT_S)
    ((done, pid, _),) = _events(redis_client)
    # One pool process did it all: none was killed, none replaced.
    assert done == "done"
    assert {pid} == {run_pid for _, run_pid in cancelled}

    for msg_id, _ in cancelled:
        stored = row(db, msg_id)
        assert stored.state == "CANCEL"
        assert [a["action"] for a in stored.audit] == ["CANCEL"]
        assert (stored.failed_count, stored.failed_error_code, stored.lost_count) == (0, None, 0)
    lines = [f"message {msg_id} aborted by cancel" for msg_id, _ in cancelled]
    wait_until(
        lambda: all(line in worker.log_path.read_text(errors="replace") for line in lines),
        WAIT_S,
        "the aborts logged",
    )
    log = worker.log_path.read_text(errors="replace")
    assert "taken over" not in log
    assert "hard time limit passed" not in log
    assert worker.alive()
