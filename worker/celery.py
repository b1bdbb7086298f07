"""The Celery app: ``celery -A orderly.worker worker`` and ``celery -A orderly.worker beat``."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import redis
from celery import Celery, bootsteps, signals
from kombu.entity import Exchange, Queue

from orderly.models import NodeState
from orderly.worker import nodes, totals
from orderly.worker.core import logs, tracing
from orderly.worker.core.clock import now_ms
from orderly.worker.observe import BrokerFigures, broker_figures
from orderly.worker.runtime import get_runtime
from orderly.worker.settings import get_settings
from orderly.worker.tracking import ServiceLease

log = logging.getLogger("orderly.worker")

PROCESS_QUEUE = "orderly.process"
AGENTS_QUEUE = "orderly.agents"
DELIVER_QUEUE = "orderly.deliver"
QUEUES = (PROCESS_QUEUE, AGENTS_QUEUE, DELIVER_QUEUE)

_settings = get_settings()

app = Celery(
    "orderly",
    broker=_settings.effective_broker_url,
    include=["orderly.worker.tasks", "orderly.beat.agents"],
)
# On RabbitMQ (ORDERLY_BROKER_URL amqp://) the queues are durable quorum queues, replicated
# over the cluster's nodes, and every send waits for the broker's confirm; on Redis, a task
# taken and not acknowledged comes back after the visibility timeout.
_AMQP = _settings.broker_is_amqp
_QUEUE_ARGUMENTS = {"x-queue-type": "quorum"} if _AMQP else None


def _queue(name: str) -> Queue:
    return Queue(
        name,
        Exchange(name, durable=True),
        routing_key=name,
        durable=True,
        queue_arguments=_QUEUE_ARGUMENTS,
    )


app.conf.update(
    task_ignore_result=True,
    # A task is acknowledged after it ran; a worker lost mid-task gives the message back.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # The seed's in-memory queue is the worker: at most AURA_QUEUE_MANAGER_CONCURRENT tasks
    # run at once, in a pool of no more processes than cores (a worker's --concurrency wins),
    # and it holds at most pool * CONCURRENT_FACTOR from the broker, running and reserved
    # (acknowledged late, a task counts against the prefetch until it ran).
    worker_concurrency=_settings.pool_processes,
    worker_prefetch_multiplier=_settings.concurrent_factor,
    task_queues=[_queue(name) for name in QUEUES],
    task_default_queue=PROCESS_QUEUE,
    task_default_queue_type="quorum" if _AMQP else "classic",
    task_routes={
        "orderly.process.*": {"queue": PROCESS_QUEUE},
        "orderly.agents.*": {"queue": AGENTS_QUEUE},
        "orderly.deliver.*": {"queue": DELIVER_QUEUE},
    },
    task_serializer="json",
    accept_content=["json"],
    worker_send_task_events=True,
    broker_connection_retry_on_startup=True,
    # Waits never sit in the broker (no countdown/eta): beat's ticker sends a task when it is
    # due (worker.core.due).
    broker_transport_options=(
        {"confirm_publish": True}
        if _AMQP
        else {"visibility_timeout": _settings.broker_visibility_timeout_s}
    ),
    beat_scheduler="orderly.beat.scheduler:ConfiguredScheduler",
    timezone="UTC",
)


# Celery's global options that take a value (``celery -A orderly.worker flower``: the app, then the
# subcommand).
_VALUED = {"-A", "--app", "-b", "--broker", "--result-backend", "--loader", "--config", "--workdir"}


def _subcommand(argv: list[str]) -> str | None:
    """The celery subcommand being run (``worker``, ``beat``, ``flower``...), if any."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def _flower_options() -> None:
    """``celery -A orderly.worker flower``, started from any directory, runs with orderly's basic
    auth, address and port: Flower reads ``FLOWER_*`` variables wherever it starts (it reads
    a configuration file only from its working directory). Without a password it does not
    start at all: Flower without basic auth lets anyone revoke tasks and stop workers."""
    if _subcommand(sys.argv[1:]) != "flower":
        return
    password = _settings.flower_password.get_secret_value()
    if not password:
        raise SystemExit(
            "orderly: Flower refuses to start without a password: set ORDERLY_FLOWER_PASSWORD "
            f"(the user is ORDERLY_FLOWER_USER, now {_settings.flower_user!r})"
        )
    os.environ["FLOWER_BASIC_AUTH"] = f"{_settings.flower_user}:{password}"
    os.environ["FLOWER_ADDRESS"] = _settings.flower_address
    os.environ["FLOWER_PORT"] = str(_settings.flower_port)


_flower_options()

# Traces (worker.core.tracing): every task's publish and run in a span, its context carried in
# the task's headers. A worker, beat or Flower names itself; an API process has already.
if tracing.configure(f"orderly-{_subcommand(sys.argv[1:]) or 'worker'}"):
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    CeleryInstrumentor().instrument()


