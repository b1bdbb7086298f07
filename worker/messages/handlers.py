"""Message handlers, registered per (service, operation): the consumer chosen by routing key.

A handler receives a :class:`MessageContext`. Besides reading its message it may split it
into children (:meth:`~MessageContext.add_child`), park it until an external response comes
(:meth:`~MessageContext.wait_for_response`), make external calls under the obsolete/duplicate
rules (:meth:`~MessageContext.external_call`) and log HTTP exchanges (:meth:`~MessageContext.post`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, TypeVar

from orderly.models import BindingType
from orderly.worker.core.retry import MAX_DELAY_MS, RetryPolicy, policy_problems
from orderly.worker.messages.extcall import CallKey, CallResult

T = TypeVar("T")


@dataclass(frozen=True)
class ChildSpec:
    """A child message a handler asked for; stored with the parent's outcome."""

    service: str
    operation: str
    payload: Any
    binding: BindingType = BindingType.HARD
    correlation_id: str | None = None
    object_id: str | None = None
    entity_type: str | None = None
    funnel_value: str | None = None
    funnel_component_id: str | None = None
    guaranteed_order: bool = False
    exclude_failed_state: bool = False


@dataclass(frozen=True)
class ExternalResponse:
    """The response that resumed a message parked in WAITING_FOR_RES."""

    res_id: int
    envelope: str | None
    failed: bool
    reason: str | None
    received_at: datetime


class HandlerBackend(Protocol):
    """What a running handler may ask of orderly (implemented by the processor)."""

    def register_wait(self, ctx: MessageContext, correlation_id: str, timeout_s: int) -> None: ...

    def external_call(
        self, ctx: MessageContext, operation: str, key: CallKey, call: Callable[[], T]
    ) -> CallResult[T]: ...

    def post(
        self,
        ctx: MessageContext,
        uri: str,
        body: Any,
        res_join_id: str | None,
        timeout_s: float,
    ) -> tuple[int, str]: ...


@dataclass
class MessageContext:
    """What a handler sees of its message; ``custom_data`` is kept between tries."""

    msg_id: int
    service: str
    operation: str
    correlation_id: str
    source_system: str
    msg_timestamp: datetime
    payload: str
    object_id: str | None
    entity_type: str | None
    process_id: str | None
    funnel_value: str | None
    failed_count: int
    custom_data: str | None
    # Set when the message was resumed by an external response.
    response: ExternalResponse | None = None
    children: list[ChildSpec] = field(default_factory=list)
    waits_for: str | None = None
    backend: HandlerBackend | None = field(default=None, repr=False)
    # Set by the processor while the handler runs: whether its message was cancelled.
    abort_flag: Callable[[], bool] | None = field(default=None, repr=False, compare=False)

    @property
    def aborted(self) -> bool:
        """True once the message was cancelled while its handler runs: return soon. After
        ORDERLY_ABORT_GRACE_MS the handler is stopped (``Aborted`` raised inside it); the
        cancel is the message's outcome either way."""
        return self.abort_flag is not None and self.abort_flag()

    def _backend(self) -> HandlerBackend:
        if self.backend is None:
            raise RuntimeError("this context is not attached to a running message")
        return self.backend

    def add_child(
        self,
        service: str,
        operation: str,
        payload: Any,
        *,
        soft: bool = False,
        correlation_id: str | None = None,
        object_id: str | None = None,
        entity_type: str | None = None,
        funnel_value: str | None = None,
        funnel_component_id: str | None = None,
        guaranteed_order: bool = False,
        exclude_failed_state: bool = False,
    ) -> None:
        """Split: a child stored when the handler returns. With HARD children (the default)
        the message waits (WAITING) until they are all OK, and fails when one fails; SOFT
        children (``soft=True``) never affect it. A child's correlation id defaults to
        ``<parent correlation id>/<n>``, so a retried split stores nothing twice."""
        self.children.append(
            ChildSpec(
                service=service,
                operation=operation,
                payload=payload,
                binding=BindingType.SOFT if soft else BindingType.HARD,
                correlation_id=correlation_id,
                object_id=object_id,
                entity_type=entity_type,
                funnel_value=funnel_value,
                funnel_component_id=funnel_component_id,
                guaranteed_order=guaranteed_order,
                exclude_failed_state=exclude_failed_state,
            )
        )

    def wait_for_response(
        self, correlation_id: str | None = None, timeout_s: int | None = None
    ) -> None:
        """Park the message in WAITING_FOR_RES when the handler returns, until
        ``POST /messages/responses`` names ``correlation_id`` (default: the message's own),
        or FAILED after ``timeout_s`` (default ``asynch.responseTimeoutSec``). The wait is
        registered at once, so a response that arrives before the handler returns is kept."""
        cid = correlation_id or self.correlation_id
        self._backend().register_wait(self, cid, timeout_s or 0)
        self.waits_for = cid

    def message_key(self) -> CallKey:
        return CallKey.message(self.source_system, self.correlation_id)

    def entity_key(self) -> CallKey:
        if self.object_id is None:
            raise ValueError("the message has no object_id for an entity key")
        return CallKey.entity(self.entity_type or self.operation, self.object_id)

    def external_call(self, operation: str, key: CallKey, call: Callable[[], T]) -> CallResult[T]:
        """Run ``call`` unless the key's last call makes it obsolete or a duplicate; raises
        :class:`~worker.core.errors.CallInProgress` (the message is POSTPONED and taken up again)
        while another message's call on the key runs."""
        return self._backend().external_call(self, operation, key, call)

    def post(
        self, uri: str, body: Any, *, res_join_id: str | None = None, timeout_s: float = 10.0
    ) -> tuple[int, str]:
        """POST JSON, logged in ``request``/``response``; raises ExchangeFailed unless 2xx."""
        return self._backend().post(self, uri, body, res_join_id, timeout_s)


