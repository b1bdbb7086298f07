"""The sync client (the async one: orderly.client.async_client): the calls of
orderly.client.calls, sent with httpx; a 503 or a 429 is tried again after its Retry-After."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from orderly.client import answers as a
from orderly.client import calls
from orderly.client.calls import Acked, Call, Published, Submitted
from orderly.client.transport import RETRIED, Settings

T = TypeVar("T")


class Client:
    """A synchronous client of one orderly API (a context manager; or call :meth:`close`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        max_wait_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._s = Settings(
            base_url, api_key, timeout_s=timeout_s, retries=retries, max_wait_s=max_wait_s
        )
        self._http = httpx.Client(
            base_url=self._s.base_url,
            headers=self._s.headers,
            timeout=timeout_s,
            # a connection that could not be made is tried again (httpx's backoff)
            transport=transport or httpx.HTTPTransport(retries=retries),
        )

    def call(self, call: Call[T]) -> T:
        """Send one call; a 503 or a 429 is sent again after its Retry-After, ``retries``
        times; a connection that could not be made is tried again as often (httpx's transport),
        and an idempotent call (:attr:`Call.retry_safe`) that got no answer in time is sent
        again after a second. No answer in the end raises :class:`NoAnswer`
        (:class:`Unreachable`, :class:`TimedOut`)."""
        for attempt in range(self._s.retries + 1):
            try:
                answer = self._http.request(**self._s.request(call))
            except httpx.TransportError as exc:
                time.sleep(self._s.again_after(call, exc, attempt))
                continue
            if answer.status_code not in RETRIED or attempt == self._s.retries:
                return self._s.read(call, answer)
            time.sleep(self._s.wait_s(answer))
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- producers -------------------------------------------------------------------------

    def submit(self, message: Any) -> Submitted:
        """``POST /messages``: a dict or a ``MessageIn`` (``delay_ms`` or ``not_before`` to
        schedule it, ``priority``). Another message stored under its (correlation_id,
        source_system) raises :class:`ConflictingMessage` (its ``msg_id``)."""
        return self.call(calls.submit(message))

    def submit_many(self, messages: Sequence[Any]) -> list[Submitted]:
        """``POST /messages:batch``: up to 1,000 messages, all stored or none (one invalid or
        conflicting refuses all); a result per message, in order (``created`` False: it had
        it already)."""
        return self.call(calls.submit_many(messages))

    def respond(self, response: Any) -> a.ResponseAccepted:
        """``POST /messages/responses``: an external system's answer to a waiting message."""
        return self.call(calls.respond(response))

    def request(self, conversation_id: str, request: Any) -> Submitted:
        """A conversation's request (``request_id``, ``origin``, ...)."""
        return self.call(calls.conversation_request(conversation_id, request))

    def response(self, conversation_id: str, response: Any) -> Submitted:
        """A response to one of the conversation's requests (delivered in order)."""
        return self.call(calls.conversation_response(conversation_id, response))

    def publish(self, room: str, event: Any, *, idempotency_key: str | None = None) -> Published:
        return self.call(calls.publish(room, event, idempotency_key))

    def subscribe(self, room: str, subscription: Any) -> a.SubscriptionCreated:
        """A subscription (an admin key): by event type, one ``event_version`` or a
        ``min_version``/``max_version`` range, and/or a routing-key pattern."""
        return self.call(calls.subscribe(room, subscription))

    # --- consumers -------------------------------------------------------------------------

    def ack(self, async_response_id: str, token: str) -> Acked:
        """A channel client's ACK, with the ``X-Orderly-Ack-Token`` its response came with."""
        return self.call(calls.ack(async_response_id, token))

    def pull(
        self, subscription_id: int, max_messages: int = 10, *, wait_ms: int = 0
    ) -> list[a.Pulled]:
        """A PULL subscription's due messages; with ``wait_ms`` (20,000 at most), waiting up to
        that long for one to come."""
        return self.call(calls.pull(subscription_id, max_messages, wait_ms))

    def extend_pulled(
        self, subscription_id: int, delivery_id: int, receipt: str, visibility_timeout_ms: int
    ) -> a.PulledVisibility:
        """A pulled message comes back that long from now unless ACKed (with its receipt)."""
        call = calls.extend_pulled(subscription_id, delivery_id, receipt, visibility_timeout_ms)
        return self.call(call)

    def replay(self, subscription_id: int, since: Any, until: Any = None) -> a.Replayed:
        """A subscription's events of a window sent again (and the ones it never had); an
        admin key. ``since``/``until``: datetimes or ISO 8601 strings."""
        return self.call(calls.replay(subscription_id, since, until))

    def enable_subscription(self, subscription_id: int, note: str = "") -> a.SubscriptionChanged:
        """An endpoint disabled by its failures (or with its circuit open) enabled again."""
        return self.call(calls.enable_subscription(subscription_id, note))

    def ack_pulled(self, subscription_id: int, delivery_id: int, receipt: str) -> a.PulledAcked:
        return self.call(calls.ack_pulled(subscription_id, delivery_id, receipt))

    def tracked_done(self, xid: str) -> a.TrackedDone:
        """Report done the tracked work known by ``xid`` (a message's msg_id, say), as the
        seed's subscriber does: the timeout monitor counts it done, never timed out."""
        return self.call(calls.tracked_done(xid))

    # --- operators -------------------------------------------------------------------------

    def queue_log(self, **filters: Any) -> list[a.QueueLogRow]:
        """The queue message log, newest first (``delivery_id``, ``correlation_id``,
        ``subscription_id``, ``routing_key``, ``state``, ``limit``, ``before``)."""
        return self.call(calls.queue_log(filters))

    def exceptions(self, **filters: Any) -> list[a.ExceptionListed]:
        """Exceptions without tracebacks, newest first (the queue log's filters, ``type``)."""
        return self.call(calls.exceptions(filters))

    def exception(self, exception_id: int) -> a.ExceptionDetail:
        """One exception with its traceback."""
        return self.call(calls.exception(exception_id))

    def published(self, **filters: Any) -> list[a.PublishedRow]:
        """published_messages, one row per attempt, newest first (the queue log's filters;
        ``state`` is the outcome)."""
        return self.call(calls.published(filters))

    def message(self, msg_id: int) -> a.MessageDetail:
        return self.call(calls.message(msg_id))

    def messages(
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
        return self.call(calls.messages(found, limit, offset))

    def iter_messages(self, *, page_size: int = 100, **filters: Any) -> Iterator[a.MessageRow]:
        """Every message matching the filters of :meth:`messages`, a page of ``page_size`` per
        request, until a page comes back short."""
        offset = 0
        while True:
            page = self.messages(limit=page_size, offset=offset, **filters)
            yield from page
            if len(page) < page_size:
                return
            offset += len(page)

    def cancel(self, msg_id: int, note: str, *, by: str | None = None) -> a.Cancelled:
        return self.call(calls.cancel(msg_id, note, by))

    def redrive(self, msg_id: int, note: str, *, by: str | None = None) -> a.Redriven:
        return self.call(calls.redrive(msg_id, note, by))

    def conversation(self, conversation_id: str) -> a.Conversation:
        return self.call(calls.conversation(conversation_id))

    def conversation_message(
        self,
        *,
        response_id: str | None = None,
        async_response_id: str | None = None,
        fields: Sequence[str] | None = None,
    ) -> a.ConversationMessage:
        """getConversationMessage (an operate key)."""
        return self.call(calls.conversation_message(response_id, async_response_id, fields))

    def delete_conversation_request(
        self, conversation_id: str, request_id: str, **filters: Any
    ) -> a.ConversationDeleted:
        """deleteConversationRegister: ``status``, ``all_origin_except``, ``note``."""
        return self.call(calls.delete_conversation_request(conversation_id, request_id, filters))

    def set_awaited(
        self,
        conversation_id: str,
        *,
        request_id: str | None = None,
        response_id: str | None = None,
        note: str | None = None,
    ) -> a.ConversationAwaited:
        """setAwaitedByRequestId (``request_id``) or setAwaitedByResponseId."""
        return self.call(calls.set_awaited(conversation_id, request_id, response_id, note))

    def set_awaited_date(
        self, conversation_id: str, response_id: str, at: datetime | str
    ) -> a.AwaitedDate:
        """updateAwaitedExpires: an AWAITED response's new awaitedToDate."""
        return self.call(calls.set_awaited_date(conversation_id, response_id, at))

    def remove_at(self, conversation_id: str, response_id: str, delay_s: int) -> a.RemovalScheduled:
        """removeAllReferencesAtTime: the response's references go after ``delay_s``."""
        return self.call(calls.remove_at(conversation_id, response_id, delay_s))

    # --- schedules -------------------------------------------------------------------------

    def create_schedule(self, schedule: Any) -> dict[str, Any]:
        """``POST /schedules`` (a produce key): one message per due instant of ``cron`` in
        ``time_zone``; ``{{instant}}`` and ``{{name}}`` in the payload's strings replaced."""
        return self.call(calls.create_schedule(schedule))

    def schedules(self, *, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """The schedules by name, with their next and last instants (an operate key)."""
        return self.call(calls.schedules(limit, offset))

    def schedule(self, name: str) -> dict[str, Any]:
        return self.call(calls.schedule(name))

    def update_schedule(self, name: str, changes: Any) -> dict[str, Any]:
        """``PATCH /schedules/{name}``: ``enabled``, ``cron``, ``time_zone`` or the template's
        fields."""
        return self.call(calls.update_schedule(name, changes))

    def enable_schedule(self, name: str) -> dict[str, Any]:
        """Due again from its first instant after now."""
        return self.call(calls.update_schedule(name, {"enabled": True}))

    def disable_schedule(self, name: str) -> dict[str, Any]:
        return self.call(calls.update_schedule(name, {"enabled": False}))

    def delete_schedule(self, name: str) -> dict[str, Any]:
        return self.call(calls.delete_schedule(name))

    # --- funnel limits (an admin key; component "" is funnels without a component) -------

    def funnel_limits(self) -> list[dict[str, Any]]:
        return self.call(calls.funnel_limits())

    def funnel_limit(self, component_id: str) -> dict[str, Any]:
        """A component's limit; :class:`NotFound` when it has none (one at a time)."""
        return self.call(calls.funnel_limit(component_id))

    def set_funnel_limit(
        self,
        component_id: str,
        max_in_flight: int,
        rate_per_s: float | None = None,
        burst: int | None = None,
    ) -> dict[str, Any]:
        """Up to ``max_in_flight`` messages of one funnel value at once, and with
        ``rate_per_s`` that many starts a second (``created``: new)."""
        return self.call(calls.set_funnel_limit(component_id, max_in_flight, rate_per_s, burst))

    def delete_funnel_limit(self, component_id: str) -> dict[str, Any]:
        """Back to one message at a time."""
        return self.call(calls.delete_funnel_limit(component_id))


__all__ = ["Client"]
