"""What every router takes from a request: the app's runtime and intake, and a JSON body."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from starlette.concurrency import run_in_threadpool

from orderly.api.http.errors import MalformedBody, PayloadTooLarge
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.messages.intake import Intake
from orderly.worker.runtime import Runtime


def runtime_of(request: Request) -> Runtime:
    """The app's runtime (a busy route's, taken without a dependency)."""
    runtime: Runtime = request.app.state.runtime
    return runtime


async def app_runtime(request: Request) -> Runtime:
    return runtime_of(request)


def intake_of(request: Request) -> Intake:
    """The intake the lifespan built (it needs the Celery face, imported at startup)."""
    intake: Intake = request.app.state.intake
    return intake


async def app_intake(request: Request) -> Intake:
    return intake_of(request)


AppRuntime = Annotated[Runtime, Depends(app_runtime)]
# A row id in a path (msg_id, subscription_id, delivery_id): a PostgreSQL bigint.
RowId = Annotated[int, Path(ge=1, le=9_223_372_036_854_775_807)]
AppIntake = Annotated[Intake, Depends(app_intake)]


# Deeper JSON is refused: nothing orderly takes needs it, and PostgreSQL, jsonschema and the
# encoders all recurse.
MAX_DEPTH = 64
# A body may be this much larger than the largest payload (the envelope around it).
ENVELOPE_BYTES = 65_536


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _text(value: str, path: str) -> None:
    if "\x00" in value:
        raise InvalidMessage(path or "body", "NUL characters (\\u0000) are not accepted")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidMessage(path or "body", "holds a lone surrogate: not text") from None


def _walk(value: Any, path: str, depth: int, escapes: bool) -> None:
    if depth > MAX_DEPTH:
        raise InvalidMessage(path or "body", f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidMessage(path or "body", "NaN and Infinity are not JSON numbers")
    if isinstance(value, str):
        if escapes:
            _text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            if escapes:
                _text(key, _path(path, "<key>"))
            _walk(item, _path(path, key), depth + 1, escapes)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, _path(path, index), depth + 1, escapes)


def parse_json(raw: bytes, limit: int) -> Any:
    """A request body as JSON that orderly can store: at most ``limit`` bytes; no NaN,
    Infinity or numbers beyond a double's range; no number of more than 4,300 digits; no
    NUL character or lone surrogate in any string; at most MAX_DEPTH levels. Anything else is
    refused naming where it is, before anything is stored."""
    if len(raw) > limit:
        raise PayloadTooLarge(f"{len(raw)} bytes is over the limit of {limit} bytes")
    try:
        # UTF-8 and nothing else (json.loads would also take UTF-16/32 and encoded surrogates).
        body = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedBody(f"not UTF-8: {exc}") from None
    nonfinite = False

    def number(text: str) -> float:
        nonlocal nonfinite
        value = float(text)
        nonfinite = nonfinite or not math.isfinite(value)
        return value

    try:
        value = json.loads(body, parse_constant=number, parse_float=number)
    except json.JSONDecodeError as exc:
        raise MalformedBody(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise InvalidMessage("body", f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise InvalidMessage("body", f"a number is too long: {str(exc)[:80]}") from None
    # Only \u escapes make NUL characters and lone surrogates, and only brackets nest.
    escapes = "\\u" in body
    if escapes or nonfinite or body.count("[") + body.count("{") > MAX_DEPTH:
        _walk(value, "", 0, escapes)
    return value


# Bodies larger than this are parsed in a thread, off the event loop.
THREAD_BYTES = 65_536


async def small_body(request: Request) -> bool:
    """Whether the request's body is small enough to be validated on the event loop (it is
    read once: a body read before costs nothing again)."""
    return len(await request.body()) <= THREAD_BYTES


async def json_body(request: Request, limit: int | None = None) -> Any:
    """The request's JSON body, read strictly; at most ``limit`` bytes (default: one
    message's payload limit and its envelope)."""
    # Read by hand, not declared as a body model: worker.* validates and names the fields.
    runtime: Runtime = request.app.state.runtime
    if limit is None:
        limit = runtime.settings.max_payload_bytes + ENVELOPE_BYTES
    raw = await request.body()
    if len(raw) > THREAD_BYTES:
        return await run_in_threadpool(parse_json, raw, limit)
    return parse_json(raw, limit)
