"""PUSH endpoints: their pace and their health.

A PUSH subscription is an endpoint. Its pace: ``rate_per_s`` (a token bucket of ``burst``, the
one limiter of worker.core.ratelimit, as funnels' start rates) and ``max_in_flight`` (sends at
once, counted in the claim under the subscription's row lock). Its health: every failed send
counts one more failure in a row, a send that succeeds forgets them. At ``circuit_failures``
in a row its circuit opens: nothing is sent but one probe, when its time comes (the endpoint's
retry policy: ``delay * multiplier ^ n`` after the n-th failed probe, at most
``probe_max_ms``); deliveries wait on their rows in their order meanwhile, and a probe that
succeeds closes the circuit and makes them due at once. An endpoint failing for
``disable_after_s`` is disabled (nothing is sent until an operator enables it) and an
``endpoint.disabled`` event is published to the system room.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, StringConstraints
from sqlalchemy import Connection, Engine

from orderly.models.keys import RateKeys
from orderly.models.pubsub import SubscriptionKind
from orderly.worker.core.clock import SYSTEM, Clock, now_ms
from orderly.worker.core.errors import NotFound
from orderly.worker.core.inputs import parse_input
from orderly.worker.core.ratelimit import FAIL_OPEN_PAUSE_S, Buckets, Limit
from orderly.worker.core.retry import RetryPolicy
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.admin import RoomIn
from orderly.worker.pubsub.publish import hand_off, publish

log = logging.getLogger(__name__)

# The room operational events go to (created with the room defaults when first needed).
SYSTEM_ROOM = "orderly-system"
DISABLED_EVENT = "endpoint.disabled"


@dataclass(frozen=True)
class EndpointPolicy:
    circuit_failures: int = 5
    probe_max_ms: int = 600_000
    disable_after_s: float = 432_000.0


class Sending(Protocol):
    """A claimed delivery as its settlement sees its endpoint."""

    @property
    def subscription_id(self) -> int: ...

    @property
    def kind(self) -> str: ...

    @property
    def unhealthy(self) -> bool: ...

    @property
    def max_in_flight(self) -> int | None: ...


class Paced(Protocol):
    """A claimed delivery with its endpoint's rate (None: none)."""

    @property
    def delivery_id(self) -> int: ...

    @property
    def subscription_id(self) -> int: ...

    @property
    def rate_per_s(self) -> float | None: ...

    @property
    def burst(self) -> int | None: ...


@dataclass(frozen=True)
class Disabled:
    """An endpoint disabled by its failures (the system event's payload)."""

    subscription_id: int
    name: str
    room: str
    push_url: str | None
    failures: int
    failing_since: datetime
    disabled_at: datetime
    reason: str

    def payload(self) -> dict[str, Any]:
        return {
            "subscription_id": self.subscription_id,
            "subscription": self.name,
            "room": self.room,
            "push_url": self.push_url,
            "failures": self.failures,
            "failing_since": self.failing_since.isoformat(),
            "disabled_at": self.disabled_at.isoformat(),
            "reason": self.reason,
        }


class Failing(Protocol):
    """The failed send's delivery: its endpoint and retry policy."""

    @property
    def subscription_id(self) -> int: ...

    @property
    def policy(self) -> RetryPolicy: ...


# What publishes an operational event (room, routing key, payload) after the commit.
Announce = Callable[[str, str, dict[str, Any]], None]


