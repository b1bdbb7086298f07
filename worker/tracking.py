"""Message tracking in Redis (message-tracking-timeouts.txt): ids, xids, deadlines, the done
list, the timeout monitor's turn and the metrics hashes; and the service (worker) lifecycle
keys of the same namespace.

Every check-and-act is one Lua script (worker/lua/track_*.lua, service_*.lua, run through
orderly.worker.lua). Times are
milliseconds since the epoch, given by the caller, so that a test can state them exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis

from orderly.models.keys import TrackKeys
from orderly.worker import lua
from orderly.worker.core.clock import SYSTEM, Clock, now_ms
from orderly.worker.core.errors import TrackingError
from orderly.worker.core.retry import RetryPolicy
from orderly.worker.core.scripts import Scripts, as_text
from orderly.worker.lua import MonitorTurn
from orderly.worker.lua import TimedOut as TimedOut  # a monitor turn's item, named here too

log = logging.getLogger(__name__)

# Histogram bounds (ms) of the done and timeout metrics; a larger value goes to le:+Inf.
BUCKETS_MS: tuple[int, ...] = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)

_NUMBER = re.compile(r"^[0-9]+$")


def _decoded(raw: Any) -> dict[str, str]:
    """A Redis hash reply as text (the client may be set to decode replies or not)."""
    return {as_text(k): as_text(v) for k, v in dict(raw).items()}


def claim_of(pid: int | None, claimed_at: datetime | None) -> str:
    """The tracking hash's ``claim``: the claiming backend and the claim's timestamp."""
    if pid is None or claimed_at is None:
        return ""
    return f"{pid} {claimed_at.isoformat()}"


def xid_of(message: Any) -> tuple[str, str]:
    """The message's intrinsic id and how it was found, by the seed's rules.

    A message that is itself a number is its own xid (``number``); otherwise
    ``message["meta"]["id"]`` if it has one (``meta``); otherwise the SHA1 of the message
    (``sha1``: of the text itself, or of its canonical JSON when it is not text).
    """
    if isinstance(message, bool):
        pass  # JSON true/false is no number
    elif isinstance(message, int) and message >= 0:
        return str(message), "number"
    elif isinstance(message, str) and _NUMBER.match(message):
        return message, "number"
    if isinstance(message, Mapping):
        meta = message.get("meta")
        if isinstance(meta, Mapping):
            meta_id = meta.get("id")
            if meta_id is not None and meta_id != "":
                return str(meta_id), "meta"
    if isinstance(message, str):
        text = message
    else:
        text = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest(), "sha1"


@dataclass(frozen=True)
class TrackingPolicy:
    """messageTimeout, messageExpire and messageCapacity of the seed, and orderly's retry."""

    timeout_ms: int = 10_000
    expire_ms: int = 60_000
    capacity: int = 1000
    retry_attempts: int = 3
    retry_delay_ms: int = 1_000
    retry_multiplier: float = 2.0
    retry_max_delay_ms: int = 60_000
    # How many done and listed ids one monitor turn looks at (at least the capacity).
    batch: int = 1000

    def __post_init__(self) -> None:
        if self.expire_ms <= self.timeout_ms:
            raise ValueError(
                f"messageExpire ({self.expire_ms} ms) must be longer than messageTimeout "
                f"({self.timeout_ms} ms), or the monitor cannot see timeouts"
            )
        self.retry  # noqa: B018 - validates the retry numbers now

    @property
    def retry(self) -> RetryPolicy:
        """Retry n after the n-th timeout waits retry_delay_ms * multiplier ^ n (capped)."""
        return RetryPolicy(
            self.retry_delay_ms,
            self.retry_multiplier,
            self.retry_attempts,
            max_delay_ms=self.retry_max_delay_ms,
        )


