"""Due messages in batches: what a woken worker does (``run_woken``, ``process_batch``), and a
single message, a batch of one (``process_message``).

Intake stores a message NEW and wakes a worker (worker.messages.wake) instead of sending it a
task of its own. The worker claims up to ``limit`` due messages at once, higher priority
first, then by place in line (funnels take turns), one per funnel (a funnel's message only
when its funnel lets it go, as the claim decides; one whose funnel allows more at once leaves
the next ones due for other workers), runs their handlers one after another on the claiming
connection, and writes their OK outcomes together in one statement; any other outcome is
written as it comes. While those outcomes release funnel messages, the worker claims again on
the same connection (the released ones take their turn among everything due), round after
round: many funnels advance side by side, each in its order, with one commit per round
instead of one per message.

A batch starts no handler after its budget: what it claimed and did not start goes back to NEW
where it was in line; what was released and not taken up is the woken worker's next claim's (or,
after a single message, gets a task of its own). Each round is tracked as one claim (kind
``batch``; one message as itself): a handler starts within the budget and runs within its time
limit, so a round is done within its longest deadline plus the budget; when one times out,
worker.messages.timeouts takes back every message it still holds. A batch needs every handler under
a time limit, so that no OK outcome held for the round's write can be taken back from a live
worker: while some handler may run unlimited, a claim takes one message.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from orderly.worker.core import tracing
from orderly.worker.core.clock import SYSTEM, Clock
from orderly.worker.db.prepared import PreparedConnection, prepared_connection
from orderly.worker.messages import store
from orderly.worker.messages.processing import Outcome, Processor, ProcessResult
from orderly.worker.messages.rates import StartRates
from orderly.worker.messages.store import Candidate, Claimed, parse_ids
from orderly.worker.messages.wake import Holder, Wake
from orderly.worker.tracking import claim_of

log = logging.getLogger(__name__)

# No handler of a batch starts after this long (fair to other work; bounds its deadline).
BATCH_BUDGET_S = 1.0

# What a batch claim is tracked as (worker.messages.timeouts takes a timed-out one back).
BATCH_KIND = "batch"


def per_funnel(candidates: Sequence[Candidate]) -> tuple[list[int], list[int]]:
    """Of due candidates: those to claim, every one without a funnel and the oldest of each funnel,
    in the candidates' order; and those that wait behind a funnel's free slots (POSTPONED: an
    outcome releases the next). A funnel whose limit allows more than one at a time leaves its next
    ones (up to its free slots) due, for other workers' claims: one worker runs its batch one
    message after another, so claiming them here would not run them side by side."""
    by_funnel: dict[int, list[Candidate]] = {}
    for c in candidates:
        if c.funnel_key is not None:
            by_funnel.setdefault(c.funnel_key, []).append(c)
    first: set[int] = set()
    left: set[int] = set()
    for waiting in by_funnel.values():
        ordered = [c.msg_id for c in sorted(waiting, key=lambda c: (c.msg_timestamp, c.msg_id))]
        free = waiting[0].free
        # the oldest, whatever its free slots read (a count from this statement's start: an
        # outcome may have freed one since; the claim decides under the lock)
        first.update(ordered[:1])
        left.update(ordered[1:free])
    chosen = [c.msg_id for c in candidates if c.funnel_key is None or c.msg_id in first]
    behind = [
        c.msg_id
        for c in candidates
        if c.funnel_key is not None and c.msg_id not in first and c.msg_id not in left
    ]
    return chosen, behind


def claim_due(
    conn: PreparedConnection,
    node_id: int,
    size: int,
    postponed_s: int,
    rates: StartRates | None = None,
) -> tuple[list[Claimed], int]:
    """Claim up to ``size`` due messages in one transaction: the claimed rows (PROCESSING, or
    POSTPONED for a funnel message its funnel holds back: in a plain funnel due again after
    ``postponed_s``), and how many were due. A funnel message whose funnel's start rate is
    spent (``rates``) is due again when its next token is there."""
    conn.execute("BEGIN")
    try:
        due = store.due_candidates(conn, node_id, size)
        found = isolated(due)
        chosen, behind = per_funnel(found)
        if rates is not None and chosen:
            waits = rates.refused([c for c in found if c.msg_id in set(chosen)])
            if waits:
                store.defer(conn, waits)
                chosen = [msg_id for msg_id in chosen if msg_id not in waits]
        rows = claim_ids(conn, node_id, chosen, postponed_s) if chosen else []
        # run in line (the claim's UPDATE returns its rows in no particular order)
        place = {msg_id: n for n, msg_id in enumerate(chosen)}
        rows.sort(key=lambda row: place[row.msg_id])
        if behind:
            store.postpone(conn, behind, postponed_s)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return rows, len(due)


def isolated(found: list[Candidate]) -> list[Candidate]:
    """What one claim takes of the due ``found``: all, or the first isolated one alone (its
    worker died in a claim of several), so that a death counts against the message it ran."""
    return next(([c] for c in found if c.isolate), found)


def claim_ids(
    conn: PreparedConnection, node_id: int, msg_ids: list[int], postponed_s: int
) -> list[Claimed]:
    """Claim the messages chosen from the due ones, or released to this worker (one
    statement; a dead worker's message is left to the orphan job here: a limit of 1)."""
    return store.claim(conn, msg_ids, node_id, 1, postponed_s)


def finish_held(
    conn: PreparedConnection, held: list[tuple[int, Any]]
) -> tuple[set[int], list[int]]:
    """Write held OK outcomes (msg_id, custom_data) in one statement, each only while this
    connection holds its claim: the ids whose claim was lost, and the funnel messages the
    outcomes released (a funnel's next; a HARD child's OK may settle its parent, and that the
    parent's funnel)."""
    conn.execute("BEGIN")
    try:
        endings = [store.Ending(msg_id, "OK", custom_data=custom) for msg_id, custom in held]
        done = store.finish(conn, endings)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    lost = {row.msg_id for row in done if row.new_state is None}
    # every row names all the outcomes released
    return lost, parse_ids(done[0].released) if done else []


def give_back(conn: PreparedConnection, msg_ids: list[int]) -> None:
    """Claimed messages whose handlers did not start: NEW again, where they were in line."""
    store.unclaim(conn, msg_ids)


def wake_quietly(wake: Callable[[], object]) -> None:
    """Wake another worker; should that fail, beat's wake-up of waiting messages covers it."""
    try:
        wake()
    except Exception:
        log.exception("waking a worker for the messages still due failed (beat will)")


@contextlib.contextmanager
def tracked(processor: Processor, claimed: list[Claimed], budget_s: float) -> Iterator[None]:
    """Track a claim as one unit (kind ``batch``; its xid names the claim), a claim of one
    message as that message (kind ``message``, its xid the msg_id). Never before its handlers'
    time limits and kill grace have passed: the limits stop a hung handler; taking its message
    back while it may still run would run it twice."""
    tracker = processor.tracker
    if tracker is None:
        yield
        return
    claim = claim_of(claimed[0].processing_pid, claimed[0].last_process_timestamp)
    if len(claimed) == 1:
        deadline = processor.limited_deadline_ms(claimed[0])
        with tracker.tracking(claimed[0].msg_id, "message", claim=claim, timeout_ms=deadline):
            yield
        return
    deadlines = (processor.limited_deadline_ms(row) or 0 for row in claimed)
    timeout_ms = max(tracker.policy.timeout_ms, *deadlines)
    if len(claimed) > 1:
        timeout_ms += round(budget_s * 1000)
    xid = {"meta": {"id": f"claim:{claim.replace(' ', ':')}"}}
    with tracker.tracking(xid, BATCH_KIND, claim=claim, timeout_ms=timeout_ms):
        yield


@dataclass(frozen=True)
class Pace:
    """How a woken worker paces its claims."""

    budget_s: float = BATCH_BUDGET_S
    # After a claim that found some but was not full: let more come before the next one (a
    # claim that found one message costs as much as one that found fifty).
    poll_s: float = 0.005
    # The woken worker (the owner of the wake-up) keeps looking this long after it last found
    # a due message, waiting for submissions' pokes: a steady stream is claimed by one looping
    # worker, not a task per message.
    linger_s: float = 0.05
    # Then it hands the wake-up over to a new task (fair to the other tasks of its queue).
    active_s: float = 5.0


def claim_size(processor: Processor, limit: int) -> int:
    """How many messages one claim takes: ``limit``, or one while some handler may run
    unlimited (see the module's note)."""
    return limit if processor.all_limited() else 1


def process_batch(
    processor: Processor,
    size: int,
    enqueue: Callable[[int], None],
    budget_s: float = BATCH_BUDGET_S,
) -> tuple[list[ProcessResult], int]:
    """Claim up to ``size`` due messages and process them, then the funnel messages their
    outcomes released, round after round until none is left or ``budget_s`` is spent: the
    results, and how many messages were due at the claim. Children go to ``enqueue``, and so
    do released messages not taken up here."""
    with prepared_connection(processor.engine) as conn:
        started = tracing.now_ns()
        claimed, due = claim_due(
            conn, processor.node_id, size, processor.postponed_s(), processor.rates
        )
        if claimed:  # a span of a claim that took something, linked to their traces
            links = [c.trace_parent for c in claimed]
            tracing.record(
                "claim", started, links=links, attributes={"orderly.claimed": len(claimed)}
            )
        # What its outcomes released and it did not take up waits IN_QUEUE for the woken
        # worker's next claim, in line (beat's wake-up covers a worker that stops looking).
        results = _rounds(processor, conn, claimed, size, enqueue, budget_s, hand_over=False)
        return results, due


def process_message(
    processor: Processor,
    msg_id: int,
    enqueue: Callable[[int], None] | None = None,
    size: int = 1,
    budget_s: float = BATCH_BUDGET_S,
) -> ProcessResult:
    """A single message is a batch of one: claimed by its id (a dead worker's claim is taken
    over at once, its death counted, up to ``worker_lost_limit``), run, then what its outcome
    released, round after round as a batch goes on (up to ``size`` at a time). Without
    ``enqueue`` nothing else runs: its result's ``ready`` lists what it released, its
    ``spawned`` the children it stored."""
    with prepared_connection(processor.engine) as conn:
        claimed = store.claim(
            conn,
            [msg_id],
            processor.node_id,
            processor.worker_lost_limit,
            processor.postponed_s(),
        )
        if not claimed:
            return processor.not_claimed(conn, msg_id)
        if not claimed[0].running:
            return ProcessResult(msg_id, Outcome.POSTPONED, "held back by its funnel")
        waits = processor.rates.refused(claimed) if processor.rates is not None else {}
        if waits:
            # its funnel's start rate is spent: due again when its token is there
            give_back(conn, [msg_id])
            store.defer(conn, waits)
            return ProcessResult(msg_id, Outcome.POSTPONED, "its funnel's start rate is spent")
        return _rounds(processor, conn, claimed, size, enqueue, budget_s)[0]


def _rounds(
    processor: Processor,
    conn: PreparedConnection,
    claimed: list[Claimed],
    size: int,
    enqueue: Callable[[int], None] | None,
    budget_s: float,
    hand_over: bool = True,
) -> list[ProcessResult]:
    """The claimed messages, then, while their outcomes released funnel messages, the next
    claim of what is due (``size`` at a time, in line: a released message takes its turn
    among every due one, so that one busy funnel cannot starve the others), round after round
    on one connection until nothing was released or ``budget_s`` is spent; released messages
    not taken up go to ``enqueue`` (``hand_over``) or wait for the next claim. Without
    ``enqueue``, one round: the results tell what was released and spawned."""
    deadline = time.monotonic() + budget_s
    results: list[ProcessResult] = []
    ready: list[int] = []
    try:
        while claimed:
            runnable = [row for row in claimed if row.running]
            if runnable:
                with tracked(processor, runnable, budget_s):
                    done, left, released = _run(processor, conn, runnable, enqueue, deadline)
                results += done
                ready += released
                if left or enqueue is None:
                    break
            if not ready or time.monotonic() > deadline:
                break
            claimed, _ = claim_due(
                conn, processor.node_id, size, processor.postponed_s(), processor.rates
            )
            taken = {row.msg_id for row in claimed}
            ready = [msg_id for msg_id in ready if msg_id not in taken]
    finally:
        # Released messages have no task of their own: never leave one behind.
        if enqueue is not None and hand_over:
            for msg_id in ready:
                enqueue(msg_id)
    return results


@dataclass
class WokenRun:
    """What a woken worker did: every result, and how many messages were due at each claim."""

    results: list[ProcessResult] = field(default_factory=list)
    claims: list[int] = field(default_factory=list)

    def add(self, found: tuple[list[ProcessResult], int]) -> int:
        self.results += found[0]
        self.claims.append(found[1])
        return found[1]


def run_woken(
    processor: Processor,
    limit: int,
    enqueue: Callable[[int], None],
    *,
    waker: Wake,
    owner: bool,
    send_owner: Callable[[], object],
    send_helper: Callable[[], object],
    pace: Pace = Pace(),
    clock: Clock = SYSTEM,
    sleep: Callable[[float], None] = time.sleep,
    wait: Callable[[Holder, float], bool] = Holder.wait,
) -> WokenRun:
    """What a woken worker does: claim and process due messages, batch after batch, while
    there are any. A claim that comes back full sends one helper (another worker joins; it
    stops at its first empty claim). The owner of the wake-up keeps its mark while it loops,
    so that intake wakes no one else meanwhile: after a claim that found some, it claims again
    ``pace.poll_s`` later (more come together); after one that found none, when a submission
    pokes it (``wait``); once nothing was due for ``pace.linger_s`` it clears the mark and
    looks once more (what was committed before the clear is seen then, and a look that found
    some hands over; what comes after wakes a worker of its own). After ``pace.active_s`` it
    hands the wake-up over to a new task (any worker past it does, unless another looks). A
    claim takes one message while some handler may run unlimited (see the module's note)."""
    woken = _Woken(
        processor,
        claim_size(processor, limit),
        enqueue,
        waker,
        send_owner,
        send_helper,
        pace,
        clock,
        sleep,
        wait,
    )
    run = WokenRun()
    holder = waker.hold() if owner else None
    try:
        woken.loop(run, holder)
    except BaseException:
        if holder is not None:
            _release(holder)  # the next submission wakes a worker again
        raise
    return run


@dataclass(frozen=True)
class _Woken:
    processor: Processor
    size: int
    enqueue: Callable[[int], None]
    waker: Wake
    send_owner: Callable[[], object]
    send_helper: Callable[[], object]
    pace: Pace
    clock: Clock
    sleep: Callable[[float], None]
    wait: Callable[[Holder, float], bool]

    def batch(self, run: WokenRun, holder: Holder | None = None) -> int:
        """One claim and its rounds; a holder is busy meanwhile (what comes then wakes
        another worker) and looking again after."""
        if holder is not None:
            _move(holder.busy)
        due = run.add(process_batch(self.processor, self.size, self.enqueue, self.pace.budget_s))
        if holder is not None:
            _move(holder.looking)
        return due

    def hand_over(self) -> None:
        """A new task for the wake-up, unless a worker looks now (it claims what is due)."""
        wake_quietly(lambda: self.waker.wake(self.send_owner))

    def loop(self, run: WokenRun, holder: Holder | None) -> None:
        pace = self.pace
        started = last_due = self.clock.monotonic()
        helped = False
        while True:
            due = self.batch(run, holder)
            owner = holder is not None and holder.held
            now = self.clock.monotonic()
            if due:
                last_due = now
            if due >= self.size and not helped:
                wake_quietly(self.send_helper)
                helped = True
            if now - started >= pace.active_s:
                if holder is not None:
                    _release(holder)
                # Also when the mark was taken over meanwhile: its holder may have gone before
                # this worker's last batch released funnel messages (IN_QUEUE, no task).
                self.hand_over()
                return
            if due >= self.size:
                continue
            if not due and (not owner or now - last_due >= pace.linger_s):
                break
            if due or holder is None or not owner:
                # Let more come: the next claim takes them together (and what this claim left:
                # released funnel messages past its budget, those it held back).
                self.sleep(pace.poll_s)
                continue
            # Nothing due and looking all along: nothing new is due unless a submission poked
            # it. Claim when one did, else at the end of the linger (the last look).
            if not self.wait(holder, pace.linger_s - (now - last_due)):
                break
        if holder is not None and _release(holder) and self.batch(run):
            self.hand_over()  # what it released past its budget may wait IN_QUEUE


def _move(move: Callable[[], bool]) -> None:
    try:
        move()
    except Exception:
        # The mark stays as it was: at worst a submission meanwhile waits for this worker's
        # next claim, or wakes one more worker than needed.
        log.exception("moving the wake-up mark failed")


def _release(holder: Holder) -> bool:
    """Let go of the mark; whether this worker still held it (then it looks once more)."""
    held = holder.held
    try:
        holder.release()
    except Exception:
        # The mark expires by itself; until then beat's wake-up covers what comes.
        log.exception("letting go of the wake-up failed")
    return held


def _run(
    processor: Processor,
    conn: PreparedConnection,
    claimed: list[Claimed],
    enqueue: Callable[[int], None] | None,
    deadline: float,
) -> tuple[list[ProcessResult], list[int], list[int]]:
    """Run claimed messages in order: their results, the ids given back unstarted, and the
    messages their outcomes released. A batch writes its plain OK outcomes together after the
    round; a message alone writes its own (its result then tells what it released)."""
    results: list[ProcessResult] = []
    held: list[tuple[int, Any]] | None = [] if len(claimed) > 1 else None
    released: list[int] = []
    pending = list(claimed)
    lost: set[int] = set()
    try:
        while pending:
            if results and time.monotonic() > deadline:
                break
            result = processor.run_claimed(conn, pending.pop(0), held)
            results.append(result)
            released += result.ready
            if enqueue is not None:
                for child in result.spawned:
                    enqueue(child)
    finally:
        # Even when something failed on the way: what ran keeps its outcome, and what did not
        # start is not left claimed.
        left = [row.msg_id for row in pending]
        try:
            if held:
                lost, more = finish_held(conn, held)
                released += more
        finally:
            if left:
                give_back(conn, left)
    if lost:
        why = {msg_id: processor.lost(conn, msg_id) for msg_id in sorted(lost)}
        results = [
            ProcessResult(r.msg_id, why[r.msg_id]) if r.msg_id in lost else r for r in results
        ]
    if held:  # written now: counted with what became of them
        ran = {c.msg_id: c for c in claimed}
        wrote = {msg_id for msg_id, _ in held}
        processor.count([(ran[r.msg_id], r.outcome) for r in results if r.msg_id in wrote])
    return results, left, released
