"""The one outbound HTTP client: conversation deliveries, pushes, external calls, confirmations.

httpx's connection pool (httpcore, the layer under httpx's transport) with keep-alive
connections (one pool per process, made again after a fork), a connect timeout, and a total
deadline per request: every connect, write and read is given only what is left of the
request's time, so an answer that trickles in, or a server that answers slowly in several
steps, cannot stretch it. At most ``max_response_bytes`` of an answer is read; the proxy and
CA bundle come from the settings (the environment's proxy variables are not read: set
``ORDERLY_HTTP_PROXY``). Requests go to the pool directly: orderly needs no cookies,
redirects or auth flows, and httpx's request and response models above the pool cost about
140 us of CPU per request, as much as the rest of the send. Nothing is retried here: the
callers' retry policies decide.

Every request a caller names a destination for (``signed_as``) is signed as the Standard
Webhooks specification defines (orderly.client.webhooks: ``webhook-id``,
``webhook-timestamp``, ``webhook-signature`` over the exact bytes sent), with the
destination's secrets as the client's ``signer`` finds them (worker.signing).
"""

from __future__ import annotations

import contextvars
import email.utils
import functools
import json
import logging
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpcore
import httpx

from orderly.client import webhooks
from orderly.worker.core import tracing
from orderly.worker.core.addresses import STRICT, AddressPolicy

# httpx logs every request at INFO; orderly's callers log what matters (failures, retries).
logging.getLogger("httpx").setLevel(logging.WARNING)

USER_AGENT = "orderly"
USER_AGENT_BYTES = USER_AGENT.encode()
# An idle kept-alive connection is closed after this long (httpx's default).
KEEPALIVE_EXPIRY_S = 5.0

# The monotonic time by which the request being made must be done (None: no deadline).
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "orderly_http_deadline", default=None
)


def _left(timeout: float | None, late: type[Exception]) -> float | None:
    """The time an I/O step may take: its own timeout, but never past the deadline."""
    deadline = _deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the request's total deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sockets, each step held to the current request's deadline, connecting
    only to addresses the outbound address policy allows (the host resolved here and the
    socket connected to a checked address; ``exempt``: the configured proxy)."""

    def __init__(self, policy: AddressPolicy, exempt: str | None = None) -> None:
        self._inner = httpcore.SyncBackend()
        self._policy = policy
        self._exempt = exempt

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        if host == self._exempt or self._policy.allows_host(host):
            return _DeadlineStream(
                self._inner.connect_tcp(host, port, left, local_address, socket_options)
            )
        failure: Exception | None = None
        for _, address in self._policy.resolve(host, port):  # OutboundRefused: none made
            try:
                return _DeadlineStream(
                    self._inner.connect_tcp(address, port, left, local_address, socket_options)
                )
            except httpcore.ConnectError as exc:
                failure = exc
                left = _left(timeout, httpcore.ConnectTimeout)
        raise failure or httpcore.ConnectError(f"{host} has no address")

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        left = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


Pool = httpcore.ConnectionPool | httpcore.HTTPProxy


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> httpcore.URL:
    """A URL as httpx reads it (IDNA hosts, percent-encoded paths), once per distinct URL."""
    parsed = httpx.URL(url)
    return httpcore.URL(
        scheme=parsed.raw_scheme, host=parsed.raw_host, port=parsed.port, target=parsed.raw_path
    )


def _pool(
    verify: ssl.SSLContext | bool, max_connections: int, proxy: str | None, policy: AddressPolicy
) -> Pool:
    """httpx's connection pool (httpcore) on the deadline-keeping, policy-checking backend."""
    url = httpx.URL(proxy) if proxy is not None else None
    options: dict[str, Any] = {
        "ssl_context": httpx.create_ssl_context(verify=verify),
        "max_connections": max_connections,
        "max_keepalive_connections": max_connections,
        "keepalive_expiry": KEEPALIVE_EXPIRY_S,
        "network_backend": _DeadlineBackend(policy, None if url is None else url.host),
    }
    if url is None:
        return httpcore.ConnectionPool(**options)
    return httpcore.HTTPProxy(
        proxy_url=httpcore.URL(
            scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
        ),
        **options,
    )


