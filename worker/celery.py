"""The Celery app: ``celery -A worker worker`` and ``celery -A worker beat``."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps, signals
from kombu.entity import Exchange, Queue

from models import NodeState
from worker import nodes
from worker.runtime import get_runtime
from worker.settings import get_settings

log = logging.getLogger("orderly.worker")

PROCESS_QUEUE = "orderly.process"
AGENTS_QUEUE = "orderly.agents"

_settings = get_settings()

app = Celery(
    "orderly", broker=_settings.effective_broker_url, include=["worker.tasks", "beat.agents"]
)
app.conf.update(
    task_ignore_result=True,
    # A task is acknowledged after it ran; a worker lost mid-task gives the message back.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # Tasks are short; a few in hand per process keeps the pipe full without hoarding.
    worker_prefetch_multiplier=4,
    task_queues=[
        Queue(PROCESS_QUEUE, Exchange(PROCESS_QUEUE), routing_key=PROCESS_QUEUE),
        Queue(AGENTS_QUEUE, Exchange(AGENTS_QUEUE), routing_key=AGENTS_QUEUE),
    ],
    task_default_queue=PROCESS_QUEUE,
    task_routes={
        "orderly.process.*": {"queue": PROCESS_QUEUE},
        "orderly.agents.*": {"queue": AGENTS_QUEUE},
    },
    task_serializer="json",
    accept_content=["json"],
    worker_send_task_events=True,
    broker_connection_retry_on_startup=True,
    beat_scheduler="beat.scheduler:ConfiguredScheduler",
    timezone="UTC",
)


def enqueue_processing(msg_id: int) -> None:
    app.send_task("orderly.process.message", args=(msg_id,))


class NodeLifecycle(bootsteps.StartStopStep):
    """Registers the worker's node, renews its heartbeat, and follows its state.

    STOPPED: stop consuming the processing queue; RUN or HANDLES_EXISTING_MESSAGES: consume.
    """

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None

    def start(self, c: Any) -> None:
        runtime = get_runtime()
        runtime.startup_check()
        log.info("node %s registered as id %s", runtime.settings.node_code, runtime.node_id)
        if nodes.node_state(runtime.engine, runtime.node_id) is NodeState.STOPPED:
            log.warning("node %s is STOPPED: not consuming", runtime.settings.node_code)
            c.cancel_task_queue(PROCESS_QUEUE)
        interval = runtime.settings.heartbeat_interval_ms / 1000
        self.tref = c.timer.call_repeatedly(interval, self.follow, (c,), priority=10)

    def follow(self, c: Any) -> None:
        runtime = get_runtime()
        try:
            state = nodes.heartbeat(runtime.engine, runtime.node_id)
        except Exception:
            log.exception("node heartbeat failed")
            return
        consuming = c.task_consumer.consuming_from(PROCESS_QUEUE)
        if state is NodeState.STOPPED and consuming:
            log.warning("node %s is STOPPED: no longer consuming", runtime.settings.node_code)
            c.cancel_task_queue(PROCESS_QUEUE)
        elif state is not NodeState.STOPPED and not consuming:
            log.warning("node %s is %s: consuming again", runtime.settings.node_code, state)
            c.add_task_queue(PROCESS_QUEUE)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


app.steps["consumer"].add(NodeLifecycle)


@signals.worker_process_init.connect
def _after_fork(**_: Any) -> None:
    get_runtime().after_fork()
