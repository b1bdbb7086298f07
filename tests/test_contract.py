"""The API's documented contract: request bodies and the error shape in the OpenAPI document,
and /docs served without internet (seen in headless Chromium)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.browser import chromium
from tests.stack import Stack
from tooling.processes import ROOT

ARTIFACTS = ROOT / "artifacts"

# Write operations whose body is a declared model, by the name the document gives it.
BODIES = {
    ("post", "/messages"): "MessageIn",
    ("post", "/messages:batch"): "MessageBatchIn",
    ("post", "/messages/responses"): "ExternalResponseIn",
    ("post", "/messages/{msg_id}/cancel"): "CommandIn",
    ("post", "/messages/{msg_id}/redrive"): "CommandIn",
    ("post", "/rooms"): "RoomIn",
    ("post", "/rooms/{room}/event-types"): "EventTypeIn",
    ("post", "/rooms/{room}/subscriptions"): "SubscriptionIn",
    ("post", "/rooms/{room}/events"): "PublishIn",
    ("post", "/conversations/{conversation_id}/requests"): "ConversationRequestIn",
    ("post", "/conversations/{conversation_id}/responses"): "ConversationResponseIn",
    ("post", "/conversations/{conversation_id}/requests/{request_id}/awaited"): (
        "ConversationOperatorIn"
    ),
    ("post", "/conversations/{conversation_id}/responses/{response_id}/awaited"): (
        "ConversationOperatorIn"
    ),
    ("put", "/conversations/{conversation_id}/responses/{response_id}/awaited-date"): (
        "AwaitedDateIn"
    ),
    ("post", "/conversations/{conversation_id}/responses/{response_id}/removal"): "RemovalIn",
    ("put", "/source-systems/{name}"): "SourceSystemIn",
    ("post", "/keys"): "KeyIn",
    ("put", "/channels/{origin}"): "ChannelIn",
    ("patch", "/rooms/{room}"): "RoomPatchIn",
    ("post", "/rooms/{room}/publishers"): "PublisherIn",
    ("patch", "/subscriptions/{subscription_id}"): "SubscriptionPatchIn",
    ("post", "/subscriptions/{subscription_id}/enable"): "EnableIn",
    ("post", "/subscriptions/{subscription_id}/replay"): "ReplayIn",
    ("post", "/signing-secrets/{kind}/{name}/rotate"): "RotateIn",
    ("post", "/subscriptions/{subscription_id}/messages/{delivery_id}/visibility"): "VisibilityIn",
    ("post", "/subscriptions/{subscription_id}/messages/{delivery_id}/ack"): "PulledAckIn",
    ("post", "/dead-letters/redrive"): "RedriveIn",
    ("post", "/schedules"): "ScheduleIn",
    ("patch", "/schedules/{name}"): "SchedulePatchIn",
    ("put", "/funnel-limits/{component_id}"): "FunnelLimitIn",
    ("post", "/tracking/done"): "TrackedDoneIn",
}


@pytest.fixture
def document(client: TestClient) -> dict[str, Any]:
    answer = client.get("/openapi.json")
    assert answer.status_code == 200
    result: dict[str, Any] = answer.json()
    return result


def test_write_operations_document_their_bodies(document: dict[str, Any]) -> None:
    found = {}
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            ref = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema", {})
                .get("$ref")
            )
            if ref:
                found[(method, path)] = ref.rsplit("/", 1)[1]
    assert found == BODIES
    schemas = document["components"]["schemas"]
    message = schemas["MessageIn"]
    assert {"service", "operation", "correlation_id", "payload"} <= set(message["properties"])
    assert message.get("additionalProperties") is False
    # Nested definitions (enums, ...) resolve inside the document.
    kind = schemas["SubscriptionIn"]["properties"]["kind"]
    assert kind["$ref"].startswith("#/components/schemas/")
    assert kind["$ref"].rsplit("/", 1)[1] in schemas


def test_every_write_operation_has_a_body_a_tag_and_an_operation_id(
    document: dict[str, Any],
) -> None:
    ids = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            if method in ("post", "put", "patch") and path != "/acks/{async_response_id}":
                assert (method, path) in BODIES, (method, path)
            assert len(op["tags"]) == 1 and op["tags"][0], (method, path)
            ids.append(op["operationId"])
    assert len(ids) == len(set(ids)) == 60
    assert "submit" in ids and "publish" in ids


def test_every_operation_documents_the_error_shape(document: dict[str, Any]) -> None:
    errors = document["components"]["schemas"]["Errors"]
    assert errors["properties"]["errors"]["type"] == "array"
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            statuses = ["400", "422", "503"]
            if path not in ("/health", "/ready"):
                statuses.append("401")
            if path not in ("/health", "/ready", "/acks/{async_response_id}"):
                statuses.append("403")
            for status in statuses:
                schema = op["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/Errors"}, (method, path, status)
            assert "HTTPValidationError" not in str(op["responses"])


def test_docs_are_served_by_orderly(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "/docs-assets/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower()
    script = client.get("/docs-assets/swagger-ui-bundle.js")
    assert script.status_code == 200 and len(script.content) > 100_000
    assert client.get("/docs-assets/swagger-ui.css").status_code == 200
    assert client.get("/redoc").status_code == 404


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with chromium(1400, 1400) as driver:
        yield driver


def test_docs_show_post_messages_with_its_body_offline(
    stack: Stack, browser: webdriver.Chrome
) -> None:
    stack.start_api()
    # Nothing but orderly itself may be fetched: a CDN asset would fail to load.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*cdn*", "*unpkg*", "https://*"]})
    wait = WebDriverWait(browser, 60)
    browser.get(f"{stack.url}/docs")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    paths = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")]
    assert "/messages" in paths
    op = next(
        e
        for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-post")
        if e.find_element(By.CSS_SELECTOR, ".opblock-summary-path").text == "/messages"
    )
    if "is-open" not in (op.get_attribute("class") or ""):
        op.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait.until(lambda d: "correlation_id" in op.text and "Request body" in op.text)
    browser.execute_script("arguments[0].scrollIntoView(true);", op)
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert resources and all(str(r).startswith(stack.url) for r in resources), resources
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "docs-post-messages.png"
    assert browser.save_screenshot(str(path))
    print(f"screenshot: {path}")
