"""The beat schedule, built when beat starts from the configuration table."""

from __future__ import annotations

import random
import time
from datetime import datetime
from typing import Any

from celery.schedules import crontab, schedstate, schedule

from worker.configuration import ConfigReader
from worker.settings import Settings


class FirstAfterOffset(schedule):  # type: ignore[misc]
    """Every ``run_every`` seconds, the first time ``offset`` seconds after beat starts.

    The awaited agent starts at a random second (within the first minute, or within the
    first interval when that is shorter) so that two beats started together do not ask for
    AWAITED messages at the same moment (the seed's rule).
    """

    def __init__(self, run_every: float, offset: float) -> None:
        super().__init__(run_every)
        self.first_at = time.monotonic() + offset
        self._started = False

    def is_due(self, last_run_at: datetime) -> schedstate:
        if not self._started:
            wait = self.first_at - time.monotonic()
            if wait > 0:
                return schedstate(False, wait)
            self._started = True
            return schedstate(True, self.run_every.total_seconds())
        return super().is_due(last_run_at)


def build_schedule(
    config: ConfigReader, settings: Settings | None = None
) -> dict[str, dict[str, Any]]:
    pool_every = config.get_int("asynch.partlyFailedRepeatTimeSec")
    # POSTPONED messages are due after postponedIntervalSec (5 s by default), so the pool runs
    # at least that often; PARTLY_FAILED ones wait for their own interval inside the query.
    pool_every = min(pool_every, max(1, config.get_int("asynch.postponedIntervalSec")))
    entries: dict[str, dict[str, Any]] = {
        "reprocess-pool": {"task": "orderly.agents.requeue_due", "schedule": float(pool_every)},
        "repair": {
            "task": "orderly.agents.repair",
            # Dead workers are found at once (their connection is gone); stuck ones after
            # repairRepeatTimeSec. Running more often than that costs one indexed query.
            "schedule": float(min(config.get_int("asynch.repairRepeatTimeSec"), 10)),
        },
        "node-watch": {
            "task": "orderly.agents.node_watch",
            "schedule": float(config.get_int("cluster.nodeHeartbeatTimeoutSec")),
        },
    }
    if settings is not None:
        every_s = settings.track_monitor_interval_ms / 1000
        entries["timeout-monitor"] = {
            "task": "orderly.agents.timeout_monitor",
            "schedule": every_s,
            # A turn not run in time is dropped, not run in a burst later: the next one does
            # the same work (busy workers must not pile up monitor tasks).
            "options": {"expires": max(every_s * 2, 1.0)},
        }
        if settings.report_nightly_hour is not None:
            entries["nightly-report"] = {
                "task": "orderly.agents.nightly_report",
                "schedule": crontab(minute=0, hour=settings.report_nightly_hour),
            }
        every = settings.awaited_messages_interval / 1000
        entries["awaited-agent"] = {
            "task": "orderly.agents.awaited",
            "schedule": FirstAfterOffset(every, random.uniform(0, min(60.0, every))),
        }
    return entries
