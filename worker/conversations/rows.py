"""The rows conversations read from PostgreSQL (worker/db/sql/conversations.sql), as small
dataclasses built by column name (``PreparedConnection.one``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Inserted:
    """A request row inserted."""

    msg_id: int


@dataclass(frozen=True)
class Stored:
    """A request or response row found by its id (``conv_find``): a repeat meets it."""

    msg_id: int
    state: str
    conversation_id: str
    origin: str
    msg_timestamp: datetime
    request_msg_id: int | None  # a response's request
    age_ms: float


@dataclass(frozen=True)
class ResponseInserted:
    """``conv_insert_response``: the response inserted (msg_id None: not inserted) and its
    request."""

    msg_id: int | None
    state: str | None
    request_msg_id: int
    request_state: str
    origin: str
    request_ts: datetime
    request_done: bool


@dataclass(frozen=True)
class OperatorRow:
    """A request or response row an operator's operation acts on (``conv_op_find``)."""

    msg_id: int
    state: str
    conversation_id: str
    origin: str
    request_id: str | None
    request_msg_id: int | None
    corr: str | None


@dataclass(frozen=True)
class MsgId:
    msg_id: int
