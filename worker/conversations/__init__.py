"""Ordered conversation delivery: requests, responses, the ordering gate, sends and ACKs.

PostgreSQL holds every request and response as a ``message`` row (the durable truth); Redis
holds the seed's ordering structures, changed only by the Lua scripts in ``worker/lua``. A
conversation is delivered by one drain at a time (its lease): the drain settles the previous
send and claims the next head in one script call, so a successor leaves the moment its
predecessor is delivered or ACKed, without polling.

``intake`` takes requests and responses in, ``gate`` delivers them, ``agent`` wakes waiting
conversations and runs the awaited agent, ``operations`` are the operators' (get a message,
delete a request's, set AWAITED, move an awaited date, remove at a time); :class:`Conversations`
is the one object the faces use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import anyio.to_thread
from sqlalchemy import Engine

from orderly.models.keys import BridgeKeys
from orderly.worker.channels import ChannelDirectory
from orderly.worker.conversations import agent, gate, intake, operations, reconcile
from orderly.worker.conversations.context import Context
from orderly.worker.conversations.model import (
    ERROR_CANCELLED,
    ERROR_EXPIRED,
    ERROR_RETRIES_SPENT,
    ID_PATTERN,
    MAX_ASYNC_ID,
    REQUEST_SOURCE,
    RESPONSE_SOURCE,
    SERVICE,
    AgentReport,
    Delivery,
    DrainReport,
    Enqueue,
    Gate,
    Head,
    Registered,
    RequestIn,
    ResponseIn,
    Sender,
    SendResult,
)
from orderly.worker.core import tracing
from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.due import ShardedDueSets
from orderly.worker.core.group_commit import GroupCommit
from orderly.worker.core.owners import Owns
from orderly.worker.settings import Settings

__all__ = [
    "ERROR_CANCELLED",
    "ERROR_EXPIRED",
    "ERROR_RETRIES_SPENT",
    "ID_PATTERN",
    "MAX_ASYNC_ID",
    "REQUEST_SOURCE",
    "RESPONSE_SOURCE",
    "SERVICE",
    "AgentReport",
    "Conversations",
    "Delivery",
    "DrainReport",
    "Enqueue",
    "Gate",
    "Head",
    "Registered",
    "RequestIn",
    "ResponseIn",
    "SendResult",
    "Sender",
]


_CONVERSATION = "orderly.conversation_id"  # a span attribute


class Conversations:
    """The mechanism; faces pass ``enqueue`` (start a drain) and ``send`` (one HTTP POST)."""

    def __init__(
        self,
        engine: Engine,
        client: OrderingRedis,
        settings: Settings,
        *,
        node_id: int,
        channels: ChannelDirectory,
        clock: Clock = SYSTEM,
    ) -> None:
        self.ctx = Context(engine, client, settings, node_id, channels, clock)
        # The API's concurrent requests and responses share commits (0: each its own).
        group_max = settings.intake_group_max
        self._requests = (
            GroupCommit(functools.partial(intake.store_requests, self.ctx), group_max)
            if group_max > 0
            else None
        )
        self._responses = (
            GroupCommit(functools.partial(intake.store_responses, self.ctx), group_max)
            if group_max > 0
            else None
        )
        self._sweeper: reconcile.Sweeper | None = None

    @property
    def keys(self) -> BridgeKeys:
        return self.ctx.keys

    @property
    def lease_ms(self) -> int:
        return self.ctx.lease_ms

    @property
    def blocked_ms(self) -> int:
        return self.ctx.blocked_ms

    def register_request(
        self, conversation_id: str, data: Any, owns: Owns | None = None
    ) -> Registered:
        """createConversationRegister: the request waits (WAITING) for its responses.
        ``owns`` (here and below): the caller's objects (worker.core.owners), None: all."""
        with tracing.span(
            "intake request", attributes={"orderly.conversation_id": conversation_id}
        ):
            return intake.register_request(self.ctx, conversation_id, data, owns)

    def add_response(
        self, conversation_id: str, data: Any, enqueue: Enqueue, owns: Owns | None = None
    ) -> Registered:
        """markPendingConversationRegister: the response joins its conversation's order."""
        with tracing.span(
            "intake response", attributes={"orderly.conversation_id": conversation_id}
        ):
            return intake.add_response(self.ctx, conversation_id, data, enqueue, owns)

    async def register_request_together(
        self, conversation_id: str, data: Any, owns: Owns | None = None
    ) -> Registered:
        """``register_request`` for a coroutine (the API's): validated on the caller's loop,
        stored with the requests registered at the same time in one INSERT (group commit,
        ORDERLY_INTAKE_GROUP_MAX; worker.core.group_commit), each answered after it; alone in
        a thread when not grouped or not settled by the group's statement."""
        with tracing.span("intake request", attributes={_CONVERSATION: conversation_id}):
            new = intake.parse_request(self.ctx, conversation_id, data, owns)
            alone = functools.partial(intake.store_request, self.ctx, new, owns)
            if self._requests is None:
                return await anyio.to_thread.run_sync(alone)
            return await self._requests.run_or_alone((new, owns), alone)

    async def add_response_together(
        self, conversation_id: str, data: Any, enqueue: Enqueue, owns: Owns | None = None
    ) -> Registered:
        """``add_response`` for a coroutine, as :meth:`register_request_together`."""
        with tracing.span("intake response", attributes={_CONVERSATION: conversation_id}):
            new = intake.parse_response(self.ctx, conversation_id, data)  # under its span
            alone = functools.partial(intake.store_response, self.ctx, new, enqueue, owns)
            if self._responses is None:
                return await anyio.to_thread.run_sync(alone)
            return await self._responses.run_or_alone((new, owns, enqueue), alone)

    def sweep(
        self, read: Callable[[str, int], Sequence[Any]], enqueue: Enqueue
    ) -> reconcile.SweepReport:
        """Rebuild the conversations whose keys Redis lost under a live marker (evicted,
        deleted), seen so twice in a row (worker.conversations.reconcile); ``read``: a page
        of the rebuild's rows (reconcile.page_reader)."""
        if self._sweeper is None:
            self._sweeper = reconcile.Sweeper(self.ctx)
        return self._sweeper.sweep(read, enqueue)

    def can_send(self, conversation_id: str, response_id: str) -> Gate:
        """canSendConversationMessage: may this response go out now, by the order alone?"""
        return gate.can_send(self.ctx, conversation_id, response_id)

    def drain(self, conversation_id: str, token: str, send: Sender) -> DrainReport:
        """Deliver the conversation's sendable heads in order while holding its lease."""
        return gate.drain(self.ctx, conversation_id, token, send)

    def ack(self, async_response_id: str, enqueue: Enqueue, token: str | None = None) -> int:
        """The client's ACK: the response is delivered and its successor released at once.
        ``token``: the ACK token the response was sent with (``X-Orderly-Ack-Token``); None
        only for callers orderly trusts (in-process code)."""
        return gate.ack(self.ctx, async_response_id, enqueue, token)

    def describe(self, conversation_id: str, owns: Owns | None = None) -> dict[str, Any]:
        return agent.describe(self.ctx, conversation_id, owns)

    def partial_metrics(self) -> dict[str, int]:
        return agent.partial_metrics(self.ctx)

    def wakes(self, enqueue: Enqueue) -> ShardedDueSets:
        """Conversations whose wait has run out (every shard's), as due work for the ticker."""
        return agent.wakes(self.ctx, enqueue)

    def awaited_turn(self, enqueue: Enqueue) -> AgentReport:
        return agent.awaited_turn(self.ctx, enqueue)

    def release_dead_drains(self) -> int:
        """Drains whose worker died: leases freed, conversations woken at once."""
        return agent.release_dead_drains(self.ctx)

    def get_message(
        self,
        *,
        response_id: str | None = None,
        async_response_id: str | None = None,
        fields: Any = None,
        owns: Owns | None = None,
    ) -> dict[str, Any]:
        """getConversationMessage: one response by responseId or asyncResponseId."""
        return operations.get_message(
            self.ctx,
            response_id=response_id,
            async_response_id=async_response_id,
            fields=fields,
            owns=owns,
        )

    def delete_register(
        self,
        conversation_id: str,
        request_id: str,
        data: Any,
        enqueue: Enqueue,
        *,
        key: str | None = None,
        owns: Owns | None = None,
    ) -> operations.Deleted:
        """deleteConversationRegister: a request's messages deleted (status, allOriginExcept)."""
        return operations.delete(
            self.ctx, conversation_id, request_id, data, enqueue, key=key, owns=owns
        )

    def set_awaited(
        self,
        conversation_id: str,
        data: Any,
        *,
        request_id: str | None = None,
        response_id: str | None = None,
        key: str | None = None,
        owns: Owns | None = None,
    ) -> operations.AwaitedSet:
        """setAwaitedByRequestId / setAwaitedByResponseId."""
        return operations.set_awaited(
            self.ctx,
            conversation_id,
            data,
            request_id=request_id,
            response_id=response_id,
            key=key,
            owns=owns,
        )

    def set_awaited_date(
        self,
        conversation_id: str,
        response_id: str,
        data: Any,
        *,
        key: str | None = None,
        owns: Owns | None = None,
    ) -> dict[str, Any]:
        """updateAwaitedExpires: a new awaitedToDate for an AWAITED response."""
        return operations.set_awaited_date(
            self.ctx, conversation_id, response_id, data, key=key, owns=owns
        )

    def remove_at(
        self,
        conversation_id: str,
        response_id: str,
        data: Any,
        *,
        key: str | None = None,
        owns: Owns | None = None,
    ) -> dict[str, Any]:
        """removeAllReferencesAtTime: the response's references go after ``delay_s``."""
        return operations.remove_at(
            self.ctx, conversation_id, response_id, data, key=key, owns=owns
        )

    def log_partial_metrics(self) -> None:
        """AURA_LOGGING_EXTRA_TIME_METRICS: the queue's figures, logged."""
        agent.log.info("queue metrics: %s", agent.partial_metrics(self.ctx))
