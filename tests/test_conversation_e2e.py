"""Conversation delivery end to end: the API, two worker processes and beat, the real Redis
and PostgreSQL, and a real HTTP client sink that fails, answers 202 and ACKs (or not)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models.keys import BridgeKeys
from tests.helpers import wait_until
from tests.stack import Stack
from tooling.sink import Sink
from tooling.workload import Verdict, check, generate, submit

# A request lives this long without a response: far longer than any submission takes, so
# that none runs out before its responses come, however slow the machine.
KEYS = BridgeKeys()  # the stack's layout (the default prefix and shard count)
MESSAGE_TTL_MS = 600_000
MAX_PENDING_TTL_MS = 3000
SENT_MESSAGE_TTL_MS = 500
# Short timings so that waits, ACK timeouts and AWAITED retries happen within the test.
TIMINGS = {
    "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": str(SENT_MESSAGE_TTL_MS),
    "AURA_QUEUE_MANAGER_AWAITED_TIME_WHEN_RETRIES_END": "300",
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGES_INTERVAL": "500",
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL": str(MAX_PENDING_TTL_MS),
    "AURA_QUEUE_MANAGER_MAX_PENDING_TTL_MARGIN": "500",
    "AURA_QUEUE_MANAGER_MESSAGE_TTL": str(MESSAGE_TTL_MS),
    # Nor does a response run out while it waits to be delivered.
    "AURA_QUEUE_MANAGER_AWAITED_MESSAGE_TTL": str(MESSAGE_TTL_MS),
    "AURA_QUEUE_MANAGER_INTERVAL": "50",
}
CHANNEL = {"delivery_delay_ms": 20, "multiplier": 2.0, "attempts": 3, "timeout_ms": 1000}


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


@pytest.fixture
def conversations(stack: Stack, sink: Sink) -> Stack:
    """The API with the sink as channel "chat", two workers (one child each) and beat."""
    stack.env(**TIMINGS)
    stack.start_api()
    answer = stack.http.put("/channels/chat", json={"url": sink.url, **CHANNEL})
    assert answer.status_code == 200, answer.text
    stack.workers({"w1": "worker-1", "w2": "worker-2"}, concurrency=1)
    stack.beat()
    return stack


def pg_states(db: Engine) -> dict[str, str]:
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT correlation_id, state FROM message WHERE service_name = 'conversation'")
        )
        return {r.correlation_id: r.state for r in rows}


def open_responses(db: Engine) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM message WHERE operation_name = 'response' "
                    "AND state NOT IN ('OK', 'CANCEL', 'FAILED')"
                )
            ).scalar_one()
        )


def _value(client: redis.Redis, key: str, kind: str) -> object:
    if kind == "list":
        return client.lrange(key, 0, -1)
    if kind == "zset":
        return client.zrange(key, 0, -1, withscores=True)
    if kind == "hash":
        return client.hgetall(key)
    return client.get(key) if kind == "string" else "?"


def _where_open_ones_stand(db: Engine, client: redis.Redis) -> str:
    """For a stall: each open response's row, and what Redis holds for its conversation."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT correlation_id, process_id, state, failed_count, last_process_timestamp"
                " FROM message WHERE operation_name = 'response'"
                " AND state NOT IN ('OK', 'CANCEL', 'FAILED') ORDER BY msg_id"
            )
        ).all()
    lines = [f"{len(rows)} open responses (server time {client.time()})"]
    shown: set[str] = set()
    for r in rows[:20]:
        lines.append(
            f"  {r.correlation_id} {r.state} fails={r.failed_count} at {r.last_process_timestamp}"
        )
        conversation = r.correlation_id.split("-")[0]
        if conversation in shown:
            continue
        shown.add(conversation)
        shard = KEYS.shard(conversation)
        patterns = (f"{conversation}", f"{conversation}:*", f"req:{conversation}-*",
                    f"res:{conversation}-*")  # fmt: skip
        found = {_text(k) for p in patterns for k in client.keys(f"{shard.base}:{p}")}
        for key in sorted(found):
            kind = _text(client.type(key))
            value = _value(client, key, kind)
            lines.append(f"    {key} {kind} PTTL {client.pttl(key)}: {value}")
        for key in (shard.scheduled, shard.scheduled_leased):
            score = client.zscore(key, conversation)
            if score is not None:
                lines.append(f"    in {key} at {score}")
        pending = [
            m
            for m in client.zrange(shard.pending_messages, 0, -1)
            if conversation.encode() + b"-" in m
        ]
        lines.append(f"    pendingMessages: {pending}")
    return "\n".join(lines)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _report(v: Verdict) -> str:
    return (
        f"delivered={v.delivered} duplicates={v.duplicates} retried={v.retried} "
        f"cancelled_groups={v.cancelled_groups} violations={v.violations[:5]} "
        f"missing={v.missing[:5]} after_cancel={v.after_cancel[:5]} mismatches={v.mismatches[:5]} "
        f"late={v.late[:5]}"
    )


