"""Cancelling a parent cancels its HARD descendants not yet final, in one transaction, each
with an audit entry; SOFT children go on. Against the real PostgreSQL, through
worker.messages.operations and the faces that call it (HTTP, CLI)."""

from __future__ import annotations

import json
import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from orderly.worker.core.errors import OperationRefused
from orderly.worker.messages import operations
from orderly.worker.messages.batches import process_message
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Outcome
from tests.helpers import OrderlyCli, api_key, message, processor, row, wait_until


def children_of(db: Engine, parent: int) -> dict[str, int]:
    """The children of ``parent`` by their operation (each operation once)."""
    with db.connect() as conn:
        rows = conn.execute(
            text("SELECT msg_id, operation_name FROM message WHERE parent_msg_id = :p"),
            {"p": parent},
        ).all()
    return {r.operation_name: r.msg_id for r in rows}


def split(*children: dict[str, Any]) -> str:
    return json.dumps({"children": list(children)})


def build_tree(db: Engine, intake: Intake) -> dict[str, int]:
    """root (WAITING) with HARD children: ``split`` (WAITING, with a HARD ``script`` and a SOFT
    ``ordered`` child), ``wait`` (WAITING_FOR_RES, in funnel ``fc``), ``say`` (OK: final), and
    a SOFT ``script`` child; a message of funnel ``fc`` POSTPONED behind ``wait``."""
    proc = processor(db)
    inner = [{"operation": "script"}, {"operation": "ordered", "soft": True}]
    root = intake.submit(
        message(
            1,
            operation="split",
            payload=split(
                {"operation": "split", "payload": {"children": inner}},
                {"operation": "wait", "payload": {"correlation_id": "ext-b"}, "funnel_value": "fc"},
                {"operation": "say", "payload": {}},
                {"operation": "script", "soft": True},
            ),
        )
    ).msg_id
    assert process_message(proc, root).outcome is Outcome.WAITING
    kids = children_of(db, root)
    assert process_message(proc, kids["split"]).outcome is Outcome.WAITING
    assert process_message(proc, kids["say"]).outcome is Outcome.OK
    process_message(proc, kids["wait"])
    assert row(db, kids["wait"]).state == "WAITING_FOR_RES"
    grand = children_of(db, kids["split"])
    behind = intake.submit(message(9, operation="script", funnel_value="fc")).msg_id
    assert row(db, behind).state == "POSTPONED"
    with db.connect() as conn:
        soft = conn.execute(
            text(
                "SELECT msg_id FROM message WHERE parent_msg_id = :p"
                " AND parent_binding_type = 'SOFT'"
            ),
            {"p": root},
        ).scalar_one()
    return {
        "root": root,
        "split": kids["split"],
        "grand_hard": grand["script"],
        "grand_soft": grand["ordered"],
        "wait": kids["wait"],
        "done": kids["say"],
        "soft": soft,
        "behind": behind,
    }


