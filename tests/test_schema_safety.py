"""Event type schemas that reach outside themselves or cost without end: references resolve
inside the schema only (nothing fetched, at registration or publish), and validation stays
within its limits; through the real API (in process) on the real PostgreSQL and Redis, and
against the schemas module directly."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker.core.errors import InvalidMessage
from orderly.worker.pubsub import schemas
from orderly.worker.runtime import Runtime
from orderly.worker.settings import get_settings

LIMITS = schemas.Limits(max_unique_items=2_000, budget_ms=2_000)
SECRET = {"type": "string", "enum": ["INTERNAL-SECRET-42"]}


class CountingServer(ThreadingHTTPServer):
    """A JSON document at /doc and a 302 to it at /moved, counting every connection."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.connections = 0

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.connections += 1
        return True

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/doc")
            self.end_headers()
            return
        body = json.dumps(SECRET).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[CountingServer]:
    srv = CountingServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


class SilentServer:
    """Accepts connections and never answers: a fetch from it would hang."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.accepted: list[socket.socket] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                self.accepted.append(self.sock.accept()[0])
            except TimeoutError:
                continue

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    srv = SilentServer()
    yield srv
    srv.close()


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Environment variables set in the test reach the settings publish reads."""
    yield monkeypatch
    get_settings.cache_clear()


def _guess(ref: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"guess": {"$ref": ref}}}


def _register(client: TestClient, schema: dict[str, Any], name: str = "t") -> Any:
    return client.post("/rooms/r/event-types", json={"name": name, "version": 1, "schema": schema})


def _counts(db: Engine) -> dict[str, int]:
    with db.connect() as conn:
        return {
            table: int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
            for table in ("event_type", "event_type_version", "event", "delivery")
        }


@pytest.fixture
def room(client: TestClient) -> TestClient:
    assert client.post("/rooms", json={"name": "r"}).status_code == 201
    pull = {"name": "p", "kind": "PULL"}
    assert client.post("/rooms/r/subscriptions", json=pull).status_code == 201
    return client


# --- through the API ----------------------------------------------------------------------------


def _renew_runtime(client: TestClient) -> None:
    """The app reads its settings from its runtime: a new one, of the environment now."""
    get_settings.cache_clear()
    cast(FastAPI, client.app).state.runtime = Runtime(get_settings())


@pytest.mark.parametrize("path", ["/doc", "/moved"])
def test_a_remote_ref_is_refused_at_registration_and_never_fetched(
    room: TestClient, db: Engine, server: CountingServer, path: str
) -> None:
    ref = server.base + path
    answer = _register(room, _guess(ref))
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "schema.properties.guess.$ref"
    assert ref in error["problem"] and "never fetches" in error["problem"]
    assert server.connections == 0
    assert room.get("/rooms/r/event-types").json() == []
    assert _counts(db)["event_type_version"] == 0


def test_a_ref_to_a_server_that_never_answers_is_refused_at_once(
    room: TestClient, db: Engine, silent: SilentServer
) -> None:
    started = time.monotonic()
    answer = _register(room, _guess(silent.base + "/schema.json"))
    took = time.monotonic() - started
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["field"] == "schema.properties.guess.$ref"
    assert took < 5, f"registration took {took:.1f} s: it waited on the server"
    assert silent.accepted == []
    assert room.get("/rooms/r/event-types").json() == []


def test_a_stored_schema_with_a_remote_ref_refuses_publishes_without_fetching(
    room: TestClient, db: Engine, server: CountingServer
) -> None:
    assert _register(room, {"type": "object"}).status_code == 201
    with db.begin() as conn:  # as an older orderly stored it, before references were checked
        conn.execute(
            text("UPDATE event_type_version SET json_schema = CAST(:s AS jsonb)"),
            {"s": json.dumps(_guess(server.base + "/moved"))},
        )
    before = _counts(db)
    answer = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"guess": "x"}})
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "event_type"
    assert server.base + "/moved" in error["problem"]
    assert "INTERNAL-SECRET-42" not in answer.text
    assert server.connections == 0
    assert _counts(db) == before


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "$defs": {"word": {"type": "string", "enum": ["yes", "no"]}},
            "properties": {"guess": {"$ref": "#/$defs/word"}},
            "required": ["guess"],
        },
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "definitions": {"word": {"type": "string", "enum": ["yes", "no"]}},
            "properties": {"guess": {"$ref": "#/definitions/word"}},
            "required": ["guess"],
        },
        {
            "$id": "https://orderly.example/guess",
            "type": "object",
            "$defs": {"word": {"$anchor": "word", "type": "string", "enum": ["yes", "no"]}},
            "properties": {"guess": {"$ref": "https://orderly.example/guess#word"}},
            "required": ["guess"],
        },
    ],
    ids=["defs", "definitions", "anchor"],
)
def test_references_inside_the_schema_validate_end_to_end(
    room: TestClient, db: Engine, schema: dict[str, Any]
) -> None:
    assert _register(room, schema).status_code == 201
    valid = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"guess": "yes"}})
    assert valid.status_code == 201, valid.text
    assert len(valid.json()["deliveries"]) == 1
    invalid = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"guess": "maybe"}})
    assert invalid.status_code == 422, invalid.text
    assert invalid.json()["errors"][0]["field"] == "payload.guess"
    assert _counts(db)["event"] == 1


TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "uniqueItems": True}},
}


def test_unique_items_over_the_limit_are_refused_and_nothing_published(
    room: TestClient, db: Engine
) -> None:
    assert _register(room, TAGS).status_code == 201
    tags = [{"id": i, "name": f"tag {i}"} for i in range(3_000)]
    started = time.monotonic()
    answer = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"tags": tags}})
    assert time.monotonic() - started < 5
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "payload.tags"
    assert "2,000" in error["problem"] and "3,000" in error["problem"]
    assert "ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS" in error["problem"]
    assert _counts(db)["event"] == 0 and _counts(db)["delivery"] == 0
    # At the limit they are compared, quickly, and a repeat is found.
    within = tags[:2_000]
    started = time.monotonic()
    answer = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"tags": within}})
    assert answer.status_code == 201, answer.text
    assert time.monotonic() - started < 5
    repeated = [*within[:1_999], {"name": "tag 7", "id": 7.0}]
    answer = room.post("/rooms/r/events", json={"event_type": "t", "payload": {"tags": repeated}})
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"][0]["problem"] == "items 7 and 1999 are equal (uniqueItems)"
    assert _counts(db)["event"] == 1


def test_the_unique_items_limit_is_the_setting(
    room: TestClient, db: Engine, settings_env: pytest.MonkeyPatch
) -> None:
    assert _register(room, TAGS).status_code == 201
    payload = {"tags": list(range(11))}
    assert room.post("/rooms/r/events", json={"event_type": "t", "payload": payload}).is_success
    settings_env.setenv("ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS", "10")
    _renew_runtime(room)
    answer = room.post("/rooms/r/events", json={"event_type": "t", "payload": payload})
    assert answer.status_code == 422, answer.text
    assert "over 10 items" in answer.json()["errors"][0]["problem"]
    assert _counts(db)["event"] == 1


# anyOf over a recursive $ref: both branches are tried at every level, 2^depth in all.
EXPONENTIAL = {
    "$defs": {
        "node": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/node"}},
                    "required": ["x"],
                },
                {
                    "type": "object",
                    "properties": {"a": {"$ref": "#/$defs/node"}},
                    "required": ["y"],
                },
            ]
        }
    },
    "$ref": "#/$defs/node",
}


def _nested(depth: int) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for _ in range(depth):
        payload = {"a": payload}
    return payload


def test_the_validation_budget_is_the_setting(
    room: TestClient, db: Engine, settings_env: pytest.MonkeyPatch
) -> None:
    assert _register(room, EXPONENTIAL).status_code == 201
    publish = {"event_type": "t", "payload": _nested(9)}
    # Within the default budget: validated, and refused for what it is.
    answer = room.post("/rooms/r/events", json=publish)
    assert answer.status_code == 422, answer.text
    assert "ORDERLY_SCHEMA_VALIDATION_BUDGET_MS" not in answer.text
    settings_env.setenv("ORDERLY_SCHEMA_VALIDATION_BUDGET_MS", "5")
    _renew_runtime(room)
    answer = room.post("/rooms/r/events", json=publish)
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "payload"
    assert "over 5 ms" in error["problem"]
    assert "ORDERLY_SCHEMA_VALIDATION_BUDGET_MS" in error["problem"]
    # Deep enough to take hours unbounded: stopped within the budget.
    started = time.monotonic()
    deep = room.post("/rooms/r/events", json={"event_type": "t", "payload": _nested(50)})
    assert deep.status_code == 422 and "BUDGET_MS" in deep.json()["errors"][0]["problem"]
    assert time.monotonic() - started < 5
    assert _counts(db)["event"] == 0


# --- the schemas module -------------------------------------------------------------------------


def _refusal(schema: dict[str, Any]) -> InvalidMessage:
    with pytest.raises(InvalidMessage) as caught:
        schemas.check(schema, LIMITS)
    return caught.value