Handler = Callable[[MessageContext], None]


@dataclass(frozen=True)
class Retry:
    """A handler's retry policy: a failed try is retried after ``delay_s * multiplier ^
    attempt`` seconds (the first retry is attempt 1), at most ``max_delay_s``, up to
    ``attempts`` retries; then the message is FAILED. Only errors of the ``retry_on`` types
    are retried (others fail the message at once); a stopped handler (its time limit) counts
    as a retried error. Fields left None take the configuration table's values:
    ``asynch.partlyFailedIntervalSec``, ``asynch.partlyFailedMultiplier``,
    ``asynch.countPartlyFailsBeforeFailed``, ``asynch.partlyFailedMaxIntervalSec``."""

    delay_s: float | None = None
    multiplier: float | None = None
    attempts: int | None = None
    max_delay_s: float | None = None
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        problems = policy_problems(
            0 if self.delay_s is None else _ms(self.delay_s),
            1.0 if self.multiplier is None else self.multiplier,
            0 if self.attempts is None else self.attempts,
            MAX_DELAY_MS if self.max_delay_s is None else _ms(self.max_delay_s),
        )
        if problems:
            name, problem = problems[0]
            raise ValueError(f"retry policy: {name.removesuffix('_ms')} {problem}")
        if not self.retry_on or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in self.retry_on
        ):
            raise ValueError("retry policy: retry_on must name exception types")

    def policy(self, default: RetryPolicy) -> RetryPolicy:
        """This policy with the defaults filled in."""
        return RetryPolicy(
            delay_ms=default.delay_ms if self.delay_s is None else _ms(self.delay_s),
            multiplier=default.multiplier if self.multiplier is None else self.multiplier,
            attempts=default.attempts if self.attempts is None else self.attempts,
            max_delay_ms=(
                default.max_delay_ms if self.max_delay_s is None else _ms(self.max_delay_s)
            ),
        )

    def retries(self, error: BaseException) -> bool:
        """Whether a try that raised ``error`` is retried."""
        return isinstance(error, self.retry_on)


def _ms(seconds: float) -> int:
    return round(seconds * 1000) if math.isfinite(seconds) else -1


DEFAULT_RETRY = Retry()


class HandlerRegistry:
    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], Handler] = {}
        self._limits: dict[tuple[str, str], float] = {}
        self._retries: dict[tuple[str, str], Retry] = {}

    def register(
        self,
        service: str,
        operation: str,
        *,
        time_limit_s: float | None = None,
        retry: Retry | None = None,
    ) -> Callable[[Handler], Handler]:
        """Decorator: ``@registry.register("customer", "createCustomer")``; ``time_limit_s``
        is the handler's own time limit (default: ORDERLY_HANDLER_TIME_LIMIT_MS), ``retry``
        its retry policy (default: the configuration table's)."""

        def wrap(fn: Handler) -> Handler:
            self.add(service, operation, fn, time_limit_s=time_limit_s, retry=retry)
            return fn

        return wrap

    def add(
        self,
        service: str,
        operation: str,
        fn: Handler,
        *,
        time_limit_s: float | None = None,
        retry: Retry | None = None,
    ) -> None:
        key = (service, operation)
        if time_limit_s is not None and not (
            isinstance(time_limit_s, int | float)
            and not isinstance(time_limit_s, bool)
            and math.isfinite(time_limit_s)
            and time_limit_s > 0
        ):
            raise ValueError(
                f"the time limit of {service}.{operation} must be a positive number of "
                f"seconds, got {time_limit_s!r}"
            )
        existing = self._handlers.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"a handler for {service}.{operation} is already registered")
        self._handlers[key] = fn
        if time_limit_s is not None:
            self._limits[key] = float(time_limit_s)
        if retry is not None:
            if not isinstance(retry, Retry):
                raise ValueError(f"the retry policy of {service}.{operation} must be a Retry")
            self._retries[key] = retry

    def get(self, service: str, operation: str) -> Handler | None:
        return self._handlers.get((service, operation))

    def time_limit_s(self, service: str, operation: str) -> float | None:
        """The handler's declared time limit; None when it takes the default."""
        return self._limits.get((service, operation))

    def retry(self, service: str, operation: str) -> Retry:
        """The handler's declared retry policy (its unset fields: the configuration's)."""
        return self._retries.get((service, operation), DEFAULT_RETRY)

    def has_service(self, service: str) -> bool:
        return any(s == service for s, _ in self._handlers)

    def all_limited(self) -> bool:
        """Whether every handler declares its own time limit."""
        return all(key in self._limits for key in self._handlers)

    def routes(self) -> list[tuple[str, str]]:
        return sorted(self._handlers)


registry = HandlerRegistry()


def load_handler_modules(modules: Iterable[str]) -> None:
    """Import the modules that register handlers (ORDERLY_HANDLER_MODULES)."""
    for name in modules:
        importlib.import_module(name)
