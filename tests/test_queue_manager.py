"""The seed's queue-manager settings, each changing what is measured:

- AURA_QUEUE_MANAGER_CONCURRENT: the tasks a worker runs at once, measured as the most
  handlers that overlap;
- AURA_QUEUE_MANAGER_CONCURRENT_FACTOR: CONCURRENT * FACTOR tasks held by a worker, measured
  as what it took off the broker queue and what ``celery inspect`` shows active and reserved;
- AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL: beat's wait after a turn that found nothing due,
  measured as the polls of its ticker over a clock of the test's own.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from sqlalchemy import Engine

import tests.gated_handlers  # noqa: F401  (the gate.hold handler, known to intake here)
from orderly.beat.scheduler import ConfiguredScheduler, next_wait, until_due
from orderly.models import NodeState
from orderly.worker.celery import PROCESS_QUEUE, app, enqueue_processing
from orderly.worker.core.due import Ticker
from orderly.worker.core.scripts import as_text
from orderly.worker.messages.intake import Intake
from orderly.worker.settings import Settings
from tests.helpers import ManualClock, message, queued, row, wait_until
from tests.stack import START_TIMEOUT_S
from tooling.processes import ROOT, ProcessGroup, wait_for_log

# --- beat's idle check, over the test's clock -------------------------------------------------


class CountedSource:
    """A due source that counts the scheduler's looks; ``due`` items each time while busy,
    and one item more when the test's clock reaches ``later_at`` (it waits till then)."""

    name = "counted"
    batch = 100

    def __init__(self, due: int, clock: ManualClock, later_at: float | None = None) -> None:
        self.due = due
        self.clock = clock
        self.later_at = later_at
        self.takes = 0
        self.handed: list[Any] = []
        self.handed_at: list[float] = []

    def take(self, limit: int) -> list[Any]:
        self.takes += 1
        items: list[Any] = list(range(self.due))
        if self.later_at is not None and self.clock.monotonic() >= self.later_at - 1e-9:
            items.append("later")
            self.handed_at.append(self.clock.monotonic())
            self.later_at = None
        return items

    def due_in_ms(self) -> float | None:
        if self.later_at is None:
            return None
        return (self.later_at - self.clock.monotonic()) * 1000

    def hand_off(self, items: list[Any]) -> None:
        self.handed.extend(items)

    def settle(self, items: list[Any]) -> None:
        pass

    def release(self, items: list[Any]) -> None:
        pass


class Running:
    def follow(self) -> NodeState:
        return NodeState.RUN


def polls_in(
    seconds: float, *, interval_ms: int, check_ms: int, due: int, later_s: float | None = None
) -> CountedSource:
    """Beat's scheduler looking for due work for ``seconds`` of the test's clock, as its loop
    does: tick, then wait what the tick returned. The source counts its looks."""
    clock = ManualClock()
    later_at = None if later_s is None else clock.monotonic() + later_s
    source = CountedSource(due, clock, later_at)
    scheduler = ConfiguredScheduler(app=app, lazy=True)
    scheduler.due = Ticker([source], clock=clock)
    scheduler.node = Running()  # type: ignore[assignment]
    scheduler.interval_s = interval_ms / 1000
    scheduler.idle_s = check_ms / 1000
    end = clock.monotonic() + seconds
    while clock.monotonic() < end - 1e-9:
        clock.advance(scheduler.tick())
    source.handed_at = [t - (end - seconds) for t in source.handed_at]
    return source


def test_an_idle_beat_looks_every_check_queue_interval_and_a_busy_one_every_interval() -> None:
    assert polls_in(10, interval_ms=200, check_ms=1000, due=0).takes == 10
    assert polls_in(10, interval_ms=200, check_ms=500, due=0).takes == 20
    assert polls_in(10, interval_ms=200, check_ms=2000, due=0).takes == 5
    # While there is due work, INTERVAL: CHECK_QUEUE_INTERVAL changes nothing then.
    assert polls_in(10, interval_ms=200, check_ms=1000, due=3).takes == 50
    assert polls_in(10, interval_ms=200, check_ms=5000, due=3).takes == 50


@pytest.mark.parametrize(("later_s", "handed_at"), [(0.45, 0.45), (0.05, 0.05)])
def test_an_idle_beat_looks_again_when_a_waiting_item_is_due(
    later_s: float, handed_at: float
) -> None:
    """Nothing due, but a retry waits: beat looks again when it is due (not a whole
    CHECK_QUEUE_INTERVAL, nor even an INTERVAL, later)."""
    source = polls_in(3, interval_ms=200, check_ms=1000, due=0, later_s=later_s)
    assert source.handed_at == pytest.approx([handed_at])
    # looks: at 0, when the item is due, one INTERVAL later (that turn was busy), then every
    # CHECK_QUEUE_INTERVAL (nothing waits any more) till the 3 s are over
    idle_looks = [t for t in (handed_at + 0.2 + n for n in range(3)) if t < 3]
    assert source.takes == 2 + len(idle_looks)


