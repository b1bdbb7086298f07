"""The conversation gate's core on a Redis Cluster of three nodes the test starts itself, and
the very same core on the plain Redis: order, retries, ACK, cancel, AWAITED and expiry by the
awaited agent, the rebuild from PostgreSQL. Conversations are spread over the shards of the
key layout (models/keys.py), whose keys land on more than one node of the cluster; a script
touching a key of another slot would fail there ("non local key", or "all keys must map to the
same key slot"), so every core test passing on the cluster shows the layout holds.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from sqlalchemy import Engine

from orderly.models.keys import CLUSTER_SHARDS, BridgeKeys
from orderly.worker import lua, readiness, rebuild
from orderly.worker.conversations import Delivery, SendResult
from orderly.worker.core.clients import ordering_client
from orderly.worker.runtime import Runtime
from orderly.worker.settings import Settings
from tests.helpers import bridge_ready, wait_until
from tests.redis_cluster import LocalCluster
from tests.stack import Stack
from tests.test_conversation_e2e import CHANNEL, TIMINGS, open_responses, pg_states
from tests.test_conversations import Harness, Recorder, make
from tooling.servers import ServerUnavailable
from tooling.sink import Sink
from tooling.workload import check, generate, submit

from .conftest import IN_CI, TEST_DB_URL, TEST_REDIS_URL

CONVERSATIONS = [f"conv-{n}" for n in range(12)]
# Key lifetimes (PEXPIRE, Redis's own clock) far longer than a slow machine takes for a test;
# the mechanism's own clock (the harness's) moves past them where a test needs it.
LIVES = {"message_ttl": 300_000, "awaited_message_ttl": 600_000, "sent_message_ttl": 60_000}
RETRY = SendResult(Delivery.RECOVERABLE, 503, reason="HTTP 503")
FATAL = SendResult(Delivery.FATAL, 400, reason="HTTP 400")


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """Three cluster nodes on free ports, joined; killed and removed whatever the tests did."""
    try:
        cluster = LocalCluster(3)
    except ServerUnavailable as exc:
        if IN_CI:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    with cluster:
        yield cluster


def _conversations(h: Harness, cids: list[str] = CONVERSATIONS) -> None:
    """Each conversation: r1 answered by s1 then s2 (final), r2 by t1 (final), the responses
    arriving in reverse so that the gate must order them."""
    for cid in cids:
        h.request(cid, f"{cid}.r1")
        h.request(cid, f"{cid}.r2")
        h.response(cid, f"{cid}.r2", f"{cid}.t1", last=True)
        h.response(cid, f"{cid}.r1", f"{cid}.s1")
        h.response(cid, f"{cid}.r1", f"{cid}.s2", last=True)


def _order(sent: list[str], cid: str) -> list[str]:
    return [s.split(".")[1] for s in sent if s.startswith(f"{cid}.")]


class Core:
    """The core tests; a subclass gives the fixture ``h`` on its Redis."""

    def test_each_conversation_is_delivered_in_order(self, h: Harness) -> None:
        _conversations(h)
        rec = Recorder()
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["s1", "s2", "t1"]
            assert {h.state(f"{cid}.{x}") for x in ("s1", "s2", "t1", "r1", "r2")} == {"OK"}
        assert h.bridge_keys() == []  # everything delivered: nothing left behind

    def test_a_retry_waits_in_its_shard_and_is_woken_by_the_walk(self, h: Harness) -> None:
        _conversations(h)
        rec = Recorder(answers={f"{cid}.s1": [RETRY] for cid in CONVERSATIONS})
        assert set(h.run(rec)) == {"WAIT_RETRY"}
        h.clock.advance_ms(19)
        assert h.wake_due() == []
        h.clock.advance_ms(1)  # deliveryDelay 10 * multiplier 2 ^ 1
        assert sorted(h.wake_due()) == sorted(CONVERSATIONS)  # every shard's set walked
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["s1", "s1", "s2", "t1"]
            assert h.state(f"{cid}.t1") == "OK"

    def test_an_ack_is_found_in_its_shard_and_releases_the_next(self, h: Harness) -> None:
        _conversations(h)
        answers = {
            f"{cid}.s1": [SendResult(Delivery.ASYNC, 202, f"ack-{cid}")] for cid in CONVERSATIONS
        }
        rec = Recorder(answers=answers)
        assert set(h.run(rec)) == {"WAIT_ACK"}
        assert len(rec.sent) == len(CONVERSATIONS)  # s2 waits behind each s1
        for cid in CONVERSATIONS:
            assert h.redis.get(h.k.shard(cid).async_request(f"ack-{cid}")) is not None
            h.conv.ack(f"ack-{cid}", h.enqueue)
            assert h.state(f"{cid}.s1") == "OK"
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["s1", "s2", "t1"]
        # Only the ACK deadlines' wake-ups are left (due later, they find nothing to do).
        assert {k.rsplit(":", 1)[1] for k in h.bridge_keys()} == {"scheduled"}

    def test_a_fatal_answer_cancels_the_group_and_the_next_goes(self, h: Harness) -> None:
        _conversations(h)
        rec = Recorder(answers={f"{cid}.s1": [FATAL] for cid in CONVERSATIONS})
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["s1", "t1"]
            states = [h.state(f"{cid}.{x}") for x in ("s1", "s2", "r1", "t1")]
            assert states == ["CANCEL", "CANCEL", "CANCEL", "OK"]

    def test_awaited_then_delivered_and_expired_by_the_awaited_agent(self, h: Harness) -> None:
        _conversations(h)
        spent = [RETRY, RETRY, RETRY]  # the channel allows 2 retries
        rec = Recorder(answers={f"{cid}.s1": list(spent) for cid in CONVERSATIONS[:6]})
        h.run(rec)
        for _ in range(2):
            h.clock.advance_ms(40)
            h.wake_due()
            h.run(rec)
        for cid in CONVERSATIONS[:6]:
            assert h.state(f"{cid}.s1") == "PARTLY_FAILED"  # AWAITED, its group with it
            assert h.redis.hget(h.k.response(cid, f"{cid}.s2"), "status") == b"AWAITED"
        h.clock.advance_ms(5_000)  # AWAITED_TIME_WHEN_RETRIES_END
        woken: list[str] = []
        while report := h.conv.awaited_turn(h.enqueue):  # every shard, within its budget
            woken += report.woken
            if not report.taken:
                break
        assert sorted(woken) == sorted(CONVERSATIONS[:6])
        h.run(rec)
        for cid in CONVERSATIONS:
            assert h.state(f"{cid}.t1") == "OK"
        # Expiry: a response held behind a request never answered, past AWAITED_MESSAGE_TTL.
        for cid in CONVERSATIONS:
            h.request(cid, f"{cid}.r3")
            h.request(cid, f"{cid}.r4")
            h.response(cid, f"{cid}.r4", f"{cid}.u1", last=True)
        h.run(rec)
        h.clock.advance_ms(600_000)  # AWAITED_MESSAGE_TTL, for the agent
        expired = 0
        while report := h.conv.awaited_turn(h.enqueue):
            expired += report.expired
            if not report.taken:
                break
        assert expired == len(CONVERSATIONS)
        assert {h.state(f"{cid}.u1") for cid in CONVERSATIONS} == {"FAILED"}

    def test_the_operators_operations_in_every_shard(self, h: Harness) -> None:
        """Get by ACK id, set AWAITED, a new awaited date, a scheduled removal and a delete,
        each in its conversation's shard."""
        _conversations(h)
        sent = {
            f"{cid}.s1": [SendResult(Delivery.ASYNC, 202, async_response_id=f"A-{cid}")]
            for cid in CONVERSATIONS
        }
        h.run(Recorder(answers=sent))
        now = h.clock.now * 1000
        for cid in CONVERSATIONS:
            got = h.conv.get_message(async_response_id=f"A-{cid}", fields=["responseId"])
            assert got == {"responseId": f"{cid}.s1"}
            done = h.conv.set_awaited(cid, {}, request_id=f"{cid}.r1")
            assert [a["response_id"] for a in done.awaited] == [f"{cid}.s2"]
            at = {"awaited_to_date": datetime.fromtimestamp(now / 1000 + 50, UTC).isoformat()}
            h.conv.set_awaited_date(cid, f"{cid}.s2", at)
            h.conv.remove_at(cid, f"{cid}.s1", {"delay_s": 10})
        h.clock.advance_ms(10_000)
        assert sorted(h.wake_due()) == sorted(CONVERSATIONS)  # every removal ran
        rec = Recorder()
        h.run(rec)  # s2 is AWAITED until its new date: nothing goes
        assert rec.sent == []
        for cid in CONVERSATIONS:
            assert h.state(f"{cid}.s1") == "OK" and h.state(f"{cid}.s2") == "PARTLY_FAILED"
            deleted = h.conv.delete_register(cid, f"{cid}.r1", {}, h.enqueue)
            assert deleted.deleted == [f"{cid}.s2"]
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["t1"] and h.state(f"{cid}.s2") == "CANCEL"

    def test_a_lost_redis_is_rebuilt_from_postgresql(self, h: Harness) -> None:
        _conversations(h)
        rec = Recorder(answers={f"{cid}.s1": [RETRY] for cid in CONVERSATIONS})
        h.run(rec)
        assert rebuild.rebuild(h.engine, h.conv, h.enqueue, lambda: None).done
        assert rebuild.check(h.conv) == ""
        self.flush(h)
        assert rebuild.check(h.conv) == "the marker is missing"
        h.started.clear()
        report = rebuild.rebuild(h.engine, h.conv, h.enqueue, lambda: None)
        assert report.done and report.marked_ready and rebuild.check(h.conv) == ""
        assert sorted(report.drains_started) == sorted(CONVERSATIONS)
        h.clock.advance_ms(1_000)
        h.run(rec)
        h.wake_due()
        h.run(rec)
        for cid in CONVERSATIONS:
            assert _order(rec.sent, cid) == ["s1", "s1", "s2", "t1"]

    def flush(self, h: Harness) -> None:
        raise NotImplementedError


