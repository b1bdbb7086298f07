"""Generated publish/subscribe rows: events, deliveries and their attempts, handler logs."""

from __future__ import annotations

from collections.abc import Iterator

from orderly.worker.core.retry import RetryPolicy
from orderly.worker.pubsub import QUEUED_LEASE_S
from tooling.generate.base import Batch, _chunked, _Rows
from tooling.generate.catalogue import (
    _HANDLER_ERRORS,
    _PUSH_ERRORS,
    _table,
    _timeline,
)
from tooling.generate.columns import (
    HOUR,
    NULL,
    SECOND,
)
from tooling.generate.setup import _Room, _Sub


class _PubsubRows(_Rows):
    """Events, deliveries, published_messages and queue_message rows."""

    # --- publish/subscribe ---------------------------------------------------------------
    def pubsub_batches(self) -> Iterator[Batch]:
        """Events in chunks, each followed by their deliveries, attempts and handler log."""
        side = (
            ("delivery", self.deliveries),
            ("published_messages", self.published),
            ("queue_message", self.queued),
        )
        yield from _chunked("event", ([row] for row in self.event_rows()), side)

    def event_rows(self) -> Iterator[str]:
        rng = self.rng
        ts = self.ts
        count = max(1, self.n // 10)
        room_pick = _table([(room, room.spec.weight) for room in self.rooms])
        for at in _timeline(rng, count, self.start, self.end):
            room = room_pick[rng.getrandbits(10)]
            etype_name, etype_id, subs = room.types[rng.getrandbits(8) % len(room.types)]
            event_id = self.next_id("event")
            correlation = f"gen{self.seed}e{event_id}"
            obj = self.obj(room.spec.prefix)
            payload = (
                f'{{"{room.spec.id_field}": "{obj}", "amount": {rng.getrandbits(16) / 100}, '
                f'"currency": "EUR"}}'
            )
            delayed = rng.random() < 0.05
            deliver = at + (self.lognormal(60 * SECOND, 1.0, HOUR) if delayed else 0)
            expires = None if not room.spec_expiration else at + room.spec_expiration
            yield (
                f"{event_id}\t{correlation}\t{room.room_id}\t{etype_id}\t1\t{etype_name}\t"
                f"{payload}\tsvc-{room.spec.name}\t{ts(at)}\t{ts(deliver)}\t"
                f"{NULL if expires is None else ts(expires)}\t{'f' if subs else 't'}\n"
            )
            for sub in subs:
                self.delivery(event_id, correlation, etype_name, payload, obj, deliver, delayed,
                              expires, room, sub)  # fmt: skip

    def delivery(
        self,
        event_id: int,
        correlation: str,
        routing_key: str,
        payload: str,
        obj: str,
        deliver: int,
        delayed: bool,
        expires: int | None,
        room: _Room,
        sub: _Sub,
    ) -> None:
        """One delivery with its attempts: published_messages rows, and for a handler the
        queue log, as worker.pubsub settles them."""
        rng = self.rng
        ts = self.ts
        delivery_id = self.next_id("delivery")
        attempts = sub.attempts
        r = rng.random()
        if r < 0.85:
            failures = 0
        elif r < 0.95:
            failures = 1
        elif r < 0.975:
            failures = 2
        else:
            failures = attempts + 1  # attempts spent
        if deliver >= self.recent and sub.kind == "PUSH" and rng.random() < 0.5:
            failures = attempts + 1  # the endpoint is down: retries are still going on
        failures = min(failures, attempts + 1)
        due = deliver
        start = due + self.lognormal(30, 1.0, 10 * SECOND)
        state = "DELIVERED"
        last_error: str | None = None
        delivered_at: int | None = None
        attempt = 0
        pull = sub.kind == "PULL"
        errors: tuple[str, ...] = _HANDLER_ERRORS if sub.kind == "HANDLER" else _PUSH_ERRORS
        if pull:
            # a pulled message not ACKed within the visibility timeout comes back
            errors = ("not ACKed in time",)
        claimed: int | None = None
        while True:
            took = self.lognormal(60, 1.0, 20 * SECOND)
            end = start + took
            if end >= self.end:
                # still running or waiting at the window's end
                state = "IN_PROCESS" if start < self.end else "PENDING"
                claimed = start if state == "IN_PROCESS" else None
                break
            if expires is not None and start >= expires:
                state, last_error = "EXPIRED", "past the room's message expiration"
                self.publish(delivery_id, correlation, event_id, sub, attempt, end, None,
                             "EXPIRED", last_error)  # fmt: skip
                break
            if attempt >= failures:
                state, delivered_at = "DELIVERED", end
                self.publish(delivery_id, correlation, event_id, sub, attempt, end, end,
                             "DELIVERED", None)  # fmt: skip
                self.handler_log(delivery_id, payload, routing_key, delayed, deliver, sub,
                                 start, end, None)  # fmt: skip
                break
            error = errors[rng.getrandbits(8) % len(errors)]
            exception_id = None
            if sub.kind == "HANDLER":
                exception_id = f"{rng.getrandbits(128):032x}"
                error = f"{error} [{exception_id}]"
            nxt = attempt + 1
            wait = (
                30 * SECOND
                if pull
                else RetryPolicy(sub.delay_ms, sub.multiplier, sub.attempts).delay(nxt)
            )
            if attempts == 0 or nxt > attempts:
                state = "DEAD"
                last_error = f"{error} (attempts spent: {attempts})"
                outcome = "DEAD"
            elif not pull and expires is not None and end + wait >= expires:
                state = "EXPIRED"
                last_error = f"{error} (the next try would come after expiry)"
                outcome = "EXPIRED"
            else:
                last_error, outcome = error, "FAILED"
            self.publish(delivery_id, correlation, event_id, sub, attempt, end, None, outcome,
                         last_error)  # fmt: skip
            self.handler_log(delivery_id, payload, routing_key, delayed, deliver, sub, start,
                             end, exception_id)  # fmt: skip
            attempt = nxt
            if outcome != "FAILED":
                break
            due = end + wait
            start = due + self.lognormal(30, 1.0, 10 * SECOND)
            if start >= self.end:
                state = "PENDING"
                break
        if state == "DELIVERED":
            last_error = None
        elif pull and attempt:
            last_error = "not ACKed within the visibility timeout"
        lease = int(QUEUED_LEASE_S * SECOND)
        order = obj if sub.order_key else None
        self.deliveries.append(
            f"{delivery_id}\t{event_id}\t{sub.subscription_id}\t{state}\t"
            f"{'t' if pull else 'f'}\t{order or NULL}\t{attempt}\t{ts(due)}\t"
            f"{ts(due if pull or state == 'PENDING' else due + lease)}\t"
            f"{NULL if claimed is None else ts(claimed)}\t"
            f"{NULL if claimed is None or pull else f'{rng.getrandbits(128):032x}'}\t"
            f"{NULL if delivered_at is None else ts(delivered_at)}\t{last_error or NULL}\n"
        )

    def publish(
        self,
        delivery_id: int,
        correlation: str,
        event_id: int,
        sub: _Sub,
        attempt: int,
        at: int,
        delivered: int | None,
        outcome: str,
        error: str | None,
    ) -> None:
        ts = self.ts
        self.published.append(
            f"{self.next_id('published_messages')}\t{correlation}\t{delivery_id}\t{event_id}\t"
            f"{sub.subscription_id}\t{attempt}\t{ts(at)}\t"
            f"{NULL if delivered is None else ts(delivered)}\t{outcome}\t{error or NULL}\n"
        )

    def handler_log(
        self,
        delivery_id: int,
        payload: str,
        routing_key: str,
        delayed: bool,
        deliver: int,
        sub: _Sub,
        start: int,
        end: int,
        exception_id: str | None,
    ) -> None:
        if sub.kind != "HANDLER":
            return
        ts = self.ts
        self.queued.append(
            f"{self.next_id('queue_message')}\t{delivery_id}\t{payload}\t{routing_key}\t"
            f"{ts(deliver) if delayed else NULL}\t{ts(start)}\t{ts(end)}\t"
            f"{'Error' if exception_id else 'Completed'}\t"
            f"{(60 << 20) + self.rng.getrandbits(26)}\n"
        )
