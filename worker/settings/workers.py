"""``orderly worker``: how many Celery worker processes it supervises and how it restarts one
that died (worker/supervisor.py)."""

from __future__ import annotations

from pydantic import Field, model_validator

from orderly.worker.settings._base import Section


class WorkerSettings(Section):
    worker_processes: int = Field(
        1,
        ge=1,
        le=64,
        validation_alias="ORDERLY_WORKER_PROCESSES",
        description="Celery worker processes `orderly worker` runs and restarts (each with "
        "its pool of min(AURA_QUEUE_MANAGER_CONCURRENT, cores) processes).",
    )
    worker_restart_delay_ms: int = Field(
        500,
        ge=1,
        le=600_000,
        validation_alias="ORDERLY_WORKER_RESTART_DELAY_MS",
        description="Back-off of a worker restart: restart n waits delay * 2^n (the retry "
        "policy), the first one twice this.",
    )
    worker_restart_max_delay_ms: int = Field(
        30_000,
        ge=1,
        le=3_600_000,
        validation_alias="ORDERLY_WORKER_RESTART_MAX_DELAY_MS",
        description="The longest wait before a worker restart.",
    )
    worker_healthy_ms: int = Field(
        60_000,
        ge=1,
        le=86_400_000,
        validation_alias="ORDERLY_WORKER_HEALTHY_MS",
        description="A worker that ran this long before it died is restarted after the first "
        "delay again (the back-off starts anew).",
    )

    @model_validator(mode="after")
    def _cap_above_delay(self) -> WorkerSettings:
        if self.worker_restart_max_delay_ms < self.worker_restart_delay_ms:
            raise ValueError(
                "ORDERLY_WORKER_RESTART_MAX_DELAY_MS may not be shorter than "
                "ORDERLY_WORKER_RESTART_DELAY_MS"
            )
        return self
