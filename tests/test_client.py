"""orderly.client against a live API (and a worker): every call, each refusal as its typed
exception, a 503 tried again after its Retry-After; the async client too."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from orderly.client import (
    AsyncClient,
    BadRequest,
    Client,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from orderly.client.answers import ConversationDeleted, MessageDetail, Replayed
from orderly.models import NodeState
from orderly.worker import nodes
from orderly.worker.messages.inputs import MessageIn
from tests.helpers import api_key, message, wait_until
from tests.stack import Stack
from tooling.sink import Sink

MAX_PAYLOAD = 2000


class Watching(httpx.HTTPTransport):
    """The real transport, remembering every status it carried."""

    def __init__(self) -> None:
        super().__init__()
        self.statuses: list[int] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = super().handle_request(request)
        self.statuses.append(answer.status_code)
        return answer


@pytest.fixture
def live(stack: Stack) -> Iterator[Stack]:
    stack.env(ORDERLY_MAX_PAYLOAD_BYTES=str(MAX_PAYLOAD))
    stack.start_api()
    stack.worker()
    yield stack


def test_every_call_and_every_refusal(live: Stack, db: Engine) -> None:
    with Client(live.url, live.token, retries=0) as orderly:
        sent = orderly.submit(message(1, service="test", operation="script", payload="{}"))
        assert sent.created and sent.state == "NEW"
        repeated = orderly.submit(message(1, service="test", operation="script", payload="{}"))
        # The same message, not a new one; the live worker may have taken it up meanwhile.
        assert (repeated.msg_id, repeated.created) == (sent.msg_id, False)
        assert repeated.state in ("NEW", "PROCESSING", "OK")
        # The API's own pydantic model is a body too.
        model = MessageIn.model_validate(message(2, service="test", operation="script"))
        second = orderly.submit(model)
        wait_until(lambda: orderly.message(sent.msg_id)["state"] == "OK", 60, "processed")
        assert {m["msg_id"] for m in orderly.messages(state="OK", limit=10)} >= {sent.msg_id}
        # Every filter the API takes narrows the list.
        assert [m["msg_id"] for m in orderly.messages(correlation_id="corr-1")] == [sent.msg_id]
        assert orderly.messages(correlation_id="corr-1", source_system="elsewhere") == []
        # every page, one message a request: both, in order, then the end
        paged = [m["msg_id"] for m in orderly.iter_messages(page_size=1, service="test")]
        assert paged == [sent.msg_id, second.msg_id]
        assert [m["msg_id"] for m in orderly.messages(since="2026-01-01T00:00:01.5Z")] == [
            second.msg_id
        ]
        assert [m["msg_id"] for m in orderly.messages(until="2026-01-01T00:00:01.5Z")] == [
            sent.msg_id
        ]
        assert [m["msg_id"] for m in orderly.messages(limit=1, offset=1)] == [second.msg_id]
        with pytest.raises(Conflict) as refused:
            orderly.cancel(sent.msg_id, "too late")
        assert refused.value.fields == ["msg_id"]
        wait_until(lambda: orderly.message(second.msg_id)["state"] == "OK", 60, "processed")
        with pytest.raises(Conflict):
            orderly.redrive(second.msg_id, "not failed")
        with pytest.raises(NotFound):
            orderly.message(10**9)
        with pytest.raises(Invalid) as invalid:
            orderly.submit({"service": "test"})
        assert {"operation", "correlation_id"} <= set(invalid.value.fields)
        with pytest.raises(NotFound):
            orderly.respond({"correlation_id": "nobody-waits", "payload": "x"})
        with pytest.raises(PayloadTooLarge):
            orderly.submit(message(3, payload="x" * (MAX_PAYLOAD + 70_000)))
        with pytest.raises(BadRequest):
            orderly.conversation("a\x00b")  # sent as %00: a NUL in the path

        # Conversations: request, response, the client's ACK with its token.
        with Sink() as sink:
            sink.configure(p_async=1.0, p_never_ack=1.0)
            channel = {"url": sink.url, "delivery_delay_ms": 20, "attempts": 3}
            assert live.http.put("/channels/chat", json=channel).status_code == 200
            live.worker("w2")  # drains
            assert orderly.request("c1", {"request_id": "r1", "origin": "chat"}).created
            response = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}}
            assert orderly.response("c1", response).created
            wait_until(lambda: bool(sink.arrivals()), 60, "the response at the client")
            arrival = sink.arrivals()[0]
            assert orderly.conversation("c1")["conversation_id"] == "c1"
            with pytest.raises(NotFound):  # as an unknown id: no oracle
                orderly.ack(arrival["async_response_id"], "A" * 43)
            acked = orderly.ack(arrival["async_response_id"], arrival["ack_token"])
            assert acked.state == "OK"

        # Publish (idempotent with a key), pull and acknowledge.
        assert live.http.post("/rooms", json={"name": "r1"}).status_code == 201
        sub = live.http.post("/rooms/r1/subscriptions", json={"name": "p", "kind": "PULL"}).json()
        event = {"payload": {"n": 1}, "routing_key": "a"}
        first = orderly.publish("r1", event, idempotency_key="k-1")
        again = orderly.publish("r1", event, idempotency_key="k-1")
        assert first.created and not again.created and again.event_id == first.event_id
        (pulled,) = orderly.pull(sub["subscription_id"])
        done = orderly.ack_pulled(sub["subscription_id"], pulled["delivery_id"], pulled["receipt"])
        assert done["state"] == "DELIVERED"

    with pytest.raises(Unauthorized) as nobody, Client(live.url) as anonymous:
        anonymous.messages()
    assert nobody.value.fields == ["Authorization"]
    reader = Client(live.url, api_key(db, "consume", name="reader"))
    with reader, pytest.raises(Forbidden) as lacking:
        reader.submit(message(4))
    assert "produce" in str(lacking.value)


def test_a_batch_is_stored_whole_or_refused_whole(live: Stack, db: Engine) -> None:
    batch = [message(n, service="test", operation="script") for n in range(1, 4)]
    with Client(live.url, live.token, retries=0) as orderly:
        sent = orderly.submit_many(batch)
        assert [s.created for s in sent] == [True, True, True]
        assert len({s.msg_id for s in sent}) == 3
        # Each idempotent: the same batch again is the same answer, created False.
        again = orderly.submit_many([*batch, message(4, service="test", operation="script")])
        assert [(a.msg_id, a.created) for a in again[:3]] == [(s.msg_id, False) for s in sent]
        assert again[3].created
        # The worker claims them in a batch and processes them.
        ids = [s.msg_id for s in again]
        wait_until(lambda: all(orderly.message(i)["state"] == "OK" for i in ids), 60, "OK")
        # One bad message refuses the whole batch, naming it; nothing is stored.
        bad = [message(10, service="test", operation="script"), message(11, service="nosuch")]
        with pytest.raises(Invalid) as invalid:
            orderly.submit_many(bad)
        assert invalid.value.fields == ["messages[1].service"]
        assert orderly.messages(correlation_id="corr-10") == []
        with pytest.raises(Invalid) as empty:
            orderly.submit_many([])
        assert empty.value.fields == ["messages"]
    answer = live.http.post("/messages:batch", json={"messages": batch, "extra": 1})
    assert answer.status_code == 422 and "extra" in answer.text
    assert live.http.post("/messages:batch", json=[batch]).status_code == 422


def test_a_503_is_tried_again_after_its_retry_after(live: Stack, db: Engine) -> None:
    nodes.set_state(db, "api-node", NodeState.HANDLES_EXISTING_MESSAGES)  # refuses new input
    watching = Watching()

    def reopen() -> None:
        wait_until(lambda: 503 in watching.statuses, 30, "a first 503")
        nodes.set_state(db, "api-node", NodeState.RUN)

    opener = threading.Thread(target=reopen)
    opener.start()
    with Client(live.url, live.token, retries=30, max_wait_s=1, transport=watching) as orderly:
        sent = orderly.submit(message(1, service="test", operation="script"))
    opener.join()
    assert sent.created and watching.statuses[0] == 503 and watching.statuses[-1] == 201

    nodes.set_state(db, "api-node", NodeState.HANDLES_EXISTING_MESSAGES)
    orderly = Client(live.url, live.token, retries=1, max_wait_s=0)
    with orderly, pytest.raises(Unavailable) as down:
        orderly.submit(message(2, service="test", operation="script"))
    assert down.value.fields == ["node"] and down.value.retry_after_s == 0


def test_a_429_is_tried_again_after_its_retry_after(stack: Stack) -> None:
    stack.env(ORDERLY_RATE_KEY_PER_S="1", ORDERLY_RATE_KEY_BURST="1")
    stack.start_api()
    watching = Watching()
    with Client(stack.url, stack.token, retries=5, max_wait_s=2, transport=watching) as orderly:
        orderly.submit(message(1, service="test", operation="script"))
        sent = orderly.submit(message(2, service="test", operation="script"))
    assert sent.created and 429 in watching.statuses and watching.statuses[-1] == 201
    with Client(stack.url, stack.token, retries=0) as orderly, pytest.raises(RateLimited) as over:
        orderly.submit(message(3, service="test", operation="script"))
    assert over.value.retry_after_s is not None and over.value.retry_after_s >= 1


def test_the_async_client(live: Stack) -> None:
    async def run() -> MessageDetail:
        async with AsyncClient(live.url, live.token) as orderly:
            sent = await orderly.submit(message(1, service="test", operation="script"))
            with pytest.raises(NotFound):
                await orderly.message(10**9)
            with pytest.raises(Invalid):
                await orderly.submit({})
            return await orderly.message(sent.msg_id)

    found = asyncio.run(run())
    assert found["correlation_id"] == "corr-1"


@pytest.mark.e2e
def test_the_client_imports_nothing_of_the_server() -> None:
    import subprocess
    import sys

    probe = "import sys, orderly.client; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    ours = {name for name in loaded if name.startswith("orderly.")}
    assert ours == {n for n in ours if n.startswith("orderly.client")}, sorted(ours)
    server = ("sqlalchemy", "psycopg2", "celery", "kombu", "redis", "fastapi", "starlette")
    assert [name for name in loaded if name.split(".")[0] in server] == []
    assert "httpx" in loaded and "pydantic" in loaded


@pytest.fixture
def api_only(stack: Stack) -> Iterator[Stack]:
    """The API without a worker: a conversation's responses stay where intake put them."""
    stack.start_api()
    answer = httpx.put(
        f"{stack.url}/channels/chat",
        json={"url": "http://127.0.0.1:9/in"},
        headers={"Authorization": f"Bearer {stack.token}"},
    )
    assert answer.status_code == 200, answer.text
    yield stack


