"""Event types' JSON schemas, with their regular expressions in a linear-time engine.

A schema's ``pattern`` and ``patternProperties`` come from whoever registers the event type.
Python's ``re`` backtracks: ``^(a+)+$`` against 27 characters takes seconds, holding the GIL,
so one publish could stall a whole API process. Here every pattern runs in RE2 (google-re2),
whose time grows linearly with the input. A pattern RE2 cannot run (a backreference, a
lookaround) is refused when the event type is registered, naming where it is.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import re2
from jsonschema.exceptions import ValidationError

from worker.core.errors import InvalidMessage

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to its author, not logged


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return re2.compile(pattern, _OPTIONS)


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if _compiled(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _patterns(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every regular expression a schema holds, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}"
            if key == "pattern" and isinstance(value, str):
                yield here, value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from ((f"{here}.{p}", p) for p in value)
            yield from _patterns(value, here)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _patterns(value, f"{path}[{index}]")


def check_patterns(schema: Any) -> None:
    """Refuse a schema with a regular expression the linear-time engine cannot run."""
    for where, pattern in _patterns(schema, "schema"):
        try:
            _compiled(pattern)
        except re2.error as exc:
            why = exc.args[0] if exc.args else exc
            if isinstance(why, bytes):
                why = why.decode("utf-8", "replace")
            raise InvalidMessage(
                where,
                f"{pattern[:80]!r} cannot be used: {why} (patterns run in RE2, in linear time:"
                " no backreferences or lookarounds)",
            ) from None


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    base = jsonschema.validators.validator_for(schema)
    linear = jsonschema.validators.extend(
        base, {"pattern": _pattern, "patternProperties": _pattern_properties}
    )
    return linear(schema)


def validator(schema: Any) -> Any:
    """A validator of this schema whose patterns run in RE2 (one per distinct schema)."""
    return _validator(json.dumps(schema, sort_keys=True))
