"""The operator console in headless Chromium, against the real API, workers and beat on the
real Redis and PostgreSQL, with data a real workload left: every page loads it, filters narrow
the lists, cancel, re-drive and respond change the rows (the audit trail names the key), a
visit without a key is refused, and a payload holding ``<script>`` is shown as text.
Screenshots go to ``artifacts/console-*.png``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import redis
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select, WebDriverWait
from sqlalchemy import Engine, text

from orderly.models.keys import BridgeKeys
from tests.browser import chromium
from tests.helpers import (
    api_key,
    bridge_ready,
    message,
    received_earlier,
    row,
    set_config,
    wait_until,
)
from tests.push_recorder import Recorder
from tests.stack import Stack
from tests.test_contract import ARTIFACTS
from tests.test_conversation_e2e import CHANNEL, TIMINGS
from tooling.sink import Sink

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


class Console:
    """A browser signed in to the console with one key."""

    def __init__(self, driver: webdriver.Chrome, url: str) -> None:
        self.driver = driver
        self.url = url
        self.wait = WebDriverWait(driver, 60)

    def sign_in(self, token: str) -> None:
        self.open("/console/login")
        field = self.driver.find_element(By.ID, "key")
        field.send_keys(token)
        field.send_keys(Keys.ENTER)  # by keyboard
        self.wait.until(lambda d: "/console/messages" in d.current_url)

    def open(self, path: str) -> None:
        self.driver.get(self.url + path)
        self.wait.until(lambda d: d.execute_script("return document.readyState") == "complete")

    def find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def text(self, css: str = "main") -> str:
        return self.find(css).text

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        height = self.driver.execute_script("return document.body.scrollHeight")
        self.driver.set_window_size(1400, max(900, min(int(height) + 40, 4000)))
        assert self.driver.save_screenshot(str(ARTIFACTS / f"console-{name}.png"))

    def accessible(self) -> None:
        """Every visible form control has a label; the page has one h1 and a main landmark;
        it fetched nothing but orderly's own files and ran no injected script."""
        unlabelled = self.driver.execute_script(
            """return [...document.querySelectorAll('input, select, textarea')]
                .filter(e => e.type !== 'hidden' && e.labels.length === 0
                        && !e.getAttribute('aria-label'))
                .map(e => e.outerHTML)"""
        )
        assert unlabelled == []
        assert len(self.all("h1")) == 1 and self.all("main#content")
        resources = self.driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert all(str(r).startswith(self.url) for r in resources), resources
        assert self.driver.execute_script("return window.__pwned === undefined")

    def submit_note(self, form_css: str, note: str) -> None:
        form = self.find(form_css)
        field = form.find_element(By.NAME, "note")
        field.send_keys(note)
        field.send_keys(Keys.ENTER)
        # the answer's page replaces this one (whose own .done may be a previous command's)
        self.wait.until(staleness_of(form))
        self.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1400, 1000) as driver:
        driver.execute_cdp_cmd("Network.enable", {})
        yield driver


def console_for(driver: webdriver.Chrome, stack: Stack, token: str) -> Console:
    # No network beyond the API: a CDN asset would fail (and Console.accessible checks that
    # every resource came from the API).
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["https://*"]})
    seen = Console(driver, stack.url)
    seen.sign_in(token)
    return seen