class TestPlainRedis(Core):
    @pytest.fixture
    def h(self, db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
        yield make(db, redis_client, **LIVES)

    def flush(self, h: Harness) -> None:
        h.redis.flushdb()


class TestRedisCluster(Core):
    @pytest.fixture
    def h(self, db: Engine, redis_cluster: LocalCluster) -> Iterator[Harness]:
        redis_cluster.flush()
        client = redis_cluster.client()
        yield make(db, client, **LIVES)
        client.close()

    def flush(self, h: Harness) -> None:
        assert isinstance(h.redis, RedisCluster)
        for node in h.redis.get_primaries():  # type: ignore[no-untyped-call]
            h.redis.flushall(target_nodes=node)

    def test_keys_land_on_more_than_one_node(self, h: Harness, redis_cluster: LocalCluster) -> None:
        _conversations(h)
        counts = [node.dbsize() for node in redis_cluster.node_clients()]
        assert sum(1 for n in counts if n > 0) >= 2, counts
        # Every key of one conversation is on one node, in one slot.
        cluster = h.redis
        assert isinstance(cluster, RedisCluster)
        for cid in CONVERSATIONS:
            keys = [k for k in h.bridge_keys() if h.k.shard(cid).base in k]
            assert len({cluster.keyslot(k) for k in keys}) == 1  # type: ignore[no-untyped-call]

    def test_a_script_reaching_a_key_of_another_node_is_refused(self, h: Harness) -> None:
        """What the layout prevents: a key a script derives must be in its slot's node."""
        cluster = h.redis
        assert isinstance(cluster, RedisCluster)
        home = h.k.shard("conv-0")
        node = cluster.get_node_from_key(home.pending_messages)  # type: ignore[no-untyped-call]
        away = next(
            s
            for s in h.k.every_shard
            if cluster.get_node_from_key(s.epoch).name != node.name  # type: ignore[no-untyped-call]
        )
        h.request("conv-0", "conv-0.r1")
        h.response("conv-0", "conv-0.r1", "conv-0.s1")
        now = h.clock.ms() + 600_000  # the member is due for the agent
        with pytest.raises(redis.ResponseError, match="non local key"):
            lua.awaited(
                h.conv.ctx.scripts,
                pending_messages=home.pending_messages,
                now_ms=now,
                limit=10,
                response_prefix=away.response_prefix,
                awaited_step_ms=1000,
            )
        # Its own shard's prefix: the same call works.
        lua.awaited(
            h.conv.ctx.scripts,
            pending_messages=home.pending_messages,
            now_ms=now,
            limit=10,
            response_prefix=home.response_prefix,
            awaited_step_ms=1000,
        )

    def test_the_runtime_uses_the_cluster_for_ordering_only(
        self, db: Engine, redis_cluster: LocalCluster
    ) -> None:
        settings = Settings(
            database_url=TEST_DB_URL,
            redis_url=TEST_REDIS_URL,
            redis_cluster=True,
            redis_cluster_nodes=redis_cluster.nodes_setting,
        )
        runtime = Runtime(settings)
        assert isinstance(runtime.ordering_redis, RedisCluster)
        assert isinstance(runtime.redis, redis.Redis)  # the broker's, tracking, the wake key
        assert runtime.conversations.ctx.redis is runtime.ordering_redis
        assert runtime.tracking_redis is runtime.redis
        runtime.ordering_redis.close()


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"redis_cluster": True}, "ORDERLY_REDIS_CLUSTER_NODES"),
        ({"redis_cluster_nodes": "10.0.0.1"}, "not host:port"),
        ({"redis_cluster_nodes": "10.0.0.1:0"}, "not host:port"),
        ({"redis_cluster_nodes": "a:7000,b:x"}, "'b:x'"),
        ({"redis_shards": 0}, "redis_shards"),
        ({"bridge_prefix": "bq{1}"}, "{ or }"),
    ],
)
def test_bad_cluster_settings_are_refused(values: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("{", r"\{").replace("}", r"\}")):
        Settings(**values)


