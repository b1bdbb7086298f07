"""Names, routing keys and topic patterns: which subscriptions an event reaches.

A subscription selects events by event type (every version, or a range of them) and/or
routing-key pattern (topic rules: ``*`` one word, ``#`` zero or more).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9._~-]{1,100}$"
Name = Annotated[str, StringConstraints(strict=True, pattern=NAME_PATTERN)]
WORD = r"[A-Za-z0-9_-]+"
ROUTING_KEY = re.compile(rf"^{WORD}(\.{WORD})*$")
PATTERN = re.compile(rf"^({WORD}|\*|#)(\.({WORD}|\*|#))*$")
PATTERN_RULE = "dot-separated words, * (one word) or # (zero or more)"


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    words = routing_key.split(".")
    parts = pattern.split(".")
    if "#" not in parts:  # word for word: no search at all
        return len(parts) == len(words) and all(
            p in ("*", w) for p, w in zip(parts, words, strict=True)
        )

    @functools.cache  # each (part, word) pair once: linear in their product, never exponential
    def match(i: int, j: int) -> bool:
        if i == len(parts):
            return j == len(words)
        if parts[i] == "#":
            return any(match(i + 1, k) for k in range(j, len(words) + 1))
        if j == len(words):
            return False
        return (parts[i] == "*" or parts[i] == words[j]) and match(i + 1, j + 1)

    return match(0, 0)


def order_value(payload: Any, path: str) -> str | None:
    """The value at a dotted payload path, as text (None when absent)."""
    value = payload
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)[:255]


@dataclass(frozen=True)
class Route:
    """An active subscription as routing sees it."""

    subscription_id: int
    kind: str
    event_type_id: int | None
    routing_key_pattern: str | None
    order_key: str | None
    # the event type's versions it selects (None: that end is open)
    min_version: int | None = None
    max_version: int | None = None
    name: str = ""

    @property
    def pull(self) -> bool:
        return self.kind == "PULL"

    @property
    def handler(self) -> bool:
        return self.kind == "HANDLER"

    def selects(self, event_type_id: int | None, version: int | None, routing_key: str) -> bool:
        if self.event_type_id is not None:
            if self.event_type_id != event_type_id or version is None:
                return False
            if self.min_version is not None and version < self.min_version:
                return False
            if self.max_version is not None and version > self.max_version:
                return False
        return self.routing_key_pattern is None or topic_matches(
            self.routing_key_pattern, routing_key
        )


def routes(rows: Sequence[dict[str, Any]]) -> list[Route]:
    """Routes from the subscriptions a query returns as JSON objects, by their keys."""
    return [Route(**r) for r in rows]
