"""What intake admits, and how: a submitted message validated (its fields, its size, a handler
for it), the caller's right to submit it, what the store keeps of it, whether it is stored
with others (a batch's statement, a group commit) or alone, and whether a submission under
ids already stored is the same message again."""

from __future__ import annotations

import json
from typing import Any

from orderly.worker.core import owners
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.owners import Owns
from orderly.worker.messages.handlers import HandlerRegistry
from orderly.worker.messages.inputs import MessageIn
from orderly.worker.messages.store import NewMessage


def parse_message(data: Any, *, max_payload_bytes: int, registry: HandlerRegistry) -> MessageIn:
    """Validate raw input; raise InvalidMessage naming every bad field."""
    message = parse_input(MessageIn, data)
    size = len(message.payload_text.encode("utf-8"))
    if size > max_payload_bytes:
        raise InvalidMessage(
            "payload", f"{size} bytes is over the limit of {max_payload_bytes} bytes"
        )
    if registry.get(message.service, message.operation) is None:
        if not registry.has_service(message.service):
            raise InvalidMessage("service", f"unknown service {message.service!r}")
        raise InvalidMessage(
            "operation", f"unknown operation {message.operation!r} of service {message.service!r}"
        )
    if message.exclude_failed_state and not message.guaranteed_order:
        raise InvalidMessage("exclude_failed_state", "only meaningful with guaranteed_order true")
    if message.delay_ms is not None and message.not_before is not None:
        raise InvalidMessage("not_before", "give delay_ms or not_before, not both")
    return message


def received(message: MessageIn) -> str:
    """The message's envelope: the producer's own, else the message as received (the JSON of
    the fields it gave), so that every row keeps its whole input (the seed's NOT NULL)."""
    if message.envelope is not None:
        return message.envelope
    return message.model_dump_json(exclude_unset=True)


def new_message(message: MessageIn, binding: str | None = None) -> NewMessage:
    """What the store keeps of a message (a child's binding to its parent: ``binding``)."""
    return NewMessage(
        msg_timestamp=message.msg_timestamp,
        service=message.service,
        operation=message.operation,
        object_id=message.object_id,
        entity_type=message.entity_type,
        correlation_id=message.correlation_id,
        process_id=message.process_id,
        payload=message.payload_text,
        envelope=received(message),
        source_system=message.source_system,
        parent_msg_id=message.parent_msg_id,
        binding=binding or ("HARD" if message.parent_msg_id is not None else None),
        funnel_value=message.funnel_value,
        funnel_component_id=message.funnel_component_id,
        guaranteed_order=message.guaranteed_order,
        exclude_failed_state=message.exclude_failed_state,
        delay_ms=message.delay_ms,
        not_before=message.not_before,
        priority=message.priority,
    )


def batchable(message: MessageIn) -> bool:
    """Whether a message is stored with others in one statement: one without a parent (whose
    existence its own insert checks). A funnel's messages are stored NEW that way; the claim
    holds back under the funnel's lock those that may not go yet (worker.messages.batches)."""
    return message.parent_msg_id is None


def groupable(message: MessageIn) -> bool:
    """A message a group of submits takes: no parent to check, no funnel to hold back under
    its lock at once (those go alone, as before)."""
    return message.parent_msg_id is None and message.funnel_value is None


def _same_payload(stored: str, given: str) -> bool:
    """Equal texts, or equal JSON values (a client may order an object's keys otherwise)."""
    if stored == given:
        return True
    try:
        return bool(json.loads(stored) == json.loads(given))
    except ValueError:
        return False


def differs(message: MessageIn, service: str, operation: str, payload: str) -> str:
    """What a submission under stored ids changes ("" when it is the same message again)."""
    changed = [
        name
        for name, same in (
            ("service", message.service == service),
            ("operation", message.operation == operation),
            ("payload", _same_payload(payload, message.payload_text)),
        )
        if not same
    ]
    return " and ".join(changed)


def require_owned(owns: Owns | None, message: MessageIn) -> None:
    """What a bound key may submit: messages of its source systems (else 404, as if the
    source system did not exist), in funnels named after one of them (``<source system>:...``)
    so that no tenant's message can hold up another's funnel."""
    owners.require_source_system(owns, message.source_system)
    funnel = message.funnel_value
    if owns is None or funnel is None:
        return
    if not any(funnel.startswith(f"{s}:") for s in owns.source_systems):
        raise InvalidMessage(
            "funnel_value",
            f"{funnel!r}: a bound key's funnel values begin with one of its source "
            f"systems and a colon (e.g. '{message.source_system}:{funnel}')",
        )
