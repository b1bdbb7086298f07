"""Beat's scheduler: the schedule comes from the configuration table when beat starts."""

from __future__ import annotations

import logging

from celery.beat import Scheduler

from beat.schedule import build_schedule
from worker.runtime import get_runtime

log = logging.getLogger("orderly.beat")


class ConfiguredScheduler(Scheduler):
    """An in-memory scheduler (the agents are periodic and idempotent)."""

    def setup_schedule(self) -> None:
        runtime = get_runtime()
        runtime.startup_check()
        schedule = build_schedule(runtime.config, runtime.settings)
        self.merge_inplace(schedule)
        log.info("beat schedule: %s", {k: str(v["schedule"]) for k, v in schedule.items()})
