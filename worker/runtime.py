"""Per-process wiring of the mechanisms from settings: engine, node, configuration, handlers,
the broker.

Faces (Celery tasks, beat agents, the HTTP API, the CLI) take what they need from here; the
mechanisms themselves receive everything as arguments.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from functools import cached_property, lru_cache
from typing import Any

import redis
from redis import Redis
from sqlalchemy import Engine

from orderly.models.keys import BEAT_LEADER_KEY, TrackKeys
from orderly.worker import configuration, nodes, readiness, totals
from orderly.worker.broker import Broker
from orderly.worker.channels import ChannelDirectory
from orderly.worker.configuration import ConfigReader
from orderly.worker.conversations import Conversations
from orderly.worker.core.clients import OrderingRedis, ordering_client, redis_client
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.core.http import HttpOptions, OutboundHttp
from orderly.worker.core.lease import Leadership
from orderly.worker.core.limits import TimeLimits
from orderly.worker.core.ratelimit import REDIS_TIMEOUT_S, Buckets
from orderly.worker.core.scripts import Scripts
from orderly.worker.db.db import engine_for
from orderly.worker.delivery import HttpSender
from orderly.worker.loss_watch import LossWatch
from orderly.worker.messages import abort
from orderly.worker.messages.handlers import HandlerRegistry, load_handler_modules, registry
from orderly.worker.messages.intake import Intake
from orderly.worker.messages.processing import Processor
from orderly.worker.messages.rates import StartRates
from orderly.worker.messages.wake import STALE_MS, Wake
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.endpoints import (
    SYSTEM_ROOM,
    EndpointPolicy,
    Endpoints,
    publish_system_event,
)
from orderly.worker.pubsub.publish_group import GroupedPublisher
from orderly.worker.pubsub.waiting import PullWaiters
from orderly.worker.settings import Settings, get_settings
from orderly.worker.signing import SigningSecrets
from orderly.worker.tracking import ServiceLease, Services, Tracker, TrackingPolicy


class Runtime:
    def __init__(self, settings: Settings, clock: Clock = SYSTEM) -> None:
        self.settings = settings
        self.clock = clock
        self._node_lock = threading.Lock()
        self._node_id: int | None = None
        # This worker's id in the service lifecycle keys, and its lease (set by a worker).
        self.service_id: int | None = None
        self.service_lease: ServiceLease | None = None
        # Beat's watch for a lost Redis, while it runs (worker.loss_watch; a plain Redis only).
        self.loss_watch: LossWatch | None = None
        self._broker: Broker | None = None

    @cached_property
    def engine(self) -> Engine:
        s = self.settings
        return engine_for(
            s.database_url, s.connect_timeout_s, s.database_pool_size, s.database_max_overflow
        )

    @cached_property
    def config(self) -> ConfigReader:
        return ConfigReader(self.engine)

    @cached_property
    def registry(self) -> HandlerRegistry:
        load_handler_modules(self.settings.handler_module_list)
        return registry

    def startup_check(self, *, redis: bool = True) -> None:
        """Stop on a database URL that reaches PostgreSQL through a pooler (PostgreSQLPooled);
        seed missing configuration defaults and stop on an inconsistent table; with ``redis``,
        stop on a Redis that may evict orderly's keys (RedisMayEvict) unless
        ORDERLY_REDIS_EVICTION_ALLOWED."""
        readiness.direct_postgresql(self.engine)
        configuration.startup_check(self.engine)
        if redis:  # (a Redis down now is no reason not to start: /ready names it)
            readiness.keeps_keys(
                self.redis_clients, self.settings.redis_eviction_allowed, unreachable_ok=True
            )

    @property
    def redis_clients(self) -> list[OrderingRedis]:
        """Every Redis this process uses: the broker's and wake's, tracking's when separate,
        the ordering structures' cluster when there is one."""
        found: list[OrderingRedis] = [self.redis]
        if self.settings.track_redis_url is not None:
            found.append(self.tracking_redis)
        if self.settings.redis_cluster:
            found.append(self.ordering_redis)
        return found

    @property
    def node_id(self) -> int:
        with self._node_lock:
            if self._node_id is None:
                self._node_id = nodes.register_node(self.engine, self.settings.node_code)
            return self._node_id

    @cached_property
    def http(self) -> OutboundHttp:
        """The one outbound HTTP client of this process."""
        s = self.settings
        return OutboundHttp(
            HttpOptions(
                connect_timeout_s=s.http_connect_timeout_ms / 1000,
                proxy=s.http_proxy,
                ca_bundle=s.http_ca_bundle,
                max_response_bytes=s.http_max_response_bytes,
                policy=s.outbound_policy,
            ),
            signer=lambda kind, name: self.signing.for_send(kind, name),
        )

    @cached_property
    def signing(self) -> SigningSecrets:
        """The secrets outbound requests are signed with (worker.signing)."""
        return SigningSecrets(self.engine)

    @cached_property
    def sender(self) -> HttpSender:
        return HttpSender(self.http)

    @cached_property
    def processor(self) -> Processor:
        return Processor(
            self.engine,
            node_id=self.node_id,
            registry=self.registry,
            config=self.config,
            max_payload_bytes=self.settings.max_payload_bytes,
            tracker=self.tracker,
            http=self.http,
            worker_lost_limit=self.settings.worker_lost_limit,
            limits=self.time_limits,
            default_time_limit_s=(self.settings.handler_time_limit_ms / 1000) or None,
            aborts=self.aborts,
            rates=StartRates(self.redis, self.clock),
        )

    @cached_property
    def pull_waiters(self) -> PullWaiters:
        """The long polls of PULL consumers waiting in this (API) process."""
        return PullWaiters(self.settings.redis_url)

    @cached_property
    def endpoints(self) -> Endpoints:
        """The PUSH endpoints' pace (rates in Redis) and health."""
        s = self.settings
        policy = EndpointPolicy(
            s.endpoint_circuit_failures, s.endpoint_probe_max_ms, s.endpoint_disable_after_s
        )
        # its own client: a slow Redis costs a send at most REDIS_TIMEOUT_S (then fail open),
        # never holds the endpoints' row locks the claim takes before it
        client = redis_client(
            s.redis_url,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            socket_timeout=REDIS_TIMEOUT_S,
        )
        return Endpoints(policy, Buckets(client), self.clock, announce=self.announce_event)

    def announce_event(self, room: str, routing_key: str, payload: dict[str, Any]) -> None:
        """An operational event to the system room (``room``), handed to the broker."""
        if room != SYSTEM_ROOM:
            raise ValueError(f"operational events go to {SYSTEM_ROOM}, not {room}")
        publish_system_event(
            self.engine,
            routing_key,
            payload,
            self.broker.enqueue_event_deliveries,
            self.settings.token_secret,
        )

    @cached_property
    def aborts(self) -> abort.AbortWatch:
        """Cancels of the messages this process runs (its listener starts with its first run)."""
        s = self.settings
        return abort.AbortWatch(
            lambda: abort.listening_client(s.redis_url, s.connect_timeout_s),
            functools.partial(abort.claim_gone, self.engine),
            s.abort_grace_ms / 1000,
            clock=self.clock,
        )

    def announce_aborts(self, msg_ids: Sequence[int]) -> None:
        """After a cancel committed: the workers running these messages stop them."""
        abort.announce(self.redis, msg_ids, clock=self.clock)

    @cached_property
    def time_limits(self) -> TimeLimits:
        """The handlers' time limits in this process (the kill grace and its watchdog)."""
        return TimeLimits(self.settings.handler_kill_grace_ms / 1000)

    @cached_property
    def node_view(self) -> nodes.NodeFollower:
        """This process's node state for its tasks: read at most once a second, so a task's
        check costs no query on the hot path (a worker's main process follows the node with
        its heartbeat and stops consuming within one)."""
        return nodes.NodeFollower(self.engine, self.node_id, 1.0, self.clock, beat=False)

    @cached_property
    def redis(self) -> redis.Redis:
        return redis_client(
            self.settings.redis_url, socket_connect_timeout=self.settings.connect_timeout_s
        )

    @cached_property
    def ordering_redis(self) -> OrderingRedis:
        """The conversations' ordering structures: ORDERLY_REDIS_URL's Redis, or the Redis
        Cluster of ORDERLY_REDIS_CLUSTER_NODES when ORDERLY_REDIS_CLUSTER is set (the broker,
        tracking and the wake key stay on ORDERLY_REDIS_URL)."""
        s = self.settings
        if not s.redis_cluster:
            return self.redis
        return ordering_client(s.redis_url, s.cluster_nodes, s.connect_timeout_s)

    @cached_property
    def tracking_redis(self) -> Redis:
        """serviceRedis: the tracking keys' Redis (the same client when it is not separate)."""
        if self.settings.track_redis_url is None:
            return self.redis
        return redis_client(
            self.settings.track_redis_url, socket_connect_timeout=self.settings.connect_timeout_s
        )

    @cached_property
    def track_keys(self) -> TrackKeys:
        return TrackKeys(self.settings.track_namespace)

    @cached_property
    def tracking_policy(self) -> TrackingPolicy:
        s = self.settings
        return TrackingPolicy(
            timeout_ms=s.track_message_timeout_ms,
            expire_ms=s.track_message_expire_ms,
            capacity=s.track_message_capacity,
            retry_attempts=s.track_retry_attempts,
            retry_delay_ms=s.track_retry_delay_ms,
            retry_multiplier=s.track_retry_multiplier,
            retry_max_delay_ms=s.track_retry_max_delay_ms,
        )

    @cached_property
    def tracker(self) -> Tracker:
        return Tracker(
            self.tracking_redis,
            self.track_keys,
            self.tracking_policy,
            str(self.service_id or ""),
            clock=self.clock,
        )

    @cached_property
    def services(self) -> Services:
        return Services(self.tracking_redis, self.track_keys)

    @cached_property
    def channels(self) -> ChannelDirectory:
        return ChannelDirectory(self.engine, self.settings, self.clock)

    @cached_property
    def conversations(self) -> Conversations:
        return Conversations(
            self.engine,
            self.ordering_redis,
            self.settings,
            node_id=self.node_id,
            channels=self.channels,
            clock=self.clock,
        )

    @cached_property
    def publisher(self) -> GroupedPublisher:
        """The API's publishes through this node; concurrent ones share commits
        (ORDERLY_INTAKE_GROUP_MAX)."""
        return GroupedPublisher(
            self.engine,
            lambda due: self.broker.enqueue_event_deliveries(due),
            node_id=self.node_id,
            secret=self.settings.token_secret,
            token_ttl_ms=self.settings.token_ttl_ms,
            max_payload_bytes=self.settings.max_payload_bytes,
            schema_limits=schemas.configured_limits(self.settings),
            group_max=self.settings.intake_group_max,
            clock=self.clock,
        )

    def intake(
        self,
        enqueue: Callable[[int], None],
        wake: Callable[[], object] | None = None,
        *,
        grouped: bool = False,
    ) -> Intake:
        """Intake through this node; ``grouped``: concurrent single submits share commits
        (ORDERLY_INTAKE_GROUP_MAX; the API's requests, Intake.submit_together)."""
        return Intake(
            self.engine,
            node_id=self.node_id,
            enqueue=enqueue,
            registry=self.registry,
            max_payload_bytes=self.settings.max_payload_bytes,
            wake=wake,
            group_max=self.settings.intake_group_max if grouped else 0,
        )

    @property
    def broker(self) -> Broker:
        """What this process sends tasks through: the one given to :meth:`use_broker`, else
        the Celery app's (built on first use)."""
        if self._broker is None:
            self._broker = _celery_broker()
        return self._broker

    def use_broker(self, broker: Broker) -> None:
        """Send through ``broker`` from now on (a test's stub; ``create_app(broker=...)``)."""
        self._broker = broker

    @cached_property
    def wake(self) -> Wake:
        """The wake-up of workers for due messages (one pending at a time)."""
        return Wake(self.redis)

    @cached_property
    def beat_leadership(self) -> Leadership:
        """Which beat runs the agents: one among the nodes' beats (the others hand out due
        work only)."""
        return Leadership(Scripts(self.redis), BEAT_LEADER_KEY, clock=self.clock)

    def wake_processing(self) -> bool:
        """Wake a worker to claim due messages, unless one is woken already; whether a task
        was sent."""
        return self.wake.wake(self.broker.send_process_due)

    def wake_stale(self) -> bool:
        """Wake a worker to claim due messages, also past a woken or looking mark that has
        not moved for ``STALE_MS`` (messages have waited: its holder is gone); whether a task
        was sent."""
        return self.wake.wake(self.broker.send_process_due, stale_ms=STALE_MS)

    def count_totals(self) -> None:
        """Add what this process counts to the metrics' running totals (worker.totals)."""
        totals.attach(self.engine, self.settings.metrics_flush_s)

    def after_fork(self) -> None:
        """A forked child must not share its parent's database connections."""
        if "engine" in self.__dict__:
            self.engine.dispose(close=False)


def _celery_broker() -> Broker:
    """The Celery app's broker. The one import of the Celery app module outside the Celery
    faces, made here and on first use: importing Celery and building its app costs about half
    a second, which a command that sends nothing (``orderly --help``) must not pay
    (tests/test_layout.py allows this one place)."""
    from orderly.worker.celery import broker

    return broker


@lru_cache(maxsize=1)
def get_runtime() -> Runtime:
    return Runtime(get_settings())