class CeleryBroker:
    """orderly's broker (``orderly.worker.broker.Broker``) over this Celery app: each send is
    a task by name, routed to its queue by ``task_routes``."""

    def __init__(self, celery: Celery) -> None:
        self.app = celery
        self._client: redis.Redis | None = None

    @property
    def queues(self) -> tuple[str, ...]:
        return QUEUES

    def _send(self, name: str, *args: Any, **kwargs: Any) -> None:
        # On RabbitMQ a send waits for the broker's confirm at most ORDERLY_CONNECT_TIMEOUT_S
        # (a broker that stops taking messages, a memory or disk alarm, raises instead of
        # blocking the API or a worker for ever).
        options = {"confirm_timeout": _settings.connect_timeout_s} if _AMQP else {}
        self.app.send_task(name, args=args, kwargs=kwargs or None, **options)

    def enqueue_processing(self, msg_id: int) -> None:
        self._send("orderly.process.message", msg_id)

    def send_process_due(self) -> None:
        self._send("orderly.process.due")

    def send_process_helper(self) -> None:
        self._send("orderly.process.due", owner=False)

    def enqueue_drain(self, conversation_id: str, token: str) -> None:
        self._send("orderly.deliver.conversation", conversation_id, token)

    def enqueue_event_deliveries(self, delivery_ids: list[int]) -> None:
        self._send("orderly.deliver.events", delivery_ids)

    def enqueue_confirmations(self, calls: list[tuple[int, str]]) -> None:
        self._send("orderly.deliver.confirmations", calls)

    def figures(self) -> BrokerFigures:
        if _AMQP:
            # RabbitMQ tells no client of unacknowledged tasks: only the ready ones.
            return BrokerFigures(self._ready_on_rabbitmq(), None)
        return broker_figures(self._redis(), QUEUES)

    def _ready_on_rabbitmq(self) -> dict[str, int]:
        """Each queue's ready messages, from a passive declare (it creates nothing; a queue
        not declared yet holds none) on a connection of the app's pool."""
        from amqp.exceptions import NotFound

        depths = {}
        with self.app.pool.acquire(block=True, timeout=_settings.connect_timeout_s) as conn:
            for name in QUEUES:
                channel = conn.channel()  # one each: a queue not found closes its channel
                try:
                    depths[name] = int(channel.queue_declare(name, passive=True).message_count)
                except NotFound:
                    depths[name] = 0
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
        return depths

    def _redis(self) -> redis.Redis:
        """The Redis broker's client: the runtime's own when the broker is ORDERLY_REDIS_URL."""
        runtime = get_runtime()
        url = runtime.settings.effective_broker_url
        if url == runtime.settings.redis_url:
            return runtime.redis
        if self._client is None:
            self._client = redis.Redis.from_url(url, socket_timeout=5.0)
        return self._client

    def ping(self, timeout_s: float) -> None:
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(
                max_retries=1, interval_start=0, interval_step=0, timeout=timeout_s
            )

    def run_command(self, argv: Sequence[str]) -> int | None:
        code = self.app.start(argv=list(argv))
        return code if isinstance(code, int) else None


# The one instance: every process's runtime sends through it (``Runtime.broker`` builds it on
# first use, worker/runtime.py), workers and beat as well as the API and the CLI.
broker = CeleryBroker(app)

# The sends by name, for the tasks (worker/tasks.py) and for tests that send directly.
enqueue_processing = broker.enqueue_processing
send_process_due = broker.send_process_due
send_process_helper = broker.send_process_helper
enqueue_drain = broker.enqueue_drain
enqueue_event_deliveries = broker.enqueue_event_deliveries
enqueue_confirmations = broker.enqueue_confirmations
ping_broker = broker.ping


def wake_processing() -> bool:
    """Wake a worker to claim due messages, unless one is woken already (worker/messages/wake.py);
    whether a task was sent."""
    return get_runtime().wake_processing()


