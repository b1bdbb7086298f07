"""The broker as one object on the runtime (worker/broker.py): the Celery app's by default,
any other one given; the faces send through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from orderly.api.http import create_app
from orderly.worker import celery
from orderly.worker.broker import Broker
from orderly.worker.runtime import Runtime
from orderly.worker.settings import get_settings
from tests.conftest import IN_CI
from tests.helpers import api_key, message, queued, wait_until
from tests.stub_broker import StubBroker
from tooling.servers import RabbitVhost, ServerUnavailable

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


SENDS = """
import json
from orderly.worker.celery import broker
before = broker.figures()
for msg_id in (1, 2, 3):
    broker.enqueue_processing(msg_id)
broker.enqueue_drain("c1", "token")
figures = broker.figures()
print(json.dumps({"before": dict(before.queues), "queues": dict(figures.queues),
                  "unacked": figures.unacked}))
"""


@pytest.mark.e2e
def test_on_rabbitmq_the_queues_are_durable_quorum_queues_and_their_depths_are_read() -> None:
    """ORDERLY_BROKER_URL amqp://: the sends reach RabbitMQ's durable quorum queues (as
    RabbitMQ itself lists them), and the broker's figures read the same depths; reading them
    before any queue was there created none."""
    try:
        vhost = RabbitVhost(f"orderly-test-broker-{uuid.uuid4().hex[:8]}").create()
    except ServerUnavailable as exc:
        if IN_CI:
            pytest.fail(f"RabbitMQ is not reachable: {exc}")
        pytest.skip(f"RabbitMQ is not reachable: {exc}")
    try:
        out = subprocess.run(
            [sys.executable, "-c", SENDS],
            env={**os.environ, "ORDERLY_BROKER_URL": vhost.url},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        sent = {celery.PROCESS_QUEUE: 3, celery.DELIVER_QUEUE: 1}
        expected = {**sent, celery.AGENTS_QUEUE: 0}
        want = {name: ("quorum", True, ready) for name, ready in sent.items()}
        # rabbitmqctl's counts are RabbitMQ's statistics, emitted every few seconds
        wait_until(
            lambda: {n: q for n, q in vhost.queues().items() if n in sent} == want,
            timeout=60,
            what=f"RabbitMQ to list {want}",
        )
        # The figures read before any send created nothing: no send went to the agents' queue.
        assert celery.AGENTS_QUEUE not in vhost.queues()
    finally:
        vhost.remove()
    assert figures == {"before": dict.fromkeys(expected, 0), "queues": expected, "unacked": None}
