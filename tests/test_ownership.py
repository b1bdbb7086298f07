"""Every object only for its owner: two tenants' keys, each bound (``owns``) to its source
system, origin and pull subscription. Every operation tenant B tries on tenant A's objects is
refused as if the object did not exist, and writes nothing (no row, no Redis key, no task);
tenant A doing the same succeeds, so that each refusal is the ownership's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.api.console.session import COOKIE
from orderly.worker import keys
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.runtime import get_runtime
from tests.helpers import message

CHANNEL = {"delivery_delay_ms": 10, "attempts": 2}
ROOM = {"name": "orders", "delivery_delay_ms": 100, "delivery_delay_multiplier": 2.0}
SCOPES = [keys.PRODUCE, keys.OPERATE, keys.CONSUME]


@dataclass
class Tenant:
    """One tenant's key and the objects it made."""

    token: str
    source: str
    origin: str
    subscription: int
    msg_id: int = 0
    waiting_id: int = 0
    failed_id: int = 0
    delivery_id: int = 0
    dead_id: int = 0
    exception_id: int = 0

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def _tenant(client: TestClient, db: Engine, name: str) -> Tenant:
    origin, source = f"web-{name}", f"crm-{name}"
    put = client.put(f"/channels/{origin}", json={"url": "http://127.0.0.1:9/in", **CHANNEL})
    assert put.status_code == 200, put.text
    sub = client.post("/rooms/orders/subscriptions", json={"name": f"s-{name}", "kind": "PULL"})
    assert sub.status_code == 201, sub.text
    subscription = int(sub.json()["subscription_id"])
    owns = {"source_systems": [source], "origins": [origin], "subscriptions": [subscription]}
    made = client.post("/keys", json={"name": f"tenant-{name}", "scopes": SCOPES, "owns": owns})
    assert made.status_code == 201, made.text
    assert made.json()["owns"] == owns
    return Tenant(made.json()["token"], source, origin, subscription)


def _own_objects(client: TestClient, db: Engine, t: Tenant, name: str) -> None:
    """Tenant ``t``'s messages, conversation, deliveries, dead letter and exception, made
    through its own key (and, for states no route makes at once, set in the table)."""
    ids = []
    for n in range(3):
        body = message(n, source_system=t.source, correlation_id=f"{name}-{n}")
        answer = client.post("/messages", json=body, headers=t.auth)
        assert answer.status_code == 201, answer.text
        ids.append(int(answer.json()["msg_id"]))
    t.msg_id, t.waiting_id, t.failed_id = ids
    assert get_runtime().tracker.register(t.msg_id) > 0  # its work, tracked by its msg_id
    request = {"request_id": f"rq-{name}", "origin": t.origin}
    answer = client.post(f"/conversations/conv-{name}/requests", json=request, headers=t.auth)
    assert answer.status_code == 201, answer.text
    response = {"request_id": f"rq-{name}", "response_id": f"rs-{name}", "payload": "hi"}
    answer = client.post(f"/conversations/conv-{name}/responses", json=response, headers=t.auth)
    assert answer.status_code == 201, answer.text
    for _ in range(2):
        answer = client.post("/rooms/orders/events", json={"routing_key": name, "payload": {}})
        assert answer.status_code == 201, answer.text
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE message SET state = 'WAITING_FOR_RES', wait_correlation_id = :w"
                " WHERE msg_id = :id"
            ),
            {"w": f"wait-{name}", "id": t.waiting_id},
        )
        conn.execute(
            text("UPDATE message SET state = 'FAILED' WHERE msg_id = :id"), {"id": t.failed_id}
        )
        found = conn.execute(
            text("SELECT delivery_id FROM delivery WHERE subscription_id = :s ORDER BY 1"),
            {"s": t.subscription},
        ).scalars()
        # Each tenant's subscription gets every event: one delivery stays for pulling, one
        # becomes a dead letter with a logged exception.
        t.delivery_id, t.dead_id = list(found)[:2]
        conn.execute(
            text("UPDATE delivery SET state = 'DEAD' WHERE delivery_id = :d"), {"d": t.dead_id}
        )
        t.exception_id = conn.execute(
            text(
                "INSERT INTO log_exception (type, message, delivery_id, attempt)"
                " VALUES ('Boom', 'it broke', :d, 1) RETURNING id"
            ),
            {"d": t.dead_id},
        ).scalar_one()