@dataclass(frozen=True)
class Histogram:
    """One ``:metrics:$name`` hash: count, sum and max (ms), buckets cumulative by bound."""

    count: int = 0
    sum_ms: int = 0
    max_ms: int | None = None
    buckets: tuple[tuple[float, int], ...] = ()

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> Histogram:
        fields = _decoded(raw)
        running, cumulative = 0, []
        for bound in (*BUCKETS_MS, float("inf")):
            label = "+Inf" if bound == float("inf") else str(bound)
            running += int(fields.get(f"le:{label}", 0))
            cumulative.append((float(bound), running))
        max_ms = fields.get("max")
        return cls(
            count=int(fields.get("count", 0)),
            sum_ms=int(fields.get("sum", 0)),
            max_ms=None if max_ms is None else int(max_ms),
            buckets=tuple(cumulative),
        )


@dataclass(frozen=True)
class TrackingSnapshot:
    done: Histogram
    timeout: Histogram
    overflow: int
    expired: int
    retried: int
    gave_up: int
    listed: int  # ids tracked now (:message:ids)
    done_waiting: int  # ids in :message:done the monitor has not taken yet


def _count(raw: Mapping[Any, Any]) -> int:
    return int(_decoded(raw).get("count", 0))


def snapshot(client: redis.Redis, keys: TrackKeys) -> TrackingSnapshot:
    """The tracking figures as they stand (one round trip)."""
    pipe = client.pipeline(transaction=True)
    for name in ("done", "timeout", "overflow", "expired", "retry", "gaveup"):
        pipe.hgetall(keys.metrics(name))
    pipe.llen(keys.message_ids)
    pipe.llen(keys.done)
    done, timeout, overflow, expired, retried, gave_up, listed, waiting = pipe.execute()
    return TrackingSnapshot(
        done=Histogram.from_hash(done),
        timeout=Histogram.from_hash(timeout),
        overflow=_count(overflow),
        expired=_count(expired),
        retried=_count(retried),
        gave_up=_count(gave_up),
        listed=int(listed),
        done_waiting=int(waiting),
    )


