"""Input validation shared by every entry point: pydantic models in, InvalidMessage out.

A face hands the raw decoded body to the mechanism; the mechanism validates it here, so that
every bad field is named in one error, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ValidationError

from orderly.worker.core.errors import InvalidMessage

T = TypeVar("T", bound=BaseModel)


def parse_timestamp(value: Any) -> datetime:
    """An ISO 8601 timestamp (or a datetime); one without an offset is taken as UTC."""
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"{value!r} is not an ISO 8601 timestamp (e.g. 2026-01-31T12:00:00Z)"
            ) from None
    else:
        raise ValueError(f"must be an ISO 8601 timestamp string, got {type(value).__name__}")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def utc_timestamp(value: Any) -> datetime:
    """:func:`parse_timestamp` in UTC (any offset Python reads, whatever PostgreSQL takes)."""
    parsed = parse_timestamp(value)
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        raise ValueError(f"{value!r} is out of range") from None


# An instant given as ISO 8601 (no offset: UTC), held in UTC.
UtcTime = Annotated[datetime, BeforeValidator(utc_timestamp)]


def _field_name(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def invalid_from(exc: ValidationError) -> InvalidMessage:
    """A pydantic error as InvalidMessage: each bad field named once, with its problem."""
    seen: dict[str, str] = {}
    for err in exc.errors():
        # union members add their type to the location; keep the field name only
        field = _field_name(tuple(err["loc"])[:1])
        problem = "missing" if err["type"] == "missing" else err["msg"]
        if err["type"] == "extra_forbidden":
            problem = "unknown field"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            problem = str(err["ctx"]["error"])  # the validator's own words, without a prefix
        seen.setdefault(field, problem)
    items = list(seen.items())
    return InvalidMessage(items[0][0], items[0][1], *items[1:])


def parse_input(model: type[T], data: Any) -> T:
    """Validate a decoded JSON body against ``model``; InvalidMessage names every bad field."""
    if not isinstance(data, Mapping):
        raise InvalidMessage("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise invalid_from(exc) from None
