"""Submits that do not wait for their commit: a producer hands over one message a call and goes
on, and the messages handed over meanwhile are stored together.

:class:`Pipeline` validates each message in the caller's thread (a bad one raises at once,
nothing of it queued) and returns a :class:`concurrent.futures.Future`, answered with the
message's :class:`SubmitResult` (or what refused it: a conflict, a node refusing input, a
broker that is down) only after the transaction that stored it committed. The storing is the
API's group commit (``Intake.store_together``, worker.core.group_commit) on an event loop of
the pipeline's own thread: every message handed over while a group is being written goes into
the next one. A future answered is as durable as ``Intake.submit`` returning.

One writer stores the groups one after another, in the order they were handed over; inside a
group the rows are inserted in key order (source system, correlation id), so msg_ids follow
that order. A funnel's message goes in a group too, stored NEW as in a batch
(``Intake.submit_many``: the claim holds it back while an earlier one of its funnel, by
``msg_timestamp`` then msg_id, is in flight); a group of one is stored as a lone submit, and
may be answered POSTPONED. Should a group's statement fail, its messages are stored each on its
own, side by side, while the next group goes on: their order is then that of concurrent
submits. A message with a parent waits until everything handed over before it is answered,
then is stored on its own in the caller's thread (its parent is checked by its own insert; it
takes no slot). At most ``max_pending`` messages are in flight; a submit beyond that waits for
a slot. ``close`` (the end of a ``with`` block) waits for every future.

A future's callbacks run on the pipeline's thread: they must be quick, and may not submit,
wait or close (that raises). A future cannot be cancelled. The pipeline owns its intake's group
commit while it runs: an intake serves one pipeline (or one API process) at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from orderly.worker.core.owners import Owns
from orderly.worker.messages.admission import batchable
from orderly.worker.messages.inputs import MessageIn
from orderly.worker.messages.intake import Intake, SubmitResult


class Pipeline:
    def __init__(self, intake: Intake, max_pending: int = 10_000) -> None:
        if not intake.grouped:
            raise ValueError("a pipeline needs an intake with group commit: intake(grouped=True)")
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self._intake = intake
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[SubmitResult]] = set()
        # Handed over, not yet started on the loop; one wake-up of the loop takes them all.
        self._handed: list[_Handed] = []
        self._scheduled = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="orderly-pipeline", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._loop.run_forever()
        finally:
            # Stopped by close(), or the loop itself failed: nothing waits for ever.
            with self._lock:
                self._closed = True
                left = list(self._pending)
            for answer in left:
                _fail(answer, "the pipeline stopped before the message was stored")

    def submit(
        self, data: Any, owns: Owns | None = None
    ) -> concurrent.futures.Future[SubmitResult]:
        """Hand over one message; its future is answered once it is stored. Raises
        InvalidMessage (nothing queued) for a message that is not valid. Not from the
        pipeline's own thread (a future's callback): a submit that waits would stop it."""
        self._not_on_own_thread("submit")
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        message = self._intake.validate(data, owns)
        answer: concurrent.futures.Future[SubmitResult] = concurrent.futures.Future()
        answer.set_running_or_notify_cancel()  # a caller's cancel() cannot drop it now
        if not batchable(message):
            self.wait()  # what came before it is stored first
            try:
                answer.set_result(self._intake.store(message, owns))
            except Exception as exc:
                answer.set_exception(exc)
            return answer
        self._slots.acquire()
        answer.add_done_callback(self._done)
        # The task runs in the caller's context: its trace is the message's parent.
        handed = _Handed(message, owns, contextvars.copy_context(), answer)
        with self._lock:
            if self._closed:
                self._slots.release()
                raise RuntimeError("the pipeline is closed")
            self._pending.add(answer)
            self._handed.append(handed)
            schedule, self._scheduled = not self._scheduled, True
        if schedule:
            try:
                self._loop.call_soon_threadsafe(self._start)
            except RuntimeError:  # the loop closed meanwhile
                _fail(answer, "the pipeline stopped before the message was stored")
        return answer

    def _start(self) -> None:
        """On the loop: a task for each message handed over since the last start."""
        with self._lock:
            handed, self._handed, self._scheduled = self._handed, [], False
        for h in handed:
            task = self._loop.create_task(
                self._intake.store_together(h.message, h.owns, funnels=True), context=h.context
            )
            task.add_done_callback(functools.partial(_settle, h.answer))

    def _done(self, answer: concurrent.futures.Future[SubmitResult]) -> None:
        with self._lock:
            self._pending.discard(answer)
        self._slots.release()

    def _not_on_own_thread(self, what: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{what} from a future's callback would stop the pipeline")

    def wait(self) -> None:
        """Until every message handed over before this call is answered."""
        self._not_on_own_thread("wait")
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Wait for every message handed over, then stop the pipeline's thread."""
        self._not_on_own_thread("close")
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no submit is taken from now on
        self.wait()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class _Handed:
    message: MessageIn
    owns: Owns | None
    context: contextvars.Context
    answer: concurrent.futures.Future[SubmitResult]


def _fail(answer: concurrent.futures.Future[SubmitResult], why: str) -> None:
    if not answer.done():
        answer.set_exception(RuntimeError(why))


def _settle(
    answer: concurrent.futures.Future[SubmitResult], task: asyncio.Task[SubmitResult]
) -> None:
    if answer.done():  # failed already (the pipeline stopping)
        return
    if task.cancelled():
        _fail(answer, "the pipeline stopped before the message was stored")
    elif (exc := task.exception()) is not None:
        answer.set_exception(exc)
    else:
        answer.set_result(task.result())
