"""API keys and scopes over every route of the OpenAPI document: no key, a malformed, unknown,
expired or revoked key, a key without the scope (403 naming it), a key with only that scope;
what a refused request wrote (nothing); keys from the CLI and over HTTP; the publisher's
identity from its key; operator commands audited under the key's name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker import keys, tokens
from orderly.worker.core.errors import InvalidMessage, Unauthenticated
from tests.helpers import ManualClock, OrderlyCli, api_key, message, stored_keys

PUBLIC = {("get", "/health"), ("get", "/ready")}
# A value for every path parameter of the document.
PATH_VALUES = {
    "msg_id": "1",
    "subscription_id": "1",
    "delivery_id": "1",
    "room": "r1",
    "origin": "chat",
    "name": "n1",
    "conversation_id": "c1",
    "request_id": "r1",
    "response_id": "s1",
    "async_response_id": "a1",
    "exception_id": "1",
    "component_id": "c1",
    "kind": "channel",
}


def _operations(client: TestClient) -> list[tuple[str, str, list[dict[str, list[str]]]]]:
    document = client.get("/openapi.json").json()
    return [
        (method, path, op.get("security", []))
        for path, methods in document["paths"].items()
        for method, op in methods.items()
    ]


def _call(client: TestClient, method: str, path: str, token: str | None) -> Any:
    url = path.format(**PATH_VALUES)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    body = None if method in ("get", "delete") else b"{}"
    return client.request(method.upper(), url, content=body, headers=headers)


def _counts(engine: Engine, r: redis.Redis) -> dict[str, int]:
    with engine.connect() as conn:
        tables = conn.execute(
            # but the metrics' running totals, which count every request, refused ones too
            text(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                " AND tablename <> 'metric_total'"
            )
        ).scalars()
        counts = {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables}
    counts["redis keys"] = stored_keys(r)
    return counts


@pytest.fixture
def anon(client: TestClient) -> Iterator[TestClient]:
    token = client.headers.pop("Authorization")
    yield client
    client.headers["Authorization"] = token


def test_every_route_but_health_and_ready_needs_a_credential(anon: TestClient) -> None:
    ops = _operations(anon)
    assert len(ops) == 60
    public = {(m, p) for m, p, security in ops if not security}
    assert public == PUBLIC
    for method, path, security in ops:
        schemes = {name for requirement in security for name in requirement}
        if (method, path) == ("post", "/acks/{async_response_id}"):
            assert schemes == {"AckToken"}
        elif (method, path) not in PUBLIC:
            assert schemes == {"ApiKey"}, (method, path)
            assert len(security[0]["ApiKey"]) == 1, (method, path)
    # The documentation itself is public.
    assert anon.get("/docs").status_code == 200
    assert anon.get("/openapi.json").status_code == 200


def test_the_scope_matrix_over_every_route(
    anon: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    past = ManualClock(start=(datetime.now(UTC) - timedelta(days=2)).timestamp())
    _, expired = keys.create_key(
        db,
        {
            "name": "old",
            "scopes": list(keys.SCOPES),
            "expires_at": datetime.now(UTC) - timedelta(days=1),
        },
        clock=past,
    )
    revoked = api_key(db, name="gone")
    keys.revoke_key(db, "gone")
    unknown = "orderly_000000000000_" + "x" * 43
    before = _counts(db, redis_client)
    checked = 0
    for method, path, security in _operations(anon):
        if not security or "ApiKey" not in security[0]:
            continue
        scope = security[0]["ApiKey"][0]
        needed = scope.format(**PATH_VALUES)
        for token, why in (
            (None, "missing"),
            ("not-a-key", "not an orderly API key"),
            (unknown, "unknown API key"),
            (expired, "expired"),
            (revoked, "revoked"),
        ):
            answer = _call(anon, method, path, token)
            assert answer.status_code == 401, (method, path, why, answer.text)
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
            error = answer.json()["errors"][0]
            assert error["field"] == "Authorization" and why in error["problem"], error
        others = [s for s in keys.SCOPES if s != scope and not scope.startswith("publish:")]
        if scope.startswith("publish:"):
            others = [s for s in keys.SCOPES if s != keys.PUBLISH_ANY] + ["publish:elsewhere"]
        wrong = api_key(db, *others, name=f"wrong-{checked}")
        answer = _call(anon, method, path, wrong)
        assert answer.status_code == 403, (method, path, answer.text)
        assert answer.json()["errors"] == [
            {"field": "scope", "problem": f"the key 'wrong-{checked}' lacks the scope '{needed}'"}
        ]
        checked += 1
    assert checked == 57
    # Refused, each of them: not a row, not a Redis key (but the keys the test made).
    after = _counts(db, redis_client)
    assert after == {**before, "api_key": before["api_key"] + checked}

    for method, path, security in _operations(anon):
        if not security or "ApiKey" not in security[0]:
            continue
        scope = security[0]["ApiKey"][0].format(**PATH_VALUES)
        right = api_key(db, scope, name=f"right-{checked}")
        checked += 1
        answer = _call(anon, method, path, right)
        assert answer.status_code not in (401, 403), (method, path, answer.text)
    # publish:* covers every room.
    every_room = api_key(db, keys.PUBLISH_ANY, name="any-room")
    assert _call(anon, "post", "/rooms/{room}/events", every_room).status_code == 422


def test_authenticate_refuses_what_it_should_and_records_use(db: Engine) -> None:
    clock = ManualClock()
    made, token = keys.create_key(db, {"name": "k1", "scopes": ["operate"]}, clock=clock)
    assert made["last_used_at"] is None and token.startswith("orderly_" + made["prefix"])
    assert keys.authenticate(db, token, clock) == keys.Principal("k1", frozenset({"operate"}))
    used = keys.list_keys(db)[0]["last_used_at"]
    assert used is not None
    clock.advance(30)  # within a minute: not written again
    keys.authenticate(db, token, clock)
    assert keys.list_keys(db)[0]["last_used_at"] == used
    with pytest.raises(Unauthenticated, match="unknown"):
        keys.authenticate(db, token[:-1] + ("A" if token[-1] != "A" else "B"), clock)
    keys.revoke_key(db, "k1")
    with pytest.raises(Unauthenticated, match="revoked"):
        keys.authenticate(db, token, clock)
    # The name is free again; the revoked key keeps it in the list of all keys.
    keys.create_key(db, {"name": "k1", "scopes": ["admin"]})
    assert [k["name"] for k in keys.list_keys(db, revoked=True)] == ["k1", "k1"]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "a b", "scopes": ["admin"]}, "name"),
        ({"name": "k", "scopes": []}, "scopes"),
        ({"name": "k", "scopes": ["root"]}, "scopes"),
        ({"name": "k", "scopes": ["publish:"]}, "scopes"),
        ({"name": "k", "scopes": ["admin"], "expires_at": "yesterday"}, "expires_at"),
        ({"name": "k", "scopes": ["admin"], "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "k", "scopes": ["admin"], "extra": 1}, "extra"),
    ],
)
def test_bad_keys_are_refused_naming_the_field(
    db: Engine, data: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        keys.create_key(db, data)
    assert refused.value.field == field
    assert keys.list_keys(db, revoked=True) == []


def test_a_second_live_key_of_a_name_is_refused(db: Engine) -> None:
    keys.create_key(db, {"name": "k", "scopes": ["admin"]})
    with pytest.raises(InvalidMessage, match="revoke it first"):
        keys.create_key(db, {"name": "k", "scopes": ["operate"]})
    assert len(keys.list_keys(db)) == 1


def test_keys_over_http_and_the_token_shown_once(client: TestClient) -> None:
    made = client.post("/keys", json={"name": "svc", "scopes": ["produce"]})
    assert made.status_code == 201, made.text
    token = made.json()["token"]
    listed = client.get("/keys").json()
    assert "svc" in {k["name"] for k in listed}
    assert token not in json.dumps(listed) and "secret_hash" not in json.dumps(listed)
    submitted = client.post(
        "/messages",
        json=message(1),
        headers={"Authorization": f"Bearer {token}"},
    )
    assert submitted.status_code not in (401, 403), submitted.text
    assert client.delete("/keys/svc").json()["revoked_at"] is not None
    again = client.get("/messages", headers={"Authorization": f"Bearer {token}"})
    assert again.status_code == 401 and "revoked" in again.text
    assert client.delete("/keys/svc").status_code == 404


def test_key_commands(cli: OrderlyCli, db: Engine) -> None:
    made = cli("key", "create", "ops", "--scope", "operate", "--scope", "metrics")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert keys.authenticate(db, token).scopes == {"operate", "metrics"}
    listed = cli("key", "list", "--json")
    assert json.loads(listed.stdout)[0]["scopes"] == ["metrics", "operate"]
    assert token not in listed.stdout
    bad = cli("key", "create", "x", "--scope", "root")
    assert bad.returncode == 2 and "scopes" in bad.stderr and "root" in bad.stderr
    assert cli("key", "revoke", "ops").returncode == 0
    with pytest.raises(Unauthenticated, match="revoked"):
        keys.authenticate(db, token)
    assert cli("key", "revoke", "ops").returncode == 2


def test_the_publisher_is_the_key_and_impersonation_needs_its_scope(
    client: TestClient, db: Engine
) -> None:
    assert client.post("/rooms", json={"name": "r1"}).status_code == 201
    alice = api_key(db, "publish:r1", name="alice")
    as_alice = {"Authorization": f"Bearer {alice}"}
    own = client.post("/rooms/r1/events", json={"payload": 1, "routing_key": "a"}, headers=as_alice)
    assert own.status_code == 201, own.text
    named = client.post(
        "/rooms/r1/events",
        json={"payload": 1, "routing_key": "a", "user": "bob"},
        headers=as_alice,
    )
    assert named.status_code == 403
    assert named.json()["errors"][0] == {
        "field": "scope",
        "problem": "the key 'alice' lacks the scope 'impersonate'",
    }
    forged = client.post(
        "/rooms/r1/events",
        json={"payload": 1, "routing_key": "a", "impersonator": "carol"},
        headers=as_alice,
    )
    assert forged.status_code == 422 and forged.json()["errors"][0]["field"] == "impersonator"
    support = api_key(db, "publish:r1", "impersonate", name="support")
    on_behalf = client.post(
        "/rooms/r1/events",
        json={"payload": 1, "routing_key": "a", "user": "bob"},
        headers={"Authorization": f"Bearer {support}"},
    )
    assert on_behalf.status_code == 201
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT user_id, impersonator_id, token FROM event ORDER BY event_id")
        ).all()
    assert [(r.user_id, r.impersonator_id) for r in rows] == [("alice", None), ("bob", "support")]


def test_signed_claims_carry_the_key(client: TestClient, db: Engine, monkeypatch: Any) -> None:
    monkeypatch.setenv("ORDERLY_TOKEN_SECRET", "s" * 32)
    from orderly.worker.runtime import get_runtime
    from orderly.worker.settings import get_settings

    get_settings.cache_clear()
    get_runtime.cache_clear()
    from orderly.api.http import create_app

    with TestClient(create_app()) as signed:
        admin = {"Authorization": client.headers["Authorization"]}
        assert signed.post("/rooms", json={"name": "r1"}, headers=admin).status_code == 201
        support = api_key(db, "publish:r1", "impersonate", name="support")
        answer = signed.post(
            "/rooms/r1/events",
            json={"payload": 1, "routing_key": "a", "user": "bob"},
            headers={"Authorization": f"Bearer {support}"},
        )
        assert answer.status_code == 201, answer.text
    with db.connect() as conn:
        token = conn.execute(text("SELECT token FROM event")).scalar_one()
    claims = tokens.verify("s" * 32, token, now_ms=0)
    assert (claims.user, claims.impersonator) == ("bob", "support")


def test_operator_commands_are_audited_under_the_key(client: TestClient, db: Engine) -> None:
    submitted = client.post(
        "/messages",
        json=message(1),
    )
    assert submitted.status_code == 201, submitted.text
    msg_id = submitted.json()["msg_id"]
    cancelled = client.post(f"/messages/{msg_id}/cancel", json={"note": "wrong", "by": "ann"})
    assert cancelled.status_code == 200, cancelled.text
    audit = client.get(f"/messages/{msg_id}").json()["audit"]
    assert audit[-1]["by"] == "key:tests for ann" and audit[-1]["note"] == "wrong"
    redriven = client.post(f"/messages/{msg_id}/redrive", json={"note": "again"})
    assert redriven.status_code == 200
    assert client.get(f"/messages/{msg_id}").json()["audit"][-1]["by"] == "key:tests"


def test_in_a_room_that_names_its_publishers_the_key_is_the_publisher(
    client: TestClient, db: Engine
) -> None:
    assert client.post("/rooms", json={"name": "r1"}).status_code == 201
    assert client.post("/rooms/r1/publishers", json={"name": "alice"}).status_code == 201
    event = {"payload": 1, "routing_key": "a"}
    alice = {"Authorization": f"Bearer {api_key(db, 'publish:r1', name='alice')}"}
    bob = {"Authorization": f"Bearer {api_key(db, 'publish:r1', name='bob')}"}
    assert client.post("/rooms/r1/events", json=event, headers=alice).status_code == 201
    refused = client.post("/rooms/r1/events", json=event, headers=bob)
    assert refused.status_code == 422
    assert refused.json()["errors"][0] == {
        "field": "publisher",
        "problem": "'bob' may not publish here",
    }
    posing = client.post("/rooms/r1/events", json={**event, "publisher": "alice"}, headers=bob)
    assert posing.status_code == 403 and "impersonate" in posing.text
    with db.connect() as conn:
        published = conn.execute(
            text("SELECT p.name, e.user_id FROM event e JOIN publisher p USING (publisher_id)")
        ).all()
    assert [tuple(r) for r in published] == [("alice", "alice")]


def test_an_ack_over_http_without_its_token_is_refused_and_changes_nothing(
    client: TestClient, db: Engine, redis_client: redis.Redis
) -> None:
    before = _counts(db, redis_client)
    client.headers.pop("Authorization")
    latin = "é".encode("latin-1")  # a header is bytes: a server decodes it as latin-1
    for token, status in ((None, 401), (b"x" * 43, 404), (latin, 401), (b"short", 401)):
        headers = {} if token is None else {"X-Orderly-Ack-Token": token}
        answer = client.post("/acks/1", headers=headers)
        assert answer.status_code == status, answer.text
        if status == 401:
            assert answer.json()["errors"][0]["field"] == "X-Orderly-Ack-Token"
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert _counts(db, redis_client) == before


def test_a_refused_request_does_not_record_the_keys_use(anon: TestClient, db: Engine) -> None:
    token = api_key(db, "consume", name="reader")
    refused = _call(anon, "get", "/messages", token)
    assert refused.status_code == 403
    assert keys.list_keys(db)[0]["last_used_at"] is None
    assert _call(anon, "get", "/subscriptions/{subscription_id}/messages", token).status_code == 404
    assert keys.list_keys(db)[0]["last_used_at"] is not None


def _keys_held_on_a_manual_clock(client: TestClient, monkeypatch: Any) -> ManualClock:
    """The app's verified keys, and their expiry checks, on a clock the test moves."""
    from orderly.api.http.auth import KeyCache

    app = cast(FastAPI, client.app)
    clock = ManualClock()
    monkeypatch.setattr(app.state.runtime, "clock", clock)
    app.state.key_cache = KeyCache(clock)
    return clock


