"""What a running handler may ask of orderly (``MessageContext.backend``), on the connection
that holds its message's claim: wait for a response, call an external system once per
entity, POST with the call logged."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

from orderly.worker.configuration import ConfigReader
from orderly.worker.core.errors import HandlerError, InvalidMessage
from orderly.worker.core.http import OutboundHttp, SignedAs
from orderly.worker.db.prepared import PreparedConnection
from orderly.worker.messages import extcall, store
from orderly.worker.messages.extcall import CallKey, CallResult
from orderly.worker.messages.handlers import MessageContext

T = TypeVar("T")

ERROR_WAIT_CONFLICT = "E_WAIT_CONFLICT"


class HandlerBackend:
    """What a running handler may ask of orderly, on the connection holding its claim."""

    def __init__(
        self, conn: PreparedConnection, config: ConfigReader, integrity: Any, http: OutboundHttp
    ) -> None:
        self._conn = conn
        self._config = config
        self._integrity = integrity
        self._http = http

    def register_wait(self, ctx: MessageContext, correlation_id: str, timeout_s: int) -> None:
        if not correlation_id or len(correlation_id) > 255:
            raise InvalidMessage("correlation_id", "must be 1 to 255 characters")
        timeout = timeout_s if timeout_s > 0 else self._config.get_int("asynch.responseTimeoutSec")
        try:
            held = store.register_wait(self._conn, ctx.msg_id, correlation_id, timeout)
        except self._integrity:
            raise HandlerError(
                ERROR_WAIT_CONFLICT,
                f"another message already waits for a response to {correlation_id!r}",
            ) from None
        if not held:
            raise HandlerError("E_LOST_CLAIM", "the message was taken over while its handler ran")

    def external_call(
        self, ctx: MessageContext, operation: str, key: CallKey, call: Callable[[], T]
    ) -> CallResult[T]:
        return extcall.external_call(
            self._conn, ctx.msg_id, ctx.msg_timestamp, operation, key, call
        )

    def post(
        self, ctx: MessageContext, uri: str, body: Any, res_join_id: str | None, timeout_s: float
    ) -> tuple[int, str]:
        return extcall.post_logged(
            self._conn,
            self._http,
            ctx.msg_id,
            uri,
            body,
            res_join_id=res_join_id,
            timeout_ms=max(1, round(timeout_s * 1000)),
            # one id for every try of this message's call to this URI
            signed_as=SignedAs("source_system", ctx.source_system, _call_id(ctx, uri, res_join_id)),
        )


def _call_id(ctx: MessageContext, uri: str, res_join_id: str | None) -> str:
    """The webhook-id of a handler's POST: its message and what it calls (no '.')."""
    called = hashlib.sha256(f"{uri}\x1f{res_join_id or ''}".encode()).hexdigest()[:16]
    return f"call_{ctx.msg_id}_{called}"