@pytest.fixture
def tenants(client: TestClient, db: Engine) -> tuple[Tenant, Tenant]:
    assert client.post("/rooms", json=ROOM).status_code == 201
    a, b = _tenant(client, db, "a"), _tenant(client, db, "b")
    _own_objects(client, db, a, "a")
    _own_objects(client, db, b, "b")
    return a, b


def _counts(db: Engine, r: redis.Redis) -> dict[str, Any]:
    """Every table's rows and every Redis key with its content's size: what a write moves."""
    with db.connect() as conn:
        tables = conn.execute(
            # but the metrics' running totals, which count every request, refused ones too
            text(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                " AND tablename <> 'metric_total'"
            )
        ).scalars()
        counts: dict[str, Any] = {
            t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables
        }
        counts["message states"] = sorted(
            tuple(row) for row in conn.execute(text("SELECT msg_id, state FROM message"))
        )
        counts["delivery states"] = sorted(
            tuple(row) for row in conn.execute(text("SELECT delivery_id, state FROM delivery"))
        )
    sizes = {}
    for key in r.scan_iter(count=1000):
        if key.startswith(b"orderly:rate:"):
            continue  # a refused request is charged to its rate limit: that is no object
        found = r.type(key)
        kind = found.decode() if isinstance(found, bytes) else found
        size = {"list": r.llen, "zset": r.zcard, "hash": r.hlen, "set": r.scard}.get(kind)
        sizes[key] = size(key) if size else r.strlen(key) if kind == "string" else kind
    counts["redis"] = sizes
    return counts


# (method, path, body) for tenant ``t``'s objects; each is refused with 404 to another tenant.
def _refused_404(t: Tenant, name: str, other: Tenant) -> list[tuple[str, str, Any]]:
    note = {"note": "not yours"}
    cid, rs = f"conv-{name}", f"rs-{name}"
    return [
        ("POST", "/messages", message(9, source_system=t.source, correlation_id="x")),
        ("POST", "/messages:batch", {"messages": [message(9, source_system=t.source)]}),
        ("POST", "/messages/responses", {"correlation_id": f"wait-{name}", "payload": "evil"}),
        ("GET", f"/messages/{t.msg_id}", None),
        ("POST", f"/messages/{t.msg_id}/cancel", note),
        ("POST", f"/messages/{t.failed_id}/redrive", note),
        ("POST", f"/conversations/{cid}/responses", {"request_id": f"rq-{name}",
                                                     "response_id": "evil", "payload": "x"}),
        ("POST", f"/conversations/{cid}/requests", {"request_id": "evil", "origin": "web-z"}),
        ("POST", f"/conversations/{cid}/requests", {"request_id": "evil", "origin": other.origin}),
        ("POST", "/conversations/evil/requests", {"request_id": "evil", "origin": t.origin}),
        ("GET", f"/conversations/{cid}", None),
        ("GET", f"/conversation-messages?response_id={rs}", None),
        ("DELETE", f"/conversations/{cid}/requests/rq-{name}", None),
        ("POST", f"/conversations/{cid}/requests/rq-{name}/awaited", note),
        ("POST", f"/conversations/{cid}/responses/{rs}/awaited", note),
        ("PUT", f"/conversations/{cid}/responses/{rs}/awaited-date",
         {"awaited_to_date": "2030-01-01T00:00:00Z"}),
        ("POST", f"/conversations/{cid}/responses/{rs}/removal", {"delay_s": 1}),
        ("GET", f"/subscriptions/{t.subscription}/messages", None),
        ("POST", f"/subscriptions/{t.subscription}/messages/{t.delivery_id}/ack",
         {"receipt": "x"}),
        ("GET", f"/exceptions/{t.exception_id}", None),
        ("POST", "/tracking/done", {"xid": str(t.msg_id)}),
    ]  # fmt: skip


