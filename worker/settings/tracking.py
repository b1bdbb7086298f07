"""Message tracking and the service lifecycle (the message-tracking-timeouts seed)."""

from __future__ import annotations

from pydantic import Field, field_validator

from orderly.worker.settings._base import Section
from orderly.worker.settings.services import redis_url_only


class TrackingSettings(Section):
    track_namespace: str = Field(
        "orderly:track",
        min_length=1,
        validation_alias="ORDERLY_TRACK_NAMESPACE",
        description="serviceNamespace: prefix of the tracking, metrics and service keys.",
    )
    track_redis_url: str | None = Field(
        None,
        validation_alias="ORDERLY_TRACK_REDIS_URL",
        description="serviceRedis: Redis of the tracking keys (default: ORDERLY_REDIS_URL); "
        "a redis+sentinel:// URL as ORDERLY_REDIS_URL's for a Sentinel-managed one.",
    )
    track_message_timeout_ms: int = Field(
        10_000,
        ge=1,
        validation_alias="ORDERLY_TRACK_MESSAGE_TIMEOUT_MS",
        description="messageTimeout: a tracked message not done this long after it started "
        "is a timeout.",
    )
    track_message_expire_ms: int = Field(
        60_000,
        ge=1,
        validation_alias="ORDERLY_TRACK_MESSAGE_EXPIRE_MS",
        description="messageExpire: lifetime of a tracking hash (longer than messageTimeout).",
    )
    track_message_capacity: int = Field(
        1000,
        ge=1,
        validation_alias="ORDERLY_TRACK_MESSAGE_CAPACITY",
        description="messageCapacity: most ids tracked at once; above it only the overflow is "
        "counted.",
    )
    track_retry_attempts: int = Field(
        3,
        ge=0,
        le=100,
        validation_alias="ORDERLY_TRACK_RETRY_ATTEMPTS",
        description="Retries of a timed-out message before it becomes FAILED (E_TIMEOUT).",
    )
    track_retry_delay_ms: int = Field(
        1_000,
        ge=0,
        validation_alias="ORDERLY_TRACK_RETRY_DELAY_MS",
        description="deliveryDelay of timeout retries: retry n waits delay * multiplier^n.",
    )
    track_retry_multiplier: float = Field(
        2.0,
        ge=1.0,
        le=100.0,
        validation_alias="ORDERLY_TRACK_RETRY_MULTIPLIER",
        description="Timeout retry n waits `delay * multiplier^n`.",
    )
    track_retry_max_delay_ms: int = Field(
        60_000,
        ge=0,
        validation_alias="ORDERLY_TRACK_RETRY_MAX_DELAY_MS",
        description="Longest wait before a timeout retry (keep it below repairRepeatTimeSec).",
    )
    track_monitor_interval_ms: int = Field(
        1_000,
        ge=100,
        validation_alias="ORDERLY_TRACK_MONITOR_INTERVAL_MS",
        description="How often beat runs the timeout monitor.",
    )
    service_expire_ms: int = Field(
        15_000,
        ge=1_000,
        validation_alias="ORDERLY_SERVICE_EXPIRE_MS",
        description="Lifetime of a worker's service key; renewed every heartbeat interval.",
    )

    @field_validator("track_redis_url")
    @classmethod
    def _track_redis_scheme(cls, value: str | None) -> str | None:  # a name of its own
        return redis_url_only(value)