def _operate(orderly: Any, cid: str) -> list[Any]:
    """The conversation operations a sync or async client runs, in order (the caller awaits
    each one for the async client); the request is ``r-<cid>``, its response ``s-<cid>``."""
    return [
        lambda: orderly.conversation_message(response_id=f"s-{cid}", fields=["status", "state"]),
        lambda: orderly.set_awaited(cid, response_id=f"s-{cid}", note="client down"),
        lambda: orderly.set_awaited_date(cid, f"s-{cid}", datetime.now(UTC)),
        lambda: orderly.remove_at(cid, f"s-{cid}", 3600),
        lambda: orderly.delete_conversation_request(cid, f"r-{cid}", note="gone"),
    ]


def _check(cid: str, answers: list[Any]) -> None:
    found, awaited, dated, removal, deleted = answers
    fields = set(found.model_dump())
    assert found["status"] == "PENDING" and fields <= {"status", "state", "responseId"}
    assert isinstance(deleted, ConversationDeleted) and deleted.deleted == [f"s-{cid}"]
    assert [a["response_id"] for a in awaited["awaited"]] == [f"s-{cid}"]
    assert awaited["skipped"] == [] and dated["awaited_to_date_ms"] > 0
    assert removal["remove_at_ms"] > dated["awaited_to_date_ms"]
    assert deleted["request_cancelled"] and deleted["deleted"] == [f"s-{cid}"]


