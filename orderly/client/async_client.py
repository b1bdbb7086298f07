"""The async client: the same calls as :class:`orderly.client.client.Client`
(orderly.client.calls), sent with httpx's asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from orderly.client import answers as a
from orderly.client import calls
from orderly.client.calls import Acked, Call, Published, Submitted
from orderly.client.errors import OrderlyError
from orderly.client.transport import RETRIED, Settings

T = TypeVar("T")


class AsyncClient:
    """The same as :class:`Client`, for asyncio (``async with``; or ``await aclose()``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        max_wait_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._s = Settings(
            base_url, api_key, timeout_s=timeout_s, retries=retries, max_wait_s=max_wait_s
        )
        self._http = httpx.AsyncClient(
            base_url=self._s.base_url,
            headers=self._s.headers,
            timeout=timeout_s,
            transport=transport or httpx.AsyncHTTPTransport(retries=retries),
        )

    async def call(self, call: Call[T]) -> T:
        for attempt in range(self._s.retries + 1):
            try:
                answer = await self._http.request(**self._s.request(call))
            except httpx.TransportError as exc:
                await asyncio.sleep(self._s.again_after(call, exc, attempt))
                continue
            if answer.status_code not in RETRIED or attempt == self._s.retries:
                return self._s.read(call, answer)
            await asyncio.sleep(self._s.wait_s(answer))
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def submit(self, message: Any) -> Submitted:
        return await self.call(calls.submit(message))

    async def submit_many(self, messages: Sequence[Any]) -> list[Submitted]:
        return await self.call(calls.submit_many(messages))

    async def respond(self, response: Any) -> a.ResponseAccepted:
        return await self.call(calls.respond(response))

    async def request(self, conversation_id: str, request: Any) -> Submitted:
        return await self.call(calls.conversation_request(conversation_id, request))

    async def response(self, conversation_id: str, response: Any) -> Submitted:
        return await self.call(calls.conversation_response(conversation_id, response))

    async def publish(
        self, room: str, event: Any, *, idempotency_key: str | None = None
    ) -> Published:
        return await self.call(calls.publish(room, event, idempotency_key))

    async def subscribe(self, room: str, subscription: Any) -> a.SubscriptionCreated:
        return await self.call(calls.subscribe(room, subscription))

    async def queue_log(self, **filters: Any) -> list[a.QueueLogRow]:
        return await self.call(calls.queue_log(filters))

    async def exceptions(self, **filters: Any) -> list[a.ExceptionListed]:
        return await self.call(calls.exceptions(filters))

    async def exception(self, exception_id: int) -> a.ExceptionDetail:
        return await self.call(calls.exception(exception_id))

    async def published(self, **filters: Any) -> list[a.PublishedRow]:
        return await self.call(calls.published(filters))

    async def ack(self, async_response_id: str, token: str) -> Acked:
        return await self.call(calls.ack(async_response_id, token))

    async def pull(
        self, subscription_id: int, max_messages: int = 10, *, wait_ms: int = 0
    ) -> list[a.Pulled]:
        return await self.call(calls.pull(subscription_id, max_messages, wait_ms))

    async def extend_pulled(
        self, subscription_id: int, delivery_id: int, receipt: str, visibility_timeout_ms: int
    ) -> a.PulledVisibility:
        call = calls.extend_pulled(subscription_id, delivery_id, receipt, visibility_timeout_ms)
        return await self.call(call)

    async def replay(self, subscription_id: int, since: Any, until: Any = None) -> a.Replayed:
        return await self.call(calls.replay(subscription_id, since, until))

    async def enable_subscription(
        self, subscription_id: int, note: str = ""
    ) -> a.SubscriptionChanged:
        return await self.call(calls.enable_subscription(subscription_id, note))

    async def ack_pulled(
        self, subscription_id: int, delivery_id: int, receipt: str
    ) -> a.PulledAcked:
        return await self.call(calls.ack_pulled(subscription_id, delivery_id, receipt))

    async def tracked_done(self, xid: str) -> a.TrackedDone:
        return await self.call(calls.tracked_done(xid))

    async def message(self, msg_id: int) -> a.MessageDetail:
        return await self.call(calls.message(msg_id))

    async def messages(
        self,
        *,
        state: str | None = None,
        service: str | None = None,
        operation: str | None = None,
        source_system: str | None = None,
        correlation_id: str | None = None,
        funnel: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        correlation_match: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[a.MessageRow]:
        """Messages matching every filter given, oldest msg_timestamp first; ``since`` and
        ``until`` bound msg_timestamp (from, before)."""
        found = calls.MessageFilter(
            state,
            service,
            operation,
            source_system,
            correlation_id,
            funnel,
            since,
            until,
            correlation_match,
        )
        return await self.call(calls.messages(found, limit, offset))

    async def cancel(self, msg_id: int, note: str, *, by: str | None = None) -> a.Cancelled:
        return await self.call(calls.cancel(msg_id, note, by))

    async def redrive(self, msg_id: int, note: str, *, by: str | None = None) -> a.Redriven:
        return await self.call(calls.redrive(msg_id, note, by))

    async def conversation(self, conversation_id: str) -> a.Conversation:
        return await self.call(calls.conversation(conversation_id))

    async def conversation_message(
        self,
        *,
        response_id: str | None = None,
        async_response_id: str | None = None,
        fields: Sequence[str] | None = None,
    ) -> a.ConversationMessage:
        """getConversationMessage (an operate key)."""
        return await self.call(calls.conversation_message(response_id, async_response_id, fields))

    async def delete_conversation_request(
        self, conversation_id: str, request_id: str, **filters: Any
    ) -> a.ConversationDeleted:
        """deleteConversationRegister: ``status``, ``all_origin_except``, ``note``."""
        return await self.call(
            calls.delete_conversation_request(conversation_id, request_id, filters)
        )

    async def set_awaited(
        self,
        conversation_id: str,
        *,
        request_id: str | None = None,
        response_id: str | None = None,
        note: str | None = None,
    ) -> a.ConversationAwaited:
        """setAwaitedByRequestId (``request_id``) or setAwaitedByResponseId."""
        return await self.call(calls.set_awaited(conversation_id, request_id, response_id, note))

    async def set_awaited_date(
        self, conversation_id: str, response_id: str, at: datetime | str
    ) -> a.AwaitedDate:
        """updateAwaitedExpires: an AWAITED response's new awaitedToDate."""
        return await self.call(calls.set_awaited_date(conversation_id, response_id, at))

    async def remove_at(
        self, conversation_id: str, response_id: str, delay_s: int
    ) -> a.RemovalScheduled:
        """removeAllReferencesAtTime: the response's references go after ``delay_s``."""
        return await self.call(calls.remove_at(conversation_id, response_id, delay_s))

    async def create_schedule(self, schedule: Any) -> dict[str, Any]:
        return await self.call(calls.create_schedule(schedule))

    async def schedules(self, *, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        return await self.call(calls.schedules(limit, offset))

    async def schedule(self, name: str) -> dict[str, Any]:
        return await self.call(calls.schedule(name))

    async def update_schedule(self, name: str, changes: Any) -> dict[str, Any]:
        return await self.call(calls.update_schedule(name, changes))

    async def enable_schedule(self, name: str) -> dict[str, Any]:
        return await self.call(calls.update_schedule(name, {"enabled": True}))

    async def disable_schedule(self, name: str) -> dict[str, Any]:
        return await self.call(calls.update_schedule(name, {"enabled": False}))

    async def delete_schedule(self, name: str) -> dict[str, Any]:
        return await self.call(calls.delete_schedule(name))

    async def funnel_limits(self) -> list[dict[str, Any]]:
        return await self.call(calls.funnel_limits())

    async def funnel_limit(self, component_id: str) -> dict[str, Any]:
        return await self.call(calls.funnel_limit(component_id))

    async def set_funnel_limit(
        self,
        component_id: str,
        max_in_flight: int,
        rate_per_s: float | None = None,
        burst: int | None = None,
    ) -> dict[str, Any]:
        call = calls.set_funnel_limit(component_id, max_in_flight, rate_per_s, burst)
        return await self.call(call)

    async def delete_funnel_limit(self, component_id: str) -> dict[str, Any]:
        return await self.call(calls.delete_funnel_limit(component_id))


__all__ = ["AsyncClient", "OrderlyError"]