def audit(db: Engine, msg_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = row(db, msg_id).audit
    return found


# --- messages ---------------------------------------------------------------------------------


@pytest.fixture
def workload(stack: Stack, db: Engine) -> Stack:
    set_config(db, asynch__countPartlyFailsBeforeFailed="0")
    stack.start_api(handler_modules="tooling.handlers")
    stack.worker()
    stack.beat()
    return stack


def test_messages_list_filter_page_cancel_redrive_respond(
    workload: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack = workload
    oks = [stack.submit(message(n, source_system="crm")) for n in range(1, 6)]
    failed = stack.submit(
        message(6, source_system="billing", payload=json.dumps({"fail_times": 9}))
    )
    hostile = stack.submit(
        message(7, source_system="billing", payload=json.dumps({"note": HOSTILE}))
    )
    waits = [
        stack.submit(
            message(
                n,
                operation="wait",
                source_system="shop",
                payload=json.dumps({"correlation_id": f"answer-{n}", "timeout_s": 3600}),
            )
        )
        for n in (8, 9)
    ]
    for msg_id in [*oks, hostile]:
        stack.wait_state(msg_id, "OK", timeout=60)
    stack.wait_state(failed, "FAILED", timeout=60)
    for msg_id in waits:
        stack.wait_state(msg_id, "WAITING_FOR_RES", timeout=60)
    name = "console-admin"
    token = api_key(db, "operate", "admin", name=name)
    seen = console_for(browser, stack, token)

    # The list: every message, newest first, with the counts by state.
    rows = [int(r.get_attribute("data-msg-id") or 0) for r in seen.all("#messages tbody tr")]
    assert sorted(rows) == sorted([*oks, failed, hostile, *waits])
    counts = {e.get_attribute("data-state"): int(e.text) for e in seen.all("#counts .n")}
    assert (counts["OK"], counts["FAILED"], counts["WAITING_FOR_RES"]) == (6, 1, 2)
    seen.accessible()
    seen.shot("messages")

    # A filter typed and sent by keyboard narrows the list (and the counts).
    field = seen.find("#f-source")
    field.send_keys("billing")
    field.send_keys(Keys.ENTER)
    seen.wait.until(lambda d: "source_system=billing" in d.current_url)
    rows = [int(r.get_attribute("data-msg-id") or 0) for r in seen.all("#messages tbody tr")]
    assert sorted(rows) == sorted([failed, hostile])
    Select(seen.find("#f-state")).select_by_value("FAILED")
    seen.find("form.filters button[type=submit]").click()
    seen.wait.until(lambda d: "state=FAILED" in d.current_url)
    rows = [int(r.get_attribute("data-msg-id") or 0) for r in seen.all("#messages tbody tr")]
    assert rows == [failed]
    seen.shot("messages-filtered")

    # A payload holding markup is shown as text, and ran nothing.
    seen.open(f"/console/messages/{hostile}")
    assert "<script>window.__pwned = 1</script><img src=x onerror=" in seen.text("#payload")
    assert seen.all("#payload script") == [] and seen.all("#payload img") == []
    seen.accessible()
    seen.shot("message-escaped")

    # Cancel, with a note: the row is CANCEL and the audit trail names the key.
    seen.open(f"/console/messages/{waits[0]}")
    seen.shot("message-waiting")
    seen.submit_note("form[action$='/cancel']", "customer withdrew")
    assert "cancelled" in seen.text(".done")
    assert row(db, waits[0]).state == "CANCEL"
    entry = audit(db, waits[0])[-1]
    assert (entry["action"], entry["by"], entry["note"]) == (
        "CANCEL",
        f"key:{name}",
        "customer withdrew",
    )
    assert f"key:{name}" in seen.text("#audit")

    # Re-drive the cancelled one: IN_QUEUE again, and waiting once more.
    seen.submit_note("form[action$='/redrive']", "customer came back")
    assert row(db, waits[0]).state in ("IN_QUEUE", "PROCESSING", "WAITING_FOR_RES")
    assert [a["action"] for a in audit(db, waits[0])][-2:] == ["CANCEL", "REDRIVE"]
    assert audit(db, waits[0])[-1]["by"] == f"key:{name}"
    stack.wait_state(waits[0], "WAITING_FOR_RES", timeout=60)

    # Re-drive the failed one.
    seen.open(f"/console/messages/{failed}")
    seen.submit_note("form[action$='/redrive']", "fixed the billing system")
    assert audit(db, failed)[-1]["by"] == f"key:{name}"
    assert audit(db, failed)[-1]["action"] == "REDRIVE"

    # Respond by hand to the other waiting one: it goes on and ends OK with the response.
    seen.open(f"/console/messages/{waits[1]}")
    seen.find("#respond-payload").send_keys('{"approved": true}')
    seen.find("#respond-note").send_keys("answered by phone")
    seen.find("form[action$='/respond'] button").click()
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))
    assert "answered" in seen.text(".done")
    stack.wait_state(waits[1], "OK", timeout=60)
    entry = audit(db, waits[1])[-1]
    assert (entry["action"], entry["by"], entry["note"]) == (
        "RESPOND",
        f"key:{name}",
        "answered by phone",
    )
    assert json.loads(row(db, waits[1]).custom_data or "") == {"approved": True}
    seen.open(f"/console/messages/{waits[1]}")
    assert "answered by phone" in seen.text("#audit")
    seen.shot("message-answered")

    # A note is required: refused, naming it, and nothing written.
    before = audit(db, waits[0])
    answer = httpx.post(
        f"{stack.url}/console/messages/{waits[0]}/cancel",
        data={"note": "  "},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 422 and "note" in answer.text
    assert audit(db, waits[0]) == before


def test_a_read_only_key_sees_pages_and_changes_nothing(
    workload: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack = workload
    waiting = stack.submit(
        message(1, operation="wait", payload=json.dumps({"correlation_id": "later"}))
    )
    stack.wait_state(waiting, "WAITING_FOR_RES", timeout=60)
    token = api_key(db, "operate", name="watcher")
    seen = console_for(browser, stack, token)
    seen.open(f"/console/messages/{waiting}")
    assert seen.all("form[action$='/cancel']") == []
    assert "admin" in seen.text(".hint")
    # HttpOnly: the page's own script cannot read the session id.
    assert "orderly_console" not in browser.execute_script("return document.cookie")
    # Posting the form anyway is refused and changes nothing.
    answer = httpx.post(
        f"{stack.url}/console/messages/{waiting}/cancel",
        data={"note": "sneaky"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 403 and "admin" in answer.text
    assert row(db, waiting).state == "WAITING_FOR_RES" and audit(db, waiting) == []
    seen.open("/console/keys")
    assert "lacks the scope 'admin'" in seen.text()


def test_a_visit_without_a_valid_key_is_refused(stack: Stack, db: Engine) -> None:
    stack.start_api()
    waiting_cancel = "/console/messages/1/cancel"
    pages = [
        "/console",
        "/console/messages",
        "/console/messages/1",
        "/console/conversations",
        "/console/conversations/c1",
        "/console/rooms",
        "/console/rooms/orders",
        "/console/nodes",
        "/console/keys",
        "/console/figures",
        "/console/figures.json",
    ]
    metrics_only = api_key(db, "metrics", name="scraper")
    with httpx.Client(base_url=stack.url) as http:
        for path in pages:
            for headers in (
                {},
                {"Cookie": "orderly_console=orderly_nothing_here"},
                {"Authorization": "Bearer not-a-key"},
            ):
                answer = http.get(path, headers=headers)
                assert answer.status_code == 401, (path, headers, answer.status_code)
                assert 'name="key"' in answer.text  # the sign-in form, and nothing else
            answer = http.get(path, headers={"Authorization": f"Bearer {metrics_only}"})
            assert answer.status_code == 403 and "operate" in answer.text, path
        assert http.post(waiting_cancel, data={"note": "x"}).status_code == 401
        refused = http.post("/console/login", data={"key": metrics_only})
        assert refused.status_code == 403 and "operate" in refused.text
        assert "set-cookie" not in refused.headers
        # The key is no cookie: the cookie is a session's id, given by signing in.
        admin = api_key(db, "operate", "admin", name="boss")
        http.cookies.set("orderly_console", admin, path="/console")
        assert http.get("/console/messages").status_code == 401
        http.cookies.clear()
        signed_in = http.post("/console/login", data={"key": admin})
        assert signed_in.status_code == 303 and http.cookies["orderly_console"] != admin
        # The session's cookie alone does not make a change: the form token must come with it.
        for token in ("guessed", "é"):
            forged = http.post("/console/keys/boss/revoke", data={"form_token": token})
            assert forged.status_code == 403 and "form_token" in forged.text
        # A form posted from another site is refused, signing in included (it would sign
        # the visitor in with someone else's key).
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            answer = http.post("/console/login", data={"key": admin}, headers=headers)
            assert answer.status_code == 403 and "origin" in answer.text, headers
            assert "set-cookie" not in answer.headers
            answer = http.post("/console/logout", data={"x": "1"}, headers=headers)
            assert answer.status_code == 403, headers
        # A link cannot put words in the console's mouth: an unsigned "done" shows nothing.
        shown = http.get("/console/messages", params={"done": "all keys rotated", "sig": "0"})
        assert shown.status_code == 200 and "all keys rotated" not in shown.text
        with db.connect() as conn:
            assert (
                conn.execute(
                    text("SELECT revoked_at FROM api_key WHERE name = 'boss'")
                ).scalar_one()
                is None
            )


# --- conversations ----------------------------------------------------------------------------


@pytest.fixture
def sink() -> Iterator[Sink]:
    with Sink() as s:
        yield s


def test_conversations_open_blocked_late_and_in_order(
    stack: Stack, db: Engine, redis_client: redis.Redis, sink: Sink, browser: webdriver.Chrome
) -> None:
    # The ACK a client never sends blocks for the whole test: SENT lives far longer.
    # Nor does the blocked response become AWAITED (MAX_RETRIES * INTERVAL) before it is shown.
    stack.env(
        **{
            **TIMINGS,
            "AURA_QUEUE_MANAGER_SENT_MESSAGE_TTL": "600000",
            "AURA_QUEUE_MANAGER_MAX_RETRIES": "100000",
        }
    )
    stack.start_api()
    http = stack.http
    assert http.put("/channels/chat", json={"url": sink.url, **CHANNEL}).status_code == 200
    sink.configure(
        rules=[{"match": {"conversation_id": "c-ack"}, "status": 202, "never_ack": True}]
    )
    stack.workers({"w1": "worker-1"}, concurrency=1)
    stack.beat()
    wait_until(lambda: bridge_ready(redis_client), 60, "beat's first rebuild")

    def request(cid: str, rid: str, **extra: Any) -> None:
        body = {"request_id": rid, "origin": "chat", **extra}
        answer = http.post(f"/conversations/{cid}/requests", json=body)
        assert answer.status_code == 201, answer.text

    def respond(cid: str, rid: str, sid: str, *, last: bool = True) -> None:
        body = {"request_id": rid, "response_id": sid, "payload": {"text": sid}, "last": last}
        answer = http.post(f"/conversations/{cid}/responses", json=body)
        assert answer.status_code == 201, answer.text

    # c-ok: two responses delivered in order. c-wait: r2 answered, r1 not yet (REQUEST).
    # c-ack: delivered with a 202 and never ACKed (ACK). c-late: r1 expired, answered late.
    request("c-ok", "ok-r1")
    respond("c-ok", "ok-r1", "ok-s1a", last=False)
    respond("c-ok", "ok-r1", "ok-s1b")
    request("c-wait", "wait-r1")
    request("c-wait", "wait-r2")
    respond("c-wait", "wait-r2", "wait-s2")
    request("c-ack", "ack-r1")
    respond("c-ack", "ack-r1", "ack-s1")
    ttl_ms = int(TIMINGS["AURA_QUEUE_MANAGER_MESSAGE_TTL"])
    old = datetime.now(UTC) - timedelta(milliseconds=ttl_ms + 5000)
    request("c-late", "late-r1", timestamp=old.isoformat())
    received_earlier(db, "late-r1", ttl_ms + 5000)  # its life ends now, in both stores
    redis_client.delete(BridgeKeys().request("c-late", "late-r1"))
    request("c-late", "late-r2")
    respond("c-late", "late-r2", "late-s2")
    respond("c-late", "late-r1", "late-s1")
    wait_until(
        lambda: (
            {"ok-s1a", "ok-s1b", "ack-s1", "late-s1", "late-s2"}
            <= {a["response_id"] for a in sink.arrivals()}
        ),
        60,
        "the deliverable responses delivered",
    )
    name = "console-admin"
    seen = console_for(browser, stack, api_key(db, "operate", "admin", name=name))
    seen.open("/console/conversations")

    def listed() -> dict[str, str]:
        return {
            str(r.get_attribute("data-conversation")): r.find_elements(By.TAG_NAME, "td")[1].text
            for r in seen.all("#conversations tbody tr[data-conversation]")
        }

    def reloaded() -> dict[str, str]:
        seen.open("/console/conversations")
        return listed()

    wait_until(
        lambda: reloaded() == {"c-ack": "ACK", "c-wait": "REQUEST"},
        60,
        "the open conversations listed with why they wait",
    )
    assert "late-s1" in seen.text("#late") and "c-late" in seen.text("#late")
    seen.accessible()
    seen.shot("conversations")
    Select(seen.find("#c-reason")).select_by_value("ack")
    seen.find("#by-reason button").click()
    seen.wait.until(lambda d: "reason=ack" in d.current_url)
    assert listed() == {"c-ack": "ACK"}

    seen.open("/console/conversations/c-late")
    turns = [
        r.find_element(By.CSS_SELECTOR, "th, td:nth-child(2)").text
        for r in seen.all("#turns tbody tr")
    ]
    assert turns == ["request late-r1", "response late-s1 (last)", "request late-r2",
                     "response late-s2 (last)"]  # fmt: skip
    late = seen.all("#turns tr.late")
    assert len(late) == 1 and "late-s1" in late[0].text and "LATE" in late[0].text
    seen.accessible()
    seen.shot("conversation-late")

    seen.open("/console/conversations/c-ok")
    assert [e.text for e in seen.all("#turns tr.response td:nth-child(2)")] == [
        "response ok-s1a",
        "response ok-s1b (last)",
    ]
    assert all("OK" in e.text for e in seen.all("#turns tr.response td:nth-child(3)"))
    seen.open("/console/conversations/c-wait")
    assert "PENDING" in seen.text("#turns tr.response")
    # The jump form finds a conversation by its id.
    seen.open("/console/conversations")
    field = seen.find("#c-id")
    field.send_keys("c-ack")
    field.send_keys(Keys.ENTER)
    seen.wait.until(lambda d: d.current_url.endswith("/console/conversations/c-ack"))
    assert "SENT" in seen.text("#turns tr.response")
    seen.open("/console/conversations/nobody-here")
    assert "no conversation" in seen.text()


# --- rooms, subscriptions, dead letters -------------------------------------------------------


def test_rooms_deliveries_backlog_and_dead_letter_redrive(
    stack: Stack, db: Engine, recorder: Recorder, browser: webdriver.Chrome
) -> None:
    stack.env(AURA_QUEUE_MANAGER_INTERVAL="20")  # the scheduler's turn
    stack.start_api()
    stack.worker()
    stack.beat()
    http = stack.http
    assert http.post("/rooms", json={"name": "orders", "delivery_delay_ms": 10}).status_code == 201
    assert http.post("/rooms", json={"name": "quiet"}).status_code == 201
    subscriptions: dict[str, dict[str, Any]] = {
        "to-recorder": {"kind": "PUSH", "push_url": f"{recorder.base}/ok"},
        "never": {"kind": "PUSH", "push_url": f"{recorder.base}/never", "delivery_attempts": 0},
        "puller": {"kind": "PULL"},
    }
    ids = {}
    for sub_name, spec in subscriptions.items():
        answer = http.post("/rooms/orders/subscriptions", json={"name": sub_name, **spec})
        assert answer.status_code == 201, answer.text
        ids[sub_name] = answer.json()["subscription_id"]
    recorder.fail[("/never", "bad")] = 1  # its one attempt fails: a dead letter
    for key in ("a", "b", "bad"):
        payload = {"key": key, "note": HOSTILE}
        answer = http.post("/rooms/orders/events", json={"routing_key": key, "payload": payload})
        assert answer.status_code == 201, answer.text

    def states(sub: str) -> dict[str, int]:
        with db.connect() as conn:
            rows = conn.execute(
                text("SELECT state, count(*) FROM delivery WHERE subscription_id = :s GROUP BY 1"),
                {"s": ids[sub]},
            )
            return {r[0]: int(r[1]) for r in rows}

    wait_until(
        lambda: (
            states("to-recorder") == {"DELIVERED": 3}
            and states("never") == {"DELIVERED": 2, "DEAD": 1}
        ),
        60,
        "pushes delivered and the failing one dead-lettered",
    )
    seen = console_for(browser, stack, api_key(db, "operate", "admin", name="console-admin"))
    seen.open("/console/rooms")
    assert {r.get_attribute("data-room") for r in seen.all("#rooms tbody tr")} == {
        "orders",
        "quiet",
    }
    assert seen.find("#rooms tr[data-room='orders'] td:last-child").text == "1"
    seen.accessible()
    seen.shot("rooms")
    seen.open("/console/rooms/orders")

    def count(sub: str, state: str) -> str:
        return seen.find(f"tr[data-subscription='{ids[sub]}'] td[data-state='{state}']").text

    assert (count("to-recorder", "DELIVERED"), count("never", "DEAD")) == ("3", "1")
    assert seen.find(f"tr[data-subscription='{ids['puller']}'] td.backlog").text == "3"
    dead = seen.all("#dead-letters tbody tr[data-delivery]")
    assert len(dead) == 1 and "bad" in dead[0].text
    seen.accessible()
    seen.shot("room")
    # Tick it by keyboard and re-drive: attempts start over, and this time it is delivered.
    seen.find("#dead-letters input[type=checkbox]").send_keys(Keys.SPACE)
    seen.find("#dead-letters button[type=submit]").click()
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))
    assert "1 dead letters re-driven" in seen.text(".done")
    wait_until(lambda: states("never") == {"DELIVERED": 3}, 60, "the re-driven one delivered")
    seen.open("/console/rooms/orders")
    assert count("never", "DELIVERED") == "3" and count("never", "DEAD") == "0"


# --- nodes, configuration, keys, figures -----------------------------------------------------


def test_nodes_workers_and_configuration_edited_with_validation(
    stack: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack.start_api()
    stack.worker()
    seen = console_for(browser, stack, api_key(db, "operate", "admin", name="console-admin"))
    seen.open("/console/nodes")
    codes = {r.get_attribute("data-node") for r in seen.all("#nodes tbody tr")}
    assert {"api-node", "worker-node"} <= codes

    def worker_listed() -> bool:
        seen.open("/console/nodes")
        return "worker-node" in seen.text("#workers")

    wait_until(
        worker_listed,
        60,
        "the worker listed",
    )
    seen.accessible()
    seen.shot("nodes")
    code = "asynch.countPartlyFailsBeforeFailed"

    def current() -> str | None:
        with db.connect() as conn:
            value: str | None = conn.execute(
                text("SELECT current_value FROM configuration WHERE code = :c"), {"c": code}
            ).scalar_one()
            return value

    before = current()
    field = seen.find(f"tr[data-code='{code}'] input[name=value]")
    field.clear()
    field.send_keys("many")
    field.send_keys(Keys.ENTER)
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))
    assert code in seen.text(".problems") and current() == before
    seen.open("/console/nodes")
    field = seen.find(f"tr[data-code='{code}'] input[name=value]")
    field.clear()
    field.send_keys("7")
    field.send_keys(Keys.ENTER)
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))
    assert f"{code} set to 7" in seen.text(".done") and current() == "7"


