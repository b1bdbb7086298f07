"""The rows conversations read from PostgreSQL (worker/db/sql/conversations.sql), as small
dataclasses built by column name (``PreparedConnection.one``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class RequestInserted:
    """``conv_insert_requests``: a request inserted; ``others_open``: its conversation had
    open rows before it."""

    msg_id: int
    request_id: str
    conversation_id: str
    others_open: bool


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
    """A response inserted (msg_id None: not inserted) and its request, known."""

    msg_id: int | None
    state: str | None
    request_msg_id: int
    request_state: str
    origin: str
    request_ts: datetime
    request_done: bool
    others_open: bool = False  # the conversation had other responses open before it


@dataclass(frozen=True)
class GroupedResponse:
    """``conv_insert_responses``: one row for each response of a group, in order; the
    response inserted (msg_id None: not inserted) and its request (None: unknown)."""

    msg_id: int | None
    state: str | None
    request_msg_id: int | None
    request_state: str | None
    origin: str | None
    request_ts: datetime | None
    request_done: bool | None
    others_open: bool | None

    def found(self) -> ResponseInserted | None:
        """The response (msg_id None: not inserted) and its request; None: the request is
        unknown."""
        if (
            self.request_msg_id is None
            or self.request_state is None
            or self.origin is None
            or self.request_ts is None
        ):
            return None
        return ResponseInserted(
            self.msg_id, self.state, self.request_msg_id, self.request_state, self.origin,
            self.request_ts, bool(self.request_done), bool(self.others_open),
        )  # fmt: skip


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
