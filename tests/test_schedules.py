"""Periodic schedules (worker/messages/schedules.py, worker/core/cron.py): cron expressions read
in a
time zone (daylight saving time included), validation that writes nothing, one message per due
instant with an injected clock, catch-up of one, disabled schedules, producers that race or die
between their commits, and beat's job."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.worker.core import cron
from orderly.worker.core.errors import InvalidMessage, NodeNotAccepting
from orderly.worker.messages import schedules
from orderly.worker.messages.intake import Intake, SubmitResult
from orderly.worker.runtime import get_runtime
from tests.helpers import ManualClock
from tests.stub_broker import StubBroker

T0 = datetime(2026, 1, 5, 9, 0, 30, tzinfo=UTC)


def at(text_: str) -> datetime:
    return datetime.fromisoformat(text_.replace("Z", "+00:00"))


# --- cron and time zones (unit) -----------------------------------------------------------


def walk(expression: str, zone: str, start: datetime, count: int) -> list[str]:
    found = cron.parse(expression, zone)
    instants, instant = [], start
    for _ in range(count):
        instant = found.next_after(instant)
        instants.append(cron.iso(instant))
    return instants


@pytest.mark.parametrize(
    ("expression", "zone", "field", "says"),
    [
        ("* * * *", "UTC", "cron", "has 4 fields; give five"),
        ("0 0 * * * *", "UTC", "cron", "has 6 fields"),
        ("@daily", "UTC", "cron", "has 1 field;"),
        ("61 * * * *", "UTC", "cron", "bad minute"),
        ("0 0 30 2 *", "UTC", "cron", "bad day-of-month"),
        ("0 0 * * FUNDAY", "UTC", "cron", "bad day-of-week"),
        ("0 0 * * *", "Mars/Olympus", "time_zone", "unknown time zone 'Mars/Olympus'"),
        ("0 0 * * *", "../../etc/passwd", "time_zone", "unknown time zone"),
        ("0 0 * * *", "Europe", "time_zone", "unknown time zone"),
    ],
)
def test_a_bad_expression_or_time_zone_is_refused_naming_it(
    expression: str, zone: str, field: str, says: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        cron.parse(expression, zone)
    assert refused.value.field == field
    assert says in refused.value.problem


def test_both_problems_are_named_at_once() -> None:
    with pytest.raises(InvalidMessage) as refused:
        cron.parse("99 * * * *", "Nowhere/Town")
    assert [f for f, _ in refused.value.problems] == ["cron", "time_zone"]


def test_the_expression_is_kept_with_single_spaces() -> None:
    assert cron.parse("  0   6 * *  MON-FRI ", "UTC").expression == "0 6 * * MON-FRI"


def test_weekdays_at_six_in_berlin_winter_and_summer() -> None:
    # Friday 27 March 2026, then the weekend (skipped), then Monday in summer time.
    found = walk("0 6 * * MON-FRI", "Europe/Berlin", at("2026-03-26T12:00:00Z"), 3)
    assert found == ["2026-03-27T05:00:00Z", "2026-03-30T04:00:00Z", "2026-03-31T04:00:00Z"]


def test_a_time_the_clocks_skip_runs_at_the_first_time_after_the_gap() -> None:
    # 29 March 2026: Berlin's clocks go from 02:00 to 03:00; 02:30 that night is 03:00 CEST.
    found = walk("30 2 * * *", "Europe/Berlin", at("2026-03-28T12:00:00Z"), 3)
    assert found == ["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z", "2026-03-31T00:30:00Z"]


def test_a_time_that_occurs_twice_runs_once() -> None:
    # 25 October 2026: Berlin's clocks go from 03:00 back to 02:00; 02:30 happens twice.
    found = walk("30 2 * * *", "Europe/Berlin", at("2026-10-24T12:00:00Z"), 3)
    assert found == ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z", "2026-10-27T01:30:00Z"]
    # Asked from inside the repeated hour, after its first 02:30: the next day's.
    inside = at("2026-10-25T01:10:00Z")  # 02:10 CET, the second time round
    assert cron.iso(cron.parse("30 2 * * *", "Europe/Berlin").next_after(inside)) == (
        "2026-10-26T01:30:00Z"
    )


def test_an_interval_runs_in_real_time_through_the_repeated_hour() -> None:
    # New York, 1 November 2026: 01:00-02:00 happens twice; every half hour of it runs.
    found = walk("*/30 * * * *", "America/New_York", at("2026-11-01T04:50:00Z"), 6)
    assert found == [
        "2026-11-01T05:00:00Z",  # 01:00 EDT
        "2026-11-01T05:30:00Z",
        "2026-11-01T06:00:00Z",  # 01:00 EST
        "2026-11-01T06:30:00Z",
        "2026-11-01T07:00:00Z",  # 02:00 EST
        "2026-11-01T07:30:00Z",
    ]


def test_next_is_strictly_after_and_catch_up_is_the_latest_missed() -> None:
    hourly = cron.parse("0 * * * *", "UTC")
    assert hourly.next_after(at("2026-01-01T10:00:00Z")) == at("2026-01-01T11:00:00Z")
    due = at("2026-01-01T00:00:00Z")
    assert hourly.latest_due(due, at("2026-01-01T00:00:00Z")) == due
    assert hourly.latest_due(due, at("2026-01-01T00:59:59.9Z")) == due
    assert hourly.latest_due(due, at("2026-01-05T07:30:00Z")) == at("2026-01-05T07:00:00Z")
    assert hourly.latest_due(due, at("2026-01-05T07:00:00Z")) == at("2026-01-05T07:00:00Z")


def test_the_payload_template_replaces_only_its_two_placeholders() -> None:
    template = {
        "at": "{{instant}}",
        "text": "run {{name}} at {{instant}}; {{other}} {{ instant }} {instant}",
        "{{name}}": ["{{name}}", 3, None, True, {"deep": "{{instant}}"}],
    }
    got = schedules.render(template, "nightly", at("2026-01-01T06:00:00Z"))
    assert got == {
        "at": "2026-01-01T06:00:00Z",
        "text": "run nightly at 2026-01-01T06:00:00Z; {{other}} {{ instant }} {instant}",
        "{{name}}": ["nightly", 3, None, True, {"deep": "2026-01-01T06:00:00Z"}],
    }
    assert schedules.render("{{name}}", "n", T0) == "n"


# --- the store (integration) -----------------------------------------------------------------


def body(name: str = "nightly", **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "cron": "* * * * *",
        "service": "test",
        "operation": "script",
        "source_system": "crm",
        "payload": {"run": "{{name}}", "at": "{{instant}}"},
    }
    data.update(overrides)
    return data


def check() -> schedules.MessageCheck:
    return schedules.message_check(get_runtime().registry, 10_000)


def create(db: Engine, clock: ManualClock, **overrides: Any) -> schedules.ScheduleView:
    return schedules.create_schedule(db, body(**overrides), check(), clock)


def count(db: Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def produced(db: Engine) -> list[tuple[str, datetime, str]]:
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT correlation_id, msg_timestamp, payload FROM message ORDER BY msg_id")
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0.timestamp())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"cron": "0 25 * * *"}, "cron"),
        ({"time_zone": "Europe/Atlantis"}, "time_zone"),
        ({"service": "nosuch"}, "service"),
        ({"operation": "nosuch"}, "operation"),
        ({"payload": 42}, "payload"),
        ({"payload": {"big": "x" * 20_000}}, "payload"),
        ({"name": "has space"}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"colour": "red"}, "colour"),
        ({"msg_timestamp": "2026-01-01T00:00:00Z"}, "msg_timestamp"),
        ({"exclude_failed_state": True}, "exclude_failed_state"),
    ],
)
def test_a_refused_schedule_writes_nothing(
    db: Engine, clock: ManualClock, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        create(db, clock, **overrides)
    assert field in [f for f, _ in refused.value.problems]
    assert count(db, "schedule") == 0


def test_a_name_is_one_schedule(db: Engine, clock: ManualClock) -> None:
    create(db, clock)
    with pytest.raises(InvalidMessage, match="schedule 'nightly' exists"):
        create(db, clock, cron="0 0 * * *")
    assert schedules.show_schedule(db, "nightly").cron == "* * * * *"


def test_three_instants_make_three_messages_each_once(
    db: Engine, clock: ManualClock, intake: Intake, queue: list[int]
) -> None:
    made = create(db, clock)
    assert made.next_at == at("2026-01-05T09:01:00Z") and made.last_at is None
    # Not due yet: nothing.
    assert schedules.produce_due(db, intake.submit, clock).produced == []
    for step in (35, 60, 60):  # 09:01:05, 09:02:05, 09:03:05
        clock.advance(step)
        report = schedules.produce_due(db, intake.submit, clock)
        assert len(report.produced) == 1 and report.repeated == []
        # Asked again at the same moment: nothing more.
        assert schedules.produce_due(db, intake.submit, clock).produced == []
    rows = produced(db)
    assert [r[0] for r in rows] == [
        "schedule:nightly:2026-01-05T09:01:00Z",
        "schedule:nightly:2026-01-05T09:02:00Z",
        "schedule:nightly:2026-01-05T09:03:00Z",
    ]
    assert [r[1] for r in rows] == [at(f"2026-01-05T09:0{n}:00Z") for n in (1, 2, 3)]
    assert rows[0][2] == '{"run":"nightly","at":"2026-01-05T09:01:00Z"}'
    assert len(queue) == 3  # each handed over after its commit
    after = schedules.show_schedule(db, "nightly")
    assert after.next_at == at("2026-01-05T09:04:00Z")
    assert after.last_at == at("2026-01-05T09:03:00Z") and after.last_error is None
    with db.connect() as conn:
        last = conn.execute(text("SELECT max(msg_id) FROM message")).scalar_one()
    assert after.last_msg_id == last


def test_instants_missed_while_beat_was_down_make_one_message(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    create(db, clock, cron="*/5 * * * *")
    clock.advance(3 * 3600)  # 12:00:30: 36 instants missed
    report = schedules.produce_due(db, intake.submit, clock)
    assert report.produced == ["schedule:nightly:2026-01-05T12:00:00Z"]
    assert schedules.show_schedule(db, "nightly").next_at == at("2026-01-05T12:05:00Z")


def test_optional_fields_reach_the_message(db: Engine, clock: ManualClock, intake: Intake) -> None:
    create(
        db,
        clock,
        object_id="o-1",
        entity_type="invoice",
        funnel_value="crm:daily",
        payload="text at {{instant}}",
    )
    clock.advance(60)
    schedules.produce_due(db, intake.submit, clock)
    with db.connect() as conn:
        found = conn.execute(
            text("SELECT object_id, entity_type, funnel_value, payload FROM message")
        ).one()
    assert tuple(found) == ("o-1", "invoice", "crm:daily", "text at 2026-01-05T09:01:00Z")


def test_a_disabled_schedule_produces_nothing_and_starts_again_from_now(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    create(db, clock, enabled=False)
    assert schedules.show_schedule(db, "nightly").next_at is None
    clock.advance(600)
    assert schedules.produce_due(db, intake.submit, clock).produced == []
    disabled = schedules.set_enabled(db, "nightly", False, check(), clock)
    assert disabled.next_at is None
    enabled = schedules.set_enabled(db, "nightly", True, check(), clock)
    assert enabled.next_at == at("2026-01-05T09:11:00Z")  # the ten minutes are not made up
    clock.advance(40)
    assert schedules.produce_due(db, intake.submit, clock).produced == [
        "schedule:nightly:2026-01-05T09:11:00Z"
    ]
    schedules.set_enabled(db, "nightly", False, check(), clock)
    clock.advance(3600)
    assert schedules.produce_due(db, intake.submit, clock).produced == []
    assert count(db, "message") == 1


def test_a_change_of_times_moves_next_a_change_of_template_does_not(
    db: Engine, clock: ManualClock
) -> None:
    create(db, clock, cron="0 12 * * *")
    assert schedules.show_schedule(db, "nightly").next_at == at("2026-01-05T12:00:00Z")
    change = {"payload": {"v": 2}, "priority": None}
    kept = schedules.update_schedule(db, "nightly", change, check(), clock)
    assert kept.next_at == at("2026-01-05T12:00:00Z") and kept.payload == {"v": 2}
    moved = schedules.update_schedule(db, "nightly", {"time_zone": "Asia/Tokyo"}, check(), clock)
    assert moved.next_at == at("2026-01-06T03:00:00Z")  # noon in Tokyo
    with pytest.raises(InvalidMessage) as refused:
        schedules.update_schedule(db, "nightly", {"cron": "0 12 * *", "name": "x"}, check(), clock)
    assert refused.value.field == "name"
    with pytest.raises(InvalidMessage) as refused:
        schedules.update_schedule(db, "nightly", {"cron": "bad"}, check(), clock)
    assert refused.value.field == "cron"
    assert schedules.show_schedule(db, "nightly").time_zone == "Asia/Tokyo"  # unchanged


def test_a_refused_message_passes_its_instant_over_and_says_why(
    db: Engine, clock: ManualClock
) -> None:
    create(db, clock)

    def refuse(data: dict[str, Any]) -> SubmitResult:
        raise InvalidMessage("service", "unknown service 'test'")

    clock.advance(60)
    report = schedules.produce_due(db, refuse, clock)
    assert report.refused == {"nightly": "service: unknown service 'test'"}
    after = schedules.show_schedule(db, "nightly")
    assert after.next_at == at("2026-01-05T09:02:00Z") and after.last_msg_id is None
    assert after.last_error == "service: unknown service 'test'"


def test_a_node_that_takes_no_input_leaves_the_schedule_due(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    create(db, clock)
    create(db, clock, name="second")

    def stopped(data: dict[str, Any]) -> SubmitResult:
        raise NodeNotAccepting("n1", "STOPPED")

    clock.advance(60)
    with pytest.raises(NodeNotAccepting):
        schedules.produce_due(db, stopped, clock)
    assert schedules.show_schedule(db, "nightly").next_at == at("2026-01-05T09:01:00Z")
    clock.advance(60)  # the node runs again a minute later: the latest instant, once each
    report = schedules.produce_due(db, intake.submit, clock)
    assert sorted(report.produced) == [
        "schedule:nightly:2026-01-05T09:02:00Z",
        "schedule:second:2026-01-05T09:02:00Z",
    ]


def test_a_producer_that_dies_between_its_commits_makes_no_second_message(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    """The message is committed, the schedule's advance is not: the next producer submits the
    same instant again and the store answers with the stored message."""
    create(db, clock)

    def submit_then_die(data: dict[str, Any]) -> SubmitResult:
        intake.submit(data)
        raise ConnectionError("the producer's connection dropped before its commit")

    clock.advance(60)
    with pytest.raises(ConnectionError):
        schedules.produce_due(db, submit_then_die, clock)
    assert schedules.show_schedule(db, "nightly").next_at == at("2026-01-05T09:01:00Z")
    report = schedules.produce_due(db, intake.submit, clock)
    assert report.produced == [] and report.repeated == ["schedule:nightly:2026-01-05T09:01:00Z"]
    assert count(db, "message") == 1
    assert schedules.show_schedule(db, "nightly").next_at == at("2026-01-05T09:02:00Z")


def test_a_second_producer_passes_over_what_the_first_holds(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    create(db, clock)
    clock.advance(60)
    holding, release = threading.Event(), threading.Event()
    first: list[schedules.ProduceReport] = []

    def slow(data: dict[str, Any]) -> SubmitResult:
        holding.set()
        assert release.wait(30)
        return intake.submit(data)

    thread = threading.Thread(target=lambda: first.append(schedules.produce_due(db, slow, clock)))
    thread.start()
    try:
        assert holding.wait(30)
        # The first producer holds the row and has not committed: the second sees nothing due.
        assert schedules.produce_due(db, intake.submit, clock).produced == []
    finally:
        release.set()
        thread.join(30)
    assert first[0].produced == ["schedule:nightly:2026-01-05T09:01:00Z"]
    assert schedules.produce_due(db, intake.submit, clock).produced == []
    assert count(db, "message") == 1


def race(db: Engine, intake: Intake, clock: ManualClock) -> list[schedules.ProduceReport]:
    """Two producers, each on its own thread and connections, started together."""
    start = threading.Barrier(2)
    reports: list[schedules.ProduceReport] = []
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            start.wait(10)
            reports.append(schedules.produce_due(db, intake.submit, clock, batch=5))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    return reports


def test_two_producers_racing_make_one_message_per_instant(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    names = [f"s{n:02d}" for n in range(24)]
    for name in names:
        create(db, clock, name=name)
    for _ in range(3):  # three instants
        clock.advance(60)
        reports = race(db, intake, clock)
        made = [cid for r in reports for cid in r.produced]
        assert len(made) == len(set(made)) == len(names)
        assert all(r.repeated == [] for r in reports)
    rows = produced(db)
    assert len(rows) == 3 * len(names) == len({r[0] for r in rows})
    instants = {r[1] for r in rows}
    assert instants == {at(f"2026-01-05T09:0{n}:00Z") for n in (1, 2, 3)}


def test_beat_lists_the_schedules_job(db: Engine) -> None:
    from orderly.beat import agents
    from orderly.beat.schedule import jobs

    runtime = get_runtime()
    found = {job.name: job for job in jobs(runtime.config, runtime.settings, runtime)}
    assert found["schedules"].run is agents.produce_schedules
    assert found["schedules"].every_s == 1.0


def test_beat_agent_produces_through_the_runtime_intake(
    db: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    """The agent's own wiring: the runtime's engine, clock, intake and broker (a stub, as no
    broker is running here): one worker woken for the message."""
    from orderly.beat import agents

    create(db, clock)
    runtime = get_runtime()
    runtime.clock = clock
    broker = StubBroker()
    runtime.use_broker(broker)
    clock.advance(60)
    report = agents.produce_schedules()
    assert report.produced == ["schedule:nightly:2026-01-05T09:01:00Z"]
    assert broker.due == [True] and count(db, "message") == 1


def test_deleting_keeps_the_messages(db: Engine, clock: ManualClock, intake: Intake) -> None:
    create(db, clock)
    clock.advance(60)
    schedules.produce_due(db, intake.submit, clock)
    schedules.delete_schedule(db, "nightly")
    with pytest.raises(Exception, match="no schedule 'nightly'"):
        schedules.show_schedule(db, "nightly")
    assert count(db, "message") == 1 and count(db, "schedule") == 0


def test_one_turn_takes_every_due_schedule_in_batches(
    db: Engine, clock: ManualClock, intake: Intake
) -> None:
    for n in range(12):
        create(db, clock, name=f"b{n:02d}")
    clock.advance(60)
    report = schedules.produce_due(db, intake.submit, clock, batch=5)
    assert len(report.produced) == 12
    assert count(db, "message") == 12
