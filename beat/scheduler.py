"""Beat's scheduler: due work every AURA_QUEUE_MANAGER_INTERVAL in beat's loop while there is
some, every AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL while there is none; the agents on a thread
of their own, and the beat schedule."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from celery.beat import Scheduler
from redis import Redis

from orderly.beat import agents as agent_jobs
from orderly.beat.schedule import build_schedule, build_tickers
from orderly.models import NodeState
from orderly.worker import rebuild
from orderly.worker.core.due import Ticker
from orderly.worker.loss_watch import LossWatch
from orderly.worker.nodes import NodeFollower
from orderly.worker.rebuild import RebuildReport
from orderly.worker.runtime import Runtime, get_runtime

log = logging.getLogger("orderly.beat")


class ConfiguredScheduler(Scheduler):
    """An in-memory scheduler (the agents are periodic and idempotent) that also runs the
    tickers: due work goes to the broker within one interval of being due, whatever an agent
    is doing meanwhile. The interval is INTERVAL after a turn that handed something over and
    CHECK_QUEUE_INTERVAL, the seed's idle check, after one that found nothing due (see
    :func:`next_wait`), cut short to when the earliest waiting item is due
    (:func:`until_due`).

    Beat follows its node (ORDERLY_NODE_CODE) every heartbeat: while it is STOPPED the
    ticker hands out no due work and neither the agents nor the beat schedule run (the beats
    of other nodes go on); HANDLES_EXISTING_MESSAGES changes nothing here, existing work
    finishes. Of the nodes' beats, one runs the agents (the one holding the leadership lease,
    worker.core.lease.Leadership; another takes over within seconds of its end); every beat
    hands out due work."""

    due: Ticker | None = None
    agents: Ticker | None = None
    loss_watch: LossWatch | None = None

    def setup_schedule(self) -> None:
        runtime = get_runtime()
        runtime.startup_check()
        runtime.count_totals()
        rebuild.count_from_zero()  # beat's agent rebuilds Redis
        self.due, self.agents = build_tickers(runtime.config, runtime.settings, runtime)
        self.node = NodeFollower(
            runtime.engine,
            runtime.node_id,
            runtime.settings.heartbeat_interval_ms / 1000,
            clock=runtime.clock,
        )
        self.interval_s = runtime.settings.interval / 1000
        self.idle_s = runtime.settings.check_queue_interval / 1000
        schedule = build_schedule(runtime.settings)
        self.merge_inplace(schedule)
        self.leadership = runtime.beat_leadership
        self._leading: bool | None = None
        self._unknown = False
        self._stopping = threading.Event()
        self._agents_thread = threading.Thread(
            target=self._run_agents, name="orderly-agents", daemon=True
        )
        self._agents_thread.start()
        self.loss_watch = self._watch_for_loss(runtime)
        log.info(
            "ticker every %.3f s (%.3f s when idle) over %s; agents %s; beat schedule %s",
            self.interval_s,
            self.idle_s,
            [s.name for s in self.due.sources],
            {j.name: j.every_s for j in self.agents.jobs},
            {k: str(v["schedule"]) for k, v in schedule.items()},
        )

    def _watch_for_loss(self, runtime: Runtime) -> LossWatch | None:
        """On a plain Redis, a thread of beat's own rebuilds Redis as soon as its markers
        change (worker.loss_watch); on a Redis Cluster the redis-watch agent looks every
        tick."""
        client = runtime.conversations.ctx.redis
        if not isinstance(client, Redis):
            return None
        watch = LossWatch(
            client,
            [shard.epoch for shard in runtime.conversations.keys.every_shard],
            # STOPPED: not looked at, not known (looked at again soon)
            lambda: RebuildReport(busy=True) if self.node.stopped else agent_jobs.redis_watch(),
            poll_s=self.interval_s,
        )
        runtime.loss_watch = watch
        self._watch_thread = threading.Thread(
            target=watch.run, args=(self._stopping,), name="orderly-loss-watch", daemon=True
        )
        self._watch_thread.start()
        return watch

    def _run_agents(self) -> None:
        assert self.agents is not None
        while not self._stopping.is_set():
            if not self.node.stopped and self._leads():
                self.agents.tick()
            self._stopping.wait(self.interval_s)

    def _leads(self) -> bool:
        """Whether this beat runs the agents: the one holding the leadership (one among the
        nodes' beats), or every beat while Redis cannot say (the agents are safe to run
        twice: they were run by every beat before)."""
        try:
            leads = self.leadership.leads()
        except Exception as exc:
            if not self._unknown:
                log.warning("beat leadership unknown (%s): running the agents", exc)
            self._unknown = True
            return True
        self._unknown = False
        if leads != self._leading:
            log.info("this beat %s the agents", "runs" if leads else "leaves another beat")
        self._leading = leads
        return leads

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self.due is None:
            return float(super().tick(*args, **kwargs))
        if self.node.follow() is NodeState.STOPPED:
            return self.interval_s
        moved = self.due.tick()
        wait: float = super().tick(*args, **kwargs)
        after = next_wait(moved, len(self.due.sources), self.interval_s, self.idle_s)
        # No longer than until the next item is due (a retry wait, a delay, an ACK deadline),
        # busy or idle: due work starts on time, not up to a turn late.
        failed = len(moved) < len(self.due.sources)
        after = until_due(self.due.due_in_s(), after, self.interval_s, failed)
        return min(wait, after)

    def close(self) -> None:
        if self.due is not None:
            self._stopping.set()
            if self.loss_watch is not None:
                self.loss_watch.close()  # ends its wait; a rebuild it runs finishes
                self._watch_thread.join(timeout=30)
            self._agents_thread.join(timeout=30)
            with contextlib.suppress(Exception):  # the next beat leads at once
                self.leadership.resign()
        super().close()


def next_wait(moved: dict[str, int], sources: int, busy_s: float, idle_s: float) -> float:
    """Beat's wait after a turn of the due ticker: ``busy_s`` when it handed something to the
    broker (more may be due) or a source failed (it is tried again soon), ``idle_s`` when
    every source answered that nothing is due."""
    idle = len(moved) == sources and not any(moved.values())
    return idle_s if idle else busy_s


# The shortest wait of the ticker: an item due in a moment is waited for, not spun on.
MIN_WAIT_S = 0.005
# An item that fell due while the turn ran (after its take looked): taken this soon after.
AGAIN_S = 0.02


def until_due(due_in_s: float | None, wait_s: float, busy_s: float, failed: bool = False) -> float:
    """Beat's wait ``wait_s`` (busy or idle), cut short to when the earliest waiting item is
    due. An item already due that the turn did not take fell due while it ran: it is taken
    :data:`AGAIN_S` later; while a source fails, ``busy_s`` (no spin on a broker that is
    down)."""
    if due_in_s is None:
        return wait_s
    if due_in_s <= 0:
        return min(wait_s, busy_s if failed else AGAIN_S)
    return min(wait_s, max(MIN_WAIT_S, due_in_s))