# Listings and bulk commands: another tenant gets its own rows only (none of ``t``'s).
def _listings(t: Tenant) -> list[tuple[str, str, Any, Callable[[Any], bool]]]:
    def none_of(ids: set[int], field: str) -> Callable[[Any], bool]:
        return lambda rows: not ids & {int(r[field]) for r in rows}

    subs = {t.subscription}
    return [
        ("GET", f"/messages?source_system={t.source}", None, lambda rows: rows == []),
        ("GET", "/messages", None, none_of({t.msg_id, t.waiting_id, t.failed_id}, "msg_id")),
        ("GET", "/dead-letters", None, none_of({t.dead_id}, "delivery_id")),
        ("GET", "/queue-messages", None, none_of(subs, "subscription_id")),
        ("GET", "/exceptions", None, none_of({t.exception_id}, "id")),
        ("GET", "/published-messages", None, none_of(subs, "subscription_id")),
        ("POST", "/dead-letters/redrive", {"subscription_id": t.subscription},
         lambda body: body == {"redriven": []}),
        ("POST", "/dead-letters/redrive", {"delivery_ids": [t.dead_id]},
         lambda body: body == {"redriven": []}),
    ]  # fmt: skip


def test_every_operation_on_another_tenants_object_is_refused_and_writes_nothing(
    client: TestClient, db: Engine, redis_client: redis.Redis, tenants: tuple[Tenant, Tenant]
) -> None:
    a, b = tenants
    refused = _refused_404(a, "a", b)
    listed = _listings(a)
    for method, path, body in refused:
        before = _counts(db, redis_client)
        answer = client.request(method, path, json=body, headers=b.auth)
        assert answer.status_code == 404, (method, path, answer.status_code, answer.text)
        assert "conv-a" not in answer.text or path.startswith("/conversations/conv-a")
        assert _counts(db, redis_client) == before, (method, path)
    for method, path, body, fine in listed:
        before = _counts(db, redis_client)
        answer = client.request(method, path, json=body, headers=b.auth)
        assert answer.status_code == 200, (method, path, answer.text)
        assert fine(answer.json()), (method, path, answer.json())
        assert _counts(db, redis_client) == before, (method, path)


def test_the_owner_may_do_what_another_tenant_may_not(
    client: TestClient, db: Engine, tenants: tuple[Tenant, Tenant]
) -> None:
    a, b = tenants
    allowed = {path: (method, body) for method, path, body in _refused_404(a, "a", b)}
    ok = [
        f"/messages/{a.msg_id}",
        "/conversations/conv-a",
        "/conversation-messages?response_id=rs-a",
        f"/exceptions/{a.exception_id}",
    ]
    for path in ok:
        answer = client.get(path, headers=a.auth)
        assert answer.status_code == 200, (path, answer.text)
    pulled = client.get(f"/subscriptions/{a.subscription}/messages", headers=a.auth)
    assert pulled.status_code == 200 and pulled.json(), pulled.text
    for path in ("/messages/responses", f"/messages/{a.msg_id}/cancel", "/tracking/done"):
        method, body = allowed[path]
        answer = client.request(method, path, json=body, headers=a.auth)
        assert answer.status_code in (200, 201), (path, answer.text)
    listed = client.get("/dead-letters", headers=a.auth).json()
    assert {r["delivery_id"] for r in listed} == {a.dead_id}
    mine = client.get("/messages", headers=a.auth).json()
    assert {r["msg_id"] for r in mine} == {a.msg_id, a.waiting_id, a.failed_id}
    redriven = client.post(
        "/dead-letters/redrive", json={"delivery_ids": [a.dead_id]}, headers=a.auth
    )
    assert redriven.json() == {"redriven": [a.dead_id]}