@dataclass(frozen=True)
class HttpOptions:
    connect_timeout_s: float = 3.0
    proxy: str | None = None
    ca_bundle: str | None = None  # a CA file; None: the default bundle
    max_connections: int = 100
    max_response_bytes: int = 1_048_576
    # Where requests may go (worker.core.addresses): by default no internal address.
    policy: AddressPolicy = STRICT


@dataclass(frozen=True)
class SignedAs:
    """Whom a request goes to, for its signature: the destination's kind and name (its
    secrets) and the request's ``webhook-id``, the same for every attempt of one delivery."""

    kind: str
    name: str
    webhook_id: str


# A destination's secrets by kind and name (worker.signing.SigningSecrets.for_send).
Signer = Callable[[str, str], list[str]]


# A receiver's ``Retry-After`` on these answers sets the next attempt (RFC 9110: 429, 503).
RETRY_AFTER_STATUS = frozenset({429, 503})
# The longest wait a ``Retry-After`` may ask for: a later one is cut to this.
MAX_RETRY_AFTER_MS = 3_600_000
# A receiver stops the retries of the one delivery it answers (any answer not 2xx carrying it).
STOP_HEADER = "X-Orderly-Retry"
STOP_VALUE = "stop"


def retry_after_ms(value: str | None, now: datetime) -> int | None:
    """``Retry-After`` (delta-seconds or an HTTP date) as milliseconds from ``now``, at most
    :data:`MAX_RETRY_AFTER_MS`; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        wait_ms = int(value[:12]) * 1000
    else:
        try:
            at = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if at.tzinfo is None:
            return None
        wait_ms = max(0, math.ceil((at - now).total_seconds() * 1000))
    return min(wait_ms, MAX_RETRY_AFTER_MS)


@dataclass(frozen=True)
class Reply:
    """An answer (``status``, its ``headers`` by lower-case name), or why there is none
    (``status`` None and ``error``)."""

    status: int | None
    content: bytes = b""
    error: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)

    def retry_after_ms(self, now: datetime) -> int | None:
        """The receiver's ``Retry-After`` on a 429 or 503 (None otherwise)."""
        if self.status not in RETRY_AFTER_STATUS:
            return None
        return retry_after_ms(self.headers.get("retry-after"), now)

    @property
    def stop(self) -> bool:
        """The receiver asked that this delivery be tried no more (``X-Orderly-Retry: stop``
        on an answer that is not 2xx)."""
        value = self.headers.get(STOP_HEADER.lower(), "")
        return not self.ok and value.strip().lower() == STOP_VALUE

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


# The answer headers callers read (the rest are not decoded).
_WANTED = frozenset({b"retry-after", STOP_HEADER.lower().encode()})


