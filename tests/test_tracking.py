"""Message tracking (message-tracking-timeouts.txt) against the real Redis, and the timeout
retry against the real PostgreSQL: keys, xid rules, capacity, the monitor's metrics, expiry,
retries with backoff, FAILED after the last attempt, and the service keys."""

from __future__ import annotations

import hashlib
import json

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, text

from orderly.models import MessageState
from orderly.models.keys import TrackKeys
from orderly.worker import lua
from orderly.worker.core.clock import SYSTEM, now_ms
from orderly.worker.core.errors import InvalidMessage, NotFound, TrackingError
from orderly.worker.core.owners import Owns
from orderly.worker.messages import timeouts
from orderly.worker.messages.done_reports import report_done
from orderly.worker.messages.intake import Intake
from orderly.worker.observe import store_figures
from orderly.worker.tracking import (
    BUCKETS_MS,
    ServiceLease,
    Services,
    Tracker,
    TrackingPolicy,
    claim_of,
    snapshot,
    xid_of,
)
from tests.helpers import ManualClock, make_due, message, row, take_due

KEYS = TrackKeys("demo:mpush")
T0 = 1_459_166_173_000  # the seed's example timestamp, in ms


def tracker(
    client: redis.Redis, clock: ManualClock | None = None, **policy: int | float
) -> Tracker:
    return Tracker(
        client,
        KEYS,
        TrackingPolicy(**policy),  # type: ignore[arg-type]
        service="1",
        clock=clock or SYSTEM,
    )


def text_hash(client: redis.Redis, key: str) -> dict[str, str]:
    raw: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


# --- xid rules --------------------------------------------------------------------------------


def test_xid_is_the_message_when_it_is_a_number() -> None:
    assert xid_of(12345) == ("12345", "number")
    assert xid_of("12345") == ("12345", "number")


def test_xid_is_meta_id_when_there_is_one() -> None:
    assert xid_of({"meta": {"id": "abc-1"}, "body": 1}) == ("abc-1", "meta")
    assert xid_of({"meta": {"id": 7}}) == ("7", "meta")


def test_xid_is_the_sha1_otherwise() -> None:
    body = {"body": "hello", "meta": {"type": "x"}}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert xid_of(body) == (hashlib.sha1(canonical.encode()).hexdigest(), "sha1")
    # Not a number: text with other characters, a negative number, a boolean, an empty id.
    assert xid_of("12a") == (hashlib.sha1(b"12a").hexdigest(), "sha1")
    assert xid_of(-5)[1] == "sha1"
    assert xid_of(True)[1] == "sha1"
    assert xid_of({"meta": {"id": ""}})[1] == "sha1"
    # The same message always gives the same xid, whatever the order of its keys.
    assert xid_of({"b": 1, "a": 2}) == xid_of({"a": 2, "b": 1})


# --- registration -----------------------------------------------------------------------------


def test_register_writes_the_seed_keys(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=10_000, expire_ms=60_000)
    redis_client.set(KEYS.message_id, 2)  # the seed's example: the next id is 3
    track_id = t.register(12345, now=T0)
    assert track_id == 3
    assert redis_client.get(KEYS.message_id) == b"3"
    assert redis_client.lrange(KEYS.message_ids, 0, -1) == [b"3"]
    assert text_hash(redis_client, KEYS.message(3)) == {
        "timestamp": str(T0),
        "xid": "12345",
        "deadline": str(T0 + 10_000),
        "service": "1",
        "kind": "message",
        "claim": "",
    }
    assert 59_000 < redis_client.pttl(KEYS.message(3)) <= 60_000
    assert text_hash(redis_client, KEYS.xid("12345")) == {"id": "3", "type": "number"}
    assert t.lookup("12345") == {"id": "3", "type": "number"}
    assert redis_client.pttl(KEYS.xid("12345")) > 0


