"""Celery tasks: thin, they take ids and call the mechanisms."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.exceptions import Reject

from worker import confirmations, pubsub
from worker.celery import PROCESS_QUEUE, app, enqueue_drain, enqueue_processing
from worker.processing import Outcome
from worker.runtime import get_runtime

log = logging.getLogger("orderly.tasks")


@app.task(name="orderly.process.message", bind=True)
def process_message(self: Any, msg_id: int) -> str:
    result = get_runtime().processor.process(msg_id, enqueue_processing)
    if result.outcome is Outcome.NODE_STOPPED:
        # This node processes nothing: stop consuming and give the message back to the queue.
        app.control.cancel_consumer(PROCESS_QUEUE, destination=[self.request.hostname])
        time.sleep(0.5)
        raise Reject("node stopped", requeue=True)
    if result.outcome in (Outcome.NOT_CLAIMABLE, Outcome.MISSING, Outcome.LOST_CLAIM):
        log.info("message %s not processed: %s %s", msg_id, result.outcome, result.detail)
    return result.outcome.value


@app.task(name="orderly.deliver.conversation")
def deliver_conversation(conversation_id: str, token: str) -> str:
    """Deliver a conversation's responses in order while holding its lease (``token``)."""
    runtime = get_runtime()
    # Tracked by the conversation (the xid is meta.id); the lease token is no part of it.
    with runtime.tracker.tracking({"meta": {"id": f"conversation:{conversation_id}"}}, "drain"):
        report = runtime.conversations.drain(conversation_id, token, runtime.sender)
    if report.end == "YIELD":
        # Fair to other conversations: the rest goes on in a new task, the lease kept.
        enqueue_drain(conversation_id, token)
    elif report.end == "LOST":
        log.info("conversation %s is held by another drain", conversation_id)
    return report.end


@app.task(name="orderly.deliver.events")
def deliver_events(delivery_ids: list[int]) -> list[str]:
    """Events to their subscriptions: push, or the consumer chosen by routing key."""
    runtime = get_runtime()
    runtime.registry  # noqa: B018 - imports the handler modules, which register consumers
    secret = runtime.settings.token_secret
    # Tracked by the batch itself (no intrinsic id: the xid is its SHA1).
    with runtime.tracker.tracking({"deliveries": delivery_ids}, "events"):
        return pubsub.deliver_batch(runtime.engine, delivery_ids, runtime.sender.push, secret)


@app.task(name="orderly.deliver.confirmations")
def confirm(calls: list[tuple[int, str]]) -> list[str]:
    """Tell source systems the final states of their messages: one try each, under the claim
    token each was taken with."""
    runtime = get_runtime()
    states = []
    for call_id, claim in calls:
        xid = {"meta": {"id": f"confirmation:{call_id}"}}
        with runtime.tracker.tracking(xid, "confirmation"):
            states.append(
                confirmations.confirm(runtime.engine, call_id, claim, runtime.config, runtime.http)
            )
    return states
