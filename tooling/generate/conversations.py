"""Generated conversation rows: requests and their responses, delivered in order."""

from __future__ import annotations

from collections.abc import Iterator

from orderly.worker.conversations import (
    ERROR_CANCELLED,
    ERROR_EXPIRED,
    ERROR_RETRIES_SPENT,
    REQUEST_SOURCE,
    RESPONSE_SOURCE,
)
from orderly.worker.conversations import SERVICE as CONVERSATION_SERVICE
from tooling.generate.base import _Outcome, _Rows
from tooling.generate.catalogue import (
    AWAITED_DESC,
    EXPIRED_DESC,
)
from tooling.generate.columns import (
    HOUR,
    MINUTE,
    NULL,
    SECOND,
)


class _ConversationRows(_Rows):
    """Conversation requests and responses."""

    # --- conversations -------------------------------------------------------------------
    def conversation(self, at: int, slots: Iterator[int], left: int) -> list[str]:
        """Requests (1-5) and their responses (1-4 each), delivered one after the other."""
        rng = self.rng
        shape = [1 + rng.getrandbits(2) for _ in range(1 + int(rng.random() * 5))]
        size = 0
        for i, responses in enumerate(shape):
            if size + 1 + responses > left:
                shape = [*shape[:i], left - size - 1] if left - size >= 2 else shape[:i]
                break
            size += 1 + responses
        origin = self.origin[rng.getrandbits(10)]
        process = None
        rows: list[str] = []
        delivered = at  # the conversation's last delivery: the next one comes after it
        blocked = False  # an undelivered response holds every later one back
        moment = at
        for r_index, responses in enumerate(shape):
            if r_index:
                moment = next(slots)
            req_id = self.next_id("message")
            request_key = f"rq{self.seed}-{req_id}"
            process = process or f"cv{self.seed}-{req_id}"
            cancel_at = (
                int(rng.random() * responses) if rng.random() < 0.04 and not blocked else None
            )
            parts: list[tuple[int, str, int, _Outcome]] = []
            req_state = "WAITING_FOR_RES"
            req_done = moment
            req_custom: str | None = None
            cancel: tuple[str, int] | None = None
            group_awaited: int | None = None  # conv_group_awaited marks the queued rest too
            for k in range(responses):
                arrived = next(slots)
                res_id = self.next_id("message")
                key = f"rs{self.seed}-{res_id}"
                last = k == responses - 1
                o = _Outcome("IN_QUEUE", done=arrived)
                if cancel is not None:
                    reason = (
                        f"response {cancel[0]}: HTTP 400: unknown request"
                        if arrived <= cancel[1]
                        else "its request was cancelled"
                    )
                    o = _Outcome("CANCEL", code=ERROR_CANCELLED, desc=reason, done=cancel[1])
                elif blocked:
                    if group_awaited is not None and arrived <= group_awaited:
                        o = _Outcome("PARTLY_FAILED", 1, ERROR_RETRIES_SPENT, AWAITED_DESC)
                        o.done = group_awaited
                elif cancel_at == k:
                    done = max(arrived, delivered) + self.lognormal(80, 1.0, 30 * SECOND)
                    if done < self.end:
                        cancel = (key, done)
                        o = _Outcome(
                            "CANCEL",
                            code=ERROR_CANCELLED,
                            desc=f"response {key}: HTTP 400: unknown request",
                            done=done,
                        )
                        req_state, req_done = "CANCEL", done
                    else:
                        blocked = True
                else:
                    done = max(arrived, delivered) + self.lognormal(80, 1.0, 30 * SECOND)
                    if group_awaited is not None and arrived <= group_awaited:
                        o.failed, o.code, o.desc = 1, ERROR_RETRIES_SPENT, AWAITED_DESC
                    elif rng.random() < 0.03:
                        # retries spent: AWAITED, with the group's queued rest; tried later
                        o.failed, o.code, o.desc = 1, ERROR_RETRIES_SPENT, AWAITED_DESC
                        group_awaited = done + 31 * SECOND
                        done = group_awaited + self.lognormal(2 * MINUTE, 1.0, HOUR)
                        if done >= self.end:
                            o.state, blocked = "PARTLY_FAILED", True
                            o.done = min(group_awaited, self.end - 1)
                        elif rng.random() < 0.1:
                            o.state, o.done, delivered = "FAILED", done, done
                            o.code, o.desc = ERROR_EXPIRED, EXPIRED_DESC
                    if o.state == "IN_QUEUE" and done < self.end:
                        o.state, o.done, delivered = "OK", done, done
                        if rng.random() < 0.2:
                            o.custom = f"ACK ack-{res_id}"
                    elif o.state == "IN_QUEUE":
                        blocked = True
                        if rng.random() < 0.5:
                            o.state, o.done = "WAITING_FOR_RES", max(arrived, delivered)
                            o.custom = f"asyncResponseId=ack-{res_id}"
                    if last and req_state != "CANCEL":
                        if o.state == "OK":
                            req_state, req_done = "OK", o.done
                        elif o.state == "FAILED":
                            req_state, req_done = "OK", o.done + 5 * MINUTE
                            req_custom = "closed without a final response"
                parts.append((res_id, key, arrived, o))
            if req_state == "CANCEL" and cancel is not None:
                req_done = cancel[1]
            request = _Outcome(
                req_state,
                code=ERROR_CANCELLED if req_state == "CANCEL" else None,
                desc=f"response {cancel[0]}: HTTP 400: unknown request" if cancel else None,
                done=min(req_done, self.end - 1) if req_state != "WAITING_FOR_RES" else moment,
                custom=req_custom,
            )
            rows.append(
                self.conversation_row(
                    req_id, moment, "request", request_key, request_key, origin, process, request
                )
            )
            for res_id, key, arrived, o in parts:
                rows.append(
                    self.conversation_row(
                        res_id,
                        arrived,
                        "response",
                        key,
                        request_key,
                        origin,
                        process,
                        o,
                        parent=req_id,
                    )
                )
        return rows

    def conversation_row(
        self,
        msg_id: int,
        at: int,
        operation: str,
        key: str,
        request_key: str,
        origin: str,
        process: str,
        o: _Outcome,
        *,
        parent: int | None = None,
    ) -> str:
        ts = self.ts
        source = RESPONSE_SOURCE if parent else REQUEST_SOURCE
        payload = f'{{"{operation}":"{key}","step":{self.rng.getrandbits(4)}}}'
        return (
            f"{msg_id}\t{ts(at - self.rng.getrandbits(9))}\t{ts(at)}\t{CONVERSATION_SERVICE}\t"
            f"{operation}\t{request_key}\t{origin}\t{key}\t{process}\t{payload}\t"
            f'{{"{operation}_id":"{key}","payload":{payload}}}\t'
            f"{source}\t{o.state}\t{o.failed}\t{o.code or NULL}\t{o.desc or NULL}\t"
            f"{ts(max(o.done, at))}\t{NULL}\t{o.custom or NULL}\t{parent or NULL}\t"
            f"{'HARD' if parent else NULL}\t{NULL}\t{NULL}\tf\tf\t"
            f"{self.node[self.rng.getrandbits(10)]}\t{NULL}\t[]\t{NULL}\t{NULL}\t{NULL}\n"
        )
