"""Message handlers, registered per (service, operation): the consumer chosen by routing key."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime


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


Handler = Callable[[MessageContext], None]


class HandlerRegistry:
    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], Handler] = {}

    def register(self, service: str, operation: str) -> Callable[[Handler], Handler]:
        """Decorator: ``@registry.register("customer", "createCustomer")``."""

        def wrap(fn: Handler) -> Handler:
            self.add(service, operation, fn)
            return fn

        return wrap

    def add(self, service: str, operation: str, fn: Handler) -> None:
        key = (service, operation)
        existing = self._handlers.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"a handler for {service}.{operation} is already registered")
        self._handlers[key] = fn

    def get(self, service: str, operation: str) -> Handler | None:
        return self._handlers.get((service, operation))

    def has_service(self, service: str) -> bool:
        return any(s == service for s, _ in self._handlers)

    def routes(self) -> list[tuple[str, str]]:
        return sorted(self._handlers)


registry = HandlerRegistry()


def load_handler_modules(modules: Iterable[str]) -> None:
    """Import the modules that register handlers (ORDERLY_HANDLER_MODULES)."""
    for name in modules:
        importlib.import_module(name)
