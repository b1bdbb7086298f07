"""The console as a daily tool, in headless Chromium against a real API, worker and beat: the
header's go-to (an id, the start of a correlation id), a list that refreshes itself without a
reload, re-drive of every FAILED message of a filter after confirming its count (an audit
entry each), a readable traceback, the conversation operator calls and a node moved to drain
with a note, and the charts of the last hour and day. Screenshots in ``artifacts/``."""

from __future__ import annotations

from typing import Any

import redis
from selenium import webdriver
from selenium.webdriver.common.keys import Keys
from sqlalchemy import Engine

from orderly.models import NodeState
from orderly.worker import nodes
from tests import test_console
from tests.helpers import api_key, bridge_ready, message, wait_until
from tests.stack import Stack
from tests.test_console import Console, audit, console_for
from tests.test_conversation_e2e import CHANNEL, TIMINGS
from tooling.sink import Sink

# the browser and the workload of the console's own tests
browser = test_console.browser
workload = test_console.workload


def _rows(seen: Console) -> list[int]:
    """The list's rows, read at once (the live list may replace them between two reads)."""
    found = seen.driver.execute_script(
        "return [...document.querySelectorAll('#messages tbody tr')].map(r => r.dataset.msgId)"
    )
    return [int(i) for i in found if i]


def _counts(seen: Console) -> dict[str, int]:
    found = seen.driver.execute_script(
        "return [...document.querySelectorAll('#counts .n')]"
        ".map(e => [e.dataset.state, e.textContent])"
    )
    return {state: int(n) for state, n in found}


def _go(seen: Console, typed: str) -> None:
    field = seen.find("#goto-q")
    field.send_keys(typed)
    field.send_keys(Keys.ENTER)


def test_go_to_live_list_bulk_redrive_and_a_readable_traceback(
    workload: Stack,
    db: Engine,
    browser: webdriver.Chrome,
) -> None:
    stack = workload
    crashed = [
        stack.submit(message(n, operation="crash", correlation_id=cid))
        for n, cid in enumerate(("seed-1", "seed-2", "seed-10"))
    ]
    other = stack.submit(message(9, correlation_id="other-1"))
    for msg_id in crashed:
        stack.wait_state(msg_id, "FAILED", timeout=60)
    stack.wait_state(other, "OK", timeout=60)
    name = "console-daily"
    seen = console_for(browser, stack, api_key(db, "operate", "admin", name=name))

    # The start of a correlation id finds every message it begins; an id opens its page.
    _go(seen, "seed-")
    seen.wait.until(lambda d: "correlation_match=prefix" in d.current_url)
    assert sorted(_rows(seen)) == sorted(crashed)
    seen.accessible()
    _go(seen, str(crashed[0]))
    seen.wait.until(lambda d: d.current_url.endswith(f"/console/messages/{crashed[0]}"))
    # The traceback keeps its lines, in a block of its own.
    shown = seen.find("#failed-desc")
    assert "RuntimeError: handler blew up" in shown.text
    assert shown.text.count("\n") >= 2 and "Traceback (most recent call last)" in shown.text
    assert seen.driver.execute_script(
        "return getComputedStyle(document.getElementById('failed-desc')).whiteSpace"
    ) in ("pre", "pre-wrap")
    seen.shot("daily-traceback")

    # The FAILED list refreshes by itself: a new failure appears, the page is not reloaded.
    seen.open("/console/messages?state=FAILED")
    assert sorted(_rows(seen)) == sorted(crashed)
    seen.driver.execute_script("window.__same_page = 1")
    late = stack.submit(message(20, operation="crash", correlation_id="seed-3"))
    stack.wait_state(late, "FAILED", timeout=60)
    seen.wait.until(lambda d: late in _rows(seen))
    assert seen.driver.execute_script("return window.__same_page") == 1
    seen.wait.until(lambda d: _counts(seen)["FAILED"] == 4)
    seen.shot("daily-live")

    # Re-drive them all: the count first, then the note; an audit entry each.
    seen.find("a.button[href*='action=redrive']").click()
    seen.wait.until(lambda d: "/console/messages/bulk" in d.current_url)
    assert "4 messages match now" in seen.text("#bulk-count")
    seen.accessible()
    seen.shot("daily-bulk-confirm")
    seen.submit_note("#bulk-form", "handler fixed")
    assert "4 messages re-driven" in seen.text(".done")
    for msg_id in [*crashed, late]:
        entry = [e for e in audit(db, msg_id) if e["action"] == "REDRIVE"]
        assert [(e["by"], e["note"]) for e in entry] == [(f"key:{name}", "handler fixed")]
    assert not [e for e in audit(db, other) if e["action"] == "REDRIVE"]

    # A node drained from the console, with who and why; then back to RUN.
    seen.open("/console/nodes")
    form = seen.find("tr[data-node='beat-node'] form.node-move")
    form.find_element("css selector", "select").send_keys("drain")
    note = form.find_element("css selector", "input[name=note]")
    note.send_keys("moving hosts")
    note.send_keys(Keys.ENTER)
    seen.wait.until(lambda d: d.find_elements("css selector", ".done, .problems"))
    assert "node beat-node is HANDLES_EXISTING_MESSAGES" in seen.text(".done")
    assert "moving hosts" in seen.text("tr[data-node='beat-node']")
    found = {n.code: n for n in nodes.list_nodes(db, 60)}["beat-node"]
    assert (found.state, found.state_changed_by, found.state_note) == (
        NodeState.HANDLES_EXISTING_MESSAGES,
        f"key:{name}",
        "moving hosts",
    )
    seen.accessible()
    seen.shot("daily-nodes")
    nodes.set_state(db, "beat-node", NodeState.RUN)

    # The charts of the last hour and day count what ended.
    seen.open("/console/figures")
    hour = seen.text("#history-hour figcaption")
    assert "FAILED" in hour and "OK" in hour
    assert len(seen.all("#history-hour svg rect.failed")) >= 1
    assert seen.all("#history-day svg polyline.backlog")
    seen.shot("daily-history")


