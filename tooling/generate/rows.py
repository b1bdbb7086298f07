"""The generator: rows of every keyed table from one stream of randomness."""

from __future__ import annotations

from collections.abc import Iterator

from orderly.models import CONFIRMATION_OPERATION, FINAL_STATES
from orderly.worker.messages.processing import ERROR_NO_HANDLER
from orderly.worker.messages.timeouts import TIMEOUT_CODE
from orderly.worker.messages.watchdogs import POSTPONED_CODE, REPAIR_CODE
from orderly.worker.pubsub import QUEUED_LEASE_S
from tooling.generate.base import Batch, _batch, _chunked, _Outcome
from tooling.generate.catalogue import (
    _CHILDREN,
    _CONFIRMED_SOURCES,
    _GENERIC_FAILURES,
    _OP,
    _PUSH_ERRORS,
    _SOAP_SOURCES,
    _SPLIT_SHARE,
    TIMEOUT_FINAL,
    _Call,
    _Op,
    _timeline,
)
from tooling.generate.columns import (
    CONFIRMATION_INTERVAL,
    CONFIRMATION_LIMIT,
    FAILS_BEFORE_FAILED,
    HOUR,
    KEYED_CALLS,
    MINUTE,
    NULL,
    PARTLY_FAILED_INTERVAL,
    POSTPONED_WHEN_FAILED,
    RESPONSE_TIMEOUT,
    SECOND,
)
from tooling.generate.conversations import _ConversationRows
from tooling.generate.pubsub import _PubsubRows
from tooling.generate.waits import _WaitRows