def _wanted(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {
        k.lower().decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() in _WANTED
    }


class OutboundHttp:
    def __init__(self, options: HttpOptions | None = None, signer: Signer | None = None) -> None:
        self.options = options or HttpOptions()
        self._signer = signer
        self._lock = threading.Lock()
        self._pool: Pool | None = None
        self._pid = 0

    def _connections(self) -> Pool:
        # A pool made before a fork must not be used by the child (shared sockets).
        if self._pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = self._make()
                    self._pid = os.getpid()
        return self._pool

    def _make(self) -> Pool:
        o = self.options
        verify: ssl.SSLContext | bool = True
        if o.ca_bundle:
            verify = ssl.create_default_context(cafile=o.ca_bundle)
        return _pool(verify, o.max_connections, o.proxy, o.policy)

    def post_json(
        self,
        url: str,
        body: Any,
        *,
        timeout_ms: int,
        headers: dict[str, str] | None = None,
        signed_as: SignedAs | None = None,
    ) -> Reply:
        """POST ``body`` as compact JSON; the answer within ``timeout_ms`` in all, or why not."""
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False, default=str).encode()
        return self.post(url, data, timeout_ms=timeout_ms, headers=headers, signed_as=signed_as)

    def post(
        self,
        url: str,
        content: bytes,
        *,
        timeout_ms: int,
        headers: dict[str, str] | None = None,
        signed_as: SignedAs | None = None,
    ) -> Reply:
        """POST ``content`` (JSON); the answer within ``timeout_ms`` in all, or why not. With
        ``signed_as`` (and a signer), signed under the destination's secrets. In a span of its
        own whose ``traceparent`` it sends (worker.core.tracing)."""
        if not tracing.enabled():
            return self._post(url, content, timeout_ms, headers or {}, signed_as)
        attributes: dict[str, str | int | None] = {"http.request.method": "POST"}
        try:  # what the span names of the target: never its credentials or query
            where = httpx.URL(url)
            shown = where.copy_with(username=None, password=None, query=None, fragment=None)
            attributes.update(
                {"server.address": where.host, "server.port": where.port, "url.full": str(shown)}
            )
        except Exception:  # a malformed URL: _post says why, as with tracing off
            pass
        with tracing.span("POST", kind="client", attributes=attributes) as span:
            sent = tracing.inject(dict(headers or {}))
            reply = self._post(url, content, timeout_ms, sent, signed_as)
            if span is not None:
                if reply.status is not None:
                    span.set_attribute("http.response.status_code", reply.status)
                if not reply.ok:
                    span.set_status(tracing.error_status(reply.error or f"HTTP {reply.status}"))
            return reply

    def _post(
        self,
        url: str,
        content: bytes,
        timeout_ms: int,
        headers: dict[str, str],
        signed_as: SignedAs | None,
    ) -> Reply:
        if signed_as is not None and self._signer is not None:
            try:
                secrets = self._signer(signed_as.kind, signed_as.name)
            except Exception as exc:  # the caller's retry policy decides, as for no answer
                return Reply(None, b"", f"no signing secret ({type(exc).__name__}: {exc})")
            headers = {
                **(headers or {}),
                **webhooks.headers(secrets, signed_as.webhook_id, content),
            }
        total = timeout_ms / 1000
        connect = min(self.options.connect_timeout_s, total)
        token = _deadline.set(time.monotonic() + total)
        try:
            if self.options.proxy is not None:
                # The proxy connects and resolves the target itself: it is checked here as
                # the connection would check it, but the proxy must enforce egress rules of
                # its own against a name that resolves elsewhere by then (README).
                target = httpx.URL(url)
                host = target.raw_host.decode("ascii")  # IDNA, as the proxy is asked for it
                if not self.options.policy.allows_host(host):
                    self.options.policy.resolve(host, target.port or 443)
            sent = [(b"Content-Type", b"application/json"), (b"User-Agent", USER_AGENT_BYTES)]
            sent += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
            with self._connections().stream(
                "POST",
                _target(url),
                headers=sent,
                content=content,
                extensions={
                    "timeout": {"connect": connect, "read": total, "write": total, "pool": total}
                },
            ) as answer:
                chunks, size = [], 0
                for chunk in answer.iter_stream():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size >= self.options.max_response_bytes:
                        break  # enough: an answer this long is read no further
                return Reply(
                    answer.status,
                    b"".join(chunks)[: self.options.max_response_bytes],
                    headers=_wanted(answer.headers),
                )
        except httpcore.TimeoutException:
            return Reply(None, b"", f"timeout after {timeout_ms} ms")
        except Exception as exc:  # no answer, whatever the reason: the caller's policy decides
            return Reply(
                None, b"", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            )
        finally:
            _deadline.reset(token)
