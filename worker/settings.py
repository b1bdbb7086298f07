"""The one validated settings object, read from the environment (and an optional ``.env``).

Names, units and defaults of the ``AURA_QUEUE_MANAGER_*`` variables are those of the
ordered-response seed; orderly's own variables start with ``ORDERLY_``.
"""

from __future__ import annotations

import json
import socket
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _queue_var(name: str) -> AliasChoices:
    # The seed spells some variables AURA_QUEUE_QUEUE_MANAGER_*; both spellings are read.
    return AliasChoices(f"AURA_QUEUE_MANAGER_{name}", f"AURA_QUEUE_QUEUE_MANAGER_{name}")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", populate_by_name=True
    )

    # --- services -------------------------------------------------------------------------
    database_url: str = Field(
        "postgresql+psycopg2://postgres@127.0.0.1:5432/orderly",
        validation_alias="ORDERLY_DATABASE_URL",
        description="SQLAlchemy URL of the PostgreSQL message store.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias="ORDERLY_REDIS_URL",
        description="Redis for ordering structures; also the broker unless ORDERLY_BROKER_URL.",
    )
    broker_url: str | None = Field(
        None,
        validation_alias="ORDERLY_BROKER_URL",
        description="Celery broker URL (defaults to ORDERLY_REDIS_URL).",
    )

    # --- orderly ----------------------------------------------------------------------------
    node_code: str = Field(
        default_factory=socket.gethostname,
        validation_alias="ORDERLY_NODE_CODE",
        description="This process's node code in the node table (default: the hostname).",
    )
    handler_modules: str = Field(
        "worker.demo",
        validation_alias="ORDERLY_HANDLER_MODULES",
        description="Comma-separated modules that register message handlers.",
    )
    max_payload_bytes: int = Field(
        1_048_576,
        ge=1,
        validation_alias="ORDERLY_MAX_PAYLOAD_BYTES",
        description="Largest payload accepted at intake, in bytes (UTF-8).",
    )
    api_host: str = Field("127.0.0.1", validation_alias="ORDERLY_API_HOST")
    api_port: int = Field(8000, ge=1, le=65535, validation_alias="ORDERLY_API_PORT")
    heartbeat_interval_ms: int = Field(
        5_000,
        ge=100,
        validation_alias="ORDERLY_HEARTBEAT_INTERVAL",
        description="In milliseconds, how often a worker renews its node row and checks its state.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        validation_alias="ORDERLY_LOG_LEVEL",
        description="Log level of the API and the CLI (Celery processes take --loglevel).",
    )

    # --- conversation delivery --------------------------------------------------------------
    channels: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        validation_alias="ORDERLY_CHANNELS",
        description='JSON object: origin -> delivery URL, e.g. {"whatsapp": "http://..."}.',
    )
    channel_delivery_delay_ms: int = Field(
        1_000,
        ge=1,
        validation_alias="ORDERLY_CHANNEL_DELIVERY_DELAY_MS",
        description="Default deliveryDelay of a channel: first retry waits delay * multiplier.",
    )
    channel_multiplier: float = Field(1.5, ge=1.0, validation_alias="ORDERLY_CHANNEL_MULTIPLIER")
    channel_attempts: int = Field(
        3,
        ge=0,
        validation_alias="ORDERLY_CHANNEL_ATTEMPTS",
        description="Retries after a recoverable failure before the group becomes AWAITED.",
    )
    channel_timeout_ms: int = Field(5_000, ge=1, validation_alias="ORDERLY_CHANNEL_TIMEOUT_MS")
    bridge_prefix: str = Field(
        "bridge:queue",
        min_length=1,
        validation_alias="ORDERLY_BRIDGE_PREFIX",
        description="Prefix of every conversation key in Redis (the seed's bridge:queue).",
    )
    drain_batch: int = Field(
        100,
        ge=1,
        validation_alias="ORDERLY_DRAIN_BATCH",
        description="Deliveries one task makes before handing the conversation to a new task.",
    )

    # --- publish/subscribe ------------------------------------------------------------------
    token_secret: str = Field(
        "",
        validation_alias="ORDERLY_TOKEN_SECRET",
        description="HMAC secret of message tokens; consumers refuse messages without a valid one.",
    )
    token_ttl_ms: int = Field(
        86_400_000,
        ge=1,
        validation_alias="ORDERLY_TOKEN_TTL_MS",
        description="A token is valid this long after its message is due.",
    )
    broker_visibility_timeout_s: int = Field(
        3600,
        ge=1,
        validation_alias="ORDERLY_BROKER_VISIBILITY_TIMEOUT",
        description="Seconds before the Redis broker redelivers a task taken but not acknowledged.",
    )

    # --- dashboard (Flower) -----------------------------------------------------------------
    flower_user: str = Field(
        "orderly",
        min_length=1,
        pattern=r"^[^:\s]+$",
        validation_alias="ORDERLY_FLOWER_USER",
        description="User of Flower's HTTP basic auth (no colon or blank).",
    )
    flower_password: SecretStr = Field(
        SecretStr(""),
        validation_alias="ORDERLY_FLOWER_PASSWORD",
        description="Password of Flower's HTTP basic auth; Flower refuses to start without one.",
    )
    flower_address: str = Field(
        "127.0.0.1",
        validation_alias="ORDERLY_FLOWER_ADDRESS",
        description="Address Flower listens on (0.0.0.0 inside a container).",
    )
    flower_port: int = Field(5555, ge=1, le=65535, validation_alias="ORDERLY_FLOWER_PORT")

    # --- message tracking and service lifecycle (message-tracking-timeouts seed) -----------
    track_namespace: str = Field(
        "orderly:track",
        min_length=1,
        validation_alias="ORDERLY_TRACK_NAMESPACE",
        description="serviceNamespace: prefix of the tracking, metrics and service keys.",
    )
    track_redis_url: str | None = Field(
        None,
        validation_alias="ORDERLY_TRACK_REDIS_URL",
        description="serviceRedis: Redis of the tracking keys (default: ORDERLY_REDIS_URL).",
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
        validation_alias="ORDERLY_TRACK_RETRY_ATTEMPTS",
        description="Retries of a timed-out message before it becomes FAILED (E_TIMEOUT).",
    )
    track_retry_delay_ms: int = Field(
        1_000,
        ge=0,
        validation_alias="ORDERLY_TRACK_RETRY_DELAY_MS",
        description="deliveryDelay of timeout retries: retry n waits delay * multiplier^(n-1).",
    )
    track_retry_multiplier: float = Field(
        2.0, ge=1.0, le=100.0, validation_alias="ORDERLY_TRACK_RETRY_MULTIPLIER"
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

    # --- reports (Spark over JDBC) ------------------------------------------------------------
    report_jdbc_url: str | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_URL",
        description="jdbc:postgresql:// URL Spark reads (default: from ORDERLY_DATABASE_URL).",
    )
    report_jdbc_user: str | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_USER",
        description="Database user of the report (default: the one of ORDERLY_DATABASE_URL).",
    )
    report_jdbc_password: SecretStr | None = Field(
        None,
        validation_alias="ORDERLY_REPORT_JDBC_PASSWORD",
        description="Its password (default: the one of ORDERLY_DATABASE_URL).",
    )
    report_jdbc_jar: str = Field(
        "/usr/share/java/postgresql.jar",
        min_length=1,
        validation_alias="ORDERLY_REPORT_JDBC_JAR",
        description="The PostgreSQL JDBC driver jar (Debian: libpostgresql-jdbc-java).",
    )
    report_partitions: int = Field(
        4,
        ge=1,
        le=1024,
        validation_alias="ORDERLY_REPORT_PARTITIONS",
        description="Partitions of each large JDBC read (ranges of the table's id).",
    )
    report_fetchsize: int = Field(
        10_000,
        ge=1,
        validation_alias="ORDERLY_REPORT_FETCHSIZE",
        description="Rows per JDBC round trip.",
    )
    report_master: str = Field(
        "local[*]",
        min_length=1,
        validation_alias="ORDERLY_REPORT_MASTER",
        description="Spark master: local[*], or a cluster's URL (spark://..., yarn, k8s://...).",
    )
    report_driver_memory: str = Field(
        "2g",
        pattern=r"^[0-9]+[kmgt]$",
        validation_alias="ORDERLY_REPORT_DRIVER_MEMORY",
        description="Spark driver memory (local mode: all of Spark).",
    )
    report_output_dir: str = Field(
        "reports-out",
        min_length=1,
        validation_alias="ORDERLY_REPORT_OUTPUT_DIR",
        description="Where reports are written, one folder per run.",
    )
    report_nightly_hour: int | None = Field(
        None,
        ge=0,
        le=23,
        validation_alias="ORDERLY_REPORT_NIGHTLY_HOUR",
        description="If set, beat runs an incremental report every day at this hour (UTC).",
    )

    # --- the ordered-response seed (milliseconds unless said otherwise) ----------------------
    awaited_message_ttl: int = Field(
        900_000, ge=1, validation_alias=_queue_var("AWAITED_MESSAGE_TTL")
    )
    awaited_messages_by_turn: int = Field(
        15, ge=1, validation_alias=_queue_var("AWAITED_MESSAGES_BY_TURN")
    )
    awaited_messages_interval: int = Field(
        20_000, ge=1, validation_alias=_queue_var("AWAITED_MESSAGES_INTERVAL")
    )
    awaited_retries_factor: float = Field(
        1, gt=0, validation_alias=_queue_var("AWAITED_RETRIES_FACTOR")
    )
    awaited_time_when_retries_end: int = Field(
        5_000, ge=0, validation_alias=_queue_var("AWAITED_TIME_WHEN_RETRIES_END")
    )
    check_queue_interval: int = Field(
        1_000, ge=1, validation_alias=_queue_var("CHECK_QUEUE_INTERVAL")
    )
    concurrent: int = Field(25, ge=1, validation_alias=_queue_var("CONCURRENT"))
    concurrent_factor: int = Field(2, ge=1, validation_alias=_queue_var("CONCURRENT_FACTOR"))
    interval: int = Field(200, ge=1, validation_alias=_queue_var("INTERVAL"))
    max_pending_ttl: int = Field(30_000, ge=1, validation_alias=_queue_var("MAX_PENDING_TTL"))
    max_pending_ttl_margin: int = Field(
        5_000, ge=0, validation_alias=_queue_var("MAX_PENDING_TTL_MARGIN")
    )
    max_retries: int = Field(100, ge=0, validation_alias=_queue_var("MAX_RETRIES"))
    message_ttl: int = Field(10_000, ge=1, validation_alias=_queue_var("MESSAGE_TTL"))
    sent_message_ttl: int = Field(5_000, ge=1, validation_alias=_queue_var("SENT_MESSAGE_TTL"))
    queue_database: str = Field("REDIS", validation_alias=_queue_var("DATABASE"))
    metrics_partial_interval: int = Field(
        30_000, ge=1, validation_alias=_queue_var("METRICS_PARTIAL_INTERVAL")
    )
    logging_extra_time_metrics: bool = Field(
        False, validation_alias="AURA_LOGGING_EXTRA_TIME_METRICS"
    )

    @field_validator("queue_database")
    @classmethod
    def _only_redis(cls, value: str) -> str:
        upper = value.strip().upper()
        if upper == "MONGODB":
            raise ValueError(
                "MONGODB is not supported by orderly: the queue structures live in Redis; "
                "set AURA_QUEUE_MANAGER_DATABASE=REDIS or leave it unset"
            )
        if upper != "REDIS":
            raise ValueError(f"unknown queue database {value!r}; the only value is REDIS")
        return upper

    @field_validator("channels", mode="before")
    @classmethod
    def _channels_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f'ORDERLY_CHANNELS must be a JSON object like {{"origin": "http://..."}}: {exc}'
                ) from None
        return value

    @field_validator("channels")
    @classmethod
    def _channel_urls(cls, value: dict[str, str]) -> dict[str, str]:
        for origin, url in value.items():
            if not origin.strip():
                raise ValueError("an origin name is empty")
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"the URL of origin {origin!r} must start with http:// or https://"
                )
        return value

    @model_validator(mode="after")
    def _tracking_times(self) -> Settings:
        if self.track_message_expire_ms <= self.track_message_timeout_ms:
            raise ValueError(
                "ORDERLY_TRACK_MESSAGE_EXPIRE_MS must be longer than "
                "ORDERLY_TRACK_MESSAGE_TIMEOUT_MS, or the monitor cannot see timeouts"
            )
        if self.service_expire_ms < 2 * self.heartbeat_interval_ms:
            raise ValueError(
                "ORDERLY_SERVICE_EXPIRE_MS must be at least twice ORDERLY_HEARTBEAT_INTERVAL, "
                "or a worker's key expires between two renewals"
            )
        return self

    @field_validator("report_jdbc_url")
    @classmethod
    def _jdbc_postgres(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("jdbc:postgresql://"):
            raise ValueError(
                "ORDERLY_REPORT_JDBC_URL must be a jdbc:postgresql://host:port/database URL, "
                f"got {value.split('?', 1)[0]!r}"
            )
        return value

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: str) -> str:
        if not value.startswith("postgresql"):
            raise ValueError(
                f"ORDERLY_DATABASE_URL must be a postgresql:// URL, got {value.split(':', 1)[0]!r}"
            )
        return value

    @field_validator("redis_url", "broker_url", "track_redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis:// URL")
        return value

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def effective_track_redis_url(self) -> str:
        return self.track_redis_url or self.redis_url

    @property
    def handler_module_list(self) -> list[str]:
        return [m.strip() for m in self.handler_modules.split(",") if m.strip()]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
