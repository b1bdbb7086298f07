"""Celery tasks of the processing queue: thin, they take ids and call the processor."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery.exceptions import Reject

from worker import confirmations, pubsub
from worker.celery import PROCESS_QUEUE, app, enqueue_drain, enqueue_processing
from worker.delivery import HttpSender
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


_sender = HttpSender()


@app.task(name="orderly.deliver.conversation")
def deliver_conversation(conversation_id: str, token: str) -> str:
    """Deliver a conversation's responses in order while holding its lease (``token``)."""
    runtime = get_runtime()
    # Tracked by the conversation (the xid is meta.id); the lease token is no part of it.
    with runtime.tracker.tracking({"meta": {"id": f"conversation:{conversation_id}"}}, "drain"):
        report = runtime.conversations.drain(conversation_id, token, _sender)
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
        return pubsub.deliver_batch(runtime.engine, delivery_ids, _sender.push, secret)


@app.task(name="orderly.deliver.confirmation")
def confirm(call_id: int) -> str:
    """Tell a source system the final state of its message (one try)."""
    runtime = get_runtime()
    with runtime.tracker.tracking({"meta": {"id": f"confirmation:{call_id}"}}, "confirmation"):
        return confirmations.confirm(runtime.engine, call_id, runtime.config)
