"""The handler API, as handler modules import it: ``from orderly.worker.handlers import
registry, MessageContext, Retry``. It lives in the message store's wing
(:mod:`orderly.worker.messages.handlers`); this module is its stable public name."""

from orderly.worker.messages.handlers import (
    DEFAULT_RETRY,
    ChildSpec,
    ExternalResponse,
    Handler,
    HandlerBackend,
    HandlerRegistry,
    MessageContext,
    Retry,
    load_handler_modules,
    registry,
)

__all__ = [
    "DEFAULT_RETRY",
    "ChildSpec",
    "ExternalResponse",
    "Handler",
    "HandlerBackend",
    "HandlerRegistry",
    "MessageContext",
    "Retry",
    "load_handler_modules",
    "registry",
]