def _lingering(client: redis.Redis) -> dict[str, str]:
    """The bridge:queue keys left that should not be: key -> why."""
    found: dict[str, str] = {}
    now_ms = int(time.time() * 1000)
    for raw in client.keys("bridge:queue:*"):
        key = _text(raw)
        ttl = int(client.pttl(key))
        # What follows the shard's tag: "req:<id>", "scheduled", "<conversation>:lease", ...
        rest = key.split("}:", 1)[1] if key.startswith(KEYS.layout) else key
        if rest == "epoch":
            continue  # the shard's marker (beat's rebuild)
        if rest.startswith("req:"):
            # A cancelled request's tombstone lives MESSAGE_TTL.
            status = client.hget(key, "status")
            if status != b"CANCEL" or not 0 < ttl <= MESSAGE_TTL_MS:
                found[key] = f"status {status!r}, PTTL {ttl}"
        elif rest.startswith("res:"):
            # A cancelled response keeps its hash, status CANCEL, for its lifetime
            # (AWAITED_MESSAGE_TTL, MESSAGE_TTL here); nothing else of a response is left.
            status = client.hget(key, "status")
            if status != b"CANCEL" or not 0 < ttl <= MESSAGE_TTL_MS:
                found[key] = f"status {status!r}, PTTL {ttl}"
        elif rest == "scheduled":
            # Wake-ups whose conversation was delivered before they fell due. The set lives
            # MESSAGE_TTL past the latest wake-up it was given; no wait is longer than a
            # request's or a response's life (MESSAGE_TTL, AWAITED_MESSAGE_TTL here).
            latest = client.zrange(key, -1, -1, withscores=True)
            ahead = int(latest[0][1]) - now_ms if latest else 0
            if not (0 < ttl <= 2 * MESSAGE_TTL_MS and ahead <= MESSAGE_TTL_MS):
                found[key] = f"PTTL {ttl}, latest wake-up {latest}"
        elif key.endswith(":lease"):
            # A drain woken by such a wake-up may still be finding nothing to do.
            if not 0 < ttl <= MAX_PENDING_TTL_MS:
                found[key] = f"PTTL {ttl}"
        else:
            found[key] = f"PTTL {ttl}: nothing else should be left"
    return found


def test_randomized_conversations_with_failures_arrive_in_order(
    conversations: Stack, db: Engine, redis_client: redis.Redis, sink: Sink
) -> None:
    sink.configure(
        seed=20261123,
        p_recoverable=0.10,
        p_non_recoverable=0.02,
        p_async=0.20,
        p_never_ack=0.25,
        ack_delay_ms=[5, 60],
        orderly_url=conversations.url,
    )
    workload = generate(seed=7, conversations=200)
    assert workload.responses >= 400
    submission = submit(workload, conversations.http, "chat")
    try:
        wait_until(lambda: open_responses(db) == 0, timeout=180, what="every response final")
    except AssertionError as stalled:
        raise AssertionError(f"{stalled}\n{_where_open_ones_stand(db, redis_client)}") from None

    verdict = check(
        workload,
        sink.arrivals(),
        pg_states(db),
        submission=submission,
        message_ttl_ms=MESSAGE_TTL_MS,
    )
    assert verdict.ok, _report(verdict)
    if verdict.late:
        # Only a machine slower than MESSAGE_TTL allows gets here: those requests' order was
        # not checked against the others (their own order and delivery were), and it shows.
        warnings.warn(
            f"{len(verdict.late)} requests answered after MESSAGE_TTL "
            f"(submission took {submission.duration_s:.0f} s): {verdict.late[:10]}",
            stacklevel=1,
        )
    # The failures really happened (the sink's seeded mix): retries, cancels, 202s, no-ACKs.
    assert verdict.retried > 0 and verdict.cancelled_groups > 0
    arrivals = sink.arrivals()
    assert any(a["status"] == 202 and a["ack_status"] == 200 for a in arrivals)
    assert any(a["status"] == 202 and a["ack_status"] is None for a in arrivals)
    assert verdict.delivered + verdict.cancelled_responses == workload.responses
    # Every key has a TTL or was removed: what is left goes by itself, within its TTL. (A
    # drain woken meanwhile may still hold its lease for a moment.)
    deadline = time.monotonic() + 20
    while (left := _lingering(redis_client)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == {}


def test_worker_killed_mid_send_loses_nothing_and_keeps_order(
    conversations: Stack, db: Engine, redis_client: redis.Redis, sink: Sink
) -> None:
    # Every delivery takes 40 ms at the client: a worker is almost always mid-send.
    sink.configure(rules=[{"match": {}, "status": 200, "delay_ms": 40}])
    workload = generate(seed=11, conversations=30, requests=(2, 3), responses=(2, 3))
    submission = submit(workload, conversations.http, "chat")
    wait_until(lambda: len(sink.arrivals()) >= 10, timeout=30, what="deliveries under way")
    victim = conversations.process("w1")
    os.killpg(victim.proc.pid, signal.SIGKILL)  # the worker and its pool child, at once
    victim.proc.wait(10)
    killed_at = time.time()
    wait_until(lambda: open_responses(db) == 0, timeout=120, what="every response final")

    verdict = check(
        workload,
        sink.arrivals(),
        pg_states(db),
        submission=submission,
        message_ttl_ms=MESSAGE_TTL_MS,
    )
    assert verdict.ok, _report(verdict)
    assert verdict.delivered == workload.responses
    # Some deliveries happened after the kill: the surviving worker carried on.
    assert any(a["t_arrival"] > killed_at for a in sink.arrivals())