class Endpoints:
    """The endpoints' pace (Redis buckets; None: paced by concurrency only) and health."""

    def __init__(
        self,
        policy: EndpointPolicy | None = None,
        buckets: Buckets | None = None,
        clock: Clock = SYSTEM,
        keys: RateKeys | None = None,
        announce: Announce | None = None,
    ) -> None:
        self.policy = policy or EndpointPolicy()
        self._buckets = buckets
        self._clock = clock
        self._keys = keys or RateKeys()
        self._announce = announce
        self._paused_until = float("-inf")

    def lock(self, conn: Connection, delivery_ids: list[int]) -> None:
        """Lock the endpoints of these deliveries (until the claim commits), in key order."""
        conn.execute(sql("endpoints_lock"), {"ids": delivery_ids})

    def lock_for_settle(self, conn: Connection, subscription_ids: Iterable[int]) -> None:
        """Lock the endpoints a settling transaction will write, first and in key order (as
        the claim does: the two never wait for each other in a cycle)."""
        subs = sorted(set(subscription_ids))
        if subs:
            conn.execute(sql("endpoints_lock_settle"), {"subs": subs})

    def refused(self, claimed: Sequence[Paced]) -> dict[int, int]:
        """Take a send token for each claimed delivery whose endpoint has a rate: the ones that
        got none, with the ms until each may go (spread at the endpoint's rate: those refused
        together do not come back together). Redis not answering (or slow) refuses nothing
        and is left alone for a second (fail open, logged)."""
        by_id = {p.delivery_id: p for p in claimed}
        rated = [
            (p.delivery_id, self._keys.endpoint(p.subscription_id), Limit(p.rate_per_s, p.burst))
            for p in claimed
            if p.rate_per_s is not None and p.burst is not None
        ]
        if self._buckets is None or not rated:
            return {}
        if self._clock.monotonic() < self._paused_until:
            return {}
        waits = self._buckets.refused(rated, now_ms(self._clock), "endpoint rates")
        if waits is None:
            self._paused_until = self._clock.monotonic() + FAIL_OPEN_PAUSE_S
            return {}
        spread: dict[int, int] = {}
        behind: dict[int, int] = {}
        for delivery_id, wait_ms in waits.items():
            p = by_id[delivery_id]
            n = behind.get(p.subscription_id, 0)
            behind[p.subscription_id] = n + 1
            spread[p.delivery_id] = wait_ms + round(n * 1000 / float(p.rate_per_s or 1))
        return spread

    def hold_back(self, conn: Connection, waits_ms: Mapping[int, int], claim: str) -> None:
        """Claimed deliveries not sent after all (delivery id: its wait in ms): PENDING again,
        their attempt not counted, due after their wait (at once if their endpoint heals)."""
        if waits_ms:
            values = {"ids": list(waits_ms), "waits_ms": list(waits_ms.values()), "claim": claim}
            conn.execute(sql("deliveries_hold_back"), values)

    def probe_later(self, conn: Connection, probes: Sequence[tuple[Paced, int]]) -> None:
        """Probes given back unsent (no rate token): their endpoint's next probe when their
        token is there, not after the probe's hold."""
        for p, wait_ms in probes:
            conn.execute(sql("endpoint_open"), {"s": p.subscription_id, "wait_ms": wait_ms})

    @staticmethod
    def written(claimed: Sequence[Sending], *, failing: bool) -> list[int]:
        """The endpoints a settlement of these may write: every PUSH one when sends may have
        failed (``failing``), else the unhealthy ones (healed) and those with max_in_flight."""
        return [
            c.subscription_id
            for c in claimed
            if c.max_in_flight is not None
            or (c.kind == SubscriptionKind.PUSH and (failing or c.unhealthy))
        ]

    def ended(self, conn: Connection, claimed: Sequence[Sending]) -> None:
        """Sends that ended free their endpoint's room (max_in_flight) for as many waiting."""
        ended: dict[int, int] = {}
        for c in claimed:
            if c.max_in_flight is not None:
                ended[c.subscription_id] = ended.get(c.subscription_id, 0) + 1
        for subscription_id, n in sorted(ended.items()):
            self.release(conn, subscription_id, n)

    def release(self, conn: Connection, subscription_id: int, ended: int) -> None:
        """``ended`` sends of an endpoint with max_in_flight are over: as many waiting ones go."""
        conn.execute(sql("endpoint_release"), {"s": subscription_id, "n": ended})

    def healed(self, conn: Connection, subscription_ids: Sequence[int]) -> None:
        """These endpoints answered: failures forgotten, circuits closed, their waiting due."""
        if subscription_ids:
            conn.execute(sql("endpoint_healed"), {"subs": sorted(set(subscription_ids))})

    def failed(self, conn: Connection, d: Failing, error: str) -> Disabled | None:
        """A send failed: count it; open (or keep open) the circuit at ``circuit_failures`` in a
        row; disable the endpoint once it has failed for ``disable_after_s``."""
        p = self.policy
        row = conn.execute(
            sql("endpoint_failed"), {"s": d.subscription_id, "disable_after_s": p.disable_after_s}
        ).first()
        if row is None:  # disabled meanwhile
            return None
        if row.too_long:
            since = row.failing_since.isoformat()
            why = f"failing since {since} ({row.failures} in a row): {error}"
            gone = conn.execute(sql("endpoint_disable"), {"s": d.subscription_id, "why": why})
            found = gone.first()
            if found is None:
                return None
            log.error("endpoint of subscription %s disabled: %s", d.subscription_id, why)
            return Disabled(
                int(found.subscription_id),
                found.name,
                found.room,
                found.push_url,
                int(found.failures),
                found.failing_since,
                found.disabled_at,
                why,
            )
        if row.failures >= p.circuit_failures:
            failed_probes = row.failures - p.circuit_failures + 1
            wait = min(d.policy.delay(failed_probes), p.probe_max_ms)
            conn.execute(sql("endpoint_open"), {"s": d.subscription_id, "wait_ms": wait})
            if failed_probes == 1:
                log.warning(
                    "endpoint of subscription %s: %d failures in a row, circuit open (probe in "
                    "%d ms): %s",
                    d.subscription_id,
                    row.failures,
                    wait,
                    error,
                )
        return None

    def announce(self, disabled: Sequence[Disabled]) -> None:
        """Publish each disabled endpoint to the system room (after the commit)."""
        if self._announce is None:
            return
        for d in disabled:
            try:
                self._announce(SYSTEM_ROOM, DISABLED_EVENT, d.payload())
            except Exception:
                log.exception("endpoint.disabled of %s not published", d.subscription_id)