def test_register_refuses_an_existing_message_key_and_writes_nothing(
    redis_client: redis.Redis,
) -> None:
    t = tracker(redis_client)
    redis_client.set(KEYS.message_id, 4)
    redis_client.hset(KEYS.message(5), "timestamp", "1")
    with pytest.raises(TrackingError, match="counter was reset"):
        t.register({"meta": {"id": "m-1"}}, now=T0)
    assert redis_client.llen(KEYS.message_ids) == 0
    assert not redis_client.exists(KEYS.xid("m-1"))
    assert text_hash(redis_client, KEYS.message(5)) == {"timestamp": "1"}


def test_over_capacity_only_the_overflow_is_counted(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, capacity=3)
    ids = [t.register(n, now=T0) for n in range(5)]
    assert ids == [1, 2, 3, 0, 0]
    assert redis_client.llen(KEYS.message_ids) == 3
    assert not redis_client.exists(KEYS.xid("3")) and not redis_client.exists(KEYS.xid("4"))
    assert not t.done(0)  # an untracked message has nothing to report
    assert snapshot(redis_client, KEYS).overflow == 2
    # Room again once the monitor has taken done ids off the list.
    t.done(1, now=T0 + 5)
    t.monitor_turn(now=T0 + 10)
    assert t.register(99, now=T0) == 4
    assert snapshot(redis_client, KEYS).overflow == 2


# --- the monitor ------------------------------------------------------------------------------


def test_done_metrics_are_exact_for_a_known_set(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=10_000, expire_ms=60_000)
    durations = [3, 7, 120, 120, 999, 4_000, 9_000]
    ids = [t.register(f"{n}", now=T0 + n) for n in range(len(durations))]
    for n, (track_id, took) in enumerate(zip(ids, durations, strict=True)):
        assert t.done(track_id, now=T0 + n + took)
    assert not t.done(ids[0], now=T0 + 50_000)  # a second report changes nothing
    assert redis_client.llen(KEYS.done) == len(durations)

    turn = t.monitor_turn(now=T0 + 9_500)
    assert (turn.done, turn.expired, turn.timed_out) == (len(durations), 0, [])
    snap = snapshot(redis_client, KEYS)
    assert snap.done.count == len(durations)
    assert snap.done.sum_ms == sum(durations)
    assert snap.done.max_ms == max(durations)
    expected = [sum(1 for d in durations if d <= bound) for bound in BUCKETS_MS]
    assert [c for _, c in snap.done.buckets[:-1]] == expected
    assert snap.done.buckets[-1] == (float("inf"), len(durations))
    assert snap.timeout.count == 0
    assert snap.listed == 0 and snap.done_waiting == 0  # delisted and taken


def test_a_message_never_done_is_a_timeout(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=10_000, expire_ms=60_000)
    hung = t.register(42, now=T0)
    fine = t.register(43, now=T0 + 1)
    t.done(fine, now=T0 + 20)

    early = t.monitor_turn(now=T0 + 10_000)  # the deadline itself is not yet past it
    assert early.timed_out == [] and early.done == 1
    assert redis_client.lrange(KEYS.message_ids, 0, -1) == [str(hung).encode()]

    turn = t.monitor_turn(now=T0 + 12_345)
    assert [(x.track_id, x.xid, x.kind, x.claim, x.elapsed_ms) for x in turn.timed_out] == [
        (hung, "42", "message", "", 12_345)
    ]
    snap = snapshot(redis_client, KEYS)
    assert (snap.timeout.count, snap.timeout.sum_ms, snap.timeout.max_ms) == (1, 12_345, 12_345)
    assert (snap.done.count, snap.done.sum_ms) == (1, 19)
    assert snap.listed == 0
    # Counted once: the next turn finds nothing, and a late done is not counted as done.
    assert t.monitor_turn(now=T0 + 20_000).timed_out == []
    t.done(hung, now=T0 + 30_000)
    t.monitor_turn(now=T0 + 30_001)
    assert snapshot(redis_client, KEYS).done.count == 1