def test_a_verified_key_is_held_briefly_and_a_revocation_elsewhere_holds_within_that(
    client: TestClient, db: Engine, monkeypatch: Any
) -> None:
    from orderly.api.http.auth import KEY_CACHE_S

    clock = _keys_held_on_a_manual_clock(client, monkeypatch)
    lookups: list[str | None] = []
    authenticate = keys.authenticate

    def counted(*args: Any, **kwargs: Any) -> keys.Principal:
        lookups.append(kwargs.get("scope"))
        return authenticate(*args, **kwargs)

    monkeypatch.setattr(keys, "authenticate", counted)
    busy = {"Authorization": f"Bearer {api_key(db, keys.OPERATE, name='busy')}"}
    for _ in range(3):
        assert client.get("/messages", headers=busy).status_code == 200
    assert lookups == [keys.OPERATE]
    # A scope the held key lacks: refused from memory, naming it.
    refused = client.get("/keys", headers=busy)
    assert refused.status_code == 403 and "lacks the scope 'admin'" in refused.text
    assert len(lookups) == 1
    # Revoked by another process (orderly key revoke): held until the window ends.
    keys.revoke_key(db, "busy")
    assert client.get("/messages", headers=busy).status_code == 200
    clock.advance(KEY_CACHE_S)
    again = client.get("/messages", headers=busy)
    assert again.status_code == 401 and "revoked" in again.text
    # Nor is a refusal held: each one asks PostgreSQL again.
    assert client.get("/messages", headers=busy).status_code == 401
    assert len(lookups) == 3