def publish_system_event(
    engine: Engine,
    routing_key: str,
    payload: dict[str, Any],
    enqueue: Callable[[list[int]], None],
    secret: str = "",
) -> None:
    """An operational event to the system room (made with the room defaults the first time),
    its due deliveries handed to ``enqueue``."""
    with engine.begin() as conn:
        conn.execute(sql("room_insert"), RoomIn(name=SYSTEM_ROOM).model_dump())
    _, due = publish(
        engine, SYSTEM_ROOM, {"payload": payload, "routing_key": routing_key}, secret=secret
    )
    hand_off(due, enqueue)


class EnableIn(BaseModel):
    """An operator's enabling of an endpoint, with why (logged)."""

    model_config = ConfigDict(extra="forbid")

    note: Annotated[str, StringConstraints(strip_whitespace=True, max_length=1000)] = ""


def enable(
    engine: Engine,
    subscription_id: int,
    owned: list[int] | None = None,
    data: Any = None,
    by: str | None = None,
) -> None:
    """An operator enables an endpoint again: its failures forgotten, its circuit closed, its
    waiting deliveries due. ``owned``: the caller's subscriptions (None: any); ``data``: an
    EnableIn (its note is logged with ``by``)."""
    asked = parse_input(EnableIn, {} if data is None else data)
    with engine.begin() as conn:
        found = conn.execute(sql("endpoint_enable"), {"s": subscription_id, "owned": owned}).first()
    if found is None:
        raise NotFound("subscription", subscription_id)
    log.warning(
        "endpoint of subscription %s enabled by %s: %s",
        subscription_id,
        by or "an operator",
        asked.note or "(no note)",
    )
