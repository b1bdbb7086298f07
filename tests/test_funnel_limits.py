"""Funnel limits through every face: the HTTP routes (admin only, refusals that write nothing,
``-`` for funnels without a component), the Python clients, the ``orderly funnel-limit``
commands, the console page, and a limit set through the API letting two claims each run a
message of one funnel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from orderly.api.cli import app as cli_app
from orderly.client import AsyncClient, Client, Forbidden, Invalid, NotFound
from orderly.models import MessageState
from orderly.worker import keys
from orderly.worker.core.errors import InvalidMessage
from orderly.worker.db.prepared import prepared_connection
from orderly.worker.messages import limits
from orderly.worker.messages.batches import claim_due
from orderly.worker.messages.intake import Intake
from orderly.worker.runtime import get_runtime
from tests.helpers import api_key, message, row


def stored(db: Engine) -> list[tuple[Any, ...]]:
    with db.connect() as conn:
        found = conn.execute(
            text("SELECT component_id, max_in_flight, updated_at FROM funnel_limit")
        )
        return sorted(tuple(r) for r in found)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("component", "word"), [("", "-"), ("-", "--"), ("--", "---"), ("a-b", "a-b"), ("x", "x")]
)
def test_a_component_has_one_word_and_back(component: str, word: str) -> None:
    assert limits.to_word(component) == word
    assert limits.from_word(word) == component


def test_set_replace_show_list_and_remove(client: TestClient, db: Engine) -> None:
    made = client.put("/funnel-limits/orders", json={"max_in_flight": 4})
    assert made.status_code == 201, made.text
    assert made.json()["component_id"] == "orders" and made.json()["max_in_flight"] == 4
    replaced = client.put("/funnel-limits/orders", json={"max_in_flight": 8})
    assert replaced.status_code == 200 and replaced.json()["max_in_flight"] == 8
    # "-": funnels without a component; "--": the component "-"; a slash escaped as %2F.
    assert client.put("/funnel-limits/-", json={"max_in_flight": 2}).status_code == 201
    assert client.put("/funnel-limits/--", json={"max_in_flight": 3}).status_code == 201
    assert client.put("/funnel-limits/a%2Fb", json={"max_in_flight": 5}).status_code == 201
    assert [(c, n) for c, n, _ in stored(db)] == [("", 2), ("-", 3), ("a/b", 5), ("orders", 8)]
    listed = client.get("/funnel-limits")
    assert [(f["component_id"], f["max_in_flight"]) for f in listed.json()] == [
        ("", 2), ("-", 3), ("a/b", 5), ("orders", 8)
    ]  # fmt: skip
    assert client.get("/funnel-limits/orders").json() == replaced.json()
    assert client.get("/funnel-limits/-").json()["component_id"] == ""
    assert client.get("/funnel-limits/a%2Fb").json()["max_in_flight"] == 5
    gone = client.delete("/funnel-limits/-")
    assert gone.status_code == 200 and gone.json() == {"component_id": "", "deleted": True}
    missing = client.get("/funnel-limits/-")
    assert missing.status_code == 404
    assert missing.json() == {
        "errors": [{"field": "funnel limit", "problem": "no funnel limit ''"}]
    }
    assert client.delete("/funnel-limits/-").status_code == 404
    assert [c for c, _, _ in stored(db)] == ["-", "a/b", "orders"]


@pytest.mark.parametrize(
    ("path", "body", "fields"),
    [
        ("/funnel-limits/c", {"max_in_flight": 0}, ["max_in_flight"]),
        ("/funnel-limits/c", {"max_in_flight": 10_001}, ["max_in_flight"]),
        ("/funnel-limits/c", {"max_in_flight": 2.5}, ["max_in_flight"]),
        ("/funnel-limits/c", {"max_in_flight": "3"}, ["max_in_flight"]),
        ("/funnel-limits/c", {"max_in_flight": True}, ["max_in_flight"]),
        ("/funnel-limits/c", {}, ["max_in_flight"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "component_id": "d"}, ["component_id"]),
        ("/funnel-limits/c", [2], ["body"]),
        ("/funnel-limits/" + "x" * 256, {"max_in_flight": 2}, ["component_id"]),
        ("/funnel-limits/" + "x" * 256, {"max_in_flight": -1}, ["component_id", "max_in_flight"]),
        ("/funnel-limits/", {"max_in_flight": 2}, ["component_id"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "rate_per_s": 0}, ["rate_per_s"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "rate_per_s": "fast"}, ["rate_per_s"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "rate_per_s": 1e6}, ["rate_per_s"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "burst": 3}, ["burst"]),
        ("/funnel-limits/c", {"max_in_flight": 2, "rate_per_s": 1, "burst": 0}, ["burst"]),
    ],
)
def test_refused_input_names_the_field_and_writes_nothing(
    client: TestClient, db: Engine, path: str, body: Any, fields: list[str]
) -> None:
    assert client.put("/funnel-limits/c", json={"max_in_flight": 7}).status_code == 201
    before = stored(db)
    answer = client.put(path, json=body)
    assert answer.status_code == 422, answer.text
    assert [e["field"] for e in answer.json()["errors"]] == fields
    assert stored(db) == before


def test_the_mechanism_refuses_before_it_writes(db: Engine) -> None:
    with pytest.raises(InvalidMessage) as refused:
        limits.set_limit(db, "c\x00", {"max_in_flight": 0})
    assert refused.value.problems == [
        ("component_id", "NUL characters (\\u0000) are not accepted"),
        ("max_in_flight", "Input should be greater than or equal to 1"),
    ]
    assert stored(db) == []


def test_only_admin_keys_read_or_change_limits(client: TestClient, db: Engine) -> None:
    assert client.put("/funnel-limits/c", json={"max_in_flight": 3}).status_code == 201
    before = stored(db)
    others = [s for s in keys.SCOPES if s != keys.ADMIN]
    without_admin = bearer(api_key(db, *others, name="no-admin"))
    owns = {"source_systems": ["crm"], "origins": [], "subscriptions": []}
    bound_made = client.post(
        "/keys", json={"name": "tenant", "scopes": [keys.PRODUCE, keys.OPERATE], "owns": owns}
    )
    assert bound_made.status_code == 201, bound_made.text
    bound = bearer(bound_made.json()["token"])
    for headers, name in ((without_admin, "no-admin"), (bound, "tenant")):
        for answer in (
            client.get("/funnel-limits", headers=headers),
            client.get("/funnel-limits/c", headers=headers),
            client.put("/funnel-limits/c", json={"max_in_flight": 9}, headers=headers),
            client.put("/funnel-limits/d", json={"max_in_flight": 9}, headers=headers),
            client.delete("/funnel-limits/c", headers=headers),
        ):
            assert answer.status_code == 403, answer.text
            assert answer.json()["errors"] == [
                {"field": "scope", "problem": f"the key {name!r} lacks the scope 'admin'"}
            ]
    # Nor can a bound key be given admin: the scope acts on the whole system.
    bound_admin = client.post(
        "/keys", json={"name": "tenant-admin", "scopes": [keys.ADMIN], "owns": owns}
    )
    assert bound_admin.status_code == 422 and bound_admin.json()["errors"][0]["field"] == "owns"
    assert stored(db) == before
    only_admin = bearer(api_key(db, keys.ADMIN, name="admin-only"))
    assert client.get("/funnel-limits", headers=only_admin).status_code == 200


def test_the_clients_call_every_route(client: TestClient, db: Engine) -> None:
    token = client.headers["Authorization"].removeprefix("Bearer ")
    transport = client._transport  # the app in this process, no server
    with Client("http://testserver", token, transport=transport, retries=0) as orderly:
        made = orderly.set_funnel_limit("", 3)
        assert made["component_id"] == "" and made["created"] is True
        assert orderly.set_funnel_limit("", 4)["created"] is False
        assert orderly.set_funnel_limit("-", 2)["created"] is True
        assert orderly.set_funnel_limit("a/b", 6)["max_in_flight"] == 6
        assert [f["component_id"] for f in orderly.funnel_limits()] == ["", "-", "a/b"]
        assert orderly.funnel_limit("")["max_in_flight"] == 4
        assert orderly.funnel_limit("-")["max_in_flight"] == 2
        with pytest.raises(Invalid) as refused:
            orderly.set_funnel_limit("c", 0)
        assert refused.value.problems[0].field == "max_in_flight"
        assert orderly.delete_funnel_limit("") == {"component_id": "", "deleted": True}
        with pytest.raises(NotFound):
            orderly.funnel_limit("")
    assert [c for c, _, _ in stored(db)] == ["-", "a/b"]
    reader = Client("http://testserver", api_key(db, keys.OPERATE, name="r"), transport=transport)
    with reader, pytest.raises(Forbidden):
        reader.funnel_limits()

    async def run_async() -> None:
        asgi = httpx.ASGITransport(app=client.app)
        async with AsyncClient("http://testserver", token, transport=asgi, retries=0) as aio:
            assert (await aio.set_funnel_limit("a/b", 7))["created"] is False
            assert (await aio.funnel_limit("a/b"))["max_in_flight"] == 7
            assert [f["component_id"] for f in await aio.funnel_limits()] == ["-", "a/b"]
            await aio.delete_funnel_limit("-")

    asyncio.run(run_async())
    assert [(c, n) for c, n, _ in stored(db)] == [("a/b", 7)]


def test_the_command_line(db: Engine) -> None:
    runner = CliRunner()

    def run(*args: str) -> str:
        done = runner.invoke(cli_app, ["funnel-limit", *args])
        assert done.exit_code == 0, done.output
        return done.output

    assert "limit set to 4" in run("set", "orders", "4")
    assert "limit changed to 5" in run("set", "orders", "5")
    assert "funnels without a component: limit set to 2" in run("set", "-", "2")
    shown = json.loads(run("show", "-", "--json"))
    assert shown["component_id"] == "" and shown["max_in_flight"] == 2
    assert "up to 5 messages" in run("show", "orders")
    listed = json.loads(run("list", "--json"))
    assert [(f["component_id"], f["max_in_flight"]) for f in listed] == [("", 2), ("orders", 5)]
    table = run("list")
    assert "orders" in table and "(no component)" in table
    before = stored(db)
    for args, field in ((["set", "orders", "0"], "max_in_flight"),
                        (["set", "x" * 256, "3"], "component_id")):  # fmt: skip
        refused = runner.invoke(cli_app, ["funnel-limit", *args])
        assert refused.exit_code == 2 and field in refused.output
    assert stored(db) == before
    assert "limit changed to 5 messages at once, 2.5 starts a second" in run(
        "set", "orders", "5", "--rate", "2.5"
    )
    rated = json.loads(run("show", "orders", "--json"))
    assert (rated["rate_per_s"], rated["burst"]) == (2.5, 3)  # the burst: the rate rounded up
    assert "2.5 (3)" in run("list")
    run("set", "orders", "5")  # a set without --rate removes the rate
    assert json.loads(run("show", "orders", "--json"))["rate_per_s"] is None
    assert "one message at a time" in run("remove", "-")
    missing = runner.invoke(cli_app, ["funnel-limit", "show", "-"])
    assert missing.exit_code == 2 and "no funnel limit" in missing.output
    assert [c for c, _, _ in stored(db)] == ["orders"]


def test_the_console_lists_and_admins_change_limits(client: TestClient, db: Engine) -> None:
    assert client.put("/funnel-limits/orders", json={"max_in_flight": 4}).status_code == 201
    page = client.get("/console/funnel-limits")
    assert page.status_code == 200
    assert 'data-component="orders"' in page.text
    assert 'href="/console/funnel-limits" aria-current="page"' in page.text
    assert 'action="/console/funnel-limits"' in page.text  # the admin's form
    set_ = client.post(
        "/console/funnel-limits",
        data={"component_id": "", "max_in_flight": "3"},
        follow_redirects=False,
    )
    assert set_.status_code == 303, set_.text
    shown = client.get(set_.headers["location"])
    assert "funnels without a component: up to 3 at once" in shown.text
    refused = client.post(
        "/console/funnel-limits", data={"component_id": "x", "max_in_flight": "many"}
    )
    assert refused.status_code == 422 and "max_in_flight" in refused.text
    removed = client.post("/console/funnel-limits/remove", data={"component_id": "orders"})
    assert removed.status_code == 200 and "one at a time again" in removed.text
    assert [(c, n) for c, n, _ in stored(db)] == [("", 3)]
    # An operator sees the limits, without the forms, and may not post them.
    operator = bearer(api_key(db, keys.OPERATE, name="op"))
    seen = client.get("/console/funnel-limits", headers=operator)
    assert seen.status_code == 200 and "funnels without a component" in seen.text
    assert 'action="/console/funnel-limits"' not in seen.text
    denied = client.post(
        "/console/funnel-limits",
        data={"component_id": "y", "max_in_flight": "2"},
        headers=operator,
    )
    assert denied.status_code == 403 and "admin" in denied.text
    # A key bound to its own objects does not see system-wide settings.
    owns = {"source_systems": ["crm"], "origins": [], "subscriptions": []}
    made = client.post("/keys", json={"name": "t", "scopes": [keys.OPERATE], "owns": owns})
    bound = bearer(made.json()["token"])
    assert client.get("/console/funnel-limits", headers=bound).status_code == 403
    assert [(c, n) for c, n, _ in stored(db)] == [("", 3)]


# --- a limit set through the API, taken by the claims ---------------------------------------

_OPEN: list[Any] = []


@pytest.fixture
def workers() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().__exit__(None, None, None)


def _claim(db: Engine) -> list[int]:
    """One worker's claim, committed; its connection stays open as a running worker's would
    (the claim belongs to its backend)."""
    opened = prepared_connection(db)
    conn = opened.__enter__()
    _OPEN.append(opened)
    rows, _ = claim_due(conn, get_runtime().node_id, 50, 5)
    return sorted(r.msg_id for r in rows if r.running)


@pytest.mark.parametrize(("word", "component"), [("orders", "orders"), ("-", None)])
def test_a_limit_set_through_the_api_lets_two_claims_run_one_funnel(
    client: TestClient,
    db: Engine,
    intake: Intake,
    workers: None,
    word: str,
    component: str | None,
) -> None:
    assert client.put(f"/funnel-limits/{word}", json={"max_in_flight": 2}).status_code == 201
    extra = {} if component is None else {"funnel_component_id": component}
    ids = [intake.submit(message(n, funnel_value="f", **extra)).msg_id for n in range(1, 4)]
    assert _claim(db) == [ids[0]]
    assert _claim(db) == [ids[1]]  # a second worker runs the funnel's second message
    assert _claim(db) == []  # both slots taken
    assert row(db, ids[2]).state is MessageState.POSTPONED
    # Removed: one at a time again, from the next claim on (those running go on).
    assert client.delete(f"/funnel-limits/{word}").status_code == 200
    with db.begin() as conn:
        conn.execute(text("UPDATE message SET state = 'OK' WHERE msg_id = :i"), {"i": ids[0]})
    assert _claim(db) == []
    assert row(db, ids[1]).state is MessageState.PROCESSING
    assert row(db, ids[2]).state is not MessageState.PROCESSING