@pytest.mark.parametrize(
    ("foreign", "missing"),
    [
        ("/messages/{msg_id}", "/messages/999999"),
        ("/conversation-messages?response_id=rs-a", "/conversation-messages?response_id=rs-zz"),
        ("/conversations/conv-a", "/conversations/conv-zz"),
        ("/exceptions/{exception_id}", "/exceptions/999999"),
    ],
)
def test_another_tenants_object_is_answered_as_one_that_does_not_exist(
    client: TestClient, tenants: tuple[Tenant, Tenant], foreign: str, missing: str
) -> None:
    a, b = tenants
    path = foreign.format(msg_id=a.msg_id, exception_id=a.exception_id)
    theirs = client.get(path, headers=b.auth)
    nobodys = client.get(missing, headers=b.auth)
    assert theirs.status_code == nobodys.status_code == 404
    asked, absent = (
        path.rsplit("/", 1)[-1].split("=")[-1],
        missing.rsplit("/", 1)[-1].split("=")[-1],
    )
    assert theirs.text.replace(asked, "ID") == nobodys.text.replace(absent, "ID")
    assert set(theirs.headers) == set(nobodys.headers)


def test_a_bound_key_neither_adopts_another_tenants_message_nor_enters_its_funnel(
    client: TestClient, db: Engine, redis_client: redis.Redis, tenants: tuple[Tenant, Tenant]
) -> None:
    a, b = tenants
    before = _counts(db, redis_client)
    for parent in (a.waiting_id, 999999):
        child = message(7, source_system=b.source, correlation_id="child", parent_msg_id=parent)
        answer = client.post("/messages", json=child, headers=b.auth)
        assert answer.status_code == 422, answer.text
        assert answer.json()["errors"] == [
            {"field": "parent_msg_id", "problem": f"no message {parent} exists"}
        ]
        batch = client.post("/messages:batch", json={"messages": [child]}, headers=b.auth)
        assert batch.status_code == 422 and "messages[0].parent_msg_id" in batch.text
    for funnel in ("fa", f"{a.source}:fa", "crm-z:fa"):
        body = message(8, source_system=b.source, funnel_value=funnel, guaranteed_order=True)
        answer = client.post("/messages", json=body, headers=b.auth)
        assert answer.status_code == 422 and "funnel_value" in answer.text, answer.text
    assert _counts(db, redis_client) == before
    own = message(8, source_system=b.source, funnel_value=f"{b.source}:fa", guaranteed_order=True)
    assert client.post("/messages", json=own, headers=b.auth).status_code == 201
    child = message(9, source_system=b.source, correlation_id="own-child", parent_msg_id=b.msg_id)
    assert client.post("/messages", json=child, headers=b.auth).status_code == 201


