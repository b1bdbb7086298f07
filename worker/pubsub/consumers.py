"""Consumers chosen by routing key (the broker seed's consumer classes): what a HANDLER
subscription's deliveries run in the workers, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orderly.worker.pubsub.claims import Claimed

ConsumerHandler = Callable[["Claimed"], None]


class Consumers:
    """Handlers chosen by routing key (the broker seed's consumer classes)."""

    def __init__(self) -> None:
        self._handlers: dict[str, ConsumerHandler] = {}

    def register(self, name: str) -> Callable[[ConsumerHandler], ConsumerHandler]:
        def add(fn: ConsumerHandler) -> ConsumerHandler:
            self._handlers[name] = fn
            return fn

        return add

    def get(self, name: str) -> ConsumerHandler | None:
        return self._handlers.get(name)


consumers = Consumers()