def test_a_failing_source_is_looked_at_again_after_interval() -> None:
    assert next_wait({}, 1, 0.2, 1.0) == 0.2  # the source failed: no answer
    assert next_wait({"a": 0}, 1, 0.2, 1.0) == 1.0
    assert next_wait({"a": 0, "b": 2}, 2, 0.2, 1.0) == 0.2
    assert until_due(None, 1.0, 0.2) == 1.0
    assert until_due(0.5, 1.0, 0.2) == 0.5
    assert until_due(0.03, 1.0, 0.2) == 0.03  # a retry due in 30 ms: no 200 ms turn late
    assert until_due(0.03, 0.2, 0.2) == 0.03  # busy too
    assert until_due(0.0001, 0.2, 0.2) == 0.005  # never a spin
    assert until_due(-0.001, 0.2, 0.2) == 0.02  # fell due while the turn ran: soon
    assert until_due(-3.0, 1.0, 0.2, failed=True) == 0.2  # a failing source: INTERVAL
    assert until_due(7.0, 1.0, 0.2) == 1.0


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"AURA_QUEUE_MANAGER_CONCURRENT": "0"}, "greater than or equal to 1"),
        ({"AURA_QUEUE_MANAGER_CONCURRENT": "1001"}, "less than or equal to 1000"),
        ({"AURA_QUEUE_MANAGER_CONCURRENT": "lots"}, "AURA_QUEUE_MANAGER_CONCURRENT"),
        ({"AURA_QUEUE_MANAGER_CONCURRENT_FACTOR": "0"}, "AURA_QUEUE_MANAGER_CONCURRENT_FACTOR"),
        ({"AURA_QUEUE_MANAGER_CONCURRENT_FACTOR": "1.5"}, "AURA_QUEUE_MANAGER_CONCURRENT_FACTOR"),
        ({"AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL": "0"}, "CHECK_QUEUE_INTERVAL"),
        ({"AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL": "100"}, "may not be shorter"),
    ],
)
def test_bad_queue_manager_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    monkeypatch.delenv("AURA_QUEUE_MANAGER_INTERVAL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        Settings()
    assert needle in str(info.value)


# --- a real worker's concurrency and prefetch ---------------------------------------------------


def most_at_once(events: list[str]) -> int:
    """The most handlers running together, from their start/end records in order."""
    running = most = 0
    for event in events:
        running += 1 if event.startswith("start:") else -1
        most = max(most, running)
    return most


def inspect(hostname: str) -> tuple[int, int]:
    """The tasks a worker runs now and those it holds besides (celery inspect)."""
    probe = app.control.inspect(destination=[hostname], timeout=10)
    active, reserved = probe.active() or {}, probe.reserved() or {}
    return len(active.get(hostname, [])), len(reserved.get(hostname, []))


@pytest.mark.parametrize(("concurrent", "factor"), [(1, 2), (3, 2), (1, 3), (25, 1)])
def test_concurrent_runs_that_many_at_once_and_the_factor_bounds_what_a_worker_holds(
    procs: ProcessGroup,
    db: Engine,
    redis_client: redis.Redis,
    intake: Intake,
    concurrent: int,
    factor: int,
) -> None:
    # At most CONCURRENT at once, and no more pool processes than the cores this may run on.
    pool = min(concurrent, len(os.sched_getaffinity(0)))
    held = pool * factor
    total = held + 3  # more than the worker may hold: some stay in the broker
    key = f"orderly:test:gate:{uuid.uuid4().hex[:8]}"
    name = f"qm{concurrent}{factor}"
    worker = procs.start_worker(
        name,
        concurrency=None,  # from AURA_QUEUE_MANAGER_CONCURRENT
        extra_env={
            "AURA_QUEUE_MANAGER_CONCURRENT": str(concurrent),
            "AURA_QUEUE_MANAGER_CONCURRENT_FACTOR": str(factor),
            "ORDERLY_HANDLER_MODULES": "tooling.handlers,tests.gated_handlers",
            "PYTHONPATH": str(ROOT),
            "ORDERLY_NODE_CODE": "queue-manager",
        },
    )
    wait_for_log(worker, "ready.", timeout=START_TIMEOUT_S)
    ids = [
        intake.submit(
            message(n, service="gate", operation="hold", payload=f'{{"key": "{key}"}}')
        ).msg_id
        for n in range(1, total + 1)
    ]
    for msg_id in ids:  # a task per message, as the pool and the re-processing send them
        enqueue_processing(msg_id)

    def events() -> list[str]:
        return [as_text(e) for e in redis_client.lrange(key, 0, -1)]

    def left_in_broker() -> int:
        return int(queued(PROCESS_QUEUE))

    try:
        # Every handler holds: the worker runs ``pool`` of them and holds pool * FACTOR
        # tasks in all; the rest stay in the broker.
        wait_until(lambda: len(events()) >= pool, 60, f"{pool} handlers running")
        wait_until(lambda: left_in_broker() == total - held, 30, f"{held} tasks taken")
        active, reserved = inspect(f"{name}@{socket.gethostname()}")
        assert (active, reserved) == (pool, held - pool)
        assert len(events()) == pool and left_in_broker() == total - held
    finally:
        redis_client.rpush(f"{key}:go", *(["go"] * total))
    wait_until(lambda: all(row(db, i).state == "OK" for i in ids), 120, "every message done")
    assert most_at_once(events()) == pool
    assert len(events()) == 2 * total
