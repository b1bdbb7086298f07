"""The abuse benchmark's cross-tenant sweep (benchmarks/abuse.py): two tenants' bound keys,
tenant A's objects, and every operation tenant B's key tries on them."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from tooling.processes import free_port

# Each of A's objects must be ready (a message waiting, a dead letter) within this.
READY_S = 90.0


def message(correlation_id: str, source_system: str, **extra: Any) -> dict[str, Any]:
    """A message for ``bench.noop`` (``extra`` overrides any field)."""
    return {
        "service": "bench",
        "operation": "noop",
        "correlation_id": correlation_id,
        "source_system": source_system,
        "msg_timestamp": datetime.now(UTC).isoformat(),
        "payload": {"n": 1},
        **extra,
    }


def _ok(answer: httpx.Response, what: str) -> Any:
    if not answer.is_success:
        raise RuntimeError(f"{what}: {answer.status_code} {answer.text[:300]}")
    return answer.json()


def make_key(
    http: httpx.Client, name: str, scopes: list[str], owns: dict[str, list[Any]] | None
) -> str:
    """A key made through POST /keys (the admin's ``http``); its token."""
    body: dict[str, Any] = {"name": name, "scopes": scopes}
    if owns is not None:
        body["owns"] = owns
    return str(_ok(http.post("/keys", json=body), f"POST /keys {name}")["token"])


def _wait(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not within {READY_S:.0f} s")


class Tenant:
    """One tenant's names and, once made, its key's client."""

    def __init__(self, letter: str, run: str) -> None:
        self.source = f"crm-{letter}-{run}"
        self.origin = f"web-{letter}-{run}"
        self.room = f"abuse-{letter}-{run}"
        self.subscriptions: list[int] = []
        self.http: httpx.Client | None = None
        self.bound = True

    def client(self, admin: httpx.Client, name: str) -> httpx.Client:
        owns: dict[str, list[Any]] = {
            "source_systems": [self.source],
            "origins": [self.origin],
            "subscriptions": self.subscriptions,
        }
        scopes = ["produce", "operate", "consume"]
        try:
            token = make_key(admin, name, scopes, owns)
        except RuntimeError:
            # An API without bound keys: the key acts on every object.
            token = make_key(admin, name, scopes, None)
            self.bound = False
        self.http = httpx.Client(
            base_url=admin.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        )
        return self.http


def _setup_tenant(admin: httpx.Client, tenant: Tenant, push_url: str) -> None:
    _ok(admin.put(f"/channels/{tenant.origin}", json={"url": push_url}), "channel")
    room = {"name": tenant.room, "delivery_attempts": 0, "delivery_delay_ms": 100}
    _ok(admin.post("/rooms", json=room), "room")
    for name, kind in (
        ("pull", {"kind": "PULL"}),
        ("push", {"kind": "PUSH", "push_url": push_url}),
    ):
        made = _ok(
            admin.post(f"/rooms/{tenant.room}/subscriptions", json={"name": name, **kind}), name
        )
        tenant.subscriptions.append(int(made["subscription_id"]))


def _objects_of_a(admin: httpx.Client, a: Tenant, run: str) -> dict[str, Any]:
    """A's objects: two messages waiting for responses, a conversation with a request, an
    event with a delivery on A's PULL subscription and a dead one on its PUSH one."""
    assert a.http is not None
    found: dict[str, Any] = {"answer_corr": f"a-answer-{run}", "conversation": f"conv-a-{run}"}
    for name, corr in (("waiting", found["answer_corr"]), ("cancellable", f"a-cancel-{run}")):
        body = message(f"a-{name}-{run}", a.source, service="test", operation="wait")
        body["payload"] = {"correlation_id": corr, "timeout_s": 3600}
        found[name] = int(_ok(a.http.post("/messages", json=body), f"A's {name}")["msg_id"])
    for name in ("waiting", "cancellable"):
        _wait(
            lambda n=name: admin.get(f"/messages/{found[n]}").json()["state"] == "WAITING_FOR_RES",  # type: ignore[misc]
            f"A's {name} message waiting for its response",
        )
    request = {"request_id": f"ra-{run}", "origin": a.origin, "payload": {"n": 1}}
    _ok(
        a.http.post(f"/conversations/{found['conversation']}/requests", json=request), "A's request"
    )
    found["request"] = request["request_id"]
    _ok(admin.post(f"/rooms/{a.room}/events", json={"routing_key": "a", "payload": {}}), "event")
    dead = _wait(
        lambda: admin.get("/dead-letters", params={"room": a.room}).json(), "A's dead letter"
    )
    found["dead"] = {int(d["delivery_id"]) for d in dead}
    return found


def _pulled(client: httpx.Client, subscription: int) -> tuple[int, str] | None:
    answer = client.get(f"/subscriptions/{subscription}/messages")
    if answer.is_success and answer.json():
        first = answer.json()[0]
        return int(first["delivery_id"]), str(first["receipt"])
    return None


def sweep(admin: httpx.Client, run: str) -> dict[str, Any]:
    """B's key tries every operation on A's objects: how many were not refused."""
    push_url = f"http://127.0.0.1:{free_port()}/nobody"  # nobody listens: pushes fail
    a, b = Tenant("a", run), Tenant("b", run)
    for tenant in (a, b):
        _setup_tenant(admin, tenant, push_url)
    a.client(admin, f"abuse-tenant-a-{run}")
    bee = b.client(admin, f"abuse-tenant-b-{run}")
    objects = _objects_of_a(admin, a, run)
    conversation = f"/conversations/{objects['conversation']}"
    pull_a = a.subscriptions[0]
    operations: list[dict[str, Any]] = []

    def attempt(name: str, answer: httpx.Response, shown: bool | None = None) -> None:
        accepted = answer.is_success if shown is None else answer.is_success and shown
        operations.append({"operation": name, "status": answer.status_code, "accepted": accepted})

    attempt(
        "POST /messages as A's source system",
        bee.post("/messages", json=message(f"b-{run}", a.source)),
    )
    answer = {"correlation_id": objects["answer_corr"], "payload": {"from": "b"}}
    attempt(
        "POST /messages/responses to A's waiting message",
        bee.post("/messages/responses", json=answer),
    )
    attempt("GET A's message", bee.get(f"/messages/{objects['waiting']}"))
    cancellable = objects["cancellable"]
    attempt("cancel A's message", bee.post(f"/messages/{cancellable}/cancel", json={"note": "b"}))
    attempt("redrive A's message", bee.post(f"/messages/{cancellable}/redrive", json={"note": "b"}))
    listed = bee.get("/messages", params={"source_system": a.source})
    attempt("GET /messages of A's source system", listed, listed.is_success and bool(listed.json()))
    response = {"request_id": objects["request"], "response_id": f"sb-{run}", "payload": {}}
    attempt("respond in A's conversation", bee.post(f"{conversation}/responses", json=response))
    request = {"request_id": f"rb-{run}", "origin": a.origin}
    attempt("request in A's origin", bee.post(f"{conversation}/requests", json=request))
    attempt("GET A's conversation", bee.get(conversation))
    attempt("DELETE A's request", bee.delete(f"{conversation}/requests/{objects['request']}"))
    pulled = bee.get(f"/subscriptions/{pull_a}/messages")
    attempt("pull A's subscription", pulled)
    mine = a.http
    assert mine is not None
    items = pulled.json() if pulled.is_success else []
    if items:  # B took A's delivery: B has its receipt
        delivery, receipt = int(items[0]["delivery_id"]), str(items[0]["receipt"])
    else:  # A takes it; B comes with A's receipt
        delivery, receipt = _wait(lambda: _pulled(mine, pull_a), "A's pulled delivery")
    ack = bee.post(f"/subscriptions/{pull_a}/messages/{delivery}/ack", json={"receipt": receipt})
    attempt("ack A's delivery", ack)
    dead = bee.get("/dead-letters")
    shown = dead.is_success and any(int(d["delivery_id"]) in objects["dead"] for d in dead.json())
    attempt("GET /dead-letters", dead, shown)
    for client in (mine, bee):
        client.close()
    return {
        "tried": len(operations),
        "accepted": sum(1 for o in operations if o["accepted"]),
        "operations": operations,
        "owns_supported": a.bound and b.bound,
    }
