"""Conversation delivery: channels and their retry policy, the bridge keys, and the
``AURA_QUEUE_MANAGER_*`` variables of the ordered-response seed (milliseconds unless said
otherwise), with the seed's names, units and defaults."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from orderly.models.keys import CLUSTER_SHARDS, DEFAULT_SHARDS
from orderly.worker.settings._base import Section, queue_var


class ConversationSettings(Section):
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
    channel_multiplier: float = Field(
        1.5,
        ge=1.0,
        le=100.0,
        validation_alias="ORDERLY_CHANNEL_MULTIPLIER",
        description="A channel's default backoff multiplier.",
    )
    channel_attempts: int = Field(
        3,
        ge=0,
        le=100,
        validation_alias="ORDERLY_CHANNEL_ATTEMPTS",
        description="Retries after a recoverable failure before the group becomes AWAITED.",
    )
    channel_timeout_ms: int = Field(
        5_000,
        ge=1,
        validation_alias="ORDERLY_CHANNEL_TIMEOUT_MS",
        description="How long a POST to a channel may take, in ms (below "
        "`AURA_QUEUE_MANAGER_MAX_PENDING_TTL`).",
    )
    bridge_prefix: str = Field(
        "bridge:queue",
        min_length=1,
        validation_alias="ORDERLY_BRIDGE_PREFIX",
        description="Prefix of every conversation key in Redis (the seed's bridge:queue).",
    )
    redis_shards: int | None = Field(
        None,
        ge=1,
        le=1024,
        validation_alias="ORDERLY_REDIS_SHARDS",
        description=f"Shards of the conversation keys: each has its own pendingMessages, "
        f"scheduled and drains under one Redis Cluster hash tag. Default {DEFAULT_SHARDS} on "
        f"one Redis, {CLUSTER_SHARDS} on a Redis Cluster (ORDERLY_REDIS_CLUSTER), whose hash "
        f"tags fall 21/21/22 on three primaries ({DEFAULT_SHARDS}: 3/8/5). A change is a "
        "rebuild from PostgreSQL (beat starts it; see docs/redis-cluster.md).",
    )
    drain_batch: int = Field(
        100,
        ge=1,
        validation_alias="ORDERLY_DRAIN_BATCH",
        description="Deliveries one task makes before handing the conversation to a new task.",
    )

    awaited_message_ttl: int = Field(
        900_000,
        ge=1,
        validation_alias=queue_var("AWAITED_MESSAGE_TTL"),
        description="Maximum lifetime of a response, in ms; then it is FAILED (`E_AWAITED_TTL`).",
    )
    awaited_messages_by_turn: int = Field(
        15,
        ge=1,
        validation_alias=queue_var("AWAITED_MESSAGES_BY_TURN"),
        description="Responses the awaited agent takes per turn.",
    )
    awaited_messages_interval: int = Field(
        20_000,
        ge=1,
        validation_alias=queue_var("AWAITED_MESSAGES_INTERVAL"),
        description="ms between the awaited agent's turns.",
    )
    awaited_retries_factor: float = Field(
        1,
        gt=0,
        validation_alias=queue_var("AWAITED_RETRIES_FACTOR"),
        description="Awaited backoff: `awaitedRetries * MAX_PENDING_TTL * factor`.",
    )
    awaited_time_when_retries_end: int = Field(
        5_000,
        ge=0,
        validation_alias=queue_var("AWAITED_TIME_WHEN_RETRIES_END"),
        description="ms before a response AWAITED after its attempts ran out is tried again.",
    )
    check_queue_interval: int = Field(
        1_000,
        ge=1,
        le=3_600_000,
        validation_alias=queue_var("CHECK_QUEUE_INTERVAL"),
        description="Beat's wait after a turn that found no due work (INTERVAL after one that "
        "found some); at least INTERVAL.",
    )
    concurrent: int = Field(
        25,
        ge=1,
        le=1000,
        validation_alias=queue_var("CONCURRENT"),
        description="The most tasks a worker runs at once. Its pool forks one process per "
        "task, and no more processes than the machine has cores: min(CONCURRENT, cores) "
        "(`orderly worker --concurrency N` sets the pool outright, e.g. for handlers that "
        "mostly wait on other systems).",
    )
    concurrent_factor: int = Field(
        2,
        ge=1,
        le=100,
        validation_alias=queue_var("CONCURRENT_FACTOR"),
        description="A worker holds at most FACTOR tasks per pool process from the broker "
        "(running and reserved): Celery's prefetch multiplier.",
    )
    interval: int = Field(
        200,
        ge=1,
        validation_alias=queue_var("INTERVAL"),
        description="ms between beat's ticker turns while there is due work.",
    )
    max_pending_ttl: int = Field(
        30_000,
        ge=1,
        validation_alias=queue_var("MAX_PENDING_TTL"),
        description="A conversation's drain lease, in ms; a response in flight longer (plus "
        "the margin) becomes AWAITED.",
    )
    max_pending_ttl_margin: int = Field(
        5_000,
        ge=0,
        validation_alias=queue_var("MAX_PENDING_TTL_MARGIN"),
        description="ms added to the in-flight limit.",
    )
    max_retries: int = Field(
        100,
        ge=0,
        validation_alias=queue_var("MAX_RETRIES"),
        description="With `INTERVAL`, the blocked limit: a response blocked "
        "`MAX_RETRIES * INTERVAL` ms becomes AWAITED.",
    )
    # A request's life after its last activity; a response after it is late (it goes after
    # later requests' responses, marked: X-Orderly-Late, message.late_ms).
    message_ttl: int = Field(
        10_000,
        ge=1,
        validation_alias=queue_var("MESSAGE_TTL"),
        description="Lifetime of a request after its last activity, in ms; a response after "
        "it is delivered late, marked.",
    )
    sent_message_ttl: int = Field(
        5_000,
        ge=1,
        validation_alias=queue_var("SENT_MESSAGE_TTL"),
        description="ms a SENT response waits for its ACK before it counts as delivered.",
    )
    queue_database: str = Field(
        "REDIS",
        validation_alias=queue_var("DATABASE"),
        description="The queue database: REDIS (MONGODB is refused at start-up).",
    )
    metrics_partial_interval: int = Field(
        30_000,
        ge=1,
        validation_alias=queue_var("METRICS_PARTIAL_INTERVAL"),
        description="ms between partial queue metrics in the log (beat's queue-metrics job, "
        "with AURA_LOGGING_EXTRA_TIME_METRICS).",
    )
    logging_extra_time_metrics: bool = Field(
        False,
        validation_alias="AURA_LOGGING_EXTRA_TIME_METRICS",
        description="Turns the partial queue metrics on.",
    )

    @field_validator("bridge_prefix")
    @classmethod
    def _no_hash_tag(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError("may not contain { or }: the keys' Redis Cluster hash tag follows it")
        return value

    def shard_count(self, cluster: bool) -> int:
        """ORDERLY_REDIS_SHARDS, or its default on a Redis Cluster (``cluster``) or one Redis."""
        if self.redis_shards is not None:
            return self.redis_shards
        return CLUSTER_SHARDS if cluster else DEFAULT_SHARDS

    @property
    def pool_processes(self) -> int:
        """A worker's pool: CONCURRENT processes, but no more than the machine's cores (the
        seed's memory queue ran its CONCURRENT messages in one process; more processes than
        cores only add memory to CPU-bound handlers)."""
        return max(1, min(self.concurrent, len(os.sched_getaffinity(0))))

    @model_validator(mode="after")
    def _idle_not_shorter(self) -> ConversationSettings:
        if self.check_queue_interval < self.interval:
            raise ValueError(
                "AURA_QUEUE_MANAGER_CHECK_QUEUE_INTERVAL (the idle wait) may not be shorter "
                f"than AURA_QUEUE_MANAGER_INTERVAL (the busy one): {self.check_queue_interval} "
                f"< {self.interval}"
            )
        return self

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
            if len(origin) > 100:
                raise ValueError(f"the origin {origin[:20]!r}... is over 100 characters")
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"the URL of origin {origin!r} must start with http:// or https://"
                )
        return value
