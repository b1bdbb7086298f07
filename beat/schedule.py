"""What beat runs, built when beat starts from the configuration table and the settings.

A ticker (worker.core.due) hands every kind of due work to the broker when it is due: the
messages that wait for a time (scheduled, retry waits, postponed, timed out), event
deliveries (``$delay``, retry waits), confirmations and conversation wake-ups; a second one
runs the agents at their periods, beside it. The Celery beat schedule itself only holds the
nightly report (a cron entry).
"""

from __future__ import annotations

import random
from typing import Any

from celery.schedules import crontab

from orderly.beat import agents
from orderly.worker import pubsub
from orderly.worker.configuration import ConfigReader
from orderly.worker.core.due import DueSource, Job, Ticker
from orderly.worker.messages import confirmations
from orderly.worker.messages.due import due_messages
from orderly.worker.runtime import Runtime
from orderly.worker.settings import Settings


def jobs(config: ConfigReader, settings: Settings, runtime: Runtime) -> list[Job]:
    """The agents and their periods (seconds)."""
    pool_every = config.get_int("asynch.partlyFailedRepeatTimeSec")
    awaited_every = settings.awaited_messages_interval / 1000
    found = [
        Job("pool-checks", float(pool_every), agents.pool_checks),
        # A dead worker's claims are known at once (its connection is gone): released within a
        # second. Stuck messages wait repairRepeatTimeSec; running repair more often than that
        # costs one indexed query.
        Job("orphans", 1.0, agents.release_orphans),
        # Due messages whose wake-up was lost are taken up within a second or two.
        Job("wake-due", 1.0, agents.wake_due),
        Job("repair", float(min(config.get_int("asynch.repairRepeatTimeSec"), 10)), agents.repair),
        Job(
            "node-watch",
            float(config.get_int("cluster.nodeHeartbeatTimeoutSec")),
            agents.node_watch,
        ),
        Job("timeout-monitor", settings.track_monitor_interval_ms / 1000, agents.timeout_monitor),
        Job("pubsub-upkeep", 1.0, agents.pubsub_upkeep),
        # Periodic schedules: each due instant's message, once (worker/messages/schedules.py).
        Job("schedules", 1.0, agents.produce_schedules),
        # The awaited agent starts at a random second (within the first minute, or the first
        # interval when that is shorter) so that two beats started together do not ask for
        # AWAITED messages at the same moment (the seed's rule).
        Job(
            "awaited-agent",
            awaited_every,
            agents.awaited,
            first_after_s=random.uniform(0, min(60.0, awaited_every)),
        ),
    ]
    if settings.redis_cluster:
        # First, every tick: a Redis that lost its state is rebuilt before anything else. On a
        # plain Redis a watch of beat's own does it as soon as the markers change
        # (worker.loss_watch), sending nothing meanwhile.
        found.insert(0, Job("redis-watch", settings.interval / 1000, agents.redis_watch))
    if settings.redis_sweep_interval_ms > 0:
        # Single keys Redis lost under a live marker (evicted, deleted by hand).
        found.append(
            Job("redis-sweep", settings.redis_sweep_interval_ms / 1000, agents.redis_sweep)
        )
    if settings.logging_extra_time_metrics:
        found.append(
            Job(
                "queue-metrics",
                settings.metrics_partial_interval / 1000,
                runtime.conversations.log_partial_metrics,
            )
        )
    return found


def build_tickers(
    config: ConfigReader, settings: Settings, runtime: Runtime
) -> tuple[Ticker, Ticker]:
    """The due work, and the agents: two tickers, so that a long agent turn (a repair of
    many rows) never holds back what is due."""
    broker = runtime.broker
    sources: list[DueSource] = [
        due_messages(
            runtime.engine, runtime.wake_processing, config.get_int("asynch.postponedIntervalSec")
        ),
        pubsub.due_deliveries(runtime.engine, broker.enqueue_event_deliveries),
        confirmations.due_confirmations(runtime.engine, broker.enqueue_confirmations),
        runtime.conversations.wakes(broker.enqueue_drain),
    ]
    return (
        Ticker(sources, clock=runtime.clock),
        Ticker([], jobs(config, settings, runtime), clock=runtime.clock),
    )


def build_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The Celery beat entries: only cron-like work."""
    entries: dict[str, dict[str, Any]] = {}
    if settings.report_nightly_hour is not None:
        entries["nightly-report"] = {
            "task": "orderly.agents.nightly_report",
            "schedule": crontab(minute=0, hour=settings.report_nightly_hour),
        }
    return entries
