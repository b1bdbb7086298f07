"""Beat's watch for a lost Redis: the key watch against the real Redis (a change, a flush, a
restart end a wait; nothing does while the keys stay), the loss watch's looks, and an idle
worker and beat that send almost nothing while a FLUSHALL is still rebuilt at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from orderly.worker.core.keywatch import KeyWatch
from orderly.worker.loss_watch import LossWatch
from orderly.worker.rebuild import RebuildReport
from tests.helpers import wait_until
from tests.stack import Stack
from tooling.servers import RedisServer

KEYS = ["test:marker:0", "test:marker:1"]


@pytest.fixture
def own(redis_server: RedisServer) -> redis.Redis:
    """A Redis of the test's own: a flush of another test's database would wake the watch
    (tracking knows keys by name, whatever their database)."""
    return redis_server.client()


@pytest.fixture
def watch(own: redis.Redis) -> Iterator[KeyWatch]:
    found = KeyWatch(own)
    yield found
    found.close()


def test_a_change_to_a_watched_key_or_a_flush_ends_a_wait(
    own: redis.Redis, watch: KeyWatch
) -> None:
    redis_client = own
    redis_client.hset(KEYS[0], "state", "ready")
    assert watch.arm(KEYS) == (1, True)  # one of two exists; connected for it
    assert not watch.wait(0.2)  # nothing changed
    redis_client.set("test:other", 1)
    assert not watch.wait(0.2)  # a key it does not watch
    redis_client.hset(KEYS[1], "state", "ready")
    assert watch.wait(5)
    assert watch.arm(KEYS) == (2, False)
    redis_client.delete(KEYS[0])
    assert watch.wait(5)
    assert watch.arm(KEYS) == (1, False)
    redis_client.flushdb()
    assert watch.wait(5)
    assert watch.arm(KEYS) == (0, False)
    assert not watch.wait(0.2)


def test_a_restart_ends_a_wait_and_the_next_arm_connects_anew(
    redis_server: RedisServer,
) -> None:
    client = redis_server.client()
    client.hset(KEYS[0], "state", "ready")
    watch = KeyWatch(client)
    try:
        assert watch.arm(KEYS) == (1, True)
        redis_server.restart()  # no persistence: the key is gone too
        assert watch.wait(10)
        assert watch.arm(KEYS) == (0, True)
    finally:
        watch.close()


def test_the_loss_watch_looks_on_a_change_and_not_while_nothing_changes(
    own: redis.Redis,
) -> None:
    redis_client = own
    looks: list[float] = []

    def look() -> None:
        looks.append(time.monotonic())
        for key in KEYS:  # as a rebuild marks what is lost (and writes nothing else)
            if not redis_client.exists(key):
                redis_client.hset(key, "state", "ready")

    lost = LossWatch(redis_client, KEYS, look, poll_s=0.05, fallback_s=0.3)
    stopping = threading.Event()
    thread = threading.Thread(target=lost.run, args=(stopping,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: lost.holds_state, 10, "the first look")
        # its own marks were a change: looked once more; then quiet past several fallbacks
        time.sleep(1.5)
        settled = len(looks)
        assert settled <= 3
        time.sleep(1.0)
        assert len(looks) == settled
        redis_client.delete(KEYS[1])
        wait_until(lambda: len(looks) > settled, 5, "a look after a marker went")
    finally:
        stopping.set()
        lost.close()
        thread.join(10)
    assert not thread.is_alive()


def _running(lost: LossWatch) -> tuple[threading.Event, threading.Thread]:
    stopping = threading.Event()
    thread = threading.Thread(target=lost.run, args=(stopping,), daemon=True)
    thread.start()
    return stopping, thread


def test_a_look_that_could_not_say_is_made_again_without_a_change(own: redis.Redis) -> None:
    answers = [RebuildReport(busy=True), RebuildReport(busy=True)]  # another beat rebuilding

    def look() -> RebuildReport | None:
        return answers.pop(0) if answers else None

    own.hset(KEYS[0], "state", "ready")
    own.hset(KEYS[1], "state", "ready")
    lost = LossWatch(own, KEYS, look, poll_s=0.05, fallback_s=30)
    stopping, thread = _running(lost)
    try:
        wait_until(lambda: lost.holds_state, 10, "Redis known to hold its state")
        assert lost.looks == 3 and answers == []  # no key changed meanwhile
    finally:
        stopping.set()
        lost.close()
        thread.join(10)


def test_a_watch_that_keeps_failing_falls_back_to_polling(
    own: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[float] = []
    lost = LossWatch(own, KEYS, lambda: looks.append(time.monotonic()), poll_s=0.05)

    def broken(keys: list[str]) -> tuple[int, bool]:
        raise TypeError("a client library the watch does not know")

    monkeypatch.setattr(lost._watch, "arm", broken)
    stopping, thread = _running(lost)
    try:
        wait_until(lambda: lost.polling and len(looks) >= 5, 10, "polling looks")
    finally:
        stopping.set()
        lost.close()
        thread.join(10)


@pytest.mark.e2e
def test_an_idle_worker_and_beat_send_few_redis_commands_and_a_flush_is_rebuilt(
    stack: Stack, redis_server: RedisServer
) -> None:
    # the default heartbeat (the tests' own renews every worker's service key every 0.3 s)
    stack.env(ORDERLY_REDIS_URL=redis_server.url, ORDERLY_HEARTBEAT_INTERVAL="5000")
    stack.worker()
    stack.beat()
    client = redis_server.client()
    marker = "bridge:queue:{bq:16:0}:epoch"
    wait_until(lambda: bool(client.exists(marker)), 60, "the first rebuild's marker")
    time.sleep(3)  # past start-up
    before = client.info("stats")["total_commands_processed"]
    started = time.monotonic()
    time.sleep(10)
    sent = client.info("stats")["total_commands_processed"] - before - 1
    rate = sent / (time.monotonic() - started)
    assert rate <= 10, f"{rate:.1f} Redis commands a second while idle"
    client.flushall()
    wait_until(lambda: bool(client.exists(marker)), 30, "the rebuild after FLUSHALL")
