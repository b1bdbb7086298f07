"""Handler time limits end to end, with real worker processes and beat: a handler past its
limit is stopped, never run twice at once, and failed with E_TIME_LIMIT; one that ignores its
soft limit is killed by the hard limit, and the message is quarantined as a worker killer."""

from __future__ import annotations

import json

import pytest
import redis
from sqlalchemy import Engine

from orderly.worker.runtime import get_runtime
from tests.helpers import message, row, set_config, wait_until
from tests.stack import Stack

EVENTS = "orderly:test:limited"

# A tracking timeout shorter than the handler's limit: the monitor must still leave a handler
# within its limit alone (its deadline is the limit, the kill grace and a margin).
LIMITED = {
    "ORDERLY_TRACK_MESSAGE_TIMEOUT_MS": "800",
    "ORDERLY_TRACK_MESSAGE_EXPIRE_MS": "20000",
    "ORDERLY_TRACK_MONITOR_INTERVAL_MS": "300",
    "ORDERLY_HANDLER_KILL_GRACE_MS": "1500",
}


@pytest.fixture
def stack(stack: Stack, db: Engine) -> Stack:
    set_config(
        db,
        asynch__partlyFailedIntervalSec="0",
        asynch__partlyFailedRepeatTimeSec="1",
        asynch__repairRepeatTimeSec="600",  # repair must not be what ends a hung message
        asynch__countPartlyFailsBeforeFailed="1",
    )
    return stack


def _events(client: redis.Redis) -> list[tuple[str, str]]:
    raw: list[bytes] = client.lrange(EVENTS, 0, -1)  # type: ignore[assignment]
    return [tuple(e.decode().split(":", 1)) for e in raw]  # type: ignore[misc]


def _one_run_at_a_time(events: list[tuple[str, str]], ends: set[str]) -> list[str]:
    """The pids of the runs, checking each ended (``ends``) before the next started."""
    pids, running = [], None
    for kind, pid in events:
        if kind == "start":
            assert running is None, f"a run started while {running} still ran: {events}"
            running = pid
            pids.append(pid)
        else:
            assert (kind in ends, pid) == (True, running), events
            running = None
    return pids


def test_a_handler_past_its_limit_is_stopped_and_never_runs_twice_at_once(
    stack: Stack, db: Engine, redis_client: redis.Redis
) -> None:
    stack.env(**LIMITED, ORDERLY_HANDLER_TIME_LIMIT_MS="1500")
    stack.start_api(node=None)
    stack.worker("w1", concurrency=2, node=None)
    stack.beat(node=None)
    quick_spec = {"sleep": 0.1, "key": "orderly:test:quick"}
    quick = stack.submit(message(1, operation="limited", payload=json.dumps(quick_spec)))
    hung = stack.submit(message(2, operation="limited", payload=json.dumps({"sleep": 60})))
    stack.wait_state(quick, "OK")
    wait_until(lambda: row(db, hung).state == "FAILED", 60, "the hung message FAILED")

    got = row(db, hung)
    assert got.failed_error_code == "E_TIME_LIMIT"
    assert "ran past its time limit of 1.5 s" in (got.failed_desc or "")
    # Two tries (countPartlyFailsBeforeFailed 1), each stopped by its limit, none taken back
    # by the timeout monitor while it ran, none killed.
    assert (got.failed_count, got.timeout_count, got.lost_count) == (2, 0, 0)
    runs = _one_run_at_a_time(_events(redis_client), {"stopped"})
    assert len(runs) == 2
    quick_events: list[bytes] = redis_client.lrange("orderly:test:quick", 0, -1)  # type: ignore[assignment]
    assert [e.split(b":")[0] for e in quick_events] == [b"start", b"end"]


def test_a_handler_that_ignores_its_soft_limit_is_killed_and_then_quarantined(
    stack: Stack, db: Engine, redis_client: redis.Redis
) -> None:
    stack.env(**LIMITED, ORDERLY_HANDLER_TIME_LIMIT_MS="500")
    stack.start_api(node=None)
    worker = stack.worker("w1", concurrency=2, node=None)
    stack.beat(node=None)
    stubborn = stack.submit(message(1, operation="stubborn", payload=json.dumps({"sleep": 60})))
    wait_until(lambda: row(db, stubborn).state == "FAILED", 90, "the stubborn message FAILED")

    got = row(db, stubborn)
    limit = get_runtime().settings.worker_lost_limit
    assert got.failed_error_code == "E_WORKER_LOST"
    assert (got.lost_count, got.timeout_count) == (limit, 0)
    # Each run ignored the soft limit and was killed before the next one started.
    events = _events(redis_client)
    runs = _one_run_at_a_time(events, {"ignored"})
    assert len(runs) == limit
    assert len(set(runs)) == limit  # each in a new pool child: the killed ones are gone
    wait_until(
        lambda: (
            worker.log_path.read_text(errors="replace").count("hard time limit passed") >= limit
        ),
        30,
        "the kills logged",
    )
    assert worker.alive()