def test_the_conversation_operator_calls_from_the_console(
    stack: Stack,
    db: Engine,
    redis_client: redis.Redis,
    browser: webdriver.Chrome,
) -> None:
    with Sink() as sink:
        stack.env(**TIMINGS)
        stack.start_api()
        http = stack.http
        assert http.put("/channels/chat", json={"url": sink.url, **CHANNEL}).status_code == 200
        stack.workers({"w1": "worker-1"}, concurrency=1)
        stack.beat()
        wait_until(lambda: bridge_ready(redis_client), 60, "beat's first rebuild")

        def post(path: str, body: dict[str, Any]) -> None:
            answer = http.post(path, json=body)
            assert answer.status_code == 201, answer.text

        # r2 is answered, r1 not: s2 waits for r1 (PENDING, blocked by the request).
        post("/conversations/c1/requests", {"request_id": "r1", "origin": "chat"})
        post("/conversations/c1/requests", {"request_id": "r2", "origin": "chat"})
        post(
            "/conversations/c1/responses",
            {"request_id": "r2", "response_id": "s2", "payload": {}, "last": True},
        )
        name = "console-conversations"
        seen = console_for(browser, stack, api_key(db, "operate", "admin", name=name))
        seen.open("/console/conversations/c1")
        seen.driver.find_element("css selector", "details summary").click()  # r1's commands
        seen.accessible()

        # s2 AWAITED by hand, with a note in its row's audit.
        row = seen.find("tr.response")
        row.find_element("css selector", "details summary").click()
        seen.submit_note("form[action$='/responses/s2/awaited']", "waiting for the bot")
        assert "AWAITED: s2" in seen.text(".done")
        status = http.get("/conversation-messages", params={"response_id": "s2"}).json()
        assert status["status"] == "AWAITED"
        msg_id = int(status["msgId"])
        assert audit(db, msg_id)[-1]["note"] == "waiting for the bot"
        seen.shot("daily-conversation")

        # r1 deleted (with the request): it no longer holds s2 back, and s2 goes once due.
        seen.driver.find_element("css selector", "tr.request details summary").click()
        seen.submit_note("form[action$='/requests/r1/delete']", "user left")
        assert "request r1: deleted" in seen.text(".done")
        assert "the request is cancelled" in seen.text(".done")
