"""The faces of periodic schedules: the HTTP routes (scopes, refusals that write nothing, two
tenants that never see each other's schedules), the Python client, the console page and the
``orderly schedule`` commands."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from typer.testing import CliRunner

from orderly.api.cli import app as cli_app
from orderly.client import Client, Forbidden, Invalid, NotFound
from orderly.worker import keys
from tests.helpers import api_key

SCOPES = [keys.PRODUCE, keys.OPERATE]


def schedule(name: str = "nightly", source: str = "crm", **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "cron": "0 6 * * MON-FRI",
        "time_zone": "Europe/Berlin",
        "service": "test",
        "operation": "script",
        "source_system": source,
        "payload": {"report": "{{name}}", "at": "{{instant}}"},
    }
    data.update(overrides)
    return data


def rows(db: Engine) -> list[tuple[Any, ...]]:
    with db.connect() as conn:
        found = conn.execute(text("SELECT name, cron, enabled, updated_at FROM schedule"))
        return sorted(tuple(r) for r in found)


def bound_key(client: TestClient, name: str, source: str) -> dict[str, str]:
    owns = {"source_systems": [source], "origins": [], "subscriptions": []}
    made = client.post("/keys", json={"name": name, "scopes": SCOPES, "owns": owns})
    assert made.status_code == 201, made.text
    return {"Authorization": f"Bearer {made.json()['token']}"}


def test_create_list_show_change_and_remove(client: TestClient, db: Engine) -> None:
    made = client.post("/schedules", json=schedule())
    assert made.status_code == 201, made.text
    found = made.json()
    assert found["name"] == "nightly" and found["enabled"] is True
    assert found["next_at"].endswith("+00:00") and found["last_at"] is None
    assert found["payload"] == {"report": "{{name}}", "at": "{{instant}}"}
    assert client.get("/schedules").json() == [found]
    assert client.get("/schedules/nightly").json() == found
    off = client.patch("/schedules/nightly", json={"enabled": False})
    assert off.status_code == 200 and off.json()["next_at"] is None
    on = client.patch("/schedules/nightly", json={"enabled": True, "cron": "30 7 * * *"})
    assert on.json()["cron"] == "30 7 * * *" and on.json()["next_at"] is not None
    gone = client.delete("/schedules/nightly")
    assert gone.status_code == 200 and gone.json() == {"name": "nightly", "deleted": True}
    missing = client.get("/schedules/nightly")
    assert missing.status_code == 404
    assert missing.json() == {"errors": [{"field": "schedule", "problem": "no schedule 'nightly'"}]}
    assert rows(db) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cron": "0 6 * *"}, "cron"),
        ({"cron": "0 6 * * FUNDAY"}, "cron"),
        ({"time_zone": "Europe/Nowhere"}, "time_zone"),
        ({"service": "unknown"}, "service"),
        ({"payload": 1}, "payload"),
        ({"name": "with/slash"}, "name"),
        ({"priority": "high"}, "priority"),
    ],
)
def test_refused_input_names_the_field_and_writes_nothing(
    client: TestClient, db: Engine, change: dict[str, Any], field: str
) -> None:
    answer = client.post("/schedules", json=schedule(**change))
    assert answer.status_code == 422, answer.text
    assert field in [e["field"] for e in answer.json()["errors"]]
    assert rows(db) == []
    # A change that is refused leaves the stored schedule as it was.
    assert client.post("/schedules", json=schedule()).status_code == 201
    before = rows(db)
    refused = client.patch("/schedules/nightly", json={k: v for k, v in change.items()})
    assert refused.status_code == 422, refused.text
    assert rows(db) == before


def test_a_taken_name_is_refused(client: TestClient, db: Engine) -> None:
    assert client.post("/schedules", json=schedule()).status_code == 201
    again = client.post("/schedules", json=schedule(cron="* * * * *"))
    assert again.status_code == 422
    assert again.json()["errors"] == [{"field": "name", "problem": "schedule 'nightly' exists"}]


def test_writes_need_produce_and_reads_need_operate(client: TestClient, db: Engine) -> None:
    producer = {"Authorization": f"Bearer {api_key(db, keys.PRODUCE, name='p')}"}
    operator = {"Authorization": f"Bearer {api_key(db, keys.OPERATE, name='o')}"}
    assert client.post("/schedules", json=schedule(), headers=producer).status_code == 201
    assert client.get("/schedules", headers=producer).status_code == 403
    assert client.get("/schedules", headers=operator).status_code == 200
    assert client.get("/schedules/nightly", headers=operator).status_code == 200
    for refused in (
        client.post("/schedules", json=schedule("other"), headers=operator),
        client.patch("/schedules/nightly", json={"enabled": False}, headers=operator),
        client.delete("/schedules/nightly", headers=operator),
    ):
        assert refused.status_code == 403
        assert refused.json()["errors"][0]["field"] == "scope"
    assert [r[2] for r in rows(db)] == [True]


def test_another_tenants_schedule_is_one_that_does_not_exist(
    client: TestClient, db: Engine
) -> None:
    a, b = bound_key(client, "tenant-a", "crm-a"), bound_key(client, "tenant-b", "crm-b")
    made = client.post("/schedules", json=schedule("crm-a:nightly", "crm-a"), headers=a)
    assert made.status_code == 201, made.text
    mine = client.post("/schedules", json=schedule("crm-b:daily", "crm-b"), headers=b)
    assert mine.status_code == 201, mine.text
    before = rows(db)
    assert [s["name"] for s in client.get("/schedules", headers=b).json()] == ["crm-b:daily"]
    assert [s["name"] for s in client.get("/schedules", headers=a).json()] == ["crm-a:nightly"]
    for name in ("crm-a:nightly", "crm-b:missing"):  # another's, and one that does not exist
        answers = [
            client.get(f"/schedules/{name}", headers=b),
            client.patch(f"/schedules/{name}", json={"enabled": False}, headers=b),
            client.patch(f"/schedules/{name}", json={"source_system": "crm-b"}, headers=b),
            client.delete(f"/schedules/{name}", headers=b),
        ]
        for answer in answers:
            assert answer.status_code == 404, answer.text
            assert answer.json() == {
                "errors": [{"field": "schedule", "problem": f"no schedule {name!r}"}]
            }
    # Nor may B schedule messages of A's source system, or take a name in A's namespace.
    theirs = client.post("/schedules", json=schedule("crm-b:x", "crm-a"), headers=b)
    assert theirs.status_code == 404
    assert theirs.json()["errors"][0]["field"] == "source system"
    squat = client.post("/schedules", json=schedule("crm-a:x", "crm-b"), headers=b)
    assert squat.status_code == 422 and squat.json()["errors"][0]["field"] == "name"
    moved = client.patch("/schedules/crm-b:daily", json={"source_system": "crm-a"}, headers=b)
    assert moved.status_code == 404
    funnel = client.post(
        "/schedules", json=schedule("crm-b:f", "crm-b", funnel_value="crm-a:f"), headers=b
    )
    assert funnel.status_code == 422 and funnel.json()["errors"][0]["field"] == "funnel_value"
    assert rows(db) == before
    # The owner, and an unrestricted key, do what B may not.
    changed = client.patch("/schedules/crm-a:nightly", json={"enabled": False}, headers=a)
    assert changed.status_code == 200
    assert len(client.get("/schedules").json()) == 2
    assert client.delete("/schedules/crm-a:nightly", headers=a).status_code == 200


def test_the_client_calls_every_route(client: TestClient, db: Engine) -> None:
    token = client.headers["Authorization"].removeprefix("Bearer ")
    transport = client._transport  # the app in this process, no server
    with Client("http://testserver", token, transport=transport, retries=0) as orderly:
        made = orderly.create_schedule(schedule())
        assert made["name"] == "nightly"
        assert [s["name"] for s in orderly.schedules()] == ["nightly"]
        assert orderly.schedule("nightly")["cron"] == "0 6 * * MON-FRI"
        assert orderly.disable_schedule("nightly")["enabled"] is False
        assert orderly.enable_schedule("nightly")["next_at"] is not None
        changed = orderly.update_schedule("nightly", {"time_zone": "UTC"})
        assert changed["time_zone"] == "UTC"
        with pytest.raises(Invalid) as refused:
            orderly.update_schedule("nightly", {"cron": "nope"})
        assert refused.value.problems[0].field == "cron"
        assert orderly.delete_schedule("nightly") == {"name": "nightly", "deleted": True}
        with pytest.raises(NotFound):
            orderly.schedule("nightly")
    operator = api_key(db, keys.OPERATE, name="reader")
    reader = Client("http://testserver", operator, transport=transport, retries=0)
    with reader, pytest.raises(Forbidden):
        reader.create_schedule(schedule())


def test_the_console_lists_schedules_with_next_and_last(client: TestClient, db: Engine) -> None:
    assert client.post("/schedules", json=schedule()).status_code == 201
    with db.begin() as conn:
        conn.execute(
            text(
                "UPDATE schedule SET last_at = '2026-01-05 05:00:00+00', last_msg_id = 7,"
                " next_at = '2026-01-06 05:00:00+00'"
            )
        )
    page = client.get("/console/schedules")
    assert page.status_code == 200
    assert 'data-schedule="nightly"' in page.text
    assert "2026-01-06 05:00:00.000" in page.text and "2026-01-05 05:00:00.000" in page.text
    assert 'href="/console/messages/7"' in page.text
    assert 'href="/console/schedules" aria-current="page"' in page.text
    b = bound_key(client, "tenant-b", "crm-b")
    theirs = client.get("/console/schedules", headers=b)
    assert theirs.status_code == 200 and 'data-schedule="nightly"' not in theirs.text
    assert "no schedule" in theirs.text


def test_the_command_line(db: Engine) -> None:
    runner = CliRunner()

    def run(*args: str) -> str:
        done = runner.invoke(cli_app, list(args))
        assert done.exit_code == 0, done.output
        return done.output

    made = json.loads(
        run(
            "schedule", "add", "nightly", "0 2 * * *", "--tz", "Europe/Berlin",
            "--service", "test", "--operation", "script", "--source-system", "crm",
            "--payload", '{"at": "{{instant}}"}',
        )
    )  # fmt: skip
    assert made["cron"] == "0 2 * * *" and made["payload"] == {"at": "{{instant}}"}
    assert "nightly" in run("schedule", "list")
    assert json.loads(run("schedule", "show", "nightly"))["time_zone"] == "Europe/Berlin"
    assert "is disabled" in run("schedule", "disable", "nightly")
    assert "is enabled, next due at" in run("schedule", "enable", "nightly")
    assert json.loads(run("schedule", "set", "nightly", "--cron", "5 2 * * *"))["cron"] == (
        "5 2 * * *"
    )
    refused = runner.invoke(cli_app, ["schedule", "set", "nightly", "--tz", "Moon/Base"])
    assert refused.exit_code == 2 and "time_zone" in refused.output
    assert "removed" in run("schedule", "remove", "nightly")
    assert runner.invoke(cli_app, ["schedule", "show", "nightly"]).exit_code == 2
    assert rows(db) == []
