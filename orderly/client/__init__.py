"""orderly's HTTP client for producers and consumers: sync (:class:`Client`) and async
(:class:`AsyncClient`), on httpx.

It needs nothing of orderly but its address and an API key: it imports httpx and pydantic
only. Bodies are dicts or pydantic models (the API's own ``MessageIn``, ``PublishIn``, ... are
sent as they dump). Every refusal of the API (``{"errors": [{"field", "problem"}]}``) is raised
as a typed :class:`OrderlyError` (a submit whose ids another message holds:
:class:`ConflictingMessage`, with the stored ``msg_id``); a 503 is tried again after its
``Retry-After`` (at most ``retries`` times, each wait at most ``max_wait_s``).

    with Client("http://127.0.0.1:8000", api_key) as orderly:
        sent = orderly.submit(message)            # Submitted(msg_id, state, created)
        orderly.message(sent.msg_id)["state"]
"""

from orderly.client.async_client import AsyncClient
from orderly.client.calls import Acked, MessageFilter, Published, Submitted
from orderly.client.client import Client
from orderly.client.errors import (
    BadRequest,
    Conflict,
    ConflictingMessage,
    Forbidden,
    Invalid,
    NoAnswer,
    NotFound,
    OrderlyError,
    PayloadTooLarge,
    Problem,
    RateLimited,
    ServerError,
    TimedOut,
    Unauthorized,
    Unavailable,
    Unreachable,
)

__all__ = [
    "Acked",
    "AsyncClient",
    "BadRequest",
    "Client",
    "Conflict",
    "ConflictingMessage",
    "Forbidden",
    "Invalid",
    "MessageFilter",
    "NoAnswer",
    "NotFound",
    "OrderlyError",
    "PayloadTooLarge",
    "Problem",
    "Published",
    "RateLimited",
    "ServerError",
    "Submitted",
    "TimedOut",
    "Unauthorized",
    "Unavailable",
    "Unreachable",
]
