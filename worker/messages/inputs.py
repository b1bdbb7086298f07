"""What a producer submits, validated: a message's fields (also a schedule's template), a
message, a batch of them (worker.messages.intake stores them)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.inputs import parse_timestamp

# The most messages one ``submit_many`` takes.
MAX_BATCH = 1000

# The longest a message may be scheduled ahead (a year and a day), and the priority range.
MAX_DELAY_MS = 366 * 86_400_000
MIN_PRIORITY, MAX_PRIORITY = -100, 100

Name = Annotated[
    str, StringConstraints(strict=True, strip_whitespace=True, min_length=1, max_length=100)
]
LongName = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=255)]


Payload = str | dict[str, Any] | list[Any]


class MessageFields(BaseModel):
    """What a message says of its work, as a producer gives it: submitted (MessageIn), or as
    a schedule's template (worker.messages.schedules)."""

    model_config = ConfigDict(extra="forbid")

    service: Name
    operation: Name
    source_system: Name
    payload: Payload
    object_id: Name | None = None
    entity_type: Name | None = None
    process_id: Name | None = None
    funnel_value: LongName | None = None
    funnel_component_id: LongName | None = None
    guaranteed_order: StrictBool = False
    exclude_failed_state: StrictBool = False


class MessageIn(MessageFields):
    """A message as a producer submits it."""

    correlation_id: Name
    msg_timestamp: datetime
    parent_msg_id: Annotated[StrictInt, Field(gt=0)] | None = None
    envelope: str | None = None
    # Scheduling: processed no earlier than ``delay_ms`` after intake, or than ``not_before``
    # (one of the two); the message waits durably in the store (its row's due time).
    delay_ms: Annotated[StrictInt, Field(ge=0, le=MAX_DELAY_MS)] | None = None
    not_before: datetime | None = None
    # Claims take higher priority first; funnel and guaranteed-order rules win over it.
    priority: Annotated[StrictInt, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)] = 0

    @field_validator("msg_timestamp", "not_before", mode="before")
    @classmethod
    def _timestamp(cls, value: Any) -> datetime | None:
        return None if value is None else parse_timestamp(value)

    @property
    def payload_text(self) -> str:
        if isinstance(self.payload, str):
            return self.payload
        return json.dumps(self.payload, separators=(",", ":"), ensure_ascii=False)


class MessageBatchIn(BaseModel):
    """Messages submitted together (``POST /messages:batch``, ``Intake.submit_many``)."""

    model_config = ConfigDict(extra="forbid")

    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=MAX_BATCH)]


def batch_items(data: Any) -> list[Any]:
    """The items of a batch body ``{"messages": [...]}``, each validated by ``submit_many``."""
    if not isinstance(data, dict):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"messages"})
    if unknown:
        raise InvalidMessage(unknown[0], "extra inputs are not permitted")
    if "messages" not in data:
        raise InvalidMessage("messages", "missing")
    items = data["messages"]
    if not isinstance(items, list):
        raise InvalidMessage("messages", f"must be a list, got {type(items).__name__}")
    return items