def _start(orderly: Client, cid: str) -> None:
    orderly.request(cid, {"request_id": f"r-{cid}", "origin": "chat"})
    orderly.response(cid, {"request_id": f"r-{cid}", "response_id": f"s-{cid}", "payload": {}})


def test_the_conversation_operations_sync_and_async(api_only: Stack) -> None:
    with Client(api_only.url, api_only.token) as orderly:
        _start(orderly, "c-sync")
        _check("c-sync", [call() for call in _operate(orderly, "c-sync")])
        gone = orderly.conversation_message(response_id="s-c-sync")  # deleted with its request
        # its row CANCEL, its hash kept for its lifetime as CANCEL (the seed's)
        assert gone["state"] == "CANCEL" and gone["inRedis"] is True
        assert gone["status"] == "CANCEL"
        with pytest.raises(NotFound):
            orderly.conversation_message(response_id="nobody-sent-this")
        with pytest.raises(ValueError, match="exactly one"):
            orderly.set_awaited("c-sync")

    async def run() -> list[Any]:
        async with AsyncClient(api_only.url, api_only.token) as orderly:
            return [await call() for call in _operate(orderly, "c-async")]

    with Client(api_only.url, api_only.token) as orderly:
        _start(orderly, "c-async")
    _check("c-async", asyncio.run(run()))


def test_no_answer_is_an_orderly_error_and_only_safe_calls_go_again() -> None:
    import socket
    import threading

    from orderly.client import NoAnswer, TimedOut, Unreachable
    from tests.helpers import message

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with (
        Client(f"http://127.0.0.1:{port}", "k", retries=1) as nobody,
        pytest.raises(Unreachable) as refused,
    ):
        nobody.submit(message(1))
    assert isinstance(refused.value, NoAnswer) and refused.value.status == 0
    assert refused.value.fields == ["server"]

    # a server that takes connections and never answers
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted: list[socket.socket] = []

    def take() -> None:
        while True:
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=take, daemon=True).start()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with Client(url, "k", timeout_s=0.3, retries=2, max_wait_s=0.05) as slow:
            with pytest.raises(TimedOut):
                slow.submit(message(1))  # idempotent by its ids: three tries
            tried = len(accepted)
            with pytest.raises(TimedOut):
                slow.respond({"res_id": 1, "response": "x"})  # may have been done: once
            assert (tried, len(accepted) - tried) == (3, 1)
    finally:
        silent.close()
        for conn in accepted:
            conn.close()