class Tracker:
    """Registers tracked messages and reports them done; runs the monitor's turn."""

    def __init__(
        self,
        client: redis.Redis,
        keys: TrackKeys,
        policy: TrackingPolicy,
        service: str = "",
        clock: Clock = SYSTEM,
    ) -> None:
        self.client = client
        self.keys = keys
        self.policy = policy
        self.service = service
        self.clock = clock
        self._scripts = Scripts(client)

    def register(
        self,
        message: Any,
        kind: str = "message",
        now: int | None = None,
        claim: str = "",
        timeout_ms: int | None = None,
    ) -> int:
        """Track ``message``; the id to report done, or 0 when over capacity (counted).

        ``timeout_ms`` lengthens this one's deadline beyond messageTimeout (a handler's time
        limit and its kill grace); its hash then lives as much longer.
        """
        xid, xid_type = xid_of(message)
        k = self.keys
        timeout = max(self.policy.timeout_ms, timeout_ms or 0)
        expire = self.policy.expire_ms + (timeout - self.policy.timeout_ms)
        return lua.track_register(
            self._scripts,
            id_counter=k.message_id,
            ids=k.message_ids,
            overflow_metrics=k.metrics("overflow"),
            message_prefix=k.message_prefix,
            xid_prefix=k.xid_prefix,
            capacity=self.policy.capacity,
            now_ms=now_ms(self.clock) if now is None else now,
            timeout_ms=timeout,
            expire_ms=expire,
            xid=xid,
            xid_type=xid_type,
            service=self.service,
            kind=kind,
            claim=claim,
        )

    def done(self, track_id: int, now: int | None = None) -> bool:
        """Report a tracked message finished (pushes its id to ``:message:done``)."""
        if track_id <= 0:
            return False
        k = self.keys
        return lua.track_done(
            self._scripts,
            message=k.message(track_id),
            done=k.done,
            track_id=track_id,
            now_ms=now_ms(self.clock) if now is None else now,
        )

    @contextmanager
    def tracking(
        self, message: Any, kind: str, claim: str = "", timeout_ms: int | None = None
    ) -> Iterator[int]:
        """Track what the block does: registered on entry, done when it returns. A block
        that raises did not finish its work (e.g. the outcome was not stored): it is left to
        time out, like a worker that never gets to the end.

        A tracking Redis that fails is logged and the block runs untracked.
        """
        try:
            track_id = self.register(message, kind, claim=claim, timeout_ms=timeout_ms)
        except (redis.RedisError, TrackingError):
            log.exception("tracking %s failed; running it untracked", kind)
            track_id = 0
        yield track_id
        try:
            self.done(track_id)
        except redis.RedisError:
            log.exception("reporting tracked %s %s done failed", kind, track_id)

    def done_by_xid(self, xid: str, now: int | None = None) -> tuple[int, lua.XidDone]:
        """Report done the work an outsider knows by its xid (the seed's subscriber, through
        the ``:message:xid:$xid`` cross-reference): its tracking id and what became of it."""
        k = self.keys
        return lua.track_done_xid(
            self._scripts,
            xid_key=k.xid(xid),
            done=k.done,
            message_prefix=k.message_prefix,
            now_ms=now_ms(self.clock) if now is None else now,
        )

    def lookup(self, xid: str) -> dict[str, str]:
        """The ``:message:xid:$xid`` cross-reference (id and type), empty when unknown."""
        return _decoded(self.client.hgetall(self.keys.xid(xid)))

    def monitor_turn(self, now: int | None = None) -> MonitorTurn:
        """Count done ids, delist expired ones, count and return the timeouts (nothing
        tracked and nothing done: one command)."""
        k = self.keys
        if not self.client.exists(k.message_ids, k.done):
            return MonitorTurn(0, 0, [])
        return lua.track_monitor(
            self._scripts,
            done=k.done,
            ids=k.message_ids,
            done_metrics=k.metrics("done"),
            timeout_metrics=k.metrics("timeout"),
            expired_metrics=k.metrics("expired"),
            message_prefix=k.message_prefix,
            now_ms=now_ms(self.clock) if now is None else now,
            batch=max(self.policy.batch, self.policy.capacity),
            bucket_bounds_ms=BUCKETS_MS,
        )

    def count(self, name: str, n: int = 1) -> None:
        """Add to the ``count`` of ``:metrics:$name`` (retry, gaveup)."""
        if n:
            self.client.hincrby(self.keys.metrics(name), "count", n)


# A service key's mark lives this many expiries (renewed with the key): long enough to outlast
# the key after an operator removed it, short enough not to pile up after the service ended.
MARK_LIFE = 4


class ServiceLease:
    """One worker's service key while it lives: renewed, restored after an outage, or the
    signal to stop.

    The key gone means stop only when an operator removed it: its mark is still there, the
    lease renewed it less than an expiry ago and Redis is the same server. A key that expired
    because renewals could not reach Redis, or that a Redis restart or FLUSHALL lost (with its
    mark), is put back under the same id.
    """

    def __init__(
        self,
        services: Services,
        fields: Mapping[str, str | int],
        expire_ms: int,
        clock: Clock = SYSTEM,
    ) -> None:
        self.services = services
        self.fields = dict(fields)
        self.expire_ms = expire_ms
        self._clock = clock
        self.service_id: int | None = None
        self._renewed_at = 0.0
        self._server = ""

    def start(self) -> int:
        self.service_id = self.services.register(self.fields, self.expire_ms)
        self._renewed_at = self._clock.monotonic()
        self._server = self.services.server_id()
        return self.service_id

    def keep(self) -> str:
        """``renewed``, ``restored``, ``stop`` or ``started`` (a first start that had failed).

        Raises redis errors: the caller logs them and tries again at the next heartbeat.
        """
        if self.service_id is None:
            self.start()
            return "started"
        renewed = self.services.renew(self.service_id, self.expire_ms)
        if renewed == "renewed":
            self._renewed_at = self._clock.monotonic()
            return "renewed"
        lapsed = (self._clock.monotonic() - self._renewed_at) * 1000 >= self.expire_ms
        server = self.services.server_id()
        if renewed == "lost" or lapsed or server != self._server:
            self.services.restore(self.service_id, self.fields, self.expire_ms)
            self._renewed_at = self._clock.monotonic()
            self._server = server
            return "restored"
        return "stop"