class NodeLifecycle(bootsteps.StartStopStep):
    """Registers the worker's node, renews its heartbeat and its service key, and follows its
        state.

        STOPPED: stop consuming every orderly queue this worker consumes (processing, deliveries
    of conversations, events and confirmations, agents); RUN or HANDLES_EXISTING_MESSAGES:
        consume them again.
        The service key deleted by an operator: warm shutdown, as on SIGTERM (the tasks in hand
        finish, then the worker exits). A key lost to an outage or a Redis restart is restored
        (``orderly.worker.tracking.ServiceLease``).
    """

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None
        # The orderly queues this worker was started to consume (-Q), found once: a queue
        # cancelled while STOPPED must be added back when the node runs again.
        self.queues: list[str] | None = None

    def _consuming(self, c: Any) -> list[str]:
        assert self.queues is not None
        return [q for q in self.queues if c.task_consumer.consuming_from(q)]

    def _pause(self, c: Any, queues: list[str]) -> None:
        for queue in queues:
            c.cancel_task_queue(queue)

    def _resume(self, c: Any) -> None:
        assert self.queues is not None
        for queue in self.queues:
            if not c.task_consumer.consuming_from(queue):
                c.add_task_queue(queue)

    def start(self, c: Any) -> None:
        runtime = get_runtime()
        runtime.startup_check()
        log.info("node %s registered as id %s", runtime.settings.node_code, runtime.node_id)
        if self.queues is None:
            # The consumer does not consume yet: the queues it is to consume.
            selected = c.app.amqp.queues.consume_from
            self.queues = [q for q in QUEUES if q in selected]
        if nodes.node_state(runtime.engine, runtime.node_id) is NodeState.STOPPED:
            log.warning("node %s is STOPPED: not consuming", runtime.settings.node_code)
            self._pause(c, self.queues)
        interval = runtime.settings.heartbeat_interval_ms / 1000
        self.tref = c.timer.call_repeatedly(interval, self.follow, (c,), priority=10)

    def follow(self, c: Any) -> None:
        runtime = get_runtime()
        lease = runtime.service_lease
        if lease is not None:
            try:
                kept = lease.keep()
            except Exception:
                log.exception("renewing the service key failed (tried again next heartbeat)")
            else:
                if kept in ("restored", "started"):
                    log.warning("service key %s %s", lease.service_id, kept)
                elif kept == "stop":
                    assert lease.service_id is not None
                    log.warning(
                        "service key %s is gone: stopping this worker",
                        runtime.track_keys.service(lease.service_id),
                    )
                    _deregister_service()
                    # A warm shutdown, as on SIGTERM: tasks in hand finish, then the exit.
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
        try:
            state = nodes.heartbeat(runtime.engine, runtime.node_id)
        except Exception:
            log.exception("node heartbeat failed")
            return
        consuming = self._consuming(c)
        if state is NodeState.STOPPED and consuming:
            log.warning("node %s is STOPPED: no longer consuming", runtime.settings.node_code)
            self._pause(c, consuming)
        elif state is not NodeState.STOPPED and consuming != self.queues:
            log.warning("node %s is %s: consuming again", runtime.settings.node_code, state)
            self._resume(c)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


app.steps["consumer"].add(NodeLifecycle)


@signals.worker_init.connect
def _register_service(sender: Any = None, **_: Any) -> None:
    """The worker's service key, before the pool forks, so every child tracks under its id.

    If Redis cannot be reached now, the lease starts at a later heartbeat.
    """
    runtime = get_runtime()
    runtime.count_totals()
    settings = runtime.settings
    lease = ServiceLease(
        runtime.services,
        {
            "node_id": runtime.node_id,
            "node_code": settings.node_code,
            "hostname": getattr(sender, "hostname", "") or socket.gethostname(),
            "pid": os.getpid(),
            "started": now_ms(),
        },
        settings.service_expire_ms,
    )
    runtime.service_lease = lease
    try:
        runtime.service_id = lease.start()
    except Exception:
        log.exception("registering the service key failed (tried again next heartbeat)")
        return
    log.info(
        "service %s registered for node %s",
        runtime.track_keys.service(runtime.service_id),
        settings.node_code,
    )


@signals.worker_process_shutdown.connect
def _flush_totals(**_: Any) -> None:
    totals.TALLY.flush()
    tracing.shutdown()  # a pool child leaves by os._exit: no atexit export


@signals.worker_shutdown.connect
def _deregister_service(**_: Any) -> None:
    totals.TALLY.flush()
    runtime = get_runtime()
    lease = runtime.service_lease
    if lease is not None and lease.service_id is not None:
        try:
            runtime.services.deregister(lease.service_id)
        except Exception:
            log.exception("removing the service key failed")
    runtime.service_lease = None


@signals.worker_process_init.connect
def _after_fork(**_: Any) -> None:
    get_runtime().after_fork()


# --- logs: orderly's format and the ids of the task at hand (worker.core.logs) -------------

_task_logs: dict[str, Any] = {}
# The id a task's first argument is, for its log records.
_TASK_IDS = {"orderly.process.message": "msg_id", "orderly.deliver.conversation": "conversation_id"}


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    if logger is not None:
        logs.set_node(_settings.node_code)
        logs.adopt(logger, _settings.log_format)


@signals.task_prerun.connect
def _log_task(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    if task_id is None:
        return
    name = getattr(task, "name", None)
    fields: dict[str, Any] = {"task": name, "task_id": task_id}
    if name in _TASK_IDS and args:
        fields[_TASK_IDS[name]] = args[0]
    _task_logs[task_id] = logs.push(**fields)


@signals.task_postrun.connect
def _unlog_task(task_id: str | None = None, **_: Any) -> None:
    token = _task_logs.pop(task_id or "", None)
    if token is not None:
        logs.pop(token)