def test_keys_created_shown_once_and_revoked(
    stack: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack.start_api()
    seen = console_for(browser, stack, api_key(db, "operate", "admin", name="console-admin"))
    seen.open("/console/keys")
    seen.find("#k-name").send_keys("reporter")
    for scope in ("metrics", "consume"):
        seen.find(f"input[name=scope][value='{scope}']").click()
    seen.find("#k-rooms").send_keys("orders, news")
    seen.find("form[action='/console/keys'] button").click()
    seen.wait.until(lambda d: d.find_elements(By.ID, "token"))
    token = seen.find("#token").get_attribute("value") or ""
    assert token.startswith("orderly_")
    seen.shot("key-created")
    # The token works against the API, with exactly those scopes.
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/messages").status_code == 403
    seen.open("/console/keys")
    assert token not in browser.page_source
    listed = seen.find("tr[data-key='reporter']").text
    assert "publish:news" in listed and "publish:orders" in listed
    seen.accessible()
    seen.shot("keys")
    seen.find("tr[data-key='reporter'] button").click()
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".done, .problems"))
    assert "key reporter revoked" in seen.text(".done")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {token}"}) as http:
        assert http.get("/metrics").status_code == 401
    # A bad name is refused, naming it, and no key is made.
    seen.find("#k-name").send_keys("no spaces allowed")
    seen.find("input[name=scope][value='metrics']").click()
    seen.find("form[action='/console/keys'] button").click()
    seen.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".problems"))
    assert "name" in seen.text(".problems")
    with db.connect() as conn:
        names = {r[0] for r in conn.execute(text("SELECT name FROM api_key"))}
    assert "reporter" in names and not any(" " in n for n in names)


def test_live_figures_match_metrics_and_refresh_without_a_reload(
    workload: Stack, db: Engine, browser: webdriver.Chrome
) -> None:
    stack = workload
    first = [stack.submit(message(n)) for n in range(1, 4)]
    for msg_id in first:
        stack.wait_state(msg_id, "OK", timeout=60)
    seen = console_for(browser, stack, api_key(db, "operate", name="watcher"))
    seen.open("/console/figures")

    def ok_shown() -> float | None:
        # Read in one script: the table is redrawn under the test's feet.
        found: float | None = browser.execute_script(
            """for (const r of document.querySelectorAll('#figures tbody tr')) {
                 const c = [...r.cells].map(x => x.textContent);
                 if (c[0] === 'orderly_messages' && c[1].includes('state=OK')) return Number(c[2]);
               }
               return null;"""
        )
        return found

    assert ok_shown() == 3.0
    metrics = stack.http.get("/metrics").text
    assert 'orderly_messages{state="OK"} 3.0' in metrics
    marker = browser.execute_script("window.__same_page = 1; return 1")
    assert marker == 1
    more = [stack.submit(message(n)) for n in range(4, 6)]
    for msg_id in more:
        stack.wait_state(msg_id, "OK", timeout=60)
    wait_until(lambda: ok_shown() == 5.0, 60, "the figures refreshed")
    assert browser.execute_script("return window.__same_page") == 1  # no reload
    labels: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('#charts figure svg')]"
        ".map(e => e.getAttribute('aria-label'))"
    )
    assert len(labels) >= 8
    wait_until(
        lambda: any(
            label.startswith("Messages OK: 5 now")
            for label in browser.execute_script(
                "return [...document.querySelectorAll('#charts figure svg')]"
                ".map(e => e.getAttribute('aria-label'))"
            )
        ),
        30,
        "the chart redrawn",
    )
    seen.accessible()
    seen.shot("figures")
