"""The one outbound HTTP client: conversation deliveries, pushes, external calls, confirmations.

httpx's HTTP transport with keep-alive connections (one pool per process, made again after a
fork), a connect timeout, a total deadline per request (the answer is read against it), at
most ``max_response_bytes`` of an answer, and the proxy and CA bundle of the settings (the
environment's proxy variables are not read: set ``ORDERLY_HTTP_PROXY``). Requests go to the
transport directly: orderly needs no cookies, redirects or auth flows, and the client layer
above the transport costs more CPU per request than the rest of a delivery. A connection
that fails to open is tried once more; nothing else is retried here: the callers' retry
policies decide.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

# httpx logs every request at INFO; orderly's callers log what matters (failures, retries).
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass(frozen=True)
class HttpOptions:
    connect_timeout_s: float = 3.0
    proxy: str | None = None
    ca_bundle: str | None = None  # a CA file; None: the default bundle
    max_connections: int = 100
    max_response_bytes: int = 1_048_576


@dataclass(frozen=True)
class Reply:
    """An answer (``status``), or why there is none (``status`` None and ``error``)."""

    status: int | None
    content: bytes = b""
    error: str = ""
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def describe(self, limit: int = 200) -> str:
        """One line for logs and failure records."""
        if self.status is None:
            return self.error
        return f"HTTP {self.status}: {self.content[:limit]!r}"


class OutboundHttp:
    def __init__(self, options: HttpOptions | None = None) -> None:
        self.options = options or HttpOptions()
        self._lock = threading.Lock()
        self._transport: httpx.HTTPTransport | None = None
        self._pid = 0

    def _connections(self) -> httpx.HTTPTransport:
        # A pool made before a fork must not be used by the child (shared sockets).
        if self._transport is None or self._pid != os.getpid():
            with self._lock:
                if self._transport is None or self._pid != os.getpid():
                    self._transport = self._make()
                    self._pid = os.getpid()
        return self._transport

    def _make(self) -> httpx.HTTPTransport:
        o = self.options
        verify: ssl.SSLContext | bool = True
        if o.ca_bundle:
            verify = ssl.create_default_context(cafile=o.ca_bundle)
        limits = httpx.Limits(
            max_connections=o.max_connections, max_keepalive_connections=o.max_connections
        )
        proxy = httpx.Proxy(o.proxy) if o.proxy else None
        return httpx.HTTPTransport(verify=verify, limits=limits, retries=1, proxy=proxy)

    def post_json(
        self,
        url: str,
        body: Any,
        *,
        timeout_ms: int,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """POST ``body`` as compact JSON; the answer within ``timeout_ms`` in all, or why not."""
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
        return self.post(url, data, timeout_ms=timeout_ms, headers=headers)

    def post(
        self,
        url: str,
        content: bytes,
        *,
        timeout_ms: int,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """POST ``content`` (JSON); the answer within ``timeout_ms`` in all, or why not."""
        deadline = time.monotonic() + timeout_ms / 1000
        total = timeout_ms / 1000
        connect = min(self.options.connect_timeout_s, total)
        try:
            request = httpx.Request(
                "POST",
                url,
                content=content,
                headers={"Content-Type": "application/json", **(headers or {})},
                extensions={
                    "timeout": {"connect": connect, "read": total, "write": total, "pool": total}
                },
            )
            answer = self._connections().handle_request(request)
        except httpx.TimeoutException:
            return Reply(None, b"", f"timeout after {timeout_ms} ms")
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            return Reply(
                None, b"", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        try:
            chunks, size, truncated = [], 0, False
            for chunk in answer.iter_raw():
                if time.monotonic() > deadline:
                    return Reply(None, b"", f"timeout after {timeout_ms} ms (total)")
                chunks.append(chunk)
                size += len(chunk)
                if size > self.options.max_response_bytes:
                    truncated = True
                    break
            read = b"".join(chunks)[: self.options.max_response_bytes]
            return Reply(answer.status_code, read, truncated=truncated)
        except httpx.TimeoutException:
            return Reply(None, b"", f"timeout after {timeout_ms} ms")
        except httpx.HTTPError as exc:
            return Reply(
                None, b"", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        finally:
            answer.close()
