"""End to end: the real API, worker processes and beat on the real Redis and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from sqlalchemy import Engine, text

from orderly.models import MessageState, NodeState
from orderly.worker import nodes
from orderly.worker.runtime import get_runtime
from tests.helpers import count_messages, message, row, set_config
from tests.stack import Stack, pool_children
from tooling.processes import wait_for_log


@pytest.fixture
def stack(stack: Stack, db: Engine) -> Stack:
    # Fast pool and repair cycles for the test; read by beat when it starts.
    set_config(
        db,
        asynch__partlyFailedIntervalSec="0",
        asynch__partlyFailedRepeatTimeSec="1",
        asynch__repairRepeatTimeSec="3",
    )
    stack.start_api(handler_modules="tooling.handlers,tests.handlers_extra")
    return stack


def script(**spec: object) -> str:
    return json.dumps(spec)


def test_partly_failed_comes_back_through_the_pool_and_ends_ok(stack: Stack) -> None:
    stack.worker()
    stack.beat()
    msg_id = stack.submit(message(1, payload=script(fail_times=2, code="E_FLAKY")))
    stack.wait_state(msg_id, "OK")
    stored = row(stack.db, msg_id)
    assert stored.failed_count == 2
    assert stored.custom_data == "0;1;2;"  # three tries, in order
    assert stored.failed_error_code == "E_FLAKY"  # the last error is kept for the record


def test_a_message_that_keeps_failing_ends_failed_at_the_limit(stack: Stack) -> None:
    set_config(stack.db, asynch__countPartlyFailsBeforeFailed="2")
    stack.worker()
    stack.beat()
    msg_id = stack.submit(message(1, payload=script(fail_times=99)))
    stack.wait_state(msg_id, "FAILED")
    time.sleep(2)  # the pool must not take a FAILED message up again
    stored = row(stack.db, msg_id)
    assert stored.state is MessageState.FAILED
    assert stored.failed_count == 3
    assert stored.custom_data == "0;1;2;"


def test_a_worker_child_killed_mid_processing_does_not_lose_the_message(stack: Stack) -> None:
    worker = stack.worker(concurrency=1)
    stack.beat()
    msg_id = stack.submit(message(1, payload=script(sleep=3)))
    stack.wait_state(msg_id, "PROCESSING")
    (child,) = pool_children(worker)
    os.kill(child, signal.SIGKILL)
    stack.wait_state(msg_id, "OK", timeout=60)
    assert worker.alive()
    assert row(stack.db, msg_id).processing_pid is None


def test_a_whole_worker_killed_is_replaced_and_its_message_released_at_once(
    stack: Stack,
) -> None:
    first = stack.worker("w1", concurrency=1)
    stack.beat()
    msg_id = stack.submit(message(1, payload=script(sleep=3)))
    stack.wait_state(msg_id, "PROCESSING")
    stack.procs.stop(first, sig=signal.SIGKILL)
    stack.worker("w2", concurrency=1, node="worker-node-2")
    stack.wait_state(msg_id, "OK", timeout=60)
    stored = row(stack.db, msg_id)
    # released by beat's orphan job (not after repairRepeatTimeSec); a death, not a failure
    assert (stored.lost_count, stored.failed_count) == (1, 0)
    assert stored.custom_data == "0;"  # the killed try recorded nothing


def test_a_poison_message_is_quarantined_while_the_others_finish(stack: Stack) -> None:
    # Submitted before any worker runs: the first claim takes them all, the poison first.
    poison = stack.submit(message(0, operation="poison"))
    others = [stack.submit(message(n, payload=script(sleep=0.05))) for n in range(1, 21)]
    worker = stack.worker(concurrency=2)
    stack.beat()
    stack.wait_state(poison, "FAILED", timeout=90)
    for msg_id in others:
        stack.wait_state(msg_id, "OK", timeout=90)
    stored = row(stack.db, poison)
    assert stored.failed_error_code == "E_WORKER_LOST"
    assert stored.lost_count == get_runtime().settings.worker_lost_limit == 3
    # The deaths of claims of several counted against none of their messages: the others
    # were claimed alone once, and only the poison's own deaths count.
    assert {row(stack.db, msg_id).lost_count for msg_id in others} == {0}
    # (That is what happened: the poison's first claim took others with it, and isolated them.)
    assert stored.isolate and any(row(stack.db, msg_id).isolate for msg_id in others)
    assert worker.alive()  # the pool replaced its killed children and went on


def test_duplicate_intake_is_processed_once(stack: Stack) -> None:
    stack.worker()
    first = stack.http.post("/messages", json=message(1))
    again = stack.http.post("/messages", json=message(1))
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["msg_id"] == first.json()["msg_id"]
    stack.wait_state(first.json()["msg_id"], "OK")
    assert count_messages(stack.db) == 1
    assert row(stack.db, first.json()["msg_id"]).custom_data == "0;"


def test_drained_node_refuses_intake_while_workers_finish_existing_work(stack: Stack) -> None:
    ids = [stack.submit(message(n, payload=script(sleep=0.05))) for n in range(20)]
    nodes.set_state(stack.db, "api-node", NodeState.HANDLES_EXISTING_MESSAGES)
    refused = stack.http.post("/messages", json=message(99))
    assert refused.status_code == 503
    assert "HANDLES_EXISTING_MESSAGES" in refused.json()["errors"][0]["problem"]
    stack.worker()
    for msg_id in ids:
        stack.wait_state(msg_id, "OK")
    assert count_messages(stack.db) == 20


def test_stopped_worker_node_processes_nothing_until_it_runs_again(stack: Stack) -> None:
    worker = stack.worker(node="worker-node")
    nodes.set_state(stack.db, "worker-node", NodeState.STOPPED)
    wait_for_log(worker, "no longer consuming", timeout=20)
    ids = [stack.submit(message(n)) for n in range(5)]
    time.sleep(2)
    assert {stack.state(i) for i in ids} == {"NEW"}
    assert worker.alive()
    nodes.set_state(stack.db, "worker-node", NodeState.RUN)
    for msg_id in ids:
        stack.wait_state(msg_id, "OK")


def test_a_handler_missing_in_the_worker_fails_the_message_and_the_worker_goes_on(
    stack: Stack,
) -> None:
    worker = stack.worker()  # ORDERLY_HANDLER_MODULES=tooling.handlers only
    missing = stack.submit(message(1, service="extra", operation="onlyInApi"))
    stack.wait_state(missing, "FAILED")
    stored = row(stack.db, missing)
    assert stored.failed_error_code == "E_NO_HANDLER"
    assert "extra.onlyInApi" in (stored.failed_desc or "")
    fine = stack.submit(message(2))
    stack.wait_state(fine, "OK")
    assert worker.alive()


def test_the_processing_record_names_node_and_times(stack: Stack) -> None:
    stack.worker(node="worker-node")
    msg_id = stack.submit(message(1))
    stack.wait_state(msg_id, "OK")
    with stack.db.connect() as conn:
        got = conn.execute(
            text(
                "SELECT n.code, m.receive_timestamp <= m.last_process_timestamp AS ordered "
                "FROM message m JOIN node n USING (node_id) WHERE msg_id=:i"
            ),
            {"i": msg_id},
        ).one()
    assert got.code == "worker-node" and got.ordered
