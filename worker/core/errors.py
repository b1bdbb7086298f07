"""orderly's exceptions: one base class, every error orderly raises on purpose below it.

Driver errors are translated at the edge (``raise ... from None``). Lua scripts report a
refusal as an error reply whose first word is a code (``ORDERLY_KEY_EXISTS <key>``);
:func:`from_script_error` is the one place those codes become exceptions. The faces map the
classes to HTTP statuses and exit codes (``api/http/errors.py``, the CLI).
"""

from __future__ import annotations

from collections.abc import Callable


class OrderlyError(Exception):
    """Base of every error orderly raises on purpose."""


class InvalidMessage(OrderlyError):
    """Input refused before anything was stored; each problem names its field."""

    def __init__(self, field: str, problem: str, *more: tuple[str, str]) -> None:
        self.problems: list[tuple[str, str]] = [(field, problem), *more]
        self.field = field
        self.problem = problem
        super().__init__("; ".join(f"{f}: {p}" for f, p in self.problems))


class NotFound(OrderlyError):
    """A named thing (room, subscription, pulled message, ...) does not exist."""

    def __init__(self, what: str, name: object) -> None:
        self.what = what
        super().__init__(f"no {what} {name!r}")


class MessageNotFound(OrderlyError):
    def __init__(self, msg_id: int) -> None:
        self.msg_id = msg_id
        super().__init__(f"message {msg_id} does not exist")


class NodeNotAccepting(OrderlyError):
    """The node refuses new input (HANDLES_EXISTING_MESSAGES or STOPPED)."""

    def __init__(self, code: str, state: str) -> None:
        self.code = code
        self.state = state
        super().__init__(f"node {code!r} is {state} and accepts no new messages")


class ServiceUnavailable(OrderlyError):
    """A service orderly depends on cannot be reached now; the same request may succeed later.

    ``service`` is ``postgresql``, ``redis``, ``redis-cluster`` or ``broker``; ``detail`` the
    driver's one-line reason (never a traceback).
    """

    NAMES = {
        "postgresql": "PostgreSQL",
        "redis": "Redis",
        "redis-cluster": "The Redis Cluster",
        "broker": "The broker",
    }

    def __init__(self, service: str, detail: str) -> None:
        self.service = service
        self.detail = detail
        super().__init__(f"{self.NAMES.get(service, service)} is unreachable: {detail}")


def first_line(exc: BaseException) -> str:
    """A driver exception's reason without its continuation lines (hints, context)."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


class NodeNotFound(OrderlyError):
    def __init__(self, code: str) -> None:
        super().__init__(f"node {code!r} does not exist")


class ConfigurationError(OrderlyError):
    """The configuration table is inconsistent, or a value was refused."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration: " + "; ".join(problems))


class SettingMissing(OrderlyError):
    """A setting the operation needs is not set in this process (``setting`` names it)."""

    def __init__(self, setting: str, why: str) -> None:
        self.setting = setting
        super().__init__(f"{setting} is not set in this process: {why}")


class HandlerError(OrderlyError):
    """Raised by a handler to fail a message with an error code of its choosing."""

    def __init__(self, code: str, description: str) -> None:
        self.code = code
        self.description = description
        super().__init__(f"{code}: {description}")


class UnknownChannel(OrderlyError):
    """No delivery channel is configured for an origin."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        super().__init__(
            f"no channel for origin {origin!r}: PUT /channels/{origin} or set ORDERLY_CHANNELS"
        )


class UnknownRequest(OrderlyError):
    """A response names a request orderly never registered (in that conversation)."""

    def __init__(self, request_id: str, conversation_id: str) -> None:
        self.request_id = request_id
        self.conversation_id = conversation_id
        super().__init__(f"request {request_id!r} is not known in conversation {conversation_id!r}")


class UnknownAck(OrderlyError):
    """An ACK for an async response id that is unknown, whose wait already ran out, or that
    does not bring its response's token (one answer for all three: no existence oracle)."""

    def __init__(self, async_response_id: str) -> None:
        self.async_response_id = async_response_id
        super().__init__(f"no message is waiting for the ACK {async_response_id!r} with this token")


class OperationRefused(OrderlyError):
    """An operator command that does not apply to the message in its current state."""

    def __init__(self, msg_id: int, reason: str) -> None:
        self.msg_id = msg_id
        super().__init__(f"message {msg_id}: {reason}")


class ConflictingMessage(OrderlyError):
    """A message submitted again under a stored (correlation_id, source_system) with other
    content: the stored one stands, the new one is refused."""

    def __init__(
        self,
        msg_id: int,
        correlation_id: str,
        source_system: str,
        fields: str,
        field: str = "correlation_id",
    ) -> None:
        self.msg_id = msg_id
        self.field = field  # where the refused input names the ids (a batch's item)
        self._args = (msg_id, correlation_id, source_system, fields)
        super().__init__(
            f"message {msg_id} holds correlation_id {correlation_id!r} of {source_system!r} "
            f"with another {fields}; submit the same message again, or use a new correlation_id"
        )

    def at(self, field: str) -> ConflictingMessage:
        """The same refusal, naming the field where the input holds the ids."""
        return ConflictingMessage(*self._args, field=field)


class ResponseNotAwaited(OrderlyError):
    """A response names a correlation id no message waits for."""

    def __init__(self, correlation_id: str) -> None:
        self.correlation_id = correlation_id
        super().__init__(f"no message waits for a response with correlation id {correlation_id!r}")


class CallInProgress(OrderlyError):
    """Another message's call on the same key is running; the message is taken up later."""

    def __init__(self, operation: str, entity_id: str, msg_id: int) -> None:
        self.operation = operation
        self.entity_id = entity_id
        super().__init__(
            f"external call {operation} on {entity_id!r} is in progress for message {msg_id}"
        )


class ExchangeFailed(OrderlyError):
    """An HTTP exchange got no answer or a non-2xx answer (logged as a failed response)."""

    def __init__(self, uri: str, reason: str, status: int | None = None) -> None:
        self.uri = uri
        self.reason = reason
        self.status = status
        super().__init__(f"{uri}: {reason}")


class Unauthorized(OrderlyError):
    """A message whose token is missing, forged, expired or for someone else."""


class Unauthenticated(OrderlyError):
    """An HTTP request without a valid credential (an API key, an ACK token): 401."""

    def __init__(self, problem: str, field: str = "Authorization") -> None:
        self.field = field
        super().__init__(problem)


class Forbidden(OrderlyError):
    """A valid API key without the scope a request needs: 403 naming the scope."""

    def __init__(self, scope: str, key: str) -> None:
        self.scope = scope
        super().__init__(f"the key {key!r} lacks the scope {scope!r}")


class TrackingError(OrderlyError):
    """A tracking or service key that must not exist does (e.g. its id counter was reset)."""


# --- Lua error replies -----------------------------------------------------------------------

SCRIPT_ERRORS: dict[str, Callable[[str], OrderlyError]] = {
    # A counter handed out an id whose key still lives: the counter was reset under live keys.
    "ORDERLY_KEY_EXISTS": lambda key: TrackingError(
        f"{key} exists: its id counter was reset while its keys live; refusing to overwrite"
    ),
    # An ACK whose asyncRequest key or response is gone (or was never recorded).
    "ORDERLY_UNKNOWN_ACK": UnknownAck,
}


def from_script_error(message: str) -> OrderlyError | None:
    """The exception an orderly script meant by its error reply (None: not one of ours)."""
    code, _, detail = message.strip().partition(" ")
    make = SCRIPT_ERRORS.get(code)
    return None if make is None else make(detail)
