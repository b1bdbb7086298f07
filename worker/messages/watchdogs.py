"""The re-processing pool and repair: the periodic work beat triggers.

Pool: a guaranteed-order message held back by a FAILED one longer than
postponedIntervalWhenFailedSec becomes FAILED; a message whose wait for an external response
ran out becomes FAILED. (PARTLY_FAILED and POSTPONED messages come back when their due time
comes: worker.messages.due.)
Orphans: a PROCESSING message whose worker died (its claiming connection is gone) goes back
to IN_QUEUE within a second, the death counted in ``lost_count`` when its claim held it alone
(``lone_claim``); at ORDERLY_WORKER_LOST_LIMIT deaths it is quarantined (FAILED,
E_WORKER_LOST) instead. The messages of a claim of several count nothing (which one its worker
ran is not known) and are isolated: claimed alone from then on, where a death counts.
Repair: NEW/IN_QUEUE/PROCESSING messages idle longer than repairRepeatTimeSec become
PARTLY_FAILED (FAILED at the limit);
external calls stuck in PROCESSING become FAILED; WAITING parents whose children all ended
are settled. Rows are taken with SKIP LOCKED, so two beat agents (or an agent and a worker)
never act on the same row. What a transition makes claimable (a funnel's next message, an
orphan) is claimable at once, without a due time. A worker is woken for a funnel's next
message after commit, and its claims take it in line with everything due
(worker.messages.batches), as the due ticker's messages are taken; a wake-up that fails
leaves them to beat's wake-up of messages due for over a second. An orphan gets a task of its
own instead, which claims it by id, alone; a batch claim that comes first takes an isolated
message among its candidates alone, before the others (worker.messages.batches.isolated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine

from orderly.worker.configuration import ConfigReader
from orderly.worker.core.lease import ORPHAN_GRACE_S
from orderly.worker.db.queries import sql
from orderly.worker.messages.store import parse_ids

log = logging.getLogger(__name__)

REPAIR_CODE = "E_REPAIR"

POSTPONED_CODE = "E_POSTPONED_TOO_LONG"

TIMEOUT_CODE = "E_RESPONSE_TIMEOUT"

WORKER_LOST_CODE = "E_WORKER_LOST"


def released_in(conn: Connection) -> list[int]:
    """The funnel messages the current transaction released (claimable after its commit)."""
    return parse_ids(conn.execute(sql("released_in_transaction")).scalar())


def wake_for(msg_ids: list[int], wake: Callable[[], object]) -> None:
    """Wake a worker for messages made claimable (committed already); a wake-up that fails is
    logged, and beat's wake-up of messages due for over a second covers them."""
    if not msg_ids:
        return
    try:
        wake()
    except Exception as exc:
        log.warning("messages %s claimable, no worker woken (%s): beat wakes one", msg_ids, exc)


MAX_BATCHES = 100


def due_waiting(engine: Engine, after_s: float) -> bool:
    """Whether a message has waited NEW longer than ``after_s`` (no worker was woken for it:
    worker/messages/wake.py)."""
    with engine.connect() as conn:
        return bool(conn.execute(sql("due_waiting"), {"after_s": after_s}).scalar())


@dataclass(frozen=True)
class RepairReport:
    messages: int
    failed: int
    external_calls: int
    parents: int = 0


def _batches(engine: Engine, query: str, params: dict[str, Any], wake: Callable[[], object]) -> int:
    """Run a batched transition until it changes fewer rows than a batch; a worker is woken
    for what it released."""
    done = 0
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            changed = len(conn.execute(sql(query), params).all())
            released = released_in(conn)
        wake_for(released, wake)
        done += changed
        if changed < params["batch"]:
            break
    return done


def fail_postponed(engine: Engine, config: ConfigReader, wake: Callable[[], object]) -> int:
    """Guaranteed-order messages held back by a FAILED one too long become FAILED."""
    params = {
        "failed_s": config.get_int("asynch.postponedIntervalWhenFailedSec"),
        "batch": config.get_int("asynch.pool.batchSize"),
    }
    return _batches(engine, "fail_postponed", params, wake)


def expire_waits(engine: Engine, config: ConfigReader, wake: Callable[[], object]) -> int:
    """Messages whose wait for an external response ran out become FAILED."""
    return _batches(
        engine, "expire_waits", {"batch": config.get_int("asynch.pool.batchSize")}, wake
    )


def _in_batches(
    engine: Engine, name: str, params: dict[str, Any], batch: int
) -> tuple[list[Any], list[int]]:
    """Run a batched transition until a batch comes back short (at most MAX_BATCHES): the
    rows it returned, and the funnel messages its transactions released."""
    rows: list[Any] = []
    released: list[int] = []
    for _ in range(MAX_BATCHES):
        with engine.begin() as conn:
            got = conn.execute(sql(name), {**params, "batch": batch}).all()
            released += released_in(conn)
        rows += got
        if len(got) < batch:
            break
    return rows, released


def repair(
    engine: Engine, config: ConfigReader, wake: Callable[[], object] | None = None
) -> RepairReport:
    stuck_s = config.get_int("asynch.repairRepeatTimeSec")
    batch = config.get_int("asynch.pool.batchSize")
    limit = config.get_int("asynch.countPartlyFailsBeforeFailed")
    rows, released = _in_batches(
        engine, "repair_messages", {"stuck_s": stuck_s, "limit": limit}, batch
    )
    calls, _ = _in_batches(engine, "repair_calls", {"stuck_s": stuck_s}, batch)
    with engine.begin() as conn:
        settled = conn.execute(sql("settle_parents"), {"stuck_s": stuck_s, "batch": batch}).all()
        released += released_in(conn)
    if wake is not None:
        wake_for(released, wake)
    return RepairReport(
        messages=len(rows),
        failed=sum(1 for r in rows if r.state == "FAILED"),
        external_calls=len(calls),
        parents=sum(1 for r in settled if r.state != "WAITING"),
    )


@dataclass(frozen=True)
class OrphanReport:
    released: int
    quarantined: int


def release_orphans(
    engine: Engine,
    config: ConfigReader,
    lost_limit: int,
    enqueue: Callable[[int], None],
    wake: Callable[[], object],
) -> OrphanReport:
    """Messages whose worker died while processing them: back to IN_QUEUE at once, each with
    a task of its own (``enqueue``), or quarantined at the limit; a worker is woken for what
    a quarantine released in their funnels."""
    rows, released = _in_batches(
        engine,
        "release_orphans",
        {"grace_s": ORPHAN_GRACE_S, "limit": lost_limit},
        config.get_int("asynch.pool.batchSize"),
    )
    back = [r.msg_id for r in rows if r.state == "IN_QUEUE"]
    for i, msg_id in enumerate(back):
        try:
            enqueue(msg_id)
        except Exception as exc:
            # claimable all the same: a woken worker's claims, or beat's wake-up, take them
            log.warning("orphans %s released, not handed to the broker (%s)", back[i:], exc)
            released += back[i:]
            break
    wake_for(released, wake)
    return OrphanReport(released=len(back), quarantined=len(rows) - len(back))
