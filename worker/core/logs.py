"""Logging: plain text or one JSON object per line (``ORDERLY_LOG_FORMAT``), with the ids of
what is being worked on.

A mechanism names what it works on with :func:`bound` (``msg_id``, ``correlation_id``,
``conversation_id``, ``task``, ...); every record logged inside carries those fields, and the
node's code. The text format shows them in brackets; the JSON format as keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Never changed in place: each bind sets a new mapping.
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "orderly_log_context", default=MappingProxyType({})
)
_node = ""


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Fields every record logged inside carries (None values are left out)."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def push(**fields: Any) -> contextvars.Token[Mapping[str, Any]]:
    """:func:`bound` for a caller that ends it elsewhere (Celery's task signals): give the
    token to :func:`pop` in the same thread."""
    return _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})


def pop(token: contextvars.Token[Mapping[str, Any]]) -> None:
    _context.reset(token)


def context() -> dict[str, Any]:
    return dict(_context.get())


class ContextFilter(logging.Filter):
    """Puts the bound fields and the node on each record (``record.orderly``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = context()
        if _node:
            fields.setdefault("node", _node)
        record.orderly = fields
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the bound ids, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        found: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        found.update(getattr(record, "orderly", None) or {})
        if record.exc_info:
            found["exception"] = self.formatException(record.exc_info)
        return json.dumps(found, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The plain format, with the bound ids in brackets after the message."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "orderly", None) or {}
        shown = " ".join(f"{k}={v}" for k, v in fields.items() if k != "node")
        return f"{line} [{shown}]" if shown else line


class _WithIds(logging.Formatter):
    """Another library's formatter, with the bound ids in brackets after its line."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        line = self.inner.format(record)
        fields = getattr(record, "orderly", None) or {}
        shown = " ".join(f"{k}={v}" for k, v in fields.items() if k != "node")
        return f"{line} [{shown}]" if shown else line


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


def dress(handler: logging.Handler, fmt: str) -> None:
    """Give a handler orderly's format and context (handlers another library made too)."""
    handler.setFormatter(formatter(fmt))
    if not any(isinstance(f, ContextFilter) for f in handler.filters):
        handler.addFilter(ContextFilter())


def set_node(node: str) -> None:
    global _node
    _node = node


def adopt(logger: logging.Logger, fmt: str) -> None:
    """A logger another library set up (Celery's): in the JSON format its handlers write JSON;
    in the text format they keep theirs and gain the context."""
    logging.captureWarnings(fmt == "json")
    for handler in logger.handlers:
        if fmt == "json":
            dress(handler, fmt)
            continue
        if not isinstance(handler.formatter, _WithIds):
            handler.setFormatter(_WithIds(handler.formatter or logging.Formatter()))
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())


def configure(level: str, fmt: str, node: str = "") -> None:
    """The root logger at ``level`` with one stream handler in ``fmt`` ("text" or "json")."""
    set_node(node)
    # Python's warnings as records too: in JSON, nothing but JSON on the stream.
    logging.captureWarnings(fmt == "json")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        dress(handler, fmt)
