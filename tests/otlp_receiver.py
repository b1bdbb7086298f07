"""An OTLP/HTTP trace receiver for the tests, which is also the endpoint orderly posts to: a
real HTTP server decoding each ``POST /v1/traces`` (protobuf, as OpenTelemetry's exporter sends
it) into spans, and recording every other POST with its headers."""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # '' for a root
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace_id, span_id)


@dataclass(frozen=True)
class Call:
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self._spans: list[Span] = []
        self._calls: list[Call] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self, trace_id: str | None = None) -> list[Span]:
        with self.lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def calls(self, path: str) -> list[Call]:
        with self.lock:
            return [c for c in self._calls if c.path == path]

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    found.append(
                        Span(
                            service=service,
                            name=s.name,
                            kind=KINDS.get(s.kind, str(s.kind)),
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                        )
                    )
        with self.lock:
            self._spans.extend(found)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding", "") == "gzip":
            raw = gzip.decompress(raw)
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest()
            request.ParseFromString(raw)
            self.server.take(request)
            answer = ExportTraceServiceResponse().SerializeToString()
            content_type = "application/x-protobuf"
        else:
            headers = {k.lower(): v for k, v in self.headers.items()}
            call = Call(self.path, headers, json.loads(raw or b"null"))
            with self.server.lock:
                self.server._calls.append(call)
            answer, content_type = b"{}", "application/json"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass
