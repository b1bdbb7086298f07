"""The broker as one object on the runtime (worker/broker.py): the Celery app's by default,
any other one given; the faces send through it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from orderly.api.http import create_app
from orderly.worker import celery
from orderly.worker.broker import Broker
from orderly.worker.runtime import Runtime
from orderly.worker.settings import get_settings
from tests.helpers import api_key, message, queued
from tests.stub_broker import StubBroker

CHANNEL = {"url": "http://127.0.0.1:9/deliver", "delivery_delay_ms": 10, "attempts": 2}


def test_a_runtime_sends_through_the_celery_apps_broker_unless_given_another() -> None:
    runtime = Runtime(get_settings())
    assert runtime.broker is celery.broker
    assert isinstance(runtime.broker, Broker)
    assert runtime.broker.queues == celery.QUEUES
    # One broker per process, whichever runtime asks; unless a runtime is given its own.
    given = Runtime(get_settings())
    stub = StubBroker()
    given.use_broker(stub)
    assert given.broker is stub and isinstance(stub, Broker)
    assert Runtime(get_settings()).broker is celery.broker


def test_the_api_sends_through_the_broker_given_to_its_factory(
    db: Engine, redis_client: redis.Redis
) -> None:
    stub = StubBroker()
    with TestClient(create_app(broker=stub)) as client:
        client.headers["Authorization"] = f"Bearer {api_key(db)}"
        assert client.put("/channels/chat", json=CHANNEL).status_code == 200
        request = {"request_id": "r1", "origin": "chat"}
        assert client.post("/conversations/c1/requests", json=request).status_code == 201
        response = {"request_id": "r1", "response_id": "s1", "payload": {"t": 1}, "last": True}
        assert client.post("/conversations/c1/responses", json=response).status_code == 201
        assert client.post("/messages", json=message(1)).status_code == 201
        stub.reachable = False
        ready = client.get("/ready")
    assert [conversation for conversation, _ in stub.drains] == ["c1"]
    assert stub.due == [True]
    assert ready.status_code == 503 and "broker" in ready.text
    # Nothing reached the Celery app's queues.
    assert [queued(queue) for queue in celery.QUEUES] == [0, 0, 0]


@pytest.mark.e2e
def test_the_command_line_and_the_api_import_no_celery() -> None:
    """Importing Celery and building its app costs about half a second: the ``orderly``
    command imports it only when it sends, through the runtime's broker."""
    probe = (
        "import sys, orderly.api.cli, orderly.api.http\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'celery'"
        " or m == 'orderly.worker.celery'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
