"""The message store's gateway to its hot-path named queries (worker/db/sql/messages.sql): one
function per statement, its arguments named, its rows returned as small dataclasses built by
column name. Intake, claims and outcomes (worker.messages.intake, .processing, .batches) call
these instead of running queries themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime

from orderly.models import MessageState
from orderly.worker.core import tracing
from orderly.worker.db.prepared import PreparedConnection


@dataclass(frozen=True)
class NewMessage:
    """What ``orderly_insert_messages`` stores of one message, in the order of its arrays."""

    msg_timestamp: datetime
    service: str
    operation: str
    object_id: str | None
    entity_type: str | None
    correlation_id: str
    process_id: str | None
    payload: str
    envelope: str  # the producer's, or the message as received
    source_system: str
    parent_msg_id: int | None
    binding: str | None
    funnel_value: str | None
    funnel_component_id: str | None
    guaranteed_order: bool
    exclude_failed_state: bool
    delay_ms: int | None
    not_before: datetime | None
    priority: int


_COLUMNS = tuple(f.name for f in fields(NewMessage))


@dataclass(frozen=True)
class Inserted:
    """One message inserted: NEW (or POSTPONED, held back by its funnel at once)."""

    msg_id: int
    correlation_id: str
    source_system: str
    state: str
    scheduled: bool  # it waits for its due time


@dataclass(frozen=True)
class StoredIds:
    """The message stored under a (correlation_id, source_system), as a resubmission meets it."""

    msg_id: int
    state: str
    service_name: str
    operation_name: str
    payload: str


@dataclass(frozen=True)
class Owned:
    owned: int


@dataclass(frozen=True)
class Candidate:
    """A due message a claim may take: its funnel's lock key (None without a funnel) and how
    many more of its funnel may start now."""

    msg_id: int
    funnel_key: int | None
    msg_timestamp: datetime
    free: int
    rate_per_s: float | None  # its funnel component's start rate, if it has one
    burst: int | None
    # its worker died holding it in a claim of several: it is claimed alone
    isolate: bool = False


@dataclass(frozen=True)
class Claimed:
    """A claimed message: its state (PROCESSING, or POSTPONED when its funnel held it back),
    what its handler reads, the claim's identity (for the timeout monitor) and the newer
    processed message of the same object, if any (then it is obsolete)."""

    state: str
    msg_id: int
    service_name: str
    operation_name: str
    correlation_id: str
    source_system: str
    msg_timestamp: datetime
    payload: str
    object_id: str | None
    entity_type: str | None
    process_id: str | None
    funnel_value: str | None
    failed_count: int
    custom_data: str | None
    wait_res_id: int | None
    processing_pid: int | None
    last_process_timestamp: datetime
    newer: int | None
    funnel_key: int | None
    rate_per_s: float | None  # its funnel component's start rate, if it has one
    burst: int | None
    trace_parent: str | None = None  # the span that stored it (worker.core.tracing)

    @property
    def running(self) -> bool:
        return self.state == MessageState.PROCESSING


@dataclass(frozen=True)
class Ending:
    """An outcome to write (``orderly_finish``): OK; FAIL (PARTLY_FAILED, or FAILED once
    failed_count reached ``fail_limit``); FAILED; WAITING; WAITING_FOR_RES; POSTPONED.
    ``due_ms``: how long a PARTLY_FAILED or POSTPONED one waits before it is due again."""

    msg_id: int
    kind: str
    fail_limit: int = 0
    code: str | None = None
    desc: str | None = None
    custom_data: str | None = None
    obsolete_by: int | None = None
    due_ms: int = 0


_ENDING = tuple(f.name for f in fields(Ending))


@dataclass(frozen=True)
class Finished:
    """An outcome written: the new state (None: the claim was lost) and the funnel messages
    it released (comma-separated ids)."""

    msg_id: int
    new_state: str | None
    released: str | None  # what all the statement's outcomes released, on every row


@dataclass(frozen=True)
class MsgId:
    msg_id: int


@dataclass(frozen=True)
class Loaded:
    """An external response a parked message's handler reads."""

    res_id: int
    res_envelope: str | None
    failed: bool
    failed_reason: str | None
    res_timestamp: datetime


@dataclass(frozen=True)
class WhyNot:
    """Why a message was not claimed: its state (None: missing), and its node's."""

    msg_state: str | None
    node_state: str | None


def parse_ids(text: str | None) -> list[int]:
    """The comma-separated ids a transaction collected in 'orderly.released'."""
    return [int(part) for part in (text or "").split(",") if part]


