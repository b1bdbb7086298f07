"""Outcomes of messages that waited: for an asynchronous response (it came, or the wait timed
out), or for an operator who cancelled them."""

from __future__ import annotations

from orderly.worker.messages.processing import ERROR_HANDLER
from orderly.worker.messages.watchdogs import TIMEOUT_CODE as RESPONSE_TIMEOUT_CODE
from tooling.generate.base import _Outcome, _Rows
from tooling.generate.catalogue import _CANCEL_NOTES, _OPERATORS, _iso
from tooling.generate.columns import DAY, MINUTE, RESPONSE_TIMEOUT, SECOND


class _WaitRows(_Rows):
    def waiting(self, msg_id: int, at: int) -> _Outcome:
        wait_id = f"gen{self.seed}-wait-{msg_id}"
        return _Outcome(
            "WAITING_FOR_RES",
            done=at,
            queued=at,
            wait_id=wait_id,
            deadline=at + RESPONSE_TIMEOUT,
            tries=1,
            custom=f"waits for {wait_id}",
        )

    def awaited(self, msg_id: int, at: int) -> _Outcome:
        """A message that waited for an asynchronous response: it came, or the wait timed out."""
        outcome = self.waiting(msg_id, at)
        assert outcome.deadline is not None
        if self.rng.random() < 0.08:
            if outcome.deadline < self.end:
                outcome.state, outcome.failed = "FAILED", 1
                outcome.code = RESPONSE_TIMEOUT_CODE
                outcome.desc = (
                    f"no response for correlation id {outcome.wait_id} "
                    f"by {self.ts(outcome.deadline)}"
                )
                outcome.done = outcome.deadline + self.lognormal(2000, 1.0, MINUTE)
            return outcome
        answered = at + self.lognormal(20 * SECOND, 1.5, RESPONSE_TIMEOUT - 1)
        if answered >= self.end:
            return outcome
        outcome.wait_res = self.next_id("response")
        outcome.state = "OK"
        outcome.queued = answered
        outcome.done = answered + self.lognormal(150, 1.0, MINUTE)
        outcome.custom = None
        return outcome

    def cancelled(self, at: int, after_failures: bool) -> _Outcome:
        rng = self.rng
        failed, code, before = 0, None, "POSTPONED"
        if after_failures:
            failed = 1 + rng.getrandbits(1)
            code, before = ERROR_HANDLER, "PARTLY_FAILED"
        done = at + self.lognormal(20 * MINUTE, 1.0, 2 * DAY)
        if done >= self.end:
            return _Outcome(before, failed, code, None if code is None else "handler failed", at)
        who = _OPERATORS[rng.getrandbits(8) % len(_OPERATORS)]
        note = _CANCEL_NOTES[rng.getrandbits(8) % len(_CANCEL_NOTES)]
        error = "null" if code is None else f'"{code}"'
        audit = (
            f'[{{"at": "{_iso(done)}", "by": "{who}", "from": "{before}", '
            f'"note": "{note}", "error": {error}, "action": "CANCEL"}}]'
        )
        desc = None if code is None else "ConnectionError: connection reset by peer"
        return _Outcome("CANCEL", failed, code, desc, done, audit=audit, tries=failed)
