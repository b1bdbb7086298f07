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

from orderly.worker.core.errors import InvalidMessage

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to its author, not logged


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return re2.compile(pattern, _OPTIONS)


def _search(pattern: str, text: str) -> bool | None:
    """Does ``pattern`` occur in ``text``; None when RE2 cannot run it (a schema registered
    before patterns were checked)."""
    try:
        return bool(_compiled(pattern).search(text))
    except re2.error:
        return None


def _unrunnable(pattern: str) -> ValidationError:
    return ValidationError(
        f"the event type's schema holds {pattern[:80]!r}, which cannot run in linear time: "
        "register a new version without backreferences or lookarounds"
    )


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    found = _search(pattern, instance)
    if found is None:
        yield _unrunnable(pattern)
    elif not found:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            found = _search(pattern, name)
            if found is None:
                yield _unrunnable(pattern)
                return
            if found:
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


def validator(schema: Any, version: tuple[int, int] | None = None) -> Any:
    """A validator of this schema whose patterns run in RE2: one per event type version
    (``version``: its id and number; a registered version never changes), else one per
    distinct schema."""
    if version is None:
        return _validator(json.dumps(schema, sort_keys=True))
    return _by_version(version, schema)


# (event type id, version) -> (its schema, its validator); the schema is compared on use, so
# a database whose ids were given out again (a restore) never gets another version's rules.
_VERSIONS: dict[tuple[int, int], tuple[Any, Any]] = {}


def _by_version(version: tuple[int, int], schema: Any) -> Any:
    found = _VERSIONS.get(version)
    if found is None or found[0] != schema:
        if len(_VERSIONS) >= 1024:
            _VERSIONS.clear()
        found = _VERSIONS[version] = (schema, _validator(json.dumps(schema, sort_keys=True)))
    return found[1]