def test_a_subscriber_reports_done_by_xid_and_it_is_no_timeout(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=10_000, expire_ms=60_000)
    by_number = t.register(12345, now=T0)
    by_meta = t.register({"meta": {"id": "job-7"}}, now=T0)
    never = t.register(777, now=T0)
    assert t.done_by_xid("12345", now=T0 + 40) == (by_number, lua.XidDone.DONE)
    assert t.done_by_xid("12345", now=T0 + 50) == (by_number, lua.XidDone.ALREADY)
    assert t.done_by_xid("job-7", now=T0 + 60) == (by_meta, lua.XidDone.DONE)
    assert t.done_by_xid("nobody", now=T0 + 70) == (0, lua.XidDone.UNKNOWN)
    turn = t.monitor_turn(now=T0 + 12_000)
    assert turn.done == 2 and [x.track_id for x in turn.timed_out] == [never]
    snap = snapshot(redis_client, KEYS)
    assert (snap.done.count, snap.done.sum_ms, snap.timeout.count) == (2, 100, 1)
    redis_client.delete(KEYS.message(never))  # its hash expired
    assert t.done_by_xid("777") == (never, lua.XidDone.GONE)


def test_a_tenant_reports_done_only_its_own_messages_and_bad_input_writes_nothing(
    db: Engine, intake: Intake, redis_client: redis.Redis
) -> None:
    t = tracker(redis_client)
    mine = intake.submit(message(1, source_system="crm")).msg_id
    theirs = intake.submit(message(2, source_system="erp")).msg_id
    for msg_id in (mine, theirs):
        t.register(msg_id)
    t.register({"meta": {"id": "claim:9"}})
    owns = Owns(source_systems=frozenset({"crm"}))
    done = report_done(db, t, {"xid": str(mine)}, owns)
    assert (done.xid, done.outcome) == (str(mine), "DONE")
    for xid in (str(theirs), "claim:9", "999999"):
        with pytest.raises(NotFound):
            report_done(db, t, {"xid": xid}, owns)
    assert report_done(db, t, {"xid": "claim:9"}, None).outcome == "DONE"  # every object's
    before = redis_client.llen(KEYS.done)
    for bad in ({"xid": ""}, {"xid": 5}, {}, {"xid": "x", "more": 1}, ["5"]):
        with pytest.raises(InvalidMessage):
            report_done(db, t, bad, None)
    assert redis_client.llen(KEYS.done) == before
    their_id = int(t.lookup(str(theirs))["id"])
    assert "done" not in text_hash(redis_client, KEYS.message(their_id))  # refused: untouched


