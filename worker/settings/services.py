"""Where orderly's services are and how this process takes part: PostgreSQL, Redis, the
broker, the node, handlers, the API's address, heartbeats and logging."""

from __future__ import annotations

import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orderly.worker.core.clients import SENTINEL_SCHEME, SentinelUrl
from orderly.worker.settings._base import Section

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://")


def redis_url_only(value: str | None) -> str | None:
    """A plain Redis URL setting's check: redis://, rediss:// or unix://, or its Sentinels'
    redis+sentinel:// URL (parsed here: a malformed one is named at start-up)."""
    if value is not None and value.startswith(SENTINEL_SCHEME):
        SentinelUrl.parse(value)
    elif value is not None and not value.startswith(REDIS_SCHEMES):
        raise ValueError("must be a redis:// URL, or redis+sentinel:// naming its Sentinels")
    return value


class ServiceSettings(Section):
    database_url: str = Field(
        "postgresql+psycopg2://postgres@127.0.0.1:5432/orderly",
        validation_alias="ORDERLY_DATABASE_URL",
        description="SQLAlchemy URL of the PostgreSQL message store: the server itself, not "
        "a connection pooler (PgBouncer and the like are refused at start-up).",
    )
    database_pool_size: int = Field(
        10,
        ge=1,
        le=1000,
        validation_alias="ORDERLY_DATABASE_POOL_SIZE",
        description="PostgreSQL connections a process (the API, beat, each worker process) "
        "keeps open once it has used them.",
    )
    database_max_overflow: int = Field(
        20,
        ge=0,
        le=1000,
        validation_alias="ORDERLY_DATABASE_MAX_OVERFLOW",
        description="Connections a process may open beyond ORDERLY_DATABASE_POOL_SIZE at a "
        "busy moment (closed again when returned); a process holds at most the sum, and "
        "waits for a free one beyond it.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias="ORDERLY_REDIS_URL",
        description="The plain Redis: the ordering structures (unless ORDERLY_REDIS_CLUSTER), "
        "the wake key, leases, rate limits and tracking (unless ORDERLY_TRACK_REDIS_URL); also "
        "the broker unless ORDERLY_BROKER_URL. redis://, rediss://, unix://, or "
        "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db] for a "
        "Sentinel-managed primary (followed across failovers; then ORDERLY_BROKER_URL is "
        "needed).",
    )
    broker_url: str | None = Field(
        None,
        validation_alias="ORDERLY_BROKER_URL",
        description="Celery broker URL (defaults to ORDERLY_REDIS_URL): a redis:// URL, or "
        "RabbitMQ's amqp:// (amqps://) URL, where orderly's queues are durable quorum queues "
        "and every send waits for the broker's confirm.",
    )
    redis_cluster: bool = Field(
        False,
        validation_alias="ORDERLY_REDIS_CLUSTER",
        description="The conversations' ordering structures on a Redis Cluster "
        "(ORDERLY_REDIS_CLUSTER_NODES); the broker, tracking and the wake key stay on "
        "ORDERLY_REDIS_URL.",
    )
    redis_cluster_nodes: str = Field(
        "",
        validation_alias="ORDERLY_REDIS_CLUSTER_NODES",
        description="Comma-separated host:port startup nodes of the Redis Cluster (required "
        "with ORDERLY_REDIS_CLUSTER=true); the client learns the others from them.",
    )

    redis_eviction_allowed: bool = Field(
        False,
        validation_alias="ORDERLY_REDIS_EVICTION_ALLOWED",
        description="Start even though a Redis orderly uses may evict its keys (a maxmemory "
        "with a maxmemory-policy other than noeviction: every conversation key has a TTL, so "
        "volatile-* policies evict them too). Without it the API, workers and beat refuse to "
        "start on such a Redis and GET /ready answers 503 naming it; with it they start, "
        "warn, and beat's sweep rebuilds the conversations whose keys are gone from their "
        "rows (ORDERLY_REDIS_SWEEP_INTERVAL_MS).",
    )
    redis_sweep_interval_ms: int = Field(
        2_000,
        ge=0,
        validation_alias="ORDERLY_REDIS_SWEEP_INTERVAL_MS",
        description="In ms, how often beat looks for conversations whose rows are open but "
        "whose keys Redis lost under a live marker (evicted, deleted by hand); one seen so "
        "twice in a row with the same rows is rebuilt from them. One query a page of 500 "
        "conversations and one pipelined round trip; 0: never.",
    )

    node_code: str = Field(
        default_factory=socket.gethostname,
        validation_alias="ORDERLY_NODE_CODE",
        description="This process's node code in the node table (default: the hostname).",
    )
    handler_modules: str = Field(
        "",
        validation_alias="ORDERLY_HANDLER_MODULES",
        description="Comma-separated modules that register message handlers (none by default).",
    )
    max_payload_bytes: int = Field(
        1_048_576,
        ge=1,
        validation_alias="ORDERLY_MAX_PAYLOAD_BYTES",
        description="Largest payload accepted at intake, in bytes (UTF-8).",
    )
    max_batch_bytes: int = Field(
        16_777_216,
        ge=65_536,
        le=1_073_741_824,
        validation_alias="ORDERLY_MAX_BATCH_BYTES",
        description="Largest body of POST /messages:batch, in bytes (each message's payload "
        "still within ORDERLY_MAX_PAYLOAD_BYTES).",
    )
    api_workers: int = Field(
        1,
        ge=1,
        le=64,
        validation_alias="ORDERLY_API_WORKERS",
        description="Processes of `orderly api` (uvicorn's --workers): one serves requests on "
        "one core; more share the port.",
    )
    intake_group_max: int = Field(
        256,
        ge=0,
        le=1000,
        validation_alias="ORDERLY_INTAKE_GROUP_MAX",
        description="At most this many requests of one kind that arrive together in one API "
        "process are stored with one commit, each answered after it (group commit; a waiting "
        "request holds no thread): single submits (POST /messages without a parent or a "
        "funnel) and conversation requests and responses with one INSERT, publishes without "
        "an Idempotency-Key in one transaction; 0: each its own transaction in a thread.",
    )
    api_host: str = Field(
        "127.0.0.1",
        validation_alias="ORDERLY_API_HOST",
        description="Address `orderly api` listens on (uvicorn's `--host` when run directly).",
    )
    api_port: int = Field(
        8000,
        ge=1,
        le=65535,
        validation_alias="ORDERLY_API_PORT",
        description="Port `orderly api` listens on (uvicorn's `--port` when run directly).",
    )
    retry_after_s: int = Field(
        1,
        ge=1,
        le=3600,
        validation_alias="ORDERLY_RETRY_AFTER_S",
        description="The Retry-After (seconds) of a 503: PostgreSQL, Redis or the broker "
        "unreachable, or a node that accepts no new input.",
    )
    connect_timeout_s: int = Field(
        5,
        ge=2,
        le=300,
        validation_alias="ORDERLY_CONNECT_TIMEOUT_S",
        description="How long opening a connection to PostgreSQL or Redis may take before it "
        "fails (a server that does not answer: a lost route, a dropped SYN); on RabbitMQ, "
        "also how long a send waits for the broker's confirm.",
    )
    ready_timeout_ms: int = Field(
        2_000,
        ge=50,
        le=30_000,
        validation_alias="ORDERLY_READY_TIMEOUT_MS",
        description="How long GET /ready waits for each of PostgreSQL, Redis and the broker.",
    )
    ready_cache_ms: int = Field(
        1_000,
        ge=0,
        le=60_000,
        validation_alias="ORDERLY_READY_CACHE_MS",
        description="How long a GET /ready verdict stands, in ms: however many ask meanwhile "
        "(it needs no key), PostgreSQL, Redis and the broker are checked once per this, and "
        "requests that come during a check share it. 0: every request checks.",
    )
    heartbeat_interval_ms: int = Field(
        5_000,
        ge=100,
        validation_alias="ORDERLY_HEARTBEAT_INTERVAL",
        description="In milliseconds, how often a worker renews its node row and checks its state.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        validation_alias="ORDERLY_LOG_FORMAT",
        description="text, or json: one JSON object per line with msg_id, conversation_id, "
        "correlation_id, task and node where known.",
    )
    metrics_flush_s: float = Field(
        1.0,
        gt=0,
        le=60,
        validation_alias="ORDERLY_METRICS_FLUSH_S",
        description="In seconds, how often a process adds what it counted (handler runs, sends,"
        " HTTP requests) to the metrics' running totals in PostgreSQL; nothing is written while"
        " nothing is counted.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        validation_alias="ORDERLY_LOG_LEVEL",
        description="Log level of the API and the CLI (Celery processes take --loglevel).",
    )

    worker_lost_limit: int = Field(
        3,
        ge=1,
        le=100,
        validation_alias="ORDERLY_WORKER_LOST_LIMIT",
        description="Deaths of its worker (SIGKILL, OOM, a crash) a message or a pub/sub delivery "
        "may cause before it is quarantined: FAILED (a delivery: DEAD) with E_WORKER_LOST "
        "instead of claimed again. A death counts when the claim (a delivery's: its batch) "
        "held it alone; one in a claim of several counts against none and isolates them (each "
        "is claimed alone from then on, where its deaths count).",
    )

    handler_time_limit_ms: int = Field(
        7_000,
        ge=0,
        le=86_400_000,
        validation_alias="ORDERLY_HANDLER_TIME_LIMIT_MS",
        description="A handler's time limit unless it declares its own (time_limit_s): past "
        "it the handler is stopped (E_TIME_LIMIT). 0: handlers that declare none run "
        "unlimited, and only the tracking timeout takes a hung one back.",
    )
    handler_kill_grace_ms: int = Field(
        1_000,
        ge=100,
        le=600_000,
        validation_alias="ORDERLY_HANDLER_KILL_GRACE_MS",
        description="How long a handler past its time limit has to stop before its worker "
        "process is killed (the hard limit).",
    )
    abort_grace_ms: int = Field(
        300,
        ge=0,
        le=60_000,
        validation_alias="ORDERLY_ABORT_GRACE_MS",
        description="How long a handler whose message was cancelled while it ran has to "
        "return once it can see ctx.aborted: then Aborted is raised inside it, and its "
        "process is killed ORDERLY_HANDLER_KILL_GRACE_MS later if it still runs. 0: at once.",
    )

    claim_batch: int = Field(
        100,
        ge=1,
        le=1000,
        validation_alias="ORDERLY_CLAIM_BATCH",
        description="The most due messages a worker claims at once and processes as one "
        "batch (their OK outcomes written in one statement; at most one of a funnel). A claim "
        "takes one at a time while some handler runs without a time limit.",
    )

    broker_visibility_timeout_s: int = Field(
        3600,
        ge=1,
        validation_alias="ORDERLY_BROKER_VISIBILITY_TIMEOUT",
        description="Seconds before the Redis broker redelivers a task taken but not acknowledged.",
    )

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: str) -> str:
        if not value.startswith(("postgresql", "postgres://")):
            raise ValueError(
                f"ORDERLY_DATABASE_URL must be a postgresql:// URL, got {value.split(':', 1)[0]!r}"
            )
        # orderly's driver is psycopg2: a plain postgresql:// URL means it.
        if value.startswith(("postgresql://", "postgres://")):
            return "postgresql+psycopg2://" + value.split("://", 1)[1]
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        return redis_url_only(value)

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(SENTINEL_SCHEME):
            raise ValueError(
                "a Sentinel-managed Redis cannot carry the Celery broker here: use RabbitMQ's "
                "amqp:// URL (the highly available broker) or a redis:// URL"
            )
        if value is not None and not value.startswith(REDIS_SCHEMES + AMQP_SCHEMES):
            raise ValueError("must be a redis:// URL or RabbitMQ's amqp:// URL")
        return value

    @field_validator("redis_cluster_nodes")
    @classmethod
    def _host_ports(cls, value: str) -> str:
        for node in (n.strip() for n in value.split(",") if n.strip()):
            host, sep, port = node.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{node!r} is not host:port (a port 1..65535)")
        return value

    @model_validator(mode="after")
    def _broker_not_on_sentinel(self) -> ServiceSettings:
        if self.broker_url is None and self.redis_url.startswith(SENTINEL_SCHEME):
            raise ValueError(
                "ORDERLY_REDIS_URL names a Sentinel-managed Redis, which cannot carry the "
                "Celery broker here: set ORDERLY_BROKER_URL to RabbitMQ's amqp:// URL (the "
                "highly available broker) or to a redis:// URL"
            )
        return self

    @model_validator(mode="after")
    def _cluster_has_nodes(self) -> ServiceSettings:
        if self.redis_cluster and not self.cluster_nodes:
            raise ValueError(
                "ORDERLY_REDIS_CLUSTER=true needs ORDERLY_REDIS_CLUSTER_NODES "
                "(host:port of one or more cluster nodes)"
            )
        return self

    @property
    def cluster_nodes(self) -> list[tuple[str, int]]:
        """ORDERLY_REDIS_CLUSTER_NODES as (host, port) pairs."""
        found = []
        for node in (n.strip() for n in self.redis_cluster_nodes.split(",") if n.strip()):
            host, _, port = node.rpartition(":")
            found.append((host, int(port)))
        return found

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def broker_is_amqp(self) -> bool:
        """The broker is RabbitMQ (an amqp:// URL), not a Redis."""
        return self.effective_broker_url.startswith(AMQP_SCHEMES)

    @property
    def handler_module_list(self) -> list[str]:
        return [m.strip() for m in self.handler_modules.split(",") if m.strip()]
