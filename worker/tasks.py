"""Celery tasks: thin, they take ids and call the mechanisms."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery.exceptions import Reject

from orderly.models import NodeState
from orderly.worker import pubsub
from orderly.worker.celery import (
    QUEUES,
    app,
    enqueue_drain,
    enqueue_processing,
    send_process_due,
    send_process_helper,
)
from orderly.worker.core import logs
from orderly.worker.messages import batches, confirmations
from orderly.worker.messages.processing import Outcome
from orderly.worker.runtime import get_runtime

log = logging.getLogger("orderly.tasks")


def _give_back(task: Any) -> NoReturn:
    """This node processes nothing: stop consuming and give the task back to its queue, for
    a worker of a node in RUN (or this one, once it runs again)."""
    log.warning("node is STOPPED: task %s %s given back", task.name, task.request.id)
    for queue in QUEUES:
        app.control.cancel_consumer(queue, destination=[task.request.hostname])
    time.sleep(0.5)
    raise Reject("node stopped", requeue=True)


def refuse_if_stopped(task: Any) -> None:
    """A delivery or agent task that reaches a STOPPED node anyway (taken before its workers
    stopped consuming) goes back; its arguments (a drain's lease token, a confirmation's claim)
    stay valid for the worker that takes it next. The state is the process's view, read at
    most once a second (``Runtime.node_view``)."""
    if get_runtime().node_view.follow() is NodeState.STOPPED:
        _give_back(task)


@app.task(name="orderly.process.message", bind=True)
def process_message(self: Any, msg_id: int) -> str:
    # The claim itself refuses a STOPPED node (in its WHERE): no extra query here.
    with logs.bound(msg_id=msg_id):
        runtime = get_runtime()
        size = batches.claim_size(runtime.processor, runtime.settings.claim_batch)
        result = batches.process_message(runtime.processor, msg_id, enqueue_processing, size)
    if result.outcome is Outcome.NODE_STOPPED:
        _give_back(self)
    if result.outcome in (Outcome.NOT_CLAIMABLE, Outcome.MISSING, Outcome.LOST_CLAIM):
        log.info("message %s not processed: %s %s", msg_id, result.outcome, result.detail)
    return result.outcome.value


@app.task(name="orderly.process.due", bind=True)
def process_due(self: Any, owner: bool = True) -> int:
    """Claim and process due messages while there are any (woken by intake, worker/messages/wake.py;
    or, ``owner`` False, a helper a full claim sent)."""
    refuse_if_stopped(self)
    runtime = get_runtime()
    run = batches.run_woken(
        runtime.processor,
        runtime.settings.claim_batch,
        enqueue_processing,
        waker=runtime.wake,
        owner=owner,
        send_owner=send_process_due,
        send_helper=send_process_helper,
    )
    return len(run.results)


@app.task(name="orderly.deliver.conversation", bind=True)
def deliver_conversation(self: Any, conversation_id: str, token: str) -> str:
    """Deliver a conversation's responses in order while holding its lease (``token``)."""
    refuse_if_stopped(self)
    runtime = get_runtime()
    # Tracked by the conversation (the xid is meta.id); the lease token is no part of it.
    with (
        logs.bound(conversation_id=conversation_id),
        runtime.tracker.tracking({"meta": {"id": f"conversation:{conversation_id}"}}, "drain"),
    ):
        report = runtime.conversations.drain(conversation_id, token, runtime.sender)
    if report.end == "YIELD":
        # Fair to other conversations: the rest goes on in a new task, the lease kept.
        enqueue_drain(conversation_id, token)
    elif report.end == "LOST":
        log.info("conversation %s is held by another drain", conversation_id)
    return report.end


@app.task(name="orderly.deliver.events", bind=True)
def deliver_events(self: Any, delivery_ids: list[int]) -> list[str]:
    """Events to their subscriptions: push, or the consumer chosen by routing key."""
    refuse_if_stopped(self)
    runtime = get_runtime()
    runtime.registry  # noqa: B018 - imports the handler modules, which register consumers
    secret = runtime.settings.token_secret
    # Tracked by the batch itself (no intrinsic id: the xid is its SHA1).
    with runtime.tracker.tracking({"deliveries": delivery_ids}, "events"):
        return pubsub.deliver_batch(
            runtime.engine,
            delivery_ids,
            runtime.sender.push,
            secret,
            endpoints=runtime.endpoints,
        )


@app.task(name="orderly.deliver.confirmations", bind=True)
def confirm(self: Any, calls: list[tuple[int, str]]) -> list[str]:
    """Tell source systems the final states of their messages: one try each, under the claim
    token each was taken with."""
    refuse_if_stopped(self)
    runtime = get_runtime()
    states = []
    for call_id, claim in calls:
        xid = {"meta": {"id": f"confirmation:{call_id}"}}
        with runtime.tracker.tracking(xid, "confirmation"):
            states.append(
                confirmations.confirm(runtime.engine, call_id, claim, runtime.config, runtime.http)
            )
    return states