def test_a_held_key_stops_at_its_expiry(client: TestClient, db: Engine, monkeypatch: Any) -> None:
    clock = _keys_held_on_a_manual_clock(client, monkeypatch)
    expires = datetime.now(UTC) + timedelta(minutes=1)
    _, token = keys.create_key(
        db, {"name": "brief", "scopes": [keys.OPERATE], "expires_at": expires}
    )
    brief = {"Authorization": f"Bearer {token}"}
    assert client.get("/messages", headers=brief).status_code == 200
    clock.now = expires.timestamp()  # the wall clock alone: the key is still held
    expired = client.get("/messages", headers=brief)
    assert expired.status_code == 401 and "expired" in expired.text


def test_the_key_cache_forgets_at_a_revocation_and_stays_bounded() -> None:
    from orderly.api.http.auth import KeyCache

    cache = KeyCache(ManualClock(), size=2)
    one, two, three = (KeyCache.digest(f"orderly_x_{i}") for i in range(3))
    key = keys.Principal("k", frozenset({keys.OPERATE}))
    # A lookup that began before a revocation through this process does not store its key.
    began = cache.generation
    cache.clear()
    cache.put(one, key, began)
    assert cache.get(one) is None
    for digest in (one, two, three):
        cache.put(digest, key, cache.generation)
    assert cache.get(one) is None and cache.get(two) == key and cache.get(three) == key
