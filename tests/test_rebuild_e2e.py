"""Rebuild from PostgreSQL end to end: a Redis server of the test's own is killed and started
again without persistence while conversations and store messages wait on its broker; beat
notices and rebuilds, and everything accepted completes in order. And ``orderly rebuild``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models.keys import BridgeKeys
from orderly.worker.celery import DELIVER_QUEUE
from tests.helpers import OrderlyCli, bridge_ready, message, queued, wait_until
from tests.stack import Stack
from tests.test_conversation_e2e import CHANNEL, TIMINGS
from tests.test_conversations import make
from tooling.servers import RedisServer
from tooling.sink import Sink

CONVERSATIONS = 5


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def open_rows(db: Engine) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM message WHERE state NOT IN ('OK', 'FAILED', 'CANCEL') "
                    "AND NOT (operation_name = 'request' AND state = 'WAITING_FOR_RES')"
                )
            ).scalar_one()
        )


def test_redis_restart_without_persistence_then_everything_completes(
    stack: Stack, db: Engine, sink: Sink, redis_server: RedisServer
) -> None:
    stack.env(**TIMINGS, ORDERLY_REDIS_URL=redis_server.url)
    stack.start_api()
    answer = stack.http.put("/channels/chat", json={"url": sink.url, **CHANNEL})
    assert answer.status_code == 200, answer.text
    stack.beat()
    client = redis_server.client()
    wait_until(lambda: bridge_ready(client), timeout=60, what="marker")
    expected: dict[str, list[str]] = {}
    for c in range(CONVERSATIONS):
        cid = f"conv-{c}"
        for r in range(2):
            rid = f"{cid}-r{r}"
            got = stack.http.post(
                f"/conversations/{cid}/requests", json={"request_id": rid, "origin": "chat"}
            )
            assert got.status_code in (200, 201), got.text
        # Responses of the later request first: they wait behind the earlier one.
        for r in (1, 0):
            for n in range(2):
                sid = f"{cid}-r{r}-s{n}"
                got = stack.http.post(
                    f"/conversations/{cid}/responses",
                    json={
                        "request_id": f"{cid}-r{r}",
                        "response_id": sid,
                        "payload": {"n": n},
                        "last": n == 1,
                    },
                )
                assert got.status_code in (200, 201), got.text
        expected[cid] = [f"{cid}-r{r}-s{n}" for r in (0, 1) for n in range(2)]
    msg_ids = [stack.submit(message(n)) for n in range(5)]
    # No worker yet: the drains and the messages' tasks are on the broker, lost with Redis.
    # (Beat may rebuild at once: what shows the loss is the new server run, not the marker.)
    run_before = client.info("server")["run_id"]
    redis_server.restart(kill=True)
    assert client.info("server")["run_id"] != run_before
    stack.worker("w1", concurrency=2)
    wait_until(lambda: open_rows(db) == 0, timeout=120, what="every response and message final")
    for msg_id in msg_ids:
        assert stack.state(msg_id) == "OK"
    assert sink.deliveries() == expected
    assert bridge_ready(client)


def test_orderly_rebuild_command(db: Engine, redis_client: redis.Redis, cli: OrderlyCli) -> None:
    h = make(db, redis_client)
    h.request("c1", "r1")
    h.response("c1", "r1", "s1", last=True)  # its drain is not run: s1 stays queued
    ready = cli("rebuild")
    assert ready.returncode == 0, ready.stderr
    assert cli("rebuild", "--check").returncode == 0
    assert "nothing to rebuild" in cli("rebuild").stdout
    redis_client.flushdb()
    lost = cli("rebuild", "--check")
    assert lost.returncode == 1 and "marker is missing" in lost.stdout, lost.stdout
    done = cli("rebuild")
    assert done.returncode == 0, done.stderr
    assert "rebuilt" in done.stdout and "1 drains started" in done.stdout, done.stdout
    assert redis_client.hget(BridgeKeys().response("c1", "s1"), "status") == b"PENDING"
    assert queued(DELIVER_QUEUE) == 1  # the drain's task, on the broker
    assert redis_client.exists(BridgeKeys().drain_lease("c1"))  # held for that drain
    assert cli("rebuild", "--check").returncode == 0
