"""Ordered conversation delivery: requests, responses, the ordering gate, sends and ACKs.

PostgreSQL holds every request and response as a ``message`` row (the durable truth); Redis
holds the seed's ordering structures, changed only by the Lua scripts in ``worker/lua``. A
conversation is delivered by one drain at a time (its lease): the drain settles the previous
send and claims the next head in one script call, so a successor leaves the moment its
predecessor is delivered or ACKed, without polling.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import redis
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StringConstraints,
    ValidationError,
    field_validator,
)
from sqlalchemy import Engine

from models import MessageState
from models.keys import BridgeKeys, min_message_info
from worker.channels import Channel, ChannelDirectory
from worker.errors import InvalidMessage, UnknownAck, UnknownRequest
from worker.intake import invalid_from, parse_timestamp
from worker.prepared import Prepared, PreparedSet
from worker.scripts import Scripts
from worker.settings import Settings

log = logging.getLogger(__name__)

SERVICE = "conversation"
REQUEST_SOURCE = "bridge.request"
RESPONSE_SOURCE = "bridge.response"

ERROR_CANCELLED = "E_CANCELLED"
ERROR_RETRIES_SPENT = "E_RETRIES_SPENT"
ERROR_EXPIRED = "E_AWAITED_TTL"
# Longest async_response_id a client may give (longer ones are delivered without an ACK).
MAX_ASYNC_ID = 255
# How long an ACK for an id not (yet) known waits for the 202 to be recorded: ~130 ms.
ACK_GRACE_S = (0.001, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)

# Ids become parts of Redis keys and of the Idempotency-Key header: letters, digits and
# . _ ~ @ + = - only (no ':' that could reach another key, nothing a header cannot carry).
ID_PATTERN = r"^[A-Za-z0-9._~@+=-]{1,100}$"
_ID_RE = re.compile(ID_PATTERN)
# Conversation ids that would name one of the shared keys (bridge:queue:pendingMessages, ...).
RESERVED_CONVERSATION_IDS = frozenset(
    {"req", "res", "asyncRequest", "pendingMessages", "scheduled"}
)
ID_RULE = "1 to 100 of A-Z a-z 0-9 . _ ~ @ + = -"

Id = Annotated[str, StringConstraints(strict=True, pattern=ID_PATTERN)]


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


class ResponseIn(_Input):
    request_id: Id
    response_id: Id
    payload: Any
    timestamp: datetime | None = None
    last: StrictBool = False


T = TypeVar("T", bound=BaseModel)


def parse_input(model: type[T], data: Any) -> T:
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise invalid_from(exc) from None


def _check_conversation_id(value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidMessage("conversation_id", f"must be {ID_RULE}")
    if value in RESERVED_CONVERSATION_IDS:
        raise InvalidMessage("conversation_id", f"{value!r} is reserved")
    return value


def _payload_text(payload: Any, limit: int) -> str:
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise InvalidMessage("payload", "NaN and Infinity are not JSON") from None
    if len(text.encode()) > limit:
        raise InvalidMessage("payload", f"over the limit of {limit} bytes")
    return text


def _ms(moment: datetime | None) -> int:
    return int((moment.timestamp() if moment else time.time()) * 1000)


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


# --- PostgreSQL --------------------------------------------------------------------------

_NOT_FINAL = "state NOT IN ('OK', 'FAILED', 'CANCEL')"

STATEMENTS = (
    Prepared(
        "conv_insert_request",
        ("text", "text", "text", "timestamptz", "text", "bigint"),
        f"""
        INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                             service_name, operation_name, object_id, entity_type,
                             correlation_id, process_id, payload, source_system, state, node_id)
        VALUES ($4, now(), now(), '{SERVICE}', 'request', $1, $3, $1, $2, $5,
                '{REQUEST_SOURCE}', 'WAITING_FOR_RES', $6)
        ON CONFLICT (correlation_id, source_system) DO NOTHING
        RETURNING msg_id
        """,
    ),
    Prepared(
        "conv_find",
        ("text", "text"),
        """
        SELECT msg_id, state, process_id, entity_type, msg_timestamp, parent_msg_id,
               extract(epoch FROM now() - receive_timestamp) * 1000
          FROM message WHERE correlation_id = $1 AND source_system = $2
        """,
    ),
    # The response row is made from its request's row, in its conversation; a response of a
    # cancelled request is born cancelled. No row back: unknown request or a duplicate.
    Prepared(
        "conv_insert_response",
        ("text", "text", "text", "timestamptz", "text", "bigint"),
        f"""
        WITH r AS (
            SELECT msg_id, state, process_id, entity_type, msg_timestamp FROM message
             WHERE correlation_id = $2 AND source_system = '{REQUEST_SOURCE}'
               AND process_id = $3),
        ins AS (
            INSERT INTO message (msg_timestamp, receive_timestamp, last_process_timestamp,
                                 service_name, operation_name, object_id, entity_type,
                                 correlation_id, process_id, payload, source_system, state,
                                 failed_error_code, failed_desc, node_id,
                                 parent_msg_id, parent_binding_type)
            SELECT $4, now(), now(), '{SERVICE}', 'response', $2, r.entity_type, $1, $3, $5,
                   '{RESPONSE_SOURCE}',
                   CASE WHEN r.state = 'CANCEL' THEN 'CANCEL' ELSE 'IN_QUEUE' END,
                   CASE WHEN r.state = 'CANCEL' THEN '{ERROR_CANCELLED}' END,
                   CASE WHEN r.state = 'CANCEL' THEN 'its request was cancelled' END,
                   $6, r.msg_id, 'HARD'
              FROM r
            ON CONFLICT (correlation_id, source_system) DO NOTHING
            RETURNING msg_id, state)
        SELECT ins.msg_id, ins.state, r.msg_id, r.state, r.entity_type, r.msg_timestamp
          FROM r LEFT JOIN ins ON true
        """,
    ),
    # Delivered (2xx, ACK, or no ACK within SENT_MESSAGE_TTL): the response, and its request
    # when this was the request's final response.
    Prepared(
        "conv_ok",
        ("bigint[]", "text"),
        f"""
        UPDATE message SET state = 'OK', last_process_timestamp = now(),
                           custom_data = COALESCE($2, custom_data)
         WHERE msg_id = ANY($1) AND {_NOT_FINAL}
        """,
        # Like the claim, the mark commits without waiting for the disk: a worker that dies
        # right after it loses nothing; only a database server crash in the next moment could
        # lose the mark (never the delivery itself).
        prefix="SET LOCAL synchronous_commit TO OFF; ",
    ),
    Prepared(
        "conv_sent",
        ("bigint", "text"),
        """
        UPDATE message SET state = 'WAITING_FOR_RES', last_process_timestamp = now(),
                           custom_data = 'asyncResponseId=' || $2
         WHERE msg_id = $1 AND state = 'IN_QUEUE'
        """,
    ),
    Prepared(
        "conv_group_awaited",
        ("bigint", "text", "text"),
        """
        UPDATE message SET state = 'PARTLY_FAILED', failed_count = failed_count + 1,
                           failed_error_code = $2, failed_desc = $3,
                           last_process_timestamp = now()
         WHERE parent_msg_id = $1 AND state IN ('IN_QUEUE', 'PARTLY_FAILED')
        """,
    ),
    Prepared(
        "conv_back_in_queue",
        ("bigint",),
        """
        UPDATE message SET state = 'IN_QUEUE', last_process_timestamp = now()
         WHERE msg_id = $1 AND state = 'PARTLY_FAILED'
        """,
    ),
    Prepared(
        "conv_group_cancel",
        ("bigint", "text", "text"),
        f"""
        UPDATE message SET state = 'CANCEL', failed_error_code = $2, failed_desc = $3,
                           last_process_timestamp = now()
         WHERE (parent_msg_id = $1 OR msg_id = $1) AND {_NOT_FINAL}
        """,
    ),
    Prepared(
        "conv_failed",
        ("bigint[]", "text", "text"),
        f"""
        UPDATE message SET state = 'FAILED', failed_error_code = $2, failed_desc = $3,
                           last_process_timestamp = now()
         WHERE msg_id = ANY($1) AND {_NOT_FINAL}
        """,
    ),
    Prepared(
        "conv_failed_by_response",
        ("text[]", "text", "text"),
        f"""
        UPDATE message SET state = 'FAILED', failed_error_code = $2, failed_desc = $3,
                           last_process_timestamp = now()
         WHERE correlation_id = ANY($1) AND source_system = '{RESPONSE_SOURCE}' AND {_NOT_FINAL}
        """,
    ),
    # Responses whose Redis lifetime (AWAITED_MESSAGE_TTL) is over can no longer be sent:
    # FAILED; one the client took with a 202 and never ACKed counts as delivered.
    Prepared(
        "conv_expire_responses",
        ("double precision",),
        f"""
        UPDATE message
           SET state = CASE WHEN state = 'WAITING_FOR_RES' THEN 'OK' ELSE 'FAILED' END,
               failed_error_code = CASE WHEN state = 'WAITING_FOR_RES' THEN failed_error_code
                                        ELSE '{ERROR_EXPIRED}' END,
               failed_desc = CASE WHEN state = 'WAITING_FOR_RES' THEN failed_desc
                                  ELSE 'AWAITED_MESSAGE_TTL spent before delivery' END,
               last_process_timestamp = now()
         WHERE state IN ('IN_QUEUE', 'PARTLY_FAILED', 'WAITING_FOR_RES')
           AND last_process_timestamp < now() - make_interval(secs => $1)
           AND service_name = '{SERVICE}' AND operation_name = 'response'
        """,
    ),
    # Requests that never got a final response: closed once nothing of theirs can be alive.
    Prepared(
        "conv_close_requests",
        ("double precision",),
        f"""
        UPDATE message SET state = 'OK', last_process_timestamp = now(),
                           custom_data = 'closed without a final response'
         WHERE service_name = '{SERVICE}' AND operation_name = 'request'
           AND state = 'WAITING_FOR_RES'
           AND last_process_timestamp < now() - make_interval(secs => $1)
           AND NOT EXISTS (SELECT 1 FROM message c
                            WHERE c.parent_msg_id = message.msg_id AND c.{_NOT_FINAL})
        """,
    ),
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _json_list(value: Any) -> list[Any]:
    # cjson encodes an empty Lua table as {}.
    return value if isinstance(value, list) else []


class Conversations:
    """The mechanism; faces pass ``enqueue`` (start a drain) and ``send`` (one HTTP POST)."""

    def __init__(
        self,
        engine: Engine,
        client: redis.Redis,
        settings: Settings,
        *,
        node_id: int,
        channels: ChannelDirectory,
    ) -> None:
        self._engine = engine
        self._redis = client
        self._s = settings
        self._node_id = node_id
        self._channels = channels
        self._scripts = Scripts(client)
        self._pg = PreparedSet(engine, STATEMENTS)
        self.keys = BridgeKeys(settings.bridge_prefix)

    # --- derived timings (milliseconds) --------------------------------------------------
    @property
    def lease_ms(self) -> int:
        return self._s.max_pending_ttl

    @property
    def inflight_ms(self) -> int:
        return self._s.max_pending_ttl + self._s.max_pending_ttl_margin

    @property
    def blocked_ms(self) -> int:
        """A response still blocked after the seed's validation budget becomes AWAITED."""
        return max(1, self._s.max_retries * self._s.interval)

    @property
    def awaited_step_ms(self) -> float:
        return self._s.max_pending_ttl * self._s.awaited_retries_factor

    # --- requests ------------------------------------------------------------------------
    def register_request(self, conversation_id: str, data: Any) -> Registered:
        """createConversationRegister: the request waits (WAITING) for its responses."""
        _check_conversation_id(conversation_id)
        req = parse_input(RequestIn, data)
        self._channels.get(req.origin)  # UnknownChannel before anything is written
        payload = _payload_text(req.payload, self._s.max_payload_bytes)
        timestamp_ms = _ms(req.timestamp)
        moment = datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC)
        with self._pg.connection() as conn:
            row = conn.run(
                "conv_insert_request",
                req.request_id,
                conversation_id,
                req.origin,
                moment,
                payload,
                self._node_id,
            )
            if row is None:
                found = conn.run("conv_find", req.request_id, REQUEST_SOURCE)
                assert found is not None
                msg_id, state, owner, origin, moment, _, age_ms = found
                if owner != conversation_id:
                    raise InvalidMessage(
                        "request_id", f"{req.request_id!r} belongs to conversation {owner!r}"
                    )
                if state == MessageState.WAITING_FOR_RES and age_ms < self._s.message_ttl:
                    # A repeat after a failure between the row and Redis: register it there
                    # now (the script does nothing if it is registered already).
                    self._register_in_redis(
                        conversation_id, origin, req.request_id, _ms(moment), int(msg_id)
                    )
                return Registered(int(msg_id), MessageState(state), created=False)
        self._register_in_redis(
            conversation_id, req.origin, req.request_id, timestamp_ms, int(row[0])
        )
        return Registered(int(row[0]), MessageState.WAITING_FOR_RES, created=True)

    def _register_in_redis(
        self, conversation_id: str, origin: str, request_id: str, timestamp_ms: int, msg_id: int
    ) -> None:
        k = self.keys
        self._scripts.run(
            "register_request",
            [
                k.request(request_id),
                k.request_list(conversation_id),
                k.request_seq(conversation_id),
            ],
            [
                conversation_id,
                origin,
                request_id,
                timestamp_ms,
                msg_id,
                int(time.time() * 1000),
                self._s.message_ttl,
                self._s.awaited_message_ttl,
            ],
        )

    # --- responses -----------------------------------------------------------------------
    def add_response(self, conversation_id: str, data: Any, enqueue: Enqueue) -> Registered:
        """markPendingConversationRegister: the response joins its conversation's order."""
        _check_conversation_id(conversation_id)
        res = parse_input(ResponseIn, data)
        payload = _payload_text(res.payload, self._s.max_payload_bytes)
        now_ms = int(time.time() * 1000)
        timestamp_ms = _ms(res.timestamp) if res.timestamp else now_ms
        moment = datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC)
        with self._pg.connection() as conn:
            row = conn.run(
                "conv_insert_response",
                res.response_id,
                res.request_id,
                conversation_id,
                moment,
                payload,
                self._node_id,
            )
            if row is None:
                raise UnknownRequest(res.request_id, conversation_id)
            msg_id, state, request_msg_id, request_state, origin, request_ts = row
            created = msg_id is not None
            if not created:
                found = conn.run("conv_find", res.response_id, RESPONSE_SOURCE)
                assert found is not None
                if found[5] != request_msg_id:
                    raise InvalidMessage(
                        "response_id",
                        f"{res.response_id!r} already belongs to another request",
                    )
                msg_id, state, age_ms = found[0], found[1], found[6]
                if state != MessageState.IN_QUEUE or age_ms >= self._s.awaited_message_ttl:
                    return Registered(int(msg_id), MessageState(state), created=False)
                # Still queued: a repeat after a failure between the row and Redis puts it
                # there now (the script answers DUPLICATE if it is there already).
        if state == MessageState.CANCEL:
            return Registered(int(msg_id), MessageState.CANCEL, created=True)
        token = uuid.uuid4().hex
        k = self.keys
        code, taken = self._scripts.run(
            "add_response",
            [
                k.request(res.request_id),
                k.response(res.response_id),
                k.response_list(conversation_id),
                k.pending_messages,
                k.request_list(conversation_id),
                k.request_seq(conversation_id),
                k.drain_lease(conversation_id),
            ],
            [
                conversation_id,
                origin,
                res.request_id,
                res.response_id,
                min_message_info(res.request_id, res.response_id, conversation_id),
                timestamp_ms,
                payload,
                msg_id,
                request_msg_id,
                1 if res.last else 0,
                now_ms,
                self._s.message_ttl,
                self._s.awaited_message_ttl,
                self.blocked_ms,
                int(request_ts.timestamp() * 1000),
                token,
                self.lease_ms,
            ],
        )
        code = _text(code)
        if code == "CANCELLED":
            # The group was cancelled between the insert and now.
            with self._pg.connection() as conn:
                conn.run(
                    "conv_group_cancel",
                    request_msg_id,
                    ERROR_CANCELLED,
                    "its request was cancelled",
                )
            return Registered(int(msg_id), MessageState.CANCEL, created=True)
        if request_state != MessageState.WAITING_FOR_RES:
            log.info(
                "response %s is a callback for request %s (%s)",
                res.response_id,
                res.request_id,
                request_state,
            )
        if int(taken):
            enqueue(conversation_id, token)
        return Registered(int(msg_id), MessageState.IN_QUEUE, created=created)

    # --- the gate -------------------------------------------------------------------------
    def _advance(
        self,
        mode: str,
        conversation_id: str,
        token: str,
        outcome: tuple[str, str, str],
        check_response: str = "",
    ) -> dict[str, Any]:
        k = self.keys
        raw = self._scripts.run(
            "advance",
            [
                k.request_list(conversation_id),
                k.response_list(conversation_id),
                k.pending_messages,
                k.drain_lease(conversation_id),
                k.scheduled,
                k.request_seq(conversation_id),
            ],
            [
                mode,
                token,
                int(time.time() * 1000),
                self.lease_ms,
                self.inflight_ms,
                self._s.sent_message_ttl,
                k.request_prefix,
                k.response_prefix,
                k.async_request(""),
                check_response,
                *outcome,
                self._s.message_ttl,
                self._s.awaited_time_when_retries_end,
                self.awaited_step_ms,
                conversation_id,
            ],
        )
        result: dict[str, Any] = json.loads(raw)
        return result

    def can_send(self, conversation_id: str, response_id: str) -> Gate:
        """canSendConversationMessage: may this response go out now, by the order alone?"""
        result = self._advance("check", conversation_id, "", ("", "", ""), response_id)
        return Gate(result["code"], result.get("first"))

    def drain(self, conversation_id: str, token: str, send: Sender) -> DrainReport:
        """Deliver the conversation's sendable heads, one after another, while holding its lease.

        Returns with ``end`` YIELD after ``ORDERLY_DRAIN_BATCH`` deliveries: the caller starts
        a new drain with the same token (the lease stays held).
        """
        report = DrainReport(conversation_id)
        outcome: tuple[str, str, str] = ("", "", "")
        after: Callable[[], None] | None = None
        sends = 0
        while True:
            mode = "yield" if sends >= self._s.drain_batch else "claim"
            step = self._advance(mode, conversation_id, token, outcome)
            if after is not None:
                after()
                after = None
            if step.get("ack_clash"):
                log.warning(
                    "ACK id %r is already in use: the response waits out SENT_MESSAGE_TTL",
                    step["ack_clash"],
                )
            self._settled_by_timeout(step, report)
            if step["code"] != "SEND":
                report.end = step["code"]
                return report
            h = step["head"]
            head = Head(
                conversation_id=h["conversationId"],
                origin=h["origin"],
                request_id=h["requestId"],
                response_id=h["responseId"],
                payload=json.loads(h["taskItem"]),
                msg_id=int(h["msgId"]),
                request_msg_id=int(h["requestMsgId"]),
                last=h["last"] == "1",
                attempt=int(h["attempt"]),
                awaited_retries=int(h["awaitedRetries"]),
            )
            if head.awaited_retries:
                with self._pg.connection() as conn:
                    conn.run("conv_back_in_queue", head.msg_id)
            channel = self._channels.get(head.origin)
            try:
                result = send(channel, head)
            except Exception as exc:  # a sender's bug must not leave the head in flight
                log.exception("sending response %s failed", head.response_id)
                result = SendResult(Delivery.RECOVERABLE, reason=f"{type(exc).__name__}: {exc}")
            sends += 1
            outcome, after = self._apply(channel, head, result, report)

    def _apply(
        self, channel: Channel, head: Head, result: SendResult, report: DrainReport
    ) -> tuple[tuple[str, str, str], Callable[[], None] | None]:
        """What PostgreSQL records now, and the outcome the next gate step settles in Redis.

        PostgreSQL goes first where the send is final (a crash in between resends, with the
        same Idempotency-Key, rather than losing); a 202 is recorded after Redis knows its
        ACK id, so that an ACK arriving at once finds it.
        """
        rid = head.response_id
        if result.kind is Delivery.DELIVERED:
            ids = [head.msg_id, head.request_msg_id] if head.last else [head.msg_id]
            with self._pg.connection() as conn:
                conn.run("conv_ok", ids, None)
            report.delivered += 1
            return ("delivered", rid, ""), None
        if result.kind is Delivery.ASYNC:
            async_id = str(result.async_response_id)
            report.sent_async += 1

            def record_sent() -> None:  # after Redis recorded the ACK id
                with self._pg.connection() as conn:
                    conn.run("conv_sent", head.msg_id, async_id)

            return ("sent", rid, async_id), record_sent
        if result.kind is Delivery.RECOVERABLE:
            attempt = head.attempt + 1
            if attempt <= channel.attempts:
                report.retried += 1
                log.info(
                    "response %s: %s; retry %d in %d ms",
                    rid,
                    result.reason,
                    attempt,
                    channel.retry_delay_ms(attempt),
                )
                return ("retry", rid, str(channel.retry_delay_ms(attempt))), None
            with self._pg.connection() as conn:
                conn.run(
                    "conv_group_awaited",
                    head.request_msg_id,
                    ERROR_RETRIES_SPENT,
                    f"{result.reason} ({channel.attempts} retries spent)",
                )
            report.awaited += 1
            log.warning("response %s: retries spent (%s); its group is AWAITED", rid, result.reason)
            return ("awaited", rid, ""), None
        with self._pg.connection() as conn:
            conn.run(
                "conv_group_cancel",
                head.request_msg_id,
                ERROR_CANCELLED,
                f"response {rid}: {result.reason}",
            )
        report.cancelled += 1
        log.warning("response %s: %s; its group is cancelled", rid, result.reason)
        return ("cancel", rid, ""), None

    def _settled_by_timeout(self, step: dict[str, Any], report: DrainReport) -> None:
        settled = _json_list(step.get("settled"))
        if not settled:
            return
        ids = [int(i) for pair in settled for i in pair if i]
        with self._pg.connection() as conn:
            conn.run("conv_ok", ids, "delivered: no ACK within SENT_MESSAGE_TTL")
        report.ack_timeouts += len(settled)

    # --- ACKs -----------------------------------------------------------------------------
    def ack(self, async_response_id: str, enqueue: Enqueue) -> int:
        """The client's ACK: the response is delivered and its successor released at once."""
        if not 0 < len(async_response_id) <= MAX_ASYNC_ID:
            raise UnknownAck(async_response_id[:MAX_ASYNC_ID])
        k = self.keys
        raw = self._redis.get(k.async_request(async_response_id))
        for pause in ACK_GRACE_S:
            if raw is not None:
                break
            # A client may ACK before the worker has recorded its 202: wait a moment.
            time.sleep(pause)
            raw = self._redis.get(k.async_request(async_response_id))
        if raw is None:
            raise UnknownAck(async_response_id)
        member = _text(raw)
        info = json.loads(member)
        cid = info["cnId"]
        token = uuid.uuid4().hex
        result = self._scripts.run(
            "ack",
            [
                k.async_request(async_response_id),
                k.response(info["rsId"]),
                k.response_list(cid),
                k.pending_messages,
                k.request_list(cid),
                k.request_seq(cid),
                k.drain_lease(cid),
            ],
            [member, k.request_prefix, k.async_request(""), token, self.lease_ms],
        )
        if result[0] != b"ACKED":
            raise UnknownAck(async_response_id)
        msg_id, completed, taken = int(result[1]), result[2], int(result[3])
        ids = [msg_id, int(completed)] if completed else [msg_id]
        with self._pg.connection() as conn:
            conn.run("conv_ok", ids, f"ACK {async_response_id}")
        if taken:
            enqueue(cid, token)
        return msg_id

    def describe(self, conversation_id: str) -> dict[str, Any]:
        """What Redis holds for a conversation now: its requests and responses in order."""
        k = self.keys
        requests = []
        for key in self._redis.lrange(k.request_list(conversation_id), 0, -1):
            fields = self._redis.hgetall(key)
            requests.append({_text(f): _text(v) for f, v in fields.items()} or {"key": _text(key)})
        responses = []
        for member in self._redis.zrange(k.response_list(conversation_id), 0, -1):
            info = json.loads(_text(member))
            fields = self._redis.hgetall(k.response(info["rsId"]))
            view = {_text(f): _text(v) for f, v in fields.items() if f != b"taskItem"}
            responses.append(view or {"responseId": info["rsId"], "status": "GONE"})
        return {
            "conversation_id": conversation_id,
            "requests": requests,
            "responses": responses,
            "draining": bool(self._redis.exists(k.drain_lease(conversation_id))),
        }

    def partial_metrics(self) -> dict[str, int]:
        """The queue's figures now (AURA_LOGGING_EXTRA_TIME_METRICS logs them periodically)."""
        k = self.keys
        now = int(time.time() * 1000)
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(k.pending_messages)
        pipe.zcount(k.pending_messages, "-inf", now)
        pipe.zcard(k.scheduled)
        pending, due, scheduled = pipe.execute()
        return {"pending_messages": pending, "awaited_due": due, "scheduled": scheduled}

    # --- waking conversations -------------------------------------------------------------
    def wake(self, conversation_id: str, enqueue: Enqueue) -> bool:
        """Start a drain unless one holds the conversation (it will see what is due)."""
        token = uuid.uuid4().hex
        if self._redis.set(
            self.keys.drain_lease(conversation_id), token, nx=True, px=self.lease_ms
        ):
            enqueue(conversation_id, token)
            return True
        return False

    def wake_due(self, enqueue: Enqueue, limit: int = 500) -> list[str]:
        """The scheduler's turn: conversations whose retry wait or ACK deadline has come."""
        due = [
            _text(c)
            for c in self._scripts.run(
                "due", [self.keys.scheduled], [int(time.time() * 1000), limit]
            )
        ]
        woken = []
        for i, cid in enumerate(due):
            try:
                if self.wake(cid, enqueue):
                    woken.append(cid)
            except Exception:
                # Taken from the schedule but not woken: put the rest back for the next turn.
                now = int(time.time() * 1000)
                self._redis.zadd(self.keys.scheduled, dict.fromkeys(due[i:], now))
                raise
        return woken

    def awaited_turn(self, enqueue: Enqueue) -> AgentReport:
        """The awaited agent's turn: re-queue due AWAITED and stuck messages, expire old ones."""
        k = self.keys
        raw = self._scripts.run(
            "awaited",
            [k.pending_messages],
            [
                int(time.time() * 1000),
                self._s.awaited_messages_by_turn,
                k.response_prefix,
                self.awaited_step_ms,
            ],
        )
        taken = json.loads(raw)
        report = AgentReport(taken=int(taken.get("taken", 0)))
        vanished = _json_list(taken.get("vanished"))
        expired = _json_list(taken.get("expired"))
        if vanished:
            with self._pg.connection() as conn:
                conn.run(
                    "conv_failed_by_response",
                    vanished,
                    ERROR_EXPIRED,
                    "AWAITED_MESSAGE_TTL spent before delivery",
                )
            report.vanished = len(vanished)
        for member, cid, status in expired:
            rid = json.loads(member)["rsId"]
            done = self._scripts.run(
                "expire",
                [
                    k.response(rid),
                    k.response_list(cid),
                    k.pending_messages,
                    k.request_list(cid),
                    k.request_seq(cid),
                ],
                [member, k.request_prefix, k.async_request("")],
            )
            ids = [int(i) for i in done if i]
            if ids and status == "SENT":
                # The client took it (202); only its ACK never came.
                with self._pg.connection() as conn:
                    conn.run("conv_ok", ids, "delivered: no ACK within AWAITED_MESSAGE_TTL")
            elif ids:
                with self._pg.connection() as conn:
                    conn.run(
                        "conv_failed",
                        ids,
                        ERROR_EXPIRED,
                        "AWAITED_MESSAGE_TTL spent before delivery",
                    )
            report.expired += 1
        for cid in _json_list(taken.get("wake")):
            if self.wake(cid, enqueue):
                report.woken.append(cid)
        ttl_s = self._s.awaited_message_ttl / 1000
        with self._pg.connection() as conn:
            conn.run("conv_expire_responses", ttl_s)
            report.swept = conn.rowcount()
            conn.run("conv_close_requests", ttl_s)
        return report