def test_cancel_cascades_to_hard_descendants_not_final_and_soft_ones_go_on(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    t = build_tree(db, intake)
    queue.clear()
    done = operations.cancel(db, t["root"], {"note": "order withdrawn", "by": "ann"}, queue.append)
    hard = sorted([t["split"], t["grand_hard"], t["wait"]])
    assert done.cancelled == tuple(hard)
    # The root is CANCEL, not FAILED by its cancelled children: it was cancelled first.
    assert row(db, t["root"]).state == "CANCEL"
    for msg_id in hard:
        stored = row(db, msg_id)
        assert stored.state == "CANCEL", msg_id
        entry = stored.audit[-1]
        assert entry["action"] == "CANCEL" and entry["by"] == "ann"
        assert entry["note"].endswith(": order withdrawn")
    assert (
        row(db, t["grand_hard"])
        .audit[-1]["note"]
        .startswith(f"parent message {t['split']} cancelled")
    )
    assert row(db, t["wait"]).audit[-1]["from"] == "WAITING_FOR_RES"
    # SOFT children (of the root and of a cancelled child) go on; a final child stays as it was.
    assert row(db, t["soft"]).state == "NEW" and row(db, t["soft"]).audit == []
    assert row(db, t["grand_soft"]).state == "NEW"
    assert row(db, t["done"]).state == "OK" and row(db, t["done"]).audit == []
    # The cancelled funnel message let the next one of its funnel go.
    assert queue == [t["behind"]] and row(db, t["behind"]).state == "IN_QUEUE"
    with pytest.raises(OperationRefused):
        operations.cancel(db, t["root"], {"note": "again"}, queue.append)


def test_a_cancel_of_a_child_leaves_its_parent_failed_and_its_siblings(
    db: Engine, intake: Intake, queue: list[int]
) -> None:
    t = build_tree(db, intake)
    done = operations.cancel(db, t["split"], {"note": "this part only"}, queue.append)
    assert done.cancelled == (t["grand_hard"],)
    # Cancelling a HARD child fails its WAITING parent, as before; the sibling still waits.
    parent = row(db, t["root"])
    assert (parent.state, parent.failed_error_code) == ("FAILED", "E_CHILD_CANCELLED")
    assert row(db, t["wait"]).state == "WAITING_FOR_RES"
    assert row(db, t["grand_soft"]).state == "NEW"


def test_the_cascade_is_one_transaction(db: Engine, intake: Intake, queue: list[int]) -> None:
    """While a child's row is locked elsewhere the cancel waits, and nothing of it shows;
    then all of it commits together."""
    t = build_tree(db, intake)
    blocker = db.connect()
    tx = blocker.begin()
    blocker.execute(
        text("SELECT 1 FROM message WHERE msg_id = :id FOR UPDATE"), {"id": t["grand_hard"]}
    )
    result: list[operations.CommandResult] = []
    thread = threading.Thread(
        target=lambda: result.append(
            operations.cancel(db, t["root"], {"note": "all at once"}, queue.append)
        )
    )
    thread.start()
    try:

        def waits_for_the_lock() -> bool:
            with db.connect() as conn:
                return bool(
                    conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND datname = current_database()"
                        )
                    ).scalar()
                )

        wait_until(waits_for_the_lock, 20, "the cancel waiting for the locked child")
        # Root and first level are changed inside the open transaction: none of it shows.
        assert [row(db, t[k]).state for k in ("root", "split", "wait")] == [
            "WAITING",
            "WAITING",
            "WAITING_FOR_RES",
        ]
    finally:
        tx.commit()
        blocker.close()
        thread.join(30)
    assert result and result[0].cancelled == tuple(sorted([t["split"], t["grand_hard"], t["wait"]]))
    assert {row(db, t[k]).state for k in ("root", "split", "wait", "grand_hard")} == {"CANCEL"}


def test_cancel_through_http_names_the_cancelled_descendants(
    db: Engine, intake: Intake, client: TestClient
) -> None:
    t = build_tree(db, intake)
    answer = client.post(f"/messages/{t['root']}/cancel", json={"note": "via the API"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["state"] == "CANCEL"
    assert body["cancelled"] == sorted([t["split"], t["grand_hard"], t["wait"]])
    shown = client.get(f"/messages/{t['grand_hard']}").json()
    assert shown["state"] == "CANCEL" and shown["audit"][-1]["by"].startswith("key:")
    assert client.get(f"/messages/{t['grand_soft']}").json()["state"] == "NEW"


def test_cancel_through_the_cli_names_the_cancelled_descendants(
    db: Engine, intake: Intake, cli: OrderlyCli
) -> None:
    t = build_tree(db, intake)
    done = cli("message", "cancel", str(t["root"]), "--note", "from the shell", "--by", "bo")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["state"] == "CANCEL"
    assert said["cancelled"] == sorted([t["split"], t["grand_hard"], t["wait"]])
    assert row(db, t["wait"]).audit[-1]["by"] == "bo"
    assert row(db, t["soft"]).state == "NEW"


def test_cancel_through_the_console_names_the_cancelled_descendants(
    db: Engine, intake: Intake, client: TestClient
) -> None:
    t = build_tree(db, intake)
    token = api_key(db, "operate", "admin", name="console-cancel")
    answer = client.post(
        f"/console/messages/{t['root']}/cancel",
        data={"note": "from the console"},
        headers={"Authorization": f"Bearer {token}"},
        follow_redirects=False,
    )
    assert answer.status_code == 303, answer.text
    hard = sorted([t["split"], t["grand_hard"], t["wait"]])
    said = parse_qs(urlsplit(answer.headers["location"]).query)["done"][0]
    assert said == f"message {t['root']} cancelled with {', '.join(map(str, hard))}"
    assert row(db, t["grand_hard"]).audit[-1]["by"] == "key:console-cancel"
    assert row(db, t["soft"]).state == "NEW"
