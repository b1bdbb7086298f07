"""Beat's agents: thin calls into the mechanisms, run by beat's ticker (beat/schedule.py).

Each returns what it did, for the log. The nightly report is a Celery task on the agents
queue (a cron entry of the beat schedule).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from orderly.worker import nodes, pubsub, rebuild
from orderly.worker.celery import app
from orderly.worker.conversations import reconcile
from orderly.worker.messages import confirmations, schedules, timeouts, watchdogs
from orderly.worker.runtime import get_runtime

log = logging.getLogger("orderly.agents")

# How long a message waits NEW before beat wakes a worker for it.
WAKE_AFTER_S = 1.0


def redis_watch() -> rebuild.RebuildReport | None:
    """Redis lost its state (the marker is gone, or the server restarted): rebuild it from
    PostgreSQL (worker/rebuild.py); otherwise one round trip."""
    runtime = get_runtime()
    return rebuild.rebuild_if_lost(
        runtime.engine,
        runtime.conversations,
        runtime.broker.enqueue_drain,
        runtime.wake_processing,
    )


def redis_sweep() -> str:
    """Conversations whose keys Redis lost under a live marker (evicted, deleted by hand):
    rebuilt from their rows once seen so twice in a row (worker/conversations/reconcile.py).
    Left to redis-watch (beat's loss watch on a plain Redis) while the markers say Redis
    lost everything."""
    runtime = get_runtime()
    conversations = runtime.conversations
    watch = runtime.loss_watch
    lost = not watch.holds_state if watch is not None else bool(rebuild.check(conversations))
    if lost:
        return "Redis lost its state: redis-watch rebuilds it"
    report = conversations.sweep(
        reconcile.page_reader(runtime.engine), runtime.broker.enqueue_drain
    )
    if report.repaired:
        rebuild.count_repair()
    return (
        f"{report.conversations} conversations looked at, {len(report.suspect)} suspect, "
        f"{len(report.repaired)} rebuilt ({report.keys_created} keys)"
    )


def pool_checks() -> int:
    """Guaranteed order held back too long, response deadlines: what they failed."""
    runtime = get_runtime()
    wake = runtime.wake_processing
    failed = watchdogs.fail_postponed(runtime.engine, runtime.config, wake)
    if failed:
        log.warning("pool failed %d messages postponed behind a FAILED one", failed)
    expired = watchdogs.expire_waits(runtime.engine, runtime.config, wake)
    if expired:
        log.warning("pool failed %d messages whose response did not come", expired)
    return failed + expired


def wake_due() -> bool:
    """Messages NEW for over a second (their wake-up was lost, the worker that looked for
    them was killed, their funnel was busy when a worker looked, or a node ran again): wake a
    worker, also past a wake-up mark that has not moved for a few seconds (its holder may be
    dead, and the mark would hold them back until it expires). One indexed look when there
    are none."""
    runtime = get_runtime()
    if not watchdogs.due_waiting(runtime.engine, WAKE_AFTER_S):
        return False
    return runtime.wake_stale()


def repair() -> watchdogs.RepairReport:
    runtime = get_runtime()
    report = watchdogs.repair(runtime.engine, runtime.config, runtime.wake_processing)
    if report.messages or report.external_calls or report.parents:
        log.warning("repair: %s", report)
    return report


def release_orphans() -> watchdogs.OrphanReport:
    """Work whose worker died: the store's messages and confirmation tries are released at
    once (quarantined at the limit), and so are conversation drains."""
    runtime = get_runtime()
    limit = runtime.settings.worker_lost_limit
    report = watchdogs.release_orphans(
        runtime.engine,
        runtime.config,
        limit,
        runtime.broker.enqueue_processing,
        runtime.wake_processing,
    )
    if report.released or report.quarantined:
        log.warning(
            "%d messages of dead workers released, %d quarantined (E_WORKER_LOST)",
            report.released,
            report.quarantined,
        )
    released, quarantined = confirmations.release_orphans(runtime.engine, limit)
    if released or quarantined:
        log.warning(
            "%d confirmation tries of dead workers released, %d quarantined (FAILED_END)",
            released,
            quarantined,
        )
    drains = runtime.conversations.release_dead_drains()
    if drains:
        log.warning("%d conversation drains of dead workers released", drains)
    return report


def node_watch() -> list[str]:
    """Log the nodes in RUN whose heartbeat stopped (their work is released by repair)."""
    runtime = get_runtime()
    timeout = runtime.config.get_int("cluster.nodeHeartbeatTimeoutSec")
    silent = [
        n.code
        for n in nodes.list_nodes(runtime.engine, timeout)
        if not n.alive and n.state != "STOPPED"
    ]
    if silent:
        log.warning("nodes without heartbeat for %ss: %s", timeout, ", ".join(silent))
    return silent


def awaited() -> None:
    """The awaited agent: re-queues due AWAITED and stuck responses, expires old ones."""
    runtime = get_runtime()
    report = runtime.conversations.awaited_turn(runtime.broker.enqueue_drain)
    if report.woken or report.expired or report.vanished:
        log.info("awaited agent: %s", report)


def timeout_monitor() -> timeouts.TimeoutReport:
    """The timeout monitor: done and timeout metrics, retries of timed-out messages."""
    runtime = get_runtime()
    report = timeouts.monitor(runtime.engine, runtime.tracker, runtime.broker.enqueue_processing)
    if report.timeouts or report.expired:
        log.warning(
            "timeout monitor: %d timeouts (retried %s, failed %s), %d expired",
            report.timeouts,
            report.retried,
            report.failed,
            report.expired,
        )
    return report


def pubsub_upkeep() -> None:
    runtime = get_runtime()
    pubsub.upkeep(runtime.engine, runtime.settings.worker_lost_limit)


def produce_schedules() -> schedules.ProduceReport:
    """The message of every due schedule, through the intake (which wakes a worker)."""
    runtime = get_runtime()
    intake = runtime.intake(runtime.broker.enqueue_processing, runtime.wake_processing)
    report = schedules.produce_due(runtime.engine, intake.submit, runtime.clock)
    if report.produced or report.repeated:
        log.info("schedules produced %s (stored before: %s)", report.produced, report.repeated)
    return report


@app.task(name="orderly.agents.nightly_report", bind=True)
def nightly_report(self: Any) -> int:
    """Start the incremental report (rows since the watermark) as a process of its own and
    return at once: Spark's driver must not live in a worker. Two overlapping runs are safe:
    the watermark moves by compare-and-set, with the report tables, so only one counts."""
    from orderly.worker.tasks import refuse_if_stopped

    refuse_if_stopped(self)
    settings = get_runtime().settings
    folder = Path(settings.report_output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "nightly.log").open("ab") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "orderly"), "report", "--incremental",
             "--lag-minutes", "60"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    log.info("nightly report started (pid %s); its output goes to %s", proc.pid, out.name)
    return proc.pid
