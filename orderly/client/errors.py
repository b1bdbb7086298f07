"""The API's refusals as exceptions: one class per status, each with the problems it named."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Problem:
    """One refused field (or the service that is unreachable) and why."""

    field: str
    problem: str


class OrderlyError(Exception):
    """An answer of the API that is not a success."""

    status = 0

    def __init__(self, status: int, problems: list[Problem], retry_after_s: float | None = None):
        self.status = status
        self.problems = problems
        self.retry_after_s = retry_after_s
        shown = "; ".join(f"{p.field}: {p.problem}" for p in problems) or "no detail"
        super().__init__(f"HTTP {status}: {shown}")

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]


class NoAnswer(OrderlyError):
    """No answer from the API (status 0): it could not be reached, or did not answer in time;
    still so after the client's retries (an idempotent call is sent again, any call whose
    connection could not be made is)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(0, [Problem("server", f"{type(cause).__name__}: {cause}")])


class Unreachable(NoAnswer):
    """The API could not be connected to (refused, no route, a name that does not resolve)."""


class TimedOut(NoAnswer):
    """The API did not answer within the client's timeout."""


def no_answer(cause: Exception) -> NoAnswer:
    """The error of a transport failure (httpx's)."""
    if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout):
        return Unreachable(cause)
    if isinstance(cause, httpx.TimeoutException):
        return TimedOut(cause)
    return NoAnswer(cause)


class BadRequest(OrderlyError):
    """400: malformed input (not JSON, a NUL in the path, a value PostgreSQL cannot store)."""


class Unauthorized(OrderlyError):
    """401: no API key (or ACK token), or one that is unknown, revoked or expired."""


class Forbidden(OrderlyError):
    """403: the key lacks the scope the operation needs (named in the problem)."""


class NotFound(OrderlyError):
    """404: no such message, room, subscription, request or ACK id (or another tenant's: it
    answers as one that does not exist)."""


class Conflict(OrderlyError):
    """409: the message is not in a state that allows this, or (:class:`ConflictingMessage`)
    another message holds the submitted one's ids."""


class ConflictingMessage(Conflict):
    """409 of a submit: another message (another service, operation or payload) is stored
    under the same (correlation_id, source_system); nothing was stored. ``msg_id``: the stored
    message's, when the answer names it. Sending the same message again answers as before;
    a new message needs a new correlation_id."""

    def __init__(self, status: int, problems: list[Problem], retry_after_s: float | None = None):
        super().__init__(status, problems, retry_after_s)
        self.msg_id = _stored_msg_id(problems)


class PayloadTooLarge(OrderlyError):
    """413: the body is over the API's size limit."""


class Invalid(OrderlyError):
    """422: invalid input; every bad field is named."""


class RateLimited(OrderlyError):
    """429: over a rate limit (the address's, the key's, or its refused credentials');
    still so after the client's retries. ``retry_after_s``: when to try again."""


class Unavailable(OrderlyError):
    """503: a service orderly needs is unreachable, or the node takes no new input; still so
    after the client's retries."""


class ServerError(OrderlyError):
    """Any other status of 500 and above."""


BY_STATUS: dict[int, type[OrderlyError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: Invalid,
    429: RateLimited,
    503: Unavailable,
}


# The stored message a conflict names: "message 12 holds correlation_id ...".
_STORED = re.compile(r"\bmessage (\d+)\b")


def _stored_msg_id(problems: list[Problem]) -> int | None:
    for p in problems:
        found = _STORED.search(p.problem) if p.field.endswith("correlation_id") else None
        if found:
            return int(found.group(1))
    return None


def error_for(status: int, body: Any, retry_after_s: float | None = None) -> OrderlyError:
    """The exception of an answer with this status and (decoded) body."""
    problems = []
    if isinstance(body, dict) and isinstance(body.get("errors"), list):
        for item in body["errors"]:
            if isinstance(item, dict):
                problems.append(Problem(str(item.get("field", "")), str(item.get("problem", ""))))
    cls = BY_STATUS.get(status, ServerError if status >= 500 else OrderlyError)
    if status == 409 and any(p.field.endswith("correlation_id") for p in problems):
        # A conflict over a message's ids, not over a message's state (field msg_id).
        cls = ConflictingMessage
    return cls(status, problems, retry_after_s)
