"""Group commit beyond POST /messages: conversation requests and responses and publishes that
arrive together are stored with one commit, each answered after it with its own result or its
own refusal, against the real PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.worker import nodes, pubsub
from orderly.worker.channels import Channel, put_channel
from orderly.worker.conversations import Registered
from orderly.worker.core.addresses import AddressPolicy
from orderly.worker.core.errors import (
    InvalidMessage,
    NotFound,
    UnknownChannel,
    UnknownRequest,
)
from orderly.worker.core.group_commit import GroupCommit
from orderly.worker.core.owners import Owns
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.publish import Published
from orderly.worker.pubsub.publish_group import GroupedPublisher
from tests.helpers import group_writes
from tests.test_conversations import SINK, Harness, make
from tooling.servers import RedisServer

T = TypeVar("T")


@pytest.fixture
def h(db: Engine, redis_client: redis.Redis) -> Iterator[Harness]:
    yield make(db, redis_client, intake_group_max=64)


def together(
    group: GroupCommit[Any, Any] | None, calls: Sequence[Callable[[], Awaitable[T]]]
) -> tuple[list[T | BaseException], list[int]]:
    """The calls made at once on one loop, the first group's write held until every call
    queued: each call's outcome, and the sizes of the groups written."""
    assert group is not None
    gate = threading.Event()
    sizes = group_writes(group, gate)

    async def run() -> list[T | BaseException]:
        tasks = [asyncio.ensure_future(call()) for call in calls]
        while len(group._queue) + sum(sizes) < len(calls):
            await asyncio.sleep(0.001)
        gate.set()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    return asyncio.run(run()), sizes


def _rows(db: Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(text(sql), params))


def test_requests_together_share_one_insert_and_each_gets_its_own_answer(h: Harness) -> None:
    h.request("c0", "r-old")  # stored before: its repeat in the group answers 200

    def register(cid: str, rid: str, origin: str = "chat") -> Callable[[], Awaitable[Any]]:
        return lambda: h.conv.register_request_together(cid, {"request_id": rid, "origin": origin})

    calls = [register(f"c{i % 4}", f"r{i}") for i in range(20)]
    calls += [
        register("c9", "r-x", origin="nowhere"),  # unknown origin: refused alone
        register("c3", "r3"),  # the same request again in the same group
        register("c2", "r3"),  # its id in another conversation
        register("c0", "r-old"),
    ]
    answers, sizes = together(h.conv._requests, calls)
    assert max(sizes) >= 20, sizes  # one INSERT for the group (the first may be alone)
    registered = answers[:20]
    assert all(isinstance(a, Registered) and a.created for a in registered), registered
    assert isinstance(answers[20], UnknownChannel)
    again = answers[21]
    assert isinstance(again, Registered) and not again.created
    assert again.msg_id == registered[3].msg_id  # type: ignore[union-attr]
    assert isinstance(answers[22], InvalidMessage) and answers[22].field == "request_id"
    assert isinstance(answers[23], Registered) and not answers[23].created
    stored = _rows(
        h.engine,
        "SELECT correlation_id, process_id FROM message WHERE source_system = 'bridge.request'"
        " AND correlation_id <> 'r-old' ORDER BY msg_id",
    )
    # inserted in the order they came, each in its own conversation, nothing else
    assert [r.correlation_id for r in stored] == [f"r{i}" for i in range(20)]
    assert [r.process_id for r in stored] == [f"c{i % 4}" for i in range(20)]
    for c in range(4):  # and registered in Redis in that order
        listed = h.redis.lrange(h.k.request_list(f"c{c}"), 0, -1)
        want = [h.k.request(f"c{c}", f"r{i}").encode() for i in range(20) if i % 4 == c]
        assert listed[-len(want) :] == want


def test_two_callers_first_in_a_new_conversation_are_not_both_let_in(h: Harness) -> None:
    put_channel(h.engine, Channel("other", SINK, 10, 2.0, 2, 1000))
    mine, theirs = Owns(origins=frozenset({"chat"})), Owns(origins=frozenset({"other"}))
    calls = [
        lambda: h.conv.register_request_together(
            "fresh", {"request_id": "a", "origin": "chat"}, mine
        ),
        lambda: h.conv.register_request_together(
            "fresh", {"request_id": "b", "origin": "other"}, theirs
        ),
    ]
    answers, _ = together(h.conv._requests, calls)
    assert isinstance(answers[0], Registered) and answers[0].created
    assert isinstance(answers[1], NotFound)  # the conversation holds another's request
    found = _rows(h.engine, "SELECT entity_type FROM message WHERE process_id = 'fresh'")
    assert [r.entity_type for r in found] == ["chat"]