def test_an_unrestricted_key_still_sees_every_tenant(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    a, b = tenants
    for t in (a, b):
        assert client.get(f"/messages/{t.msg_id}").status_code == 200
        assert client.get(f"/conversations/conv-{t.origin[-1]}").status_code == 200
    dead = {r["delivery_id"] for r in client.get("/dead-letters").json()}
    assert {a.dead_id, b.dead_id} <= dead


def test_a_request_id_of_another_tenant_is_taken_without_saying_where(
    client: TestClient, db: Engine, redis_client: redis.Redis, tenants: tuple[Tenant, Tenant]
) -> None:
    _, b = tenants
    before = _counts(db, redis_client)
    answer = client.post(
        "/conversations/conv-new/requests",
        json={"request_id": "rq-a", "origin": b.origin},
        headers=b.auth,
    )
    assert answer.status_code == 422 and "taken" in answer.text, answer.text
    assert "conv-a" not in answer.text
    assert _counts(db, redis_client) == before


def test_a_conversation_of_several_origins_is_only_an_unrestricted_keys(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    """A key that owns every origin may mix them in one conversation (the seed's
    allOriginExcept); a bound key may not join one that holds another tenant's request."""
    a, b = tenants
    first = {"request_id": "q1", "origin": a.origin}
    assert client.post("/conversations/mixed/requests", json=first).status_code == 201
    second = {"request_id": "q2", "origin": b.origin}
    assert client.post("/conversations/mixed/requests", json=second).status_code == 201
    third = {"request_id": "q3", "origin": b.origin}
    joined = client.post("/conversations/mixed/requests", json=third, headers=b.auth)
    assert joined.status_code == 404, joined.text
    assert client.get("/conversations/mixed", headers=b.auth).status_code == 404
    assert client.get("/conversations/mixed").status_code == 200


def test_the_console_shows_a_bound_key_its_own_objects_only(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    a, b = tenants
    page = client.get("/console/messages", headers=b.auth)
    assert page.status_code == 200
    assert f"/console/messages/{b.msg_id}" in page.text
    assert f"/console/messages/{a.msg_id}" not in page.text
    assert client.get(f"/console/messages/{a.msg_id}", headers=b.auth).status_code == 404
    assert client.get("/console/conversations/conv-a", headers=b.auth).status_code == 404
    assert client.get("/console/conversations/conv-b", headers=b.auth).status_code == 200


def test_a_bound_keys_console_session_keeps_its_bounds(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    """Signed in with a bound key, the session (a cookie, not the key) sees what the key
    sees: its own messages and conversations, none of the system-wide pages."""
    a, b = tenants
    client.cookies.clear()
    signed = client.post(
        "/console/login", data={"key": b.token}, headers={"Authorization": ""},
        follow_redirects=False,
    )  # fmt: skip
    assert signed.status_code == 303, signed.text
    session = {"Cookie": f"{COOKIE}={signed.cookies[COOKIE]}", "Authorization": ""}
    client.cookies.clear()
    page = client.get("/console/messages", headers=session)
    assert page.status_code == 200
    assert f"/console/messages/{b.msg_id}" in page.text
    assert f"/console/messages/{a.msg_id}" not in page.text
    assert "/console/figures" not in page.text
    assert client.get(f"/console/messages/{a.msg_id}", headers=session).status_code == 404
    assert client.get("/console/conversations/conv-a", headers=session).status_code == 404
    for system_wide in ("/console/figures", "/console/figures.json", "/console/nodes"):
        assert client.get(system_wide, headers=session).status_code == 403, system_wide


@pytest.mark.parametrize(
    ("owns", "scopes", "problem"),
    [
        ({"source_systems": ["crm"]}, ["admin"], "acts on every object"),
        ({"source_systems": ["crm"]}, ["produce", "metrics"], "acts on every object"),
        ({"subscriptions": [0]}, ["consume"], "greater than or equal to 1"),
        ({"origins": ["bad name"]}, ["produce"], "match pattern"),
        ({"rooms": ["x"]}, ["produce"], "unknown field"),
    ],
)
def test_a_key_bound_wrongly_is_refused_naming_why(
    db: Engine, owns: dict[str, Any], scopes: list[str], problem: str
) -> None:
    with pytest.raises(InvalidMessage) as refused:
        keys.create_key(db, {"name": "k", "scopes": scopes, "owns": owns})
    (field, said), *_ = refused.value.problems
    assert field == "owns" and problem in said, refused.value.problems
    assert keys.list_keys(db, revoked=True) == []


def test_keys_made_before_ownership_act_on_every_object(db: Engine) -> None:
    """The migration leaves every existing key's owns NULL: unrestricted, as before."""
    made, token = keys.create_key(db, {"name": "old", "scopes": ["produce"]})
    assert made["owns"] is None
    assert keys.authenticate(db, token).owns is None