@dataclass
class ServiceInfo:
    service_id: int
    fields: dict[str, str] = field(default_factory=dict)
    ttl_ms: int = -1


class Services:
    """The service lifecycle keys: ``:service:id``, ``:service:$id`` (expiring, renewed).

    A worker registers at start, renews its key while it lives and stops when the key is
    gone: deleting the key is how an operator stops one worker.
    """

    def __init__(self, client: redis.Redis, keys: TrackKeys) -> None:
        self.client = client
        self.keys = keys
        self._scripts = Scripts(client)

    def register(self, fields: Mapping[str, str | int], expire_ms: int) -> int:
        if not fields:
            raise ValueError("a service needs at least one field")
        k = self.keys
        service_id = lua.service_register(
            self._scripts,
            id_counter=k.service_id,
            ids=k.services,
            service_prefix=k.service(""),
            expire_ms=expire_ms,
            fields=fields,
        )
        self.client.set(k.service_mark(service_id), "1", px=MARK_LIFE * expire_ms)
        return service_id

    def renew(self, service_id: int, expire_ms: int, now: int | None = None) -> str:
        """Renew the key and its mark: ``renewed``; ``removed`` when the key is gone but its
        mark is there (an operator removed it: the service must stop); ``lost`` when both are
        gone (Redis lost its data: the service puts its key back)."""
        return lua.service_renew(
            self._scripts,
            service=self.keys.service(service_id),
            mark=self.keys.service_mark(service_id),
            expire_ms=expire_ms,
            now_ms=now_ms() if now is None else now,
            mark_life_ms=MARK_LIFE * expire_ms,
        )

    def restore(self, service_id: int, fields: Mapping[str, str | int], expire_ms: int) -> bool:
        k = self.keys
        restored = lua.service_restore(
            self._scripts,
            service=k.service(service_id),
            ids=k.services,
            id_counter=k.service_id,
            service_id=service_id,
            expire_ms=expire_ms,
            fields=fields,
        )
        self.client.set(k.service_mark(service_id), "1", px=MARK_LIFE * expire_ms)
        return restored

    def server_id(self) -> str:
        """The Redis server's run id: it changes when Redis restarts."""
        info: Any = self.client.info("server")
        return str(info.get("run_id", ""))

    def deregister(self, service_id: int) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.service(service_id), self.keys.service_mark(service_id))
        pipe.srem(self.keys.services, service_id)
        pipe.execute()

    def stop(self, service_id: int) -> bool:
        """Delete a service's key: the service stops at its next renewal."""
        removed = int(self.client.delete(self.keys.service(service_id)))
        return removed > 0

    def stop_node(self, node_code: str) -> list[int]:
        """Delete the keys of every live service of a node; the ids told to stop."""
        stopped = [s.service_id for s in self.live() if s.fields.get("node_code") == node_code]
        for service_id in stopped:
            self.stop(service_id)
        return stopped

    def live(self) -> list[ServiceInfo]:
        """The services whose key exists; ids whose key is gone are dropped from the set."""
        members: Any = self.client.smembers(self.keys.services)
        ids = sorted(int(x) for x in members)
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for service_id in ids:
            pipe.hgetall(self.keys.service(service_id))
            pipe.pttl(self.keys.service(service_id))
        raw = pipe.execute()
        alive, gone = [], []
        for i, service_id in enumerate(ids):
            fields, ttl = raw[2 * i], raw[2 * i + 1]
            if not fields:
                gone.append(service_id)
                continue
            alive.append(ServiceInfo(service_id, _decoded(fields), int(ttl)))
        if gone:
            # Ids are never reused (INCR), so dropping one whose key is gone is safe.
            self.client.srem(self.keys.services, *gone)
        return alive
