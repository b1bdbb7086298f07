"""Delayed messages and worker deaths, with real worker processes on the real services."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import redis
from sqlalchemy import Engine

from tests.helpers import wait_until
from tooling.processes import Managed, ProcessGroup, wait_for_log

from .push_recorder import Recorder
from .test_e2e import free_port
from .test_pubsub import ROOM


def _stack(procs: ProcessGroup, recorder: Recorder, **env: str) -> httpx.Client:
    procs.env.update({"AURA_QUEUE_MANAGER_INTERVAL": "50", **env})
    port = free_port()
    procs.start_api(port, extra_env={"ORDERLY_NODE_CODE": "api-node"})
    procs.start_beat(extra_env={"ORDERLY_NODE_CODE": "beat-node"})  # the ticker
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    assert http.post("/rooms", json=ROOM).status_code == 201
    body = {"name": "push", "kind": "PUSH", "push_url": f"{recorder.base}/push"}
    assert http.post("/rooms/orders/subscriptions", json=body).status_code == 201
    return http


def _worker(procs: ProcessGroup, name: str, concurrency: int = 1) -> Managed:
    w = procs.start_worker(name, concurrency=concurrency, node_code=name)
    wait_for_log(w, "ready.", timeout=60)
    return w


def test_delay_longer_than_the_broker_visibility_timeout_is_delivered_once(
    procs: ProcessGroup, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _stack(procs, recorder, ORDERLY_BROKER_VISIBILITY_TIMEOUT="1")
    _worker(procs, "w1")
    _worker(procs, "w2")
    sent = time.monotonic()
    answer = http.post(
        "/rooms/orders/events", json={"routing_key": "later", "payload": {}, "$delay": 2500}
    )
    assert answer.status_code == 201
    wait_until(lambda: recorder.times("/push", "later") != [], timeout=15, what="delivery")
    time.sleep(2.5)  # more than twice the visibility timeout: any redelivery would show
    arrivals = recorder.times("/push", "later")
    assert len(arrivals) == 1
    assert arrivals[0] - sent >= 2.5


def test_delayed_message_survives_sigkill_of_every_worker(
    procs: ProcessGroup, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _stack(procs, recorder)
    first = _worker(procs, "w1")
    sent = time.monotonic()
    assert (
        http.post(
            "/rooms/orders/events", json={"routing_key": "later", "payload": {}, "$delay": 1500}
        ).status_code
        == 201
    )
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    time.sleep(0.5)
    _worker(procs, "w2")  # a new worker, nothing of the old one's memory
    wait_until(lambda: recorder.times("/push", "later") != [], timeout=20, what="delivery")
    time.sleep(0.5)
    arrivals = recorder.times("/push", "later")
    assert len(arrivals) == 1 and arrivals[0] - sent >= 1.5


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_killed_pool_child_is_replaced_and_work_goes_on(
    procs: ProcessGroup, db: Engine, redis_client: redis.Redis, recorder: Recorder
) -> None:
    http = _stack(procs, recorder)
    worker = _worker(procs, "w1", concurrency=2)
    wait_until(lambda: len(_children(worker.proc.pid)) == 2, timeout=20, what="two children")
    before = _children(worker.proc.pid)
    os.kill(before[0], signal.SIGKILL)
    for n in range(20):
        answer = http.post("/rooms/orders/events", json={"routing_key": "a", "payload": {"n": n}})
        assert answer.status_code == 201
    wait_until(lambda: len(recorder.times("/push")) == 20, timeout=30, what="20 deliveries")
    assert worker.alive()
    after = _children(worker.proc.pid)
    assert len(after) == 2 and before[0] not in after  # the pool replaced the dead child