def test_the_outbound_calls_of_a_subscriber(api_only: Stack) -> None:
    import threading

    with Client(api_only.url, api_only.token, retries=0) as orderly:
        assert (
            httpx.post(
                f"{api_only.url}/rooms",
                json={"name": "lp"},
                headers={"Authorization": f"Bearer {api_only.token}"},
            ).status_code
            == 201
        )
        sub = orderly.subscribe("lp", {"name": "q", "kind": "PULL"})["subscription_id"]
        since = datetime.now(UTC)
        later = threading.Timer(
            0.5, lambda: orderly.publish("lp", {"routing_key": "a", "payload": {}})
        )
        later.start()
        # a long poll past the client's own 10 s would be cut short without its wait on top
        [taken] = orderly.pull(sub, 1, wait_ms=20_000)
        later.join()
        moved = orderly.extend_pulled(sub, taken["delivery_id"], taken["receipt"], 60_000)
        assert moved.model_dump() == {"delivery_id": taken.delivery_id, "state": "IN_PROCESS"}
        with pytest.raises(NotFound):
            orderly.extend_pulled(sub, taken["delivery_id"], "not-the-receipt", 1)
        orderly.ack_pulled(sub, taken["delivery_id"], taken["receipt"])
        assert orderly.replay(sub, since) == Replayed(replayed=1, backfilled=0)
        assert orderly.pull(sub, 5)[0]["delivery_id"] == taken["delivery_id"]
        assert orderly.enable_subscription(sub, note="checked")["subscription_id"] == sub


def _route(spec: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """The documented operation a concrete path is an instance of."""
    for template, operations in spec["paths"].items():
        pattern = "^" + re.sub(r"\{[^/]+\}", "[^/]+", template) + "$"
        if method.lower() in operations and re.match(pattern, path):
            found: dict[str, Any] = operations[method.lower()]
            return found
    raise AssertionError(f"no route documents {method} {path}")


def test_every_typed_answer_is_the_one_its_route_documents() -> None:
    from orderly.api.http import create_app
    from orderly.client import calls

    spec = create_app().openapi()
    made: list[calls.Call[Any]] = [
        calls.message(1),
        calls.messages(calls.MessageFilter(), 10, 0),
        calls.cancel(1, "n", None),
        calls.redrive(1, "n", None),
        calls.respond({}),
        calls.conversation("c"),
        calls.conversation_message("s", None, None),
        calls.delete_conversation_request("c", "r", {}),
        calls.set_awaited("c", "r", None, None),
        calls.set_awaited_date("c", "s", "2026-01-01T00:00:00Z"),
        calls.remove_at("c", "s", 1),
        calls.subscribe("room", {}),
        calls.pull(1, 1),
        calls.extend_pulled(1, 2, "x", 1),
        calls.ack_pulled(1, 2, "x"),
        calls.replay(1, "2026-01-01T00:00:00Z"),
        calls.enable_subscription(1),
        calls.queue_log({}),
        calls.exceptions({}),
        calls.exception(1),
        calls.published({}),
    ]
    for call in made:
        route = _route(spec, call.method, call.path)
        answered = {k: v for k, v in route["responses"].items() if k in ("200", "201")}
        schema = next(iter(answered.values()))["content"]["application/json"]["schema"]
        documented = schema.get("$ref") or schema["items"]["$ref"]
        # what the client reads the answer into: the model the document names
        read = call.read(200, _example(schema, spec))
        model = type(read[0] if isinstance(read, list) else read)
        assert documented.rsplit("/", 1)[1] == model.__name__, (call.path, documented)


def _example(schema: dict[str, Any], spec: dict[str, Any]) -> Any:
    """A minimal answer of ``schema`` (every required field filled): enough to read it."""
    if "$ref" in schema:
        return _example(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec)
    if "anyOf" in schema:
        return None
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    if kind == "array":
        return [_example(schema["items"], spec)] if "$ref" in schema["items"] else []
    if kind == "object":
        props = schema.get("properties", {})
        return {k: _example(props[k], spec) for k in schema.get("required", [])}
    if kind == "string":
        return "2026-01-01T00:00:00Z" if schema.get("format") == "date-time" else "x"
    return {"integer": 1, "number": 1.0, "boolean": True}.get(kind or "")