def insert(
    conn: PreparedConnection,
    rows: Sequence[NewMessage],
    node_id: int,
    *,
    require_run: bool,
    hold: bool,
    traces: Sequence[str | None] | None = None,
) -> list[Inserted]:
    """Insert messages NEW in one statement, in order: each one inserted (one already stored
    under its ids is not). ``require_run``: new input, refused unless the node is in RUN.
    ``hold``, for one message alone with a funnel: inserted under its funnel's lock and held
    back at once (POSTPONED) when its funnel does not let it go yet, so that a release cannot
    miss it. Otherwise they are stored NEW without a lock, and the claim decides. ``traces``:
    each one's traceparent (default: the span running now)."""
    columns = [[getattr(row, name) for row in rows] for name in _COLUMNS]
    # what each message's handler will continue: its own span's, or the one storing them all
    traced = list(traces) if traces is not None else [tracing.current_parent()] * len(rows)
    if not hold or len(rows) != 1 or rows[0].funnel_value is None:
        return conn.all(
            Inserted, "orderly_insert_messages", *columns, node_id, require_run, False, traced
        )
    lock = ("lock_funnels", ([rows[0].funnel_value], [rows[0].funnel_component_id]))
    found = conn.one(
        Inserted,
        "orderly_insert_messages",
        *columns,
        node_id,
        require_run,
        True,
        traced,
        before=lock,
    )
    return [] if found is None else [found]


def lock_funnels(conn: PreparedConnection, funnels: Sequence[tuple[str, str | None]]) -> None:
    """Take the advisory locks of these funnels (value, component), in key order (whoever
    takes several takes them so: no deadlock), held until the transaction ends."""
    if funnels:
        conn.run_all(
            "lock_funnels", [value for value, _ in funnels], [component for _, component in funnels]
        )


def find(conn: PreparedConnection, correlation_id: str, source_system: str) -> StoredIds | None:
    return conn.one(StoredIds, "orderly_find_message", correlation_id, source_system)


def parent_owned(conn: PreparedConnection, parent_msg_id: int, owned: list[str] | None) -> bool:
    """Whether a message exists and is of one of the source systems ``owned``."""
    return conn.one(Owned, "orderly_parent_owned", parent_msg_id, owned) is not None


def due_candidates(conn: PreparedConnection, node_id: int, size: int) -> list[Candidate]:
    return conn.all(Candidate, "orderly_due_candidates", node_id, size)


def claim(
    conn: PreparedConnection, msg_ids: list[int], node_id: int, lost_limit: int, postponed_s: int
) -> list[Claimed]:
    return conn.all(Claimed, "orderly_claim_ids", msg_ids, node_id, lost_limit, postponed_s)


def postpone(conn: PreparedConnection, msg_ids: list[int], postponed_s: int) -> None:
    conn.run_all("orderly_postpone_ids", msg_ids, postponed_s)


def defer(conn: PreparedConnection, waits: dict[int, int]) -> None:
    """Make due messages wait so many ms each (msg_id -> ms)."""
    ids = list(waits)
    conn.run_all("orderly_defer_ids", ids, [waits[i] for i in ids])


def hand_over_later(conn: PreparedConnection, msg_ids: list[int], after_s: float) -> None:
    """Messages no worker could be woken for: due again after ``after_s`` (the ticker wakes
    one then)."""
    conn.run_all("hand_over_later", msg_ids, after_s)


def unclaim(conn: PreparedConnection, msg_ids: list[int]) -> None:
    conn.run_all("orderly_unclaim", msg_ids)


def finish(conn: PreparedConnection, outcomes: Sequence[Ending]) -> list[Finished]:
    """Write outcomes in one statement, each only while this connection holds its claim: one
    :class:`Finished` per outcome, in order."""
    columns = [[getattr(o, name) for o in outcomes] for name in _ENDING]
    return conn.all(Finished, "orderly_finish", *columns)


def load_response(conn: PreparedConnection, res_id: int) -> Loaded | None:
    return conn.one(Loaded, "orderly_load_response", res_id)


def why_not_claimed(conn: PreparedConnection, msg_id: int, node_id: int) -> WhyNot:
    found = conn.one(WhyNot, "orderly_why_not_claimed", msg_id, node_id)
    return found if found is not None else WhyNot(None, None)


def register_wait(
    conn: PreparedConnection, msg_id: int, correlation_id: str, timeout_s: int
) -> bool:
    """Park a running message until a response names ``correlation_id``; False when this
    connection no longer holds its claim."""
    return conn.one(MsgId, "orderly_register_wait", msg_id, correlation_id, timeout_s) is not None