def test_responses_together_keep_their_order_and_refuse_only_their_own(h: Harness) -> None:
    h.request("c1", "r1")
    h.request("c2", "r2")

    def respond(
        cid: str, rid: str, sid: str, owns: Owns | None = None
    ) -> Callable[[], Awaitable[Any]]:
        body = {"request_id": rid, "response_id": sid, "payload": {"text": sid}}
        return lambda: h.conv.add_response_together(cid, body, h.enqueue, owns)

    calls = [respond("c1", "r1", f"s{i}") for i in range(25)]
    calls += [
        respond("c2", "r2", "t0"),
        respond("c1", "r-none", "u0"),  # no such request
        respond("c1", "r1", "s5"),  # the same response again in the same group
        respond("c2", "r2", "v0", Owns(origins=frozenset({"other"}))),  # another's request
    ]
    answers, sizes = together(h.conv._responses, calls)
    assert max(sizes) >= 25, sizes
    assert all(isinstance(a, Registered) and a.created for a in answers[:26]), answers
    assert isinstance(answers[26], UnknownRequest)
    repeat = answers[27]
    assert isinstance(repeat, Registered) and not repeat.created
    assert repeat.msg_id == answers[5].msg_id  # type: ignore[union-attr]
    assert isinstance(answers[28], UnknownRequest)
    ids = [a.msg_id for a in answers[:25]]  # type: ignore[union-attr]
    assert ids == sorted(ids)  # stored in the order they came
    order = [str(m) for m in h.redis.zrange(h.k.response_list("c1"), 0, -1)]
    assert [f'"rsId":"s{i}"' in m for i, m in enumerate(order)] == [True] * 25
    # one drain each conversation, started by the response that took its lease
    assert sorted(cid for cid, _ in h.started) == ["c1", "c2"]
    assert not _rows(h.engine, "SELECT 1 FROM message WHERE correlation_id IN ('u0', 'v0')")


@pytest.fixture
def publisher(db: Engine) -> tuple[GroupedPublisher, list[list[int]]]:
    pubsub.create_room(db, {"name": "r"})
    pubsub.create_room(db, {"name": "named"})
    pubsub.add_publisher(db, "named", {"name": "billing"})
    for room in ("r", "named"):
        pubsub.create_subscription(
            db,
            room,
            {"name": "push", "kind": "PUSH", "push_url": "http://127.0.0.1:9/"},
            policy=AddressPolicy.parse("127.0.0.1"),
        )
    handed: list[list[int]] = []
    grouped = GroupedPublisher(
        db,
        handed.append,
        node_id=nodes.register_node(db, "publish-test"),
        secret="",
        token_ttl_ms=60_000,
        max_payload_bytes=10_000,
        schema_limits=schemas.configured_limits(),
        group_max=64,
    )
    return grouped, handed


def test_publishes_together_share_one_transaction_and_one_hand_off(
    db: Engine, publisher: tuple[GroupedPublisher, list[list[int]]]
) -> None:
    grouped, handed = publisher

    def publish(room: str, **body: Any) -> Callable[[], Awaitable[Published]]:
        data = {"routing_key": "a.b", "payload": {"n": 1}, **body}
        return lambda: grouped.publish(room, data)

    calls = [publish("r", payload={"n": i}) for i in range(20)]
    calls += [
        publish("nowhere"),  # no such room
        publish("named"),  # a room that names its publishers
        publish("named", publisher="billing"),
        publish("r", routing_key="bad key"),
    ]
    answers, sizes = together(grouped._group, calls)
    assert max(sizes) >= 20, sizes
    published = [*answers[:20], answers[22]]
    assert all(isinstance(p, Published) and p.created for p in published), answers
    assert isinstance(answers[20], NotFound)
    assert isinstance(answers[21], InvalidMessage) and answers[21].field == "publisher"
    assert isinstance(answers[23], InvalidMessage) and answers[23].field == "routing_key"
    payloads = _rows(db, "SELECT payload FROM event e JOIN room r USING (room_id) "
                         "WHERE r.name = 'r' ORDER BY event_id")  # fmt: skip
    assert [p.payload for p in payloads] == [{"n": i} for i in range(20)]
    deliveries = [d for p in published for d in p.deliveries]  # type: ignore[union-attr]
    assert len(deliveries) == 21 == len(set(deliveries))
    # handed to the broker after the commit, together (not one task a publish)
    assert sorted(d for batch in handed for d in batch) == sorted(deliveries)
    assert len(handed) <= 2


