"""What conversations take in and hand out: validated input, identifiers, results, reports."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StrictBool, StringConstraints, field_validator

from orderly.models import MessageState
from orderly.worker.channels import Channel
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.core.inputs import parse_timestamp

SERVICE = "conversation"
REQUEST_SOURCE = "bridge.request"
RESPONSE_SOURCE = "bridge.response"

ERROR_CANCELLED = "E_CANCELLED"
ERROR_RETRIES_SPENT = "E_RETRIES_SPENT"
ERROR_EXPIRED = "E_AWAITED_TTL"
ERROR_WORKER_LOST = "E_WORKER_LOST"
# Longest async_response_id a client may give (longer ones are delivered without an ACK).
MAX_ASYNC_ID = 255

# Ids become parts of Redis keys and of the Idempotency-Key header: letters, digits and
# . _ ~ @ + = - only (no ':' that could reach another key, nothing a header cannot carry).
ID_PATTERN = r"^[A-Za-z0-9._~@+=-]{1,100}$"
_ID_RE = re.compile(ID_PATTERN)
# Conversation ids that would name one of a shard's keys (<shard>:pendingMessages, ...).
RESERVED_CONVERSATION_IDS = frozenset(
    {"req", "res", "asyncRequest", "pendingMessages", "scheduled", "drains", "epoch"}
)
ID_RULE = "1 to 100 of A-Z a-z 0-9 . _ ~ @ + = -"

Id = Annotated[str, StringConstraints(strict=True, pattern=ID_PATTERN)]
# The seed's corr: a correlator the client gives with a request or a response (1 to 255
# characters, no control characters); kept on its Redis hash and its row (message.envelope).
CORR_PATTERN = r"^[^\x00-\x1f\x7f]{1,255}$"
Corr = Annotated[str, StringConstraints(strict=True, pattern=CORR_PATTERN)]


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("timestamp", mode="before", check_fields=False)
    @classmethod
    def _timestamp(cls, value: Any) -> datetime | None:
        if value is None:
            return None
        moment = parse_timestamp(value)
        try:
            year = moment.astimezone(UTC).year
        except (OverflowError, ValueError):
            year = 0
        if not 1970 <= year <= 9999:
            raise ValueError(f"{value!r} is out of range (years 1970 to 9999)")
        return moment


class RequestIn(_Input):
    request_id: Id
    origin: Id
    timestamp: datetime | None = None
    payload: Any = None
    corr: Corr | None = None


class ResponseIn(_Input):
    request_id: Id
    response_id: Id
    payload: Any
    timestamp: datetime | None = None
    last: StrictBool = False
    corr: Corr | None = None


def check_conversation_id(value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidMessage("conversation_id", f"must be {ID_RULE}")
    if value in RESERVED_CONVERSATION_IDS:
        raise InvalidMessage("conversation_id", f"{value!r} is reserved")
    return value


def payload_text(payload: Any, limit: int) -> str:
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise InvalidMessage("payload", "NaN and Infinity are not JSON") from None
    if len(text.encode()) > limit:
        raise InvalidMessage("payload", f"over the limit of {limit} bytes")
    return text


@dataclass(frozen=True)
class Registered:
    msg_id: int
    state: MessageState
    created: bool


class Delivery(enum.StrEnum):
    DELIVERED = "delivered"  # 2xx: the client has it
    ASYNC = "async"  # 202 with an async_response_id: delivered, the ACK follows
    RECOVERABLE = "recoverable"  # connection error, timeout, 5xx, 408, 425, 429: again
    FATAL = "fatal"  # any other answer: the group is cancelled


@dataclass(frozen=True)
class SendResult:
    kind: Delivery
    status: int | None = None
    async_response_id: str | None = None
    reason: str = ""
    # FATAL: the code the cancelled group's rows record (default ERROR_CANCELLED)
    error_code: str | None = None
    # RECOVERABLE: the client's Retry-After (429, 503), the next try's wait
    retry_after_ms: int | None = None


@dataclass(frozen=True)
class Head:
    """The response a drain claimed for sending."""

    conversation_id: str
    origin: str
    request_id: str
    response_id: str
    payload: Any
    msg_id: int
    request_msg_id: int
    last: bool
    attempt: int
    awaited_retries: int
    # Not None: late (its request expired, MESSAGE_TTL, before it came; it went after later
    # requests' responses); how long after the request's timestamp + MESSAGE_TTL it came.
    late_ms: int | None = None
    # Claims of this response that died with their worker (quarantined at the limit).
    lost: int = 0
    # When orderly took the response in (ms; None: a hash from before this field)
    received_ms: int | None = None
    # the traceparent of the span that took it in (worker.core.tracing), or None
    trace_parent: str | None = None


Sender = Callable[[Channel, Head], SendResult]
Enqueue = Callable[[str, str], None]  # (conversation_id, lease token): start a drain


@dataclass
class DrainReport:
    conversation_id: str
    delivered: int = 0
    sent_async: int = 0
    retried: int = 0
    awaited: int = 0
    cancelled: int = 0
    ack_timeouts: int = 0
    late: int = 0  # of the delivered and sent ones: late (Head.late_ms)
    end: str = ""


@dataclass(frozen=True)
class Gate:
    """The seed's CanSendResponse."""

    status: str
    first_response_id: str | None


@dataclass
class AgentReport:
    woken: list[str] = field(default_factory=list)
    taken: int = 0  # pendingMessages members this turn claimed
    expired: int = 0  # found in pendingMessages past AWAITED_MESSAGE_TTL
    vanished: int = 0  # in pendingMessages, but the hash had already expired
    swept: int = 0  # rows PostgreSQL still had open after their Redis lifetime
