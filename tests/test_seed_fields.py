"""Seed fields that worked only when driven from outside: each against PostgreSQL and Redis.

The obsolete check without an entity type (async-message-tables: the operation name stands in
for it), ``process_id`` (stored, copied to children, searchable), ``funnel_component_id``
(components of one funnel value run side by side; one component waits), the request table's
(uri, res_join_id) upsert through ``ctx.post``, and serviceNamespace / serviceRedis (the
tracking keys under their namespace on a Redis of their own).
"""

from __future__ import annotations

import json

import redis
from sqlalchemy import Engine, text

from orderly.worker.db.prepared import prepared_connection
from orderly.worker.messages import operations
from orderly.worker.messages.batches import claim_due, process_message
from orderly.worker.messages.handlers import HandlerRegistry, MessageContext
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome
from orderly.worker.runtime import Runtime, get_runtime
from orderly.worker.settings import Settings
from tests.conftest import TEST_DB_URL, TEST_REDIS_URL
from tests.helpers import message, processor, row
from tests.push_recorder import Recorder
from tooling.servers import RedisServer


def test_without_an_entity_type_the_operation_names_the_object(db: Engine, intake: Intake) -> None:
    newer = intake.submit(message(5, object_id="o-1")).msg_id
    older = intake.submit(message(1, object_id="o-1")).msg_id
    other_operation = intake.submit(message(2, object_id="o-1", operation="say")).msg_id
    typed = intake.submit(message(3, object_id="o-1", entity_type="customer")).msg_id
    assert process_message(processor(db), newer).outcome is Outcome.OK
    assert process_message(processor(db), older).outcome is Outcome.OBSOLETE
    assert row(db, older).obsolete_by == newer
    # the same object id under another operation, or with a type, is another object
    assert process_message(processor(db), other_operation).outcome is Outcome.OK
    assert process_message(processor(db), typed).outcome is Outcome.OK
    assert row(db, other_operation).obsolete_by is None and row(db, typed).obsolete_by is None


def test_process_id_is_stored_copied_to_children_and_searchable(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    parent = intake.submit(
        message(
            1,
            operation="split",
            process_id="proc-7",
            payload=json.dumps({"children": [{"operation": "script"}]}),
        )
    ).msg_id
    intake.submit(message(2, process_id="proc-8"))
    intake.submit(message(3))
    assert row(db, parent).process_id == "proc-7"
    assert process_message(processor(db), parent).outcome is Outcome.WAITING  # its child
    with db.connect() as conn:
        child = conn.execute(
            text("SELECT msg_id, process_id FROM message WHERE parent_msg_id = :p"),
            {"p": parent},
        ).one()
    assert child.process_id == "proc-7"
    found = operations.list_messages(db, process_id="proc-7")
    assert sorted(r["msg_id"] for r in found) == sorted([parent, child.msg_id])
    assert [r["msg_id"] for r in operations.list_messages(db, process_id="proc-9")] == []


def test_components_of_one_funnel_run_side_by_side_and_one_component_waits(
    db: Engine, intake: Intake
) -> None:
    first = intake.submit(message(1, funnel_value="f", funnel_component_id="c1")).msg_id
    second = intake.submit(message(2, funnel_value="f", funnel_component_id="c1")).msg_id
    other = intake.submit(message(3, funnel_value="f", funnel_component_id="c2")).msg_id
    with prepared_connection(db) as conn:
        rows, due = claim_due(conn, get_runtime().node_id, 10, 5)
        running = sorted(r.msg_id for r in rows if r.running)
    assert due == 3 and running == sorted([first, other])
    assert row(db, second).state == "POSTPONED"  # behind the first of its component


def test_ctx_post_keeps_one_request_row_per_uri_and_join_id(
    db: Engine, intake: Intake, recorder: Recorder
) -> None:
    reg = HandlerRegistry()

    @reg.register("test", "call")  # submitted as test.call, run by this handler
    def post(ctx: MessageContext) -> None:
        ctx.post(recorder.base + "/exchange", {"n": ctx.correlation_id}, res_join_id="join-1")

    ids = [intake.submit(message(n, operation="call")).msg_id for n in (1, 2)]
    for msg_id in ids:
        assert process_message(processor(db, reg), msg_id).outcome is Outcome.OK
    with db.connect() as conn:
        requests = conn.execute(
            text("SELECT req_id, msg_id, uri, res_join_id, req_envelope FROM request")
        ).all()
        responses = conn.execute(text("SELECT req_id, msg_id, failed FROM response")).all()
    assert len(recorder.arrivals) == 2
    # the second exchange under the same (uri, res_join_id) updated the row: now the second's
    assert len(requests) == 1
    assert requests[0].msg_id == ids[1] and requests[0].res_join_id == "join-1"
    assert json.loads(requests[0].req_envelope) == {"n": "corr-2"}
    assert sorted(r.msg_id for r in responses) == ids
    assert {r.req_id for r in responses} == {requests[0].req_id}


def test_tracking_keys_go_under_their_namespace_to_their_own_redis(
    db: Engine, redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    settings = Settings(
        database_url=TEST_DB_URL,
        redis_url=TEST_REDIS_URL,
        track_namespace="demo:mpush",
        track_redis_url=redis_server.url,
    )
    runtime = Runtime(settings)
    track_id = runtime.tracker.register(12345)
    assert track_id > 0
    own = redis_server.client()
    assert own.hgetall("demo:mpush:message:xid:12345") == {
        b"id": str(track_id).encode(),
        b"type": b"number",
    }
    assert own.exists(f"demo:mpush:message:{track_id}")
    assert redis_client.keys("demo:mpush:*") == []  # ORDERLY_REDIS_URL's: nothing of it
    assert redis_client.keys("orderly:track:*") == []