def test_a_publish_with_an_idempotency_key_is_stored_alone_and_once(
    db: Engine, publisher: tuple[GroupedPublisher, list[list[int]]]
) -> None:
    grouped, handed = publisher
    body = {"routing_key": "a", "payload": {}}

    async def twice() -> list[Published]:
        return [await grouped.publish("r", body, idempotency_key="k1") for _ in range(2)]

    first, again = asyncio.run(twice())
    assert first.created and not again.created and again.event_id == first.event_id
    assert [d for batch in handed for d in batch] == first.deliveries


def test_a_key_cannot_register_in_another_tenants_conversation_through_a_group(
    h: Harness,
) -> None:
    """The same request id in another tenant's conversation and in the caller's own, in one
    group: the statement refuses the first and inserts the second; the first, stored alone
    after it, is refused (its id is taken now: as if it came second), the second is 201, and
    nothing joins the other tenant's conversation in Redis."""
    put_channel(h.engine, Channel("other", SINK, 10, 2.0, 2, 1000))
    mine, theirs = Owns(origins=frozenset({"chat"})), Owns(origins=frozenset({"other"}))
    h.conv.register_request("victim", {"request_id": "v1", "origin": "other"}, theirs)
    calls = [
        lambda: h.conv.register_request_together(
            "victim", {"request_id": "x", "origin": "chat"}, mine
        ),
        lambda: h.conv.register_request_together(
            "own", {"request_id": "x", "origin": "chat"}, mine
        ),
    ]
    answers, sizes = together(h.conv._requests, calls)
    assert sizes == [2]
    assert isinstance(answers[0], InvalidMessage) and "'own'" in str(answers[0]), answers[0]
    assert isinstance(answers[1], Registered) and answers[1].created, answers[1]
    assert h.redis.lrange(h.k.request_list("victim"), 0, -1) == [
        h.k.request("victim", "v1").encode()
    ]
    found = _rows(h.engine, "SELECT process_id FROM message WHERE correlation_id = 'x'")
    assert [r.process_id for r in found] == ["own"]


def test_redis_down_fails_only_those_of_a_group_that_need_it(
    db: Engine, redis_server: RedisServer
) -> None:
    """Redis stops between the group's rows and their scripts: the stored ones answer the
    error (a repeat puts them in Redis), the others are answered as alone (their refusals
    need no Redis)."""
    client = redis_server.client()
    h = make(db, client, intake_group_max=64)
    h.request("c1", "r1")
    put_channel(h.engine, Channel("gone", SINK, 10, 2.0, 2, 1000))
    body = {"request_id": "r1", "response_id": "s1", "payload": {}}
    unknown = {"request_id": "nope", "response_id": "s2", "payload": {}}
    assert h.conv._responses is not None
    gate = threading.Event()
    sizes = group_writes(h.conv._responses, gate)

    async def run() -> list[Any]:
        tasks = [
            asyncio.ensure_future(h.conv.add_response_together("c1", body, h.enqueue)),
            asyncio.ensure_future(h.conv.add_response_together("c1", unknown, h.enqueue)),
        ]
        while len(h.conv._responses._queue) + sum(sizes) < 2:  # type: ignore[union-attr]
            await asyncio.sleep(0.001)
        redis_server.stop()
        gate.set()
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    answers = asyncio.run(run())
    assert isinstance(answers[0], redis.ConnectionError), answers[0]
    assert isinstance(answers[1], UnknownRequest), answers[1]
    stored = _rows(db, "SELECT state FROM message WHERE correlation_id = 's1'")
    assert [r.state for r in stored] == ["IN_QUEUE"]  # stored: its repeat queues it
    redis_server.start()
    again = h.conv.add_response("c1", body, h.enqueue)
    assert not again.created and h.redis.exists(h.k.response("c1", "s1"))