def test_the_layout_tags_every_key_with_its_shard() -> None:
    keys = BridgeKeys("bridge:queue", 16)
    shard = keys.shard("c1")
    tag = f"{{bq:16:{shard.number}}}"
    for key in (
        keys.request("c1", "r1"),
        keys.response("c1", "s1"),
        keys.request_list("c1"),
        keys.response_list("c1"),
        keys.request_seq("c1"),
        keys.drain_lease("c1"),
        shard.pending_messages,
        shard.scheduled,
        shard.scheduled_leased,
        shard.drains,
        shard.epoch,
        shard.async_request("a"),
    ):
        assert key.startswith(f"bridge:queue:{tag}:"), key
    assert len({s.base for s in keys.every_shard}) == 16
    # Another shard count is another layout: no key in common.
    assert not BridgeKeys("bridge:queue", 8).request_list("c1").startswith(keys.layout)


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def test_the_stack_delivers_in_order_with_its_ordering_on_the_cluster(
    stack: Stack, db: Engine, redis_cluster: LocalCluster, sink: Sink
) -> None:
    """The API, a worker and beat as real processes, ORDERLY_REDIS_CLUSTER=true: a seeded
    workload with retries, cancels, 202s and ACKs arrives in order; the conversation keys
    are on the cluster's nodes, the broker's on the plain Redis."""
    redis_cluster.flush()
    stack.env(
        **TIMINGS,
        ORDERLY_REDIS_CLUSTER="true",
        ORDERLY_REDIS_CLUSTER_NODES=redis_cluster.nodes_setting,
    )
    stack.start_api()
    ready = stack.http.get("/ready")
    assert ready.status_code == 200 and "redis-cluster" in ready.json()["checked"], ready.text
    assert stack.http.put("/channels/chat", json={"url": sink.url, **CHANNEL}).status_code == 200
    stack.workers({"w1": "worker-1"}, concurrency=2)
    stack.beat()
    cluster = redis_cluster.client()
    keys = BridgeKeys(shards=CLUSTER_SHARDS)  # the default on a cluster
    wait_until(lambda: bridge_ready(cluster, keys), timeout=60, what="beat's first rebuild")
    sink.configure(
        seed=20261125,
        p_recoverable=0.10,
        p_non_recoverable=0.02,
        p_async=0.30,
        ack_delay_ms=[5, 60],
        orderly_url=stack.url,
    )
    workload = generate(seed=11, conversations=40)
    submission = submit(workload, stack.http, "chat")
    wait_until(lambda: open_responses(db) == 0, timeout=180, what="every response final")
    verdict = check(
        workload, sink.arrivals(), pg_states(db), submission=submission, message_ttl_ms=600_000
    )
    assert verdict.ok, verdict
    assert verdict.retried > 0
    assert any(a["status"] == 202 and a["ack_status"] == 200 for a in sink.arrivals())
    on_nodes = [
        sum(1 for _ in node.scan_iter(match="bridge:queue:*"))
        for node in redis_cluster.node_clients()
    ]
    assert sum(1 for n in on_nodes if n > 0) >= 2, on_nodes  # at least the shards' markers
    plain = redis.Redis.from_url(TEST_REDIS_URL)
    assert not list(plain.scan_iter(match="bridge:queue:*"))  # nothing of the ordering here
    plain.close()
    cluster.close()


def test_a_cluster_that_does_not_answer_is_named_by_readiness() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = readiness.probe(
        "redis-cluster",
        functools.partial(
            readiness.ping_redis_cluster,
            lambda: ordering_client("", [("127.0.0.1", port)], connect_timeout_s=1),
        ),
    )
    assert down is not None and str(down).startswith("The Redis Cluster is unreachable: ")