@pytest.mark.parametrize(
    ("schema", "field", "ref"),
    [
        (
            {"$ref": "https://schemas.example/x.json"},
            "schema.$ref",
            "https://schemas.example/x.json",
        ),
        (_guess("file:///etc/passwd"), "schema.properties.guess.$ref", "file:///etc/passwd"),
        (
            {"$id": "https://orderly.example/root", "properties": {"a": {"$ref": "other.json"}}},
            "schema.properties.a.$ref",
            "other.json",
        ),
        ({"items": {"$ref": "#/$defs/missing"}}, "schema.items.$ref", "#/$defs/missing"),
        # A reference into a place no keyword validates still has its own checked.
        (
            {"$ref": "#/elsewhere", "elsewhere": {"$ref": "http://127.0.0.1:9/x"}},
            "schema.elsewhere.$ref",
            "http://127.0.0.1:9/x",
        ),
        ({"$dynamicRef": "http://127.0.0.1:9/x"}, "schema.$dynamicRef", "http://127.0.0.1:9/x"),
        (
            {"$ref": "https://json-schema.org/draft/2020-12/schema"},
            "schema.$ref",
            "https://json-schema.org/draft/2020-12/schema",
        ),
    ],
)
def test_a_reference_must_resolve_inside_the_schema(
    schema: dict[str, Any], field: str, ref: str
) -> None:
    refused = _refusal(schema)
    assert refused.field == field
    assert repr(ref) in refused.problem


def test_data_that_looks_like_a_reference_is_data() -> None:
    schemas.check({"enum": [{"$ref": "http://127.0.0.1:9/x"}]}, LIMITS)
    schemas.check({"properties": {"$ref": {"type": "string"}}}, LIMITS)


def test_a_reference_that_never_ends_is_refused() -> None:
    assert "without end" in _refusal({"$ref": "#"}).problem


def test_unique_items_follow_json_equality_in_linear_time() -> None:
    validate = schemas.validator({"type": "array", "uniqueItems": True})
    assert schemas.errors(validate, [1, 1.0], LIMITS) is not None
    assert schemas.errors(validate, [{"a": [1], "b": 2}, {"b": 2, "a": [1.0]}], LIMITS)
    assert schemas.errors(validate, [1, True], LIMITS) is None
    assert schemas.errors(validate, [0, False, None, "0", [0], {"0": 0}], LIMITS) is None
    # Compared pairwise, 3,000 objects took 18 s; 20,000 would take over ten minutes.
    many = [{"id": i, "tags": ["a", "b"]} for i in range(20_000)]
    started = time.monotonic()
    assert schemas.errors(validate, many, schemas.Limits(20_000, 60_000)) is None
    assert time.monotonic() - started < 5


def test_a_limit_reached_under_not_refuses_instead_of_passing() -> None:
    validate = schemas.validator({"not": {"type": "array", "uniqueItems": True}})
    failed = schemas.errors(validate, list(range(2_001)), LIMITS)
    assert failed is not None and "ORDERLY_SCHEMA_MAX_UNIQUE_ITEMS" in failed[1]


def test_a_schema_expensive_for_any_value_is_refused_at_registration() -> None:
    # Each level refers twice to the next: 2^40 steps for even {}.
    levels: dict[str, Any] = {
        f"l{i}": {"allOf": [{"$ref": f"#/$defs/l{i + 1}"}, {"$ref": f"#/$defs/l{i + 1}"}]}
        for i in range(40)
    }
    levels["l40"] = {"type": "string"}
    started = time.monotonic()
    with pytest.raises(InvalidMessage) as caught:
        schemas.check({"$defs": levels, "$ref": "#/$defs/l0"}, schemas.Limits(2_000, 200))
    assert time.monotonic() - started < 5
    assert caught.value.field == "schema"
    assert "over 200 ms" in caught.value.problem
    assert "ORDERLY_SCHEMA_VALIDATION_BUDGET_MS" in caught.value.problem


def test_patterns_are_bounded_in_length_and_in_work() -> None:
    refused = _refusal({"type": "string", "pattern": "a" * 1_001})
    assert refused.field == "schema.pattern" and "at most 1,000" in refused.problem
    # RE2 is linear in the text, times the program: 10 s for a megabyte of this one.
    costly = {"type": "object", "properties": {"s": {"pattern": "[ab]*a[ab]{1000}c"}}}
    schemas.check(costly, LIMITS)
    validate = schemas.validator(costly)
    started = time.monotonic()
    failed = schemas.errors(validate, {"s": "ab" * 100_000}, LIMITS)
    assert time.monotonic() - started < 5
    assert failed is not None and failed[0] == "payload.s"
    assert "200,000 characters are not matched" in failed[1]
    assert schemas.errors(validate, {"s": "a" * 10 + "b" * 1000 + "c"}, LIMITS) is None


def test_a_schema_nested_too_deep_is_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(70):
        schema = {"items": schema}
    assert "nested deeper than 64" in _refusal(schema).problem
