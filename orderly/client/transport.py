"""What both clients share about the wire: the base URL, the key, the timeouts and retries; a
call made a request; how long a 429 or 503 asks to wait (Retry-After); an answer read into its
call's result or its error."""

from __future__ import annotations

from typing import Any, TypeVar

import httpx

from orderly.client.calls import Call
from orderly.client.errors import error_for, no_answer

T = TypeVar("T")

# Answers sent again after their Retry-After: a service down for a moment, a rate limit.
RETRIED = frozenset({429, 503})
# The wait before sending again when the API named none (no Retry-After, or no answer).
DEFAULT_WAIT_S = 1.0


class Settings:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        max_wait_s: float = 30.0,
    ) -> None:
        if retries < 0 or max_wait_s < 0:
            raise ValueError("retries and max_wait_s may not be negative")
        self.base_url = base_url.rstrip("/")
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_wait_s = max_wait_s

    def again_after(self, call: Call[Any], cause: httpx.TransportError, attempt: int) -> float:
        """Seconds to wait before sending ``call`` again after try ``attempt`` (0-based) got no
        answer (as after a 503 without Retry-After); raises the client's error when it is not
        sent again: tries spent, or a call that may have been carried out (not idempotent).
        A connection that could not be made was already tried again by httpx's transport
        (``retries`` times, with its own backoff): that is the end."""
        unsent = isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout)
        if attempt >= self.retries or unsent or not call.retry_safe:
            raise no_answer(cause) from cause
        return min(DEFAULT_WAIT_S, self.max_wait_s)

    def request(self, call: Call[Any]) -> dict[str, Any]:
        found = {
            "method": call.method,
            "url": call.path,
            "json": call.body,
            "params": call.params,
            "headers": dict(call.headers),
        }
        if call.wait_s:  # a long poll: its wait on top of the client's timeout
            found["timeout"] = self.timeout_s + call.wait_s
        return found

    def wait_s(self, answer: httpx.Response) -> float:
        try:
            wanted = float(answer.headers.get("Retry-After", str(DEFAULT_WAIT_S)))
        except ValueError:  # an HTTP date: orderly sends seconds
            wanted = DEFAULT_WAIT_S
        return min(max(wanted, 0.0), self.max_wait_s)

    def read(self, call: Call[T], answer: httpx.Response) -> T:
        try:
            body = answer.json() if answer.content else None
        except ValueError:
            body = None
        if answer.is_success:
            return call.read(answer.status_code, body)
        retry_after = self.wait_s(answer) if answer.status_code in RETRIED else None
        raise error_for(answer.status_code, body, retry_after)
