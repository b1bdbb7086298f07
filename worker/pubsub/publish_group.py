"""Publishes that arrive together, stored in one transaction (group commit).

The API's publishes (POST /rooms/{room}/events) queue on a :class:`GroupCommit`
(worker.core.group_commit): a group is one transaction that reads each room it names once,
checks every publish against its room as a publish alone would (publisher, paused, event type
and schema, destinations, routing key), and inserts the events and deliveries of the publishes
that share a room, event type and publisher with one statement each; each caller is answered
after the commit with its own result or its own refusal, the group's deliveries due now handed
to the broker together (``BATCH`` a task) after it. A publish with an Idempotency-Key
(its lock and lookup are its own), or any publish of a group whose transaction failed, is
stored on its own, as without a group.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio.to_thread
from sqlalchemy import Engine

from orderly.worker.core.clock import SYSTEM, Clock, utcnow
from orderly.worker.core.errors import OrderlyError
from orderly.worker.core.group_commit import ALONE, Alone, GroupCommit
from orderly.worker.pubsub import schemas
from orderly.worker.pubsub.event_rows import context, store
from orderly.worker.pubsub.publish import (
    NewPublish,
    Published,
    Routed,
    hand_off,
    parse_publish,
    publisher_of,
    result_of,
    route,
    store_publish,
)

log = logging.getLogger(__name__)

Stored = tuple[Published, list[int]]
Outcome = Published | Alone | Exception


class GroupedPublisher:
    """Publishes through one node, concurrent ones sharing commits (``group_max`` above 0;
    0: each its own transaction, in a thread). ``enqueue``: hands deliveries due now to the
    broker (after the commit; one that fails is logged: the ticker sends them once their
    lease runs out)."""

    def __init__(
        self,
        engine: Engine,
        enqueue: Callable[[list[int]], None],
        *,
        node_id: int | None,
        secret: str,
        token_ttl_ms: int,
        max_payload_bytes: int | None,
        schema_limits: schemas.Limits,
        group_max: int,
        clock: Clock = SYSTEM,
    ) -> None:
        self._engine = engine
        self._enqueue = enqueue
        self._node_id = node_id
        self._secret = secret
        self._token_ttl_ms = token_ttl_ms
        self._max_payload_bytes = max_payload_bytes
        self._schema_limits = schema_limits
        self._clock = clock
        self._group = GroupCommit(self._write, group_max) if group_max > 0 else None

    async def publish(
        self,
        room_name: str,
        data: Any,
        *,
        idempotency_key: str | None = None,
        caller: str | None = None,
        may_impersonate: bool = False,
    ) -> Published:
        """worker.pubsub.publish.publish for a coroutine: checked on the caller's loop,
        stored with the publishes made at the same time, its deliveries due now handed to the
        broker after the commit."""
        new = self._parse(room_name, data, idempotency_key, caller, may_impersonate)
        alone = functools.partial(self._alone, new)
        if self._group is None:
            return await anyio.to_thread.run_sync(alone)
        return await self._group.run_or_alone(new, alone, grouped=idempotency_key is None)

    def publish_alone(
        self,
        room_name: str,
        data: Any,
        *,
        idempotency_key: str | None = None,
        caller: str | None = None,
        may_impersonate: bool = False,
    ) -> Published:
        """:meth:`publish` in its own transaction, checked in the calling thread (a large
        body's)."""
        return self._alone(self._parse(room_name, data, idempotency_key, caller, may_impersonate))

    def _parse(
        self,
        room_name: str,
        data: Any,
        idempotency_key: str | None,
        caller: str | None,
        may_impersonate: bool,
    ) -> NewPublish:
        return parse_publish(
            room_name,
            data,
            idempotency_key=idempotency_key,
            max_payload_bytes=self._max_payload_bytes,
            caller=caller,
            may_impersonate=may_impersonate,
        )

    def _alone(self, new: NewPublish) -> Published:
        result, due = store_publish(
            self._engine,
            new,
            secret=self._secret,
            token_ttl_ms=self._token_ttl_ms,
            clock=self._clock,
            node_id=self._node_id,
            schema_limits=self._schema_limits,
        )
        self._hand_off(due)
        return result

    def _hand_off(self, due: list[int]) -> None:
        try:
            hand_off(due, self._enqueue)
        except Exception:
            # Stored: the ticker sends them once their lease runs out.
            log.exception("deliveries %s stored but not handed to the broker", due)

    def _write(self, items: Sequence[NewPublish]) -> list[Outcome]:
        """One transaction for the group: each publish checked against its room (a refusal
        is its own), those of one room, event type, publisher and user inserted together."""
        out: list[Outcome] = [ALONE] * len(items)
        due: list[int] = []
        now = utcnow(self._clock)
        try:
            with self._engine.begin() as conn:
                rooms: dict[str, Any] = {}
                together: dict[tuple[Any, ...], list[tuple[int, Routed]]] = {}
                for i, new in enumerate(items):
                    try:
                        if new.room not in rooms:
                            rooms[new.room] = context(conn, new.room)
                        room, publishers, subscriptions = rooms[new.room]
                        publisher_id = publisher_of(new, publishers)
                        routed = route(
                            conn, room, subscriptions, new, now,
                            secret=self._secret, token_ttl_ms=self._token_ttl_ms,
                            schema_limits=self._schema_limits,
                        )  # fmt: skip
                    except OrderlyError as exc:  # its own refusal, as alone
                        out[i] = exc
                        continue
                    pub = new.pub
                    key = (new.room, routed.event_type_id, routed.version, publisher_id,
                           pub.user, pub.impersonator, routed.named)  # fmt: skip
                    together.setdefault(key, []).append((i, routed))
                for key, members in together.items():
                    room, _, subscriptions = rooms[key[0]]
                    inserted, deliveries = store(
                        conn,
                        room,
                        now,
                        [routed.event for _, routed in members],
                        subscriptions,
                        event_type_id=key[1],
                        version=key[2],
                        publisher_id=key[3],
                        user=key[4],
                        impersonator=key[5],
                        node_id=self._node_id,
                        named=key[6],
                    )
                    ids = {correlation_id: event_id for event_id, correlation_id in inserted}
                    for i, routed in members:
                        event_id = ids[routed.event["correlation_id"]]
                        mine = [d for d in deliveries if d[1] == event_id]
                        result, now_due = result_of(items[i], routed, event_id, mine, subscriptions)
                        out[i] = result
                        due += now_due
        except Exception as exc:  # nothing of the group stored: each alone, its own error
            log.warning("a group of %d publishes failed (%s): each alone", len(items), exc)
            return [o if isinstance(o, OrderlyError) else ALONE for o in out]
        self._hand_off(due)
        return out