def test_expired_ids_are_counted_and_delisted(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    t = tracker(redis_client, clock, timeout_ms=10_000, expire_ms=60_000)
    gone = t.register(1)
    kept = t.register(2)
    done_late = t.register(3)
    t.done(done_late)
    # Redis expires all three hashes (messageExpire): here at once, after checking it would.
    for track_id in (gone, kept, done_late):
        assert 0 < redis_client.pttl(KEYS.message(track_id)) <= 60_000
        redis_client.delete(KEYS.message(track_id))
    clock.advance_ms(60_000)
    kept_again = t.register(4)
    assert not redis_client.exists(KEYS.message(gone))
    turn = t.monitor_turn()
    # ids 1 and 2 listed with no hash; id 3 in the done list with no hash; id 4 is young.
    assert turn.expired == 3 and turn.done == 0 and turn.timed_out == []
    assert redis_client.lrange(KEYS.message_ids, 0, -1) == [str(kept_again).encode()]
    assert snapshot(redis_client, KEYS).expired == 3
    assert kept != kept_again


# --- timeout retry in the message store --------------------------------------------------------


def _hang(engine: Engine, msg_id: int) -> str:
    """What a claim does, for a worker that then never finishes; the claim's identity."""
    with engine.begin() as conn:
        pid, at = conn.execute(
            text(
                "UPDATE message SET state = 'PROCESSING', processing_pid = pg_backend_pid(),"
                " last_process_timestamp = clock_timestamp() WHERE msg_id = :id"
                " RETURNING processing_pid, last_process_timestamp"
            ),
            {"id": msg_id},
        ).one()
    return claim_of(pid, at)


def test_timed_out_message_is_retried_with_backoff_then_failed(
    db: Engine, redis_client: redis.Redis, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    other = intake.submit(message(2)).msg_id
    clock = ManualClock(T0 / 1000)
    t = tracker(
        redis_client,
        clock,
        timeout_ms=1_000,
        expire_ms=5_000,
        retry_attempts=2,
        retry_delay_ms=500,
        retry_multiplier=3.0,
    )
    enqueued: list[int] = []
    now = T0
    expected_delays = [1_500, 4_500]  # deliveryDelay * multiplier ^ n
    for attempt, delay in enumerate(expected_delays, start=1):
        t.register(msg_id, now=now, claim=_hang(db, msg_id))
        now += 1_001
        report = timeouts.monitor(db, t, enqueued.append, now=now)
        assert report.retried == [msg_id] and report.failed == []
        got = row(db, msg_id)
        assert (got.state, got.failed_count, got.timeout_count, got.failed_error_code) == (
            "IN_QUEUE",
            attempt,
            attempt,
            "E_TIMEOUT",
        )
        assert got.processing_pid is None  # the hung worker's outcome will be dropped
        # The retry waits on the row for its backoff: the messages' due source takes it then.
        assert got.due_at is not None and got.last_process_timestamp is not None
        assert (got.due_at - got.last_process_timestamp).total_seconds() * 1000 == delay
        assert store_figures(db).due_waiting[MessageState.IN_QUEUE] == 1
        assert take_due(db) == 0
        make_due(db, msg_id)
        assert take_due(db) == 1
        assert row(db, msg_id).due_at is None
    assert enqueued == []  # nothing goes to the broker but through the due source

    t.register(msg_id, now=now, claim=_hang(db, msg_id))
    report = timeouts.monitor(db, t, enqueued.append, now=now + 1_001)
    assert report.failed == [msg_id] and report.retried == []
    got = row(db, msg_id)
    assert (got.state, got.failed_count, got.timeout_count) == ("FAILED", 3, 3)
    assert got.failed_error_code == "E_TIMEOUT"
    # how long it really ran (a message's deadline may be longer than messageTimeout)
    assert "within 1001 ms (timeout 3 of 3); no retries left" in (got.failed_desc or "")
    snap = snapshot(redis_client, KEYS)
    assert (snap.timeout.count, snap.retried, snap.gave_up) == (3, 2, 1)
    assert store_figures(db).due_waiting[MessageState.IN_QUEUE] == 0
    assert row(db, other).state == "NEW"  # nothing else touched


def test_retry_delay_is_capped() -> None:
    policy = TrackingPolicy(retry_delay_ms=100, retry_multiplier=10.0, retry_max_delay_ms=5_000)
    assert [policy.retry.delay(n) for n in (1, 2, 3, 500)] == [1_000, 5_000, 5_000, 5_000]


def test_only_the_claim_that_timed_out_is_taken_back(
    db: Engine, redis_client: redis.Redis, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    t = tracker(redis_client, timeout_ms=1_000, expire_ms=5_000)
    t.register(msg_id, now=T0, claim=_hang(db, msg_id))
    # Its worker died; the redelivered task claimed the message again, and is healthy.
    t.register(msg_id, now=T0 + 900, claim=_hang(db, msg_id))
    report = timeouts.monitor(db, t, lambda _: None, now=T0 + 1_500)
    assert report.timeouts == 1 and report.settled == [msg_id] and report.retried == []
    got = row(db, msg_id)
    assert (got.state, got.timeout_count) == ("PROCESSING", 0)
    assert got.processing_pid is not None
    # The second claim, when it too runs out of time, is taken back.
    report = timeouts.monitor(db, t, lambda _: None, now=T0 + 2_000)
    assert report.retried == [msg_id]
    assert row(db, msg_id).state == "IN_QUEUE"


def test_a_plain_funnel_message_is_left_to_its_funnel(
    db: Engine, redis_client: redis.Redis, intake: Intake
) -> None:
    plain = intake.submit(message(1, funnel_value="f-1")).msg_id
    ordered = intake.submit(message(2, funnel_value="f-2", guaranteed_order=True)).msg_id
    t = tracker(redis_client, timeout_ms=1_000, expire_ms=5_000, retry_attempts=0)
    for msg_id in (plain, ordered):
        t.register(msg_id, now=T0, claim=_hang(db, msg_id))
    report = timeouts.monitor(db, t, lambda _: None, now=T0 + 2_000)
    assert report.timeouts == 2
    # Taking back a plain funnel's message would let its successor run beside the hung one.
    assert report.settled == [plain] and row(db, plain).state == "PROCESSING"
    # Guaranteed order holds successors behind any unfinished message: safe to fail it.
    assert report.failed == [ordered] and row(db, ordered).state == "FAILED"


def test_a_message_finished_meanwhile_is_not_retried(
    db: Engine, redis_client: redis.Redis, intake: Intake
) -> None:
    msg_id = intake.submit(message(1)).msg_id
    t = tracker(redis_client, timeout_ms=1_000, expire_ms=5_000)
    t.register(msg_id, now=T0, claim=_hang(db, msg_id))
    with db.begin() as conn:  # the outcome reached the store, but its done report was lost
        conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :id"), {"id": msg_id})
    report = timeouts.monitor(db, t, lambda _: None, now=T0 + 2_000)
    assert report.timeouts == 1 and report.settled == [msg_id] and report.retried == []
    assert row(db, msg_id).state == "OK"
    assert row(db, msg_id).failed_count == 0
    assert store_figures(db).due_waiting[MessageState.IN_QUEUE] == 0


def test_only_message_processing_is_retried(db: Engine, redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=1_000, expire_ms=5_000)
    t.register({"meta": {"id": "conversation:c1"}}, kind="drain", now=T0)
    report = timeouts.monitor(db, t, lambda _: None, now=T0 + 2_000)
    assert report.timeouts == 1 and report.retried == [] and report.settled == []
    raw = text_hash(redis_client, KEYS.metrics("timeout"))
    assert (raw["count"], raw["count:drain"]) == ("1", "1")


def test_a_block_that_raises_is_not_done(redis_client: redis.Redis) -> None:
    t = tracker(redis_client, timeout_ms=1_000, expire_ms=5_000)
    with pytest.raises(RuntimeError), t.tracking(5, "message"):
        raise RuntimeError("the outcome could not be stored")
    assert redis_client.llen(KEYS.done) == 0
    assert len(t.monitor_turn(now=now_ms() + 2_000).timed_out) == 1


# --- service keys -------------------------------------------------------------------------------


def test_service_keys_register_renew_and_stop(redis_client: redis.Redis) -> None:
    services = Services(redis_client, KEYS)
    a = services.register({"node_code": "n1", "pid": 11}, expire_ms=5_000)
    b = services.register({"node_code": "n2", "pid": 12}, expire_ms=5_000)
    c = services.register({"node_code": "n1", "pid": 13}, expire_ms=5_000)
    assert (a, b, c) == (1, 2, 3)
    assert text_hash(redis_client, KEYS.service(a)) == {"node_code": "n1", "pid": "11"}
    assert [s.service_id for s in services.live()] == [1, 2, 3]
    assert services.renew(a, 9_000, now=T0) == "renewed"
    assert redis_client.pttl(KEYS.service(a)) > 5_000
    assert text_hash(redis_client, KEYS.service(a))["renewed"] == str(T0)

    assert services.stop_node("n1") == [1, 3]
    assert services.renew(a, 9_000) == "removed"  # gone stays gone: the worker must stop
    assert not redis_client.exists(KEYS.service(a))
    assert [s.service_id for s in services.live()] == [2]
    assert redis_client.smembers(KEYS.services) == {b"2"}
    services.deregister(b)
    assert services.live() == []
    with pytest.raises(ValueError, match="at least one field"):
        services.register({}, expire_ms=5_000)


def test_policy_refuses_expire_not_longer_than_timeout() -> None:
    with pytest.raises(ValueError, match="messageExpire"):
        TrackingPolicy(timeout_ms=10_000, expire_ms=10_000)


def test_a_failing_tracking_redis_never_stops_the_work() -> None:
    from tooling.processes import free_port

    # Refused at once: redis-py's own retries (seconds of backoff) are not what is tested.
    broken = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    t = Tracker(broken, KEYS, TrackingPolicy())
    ran: list[int] = []
    with t.tracking(7, "message") as track_id:
        ran.append(track_id)
    assert ran == [0]  # untracked, but the block ran and nothing was raised


class _Restartable(Services):
    """The real Services, with a Redis run id the test can change (a restart of Redis)."""

    run_id = "first"

    def server_id(self) -> str:
        return self.run_id


def test_a_service_lease_stops_only_when_an_operator_removed_the_key(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()
    services = _Restartable(redis_client, KEYS)
    lease = ServiceLease(services, {"node_code": "n1", "pid": 7}, expire_ms=5_000, clock=clock)
    service_id = lease.start()
    clock.advance(1)
    assert lease.keep() == "renewed"

    # Expired because renewals could not get through (an outage longer than the expiry):
    # put back under the same id, not a reason to stop.
    redis_client.delete(KEYS.service(service_id))
    clock.advance(6)
    assert lease.keep() == "restored"
    assert text_hash(redis_client, KEYS.service(service_id)) == {"node_code": "n1", "pid": "7"}

    # Redis restarted and lost the key (and the counter) a moment after a renewal.
    redis_client.delete(KEYS.service(service_id), KEYS.service_id)
    services.run_id = "second"
    clock.advance(1)
    assert lease.keep() == "restored"
    assert int(redis_client.get(KEYS.service_id) or 0) == service_id  # never handed out again
    assert services.register({"node_code": "n2"}, expire_ms=5_000) == service_id + 1

    # Redis flushed (same server, the lease fresh): the key and its mark are gone, put back.
    redis_client.flushdb()
    clock.advance(1)
    assert lease.keep() == "restored"
    assert redis_client.exists(KEYS.service(service_id), KEYS.service_mark(service_id)) == 2

    # Deleted by an operator while the lease is fresh and Redis the same: stop.
    redis_client.delete(KEYS.service(service_id))
    clock.advance(1)
    assert lease.keep() == "stop"


def test_beat_runs_the_monitor_and_optionally_the_nightly_report(db: Engine) -> None:
    from orderly.beat.schedule import build_schedule, jobs
    from orderly.worker.configuration import ConfigReader
    from orderly.worker.runtime import get_runtime
    from orderly.worker.settings import Settings

    settings = Settings(track_monitor_interval_ms=1500)
    found = {j.name: j for j in jobs(ConfigReader(db), settings, get_runtime())}
    assert found["timeout-monitor"].every_s == 1.5
    assert found["timeout-monitor"].run.__name__ == "timeout_monitor"
    assert "nightly-report" not in build_schedule(settings)  # off unless an hour is set

    nightly = build_schedule(Settings(report_nightly_hour=3))["nightly-report"]
    assert nightly["task"] == "orderly.agents.nightly_report"
    assert nightly["schedule"].hour == {3} and nightly["schedule"].minute == {0}
