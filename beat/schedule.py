"""The beat schedule, built when beat starts from the configuration table."""

from __future__ import annotations

from typing import Any

from worker.configuration import ConfigReader


def build_schedule(config: ConfigReader) -> dict[str, dict[str, Any]]:
    pool_every = config.get_int("asynch.partlyFailedRepeatTimeSec")
    # POSTPONED messages are due after postponedIntervalSec (5 s by default), so the pool runs
    # at least that often; PARTLY_FAILED ones wait for their own interval inside the query.
    pool_every = min(pool_every, max(1, config.get_int("asynch.postponedIntervalSec")))
    return {
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
