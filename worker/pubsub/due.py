"""The due work and upkeep of deliveries: due push deliveries (a ``$delay``, a retry wait, an
endpoint's wait, a lost hand-off) handed to the broker in batches, and the dead workers'
claims and the pull queues' timeouts taken care of once a second (beat)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Engine

from orderly.worker.core.due import PgDueIndex
from orderly.worker.core.lease import ORPHAN_GRACE_S
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.event_rows import QUEUED_LEASE_S
from orderly.worker.pubsub.publish import BATCH


def due_deliveries(engine: Engine, hand_off: Callable[[list[int]], None]) -> PgDueIndex:
    """Due push deliveries (delays, retry waits, lost hand-offs) as due work: batches of
    ``BATCH`` go to ``hand_off`` (one task each). A delivery whose worker died while holding
    it goes alone, in a task of its own: if it is the one that kills its worker, the
    deliveries that shared its batch are not lost with it again, and its deaths count towards
    its own quarantine (a claim takes an isolated delivery alone in any case)."""

    def split(items: list[tuple[int, bool]]) -> None:
        together = [delivery_id for delivery_id, alone in items if not alone]
        if together:
            hand_off(together)
        for delivery_id, alone in items:
            if alone:
                hand_off([delivery_id])

    return PgDueIndex(
        "deliveries",
        engine,
        "deliveries_take_due",
        "deliveries_release",
        "deliveries_next_due",
        split,
        batch=BATCH,
        lease_ms=int(QUEUED_LEASE_S * 1000),
    )


# A claim held by a live worker far longer than its batch can take (a hung worker, or a
# backend pid reused by another connection): released all the same.
STALE_CLAIM_S = 60.0


def upkeep(engine: Engine, lost_limit: int) -> None:
    """Release dead workers' claims (quarantined at ``lost_limit`` deaths), expire untaken
    pull messages, return pulled ones not ACKed in time (a periodic job of the ticker, once a
    second)."""
    with engine.begin() as conn:
        conn.execute(
            sql("deliveries_release_stuck"),
            {
                "grace_s": ORPHAN_GRACE_S,
                "stale_s": STALE_CLAIM_S,
                "per_batch": BATCH,
                "limit": lost_limit,
                "batch": 1000,
            },
        )
        conn.execute(sql("pulled_expire"))
        conn.execute(sql("pulled_return_unacked"))