class _Generator(_ConversationRows, _PubsubRows, _WaitRows):
    """Every generated row: the store's messages and what they make here, conversations and
    publish/subscribe rows from their own modules, all from one stream of randomness."""

    # --- messages ------------------------------------------------------------------------
    def message_batches(self) -> Iterator[Batch]:
        """Messages in chunks, each followed by the rows made with it that reference it."""
        side = (
            ("external_call", self.calls),
            ("request", self.requests),
            ("response", self.responses),
        )
        yield from _chunked("message", self.message_units(), side)
        keyed = [f"{self.next_id('external_call')}\t{row}" for row in self.keyed_calls.values()]
        self.keyed_calls.clear()
        yield _batch(KEYED_CALLS, keyed)

    def message_units(self) -> Iterator[list[str]]:
        """Messages that belong together (a parent and its children, a conversation)."""
        rng = self.rng
        slots = _timeline(rng, self.n, self.start, self.end)
        left = self.n
        while left > 0:
            at = next(slots)
            roll = rng.random()
            if roll < 0.014 and left >= 2:
                rows = self.conversation(at, slots, left)
            else:
                op = self.op[rng.getrandbits(10)]
                children = 0
                if op.operation == "placeOrder" and rng.random() < _SPLIT_SHARE and left >= 2:
                    children = min(1 + rng.getrandbits(2), left - 1, len(_CHILDREN))
                    for _ in range(children):
                        next(slots)  # children take their place in the count, at split time
                rows = self.business(at, op, children)
            left -= len(rows)
            yield rows

    def business(self, at: int, op: _Op, children: int) -> list[str]:
        """One message (and the children it split into): its rows, parent first."""
        rng = self.rng
        msg_id = self.next_id("message")
        source = op.sources[rng.getrandbits(8) % len(op.sources)]
        obj = self.obj(op.prefix) if op.entity else None
        funnel = obj if op.funnel and rng.random() < op.funnel else None
        guaranteed = funnel is not None and rng.random() < op.guaranteed
        exclude = guaranteed and rng.random() < 0.2
        correlation = f"gen{self.seed}-{msg_id}"
        sent = at - self.sent_lag[rng.getrandbits(12)]
        if children:
            out = self.split(msg_id, at, sent, op, source, obj, correlation, children)
        else:
            outcome = self.outcome(msg_id, at, op, funnel, guaranteed, exclude)
            self.after(msg_id, sent, op, source, obj, correlation, outcome)
            out = [
                self.message_row(
                    msg_id,
                    sent,
                    at,
                    op,
                    source,
                    obj,
                    correlation,
                    outcome,
                    funnel=funnel,
                    component=f"{op.service}.{op.entity}" if funnel else None,
                    guaranteed=guaranteed,
                    exclude=exclude,
                )
            ]
        return out

    def split(
        self,
        msg_id: int,
        at: int,
        sent: int,
        op: _Op,
        source: str,
        obj: str | None,
        correlation: str,
        count: int,
    ) -> list[str]:
        """A parent that split into children in one transaction: they share its time."""
        split_at = at + self.lognormal(30, 1.0, 10 * SECOND) + self.lognormal(150, 1.0, MINUTE)
        kids: list[tuple[int, _Op, str, _Outcome]] = []
        for n in range(count):
            service, operation, binding = _CHILDREN[n]
            child_op = _OP[(service, operation)]
            child_id = self.next_id("message")
            kids.append((child_id, child_op, binding, self.outcome(child_id, split_at, child_op)))
        hard = [(cid, o) for cid, _, b, o in kids if b == "HARD"]
        ended = sorted(
            ((o.done, cid, o) for cid, o in hard if o.state in ("FAILED", "CANCEL")),
            key=lambda item: (item[0], item[1]),
        )
        if ended:
            done, child_id, child = ended[0]
            cancelled = child.state == "CANCEL"
            parent = _Outcome(
                "FAILED",
                code="E_CHILD_CANCELLED" if cancelled else child.code or "E_CHILD_FAILED",
                desc=f"child message {child_id} "
                f"{'was cancelled' if cancelled else 'failed'}: {child.desc or ''}",
                done=done,
            )
        elif all(o.state == "OK" for _, o in hard):
            parent = _Outcome("OK", done=max([split_at, *(o.done for _, o in hard)]))
        else:
            parent = _Outcome("WAITING", done=split_at)
        parent.queued = at
        rows = [
            self.message_row(
                msg_id,
                sent,
                at,
                op,
                source,
                obj,
                correlation,
                parent,
            )
        ]
        self.confirm(msg_id, sent, source, correlation, parent)
        for n, (child_id, child_op, binding, outcome) in enumerate(kids, start=1):
            child_corr = f"{correlation}/{n}"
            child_obj = self.obj(child_op.prefix) if child_op.entity else None
            self.after(child_id, sent, child_op, source, child_obj, child_corr, outcome)
            rows.append(
                self.message_row(
                    child_id,
                    sent,
                    split_at,
                    child_op,
                    source,
                    child_obj,
                    child_corr,
                    outcome,
                    parent=msg_id,
                    binding=binding,
                )
            )
        return rows

    def outcome(
        self,
        msg_id: int,
        at: int,
        op: _Op,
        funnel: str | None = None,
        guaranteed: bool = False,
        exclude: bool = False,
    ) -> _Outcome:
        """The state a message reached by the window's end, with its failures and times."""
        rng = self.rng
        recent = at >= self.recent
        wait = self.queue_wait[rng.getrandbits(12)]
        run = self.run_time[rng.getrandbits(12)]
        r = rng.random()
        if funnel is not None:
            blocker = self.blocked_funnels.get(funnel)
            if guaranteed and blocker is not None and not exclude and r < 0.5:
                # held behind the funnel's FAILED message, then failed for waiting too long
                done = at + POSTPONED_WHEN_FAILED + self.lognormal(20 * SECOND, 1.0, HOUR)
                if done >= self.end:
                    return _Outcome("POSTPONED", done=at)
                return _Outcome(
                    "FAILED",
                    failed=1,
                    code=POSTPONED_CODE,
                    desc=f"postponed for over {POSTPONED_WHEN_FAILED // SECOND} s behind "
                    f"FAILED message {blocker} of funnel {funnel}",
                    done=done,
                )
            if r < 0.04:
                return _Outcome("POSTPONED", done=at + wait)
            r = rng.random()
        if recent:
            if r < 0.07:
                return _Outcome("NEW", done=at)
            if r < 0.17:
                return _Outcome("IN_QUEUE", done=at + wait, queued=at + wait)
            if r < 0.24:
                return _Outcome(
                    "PROCESSING", done=at + wait, pid=1000 + rng.getrandbits(15), in_flight=True
                )
            if r < 0.34 and op.waits:
                return self.waiting(msg_id, at + wait + run)
        elif r < 0.002:
            # stuck and repaired: the pool found it PROCESSING after its worker died
            failed = 1 + rng.getrandbits(1)
            return _Outcome(
                "PARTLY_FAILED",
                failed=failed,
                code=REPAIR_CODE,
                desc="worker connection lost while PROCESSING",
                done=at + failed * 5 * MINUTE,
                tries=failed,
            )
        r = rng.random()
        if r < 0.86:
            failed = 0 if r < 0.80 else 1 if r < 0.845 else 2 if r < 0.856 else 3
        elif r < 0.90:
            failed = FAILS_BEFORE_FAILED + 1
        elif r < 0.925:
            failed = 1 + (rng.random() < 0.3)
        elif r < 0.94:
            return self.cancelled(at + wait, rng.random() < 0.5)
        elif r < 0.942:
            return _Outcome(
                "FAILED",
                failed=1,
                code=ERROR_NO_HANDLER,
                desc=f"no handler registered for {op.service}.{op.operation}",
                done=at + wait + 5,
            )
        else:
            failed = 0
            if op.waits and r < 0.942 + op.waits * 0.3:
                return self.awaited(msg_id, at + wait + run)
        code = desc = None
        if failed:
            codes = op.codes if rng.random() < 0.75 else _GENERIC_FAILURES
            code, desc = codes[rng.getrandbits(8) % len(codes)]
            if code == TIMEOUT_CODE and failed > FAILS_BEFORE_FAILED:
                desc = TIMEOUT_FINAL
        done = at + wait + run
        for _ in range(failed):
            done += PARTLY_FAILED_INTERVAL + int(rng.random() * MINUTE) + run
        tries = failed + 1
        if failed > FAILS_BEFORE_FAILED:
            state, tries = "FAILED", failed
        elif r >= 0.86 and r < 0.925:
            state, tries = "PARTLY_FAILED", failed
        else:
            state = "OK"
        if done >= self.end:
            # not finished yet: waiting for the pool's next try
            failed = min(failed, FAILS_BEFORE_FAILED)
            state = "PARTLY_FAILED" if failed else "IN_QUEUE"
            done = min(at + wait + run, self.end - 1)
            tries = failed
        return _Outcome(state, failed, code, desc, done, queued=at + wait, tries=tries)

    def message_row(
        self,
        msg_id: int,
        sent: int,
        at: int,
        op: _Op,
        source: str,
        obj: str | None,
        correlation: str,
        o: _Outcome,
        *,
        parent: int | None = None,
        binding: str | None = None,
        funnel: str | None = None,
        component: str | None = None,
        guaranteed: bool = False,
        exclude: bool = False,
        custom: str | None = None,
    ) -> str:
        ts = self.ts
        if o.state == "FAILED" and guaranteed and funnel is not None:
            self.blocked_funnels.setdefault(funnel, msg_id)
        payload = (
            f'{{"{op.entity or "recipient"}":"{obj or correlation}",'
            f'"source":"{source}","amount":{self.rng.getrandbits(16) / 100}}}'
        )
        envelope = (
            f"<soap:Envelope><soap:Body><{op.operation}>{payload}</{op.operation}>"
            "</soap:Body></soap:Envelope>"
            if source in _SOAP_SOURCES
            else f'{{"service":"{op.service}","operation":"{op.operation}",'
            f'"correlation_id":"{correlation}","payload":{payload}}}'
        )
        return (
            f"{msg_id}\t{ts(sent)}\t{ts(at)}\t{op.service}\t{op.operation}\t{obj or NULL}\t"
            f"{op.entity or NULL}\t{correlation}\t{NULL}\t{payload}\t{envelope}\t{source}\t"
            f"{o.state}\t{o.failed}\t{o.code or NULL}\t{o.desc or NULL}\t{ts(o.done)}\t"
            f"{NULL if o.queued is None else ts(o.queued)}\t{custom or o.custom or NULL}\t"
            f"{parent or NULL}\t{binding or NULL}\t{funnel or NULL}\t{component or NULL}\t"
            f"{'t' if guaranteed else 'f'}\t{'t' if exclude else 'f'}\t"
            f"{self.node[self.rng.getrandbits(10)]}\t{o.pid or NULL}\t{o.audit}\t"
            f"{o.wait_id or NULL}\t{NULL if o.deadline is None else ts(o.deadline)}\t"
            f"{o.wait_res or NULL}\n"
        )

    # --- external calls, exchanges, confirmations ---------------------------------------
    def after(
        self,
        msg_id: int,
        sent: int,
        op: _Op,
        source: str,
        obj: str | None,
        correlation: str,
        o: _Outcome,
    ) -> None:
        """The rows a message's processing left: its external call, exchanges, confirmation."""
        rng = self.rng
        call = op.call
        if call is not None and o.tries and rng.random() < call.share:
            if call.keyed_by == "entity" and obj is not None:
                entity = f"entity:{op.entity}:{obj}"
            else:
                entity = f"msg:{source}:{correlation}"
            start = (o.queued or o.done) + 5
            if o.in_flight:
                state = "PROCESSING"
            elif o.state in ("OK", "WAITING_FOR_RES"):
                state = "OK"
            else:
                state = "FAILED"
            failed = o.failed if state != "OK" else max(0, o.tries - 1)
            row = (
                f"{call.operation}\t{state}\t{entity}\t{self.ts(sent)}\t{self.ts(start)}\t"
                f"{self.ts(max(o.done, start))}\t{failed}\t{NULL}\n"
            )
            if call.keyed_by == "entity":
                # the key's row belongs to its newest message; ids are given when written
                self.keyed_calls[(call.operation, entity)] = f"{msg_id}\t{row}"
            else:
                self.calls.append(f"{self.next_id('external_call')}\t{msg_id}\t{row}")
            if rng.random() < call.logged:
                self.exchanges(msg_id, call, obj or correlation, start, o, state)
        if o.wait_id is not None:
            self.wait_exchange(msg_id, o)
        self.confirm(msg_id, sent, source, correlation, o)

    def exchanges(
        self, msg_id: int, call: _Call, key: str, start: int, o: _Outcome, state: str
    ) -> None:
        """One logged request per try; the last answered unless the call is still running."""
        ts = self.ts
        tries = max(o.tries, 1)
        step = max((o.done - start) // tries, 1)
        for n in range(tries):
            req_id = self.next_id("request")
            at = start + n * step
            self.requests.append(
                f"{req_id}\t{msg_id}\t{NULL}\t{call.uri}\t"
                f'{{"key":"{key}","try":{n + 1}}}\t{ts(at)}\n'
            )
            last = n == tries - 1
            if last and state == "PROCESSING":
                break  # no answer yet
            answered = at + self.lognormal(120, 1.0, 30 * SECOND)
            if last and state == "OK":
                self.responses.append(
                    f"{self.next_id('response')}\t{req_id}\t"
                    f'{{"status":"ACCEPTED","ref":"{key}"}}\t{NULL}\t{ts(answered)}\tf\t'
                    f"{msg_id}\n"
                )
            else:
                reason = _PUSH_ERRORS[self.rng.getrandbits(8) % len(_PUSH_ERRORS)]
                body = reason.split(": ", 1)[-1] if reason.startswith("HTTP") else NULL
                self.responses.append(
                    f"{self.next_id('response')}\t{req_id}\t{body}\t{reason}\t{ts(answered)}\t"
                    f"t\t{msg_id}\n"
                )

    def wait_exchange(self, msg_id: int, o: _Outcome) -> None:
        """The request a waiting handler sent, and the response that ended the wait."""
        assert o.wait_id is not None and o.queued is not None
        assert o.deadline is not None
        req_id = self.next_id("request")
        self.requests.append(
            f"{req_id}\t{msg_id}\t{o.wait_id}\thttps://partner.example.com/async/requests\t"
            f'{{"correlation":"{o.wait_id}"}}\t{self.ts(o.deadline - RESPONSE_TIMEOUT)}\n'
        )
        if o.wait_res is not None:
            self.responses.append(
                f"{o.wait_res}\t{req_id}\t"
                f'{{"correlation_id":"{o.wait_id}","result":"done"}}\t{NULL}\t'
                f"{self.ts(o.queued)}\tf\t{msg_id}\n"
            )

    def confirm(self, msg_id: int, sent: int, source: str, correlation: str, o: _Outcome) -> None:
        """The confirmation the state trigger records for a final state of a told source."""
        if source not in _CONFIRMED_SOURCES or o.state not in FINAL_STATES:
            return
        rng = self.rng
        ts = self.ts
        created = o.done
        r = rng.random()
        if created >= self.end - 10 * MINUTE and r < 0.3:
            state, failed = ("PROCESSING", 0) if r < 0.15 else ("FAILED", 1)
        elif r < 0.95:
            state, failed = "OK", 0
        elif r < 0.985:
            state, failed = "OK", 1 + (r > 0.975)
        else:
            state, failed = "FAILED_END", CONFIRMATION_LIMIT
        tries = failed + (1 if state == "OK" else 0)
        uri = f"https://{source}.example.com/orderly/confirmations"
        code = "null" if o.code is None else f'"{o.code}"'
        desc = "null" if o.desc is None else f'"{o.desc}"'
        body = (
            f'{{"msg_id":{msg_id},"correlation_id":"{correlation}","source_system":"{source}",'
            f'"state":"{o.state}","failed_error_code":{code},"failed_desc":{desc}}}'
        )
        at = created + self.lognormal(300, 1.0, 30 * SECOND)
        for n in range(1, tries + 1):
            req_id = self.next_id("request")
            self.requests.append(
                f"{req_id}\t{msg_id}\tconfirmation:{msg_id}:{n}\t{uri}\t{body}\t{ts(at)}\n"
            )
            answered = at + self.lognormal(80, 1.0, 5 * SECOND)
            if n == tries and state == "OK":
                self.responses.append(
                    # an empty 2xx body, as the sender logs it (the seed: no envelope needs a
                    # failed reason)
                    f"{self.next_id('response')}\t{req_id}\t\t{NULL}\t{ts(answered)}\tf\t{msg_id}\n"
                )
            else:
                self.responses.append(
                    f"{self.next_id('response')}\t{req_id}\tService Unavailable\t"
                    f"HTTP 503: Service Unavailable\t{ts(answered)}\tt\t{msg_id}\n"
                )
            at = answered + CONFIRMATION_INTERVAL + int(rng.random() * SECOND)
        last = at - CONFIRMATION_INTERVAL if tries else created
        if state == "PROCESSING":
            due = ts(created + int(QUEUED_LEASE_S * SECOND))
        elif state == "FAILED":
            due = ts(last + CONFIRMATION_INTERVAL)
        else:
            due = NULL
        self.calls.append(
            f"{self.next_id('external_call')}\t{msg_id}\t{CONFIRMATION_OPERATION}\t{state}\t"
            f"{msg_id}\t{ts(sent)}\t{ts(created)}\t{ts(max(last, created))}\t{failed}\t{due}\n"
        )
