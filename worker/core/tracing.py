"""Traces: OpenTelemetry spans across orderly's processes (the ``otel`` extra).

Tracing is on in a process when the extra is installed and the standard variables ask for an
exporter (``OTEL_TRACES_EXPORTER`` = ``otlp`` or ``console``, or an
``OTEL_EXPORTER_OTLP_ENDPOINT``/``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), unless
``OTEL_SDK_DISABLED=true``; the exporter, its endpoint, headers, batch delays and the resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) are read by OpenTelemetry's SDK from the
same variables. Off, every function here is a no-op that costs a flag test.

A trace runs from the producer to the receiving endpoint through what orderly stores: the W3C
``traceparent`` of the span that took a message, event or conversation response in is kept
with it (``message.trace_parent``, ``event.trace_parent``, the response's hash), so that the
worker that runs its handler or sends it, whenever that is, continues the same trace; every
outbound POST carries the ``traceparent`` of its own span.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

try:
    from opentelemetry import context, propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    INSTALLED = True
except ImportError:  # the otel extra is not installed
    INSTALLED = False

TRACEPARENT = "traceparent"
_enabled = False


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for traces to be exported."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure(service_name: str) -> bool:
    """Start exporting this process's spans, if :func:`wanted` (once per process; later calls
    keep the first one's setup). ``service_name`` unless ``OTEL_SERVICE_NAME`` says another.
    Whether tracing is on."""
    global _enabled
    if _enabled or not wanted():
        return _enabled
    if not INSTALLED:
        log.warning("OTEL_* asks for traces, but the otel extra is not installed: no traces")
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    wanted_exporters = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    exporters: list[Any] = []
    for name in (n.strip() for n in wanted_exporters.split(",")):
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp" and protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "otlp":
            log.error(
                "OTEL_EXPORTER_OTLP_PROTOCOL=%s: orderly[otel] exports OTLP over http/protobuf"
                " only (a collector's port 4318); no OTLP export",
                protocol,
            )
        elif name != "none":
            log.error("OTEL_TRACES_EXPORTER names %r: otlp, console or none; ignored", name)
    if not exporters:
        return False
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    # Its worker thread is started again in a forked child (Celery's pool).
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def current_parent() -> str | None:
    """The ``traceparent`` of the span running now (what a stored item continues), or None."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get(TRACEPARENT)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the running span's ``traceparent`` (and ``tracestate``) added."""
    if _enabled:
        propagate.inject(headers)
    return headers


def _context_of(traceparent: str | None) -> Any:
    return None if not traceparent else propagate.extract({TRACEPARENT: traceparent})


def span_context(traceparent: str) -> Any:
    """The span a stored ``traceparent`` names (for a link; invalid when it is malformed)."""
    return trace.get_current_span(_context_of(traceparent)).get_span_context()


def now_ns() -> int:
    """A span's start, for :func:`record` (0 while tracing is off)."""
    return time.time_ns() if _enabled else 0


def record(
    name: str,
    start_ns: int,
    *,
    links: Sequence[str | None] = (),
    attributes: Mapping[str, str | int | float | bool | None] | None = None,
) -> None:
    """A span of the running one that began at ``start_ns`` (:func:`now_ns`) and ends now:
    made once it turns out worth keeping (a claim that took something), linked to stored
    ones."""
    if not _enabled or not start_ns:
        return
    found = [span_context(tp) for tp in links if tp]
    made = trace.get_tracer("orderly").start_span(
        name,
        start_time=start_ns,
        attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        links=[Link(c) for c in found if c.is_valid],
    )
    made.end()


@contextlib.contextmanager
def within(traceparent: str | None) -> Iterator[None]:
    """The block runs as part of the stored ``traceparent``'s trace (no span of its own): what
    it sends (a task) continues that trace, though another thread took it in (group commit)."""
    if not _enabled or not traceparent:
        yield
        return
    token = context.attach(_context_of(traceparent))
    try:
        yield
    finally:
        context.detach(token)


@contextlib.contextmanager
def span(
    name: str,
    *,
    parent: str | None = None,
    kind: str = "internal",
    attributes: Mapping[str, str | int | float | bool | None] | None = None,
    links: Sequence[str | None] = (),
) -> Iterator[Any]:
    """A span around the block, the current one inside it: a child of ``parent`` (a stored
    ``traceparent``) when given, else of the span running now; ``links`` to other stored
    ones. An exception raised inside is recorded on it and raised on."""
    if not _enabled:
        yield None
        return
    tracer = trace.get_tracer("orderly")
    found = [span_context(tp) for tp in links if tp]
    with tracer.start_as_current_span(
        name,
        context=_context_of(parent),
        kind=SpanKind[kind.upper()],
        attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        links=[Link(c) for c in found if c.is_valid],
    ) as current:
        yield current


def error_status(description: str) -> Any:
    """A span's status for a failure (what an outbound POST got instead of a 2xx)."""
    return Status(StatusCode.ERROR, description)


def shutdown() -> None:
    """Export what is buffered (a process about to exit)."""
    if _enabled:
        provider: Any = trace.get_tracer_provider()
        with contextlib.suppress(Exception):
            provider.force_flush(5_000)
