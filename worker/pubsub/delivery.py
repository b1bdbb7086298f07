"""Delivery of events: claim a batch of due deliveries, send each (push, or the consumer
chosen by routing key), record every attempt and what comes next (the due work and upkeep
around it: worker.pubsub.due; each endpoint's pace and health: worker.pubsub.endpoints).

A failed attempt is retried after ``deliveryDelay * multiplier ^ attempt`` (the retry
policy, the room's or the subscription's override); when the attempts are spent the delivery
is dead-lettered, and one whose next try would come after its room's expiration expires. An
ordered subscription's next delivery of a key is released at once when its head is final.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine

from orderly.models import DeliveryState, SubscriptionKind
from orderly.worker import tokens
from orderly.worker.core import logs
from orderly.worker.core import tracing as otel
from orderly.worker.core.clock import SYSTEM, Clock, now_ms, utcnow
from orderly.worker.core.errors import Unauthorized
from orderly.worker.core.lease import new_token
from orderly.worker.db.queries import sql
from orderly.worker.pubsub.claims import Attempt, Claimed, Failure, Push
from orderly.worker.pubsub.consumers import consumers
from orderly.worker.pubsub.endpoints import Disabled, EndpointPolicy, Endpoints
from orderly.worker.pubsub.measure import Measure, tracing
from orderly.worker.totals import DELIVERIES, TALLY

log = logging.getLogger(__name__)


# --- delivery ------------------------------------------------------------------------------------


@dataclass
class _Done:
    """What happened to one claimed delivery, for the settling transaction."""

    claimed: Claimed
    started: datetime
    attempt: Attempt | None = None  # None: not sent (expired or refused)
    refused: str | None = None
    failure: Failure | None = None
    memory: int | None = None  # bytes the attempt allocated at its peak


def deliver_batch(
    engine: Engine,
    delivery_ids: list[int],
    push: Push,
    secret: str = "",
    clock: Clock = SYSTEM,
    endpoints: Endpoints | None = None,
) -> list[str]:
    """Claim deliveries, send each, record every attempt and what comes next; new states.

    Each batch is two transactions: the claims, and the outcomes. Neither waits for the disk:
    a database crash in that instant can only make a delivery come again, never lose it.
    ``endpoints``: the endpoints' pace and health (worker.pubsub.endpoints; the defaults, and
    no rates, when not given).
    """
    endpoints = endpoints or Endpoints()
    claim = new_token()
    # One connection from the claim to the last outcome: its backend pid, recorded with the
    # claim, is this worker's liveness (a worker that dies drops it, and beat releases the
    # claim within a second: upkeep).
    with engine.connect() as conn:
        with conn.begin():
            endpoints.lock(conn, delivery_ids)
            rows = conn.execute(sql("deliveries_claim"), {"ids": delivery_ids, "claim": claim})
            # sent in publish order (the order the batch's deliveries were made in)
            claimed = sorted((Claimed(**r._mapping) for r in rows), key=lambda c: c.delivery_id)
            # a token for each send to a paced endpoint; the ones without go back, unsent
            paced = endpoints.refused(claimed)
            endpoints.hold_back(conn, paced, claim)
            probes = [c for c in claimed if c.probe and c.delivery_id in paced]
            endpoints.probe_later(conn, [(c, paced[c.delivery_id]) for c in probes])
        claimed = [c for c in claimed if c.delivery_id not in paced]
        with tracing():
            done, held_back = _send(claimed, push, secret, clock, endpoints.policy)
        states, disabled = _record(conn, delivery_ids, done, claim, clock, endpoints)
        if held_back:
            with conn.begin():
                endpoints.hold_back(conn, {c.delivery_id: c.timeout_ms for c in held_back}, claim)
    endpoints.announce(disabled)
    for delivery_id in paced:
        states[delivery_ids.index(delivery_id)] = "PACED"
    for c in held_back:
        states[delivery_ids.index(c.delivery_id)] = "HELD_BACK"
    return states


def _send(
    claimed: list[Claimed], push: Push, secret: str, clock: Clock, policy: EndpointPolicy
) -> tuple[list[_Done], list[Claimed]]:
    """Try each claimed delivery, in order; once a PUSH endpoint has failed
    ``circuit_failures`` sends in a row in this batch, the rest of its deliveries are held
    back unsent (a down endpoint gets no more than that from one batch)."""
    done: list[_Done] = []
    held_back: list[Claimed] = []
    streak: dict[int, int] = {}
    for c in claimed:
        is_push = c.kind == SubscriptionKind.PUSH.value
        if is_push and streak.get(c.subscription_id, 0) >= policy.circuit_failures:
            held_back.append(c)
            continue
        d = _attempt(c, push, secret, clock)
        if is_push and d.attempt is not None:
            failed = not d.attempt.ok and not d.attempt.stop
            streak[c.subscription_id] = streak.get(c.subscription_id, 0) + 1 if failed else 0
        done.append(d)
    return done, held_back


def _record(
    conn: Connection,
    delivery_ids: list[int],
    done: list[_Done],
    claim: str,
    clock: Clock,
    endpoints: Endpoints,
) -> tuple[list[str], list[Disabled]]:
    """The outcomes of one batch, recorded while its claim holds each delivery; with the
    endpoints its failures disabled."""
    states = dict.fromkeys(delivery_ids, "NOT_CLAIMABLE")
    disabled: list[Disabled] = []
    endpoint = {d.claimed.delivery_id: d.claimed.subscription_id for d in done}
    # The common case, deliveries sent without an ordering key, is recorded for the whole
    # batch at once.
    plain = [
        d for d in done if d.attempt is not None and d.attempt.ok and d.claimed.order_value is None
    ]
    if plain:
        ids = [d.claimed.delivery_id for d in plain]
        values = {
            "ids": ids,
            "claim": claim,
            "starts": [d.started for d in plain],  # each try's own start
            "memory": [d.memory for d in plain],
        }
        sent = [d.claimed for d in plain]
        with conn.begin():
            endpoints.lock_for_settle(conn, endpoints.written(sent, failing=False))
            held = {int(r.delivery_id) for r in conn.execute(sql("deliveries_delivered"), values)}
            endpoints.ended(conn, sent)
            endpoints.healed(
                conn,
                [
                    d.claimed.subscription_id
                    for d in plain
                    if d.claimed.unhealthy and d.claimed.kind == SubscriptionKind.PUSH.value
                ],
            )
        for delivery_id in ids:
            states[delivery_id] = "DELIVERED" if delivery_id in held else "LOST_CLAIM"
        recorded = set(ids)
        done = [d for d in done if d.claimed.delivery_id not in recorded]
    if not done:
        return _counted(states, endpoint, delivery_ids), disabled
    written = endpoints.written([d.claimed for d in done], failing=True)
    try:
        with conn.begin():
            conn.execute(sql("async_commit"))
            endpoints.lock_for_settle(conn, written)
            for d in done:
                states[d.claimed.delivery_id] = _settle(conn, d, claim, clock, endpoints, disabled)
            endpoints.ended(conn, [d.claimed for d in done])
    except Exception:
        # One bad delivery must not hold back the batch: again, one savepoint each, and the
        # one that cannot be recorded is dead-lettered with the reason.
        log.exception("recording a batch of deliveries failed; recording one by one")
        disabled.clear()
        with conn.begin():
            conn.execute(sql("async_commit"))
            endpoints.lock_for_settle(conn, written)
            for d in done:
                try:
                    with conn.begin_nested():
                        states[d.claimed.delivery_id] = _settle(
                            conn, d, claim, clock, endpoints, disabled
                        )
                except Exception as exc:
                    log.exception("recording delivery %s failed", d.claimed.delivery_id)
                    states[d.claimed.delivery_id] = _dead_letter(conn, d, claim, exc)
            endpoints.ended(conn, [d.claimed for d in done])
    return _counted(states, endpoint, delivery_ids), disabled


_SETTLED = frozenset({"DELIVERED", "PENDING", "DEAD", "EXPIRED"})


def _counted(states: dict[int, str], endpoint: dict[int, int], order: list[int]) -> list[str]:
    """The batch's outcomes in ``order``, each committed one counted by its endpoint (whose
    DEAD series is there from its first send, at 0: an alert on its increase sees the first)."""
    for delivery_id, state in states.items():
        if state in _SETTLED and delivery_id in endpoint:
            TALLY.add(DELIVERIES, str(endpoint[delivery_id]), state)
            TALLY.add(DELIVERIES, str(endpoint[delivery_id]), "DEAD", amount=0)
    return [states[i] for i in order]


def deliver(
    engine: Engine,
    delivery_id: int,
    push: Push,
    secret: str = "",
    clock: Clock = SYSTEM,
    endpoints: Endpoints | None = None,
) -> str:
    return deliver_batch(engine, [delivery_id], push, secret, clock, endpoints)[0]


def _dead_letter(conn: Connection, d: _Done, claim: str, exc: Exception) -> str:
    failure = Failure.of(exc)
    why = f"cannot be recorded: {type(exc).__name__}: {exc}"
    conn.execute(
        sql("delivery_dead_letter"),
        {
            "why": why,
            "id": d.claimed.delivery_id,
            "claim": claim,
            "exc_type": failure.type,
            "exc_traceback": failure.traceback,
            "started": d.started,
        },
    )
    return DeliveryState.DEAD.value


def _attempt(c: Claimed, push: Push, secret: str, clock: Clock) -> _Done:
    attributes = {
        "orderly.delivery_id": c.delivery_id,
        "orderly.subscription_id": c.subscription_id,
    }
    with otel.span(f"deliver {c.room}", parent=c.trace_parent, attributes=attributes):
        return _try(c, push, secret, clock)


def _try(c: Claimed, push: Push, secret: str, clock: Clock) -> _Done:
    started = utcnow(clock)
    if c.expires_at is not None and c.expires_at <= started:
        expired = Failure("MessageExpired", f"past the room's message expiration ({c.expires_at})")
        return _Done(c, started, failure=expired)
    if c.kind != SubscriptionKind.HANDLER.value:
        return _measured(c, started, lambda: push(c))
    try:
        claims = tokens.verify(secret, c.token, now_ms=now_ms(clock))
        if (claims.user, claims.impersonator, claims.correlation_id) != (
            c.user,
            c.impersonator,
            c.correlation_id,
        ):
            raise Unauthorized("the token was signed for another message or user")
    except Unauthorized as exc:
        return _Done(c, started, refused=f"unauthorized: {exc}", failure=Failure.of(exc))
    handler = consumers.get(c.handler or "")

    def consume() -> Attempt:
        if handler is None:
            raise LookupError(f"no consumer registered for {c.handler!r}")
        handler(c)
        return Attempt(True)

    return _measured(c, started, consume)


def _measured(c: Claimed, started: datetime, run: Callable[[], Attempt]) -> _Done:
    """One try (a push, a consumer), with the memory it allocated; what it raises is its
    failure (a sender's bug, a consumer's error: never a delivery left claimed)."""
    sent = Attempt(False)
    failure: Failure | None = None
    with Measure() as used:
        try:
            sent = run()
        except Exception as exc:
            failure = Failure.of(exc)
    if failure is not None:
        # its line (with the traceback) is written when its outcome is: _log_failure
        sent = Attempt(False, f"{failure.type}: {failure.message}")
    elif not sent.ok:
        failure = Failure(sent.error_type, sent.error)
    return _Done(c, started, sent, failure=failure, memory=used.bytes)


def _log_failure(d: _Done, state: str, wait_ms: int, why: str) -> None:
    """One line per failed send, with the delivery's ids as fields: WARNING while it will be
    tried again, ERROR (with the traceback, when one was thrown) when it is dead or expired."""
    c = d.claimed
    with logs.bound(
        delivery_id=c.delivery_id,
        subscription_id=c.subscription_id,
        correlation_id=c.correlation_id,
        room=c.room,
        attempt=c.attempt + 1,
    ):
        if state == "PENDING":
            log.warning(
                "delivery %s to subscription %s failed, send %d: %s; sent again in %d ms",
                c.delivery_id,
                c.subscription_id,
                c.attempt + 1,
                why,
                wait_ms,
            )
        else:
            log.error(
                "delivery %s to subscription %s is %s after send %d: %s%s",
                c.delivery_id,
                c.subscription_id,
                state,
                c.attempt + 1,
                why,
                ""
                if d.failure is None or d.failure.traceback is None
                else "\n" + d.failure.traceback,
            )


def _set_state(
    conn: Connection,
    d: _Done,
    claim: str,
    state: str,
    next_attempt: int,
    wait_ms: int | None,
    why: str | None,
    outcome: str,
    clock: Clock,
) -> bool:
    """Record the outcome, its published_messages rows and its queue log rows (with the
    failure's log_exception row) in one statement, only while this claim still holds the
    delivery."""
    c = d.claimed
    at = None if wait_ms is None else utcnow(clock) + timedelta(milliseconds=wait_ms)
    failure = d.failure
    done = conn.execute(
        sql("delivery_settle"),
        {
            "state": state,
            "next_attempt": next_attempt,
            "at": at,
            "why": why,
            "id": c.delivery_id,
            "claim": claim,
            "c": c.correlation_id,
            "a": c.attempt,
            "started": d.started,
            "o": outcome,
            "next_delay_ms": wait_ms if state == "PENDING" else None,
            "exc_type": None if failure is None else failure.type[:200],
            "exc_message": None if failure is None else failure.message,
            "exc_traceback": None if failure is None else failure.traceback,
            "memory": d.memory,
        },
    )
    return done.first() is not None


def _settle(
    conn: Connection,
    d: _Done,
    claim: str,
    clock: Clock,
    endpoints: Endpoints,
    disabled: list[Disabled],
) -> str:
    c = d.claimed
    push = c.kind == SubscriptionKind.PUSH.value
    if d.refused is not None:
        # Consumer authorization failed: never processed, dead-lettered with the reason.
        state = "DEAD"
        held = _set_state(conn, d, claim, state, c.attempt, None, d.refused, "DEAD", clock)
        if held:
            _log_failure(d, state, 0, d.refused)
    elif d.attempt is None:
        state, why = "EXPIRED", "past the room's message expiration"
        held = _set_state(conn, d, claim, state, c.attempt, None, why, "EXPIRED", clock)
        if held:
            _log_failure(d, state, 0, why)
    elif d.attempt.ok:
        state = "DELIVERED"
        held = _set_state(conn, d, claim, state, c.attempt, None, None, "DELIVERED", clock)
        if held and push and c.unhealthy:
            endpoints.healed(conn, [c.subscription_id])
    elif d.attempt.stop:
        # The receiver answered: it wants no more tries of this one. Its endpoint is up.
        state, why = "DEAD", f"the receiver stopped its retries: {d.attempt.error}"
        held = _set_state(conn, d, claim, state, c.attempt + 1, None, why, "DEAD", clock)
        if held and push and c.unhealthy:
            endpoints.healed(conn, [c.subscription_id])
    else:
        policy = c.policy
        next_attempt = c.attempt + 1
        wait = d.attempt.retry_after_ms
        if wait is None:
            wait = policy.delay(next_attempt)
        # A probe of a down endpoint is the endpoint's send: it spends no message's last chance.
        kept = push and c.probe and not policy.allows(next_attempt)
        if kept:
            wait = min(wait, endpoints.policy.probe_max_ms)
        at = utcnow(clock) + timedelta(milliseconds=wait)
        if push:
            gone = endpoints.failed(conn, c, d.attempt.error)
            if gone is not None:
                disabled.append(gone)
        if not policy.allows(next_attempt) and not kept:
            state, why = "DEAD", f"{d.attempt.error} (attempts spent: {c.attempts} sends)"
        elif c.expires_at is not None and at >= c.expires_at:
            state, why = "EXPIRED", f"{d.attempt.error} (the next try would come after expiry)"
        elif kept:
            state, why = "PENDING", f"{d.attempt.error} (a probe of its endpoint's open circuit)"
        else:
            state, why = "PENDING", d.attempt.error
        outcome = "FAILED" if state == "PENDING" else state
        held = _set_state(conn, d, claim, state, next_attempt, wait, why, outcome, clock)
        if held:
            _log_failure(d, state, wait, why)
    if not held:
        # The claim was released meanwhile (too slow) and the delivery taken over: its
        # outcome now belongs to the new holder.
        log.warning("delivery %s was taken over; this outcome is dropped", c.delivery_id)
        return "LOST_CLAIM"
    if state != "PENDING" and c.order_value is not None:
        # An ordered key's head is final: its successor is due at once (a retry waiting at
        # the head keeps holding its key).
        conn.execute(
            sql("delivery_release_next"),
            {"s": c.subscription_id, "v": c.order_value, "d": c.delivery_id},
        )
    return state
