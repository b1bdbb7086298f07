"""What every part of conversation delivery shares: the stores, the keys, the clock, the
seed's timings in milliseconds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from sqlalchemy import Engine

from orderly.models.keys import BridgeKeys
from orderly.worker.channels import ChannelDirectory
from orderly.worker.core.clients import OrderingRedis
from orderly.worker.core.clock import Clock, now_ms
from orderly.worker.core.scripts import Scripts
from orderly.worker.db.prepared import PreparedConnection, prepared_connection
from orderly.worker.settings import Settings


@dataclass
class Context:
    engine: Engine
    redis: OrderingRedis  # a plain Redis or a Redis Cluster (worker.core.clients)
    settings: Settings
    node_id: int
    channels: ChannelDirectory
    clock: Clock
    scripts: Scripts = field(init=False)
    keys: BridgeKeys = field(init=False)
    # The shard the awaited agent's next turn starts with: turns go round the shards, so a
    # turn's budget (AWAITED_MESSAGES_BY_TURN) reaches every shard in time.
    awaited_from: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.scripts = Scripts(self.redis)
        self.keys = self.settings.bridge_keys

    @contextlib.contextmanager
    def pg(self) -> Iterator[PreparedConnection]:
        with prepared_connection(self.engine) as conn:
            yield conn

    @contextlib.contextmanager
    def locked(self, conversation_id: str) -> Iterator[PreparedConnection]:
        """A transaction holding the conversation's lock (``conv_lock_all``, as a request's
        insert takes it). A Redis step that settles a response before PostgreSQL records it
        (an ACK, a deletion, a scheduled removal) runs inside, with that record: a repair
        (reconcile.repair), which takes the lock to read the rows, never reads them between
        the two and brings the response back."""
        with self.pg() as conn, conn.transaction():
            conn.run("conv_lock_all", [conversation_id])
            yield conn

    def now_ms(self) -> int:
        return now_ms(self.clock)

    @property
    def lease_ms(self) -> int:
        """A drain holds its conversation this long (MAX_PENDING_TTL), renewed every step."""
        return self.settings.max_pending_ttl

    @property
    def inflight_ms(self) -> int:
        return self.settings.max_pending_ttl + self.settings.max_pending_ttl_margin

    @property
    def blocked_ms(self) -> int:
        """A response still blocked after the seed's validation budget becomes AWAITED."""
        return max(1, self.settings.max_retries * self.settings.interval)

    @property
    def awaited_step_ms(self) -> float:
        return self.settings.max_pending_ttl * self.settings.awaited_retries_factor
