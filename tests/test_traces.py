"""Traces (worker.core.tracing, the otel extra), end to end across real processes: an API and
a worker export to an OTLP receiver the test runs, and one trace runs from the producer's
``traceparent`` through the API request, intake, the broker hop, the handler or the send, to
the receiving endpoint, for a stored message, a conversation response and a published event;
the report has its span. And the switch: the standard variables, off by default."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from orderly.worker.core import tracing
from tests.helpers import OrderlyCli, message, wait_until
from tests.otlp_receiver import Receiver, Span
from tests.stack import Stack

OTEL = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within a tenth of a second
}


def producer_parent() -> tuple[str, str, str]:
    """A producer's span: (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[Span], **match: str) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name, s.kind) for s in spans])
    return found[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def traced(stack: Stack, receiver: Receiver) -> Stack:
    stack.env(**OTEL, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base)
    stack.start_api()
    stack.worker(concurrency=1)
    return stack


def test_a_messages_trace_runs_from_the_producer_to_its_handlers_call(
    traced: Stack, receiver: Receiver
) -> None:
    header, trace_id, producer = producer_parent()
    payload = json.dumps({"url": f"{receiver.base}/hook", "body": {"n": 1}})
    body = message(1, operation="call", payload=payload)
    answer = traced.http.post("/messages", json=body, headers={"traceparent": header})
    assert answer.status_code == 201, answer.text

    wait_until(lambda: bool(receiver.calls("/hook")), timeout=60, what="the handler's POST")
    names = {"POST /messages", "intake", "handle test.call", "POST"}

    def exported() -> bool:
        return names <= {s.name for s in receiver.spans(trace_id)}

    wait_until(exported, timeout=30, what="the message's spans exported")
    spans = receiver.spans(trace_id)
    request = one(spans, name="POST /messages", kind="SERVER")
    assert (request.service, request.parent_id) == ("orderly-api", producer)
    intake = one(spans, name="intake")
    assert intake.service == "orderly-api"
    handle = one(spans, name="handle test.call")
    # the worker continues what the message row kept: the intake's span
    assert (handle.service, handle.parent_id) == ("orderly-worker", intake.span_id)
    assert handle.attributes["orderly.outcome"] == "OK"
    post = one(spans, name="POST", kind="CLIENT")
    assert (post.service, post.parent_id) == ("orderly-worker", handle.span_id)
    assert post.attributes["http.response.status_code"] == 200
    assert post.attributes["url.full"] == f"{receiver.base}/hook"
    # and the receiving endpoint is told: its parent is that POST's span
    assert receiver.calls("/hook")[0].headers["traceparent"] == f"00-{trace_id}-{post.span_id}-01"
    # the batch's claim took it: linked to the trace it continues
    claims = [s for s in receiver.spans() if s.name == "claim" and s.service == "orderly-worker"]
    assert any((trace_id, intake.span_id) in c.links for c in claims)


def test_a_conversation_responses_trace_crosses_the_broker_to_the_client(
    traced: Stack, receiver: Receiver
) -> None:
    http = traced.http
    assert http.put("/channels/chat", json={"url": f"{receiver.base}/chat"}).status_code == 200
    answer = http.post("/conversations/c1/requests", json={"request_id": "r1", "origin": "chat"})
    assert answer.status_code == 201, answer.text
    header, trace_id, producer = producer_parent()
    response = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}, "last": True}
    answer = http.post(
        "/conversations/c1/responses", json=response, headers={"traceparent": header}
    )
    assert answer.status_code == 201, answer.text

    wait_until(lambda: bool(receiver.calls("/chat")), timeout=60, what="the response delivered")
    # the worker's task span ends last, after the send in it
    wanted = {"intake response", "deliver response", "POST", "run/orderly.deliver.conversation"}
    wait_until(
        lambda: wanted <= {s.name for s in receiver.spans(trace_id)},
        timeout=30,
        what="the response's spans exported",
    )
    spans = receiver.spans(trace_id)
    request = one(spans, kind="SERVER", service="orderly-api")
    assert request.parent_id == producer
    intake = one(spans, name="intake response")
    # the broker hop: the drain's task sent by the API, run by the worker, one trace
    sent = [s for s in spans if s.kind == "PRODUCER" and s.service == "orderly-api"]
    run = [s for s in spans if s.kind == "CONSUMER" and s.service == "orderly-worker"]
    assert sent and run and {r.parent_id for r in run} <= {s.span_id for s in sent}
    deliver = one(spans, name="deliver response")
    assert (deliver.service, deliver.parent_id) == ("orderly-worker", intake.span_id)
    post = one(spans, name="POST", kind="CLIENT")
    assert post.parent_id == deliver.span_id
    assert receiver.calls("/chat")[0].headers["traceparent"] == f"00-{trace_id}-{post.span_id}-01"


def test_a_published_events_trace_reaches_its_push_endpoint(
    traced: Stack, receiver: Receiver
) -> None:
    http = traced.http
    assert http.post("/rooms", json={"name": "orders"}).status_code == 201
    sub = {"name": "hook", "kind": "PUSH", "push_url": f"{receiver.base}/push"}
    assert http.post("/rooms/orders/subscriptions", json=sub).status_code == 201
    header, trace_id, producer = producer_parent()
    event = {"routing_key": "a", "payload": {"n": 1}}
    answer = http.post("/rooms/orders/events", json=event, headers={"traceparent": header})
    assert answer.status_code == 201, answer.text

    wait_until(lambda: bool(receiver.calls("/push")), timeout=60, what="the event delivered")
    wait_until(
        lambda: {"deliver orders", "POST"} <= {s.name for s in receiver.spans(trace_id)},
        timeout=30,
        what="the delivery's spans exported",
    )
    spans = receiver.spans(trace_id)
    request = one(spans, kind="SERVER", service="orderly-api")
    assert request.parent_id == producer
    deliver = one(spans, name="deliver orders")
    assert deliver.service == "orderly-worker"
    assert deliver.parent_id in {s.span_id for s in spans if s.service == "orderly-api"}
    post = one(spans, name="POST", kind="CLIENT")
    assert post.parent_id == deliver.span_id
    assert receiver.calls("/push")[0].headers["traceparent"] == f"00-{trace_id}-{post.span_id}-01"


def test_the_report_has_its_span_and_a_refused_one_says_why(
    db: object, receiver: Receiver, cli: OrderlyCli, tmp_path: Path
) -> None:
    # Refused before Spark starts (no JDBC driver there): its span is exported all the same.
    missing = str(tmp_path / "no-such-driver.jar")
    env = {**OTEL, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base, "ORDERLY_REPORT_JDBC_JAR": missing}
    done = cli("report", "--output-dir", str(tmp_path), env=env)
    assert done.returncode == 2 and "does not exist" in done.stderr, done.stderr
    wait_until(
        lambda: any(s.name == "report" for s in receiver.spans()),
        timeout=30,
        what="the report's span exported",
    )
    report = one(receiver.spans(), name="report")
    assert report.service == "orderly-report" and report.parent_id == ""
    assert report.attributes["orderly.incremental"] is True  # the default


def test_tracing_is_off_unless_the_standard_variables_ask_for_it() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert not tracing.wanted({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    # off in this process: a span is nothing, nothing is stored or sent
    assert not tracing.enabled()
    with tracing.span("intake") as current:
        assert current is None
        assert tracing.current_parent() is None
        assert tracing.inject({}) == {}
