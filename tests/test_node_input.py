"""A node not in RUN refuses new conversation input and publishes in the inserting statement
itself (the message store's intake is tested in test_intake)."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import Engine, text

from orderly.models import NodeState
from orderly.worker import nodes, pubsub
from orderly.worker.core.errors import NodeNotAccepting, UnknownRequest
from tests.helpers import count_messages
from tests.test_conversations import make

NOT_RUN = [NodeState.HANDLES_EXISTING_MESSAGES, NodeState.STOPPED]


@pytest.mark.parametrize("state", NOT_RUN)
def test_conversation_requests_and_responses_are_refused(
    db: Engine, redis_client: redis.Redis, state: NodeState
) -> None:
    h = make(db, redis_client)
    h.conv.register_request("c-1", {"request_id": "r-1", "origin": "chat"})
    nodes.set_state(db, "conversations-test", state)

    with pytest.raises(NodeNotAccepting, match=state.value):
        h.conv.register_request("c-1", {"request_id": "r-2", "origin": "chat"})
    response = {"request_id": "r-1", "response_id": "rs-1", "payload": {}, "last": True}
    with pytest.raises(NodeNotAccepting, match=state.value):
        h.conv.add_response("c-1", response, h.enqueue)
    # An unknown request is still named first; a stored request's repeat is answered.
    with pytest.raises(UnknownRequest):
        h.conv.add_response("c-1", {**response, "request_id": "nope"}, h.enqueue)
    assert not h.conv.register_request("c-1", {"request_id": "r-1", "origin": "chat"}).created
    assert count_messages(db) == 1 and h.started == []

    nodes.set_state(db, "conversations-test", NodeState.RUN)
    assert h.conv.add_response("c-1", response, h.enqueue).created


@pytest.mark.parametrize("state", NOT_RUN)
def test_publishes_through_the_node_are_refused(db: Engine, state: NodeState) -> None:
    node_id = nodes.register_node(db, "publish-test")
    pubsub.create_room(db, {"name": "r"})
    pubsub.create_subscription(db, "r", {"name": "s", "kind": "PUSH", "push_url": "http://x/i"})
    event = {"routing_key": "k", "payload": {}}
    pubsub.publish(db, "r", event, node_id=node_id)
    nodes.set_state(db, "publish-test", state)

    with pytest.raises(NodeNotAccepting, match=state.value):
        pubsub.publish(db, "r", event, node_id=node_id)
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM event")).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM delivery")).scalar_one() == 1
