"""Beat's scheduler: the ticker every AURA_QUEUE_MANAGER_INTERVAL, and the beat schedule."""

from __future__ import annotations

import logging
from typing import Any

from celery.beat import Scheduler

from beat.schedule import build_schedule, build_ticker
from worker.core.due import Ticker
from worker.runtime import get_runtime

log = logging.getLogger("orderly.beat")


class ConfiguredScheduler(Scheduler):
    """An in-memory scheduler (the agents are periodic and idempotent) that also runs the
    ticker: due work goes to the broker within one interval of being due."""

    ticker: Ticker | None = None

    def setup_schedule(self) -> None:
        runtime = get_runtime()
        runtime.startup_check()
        self.ticker = build_ticker(runtime.config, runtime.settings, runtime)
        self.interval_s = runtime.settings.interval / 1000
        schedule = build_schedule(runtime.settings)
        self.merge_inplace(schedule)
        log.info(
            "ticker every %.3f s over %s; jobs %s; beat schedule %s",
            self.interval_s,
            [s.name for s in self.ticker.sources],
            {j.name: j.every_s for j in self.ticker.jobs},
            {k: str(v["schedule"]) for k, v in schedule.items()},
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self.ticker is not None:
            self.ticker.tick()
        wait: float = super().tick(*args, **kwargs)
        return min(wait, self.interval_s)
