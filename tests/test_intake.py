"""Intake through the Python API against the real store."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine

from orderly.models import MessageState, NodeState
from orderly.worker import nodes
from orderly.worker.core.errors import ConflictingMessage, InvalidMessage, NodeNotAccepting
from orderly.worker.handlers import registry
from orderly.worker.messages.intake import Intake
from orderly.worker.runtime import get_runtime
from tests.helpers import count_messages, message, row


class Recorder:
    """Collects what intake hands to the queue (the queue itself is tested end to end)."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, msg_id: int) -> None:
        self.ids.append(msg_id)


@pytest.fixture
def sent() -> Recorder:
    return Recorder()


@pytest.fixture
def intake(db: Engine, sent: Recorder) -> Intake:
    runtime = get_runtime()
    _ = runtime.registry
    return Intake(
        db, node_id=runtime.node_id, enqueue=sent, registry=registry, max_payload_bytes=1000
    )


def test_accepts_a_message_as_new_with_receive_timestamp(
    intake: Intake, db: Engine, sent: Recorder
) -> None:
    result = intake.submit(message(1, funnel_value="f1", object_id="o1", process_id="p"))
    assert result.created and result.state is MessageState.NEW
    stored = row(db, result.msg_id)
    assert stored.state is MessageState.NEW
    assert stored.receive_timestamp is not None
    assert stored.funnel_value == "f1" and stored.object_id == "o1"
    assert stored.node_id == get_runtime().node_id
    assert sent.ids == [result.msg_id]


def test_json_payload_is_stored_as_text(intake: Intake, db: Engine) -> None:
    result = intake.submit(message(1, payload={"a": [1, 2]}))
    assert row(db, result.msg_id).payload == '{"a":[1,2]}'


def test_duplicate_is_idempotent(intake: Intake, db: Engine, sent: Recorder) -> None:
    first = intake.submit(message(1, payload={"a": 1, "b": [2, 3]}))
    again = intake.submit(message(1, payload={"b": [2, 3], "a": 1}))  # the same JSON value
    assert again.msg_id == first.msg_id and not again.created
    assert count_messages(db) == 1
    assert sent.ids == [first.msg_id]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"payload": "different"}, "payload"),
        ({"payload": {"a": 2, "b": [2, 3]}}, "payload"),
        ({"operation": "extcall"}, "operation"),
    ],
)
def test_a_resubmission_with_other_content_is_refused_naming_the_stored_message(
    intake: Intake, db: Engine, sent: Recorder, change: dict[str, Any], named: str
) -> None:
    first = intake.submit(message(1, payload={"a": 1, "b": [2, 3]}))
    with pytest.raises(ConflictingMessage) as refused:
        intake.submit(message(1, **change))
    assert refused.value.msg_id == first.msg_id
    assert f"message {first.msg_id} holds correlation_id 'corr-1'" in str(refused.value)
    assert f"another {named}" in str(refused.value)
    assert count_messages(db) == 1 and sent.ids == [first.msg_id]
    assert row(db, first.msg_id).payload == '{"a":1,"b":[2,3]}'  # the stored one stands


def test_same_correlation_from_another_system_is_a_new_message(intake: Intake, db: Engine) -> None:
    intake.submit(message(1))
    intake.submit(message(1, source_system="erp"))
    assert count_messages(db) == 2


BAD_INPUTS: list[tuple[str, Any, str, str]] = [
    ("not an object", ["a list"], "body", "JSON object"),
    (
        "missing service",
        {k: v for k, v in message(1).items() if k != "service"},
        "service",
        "missing",
    ),
    (
        "missing payload",
        {k: v for k, v in message(1).items() if k != "payload"},
        "payload",
        "missing",
    ),
    ("service mistyped", message(1, service=5), "service", "string"),
    ("empty correlation id", message(1, correlation_id=""), "correlation_id", "at least 1"),
    ("unknown service", message(1, service="nosuch"), "service", "unknown service 'nosuch'"),
    (
        "unknown operation",
        message(1, operation="nosuch"),
        "operation",
        "unknown operation 'nosuch'",
    ),
    (
        "timestamp does not parse",
        message(1, msg_timestamp="yesterday"),
        "msg_timestamp",
        "not an ISO 8601",
    ),
    ("timestamp is a number", message(1, msg_timestamp=12), "msg_timestamp", "ISO 8601"),
    ("payload too large", message(1, payload="x" * 1001), "payload", "over the limit of 1000"),
    (
        "guaranteed_order not a bool",
        message(1, guaranteed_order="yes"),
        "guaranteed_order",
        "boolean",
    ),
    ("parent id negative", message(1, parent_msg_id=-3), "parent_msg_id", "greater than 0"),
    ("parent does not exist", message(1, parent_msg_id=999), "parent_msg_id", "no message 999"),
    ("unknown field", message(1, colour="red"), "colour", "unknown field"),
    (
        "correlation id too long",
        message(1, correlation_id="c" * 101),
        "correlation_id",
        "at most 100",
    ),
    (
        "exclude_failed without guaranteed order",
        message(1, exclude_failed_state=True),
        "exclude_failed_state",
        "guaranteed_order",
    ),
]


@pytest.mark.parametrize(
    ("case", "data", "field", "problem"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_written(
    intake: Intake, db: Engine, sent: Recorder, case: str, data: Any, field: str, problem: str
) -> None:
    with pytest.raises(InvalidMessage) as info:
        intake.submit(data)
    assert info.value.field == field, info.value
    assert problem in str(info.value), info.value
    assert count_messages(db) == 0
    assert sent.ids == []


def test_all_bad_fields_are_named_at_once(intake: Intake) -> None:
    with pytest.raises(InvalidMessage) as info:
        intake.submit(message(1, service=1, guaranteed_order="no"))
    assert {f for f, _ in info.value.problems} == {"service", "guaranteed_order"}


def test_naive_timestamp_is_taken_as_utc(intake: Intake, db: Engine) -> None:
    result = intake.submit(message(1, msg_timestamp="2026-03-01T10:00:00"))
    assert row(db, result.msg_id).msg_timestamp.isoformat() == "2026-03-01T10:00:00+00:00"


@pytest.mark.parametrize("state", [NodeState.HANDLES_EXISTING_MESSAGES, NodeState.STOPPED])
def test_a_node_that_does_not_run_refuses_new_input(
    intake: Intake, db: Engine, sent: Recorder, state: NodeState
) -> None:
    known = intake.submit(message(1))
    nodes.set_state(db, get_runtime().settings.node_code, state)
    with pytest.raises(NodeNotAccepting, match=state.value):
        intake.submit(message(2))
    # a duplicate of a stored message still answers with it: nothing new is accepted
    assert intake.submit(message(1)).msg_id == known.msg_id
    assert count_messages(db) == 1
    assert sent.ids == [known.msg_id]


def test_child_of_an_existing_message_is_bound_hard(intake: Intake, db: Engine) -> None:
    parent = intake.submit(message(1))
    child = intake.submit(message(2, parent_msg_id=parent.msg_id))
    assert row(db, child.msg_id).parent_binding_type == "HARD"
